//! The root context's side of the concurrency gate (see `waiting`): the
//! gates configured at a policy load, and the streams resumed from the
//! root — a wake-up message, a sleep's end, the tick's dispatch, expiry
//! and eviction, a reroute when the primary is out.

use std::rc::Rc;

use super::steps::Step;
use super::waiting::*;
use super::{count_contention, Filter, Phase, Stream};
use crate::admission::answer::{Reason, Refused};
use crate::admission::route::BreakerState;
use crate::host::metrics;
use crate::host::{Action, Host};
use crate::limits::reservation::SETTLE_TRIES_FACTOR;
use crate::queue::{self, Changed, Grant, State};

/// Load: keys created, wake-up queue registered (or this root's kept:
/// `same_root`, the previous policy was this root's), tick made fast,
/// gauges defined at 0.
pub fn configure(
    filter: &Filter,
    previous: Option<&Filter>,
    same_root: bool,
    host: &dyn Host,
    vm_id: u64,
) {
    // The queued streams are the VM's: they stay where they are, and the
    // latest policy's root now tends them.
    if let Some(previous) = previous.filter(|_| same_root) {
        filter.wake_queue.set(previous.wake_queue.get());
    }
    if filter.gates.is_empty() {
        if has_waiters(filter) {
            // Their deadlines still hold (the tick answers them).
            host.set_tick_period_ms(QUEUE_TICK_MS);
        }
        return;
    }
    filter.gates.prepare(host);
    if filter.wake_queue.get().is_none() {
        let queue = host.register_wake_queue(&format!("sluice:wake:{vm_id:x}"));
        if queue.is_none() {
            log::warn!("cannot register a wake-up queue: requests that would wait are refused");
        }
        filter.wake_queue.set(queue);
    }
    host.set_tick_period_ms(QUEUE_TICK_MS);
    for via in ["message", "tick"] {
        metrics::QUEUE_RESUMED.define_at(host, &[via]);
    }
    for (backend, group) in filter.gates.groups() {
        let state = host
            .get(&group.key)
            .and_then(|(b, _)| State::decode(&b))
            .unwrap_or_default();
        publish(filter, host, backend, &state);
        for model in group.model_limits.keys() {
            for class in class_labels(filter) {
                for (outcome, reason) in [
                    ("expired", "queue_deadline"),
                    ("abandoned", "client_gone"),
                    ("evicted", "queue_full"),
                    ("rerouted", "fallback"),
                ] {
                    metrics::QUEUE_OUTCOMES.define_at(host, &[outcome, reason, model, &class]);
                }
            }
        }
    }
}

/// Once the policy is this VM's latest: its limits hand out at once what
/// they free (a raised concurrency drains a backlog without waiting for a
/// release).
pub fn after_configure(filter: &Filter, host: &dyn Host) {
    let now = host.now_ms();
    for (backend, group) in filter.gates.groups() {
        let saturated = filter.saturated_models(host, backend, now);
        let saturated = |m: &str| saturated.iter().any(|s| s == m);
        let changed = queue::pump(host, group, filter.tries(), &saturated, now);
        filter.applied(host, backend, &changed);
    }
}

/// Does this VM hold queued or sleeping streams under this policy?
pub fn has_waiters(filter: &Filter) -> bool {
    filter.waiters.try_borrow().is_ok_and(|w| !w.is_empty())
}

/// Acts on the waiter of `ticket`, taken out of this VM's map, with its
/// stream and Envoy's context id; nothing when it is gone (its `on_log`
/// withdrew it and gave the slot back) or its stream is busy.
fn on_waiter(filter: &Filter, ticket: u64, act: impl FnOnce(u32, &mut Stream)) {
    let Some(waiter) = filter
        .waiters
        .try_borrow_mut()
        .ok()
        .and_then(|mut w| w.remove(&ticket))
    else {
        return;
    };
    let Some(stream) = waiter.stream.upgrade() else {
        return;
    };
    let Ok(mut stream) = stream.try_borrow_mut() else {
        return;
    };
    act(waiter.context_id, &mut stream);
}

