//! Health and routing (docs/src/design.md, "Route"): where a request may go given what
//! the sidecar reports (GPU breakers, kill switch) and what the upstream
//! itself said lately (failures, `Retry-After`). Pure: state comes in as
//! values or through the [`SharedStore`] trait, time as `now_ms`, chance as
//! a number in 0..1000.
//!
//! The upstream pushback record, [`RouteHealth`] (one per model route, fixed size). Invariants:
//! - The error breaker opens only on `failures_to_open` failures in a row,
//!   within `failure_window`, from `min_callers` distinct callers (their
//!   32-bit fingerprints, at most [`MAX_CALLERS`] kept; two callers that
//!   share a fingerprint count as one, which only opens the breaker later).
//! - While it is open, one probe at a time, claimed by compare-and-swap
//!   after admission, for at most [`PROBE_LEASE_MS`]. A failed probe reopens
//!   the breaker (cooldown × backoff) only once probes of `min_callers`
//!   callers failed; a caller whose probe failed waits a cooldown first.
//! - A route pause and a credential pause each last at most `max_pause`
//!   plus jitter. A credential's pause lives in a hashed slot holding its
//!   64-bit fingerprint: it never applies to another credential; a newer
//!   pause may displace it (that credential then reaches the upstream and
//!   gets its 429 again).
//! - Contention: every change goes through the one CAS loop
//!   ([`crate::state::store::update`], `state.cas_max_retries` tries); an
//!   exhausted change is dropped and counted (`sluice_cas_exhausted_total`,
//!   `sluice_upstream_unrecorded_total`). This state is advisory: losing a
//!   write never admits or charges anyone.

use crate::state::codec::{Reader, Record, Writer};
pub use sluice_wire::state::{
    Breaker as BreakerView, BreakerState, KillSwitch, State as SidecarState,
};

use crate::admission::answer::Reason;
use crate::policy::protection::{Credentials, MAX_CALLERS};
use crate::policy::sidecar::OnStale;
use crate::state::store::{Cas, SharedStore, Updated};

/// The sidecar state as one worker sees it: the last one received, and when.
#[derive(Debug, Clone, Default)]
pub struct SidecarSeen {
    pub state: Option<SidecarState>,
    pub received_ms: u64,
}

impl SidecarSeen {
    /// The state whose breakers count at `now_ms`: received within
    /// `stale_after_ms`, or older under `on_stale: fail_closed`.
    pub fn trusted(
        &self,
        now_ms: u64,
        stale_after_ms: u64,
        on_stale: OnStale,
    ) -> Option<&SidecarState> {
        let fresh = now_ms.saturating_sub(self.received_ms) <= stale_after_ms;
        self.state
            .as_ref()
            .filter(|_| fresh || on_stale == OnStale::FailClosed)
    }
}

/// How long a claimed half-open probe keeps other requests out, at most
/// (a probe whose answer never comes must not block the route for good).
pub const PROBE_LEASE_MS: u64 = 30_000;

/// What the last responses of one model route said. Kept per route in
/// shared data so every worker pauses and breaks together; fixed size,
/// whatever the number of callers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteHealth {
    /// Requests wait until then (an upstream `Retry-After` about the route).
    pub paused_until_ms: u64,
    /// The latest end of a per-credential pause on this route: until then
    /// a request looks its credential's slot up (else it skips the read).
    pub credential_pauses_until_ms: u64,
    /// Failures in a row (5xx, reset, timeout) since `streak_since_ms`.
    pub failures: u32,
    pub streak_since_ms: u64,
    /// Fingerprints of the distinct callers behind those failures (0: free)
    /// or, while the breaker is open, behind its failed probes.
    pub callers: [u32; MAX_CALLERS],
    /// The error breaker is open until then; after it, one probe at a time.
    pub open_until_ms: u64,
    /// The cooldown the next opening will use.
    pub cooldown_ms: u64,
    /// A half-open probe is in flight, until this time (its lease; the value
    /// also names the claim, so a late answer cannot end a newer one).
    pub probe_until_ms: u64,
    /// The caller whose probe failed last may not probe again until then.
    pub barred: u32,
    pub barred_until_ms: u64,
}

impl RouteHealth {
    pub fn is_blank(&self) -> bool {
        *self == RouteHealth::default()
    }

    /// The breaker is past its cooldown, no probe is in flight, and this
    /// caller's own probe did not just fail.
    pub fn may_probe(&self, caller: u32, now_ms: u64) -> bool {
        self.open_until_ms > 0
            && self.open_until_ms <= now_ms
            && self.probe_until_ms <= now_ms
            && !(self.barred == caller && self.barred_until_ms > now_ms)
    }

    fn distinct_callers(&self) -> u32 {
        self.callers.iter().filter(|c| **c != 0).count() as u32
    }

    /// Remembers a failing caller; when the set is full it already holds
    /// more callers than `min_callers` can ask for.
    fn add_caller(&mut self, caller: u32) {
        if self.callers.contains(&caller) {
            return;
        }
        if let Some(free) = self.callers.iter_mut().find(|c| **c == 0) {
            *free = caller;
        }
    }

    fn forget_streak(&mut self) {
        self.failures = 0;
        self.streak_since_ms = 0;
        self.callers = [0; MAX_CALLERS];
    }

    fn open(&mut self, p: &Protection, now_ms: u64) {
        let cooldown = if self.cooldown_ms == 0 {
            p.cooldown_ms
        } else {
            self.cooldown_ms
                .saturating_mul(u64::from(p.backoff))
                .min(p.max_cooldown_ms)
        };
        self.open_until_ms = now_ms.saturating_add(cooldown).max(1);
        self.cooldown_ms = cooldown;
        self.forget_streak();
    }

