//! Admission (step 4): the global spend breaker, then every bucket that
//! applies, all or nothing; a lowered output where a hard token budget
//! cannot cover the maximum; a downshift over a soft cap; the 429 of the
//! bucket that refused, or the headers of an admission.

use super::rewrite::{carries_max_output, rewrite};
use super::*;
use crate::admission::ladder::Served;
use crate::limits::bucket::Shortfall;
use crate::limits::reservation::{Reservation, Share};
use crate::usage::declared::Declared;

/// Who takes from the buckets: declared API keys by name (they have
/// dedicated keys), everyone else by hash.
pub(super) fn caller(identity: &Identity) -> Caller<'_> {
    Caller {
        hash: identity.hash,
        declared: identity.declared.then_some(identity.principal.as_str()),
        run: identity.run.unwrap_or(0),
    }
}

/// What a request asks of the buckets before any lowering, sized the one
/// way admission and the queue's peek both use.
struct Sized {
    requested_model: Option<String>,
    /// Estimated input tokens, corrected per model: what soft budgets and
    /// the audit's estimate use.
    input: u64,
    /// The most input the server can charge (`usage/bound.rs`): what a
    /// hard token or spend budget reserves.
    input_bound: u64,
    /// Output billed beyond the limit (a prediction's text, bounded).
    extra_output: u64,
    /// The API the body speaks (an `/invocations` body's, resolved).
    api: Api,
    produces_output: bool,
    /// Every prompt × `n`/`best_of` (the API's multiplier table).
    choices: u64,
    /// The maximum output of one completion.
    per_choice: u64,
}

/// How a request was admitted, for its plan: the model it asked for (after
/// any downshift), the rung that serves it, the price it is reserved at,
/// whether its output was lowered, whether sluice asked for the usage
/// chunk, and the tier whose estimate it teaches.
struct How<'a> {
    model: Option<String>,
    served: Option<&'a Served>,
    price: ModelPrice,
    lowered: bool,
    strip_usage: bool,
    tier: &'a str,
}

/// What the reservation loop took: the reservation, the buckets taken, and
/// whether the output was lowered to fit a hard token budget.
struct Reserved {
    reservation: Reservation,
    taken: Vec<usize>,
    lowered: bool,
}

impl Sized {
    /// The maximum output of every completion together.
    fn output(&self) -> u64 {
        self.per_choice
            .saturating_mul(self.choices)
            .saturating_add(self.extra_output)
    }

    /// The input a bucket reserves: the bound where the budget is hard,
    /// the estimate where a soft cap or the request count tolerates it.
    fn input_for(&self, bucket: &Bucket) -> u64 {
        match bounded(bucket) {
            true => self.input_bound,
            false => self.input,
        }
    }
}

/// Does this bucket reserve the input's bound, not its estimate? A hard
/// budget (a calendar window: daily, monthly) of tokens, input tokens or
/// spend: what must never be overshot. A rate (`tokens: 10000/min`)
/// refills within the minute and a soft cap only downshifts: they keep the
/// estimate, corrected, and so admit as many requests as before.
pub(super) fn bounded(bucket: &Bucket) -> bool {
    !bucket.soft
        && (bucket.rule.limit.window.is_some() || bucket.rule.scope == Scope::PerRun)
        && matches!(
            bucket.meter,
            Meter::Tokens | Meter::InputTokens | Meter::Spend
        )
}

