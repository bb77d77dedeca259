//! The penalty box (`abuse`): a caller that sends more than `threshold`
//! requests within one period is refused 429 `temporarily_blocked`, with
//! `Retry-After`, for `block_for`; then its count starts again from zero.
//! Counted per client address (IPv6 by `identity.ipv6_prefix`, default
//! `/64`, as everywhere) or per principal (`by`); declared API keys can be
//! exempt. Every request counts,
//! admitted or not, and so does every failed authentication (a 401): the box
//! is about the pressure a caller puts on the gateway, before any bucket.
//!
//! Counts: a count-min sketch with conservative update, in fixed shared
//! data. [`SKETCH_KEYS`] (1,024) independent sub-sketches, each one key of
//! [`DEPTH`] (4) rows × [`WIDTH`] (64) u32 counters and the start of its
//! period (1,032 bytes; 1 MiB in all). A caller hashes to one sub-sketch
//! and to one counter per row; its estimate is the smallest of its 4
//! counters, and a request raises only those of them that equal the
//! estimate (conservative update), all in one compare-and-swap of one key.
//! The estimate is never below the caller's true count. It exceeds it only
//! by what colliding callers sent: with `n` requests in the caller's
//! sub-sketch in the period, the excess is at least `x` with probability at
//! most `(n / (WIDTH·x))^DEPTH` (Markov on each of the 4 independent rows).
//! A newcomer is blocked by others only when that excess reaches
//! `threshold`. With `N` requests from everyone else in a period (about
//! `N / 1024` per sub-sketch), that is at most `(N / (65,536 · threshold))^4`:
//! for the 6,000 one-shot addresses of issue 18 at 60/min, about 5e-12 per
//! newcomer (4e-10 in the busiest sub-sketch); for that flood kept up a
//! whole minute (200,000 requests), about 7e-6; under 1 % as long as
//! everyone else sends fewer than about 20,000 × threshold requests per
//! period (1.2 M/min at 60/min). One-shot
//! callers never take a block record, so however many there are they cannot
//! fill anything: they only raise counters, by one request each.
//!
//! Blocks: [`BLOCK_KEYS`] (2,048) keys of [`RECORDS`] (8) block records of
//! 32 bytes (owner, blocked until, period start, count forgiven), 512 KiB in
//! all. Only a caller over the threshold takes a record, in the one key its
//! hash names. A live block is never evicted; a record is free again once
//! its block and its period are over. If all 8 records of that key hold
//! live blocks (8 blocked callers in one key at once), the newcomer over
//! the threshold is still refused — by the sketch, until its period ends,
//! not for `block_for` — and counted in `sluice_abuse_untracked_total`.
//!
//! Reloads. The key set and every hash above are constants, independent of
//! the policy (`abuse.slots` no longer shapes anything; it is accepted so
//! older configs load): a reload keeps every count and every block. A
//! changed period takes effect at the next period start of each sub-sketch.
//! Periods are per sub-sketch: the first request after a period ended
//! starts the next one (for a lone caller, its own first request).
//!
//! Hashes are fixed (unkeyed), as for the buckets: an attacker who could
//! aim addresses at a victim's 4 counters could push the victim's estimate
//! up — and be refused itself long before (every request it aims counts
//! against its own addresses too). Without a source of randomness in the
//! VM the seed would be as public as the code.
//!
//! Contention. Each key is updated with compare-and-swap, retried up to
//! `state.cas_max_retries` times (counted). A request whose count cannot be
//! written then goes on uncounted (the buckets behind the box still hold
//! their exact limits); the exhaustion is counted in
//! `sluice_cas_exhausted_total`.

use hashbrown::HashSet;

use crate::admission::identity::{Identity, RequestView};
use crate::limits::slot_table::{self, SlotSeen, SlotTable};
use crate::policy::abuse::{AbuseConfig, By};
use crate::policy::units::Rate;
use crate::state::codec::{Reader, Record, Writer};
use crate::state::store::{retry, Attempt, Contention, SharedStore, StoreError};

