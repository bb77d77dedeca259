//! Telling a host whose first health check has not finished from a host
//! whose checks failed, so a rung is never read down only because Envoy
//! has not probed it yet (right after Envoy starts, or when new hosts
//! join its cluster).
//!
//! What Envoy shows, read in its source:
//!
//! - A cluster with health checks marks every host it starts with as
//!   failing: `FAILED_ACTIVE_HC` (`startPreInit` in
//!   `source/extensions/clusters/static/static_cluster.cc`; hosts added by
//!   DNS or EDS get the same in `updateDynamicHostList`,
//!   `source/common/upstream/upstream_impl.cc`). Only with the cluster's
//!   `ignore_new_hosts_until_first_hc` do new hosts also get
//!   `PENDING_ACTIVE_HC`, which the first result clears (`clearPendingFlag`
//!   in `source/extensions/health_checkers/common/health_checker_base_impl.cc`).
//! - The first check that passes makes the host healthy at once, whatever
//!   `healthy_threshold` says (`handleSuccess`, same file). A first check
//!   that fails leaves `FAILED_ACTIVE_HC` as it was and adds
//!   `ACTIVE_HC_TIMEOUT` only if it timed out (`setUnhealthy`).
//! - The admin API shows these flags as `failed_active_health_check`,
//!   `pending_active_hc` and `active_hc_timeout` (`HostHealthStatus` in
//!   `api/envoy/admin/v3/clusters.proto`) and nothing else about the
//!   checks: no time of the last check, no per-host count.
//!
//! So `pending_active_hc` means "not checked yet" and `active_hc_timeout`
//! means "checked and failed", but a host showing `failed_active_health_check`
//! alone may be either. For those the sidecar reads the cluster's check
//! counters (`cluster.<name>.health_check.success` and `.failure`, counted
//! when a check finishes, `ALL_HEALTH_CHECKER_STATS` in
//! `health_checker_base_impl.h`). Envoy starts the first check of every
//! host of a cluster together, so until the cluster has finished at least
//! as many checks as it has hosts, some host has not had its first one,
//! and such a host is taken as not checked yet. The counters count since
//! Envoy started; a host that joins later is judged by the checks finished
//! since the sidecar first saw it. Without the counters (Envoy's stats not
//! read) a failing flag is a failed check, as before.

use std::collections::BTreeMap;

/// Envoy's stats page, only the counters of finished health checks.
pub const STATS_PATH: &str = "/stats?filter=health_check.(success|failure)$";

/// Checks finished per cluster (the name in Envoy's stat names: the
/// cluster's `observability_name`, by default its name), from the text of
/// Envoy's `/stats` (`name: value` per line).
pub fn checks_done(stats: &str) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for line in stats.lines() {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<u64>() else {
            continue;
        };
        let Some(rest) = name.trim().strip_prefix("cluster.") else {
            continue;
        };
        let cluster = rest
            .strip_suffix(".health_check.success")
            .or_else(|| rest.strip_suffix(".health_check.failure"));
        if let Some(cluster) = cluster {
            *out.entry(cluster.to_string()).or_default() += value;
        }
    }
    out
}

/// What the sidecar remembers of one cluster between readings.
#[derive(Debug, Default)]
struct Seen {
    /// Checks the cluster had finished at the last reading.
    done: u64,
    /// Per host, the checks the cluster had finished when the sidecar
    /// first saw the host (0 for the hosts of the first reading).
    since: BTreeMap<String, u64>,
}

/// The hosts of each cluster, remembered to judge the ones showing only
/// `failed_active_health_check`.
#[derive(Debug, Default)]
pub struct FirstChecks {
    clusters: BTreeMap<String, Seen>,
}

/// One reading of a cluster, as [`FirstChecks::unchecked`] needs it.
pub struct Reading<'a> {
    /// Checks finished so far; `None`: Envoy's counters were not read.
    pub done: Option<u64>,
    /// Every host of the cluster, by address.
    pub hosts: &'a [String],
    /// The hosts showing only `failed_active_health_check`.
    pub unsure: &'a [String],
}