impl Engine {
    fn size(&self, store: &dyn SharedStore, api: Api, asked: Option<&Asked>, tier: &str) -> Sized {
        // A passthrough rule's model: its request limits apply (no body is
        // read, so nothing else is known of the request).
        let requested_model = asked
            .and_then(|a| a.demand.model.clone())
            .or_else(|| self.passthrough_model(api).map(str::to_string));
        let input = match (asked, &requested_model) {
            // A cache hit that costs no tokens: nothing to estimate (the
            // estimate's floor of one token would be charged at settle,
            // the hit reporting no input).
            (Some(a), _) if a.rendered.free => 0,
            (Some(a), Some(m)) => self.correction(store, m, tier).apply(a.input_raw),
            (Some(a), None) => Correction::default().apply(a.input_raw),
            (None, _) => 0,
        };
        // The bound at the requested model's figures (its buckets are the
        // ones reserved, whoever serves it). Never below the estimate.
        let model = requested_model
            .as_deref()
            .and_then(|m| self.policy.models.get(m));
        let (input_bound, extra_output) = asked.map_or((0, 0), |a| {
            let figures = model.map(|m| m.input_bound).unwrap_or_default();
            let context = model.and_then(|m| m.context_length);
            let bound = a.rendered.tokens(&figures, context).max(input);
            (bound, a.rendered.extra_output)
        });
        let api = asked.map_or(api, |a| a.demand.api);
        let produces_output = asked.is_some() && api.produces_output();
        // Each completion may produce the maximum: the output reserved is
        // the maximum times the completions. All are capped at parse time,
        // so the product cannot wrap (saturating all the same).
        let choices = asked.map_or(1, |a| a.demand.completions().max(1));
        let per_choice = match (produces_output, asked.and_then(|a| a.demand.max_output)) {
            (false, _) => 0,
            (true, Some(max)) => max,
            (true, None) => self.default_output(requested_model.as_deref()),
        };
        Sized {
            requested_model,
            input,
            input_bound,
            extra_output,
            api,
            produces_output,
            choices,
            per_choice,
        }
    }

    /// The buckets a request draws on: the identity's, its model's and
    /// route's, and a passthrough rule's own.
    fn drawn_on(
        &self,
        identity: &Identity,
        api: Api,
        model: Option<&str>,
        path: &str,
    ) -> Vec<usize> {
        let mut applying = self.applying(identity, model, path);
        if let Api::Passthrough(n) = api {
            applying.extend(self.passthrough.get(usize::from(n)).map(|(_, i)| *i));
        }
        applying
    }
}

impl Engine {
    /// Step 4 for the primary: see [`Engine::admit_on`].
    pub fn admit(&self, store: &dyn SharedStore, ctx: &RequestContext) -> Verdict {
        self.admit_on(store, ctx, None)
    }

    /// Step 4: reserve every bucket that applies, all or nothing; lower the
    /// output a hard token budget cannot cover; downshift over a soft cap.
    /// For a rung of the ladder (`served`), spend is reserved at that
    /// provider's price and the body rewritten for it (its model, its
    /// limit field); the buckets are the requested model's.
    pub fn admit_on(
        &self,
        store: &dyn SharedStore,
        ctx: &RequestContext,
        served: Option<&Served>,
    ) -> Verdict {
        let (identity, asked, now_ms) = (ctx.identity, ctx.asked, ctx.now_ms);
        if let Some(verdict) = self.global_breaker(store, identity, asked, now_ms) {
            return verdict;
        }
        let reserver = self.reserver(store);
        let mut sized = self.size(store, ctx.api, asked, &identity.tier);
        let downshift = asked.filter(|_| served.is_none()).and_then(|_| {
            let model = sized.requested_model.as_deref();
            self.downshift(&reserver, ctx, model, sized.input, sized.output())
        });
        let model = downshift.clone().or(sized.requested_model.clone());
        let degraded = downshift.is_some().then_some(Degraded::Downshift);
        let mut effort = Contention::default();
        let price = served
            .and_then(|s| s.price)
            .unwrap_or_else(|| self.price_of(model.as_deref()));
        let mut applying = self.drawn_on(identity, sized.api, model.as_deref(), ctx.path);
        if let Some(served) = served {
            applying.extend(self.provider_buckets(&served.provider));
        }
        let Reserved {
            reservation,
            taken,
            lowered,
        } = match self.reserve_lowering(&reserver, ctx, &applying, &mut sized, price, &mut effort) {
            Ok(reserved) => reserved,
            Err((refusal, taken)) => {
                return self.refusal(refusal, &taken, identity, model.as_deref(), effort, now_ms)
            }
        };
        let (mut headers, alerts) = self.admitted_headers(&reservation.quotas, &taken);
        if let Some(kind) = degraded {
            headers.push("x-sluice-degraded", kind.code());
        }
        let (body, strip_usage) = asked.map_or((None, false), |asked| {
            let declared = self.declared(sized.api);
            upstream_body(&sized, asked, downshift.as_deref(), served, declared)
        });
        // A request without a body settles from `held`, one with a body
        // from its plan: the holds go to one of them, moved.
        let (held, plan) = match asked {
            None => (Some((reservation.held, self.meters_of(&taken))), None),
            Some(a) => {
                let how = How {
                    model: model.clone(),
                    served,
                    price,
                    lowered,
                    strip_usage,
                    tier: &identity.tier,
                };
                (
                    None,
                    Some(self.plan(a, &sized, reservation.held, &taken, how)),
                )
            }
        };
        Verdict::Admit(Admitted {
            response_headers: headers,
            body,
            labels: Labels {
                decision: Decision::Admit,
                tier: identity.tier.clone(),
                model: self.model_label(model.as_deref()),
            },
            contention: effort,
            plan,
            alerts,
            degraded,
            held,
        })
    }

