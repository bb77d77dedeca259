//! A failover attempt (see `failover`): through the fleet's gate as at
//! dispatch, then sent as a callout through Envoy's own listener.

use super::failover::*;
use super::{add, count_contention, Stream};
use crate::admission::ladder::Served;
use crate::admission::Verdict;
use crate::host::metrics;
use crate::host::{Action, Host};

impl Stream {
    /// An admitted attempt through the fleet's gate, as at dispatch (no
    /// bypass of a fleet-wide budget): covered, it is sent now; waiting,
    /// when the sidecar answers; refused (the rung's budget across the
    /// fleet), the request goes on down the ladder.
    pub(super) fn through_fleet(
        &mut self,
        host: &dyn Host,
        r: &mut Resend,
        verdict: Verdict,
        served: Option<Box<Served>>,
        deadline: u64,
        now: u64,
    ) -> Next {
        let filter = self.filter.clone();
        let held = verdict.plan().map(|p| (&p.held, &p.meters));
        let gate = match (filter.fleet.as_ref(), held, self.identity.as_deref()) {
            (Some(fleet), Some((held, meters)), Some(identity)) => {
                fleet.admit(&filter.engine, host, held, meters, identity, now)
            }
            _ => crate::fleet::Gate::Pass(Vec::new()),
        };
        match gate {
            crate::fleet::Gate::Pass(claims) => {
                self.send_now(host, r, verdict, served, deadline, claims)
            }
            crate::fleet::Gate::Wait(pending) => {
                r.fleet = Some(Box::new(FleetAttempt {
                    pending,
                    verdict,
                    served,
                    deadline,
                }));
                Next::Sent
            }
            crate::fleet::Gate::Refuse { .. } => {
                self.fleet_refused_attempt(host, r, &verdict, served, now)
            }
        }
    }

    /// Sends an admitted (and covered) attempt, holding its fleet claims.
    pub(super) fn send_now(
        &mut self,
        host: &dyn Host,
        r: &mut Resend,
        mut verdict: Verdict,
        served: Option<Box<Served>>,
        deadline: u64,
        claims: Vec<crate::fleet::Claimed>,
    ) -> Next {
        let body = verdict.take_body().unwrap_or_else(|| r.asked.raw.clone());
        let timeout = deadline.saturating_sub(host.now_ms());
        let Some(token) = self.send_attempt(host, verdict, body, served.as_deref(), timeout) else {
            return Next::Exhausted;
        };
        if let Some(up) = self.upstream() {
            up.fleet_claims = claims;
        }
        if let Some(served) = served {
            r.on = Some(*served);
        }
        r.attempts += 1;
        r.token = Some(token);
        Next::Sent
    }

    /// The fleet refused an attempt's rung: what it holds here goes back
    /// and the request goes on down the ladder, after that rung.
    pub(super) fn fleet_refused_attempt(
        &mut self,
        host: &dyn Host,
        r: &mut Resend,
        verdict: &Verdict,
        served: Option<Box<Served>>,
        now: u64,
    ) -> Next {
        super::release_local(host, &self.filter.engine, verdict, now);
        let Some(served) = served else {
            metrics::FAILOVER.add_at(host, &["exhausted"], 1);
            return Next::Exhausted;
        };
        metrics::PROVIDER_REQUESTS.add_at(host, &[&served.provider, "skipped_budget"], 1);
        r.failed.push(format!("{}=budget", served.provider));
        r.on = Some(*served);
        self.next_from(host, r, now)
    }

    /// Is `token` the fleet's answer for this request's attempt?
    pub(super) fn owns_fleet_attempt(&self, token: u32) -> bool {
        self.resend
            .as_ref()
            .and_then(|r| r.fleet.as_ref())
            .is_some_and(|f| f.pending.token == token)
    }

    /// The fleet's answer for an attempt: sent, or on down the ladder;
    /// with nothing left, the held failure goes on.
    pub(super) fn fleet_attempt_answered(&mut self, host: &dyn Host, body_size: usize) {
        let filter = self.filter.clone();
        let (Some(mut r), Some(fleet), Some(identity)) = (
            self.resend.take(),
            filter.fleet.as_ref(),
            self.identity.clone(),
        ) else {
            return;
        };
        let Some(wait) = r.fleet.take() else {
            self.resend = Some(r);
            return;
        };
        let FleetAttempt {
            pending,
            verdict,
            served,
            deadline,
        } = *wait;
        let now = host.now_ms();
        let gate = fleet.answer(&filter.engine, host, pending, body_size, &identity, now);
        let next = match gate {
            crate::fleet::Gate::Pass(claims) => {
                self.send_now(host, &mut r, verdict, served, deadline, claims)
            }
            // `answer` never waits again; should it, covered locally.
            crate::fleet::Gate::Wait(_) => {
                self.send_now(host, &mut r, verdict, served, deadline, Vec::new())
            }
            crate::fleet::Gate::Refuse { .. } => {
                self.fleet_refused_attempt(host, &mut r, &verdict, served, now)
            }
        };
        self.resend = Some(r);
        if matches!(next, Next::Exhausted) {
            self.let_failure_through(host);
        }
    }

