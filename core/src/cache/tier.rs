//! The exact cache's tier inside Envoy: in single-Envoy mode an exact
//! lookup and an exact store are shared-data reads and writes, not
//! callouts to the sidecar (a miss's lookup and store callouts cost about
//! 140 µs of Envoy CPU together; docs/src/benchmark-history.md, "Where a
//! miss's CPU went, and the exact tier in Envoy").
//!
//! - **Bounded key set.** Envoy never frees a shared-data key, so the tier
//!   is `sets` × [`WAYS`] fixed slots: one index record per set
//!   (`sluice:v1:cache:set:<n>`: per way a 16-byte tag, stored-at, expiry,
//!   generation, a flag) and one entry per slot (`sluice:v1:cache:e:<n>:<w>`).
//!   Keys exist only once written: at most `sets` × (1 + [`WAYS`]).
//! - **Memory bound**: slots × (`max_entry_bytes` + [`ENTRY_HEADER`]) +
//!   sets × [`INDEX_BYTES`] (`InEnvoyConfig::memory_bound`, which
//!   check-config prints); an answer over `max_entry_bytes` is kept by the
//!   sidecar instead and its slot only says so ([`Lookup::Remote`]).
//! - **Never a wrong answer.** The set is chosen by the salted key; an
//!   entry answers only if its own full 32-byte key is the request's, it
//!   has not expired and its generation is the current one. A store claims
//!   its way in the index by compare-and-swap, then writes the entry:
//!   a reader in between, or two writers racing, see a key mismatch — a
//!   miss, never another question's answer.
//! - **Purge.** Every entry carries the sidecar's `cache_generation` of
//!   when it was stored; an admin purge (and a sidecar restart) changes
//!   it, and the state push that says so makes every entry a miss.
//! - **Eviction**: a full set drops its oldest-stored entry (expired or
//!   purged ones first); one scope can evict another's, never read it.
//!   Undeclared callers (anonymous addresses, undeclared keys, any caller
//!   whose API key the policy does not list) hold at most
//!   [`UNDECLARED_WAYS`] ways of a set and evict only each other's
//!   entries there, so a flood of new identities storing ever-new answers
//!   cannot push the declared callers' answers out; a declared caller's
//!   store evicts an undeclared entry first.

use crate::state::codec::{Reader, Writer};
use crate::state::store::{SharedStore, StoreError};

use crate::policy::cache::{
    InEnvoyConfig, IN_ENVOY_ENTRY_HEADER, IN_ENVOY_WAYS, IN_ENVOY_WAY_BYTES, MAX_IN_ENVOY_SLOTS,
};

/// Slots per set.
pub const WAYS: usize = IN_ENVOY_WAYS as usize;
const INDEX_PREFIX: &str = "sluice:v1:cache:set:";
const ENTRY_PREFIX: &str = "sluice:v1:cache:e:";
/// One way in an index record: tag, stored at, expires at, generation, flags.
const WAY_BYTES: usize = IN_ENVOY_WAY_BYTES as usize;
/// One set's index record.
pub const INDEX_BYTES: usize = WAYS * WAY_BYTES;
/// An entry before its body: key, generation, stored at, expires at,
/// prompt and completion tokens, spend.
pub const ENTRY_HEADER: usize = IN_ENVOY_ENTRY_HEADER as usize;
/// The most ways of one set undeclared callers' answers hold.
pub const UNDECLARED_WAYS: usize = WAYS / 2;
/// Index writes lost to another worker before the store gives up.
const TRIES: u32 = 4;

/// The salted exact key (SHA-256).
pub type Key = [u8; 32];

