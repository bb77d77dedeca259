//! How loaded the server was: requests in flight now, the peak since the
//! last reset, and how long it spent at each level (so a test or bench can
//! say "never more than 4" and "at 4 for 97 % of the backlog"). Plus an
//! optional provider-style request limit per fixed window, answered with
//! OpenAI's `x-ratelimit-*` headers and a 429 past it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[derive(Debug)]
struct Levels {
    level: i64,
    peak: i64,
    since: Instant,
    /// Seconds spent at each in-flight level.
    at: BTreeMap<i64, f64>,
    /// Ends not yet followed by a start, oldest first (bounded).
    ends: std::collections::VecDeque<Instant>,
    /// Refill gaps (ms): a request ended → the next one started. With a
    /// backlog in front of the server, this is the proxy's wake-up latency
    /// (plus its forwarding). Bounded.
    gaps: Vec<f64>,
}

const MAX_GAPS: usize = 100_000;

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[derive(Debug)]
pub struct Load {
    levels: Mutex<Levels>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Default for Load {
    fn default() -> Self {
        Load {
            levels: Mutex::new(Levels {
                level: 0,
                peak: 0,
                since: Instant::now(),
                at: BTreeMap::new(),
                ends: std::collections::VecDeque::new(),
                gaps: Vec::new(),
            }),
        }
    }
}

impl Load {
    /// One more (`+1`) or one fewer (`-1`) request in flight.
    pub fn change(&self, by: i64) {
        let mut l = lock(&self.levels);
        let now = Instant::now();
        let spent = now.duration_since(l.since).as_secs_f64();
        let level = l.level;
        *l.at.entry(level).or_default() += spent;
        l.since = now;
        if by > 0 {
            // Each start refills the oldest slot freed before it.
            if let Some(end) = l.ends.pop_front() {
                if l.gaps.len() < MAX_GAPS {
                    l.gaps.push(now.duration_since(end).as_secs_f64() * 1000.0);
                }
            }
        } else {
            if l.ends.len() >= 1024 {
                l.ends.pop_front();
            }
            l.ends.push_back(now);
        }
        l.level = (l.level + by).max(0);
        l.peak = l.peak.max(l.level);
    }

    /// Peak and time-at-level since the last reset; in-flight requests
    /// stay counted.
    pub fn reset(&self) {
        let mut l = lock(&self.levels);
        l.peak = l.level;
        l.since = Instant::now();
        l.at.clear();
        l.gaps.clear();
        l.ends.clear();
    }

    pub fn snapshot(&self) -> Value {
        let l = lock(&self.levels);
        let mut at = l.at.clone();
        *at.entry(l.level).or_default() += l.since.elapsed().as_secs_f64();
        let at: BTreeMap<String, f64> = at.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let mut gaps = l.gaps.clone();
        gaps.sort_by(f64::total_cmp);
        json!({"in_flight": l.level, "peak_in_flight": l.peak, "seconds_at_level": at,
               "refill_gap_ms": {"count": gaps.len(), "p50": quantile(&gaps, 0.5),
                                 "p99": quantile(&gaps, 0.99), "max": quantile(&gaps, 1.0)}})
    }

    pub fn peak(&self) -> i64 {
        lock(&self.levels).peak
    }
}

/// `--ratelimit-requests N --ratelimit-window-ms W`: N requests per fixed
/// window, like a provider's per-key limit. The first window starts at the
/// first request, not at start-up: what a test sees then depends on what it
/// sent, not on how long the rest of its stack took to come up.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub requests: u64,
    /// Tokens (input + output) per window, when limited (`--ratelimit-tokens`).
    pub tokens: Option<u64>,
    pub window: Duration,
}

#[derive(Debug, Default)]
struct Window {
    /// None before the first request.
    start: Option<Instant>,
    requests: u64,
    tokens: u64,
}

#[derive(Debug)]
pub struct Limiter {
    limit: RateLimit,
    window: Mutex<Window>,
}

/// What the limiter says about one request.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub allowed: bool,
    pub limit: u64,
    pub remaining: u64,
    pub reset: Duration,
    /// (limit, remaining) of the token budget, when there is one.
    pub tokens: Option<(u64, u64)>,
    /// Refused by the token budget (the requests had room).
    pub by_tokens: bool,
}

impl Limiter {
    pub fn new(limit: RateLimit) -> Limiter {
        Limiter {
            limit,
            window: Mutex::default(),
        }
    }

    pub fn take(&self) -> Verdict {
        self.take_at(Instant::now())
    }