    /// The client left while an attempt waited for the fleet: the take
    /// and what the attempt holds here go back.
    pub(super) fn abandon_fleet_attempt(&mut self, host: &dyn Host) {
        let Some(wait) = self.resend.as_mut().and_then(|r| r.fleet.take()) else {
            return;
        };
        let filter = self.filter.clone();
        let now = host.now_ms();
        if let Some(fleet) = &filter.fleet {
            fleet.abandon(&filter.engine, host, wait.pending, now);
        }
        super::release_local(host, &filter.engine, &wait.verdict, now);
    }

    /// Sends the request to `served` through Envoy's own listener, the
    /// body rewritten for it and its reservation held in the upstream
    /// phase until the answer settles it.
    pub(super) fn send_attempt(
        &mut self,
        host: &dyn Host,
        mut verdict: Verdict,
        body: Vec<u8>,
        served: Option<&Served>,
        timeout_ms: u64,
    ) -> Option<u32> {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let cfg = engine.policy.failover.as_ref()?;
        let secret = host
            .get(SECRET_KEY)
            .map(|(s, _)| String::from_utf8_lossy(&s).into_owned())
            .unwrap_or_default();
        let mut headers = attempt_headers(self.request_headers.as_ref(), served.is_some());
        if let Some(served) = served {
            headers.push((served.header.clone(), served.value.clone()));
        }
        headers.push((ATTEMPT_HEADER.to_string(), secret));
        let provider = served.map_or("primary", |s| s.provider.as_str());
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let token = match host.dispatch_post(&cfg.cluster, &pairs, &body, timeout_ms.max(1)) {
            Ok(token) => token,
            Err(why) => {
                log::warn!("failover to {provider} could not start: {why}");
                if let Some(plan) = verdict.plan() {
                    count_contention(host, engine.release(host, plan, host.now_ms()));
                }
                metrics::FAILOVER.add_at(host, &["exhausted"], 1);
                return None;
            }
        };
        metrics::FAILOVER.add_at(host, &["sent"], 1);
        if let Some(served) = served {
            metrics::PROVIDER_REQUESTS.add_at(host, &[&served.provider, "served"], 1);
            add(host, metrics::REROUTED, 1);
            verdict.push_header("x-sluice-provider", &served.provider);
            self.audit
                .text(super::audit::Field::Provider, &served.provider);
        }
        let plan = verdict.take_plan().filter(|p| engine.settles(p));
        if plan.is_some() {
            add(host, metrics::RESERVATIONS_OUTSTANDING, 1);
        }
        self.cache_store = None;
        if let Some(up) = self.upstream() {
            up.plan = plan;
            up.response_headers = verdict.into_response_headers();
            up.meter = None;
        }
        Some(token)
    }

    /// A rung's own budget refused by the fleet (its spend across every
    /// Envoy): like a local refusal by it, the request goes on down the
    /// ladder (rerouted, rewritten and admitted for the next rung, then
    /// through the fleet's gate again), or to the static answer. `None`:
    /// the refusal was not the rung's (the caller's own budget), or the
    /// request kept nothing to be sent again.
    pub(super) fn fleet_refused_rung(&mut self, host: &dyn Host, rule: &str) -> Option<Action> {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let identity = self.identity.clone()?;
        let mut r = self.resend.take()?;
        let refused_by_rung =
            r.on.as_ref()
                .is_some_and(|s| engine.is_rung_budget(&s.provider, rule));
        if !refused_by_rung {
            self.resend = Some(r);
            return None;
        }
        let now = host.now_ms();
        let provider =
            r.on.as_ref()
                .map(|s| s.provider.clone())
                .unwrap_or_default();
        metrics::PROVIDER_REQUESTS.add_at(host, &[&provider, "skipped_budget"], 1);
        let model = r.asked.demand.model.as_deref();
        let next = engine.rung_after(self.api, model, Some(&provider));
        let (mut verdict, rung) =
            self.admit_again(host, (&identity, &r), now, Again::Down(next.map(Box::new)));
        let skipped = format!("{provider}=budget");
        verdict.push_header("x-sluice-skipped", &skipped);
        r.on = rung.as_deref().cloned();
        self.resend = Some(r);
        let body_len = self.sent_len;
        Some(self.send_on(host, verdict, rung.as_deref(), body_len, None))
    }
}