    /// Records one upstream answer for the error breaker. `caller` is the
    /// fingerprint of the principal that sent the request (never 0), and
    /// `lease` the probe claim it held, if any.
    pub fn observe(
        mut self,
        p: &Protection,
        status: u32,
        caller: u32,
        lease: Option<u64>,
        now_ms: u64,
    ) -> RouteHealth {
        // What has ended leaves no trace.
        if self.paused_until_ms <= now_ms {
            self.paused_until_ms = 0;
        }
        if self.credential_pauses_until_ms <= now_ms {
            self.credential_pauses_until_ms = 0;
        }
        if self.barred_until_ms <= now_ms {
            (self.barred, self.barred_until_ms) = (0, 0);
        }
        let caller = caller.max(1);
        let was_probe = lease.is_some_and(|l| l == self.probe_until_ms && l > 0);
        if was_probe {
            self.probe_until_ms = 0;
        }
        let failed = status == 0 || status >= 500;
        if !failed {
            // A good answer closes the breaker: the upstream serves.
            self.forget_streak();
            if self.open_until_ms > 0 {
                self.open_until_ms = 0;
                self.cooldown_ms = 0;
                self.probe_until_ms = 0;
                (self.barred, self.barred_until_ms) = (0, 0);
            }
            return self;
        }
        if self.open_until_ms > 0 {
            if !was_probe {
                // Requests let in before the breaker opened say nothing new.
                return self;
            }
            // A failed probe reopens the breaker only once probes of
            // `min_callers` callers failed: one caller cannot keep a route
            // shut by failing every probe. Meanwhile it may not probe again
            // for a cooldown, so another caller's probe goes next.
            self.add_caller(caller);
            if self.distinct_callers() >= p.min_callers {
                self.open(p, now_ms);
            } else {
                self.barred = caller;
                self.barred_until_ms = now_ms.saturating_add(p.cooldown_ms);
            }
            return self;
        }
        let window_over = now_ms.saturating_sub(self.streak_since_ms) > p.failure_window_ms;
        if self.failures == 0 || window_over {
            self.forget_streak();
            self.streak_since_ms = now_ms;
        }
        self.failures = self.failures.saturating_add(1);
        self.add_caller(caller);
        if self.failures >= p.failures_to_open && self.distinct_callers() >= p.min_callers {
            self.open(p, now_ms);
        }
        self
    }
}

/// One credential's pause, in a hashed slot (`sluice:v1:pause/<n>`). The
/// slot keeps the credential's 64-bit fingerprint, so a pause never applies
/// to a credential that merely shares the slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CredentialPause {
    pub fingerprint: u64,
    pub until_ms: u64,
}

impl CredentialPause {
    /// When this credential's pause ends (0: it is not paused).
    pub fn until_for(&self, fingerprint: u64, now_ms: u64) -> u64 {
        if self.fingerprint == fingerprint && self.until_ms > now_ms {
            self.until_ms
        } else {
            0
        }
    }
}

/// Upstream-driven protection settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protection {
    pub failures_to_open: u32,
    pub min_callers: u32,
    pub failure_window_ms: u64,
    pub cooldown_ms: u64,
    pub backoff: u32,
    pub max_cooldown_ms: u64,
    pub max_jitter_ms: u64,
    pub max_pause_ms: u64,
}

/// What an upstream's `Retry-After` pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseScope {
    /// Every caller of the model route.
    Route,
    /// Only requests sent with the same credential.
    Credential,
}

/// Who a `Retry-After` on `status` pauses. A 503 speaks for the upstream
/// itself. A 429 speaks for the credential the request carried: the whole
/// route only when that credential is Envoy's, shared by everyone.
pub fn pause_scope(status: u32, credentials: Credentials) -> Option<PauseScope> {
    match (status, credentials) {
        (503, _) | (429, Credentials::Injected) => Some(PauseScope::Route),
        (429, Credentials::PassThrough) => Some(PauseScope::Credential),
        _ => None,
    }
}

/// The pause a `Retry-After` of `retry_after_ms` causes: at most
/// `max_pause`, plus jitter (`dice` in 0..1000) so that the paused callers
/// do not all come back at once. `None` when pauses are off (`max_pause: 0s`).
pub fn pause_ms(retry_after_ms: u64, p: &Protection, dice: u32) -> Option<u64> {
    if p.max_pause_ms == 0 {
        return None;
    }
    let jitter = p.max_jitter_ms.saturating_mul(u64::from(dice.min(999))) / 1000;
    Some(retry_after_ms.min(p.max_pause_ms).saturating_add(jitter))
}

/// Where one request's pushback state lives, and what it said when the
/// request arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushback {
    /// The model route's record (`sluice:v1:upstream/<route>`).
    pub route_key: String,
    /// Pass-through credential: its pause slot's key and fingerprint.
    pub credential: Option<(String, u64)>,
    pub credentials: Credentials,
    /// The caller's fingerprint for the breaker's distinct-caller count.
    pub caller: u32,
    pub record: RouteHealth,
    /// This credential is paused until then (0: not paused).
    pub credential_paused_until_ms: u64,
}

/// A route's record and its CAS token (a missing key reads as clean).
pub fn read(store: &dyn SharedStore, key: &str) -> (RouteHealth, u32) {
    store
        .get(key)
        .map_or((RouteHealth::default(), 0), |(b, cas)| {
            (RouteHealth::decode(&b), cas)
        })
}

