//! What the fleet (`crate::fleet`) needs from the engine, kept in one
//! place: the buckets' limits and kinds, a local reservation on the
//! `local_share` stand-ins, and the 429 of a bucket refused fleet-wide.

use super::*;

impl Engine {
    /// The meter's units for what a request really used (requests: 1).
    pub fn units(meter: Meter, billed: Billed, price: ModelPrice) -> u64 {
        meter.settled(billed, price)
    }

    /// Creates the shared-data keys of extra rules (the `local_share`
    /// stand-ins), with this policy's per-caller layout.
    pub fn prepare_rules(
        &self,
        store: &dyn SharedStore,
        rules: &[Rule],
    ) -> Result<usize, StoreError> {
        let rules: Vec<(Rule, Vec<String>)> =
            rules.iter().map(|r| (r.clone(), Vec::new())).collect();
        prepare(store, &rules, &self.layout())
    }

    /// Takes `amount` from each rule locally, all or nothing; on refusal
    /// the index of the rule that refused.
    pub fn reserve_rules(
        &self,
        store: &dyn SharedStore,
        claims: &[(&Rule, u64)],
        identity: &Identity,
        now_ms: u64,
        effort: &mut Contention,
    ) -> Result<Vec<Held>, (usize, Quota)> {
        let claims: Vec<Claim> = claims
            .iter()
            .map(|(rule, amount)| Claim::hard(rule, *amount))
            .collect();
        match self
            .reserver(store)
            .reserve(&claims, admit::caller(identity), now_ms, effort)
        {
            Ok(r) => Ok(r.held),
            Err(Refusal::Full { index, shortfall }) => Err((index, shortfall.quota)),
            // No slot, lost every race, or the host refused: refused by
            // that rule, briefly (never let through unchecked).
            Err(Refusal::NoSlot { index, .. })
            | Err(Refusal::Contended { index })
            | Err(Refusal::Host { index, .. }) => Err((
                index,
                Quota {
                    limit: claims.get(index).map_or(0, |c| c.rule.limit.capacity()),
                    remaining: 0,
                    reset_ms: 1_000,
                },
            )),
        }
    }

    /// What this Envoy's own bucket `rule_id` holds for the caller now (a
    /// peek: nothing taken). A fleet budget's `local_share` counts what
    /// this Envoy admitted in the window against it.
    pub fn local_quota(
        &self,
        store: &dyn SharedStore,
        rule_id: &str,
        identity: &Identity,
        now_ms: u64,
    ) -> Option<Quota> {
        let bucket = self.buckets.iter().find(|b| *b.rule.id == *rule_id)?;
        let claim = Claim::hard(&bucket.rule, 0);
        Some(
            self.reserver(store)
                .peek(&claim, admit::caller(identity), now_ms),
        )
    }

    /// Settles a local hold (a `local_share` stand-in) to what was used.
    pub fn settle_held(
        &self,
        store: &dyn SharedStore,
        held: &Held,
        actual: u64,
        now_ms: u64,
    ) -> Contention {
        let mut effort = Contention::default();
        self.reserver(store)
            .settle(held, actual, now_ms, &mut effort);
        effort
    }

    /// Gives back what a request without a plan (a GET) took.
    pub fn release_held(&self, store: &dyn SharedStore, held: &[Held], now_ms: u64) -> Contention {
        let mut effort = Contention::default();
        let items: Vec<(&Held, u64)> = held.iter().map(|h| (h, 0)).collect();
        self.settle_leased(&self.reserver(store), &items, now_ms, &mut effort);
        effort
    }

    /// The 429 of bucket `rule_id` when the fleet refused it.
    pub fn fleet_refusal(
        &self,
        rule_id: &str,
        quota: Quota,
        identity: &Identity,
        model: Option<&str>,
        now_ms: u64,
    ) -> Option<Verdict> {
        let bucket = self.buckets.iter().find(|b| *b.rule.id == *rule_id)?;
        let retry_after_ms = quota.reset_ms.clamp(1_000, 86_400_000);
        let refused = self.bucket_refusal(bucket, quota, retry_after_ms, &identity.tier, now_ms);
        Some(self.refuse(refused, &identity.tier, model))
    }
}