    /// The meters of the buckets taken, in their order.
    fn meters_of(&self, taken: &[usize]) -> Vec<Meter> {
        taken.iter().map(|&i| self.buckets[i].meter).collect()
    }

    /// What an admitted request with a body keeps until it is settled.
    fn plan(
        &self,
        a: &Asked,
        sized: &Sized,
        held: Vec<Held>,
        taken: &[usize],
        how: How<'_>,
    ) -> Plan {
        Plan {
            held,
            meters: taken.iter().map(|&i| self.buckets[i].meter).collect(),
            bounded: taken.iter().map(|&i| bounded(&self.buckets[i])).collect(),
            api: sized.api,
            model: how.model,
            rung: how.served.map(|s| (s.provider.clone(), s.model.clone())),
            input_raw: a.input_raw,
            input_estimate: sized.input,
            input_bound: sized.input_bound,
            tier: how.tier.to_string(),
            background: a.background,
            max_output: sized.output(),
            stream: a.demand.stream,
            strip_usage: how.strip_usage,
            price: how.price,
            output_lowered: how.lowered,
            answer_at: self.declared(sized.api).map(|d| d.answer.clone()),
        }
    }

    /// Reserves every applying bucket that counts something, all or
    /// nothing. When a hard token budget cannot cover the maximum output,
    /// asks the model for only what it still covers (no overshoot) and
    /// tries again. A refusal comes back with the buckets it was among.
    fn reserve_lowering(
        &self,
        reserver: &Reserver,
        ctx: &RequestContext,
        applying: &[usize],
        sized: &mut Sized,
        price: ModelPrice,
        effort: &mut Contention,
    ) -> Result<Reserved, (Refusal, Vec<usize>)> {
        let identity = ctx.identity;
        let mut lowered = false;
        loop {
            let output = sized.output();
            let amount = |b: &Bucket| b.meter.amount(sized.input_for(b), output, price);
            let taken: Vec<usize> = applying
                .iter()
                .copied()
                .filter(|&i| amount(&self.buckets[i]) > 0)
                .collect();
            let claims: Vec<Claim> = taken
                .iter()
                .map(|&i| {
                    let b = &self.buckets[i];
                    Claim {
                        rule: &b.rule,
                        amount: amount(b),
                        soft: b.soft,
                        share: b.shares.as_ref().map(|table| Share {
                            table,
                            group: table.group_of(&identity.tier, identity.declared),
                        }),
                        lease: None,
                    }
                })
                .collect();
            match self.reserve_leased(reserver, &claims, caller(identity), ctx.now_ms, effort) {
                Ok(reservation) => {
                    return Ok(Reserved {
                        reservation,
                        taken,
                        lowered,
                    })
                }
                Err(Refusal::Full { index, shortfall }) if sized.produces_output => {
                    let room = shortfall.quota.remaining;
                    let bucket = &self.buckets[taken[index]];
                    let allowed = match bucket.meter {
                        Meter::Tokens => room.saturating_sub(sized.input_for(bucket)),
                        Meter::OutputTokens => room,
                        _ => 0,
                    };
                    let allowed_per_choice =
                        allowed.saturating_sub(sized.extra_output) / sized.choices;
                    if allowed_per_choice >= MIN_LOWERED_OUTPUT
                        && allowed_per_choice < sized.per_choice
                    {
                        sized.per_choice = allowed_per_choice;
                        lowered = true;
                        continue;
                    }
                    return Err((Refusal::Full { index, shortfall }, taken));
                }
                Err(refusal) => return Err((refusal, taken)),
            }
        }
    }

