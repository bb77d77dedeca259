//! The penalty box (`abuse`): a caller that sends more than `threshold`
//! requests within one period is refused 429 `temporarily_blocked`, with
//! `Retry-After`, for `block_for`; then its count starts again from zero.
//! Counted per client address or per principal (`by`); declared API keys
//! can be exempt. Every request counts, admitted or not: the box is about
//! the pressure a caller puts on the gateway, before any bucket is read.
//!
//! State and bound. A fixed table of `slots` shared-data keys (default
//! 4096, at most 65536; 32 bytes each) plus one overflow key, all created
//! when the policy loads: memory never grows with traffic, and at most
//! `slots` callers are tracked or blocked at once. A caller hashes to a
//! home slot and probes [`PROBES`] slots from there; its count lives in the
//! slot it owns.
//!
//! Eviction. A slot is handed to another caller only when it is free: never
//! used, or its owner is not blocked and its period ended (nothing to
//! remember). A live block is never evicted, nor is a count within its
//! period, so a flood of new addresses cannot wipe a block or a running
//! count: it can only fill free slots. When all probed slots are live, the
//! newcomer is counted in the shared overflow key, with every other
//! untracked caller together, against the same threshold (refused until
//! that period ends, not blocked for `block_for`): under a flood that fills
//! the table, untracked callers together get one caller's allowance, and
//! tracked callers and blocks are untouched. Counted in
//! `sluice_abuse_untracked_total`.
//!
//! Contention. Each slot is updated with compare-and-swap, retried up to
//! `state.cas_max_retries` times (counted). A request whose count cannot be
//! written then goes on uncounted (the buckets behind the box still hold
//! their exact limits); the exhaustion is counted in
//! `sluice_cas_exhausted_total`.

use std::collections::HashSet;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::codec::{Reader, Record, Writer};
use crate::config::{ConfigError, Policy};
use crate::principal::{Identity, RequestView, Resolver};
use crate::store::{retry, Attempt, Contention, SharedStore, StoreError};
use crate::units::{parse_duration, parse_rate, Rate};

/// Slots probed from a caller's home slot.
pub const PROBES: u32 = 8;
const KEY_PREFIX: &str = "sluice:v1:abuse:";
const OVERFLOW_KEY: &str = "sluice:v1:abuse:overflow";
/// Owner of the overflow record.
const OVERFLOW_OWNER: u64 = 1;
/// The longest block or period the box accepts.
const MAX_MS: u64 = 7 * 86_400_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum By {
    /// The connection's address (port dropped).
    #[default]
    ClientAddress,
    /// The resolved principal (key, JWT subject, header, or address).
    Principal,
}

/// `abuse: {threshold: 60/min, block_for: 10m, by: client_address}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbuseConfig {
    /// Requests one caller may send within the period.
    #[serde(deserialize_with = "de_rate")]
    pub threshold: Rate,
    /// How long a caller over the threshold is refused.
    #[serde(deserialize_with = "de_duration", rename = "block_for")]
    pub block_for_ms: u64,
    #[serde(default)]
    pub by: By,
    /// Declared API keys (raw or `sha256:<hex>`) never counted or blocked.
    #[serde(default)]
    pub exempt: Vec<String>,
    /// Every declared API key is exempt.
    #[serde(default)]
    pub exempt_declared: bool,
    /// Callers tracked at once (the bound on the key set).
    #[serde(default = "default_slots")]
    pub slots: u32,
}

fn default_slots() -> u32 {
    4096
}

fn de_rate<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Rate, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_rate(&text, &["requests", "request"]).map_err(de::Error::custom)
}

fn de_duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let text = String::deserialize(deserializer)?;
    parse_duration(&text).map_err(de::Error::custom)
}