/// The key as the filter's hex text; `None` if it is not 64 hex digits.
pub fn key_of_hex(hex: &str) -> Option<Key> {
    let b = hex.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        let pair = std::str::from_utf8(&b[2 * i..2 * i + 2]).ok()?;
        *o = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Way {
    tag: [u8; 16],
    stored_ms: u64,
    expires_ms: u64,
    generation: u64,
    /// The answer is at the sidecar (larger than the tier takes).
    remote: bool,
    /// Stored by an undeclared caller (see "Eviction").
    undeclared: bool,
}

/// The flag bits of a way.
const REMOTE: u8 = 1;
const UNDECLARED: u8 = 2;

impl Way {
    fn live(&self, now_ms: u64, generation: u64) -> bool {
        self.expires_ms > now_ms && self.generation == generation
    }
}

fn decode_index(bytes: &[u8]) -> [Way; WAYS] {
    let mut ways = [Way::default(); WAYS];
    if bytes.len() != INDEX_BYTES {
        return ways;
    }
    let mut r = Reader::new(bytes);
    for w in ways.iter_mut() {
        let mut tag = [0u8; 16];
        tag.copy_from_slice(r.try_bytes(16).unwrap_or(&[0; 16]));
        *w = Way {
            tag,
            stored_ms: r.u64(),
            expires_ms: r.u64(),
            generation: r.u64(),
            remote: false,
            undeclared: false,
        };
        let flags = r.u8();
        w.remote = flags & REMOTE != 0;
        w.undeclared = flags & UNDECLARED != 0;
    }
    ways
}

fn encode_index(ways: &[Way; WAYS]) -> Vec<u8> {
    let mut w = Writer::with_capacity(INDEX_BYTES);
    for way in ways {
        w.bytes(&way.tag);
        w.u64(way.stored_ms);
        w.u64(way.expires_ms);
        w.u64(way.generation);
        w.u8((u8::from(way.remote) * REMOTE) | (u8::from(way.undeclared) * UNDECLARED));
    }
    w.into_bytes()
}

/// An answer kept in the tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The JSON body, as a non-streaming request gets it.
    pub body: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub spend_micros: u64,
    pub stored_ms: u64,
}

/// What a lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Hit(Stored),
    /// Stored, but too large for the tier: ask the sidecar.
    Remote,
    Miss,
}

/// Why a store was not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotKept {
    /// An undeclared caller's answer, in a set whose ways are all the
    /// declared callers' (and live).
    Reserved,
    /// Every index write lost to another worker.
    Contended,
    Host(String),
}

/// The tier's shape (from the policy's `cache.in_envoy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tier {
    sets: u32,
    pub max_entry_bytes: u64,
}

impl Tier {
    /// `slots` rounded up to whole sets of [`WAYS`].
    pub fn new(c: InEnvoyConfig) -> Tier {
        let sets = c.slots.clamp(1, MAX_IN_ENVOY_SLOTS).div_ceil(IN_ENVOY_WAYS);
        Tier {
            sets,
            max_entry_bytes: c.max_entry_bytes,
        }
    }

    fn set_of(&self, key: &Key) -> u32 {
        let mut head = [0u8; 8];
        head.copy_from_slice(&key[..8]);
        (u64::from_be_bytes(head) % u64::from(self.sets)) as u32
    }

    fn tag(key: &Key) -> [u8; 16] {
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&key[..16]);
        tag
    }

    fn index_key(set: u32) -> String {
        format!("{INDEX_PREFIX}{set}")
    }

    fn entry_key(set: u32, way: usize) -> String {
        format!("{ENTRY_PREFIX}{set}:{way}")
    }

    /// One shared-data read for a miss, two for a hit.
    pub fn lookup(
        &self,
        store: &dyn SharedStore,
        key: &Key,
        now_ms: u64,
        generation: u64,
    ) -> Lookup {
        let set = self.set_of(key);
        let Some((bytes, _)) = store.get(&Self::index_key(set)) else {
            return Lookup::Miss;
        };
        let tag = Self::tag(key);
        let ways = decode_index(&bytes);
        let Some((w, way)) = ways
            .iter()
            .enumerate()
            .find(|(_, w)| w.tag == tag && w.live(now_ms, generation))
        else {
            return Lookup::Miss;
        };
        if way.remote {
            return Lookup::Remote;
        }
        let Some((entry, _)) = store.get(&Self::entry_key(set, w)) else {
            return Lookup::Miss;
        };
        decode_entry(&entry, key, now_ms, generation).map_or(Lookup::Miss, Lookup::Hit)
    }

    /// Keeps `answer` under `key` for `ttl_ms` (`None`: only notes that the
    /// sidecar holds it), for a caller the policy declares or not (see
    /// "Eviction"). An answer over `max_entry_bytes` is noted as remote,
    /// never kept here.
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &self,
        store: &dyn SharedStore,
        key: &Key,
        answer: Option<&Stored>,
        ttl_ms: u64,
        now_ms: u64,
        generation: u64,
        undeclared: bool,
    ) -> Result<(), NotKept> {
        let answer = answer.filter(|a| a.body.len() as u64 <= self.max_entry_bytes);
        let set = self.set_of(key);
        let index = Self::index_key(set);
        let tag = Self::tag(key);
        let claimed = Way {
            tag,
            stored_ms: now_ms,
            expires_ms: now_ms.saturating_add(ttl_ms),
            generation,
            remote: answer.is_none(),
            undeclared,
        };
        let mut way = None;
        for _ in 0..TRIES {
            let (bytes, cas) = store.get(&index).unwrap_or_default();
            let mut ways = decode_index(&bytes);
            let Some(w) = pick(&ways, &tag, now_ms, generation, undeclared) else {
                return Err(NotKept::Reserved);
            };
            ways[w] = claimed;
            match store.set(&index, &encode_index(&ways), cas) {
                Ok(()) => {
                    way = Some(w);
                    break;
                }
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Host(e)) => return Err(NotKept::Host(e)),
            }
        }
        let Some(w) = way else {
            return Err(NotKept::Contended);
        };
        let Some(a) = answer else {
            return Ok(());
        };
        let value = encode_entry(key, a, claimed.expires_ms, generation);
        store
            .set(&Self::entry_key(set, w), &value, 0)
            .map_err(|e| NotKept::Host(e.to_string()))
    }
}

