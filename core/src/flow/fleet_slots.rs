//! Concurrency slots across the fleet: with a `fleet:` section, a gated
//! backend's `concurrency` (and each of its models') holds across every
//! Envoy, unless `fleet.local` lists `concurrency/<backend>`.
//!
//! Each Envoy may use only the slots it holds in Redis (its *lease*, kept
//! in the backend's queue record beside the in-flight counts, so every
//! worker's gate sees it in the same compare-and-swap as the queue).
//! The VM that polls the sidecar, on every queue tick, compares each lease
//! with the demand (in flight + queued, at most the limit):
//! - less demand: the lease is lowered here first (never under what is in
//!   flight), then the smaller holding is reported — a freed slot nobody
//!   here waits for goes back to the fleet within a tick or two;
//! - more demand: the wish is reported, and only the grant (`min(wish,
//!   limit − what the other live Envoys hold)`, one Lua script) raises the
//!   lease; waiters then go through the usual grant/wake-up path.
//!
//! So what this Envoy admits never exceeds what Redis counts as its
//! holding, and the holdings never sum past the limit: in flight
//! fleet-wide ≤ N. Reports are absolute (a lost answer is repaired by the
//! next) and renew this Envoy's liveness; one goes out at least every
//! [`BEAT_MS`] while anything is held. A dead Envoy's holding is dropped by
//! Redis [`LIVE_MS`](sidecar) after its last report.
//!
//! Sidecar or Redis away: the lease becomes the `on_unavailable.requests`
//! stand-in — `local_share`: `N ÷ expected_replicas` (rounded down),
//! `fail_open`: N, `fail_closed`: 0 (classes that wait wait, the others get
//! 429 `model_concurrency`) — until a report is answered again.

use sluice_wire::fleet::{SlotScope, SlotsAnswer, SlotsRequest};

use super::Filter;
use crate::host::metrics;
use crate::host::Host;
use crate::policy::fleet::Unavailable;
use crate::queue::{self, slots_scope, Group, State};

/// A report at least this often while slots are held (liveness).
pub const BEAT_MS: u64 = 1_000;
/// After a failed report, wait this long before the next.
const RETRY_MS: u64 = 500;
pub const PATH: &str = "/v1/fleet/slots";

/// One scope of a report: which lease of which backend.
#[derive(Debug, Clone)]
struct Ask {
    backend: String,
    model: Option<String>,
}

#[derive(Debug, Default)]
pub struct Agent {
    call: Option<(u32, Vec<Ask>)>,
    next_beat_ms: u64,
    retry_at_ms: u64,
    /// The last report failed: leases are the `on_unavailable` stand-in.
    down: bool,
}

/// The leases of a group: (model, limit) per scope, `None` the backend.
fn scopes(g: &Group) -> Vec<(Option<String>, u32)> {
    let mut out = Vec::new();
    if let Some(l) = g.backend_limit {
        out.push((None, l));
    }
    for (m, l) in &g.model_limits {
        if let Some(l) = l {
            out.push((Some(m.clone()), *l));
        }
    }
    out
}

fn lease_of(s: &State, model: Option<&str>) -> u32 {
    match model {
        Some(m) => s
            .models
            .iter()
            .find(|x| x.name == m)
            .map_or(0, |x| x.leased),
        None => s.leased,
    }
}

/// In flight and queued (demand), for one scope.
fn demand(s: &State, model: Option<&str>) -> (u32, u32) {
    let index = model.and_then(|m| s.models.iter().position(|x| x.name == m));
    let inflight: u32 = match (model, index) {
        (Some(_), Some(i)) => s.models[i].inflight,
        (Some(_), None) => 0,
        (None, _) => s.models.iter().map(|m| m.inflight).sum(),
    };
    let queued = s
        .entries
        .iter()
        .filter(|e| !e.evicted && (model.is_none() || Some(usize::from(e.model)) == index))
        .count();
    (inflight, u32::try_from(queued).unwrap_or(u32::MAX))
}

fn fleet_groups(filter: &Filter) -> Vec<(String, Group)> {
    filter
        .gates
        .groups()
        .filter(|(_, g)| g.fleet)
        .map(|(b, g)| (b.to_string(), g.clone()))
        .collect()
}

impl Agent {
    pub fn owns(&self, token: u32) -> bool {
        self.call.as_ref().is_some_and(|(t, _)| *t == token)
    }

