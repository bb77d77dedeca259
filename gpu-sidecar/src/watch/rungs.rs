//! The ladder's rungs, watched before a request needs one: each provider
//! of `envoy_admin.rungs` is mapped to the Envoy cluster its route goes to,
//! and every scrape reads Envoy's `/clusters?format=json`. A cluster with
//! no host passing Envoy's health checks makes its rung down: an open
//! breaker of scope `provider:<name>` in the published state, which the
//! filter reads like every breaker and then passes the rung over before
//! dispatch (`x-sluice-skipped: <name>=down`).
//!
//! The probing and its damping are Envoy's active health checking of the
//! cluster (`health_checks` with `unhealthy_threshold` /
//! `healthy_threshold`): a flapping provider is marked down only after
//! that many failed probes in a row, and up after that many good ones,
//! on every Envoy alike. The sidecar only reads the verdict, so one
//! reading per scrape changes nothing by itself.
//!
//! Envoy keeps no latency of its probes (its health checker counts
//! attempts, successes and failures only: `ALL_HEALTH_CHECKER_STATS` in
//! `source/extensions/health_checkers/common/health_checker_base_impl.h`),
//! so each scrape the sidecar times a TCP connect of its own to the hosts
//! Envoy lists for each rung (the healthy ones, or all when none is), all
//! rungs in parallel: the page shows every rung, up or down, with that
//! time. It is the network's part of a probe, not the provider's answer
//! time.
//!
//! A host's verdict is Envoy's `HostHealthStatus` (admin API,
//! `envoy/admin/v3/clusters.proto`): failed active or outlier checks, an
//! active check timeout, a pending or immediate-failure exclusion, or an
//! EDS status other than HEALTHY, DEGRADED or UNKNOWN. A rung whose
//! cluster Envoy does not list is not reported down (the sidecar does not
//! know, and the filter's own error breaker still guards the route); while
//! Envoy does not answer, the last verdicts stand.
//!
//! Envoy marks a host failing until its first check has passed, so right
//! after Envoy starts every host of a checked cluster reads failing. A
//! host not checked yet (see [`crate::watch::first_check`] for how it is
//! told from a host that failed) is not a failed one: a rung with no
//! healthy host but some host not checked yet is not down, and the page
//! shows it `unknown` until Envoy's first checks are done.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde_json::Value;

use crate::state::{Breaker, BreakerState};
use crate::watch::first_check::{FirstChecks, Reading};

/// What a rung's cluster looked like at the last reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterHealth {
    pub healthy: usize,
    pub hosts: usize,
    /// `ip:port` of the hosts a probe is timed to: the healthy ones, or
    /// every host when none is (at most [`MAX_TIMED`]).
    pub addresses: Vec<String>,
    /// Hosts Envoy says it has not checked yet (`pending_active_hc`).
    pub pending: usize,
    /// Hosts whose only flag is `failed_active_health_check`: failed, or
    /// not checked yet (by address).
    pub unsure: Vec<String>,
    /// Every host, by address.
    pub keys: Vec<String>,
    /// Health checks the cluster has finished since Envoy started
    /// (`None`: Envoy's counters were not read, or it has none).
    pub checks_done: Option<u64>,
}

/// One host as Envoy's health flags show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostState {
    Healthy,
    /// Envoy says its first check has not finished.
    Pending,
    /// Only `failed_active_health_check`: it failed, or was not checked yet.
    Unsure,
    Failed,
}

/// The most hosts of one rung whose connect is timed per scrape.
pub const MAX_TIMED: usize = 8;

