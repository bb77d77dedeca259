//! The request path, top to bottom: identity → demand → route (health,
//! kill switch) → admission (with rewrite) → answer, and after the
//! response, reconcile. Pure: [`crate::flow`] feeds it what Envoy knows,
//! one event at a time, and applies what it decides through the host.

use std::collections::HashMap;

use serde_json::Value;

use crate::anomaly::UsageRing;
use crate::answer::{self, Decision, Degraded, Limited, Reason, Reply};
use crate::bucket::Quota;
use crate::codec::Record;
use crate::config::{Budget, Limit, Mode, Policy, Window};
use crate::estimate::{self, Correction};
use crate::health::{self, OnStale, Pushback, Route, Seen, Situation};
use crate::principal::{Identity, RequestView, Resolver};
use crate::reconcile::Found;
use crate::request::{self, Api, Demand};
use crate::reservation::{prepare, Caller, Claim, Held, Layout, Refusal, Reserver, Rule, Scope};
use crate::store::{self, Contention, SharedStore, StoreError, Updated};

/// Metric labels of one decision. Bounded: tiers and models come from the
/// policy (`other` for unlisted models), reasons from a fixed set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels {
    pub decision: Decision,
    pub tier: String,
    pub model: String,
}

/// What to do with a request.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// `Some`: answer the client with this and stop. `None`: go upstream.
    pub reply: Option<Reply>,
    /// Headers to add to the upstream's response when admitted.
    pub response_headers: Vec<(String, String)>,
    /// The request body to send upstream instead of the client's.
    pub body: Option<Vec<u8>>,
    pub labels: Labels,
    /// Compare-and-swap races lost while deciding.
    pub contention: Contention,
    /// Refused because no per-caller slot was free (`capacity_exhausted`).
    pub no_slot: bool,
    /// What was reserved, to settle after the response.
    pub plan: Option<Plan>,
    /// Budget alert thresholds crossed by this request.
    pub alerts: Vec<String>,
    /// A soft cap rewrote the model, or the static table answered.
    pub degraded: Option<Degraded>,
    /// The rule id of the bucket that refused (`tier/free/requests`).
    pub bucket: Option<String>,
}

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meter {
    Requests,
    /// Input + output tokens.
    Tokens,
    InputTokens,
    OutputTokens,
    /// Micro-currency.
    Spend,
}

impl Meter {
    fn amount(self, input: u64, output: u64, pricing: Pricing) -> u64 {
        match self {
            Meter::Requests => 1,
            Meter::Tokens => input.saturating_add(output),
            Meter::InputTokens => input,
            Meter::OutputTokens => output,
            Meter::Spend => pricing.cost(input, output),
        }
    }
}

/// Price of a model in micro-currency per 1,000 tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pricing {
    pub input_per_1k: u64,
    pub output_per_1k: u64,
}

impl Pricing {
    /// Micro-currency for a request, rounded up.
    pub fn cost(self, input: u64, output: u64) -> u64 {
        let micro_k =
            input as u128 * self.input_per_1k as u128 + output as u128 * self.output_per_1k as u128;
        micro_k.div_ceil(1000).min(u64::MAX as u128) as u64
    }
}

/// A bucket definition with what answers need to say about it.
struct Bucket {
    rule: Rule,
    /// The tier of a per-caller bucket (its declared keys get their own).
    tier: Option<String>,
    /// Counts every undeclared caller of the tier together.
    anonymous: bool,
    reason: Reason,
    /// `tier free: requests per caller`
    name: String,
    meter: Meter,
    soft: bool,
    alert_permille: Option<u32>,
}

/// Where a request that passed identity and parsing goes (step 4).
#[derive(Debug)]
pub enum Routed {
    Primary,
    /// Kill switch: to the fallback provider.
    Fallback,
    /// The error breaker's half-open probe.
    Probe,
    /// Answered here: a 503, or the static fallback.
    Answered(Box<Verdict>),
}

/// Everything admission reserved for one request, kept until its response
/// is settled.
#[derive(Debug, Clone)]
pub struct Plan {
    pub held: Vec<Held>,
    pub meters: Vec<Meter>,
    pub api: Api,
    /// The model sent upstream (after any downshift).
    pub model: Option<String>,
    pub input_raw: f64,
    pub input_estimate: u64,
    /// Output reserved: the most the upstream may produce, every choice
    /// (`n`, `best_of`) together.
    pub max_output: u64,
    pub stream: bool,
    /// sluice asked for the usage chunk; the client did not.
    pub strip_usage: bool,
    pub pricing: Pricing,
}

impl Plan {
    /// Does this plan hold any token or spend units to settle?
    pub fn settles(&self) -> bool {
        self.meters.iter().any(|m| *m != Meter::Requests)
    }
}

/// How a response was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub input: u64,
    pub output: u64,
    /// The counts came from the upstream's usage (not the estimate).
    pub from_usage: bool,
    /// The upstream sent usage sluice could not believe.
    pub invalid_usage: bool,
    pub cost: u64,
    /// This request's minute is a consumption surge (first time flagged).
    pub surge: bool,
    /// The global spend breaker is open after this request.
    pub global_open: bool,
    /// Buckets whose extra charge (usage past the reservation) could not be
    /// written even with the settlement's larger retry bound: counted in
    /// `sluice_cas_exhausted_total` and logged, never silently lost.
    pub charges_unwritten: u32,
}

/// A parsed request body and its raw input estimate.
#[derive(Debug, Clone)]
pub struct Asked {
    pub demand: Demand,
    pub body: Value,
    pub input_raw: f64,
}

pub struct Engine {
    pub policy: Policy,
    resolver: Resolver,
    buckets: Vec<Bucket>,
    tier_buckets: HashMap<String, Vec<usize>>,
    model_buckets: HashMap<String, Vec<usize>>,
    route_buckets: Vec<(String, usize)>,
    pricing: HashMap<String, Pricing>,
}

const CORRECTION_KEY: &str = "sluice:v1:estimate/";
/// The global per-minute usage ring (one key).
const USAGE_KEY: &str = "sluice:v1:usage";

/// Below this many output tokens a lowered request is refused instead: an
/// answer cut to a handful of tokens is worth less than a clear 429.
pub const MIN_LOWERED_OUTPUT: u64 = 16;

