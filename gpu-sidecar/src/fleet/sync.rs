//! The fleet-wide kill switch, breakers and fingerprints: loops, one per
//! `sync_interval`, that keep this sidecar and Redis in step (see the
//! folder's header).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::{now_ms, Fleet, Shared, BOARD_FORGET_MS, BOARD_LIVE_MS};
use crate::state::StateStore;
use crate::watch::kill_switch::KillSwitchControl;

/// A breaker as published in Redis for the other sidecars.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Published {
    scope: String,
    state: crate::state::BreakerState,
    half_open_fraction: f64,
    retry_after_seconds: u64,
    reason: Option<String>,
    since_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Board {
    at_ms: u64,
    breakers: Vec<Published>,
}

/// Publishes this sidecar's open and half-open breakers and merges every
/// other live sidecar's into the state this sidecar serves (under its own
/// for the same scope), so a breaker opened by the sidecar that watches a
/// GPU reaches every Envoy through its own sidecar's long poll.
pub async fn sync_breakers(
    fleet: Arc<Fleet>,
    store: StateStore,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let id = format!("{:x}-{:x}", now_ms(), std::process::id());
    let mut tick = tokio::time::interval(fleet.config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = closing.changed() => return,
        }
        let now = now_ms();
        let body = my_board(&store, now);
        let Ok(all) = fleet.swap_breakers(&id, &body).await else {
            // Redis away: keep the last merged view until the entries would
            // have gone stale, then serve only this sidecar's own.
            continue;
        };
        let (merged, gone) = merge_boards(all, &id, now);
        store.set_fleet_breakers(SystemTime::now(), merged);
        fleet.forget_breakers(&gone).await;
    }
}

/// This sidecar's board at `now`, as JSON: its own breakers (not those
/// merged from the fleet).
fn my_board(store: &StateStore, now: u64) -> String {
    let mine: Vec<Published> = store
        .current()
        .breakers
        .iter()
        .filter(|b| !b.from_fleet)
        .map(|b| Published {
            scope: b.scope.clone(),
            state: b.state,
            half_open_fraction: b.half_open_fraction,
            retry_after_seconds: b.retry_after_seconds,
            reason: b.reason.clone(),
            since_ms: b
                .since
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        })
        .collect();
    serde_json::to_string(&Board {
        at_ms: now,
        breakers: mine,
    })
    .unwrap_or_default()
}

/// The other live sidecars' boards (`all` but `id`, this one) merged, the
/// most open state winning per scope, sorted by scope; and the sidecars
/// whose boards are unreadable or long stale, to forget.
fn merge_boards(
    all: Vec<(String, String)>,
    id: &str,
    now: u64,
) -> (Vec<crate::state::Breaker>, Vec<String>) {
    let mut merged: Vec<crate::state::Breaker> = Vec::new();
    let mut gone = Vec::new();
    for (other, raw) in all {
        if other == id {
            continue;
        }
        let Some(board) = read_board(&raw) else {
            gone.push(other);
            continue;
        };
        if board.at_ms + BOARD_FORGET_MS < now {
            gone.push(other);
        }
        if board.at_ms + BOARD_LIVE_MS < now {
            continue;
        }
        for b in board.breakers {
            let view = crate::state::Breaker {
                scope: b.scope.clone(),
                state: b.state,
                half_open_fraction: b.half_open_fraction,
                retry_after_seconds: b.retry_after_seconds,
                reason: Some(format!(
                    "fleet: {}",
                    b.reason.as_deref().unwrap_or("opened by another sidecar")
                )),
                since: SystemTime::UNIX_EPOCH + Duration::from_millis(b.since_ms),
                from_fleet: true,
            };
            match merged.iter_mut().find(|m| m.scope == view.scope) {
                Some(m) if crate::state::gauge(m.state) < crate::state::gauge(view.state) => {
                    *m = view
                }
                Some(_) => {}
                None => merged.push(view),
            }
        }
    }
    merged.sort_by(|a, b| a.scope.cmp(&b.scope));
    (merged, gone)
}