/// Resumes a queued stream of this VM that holds a slot now; `via`: the
/// wake-up message, or the tick that found the grant (a lost or late
/// wake-up), counted in `sluice_queue_resumed_total{via}`.
fn resume(filter: &Filter, host: &dyn Host, ticket: u64, via: &str) {
    on_waiter(filter, ticket, |context, stream| {
        if !host.set_effective_context(context) {
            return;
        }
        metrics::QUEUE_RESUMED.add_at(host, &[via], 1);
        if stream.dispatch(host, true) == Action::Continue && !host.resume_request() {
            log::warn!("a dispatched request could not be resumed");
        }
    });
}

fn expire(filter: &Filter, host: &dyn Host, ticket: u64) {
    on_waiter(filter, ticket, |context, stream| {
        if host.set_effective_context(context) {
            stream.expire(host);
        }
    });
}

/// Its place was taken by a caller holding fewer: `queue_full`.
fn evict(filter: &Filter, host: &dyn Host, ticket: u64) {
    on_waiter(filter, ticket, |context, stream| {
        if host.set_effective_context(context) {
            stream.evicted(host);
        }
    });
}

/// Out of the queue without a slot (it will not use the primary's):
/// dispatched now, routed as a new request would be.
fn dispatch_off_primary(filter: &Filter, host: &dyn Host, ticket: u64) {
    on_waiter(filter, ticket, |context, stream| {
        if host.set_effective_context(context)
            && stream.dispatch(host, false) == Action::Continue
            && !host.resume_request()
        {
            log::warn!("a rerouted request could not be resumed");
        }
    });
}

fn wake_sleeper(filter: &Filter, host: &dyn Host, ticket: u64) {
    on_waiter(filter, ticket, |context, stream| {
        if let Some(g) = stream.gate.as_mut() {
            g.sleeper = None;
        }
        if host.set_effective_context(context)
            && stream.retry(host) == Action::Continue
            && !host.resume_request()
        {
            log::warn!("a deferred request could not be resumed");
        }
    });
}

/// Wake-up messages: each is the ticket of a granted entry of this VM.
/// This root's queue (after a reload it may still carry grants of waiters
/// that arrived before); the waiters are the VM's.
pub fn on_wake(filter: &Rc<Filter>, host: &dyn Host) {
    let Some(queue) = filter.wake_queue.get() else {
        return;
    };
    let latest = filter.latest();
    while let Some(message) = host.take_wake(queue) {
        if let Ok(bytes) = <[u8; 8]>::try_from(message.as_slice()) {
            resume(&latest, host, u64::from_le_bytes(bytes), "message");
        }
    }
}

