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

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde_json::Value;

use crate::state::{Breaker, BreakerState};

/// What a rung's cluster looked like at the last reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterHealth {
    pub healthy: usize,
    pub hosts: usize,
    /// `ip:port` of the hosts a probe is timed to: the healthy ones, or
    /// every host when none is (at most [`MAX_TIMED`]).
    pub addresses: Vec<String>,
}

/// The most hosts of one rung whose connect is timed per scrape.
pub const MAX_TIMED: usize = 8;

/// Every cluster's health in Envoy's `/clusters?format=json` answer.
pub fn cluster_health(clusters: &Value) -> BTreeMap<String, ClusterHealth> {
    let mut out = BTreeMap::new();
    let Some(list) = clusters["cluster_statuses"].as_array() else {
        return out;
    };
    for cluster in list {
        let Some(name) = cluster["name"].as_str() else {
            continue;
        };
        let hosts = cluster["host_statuses"].as_array().map_or(&[][..], |h| h);
        let healthy: Vec<&Value> = hosts
            .iter()
            .filter(|h| host_healthy(&h["health_status"]))
            .collect();
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
            },
        );
    }
    out
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

fn host_healthy(status: &Value) -> bool {
    let flagged = [
        "failed_active_health_check",
        "failed_outlier_check",
        "failed_active_degraded_check",
        "pending_active_hc",
        "excluded_via_immediate_hc_fail",
        "active_hc_timeout",
    ]
    .iter()
    .any(|flag| status[*flag].as_bool() == Some(true));
    let eds_ok = matches!(
        status["eds_health_status"].as_str(),
        None | Some("HEALTHY" | "DEGRADED" | "UNKNOWN")
    );
    !flagged && eds_ok
}

/// The rungs down, as breakers, each kept with the time it went down (so
/// a rung that stays down changes nothing in the published state); and
/// when each rung last changed, for the page.
#[derive(Debug, Default)]
pub struct Rungs {
    down_since: BTreeMap<String, SystemTime>,
    up_since: BTreeMap<String, SystemTime>,
}

/// One rung as the operator page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RungView {
    pub provider: String,
    pub cluster: String,
    /// `None`: Envoy lists no such cluster (or has not answered yet).
    pub health: Option<(usize, usize)>,
    pub down: bool,
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
            for (provider, cluster) in rungs {
                let down = health.get(cluster).is_some_and(|h| h.healthy == 0);
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
        let h = cluster_health(&clusters(
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
        let h = cluster_health(&clusters(
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
            let h = cluster_health(&clusters(json!([{"health_status": status}])));
            assert_eq!(h["llm_fallback"].healthy, 0, "{status}");
        }
        assert!(cluster_health(&json!({"nonsense": 1})).is_empty());
    }

    #[test]
    fn a_rung_stays_down_with_the_time_it_went_down_until_its_cluster_is_back() {
        let rungs: BTreeMap<String, String> =
            [("openai".to_string(), "llm_fallback".to_string())].into();
        let t = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        let mut watch = Rungs::default();
        let down = cluster_health(&clusters(
            json!([{"health_status": {"failed_active_health_check": true}}]),
        ));
        let up = cluster_health(&clusters(json!([{"health_status": {}}])));
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
        let up = cluster_health(&clusters(json!([{"health_status": {}}])));
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
        let down = cluster_health(&clusters(
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
