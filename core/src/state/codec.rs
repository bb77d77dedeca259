//! The one codec of shared data: the little-endian [`Writer`] and
//! [`Reader`] every record is coded with, the [`Record`] trait of the
//! fixed-width ones, and below the table of every layout sluice keeps in
//! Envoy's shared data, side by side, so a change of one is seen next to the
//! others. Each `impl Record` lives beside its type (named in the table);
//! `tests::every_record_encodes_to_its_len` holds every record to its `LEN`.
//!
//! Shared data outlives a policy (and a filter build): a key may hold bytes
//! an older layout wrote, or nothing. Reads are checked: a short or
//! garbled value decodes to the record's default (or, for the few records
//! read by prefix, to what its present fields say), never a panic.
//!
//! | record | bytes | fields |
//! |---|---|---|
//! | [`BucketState`](crate::limits::bucket::BucketState) | 24 | owner, used, updated_ms |
//! | [`Bundle`](crate::limits::record::Bundle) (the buckets of one scope; no `Record`: variable) | 19 + Σ (10 + entry) | version 1 (u8), owner, touched_ms, u16 count × (rule hash, u16 length, entry); any other version reads as empty |
//! | [`Kept`](crate::limits::record::Kept) (a per-caller entry of a `Bundle`) | 25 | used, updated_ms, idle_at_ms, budget (u8) |
//! | [`SketchCell`](crate::limits::reservation) | 16 | window, used (by prefix) |
//! | [`Pool`](crate::limits::shares::Pool) (a shared bucket with fair shares; coded in `shares`) | 24 + 32 × groups | bucket state, then per group: id, used, seen_ms, lent (by prefix; no groups: a plain `BucketState`) |
//! | [`RouteHealth`](crate::admission::route::RouteHealth) | 96 | 7 × u64 times, failures, barred, 8 × caller |
//! | [`CredentialPause`](crate::admission::route::CredentialPause) | 16 | fingerprint, until_ms |
//! | `Sketch` ([`penalty`](crate::admission::penalty)) | 8 + 4 × 64 × 4 | period_start_ms, 256 × u32 counters (row after row) |
//! | `Block` ([`penalty`](crate::admission::penalty)) | 32 | owner, blocked_until_ms, period_start_ms, forgiven |
//! | `Blocks` ([`penalty`](crate::admission::penalty)) | 8 × 32 | 8 × `Block` |
//! | [`UsageRing`](crate::usage::anomaly::UsageRing) | 16 + 60 × 16 | newest, surge_flagged, tokens[60], spend[60] |
//! | [`Correction`](crate::usage::estimate::Correction) | 4 | thousandths (clamped on read) |
//! | `LoopRecord` ([`runs`](crate::admission::runs)) | 20 | fingerprint, window_start, count (u32) |
//! | [`PollLease`](crate::flow::PollLease) | 16 | owner, expires_ms (by prefix) |
//! | `FleetLease` ([`fleet`](crate::fleet)) | 48 | owner, window_end, balance (i64), expires_ms, last_ms, grant (by prefix) |
//! | `Status` ([`fleet`](crate::fleet)) | 17 | down (u8), retry_at_ms, lost_at_ms (by prefix) |
//! | [`queue::State`](crate::queue::State) (no `Record`: variable, versioned) | 1 + … | version 1; u16 models × (u8 name length, name, u32 inflight, u64 paused_until_ms); u16 classes × (name, u64 pass, u64 round); u64 vtime, u64 next_ticket; u32 entries × 48 bytes; u32 leased, models × u32 leased; u32 evicted × u64 ticket |
//! | sidecar state ([`encode_seen`](crate::admission::route::encode_seen)) | 8 + n | received_ms, the state's JSON |

