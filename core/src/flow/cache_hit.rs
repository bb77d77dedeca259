//! A cache hit answered here (see `cache`): admitted at the policy's
//! `hit_cost`, through the fleet's gate, settled, then the stored answer
//! sent; and a queued request whose answer was stored while it waited.

use super::cache::*;
use super::Stream;
use crate::admission::{Asked, RequestContext};
use crate::cache::answer::Rendered;
use crate::cache::tier::Lookup as InEnvoy;
use crate::host::metrics;
use crate::host::{Action, Host};
use crate::usage::reconcile::{Found, Usage};
use sluice_wire::cache::Entry;

impl Stream {
    /// A hit: admission at the hit's cost (locally, then in fleet mode
    /// fleet-wide, like a normal request), then the stored answer.
    pub(super) fn serve_hit(
        &mut self,
        host: &dyn Host,
        wait: &Wait,
        rendered: Rendered,
        entry: &Entry,
        age_s: u64,
        kind: &'static str,
    ) {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let Some(identity) = self.identity.clone() else {
            return;
        };
        let cost = engine
            .policy
            .cache_compiled
            .as_ref()
            .map(|c| c.hit_cost)
            .unwrap_or_default();
        let mut asked = wait.asked.clone();
        if let Some(a) = asked.as_mut().filter(|_| !cost.tokens) {
            a.input_raw = 0.0;
            a.rendered.free = true;
            a.demand.max_output = Some(0);
        }
        let (input, output) = if cost.tokens {
            (entry.prompt_tokens, entry.completion_tokens)
        } else {
            (0, 0)
        };
        let ctx = RequestContext {
            identity: &identity,
            api: self.api,
            path: &self.path,
            asked: asked.as_ref(),
            now_ms: self.started_ms,
        };
        let verdict = engine.admit(host, &ctx);
        let hit = HeldHit {
            rendered,
            saved_tokens: entry.prompt_tokens.saturating_add(entry.completion_tokens),
            saved_spend: entry.spend_micros,
            input,
            output,
            age_s,
            kind,
            label: engine.model_label(Some(&wait.model)),
            model: wait.model.clone(),
            asked,
        };
        if !verdict.is_admitted() {
            hit.refused(host);
            self.finish(host, verdict);
            return;
        }
        // The fleet's buckets count the hit as they count any request.
        let held = verdict.plan().map(|p| (&p.held, &p.meters));
        let (Some(fleet), Some((held, meters))) = (filter.fleet.as_ref(), held) else {
            return self.deliver_hit(host, hit, verdict, Vec::new());
        };
        match fleet.admit(engine, host, held, meters, &identity, self.started_ms) {
            crate::fleet::Gate::Pass(claims) => self.deliver_hit(host, hit, verdict, claims),
            crate::fleet::Gate::Wait(pending) => {
                if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
                    calls.insert(pending.token, (self.me.clone(), self.context_id));
                }
                self.phase = super::Phase::Fleet(Box::new(super::FleetWait {
                    pending,
                    verdict,
                    watch: None,
                    hit: Some(hit),
                }));
            }
            crate::fleet::Gate::Refuse { rule, quota } => {
                hit.refused(host);
                self.fleet_refuse(host, verdict, None, &rule, quota);
            }
        }
    }

    /// An admitted hit: its reservation (and fleet claims) settled at the
    /// hit's cost, then the stored answer sent.
    pub(super) fn deliver_hit(
        &mut self,
        host: &dyn Host,
        hit: HeldHit,
        mut verdict: super::Verdict,
        claims: Vec<crate::fleet::Claimed>,
    ) {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let Some(identity) = self.identity.clone() else {
            return;
        };
        let kind = hit.kind;
        if let Some(plan) = verdict.take_plan() {
            let found = Found::Usage(Usage {
                input: hit.input,
                output: hit.output,
            });
            let now = host.now_ms();
            let (settled, effort) = engine.settle(host, &plan, found, hit.output, true, now);
            super::count_contention(host, effort);
            if let Some(fleet) = &filter.fleet {
                let used = crate::fleet::Used {
                    billed: settled.billed,
                    price: plan.price,
                };
                fleet.settle(engine, host, &claims, used, now);
            }
        }
        self.phase = super::Phase::Answered;
        self.observe(host, &verdict);
        self.audit.code(super::audit::Field::Cache, kind);
        metrics::CACHE.add_at(host, &["hit", kind, &hit.label], 1);
        // What the upstream was not asked for, by the caller's tier (one
        // of the policy's: an unknown tier is the default) and the model.
        let labels = [identity.tier.as_str(), hit.label.as_str()];
        let saved = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        metrics::CACHE_SAVED_TOKENS.add_at(host, &labels, saved(hit.saved_tokens));
        metrics::CACHE_SAVED_SPEND.add_at(host, &labels, saved(hit.saved_spend));
        let age = hit.age_s.to_string();
        // When the primary is out (kill switch, breaker, every upstream
        // down), the cached answer comes first, marked as degraded.
        let out = self.primary_out(host, &identity, hit.asked.as_ref(), &hit.model);
        if out {
            metrics::DEGRADED.add_at(host, &["cache", &identity.tier, &hit.label], 1);
        }
        let mut headers: Vec<(&str, &str)> = vec![
            ("x-sluice-degraded", if out { "cache" } else { "" }),
            ("content-type", hit.rendered.content_type),
            ("x-sluice-cache", "hit"),
            ("x-sluice-cache-kind", kind),
            ("age", age.as_str()),
        ];
        if let Some(admitted) = verdict.admitted() {
            headers.extend(admitted.response_headers.iter());
        }
        let timing = self.decision_timing(host, verdict.labels().decision);
        if let Some(timing) = &timing {
            headers.push((super::timing::SERVER_TIMING, timing));
        }
        headers.retain(|(_, v)| !v.is_empty());
        // The reply passes the response callbacks: nothing to store.
        self.cache_store = None;
        host.send_reply(200, &headers, &hit.rendered.body);
    }

    /// Would this request not go to the primary (kill switch, an open
    /// breaker, every upstream out)?
    pub(super) fn primary_out(
        &self,
        host: &dyn Host,
        identity: &crate::admission::identity::Identity,
        asked: Option<&Asked>,
        model: &str,
    ) -> bool {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let view = super::HostRequest(host, self.request_headers.as_ref());
        let pushback = engine.pushback(host, Some(model), &view, identity, self.started_ms);
        let seen = if engine.policy.sidecar.is_some() {
            filter.seen(host)
        } else {
            std::rc::Rc::new(crate::admission::route::SidecarSeen::default())
        };
        let ctx = RequestContext {
            identity,
            api: self.api,
            path: &self.path,
            asked,
            now_ms: self.started_ms,
        };
        let dice = filter.roll(self.started_ms);
        // Out: the kill switch (to the fallback provider), an open breaker
        // (a 503), every upstream down (the static answer). The hit is
        // served in each case, marked as the degraded answer it is.
        !matches!(
            engine.route(&ctx, &seen, &pushback, dice),
            crate::admission::Routed::Primary | crate::admission::Routed::Probe
        )
    }

    /// A queued request's turn came: its answer may have been stored while
    /// it waited (an identical question answered meanwhile). The tier in
    /// Envoy is read again (no callout); `Some`: served from it, its slot
    /// given back.
    pub(super) fn cache_at_dispatch(
        &mut self,
        host: &dyn Host,
        asked: Option<&Asked>,
    ) -> Option<Action> {
        let s = self.cache_store.as_ref().filter(|s| s.read)?;
        let (tier, key, api, model) = (s.tier?, s.key.clone(), s.api, s.model.clone());
        let asked = asked?;
        let wait = Wait {
            token: 0,
            key: key.clone(),
            stream: api.streams(asked.body()),
            include_usage: asked.include_usage,
            asked: Some(asked.clone()),
            api,
            model,
        };
        match self.tier_lookup(host, &tier, &key, &wait) {
            InEnvoy::Hit(_) => {
                self.release_slot(host);
                Some(Action::Pause)
            }
            _ => None,
        }
    }
}
