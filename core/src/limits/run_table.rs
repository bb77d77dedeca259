//! The shape of the run table (`runs` in the policy) and the limits of a
//! run's budgets: what the reservation, admission and the fleet contract
//! read. Where a run lives and how it is settled is `crate::limits::runs`.

use crate::limits::bucket::Shortfall;
use crate::limits::slot_table::SlotTable;
use crate::policy::units::Rate;
use crate::policy::Limit;

const RUN_PREFIX: &str = "sluice:v1:run:";

/// The run table's shape (from `runs` in the policy); all zeros without.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunTable {
    /// Live runs, all callers together (`max_live`).
    pub slots: u32,
    /// Live runs of one caller (`max_per_caller`): the slots it probes.
    pub per_caller: u32,
    /// A run unused this long is forgotten.
    pub ttl_ms: u64,
}

/// The table's keys.
pub fn table(t: &RunTable) -> SlotTable<'static> {
    SlotTable::flat(RUN_PREFIX, t.slots, t.per_caller)
}

/// A run budget of `units`: no window, and a refill so slow (`units` per
/// `u64::MAX` ms, under a millionth of a unit a day for any amount the
/// counters hold) that it never refills in a run's life.
pub fn run_limit(units: u64) -> Limit {
    Limit {
        rate: Rate {
            amount: units,
            period_ms: u64::MAX,
        },
        burst: units,
        window: None,
    }
}

/// A run bucket's refusal: whole again only once the run is forgotten,
/// `ttl` after its last use.
pub fn run_shortfall(mut s: Shortfall, t: &RunTable) -> Shortfall {
    s.quota.reset_ms = t.ttl_ms;
    s.retry_after_ms = t.ttl_ms;
    s
}

/// The budgets `runs` sets, with the ids admission gives them (`run/tokens`,
/// `run/spend`) and their limits (spend in micro-currency): the one list
/// admission and the fleet contract both read.
pub fn run_budgets(
    policy: &crate::policy::Policy,
) -> Vec<(&'static str, Limit, crate::policy::Budget)> {
    let Some(r) = &policy.runs else {
        return Vec::new();
    };
    let tokens = r.tokens.map(|b| ("tokens", b.limit as u64, b));
    let spend = r
        .spend
        .map(|b| ("spend", (b.limit * 1e6).round() as u64, b));
    tokens
        .into_iter()
        .chain(spend)
        .map(|(what, units, b)| (what, run_limit(units.max(1)), b))
        .collect()
}

/// The run table of a policy.
pub fn run_table(policy: &crate::policy::Policy) -> RunTable {
    policy
        .runs
        .as_ref()
        .map_or_else(RunTable::default, |r| RunTable {
            slots: r.max_live,
            per_caller: r.max_per_caller,
            ttl_ms: r.ttl_ms,
        })
}
