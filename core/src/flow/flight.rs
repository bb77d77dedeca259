//! One upstream call per cache key in flight: identical questions that
//! miss the cache together do not all go upstream. The first to miss
//! claims the key (it *leads*); the others that read the cache find the
//! claim and *follow*: they pause, holding nothing (no slot, no place, no
//! reservation), and look the cache up again once the leader's claim is
//! gone (its answer stored, or it ended without one) or after
//! [`FOLLOW_MS`], whichever comes first. Then a hit is served from the
//! store, and a miss goes on as any miss (it may lead in turn).
//!
//! Claims live in [`SLOTS`] shared-data keys made at load (never one per
//! question: shared data never forgets a key), so every worker of the
//! Envoy sees them; a key's slot and its 64-bit id come from its hex
//! digest (salted SHA-256: a caller cannot aim at another's slot without
//! the salt and the other's scope). A slot held by another key is never
//! waited for: that question goes on alone, as before (a collision costs
//! the dedup, never a delay). A claim lapses after [`HOLD_MS`], so a
//! leader that vanished (its worker gone) blocks no one for longer.
//!
//! Followers are kept per root context and re-checked on its tick (with a
//! sidecar, every `TICK_MS`): at most that much later than the store.

use std::cell::RefCell;
use std::rc::Weak;

use super::{count_contention, Filter, Stream};
use crate::host::Host;
use crate::state::store::{Cas, Updated};

/// Shared-data keys holding claims.
pub const SLOTS: u64 = 256;
/// A claim lapses after this (ms): the longest a leader may keep others
/// waiting for its answer.
pub const HOLD_MS: u64 = 120_000;
/// The longest a request follows a leader in all (ms), before it goes
/// upstream itself.
pub const FOLLOW_MS: u64 = 30_000;

const PREFIX: &str = "sluice:v1:cache:flight:";

/// A claimed slot: released by the one who holds it, once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FlightSlot {
    slot: String,
    id: u64,
    until_ms: u64,
}

/// A paused request waiting for a leader's answer.
pub(super) struct Follower {
    stream: Weak<RefCell<Stream>>,
    context_id: u32,
    slot: String,
    id: u64,
    until_ms: u64,
}

/// What a request that missed does.
pub(super) enum Flight {
    Lead(FlightSlot),
    /// Another request asks the same question now: wait for it.
    Follow {
        slot: String,
        id: u64,
    },
    /// The slot holds another question: go on without a claim.
    Alone,
}

/// Creates the slots (at load, only with a cache).
pub(super) fn prepare(host: &dyn Host) {
    for i in 0..SLOTS {
        let key = format!("{PREFIX}{i}");
        if host.get(&key).is_none() {
            let _ = host.set(&key, &[], 0);
        }
    }
}

/// The slot and id of a cache key (hex): `None` for a key too short.
fn place(key_hex: &str) -> Option<(String, u64)> {
    let id = u64::from_str_radix(key_hex.get(..16)?, 16).ok()?;
    let spread = u64::from_str_radix(key_hex.get(16..32)?, 16).ok()?;
    Some((format!("{PREFIX}{}", spread % SLOTS), id.max(1)))
}

fn decode(bytes: Option<&[u8]>) -> (u64, u64) {
    let b = bytes.unwrap_or_default();
    let word = |i: usize| {
        b.get(i..i + 8)
            .and_then(|w| <[u8; 8]>::try_from(w).ok())
            .map_or(0, u64::from_le_bytes)
    };
    (word(0), word(8))
}

fn encode(id: u64, until_ms: u64) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend_from_slice(&until_ms.to_le_bytes());
    v
}

/// Claims the key's slot, or finds the same question in flight.
pub(super) fn claim(host: &dyn Host, tries: u32, key_hex: &str, now: u64) -> Flight {
    let Some((slot, id)) = place(key_hex) else {
        return Flight::Alone;
    };
    let mut found = Flight::Alone;
    let until_ms = now.saturating_add(HOLD_MS);
    let mut cas = Cas::new(host, tries);
    let written = cas.update(&slot, |bytes| {
        let (held, until) = decode(bytes);
        if until > now {
            found = if held == id {
                Flight::Follow {
                    slot: slot.clone(),
                    id,
                }
            } else {
                Flight::Alone
            };
            return None;
        }
        Some(encode(id, until_ms))
    });
    count_contention(host, cas.contention);
    match written {
        Updated::Written => Flight::Lead(FlightSlot { slot, id, until_ms }),
        _ => found,
    }
}