impl Engine {
    pub fn new(policy: Policy) -> Engine {
        let mut buckets = Vec::new();
        let mut tier_buckets: HashMap<String, Vec<usize>> = HashMap::new();
        let mut model_buckets: HashMap<String, Vec<usize>> = HashMap::new();
        let mut add = |id: String,
                       name: String,
                       limit: Limit,
                       scope,
                       reason,
                       meter,
                       budget: Option<Budget>| {
            buckets.push(Bucket {
                rule: Rule { id, limit, scope },
                tier: None,
                anonymous: false,
                reason,
                name,
                meter,
                soft: budget.is_some_and(|b| b.mode == Mode::Soft),
                alert_permille: budget.and_then(|b| b.alert_at_permille),
            });
            buckets.len() - 1
        };
        for (tier, t) in &policy.tiers {
            // The tier's shared total for undeclared callers comes first: a
            // flood refused there never reaches the per-caller slots.
            let mut mine = Vec::new();
            if let Some(total) = &t.anonymous_total {
                for l in tier_limits(total) {
                    let i = add(
                        format!("tier/{tier}/anonymous/{}", l.what),
                        format!(
                            "tier {tier}: {}, all callers without a declared key",
                            l.what.replace('_', " ")
                        ),
                        l.limit,
                        Scope::Global,
                        Reason::AnonymousLimit,
                        l.meter,
                        l.budget,
                    );
                    mine.push(i);
                }
            }
            for l in tier_limits(t) {
                let i = add(
                    format!("tier/{tier}/{}", l.what),
                    format!("tier {tier}: {} per caller", l.what.replace('_', " ")),
                    l.limit,
                    Scope::PerPrincipal,
                    l.reason,
                    l.meter,
                    l.budget,
                );
                mine.push(i);
            }
            tier_buckets.insert(tier.clone(), mine);
        }
        for (model, m) in &policy.models {
            let rates = [
                (
                    "requests",
                    m.requests,
                    Meter::Requests,
                    Reason::ModelRateLimit,
                ),
                ("tokens", m.tokens, Meter::Tokens, Reason::TokenRateLimit),
            ];
            let mut mine = Vec::new();
            for (what, limit, meter, reason) in rates {
                if let Some(limit) = limit {
                    let name = format!("model {model}: {what}");
                    mine.push(add(
                        format!("model/{model}/{what}"),
                        name,
                        limit,
                        Scope::Global,
                        reason,
                        meter,
                        None,
                    ));
                }
            }
            model_buckets.insert(model.clone(), mine);
        }
        let route_buckets = policy
            .routes
            .iter()
            .map(|route| {
                let i = add(
                    format!("route/{}/requests", route.name),
                    format!("route {}: requests", route.name),
                    route.requests,
                    Scope::Global,
                    Reason::RouteRateLimit,
                    Meter::Requests,
                    None,
                );
                // Matched against the canonical path (see `canonical_path`),
                // so the prefix is compared in that form too.
                let prefix = request::canonical_path(&route.path_prefix)
                    .unwrap_or_else(|_| route.path_prefix.to_ascii_lowercase());
                (prefix, i)
            })
            .collect();
        for (tier, list) in &tier_buckets {
            for &i in list {
                if buckets[i].rule.scope == Scope::Global {
                    buckets[i].anonymous = true;
                } else {
                    buckets[i].tier = Some(tier.clone());
                }
            }
        }
        let pricing = policy
            .models
            .iter()
            .map(|(name, m)| {
                let micro = |per_1k: f64| (per_1k * 1e6).round().max(0.0) as u64;
                let p = match (m.price, m.gpu) {
                    (Some(p), _) => Pricing {
                        input_per_1k: micro(p.input_per_1k),
                        output_per_1k: micro(p.output_per_1k),
                    },
                    (None, Some(g)) => {
                        // GPU cost per hour over the tokens it serves per hour.
                        let per_1k =
                            micro(g.cost_per_hour * 1000.0 / (g.tokens_per_second * 3600.0));
                        Pricing {
                            input_per_1k: per_1k,
                            output_per_1k: per_1k,
                        }
                    }
                    (None, None) => Pricing::default(),
                };
                (name.clone(), p)
            })
            .collect();
        Engine {
            resolver: Resolver::new(&policy),
            policy,
            buckets,
            tier_buckets,
            model_buckets,
            route_buckets,
            pricing,
        }
    }

    /// Every bucket the policy defines.
    pub fn rules(&self) -> Vec<Rule> {
        self.buckets.iter().map(|b| b.rule.clone()).collect()
    }

    /// Creates every shared-data key the policy can use (a bounded set:
    /// see `reservation`), with dedicated keys for each declared API key
    /// in its tier's per-caller buckets. Returns how many were new.
    pub fn prepare(&self, store: &dyn SharedStore) -> Result<usize, StoreError> {
        let declared = self.resolver.declared();
        let rules: Vec<(Rule, Vec<String>)> = self
            .buckets
            .iter()
            .map(|b| {
                let mine = declared
                    .iter()
                    .filter(|(_, tier)| Some(tier) == b.tier.as_ref())
                    .map(|(principal, _)| principal.clone())
                    .collect();
                (b.rule.clone(), mine)
            })
            .collect();
        prepare(store, &rules, &self.layout())
    }

    fn layout(&self) -> Layout {
        let s = &self.policy.state;
        Layout {
            slots: s.principal_slots,
            sketch_width: s.sketch_width,
            hold_ms: s.slot_hold_ms,
        }
    }

