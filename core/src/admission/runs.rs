//! The request's run (`runs`) and the loop guard (`loop_guard`), read
//! once the body is: which run a request is counted against, hashed with
//! the caller's identity; and whether the caller sent this very body too
//! often within the guard's window.
//!
//! A run id is never kept or shown: it is hashed with the caller's
//! principal hash under the deployment's key (`crate::policy::keys`), and
//! only the hash places the run's record (`crate::limits::runs`).
//!
//! The loop guard's records are a fixed table of `loop_guard.slots` keys
//! (`sluice:v1:loop:{slot}`), each a body's fingerprint (caller, path and
//! body, hashed under the same key), the start of its window and its count.
//! A record whose window has ended is free. When every probed record holds
//! another live body the request is let through uncounted (counted in
//! `sluice_loop_guard_untracked_total`): the guard catches a client stuck
//! in a loop, it is no budget, and never refuses what it cannot count.

use super::*;
use crate::admission::identity::RequestView;
use crate::limits::slot_table::{self, SlotClaim, SlotSeen, SlotTable};
use crate::policy::runs::MAX_RUN_ID;
use crate::state::codec::{Reader, Writer};
use crate::state::store::Attempt;

const LOOP_PREFIX: &str = "sluice:v1:loop:";
/// Slots probed from a body's home slot.
const LOOP_PROBES: u32 = 4;

/// One loop-guard record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LoopRecord {
    /// The body's fingerprint (0: never used).
    pub(crate) print: u64,
    pub(crate) window_start: u64,
    pub(crate) count: u32,
}

impl Record for LoopRecord {
    const LEN: usize = 20;
    fn write(&self, w: &mut Writer) {
        w.u64(self.print).u64(self.window_start).u32(self.count);
    }
    fn read(r: &mut Reader) -> Self {
        LoopRecord {
            print: r.u64(),
            window_start: r.u64(),
            count: r.u32(),
        }
    }
}

/// What the loop guard found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopSeen {
    /// Counted, within the limit (or no guard).
    Fine,
    /// Every probed record holds another live body: not counted.
    Untracked,
    /// Over the limit: the refusal, and the wait until the window ends.
    Loop { retry_after_ms: u64 },
}

impl Engine {
    /// The run a request is counted against: `Ok(None)` without `runs`,
    /// without a body, or when the run is optional and not named. A run
    /// required and not named, named twice, or named by a bad value is
    /// refused 400 naming the field.
    pub fn run_of(
        &self,
        identity: &Identity,
        view: &dyn RequestView,
        asked: Option<&Asked>,
    ) -> Result<Option<u64>, Box<Verdict>> {
        let (Some(runs), Some(asked)) = (&self.policy.runs, asked) else {
            return Ok(None);
        };
        let field = runs.id.field();
        let bad = |why: &str| {
            let message = format!("`{field}` names this request's run: {why}.");
            let refused = Refused::rejected(Reason::InvalidRequest, message, Some(field));
            Box::new(self.refuse(refused, &identity.tier, None))
        };
        let id: Option<String> = match (&runs.id.header, &runs.id.body) {
            (Some(name), _) => {
                let name = name.to_ascii_lowercase();
                if view.header_count(&name) > 1 {
                    return Err(bad("it was sent more than once"));
                }
                view.header(&name).map(|v| v.into_owned())
            }
            (None, Some(path)) => {
                let at = path.split('.').try_fold(asked.body(), |v, k| v.get(k));
                match at {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(_) => return Err(bad("it must be a string")),
                }
            }
            (None, None) => None,
        };
        let Some(id) = id else {
            if runs.required {
                return Err(bad(
                    "this gateway counts a budget per run, and the request names none",
                ));
            }
            return Ok(None);
        };
        if let Some(why) = run_id_problem(&id) {
            return Err(bad(&why));
        }
        Ok(Some(self.run_hash(identity, &id)))
    }

    /// A run id as its records know it: hashed with the caller's identity
    /// under the deployment's key (one caller cannot name another's run).
    fn run_hash(&self, identity: &Identity, id: &str) -> u64 {
        let mut bytes = identity.hash.to_le_bytes().to_vec();
        bytes.extend_from_slice(id.as_bytes());
        self.hash_key.hash(&bytes).max(2)
    }

    /// The run a bodyless request names in the policy's run header, if it
    /// names one well (the limits endpoint shows that run's budgets);
    /// `None` otherwise: nothing is refused for it, as no budget is taken.
    pub fn run_in_header(&self, identity: &Identity, view: &dyn RequestView) -> Option<u64> {
        let name = self.policy.runs.as_ref()?.id.header.as_ref()?;
        let name = name.to_ascii_lowercase();
        if view.header_count(&name) != 1 {
            return None;
        }
        let id = view.header(&name)?;
        run_id_problem(&id)
            .is_none()
            .then(|| self.run_hash(identity, &id))
    }