/// Another sidecar's board, if this sidecar can serve all of it. A state
/// this build does not know (`Unknown`, from a newer sidecar) makes the
/// board unreadable, as it was before the states were one enum: it must
/// not reach `/v1/state`, which could not be written with it.
fn read_board(raw: &str) -> Option<Board> {
    let board: Board = serde_json::from_str(raw).ok()?;
    let known = board
        .breakers
        .iter()
        .all(|b| b.state != crate::state::BreakerState::Unknown);
    known.then_some(board)
}

/// Keeps the local kill switch and Redis' equal until `closing`: a local
/// change (admin call here) is written to Redis; a newer value in Redis
/// (pulled on another sidecar) is applied here, which bumps the state
/// version and so answers this Envoy's held long poll at once.
pub async fn sync_kill_switch(
    fleet: Arc<Fleet>,
    store: StateStore,
    control: Arc<KillSwitchControl>,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let local = |s: &StateStore| {
        let k = s.current().kill_switch.clone();
        (k.active, k.reason)
    };
    // What both sides agreed on last: a local value different from it is
    // a local change.
    let mut agreed: Option<(bool, Option<String>)> = None;
    let mut seen_stamp = 0u64;
    let mut tick = tokio::time::interval(fleet.config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = closing.changed() => return,
        }
        let Ok(remote) = fleet.get_kill_switch().await else {
            continue; // Redis away: the local switch still works here
        };
        let mine = local(&store);
        let changed_here = agreed.as_ref().is_some_and(|a| *a != mine);
        match remote {
            Some(r) if !changed_here && r.stamp > seen_stamp => {
                seen_stamp = r.stamp;
                if (r.active, r.reason.clone()) != mine {
                    control
                        .set(r.active, r.reason.clone(), SystemTime::now())
                        .await;
                }
                agreed = Some(local(&store));
            }
            Some(_) if !changed_here => {
                agreed = Some(mine);
            }
            _ => {
                // First start with nothing in Redis, or a change made here.
                if agreed.is_none() && !mine.0 && remote.is_none() {
                    agreed = Some(mine);
                    continue;
                }
                let stamp = now_ms().max(seen_stamp + 1);
                let value = Shared {
                    active: mine.0,
                    reason: mine.1.clone(),
                    stamp,
                };
                if fleet.put_kill_switch(&value).await.is_ok() {
                    seen_stamp = stamp;
                    agreed = Some(mine);
                }
            }
        }
    }
}

/// Every `sync_interval`: checks the epoch, publishes this sidecar's
/// fingerprint and compares it with every live sidecar's; while one
/// differs, the fleet endpoints answer 503 `fleet_mismatch` (logged on
/// each change).
pub async fn sync_fingerprints(fleet: Arc<Fleet>, mut closing: tokio::sync::watch::Receiver<bool>) {
    let id = super::concurrency::holder_id();
    let mut tick = tokio::time::interval(fleet.config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = closing.changed() => return,
        }
        fleet.reload_policy();
        let _ = fleet.check_epoch().await;
        let Ok(agree) = fleet.compare_fingerprints(id).await else {
            continue; // Redis away: nothing is counted meanwhile anyway
        };
        let was = fleet.stats.mismatch.swap(!agree, Ordering::Relaxed);
        if was == agree {
            if agree {
                eprintln!("sluice-sidecar: fleet: every live sidecar has this fleet fingerprint again; counting resumes");
            } else {
                eprintln!(
                    "sluice-sidecar: fleet: fingerprint mismatch: another live sidecar has another salt, \
                     expected_replicas or fleet rules (ours: {}); answering 503 fleet_mismatch, the \
                     Envoy follows on_unavailable until they agree",
                    fleet.view().fingerprint
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_board_with_a_state_this_sidecar_does_not_know_is_not_served() {
        let ok = r#"{"at_ms":1,"breakers":[{"scope":"model:m","state":"open","half_open_fraction":0.0,"retry_after_seconds":30,"reason":null,"since_ms":0}]}"#;
        assert_eq!(read_board(ok).map(|b| b.breakers.len()), Some(1));
        let newer = ok.replace("\"open\"", "\"melting\"");
        assert!(read_board(&newer).is_none());
        assert!(read_board("{").is_none());
    }
}
