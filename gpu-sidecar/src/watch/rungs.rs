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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterHealth {
    pub healthy: usize,
    pub hosts: usize,
}

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
        let healthy = hosts
            .iter()
            .filter(|h| host_healthy(&h["health_status"]))
            .count();
        out.insert(
            name.to_string(),
            ClusterHealth {
                healthy,
                hosts: hosts.len(),
            },
        );
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
/// a rung that stays down changes nothing in the published state).
#[derive(Debug, Default)]
pub struct Rungs {
    down_since: BTreeMap<String, SystemTime>,
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
                } else {
                    self.down_since.remove(provider);
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
        let h = cluster_health(&clusters(json!([{"health_status": failed}])));
        assert_eq!(
            h["llm_fallback"],
            ClusterHealth {
                healthy: 0,
                hosts: 1
            }
        );
        assert_eq!(
            h["llm_upstream"],
            ClusterHealth {
                healthy: 1,
                hosts: 1
            }
        );
        let h = cluster_health(&clusters(json!([{"health_status": failed},
                                                  {"health_status": ok}])));
        assert_eq!(
            h["llm_fallback"],
            ClusterHealth {
                healthy: 1,
                hosts: 2
            }
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
}