    /// Over a soft cap, the model's cheaper model (`downshift_to`), if it
    /// has one. A peek, not a reservation: soft caps tolerate the race.
    pub(super) fn downshift(
        &self,
        reserver: &Reserver,
        ctx: &RequestContext,
        model: Option<&str>,
        input: u64,
        output: u64,
    ) -> Option<String> {
        let RequestContext {
            identity,
            path,
            now_ms,
            ..
        } = *ctx;
        let target = self.policy.models.get(model?)?.downshift_to.clone()?;
        let price = self.price_of(model);
        let over_soft = self.applying(identity, model, path).iter().any(|&i| {
            let b = &self.buckets[i];
            b.soft && {
                let claim = Claim::hard(&b.rule, b.meter.amount(input, output, price));
                reserver.peek(&claim, caller(identity), now_ms).remaining < claim.amount
            }
        });
        over_soft.then_some(target)
    }

    /// The 429 of the bucket that refused (`taken[index]`).
    pub(super) fn refusal(
        &self,
        refusal: Refusal,
        taken: &[usize],
        identity: &Identity,
        model: Option<&str>,
        mut effort: Contention,
        now_ms: u64,
    ) -> Verdict {
        let refused = match refusal {
            Refusal::NoSlot {
                index,
                retry_after_ms,
            } => {
                let bucket = &self.buckets[taken[index]];
                if bucket.rule.scope == Scope::PerRun {
                    self.run_limit(retry_after_ms)
                } else {
                    Refused::CapacityExhausted {
                        retry_after_ms,
                        tier: identity.tier.clone(),
                        bucket: bucket.name.clone(),
                        rule: bucket.rule.id.to_string(),
                        now_ms,
                    }
                }
            }
            Refusal::Full { index, shortfall } => {
                let bucket = &self.buckets[taken[index]];
                let (quota, retry_after_ms) = (shortfall.quota, shortfall.retry_after_ms);

                self.bucket_refusal(bucket, quota, retry_after_ms, &identity.tier, now_ms)
            }
            // Lost every CAS race (counted where it was lost) or the host
            // refused the write (counted here): refuse by that bucket,
            // briefly.
            Refusal::Contended { index } | Refusal::Host { index, .. } => {
                if matches!(refusal, Refusal::Host { .. }) {
                    effort.cas_exhausted = effort.cas_exhausted.saturating_add(1);
                }
                let bucket = &self.buckets[taken[index]];
                let quota = Quota {
                    limit: bucket.rule.limit.capacity(),
                    remaining: 0,
                    reset_ms: 1_000,
                };

                self.bucket_refusal(bucket, quota, 1_000, &identity.tier, now_ms)
            }
        };
        let mut verdict = self.refuse(refused, &identity.tier, model);
        *verdict.contention_mut() = effort;
        verdict
    }

    /// The 429 of one bucket (its quota and wait): what admission answers,
    /// and the fleet when Redis refuses the bucket.
    pub(super) fn bucket_refusal(
        &self,
        bucket: &Bucket,
        quota: Quota,
        retry_after_ms: u64,
        tier: &str,
        now_ms: u64,
    ) -> Refused {
        Refused::Bucket(BucketRefusal {
            reason: bucket.reason,
            quota,
            retry_after_ms,
            tier: tier.to_string(),
            bucket: bucket.name.clone(),
            rule: bucket.rule.id.to_string(),
            limit_text: bucket.rule.limit.describe(),
            now_ms,
            ietf: self.ietf_policy(bucket),
            status: bucket.refuse_with,
        })
    }

    /// A bucket's IETF `RateLimit-Policy` item, when the policy turns the
    /// fields on (`request.rate_limit_headers.ietf`).
    fn ietf_policy(&self, bucket: &Bucket) -> Option<answer::IetfPolicy> {
        if !self.policy.request.rate_limit_headers.ietf {
            return None;
        }
        let unit = match bucket.meter {
            Meter::Requests => None,
            Meter::Tokens => Some("tokens"),
            Meter::InputTokens => Some("input-tokens"),
            Meter::OutputTokens => Some("output-tokens"),
            Meter::Spend => Some("spend"),
        };
        Some(answer::IetfPolicy::of(&bucket.rule.limit, unit))
    }