    fn reserver<'a>(&self, store: &'a dyn SharedStore) -> Reserver<'a> {
        Reserver {
            store,
            layout: self.layout(),
            max_retries: self.policy.state.cas_max_retries,
        }
    }

    /// Step 1: who is calling. A refusal (unknown API key) is a verdict.
    pub fn identify(&self, req: &dyn RequestView) -> Result<Identity, Box<Verdict>> {
        self.resolver.resolve(req).map_err(|refusal| {
            let reply = answer::rejected(Reason::Unauthenticated, refusal.message(), None);
            Box::new(self.refused(
                reply,
                Reason::Unauthenticated,
                &self.policy.default_tier,
                None,
            ))
        })
    }

    /// Must this admitted request be settled after its response? When it
    /// holds token or spend units, and whenever the global spend breaker
    /// watches spend (else a tier with request limits only would spend
    /// without the breaker ever seeing it).
    pub fn settles(&self, plan: &Plan) -> bool {
        plan.settles() || self.policy.anomaly.is_some()
    }

    /// 400 for a path that reads differently decoded once or twice.
    pub fn ambiguous_path(&self, identity: &Identity) -> Verdict {
        let reply = answer::rejected(
            Reason::InvalidRequest,
            "The request path is ambiguous (an escape that decodes to another escape or to a control character).",
            None,
        );
        self.refused(reply, Reason::InvalidRequest, &identity.tier, None)
    }

    /// The body cap, checked against a declared or an accumulated size.
    pub fn too_large(&self, identity: &Identity, size: u64) -> Option<Verdict> {
        let cap = self.policy.request.max_body_bytes;
        (size > cap).then(|| {
            let reply = answer::rejected(
                Reason::RequestTooLarge,
                &format!("The request body is larger than the {cap}-byte limit."),
                None,
            );
            self.refused(reply, Reason::RequestTooLarge, &identity.tier, None)
        })
    }

    /// Step 2: what the body asks for (APIs sluice does not read give none).
    pub fn demand(
        &self,
        identity: &Identity,
        api: Api,
        body: &[u8],
    ) -> Result<Option<Asked>, Box<Verdict>> {
        if !api.reads_body() {
            return Ok(None);
        }
        let cap = |model: &str| self.output_cap(model);
        match request::parse_body(api, body, &cap) {
            Ok((demand, body)) => {
                let input_raw = estimate::input_tokens(&body);
                Ok(Some(Asked {
                    demand,
                    body,
                    input_raw,
                }))
            }
            Err(bad) => {
                let reply =
                    answer::rejected(Reason::InvalidRequest, &bad.message, bad.param.as_deref());
                Err(Box::new(self.refused(
                    reply,
                    Reason::InvalidRequest,
                    &identity.tier,
                    None,
                )))
            }
        }
    }

    /// Step 3: where the request may go, given the sidecar's state and the
    /// upstream's recent answers.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        seen: &Seen,
        pushback: &Pushback,
        identity: &Identity,
        api: Api,
        asked: Option<&Asked>,
        now_ms: u64,
        dice: u32,
    ) -> Routed {
        let model = asked.and_then(|a| a.demand.model.as_deref());
        let backend = model
            .and_then(|m| self.policy.models.get(m))
            .map_or("local", |m| m.backend.as_str());
        let sidecar = self.policy.sidecar.as_ref();
        let situation = Situation {
            seen,
            stale_after_ms: sidecar.map_or(u64::MAX, |s| s.stale_after_ms),
            on_stale: sidecar.map_or(OnStale::FailOpen, |s| s.on_stale),
            model,
            backend,
            upstream: pushback.record,
            credential_paused_until_ms: pushback.credential_paused_until_ms,
            caller: pushback.caller,
            has_fallback: self.policy.fallback.is_some(),
            static_when_out: self
                .policy
                .static_fallback
                .as_ref()
                .is_some_and(|s| s.when_primary_out),
            default_retry_after_s: sidecar.map_or(30, |s| s.retry_after_ms / 1000),
            now_ms,
            dice,
        };
        match health::route(&situation) {
            Route::Primary => Routed::Primary,
            Route::Fallback => Routed::Fallback,
            Route::Probe => Routed::Probe,
            Route::Static => {
                let text = self.static_text(asked.map(|a| &a.body));
                let stream = asked.is_some_and(|a| a.demand.stream);
                let reply = answer::static_answer(
                    api,
                    model.unwrap_or("sluice-static"),
                    &text,
                    stream,
                    now_ms,
                );
                let mut verdict =
                    self.refused(reply, Reason::UpstreamUnhealthy, &identity.tier, model);
                verdict.labels.decision = Decision::Degrade(Degraded::Static);
                verdict.degraded = Some(Degraded::Static);
                Routed::Answered(Box::new(verdict))
            }
            Route::Refuse {
                reason,
                retry_after_s,
                why,
            } => {
                let reply = answer::unavailable(reason, &why, retry_after_s);
                Routed::Answered(Box::new(self.refused(reply, reason, &identity.tier, model)))
            }
        }
    }

    /// The canned answer for a body's last user prompt, else the message.
    fn static_text(&self, body: Option<&Value>) -> String {
        let Some(cfg) = &self.policy.static_fallback else {
            return crate::config::StaticFallback::default_message();
        };
        let prompt = body.map(prompt_text).unwrap_or_default();
        let key = health::normalize_prompt(&prompt);
        cfg.answers
            .iter()
            .find(|(k, _)| health::normalize_prompt(k) == key)
            .map_or_else(|| cfg.message.clone(), |(_, v)| v.clone())
    }

    /// Step 4: reserve every bucket that applies, all or nothing; lower the
    /// output a hard token budget cannot cover; downshift over a soft cap.
    pub fn admit(
        &self,
        store: &dyn SharedStore,
        identity: &Identity,
        api: Api,
        path: &str,
        asked: Option<&Asked>,
        now_ms: u64,
    ) -> Verdict {
        if let Some(verdict) = self.global_breaker(store, identity, asked, now_ms) {
            return verdict;
        }
        let reserver = self.reserver(store);
        let requested_model = asked.and_then(|a| a.demand.model.clone());
        let input_raw = asked.map_or(0.0, |a| a.input_raw);
        let input = match (asked, &requested_model) {
            (Some(_), Some(m)) => self.correction(store, m).apply(input_raw),
            (Some(_), None) => Correction::default().apply(input_raw),
            (None, _) => 0,
        };
        let produces_output = asked.is_some() && api != Api::OpenAiEmbeddings;
        let requested_out = asked.and_then(|a| a.demand.max_output);
        // Each choice (`n`, `best_of`) may produce the maximum: the output
        // reserved is the maximum times the choices. Both are capped at
        // parse time, so the product cannot wrap (saturating all the same).
        let choices = asked.map_or(1, |a| a.demand.choices.max(1));
        let mut per_choice = match (produces_output, requested_out) {
            (false, _) => 0,
            (true, Some(max)) => max,
            (true, None) => self.default_output(requested_model.as_deref()),
        };
        let mut output = per_choice.saturating_mul(choices);
        let downshift = asked.and_then(|_| {
            self.downshift(
                &reserver,
                identity,
                requested_model.as_deref(),
                path,
                input,
                output,
                now_ms,
            )
        });
        let model = downshift.clone().or(requested_model.clone());
        let degraded = downshift.is_some().then_some(Degraded::Downshift);
        let labels = |decision| Labels {
            decision,
            tier: identity.tier.clone(),
            model: self.model_label(model.as_deref()),
        };

        // Reserve; when a hard token budget cannot cover the maximum output,
        // ask the model for only what it still covers (no overshoot).
        let mut effort = Contention::default();
        let pricing = self.pricing_of(model.as_deref());
        let applying = self.applying(identity, model.as_deref(), path);
        let mut lowered = false;
        let (reservation, taken) = loop {
            let taken: Vec<usize> = applying
                .iter()
                .copied()
                .filter(|&i| self.buckets[i].meter.amount(input, output, pricing) > 0)
                .collect();
            let claims: Vec<Claim> = taken
                .iter()
                .map(|&i| {
                    let b = &self.buckets[i];
                    Claim {
                        rule: &b.rule,
                        amount: b.meter.amount(input, output, pricing),
                        soft: b.soft,
                    }
                })
                .collect();
            match reserver.reserve(&claims, caller(identity), now_ms, &mut effort) {
                Ok(reservation) => break (reservation, taken),
                Err(Refusal::Full { index, shortfall }) if produces_output => {
                    let room = shortfall.quota.remaining;
                    let allowed = match self.buckets[taken[index]].meter {
                        Meter::Tokens => room.saturating_sub(input),
                        Meter::OutputTokens => room,
                        _ => 0,
                    };
                    let allowed_per_choice = allowed / choices;
                    if allowed_per_choice >= MIN_LOWERED_OUTPUT && allowed_per_choice < per_choice {
                        per_choice = allowed_per_choice;
                        output = per_choice.saturating_mul(choices);
                        lowered = true;
                        continue;
                    }
                    let refusal = Refusal::Full { index, shortfall };
                    return self.refusal(refusal, &taken, identity, labels, effort, now_ms);
                }
                Err(refusal) => {
                    return self.refusal(refusal, &taken, identity, labels, effort, now_ms)
                }
            }
        };

        let meters: Vec<Meter> = taken.iter().map(|&i| self.buckets[i].meter).collect();
        let (mut headers, alerts) = self.admitted_headers(&reservation.quotas, &taken);
        if let Some(kind) = degraded {
            headers.push(("x-sluice-degraded".into(), kind.code().into()));
        }
        let (body, strip_usage) = match asked {
            Some(asked) => {
                let new_output =
                    (produces_output && (lowered || requested_out.is_none())).then_some(per_choice);
                rewrite(api, asked, downshift.as_deref(), new_output)
            }
            None => (None, false),
        };
        let plan = asked.map(|a| Plan {
            held: reservation.held,
            meters,
            api,
            model: model.clone(),
            input_raw,
            input_estimate: input,
            max_output: output,
            stream: a.demand.stream,
            strip_usage,
            pricing,
        });
        Verdict {
            reply: None,
            response_headers: headers,
            body,
            labels: labels(Decision::Admit),
            contention: effort,
            no_slot: false,
            plan,
            alerts,
            degraded,
            bucket: None,
        }
    }

    /// Over a soft cap, the model's cheaper model (`downshift_to`), if it
    /// has one. A peek, not a reservation: soft caps tolerate the race.
    #[allow(clippy::too_many_arguments)]
    fn downshift(
        &self,
        reserver: &Reserver,
        identity: &Identity,
        model: Option<&str>,
        path: &str,
        input: u64,
        output: u64,
        now_ms: u64,
    ) -> Option<String> {
        let target = self.policy.models.get(model?)?.downshift_to.clone()?;
        let pricing = self.pricing_of(model);
        let over_soft = self.applying(identity, model, path).iter().any(|&i| {
            let b = &self.buckets[i];
            b.soft && {
                let claim = Claim::hard(&b.rule, b.meter.amount(input, output, pricing));
                reserver.peek(&claim, caller(identity), now_ms).remaining < claim.amount
            }
        });
        over_soft.then_some(target)
    }

    /// The 429 of the bucket that refused (`taken[index]`).
    fn refusal(
        &self,
        refusal: Refusal,
        taken: &[usize],
        identity: &Identity,
        labels: impl Fn(Decision) -> Labels,
        mut effort: Contention,
        now_ms: u64,
    ) -> Verdict {
        let (index, quota, retry_after_ms) = match refusal {
            Refusal::NoSlot {
                index,
                retry_after_ms,
            } => {
                let bucket = &self.buckets[taken[index]];
                let reason = Reason::CapacityExhausted;
                let reply = answer::capacity_exhausted(
                    retry_after_ms,
                    &identity.tier,
                    &bucket.name,
                    now_ms,
                );
                return Verdict {
                    reply: Some(reply),
                    response_headers: Vec::new(),
                    body: None,
                    labels: labels(Decision::Refuse(reason)),
                    contention: effort,
                    no_slot: true,
                    plan: None,
                    alerts: Vec::new(),
                    degraded: None,
                    bucket: Some(bucket.rule.id.clone()),
                };
            }
            Refusal::Full { index, shortfall } => {
                (index, shortfall.quota, shortfall.retry_after_ms)
            }
            // Lost every CAS race (counted where it was lost) or the host
            // refused the write (counted here): refuse by that bucket,
            // briefly.
            Refusal::Contended { index } | Refusal::Host { index, .. } => {
                if matches!(refusal, Refusal::Host { .. }) {
                    effort.cas_exhausted = effort.cas_exhausted.saturating_add(1);
                }
                let limit = self.buckets[taken[index]].rule.limit.capacity();
                (
                    index,
                    Quota {
                        limit,
                        remaining: 0,
                        reset_ms: 1_000,
                    },
                    1_000,
                )
            }
        };
        let bucket = &self.buckets[taken[index]];
        let limit_text = bucket.rule.limit.describe();
        let reply = answer::limited(
            &Limited {
                reason: bucket.reason,
                quota,
                retry_after_ms,
                tier: &identity.tier,
                bucket: &bucket.name,
                limit_text: &limit_text,
            },
            now_ms,
        );
        Verdict {
            reply: Some(reply),
            response_headers: Vec::new(),
            body: None,
            labels: labels(Decision::Refuse(bucket.reason)),
            contention: effort,
            no_slot: false,
            plan: None,
            alerts: Vec::new(),
            degraded: None,
            bucket: Some(bucket.rule.id.clone()),
        }
    }

    /// Headers of an admitted request: the tightest request bucket as
    /// `X-RateLimit-*`, the tightest token bucket as `X-RateLimit-*-Tokens`
    /// (OpenAI's names), and budget alerts past their threshold.
    fn admitted_headers(
        &self,
        quotas: &[Quota],
        taken: &[usize],
    ) -> (Vec<(String, String)>, Vec<String>) {
        let share_left = |q: &Quota| {
            (
                q.remaining as u128 * 1_000_000 / q.limit.max(1) as u128,
                std::cmp::Reverse(q.reset_ms),
            )
        };
        let tightest = |want: fn(Meter) -> bool| {
            quotas
                .iter()
                .zip(taken)
                .filter(|(_, &i)| want(self.buckets[i].meter))
                .map(|(q, _)| *q)
                .min_by_key(share_left)
        };
        let mut headers = Vec::new();
        if let Some(q) = tightest(|m| m == Meter::Requests).or_else(|| tightest(|_| true)) {
            headers.extend(answer::rate_limit_headers(&q));
        }
        if let Some(q) =
            tightest(|m| matches!(m, Meter::Tokens | Meter::InputTokens | Meter::OutputTokens))
        {
            headers.extend(
                answer::rate_limit_headers(&q)
                    .into_iter()
                    .map(|(n, v)| (format!("{n}-tokens"), v)),
            );
        }
        let mut alerts = Vec::new();
        for (q, &i) in quotas.iter().zip(taken) {
            let b = &self.buckets[i];
            if let Some(alert) = b.alert_permille {
                let used_permille =
                    1000 - (q.remaining as u128 * 1000 / q.limit.max(1) as u128) as u32;
                if used_permille >= alert {
                    alerts.push(format!("{}: {}% used", b.name, used_permille / 10));
                }
            }
        }
        if !alerts.is_empty() {
            headers.push(("x-sluice-budget-alert".into(), alerts.join("; ")));
        }
        (headers, alerts)
    }

    /// Step 5: replace the reservation with what the response really cost.
    /// Usage from the upstream wins; without (believable) usage, the input
    /// estimate and the output counted in the stream. An upstream error
    /// costs nothing.
    pub fn settle(
        &self,
        store: &dyn SharedStore,
        plan: &Plan,
        found: Found,
        output_counted: u64,
        upstream_ok: bool,
        now_ms: u64,
    ) -> (Settled, Contention) {
        let (input, output, from_usage) = match found {
            Found::Usage(u) => (u.input, u.output, true),
            _ if !upstream_ok => (0, 0, false),
            _ => (plan.input_estimate, output_counted, false),
        };
        let reserver = self.reserver(store);
        let mut effort = Contention::default();
        let mut charges_unwritten = 0;
        for (held, meter) in plan.held.iter().zip(&plan.meters) {
            if *meter != Meter::Requests {
                let actual = meter.amount(input, output, plan.pricing);
                if !reserver.settle(held, actual, now_ms, &mut effort) && actual > held.amount {
                    charges_unwritten += 1;
                }
            }
        }
        if from_usage && input > 0 {
            if let Some(model) = &plan.model {
                self.learn(store, model, plan.input_raw, input, &mut effort);
            }
        }
        let cost = plan.pricing.cost(input, output);
        let (surge, global_open) =
            self.record_usage(store, input + output, cost, now_ms, &mut effort);
        let settled = Settled {
            input,
            output,
            from_usage,
            invalid_usage: found == Found::Invalid,
            cost,
            surge,
            global_open,
            charges_unwritten,
        };
        (settled, effort)
    }

    /// Gives back everything an admitted request reserved, when it is
    /// answered here after all (it lost the half-open probe to another).
    pub fn release(&self, store: &dyn SharedStore, plan: &Plan, now_ms: u64) -> Contention {
        let mut effort = Contention::default();
        self.reserver(store)
            .release(&plan.held, now_ms, &mut effort);
        effort
    }

    /// 503 `global_breaker_open` while the last hour's spend, all callers
    /// together, is at the ceiling.
    fn global_breaker(
        &self,
        store: &dyn SharedStore,
        identity: &Identity,
        asked: Option<&Asked>,
        now_ms: u64,
    ) -> Option<Verdict> {
        let a = self.policy.anomaly.as_ref()?;
        let ceiling = (a.max_spend_per_hour?.limit * 1e6).round() as u64;
        let (bytes, _) = store.get(USAGE_KEY)?;
        let reading = UsageRing::decode(&bytes).read(a.baseline_minutes as usize, now_ms);
        if reading.spend_last_hour < ceiling {
            return None;
        }
        // The oldest minute leaves the window within a minute.
        let retry_after_s = 60 - (now_ms / 1000) % 60;
        let why = format!(
            "spend in the last hour reached the {:.2} ceiling",
            ceiling as f64 / 1e6
        );
        let reply = answer::unavailable(Reason::GlobalBreakerOpen, &why, retry_after_s);
        let model = asked.and_then(|a| a.demand.model.as_deref());
        Some(self.refused(reply, Reason::GlobalBreakerOpen, &identity.tier, model))
    }

    /// Adds a settled request to the global per-minute ring; says whether
    /// its minute is a new surge and whether the spend ceiling is reached.
    /// Exhausted (counted): this request's usage is missing from the ring,
    /// which only makes the surge and spend ceiling see less.
    fn record_usage(
        &self,
        store: &dyn SharedStore,
        tokens: u64,
        cost: u64,
        now_ms: u64,
        contention: &mut Contention,
    ) -> (bool, bool) {
        let Some(a) = &self.policy.anomaly else {
            return (false, false);
        };
        let mut seen = (false, false);
        let tries = self.policy.state.cas_max_retries;
        let written = store::update(store, USAGE_KEY, tries, contention, |bytes| {
            let mut ring = UsageRing::decode(bytes.unwrap_or_default());
            ring.add(tokens, cost, now_ms);
            let reading = ring.read(a.baseline_minutes as usize, now_ms);
            let minute = now_ms / 60_000;
            let surge = reading.baseline > 0
                && reading.tokens_this_minute as f64 > reading.baseline as f64 * a.surge_ratio
                && ring.surge_flagged != minute;
            if surge {
                ring.surge_flagged = minute;
            }
            let ceiling = a.max_spend_per_hour.map(|b| (b.limit * 1e6).round() as u64);
            seen = (surge, ceiling.is_some_and(|c| reading.spend_last_hour >= c));
            Some(ring.encode())
        });
        if written == Updated::Written {
            seen
        } else {
            (false, false)
        }
    }

    /// Indexes of the buckets that apply to a request, in the order they
    /// are taken (the first that refuses decides the answer).
    fn applying(&self, identity: &Identity, model: Option<&str>, path: &str) -> Vec<usize> {
        let none = Vec::new();
        self.tier_buckets
            .get(&identity.tier)
            .unwrap_or(&none)
            .iter()
            .filter(|&&i| !(identity.declared && self.buckets[i].anonymous))
            .chain(
                model
                    .and_then(|m| self.model_buckets.get(m))
                    .unwrap_or(&none),
            )
            .copied()
            .chain(
                self.route_buckets
                    .iter()
                    .filter(|(prefix, _)| path.starts_with(prefix.as_str()))
                    .map(|(_, i)| *i),
            )
            .collect()
    }

    /// The most output one choice of `model` may ask for.
    fn output_cap(&self, model: &str) -> u64 {
        self.policy
            .models
            .get(model)
            .and_then(|m| m.max_output)
            .unwrap_or(self.policy.request.max_output)
    }

    fn default_output(&self, model: Option<&str>) -> u64 {
        model
            .and_then(|m| self.policy.models.get(m))
            .and_then(|m| m.default_max_output)
            .unwrap_or(self.policy.defaults.max_output_tokens)
    }

    fn pricing_of(&self, model: Option<&str>) -> Pricing {
        model
            .and_then(|m| self.pricing.get(m))
            .copied()
            .unwrap_or_default()
    }

    /// The learned estimate correction of a configured model (others: 1.0).
    fn correction(&self, store: &dyn SharedStore, model: &str) -> Correction {
        if !self.policy.models.contains_key(model) {
            return Correction::default();
        }
        store
            .get(&format!("{CORRECTION_KEY}{model}"))
            .map_or(Correction::default(), |(bytes, _)| {
                Correction::decode(&bytes)
            })
    }

    /// Moves the model's estimate correction towards this sample. A sample
    /// that loses every race (counted) is dropped: the next one will do.
    fn learn(
        &self,
        store: &dyn SharedStore,
        model: &str,
        raw: f64,
        actual: u64,
        contention: &mut Contention,
    ) {
        if !self.policy.models.contains_key(model) {
            return;
        }
        let key = format!("{CORRECTION_KEY}{model}");
        let tries = self.policy.state.cas_max_retries;
        store::update(store, &key, tries, contention, |bytes| {
            let current = bytes.map_or(Correction::default(), Correction::decode);
            current.learn(raw, actual).map(|next| next.encode())
        });
    }

    /// `model` as a metric label: configured models by name, others as
    /// `other`, none as `none`, so a client cannot mint label values.
    pub fn model_label(&self, model: Option<&str>) -> String {
        match model {
            None => "none".into(),
            Some(m) if self.policy.models.contains_key(m) => m.into(),
            Some(_) => "other".into(),
        }
    }

    pub(crate) fn refused(
        &self,
        reply: Reply,
        reason: Reason,
        tier: &str,
        model: Option<&str>,
    ) -> Verdict {
        Verdict {
            reply: Some(reply),
            response_headers: Vec::new(),
            body: None,
            labels: Labels {
                decision: Decision::Refuse(reason),
                tier: tier.into(),
                model: self.model_label(model),
            },
            contention: Contention::default(),
            no_slot: false,
            plan: None,
            alerts: Vec::new(),
            degraded: None,
            bucket: None,
        }
    }

    /// The principal as the audit log shows it: a salted SHA-256, never the
    /// raw key, address or subject.
    pub fn audit_principal(&self, identity: &Identity) -> String {
        let salt = self.policy.audit.as_ref().map_or("", |a| a.salt.as_str());
        let salted = format!("{salt}\n{}", identity.principal);
        crate::principal::sha256_hex(salted.as_bytes())[..32].to_string()
    }
}

