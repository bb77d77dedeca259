//! The penalty box as admission applies it: whether a caller (or a failed
//! authentication's address) is boxed, as the engine's verdict.

use crate::admission::identity::{Identity, RequestView};
use crate::admission::penalty::{Checked, PenaltyBox};
use crate::admission::Engine;
use crate::state::store::SharedStore;

impl Engine {
    /// Before anything else about a request: is its caller in the penalty
    /// box? `Some` verdict: refuse it (429 `temporarily_blocked`).
    pub fn penalty_box(
        &self,
        store: &dyn SharedStore,
        req: &dyn RequestView,
        identity: &Identity,
        now_ms: u64,
    ) -> (Option<crate::admission::Verdict>, Checked) {
        let Some(pb) = &self.penalty else {
            return (None, Checked::default());
        };
        let Some(who) = pb.who(identity, req) else {
            return (None, Checked::default());
        };
        self.boxed(pb, store, who, &identity.tier, now_ms)
    }

    /// A failed authentication counts against its address: what the box
    /// is for. `Some` verdict: the address is blocked (429 instead of 401).
    pub fn penalty_box_failed(
        &self,
        store: &dyn SharedStore,
        req: &dyn RequestView,
        now_ms: u64,
    ) -> (Option<crate::admission::Verdict>, Checked) {
        let Some(pb) = &self.penalty else {
            return (None, Checked::default());
        };
        let Some(who) = pb.who_by_address(req) else {
            return (None, Checked::default());
        };
        self.boxed(pb, store, who, &self.policy.default_tier, now_ms)
    }

    fn boxed(
        &self,
        pb: &PenaltyBox,
        store: &dyn SharedStore,
        who: u64,
        tier: &str,
        now_ms: u64,
    ) -> (Option<crate::admission::Verdict>, Checked) {
        let checked = pb.check(store, who, now_ms, self.tries().take());
        let verdict = checked.blocked_until_ms.map(|until| {
            let refused = crate::admission::answer::Refused::TemporarilyBlocked {
                retry_after_ms: until.saturating_sub(now_ms),
                now_ms,
            };
            let mut verdict = self.refuse(refused, tier, None);
            *verdict.contention_mut() = checked.contention;
            verdict
        });
        (verdict, checked)
    }
}