/// Appends little-endian words.
#[derive(Debug, Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    pub fn with_capacity(len: usize) -> Writer {
        Writer(Vec::with_capacity(len))
    }

    /// A writer appending to `bytes` (given back by [`Self::into_bytes`]).
    pub fn onto(bytes: Vec<u8>) -> Writer {
        Writer(bytes)
    }

    pub fn u64(&mut self, v: u64) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Writer {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u8(&mut self, v: u8) -> &mut Writer {
        self.0.push(v);
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

    pub fn try_u16(&mut self) -> Option<u16> {
        self.take::<2>().map(u16::from_le_bytes)
    }

    pub fn try_u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|[b]| b)
    }

    /// The next `n` bytes, `None` (consuming nothing) when fewer are left.
    pub fn try_bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let head = self.rest.get(..n)?;
        self.rest = self.rest.get(n..).unwrap_or_default();
        Some(head)
    }

    /// The next word, 0 past the end.
    pub fn u64(&mut self) -> u64 {
        self.try_u64().unwrap_or(0)
    }

    pub fn u32(&mut self) -> u32 {
        self.try_u32().unwrap_or(0)
    }

    pub fn u8(&mut self) -> u8 {
        self.try_u8().unwrap_or(0)
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
    use crate::admission::penalty::{Block, Blocks, Sketch};
    use crate::admission::route::{decode_seen, encode_seen, CredentialPause, RouteHealth};
    use crate::fleet::{FleetLease, Status};
    use crate::flow::PollLease;
    use crate::limits::bucket::BucketState;
    use crate::limits::record::{Bundle, Kept};
    use crate::limits::reservation::SketchCell;
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

    fn any_upstream() -> impl Strategy<Value = RouteHealth> {
        (
            proptest::array::uniform7(any::<u64>()),
            any::<u32>(),
            any::<u32>(),
            proptest::array::uniform8(any::<u32>()),
        )
            .prop_map(|(w, failures, barred, callers)| RouteHealth {
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
            round_trips(Kept { used: bucket.used, updated_ms: bucket.updated_ms, idle_at_ms: touched, budget: touched % 2 == 0 });
            round_trips(SketchCell { window: words.0, used: words.1 });
            round_trips(upstream);
            round_trips(CredentialPause { fingerprint: words.0, until_ms: words.1 });
            let mut ring = UsageRing { newest: minutes[0], surge_flagged: minutes[1], ..UsageRing::default() };
            ring.tokens.copy_from_slice(&minutes[2..2 + MINUTES]);
            ring.spend.copy_from_slice(&minutes[2 + MINUTES..]);
            round_trips(ring);
            round_trips(Correction(correction));
            round_trips(PollLease { owner: words.0, expires_ms: words.1 });
            round_trips(FleetLease {
                owner: words.0,
                window_end: words.1,
                balance: touched as i64,
                expires_ms: bucket.owner,
                last_ms: bucket.used,
                grant: bucket.updated_ms,
            });
            round_trips(Status { down: touched % 2 == 1, retry_at_ms: words.0, lost_at_ms: words.1 });
            let block = Block { owner: words.0, blocked_until_ms: words.1, period_start_ms: touched, forgiven: bucket.used };
            round_trips(block);
            round_trips(Blocks([block; crate::admission::penalty::RECORDS]));
            let seen = decode_seen(&encode_seen(touched, b"{}"));
            prop_assert_eq!(seen.received_ms, touched);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..1100)) {
            let _ = BucketState::decode(&bytes);
            let _ = Kept::decode(&bytes);
            let _ = Bundle::decode(bytes.as_slice());
            let _ = SketchCell::decode(&bytes);
            let _ = RouteHealth::decode(&bytes);
            let _ = CredentialPause::decode(&bytes);
            let _ = UsageRing::decode(&bytes);
            let c = Correction::decode(&bytes);
            prop_assert!((Correction::MIN..=Correction::MAX).contains(&c.0));
            let _ = PollLease::decode(&bytes);
            let _ = FleetLease::decode(&bytes);
            let _ = Status::decode(&bytes);
            let _ = Sketch::decode(&bytes);
            let _ = Blocks::decode(&bytes);
            let _ = crate::queue::State::decode(&bytes);
            let _ = decode_seen(&bytes);
        }
    }

    /// Every record, a default and a filled one: (type, [(encoded length,
    /// `LEN`); 2]).
    fn lengths() -> Vec<(&'static str, [(usize, usize); 2])> {
        fn len_of<T: Record>(x: T) -> (usize, usize) {
            (x.encode().len(), T::LEN)
        }
        fn both<T: Record>(x: T) -> (&'static str, [(usize, usize); 2]) {
            let name = std::any::type_name::<T>();
            let name = name.rsplit("::").next().unwrap_or(name);
            (name, [len_of(T::default()), len_of(x)])
        }
        let bucket = BucketState {
            owner: 1,
            used: 2,
            updated_ms: 3,
        };
        let mut sketch = Sketch::default();
        sketch.counters[255] = 7;
        let block = Block {
            owner: 1,
            blocked_until_ms: 2,
            period_start_ms: 3,
            forgiven: 4,
        };
        vec![
            both(bucket),
            both(Kept {
                used: 2,
                updated_ms: 3,
                idle_at_ms: 4,
                budget: true,
            }),
            both(SketchCell { window: 1, used: 2 }),
            both(crate::admission::runs::LoopRecord {
                print: 1,
                window_start: 2,
                count: 3,
            }),
            both(RouteHealth {
                failures: 3,
                ..RouteHealth::default()
            }),
            both(CredentialPause {
                fingerprint: 1,
                until_ms: 2,
            }),
            both(sketch),
            both(block),
            both(Blocks([block; crate::admission::penalty::RECORDS])),
            both(UsageRing {
                newest: 9,
                ..UsageRing::default()
            }),
            both(Correction(Correction::MAX)),
            both(PollLease {
                owner: 1,
                expires_ms: 2,
            }),
            both(FleetLease {
                owner: 1,
                balance: -5,
                ..FleetLease::default()
            }),
            both(Status {
                down: true,
                retry_at_ms: 6,
                lost_at_ms: 7,
            }),
        ]
    }

    /// Every record of the table, a default and a filled one: encoded, it
    /// is `LEN` bytes.
    #[test]
    fn every_record_encodes_to_its_len() {
        for (name, [empty, filled]) in lengths() {
            assert_eq!(empty.0, empty.1, "{name} (default)");
            assert_eq!(filled.0, filled.1, "{name}");
        }
        assert_eq!(Sketch::LEN, 1032);
        assert_eq!((FleetLease::LEN, Status::LEN), (48, 17));
    }

    /// Every `impl Record` of the crate is a row of the table in this
    /// file's header and is held to its `LEN` by [`lengths`].
    #[test]
    fn every_record_is_in_the_table() {
        fn walk(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for line in text.lines() {
                        if let Some(rest) = line.strip_prefix("impl Record for ") {
                            let name = rest.trim_end_matches(" {").to_string();
                            out.push((name, path.display().to_string()));
                        }
                    }
                }
            }
        }
        let mut records = Vec::new();
        walk(
            std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")),
            &mut records,
        );
        let header: Vec<&str> = include_str!("codec.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .collect();
        let held: Vec<&str> = lengths().iter().map(|(name, _)| *name).collect();
        assert!(records.len() >= 13, "{records:?}");
        for (name, file) in &records {
            let row = format!("`{name}`");
            assert!(
                header
                    .iter()
                    .any(|l| l.starts_with("//! | ") && l.contains(&row)),
                "{name} ({file}) is not in codec.rs's table"
            );
            assert!(
                held.contains(&name.as_str()),
                "{name} ({file}) is not held to its LEN"
            );
        }
    }

    /// The fleet's records read as they did before they were `Record`s:
    /// by prefix, a missing word 0.
    #[test]
    fn fleet_records_read_by_prefix() {
        let lease = FleetLease {
            owner: 7,
            window_end: 8,
            balance: -3,
            expires_ms: 9,
            last_ms: 10,
            grant: 11,
        };
        let bytes = lease.encode();
        assert_eq!(&bytes[16..24], &(-3i64 as u64).to_le_bytes());
        assert_eq!(
            FleetLease::decode(&bytes[..16]),
            FleetLease {
                owner: 7,
                window_end: 8,
                ..FleetLease::default()
            }
        );
        assert_eq!(
            Status {
                down: true,
                retry_at_ms: 5,
                lost_at_ms: 0,
            }
            .encode(),
            [1, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            Status::decode(&[1]),
            Status {
                down: true,
                ..Status::default()
            }
        );
        assert_eq!(Status::decode(&[]), Status::default());
    }

    #[test]
    fn short_or_foreign_values_read_as_defaults() {
        assert_eq!(BucketState::decode(b"short"), BucketState::default());
        assert_eq!(RouteHealth::decode(&[7; 95]), RouteHealth::default());
        assert_eq!(UsageRing::decode(b"junk"), UsageRing::default());
        assert_eq!(Correction::decode(&[1, 2, 3]), Correction::default());
        assert_eq!(Correction::decode(&0u32.to_le_bytes()).0, Correction::MIN);
        // A value an older layout wrote (a bare bucket state) reads as an
        // empty record.
        let older = BucketState {
            owner: 3,
            used: 4,
            updated_ms: 5,
        }
        .encode();
        assert_eq!(Bundle::decode(older.as_slice()), Bundle::default());
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
