//! Settlement (step 5): what the response really cost replaces what was
//! reserved; the estimate learns from real usage; the global usage ring
//! feeds the surge warning and the spend breaker.

use super::*;
use crate::usage::reconcile::{Details, Usage};

/// What each record the plan holds is charged (one update per record, its
/// buckets' settlements together; a request bucket costs what it
/// reserved): `billed`, or `bound` where the record reserved the input's
/// bound and the upstream did not report the input.
fn charges(plan: &Plan, billed: Billed, bound: Option<Billed>) -> Vec<(&Held, u64)> {
    plan.held
        .iter()
        .zip(&plan.meters)
        .zip(plan.bounded.iter().chain(std::iter::repeat(&false)))
        .filter(|((_, meter), _)| **meter != Meter::Requests)
        .map(|((held, meter), &bounded)| {
            let billed = bound.filter(|_| bounded).unwrap_or(billed);
            (held, meter.settled(billed, plan.price))
        })
        .collect()
}

impl Engine {
    /// Step 5: replace the reservation with what the response really cost.
    /// Usage from the upstream wins; without (believable) usage, the input
    /// estimate and the output counted in the stream. An upstream error
    /// costs nothing. Every token at its plain rate: see
    /// [`Engine::settle_parts`] for an answer whose usage prices parts apart.
    pub fn settle(
        &self,
        store: &dyn SharedStore,
        plan: &Plan,
        found: Found,
        output_counted: u64,
        upstream_ok: bool,
        now_ms: u64,
    ) -> (Settled, Contention) {
        let parts = Details::default();
        self.settle_parts(
            store,
            plan,
            found,
            parts,
            output_counted,
            upstream_ok,
            now_ms,
        )
    }

    /// [`Engine::settle`], with the usage's `details` (cached input, cache
    /// writes, reasoning) priced at their own rates when the usage is
    /// believed.
    #[allow(clippy::too_many_arguments)]
    pub fn settle_parts(
        &self,
        store: &dyn SharedStore,
        plan: &Plan,
        found: Found,
        details: Details,
        output_counted: u64,
        upstream_ok: bool,
        now_ms: u64,
    ) -> (Settled, Contention) {
        let Counted {
            input,
            output,
            from_usage,
            input_estimated,
            reported,
            billed,
        } = counted(plan, found, details, output_counted, upstream_ok);
        let reserver = self.reserver(store);
        let mut effort = Contention::default();
        // Input the upstream did not report is charged to a hard budget
        // at the bound it reserved, never at the guess: it cannot be over.
        let charged_bound = !reported && upstream_ok && plan.bounded.contains(&true);
        let billed_bound = Billed {
            input: plan.input_bound.max(input),
            ..billed
        };
        let items = charges(plan, billed, charged_bound.then_some(billed_bound));
        let charges_unwritten = self.settle_leased(&reserver, &items, now_ms, &mut effort);
        // Another provider's tokenizer says nothing about the primary's.
        if from_usage && !input_estimated && input > 0 && plan.rung.is_none() {
            if let Some(model) = &plan.model {
                self.learn(store, model, &plan.tier, plan.input_raw, input, &mut effort);
            }
        }
        // What the hard budgets were charged is what the audit reports.
        let (billed, input) = match charged_bound {
            true => (billed_bound, billed_bound.input),
            false => (billed, input),
        };
        let input_source = match (reported, charged_bound) {
            (true, _) => InputSource::Reported,
            (false, true) => InputSource::Bounded,
            (false, false) => InputSource::Estimated,
        };
        let cost = plan.price.cost_micros(billed);
        let (surge, global_open) = self.record_usage(
            store,
            input.saturating_add(output),
            cost,
            now_ms,
            &mut effort,
        );
        let settled = Settled {
            input,
            output,
            from_usage,
            input_estimated,
            input_source,
            invalid_usage: found == Found::Invalid,
            billed,
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
        let items: Vec<(&Held, u64)> = plan.held.iter().map(|h| (h, 0)).collect();
        self.settle_leased(&self.reserver(store), &items, now_ms, &mut effort);
        effort
    }

    /// Adds a settled request to the global per-minute ring; says whether
    /// its minute is a new surge and whether the spend ceiling is reached.
    /// Exhausted (counted): this request's usage is missing from the ring,
    /// which only makes the surge and spend ceiling see less.
    pub(super) fn record_usage(
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
        let tries = self.tries().take();
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

    /// Moves the model's estimate correction for `tier` towards this
    /// sample (an outlier is dropped, see [`Correction::learn`]). A sample
    /// that loses every race (counted) is dropped: the next one will do.
    pub(super) fn learn(
        &self,
        store: &dyn SharedStore,
        model: &str,
        tier: &str,
        raw: f64,
        actual: u64,
        contention: &mut Contention,
    ) {
        if !self.policy.models.contains_key(model) {
            return;
        }
        let key = correction_key(model, tier);
        let tries = self.tries().take();
        store::update(store, &key, tries, contention, |bytes| {
            let current = bytes.map_or(Correction::default(), Correction::decode);
            current.learn(raw, actual).map(|next| next.encode())
        });
    }
}

/// What a response is counted as, before anything is charged.
struct Counted {
    input: u64,
    output: u64,
    /// The counts are the upstream's usage (not the estimate).
    from_usage: bool,
    /// The usage left the input out: the input is the estimate.
    input_estimated: bool,
    /// The usage reported the input (a background response's never is).
    reported: bool,
    billed: Billed,
}

/// The counts of a response from what its meter found: the upstream's
/// usage, else the estimate and the output counted (nothing for a failed
/// answer); a background response is counted all it reserved.
fn counted(
    plan: &Plan,
    found: Found,
    details: Details,
    output_counted: u64,
    upstream_ok: bool,
) -> Counted {
    let reported_input = |u: Usage| u.input > 0 || plan.input_estimate == 0;
    let reported = matches!(found, Found::Usage(u) if reported_input(u)) && !plan.background;
    let (input, output, from_usage) = match found {
        // A background response answers `queued` and generates on:
        // whatever it first says, it may cost all it reserved.
        _ if plan.background && upstream_ok => (plan.input_estimate, plan.max_output, false),
        Found::Usage(u) if reported_input(u) => (u.input, u.output, true),
        // No prompt reads as 0 tokens: a 0 is a count the upstream
        // left out (Ollama drops `prompt_eval_count` when it is 0,
        // and its OpenAI and Anthropic APIs then say `prompt_tokens: 0`
        // / `input_tokens: 0`: ollama/ollama#2068, #5370). The
        // estimate stands in for the input; the output is the
        // upstream's.
        Found::Usage(u) => (plan.input_estimate, u.output, true),
        _ if !upstream_ok => (0, 0, false),
        _ => (plan.input_estimate, output_counted, false),
    };
    let input_estimated = matches!(found, Found::Usage(u) if !reported_input(u));
    // Parts only of counts the upstream reported (bounded by them).
    let parts = match from_usage && !input_estimated {
        true => details.within(Usage { input, output }),
        false => Details::default(),
    };
    let billed = Billed {
        input,
        output,
        cached_input: parts.cached_input,
        cache_write_input: parts.cache_write_input,
        reasoning_output: parts.reasoning_output,
    };
    Counted {
        input,
        output,
        from_usage,
        input_estimated,
        reported,
        billed,
    }
}
