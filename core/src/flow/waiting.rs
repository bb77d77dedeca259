//! The request path's side of the concurrency gate ([`crate::queue`]; the
//! root's side is `wakes`):
//! which class a caller is in, taking a slot or a place in the queue when
//! the request is decided, resuming it from the root context when its
//! turn comes (a wake-up message, or the tick as a safety net), answering
//! `queue_deadline`, and giving the slot back exactly once.
//!
//! Each VM keeps its queued streams in one map (ticket → stream) that all
//! its root contexts share (`flow::Vm`).
//! A slot freed on any worker is handed to the next entry in the shared
//! queue and a message with its ticket goes to the owner's wake-up queue
//! (one per VM: a shared queue only wakes the VM that registered it last).
//! The owner resumes the stream with `set_effective_context` and
//! `resume_http_request`. Who gives a granted slot back: the stream
//! (response end or log) once it was resumed; `on_log` when the client
//! left first (its withdrawal finds the entry gone, so it owns the slot).
//!
//! Before a request takes a place, its buckets are peeked
//! ([`crate::admission::Engine::would_admit`], nothing reserved): a caller
//! they would refuse at dispatch is refused at once, or sleeps (holding no
//! place) for as long as its bucket says when that is within its wait.
//! When its turn comes it is routed again, as a new request would be now
//! (kill switch, breakers, pauses): a queued request never goes to a
//! primary that new requests no longer go to.
//!
//! Reload: the gate of every stream of the VM follows the policy loaded
//! last ([`Filter::latest`]); its root tends the VM's waiters, its limits
//! pump the queue at once, and the slots of requests in flight are given
//! back to it, so the new limits govern what waits and what is in flight.
//! Slots live in shared data only (one count per model), so nothing is
//! counted twice.

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};

use super::{Filter, Phase, Request, Stream};
use crate::admission::answer::{Reason, Refused};
use crate::admission::identity::{Identity, RequestView};
use crate::admission::route::{Pushback, SidecarSeen};
use crate::admission::{Asked, RequestContext, Routed, Verdict};
use crate::flow::HostRequest;
use crate::host::metrics;
use crate::host::{Action, Host};
use crate::policy::IdentitySource;
use crate::queue::{self, Blocked, Entered, State};

/// Tick period while a policy has gates: deadlines are kept within it.
pub const QUEUE_TICK_MS: u64 = 20;

/// An idle worker's ticks between two publishes of the gauges (1 s).
pub(super) const IDLE_PUBLISH_TICKS: u32 = 50;
/// The header by which a client asks to wait less than its class would.
pub const MAX_WAIT_HEADER: &str = "x-sluice-max-wait-ms";

/// A queued stream of this VM.
pub struct Waiter {
    pub(super) stream: Weak<RefCell<Stream>>,
    pub(super) context_id: u32,
    pub(super) backend: String,
    pub(super) deadline_ms: u64,
    /// Not in the shared queue: waiting for a bucket until `deadline_ms`,
    /// then it tries the gate again.
    pub(super) sleeping: bool,
}

/// Tickets of sleepers (local to a VM), apart from the shared queue's.
pub(super) const SLEEPER: u64 = 1 << 63;

/// A request's hold on the gate.
#[derive(Debug, Clone)]
pub struct GateState {
    pub(super) backend: String,
    pub(super) model: String,
    /// The class label (`none` without a class).
    pub(super) class: String,
    pub(super) arrived_ms: u64,
    /// In the queue under this ticket.
    pub(super) ticket: Option<u64>,
    /// Holds a concurrency slot.
    pub(super) slot: bool,
    pub waited_ms: u64,
    /// The longest it may wait in all, from `arrived_ms` (0: no waiting).
    pub(super) wait_ms: u64,
    /// Sleeping for a bucket under this local ticket.
    pub(super) sleeper: Option<u64>,
}

impl GateState {
    /// A hold on `model`'s gate of `backend`, taken at `arrived_ms`:
    /// neither a slot nor a place yet.
    fn new(backend: &str, model: &str, class: String, arrived_ms: u64) -> GateState {
        GateState {
            backend: backend.to_string(),
            model: model.to_string(),
            class,
            arrived_ms,
            ticket: None,
            slot: false,
            waited_ms: 0,
            wait_ms: 0,
            sleeper: None,
        }
    }
}

/// The group of the model's shares the caller draws from.
fn share_group(group: &queue::Group, model: &str, identity: &Identity) -> u64 {
    group
        .shares
        .get(model)
        .map_or(crate::limits::shares::REST, |t| {
            t.group_of(&identity.tier, identity.declared)
        })
}