/// Every cluster's health in Envoy's `/clusters?format=json` answer, with
/// the health checks each has finished (`done`, from
/// [`crate::watch::first_check::checks_done`]; keyed by the name in
/// Envoy's stats, the cluster's `observability_name`).
pub fn cluster_health(
    clusters: &Value,
    done: Option<&BTreeMap<String, u64>>,
) -> BTreeMap<String, ClusterHealth> {
    let mut out = BTreeMap::new();
    let Some(list) = clusters["cluster_statuses"].as_array() else {
        return out;
    };
    for cluster in list {
        let Some(name) = cluster["name"].as_str() else {
            continue;
        };
        let hosts = cluster["host_statuses"].as_array().map_or(&[][..], |h| h);
        let states: Vec<HostState> = hosts
            .iter()
            .map(|h| host_state(&h["health_status"]))
            .collect();
        let healthy: Vec<&Value> = hosts
            .iter()
            .zip(&states)
            .filter(|(_, s)| **s == HostState::Healthy)
            .map(|(h, _)| h)
            .collect();
        let stat_name = cluster["observability_name"].as_str().unwrap_or(name);
        let timed = if healthy.is_empty() {
            hosts.iter().collect()
        } else {
            healthy.clone()
        };
        out.insert(
            name.to_string(),
            ClusterHealth {
                healthy: healthy.len(),
                hosts: hosts.len(),
                addresses: timed
                    .into_iter()
                    .filter_map(address)
                    .take(MAX_TIMED)
                    .collect(),
                pending: states.iter().filter(|s| **s == HostState::Pending).count(),
                unsure: hosts
                    .iter()
                    .zip(&states)
                    .filter(|(_, s)| **s == HostState::Unsure)
                    .map(|(h, _)| host_key(h))
                    .collect(),
                keys: hosts.iter().map(host_key).collect(),
                checks_done: done.and_then(|d| d.get(stat_name).or_else(|| d.get(name)).copied()),
            },
        );
    }
    out
}

/// A host's name for [`FirstChecks`]: its `ip:port`, or its whole
/// address for a pipe.
fn host_key(host: &Value) -> String {
    address(host).unwrap_or_else(|| host["address"].to_string())
}

/// A host's `ip:port` (`address.socket_address`); none for a pipe.
fn address(host: &Value) -> Option<String> {
    let socket = &host["address"]["socket_address"];
    let ip: std::net::IpAddr = socket["address"].as_str()?.parse().ok()?;
    let port = u16::try_from(socket["port_value"].as_u64()?).ok()?;
    Some(std::net::SocketAddr::new(ip, port).to_string())
}

/// Milliseconds of the fastest TCP connect to any of `addresses` within
/// `timeout`, all tried at once; `None` when none connects.
pub async fn connect_ms(addresses: &[String], timeout: std::time::Duration) -> Option<u64> {
    let mut tries = tokio::task::JoinSet::new();
    for addr in addresses.iter().take(MAX_TIMED).cloned() {
        tries.spawn(async move {
            let start = std::time::Instant::now();
            let connected = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
                .await
                .is_ok_and(|c| c.is_ok());
            connected.then(|| start.elapsed())
        });
    }
    let mut fastest: Option<std::time::Duration> = None;
    while let Some(done) = tries.join_next().await {
        if let Ok(Some(took)) = done {
            fastest = Some(fastest.map_or(took, |f| f.min(took)));
        }
    }
    fastest.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Every rung's connect time, timed in parallel.
pub async fn connect_times(
    rungs: &BTreeMap<String, String>,
    health: &BTreeMap<String, ClusterHealth>,
    timeout: std::time::Duration,
) -> BTreeMap<String, Option<u64>> {
    let mut all = tokio::task::JoinSet::new();
    for (provider, cluster) in rungs {
        let Some(h) = health.get(cluster) else {
            continue;
        };
        let (provider, addresses) = (provider.clone(), h.addresses.clone());
        all.spawn(async move { (provider, connect_ms(&addresses, timeout).await) });
    }
    let mut out = BTreeMap::new();
    while let Some(done) = all.join_next().await {
        if let Ok((provider, ms)) = done {
            out.insert(provider, ms);
        }
    }
    out
}

/// A host's state from its `health_status`: any flag other than the two
/// an unchecked host carries (`failed_active_health_check`,
/// `pending_active_hc`), or a bad EDS status, is a failure.
fn host_state(status: &Value) -> HostState {
    let flag = |name: &str| status[name].as_bool() == Some(true);
    let failed = [
        "failed_outlier_check",
        "failed_active_degraded_check",
        "excluded_via_immediate_hc_fail",
        "active_hc_timeout",
    ]
    .iter()
    .any(|f| flag(f));
    let eds_ok = matches!(
        status["eds_health_status"].as_str(),
        None | Some("HEALTHY" | "DEGRADED" | "UNKNOWN")
    );
    if failed || !eds_ok {
        HostState::Failed
    } else if flag("pending_active_hc") {
        HostState::Pending
    } else if flag("failed_active_health_check") {
        HostState::Unsure
    } else {
        HostState::Healthy
    }
}

/// The rungs down, as breakers, each kept with the time it went down (so
/// a rung that stays down changes nothing in the published state); and
/// when each rung last changed, for the page.
#[derive(Debug, Default)]
pub struct Rungs {
    down_since: BTreeMap<String, SystemTime>,
    up_since: BTreeMap<String, SystemTime>,
    /// Per provider with no healthy host, its hosts Envoy has not checked
    /// yet (a rung listed here is not down).
    waiting: BTreeMap<String, usize>,
    first: FirstChecks,
}

/// One rung as the operator page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RungView {
    pub provider: String,
    pub cluster: String,
    /// `None`: Envoy lists no such cluster (or has not answered yet).
    pub health: Option<(usize, usize)>,
    pub down: bool,
    /// No host healthy, and this many not checked yet by Envoy (so not
    /// down); 0 otherwise.
    pub waiting: usize,
    pub since: Option<SystemTime>,
    pub connect_ms: Option<u64>,
}