/// Applies `next` to a route's record. `None`: the change was dropped
/// (every try lost, or the host refused), for the caller to count.
fn update_record(
    cas: &mut Cas,
    key: &str,
    next: impl Fn(RouteHealth) -> RouteHealth,
) -> Option<(RouteHealth, RouteHealth)> {
    let mut seen = (RouteHealth::default(), RouteHealth::default());
    match cas.update(key, |bytes| {
        let current = bytes.map(RouteHealth::decode).unwrap_or_default();
        let updated = next(current);
        seen = (current, updated);
        (updated != current).then(|| updated.encode())
    }) {
        Updated::Written | Updated::Unchanged => Some(seen),
        Updated::Exhausted | Updated::Failed => None,
    }
}

/// Claims the half-open probe for an admitted request: returns its lease,
/// or `None` when the probe is not (or no longer) this caller's to take.
pub fn claim_probe(cas: &mut Cas, key: &str, caller: u32, now_ms: u64) -> Option<u64> {
    let lease = now_ms.saturating_add(PROBE_LEASE_MS);
    let (before, after) = update_record(cas, key, |u| {
        if u.may_probe(caller, now_ms) {
            RouteHealth {
                probe_until_ms: lease,
                ..u
            }
        } else {
            u
        }
    })?;
    (before != after).then_some(lease)
}

/// Gives a probe claim back without an answer (the client left first): the
/// next request may probe at once.
/// `false`: the change was dropped (the lease then simply expires).
pub fn release_probe(cas: &mut Cas, key: &str, lease: u64) -> bool {
    update_record(cas, key, |u| {
        if u.probe_until_ms == lease {
            RouteHealth {
                probe_until_ms: 0,
                ..u
            }
        } else {
            u
        }
    })
    .is_some()
}

/// One upstream answer, as the pushback state needs it.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    pub status: u32,
    /// The pause its `Retry-After` asks for, capped and jittered
    /// ([`pause_ms`]); `None` without one.
    pub pause_ms: Option<u64>,
    /// The probe claim the request held.
    pub lease: Option<u64>,
    /// The answer came from the upstream (Envoy's `response.code_details`
    /// is `via_upstream`), not from Envoy or a filter after sluice. Only an
    /// upstream's answer can close the breaker or pause anyone; a failure
    /// counts either way (a connect failure is Envoy's own 503).
    pub from_upstream: bool,
}

/// What recording an answer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recorded {
    pub paused: Option<PauseScope>,
    pub breaker_opened: bool,
    /// A write was lost to contention (or the host): counted, not retried.
    pub dropped: bool,
    /// The races lost on the way (all of the [`Cas`] it was given).
    pub contention: crate::state::store::Contention,
}

/// Writes a credential's pause to its slot; `false` when the write was
/// lost (contention, or the host refused it).
fn pause_credential(cas: &mut Cas, slot: &str, fingerprint: u64, until: u64, now_ms: u64) -> bool {
    // Latest wins: a pause displaced from its slot only lets that
    // credential reach the upstream again, which answers 429 again.
    let slot_pause = CredentialPause {
        fingerprint,
        until_ms: until,
    };
    let written = cas.update(slot, |bytes| {
        let current = bytes.map(CredentialPause::decode).unwrap_or_default();
        let until = until.max(current.until_for(fingerprint, now_ms));
        Some(
            CredentialPause {
                until_ms: until,
                ..slot_pause
            }
            .encode(),
        )
    });
    !matches!(written, Updated::Exhausted | Updated::Failed)
}

/// Feeds one answer to the route's record and, for a pause about a
/// credential, to that credential's slot.
pub fn record(
    cas: &mut Cas,
    pb: &Pushback,
    p: &Protection,
    answer: Answer,
    now_ms: u64,
) -> Recorded {
    let mut out = Recorded::default();
    let pause = answer
        .pause_ms
        .filter(|_| answer.from_upstream)
        .and_then(|wait| {
            let scope = pause_scope(answer.status, pb.credentials)?;
            Some((scope, now_ms.saturating_add(wait)))
        });
    // A pass-through route always has a credential; without one the pause
    // has nobody to apply to but everyone, which a 429 must not do.
    let pause = match (pause, &pb.credential) {
        (Some((PauseScope::Credential, until)), Some((slot, fingerprint))) => {
            out.dropped |= !pause_credential(cas, slot, *fingerprint, until, now_ms);
            Some((PauseScope::Credential, until))
        }
        (Some((PauseScope::Credential, _)), None) => None,
        (other, _) => other,
    };
    out.paused = pause.map(|(scope, _)| scope);
    // A 429 speaks for the route when one credential serves everyone
    // (`injected`): then it is a failure of the route, with or without
    // `Retry-After`. On a pass-through route it is about the caller's own
    // credential, which its pause covers: it says nothing of the route.
    let route_429 =
        answer.status == 429 && answer.from_upstream && pb.credentials == Credentials::Injected;
    let status = if route_429 { 0 } else { answer.status };
    let failed = status == 0 || status >= 500;
    let updated = update_record(cas, &pb.route_key, |u| {
        let mut next = if failed || answer.from_upstream {
            u.observe(p, status, pb.caller, answer.lease, now_ms)
        } else if answer.lease.is_some_and(|l| l == u.probe_until_ms) {
            // Answered locally after its claim: the probe learned nothing,
            // the next request may probe.
            RouteHealth {
                probe_until_ms: 0,
                ..u
            }
        } else {
            u
        };
        match pause {
            Some((PauseScope::Route, until)) => {
                next.paused_until_ms = next.paused_until_ms.max(until);
            }
            Some((PauseScope::Credential, until)) => {
                next.credential_pauses_until_ms = next.credential_pauses_until_ms.max(until);
            }
            None => {}
        }
        next
    });
    match updated {
        Some((before, after)) => {
            out.breaker_opened = after.open_until_ms > before.open_until_ms;
        }
        None => out.dropped = true,
    }
    out.contention = cas.contention;
    out
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    Primary,
    /// The ladder's first provider that serves the request: on the kill
    /// switch, or (with a `ladder`) when the primary is out.
    Fallback,
    /// Nothing upstream may serve it: answer from the static table.
    Static,
    /// 503 with this code and `Retry-After`.
    Refuse {
        reason: Reason,
        retry_after_s: u64,
        why: String,
    },
    /// A half-open probe of the error breaker: go, and report back.
    Probe,
}