/// The way a store takes: the key's own, else a free (expired, purged,
/// empty) one, else the oldest stored — an undeclared caller's first. An
/// undeclared caller at [`UNDECLARED_WAYS`] live ways in the set takes
/// only the oldest of those, and never a declared caller's live entry
/// (`None`: not kept).
fn pick(
    ways: &[Way; WAYS],
    tag: &[u8; 16],
    now_ms: u64,
    generation: u64,
    undeclared: bool,
) -> Option<usize> {
    if let Some(w) = ways.iter().position(|w| &w.tag == tag) {
        return Some(w);
    }
    let live = |w: &Way| w.live(now_ms, generation);
    let oldest = |of_undeclared: bool| {
        ways.iter()
            .enumerate()
            .filter(|(_, w)| live(w) && (!of_undeclared || w.undeclared))
            .min_by_key(|(_, w)| w.stored_ms)
            .map(|(i, _)| i)
    };
    let theirs = ways.iter().filter(|w| live(w) && w.undeclared).count();
    if undeclared && theirs >= UNDECLARED_WAYS {
        return oldest(true);
    }
    if let Some(w) = ways.iter().position(|w| !live(w)) {
        return Some(w);
    }
    if undeclared {
        return oldest(true);
    }
    oldest(true).or_else(|| oldest(false))
}

fn encode_entry(key: &Key, a: &Stored, expires_ms: u64, generation: u64) -> Vec<u8> {
    let mut w = Writer::with_capacity(ENTRY_HEADER + a.body.len());
    w.bytes(key);
    w.u64(generation);
    w.u64(a.stored_ms);
    w.u64(expires_ms);
    w.u64(a.prompt_tokens);
    w.u64(a.completion_tokens);
    w.u64(a.spend_micros);
    w.bytes(a.body.as_bytes());
    w.into_bytes()
}