    /// 429 `run_limit`: every run slot the caller may use holds a live run.
    pub(super) fn run_limit(&self, retry_after_ms: u64) -> Refused {
        let per_caller = self.policy.runs.as_ref().map_or(0, |r| r.max_per_caller);
        let secs = retry_after_ms.div_ceil(1000).max(1);
        let message = format!(
            "Too many live runs: this gateway counts at most {per_caller} runs of one caller \
             at once (fewer while it tracks many callers' runs), and forgets a run only once \
             it has gone unused. Reuse a run, or try again in {secs} s."
        );
        Refused::retry_later(Reason::RunLimit, message, secs)
    }

    /// Counts this body from this caller (the loop guard); `Loop` once it
    /// came more than `max_repeats` times within the window.
    pub fn loop_seen(
        &self,
        store: &dyn SharedStore,
        identity: &Identity,
        path: &str,
        raw: &[u8],
        now_ms: u64,
    ) -> (LoopSeen, Contention) {
        let mut effort = Contention::default();
        let Some(guard) = &self.policy.loop_guard else {
            return (LoopSeen::Fine, effort);
        };
        let mut bytes = Vec::with_capacity(raw.len() + path.len() + 9);
        bytes.extend_from_slice(&identity.hash.to_le_bytes());
        bytes.extend_from_slice(path.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(raw);
        let print = self.hash_key.hash(&bytes).max(1);
        let table = loop_table(guard.slots);
        let window = guard.window_ms;
        let seen = store::retry(self.tries().take(), &mut effort, || {
            let probed = table.probe(print).map(|key| {
                let (bytes, cas) = store.get(&key).unwrap_or_default();
                (key, cas, LoopRecord::decode(&bytes))
            });
            let live = |s: &LoopRecord| now_ms.saturating_sub(s.window_start) < window;
            let found = slot_table::claim(probed, |(_, _, s)| match s {
                s if s.print == print && live(s) => SlotSeen::Mine,
                s if s.print == 0 => SlotSeen::Last(1u8),
                s if !live(s) => SlotSeen::Free(0),
                _ => SlotSeen::Busy,
            });
            let (key, cas, next) = match found {
                SlotClaim::Mine((key, cas, s)) => (
                    key,
                    cas,
                    LoopRecord {
                        count: s.count.saturating_add(1),
                        ..s
                    },
                ),
                SlotClaim::Free((key, cas, _)) => (
                    key,
                    cas,
                    LoopRecord {
                        print,
                        window_start: now_ms,
                        count: 1,
                    },
                ),
                SlotClaim::Full => return Attempt::Done(LoopSeen::Untracked),
            };
            if next.count > guard.max_repeats {
                let retry_after_ms = (next.window_start + window).saturating_sub(now_ms);
                return Attempt::Done(LoopSeen::Loop { retry_after_ms });
            }
            match store.set(&key, &next.encode(), cas) {
                Ok(()) => Attempt::Done(LoopSeen::Fine),
                Err(StoreError::CasMismatch) => Attempt::Lost,
                Err(StoreError::Host(_)) => Attempt::Done(LoopSeen::Untracked),
            }
        });
        (seen.unwrap_or(LoopSeen::Untracked), effort)
    }

    /// 429 `loop_detected`, with the wait until the body's window ends.
    pub fn loop_refusal(&self, identity: &Identity, retry_after_ms: u64) -> Verdict {
        let guard = self.policy.loop_guard.as_ref();
        let (n, window_s) = guard.map_or((0, 0), |g| (g.max_repeats, g.window_ms / 1000));
        let secs = retry_after_ms.div_ceil(1000).max(1);
        let message = format!(
            "This exact request was sent more than {n} times within {window_s} s: \
             it looks like a client stuck in a loop. Change the request, or try again in {secs} s."
        );
        let refused = Refused::retry_later(Reason::LoopDetected, message, secs);
        self.refuse(refused, &identity.tier, None)
    }

    /// Creates the loop guard's keys (none without a guard).
    pub(super) fn prepare_loop_guard(&self, store: &dyn SharedStore) -> Result<usize, StoreError> {
        match &self.policy.loop_guard {
            Some(g) => loop_table(g.slots).prepare(store, &LoopRecord::default().encode()),
            None => Ok(0),
        }
    }
}

fn loop_table(slots: u32) -> SlotTable<'static> {
    SlotTable::flat(LOOP_PREFIX, slots, LOOP_PROBES)
}

/// What is wrong with a run id, if anything (the 400's words).
fn run_id_problem(id: &str) -> Option<String> {
    if id.is_empty() || id.len() > MAX_RUN_ID {
        return Some(format!("it must be 1 to {MAX_RUN_ID} bytes long"));
    }
    id.chars()
        .any(char::is_control)
        .then(|| "it must not hold control characters".to_string())
}
