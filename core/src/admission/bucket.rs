//! A compiled bucket: what it counts ([`Meter`]), what a model costs
//! ([`Pricing`]), and what answers say about it. Made by `compile`, read
//! by the rest of admission.

use crate::admission::answer::Reason;
use crate::limits::reservation::Rule;

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
    pub(crate) fn amount(self, input: u64, output: u64, pricing: Pricing) -> u64 {
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
pub(crate) struct Bucket {
    pub(crate) rule: Rule,
    /// The tier of a per-caller bucket (its declared keys get their own).
    pub(crate) tier: Option<String>,
    /// Counts every undeclared caller of the tier together.
    pub(crate) anonymous: bool,
    pub(crate) reason: Reason,
    /// `tier free: requests per caller`
    pub(crate) name: String,
    pub(crate) meter: Meter,
    pub(crate) soft: bool,
    pub(crate) alert_permille: Option<u32>,
    /// Fair shares of a shared bucket (models, routes; see `shares`).
    pub(crate) shares: Option<crate::limits::shares::Table>,
}