fn decode_entry(bytes: &[u8], key: &Key, now_ms: u64, generation: u64) -> Option<Stored> {
    let mut r = Reader::new(bytes);
    if r.try_bytes(32)? != key.as_slice() || r.try_u64()? != generation {
        return None;
    }
    let stored_ms = r.try_u64()?;
    if r.try_u64()? <= now_ms {
        return None;
    }
    let (prompt_tokens, completion_tokens, spend_micros) =
        (r.try_u64()?, r.try_u64()?, r.try_u64()?);
    let body = std::str::from_utf8(r.rest()).ok()?.to_string();
    Some(Stored {
        body,
        prompt_tokens,
        completion_tokens,
        spend_micros,
        stored_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;

    fn key(n: u8) -> Key {
        let mut k = [n; 32];
        k[31] = n.wrapping_mul(7);
        k
    }

    fn answer(body: &str) -> Stored {
        Stored {
            body: body.into(),
            prompt_tokens: 3,
            completion_tokens: 4,
            spend_micros: 5,
            stored_ms: 1_000,
        }
    }

    #[test]
    fn stores_and_finds_by_the_full_key_only() {
        let host = MockHost::new(0);
        let t = Tier::new(InEnvoyConfig {
            slots: 8,
            max_entry_bytes: 1024,
        });
        assert_eq!(t.lookup(&host, &key(1), 1_000, 7), Lookup::Miss);
        t.store(
            &host,
            &key(1),
            Some(&answer("one")),
            60_000,
            1_000,
            7,
            false,
        )
        .unwrap();
        assert_eq!(
            t.lookup(&host, &key(1), 2_000, 7),
            Lookup::Hit(answer("one"))
        );
        // The same set and tag, another key: never its answer.
        let mut twin = key(1);
        twin[20] ^= 1;
        assert_eq!(t.lookup(&host, &twin, 2_000, 7), Lookup::Miss);
        // Expired, or purged (another generation): a miss.
        assert_eq!(t.lookup(&host, &key(1), 61_000, 7), Lookup::Miss);
        assert_eq!(t.lookup(&host, &key(1), 2_000, 8), Lookup::Miss);
    }

    #[test]
    fn large_answers_are_remote_and_the_bound_holds() {
        let host = MockHost::new(0);
        let t = Tier::new(InEnvoyConfig {
            slots: 4,
            max_entry_bytes: 8,
        });
        t.store(
            &host,
            &key(2),
            Some(&answer("far too long")),
            60_000,
            0,
            1,
            false,
        )
        .unwrap();
        assert_eq!(t.lookup(&host, &key(2), 1, 1), Lookup::Remote);
        // Many distinct keys: the tier never holds more than its slots.
        for n in 0..200u8 {
            t.store(
                &host,
                &key(n),
                Some(&answer("short")),
                60_000,
                u64::from(n),
                1,
                false,
            )
            .unwrap();
        }
        // One set: its index and its ways' entries, nothing more.
        assert!(host.store.len() <= 1 + WAYS, "{} keys", host.store.len());
        assert_eq!(
            InEnvoyConfig {
                slots: 4,
                max_entry_bytes: 8
            }
            .memory_bound(),
            4 * (8 + ENTRY_HEADER as u64) + INDEX_BYTES as u64
        );
        // The newest are kept, the oldest went first.
        assert!(matches!(t.lookup(&host, &key(199), 300, 1), Lookup::Hit(_)));
        assert_eq!(t.lookup(&host, &key(0), 300, 1), Lookup::Miss);
    }

    /// Issue 29 item 5's sibling: a flood of undeclared callers storing
    /// ever-new answers keeps the declared callers' answers of a set.
    #[test]
    fn an_undeclared_flood_cannot_push_declared_answers_out() {
        let host = MockHost::new(0);
        let t = Tier::new(InEnvoyConfig {
            slots: 4,
            max_entry_bytes: 1024,
        });
        let keep = |n: u8, at: u64, undeclared: bool| {
            t.store(
                &host,
                &key(n),
                Some(&answer("a")),
                600_000,
                at,
                1,
                undeclared,
            )
        };
        // Three declared answers and one undeclared fill the one set.
        for n in 0..3 {
            keep(n, u64::from(n), false).unwrap();
        }
        keep(100, 3, true).unwrap();
        // 200 undeclared stores: they evict each other's answers, and the
        // declared answers stay (the set holds 2 undeclared at most).
        for n in 101..=255u8 {
            keep(n, u64::from(n), true).unwrap();
        }
        for n in 0..3 {
            assert!(
                matches!(t.lookup(&host, &key(n), 300, 1), Lookup::Hit(_)),
                "{n}"
            );
        }
        assert!(matches!(t.lookup(&host, &key(255), 300, 1), Lookup::Hit(_)));
        // A declared store evicts an undeclared entry first.
        keep(3, 400, false).unwrap();
        assert_eq!(t.lookup(&host, &key(255), 401, 1), Lookup::Miss);
        for n in 0..4 {
            assert!(
                matches!(t.lookup(&host, &key(n), 401, 1), Lookup::Hit(_)),
                "{n}"
            );
        }
        // Now every way is a declared caller's and live: an undeclared
        // answer is not kept here (the sidecar still may keep it).
        assert_eq!(keep(9, 402, true), Err(NotKept::Reserved));
        // Declared callers still evict each other, oldest first.
        keep(4, 403, false).unwrap();
        assert_eq!(t.lookup(&host, &key(0), 404, 1), Lookup::Miss);
    }

    #[test]
    fn a_slot_claimed_by_another_key_answers_neither_wrongly() {
        // One set, one way taken by key 5 in the index while the entry
        // still holds key 6's answer (a writer overtaken mid-store).
        let host = MockHost::new(0);
        let t = Tier::new(InEnvoyConfig {
            slots: 1,
            max_entry_bytes: 1024,
        });
        t.store(&host, &key(6), Some(&answer("six")), 60_000, 0, 1, false)
            .unwrap();
        let (bytes, cas) = host.get(&Tier::index_key(0)).unwrap();
        let mut ways = decode_index(&bytes);
        let w = ways
            .iter()
            .position(|w| w.tag == Tier::tag(&key(6)))
            .unwrap();
        ways[w].tag = Tier::tag(&key(5));
        host.set(&Tier::index_key(0), &encode_index(&ways), cas)
            .unwrap();
        assert_eq!(t.lookup(&host, &key(5), 1, 1), Lookup::Miss);
        assert_eq!(t.lookup(&host, &key(6), 1, 1), Lookup::Miss);
    }

    #[test]
    fn hex_keys() {
        let hex = crate::policy::keys::hex(&key(9));
        assert_eq!(key_of_hex(&hex), Some(key(9)));
        assert_eq!(key_of_hex("ab"), None);
        assert_eq!(key_of_hex(&"zz".repeat(32)), None);
    }
}
