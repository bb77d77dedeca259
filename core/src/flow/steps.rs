//! The decision's steps, in order, and the one driver that runs them:
//! route → the model's gate → admit → a bucket wait → the probe's claim
//! → on to the upstream (`send_on`: rerouted or watched, rewritten,
//! through the fleet's gate, sent).
//!
//! Each step returns what comes next: another step, a pause (a place in
//! the queue, or a sleep until a bucket frees up), or an answer. A request
//! that paused is resumed by naming a step: the queue's dispatch and a
//! sleep's wake resume it at [`Step::Route`] (its turn is routed again, as
//! a new request would be now), the same driver a request runs as it
//! arrives — so the decision's tail exists once.

use std::rc::Rc;

use super::phase::{Phase, Watch};
use super::waiting::{Gated, Parked};
use super::{admit_down_the_ladder, Stream};
use crate::admission::identity::Identity;
use crate::admission::ladder::Served;
use crate::admission::route::{Pushback, SidecarSeen};
use crate::admission::{Asked, Engine, RequestContext, Routed, Verdict};
use crate::host::{Action, Host};
use crate::usage::demand::Api;

#[cfg(test)]
use super::CONCLUDED;

/// A step of the decision; the ones after admission carry its verdict.
// Unboxed: a step is moved from one to the next, and boxing the verdict
// would add an allocation to every request.
#[allow(clippy::large_enum_variant)]
pub(super) enum Step {
    /// Where the request may go (the primary, a rung, the probe, or
    /// answered: a 503 or the static answer).
    Route,
    /// The model's concurrency gate: a slot, a place in the queue, a
    /// sleep, or a refusal.
    Gate,
    /// The buckets reserved (down the ladder's rungs).
    Admit,
    /// A bucket's 429 that frees up within the caller's wait: it sleeps
    /// instead.
    BucketWait(Verdict),
    /// The half-open probe claimed, by an admitted request only.
    Probe(Verdict),
    /// On to the upstream: rerouted or watched, rewritten, through the
    /// fleet's gate.
    Send(Verdict),
}

/// What a step says comes next.
enum Next {
    Go(Step),
    /// Wait in the model's queue (its dispatch resumes at `Step::Route`).
    Park,
    /// Sleep until then (its wake resumes at `Step::Route`).
    Sleep(u64),
    /// Answer here.
    Answer(Verdict),
    /// The step answered already (with its own bookkeeping).
    Done(Action),
}

/// The decision in progress, carried from step to step.
pub(super) struct Deciding {
    identity: Rc<Identity>,
    parked: Parked,
    /// Every decision of the request is made as of then.
    now: u64,
    path: Rc<str>,
    /// The route's state as the request found it, and the sidecar's.
    pushback: Pushback,
    seen: Rc<SidecarSeen>,
    dice: u32,
    /// The rung of the ladder it goes to (`None`: the primary).
    rung: Option<Box<Served>>,
    /// Routed as the half-open probe; the probe's lease once claimed.
    probe: bool,
    probe_lease: Option<u64>,
}

impl Deciding {
    fn ctx(&self, api: Api) -> RequestContext<'_> {
        RequestContext {
            identity: &self.identity,
            api,
            path: &self.path,
            asked: self.parked.asked.as_ref(),
            now_ms: self.now,
        }
    }
}

/// The model a request counts against: the body's, else a passthrough
/// rule's.
fn model_of<'a>(asked: Option<&'a Asked>, engine: &'a Engine, api: Api) -> Option<&'a str> {
    asked
        .and_then(|a| a.demand.model.as_deref())
        .or(engine.passthrough_model(api))
}

impl Stream {
    /// Runs the decision from `from` (a request as it arrives and one
    /// resumed from the queue or a sleep both start at [`Step::Route`]).
    pub(super) fn run_steps(
        &mut self,
        host: &dyn Host,
        from: Step,
        identity: Rc<Identity>,
        parked: Parked,
        now: u64,
    ) -> Action {
        #[cfg(test)]
        CONCLUDED.with(|c| c.set(c.get() + 1));
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let model = model_of(parked.asked.as_ref(), engine, self.api);
        let (pushback, seen, dice) = self.world(host, &identity, model, now);
        let decision = Deciding {
            identity,
            parked,
            now,
            path: self.path.clone(),
            pushback,
            seen,
            dice,
            rung: None,
            probe: false,
            probe_lease: None,
        };
        self.drive(host, engine, from, decision)
    }

    /// The driver: each step in turn until one pauses or answers.
    fn drive(&mut self, host: &dyn Host, engine: &Engine, from: Step, mut d: Deciding) -> Action {
        let mut step = from;
        loop {
            let next = match step {
                Step::Route => self.route_step(host, engine, &mut d),
                Step::Gate => self.gate_step(host, engine, &mut d),
                Step::Admit => self.admit_step(host, engine, &mut d),
                Step::BucketWait(verdict) => self.bucket_wait_step(&mut d, verdict),
                Step::Probe(verdict) => self.probe_step(host, engine, &mut d, verdict),
                Step::Send(verdict) => return self.send_step(host, d, verdict),
            };
            step = match next {
                Next::Go(step) => step,
                Next::Answer(verdict) => return self.finish(host, verdict),
                Next::Park => {
                    self.phase = Phase::Parked(d.parked);
                    return Action::Pause;
                }
                Next::Sleep(until) => {
                    self.phase = Phase::Parked(d.parked);
                    return self.sleep(host, until);
                }
                Next::Done(action) => return action,
            };
        }
    }

