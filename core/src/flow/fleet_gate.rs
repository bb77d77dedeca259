//! The fleet's gate: an admitted request's fleet buckets covered, waited
//! for (the sidecar's answer resumes it) or refused fleet-wide.

use super::*;

impl Stream {
    /// An admitted request's fleet buckets: covered by the leases (go on),
    /// waiting for the sidecar (pause), or refused fleet-wide.
    pub(super) fn fleet_gate(
        &mut self,
        host: &dyn Host,
        verdict: Verdict,
        watch: Option<Watch>,
    ) -> Action {
        let filter = self.filter.clone();
        // A body request's plan, or what a GET took.
        let held = verdict.admitted().and_then(|a| {
            a.plan
                .as_ref()
                .map(|p| (&p.held, &p.meters))
                .or(a.held.as_ref().map(|(h, m)| (h, m)))
        });
        let (Some(fleet), Some((held, meters)), Some(identity)) =
            (filter.fleet.as_ref(), held, self.identity.clone())
        else {
            return self.finish_onward(host, verdict, watch, Vec::new());
        };
        let now = self.started_ms;
        match fleet.admit(&filter.engine, host, held, meters, &identity, now) {
            crate::fleet::Gate::Pass(claims) => self.finish_onward(host, verdict, watch, claims),
            crate::fleet::Gate::Wait(pending) => {
                // Its answer comes to this stream, or to the root when the
                // root made the call while resuming this stream.
                if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
                    calls.insert(pending.token, (self.me.clone(), self.context_id));
                }
                self.phase = Phase::Fleet(Box::new(FleetWait {
                    pending,
                    verdict,
                    watch,
                    hit: None,
                }));
                Action::Pause
            }
            crate::fleet::Gate::Refuse { rule, quota } => {
                self.fleet_refuse(host, verdict, watch, &rule, quota)
            }
        }
    }

    /// The sidecar's answer to a request paused for the fleet.
    pub fn on_call_response(&mut self, host: &dyn Host, token: u32, body_size: usize) {
        if self.owns_attempt(token) {
            self.attempt_answered(host, body_size);
            return;
        }
        if self.owns_fleet_attempt(token) {
            self.fleet_attempt_answered(host, body_size);
            return;
        }
        if self.cache_owns(token) {
            self.cache_answer(host, body_size);
            return;
        }
        let wait = match std::mem::replace(&mut self.phase, Phase::Undecided) {
            Phase::Fleet(wait) if wait.pending.token == token => wait,
            other => {
                self.phase = other;
                return;
            }
        };
        let FleetWait {
            pending,
            verdict,
            watch,
            hit,
        } = *wait;
        let filter = self.filter.clone();
        if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
            calls.remove(&token);
        }
        let (Some(fleet), Some(identity)) = (filter.fleet.as_ref(), self.identity.clone()) else {
            return self.give_back_probe(host, watch);
        };
        let now = host.now_ms();
        let gate = fleet.answer(&filter.engine, host, pending, body_size, &identity, now);
        // A cache hit waiting for the fleet: its kept reply, or the 429.
        if let Some(hit) = hit {
            match gate {
                crate::fleet::Gate::Refuse { rule, quota } => {
                    hit.refused(host);
                    self.fleet_refuse(host, verdict, None, &rule, quota);
                }
                crate::fleet::Gate::Pass(claims) => self.deliver_hit(host, hit, verdict, claims),
                crate::fleet::Gate::Wait(_) => self.deliver_hit(host, hit, verdict, Vec::new()),
            }
            return;
        }
        let claims = match gate {
            crate::fleet::Gate::Refuse { rule, quota } => {
                // Sent on down the ladder, it may go upstream now.
                if self.fleet_refuse(host, verdict, watch, &rule, quota) == Action::Continue {
                    host.resume_request();
                }
                return;
            }
            crate::fleet::Gate::Pass(claims) => claims,
            // `answer` never waits again; should it, the request goes on
            // covered locally rather than hang.
            crate::fleet::Gate::Wait(_) => Vec::new(),
        };
        if self.finish_onward(host, verdict, watch, claims) == Action::Continue {
            host.resume_request();
        }
    }

    /// The client left while its request waited for the fleet: the take,
    /// what the request holds here and a probe it claimed go back (a cache
    /// hit's kept reply is dropped).
    pub(super) fn abandon_fleet_wait(&mut self, host: &dyn Host, wait: FleetWait) {
        let FleetWait {
            pending,
            verdict,
            watch,
            ..
        } = wait;
        let filter = self.filter.clone();
        if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
            calls.remove(&pending.token);
        }
        let engine = &filter.engine;
        let now = host.now_ms();
        if let Some(fleet) = &filter.fleet {
            fleet.abandon(engine, host, pending, now);
        }
        // (Counted outstanding only once `finish` sends it on: not yet.)
        release_local(host, engine, &verdict, now);
        self.give_back_probe(host, watch);
    }

    /// Refused fleet-wide: what the request took locally is given back
    /// (a probe it claimed too) and the bucket answers 429.
    pub(super) fn fleet_refuse(
        &mut self,
        host: &dyn Host,
        verdict: Verdict,
        watch: Option<Watch>,
        rule: &str,
        quota: crate::limits::bucket::Quota,
    ) -> Action {
        let engine = &self.filter.engine;
        let now = host.now_ms();
        let model = verdict.plan().and_then(|p| p.model.clone());
        release_local(host, engine, &verdict, now);
        if let Some(action) = self.fleet_refused_rung(host, rule) {
            self.give_back_probe(host, watch);
            return action;
        }
        let engine = &self.filter.engine;
        let refusal = self.identity.as_ref().and_then(|identity| {
            engine.fleet_refusal(rule, quota, identity, model.as_deref(), now)
        });
        match refusal {
            Some(r) => {
                self.give_back_probe(host, watch);
                self.finish(host, r)
            }
            None => self.finish_onward(host, verdict, watch, Vec::new()),
        }
    }
}
