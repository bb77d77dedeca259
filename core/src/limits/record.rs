//! One shared-data value for every bucket of one scope (issue 21, lever 1):
//! a caller's buckets of a tier in one record, a model's in one, a route's
//! in one. A request then reads and compare-and-swaps one key per scope it
//! touches, at admission and at settlement, instead of one per bucket.
//!
//! A [`Bundle`] is a header (the owner of a per-caller record, when its
//! owner last took or settled) and entries, each the state of one bucket
//! under the 64-bit hash of its rule id ([`rule_hash`]), so a policy
//! reload that keeps a rule id keeps its count, whatever else changes in
//! the scope. Entries of a per-caller record are [`Kept`] (the bucket, and
//! when it will be idle, so whether the record may change hands is known
//! from the record alone); entries of a shared record are a
//! [`Pool`](crate::limits::shares::Pool) (the bucket and its fair-share
//! accounts), coded by that type.
//!
//! Bounded: at most [`MAX_ENTRIES`] entries. A write moves the entries it
//! wrote to the end, so when a reload has left entries of rules that no
//! longer exist, the ones written longest ago go first.

use crate::limits::bucket::BucketState;
use crate::policy::Limit;
use crate::state::codec::{Reader, Record, Writer};

/// The layout's version byte: any other first byte reads as an empty
/// record (a value an older build left).
const VERSION: u8 = 1;
/// Most entries one record keeps (a tier defines at most a dozen).
pub const MAX_ENTRIES: usize = 64;