    fn route_step(&mut self, host: &dyn Host, engine: &Engine, d: &mut Deciding) -> Next {
        let routed = engine.route(&d.ctx(self.api), &d.seen, &d.pushback, d.dice);
        let model = model_of(d.parked.asked.as_ref(), engine, self.api);
        match routed {
            // A route paused by the upstream's Retry-After: a caller whose
            // class may wait that long waits the pause out in the model's
            // queue (a slot it held goes to the next waiter meanwhile).
            Routed::Answered(verdict)
                if self.pause_gate(host, &verdict, &d.pushback, model, d.now) =>
            {
                self.release_slot(host);
                Next::Go(Step::Gate)
            }
            // A 503 or the static answer (a slot it held is given back
            // as the answer goes).
            Routed::Answered(verdict) => Next::Answer(*verdict),
            Routed::Rung(served) => {
                // A queued request's slot of the primary goes to the next
                // waiter.
                self.leave_for_fallback(host);
                d.rung = Some(served);
                Next::Go(Step::Admit)
            }
            // The model's concurrency gate, unless its turn in the queue
            // already gave it a slot.
            Routed::Primary if self.gate.as_ref().is_some_and(|g| g.slot) => Next::Go(Step::Admit),
            Routed::Primary => Next::Go(Step::Gate),
            // The half-open probe is one request: it takes no slot.
            Routed::Probe => {
                d.probe = true;
                Next::Go(Step::Admit)
            }
        }
    }

    fn gate_step(&mut self, host: &dyn Host, engine: &Engine, d: &mut Deciding) -> Next {
        // Its body must fit the VM's bound on waiting bodies, should it
        // wait: else 429 `queue_full` before it takes a place.
        if !self.hold_body(&mut d.parked.hold, d.parked.body_len) {
            let model = model_of(d.parked.asked.as_ref(), engine, self.api);
            return Next::Done(self.refuse_waiting_body(host, &d.identity, model));
        }
        // A slot, a place in the queue (budgets are reserved when its
        // turn comes), or a refusal; a request that waited already waits
        // at most what is left of its class's wait.
        let since = self.gate.as_ref().map_or(d.now, |g| g.arrived_ms);
        let asked = d.parked.asked.as_ref();
        let (gated, gate) = self.pass_gate(host, &d.identity, asked, since, d.now);
        self.gate = gate;
        match gated {
            Gated::Go => Next::Go(Step::Admit),
            Gated::Answered(verdict) => Next::Answer(*verdict),
            Gated::Wait => Next::Park,
            // Its buckets free up within its wait: it sleeps, holding no
            // place, then tries the gate again.
            Gated::Sleep(until) => Next::Sleep(until),
        }
    }

    fn admit_step(&mut self, host: &dyn Host, engine: &Engine, d: &mut Deciding) -> Next {
        let rung = d.rung.take();
        let (verdict, rung) = admit_down_the_ladder(host, engine, &d.ctx(self.api), rung, &d.seen);
        d.rung = rung;
        Next::Go(Step::BucketWait(verdict))
    }

    fn bucket_wait_step(&mut self, d: &mut Deciding, verdict: Verdict) -> Next {
        if let Some(retry_ms) = self.bucket_wait(&verdict, d.now) {
            // A bucket frees up within the class's wait: the request gives
            // its slot back and tries again then, instead of a 429 (which
            // it gets if the VM cannot hold its body meanwhile).
            if self.hold_body(&mut d.parked.hold, d.parked.body_len) {
                return Next::Sleep(d.now + retry_ms);
            }
        }
        Next::Go(Step::Probe(verdict))
    }

    fn probe_step(
        &mut self,
        host: &dyn Host,
        engine: &Engine,
        d: &mut Deciding,
        verdict: Verdict,
    ) -> Next {
        if !d.probe {
            return Next::Go(Step::Send(verdict));
        }
        // Claimed only now, by an admitted request: a refused one never
        // holds the probe.
        let ctx = RequestContext {
            identity: &d.identity,
            api: self.api,
            path: &d.path,
            asked: d.parked.asked.as_ref(),
            now_ms: d.now,
        };
        let (seen, dice) = (&d.seen, d.dice);
        let route = |pushback: &Pushback| engine.route(&ctx, seen, pushback, dice);
        let (decided, lease) =
            engine.take_probe(host, &mut d.pushback, verdict, &d.identity, d.now, route);
        d.probe_lease = lease;
        Next::Go(Step::Send(decided))
    }

    /// The decided request goes on (`send_on`), keeping what it asked
    /// should its rung fail it (`failover`).
    fn send_step(&mut self, host: &dyn Host, d: Deciding, verdict: Verdict) -> Action {
        let Deciding {
            mut parked,
            pushback,
            probe_lease,
            rung,
            ..
        } = d;
        let watch = Watch {
            pushback,
            probe_lease,
        };
        let rung = rung.as_deref();
        self.keep_for_failover(&verdict, rung, &mut parked.asked);
        self.send_on(host, verdict, rung, parked.body_len, Some(watch))
    }
}
