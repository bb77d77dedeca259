//! Token-bucket arithmetic on one bucket's state, pure and clock-free.
//!
//! A bucket records how much of its capacity is in use (`used`) and drains
//! that at the configured rate. Storing use rather than what is left means a
//! policy reload that changes the limit keeps the count: 7 used of 10 is
//! 7 used of 12 after the reload. Amounts are kept in millionths of a unit so
//! a slow refill (10/min) still drains smoothly at millisecond resolution.

use crate::config::Limit;

/// Millionths of a unit per unit.
pub const SCALE: u64 = 1_000_000;

/// What one shared-data slot holds. `owner` is the hash of the principal
/// holding a per-principal slot (0 = never used); global buckets use 1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BucketState {
    pub owner: u64,
    /// In use, in millionths of a unit.
    pub used: u64,
    /// When `used` was last brought up to date (ms since the Unix epoch).
    pub updated_ms: u64,
}

/// The state of a bucket as the client may see it (`X-RateLimit-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub remaining: u64,
    /// Milliseconds until the bucket is full again.
    pub reset_ms: u64,
}

/// A take that does not fit: what the bucket looks like and when it would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortfall {
    pub quota: Quota,
    /// Milliseconds until the amount fits (until full when it never can).
    pub retry_after_ms: u64,
}

pub const ENCODED_LEN: usize = 24;

impl BucketState {
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut out = [0u8; ENCODED_LEN];
        out[..8].copy_from_slice(&self.owner.to_le_bytes());
        out[8..16].copy_from_slice(&self.used.to_le_bytes());
        out[16..].copy_from_slice(&self.updated_ms.to_le_bytes());
        out
    }

    /// `None` for bytes this version did not write.
    pub fn decode(bytes: &[u8]) -> Option<BucketState> {
        if bytes.len() != ENCODED_LEN {
            return None;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        Some(BucketState {
            owner: word(0),
            used: word(1),
            updated_ms: word(2),
        })
    }

    /// The state at `now_ms`, with the refill since the last update applied.
    /// A clock that steps back refills nothing.
    pub fn at(self, limit: &Limit, now_ms: u64) -> BucketState {
        let elapsed = now_ms.saturating_sub(self.updated_ms);
        let refill = (elapsed as u128 * limit.rate.amount as u128 * SCALE as u128
            / limit.rate.period_ms as u128)
            .min(u64::MAX as u128) as u64;
        BucketState {
            owner: self.owner,
            used: self.used.saturating_sub(refill),
            updated_ms: self.updated_ms.max(now_ms),
        }
    }

    /// Nothing in use: the slot can be given to another principal without
    /// losing anything.
    pub fn is_idle(&self, limit: &Limit, now_ms: u64) -> bool {
        self.at(limit, now_ms).used == 0
    }

    pub fn quota(&self, limit: &Limit) -> Quota {
        let capacity = limit.capacity().saturating_mul(SCALE);
        Quota {
            limit: limit.capacity(),
            remaining: capacity.saturating_sub(self.used) / SCALE,
            reset_ms: drain_ms(self.used, limit),
        }
    }

    /// Takes `amount` units if they fit, all or nothing.
    pub fn take(self, amount: u64, limit: &Limit, now_ms: u64) -> Result<BucketState, Shortfall> {
        let now = self.at(limit, now_ms);
        let capacity = limit.capacity().saturating_mul(SCALE);
        let wanted = now.used.saturating_add(amount.saturating_mul(SCALE));
        if wanted <= capacity {
            return Ok(BucketState {
                used: wanted,
                ..now
            });
        }
        let retry_after_ms = if amount > limit.capacity() {
            drain_ms(now.used, limit)
        } else {
            drain_ms(wanted - capacity, limit)
        };
        Err(Shortfall {
            quota: now.quota(limit),
            retry_after_ms,
        })
    }

    /// Returns `amount` units taken earlier (never below empty).
    pub fn give_back(self, amount: u64, limit: &Limit, now_ms: u64) -> BucketState {
        let now = self.at(limit, now_ms);
        BucketState {
            used: now.used.saturating_sub(amount.saturating_mul(SCALE)),
            ..now
        }
    }
}

