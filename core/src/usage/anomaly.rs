//! Consumption anomalies across all callers (docs/src/design.md, "Observability and
//! audit"): tokens per minute against a trailing baseline (a surge is a warning), and
//! spend per hour against a ceiling (past it, the global breaker refuses new requests).
//!
//! Computed in shared data rather than in the sidecar: settlement already
//! holds the numbers, one compare-and-swap on one small key adds them, and
//! admission reads the same key, so the breaker needs no network hop and no
//! second source of truth. The ring is one key (bounded).

use crate::state::codec::{Reader, Record, Writer};

/// Minutes kept: one hour.
pub const MINUTES: usize = 60;
const MINUTE_MS: u64 = 60_000;

/// Per-minute totals of the last hour, all callers together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRing {
    /// The minute (ms since epoch / 60 000) of the newest slot.
    pub newest: u64,
    pub tokens: [u64; MINUTES],
    /// Micro-currency.
    pub spend: [u64; MINUTES],
    /// The last minute flagged as a surge (so each surge counts once).
    pub surge_flagged: u64,
}

impl Default for UsageRing {
    fn default() -> Self {
        UsageRing {
            newest: 0,
            tokens: [0; MINUTES],
            spend: [0; MINUTES],
            surge_flagged: 0,
        }
    }
}

/// What the global numbers say now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub tokens_this_minute: u64,
    /// Average tokens per minute over the baseline minutes with traffic.
    pub baseline: u64,
    pub spend_last_hour: u64,
}

impl UsageRing {
    fn slot(minute: u64) -> usize {
        (minute % MINUTES as u64) as usize
    }

    /// Moves the ring to `minute`, clearing the minutes in between.
    fn advance(&mut self, minute: u64) {
        if minute <= self.newest {
            return;
        }
        let gap = (minute - self.newest).min(MINUTES as u64);
        for m in 0..gap {
            let i = Self::slot(minute - m);
            self.tokens[i] = 0;
            self.spend[i] = 0;
        }
        self.newest = minute;
    }

    /// Adds one settled request.
    pub fn add(&mut self, tokens: u64, spend: u64, now_ms: u64) {
        let minute = now_ms / MINUTE_MS;
        self.advance(minute);
        if minute + MINUTES as u64 <= self.newest {
            return; // older than the ring
        }
        let i = Self::slot(minute);
        self.tokens[i] = self.tokens[i].saturating_add(tokens);
        self.spend[i] = self.spend[i].saturating_add(spend);
    }

    pub fn read(&self, baseline_minutes: usize, now_ms: u64) -> Reading {
        let mut ring = self.clone();
        let minute = now_ms / MINUTE_MS;
        ring.advance(minute);
        let past: Vec<u64> = (1..=baseline_minutes.min(MINUTES - 1) as u64)
            .filter_map(|back| minute.checked_sub(back))
            .map(|m| ring.tokens[Self::slot(m)])
            .filter(|t| *t > 0)
            .collect();
        let baseline = if past.is_empty() {
            0
        } else {
            past.iter().sum::<u64>() / past.len() as u64
        };
        Reading {
            tokens_this_minute: ring.tokens[Self::slot(minute)],
            baseline,
            spend_last_hour: ring.spend.iter().sum(),
        }
    }
}

impl Record for UsageRing {
    const LEN: usize = 16 + MINUTES * 16;

    fn write(&self, w: &mut Writer) {
        w.u64(self.newest).u64(self.surge_flagged);
        for v in self.tokens.iter().chain(self.spend.iter()) {
            w.u64(*v);
        }
    }

    fn read(r: &mut Reader) -> Self {
        let mut ring = UsageRing {
            newest: r.u64(),
            surge_flagged: r.u64(),
            ..UsageRing::default()
        };
        for v in ring.tokens.iter_mut().chain(ring.spend.iter_mut()) {
            *v = r.u64();
        }
        ring
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::codec::Record;

    #[test]
    fn the_ring_keeps_an_hour_and_forgets_the_rest() {
        let mut r = UsageRing::default();
        let t0 = 1_795_996_800_000;
        r.add(100, 10, t0);
        r.add(50, 5, t0 + 30_000);
        assert_eq!(r.read(15, t0 + 59_000).tokens_this_minute, 150);
        r.add(10, 1, t0 + 61 * MINUTE_MS);
        let now = r.read(15, t0 + 61 * MINUTE_MS);
        assert_eq!(
            (now.tokens_this_minute, now.spend_last_hour),
            (10, 1),
            "minute 0 fell out"
        );
        assert_eq!(UsageRing::decode(&r.encode()), r);
        assert_eq!(UsageRing::decode(b"junk"), UsageRing::default());
    }

    #[test]
    fn baseline_averages_the_minutes_with_traffic() {
        let mut r = UsageRing::default();
        let t0 = 1_795_996_800_000;
        for m in 0..10 {
            r.add(1_000, 0, t0 + m * MINUTE_MS);
        }
        r.add(5_000, 0, t0 + 10 * MINUTE_MS);
        let now = r.read(15, t0 + 10 * MINUTE_MS + 1);
        assert_eq!((now.tokens_this_minute, now.baseline), (5_000, 1_000));
    }
}
