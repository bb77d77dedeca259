//! Token-bucket arithmetic on one bucket's state, pure and clock-free.
//!
//! A bucket records how much of its capacity is in use (`used`) and drains
//! that at the configured rate. Storing use rather than what is left means a
//! policy reload that changes the limit keeps the count: 7 used of 10 is
//! 7 used of 12 after the reload. Amounts are kept in millionths of a unit so
//! a slow refill (10/min) still drains smoothly at millisecond resolution.
//!
//! Nothing here can trap the VM: config refuses zero rates and amounts that
//! do not fit ([`MAX_UNITS`]), and the arithmetic is still checked or
//! saturating for any limit and clock (a zero rate refills nothing, a wait
//! is at most [`MAX_WAIT_MS`]).

use crate::policy::units::SCALE;
use crate::policy::{Limit, Window};
use crate::state::codec::{Reader, Record, Writer};

/// The longest wait a bucket reports (a year and a day), whatever its rate:
/// keeps `now + wait` and header values far from overflow.
pub const MAX_WAIT_MS: u64 = 366 * DAY_MS;

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

impl BucketState {
    /// The state at `now_ms`, with the refill since the last update applied.
    /// A clock that steps back refills nothing.
    pub fn at(self, limit: &Limit, now_ms: u64) -> BucketState {
        if let Some(window) = limit.window {
            // Fixed window: `updated_ms` is the start of the window counted.
            let start = window_start(window, now_ms);
            if start > self.updated_ms {
                return BucketState {
                    owner: self.owner,
                    used: 0,
                    updated_ms: start,
                };
            }
            return self;
        }
        let elapsed = now_ms.saturating_sub(self.updated_ms);
        // A zero period (refused by config) refills nothing rather than divide.
        let refill = (elapsed as u128)
            .saturating_mul(limit.rate.amount as u128)
            .saturating_mul(SCALE as u128)
            .checked_div(limit.rate.period_ms as u128)
            .unwrap_or(0)
            .min(u64::MAX as u128) as u64;
        BucketState {
            owner: self.owner,
            used: self.used.saturating_sub(refill),
            updated_ms: self.updated_ms.max(now_ms),
        }
    }

    /// Nothing in use: the slot can be given to another principal without
    /// losing anything.
    #[cfg(test)]
    pub fn is_idle(&self, limit: &Limit, now_ms: u64) -> bool {
        self.at(limit, now_ms).used == 0
    }