/// Every `QUEUE_TICK_MS`: time gates (a provider reset, saturation
/// cleared) are pumped, grants whose wake-up was lost are resumed,
/// entries past their deadline leave the queue with 429 `queue_deadline`,
/// evicted ones with 429 `queue_full`, and, when the sidecar's state
/// changed, those whose primary new requests no longer go to leave it to
/// be routed again. Only the VM's latest policy's root does this (the
/// waiters are its).
pub fn tick(filter: &Rc<Filter>, host: &dyn Host, now: u64) {
    if !Rc::ptr_eq(&filter.latest(), filter) {
        return;
    }
    let due: Vec<u64> = match filter.waiters.try_borrow() {
        Ok(w) => w
            .iter()
            .filter(|(_, w)| w.sleeping && w.deadline_ms <= now)
            .map(|(t, _)| *t)
            .collect(),
        Err(_) => return,
    };
    for ticket in due {
        wake_sleeper(filter, host, ticket);
    }
    let mine: Vec<(u64, String, u64)> = match filter.waiters.try_borrow() {
        Ok(w) => w
            .iter()
            .filter(|(_, w)| !w.sleeping)
            .map(|(t, w)| (*t, w.backend.clone(), w.deadline_ms))
            .collect(),
        Err(_) => return,
    };
    if mine.is_empty() {
        let idle = filter.idle_ticks.get() + 1;
        filter.idle_ticks.set(idle % IDLE_PUBLISH_TICKS);
        if idle >= IDLE_PUBLISH_TICKS {
            for (backend, group) in filter.gates.groups() {
                if let Some(state) = host.get(&group.key).and_then(|(b, _)| State::decode(&b)) {
                    publish(filter, host, backend, &state);
                }
            }
        }
        return;
    }
    reroute_changed(filter, host, &mine);
    let mut backends: Vec<&String> = mine.iter().map(|(_, b, _)| b).collect();
    backends.sort();
    backends.dedup();
    for backend in backends {
        let Some(group) = filter.gates.group(backend) else {
            // A reloaded policy no longer gates this backend: its waiters
            // are answered rather than left to Envoy's route timeout.
            for (ticket, _, _) in mine.iter().filter(|(_, b, _)| b == backend) {
                expire(filter, host, *ticket);
            }
            continue;
        };
        let saturated = filter.saturated_models(host, backend, now);
        let saturated = |m: &str| saturated.iter().any(|s| s == m);
        let changed = queue::pump(host, group, filter.tries(), &saturated, now);
        filter.applied(host, backend, &changed);
        let Some(state) = host.get(&group.key).and_then(|(b, _)| State::decode(&b)) else {
            continue;
        };
        publish(filter, host, backend, &state);
        tend_waiters(filter, host, (backend, group), &state, &mine, now);
    }
}

/// Each of this VM's waiters of `backend`, as the queue's state after the
/// tick's pump has it: dispatched, evicted, or past its deadline.
fn tend_waiters(
    filter: &Filter,
    host: &dyn Host,
    (backend, group): (&str, &queue::Group),
    state: &State,
    mine: &[(u64, String, u64)],
    now: u64,
) {
    for (ticket, b, deadline) in mine {
        if b != backend {
            continue;
        }
        if !state.entries.iter().any(|e| e.ticket == *ticket) {
            resume(filter, host, *ticket, "tick");
        } else if state.evicted(*ticket) {
            let tries = filter.tries().saturating_mul(SETTLE_TRIES_FACTOR);
            let out = queue::withdraw(host, group, tries, *ticket);
            filter.applied(host, backend, &out);
            match out.written {
                crate::state::store::Updated::Written => evict(filter, host, *ticket),
                crate::state::store::Updated::Unchanged => resume(filter, host, *ticket, "tick"),
                _ => {}
            }
        } else if *deadline <= now {
            let tries = filter.tries().saturating_mul(SETTLE_TRIES_FACTOR);
            let out = queue::withdraw(host, group, tries, *ticket);
            filter.applied(host, backend, &out);
            match out.written {
                crate::state::store::Updated::Written => expire(filter, host, *ticket),
                crate::state::store::Updated::Unchanged => resume(filter, host, *ticket, "tick"),
                _ => {}
            }
        }
    }
}

/// When the sidecar's state changed since the last look (kill switch,
/// breakers), each waiter of this VM whose primary new requests no longer
/// go to leaves the queue and is dispatched now (to the fallback, or
/// answered as a new request would be). One read of the state key per
/// tick otherwise.
fn reroute_changed(filter: &Filter, host: &dyn Host, mine: &[(u64, String, u64)]) {
    if filter.engine.policy.sidecar.is_none() {
        return;
    }
    let version = host.get(super::SIDECAR_KEY).map_or(0, |(_, cas)| cas);
    if filter.seen_by_queue.replace(version) == version {
        return;
    }
    for (ticket, backend, _) in mine {
        let waiter = filter
            .waiters
            .try_borrow()
            .ok()
            .and_then(|w| w.get(ticket).map(|w| (w.stream.clone(), w.context_id)));
        let Some((stream, context_id)) = waiter else {
            continue;
        };
        // Read as the stream (its headers and properties).
        let off = host.set_effective_context(context_id)
            && stream
                .upgrade()
                .and_then(|s| s.try_borrow().ok().map(|s| s.off_primary(host)))
                .unwrap_or(false);
        if !off {
            continue;
        }
        let Some(group) = filter.gates.group(backend) else {
            continue;
        };
        let tries = filter.tries().saturating_mul(SETTLE_TRIES_FACTOR);
        let out = queue::withdraw(host, group, tries, *ticket);
        filter.applied(host, backend, &out);
        match out.written {
            crate::state::store::Updated::Written => dispatch_off_primary(filter, host, *ticket),
            // Granted meanwhile: it holds a slot, and its dispatch routes
            // it again.
            crate::state::store::Updated::Unchanged => resume(filter, host, *ticket, "tick"),
            _ => {}
        }
    }
}