/// Sub-sketches (one shared-data key each).
pub const SKETCH_KEYS: u32 = 1024;
/// Rows of each sub-sketch.
pub const DEPTH: usize = 4;
/// Counters per row.
pub const WIDTH: usize = 64;
/// Keys of block records.
pub const BLOCK_KEYS: u32 = 2048;
/// Block records per key.
pub const RECORDS: usize = 8;
const SKETCH_PREFIX: &str = "sluice:v2:abuse:cm:";
const BLOCK_PREFIX: &str = "sluice:v2:abuse:block:";
/// The sub-sketches, one key each (`{SKETCH_PREFIX}{i}`), placed by hash.
const SKETCHES: SlotTable<'static> = SlotTable::flat(SKETCH_PREFIX, SKETCH_KEYS, 1);
/// The block keys (`{BLOCK_PREFIX}{i}`): a caller's one key, then one of
/// its [`RECORDS`] records (see [`PenaltyBox::record`]).
const BLOCKS: SlotTable<'static> = SlotTable::flat(BLOCK_PREFIX, BLOCK_KEYS, 1);

/// One sub-sketch: when its period started, and its counters, row after
/// row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sketch {
    pub period_start_ms: u64,
    pub counters: [u32; DEPTH * WIDTH],
}

impl Default for Sketch {
    fn default() -> Sketch {
        Sketch {
            period_start_ms: 0,
            counters: [0; DEPTH * WIDTH],
        }
    }
}

impl Record for Sketch {
    const LEN: usize = 8 + DEPTH * WIDTH * 4;

    fn write(&self, w: &mut Writer) {
        w.u64(self.period_start_ms);
        for c in &self.counters {
            w.u32(*c);
        }
    }

    fn read(r: &mut Reader) -> Self {
        let period_start_ms = r.u64();
        let mut counters = [0; DEPTH * WIDTH];
        for c in &mut counters {
            *c = r.u32();
        }
        Sketch {
            period_start_ms,
            counters,
        }
    }
}

/// One blocked caller: until when, and what of its count the block
/// already paid for (so that after the block its count starts from zero).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Block {
    pub owner: u64,
    pub blocked_until_ms: u64,
    /// The sketch period the forgiven count belongs to.
    pub period_start_ms: u64,
    pub forgiven: u64,
}

impl Record for Block {
    const LEN: usize = 32;

    fn write(&self, w: &mut Writer) {
        w.u64(self.owner)
            .u64(self.blocked_until_ms)
            .u64(self.period_start_ms)
            .u64(self.forgiven);
    }

    fn read(r: &mut Reader) -> Self {
        Block {
            owner: r.u64(),
            blocked_until_ms: r.u64(),
            period_start_ms: r.u64(),
            forgiven: r.u64(),
        }
    }
}

/// The records of one block key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Blocks(pub [Block; RECORDS]);

impl Record for Blocks {
    const LEN: usize = RECORDS * Block::LEN;

    fn write(&self, w: &mut Writer) {
        for b in &self.0 {
            b.write(w);
        }
    }

    fn read(r: &mut Reader) -> Self {
        let mut out = Blocks::default();
        for b in out.0.iter_mut() {
            *b = Block::read(r);
        }
        out
    }
}

/// What the box says about one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checked {
    /// Refused until then (ms since the epoch).
    pub blocked_until_ms: Option<u64>,
    /// This request started the block.
    pub started: bool,
    /// Over the threshold, but every block record its key has holds a live
    /// block: refused by the sketch until its period ends.
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
    ipv6_prefix: u8,
    /// The deployment's hash key: where an address counts.
    key: crate::policy::keys::HashKey,
}

/// Where one caller lives: its sub-sketch, its counter in each row, its
/// block key. Constants only: the same in every policy.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Place {
    sketch: u32,
    cells: [usize; DEPTH],
    block: u32,
}

fn place(who: u64) -> Place {
    let h = mix(who);
    let mut cells = [0usize; DEPTH];
    for (row, cell) in cells.iter_mut().enumerate() {
        let column = mix(who ^ (row as u64 + 1).wrapping_mul(0xa076_1d64_78bd_642f)) % WIDTH as u64;
        *cell = row * WIDTH + column as usize;
    }
    Place {
        sketch: SKETCHES.home(h),
        cells,
        block: BLOCKS.home(h >> 32),
    }
}