    /// The quota at `now_ms` (the state must be brought to `now_ms`).
    pub fn quota(&self, limit: &Limit, now_ms: u64) -> Quota {
        let capacity = limit.capacity().saturating_mul(SCALE);
        let reset_ms = match limit.window {
            Some(window) => next_window(window, now_ms).saturating_sub(now_ms),
            None => drain_ms(self.used, limit),
        }
        .min(MAX_WAIT_MS);
        Quota {
            limit: limit.capacity(),
            remaining: capacity.saturating_sub(self.used) / SCALE,
            reset_ms,
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
        let quota = now.quota(limit, now_ms);
        let retry_after_ms = if limit.window.is_some() {
            quota.reset_ms
        } else if amount > limit.capacity() {
            drain_ms(now.used, limit)
        } else {
            drain_ms(wanted.saturating_sub(capacity), limit)
        }
        .min(MAX_WAIT_MS);
        Err(Shortfall {
            quota,
            retry_after_ms,
        })
    }

    /// Returns `amount` units taken at `taken_ms` (never below empty). A
    /// fixed window that has rolled over since owes nothing back.
    pub fn give_back(self, amount: u64, limit: &Limit, taken_ms: u64, now_ms: u64) -> BucketState {
        let now = self.at(limit, now_ms);
        if !same_window(limit, taken_ms, now_ms) {
            return now;
        }
        BucketState {
            used: now.used.saturating_sub(amount.saturating_mul(SCALE)),
            ..now
        }
    }

    /// Charges `amount` units whether or not they fit: settlement of usage
    /// that already happened. The bucket may go over its capacity (a debt
    /// that blocks admission until it drains); admission never does.
    pub fn charge(self, amount: u64, limit: &Limit, now_ms: u64) -> BucketState {
        let now = self.at(limit, now_ms);
        BucketState {
            used: now.used.saturating_add(amount.saturating_mul(SCALE)),
            ..now
        }
    }
}

const DAY_MS: u64 = 86_400_000;

/// Start of the local day or month holding `ms`, in the window's zone.
pub fn window_start(window: Window, ms: u64) -> u64 {
    match window {
        Window::Day(zone) => zone.day_start(ms),
        Window::Month(zone) => zone.month_start(ms),
    }
}

/// Whether `a` and `b` fall in the same calendar window of `limit` (any
/// two times do for a token bucket): what was taken in one window is owed
/// nothing back, and serves nothing, in the next.
pub fn same_window(limit: &Limit, a: u64, b: u64) -> bool {
    limit
        .window
        .is_none_or(|w| window_start(w, a) == window_start(w, b))
}

/// Start of the window after the one holding `ms`.
pub fn next_window(window: Window, ms: u64) -> u64 {
    match window {
        Window::Day(zone) => zone.next_day(ms),
        Window::Month(zone) => zone.next_month(ms),
    }
}

/// Milliseconds for the bucket to drain `used` millionths, rounded up, at
/// most [`MAX_WAIT_MS`]. A bucket that never drains (a zero rate, refused by
/// config) waits the most.
pub(crate) fn drain_ms(used: u64, limit: &Limit) -> u64 {
    let per = limit.rate.amount as u128 * SCALE as u128;
    if per == 0 {
        return MAX_WAIT_MS;
    }
    let ms = (used as u128 * limit.rate.period_ms as u128).div_ceil(per);
    ms.min(MAX_WAIT_MS as u128) as u64
}

impl Record for BucketState {
    const LEN: usize = 24;

    fn write(&self, w: &mut Writer) {
        w.u64(self.owner).u64(self.used).u64(self.updated_ms);
    }