    /// Every queue tick of the polling VM.
    pub fn tick(&mut self, filter: &Filter, host: &dyn Host, now: u64) {
        let Some(fleet) = filter.fleet.as_ref() else {
            return;
        };
        if self.call.is_some() || now < self.retry_at_ms {
            return;
        }
        let groups = fleet_groups(filter);
        if groups.is_empty() {
            return;
        }
        let mut asks = Vec::new();
        let mut report = Vec::new();
        let mut moved = false;
        let mut held = false;
        for (backend, g) in &groups {
            let saturated = filter.saturated_models(host, backend, now);
            let saturated = |m: &str| saturated.iter().any(|s| s == m);
            let mut wishes = Vec::new();
            // Lower first: a lease given back is never still used here.
            let changed = queue::lease(host, g, filter.tries(), &saturated, now, |s| {
                wishes.clear();
                let mut lowered = Vec::new();
                for (model, limit) in scopes(g) {
                    let (inflight, queued) = demand(s, model.as_deref());
                    let target = inflight.saturating_add(queued).min(limit);
                    let lease = lease_of(s, model.as_deref());
                    let kept = if target < lease {
                        target.max(inflight).min(lease)
                    } else {
                        lease
                    };
                    lowered.push((model.clone(), kept));
                    wishes.push((model, limit, target.max(kept), lease));
                }
                lowered
            });
            filter.applied(host, backend, &changed);
            if changed.written == crate::state::store::Updated::Exhausted
                || changed.written == crate::state::store::Updated::Failed
            {
                return; // next tick
            }
            for (model, _limit, hold, before) in wishes {
                moved |= hold != before;
                held |= hold > 0 || before > 0;
                report.push(SlotScope {
                    id: slots_scope(backend, model.as_deref()),
                    hold,
                });
                asks.push(Ask {
                    backend: backend.clone(),
                    model,
                });
            }
        }
        if !(moved || self.down || (held && now >= self.next_beat_ms)) {
            return;
        }
        let body = serde_json::to_vec(&SlotsRequest { scopes: report }).unwrap_or_default();
        match fleet.post(host, PATH, &body) {
            Ok(token) => self.call = Some((token, asks)),
            Err(_) => self.unavailable(filter, host, now),
        }
    }

    /// The sidecar's answer to a report.
    pub fn on_answer(&mut self, filter: &Filter, host: &dyn Host, token: u32, body_size: usize) {
        let Some((_, asks)) = self.call.take_if(|(t, _)| *t == token) else {
            return;
        };
        let now = host.now_ms();
        let status = host.call_response_header(":status");
        let body = host.call_response_body(body_size);
        let answer = match (
            status.as_deref(),
            serde_json::from_slice::<SlotsAnswer>(&body),
        ) {
            (Some("200"), Ok(a)) if a.grants.len() == asks.len() => a,
            _ => {
                let _ = crate::fleet::failed_call(host, status.as_deref(), &body);
                return self.unavailable(filter, host, now);
            }
        };
        crate::fleet::note_refusal(host, None);
        if std::mem::take(&mut self.down) {
            log::info!("fleet: concurrency slots granted by the fleet again");
            metrics::FLEET_SLOTS_DEGRADED.record(host, 0);
        }
        self.next_beat_ms = now + BEAT_MS;
        for (backend, g) in fleet_groups(filter) {
            let leases: Vec<(Option<String>, u32)> = asks
                .iter()
                .zip(&answer.grants)
                .filter(|(a, _)| a.backend == backend)
                .map(|(a, n)| (a.model.clone(), *n))
                .collect();
            if leases.is_empty() {
                continue;
            }
            set(filter, host, &backend, &g, now, |_| leases.clone());
        }
    }

    /// No answer: every fleet lease becomes its `on_unavailable` stand-in.
    fn unavailable(&mut self, filter: &Filter, host: &dyn Host, now: u64) {
        self.retry_at_ms = now + RETRY_MS;
        let Some(fleet) = filter.fleet.as_ref() else {
            return;
        };
        if !self.down {
            self.down = true;
            log::warn!(
                "fleet: concurrency slots cannot be reported; gates follow on_unavailable.requests"
            );
            metrics::FLEET_SLOTS_DEGRADED.record(host, 1);
        }
        let cfg = &fleet.config;
        let stand_in = |limit: u32| match cfg.on_unavailable.requests {
            Unavailable::LocalShare => {
                u32::try_from(u64::from(limit) / cfg.expected_replicas.max(1)).unwrap_or(limit)
            }
            Unavailable::FailOpen => limit,
            Unavailable::FailClosed => 0,
        };
        for (backend, g) in fleet_groups(filter) {
            let leases: Vec<(Option<String>, u32)> = scopes(&g)
                .into_iter()
                .map(|(m, l)| (m, stand_in(l)))
                .collect();
            set(filter, host, &backend, &g, now, |_| leases.clone());
        }
    }
}

fn set(
    filter: &Filter,
    host: &dyn Host,
    backend: &str,
    g: &Group,
    now: u64,
    f: impl FnMut(&State) -> Vec<(Option<String>, u32)>,
) {
    let saturated = filter.saturated_models(host, backend, now);
    let saturated = |m: &str| saturated.iter().any(|s| s == m);
    let tries = filter
        .tries()
        .saturating_mul(crate::limits::reservation::SETTLE_TRIES_FACTOR);
    let changed = queue::lease(host, g, tries, &saturated, now, f);
    filter.applied(host, backend, &changed);
}

#[cfg(test)]
mod tests;