impl RungView {
    /// A row of the page's breakers table (scope `provider:<name>`).
    pub fn row(&self) -> Value {
        let connect = match self.connect_ms {
            Some(ms) => format!("TCP connect {ms} ms"),
            None => "TCP connect failed".into(),
        };
        let (state, reason) = match self.health {
            None => ("unknown", format!("Envoy lists no cluster {}", self.cluster)),
            Some((_, hosts)) if self.down => (
                "open",
                format!(
                    "Envoy health checks: no host of cluster {} healthy (0 of {hosts}); {connect}",
                    self.cluster
                ),
            ),
            Some((_, hosts)) if self.waiting > 0 => (
                "unknown",
                format!(
                    "Envoy health checks: {} of {hosts} hosts of cluster {} not checked yet, \
                     none healthy so far; {connect}",
                    self.waiting, self.cluster
                ),
            ),
            Some((healthy, hosts)) => (
                "closed",
                format!(
                    "Envoy health checks: {healthy} of {hosts} hosts of cluster {} healthy; {connect}",
                    self.cluster
                ),
            ),
        };
        serde_json::json!({
            "scope": format!("{}{}", crate::state::RUNG_SCOPE, self.provider),
            "state": state,
            "since": self.since.map(|t| humantime::format_rfc3339_seconds(t).to_string()),
            "reason": reason,
            "connect_ms": self.connect_ms,
            "stale": false,
            "rules": [],
        })
    }
}

impl Rungs {
    /// The breakers after a reading of Envoy's clusters (`None`: Envoy did
    /// not answer; the last verdicts stand).
    pub fn observe(
        &mut self,
        rungs: &BTreeMap<String, String>,
        health: Option<&BTreeMap<String, ClusterHealth>>,
        now: SystemTime,
    ) -> Vec<Breaker> {
        if let Some(health) = health {
            let unchecked = self.unchecked(rungs, health);
            self.waiting.clear();
            for (provider, cluster) in rungs {
                let waiting = unchecked.get(cluster).copied().unwrap_or(0);
                let none_healthy = health.get(cluster).is_some_and(|h| h.healthy == 0);
                if none_healthy && waiting > 0 {
                    self.waiting.insert(provider.clone(), waiting);
                }
                let down = none_healthy && waiting == 0;
                if down {
                    self.down_since.entry(provider.clone()).or_insert(now);
                    self.up_since.remove(provider);
                } else {
                    self.down_since.remove(provider);
                    self.up_since.entry(provider.clone()).or_insert(now);
                }
            }
        }
        self.down_since
            .iter()
            .map(|(provider, since)| {
                let cluster = rungs.get(provider).map_or("?", String::as_str);
                let hosts = health.and_then(|h| h.get(cluster)).map_or(0, |h| h.hosts);
                Breaker {
                    scope: format!("provider:{provider}"),
                    state: BreakerState::Open,
                    half_open_fraction: 0.0,
                    retry_after_seconds: 0,
                    reason: Some(format!(
                        "Envoy health checks: no host of cluster {cluster} healthy (0 of {hosts})"
                    )),
                    since: *since,
                    from_fleet: false,
                }
            })
            .collect()
    }
}

