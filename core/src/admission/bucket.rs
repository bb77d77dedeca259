//! A compiled bucket: what it counts ([`Meter`]) and what answers say
//! about it. Made by `compile`, read by the rest of admission. What a
//! model costs is the policy's [`ModelPrice`].

use crate::admission::answer::Reason;
use crate::limits::reservation::Rule;
use crate::policy::prices::{Billed, ModelPrice};

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
    /// What a request of these totals takes from a bucket before its
    /// answer: for spend, the most its parts may cost (a cached or
    /// reasoning token may be priced above a plain one).
    pub(crate) fn amount(self, input: u64, output: u64, price: ModelPrice) -> u64 {
        match self {
            Meter::Spend => price.bound_micros(input, output),
            _ => self.settled(
                Billed {
                    input,
                    output,
                    ..Billed::default()
                },
                price,
            ),
        }
    }

    /// What a request really cost this bucket, its parts priced apart.
    pub(crate) fn settled(self, billed: Billed, price: ModelPrice) -> u64 {
        let Billed { input, output, .. } = billed;
        match self {
            Meter::Requests => 1,
            Meter::Tokens => input.saturating_add(output),
            Meter::InputTokens => input,
            Meter::OutputTokens => output,
            Meter::Spend => price.cost_micros(billed),
        }
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
    /// The status a refusal by it answers (a budget's `refuse_with`).
    pub(crate) refuse_with: u32,
    /// Fair shares of a shared bucket (models, routes; see `shares`).
    pub(crate) shares: Option<crate::limits::shares::ShareTable>,
}