impl Filter {
    /// The sidecar reports the model or its backend saturated (a state it
    /// sends beside `open`); only a fresh state counts (saturation fails open).
    pub(super) fn saturated(
        &self,
        host: &dyn Host,
        model: &str,
        backend: &str,
        now_ms: u64,
    ) -> bool {
        let Some(sidecar) = self.engine.policy.sidecar.as_ref() else {
            return false;
        };
        let seen = self.seen(host);
        if now_ms.saturating_sub(seen.received_ms) > sidecar.stale_after_ms {
            return false;
        }
        let (m, b) = (format!("model:{model}"), format!("backend:{backend}"));
        seen.state.as_ref().is_some_and(|st| {
            st.breakers
                .iter()
                .any(|x| x.state == BreakerState::Saturated && (x.scope == m || x.scope == b))
        })
    }

    /// The models of `backend` the sidecar reports saturated, for a pump.
    pub(super) fn saturated_models(
        &self,
        host: &dyn Host,
        backend: &str,
        now_ms: u64,
    ) -> Vec<String> {
        let Some(group) = self.gates.group(backend) else {
            return Vec::new();
        };
        group
            .model_limits
            .keys()
            .filter(|m| self.saturated(host, m, backend, now_ms))
            .cloned()
            .collect()
    }

    pub(super) fn tries(&self) -> u32 {
        self.engine.tries().take()
    }

    /// Sends each grant's ticket to its worker.
    pub(super) fn send_wakes(&self, host: &dyn Host, grants: &[Grant]) {
        for grant in grants {
            if !host.wake(grant.wake, &grant.ticket.to_le_bytes()) {
                // Its owner's tick finds the grant (the safety net).
                log::warn!("a queued request's wake-up could not be sent");
            }
        }
    }

    pub(super) fn applied<T>(&self, host: &dyn Host, backend: &str, changed: &Changed<T>) {
        count_contention(host, changed.contention);
        if let Some(state) = &changed.state {
            publish(self, host, backend, state);
        }
        self.send_wakes(host, &changed.grants);
    }
}

impl Stream {
    /// Out of the queue or asleep no more: what it kept for its next try
    /// is dropped.
    pub(super) fn unpark(&mut self) {
        if matches!(self.phase, Phase::Parked(_)) {
            self.phase = Phase::Undecided;
        }
    }

    /// Its turn came (it holds a slot now, or `slot` is false: it left the
    /// queue because the world changed under it): routed again as a new
    /// request would be now, then its budgets are reserved, then it goes
    /// upstream (the primary or, kill switch pulled meanwhile, the
    /// fallback) or is answered.
    pub(super) fn dispatch(&mut self, host: &dyn Host, slot: bool) -> Action {
        let parked = match std::mem::replace(&mut self.phase, Phase::Undecided) {
            Phase::Parked(parked) => parked,
            other => {
                self.phase = other;
                return Action::Continue;
            }
        };
        let now = host.now_ms();
        if let Some(g) = self.gate.as_mut() {
            g.ticket = None;
            g.slot = slot;
            g.waited_ms = now.saturating_sub(g.arrived_ms);
            metrics::QUEUE_WAIT_MS.record_at(host, &[&g.model, &g.class], g.waited_ms);
            count(host, "dispatched", "queued", g);
        }
        let Some(identity) = self.identity.clone() else {
            return Action::Continue;
        };
        // Answered meanwhile: the stored answer, not another upstream call.
        if let Some(action) = self.cache_at_dispatch(host, parked.asked.as_ref()) {
            return action;
        }
        // Decided as a new request would be now (the one decision's
        // steps, from the route), holding the slot its turn gave it.
        self.run_steps(host, Step::Route, identity, parked, now)
    }