/// Milliseconds for the bucket to drain `used` millionths, rounded up.
fn drain_ms(used: u64, limit: &Limit) -> u64 {
    let per = limit.rate.amount as u128 * SCALE as u128;
    let ms = (used as u128 * limit.rate.period_ms as u128).div_ceil(per);
    ms.min(u64::MAX as u128) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::Rate;
    use proptest::prelude::*;

    fn limit(amount: u64, period_ms: u64, burst: u64) -> Limit {
        Limit {
            rate: Rate { amount, period_ms },
            burst,
        }
    }

    #[test]
    fn a_full_bucket_admits_exactly_its_capacity() {
        let l = limit(10, 60_000, 10);
        let mut s = BucketState::default();
        for i in 0..10 {
            s = s
                .take(1, &l, 1_000)
                .unwrap_or_else(|_| panic!("take {i} refused"));
        }
        let refused = s.take(1, &l, 1_000).unwrap_err();
        assert_eq!(refused.quota.remaining, 0);
        assert_eq!(refused.retry_after_ms, 6_000, "one unit refills in 6 s");
        assert_eq!(refused.quota.reset_ms, 60_000);
    }

    #[test]
    fn refill_is_proportional_to_time() {
        let l = limit(10, 60_000, 10);
        let s = BucketState {
            owner: 1,
            used: 10 * SCALE,
            updated_ms: 0,
        };
        assert_eq!(s.at(&l, 6_000).quota(&l).remaining, 1);
        assert_eq!(s.at(&l, 30_000).quota(&l).remaining, 5);
        assert_eq!(s.at(&l, 600_000).used, 0, "never below empty");
        assert!(s.is_idle(&l, 60_000));
        assert!(!s.is_idle(&l, 59_999));
    }

    #[test]
    fn burst_raises_capacity_not_rate() {
        let l = limit(10, 60_000, 15);
        let mut s = BucketState::default();
        for _ in 0..15 {
            s = s.take(1, &l, 0).unwrap();
        }
        assert!(s.take(1, &l, 0).is_err());
        assert!(s.take(1, &l, 6_000).is_ok());
    }

    #[test]
    fn clock_stepping_back_refills_nothing() {
        let l = limit(10, 60_000, 10);
        let s = BucketState {
            owner: 1,
            used: 5 * SCALE,
            updated_ms: 10_000,
        };
        let back = s.at(&l, 1_000);
        assert_eq!(back.used, 5 * SCALE);
        assert_eq!(back.updated_ms, 10_000);
    }

    #[test]
    fn too_big_to_ever_fit_waits_for_full() {
        let l = limit(10, 60_000, 10);
        let s = BucketState::default().take(3, &l, 0).unwrap();
        let refused = s.take(11, &l, 0).unwrap_err();
        assert_eq!(refused.retry_after_ms, 18_000);
    }

    #[test]
    fn encoding_round_trips() {
        let s = BucketState {
            owner: 7,
            used: 123_456_789,
            updated_ms: 1_700_000_000_000,
        };
        assert_eq!(BucketState::decode(&s.encode()), Some(s));
        assert_eq!(BucketState::decode(b"short"), None);
    }

    proptest! {
        /// Any interleaving of takes, gives back and time steps keeps the
        /// bucket between empty and capacity, and admits no more than
        /// capacity + what refilled.
        #[test]
        fn never_negative_never_over(
            amount in 1u64..1000, period in 1u64..100_000, extra in 0u64..100,
            ops in prop::collection::vec((0u8..3, 0u64..50, 0u64..5_000), 1..200)
        ) {
            let l = limit(amount, period, amount + extra);
            let cap = l.capacity() * SCALE;
            let mut s = BucketState::default();
            let mut now = 0u64;
            let mut admitted = 0u128;
            let mut returned = 0u128;
            for (op, n, dt) in ops {
                match op {
                    0 => if let Ok(next) = s.take(n, &l, now) {
                        admitted += n as u128;
                        s = next;
                    },
                    1 => {
                        let before = s.at(&l, now).used;
                        s = s.give_back(n, &l, now);
                        returned += ((before - s.used) / SCALE) as u128;
                    }
                    _ => now += dt,
                }
                prop_assert!(s.used <= cap);
            }
            // Units admitted minus those given back never exceed capacity
            // plus everything that could have refilled.
            let refilled = now as u128 * amount as u128 / period as u128 + 1;
            prop_assert!(admitted <= l.capacity() as u128 + refilled + returned);
        }

        #[test]
        fn take_then_give_back_is_identity(
            used in 0u64..10, n in 1u64..10, now in 0u64..1_000
        ) {
            let l = limit(10, 60_000, 20);
            let s = BucketState { owner: 1, used: used * SCALE, updated_ms: now };
            if let Ok(taken) = s.take(n, &l, now) {
                prop_assert_eq!(taken.give_back(n, &l, now), s);
            }
        }
    }
}