impl Rungs {
    /// Per rung cluster Envoy lists, its hosts not checked yet: those Envoy
    /// says are pending, and those [`FirstChecks`] judges so.
    fn unchecked(
        &mut self,
        rungs: &BTreeMap<String, String>,
        health: &BTreeMap<String, ClusterHealth>,
    ) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for cluster in rungs.values() {
            let Some(h) = health.get(cluster) else {
                continue;
            };
            if out.contains_key(cluster) {
                continue;
            }
            let reading = Reading {
                done: h.checks_done,
                hosts: &h.keys,
                unsure: &h.unsure,
            };
            let unsure = self.first.unchecked(cluster, &reading);
            out.insert(cluster.clone(), h.pending + unsure);
        }
        out
    }

    /// Every rung of `rungs` as the page shows it, after [`Rungs::observe`].
    pub fn views(
        &self,
        rungs: &BTreeMap<String, String>,
        health: Option<&BTreeMap<String, ClusterHealth>>,
        connect: &BTreeMap<String, Option<u64>>,
    ) -> Vec<RungView> {
        rungs
            .iter()
            .map(|(provider, cluster)| {
                let h = health.and_then(|h| h.get(cluster));
                let down = self.down_since.get(provider);
                RungView {
                    provider: provider.clone(),
                    cluster: cluster.clone(),
                    health: h.map(|h| (h.healthy, h.hosts)),
                    down: down.is_some(),
                    waiting: self.waiting.get(provider).copied().unwrap_or(0),
                    since: down.or_else(|| self.up_since.get(provider)).copied(),
                    connect_ms: connect.get(provider).copied().flatten(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::{Duration, UNIX_EPOCH};

    /// Envoy's clusters, read without its check counters.
    fn read(clusters: &Value) -> BTreeMap<String, ClusterHealth> {
        cluster_health(clusters, None)
    }

    fn clusters(fallback: Value) -> Value {
        json!({"cluster_statuses": [
            {"name": "llm_upstream", "host_statuses": [{"health_status": {"eds_health_status": "HEALTHY"}}]},
            {"name": "llm_fallback", "host_statuses": fallback},
        ]})
    }

    #[test]
    fn a_cluster_with_no_healthy_host_is_down() {
        let failed = json!({"failed_active_health_check": true, "eds_health_status": "HEALTHY"});
        let ok = json!({"eds_health_status": "HEALTHY"});
        let at =
            |port: u64| json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
        let h = read(&clusters(
            json!([{"health_status": failed, "address": at(1)}]),
        ));
        let fallback = &h["llm_fallback"];
        assert_eq!((fallback.healthy, fallback.hosts), (0, 1));
        assert_eq!(
            fallback.addresses,
            ["127.0.0.1:1"],
            "none healthy: every host timed"
        );
        assert_eq!((h["llm_upstream"].healthy, h["llm_upstream"].hosts), (1, 1));
        assert!(h["llm_upstream"].addresses.is_empty(), "no address listed");
        let h = read(&clusters(
            json!([{"health_status": failed, "address": at(1)},
                                                  {"health_status": ok, "address": at(2)},
                                                  {"health_status": ok, "address": {"pipe": {"path": "/x"}}}]),
        ));
        let fallback = &h["llm_fallback"];
        assert_eq!((fallback.healthy, fallback.hosts), (2, 3));
        assert_eq!(
            fallback.addresses,
            ["127.0.0.1:2"],
            "the healthy ones, pipes left out"
        );
        for status in [
            json!({"eds_health_status": "UNHEALTHY"}),
            json!({"eds_health_status": "DRAINING"}),
            json!({"active_hc_timeout": true}),
            json!({"failed_outlier_check": true}),
        ] {
            let h = read(&clusters(json!([{"health_status": status}])));
            assert_eq!(h["llm_fallback"].healthy, 0, "{status}");
        }
        assert!(cluster_health(&json!({"nonsense": 1}), None).is_empty());
    }

    #[test]
    fn a_rung_stays_down_with_the_time_it_went_down_until_its_cluster_is_back() {
        let rungs: BTreeMap<String, String> =
            [("openai".to_string(), "llm_fallback".to_string())].into();
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let mut watch = Rungs::default();
        let down = read(&clusters(
            json!([{"health_status": {"failed_active_health_check": true}}]),
        ));
        let up = read(&clusters(json!([{"health_status": {}}])));
        assert!(watch.observe(&rungs, Some(&up), t(1)).is_empty());
        let first = watch.observe(&rungs, Some(&down), t(2));
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].scope, "provider:openai");
        assert_eq!(first[0].state, BreakerState::Open);
        // Still down later, and Envoy silent: the same breaker, same since.
        assert_eq!(watch.observe(&rungs, Some(&down), t(9)), first);
        assert_eq!(watch.observe(&rungs, None, t(10))[0].since, t(2));
        assert!(watch.observe(&rungs, Some(&up), t(11)).is_empty());
        // A cluster Envoy does not list is not known to be down.
        let other: BTreeMap<String, String> =
            [("openai".to_string(), "no_such_cluster".to_string())].into();
        assert!(watch.observe(&other, Some(&down), t(12)).is_empty());
    }

    #[test]
    fn every_rung_has_a_page_row_with_its_state_since_and_connect_time() {
        let rungs: BTreeMap<String, String> = [
            ("openai".to_string(), "llm_fallback".to_string()),
            ("spare".to_string(), "no_such_cluster".to_string()),
        ]
        .into();
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let mut watch = Rungs::default();
        let up = read(&clusters(json!([{"health_status": {}}])));
        watch.observe(&rungs, Some(&up), t(5));
        let connect: BTreeMap<String, Option<u64>> = [("openai".to_string(), Some(3))].into();
        let views = watch.views(&rungs, Some(&up), &connect);
        let row = views[0].row();
        assert_eq!(
            (row["scope"].as_str(), row["state"].as_str()),
            (Some("provider:openai"), Some("closed"))
        );
        assert_eq!(row["connect_ms"], 3);
        let reason = row["reason"].as_str().unwrap();
        assert!(
            reason.contains("1 of 1 hosts") && reason.contains("TCP connect 3 ms"),
            "{reason}"
        );
        assert_eq!(views[1].row()["state"], "unknown");
        let down = read(&clusters(
            json!([{"health_status": {"active_hc_timeout": true}}]),
        ));
        watch.observe(&rungs, Some(&down), t(9));
        watch.observe(&rungs, Some(&down), t(12));
        let row = watch.views(&rungs, Some(&down), &BTreeMap::new())[0].row();
        assert_eq!(row["state"], "open");
        assert_eq!(
            row["since"],
            humantime::format_rfc3339_seconds(t(9)).to_string()
        );
        assert!(
            row["reason"]
                .as_str()
                .unwrap()
                .contains("TCP connect failed"),
            "{row}"
        );
    }

    /// Envoy's `/clusters?format=json` for the rung's cluster with one host
    /// per `health_status`, as Envoy writes it (address, stats, flags).
    fn envoy_clusters(statuses: &[Value]) -> Value {
        let hosts: Vec<Value> = statuses
            .iter()
            .enumerate()
            .map(|(i, status)| {
                json!({
                    "address": {"socket_address": {"address": "127.0.0.1",
                                                   "port_value": 8081 + i}},
                    "stats": [{"name": "cx_connect_fail"}, {"value": "0", "name": "cx_total"}],
                    "health_status": status,
                    "weight": 1,
                    "locality": {}
                })
            })
            .collect();
        json!({"cluster_statuses": [{
            "name": "llm_fallback",
            "observability_name": "llm_fallback",
            "host_statuses": hosts
        }]})
    }

    /// Envoy's `/stats` text for the cluster's finished checks.
    fn envoy_stats(success: u64, failure: u64) -> BTreeMap<String, u64> {
        crate::watch::first_check::checks_done(&format!(
            "cluster.llm_fallback.health_check.attempt: {}\n\
             cluster.llm_fallback.health_check.failure: {failure}\n\
             cluster.llm_fallback.health_check.success: {success}\n",
            success + failure + 1
        ))
    }

    fn openai() -> BTreeMap<String, String> {
        [("openai".to_string(), "llm_fallback".to_string())].into()
    }

    #[test]
    fn a_rung_whose_first_checks_have_not_run_is_not_down() {
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let unchecked = json!({"failed_active_health_check": true, "eds_health_status": "HEALTHY"});
        let pending = json!({"failed_active_health_check": true, "pending_active_hc": true,
                             "eds_health_status": "HEALTHY"});
        // Right after Envoy starts: every host failing, no check finished.
        let mut watch = Rungs::default();
        let start = envoy_clusters(&[unchecked.clone(), unchecked.clone()]);
        let h = cluster_health(&start, Some(&envoy_stats(0, 0)));
        assert_eq!(h["llm_fallback"].healthy, 0);
        assert!(watch.observe(&openai(), Some(&h), t(1)).is_empty());
        let row = watch.views(&openai(), Some(&h), &BTreeMap::new())[0].row();
        assert_eq!(row["state"], "unknown", "{row}");
        let reason = row["reason"].as_str().unwrap();
        assert!(reason.contains("2 of 2 hosts"), "{reason}");
        // One check finished (it failed): the other host is still waiting.
        let h = cluster_health(&start, Some(&envoy_stats(0, 1)));
        assert!(watch.observe(&openai(), Some(&h), t(2)).is_empty());
        // Both finished and failed: down, as before.
        let h = cluster_health(&start, Some(&envoy_stats(0, 2)));
        assert_eq!(watch.observe(&openai(), Some(&h), t(3)).len(), 1);
        let row = watch.views(&openai(), Some(&h), &BTreeMap::new())[0].row();
        assert_eq!(row["state"], "open", "{row}");
        // Envoy's own pending flag (`ignore_new_hosts_until_first_hc`): not
        // checked yet, whatever the counters say.
        let mut watch = Rungs::default();
        let h = cluster_health(
            &envoy_clusters(std::slice::from_ref(&pending)),
            Some(&envoy_stats(7, 9)),
        );
        assert_eq!(h["llm_fallback"].pending, 1);
        assert!(watch.observe(&openai(), Some(&h), t(1)).is_empty());
        let h = cluster_health(&envoy_clusters(&[pending]), None);
        assert!(watch.observe(&openai(), Some(&h), t(2)).is_empty());
    }

    #[test]
    fn a_rung_whose_checks_failed_is_down() {
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let failed = json!({"failed_active_health_check": true, "eds_health_status": "HEALTHY"});
        let timed_out = json!({"failed_active_health_check": true, "active_hc_timeout": true,
                               "eds_health_status": "HEALTHY"});
        let clusters = envoy_clusters(std::slice::from_ref(&failed));
        // Checked since Envoy started (its counters say so): down.
        let mut watch = Rungs::default();
        let h = cluster_health(&clusters, Some(&envoy_stats(3, 12)));
        assert_eq!(watch.observe(&openai(), Some(&h), t(1)).len(), 1);
        // No counters read: a failing flag is a failed check, as before.
        let mut watch = Rungs::default();
        let h = cluster_health(&clusters, None);
        assert_eq!(watch.observe(&openai(), Some(&h), t(1)).len(), 1);
        // A timeout is a finished check, even with no counter yet.
        let mut watch = Rungs::default();
        let h = cluster_health(&envoy_clusters(&[timed_out]), Some(&envoy_stats(0, 0)));
        assert_eq!(watch.observe(&openai(), Some(&h), t(1)).len(), 1);
        // An EDS or outlier verdict is not a pending check either.
        for status in [
            json!({"failed_active_health_check": true, "eds_health_status": "UNHEALTHY"}),
            json!({"failed_active_health_check": true, "pending_active_hc": true,
                   "failed_outlier_check": true}),
        ] {
            let mut watch = Rungs::default();
            let h = cluster_health(
                &envoy_clusters(std::slice::from_ref(&status)),
                Some(&envoy_stats(0, 0)),
            );
            assert_eq!(
                watch.observe(&openai(), Some(&h), t(1)).len(),
                1,
                "{status}"
            );
        }
    }

    #[test]
    fn a_mix_of_failed_and_unchecked_hosts_is_not_down_and_a_healthy_one_is_up() {
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let failed = json!({"failed_active_health_check": true, "active_hc_timeout": true});
        let pending = json!({"failed_active_health_check": true, "pending_active_hc": true});
        let ok = json!({"eds_health_status": "HEALTHY"});
        let mut watch = Rungs::default();
        let h = cluster_health(
            &envoy_clusters(&[failed.clone(), pending.clone()]),
            Some(&envoy_stats(0, 5)),
        );
        assert!(watch.observe(&openai(), Some(&h), t(1)).is_empty());
        let view = &watch.views(&openai(), Some(&h), &BTreeMap::new())[0];
        assert_eq!(
            (view.down, view.waiting, view.health),
            (false, 1, Some((0, 2)))
        );
        // A healthy host: up, nothing waiting on the page.
        let h = cluster_health(&envoy_clusters(&[ok, pending]), Some(&envoy_stats(1, 5)));
        assert!(watch.observe(&openai(), Some(&h), t(2)).is_empty());
        let row = watch.views(&openai(), Some(&h), &BTreeMap::new())[0].row();
        assert_eq!(row["state"], "closed", "{row}");
        // The pending host's first check fails: every host failed, down.
        let h = cluster_health(
            &envoy_clusters(&[failed.clone(), failed]),
            Some(&envoy_stats(1, 7)),
        );
        assert_eq!(watch.observe(&openai(), Some(&h), t(3)).len(), 1);
    }

    /// Envoy's real answers (`testdata/envoy-first-check`): right after
    /// start, the host whose first check is still running and the host whose
    /// first check failed look the same in `/clusters`; only the counters
    /// tell them apart.
    #[test]
    fn envoy_right_after_start_a_running_first_check_is_not_down_a_failed_one_is() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/envoy-first-check/");
        let read = |name: &str| std::fs::read_to_string(format!("{dir}{name}")).expect(name);
        let rungs: BTreeMap<String, String> = [
            ("waiting".to_string(), "pending_rung".to_string()),
            ("refused".to_string(), "refused_rung".to_string()),
        ]
        .into();
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let mut watch = Rungs::default();
        let mut observe = |clusters: &str, stats: &str, at| {
            let clusters: Value = serde_json::from_str(&read(clusters)).unwrap();
            let done = crate::watch::first_check::checks_done(&read(stats));
            let h = cluster_health(&clusters, Some(&done));
            let down = watch.observe(&rungs, Some(&h), at);
            down.iter().map(|b| b.scope.clone()).collect::<Vec<_>>()
        };
        let start = observe("clusters-start.json", "stats-start.txt", t(1));
        assert_eq!(start, ["provider:refused"]);
        let later = observe("clusters-later.json", "stats-later.txt", t(30));
        assert_eq!(later, ["provider:refused", "provider:waiting"]);
    }

    #[tokio::test]
    async fn the_connect_time_is_the_fastest_host_and_none_when_none_answers() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap().to_string();
        // A port nothing listens on (bound, then closed).
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let timeout = Duration::from_secs(2);
        let ms = connect_ms(&[closed.clone(), open.clone()], timeout).await;
        assert!(ms.is_some_and(|ms| ms < 2000), "{ms:?}");
        assert_eq!(connect_ms(&[closed], timeout).await, None);
        assert_eq!(connect_ms(&[], timeout).await, None);
    }
}