    fn take_at(&self, now: Instant) -> Verdict {
        let mut w = lock(&self.window);
        let start = match w.start {
            Some(start) if now.saturating_duration_since(start) < self.limit.window => start,
            _ => {
                *w = Window {
                    start: Some(now),
                    ..Window::default()
                };
                now
            }
        };
        let requests_left = w.requests < self.limit.requests;
        let allowed = requests_left && self.limit.tokens.is_none_or(|t| w.tokens < t);
        if allowed {
            w.requests += 1;
        }
        Verdict {
            allowed,
            limit: self.limit.requests,
            remaining: self.limit.requests.saturating_sub(w.requests),
            reset: self
                .limit
                .window
                .saturating_sub(now.saturating_duration_since(start)),
            tokens: self.limit.tokens.map(|t| (t, t.saturating_sub(w.tokens))),
            by_tokens: !allowed && requests_left,
        }
    }

    /// Charges a served request's tokens to the window; the verdict's
    /// token figures then include them.
    pub fn charge(&self, tokens: u64, verdict: &mut Verdict) {
        let mut w = lock(&self.window);
        w.tokens = w.tokens.saturating_add(tokens);
        if let Some(t) = self.limit.tokens {
            verdict.tokens = Some((t, t.saturating_sub(w.tokens)));
        }
    }
}

/// OpenAI's spelling of a reset: `1s`, `250ms`, `6m0s`. Rounded up to
/// what it writes: a reset rounded down (1491.7 ms as `1.491s`) would tell
/// a client that waits exactly that long to come back before the window
/// opens, into a 429.
pub fn reset_text(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000);
    if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{}s", ms as f64 / 1000.0)
    } else {
        let s = ms.div_ceil(1000);
        format!("{}m{}s", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_and_levels() {
        let load = Load::default();
        load.change(1);
        load.change(1);
        load.change(-1);
        assert_eq!(load.peak(), 2);
        let s = load.snapshot();
        assert_eq!(s["in_flight"], 1);
        assert!(s["seconds_at_level"]["2"].as_f64().is_some());
        assert_eq!(s["refill_gap_ms"]["count"], 0);
        load.change(1);
        assert_eq!(load.snapshot()["refill_gap_ms"]["count"], 1);
        load.reset();
        assert_eq!(load.peak(), 2);
    }

    #[test]
    fn the_first_window_starts_at_the_first_request() {
        let l = Limiter::new(RateLimit {
            requests: 1,
            tokens: None,
            window: Duration::from_millis(1_500),
        });
        // However long after start-up the first request comes, it opens a
        // whole window.
        let first = Instant::now() + Duration::from_secs(10);
        let v = l.take_at(first);
        assert!(v.allowed);
        assert_eq!(v.reset, Duration::from_millis(1_500));
        let v = l.take_at(first + Duration::from_millis(1_499));
        assert!(!v.allowed);
        assert_eq!(v.reset, Duration::from_millis(1));
        let v = l.take_at(first + Duration::from_millis(1_500));
        assert!(v.allowed, "a new window");
        assert_eq!(v.reset, Duration::from_millis(1_500));
    }

    #[test]
    fn limiter_counts_a_window() {
        let l = Limiter::new(RateLimit {
            requests: 2,
            tokens: None,
            window: Duration::from_secs(60),
        });
        assert!(l.take().allowed);
        let v = l.take();
        assert!(v.allowed);
        assert_eq!(v.remaining, 0);
        assert!(!l.take().allowed);
        assert_eq!(reset_text(Duration::from_millis(250)), "250ms");
        assert_eq!(reset_text(Duration::from_millis(2_000)), "2s");
        assert_eq!(reset_text(Duration::from_millis(1_500)), "1.5s");
        assert_eq!(reset_text(Duration::from_secs(360)), "6m0s");
        // Never earlier than the window opens.
        assert_eq!(reset_text(Duration::from_micros(1_491_700)), "1.492s");
        assert_eq!(reset_text(Duration::from_micros(999_100)), "1s");
        assert_eq!(reset_text(Duration::from_micros(100)), "1ms");
        assert_eq!(reset_text(Duration::from_millis(60_001)), "1m1s");
    }

    #[test]
    fn a_token_budget_refuses_once_spent() {
        let l = Limiter::new(RateLimit {
            requests: 100,
            tokens: Some(50),
            window: Duration::from_secs(60),
        });
        let mut v = l.take();
        assert!(v.allowed);
        l.charge(60, &mut v);
        assert_eq!(v.tokens, Some((50, 0)));
        let v = l.take();
        assert!(!v.allowed, "the window's tokens are spent");
        assert!(v.by_tokens);
    }
}