    /// Headers of an admitted request: the tightest request bucket as
    /// `X-RateLimit-*`, the tightest token bucket as `X-RateLimit-*-Tokens`
    /// (OpenAI's names), and budget alerts past their threshold.
    pub(super) fn admitted_headers(
        &self,
        quotas: &[Quota],
        taken: &[usize],
    ) -> (Headers, Vec<BudgetAlert>) {
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
                .map(|(q, &i)| (*q, i))
                .min_by_key(|(q, _)| share_left(q))
        };
        // Six headers at most (the IETF pair aside), in one buffer.
        let mut headers = Headers::with_capacity(6, 160);
        if let Some((q, i)) = tightest(|m| m == Meter::Requests).or_else(|| tightest(|_| true)) {
            for (name, n) in answer::rate_limit_headers(&q, answer::REQUEST_LIMIT_NAMES) {
                headers.push_number(name, n);
            }
            let bucket = &self.buckets[i];
            if let Some(item) = self.ietf_policy(bucket) {
                // `t` is `X-RateLimit-Reset`: until the bucket is full.
                let t_s = q.reset_ms.div_ceil(1000);
                headers.extend(answer::ietf_headers(&bucket.rule.id, item, &q, t_s));
            }
        }
        if let Some((q, _)) =
            tightest(|m| matches!(m, Meter::Tokens | Meter::InputTokens | Meter::OutputTokens))
        {
            for (name, n) in answer::rate_limit_headers(&q, answer::TOKEN_LIMIT_NAMES) {
                headers.push_number(name, n);
            }
        }
        let mut alerts = Vec::new();
        for (q, &i) in quotas.iter().zip(taken) {
            let b = &self.buckets[i];
            if let Some(alert) = b.alert_permille {
                let used_permille =
                    1000 - (q.remaining as u128 * 1000 / q.limit.max(1) as u128) as u32;
                if used_permille >= alert {
                    let text = format!("{}: {}% used", b.name, used_permille / 10);
                    alerts.push(BudgetAlert { bucket: i, text });
                }
            }
        }
        // A provider's budget is the operator's, not the caller's to see.
        let callers: Vec<&str> = alerts
            .iter()
            .filter(|a| !self.is_provider_bucket(a.bucket))
            .map(|a| a.text.as_str())
            .collect();
        if !callers.is_empty() {
            headers.push("x-sluice-budget-alert", &callers.join("; "));
        }
        (headers, alerts)
    }

    /// 503 `global_breaker_open` while the last hour's spend, all callers
    /// together, is at the ceiling.
    pub(super) fn global_breaker(
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
        let refused = Refused::unavailable(Reason::GlobalBreakerOpen, why, retry_after_s);
        let model = asked.and_then(|a| a.demand.model.as_deref());
        Some(self.refuse(refused, &identity.tier, model))
    }

    /// The learned estimate correction of a configured model for callers
    /// of `tier` (others: 1.0). Learnt per tier, so one tier's callers
    /// cannot move another's estimates; a hard budget never reads it.
    pub(super) fn correction(
        &self,
        store: &dyn SharedStore,
        model: &str,
        tier: &str,
    ) -> Correction {
        if !self.policy.models.contains_key(model) {
            return Correction::default();
        }
        store
            .get(&correction_key(model, tier))
            .map_or(Correction::default(), |(bytes, _)| {
                Correction::decode(&bytes)
            })
    }
}

impl Engine {
    /// Would [`Engine::admit`] let this request through now? A peek, not a
    /// reservation: nothing is taken, so another request may take the
    /// units first. Advisory only: the real admission still runs when the
    /// request is dispatched and alone decides what goes upstream. Asked
    /// before a request takes a place in a queue, so a caller its buckets
    /// would refuse at dispatch is refused at once (the same 429, with the
    /// same `Retry-After`) instead of holding a place others could use.
    ///
    /// `queued`: the caller's requests already waiting in that queue; each
    /// takes one unit of every request-counting bucket before this one, so
    /// those must have `queued + 1` left (at most their capacity: what a
    /// bucket cannot hold at once it still serves one after the other).
    ///
    /// It errs towards letting through: soft caps never refuse, a token
    /// budget needs only the least output admission would lower a request
    /// to, a downshift is followed; it reads each bucket once and writes
    /// nothing. `None`: would admit; else the refusal admission would give.
    pub fn would_admit(
        &self,
        store: &dyn SharedStore,
        ctx: &RequestContext,
        queued: u64,
    ) -> Option<Verdict> {
        let RequestContext {
            identity,
            api,
            path,
            asked,
            now_ms,
        } = *ctx;
        if let Some(verdict) = self.global_breaker(store, identity, asked, now_ms) {
            return Some(verdict);
        }
        let reserver = self.reserver(store);
        let sized = self.size(store, api, asked, &identity.tier);
        let (input, choices, per_choice) = (sized.input, sized.choices, sized.per_choice);
        let output = sized.output();
        let requested_model = sized.requested_model.clone();
        let api = sized.api;
        let downshift = asked.and_then(|_| {
            self.downshift(&reserver, ctx, requested_model.as_deref(), input, output)
        });
        let model = downshift.or(requested_model);
        let price = self.price_of(model.as_deref());
        // The least output admission would lower this request to.
        let least = per_choice
            .min(MIN_LOWERED_OUTPUT)
            .saturating_mul(choices)
            .saturating_add(sized.extra_output);
        let taken = self.drawn_on(identity, api, model.as_deref(), path);
        let need = |b: &Bucket| {
            if b.soft || b.meter.amount(input, output, price) == 0 {
                return None;
            }
            let amount = b.meter.amount(sized.input_for(b), least, price);
            if b.meter != Meter::Requests {
                return Some(amount);
            }
            let ahead = amount.saturating_mul(queued.saturating_add(1));
            Some(ahead.min(b.rule.limit.capacity()).max(amount))
        };
        let (index, shortfall) = self
            .short(&reserver, identity, &taken, need, now_ms)
            .next()?;
        Some(self.peeked(index, shortfall, &taken, identity, model.as_deref(), now_ms))
    }