/// Whether the slot still holds this question's claim.
fn held(host: &dyn Host, slot: &str, id: u64, now: u64) -> bool {
    let bytes = host.get(slot).map(|(b, _)| b);
    let (held, until) = decode(bytes.as_deref());
    held == id && until > now
}

/// Gives a claim back (its answer is stored, or will never be).
pub(super) fn release(host: &dyn Host, tries: u32, claim: &FlightSlot) {
    let mut cas = Cas::new(host, tries);
    cas.update(&claim.slot, |bytes| {
        let (held, until) = decode(bytes);
        (held == claim.id && until == claim.until_ms).then(Vec::new)
    });
    count_contention(host, cas.contention);
}

impl Filter {
    pub(super) fn follow(&self, follower: Follower) {
        if let Ok(mut f) = self.followers.try_borrow_mut() {
            f.push(follower);
        }
    }
}

/// On the root's tick: each follower whose leader is done (or whose wait
/// is over) looks the cache up again, as its stream.
pub(super) fn tick(filter: &Filter, host: &dyn Host, now: u64) {
    let due: Vec<Follower> = {
        let Ok(mut followers) = filter.followers.try_borrow_mut() else {
            return;
        };
        if followers.is_empty() {
            return;
        }
        let (due, waiting) = std::mem::take(&mut *followers).into_iter().partition(|f| {
            f.stream.strong_count() == 0 || now >= f.until_ms || !held(host, &f.slot, f.id, now)
        });
        *followers = waiting;
        due
    };
    for f in due {
        let Some(stream) = f.stream.upgrade() else {
            continue;
        };
        let Ok(mut stream) = stream.try_borrow_mut() else {
            continue;
        };
        if host.set_effective_context(f.context_id) {
            stream.flight_over(host);
        }
    }
}

impl Stream {
    /// A miss of a request that reads the cache: lead (it will store),
    /// follow the same question in flight (`Some(Pause)`), or go alone.
    pub(super) fn take_flight(
        &mut self,
        host: &dyn Host,
        key_hex: &str,
        model: &str,
    ) -> Option<super::Action> {
        let now = host.now_ms();
        let deadline = *self
            .follow_until
            .get_or_insert(now.saturating_add(FOLLOW_MS));
        if now >= deadline || self.flight.is_some() {
            return None;
        }
        match claim(host, self.filter.engine.tries().take(), key_hex, now) {
            Flight::Lead(claim) if self.cache_store.is_some() => {
                self.flight = Some(claim);
                None
            }
            // Nothing to store after all: the claim goes back at once.
            Flight::Lead(claim) => {
                release(host, self.filter.engine.tries().take(), &claim);
                None
            }
            Flight::Alone => None,
            Flight::Follow { slot, id } => {
                self.filter.follow(Follower {
                    stream: self.me.clone(),
                    context_id: self.context_id,
                    slot,
                    id,
                    until_ms: deadline,
                });
                let label = self.filter.engine.model_label(Some(model));
                crate::host::metrics::CACHE.add_at(host, &["followed", "exact", &label], 1);
                Some(super::Action::Pause)
            }
        }
    }

    /// Its leader is done (or its wait is over): the cache again, then on
    /// as a hit or a miss (the body is still buffered in Envoy).
    fn flight_over(&mut self, host: &dyn Host) {
        if self.decided() {
            return;
        }
        self.cache_looked = false;
        self.cache_store = None;
        let body = host.request_body(self.body_size);
        if self.decide(host, &body) == super::Action::Continue {
            host.resume_request();
        }
    }

    /// The claim goes back (stored, or the request ends without it).
    pub(super) fn land_flight(&mut self, host: &dyn Host) {
        if let Some(claim) = self.flight.take() {
            release(host, self.filter.engine.tries().settle(), &claim);
        }
    }
}