/// Who takes from the buckets: declared API keys by name (they have
/// dedicated keys), everyone else by hash.
fn caller(identity: &Identity) -> Caller<'_> {
    Caller {
        hash: identity.hash,
        declared: identity.declared.then_some(identity.principal.as_str()),
    }
}

/// One limit of a tier's (or its anonymous total's) configuration.
struct TierLimit {
    what: &'static str,
    limit: Limit,
    meter: Meter,
    reason: Reason,
    budget: Option<Budget>,
}

/// The limits a `TierConfig` sets, in the order they are taken.
fn tier_limits(t: &crate::config::TierConfig) -> Vec<TierLimit> {
    let rates = [
        (
            "requests",
            t.requests,
            Meter::Requests,
            Reason::UserRateLimit,
        ),
        ("tokens", t.tokens, Meter::Tokens, Reason::TokenRateLimit),
        (
            "input_tokens",
            t.input_tokens,
            Meter::InputTokens,
            Reason::TokenRateLimit,
        ),
        (
            "output_tokens",
            t.output_tokens,
            Meter::OutputTokens,
            Reason::TokenRateLimit,
        ),
    ];
    let budgets = [
        (
            "daily_tokens",
            t.daily_tokens,
            Window::Day,
            Meter::Tokens,
            Reason::DailyBudgetExceeded,
        ),
        (
            "monthly_tokens",
            t.monthly_tokens,
            Window::Month,
            Meter::Tokens,
            Reason::MonthlyBudgetExceeded,
        ),
        (
            "daily_spend",
            t.daily_spend,
            Window::Day,
            Meter::Spend,
            Reason::SpendCapExceeded,
        ),
        (
            "monthly_spend",
            t.monthly_spend,
            Window::Month,
            Meter::Spend,
            Reason::SpendCapExceeded,
        ),
    ];
    let mut out: Vec<TierLimit> = rates
        .into_iter()
        .filter_map(|(what, limit, meter, reason)| {
            limit.map(|limit| TierLimit {
                what,
                limit,
                meter,
                reason,
                budget: None,
            })
        })
        .collect();
    out.extend(
        budgets
            .into_iter()
            .filter_map(|(what, budget, window, meter, reason)| {
                budget.map(|b| {
                    let units = if meter == Meter::Spend {
                        (b.limit * 1e6).round() as u64
                    } else {
                        b.limit as u64
                    };
                    TierLimit {
                        what,
                        limit: Limit::windowed(units.max(1), window),
                        meter,
                        reason,
                        budget: Some(b),
                    }
                })
            }),
    );
    out
}