    /// The one peek, behind [`Engine::would_admit`] and
    /// [`Engine::refusal_before_body`]: each of `buckets` (in order) that
    /// cannot give what `need` says the request takes of it now (`None`:
    /// not asked of it), with its shortfall. Lazy: a bucket is read only
    /// when the ones before it were taken care of; nothing is written.
    pub(super) fn short<'a>(
        &'a self,
        reserver: &'a Reserver,
        identity: &'a Identity,
        buckets: &'a [usize],
        need: impl Fn(&Bucket) -> Option<u64> + 'a,
        now_ms: u64,
    ) -> impl Iterator<Item = (usize, Shortfall)> + 'a {
        buckets.iter().enumerate().filter_map(move |(n, &i)| {
            let b = &self.buckets[i];
            let amount = need(b)?;
            let claim = Claim::hard(&b.rule, amount);
            // What this worker's lease of the bucket covers is not short,
            // whatever the shared bucket has left.
            if self.lease_covers(reserver, &claim, identity, now_ms) {
                return None;
            }
            let shortfall = reserver.shortfall(&claim, caller(identity), now_ms)?;
            Some((n, shortfall))
        })
    }

    /// The refusal a peek found: admission's 429 of `buckets[index]`,
    /// with the same `Retry-After`.
    pub(super) fn peeked(
        &self,
        index: usize,
        shortfall: Shortfall,
        buckets: &[usize],
        identity: &Identity,
        model: Option<&str>,
        now_ms: u64,
    ) -> Verdict {
        let refusal = Refusal::Full { index, shortfall };
        self.refusal(
            refusal,
            buckets,
            identity,
            model,
            Contention::default(),
            now_ms,
        )
    }
}

/// The body the upstream gets: the served model (a downshift's, or the
/// rung's), and the reserved limit in every field the API's servers read
/// unless the body carries it there already — or, for a rung with a
/// `limit_field`, in that one field only. A declared API's: both at its
/// pointers.
fn upstream_body(
    sized: &Sized,
    asked: &Asked,
    downshift: Option<&str>,
    served: Option<&Served>,
    declared: Option<&Declared>,
) -> (Option<Vec<u8>>, bool) {
    // A listed model spelt otherwise goes up under the policy's name.
    let respelled = asked.demand.model.as_deref().filter(|_| asked.respelled);
    let model = served
        .and_then(|s| s.model.as_deref())
        .or(downshift)
        .or(respelled);
    if let Some(declared) = declared {
        let max = sized.per_choice;
        let new_output = (!declared.carries(asked.body(), max)).then_some(max);
        let rewritten = declared.rewrite(asked.body(), model, new_output);
        return (
            rewritten.map(|json| super::rewrite::spliced(asked, &json)),
            false,
        );
    }
    let only = served
        .and_then(|s| s.limit_field)
        .filter(|f| sized.api.output_limit().reads.contains(f));
    let new_output = (sized.produces_output
        && (only.is_some() || !carries_max_output(sized.api, &asked.sent, sized.per_choice)))
    .then_some(sized.per_choice);
    rewrite(sized.api, asked, model, new_output, only)
}