/// A gate's refusal, as the gate's outcome.
fn gate_refused(
    engine: &crate::admission::Engine,
    refused: Refused,
    identity: &Identity,
    model: &str,
) -> (Gated, Option<GateState>) {
    let verdict = engine.refuse(refused, &identity.tier, Some(model));
    (Gated::Answered(Box::new(verdict)), None)
}

/// What a queued request needs to be admitted when its turn comes.
pub struct Parked {
    pub asked: Option<Asked>,
    pub body_len: usize,
    /// Its body counted against the VM's `request.max_waiting_body_bytes`
    /// while it waits (`None`: not waiting yet).
    pub hold: Option<BodyHold>,
}

/// A waiting request's body bytes, counted in its VM's total until the
/// request stops waiting (dispatched, refused, or gone: dropped).
pub struct BodyHold {
    total: Rc<Cell<u64>>,
    bytes: u64,
}

impl BodyHold {
    /// Counts `bytes` more in `total`, if that stays within `max`.
    pub fn take(total: &Rc<Cell<u64>>, bytes: usize, max: u64) -> Option<BodyHold> {
        let bytes = bytes as u64;
        let now = total.get().checked_add(bytes).filter(|&n| n <= max)?;
        total.set(now);
        Some(BodyHold {
            total: total.clone(),
            bytes,
        })
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.total.set(self.total.get().saturating_sub(self.bytes));
    }
}

pub enum Gated {
    Go,
    Wait,
    /// Its buckets would refuse it now but free up within its wait: it
    /// sleeps until then (ms), holding no place.
    Sleep(u64),
    Answered(Box<Verdict>),
}

/// `outcome`: dispatched (reason immediate|queued), rejected (model_concurrency,
/// queue_full, gpu_overloaded, upstream_paused, or the reason of the bucket
/// the peek found empty), expired, evicted (queue_full), rerouted
/// (fallback), abandoned, deferred.
pub(super) fn count(host: &dyn Host, outcome: &str, reason: &str, g: &GateState) {
    metrics::QUEUE_OUTCOMES.add_at(host, &[outcome, reason, &g.model, &g.class], 1);
}

/// Gauges from the state just written: every gated model and class of the
/// backend (a bounded set), so a gauge that went to 0 says so. Workers
/// write the same gauge, and one that wrote an older state may record it
/// after another recorded a newer one: the tick publishes the state again
/// (each tick on a worker with waiters, every `IDLE_PUBLISH_TICKS`
/// otherwise), so a gauge is never stale for longer than that.
pub(super) fn publish(filter: &Filter, host: &dyn Host, backend: &str, state: &State) {
    let Some(group) = filter.gates.group(backend) else {
        return;
    };
    for model in group.model_limits.keys() {
        let inflight = u64::from(state.inflight(model));
        metrics::INFLIGHT.record_at(host, &[model], inflight);
        for class in class_labels(filter) {
            let depth = state.depth(model, &class) as u64;
            metrics::QUEUE_DEPTH.record_at(host, &[model, &class], depth);
        }
    }
}

pub(super) fn class_labels(filter: &Filter) -> Vec<String> {
    let mut labels: Vec<String> = filter.engine.policy.classes.keys().cloned().collect();
    labels.push("none".into());
    labels
}

/// The caller's class: a verified claim or a trusted header when the
/// policy names one and the identity came from there, else its tier's,
/// else `default_class`. Never from a header the policy does not trust.
pub(super) fn class_of(
    filter: &Filter,
    identity: &Identity,
    view: &dyn RequestView,
) -> Option<String> {
    let policy = &filter.engine.policy;
    let known = |c: String| policy.classes.contains_key(&c).then_some(c);
    let named = match identity.source {
        Some(IdentitySource::Jwt) => policy.identity.jwt.as_ref().and_then(|jwt| {
            let claim = jwt.class_claim.as_ref()?;
            view.jwt_claim(&jwt.metadata_namespace, &jwt.payload_key, claim)
        }),
        Some(IdentitySource::TrustedHeader) => policy
            .identity
            .trusted_header
            .as_ref()
            .and_then(|h| view.header(h.class.as_ref()?))
            .map(std::borrow::Cow::into_owned),
        _ => None,
    };
    named
        .and_then(known)
        .or_else(|| policy.tiers.get(&identity.tier)?.class.clone())
        .or_else(|| policy.default_class.clone())
}

/// `x-sluice-max-wait-ms`: a whole number of milliseconds; `Err`: not one.
pub(super) fn asked_wait(view: &dyn RequestView) -> Result<Option<u64>, ()> {
    match view.header(MAX_WAIT_HEADER) {
        None => Ok(None),
        Some(v) => {
            let v = v.trim();
            if v.is_empty() || v.len() > 12 || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(());
            }
            v.parse().map(Some).map_err(|_| ())
        }
    }
}