/// Inputs of the routing decision.
pub struct Situation<'a> {
    pub seen: &'a SidecarSeen,
    pub stale_after_ms: u64,
    pub on_stale: OnStale,
    pub model: Option<&'a str>,
    pub backend: &'a str,
    pub upstream: RouteHealth,
    /// The request's credential is paused until then (0: it is not).
    pub credential_paused_until_ms: u64,
    /// The caller's fingerprint (a caller whose probe just failed waits).
    pub caller: u32,
    /// A provider of the ladder (or the older `fallback`) serves this
    /// request: the kill switch sends it there.
    pub has_fallback: bool,
    /// The ladder also takes the request when the primary is out (open
    /// breakers, a paused or failing upstream), before the static answer.
    pub rung_when_out: bool,
    /// Serve the static table when the primary is out (breaker, error
    /// breaker) instead of refusing.
    pub static_when_out: bool,
    pub default_retry_after_s: u64,
    pub now_ms: u64,
    /// Uniform in 0..1000, for the half-open trickle.
    pub dice: u32,
}

/// A breaker of the sidecar's (trusted) state that covers the model or
/// its backend and lets nothing through: where the request goes instead.
fn breaker_route(s: &Situation) -> Option<Route> {
    let st = s.seen.trusted(s.now_ms, s.stale_after_ms, s.on_stale)?;
    let model_scope = s.model.map(|m| format!("model:{m}"));
    let backend_scope = format!("backend:{}", s.backend);
    for b in &st.breakers {
        let applies = Some(&b.scope) == model_scope.as_ref() || b.scope == backend_scope;
        // `saturated` is not a refusal: the concurrency gate decides
        // (batch waits, interactive is refused), see `queue`.
        if !applies || b.state == BreakerState::Saturated {
            continue;
        }
        let let_through =
            b.state == BreakerState::HalfOpen && (s.dice as f64) < b.half_open_fraction * 1000.0;
        if !let_through {
            if s.rung_when_out {
                return Some(Route::Fallback);
            }
            if s.static_when_out {
                return Some(Route::Static);
            }
            return Some(Route::Refuse {
                reason: Reason::GpuOverloaded,
                retry_after_s: b
                    .retry_after_seconds
                    .unwrap_or(s.default_retry_after_s)
                    .max(1),
                why: b
                    .reason
                    .clone()
                    .unwrap_or_else(|| format!("breaker {} is {}", b.scope, b.state.as_str())),
            });
        }
    }
    None
}

/// Decides the route. Order: kill switch, then the sidecar's breakers, then
/// the upstream's own pushback (pause, error breaker). A primary that is
/// out sends the request down the ladder when the policy has one
/// (`rung_when_out`), else to the static answer or a 503.
pub fn route(s: &Situation) -> Route {
    let state = s.seen.state.as_ref();
    if state.is_some_and(|st| st.kill_switch.active) {
        return if s.has_fallback {
            Route::Fallback
        } else {
            Route::Static
        };
    }
    if let Some(route) = breaker_route(s) {
        return route;
    }
    let up = s.upstream;
    let paused = [
        (
            up.paused_until_ms,
            "the upstream asked to slow down (Retry-After)",
        ),
        (
            s.credential_paused_until_ms,
            "the upstream rate-limited this credential (Retry-After)",
        ),
    ]
    .into_iter()
    .filter(|(until, _)| *until > s.now_ms)
    .max_by_key(|(until, _)| *until);
    if let Some((until, why)) = paused {
        if s.rung_when_out {
            return Route::Fallback;
        }
        return Route::Refuse {
            reason: Reason::UpstreamPaused,
            retry_after_s: (until - s.now_ms).div_ceil(1000).max(1),
            why: why.into(),
        };
    }
    if up.open_until_ms > 0 {
        if up.may_probe(s.caller, s.now_ms) {
            return Route::Probe;
        }
        if s.rung_when_out {
            return Route::Fallback;
        }
        if s.static_when_out {
            return Route::Static;
        }
        let barred = if up.barred == s.caller {
            up.barred_until_ms
        } else {
            0
        };
        let until = up.open_until_ms.max(up.probe_until_ms).max(barred);
        return Route::Refuse {
            reason: Reason::UpstreamUnhealthy,
            retry_after_s: until.saturating_sub(s.now_ms).div_ceil(1000).max(1),
            why: "the upstream failed repeatedly; its breaker is open".into(),
        };
    }
    Route::Primary
}

/// Seconds the sidecar may hold one long poll: `poll_wait`, but at most
/// half of `stale_after`, and at least 1 (the sidecar counts in seconds).
/// Only an answer refreshes the state's receive time, so a poll held past
/// `stale_after` would make a healthy sidecar whose state does not change
/// look dead, and its open breakers would be ignored (fail open).
pub fn poll_wait_s(poll_wait_ms: u64, stale_after_ms: u64) -> u64 {
    (poll_wait_ms.min(stale_after_ms / 2) / 1000).max(1)
}