    fn read(r: &mut Reader) -> Self {
        BucketState {
            owner: r.u64(),
            used: r.u64(),
            updated_ms: r.u64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::units::Rate;
    use crate::state::codec::Record;
    use proptest::prelude::*;

    fn limit(amount: u64, period_ms: u64, burst: u64) -> Limit {
        Limit {
            rate: Rate { amount, period_ms },
            burst,
            window: None,
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
        assert_eq!(s.at(&l, 6_000).quota(&l, 0).remaining, 1);
        assert_eq!(s.at(&l, 30_000).quota(&l, 0).remaining, 5);
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
    fn fixed_windows_reset_on_the_utc_calendar() {
        let nov_30_noon = 1_795_996_800_000 + 12 * 3_600_000;
        let dec_1 = 1_795_996_800_000 + 86_400_000;
        let day = Limit::windowed(100, Window::Day(crate::policy::zone::Zone::UTC));
        let s = BucketState::default().take(100, &day, nov_30_noon).unwrap();
        let refused = s.take(1, &day, nov_30_noon).unwrap_err();
        assert_eq!(refused.retry_after_ms, 12 * 3_600_000, "until 00:00 UTC");
        assert!(s.take(100, &day, dec_1).is_ok(), "a new day, a new budget");
        // A reservation from yesterday gives nothing back to today.
        let today = s.charge(0, &day, dec_1).take(10, &day, dec_1).unwrap();
        assert_eq!(
            today.give_back(100, &day, nov_30_noon, dec_1).used,
            10 * SCALE
        );

        let month = Limit::windowed(5, Window::Month(crate::policy::zone::Zone::UTC));
        assert_eq!(
            window_start(Window::Month(crate::policy::zone::Zone::UTC), nov_30_noon),
            1_793_491_200_000
        ); // 2026-11-01
        assert_eq!(
            next_window(Window::Month(crate::policy::zone::Zone::UTC), nov_30_noon),
            dec_1
        );
        assert_eq!(
            next_window(
                Window::Month(crate::policy::zone::Zone::UTC),
                1_798_675_200_000 + 5
            ),
            1_798_761_600_000
        ); // Dec 31 → Jan 1
        let s = BucketState::default().take(5, &month, nov_30_noon).unwrap();
        assert!(s.take(1, &month, dec_1 - 1).is_err());
        assert!(s.take(1, &month, dec_1).is_ok());
    }

    #[test]
    fn charge_settles_beyond_capacity_and_blocks_until_drained() {
        let l = limit(10, 60_000, 10);
        let s = BucketState::default()
            .take(8, &l, 0)
            .unwrap()
            .charge(5, &l, 0);
        assert_eq!(s.used, 13 * SCALE);
        assert_eq!(s.quota(&l, 0).remaining, 0);
        assert!(s.take(1, &l, 0).is_err());
        assert!(s.take(1, &l, 24_000).is_ok());
    }

    #[test]
    fn encoding_round_trips() {
        let s = BucketState {
            owner: 7,
            used: 123_456_789,
            updated_ms: 1_700_000_000_000,
        };
        assert_eq!(BucketState::decode(&s.encode()), s);
        assert_eq!(BucketState::decode(b"short"), BucketState::default());
    }

    /// 0, 1, the top of u64 and a few ordinary values.
    fn extreme() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(u64::MAX),
            Just(u64::MAX - 1),
            Just(crate::policy::units::MAX_UNITS),
            Just(u32::MAX as u64),
            0u64..100_000,
            any::<u64>(),
        ]
    }

    #[test]
    fn a_zero_rate_neither_traps_nor_refills() {
        let l = limit(0, 60_000, 5);
        let s = BucketState::default().take(5, &l, 0).unwrap();
        let refused = s.take(1, &l, 1_000_000).unwrap_err();
        assert_eq!(refused.retry_after_ms, MAX_WAIT_MS);
        assert_eq!(s.at(&l, u64::MAX).used, 5 * SCALE);
        let no_period = limit(10, 0, 10);
        assert_eq!(s.at(&no_period, 5_000).used, 5 * SCALE);
        let empty = limit(0, 0, 0);
        assert!(BucketState::default().take(1, &empty, 0).is_err());
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
                        s = s.give_back(n, &l, now, now);
                        returned += (before - s.used).div_ceil(SCALE) as u128;
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

        /// No limit, state or clock makes the math trap or overflow,
        /// even ones config refuses; waits stay bounded, and a take that
        /// succeeds fits the capacity.
        #[test]
        fn extremes_never_trap(
            amount in extreme(), period in extreme(), burst in extreme(),
            used in extreme(), updated in extreme(), now in extreme(),
            n in extreme(), window in prop::option::of(prop_oneof![Just(Window::Day(crate::policy::zone::Zone::UTC)), Just(Window::Month(crate::policy::zone::Zone::UTC))]),
        ) {
            let l = Limit { rate: Rate { amount, period_ms: period }, burst, window };
            let s = BucketState { owner: 1, used, updated_ms: updated };
            let at = s.at(&l, now);
            prop_assert!(at.used <= used || window.is_some());
            let q = at.quota(&l, now);
            prop_assert!(q.reset_ms <= MAX_WAIT_MS);
            prop_assert!(q.remaining <= l.capacity());
            match s.take(n, &l, now) {
                Ok(next) => prop_assert!(next.used <= l.capacity().saturating_mul(SCALE)),
                Err(short) => prop_assert!(short.retry_after_ms <= MAX_WAIT_MS),
            }
            let _ = s.give_back(n, &l, updated, now);
            let _ = s.charge(n, &l, now);
            let _ = s.is_idle(&l, now);
        }

        #[test]
        fn take_then_give_back_is_identity(
            used in 0u64..10, n in 1u64..10, now in 0u64..1_000
        ) {
            let l = limit(10, 60_000, 20);
            let s = BucketState { owner: 1, used: used * SCALE, updated_ms: now };
            if let Ok(taken) = s.take(n, &l, now) {
                prop_assert_eq!(taken.give_back(n, &l, now, now), s);
            }
        }
    }
}