impl Stream {
    /// The concurrency gate, once the route is the primary upstream.
    /// Returns the gate state the stream keeps (`None`: ungated).
    /// `since`: when the request arrived (it may have waited already).
    /// `asked`: its parsed body, for the peek at its buckets before it
    /// takes a place.
    pub(super) fn pass_gate(
        &self,
        host: &dyn Host,
        identity: &Identity,
        asked: Option<&Asked>,
        since: u64,
        now: u64,
    ) -> (Gated, Option<GateState>) {
        let Some(model) = asked.and_then(|a| a.demand.model.as_deref()) else {
            return (Gated::Go, None);
        };
        // The gates (limits, classes, queue) of the VM's latest policy.
        let filter = self.filter.latest();
        let Some((backend, group)) = filter.gates.group_of(model) else {
            return (Gated::Go, None);
        };
        let engine = &filter.engine;
        let view = HostRequest(host, self.request_headers.as_ref());
        let Ok(asked_wait) = asked_wait(&view) else {
            let refused = Refused::rejected(
                Reason::InvalidRequest,
                "x-sluice-max-wait-ms must be a whole number of milliseconds.",
                Some(MAX_WAIT_HEADER),
            );
            return gate_refused(engine, refused, identity, model);
        };
        let class = class_of(&filter, identity, &view);
        let class_cfg = class.as_ref().and_then(|c| engine.policy.classes.get(c));
        let wake = filter.wake_queue.get();
        let queues = class_cfg.filter(|c| c.queue && wake.is_some());
        let (wait_ms, wait) = class_wait(queues, asked_wait, now.saturating_sub(since));
        let class_label = class.clone().unwrap_or_else(|| "none".into());
        let arrival = queue::Arrival {
            model,
            class: &class_label,
            wait,
            max_per_principal: class_cfg.map_or(0, |c| c.principal_cap()),
            principal: identity.hash,
            group: share_group(group, model, identity),
            wake: wake.unwrap_or(0),
            saturated: filter.saturated(host, model, backend, now),
            now_ms: now,
        };
        let ctx = RequestContext {
            identity,
            api: self.api,
            path: &self.path,
            asked,
            now_ms: now,
        };
        let (entered, declined) =
            self.enter_peeking(host, &filter, (backend, group), &arrival, &ctx);
        let mut gate = GateState {
            waited_ms: now.saturating_sub(since),
            wait_ms,
            ..GateState::new(backend, model, class_label, since)
        };
        match entered {
            Entered::Go => {
                gate.slot = true;
                count(host, "dispatched", "immediate", &gate);
                metrics::QUEUE_WAIT_MS.record_at(host, &[&gate.model, &gate.class], 0);
                (Gated::Go, Some(gate))
            }
            Entered::Queued {
                ticket,
                deadline_ms,
            } => {
                gate.ticket = Some(ticket);
                self.add_waiter(&filter, ticket, backend, deadline_ms, false);
                (Gated::Wait, Some(gate))
            }
            Entered::Declined => declined_gate(host, declined, gate, now),
            refused => {
                let refused = gate_refusal(engine, &refused, model, now);
                count(host, "rejected", refused.reason().code(), &gate);
                gate_refused(engine, refused, identity, model)
            }
        }
    }

    /// Enters the model's queue, peeking first at the request's buckets:
    /// would they let it through? (Its own engine's buckets: they admit it
    /// at dispatch.) What the queue said, and the peek's refusal if any.
    pub(super) fn enter_peeking(
        &self,
        host: &dyn Host,
        filter: &Filter,
        (backend, group): (&str, &queue::Group),
        arrival: &queue::Arrival,
        ctx: &RequestContext,
    ) -> (Entered, Option<Verdict>) {
        let mut declined: Option<Verdict> = None;
        // The peek runs inside the queue's compare-and-swap: a retry that
        // finds the caller holding as many places reuses the first answer
        // instead of reading every bucket again.
        let mut peeked: Option<u32> = None;
        let mut may_wait = |queued: u32| {
            if peeked != Some(queued) {
                declined = self.filter.engine.would_admit(host, ctx, u64::from(queued));
                peeked = Some(queued);
            }
            declined.is_none()
        };
        let changed = queue::enter_checked(host, group, filter.tries(), arrival, &mut may_wait);
        filter.applied(host, backend, &changed);
        (changed.value, declined)
    }