/// splitmix64's finalizer: an independent mix per row of the (already
/// keyed) caller hash.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl PenaltyBox {
    /// `ipv6_prefix`: the policy's (`policy::identity::ipv6_prefix`), so
    /// that the box counts an address as the caller identity makes of it.
    pub fn new(config: &AbuseConfig, ipv6_prefix: u8) -> PenaltyBox {
        PenaltyBox {
            threshold: config.threshold,
            block_for_ms: config.block_for_ms,
            by: config.by,
            exempt: config
                .exempt
                .iter()
                .map(|k| crate::policy::keys::principal_of_key(k))
                .collect(),
            exempt_declared: config.exempt_declared,
            ipv6_prefix,
            key: Default::default(),
        }
    }

    /// Counts addresses under `key` from now on (the principal's hash is
    /// already keyed).
    pub fn set_key(&mut self, key: crate::policy::keys::HashKey) {
        self.key = key;
    }

    /// Creates the box's keys (empty) unless they exist: the same fixed
    /// set for every policy.
    pub fn prepare(&self, store: &dyn SharedStore) -> Result<usize, StoreError> {
        let created = SKETCHES.prepare(store, &Sketch::default().encode())?;
        Ok(created + BLOCKS.prepare(store, &Blocks::default().encode())?)
    }

    /// Whom the box counts for this request; `None`: exempt (or no
    /// address to count by).
    pub fn who(&self, identity: &Identity, req: &dyn RequestView) -> Option<u64> {
        if identity.declared && (self.exempt_declared || self.exempt.contains(&identity.principal))
        {
            return None;
        }
        let from_address = identity.source == Some(crate::policy::IdentitySource::ClientAddress);
        match self.by {
            By::Principal if !from_address => Some(identity.hash.max(1)),
            _ => self.who_by_address(req),
        }
    }

    /// The caller as its address counts (a failed authentication has no
    /// principal: its address is what the box counts).
    pub fn who_by_address(&self, req: &dyn RequestView) -> Option<u64> {
        req.client_address()
            .map(|a| crate::admission::identity::address_hash(&self.key, &a, self.ipv6_prefix))
            // 0 marks a free record.
            .map(|h| h.max(1))
    }

    /// Counts one request of `who` and says whether it is blocked.
    pub fn check(&self, store: &dyn SharedStore, who: u64, now_ms: u64, max_tries: u32) -> Checked {
        let mut contention = Contention::default();
        let at = place(who);
        let bkey = BLOCKS.key(at.block);
        let mine = store
            .get(&bkey)
            .map(|(bytes, _)| Blocks::decode(&bytes))
            .and_then(|b| b.0.iter().copied().find(|r| r.owner == who));
        if let Some(until) = mine.map(|r| r.blocked_until_ms).filter(|&u| u > now_ms) {
            // Blocked: nothing to write; the block is not extended.
            return Checked {
                blocked_until_ms: Some(until),
                ..Checked::default()
            };
        }
        let Some((estimate, period_start)) =
            self.count(store, &at, now_ms, max_tries, &mut contention)
        else {
            return Checked {
                contention,
                ..Checked::default()
            };
        };
        let forgiven = mine
            .filter(|r| r.period_start_ms == period_start)
            .map_or(0, |r| r.forgiven);
        let mut checked = Checked {
            contention,
            ..Checked::default()
        };
        if estimate.saturating_sub(forgiven) <= self.threshold.amount {
            return checked;
        }
        let until = now_ms.saturating_add(self.block_for_ms);
        let block = Block {
            owner: who,
            blocked_until_ms: until,
            period_start_ms: period_start,
            forgiven: estimate,
        };
        match self.record(
            store,
            &bkey,
            block,
            now_ms,
            max_tries,
            &mut checked.contention,
        ) {
            Some(true) => {
                checked.blocked_until_ms = Some(until);
                checked.started = true;
            }
            Some(false) => {
                // No record free: refused by the sketch until the period
                // ends (each request until then is over the threshold).
                let end = period_start.saturating_add(self.threshold.period_ms);
                checked.blocked_until_ms = Some(end.max(now_ms.saturating_add(1_000)));
                checked.untracked = true;
            }
            // Not written (contention, host): goes on, as a count would.
            None => {}
        }
        checked
    }

    /// One request on the caller's sub-sketch (conservative update): its
    /// estimate after it, and the period it counts in. `None`: not written.
    fn count(
        &self,
        store: &dyn SharedStore,
        at: &Place,
        now_ms: u64,
        max_tries: u32,
        contention: &mut Contention,
    ) -> Option<(u64, u64)> {
        let key = SKETCHES.key(at.sketch);
        let period = self.threshold.period_ms;
        retry(max_tries, contention, || {
            let Some((bytes, cas)) = store.get(&key) else {
                return Attempt::Done(None);
            };
            let mut sketch = Sketch::decode(&bytes);
            // A `now` a little before the period's start (another worker's
            // request that arrived earlier) counts in it: only a period's
            // end starts the next, so no interleaving can wipe counts.
            if now_ms >= sketch.period_start_ms.saturating_add(period) {
                sketch = Sketch {
                    period_start_ms: now_ms,
                    ..Sketch::default()
                };
            }
            let least = at
                .cells
                .iter()
                .map(|&c| sketch.counters.get(c).copied().unwrap_or(0))
                .min()
                .unwrap_or(0);
            let next = least.saturating_add(1);
            for &c in &at.cells {
                if let Some(counter) = sketch.counters.get_mut(c) {
                    *counter = (*counter).max(next);
                }
            }
            match store.set(&key, &sketch.encode(), cas) {
                Ok(()) => Attempt::Done(Some((u64::from(next), sketch.period_start_ms))),
                Err(StoreError::CasMismatch) => Attempt::Lost,
                Err(StoreError::Host(_)) => Attempt::Done(None),
            }
        })
        .flatten()
    }

    /// Writes `block` into its key: over the caller's own record, else a
    /// free one. `Some(false)`: every record holds a live block.
    fn record(
        &self,
        store: &dyn SharedStore,
        key: &str,
        block: Block,
        now_ms: u64,
        max_tries: u32,
        contention: &mut Contention,
    ) -> Option<bool> {
        let period = self.threshold.period_ms;
        retry(max_tries, contention, || {
            let Some((bytes, cas)) = store.get(key) else {
                return Attempt::Done(None);
            };
            let mut blocks = Blocks::decode(&bytes);
            let free = |r: &Block| {
                r.owner == 0
                    || (r.blocked_until_ms <= now_ms
                        && now_ms >= r.period_start_ms.saturating_add(period))
            };
            // The key's records are the slots probed: the caller's own
            // record, else the first free one.
            let at = slot_table::claim(0..RECORDS, |&i| match blocks.0.get(i) {
                Some(r) if r.owner == block.owner => SlotSeen::Mine,
                Some(r) if free(r) => SlotSeen::Free(()),
                _ => SlotSeen::Busy,
            })
            .slot();
            let Some(slot) = blocks.0.get_mut(at.unwrap_or(RECORDS)) else {
                return Attempt::Done(Some(false));
            };
            *slot = block;
            match store.set(key, &blocks.encode(), cas) {
                Ok(()) => Attempt::Done(Some(true)),
                Err(StoreError::CasMismatch) => Attempt::Lost,
                Err(StoreError::Host(_)) => Attempt::Done(None),
            }
        })
        .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;
    use crate::state::store::MemStore;

    fn config(threshold: &str, block_for: &str, slots: u32) -> AbuseConfig {
        serde_json::from_value(serde_json::json!({
            "threshold": threshold, "block_for": block_for, "slots": slots,
        }))
        .unwrap()
    }

    fn boxed(threshold: &str, block_for: &str, slots: u32) -> (PenaltyBox, MemStore) {
        let pb = PenaltyBox::new(&config(threshold, block_for, slots), 64);
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
    fn a_block_shorter_than_the_period_forgives_what_it_paid_for() {
        let (pb, store) = boxed("5/min", "2s", 64);
        for t in 0..5 {
            assert_eq!(pb.check(&store, 7, t, 8).blocked_until_ms, None);
        }
        assert!(pb.check(&store, 7, 10, 8).started);
        // Same period, block over: the count starts from zero.
        for t in 0..5 {
            assert_eq!(pb.check(&store, 7, 3_000 + t, 8).blocked_until_ms, None);
        }
        assert!(pb.check(&store, 7, 3_010, 8).started);
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

    /// Issue 18's flood: 6,000 one-request addresses in 1.8 s, then
    /// first-time callers. Today's table filled and its overflow record
    /// blocked every newcomer; the sketch gives each its own count.
    #[test]
    fn a_flood_of_one_shot_callers_blocks_no_newcomer_and_no_block_is_lost() {
        let (pb, store) = boxed("60/min", "10m", 4096);
        let abuser = 1_000_003;
        for t in 0..61 {
            pb.check(&store, abuser, t, 8);
        }
        let until = pb.check(&store, abuser, 100, 8).blocked_until_ms;
        assert_eq!(until, Some(60 + 600_000));
        for i in 0..6_000u64 {
            let who = crate::admission::identity::address_hash(
                &Default::default(),
                &format!("10.{}.{}.{}:40000", i >> 16, (i >> 8) & 255, i & 255),
                64,
            );
            let c = pb.check(&store, who, 200 + i * 3 / 10, 8);
            assert_eq!(c.blocked_until_ms, None, "flood caller {i}");
        }
        for i in 0..1_000u64 {
            let c = pb.check(&store, 9_000_000_000 + i * 7_919, 2_000, 8);
            assert_eq!(c.blocked_until_ms, None, "newcomer {i}");
        }
        assert_eq!(pb.check(&store, abuser, 2_100, 8).blocked_until_ms, until);
        // And the storage did not grow.
        assert_eq!(store.len(), (SKETCH_KEYS + BLOCK_KEYS) as usize);
    }

    #[test]
    fn the_estimate_is_never_below_the_true_count() {
        let (pb, store) = boxed("1000000/h", "10m", 64);
        let at = |who: u64| place(who);
        // 300 callers, caller i sends i % 17 + 1 requests, interleaved.
        let mut sent = vec![0u64; 300];
        for round in 0..17u64 {
            for (i, n) in sent.iter_mut().enumerate() {
                if round < (i as u64 % 17) + 1 {
                    pb.check(&store, 5_000 + i as u64, round, 8);
                    *n += 1;
                }
            }
        }
        for (i, n) in sent.iter().enumerate() {
            let p = at(5_000 + i as u64);
            let (bytes, _) = store.get(&SKETCHES.key(p.sketch)).unwrap();
            let s = Sketch::decode(&bytes);
            let est = p.cells.iter().map(|&c| s.counters[c]).min().unwrap();
            assert!(u64::from(est) >= *n, "caller {i}: {est} < {n}");
        }
    }

    proptest::proptest! {
        /// Whatever the mix of callers, within one period no caller gets
        /// more than `threshold` requests through: the sketch never
        /// under-counts (a collision can only refuse early).
        #[test]
        fn no_caller_gets_more_than_the_threshold(
            calls in proptest::collection::vec(0u64..40, 1..600),
        ) {
            let (pb, store) = boxed("5/h", "2h", 64);
            let mut passed = std::collections::HashMap::new();
            for (t, who) in calls.iter().enumerate() {
                let who = who * 1_024 + 7;
                if pb.check(&store, who, t as u64, 8).blocked_until_ms.is_none() {
                    *passed.entry(who).or_insert(0u64) += 1;
                }
            }
            for (who, n) in passed {
                proptest::prop_assert!(n <= 5, "caller {} got {} through", who, n);
            }
        }
    }

    #[test]
    fn requests_out_of_arrival_order_keep_the_count() {
        let (pb, store) = boxed("5/min", "10m", 64);
        // Two workers: arrival times interleave out of order.
        for t in [1_000, 999, 1_002, 998, 1_001] {
            assert_eq!(pb.check(&store, 7, t, 8).blocked_until_ms, None);
        }
        assert!(pb.check(&store, 7, 997, 8).started, "the 6th is over");
    }

    #[test]
    fn a_full_block_key_still_refuses_until_the_period_ends() {
        let (pb, store) = boxed("2/min", "10m", 64);
        // Nine callers whose blocks all go to one key.
        let target = place(1).block;
        let whos: Vec<u64> = (2..)
            .filter(|&w| place(w).block == target)
            .take(RECORDS + 1)
            .collect();
        for (n, &who) in whos.iter().enumerate() {
            for t in 0..2 {
                assert_eq!(pb.check(&store, who, t, 8).blocked_until_ms, None);
            }
            let c = pb.check(&store, who, 10, 8);
            assert!(c.blocked_until_ms.is_some(), "caller {n}");
            assert_eq!((c.started, c.untracked), (n < RECORDS, n == RECORDS));
        }
        let last = whos[RECORDS];
        let c = pb.check(&store, last, 1_000, 8);
        assert!(c.untracked && c.blocked_until_ms == Some(60_000), "{c:?}");
        // The eight blocks stand.
        for &who in &whos[..RECORDS] {
            assert_eq!(
                pb.check(&store, who, 1_000, 8).blocked_until_ms,
                Some(600_010)
            );
        }
    }

    /// Issue 18 item 8: the home slot was `who % slots`, so a reload from
    /// 4,096 to 4,099 slots lost every block. The layout is now constant.
    #[test]
    fn a_reload_with_other_sizes_keeps_blocks_and_counts() {
        let (pb, store) = boxed("5/min", "10m", 4096);
        for t in 0..6 {
            pb.check(&store, 42, t, 8);
        }
        for t in 0..4 {
            pb.check(&store, 43, t, 8);
        }
        let reloaded = PenaltyBox::new(&config("5/min", "10m", 4099), 64);
        assert_eq!(reloaded.prepare(&store).unwrap(), 0, "same keys");
        assert_eq!(
            reloaded.check(&store, 42, 100, 8).blocked_until_ms,
            Some(600_005)
        );
        assert_eq!(reloaded.check(&store, 43, 100, 8).blocked_until_ms, None);
        assert!(
            reloaded.check(&store, 43, 101, 8).started,
            "its count survived"
        );
    }

    /// Issue 29: four addresses computed to share a victim's counters,
    /// 61 requests each, blocked an address that sent nothing. That needs
    /// the key: computed under one key, the same addresses leave the
    /// victim alone under the deployment's.
    #[test]
    fn addresses_computed_to_collide_under_one_key_do_not_under_another() {
        use crate::policy::keys::HashKey;
        let known = HashKey::derive("test", b"a key the attacker knows");
        let who =
            |key: &HashKey, a: &str| crate::admission::identity::address_hash(key, a, 64).max(1);
        let victim = "192.0.2.1:1";
        let aim = place(who(&known, victim));
        let address = |i: u32| format!("10.{}.{}.{}:1", i >> 16, (i >> 8) & 255, i & 255);
        let colliders: Vec<String> = (0..DEPTH)
            .map(|row| {
                (0..1u32 << 24)
                    .map(address)
                    .find(|a| {
                        let p = place(who(&known, a));
                        p.sketch == aim.sketch && p.cells[row] == aim.cells[row]
                    })
                    .unwrap()
            })
            .collect();
        let victim_blocked = |key: &HashKey| {
            let (pb, store) = boxed("60/min", "10m", 4096);
            for (n, a) in colliders.iter().enumerate() {
                for i in 0..61 {
                    pb.check(&store, who(key, a), (n * 61 + i) as u64, 8);
                }
            }
            pb.check(&store, who(key, victim), 1_000, 8)
                .blocked_until_ms
                .is_some()
        };
        assert!(victim_blocked(&known), "the attack, with the key");
        let deployment = HashKey::derive("test", b"the deployment's own key");
        assert!(!victim_blocked(&deployment), "the same addresses, keyed");
    }

    #[test]
    fn ipv6_callers_are_counted_by_prefix() {
        let c =
            |a: &str, p: u8| crate::admission::identity::address_hash(&Default::default(), a, p);
        assert_eq!(
            c("[2001:db8:1:2::1]:443", 64),
            c("[2001:db8:1:2:ffff::9]:1", 64)
        );
        assert_ne!(
            c("[2001:db8:1:2::1]:443", 64),
            c("[2001:db8:1:3::1]:443", 64)
        );
        assert_eq!(
            c("[2001:db8:1:2::1]:443", 48),
            c("[2001:db8:1:3::1]:443", 48)
        );
        assert_ne!(c("[2001:db8::1]:1", 128), c("[2001:db8::2]:1", 128));
        // IPv4 (and IPv4 mapped into IPv6) is the whole address.
        assert_eq!(c("1.2.3.4:5", 64), c("[::ffff:1.2.3.4]:5", 64));
        assert_ne!(c("1.2.3.4:5", 64), c("1.2.3.5:5", 64));
        assert_eq!(c("1.2.3.4:5", 64), c("1.2.3.4:7", 48), "IPv4 counts whole");
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
                serde_json::json!({"threshold": "5/min", "block_for": "1m", "ipv6_prefix": 0}),
                "abuse.ipv6_prefix",
            ),
            (
                serde_json::json!({"threshold": "5/min", "block_for": "1m", "ipv6_prefix": 129}),
                "abuse.ipv6_prefix",
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
        let pb = PenaltyBox::new(
            p.abuse.as_ref().unwrap(),
            crate::policy::identity::ipv6_prefix(&p),
        );
        assert!(pb
            .exempt
            .contains(&crate::policy::keys::principal_of_key("k1")));
        assert_eq!(pb.ipv6_prefix, 64);
    }
}