    /// Gives the slot back and waits until `until_ms` (a bucket refills),
    /// then tries the gate again (see `retry`).
    pub(super) fn sleep(&mut self, host: &dyn Host, until_ms: u64) -> Action {
        self.release_slot(host);
        let filter = self.filter.latest();
        let ticket = SLEEPER | u64::from(self.context_id) << 20 | (until_ms & 0xF_FFFF);
        if let Some(g) = self.gate.as_mut() {
            g.sleeper = Some(ticket);
            count(host, "deferred", "bucket", g);
            let backend = g.backend.clone();
            self.add_waiter(&filter, ticket, &backend, until_ms, true);
        }
        Action::Pause
    }

    /// A sleeper's time came: the gate again, with what is left of its wait.
    pub(super) fn retry(&mut self, host: &dyn Host) -> Action {
        let (Some(identity), Some(g)) = (self.identity.clone(), self.gate.take()) else {
            return Action::Continue;
        };
        let now = host.now_ms();
        let asked = match &self.phase {
            Phase::Parked(parked) => parked.asked.as_ref(),
            _ => None,
        };
        let (gated, gate) = self.pass_gate(host, &identity, asked, g.arrived_ms, now);
        self.gate = gate;
        match gated {
            Gated::Go => self.dispatch(host, true),
            Gated::Wait => Action::Pause,
            Gated::Sleep(until) => self.sleep(host, until),
            Gated::Answered(verdict) => {
                self.unpark();
                self.finish(host, *verdict)
            }
        }
    }

    /// Past its deadline and still in the queue: 429 `queue_deadline`.
    pub(super) fn expire(&mut self, host: &dyn Host) {
        let Some(g) = self.gate.as_ref() else { return };
        let waited = host.now_ms().saturating_sub(g.arrived_ms);
        let message = format!(
            "Waited {waited} ms for {} without a free slot. Try again later.",
            g.model
        );
        self.leave_queue_refused(host, "expired", Reason::QueueDeadline, &message);
    }

    /// Its place went to a caller holding fewer (fair places): 429
    /// `queue_full`, as if it had found the queue full.
    pub(super) fn evicted(&mut self, host: &dyn Host) {
        let Some(g) = self.gate.as_ref() else { return };
        let message = format!(
            "Too many of your requests are waiting for {}: this one's place went to another caller. Try again in 1 s.",
            g.model
        );
        self.leave_queue_refused(host, "evicted", Reason::QueueFull, &message);
    }

    /// Leaves the queue without a slot and answers `reason` (429, retry in
    /// 1 s), counted under `outcome`.
    pub(super) fn leave_queue_refused(
        &mut self,
        host: &dyn Host,
        outcome: &str,
        reason: Reason,
        message: &str,
    ) {
        self.unpark();
        let Some(g) = self.gate.as_mut() else { return };
        g.ticket = None;
        count(host, outcome, reason.code(), g);
        let refused = Refused::retry_later(reason, message, 1);
        let tier = self
            .identity
            .as_ref()
            .map(|i| i.tier.clone())
            .unwrap_or_default();
        let model = g.model.clone();
        let verdict = self.filter.engine.refuse(refused, &tier, Some(&model));
        self.finish(host, verdict);
    }