    /// This stream waits under `ticket` until its wake-up or `deadline_ms`:
    /// queued for the model's gate, or `sleeping` until its buckets refill.
    pub(super) fn add_waiter(
        &self,
        filter: &Filter,
        ticket: u64,
        backend: &str,
        deadline_ms: u64,
        sleeping: bool,
    ) {
        if let Ok(mut waiters) = filter.waiters.try_borrow_mut() {
            waiters.insert(
                ticket,
                Waiter {
                    stream: self.me.clone(),
                    context_id: self.context_id,
                    backend: backend.to_string(),
                    deadline_ms,
                    sleeping,
                },
            );
        }
    }

    /// The route is paused (upstream 503/429 with `Retry-After`, for the
    /// whole route, never one credential's pause): the pause is written
    /// into the model's queue so the gate decides — wait until it ends
    /// (a class that may wait that long), or the same 503 as before.
    /// `false`: not a route pause, or the model has no gate.
    pub(super) fn pause_gate(
        &self,
        host: &dyn Host,
        verdict: &Verdict,
        pushback: &Pushback,
        model: Option<&str>,
        now: u64,
    ) -> bool {
        let until = pushback.record.paused_until_ms;
        let paused = verdict.labels().decision
            == crate::admission::answer::Decision::Refuse(Reason::UpstreamPaused);
        if !paused || until <= now || pushback.credential_paused_until_ms > now {
            return false;
        }
        let filter = self.filter.latest();
        let Some((backend, group)) = model.and_then(|m| filter.gates.group_of(m)) else {
            return false;
        };
        let Some(model) = model else { return false };
        let changed = queue::pause(host, group, filter.tries(), model, until);
        filter.applied(host, backend, &changed);
        true
    }

    /// Counts a request's body against its VM's bound on waiting bodies
    /// (once: a request that waited already holds its count). `false`:
    /// the VM holds too many waiting bodies to keep this one too.
    pub(super) fn hold_body(&self, hold: &mut Option<BodyHold>, body_len: usize) -> bool {
        if hold.is_none() {
            let max = self.filter.engine.policy.request.max_waiting_body_bytes;
            *hold = BodyHold::take(&self.filter.vm.waiting_bytes, body_len, max);
        }
        hold.is_some()
    }

    /// 429 `queue_full`: the request would have to wait, and its VM
    /// already holds `request.max_waiting_body_bytes` of waiting bodies.
    pub(super) fn refuse_waiting_body(
        &mut self,
        host: &dyn Host,
        identity: &Identity,
        model: Option<&str>,
    ) -> Action {
        let message = "Too many large requests are waiting here: this one's body cannot be held \
                       until its turn. Try again in 1 s.";
        let refused = Refused::retry_later(Reason::QueueFull, message, 1);
        let verdict = self.filter.engine.refuse(refused, &identity.tier, model);
        self.finish(host, verdict)
    }

    /// Routed to the fallback: a slot of the primary it held goes to the
    /// next waiter, and a request that was gated counts as rerouted.
    pub(super) fn leave_for_fallback(&mut self, host: &dyn Host) {
        self.release_slot(host);
        if let Some(g) = self.gate.as_ref() {
            count(host, "rerouted", "fallback", g);
        }
    }

    /// What routing reads, as of now: the route's pushback, the sidecar's
    /// state, a dice for the half-open trickle.
    pub(super) fn world(
        &self,
        host: &dyn Host,
        identity: &Identity,
        model: Option<&str>,
        now: u64,
    ) -> (Pushback, Rc<SidecarSeen>, u32) {
        let engine = &self.filter.engine;
        let view = HostRequest(host, self.request_headers.as_ref());
        let pushback = engine.pushback(host, model, &view, identity, now);
        let seen = if engine.policy.sidecar.is_some() {
            self.filter.seen(host)
        } else {
            Rc::new(SidecarSeen::default())
        };
        (pushback, seen, self.filter.roll(now))
    }

    /// A waiting request whose primary new requests no longer go to (kill
    /// switch, an open breaker): it should leave the queue now rather
    /// than wait for a slot it will not use.
    pub(super) fn off_primary(&self, host: &dyn Host) -> bool {
        let (Some(identity), Phase::Parked(parked)) = (self.identity.as_ref(), &self.phase) else {
            return false;
        };
        let now = host.now_ms();
        let ctx = RequestContext {
            identity,
            api: self.api,
            path: &self.path,
            asked: parked.asked.as_ref(),
            now_ms: now,
        };
        let model = ctx.asked.and_then(|a| a.demand.model.as_deref());
        let (pushback, seen, dice) = self.world(host, identity, model, now);
        match self.filter.engine.route(&ctx, &seen, &pushback, dice) {
            Routed::Rung(_) => true,
            // An upstream pause is the queue's to wait out; other answers
            // (open breaker, static) are what a new request gets.
            Routed::Answered(v) => {
                v.labels().decision
                    != crate::admission::answer::Decision::Refuse(Reason::UpstreamPaused)
            }
            Routed::Primary | Routed::Probe => false,
        }
    }