/// The last user prompt of a request, as text.
fn prompt_text(body: &Value) -> String {
    let text_of = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str).or(p.as_str()))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        if let Some(last) = messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        {
            return last.get("content").map(text_of).unwrap_or_default();
        }
    }
    ["prompt", "input"]
        .iter()
        .find_map(|k| body.get(*k))
        .map(text_of)
        .unwrap_or_default()
}

/// The body the upstream gets: the served model (downshift), the output
/// reserved (`new_output`), and, for streams, a request for the usage chunk
/// (which the client then does not see: the second value).
fn rewrite(
    api: Api,
    asked: &Asked,
    model: Option<&str>,
    new_output: Option<u64>,
) -> (Option<Vec<u8>>, bool) {
    let wants_usage = matches!(api, Api::OpenAiChat | Api::OpenAiCompletions)
        && asked.demand.stream
        && asked
            .body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            != Some(true);
    if model.is_none() && new_output.is_none() && !wants_usage {
        return (None, false); // the client's body goes up as it came
    }
    let mut json = asked.body.clone();
    if let Some(m) = model {
        json["model"] = Value::String(m.to_string());
    }
    if let Some(max) = new_output {
        set_max_output(api, &mut json, max);
    }
    if wants_usage {
        if !json.get("stream_options").is_some_and(Value::is_object) {
            json["stream_options"] = Value::Object(Default::default());
        }
        json["stream_options"]["include_usage"] = Value::Bool(true);
    }
    (Some(json.to_string().into_bytes()), wants_usage)
}