    /// Gives the slot back, once, to the VM's latest gates (a reloaded
    /// policy's limits decide who gets it); the next waiter gets it.
    pub(super) fn release_slot(&mut self, host: &dyn Host) {
        let Some(g) = self.gate.as_mut().filter(|g| g.slot) else {
            return;
        };
        g.slot = false;
        let (backend, model) = (g.backend.clone(), g.model.clone());
        let filter = self.gate_filter(&backend);
        let Some(group) = filter.gates.group(&backend) else {
            return;
        };
        let now = host.now_ms();
        let saturated = filter.saturated_models(host, &backend, now);
        let saturated = |m: &str| saturated.iter().any(|s| s == m);
        let tries = filter.tries().saturating_mul(SETTLE_TRIES_FACTOR);
        let changed = queue::release(host, group, tries, &model, &saturated, now);
        if !changed.value {
            log::error!(
                "a concurrency slot of {model} could not be given back (shared-data contention)"
            );
        }
        filter.applied(host, &backend, &changed);
    }

    /// The gates a slot or entry of `backend` goes back to: the latest
    /// policy's, else (it no longer gates the backend) the ones it was
    /// taken under, so the count is still given back.
    pub(super) fn gate_filter(&self, backend: &str) -> Rc<Filter> {
        let latest = self.filter.latest();
        if latest.gates.group(backend).is_some() {
            return latest;
        }
        self.filter.clone()
    }

    /// The stream ends: out of the queue, or its slot given back.
    pub(super) fn leave_gate(&mut self, host: &dyn Host) {
        let waiters = self.filter.waiters.clone();
        let forget = |ticket: u64| {
            if let Ok(mut waiters) = waiters.try_borrow_mut() {
                waiters.remove(&ticket);
            }
        };
        if let Some(sleeper) = self.gate.as_mut().and_then(|g| g.sleeper.take()) {
            // Holds no slot and no queue entry while asleep.
            self.unpark();
            forget(sleeper);
            if let Some(g) = self.gate.clone() {
                count(host, "abandoned", "client_gone", &g);
            }
            return;
        }
        let Some(ticket) = self.gate.as_mut().and_then(|g| g.ticket.take()) else {
            self.release_slot(host);
            return;
        };
        self.unpark();
        forget(ticket);
        let Some(g) = self.gate.clone() else { return };
        let filter = self.gate_filter(&g.backend);
        let Some(group) = filter.gates.group(&g.backend) else {
            return;
        };
        let tries = filter.tries().saturating_mul(SETTLE_TRIES_FACTOR);
        let changed = queue::withdraw(host, group, tries, ticket);
        filter.applied(host, &g.backend, &changed);
        match changed.written {
            crate::state::store::Updated::Written => count(host, "abandoned", "client_gone", &g),
            crate::state::store::Updated::Unchanged => {
                // Granted while the client left: the slot is ours to give back.
                if let Some(g) = self.gate.as_mut() {
                    g.slot = true;
                }
                count(host, "abandoned", "client_gone", &g);
                self.release_slot(host);
            }
            _ => log::error!("a queued request could not be withdrawn (shared-data contention)"),
        }
    }

    /// A provider's "nothing left until the reset" (OpenAI's
    /// `x-ratelimit-*` or Anthropic's `anthropic-ratelimit-*`, read by
    /// [`queue::provider_reset_ms`]): the model's queue
    /// waits for it instead of sending requests into 429s.
    pub(super) fn observe_provider_limits(&mut self, host: &dyn Host) {
        let Some(g) = self.gate.clone() else { return };
        let filter = self.gate_filter(&g.backend);
        let Some(group) = filter.gates.group(&g.backend) else {
            return;
        };
        let from_upstream = host
            .property(&["response", "code_details"])
            .is_some_and(|d| d == b"via_upstream");
        if !from_upstream {
            return;
        }
        let now = host.now_ms();
        let cap = filter.engine.policy.protection.max_pause_ms;
        let reset = queue::provider_reset_ms(&|name| host.response_header(name), now);
        if let Some(reset) = reset.filter(|r| *r > 0) {
            let until = now.saturating_add(reset.min(cap));
            let changed = queue::pause(host, group, filter.tries(), &g.model, until);
            filter.applied(host, &g.backend, &changed);
        }
    }
}