impl AbuseConfig {
    /// Rules that need the rest of the policy.
    pub(crate) fn check(&self, policy: &Policy) -> Result<(), ConfigError> {
        let t = self.threshold;
        if t.amount == 0 || t.period_ms == 0 || t.period_ms > MAX_MS {
            return Err(ConfigError::at(
                "abuse.threshold",
                "must be at least 1 request per period, and the period at most 7 days",
            ));
        }
        if self.block_for_ms < 1_000 || self.block_for_ms > MAX_MS {
            return Err(ConfigError::at(
                "abuse.block_for",
                "must be between 1s and 7 days",
            ));
        }
        if self.slots == 0 || self.slots > 1 << 16 {
            return Err(ConfigError::at(
                "abuse.slots",
                "must be between 1 and 65536",
            ));
        }
        let declared: HashSet<String> = policy
            .identity
            .api_key
            .iter()
            .flat_map(|k| k.keys.keys())
            .map(|k| Resolver::principal_of_key(k))
            .collect();
        for (i, key) in self.exempt.iter().enumerate() {
            if !declared.contains(&Resolver::principal_of_key(key)) {
                return Err(ConfigError::at(
                    format!("abuse.exempt[{i}]"),
                    format!(
                        "{} is not declared under identity.api_key.keys (only declared keys can be exempt)",
                        crate::config::redact_key(key)
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// One tracked caller: its count in the current period and its block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub owner: u64,
    pub period_start_ms: u64,
    pub count: u64,
    pub blocked_until_ms: u64,
}

impl Record for Tally {
    const LEN: usize = 32;

    fn write(&self, w: &mut Writer) {
        w.u64(self.owner)
            .u64(self.period_start_ms)
            .u64(self.count)
            .u64(self.blocked_until_ms);
    }

    fn read(r: &mut Reader) -> Self {
        Tally {
            owner: r.u64(),
            period_start_ms: r.u64(),
            count: r.u64(),
            blocked_until_ms: r.u64(),
        }
    }
}

/// What the box says about one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checked {
    /// Refused until then (ms since the epoch).
    pub blocked_until_ms: Option<u64>,
    /// This request started the block.
    pub started: bool,
    /// Counted in the overflow record (no slot was free).
    pub untracked: bool,
    pub contention: Contention,
}

/// The penalty box of a loaded policy.
#[derive(Debug, Clone)]
pub struct PenaltyBox {
    threshold: Rate,
    block_for_ms: u64,
    by: By,
    exempt: HashSet<String>,
    exempt_declared: bool,
    slots: u32,
}

impl PenaltyBox {
    pub fn new(config: &AbuseConfig) -> PenaltyBox {
        PenaltyBox {
            threshold: config.threshold,
            block_for_ms: config.block_for_ms,
            by: config.by,
            exempt: config
                .exempt
                .iter()
                .map(|k| Resolver::principal_of_key(k))
                .collect(),
            exempt_declared: config.exempt_declared,
            slots: config.slots.max(1),
        }
    }

    /// Creates the table's keys (empty) unless they exist.
    pub fn prepare(&self, store: &dyn SharedStore) -> Result<usize, StoreError> {
        let empty = Tally::default().encode();
        let mut created = 0;
        for key in (0..self.slots)
            .map(slot_key)
            .chain(std::iter::once(OVERFLOW_KEY.to_string()))
        {
            if store.get(&key).is_none() {
                store.set(&key, &empty, 0)?;
                created += 1;
            }
        }
        Ok(created)
    }

    /// Whom the box counts for this request; `None`: exempt (or no
    /// address to count by).
    pub fn who(&self, identity: &Identity, req: &dyn RequestView) -> Option<u64> {
        if identity.declared && (self.exempt_declared || self.exempt.contains(&identity.principal))
        {
            return None;
        }
        match self.by {
            By::Principal => Some(identity.hash),
            By::ClientAddress => req
                .client_address()
                .map(|a| crate::principal::address_hash(&a)),
        }
        // 0 and 1 mark free and overflow records.
        .map(|h| h.max(2))
    }

    /// Counts one request of `who` and says whether it is blocked.
    pub fn check(&self, store: &dyn SharedStore, who: u64, now_ms: u64, max_tries: u32) -> Checked {
        let mut contention = Contention::default();
        let home = (who % u64::from(self.slots)) as u32;
        let keys: Vec<String> = (0..PROBES.min(self.slots))
            .map(|p| slot_key((home + p) % self.slots))
            .collect();
        let outcome = retry(max_tries, &mut contention, || {
            let mut free = None;
            for key in &keys {
                let Some((bytes, cas)) = store.get(key) else {
                    continue;
                };
                let tally = Tally::decode(&bytes);
                if tally.owner == who {
                    return self.write(store, key, cas, tally, now_ms, self.block_for_ms, false);
                }
                if free.is_none() && self.is_free(&tally, now_ms) {
                    free = Some((key, cas));
                }
            }
            match free {
                Some((key, cas)) => {
                    let fresh = Tally {
                        owner: who,
                        ..Tally::default()
                    };
                    self.write(store, key, cas, fresh, now_ms, self.block_for_ms, false)
                }
                None => {
                    // No slot: counted with every other untracked caller,
                    // refused only until the period ends.
                    let Some((bytes, cas)) = store.get(OVERFLOW_KEY) else {
                        return Attempt::Done(Checked::default());
                    };
                    let mut tally = Tally::decode(&bytes);
                    tally.owner = OVERFLOW_OWNER;
                    let period = self.threshold.period_ms;
                    self.write(store, OVERFLOW_KEY, cas, tally, now_ms, period, true)
                }
            }
        });
        let mut checked = outcome.unwrap_or_default();
        checked.contention = contention;
        checked
    }

    /// A slot that remembers nothing worth keeping: never used, or not
    /// blocked and past its period.
    fn is_free(&self, t: &Tally, now_ms: u64) -> bool {
        t.owner == 0
            || (t.blocked_until_ms <= now_ms
                && now_ms >= t.period_start_ms.saturating_add(self.threshold.period_ms))
    }

    /// Counts the request on `tally` and writes it back under `cas`.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        store: &dyn SharedStore,
        key: &str,
        cas: u32,
        tally: Tally,
        now_ms: u64,
        block_ms: u64,
        untracked: bool,
    ) -> Attempt<Checked> {
        if tally.blocked_until_ms > now_ms {
            // Blocked: nothing to write; the block is not extended.
            return Attempt::Done(Checked {
                blocked_until_ms: Some(tally.blocked_until_ms),
                untracked,
                ..Checked::default()
            });
        }
        let (next, checked) = self.step(tally, now_ms, block_ms, untracked);
        match store.set(key, &next.encode(), cas) {
            Ok(()) => Attempt::Done(checked),
            Err(StoreError::CasMismatch) => Attempt::Lost,
            // The host refused the write: go on uncounted.
            Err(StoreError::Host(_)) => Attempt::Done(Checked::default()),
        }
    }

    /// One more request on an unblocked tally.
    fn step(&self, t: Tally, now_ms: u64, block_ms: u64, untracked: bool) -> (Tally, Checked) {
        let mut t = t;
        let period_over = now_ms >= t.period_start_ms.saturating_add(self.threshold.period_ms);
        if period_over || t.count == 0 {
            t.period_start_ms = now_ms;
            t.count = 0;
        }
        t.count = t.count.saturating_add(1);
        let mut checked = Checked {
            untracked,
            ..Checked::default()
        };
        if t.count > self.threshold.amount {
            let until = now_ms.saturating_add(block_ms);
            // After the block the count starts again from zero.
            t.blocked_until_ms = until;
            t.period_start_ms = until;
            t.count = 0;
            checked.blocked_until_ms = Some(until);
            checked.started = true;
        }
        (t, checked)
    }
}

impl crate::engine::Engine {
    /// Before anything else about a request: is its caller in the penalty
    /// box? `Some` verdict: refuse it (429 `temporarily_blocked`).
    pub fn penalty_box(
        &self,
        store: &dyn SharedStore,
        req: &dyn RequestView,
        identity: &Identity,
        now_ms: u64,
    ) -> (Option<crate::engine::Verdict>, Checked) {
        let Some(pb) = &self.penalty else {
            return (None, Checked::default());
        };
        let Some(who) = pb.who(identity, req) else {
            return (None, Checked::default());
        };
        let checked = pb.check(store, who, now_ms, self.policy.state.cas_max_retries);
        let verdict = checked.blocked_until_ms.map(|until| {
            let reply = crate::answer::temporarily_blocked(until.saturating_sub(now_ms), now_ms);
            let reason = crate::answer::Reason::TemporarilyBlocked;
            let mut verdict = self.refused(reply, reason, &identity.tier, None);
            verdict.contention = checked.contention;
            verdict
        });
        (verdict, checked)
    }
}

fn slot_key(slot: u32) -> String {
    format!("{KEY_PREFIX}{slot}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    fn boxed(threshold: &str, block_for: &str, slots: u32) -> (PenaltyBox, MemStore) {
        let config: AbuseConfig = serde_json::from_value(serde_json::json!({
            "threshold": threshold, "block_for": block_for, "slots": slots,
        }))
        .unwrap();
        let pb = PenaltyBox::new(&config);
        let store = MemStore::default();
        pb.prepare(&store).unwrap();
        (pb, store)
    }

    #[test]
    fn the_61st_request_starts_a_block_that_ends_on_time() {
        let (pb, store) = boxed("60/min", "10m", 64);
        let who = 12_345;
        for i in 0..60 {
            let c = pb.check(&store, who, 1_000 + i, 8);
            assert_eq!(c.blocked_until_ms, None, "request {i}");
        }
        let c = pb.check(&store, who, 2_000, 8);
        assert!(c.started);
        assert_eq!(c.blocked_until_ms, Some(2_000 + 600_000));
        // Every request during the block is refused, and does not extend it.
        for t in [2_001, 300_000, 601_999] {
            let c = pb.check(&store, who, t, 8);
            assert_eq!(c.blocked_until_ms, Some(602_000), "at {t}");
            assert!(!c.started);
        }
        // Another caller is not affected.
        assert_eq!(pb.check(&store, 999, 300_000, 8).blocked_until_ms, None);
        // After the block the threshold applies again, from zero.
        for i in 0..60 {
            assert_eq!(
                pb.check(&store, who, 602_000 + i, 8).blocked_until_ms,
                None,
                "after {i}"
            );
        }
        assert!(pb.check(&store, who, 602_100, 8).started);
    }

    #[test]
    fn a_new_period_starts_the_count_again() {
        let (pb, store) = boxed("3/s", "10s", 16);
        for t in [0, 100, 200] {
            assert_eq!(pb.check(&store, 7, t, 8).blocked_until_ms, None);
        }
        // 1 s later: a new period.
        for t in [1_000, 1_100, 1_200] {
            assert_eq!(pb.check(&store, 7, t, 8).blocked_until_ms, None);
        }
        assert!(pb.check(&store, 7, 1_300, 8).started);
    }

    #[test]
    fn a_flood_of_addresses_cannot_evict_a_live_block() {
        let (pb, store) = boxed("5/min", "10m", 32);
        let abuser = 1_000_003;
        for t in 0..6 {
            pb.check(&store, abuser, t, 8);
        }
        assert!(pb.check(&store, abuser, 10, 8).blocked_until_ms.is_some());
        // 10,000 distinct callers within the minute: they fill every free
        // slot, then share the overflow record.
        let mut untracked = 0;
        for who in 0..10_000u64 {
            let c = pb.check(&store, 5_000_000 + who * 7_919, 20, 8);
            untracked += u32::from(c.untracked);
        }
        assert!(untracked > 9_900, "{untracked}");
        assert_eq!(
            pb.check(&store, abuser, 30, 8).blocked_until_ms,
            Some(6 + 600_000 - 1),
            "the block survived the flood"
        );
        // Untracked callers together get one caller's allowance.
        let newcomer = pb.check(&store, 77_777_777_777, 40, 8);
        assert!(newcomer.untracked && newcomer.blocked_until_ms.is_some());
        // Once the period ends, the flood's slots are free again.
        let later = pb.check(&store, 77_777_777_777, 120_000, 8);
        assert_eq!((later.untracked, later.blocked_until_ms), (false, None));
        assert!(store.len() <= 33, "bounded: {} keys", store.len());
    }

    #[test]
    fn config_is_checked_with_field_paths() {
        let base = serde_json::json!({
            "default_tier": "free", "tiers": {"free": {}},
            "identity": {"sources": ["api_key", "client_address"],
                         "api_key": {"keys": {"k1": "free"}}},
        });
        for (abuse, path) in [
            (
                serde_json::json!({"threshold": "0/min", "block_for": "1m"}),
                "abuse.threshold",
            ),
            (
                serde_json::json!({"threshold": "5/min", "block_for": "0s"}),
                "abuse.block_for",
            ),
            (
                serde_json::json!({"threshold": "5/min", "block_for": "1m", "slots": 0}),
                "abuse.slots",
            ),
            (
                serde_json::json!({"threshold": "5/min", "block_for": "1m", "exempt": ["k2"]}),
                "abuse.exempt[0]",
            ),
            (
                serde_json::json!({"threshold": "5/min", "block_for": "1m", "by": "moon"}),
                "abuse.by",
            ),
        ] {
            let mut v = base.clone();
            v["abuse"] = abuse;
            let err = Policy::from_value(v).unwrap_err();
            assert_eq!(err.path, path, "{err}");
            assert!(!err.message.contains("k2"), "never echo a key: {err}");
        }
        let mut v = base.clone();
        v["abuse"] =
            serde_json::json!({"threshold": "60/min", "block_for": "10m", "exempt": ["k1"]});
        let p = Policy::from_value(v).unwrap();
        let pb = PenaltyBox::new(p.abuse.as_ref().unwrap());
        assert!(pb.exempt.contains(&Resolver::principal_of_key("k1")));
    }
}