    /// A 429 of a bucket whose `Retry-After` ends within the request's
    /// wait: how long to sleep before trying again.
    pub(super) fn bucket_wait(&self, verdict: &Verdict, now: u64) -> Option<u64> {
        let g = self.gate.as_ref()?;
        let retry_ms = bucket_retry_ms(verdict)?;
        let deadline = g.arrived_ms.saturating_add(g.wait_ms);
        (g.wait_ms > 0
            && now.saturating_add(retry_ms) < deadline
            && self.filter.latest().wake_queue.get().is_some())
        .then_some(retry_ms)
    }
}

/// The `Retry-After` (ms) of a bucket's 429: how long until it would let
/// the request through.
pub(super) fn bucket_retry_ms(verdict: &Verdict) -> Option<u64> {
    verdict.bucket_retry_ms()
}

impl Request {
    pub(super) fn wrap(stream: Stream, context_id: u32) -> Request {
        let stream = Rc::new(RefCell::new(stream));
        if let Ok(mut s) = stream.try_borrow_mut() {
            s.context_id = context_id;
            s.me = Rc::downgrade(&stream);
        }
        Request { stream }
    }
}

/// How long a request of a queueing class may wait in all (`0`: a class
/// that does not queue), at most what the client asked; and, while some of
/// that is left after `waited`, how much, in a queue how deep.
pub(super) fn class_wait(
    queues: Option<&crate::policy::queue::ClassConfig>,
    asked_wait: Option<u64>,
    waited: u64,
) -> (u64, Option<(u64, u32)>) {
    let wait = queues.map(|c| {
        (
            c.max_wait_ms.min(asked_wait.unwrap_or(u64::MAX)),
            c.max_depth,
        )
    });
    let wait_ms = wait.map_or(0, |(w, _)| w);
    let left = wait
        .map(|(w, depth)| (w.saturating_sub(waited), depth))
        .filter(|(w, _)| *w > 0);
    (wait_ms, left)
}

/// The peek said its buckets would refuse it: it sleeps until they free up
/// when that is within its wait, else it gets their refusal now.
pub(super) fn declined_gate(
    host: &dyn Host,
    declined: Option<Verdict>,
    gate: GateState,
    now: u64,
) -> (Gated, Option<GateState>) {
    let Some(verdict) = declined else {
        // Declined without a verdict cannot happen; go to admission,
        // which decides for itself.
        return (Gated::Go, None);
    };
    let deadline = gate.arrived_ms.saturating_add(gate.wait_ms);
    let sleep = bucket_retry_ms(&verdict)
        .filter(|retry| gate.wait_ms > 0 && now.saturating_add(*retry) < deadline);
    if let Some(retry) = sleep {
        return (Gated::Sleep(now.saturating_add(retry)), Some(gate));
    }
    count(
        host,
        "rejected",
        verdict.labels().decision.reason_code(),
        &gate,
    );
    (Gated::Answered(Box::new(verdict)), None)
}

/// The refusal of a request the queue neither let through nor took in:
/// its class's queue full, the backend saturated or paused by the
/// provider, or no slot (every other outcome: `Refused(Free | Slot)`,
/// `Contended`).
pub(super) fn gate_refusal(
    engine: &crate::admission::Engine,
    entered: &Entered,
    model: &str,
    now: u64,
) -> Refused {
    match entered {
        Entered::Full => Refused::retry_later(
            Reason::QueueFull,
            format!("Too many requests of your class are waiting for {model}. Try again in 1 s."),
            1,
        ),
        Entered::Refused(Blocked::Saturated) => Refused::unavailable(
            Reason::GpuOverloaded,
            "the backend is saturated",
            engine
                .policy
                .sidecar
                .as_ref()
                .map_or(1, |s| (s.retry_after_ms / 1000).max(1)),
        ),
        Entered::Refused(Blocked::Paused(until)) => Refused::unavailable(
            Reason::UpstreamPaused,
            "the provider has no capacity left until its limit resets",
            until.saturating_sub(now).div_ceil(1000).max(1),
        ),
        _ => Refused::retry_later(
            Reason::ModelConcurrency,
            format!("{model} is serving as many requests as it may at once. Try again in 1 s."),
            1,
        ),
    }
}

#[cfg(test)]
pub(super) mod tests;
