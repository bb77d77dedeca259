//! The records of run budgets (`runs` in the policy): one shared-data key
//! per live run, in a fixed table of `max_live` keys
//! (`sluice:v1:run:{slot}`), created up front like every other key, so a
//! flood of run ids never grows the key set.
//!
//! Where a run lives. A caller's runs are placed from the caller's home
//! slot (its identity hash, keyed by the deployment's hash key) and probe
//! `max_per_caller` slots from there: a caller never holds more than that
//! many live runs, and a run is found by its owner, the hash of the
//! caller's identity and the run id together, so another caller naming the
//! same id owns another record.
//!
//! Who may take a record. A record whose run has gone unused for `ttl` is
//! forgotten: it goes to the next new run, and a run coming back after
//! that starts afresh. A live run's record is never taken: when every
//! probed record is live, a new run is refused (429 `run_limit`, with the
//! time until the first of them may be forgotten) rather than evict
//! anyone's counts, so a caller cannot reset its run budget by flooding
//! new ids. Every take and every settlement counts as use.
//!
//! A run's budget does not refill: its bucket has no window and a rate
//! too slow to matter (`run_limit`), and what a refusal tells the client
//! to wait is the `ttl` (`crate::limits::run_table`).

use crate::limits::bucket::{BucketState, Quota, Shortfall};
use crate::limits::record::Bundle;
use crate::limits::reservation::{
    apply_settlement, lost_charges, Caller, Claim, Held, Located, Placement, Reserver, GLOBAL_OWNER,
};
use crate::limits::run_table::{run_shortfall, table};
use crate::limits::slot_table::{self, SlotClaim, SlotSeen};
use crate::state::store::Contention;

impl Reserver<'_> {
    /// The record of `caller`'s run: its own, else a free one (never used,
    /// or forgotten: unused for `ttl`), read fresh. `Err`: every slot the
    /// caller may use holds a live run; the value is when one is forgotten.
    pub(crate) fn locate_run(&self, caller: Caller, now_ms: u64) -> Result<Located, u64> {
        let t = self.layout.runs;
        if caller.run == 0 || t.slots == 0 {
            return Err(t.ttl_ms);
        }
        let owner = caller.run.max(GLOBAL_OWNER + 1);
        let table = table(&t);
        let mut frees_in = u64::MAX;
        let probed = table.probe(caller.hash).map(|key| {
            let (bytes, cas) = self.store.get(&key).unwrap_or_default();
            (key, cas, Bundle::decode(bytes))
        });
        let found = slot_table::claim(probed, |(_, _, bundle)| {
            let idle = now_ms.saturating_sub(bundle.touched_ms);
            if bundle.owner == owner {
                return SlotSeen::Mine;
            }
            if bundle.owner == 0 {
                return SlotSeen::Last((1u8, 0));
            }
            if idle >= t.ttl_ms {
                return SlotSeen::Free((0, bundle.touched_ms));
            }
            frees_in = frees_in.min(t.ttl_ms - idle);
            SlotSeen::Busy
        });
        let (key, cas, bundle) = match found {
            // Its own, forgotten since: it starts afresh.
            SlotClaim::Mine((key, cas, bundle))
                if now_ms.saturating_sub(bundle.touched_ms) < t.ttl_ms =>
            {
                (key, cas, bundle)
            }
            SlotClaim::Mine((key, cas, _)) | SlotClaim::Free((key, cas, _)) => {
                (key, cas, Bundle::new(owner, now_ms))
            }
            SlotClaim::Full => return Err(frees_in),
        };
        Ok(Located {
            key: key.into(),
            bundle,
            cas,
            owner,
            placement: Placement::Run,
        })
    }

    /// Settles the buckets of one run's record, while the run still holds
    /// it (a settlement is use too). A run forgotten and its record taken
    /// meanwhile owes nothing more: its counts are gone.
    pub(crate) fn settle_run(
        &self,
        group: &[(&Held, u64)],
        now_ms: u64,
        effort: &mut Contention,
    ) -> u32 {
        let Some(&(first, _)) = group.first() else {
            return 0;
        };
        let written = self.update(&first.key, self.tries.settle(), effort, |bytes| {
            let mut bundle = Bundle::decode(bytes);
            (bundle.owner == first.owner).then(|| {
                for &(h, actual) in group {
                    apply_settlement(&mut bundle, h, actual, None, now_ms);
                }
                bundle.touched_ms = bundle.touched_ms.max(now_ms);
                bundle.encode()
            })
        });
        lost_charges(group, written)
    }

    /// A run bucket's quota: whole again once the run is forgotten, `ttl`
    /// after its last use (its budget never refills). Any other as it is.
    pub(crate) fn run_reset(&self, placement: Placement, mut quota: Quota) -> Quota {
        if placement == Placement::Run {
            quota.reset_ms = self.layout.runs.ttl_ms;
        }
        quota
    }

    /// Takes a claim from a bucket's state; a run bucket's refusal waits
    /// for the run to be forgotten.
    pub(crate) fn take_in(
        &self,
        placement: Placement,
        state: BucketState,
        c: &Claim,
        now_ms: u64,
    ) -> Result<BucketState, Shortfall> {
        let taken = state.take(c.amount, &c.rule.limit, now_ms);
        match placement {
            Placement::Run => taken.map_err(|s| run_shortfall(s, &self.layout.runs)),
            _ => taken,
        }
    }
}