/// Writes the output limit where each API reads it.
fn set_max_output(api: Api, json: &mut Value, max: u64) {
    match api {
        Api::OpenAiChat
            if json
                .get("max_completion_tokens")
                .is_some_and(|v| !v.is_null()) =>
        {
            json["max_completion_tokens"] = max.into();
        }
        Api::OpenAiChat | Api::OpenAiCompletions => json["max_tokens"] = max.into(),
        Api::OpenAiResponses => json["max_output_tokens"] = max.into(),
        Api::OllamaGenerate | Api::OllamaChat => {
            if !json.get("options").is_some_and(Value::is_object) {
                json["options"] = Value::Object(Default::default());
            }
            json["options"]["num_predict"] = max.into();
        }
        Api::OpenAiEmbeddings | Api::Other => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::Usage;
    use crate::store::MemStore;
    use serde_json::json;

    struct Caller(&'static str);
    impl RequestView for Caller {
        fn header(&self, _: &str) -> Option<String> {
            None
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some(self.0.into())
        }
    }

    fn engine_with(policy: Value) -> (Engine, MemStore) {
        let e = Engine::new(Policy::from_value(policy).unwrap());
        let store = MemStore::default();
        e.prepare(&store).unwrap();
        (e, store)
    }

    fn engine() -> (Engine, MemStore) {
        engine_with(json!({
            "default_tier": "free",
            "tiers": {"free": {"requests": "10/min"}},
            "models": {"big": {"requests": "3/min"}},
            "routes": [{"name": "chat", "path_prefix": "/v1/chat/", "requests": "100/s"}],
        }))
    }

    fn asked(e: &Engine, body: Value) -> Asked {
        let id = e.identify(&Caller("9.9.9.9:1")).unwrap();
        e.demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
            .unwrap()
            .unwrap()
    }

    fn chat(model: &str, max_tokens: u64) -> Value {
        json!({"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
    }

    #[test]
    fn free_tier_gets_ten_then_a_full_429() {
        let (e, store) = engine();
        let id = e.identify(&Caller("10.0.0.1:1234")).unwrap();
        let results: Vec<Verdict> = (0..12)
            .map(|_| e.admit(&store, &id, Api::Other, "/v1/models", None, 1_000))
            .collect();
        assert_eq!(results.iter().filter(|v| v.reply.is_none()).count(), 10);
        assert_eq!(
            results[0].response_headers[1],
            ("x-ratelimit-remaining".into(), "9".into())
        );
        let refused = results[11].reply.as_ref().unwrap();
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-sluice-reason"), Some("user_rate_limit"));
        assert_eq!(results[11].labels.decision.reason_code(), "user_rate_limit");
    }

    #[test]
    fn model_limit_applies_across_callers_and_labels_are_bounded() {
        let (e, store) = engine();
        let big = asked(&e, chat("big", 10));
        for caller in ["1.1.1.1:1", "2.2.2.2:1", "3.3.3.3:1"] {
            let id = e.identify(&Caller(caller)).unwrap();
            assert!(e
                .admit(
                    &store,
                    &id,
                    Api::OpenAiChat,
                    "/v1/chat/completions",
                    Some(&big),
                    0
                )
                .reply
                .is_none());
        }
        let id = e.identify(&Caller("4.4.4.4:1")).unwrap();
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&big),
            0,
        );
        assert_eq!(v.labels.decision.reason_code(), "model_rate_limit");
        assert_eq!(v.labels.model, "big");
        let other = asked(&e, chat("gpt-made-up", 10));
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&other),
            0,
        );
        assert!(v.reply.is_none());
        assert_eq!(v.labels.model, "other");
    }

    #[test]
    fn token_budget_admits_exactly_what_fits_and_settles_to_usage() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 10_000}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("m", 490));
        let mut plans = Vec::new();
        for _ in 0..30 {
            let v = e.admit(
                &store,
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&a),
                0,
            );
            if let Some(plan) = v.plan.filter(|_| v.reply.is_none()) {
                plans.push(plan);
            }
        }
        let each = plans[0].input_estimate + 490;
        let full = plans.iter().filter(|p| p.max_output == 490).count() as u64;
        assert_eq!(full, 10_000 / each, "reserved {each} each");
        // What was left is given to one more request, with its output
        // lowered to fit: never a token over the budget.
        let reserved: u64 = plans.iter().map(|p| p.input_estimate + p.max_output).sum();
        assert!(
            reserved <= 10_000 && 10_000 - reserved < MIN_LOWERED_OUTPUT + each,
            "{reserved}"
        );
        // The real usage is smaller: settling frees room for more.
        for p in &plans {
            let usage = Found::Usage(Usage {
                input: 10,
                output: 90,
            });
            let (s, _) = e.settle(&store, p, usage, 0, true, 0);
            assert_eq!((s.input, s.output, s.from_usage), (10, 90, true));
        }
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert!(v.reply.is_none());
    }

    #[test]
    fn output_is_lowered_to_what_a_hard_budget_covers() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 1_000}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("m", 800));
        let first = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert!(
            first.reply.is_none() && first.body.is_none(),
            "fits as asked"
        );
        let second = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert!(second.reply.is_none());
        let body: Value = serde_json::from_slice(&second.body.unwrap()).unwrap();
        let lowered = body["max_tokens"].as_u64().unwrap();
        let plan = second.plan.unwrap();
        assert_eq!(lowered, plan.max_output);
        assert_eq!(
            first.plan.unwrap().input_estimate * 2 + 800 + lowered,
            1_000
        );
        let third = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert_eq!(third.labels.decision.reason_code(), "daily_budget_exceeded");
        let reply = third.reply.unwrap();
        let json: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(json["error"]["code"], "daily_budget_exceeded");
        assert!(json["error"]["sluice"]["reset_at"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00Z"));
    }

    #[test]
    fn soft_cap_downshifts_and_alerts() {
        let (e, store) = engine_with(json!({
            "default_tier": "pro",
            "tiers": {"pro": {"daily_tokens": {"limit": 1_000, "mode": "soft", "alert_at": "50%"}}},
            "models": {"big": {"downshift_to": "small"}, "small": {}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("big", 600));
        let first = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert_eq!(first.degraded, None);
        assert_eq!(first.alerts.len(), 1, "{:?}", first.alerts);
        let second = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert!(second.reply.is_none(), "soft caps never refuse");
        assert_eq!(second.degraded.map(Degraded::code), Some("downshift"));
        let body: Value = serde_json::from_slice(&second.body.unwrap()).unwrap();
        assert_eq!(body["model"], "small");
        assert!(second
            .response_headers
            .contains(&("x-sluice-degraded".into(), "downshift".into())));
    }

    #[test]
    fn spend_caps_price_input_and_output() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_spend": 0.1}},
            "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 2.0}}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("paid", 4));
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        let plan = v.plan.unwrap();
        let cost = plan.pricing.cost(plan.input_estimate, 4);
        assert_eq!(cost, plan.input_estimate * 1000 + 8000);
        let a = asked(&e, chat("paid", 5000));
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        assert_eq!(v.labels.decision.reason_code(), "spend_cap_exceeded");
    }

    #[test]
    fn streams_ask_for_usage_and_missing_usage_settles_from_the_estimate() {
        let (e, store) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}}));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let mut body = chat("m", 50);
        body["stream"] = json!(true);
        let a = asked(&e, body);
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            0,
        );
        let rewritten: Value = serde_json::from_slice(&v.body.unwrap()).unwrap();
        assert_eq!(rewritten["stream_options"]["include_usage"], true);
        let plan = v.plan.unwrap();
        assert!(plan.strip_usage);
        let (s, _) = e.settle(&store, &plan, Found::Invalid, 7, true, 0);
        assert_eq!(
            (s.input, s.output, s.from_usage, s.invalid_usage),
            (plan.input_estimate, 7, false, true)
        );
        let (s, _) = e.settle(&store, &plan, Found::Nothing, 0, false, 0);
        assert_eq!(
            (s.input, s.output),
            (0, 0),
            "an upstream error costs nothing"
        );
    }

    #[test]
    fn the_global_breaker_opens_at_the_spend_ceiling() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {}},
            "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 1.0}}},
            "anomaly": {"max_spend_per_hour": 0.05},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("paid", 10));
        let mut opened = false;
        for _ in 0..10 {
            let v = e.admit(
                &store,
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&a),
                0,
            );
            if let Some(reply) = &v.reply {
                assert_eq!(v.labels.decision.reason_code(), "global_breaker_open");
                assert_eq!(reply.status, 503);
                opened = true;
                break;
            }
            let usage = Found::Usage(Usage {
                input: 10_000,
                output: 0,
            });
            e.settle(&store, &v.plan.unwrap(), usage, 0, true, 0);
        }
        assert!(opened, "0.05 spent after 5 requests of 0.01");
        // An hour later the window has slid past it.
        let v = e.admit(
            &store,
            &id,
            Api::OpenAiChat,
            "/v1/chat/completions",
            Some(&a),
            3_600_000,
        );
        assert!(v.reply.is_none());
    }

    struct Keyed(&'static str, &'static str);
    impl RequestView for Keyed {
        fn header(&self, name: &str) -> Option<String> {
            (name == "x-api-key" && !self.0.is_empty()).then(|| self.0.to_string())
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some(self.1.into())
        }
    }

    #[test]
    fn a_flood_leaves_declared_keys_alone_and_new_callers_get_capacity_exhausted() {
        let (e, store) = engine_with(json!({
            "default_tier": "free",
            "identity": {"sources": ["api_key", "client_address"],
                         "api_key": {"keys": {"k-free": "free"}}},
            "tiers": {"free": {"requests": "10/min", "daily_tokens": 5_000,
                               "anonymous_total": {"requests": "1000/min"}}},
            "state": {"principal_slots": 8},
        }));
        let declared = e.identify(&Keyed("k-free", "1.1.1.1:1")).unwrap();
        assert!(declared.declared);
        let admit = |id: &Identity| e.admit(&store, id, Api::Other, "/v1/models", None, 1_000);
        for i in 0..600u32 {
            let addr: &'static str = format!("10.0.{}.{}:1", i / 250, i % 250).leak();
            admit(&e.identify(&Keyed("", addr)).unwrap());
        }
        let late = e.identify(&Keyed("", "192.168.1.1:1")).unwrap();
        assert!(!late.declared);
        let v = admit(&late);
        assert_eq!(v.labels.decision.reason_code(), "capacity_exhausted");
        assert!(v.no_slot);
        let reply = v.reply.unwrap();
        assert_eq!(
            (reply.status, reply.header("retry-after")),
            (429, Some("6"))
        );
        let admitted = (0..10).filter(|_| admit(&declared).reply.is_none()).count();
        assert_eq!(admitted, 10, "the declared key keeps all of its capacity");
    }

    #[test]
    fn the_anonymous_total_binds_undeclared_callers_only() {
        let (e, store) = engine_with(json!({
            "default_tier": "free",
            "identity": {"sources": ["api_key", "client_address"],
                         "api_key": {"keys": {"k-free": "free"}}},
            "tiers": {"free": {"requests": "10/min", "anonymous_total": {"requests": "5/min"}}},
        }));
        let admit = |id: &Identity| e.admit(&store, id, Api::Other, "/v1/models", None, 0);
        let results: Vec<Verdict> = (0..8u8)
            .map(|i| {
                admit(
                    &e.identify(&Keyed("", format!("10.0.0.{i}:1").leak()))
                        .unwrap(),
                )
            })
            .collect();
        assert_eq!(results.iter().filter(|v| v.reply.is_none()).count(), 5);
        assert_eq!(results[7].labels.decision.reason_code(), "anonymous_limit");
        assert_eq!(
            results[7].bucket.as_deref(),
            Some("tier/free/anonymous/requests")
        );
        let declared = e.identify(&Keyed("k-free", "10.0.0.1:1")).unwrap();
        assert!(
            admit(&declared).reply.is_none(),
            "declared keys are outside it"
        );
    }

    #[test]
    fn usage_teaches_the_estimate() {
        let (e, store) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {}}, "models": {"m": {}}}));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let long = "word ".repeat(200);
        let a = asked(
            &e,
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": long}]}),
        );
        let before = e
            .admit(
                &store,
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&a),
                0,
            )
            .plan
            .unwrap();
        for _ in 0..50 {
            let truth = (before.input_raw * 1.5) as u64;
            e.settle(
                &store,
                &before,
                Found::Usage(Usage {
                    input: truth,
                    output: 1,
                }),
                0,
                true,
                0,
            );
        }
        let after = e
            .admit(
                &store,
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&a),
                0,
            )
            .plan
            .unwrap();
        let ratio = after.input_estimate as f64 / before.input_estimate as f64;
        assert!((1.4..1.6).contains(&ratio), "{ratio}");
    }

    #[test]
    fn every_choice_is_reserved_and_lowered_per_choice() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 1_000}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let admit = |body: Value| {
            let a = asked(&e, body);
            e.admit(
                &store,
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&a),
                0,
            )
        };
        let mut body = chat("m", 200);
        body["n"] = json!(4);
        let first = admit(body.clone());
        let plan = first.plan.unwrap();
        assert_eq!(plan.max_output, 800, "4 choices × 200");
        assert!(
            first.body.is_none(),
            "fits as asked: the body goes up untouched"
        );
        // 1,000 − 800 − input left: 4 choices of 200 do not fit any more;
        // each choice is lowered so that all four fit.
        let second = admit(body.clone());
        let plan2 = second.plan.unwrap();
        let sent: Value = serde_json::from_slice(&second.body.unwrap()).unwrap();
        let per_choice = sent["max_tokens"].as_u64().unwrap();
        assert!(
            (MIN_LOWERED_OUTPUT..200).contains(&per_choice),
            "{per_choice}"
        );
        assert_eq!(plan2.max_output, per_choice * 4);
        assert!(plan.input_estimate + 800 + plan2.input_estimate + plan2.max_output <= 1_000);
        // `best_of` counts the same way; past what the budget covers: 429.
        let mut greedy = chat("m", 100);
        greedy["best_of"] = json!(128);
        let refused = admit(greedy);
        assert_eq!(refused.reply.unwrap().status, 429);
    }

    #[test]
    fn the_output_cap_is_the_models_or_the_gateways() {
        let (e, _) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"requests": "10/min"}},
            "models": {"small": {"max_output": 4096}},
            "request": {"max_output": 100_000},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let refused = |body: Value| {
            e.demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
                .err()
                .map(|v| serde_json::from_slice::<Value>(&v.reply.unwrap().body).unwrap())
        };
        let err = refused(chat("small", 4097)).unwrap();
        assert_eq!(err["error"]["param"], "max_tokens");
        assert!(refused(chat("small", 4096)).is_none());
        assert!(refused(chat("other", 100_000)).is_none());
        let err = refused(json!({"model": "other", "max_tokens": u64::MAX})).unwrap();
        assert_eq!(err["error"]["param"], "max_tokens");
    }
}