/// `Retry-After` in milliseconds from `now_ms`: delta-seconds (digits,
/// saturating: a value too big for 64 bits is simply very long) or an HTTP
/// date (IMF-fixdate, RFC 850, asctime; one in the past is 0). Anything else
/// is `None`. Callers cap the result (`max_pause`).
pub fn parse_retry_after(value: &str, now_ms: u64) -> Option<u64> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        let seconds = value.bytes().fold(0u64, |n, b| {
            n.saturating_mul(10).saturating_add(u64::from(b - b'0'))
        });
        return Some(seconds.saturating_mul(1000));
    }
    // httpdate (hyper's) reads the three date forms RFC 9110 allows.
    let at = httpdate::parse_http_date(value).ok()?;
    let at_ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Some(at_ms.saturating_sub(now_ms))
}

/// Canned-answer key: lower case, letters and digits, single spaces.
pub fn normalize_prompt(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}

impl Record for RouteHealth {
    const LEN: usize = 7 * 8 + (2 + MAX_CALLERS) * 4;

    fn write(&self, w: &mut Writer) {
        w.u64(self.paused_until_ms)
            .u64(self.credential_pauses_until_ms)
            .u64(self.streak_since_ms)
            .u64(self.open_until_ms)
            .u64(self.cooldown_ms)
            .u64(self.probe_until_ms)
            .u64(self.barred_until_ms)
            .u32(self.failures)
            .u32(self.barred);
        for c in self.callers {
            w.u32(c);
        }
    }

    fn read(r: &mut Reader) -> Self {
        let mut u = RouteHealth {
            paused_until_ms: r.u64(),
            credential_pauses_until_ms: r.u64(),
            streak_since_ms: r.u64(),
            open_until_ms: r.u64(),
            cooldown_ms: r.u64(),
            probe_until_ms: r.u64(),
            barred_until_ms: r.u64(),
            failures: r.u32(),
            barred: r.u32(),
            callers: [0; MAX_CALLERS],
        };
        for c in &mut u.callers {
            *c = r.u32();
        }
        u
    }
}

impl Record for CredentialPause {
    const LEN: usize = 16;

    fn write(&self, w: &mut Writer) {
        w.u64(self.fingerprint).u64(self.until_ms);
    }

    fn read(r: &mut Reader) -> Self {
        CredentialPause {
            fingerprint: r.u64(),
            until_ms: r.u64(),
        }
    }
}

/// Shared-data encoding of a received sidecar state: receive time, then
/// the JSON.
pub fn encode_seen(received_ms: u64, json: &[u8]) -> Vec<u8> {
    let mut w = Writer::with_capacity(8 + json.len());
    w.u64(received_ms).bytes(json);
    w.into_bytes()
}

