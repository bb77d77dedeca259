//! Every fixed-width record sluice keeps in Envoy's shared data, and the one
//! little-endian reader and writer they are coded with. The layouts are all
//! here, side by side, so a change of one is seen next to the others.
//!
//! Shared data outlives a policy (and a filter build): a key may hold bytes
//! an older layout wrote, or nothing. Reads are checked: a short or
//! garbled value decodes to the record's default (or, for the few records
//! read by prefix, to what its present fields say), never a panic.
//!
//! | record | bytes | fields |
//! |---|---|---|
//! | [`BucketState`] | 24 | owner, used, updated_ms |
//! | [`Slot`] | 32 | bucket state, touched_ms (a 24-byte prepared key reads as untouched since `updated_ms`) |
//! | [`SketchCell`] | 16 | window, used (by prefix) |
//! | [`Pool`](crate::limits::shares::Pool) (a shared bucket with fair shares; coded in `shares`) | 24 + 32 × groups | bucket state, then per group: id, used, seen_ms, lent (by prefix; no groups: a plain [`BucketState`]) |
//! | [`Upstream`] | 96 | 7 × u64 times, failures, barred, 8 × caller |
//! | [`CredentialPause`] | 16 | fingerprint, until_ms |
//! | [`UsageRing`] | 16 + 60 × 16 | newest, surge_flagged, tokens[60], spend[60] |
//! | [`Correction`] | 4 | thousandths (clamped on read) |
//! | [`PollLease`] | 16 | owner, expires_ms (by prefix) |
//! | sidecar state ([`encode_seen`]) | 8 + n | received_ms, the state's JSON |

/// Appends little-endian words.
#[derive(Debug, Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    pub fn with_capacity(len: usize) -> Writer {
        Writer(Vec::with_capacity(len))
    }

    pub fn u64(&mut self, v: u64) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Writer {
        self.0.extend_from_slice(v);
        self
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

/// Reads little-endian words from the front; a read past the end is `None`
/// (or 0 for the plain getters) and consumes nothing.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { rest: bytes }
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let head = self.rest.get(..N)?;
        let word = <[u8; N]>::try_from(head).ok()?;
        self.rest = self.rest.get(N..).unwrap_or_default();
        Some(word)
    }

    pub fn try_u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    pub fn try_u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    /// The next word, 0 past the end.
    pub fn u64(&mut self) -> u64 {
        self.try_u64().unwrap_or(0)
    }

    pub fn u32(&mut self) -> u32 {
        self.try_u32().unwrap_or(0)
    }

    /// Everything not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
}

/// A fixed-width record. `decode` of a value of another length gives the
/// default (an older layout, a blank key): records override it only to
/// read a known shorter prefix.
pub trait Record: Default {
    const LEN: usize;
    fn write(&self, w: &mut Writer);
    /// Reads the fields; only called on `LEN` bytes unless `decode` says
    /// otherwise.
    fn read(r: &mut Reader) -> Self;

    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(Self::LEN);
        self.write(&mut w);
        w.into_bytes()
    }

    fn decode(bytes: &[u8]) -> Self {
        if bytes.len() == Self::LEN {
            Self::read(&mut Reader::new(bytes))
        } else {
            Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::health::{decode_seen, encode_seen, CredentialPause, Upstream};
    use crate::flow::PollLease;
    use crate::limits::bucket::BucketState;
    use crate::limits::reservation::{SketchCell, Slot};
    use crate::usage::anomaly::{UsageRing, MINUTES};
    use crate::usage::estimate::Correction;
    use proptest::prelude::*;

    fn round_trips<T: Record + PartialEq + std::fmt::Debug>(x: T) {
        let bytes = x.encode();
        assert_eq!(bytes.len(), T::LEN);
        assert_eq!(T::decode(&bytes), x);
    }

    fn any_bucket() -> impl Strategy<Value = BucketState> {
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(owner, used, updated_ms)| {
            BucketState {
                owner,
                used,
                updated_ms,
            }
        })
    }

    fn any_upstream() -> impl Strategy<Value = Upstream> {
        (
            proptest::array::uniform7(any::<u64>()),
            any::<u32>(),
            any::<u32>(),
            proptest::array::uniform8(any::<u32>()),
        )
            .prop_map(|(w, failures, barred, callers)| Upstream {
                paused_until_ms: w[0],
                credential_pauses_until_ms: w[1],
                streak_since_ms: w[2],
                open_until_ms: w[3],
                cooldown_ms: w[4],
                probe_until_ms: w[5],
                barred_until_ms: w[6],
                failures,
                barred,
                callers,
            })
    }

    proptest! {
        #[test]
        fn every_record_round_trips(
            bucket in any_bucket(),
            touched in any::<u64>(),
            words in (any::<u64>(), any::<u64>()),
            upstream in any_upstream(),
            minutes in proptest::collection::vec(any::<u64>(), 2 * MINUTES + 2),
            correction in Correction::MIN..=Correction::MAX,
        ) {
            round_trips(bucket);
            round_trips(Slot { state: bucket, touched_ms: touched });
            round_trips(SketchCell { window: words.0, used: words.1 });
            round_trips(upstream);
            round_trips(CredentialPause { fingerprint: words.0, until_ms: words.1 });
            let mut ring = UsageRing { newest: minutes[0], surge_flagged: minutes[1], ..UsageRing::default() };
            ring.tokens.copy_from_slice(&minutes[2..2 + MINUTES]);
            ring.spend.copy_from_slice(&minutes[2 + MINUTES..]);
            round_trips(ring);
            round_trips(Correction(correction));
            round_trips(PollLease { owner: words.0, expires_ms: words.1 });
            let seen = decode_seen(&encode_seen(touched, b"{}"));
            prop_assert_eq!(seen.received_ms, touched);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..1100)) {
            let _ = BucketState::decode(&bytes);
            let _ = Slot::decode(&bytes);
            let _ = SketchCell::decode(&bytes);
            let _ = Upstream::decode(&bytes);
            let _ = CredentialPause::decode(&bytes);
            let _ = UsageRing::decode(&bytes);
            let c = Correction::decode(&bytes);
            prop_assert!((Correction::MIN..=Correction::MAX).contains(&c.0));
            let _ = PollLease::decode(&bytes);
            let _ = decode_seen(&bytes);
        }
    }

    #[test]
    fn short_or_foreign_values_read_as_defaults() {
        assert_eq!(BucketState::decode(b"short"), BucketState::default());
        assert_eq!(Upstream::decode(&[7; 95]), Upstream::default());
        assert_eq!(UsageRing::decode(b"junk"), UsageRing::default());
        assert_eq!(Correction::decode(&[1, 2, 3]), Correction::default());
        assert_eq!(Correction::decode(&0u32.to_le_bytes()).0, Correction::MIN);
        // A prepared slot key (an empty bucket state) is an untouched slot.
        let prepared = BucketState {
            owner: 3,
            used: 4,
            updated_ms: 5,
        }
        .encode();
        assert_eq!(Slot::decode(&prepared).touched_ms, 5);
        assert_eq!(SketchCell::decode(&[0; 24]), SketchCell::default());
        assert_eq!(
            PollLease::decode(&9u64.to_le_bytes()),
            PollLease {
                owner: 9,
                expires_ms: 0
            }
        );
        assert_eq!(decode_seen(b"1234567").received_ms, 0);
    }
}