/// FNV-1a of a rule id: the entry's name inside its record.
pub fn rule_hash(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The buckets of one scope, as one shared-data value.
#[derive(Debug, Clone, Default)]
pub struct Bundle {
    /// Hash of the caller holding a per-caller record (0: never used); 1
    /// for a shared record.
    pub owner: u64,
    /// When the owner last took or settled (per-caller records).
    pub touched_ms: u64,
    /// Every entry's bytes: one allocation for the record, not one per
    /// bucket (the hot path decodes a record per scope per request). A
    /// record read from shared data keeps the value as it came, its
    /// entries where they lie in it (the bytes between them, headers, are
    /// never read again); an entry written goes at the end.
    data: Vec<u8>,
    /// Per entry, oldest written first: its rule hash, where its bytes
    /// start in `data`, and how many.
    index: Vec<(u64, usize, usize)>,
}

/// Two records are equal when their headers and entries are, in order
/// (not the bytes they were read from).
impl PartialEq for Bundle {
    fn eq(&self, other: &Bundle) -> bool {
        (self.owner, self.touched_ms) == (other.owner, other.touched_ms)
            && self.pairs().eq(other.pairs())
    }
}

impl Eq for Bundle {}

impl Bundle {
    pub fn new(owner: u64, touched_ms: u64) -> Bundle {
        Bundle {
            owner,
            touched_ms,
            data: Vec::new(),
            index: Vec::new(),
        }
    }

    /// Reads a record; a value of another layout (or garbled) reads as
    /// empty, a truncated one as the entries it holds whole. A value
    /// given owned (as shared data hands it over) is kept, not copied.
    pub fn decode(value: impl Into<Vec<u8>>) -> Bundle {
        let data = value.into();
        let mut r = Reader::new(&data);
        if r.try_u8() != Some(VERSION) {
            return Bundle::default();
        }
        let (Some(owner), Some(touched_ms), Some(count)) = (r.try_u64(), r.try_u64(), r.try_u16())
        else {
            return Bundle::default();
        };
        let count = usize::from(count).min(MAX_ENTRIES);
        let mut index = Vec::with_capacity(count);
        for _ in 0..count {
            let (Some(id), Some(len)) = (r.try_u64(), r.try_u16()) else {
                break;
            };
            let at = data.len() - r.rest().len();
            if r.try_bytes(usize::from(len)).is_none() {
                break;
            }
            index.push((id, at, usize::from(len)));
        }
        Bundle {
            owner,
            touched_ms,
            data,
            index,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(19 + 10 * self.index.len() + self.data.len());
        w.u8(VERSION).u64(self.owner).u64(self.touched_ms);
        w.u16(self.index.len() as u16);
        for (id, bytes) in self.pairs() {
            w.u64(id).u16(bytes.len().min(usize::from(u16::MAX)) as u16);
            w.bytes(bytes.get(..usize::from(u16::MAX)).unwrap_or(bytes));
        }
        w.into_bytes()
    }

    fn pairs(&self) -> impl Iterator<Item = (u64, &[u8])> {
        self.index
            .iter()
            .map(|&(id, at, len)| (id, self.data.get(at..at + len).unwrap_or_default()))
    }

    /// The entry of rule `id`, if the record has one.
    pub fn get(&self, id: u64) -> Option<&[u8]> {
        self.pairs().find(|(i, _)| *i == id).map(|(_, b)| b)
    }

    /// Writes the entry of rule `id` (moved to the end: the most recently
    /// written), dropping the oldest beyond [`MAX_ENTRIES`].
    #[cfg(test)]
    pub fn put(&mut self, id: u64, bytes: Vec<u8>) {
        self.put_with(id, |w| {
            w.bytes(&bytes);
        });
    }

    /// [`Self::put`], the entry written by `write` in place (no buffer of
    /// its own on the hot path).
    pub fn put_with(&mut self, id: u64, write: impl FnOnce(&mut Writer)) {
        self.remove(|i| i == id);
        let at = self.data.len();
        let mut w = Writer::onto(std::mem::take(&mut self.data));
        write(&mut w);
        self.data = w.into_bytes();
        self.index.push((id, at, self.data.len() - at));
        if self.index.len() > MAX_ENTRIES {
            if let Some(&(oldest, _, _)) = self.index.first() {
                self.remove(|i| i == oldest);
            }
        }
    }

    /// Takes out the first entry whose id `matches`, closing the gap.
    fn remove(&mut self, matches: impl Fn(u64) -> bool) {
        let Some(pos) = self.index.iter().position(|&(i, _, _)| matches(i)) else {
            return;
        };
        let (_, at, len) = self.index.remove(pos);
        self.data.drain(at..at + len);
        for e in &mut self.index {
            if e.1 > at {
                e.1 -= len;
            }
        }
    }

    /// Every entry's bytes.
    pub fn entries(&self) -> impl Iterator<Item = &[u8]> {
        self.pairs().map(|(_, b)| b)
    }
}

/// One per-caller bucket inside its record: the bucket, when it will be
/// idle (0: it is), and whether it is a calendar budget (handed over after
/// `slot_hold` untouched, its charges kept by the sketch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Kept {
    pub used: u64,
    pub updated_ms: u64,
    pub idle_at_ms: u64,
    pub budget: bool,
}

impl Kept {
    /// `state` after a write at `now_ms` under `limit`.
    pub fn of(state: BucketState, limit: &Limit, now_ms: u64) -> Kept {
        let idle_at_ms = if state.used == 0 {
            0
        } else {
            now_ms.saturating_add(state.quota(limit, now_ms).reset_ms)
        };
        Kept {
            used: state.used,
            updated_ms: state.updated_ms,
            idle_at_ms,
            budget: limit.window.is_some(),
        }
    }

    pub fn state(&self, owner: u64) -> BucketState {
        BucketState {
            owner,
            used: self.used,
            updated_ms: self.updated_ms,
        }
    }

    /// May the record change hands as far as this bucket goes?
    pub fn takeable(&self, touched_ms: u64, hold_ms: u64, now_ms: u64) -> bool {
        self.idle_at_ms <= now_ms || (self.budget && touched_ms.saturating_add(hold_ms) <= now_ms)
    }

    /// Milliseconds until it may (0: now).
    pub fn frees_in(&self, touched_ms: u64, hold_ms: u64, now_ms: u64) -> u64 {
        let at = if self.budget {
            self.idle_at_ms.min(touched_ms.saturating_add(hold_ms))
        } else {
            self.idle_at_ms
        };
        at.saturating_sub(now_ms)
    }
}

impl Record for Kept {
    const LEN: usize = 25;

    fn write(&self, w: &mut Writer) {
        w.u64(self.used).u64(self.updated_ms).u64(self.idle_at_ms);
        w.u8(u8::from(self.budget));
    }

    fn read(r: &mut Reader) -> Self {
        Kept {
            used: r.u64(),
            updated_ms: r.u64(),
            idle_at_ms: r.u64(),
            budget: r.u8() != 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_record_round_trips_and_keeps_entries_by_rule() {
        let mut b = Bundle::new(7, 9);
        b.put(rule_hash("tier/t/requests"), vec![1, 2, 3]);
        b.put(rule_hash("tier/t/tokens"), vec![4]);
        b.put(rule_hash("tier/t/requests"), vec![5]);
        let back = Bundle::decode(b.encode());
        assert_eq!(back, b);
        assert_eq!(back.get(rule_hash("tier/t/requests")), Some(&[5u8][..]));
        assert_eq!(back.get(rule_hash("tier/t/daily")), None);
        assert_eq!(back.entries().count(), 2);
    }

    #[test]
    fn a_record_stays_bounded() {
        let mut b = Bundle::default();
        for i in 0..(MAX_ENTRIES as u64 + 10) {
            b.put(i, vec![0; 25]);
        }
        assert_eq!(b.entries().count(), MAX_ENTRIES);
        assert_eq!(b.get(0), None, "the oldest went first");
        assert!(b.get(MAX_ENTRIES as u64 + 9).is_some());
    }

    #[test]
    fn an_older_layout_reads_as_empty() {
        assert_eq!(Bundle::decode([0u8; 24]), Bundle::default());
        assert_eq!(Bundle::decode(b""), Bundle::default());
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let b = Bundle::decode(bytes.as_slice());
            prop_assert_eq!(Bundle::decode(b.encode()), b);
        }

        /// A record kept in the value it was read from (its entries where
        /// they lie, headers between them) writes, rewrites and drops
        /// entries as one built entry by entry does, byte for byte.
        #[test]
        fn a_record_kept_in_its_value_writes_as_a_built_one(
            entries in prop::collection::vec((0u64..6, prop::collection::vec(any::<u8>(), 0..40)), 0..8),
            writes in prop::collection::vec((0u64..8, prop::collection::vec(any::<u8>(), 0..40)), 0..8),
        ) {
            let mut built = Bundle::new(7, 9);
            for (id, bytes) in &entries {
                built.put(*id, bytes.clone());
            }
            let mut kept = Bundle::decode(built.encode());
            prop_assert_eq!(&kept, &built);
            for (id, bytes) in writes {
                built.put(id, bytes.clone());
                kept.put(id, bytes);
                prop_assert_eq!(kept.encode(), built.encode());
            }
        }

        #[test]
        fn kept_round_trips(used: u64, updated: u64, idle: u64, budget: bool) {
            let k = Kept { used, updated_ms: updated, idle_at_ms: idle, budget };
            prop_assert_eq!(Kept::decode(&k.encode()), k);
        }
    }
}