impl FirstChecks {
    /// How many of `reading.unsure` are taken as not checked yet.
    pub fn unchecked(&mut self, cluster: &str, reading: &Reading) -> usize {
        let Some(done) = reading.done else {
            return 0;
        };
        let seen = match self.clusters.get_mut(cluster) {
            // The counters run since Envoy started, and so may these hosts.
            None => self.clusters.entry(cluster.to_string()).or_insert(Seen {
                done,
                since: reading.hosts.iter().map(|h| (h.clone(), 0)).collect(),
            }),
            Some(seen) => {
                if done < seen.done {
                    // Envoy restarted: its counters began again.
                    seen.since.values_mut().for_each(|s| *s = 0);
                }
                seen.done = done;
                seen.since.retain(|h, _| reading.hosts.contains(h));
                for host in reading.hosts {
                    seen.since.entry(host.clone()).or_insert(done);
                }
                seen
            }
        };
        let hosts = u64::try_from(reading.hosts.len()).unwrap_or(u64::MAX);
        reading
            .unsure
            .iter()
            .filter(|h| done.saturating_sub(seen.since.get(*h).copied().unwrap_or(0)) < hosts)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_counters_are_summed_per_cluster() {
        let text = "cluster.llm_fallback.health_check.success: 3\n\
                    cluster.llm_fallback.health_check.failure: 2\n\
                    cluster.a.b.health_check.failure: 1\n\
                    cluster.llm_fallback.health_check.attempt: 9\n\
                    cluster.x.health_check.success: nonsense\n\
                    server.health_check.success: 4\n";
        let done = checks_done(text);
        assert_eq!(done.get("llm_fallback"), Some(&5));
        assert_eq!(done.get("a.b"), Some(&1), "a cluster name with dots");
        assert_eq!(done.len(), 2, "{done:?}");
        // The request line the HTTP client sends is a valid URI.
        assert!(STATS_PATH.parse::<hyper::Uri>().is_ok());
    }

    #[test]
    fn a_host_is_unchecked_until_the_cluster_finished_as_many_checks_as_it_has_hosts() {
        let mut first = FirstChecks::default();
        let hosts = names(&["a", "b"]);
        let read = |done| Reading {
            done: Some(done),
            hosts: &hosts,
            unsure: &hosts,
        };
        assert_eq!(first.unchecked("c", &read(0)), 2);
        assert_eq!(first.unchecked("c", &read(1)), 2, "one check of two");
        assert_eq!(first.unchecked("c", &read(2)), 0);
        assert_eq!(first.unchecked("c", &read(40)), 0);
        // Without the counters a failing flag is a failed check.
        let none = Reading {
            done: None,
            hosts: &hosts,
            unsure: &hosts,
        };
        assert_eq!(first.unchecked("c", &none), 0);
        // Envoy restarted: its counters start again, so do the hosts.
        assert_eq!(first.unchecked("c", &read(0)), 2);
        assert_eq!(first.unchecked("c", &read(2)), 0);
    }

    #[test]
    fn a_host_that_joins_later_waits_for_checks_finished_after_it_joined() {
        let mut first = FirstChecks::default();
        let old = names(&["a"]);
        let both = names(&["a", "b"]);
        let at = |done, hosts, unsure| Reading {
            done: Some(done),
            hosts,
            unsure,
        };
        assert_eq!(first.unchecked("c", &at(50, &old, &old)), 0, "long checked");
        let b = names(&["b"]);
        assert_eq!(first.unchecked("c", &at(51, &both, &b)), 1, "b is new");
        assert_eq!(first.unchecked("c", &at(52, &both, &b)), 1);
        assert_eq!(first.unchecked("c", &at(53, &both, &b)), 0);
        // A host that left and comes back is new again.
        assert_eq!(first.unchecked("c", &at(60, &old, &old)), 0);
        assert_eq!(first.unchecked("c", &at(61, &both, &b)), 1);
    }
}