/// A value too short for its receive time reads as never received; JSON
/// that does not parse as a state keeps the receive time, without state.
pub fn decode_seen(bytes: &[u8]) -> SidecarSeen {
    let mut r = Reader::new(bytes);
    let Some(received_ms) = r.try_u64() else {
        return SidecarSeen::default();
    };
    SidecarSeen {
        state: serde_json::from_slice(r.rest()).ok(),
        received_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(json: &str, at: u64) -> SidecarSeen {
        crate::admission::route::decode_seen(&crate::admission::route::encode_seen(
            at,
            json.as_bytes(),
        ))
    }

    fn situation<'a>(
        seen: &'a SidecarSeen,
        upstream: RouteHealth,
        now_ms: u64,
        dice: u32,
    ) -> Situation<'a> {
        Situation {
            seen,
            stale_after_ms: 10_000,
            on_stale: OnStale::FailOpen,
            model: Some("big"),
            backend: "local",
            upstream,
            credential_paused_until_ms: 0,
            caller: A,
            has_fallback: true,
            rung_when_out: false,
            static_when_out: false,
            default_retry_after_s: 30,
            now_ms,
            dice,
        }
    }

    const OPEN: &str = r#"{"version": 2, "kill_switch": {"active": false, "reason": null},
        "breakers": [{"scope": "model:big", "state": "open", "half_open_fraction": 0.0,
                      "retry_after_seconds": 12, "reason": "gpu_utilization 95 >= 90 for 30s"}]}"#;

    #[test]
    fn an_open_breaker_refuses_its_scope_only() {
        let s = seen(OPEN, 1_000);
        let r = route(&situation(&s, RouteHealth::default(), 2_000, 0));
        assert!(
            matches!(
                r,
                Route::Refuse {
                    reason: Reason::GpuOverloaded,
                    retry_after_s: 12,
                    ..
                }
            ),
            "{r:?}"
        );
        let mut other = situation(&s, RouteHealth::default(), 2_000, 0);
        other.model = Some("small");
        assert_eq!(route(&other), Route::Primary);
    }

    #[test]
    fn half_open_lets_a_fraction_through() {
        let s = seen(
            &OPEN
                .replace("\"open\"", "\"half_open\"")
                .replace("0.0", "0.1"),
            0,
        );
        let through = (0..1000)
            .filter(|d| route(&situation(&s, RouteHealth::default(), 0, *d)) == Route::Primary)
            .count();
        assert_eq!(through, 100);
    }

    #[test]
    fn a_stale_sidecar_fails_open_but_keeps_the_kill_switch() {
        let s = seen(OPEN, 0);
        assert_eq!(
            route(&situation(&s, RouteHealth::default(), 20_000, 0)),
            Route::Primary
        );
        let mut closed = situation(&s, RouteHealth::default(), 20_000, 0);
        closed.on_stale = OnStale::FailClosed;
        assert!(matches!(route(&closed), Route::Refuse { .. }));
        let killed = seen(
            r#"{"version": 3, "kill_switch": {"active": true, "reason": "drill"}, "breakers": []}"#,
            0,
        );
        assert_eq!(
            route(&situation(&killed, RouteHealth::default(), 20_000, 0)),
            Route::Fallback
        );
        let mut no_fallback = situation(&killed, RouteHealth::default(), 0, 0);
        no_fallback.has_fallback = false;
        assert_eq!(route(&no_fallback), Route::Static);
    }

    #[test]
    fn with_a_ladder_a_primary_that_is_out_goes_to_the_rung_before_static_or_503() {
        let open = seen(OPEN, 1_000);
        let quiet = seen(
            r#"{"version": 1, "kill_switch": {"active": false}, "breakers": []}"#,
            1_000,
        );
        let paused = RouteHealth {
            paused_until_ms: 9_000,
            ..RouteHealth::default()
        };
        // Open until later, and a probe already out: no probe for this caller.
        let failing = RouteHealth {
            open_until_ms: 1_500,
            probe_until_ms: 9_000,
            ..RouteHealth::default()
        };
        for (s, up) in [
            (&open, RouteHealth::default()),
            (&quiet, paused),
            (&quiet, failing),
        ] {
            let mut laddered = situation(s, up, 2_000, 0);
            laddered.static_when_out = true;
            assert_ne!(route(&laddered), Route::Fallback, "no ladder: as before");
            laddered.rung_when_out = true;
            assert_eq!(route(&laddered), Route::Fallback, "{up:?}");
        }
        // A healthy primary keeps the request.
        let mut healthy = situation(&quiet, RouteHealth::default(), 2_000, 0);
        healthy.rung_when_out = true;
        assert_eq!(route(&healthy), Route::Primary);
    }

    const A: u32 = 11;
    const B: u32 = 22;

    fn protection() -> Protection {
        Protection {
            failures_to_open: 3,
            min_callers: 2,
            failure_window_ms: 60_000,
            cooldown_ms: 60_000,
            backoff: 2,
            max_cooldown_ms: 600_000,
            max_jitter_ms: 0,
            max_pause_ms: 300_000,
        }
    }

    fn fail(u: RouteHealth, caller: u32, now: u64) -> RouteHealth {
        u.observe(&protection(), 500, caller, None, now)
    }

    fn refused_with(r: &Route) -> Option<(&'static str, u64)> {
        match r {
            Route::Refuse {
                reason,
                retry_after_s,
                ..
            } => Some((reason.code(), *retry_after_s)),
            _ => None,
        }
    }

    #[test]
    fn a_route_pause_refuses_until_it_ends() {
        let none = SidecarSeen::default();
        let paused = RouteHealth {
            paused_until_ms: 6_000,
            ..RouteHealth::default()
        };
        let r = route(&situation(&none, paused, 2_000, 0));
        assert_eq!(refused_with(&r), Some(("upstream_paused", 4)), "{r:?}");
        assert_eq!(route(&situation(&none, paused, 6_001, 0)), Route::Primary);
        // A credential's pause refuses that credential only.
        let mut mine = situation(&none, RouteHealth::default(), 2_000, 0);
        mine.credential_paused_until_ms = 9_000;
        assert_eq!(refused_with(&route(&mine)), Some(("upstream_paused", 7)));
    }

    #[test]
    fn one_callers_failures_never_open_the_breaker() {
        let none = SidecarSeen::default();
        let mut u = RouteHealth::default();
        for i in 0..50 {
            u = fail(u, A, i);
        }
        assert_eq!(u.open_until_ms, 0);
        assert_eq!(route(&situation(&none, u, 100, 0)), Route::Primary);
        // A second caller's failure completes it.
        u = fail(u, B, 100);
        assert_eq!(u.open_until_ms, 60_100);
        assert!(matches!(
            refused_with(&route(&situation(&none, u, 101, 0))),
            Some(("upstream_unhealthy", 60))
        ));
    }

    #[test]
    fn failures_count_in_a_row_and_within_the_window() {
        let p = protection();
        let mut u = fail(fail(RouteHealth::default(), A, 0), B, 1);
        // A good answer resets the streak.
        u = u.observe(&p, 200, A, None, 2);
        u = fail(u, A, 3);
        assert_eq!((u.failures, u.open_until_ms), (1, 0));
        // Failures spread wider than the window do not add up.
        let mut u = fail(fail(RouteHealth::default(), A, 0), B, 1);
        u = fail(u, B, 60_002);
        assert_eq!((u.failures, u.open_until_ms), (1, 0));
        u = fail(fail(u, A, 60_003), B, 60_004);
        assert!(u.open_until_ms > 0);
        // min_callers 1 is the old behaviour: three in a row from anyone.
        let solo = Protection {
            min_callers: 1,
            ..p
        };
        let mut u = RouteHealth::default();
        for t in 0..3 {
            u = u.observe(&solo, 502, A, None, t);
        }
        assert_eq!(u.open_until_ms, 60_002);
    }

    #[test]
    fn the_distinct_caller_set_is_bounded() {
        let p = Protection {
            failures_to_open: 100,
            min_callers: MAX_CALLERS as u32,
            ..protection()
        };
        let mut u = RouteHealth::default();
        for c in 1..=50u32 {
            u = u.observe(&p, 500, c, None, u64::from(c));
        }
        assert_eq!(u.distinct_callers(), MAX_CALLERS as u32);
        assert_eq!(RouteHealth::decode(&u.encode()), u);
        assert_eq!(RouteHealth::decode(&[1, 2, 3]), RouteHealth::default());
    }

    #[test]
    fn probes_are_one_at_a_time_and_one_caller_cannot_keep_the_route_shut() {
        let store = crate::state::store::MemStore::default();
        let p = protection();
        let key = "sluice:v1:upstream/big";
        let opened = fail(fail(fail(RouteHealth::default(), A, 0), B, 1), A, 2);
        store.set(key, &opened.encode(), 0).unwrap();
        assert_eq!(
            claim_probe(&mut Cas::new(&store, 16), key, A, 1_000),
            None,
            "cooling down"
        );
        let lease = claim_probe(&mut Cas::new(&store, 16), key, A, 60_002).expect("probe");
        assert_eq!(
            claim_probe(&mut Cas::new(&store, 16), key, B, 60_003),
            None,
            "one at a time"
        );
        // A's probe fails: the route stays half-open, but A must wait.
        let pb = |caller| Pushback {
            route_key: key.into(),
            credential: None,
            credentials: Credentials::PassThrough,
            caller,
            record: RouteHealth::default(),
            credential_paused_until_ms: 0,
        };
        let failed = Answer {
            status: 500,
            pause_ms: None,
            lease: Some(lease),
            from_upstream: true,
        };
        let r = record(&mut Cas::new(&store, 16), &pb(A), &p, failed, 60_010);
        assert!(!r.breaker_opened);
        assert_eq!(
            claim_probe(&mut Cas::new(&store, 16), key, A, 60_011),
            None,
            "A is barred"
        );
        let none = SidecarSeen::default();
        let barred = read(&store, key).0;
        let mut s = situation(&none, barred, 60_011, 0);
        assert_eq!(refused_with(&route(&s)), Some(("upstream_unhealthy", 60)));
        s.caller = B;
        assert_eq!(route(&s), Route::Probe);
        // B's probe fails too: two callers agree, the breaker reopens, x2.
        let lease = claim_probe(&mut Cas::new(&store, 16), key, B, 60_020).expect("B probes");
        let r = record(
            &mut Cas::new(&store, 16),
            &pb(B),
            &p,
            Answer {
                lease: Some(lease),
                ..failed
            },
            60_030,
        );
        assert!(r.breaker_opened);
        let u = read(&store, key).0;
        assert_eq!((u.open_until_ms, u.cooldown_ms), (180_030, 120_000));
        // A good probe closes it.
        let lease =
            claim_probe(&mut Cas::new(&store, 16), key, A, 180_030).expect("A may probe again");
        let ok = Answer {
            status: 200,
            pause_ms: None,
            lease: Some(lease),
            from_upstream: true,
        };
        record(&mut Cas::new(&store, 16), &pb(A), &p, ok, 180_040);
        assert!(read(&store, key).0.is_blank());
    }

    #[test]
    fn only_the_upstreams_own_answers_close_the_breaker_or_pause() {
        let store = crate::state::store::MemStore::default();
        let p = protection();
        let key = "k";
        let open = RouteHealth {
            open_until_ms: 10,
            cooldown_ms: 10,
            ..RouteHealth::default()
        };
        store.set(key, &open.encode(), 0).unwrap();
        let pb = Pushback {
            route_key: key.into(),
            credential: None,
            credentials: Credentials::Injected,
            caller: A,
            record: RouteHealth::default(),
            credential_paused_until_ms: 0,
        };
        // Envoy itself answered the probe (a 413 after the claim, a later
        // filter's 429): the breaker stays open, the probe is free again,
        // and nobody is paused.
        let lease = claim_probe(&mut Cas::new(&store, 16), key, A, 20).unwrap();
        let local = Answer {
            status: 429,
            pause_ms: Some(60_000),
            lease: Some(lease),
            from_upstream: false,
        };
        let r = record(&mut Cas::new(&store, 16), &pb, &p, local, 21);
        assert_eq!(r.paused, None);
        let u = read(&store, key).0;
        assert_eq!(
            (u.open_until_ms, u.probe_until_ms, u.paused_until_ms),
            (10, 0, 0)
        );
        // Envoy's 503 for an upstream it cannot reach is a failure.
        let lease = claim_probe(&mut Cas::new(&store, 16), key, A, 22).unwrap();
        let unreachable = Answer {
            status: 503,
            pause_ms: None,
            ..local
        };
        record(
            &mut Cas::new(&store, 16),
            &pb,
            &p,
            Answer {
                lease: Some(lease),
                ..unreachable
            },
            23,
        );
        assert_eq!(read(&store, key).0.barred, A);
    }

    #[test]
    fn a_probe_given_back_or_expired_frees_the_route() {
        let store = crate::state::store::MemStore::default();
        let key = "k";
        let open = RouteHealth {
            open_until_ms: 10,
            cooldown_ms: 10,
            ..RouteHealth::default()
        };
        store.set(key, &open.encode(), 0).unwrap();
        let lease = claim_probe(&mut Cas::new(&store, 16), key, A, 20).unwrap();
        assert!(release_probe(&mut Cas::new(&store, 16), key, lease));
        let second = claim_probe(&mut Cas::new(&store, 16), key, B, 21).unwrap();
        // The first claim's late answer cannot end the second's lease.
        assert!(release_probe(&mut Cas::new(&store, 16), key, lease));
        assert_eq!(read(&store, key).0.probe_until_ms, second);
        // A lease that ran out lets the next request probe.
        assert!(claim_probe(&mut Cas::new(&store, 16), key, A, second + 1).is_some());
    }

    #[test]
    fn a_429_pauses_the_credential_on_pass_through_routes_and_the_route_when_injected() {
        let p = protection();
        let store = crate::state::store::MemStore::default();
        let mine = Pushback {
            route_key: "r".into(),
            credential: Some(("sluice:v1:pause/7".into(), 0xAAAA)),
            credentials: Credentials::PassThrough,
            caller: A,
            record: RouteHealth::default(),
            credential_paused_until_ms: 0,
        };
        let answer = Answer {
            status: 429,
            pause_ms: pause_ms(3_600_000, &p, 0),
            lease: None,
            from_upstream: true,
        };
        let r = record(&mut Cas::new(&store, 16), &mine, &p, answer, 1_000);
        assert_eq!(r.paused, Some(PauseScope::Credential));
        let u = read(&store, "r").0;
        assert_eq!(u.paused_until_ms, 0, "the route is not paused");
        assert_eq!(u.credential_pauses_until_ms, 301_000, "capped at 5 min");
        let slot = CredentialPause::decode(&store.get("sluice:v1:pause/7").unwrap().0);
        assert_eq!(slot.until_for(0xAAAA, 2_000), 301_000);
        // Another credential in the same slot is not paused by it.
        assert_eq!(slot.until_for(0xBBBB, 2_000), 0);
        // Injected: everyone shares the credential, so the route pauses.
        let shared = Pushback {
            route_key: "s".into(),
            credential: None,
            credentials: Credentials::Injected,
            ..mine.clone()
        };
        let r = record(&mut Cas::new(&store, 16), &shared, &p, answer, 1_000);
        assert_eq!(r.paused, Some(PauseScope::Route));
        assert_eq!(read(&store, "s").0.paused_until_ms, 301_000);
        // A 503 speaks for the upstream: the route, whatever the credential.
        let r = record(
            &mut Cas::new(&store, 16),
            &mine,
            &p,
            Answer {
                status: 503,
                ..answer
            },
            1_000,
        );
        assert_eq!(r.paused, Some(PauseScope::Route));
        // A 429 without Retry-After pauses nothing.
        let quiet = Pushback {
            route_key: "q".into(),
            ..mine
        };
        let r = record(
            &mut Cas::new(&store, 16),
            &quiet,
            &p,
            Answer {
                pause_ms: None,
                ..answer
            },
            1_000,
        );
        assert_eq!(r.paused, None);
        assert!(read(&store, "q").0.is_blank());
    }

    #[test]
    fn pauses_are_capped_jittered_and_can_be_turned_off() {
        let p = Protection {
            max_jitter_ms: 1_000,
            ..protection()
        };
        assert_eq!(pause_ms(5_000, &p, 0), Some(5_000));
        assert_eq!(pause_ms(5_000, &p, 500), Some(5_500));
        assert_eq!(pause_ms(u64::MAX, &p, 999), Some(300_999));
        let off = Protection {
            max_pause_ms: 0,
            ..p
        };
        assert_eq!(pause_ms(5_000, &off, 0), None);
    }

    #[test]
    fn retry_after_reads_every_form_without_overflow() {
        let now = 1_445_412_480_000; // Wed, 21 Oct 2015 07:28:00 GMT
        assert_eq!(parse_retry_after(" 5 ", now), Some(5_000));
        assert_eq!(parse_retry_after("0", now), Some(0));
        assert_eq!(parse_retry_after("3600", now), Some(3_600_000));
        assert_eq!(
            parse_retry_after("18446744073709551615", now),
            Some(u64::MAX)
        );
        assert_eq!(
            parse_retry_after("99999999999999999999999999999999", now),
            Some(u64::MAX)
        );
        for date in [
            "Wed, 21 Oct 2015 07:28:30 GMT",
            "Wednesday, 21-Oct-15 07:28:30 GMT",
            "Wed Oct 21 07:28:30 2015",
        ] {
            assert_eq!(parse_retry_after(date, now), Some(30_000), "{date}");
        }
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:00:00 GMT", now),
            Some(0),
            "a date in the past"
        );
        for bad in [
            "",
            "-5",
            "1.5",
            "5s",
            "soon",
            "+3",
            "Wed, 32 Oct 2015 07:28:00 GMT",
        ] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
        // The last representable dates parse (no panic in the VM).
        for edge in [
            "Fri, 31 Dec 9999 23:59:59 GMT",
            "Mon, 31 Feb 9999 23:59:59 GMT",
            "Fri Dec 31 23:59:59 9999",
        ] {
            let _ = parse_retry_after(edge, now);
            let _ = parse_retry_after(edge, 0);
            let _ = parse_retry_after(edge, u64::MAX);
        }
    }

    proptest::proptest! {
        #[test]
        fn retry_after_never_panics(value in "\\PC{0,40}", now in proptest::num::u64::ANY) {
            let _ = parse_retry_after(&value, now);
        }

        #[test]
        fn date_shaped_retry_after_never_panics(
            day in 0u32..40, month in 0usize..13, year in 0u32..10000,
            h in 0u32..30, m in 0u32..70, sec in 0u32..70,
        ) {
            const MONTHS: [&str; 13] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul",
                                        "Aug", "Sep", "Oct", "Nov", "Dec", "Foo"];
            let mon = MONTHS[month];
            let v = format!("Sun, {day:02} {mon} {year:04} {h:02}:{m:02}:{sec:02} GMT");
            let _ = parse_retry_after(&v, 0);
            let yy = year % 100;
            let v = format!("Sunday, {day:02}-{mon}-{yy:02} {h:02}:{m:02}:{sec:02} GMT");
            let _ = parse_retry_after(&v, 0);
        }
    }

    #[test]
    fn a_held_poll_is_answered_well_within_stale_after() {
        // Defaults: 30 s poll, 60 s staleness.
        assert_eq!(poll_wait_s(30_000, 60_000), 30);
        // A short staleness window shortens the poll instead of going stale
        // while the sidecar is healthy and quiet.
        assert_eq!(poll_wait_s(30_000, 2_000), 1);
        assert_eq!(poll_wait_s(30_000, 10_000), 5);
        assert_eq!(poll_wait_s(500, 60_000), 1);
        for stale_after in [2_000, 3_000, 10_000, 61_000] {
            assert!(poll_wait_s(30_000, stale_after) * 1000 * 2 <= stale_after);
        }
    }

    #[test]
    fn prompts_normalize() {
        assert_eq!(normalize_prompt("  What is   sluice?! "), "what is sluice");
    }
}
