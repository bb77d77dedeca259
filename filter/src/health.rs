//! Health and routing (SPEC §2.4, §2.8): where a request may go given what
//! the sidecar reports (GPU breakers, kill switch) and what the upstream
//! itself said lately (failures, `Retry-After`). Pure: state comes in as
//! values, time as `now_ms`, chance as a number in 0..1000.

use serde::Deserialize;

/// The sidecar's `/v1/state`, as far as the filter needs it.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct SidecarState {
    pub version: u64,
    #[serde(default)]
    pub kill_switch: KillSwitch,
    #[serde(default)]
    pub breakers: Vec<BreakerView>,
    #[serde(default)]
    pub stale: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct KillSwitch {
    pub active: bool,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BreakerView {
    /// `model:<name>` or `backend:<name>`.
    pub scope: String,
    /// `open` or `half_open` (closed breakers are not listed).
    pub state: String,
    #[serde(default)]
    pub half_open_fraction: f64,
    #[serde(default)]
    pub retry_after_seconds: Option<u64>,
    pub reason: Option<String>,
}

/// The sidecar state as one worker sees it: the last one received, and when.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    pub state: Option<SidecarState>,
    pub received_ms: u64,
}

/// What the sidecar's silence means once its last state is older than
/// `stale_after`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Ignore the breakers (a breaker that blocks on no data takes the
    /// service down with the sidecar). The kill switch keeps its last value:
    /// it is an operator's decision, not a measurement.
    #[default]
    FailOpen,
    /// Keep refusing what the last state refused.
    FailClosed,
}

/// Shared-data encoding of a received state: receive time, then the JSON.
pub fn encode_seen(received_ms: u64, json: &[u8]) -> Vec<u8> {
    let mut out = received_ms.to_le_bytes().to_vec();
    out.extend_from_slice(json);
    out
}

pub fn decode_seen(bytes: &[u8]) -> Seen {
    if bytes.len() < 8 {
        return Seen::default();
    }
    let mut ms = [0u8; 8];
    ms.copy_from_slice(&bytes[..8]);
    Seen {
        state: serde_json::from_slice(&bytes[8..]).ok(),
        received_ms: u64::from_le_bytes(ms),
    }
}

/// What the last few responses of one model route said. Kept per model in
/// shared data so every worker pauses and breaks together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Upstream {
    /// Requests wait until then (an upstream `Retry-After`).
    pub paused_until_ms: u64,
    /// Failures in a row (5xx, reset, timeout).
    pub failures: u32,
    /// The error breaker is open until then; after it, one probe at a time.
    pub open_until_ms: u64,
    /// The cooldown the next opening will use.
    pub cooldown_ms: u64,
    /// A half-open probe is in flight (until this time, as a lease).
    pub probe_until_ms: u64,
}

impl Upstream {
    pub fn encode(&self) -> [u8; 36] {
        let mut out = [0u8; 36];
        out[..8].copy_from_slice(&self.paused_until_ms.to_le_bytes());
        out[8..12].copy_from_slice(&self.failures.to_le_bytes());
        out[12..20].copy_from_slice(&self.open_until_ms.to_le_bytes());
        out[20..28].copy_from_slice(&self.cooldown_ms.to_le_bytes());
        out[28..36].copy_from_slice(&self.probe_until_ms.to_le_bytes());
        out
    }

    pub fn decode(b: &[u8]) -> Upstream {
        if b.len() != 36 {
            return Upstream::default();
        }
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let mut w = [0u8; 4];
        w.copy_from_slice(&b[8..12]);
        Upstream {
            paused_until_ms: u64_at(0),
            failures: u32::from_le_bytes(w),
            open_until_ms: u64_at(12),
            cooldown_ms: u64_at(20),
            probe_until_ms: u64_at(28),
        }
    }

    /// Records a response. `retry_after_ms` is the upstream's `Retry-After`
    /// on a 429/503 (with jitter already added).
    pub fn observe(
        mut self,
        p: &Protection,
        status: u32,
        retry_after_ms: Option<u64>,
        now_ms: u64,
    ) -> Upstream {
        if self.paused_until_ms <= now_ms {
            self.paused_until_ms = 0; // a pause that ended leaves no trace
        }
        if let (429 | 503, Some(wait)) = (status, retry_after_ms) {
            self.paused_until_ms = self.paused_until_ms.max(now_ms + wait);
        }
        let failed = status == 0 || status >= 500;
        let was_probe = self.probe_until_ms > 0;
        self.probe_until_ms = 0;
        if !failed {
            self.failures = 0;
            if was_probe || self.open_until_ms > 0 {
                // A good answer after the cooldown closes the breaker.
                self.open_until_ms = 0;
                self.cooldown_ms = 0;
            }
            return self;
        }
        self.failures = self.failures.saturating_add(1);
        if self.failures >= p.failures_to_open || was_probe {
            let cooldown = if self.cooldown_ms == 0 {
                p.cooldown_ms
            } else {
                (self.cooldown_ms.saturating_mul(p.backoff as u64)).min(p.max_cooldown_ms)
            };
            self.open_until_ms = now_ms + cooldown;
            self.cooldown_ms = cooldown;
            self.failures = 0;
        }
        self
    }
}

/// Upstream-driven protection settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protection {
    pub failures_to_open: u32,
    pub cooldown_ms: u64,
    pub backoff: u32,
    pub max_cooldown_ms: u64,
    pub max_jitter_ms: u64,
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    Primary,
    /// Kill switch: the fallback provider.
    Fallback,
    /// Nothing upstream may serve it: answer from the static table.
    Static,
    /// 503 with this code and `Retry-After`.
    Refuse {
        code: &'static str,
        retry_after_s: u64,
        why: String,
    },
    /// A half-open probe of the error breaker: go, and report back.
    Probe,
}

/// Inputs of the routing decision.
pub struct Situation<'a> {
    pub seen: &'a Seen,
    pub stale_after_ms: u64,
    pub on_stale: OnStale,
    pub model: Option<&'a str>,
    pub backend: &'a str,
    pub upstream: Upstream,
    pub has_fallback: bool,
    /// Serve the static table when the primary is out (breaker, error
    /// breaker) instead of refusing.
    pub static_when_out: bool,
    pub default_retry_after_s: u64,
    pub now_ms: u64,
    /// Uniform in 0..1000, for the half-open trickle.
    pub dice: u32,
}

/// Decides the route. Order: kill switch, then the sidecar's breakers, then
/// the upstream's own pushback (pause, error breaker).
pub fn route(s: &Situation) -> Route {
    let fresh = s.now_ms.saturating_sub(s.seen.received_ms) <= s.stale_after_ms;
    let state = s.seen.state.as_ref();
    if state.is_some_and(|st| st.kill_switch.active) {
        return if s.has_fallback {
            Route::Fallback
        } else {
            Route::Static
        };
    }
    let trust_breakers = fresh || s.on_stale == OnStale::FailClosed;
    if let Some(st) = state.filter(|_| trust_breakers) {
        let model_scope = s.model.map(|m| format!("model:{m}"));
        let backend_scope = format!("backend:{}", s.backend);
        for b in &st.breakers {
            let applies = Some(&b.scope) == model_scope.as_ref() || b.scope == backend_scope;
            if !applies {
                continue;
            }
            let let_through =
                b.state == "half_open" && (s.dice as f64) < b.half_open_fraction * 1000.0;
            if !let_through {
                if s.static_when_out {
                    return Route::Static;
                }
                return Route::Refuse {
                    code: "gpu_overloaded",
                    retry_after_s: b
                        .retry_after_seconds
                        .unwrap_or(s.default_retry_after_s)
                        .max(1),
                    why: b
                        .reason
                        .clone()
                        .unwrap_or_else(|| format!("breaker {} is {}", b.scope, b.state)),
                };
            }
        }
    }
    let up = s.upstream;
    if up.paused_until_ms > s.now_ms {
        return Route::Refuse {
            code: "upstream_paused",
            retry_after_s: (up.paused_until_ms - s.now_ms).div_ceil(1000).max(1),
            why: "the upstream asked to slow down (Retry-After)".into(),
        };
    }
    if up.open_until_ms > 0 {
        if up.open_until_ms > s.now_ms || up.probe_until_ms > s.now_ms {
            if s.static_when_out {
                return Route::Static;
            }
            let until = up.open_until_ms.max(up.probe_until_ms);
            return Route::Refuse {
                code: "upstream_unhealthy",
                retry_after_s: until.saturating_sub(s.now_ms).div_ceil(1000).max(1),
                why: "the upstream failed repeatedly; its breaker is open".into(),
            };
        }
        return Route::Probe;
    }
    Route::Primary
}

/// Seconds the sidecar may hold one long poll: `poll_wait`, but at most
/// half of `stale_after`, and at least 1 (the sidecar counts in seconds).
/// Only an answer refreshes the state's receive time, so a poll held past
/// `stale_after` would make a healthy sidecar whose state does not change
/// look dead, and its open breakers would be ignored (fail open).
pub fn poll_wait_s(poll_wait_ms: u64, stale_after_ms: u64) -> u64 {
    (poll_wait_ms.min(stale_after_ms / 2) / 1000).max(1)
}

/// `Retry-After` as seconds or an HTTP date we cannot parse (then `None`).
pub fn parse_retry_after(value: &str) -> Option<u64> {
    value.trim().parse::<u64>().ok().map(|s| s.min(3600) * 1000)
}

/// Canned-answer key: lower case, letters and digits, single spaces.
pub fn normalize_prompt(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(json: &str, at: u64) -> Seen {
        decode_seen(&encode_seen(at, json.as_bytes()))
    }

    fn situation<'a>(seen: &'a Seen, upstream: Upstream, now_ms: u64, dice: u32) -> Situation<'a> {
        Situation {
            seen,
            stale_after_ms: 10_000,
            on_stale: OnStale::FailOpen,
            model: Some("big"),
            backend: "local",
            upstream,
            has_fallback: true,
            static_when_out: false,
            default_retry_after_s: 30,
            now_ms,
            dice,
        }
    }

    const OPEN: &str = r#"{"version": 2, "kill_switch": {"active": false, "reason": null},
        "breakers": [{"scope": "model:big", "state": "open", "half_open_fraction": 0.0,
                      "retry_after_seconds": 12, "reason": "gpu_utilization 95 >= 90 for 30s"}]}"#;

    #[test]
    fn an_open_breaker_refuses_its_scope_only() {
        let s = seen(OPEN, 1_000);
        let r = route(&situation(&s, Upstream::default(), 2_000, 0));
        assert!(
            matches!(
                r,
                Route::Refuse {
                    code: "gpu_overloaded",
                    retry_after_s: 12,
                    ..
                }
            ),
            "{r:?}"
        );
        let mut other = situation(&s, Upstream::default(), 2_000, 0);
        other.model = Some("small");
        assert_eq!(route(&other), Route::Primary);
    }

    #[test]
    fn half_open_lets_a_fraction_through() {
        let s = seen(
            &OPEN
                .replace("\"open\"", "\"half_open\"")
                .replace("0.0", "0.1"),
            0,
        );
        let through = (0..1000)
            .filter(|d| route(&situation(&s, Upstream::default(), 0, *d)) == Route::Primary)
            .count();
        assert_eq!(through, 100);
    }

    #[test]
    fn a_stale_sidecar_fails_open_but_keeps_the_kill_switch() {
        let s = seen(OPEN, 0);
        assert_eq!(
            route(&situation(&s, Upstream::default(), 20_000, 0)),
            Route::Primary
        );
        let mut closed = situation(&s, Upstream::default(), 20_000, 0);
        closed.on_stale = OnStale::FailClosed;
        assert!(matches!(route(&closed), Route::Refuse { .. }));
        let killed = seen(
            r#"{"version": 3, "kill_switch": {"active": true, "reason": "drill"}, "breakers": []}"#,
            0,
        );
        assert_eq!(
            route(&situation(&killed, Upstream::default(), 20_000, 0)),
            Route::Fallback
        );
        let mut no_fallback = situation(&killed, Upstream::default(), 0, 0);
        no_fallback.has_fallback = false;
        assert_eq!(route(&no_fallback), Route::Static);
    }

    #[test]
    fn upstream_pushback_pauses_and_breaks() {
        let p = Protection {
            failures_to_open: 3,
            cooldown_ms: 60_000,
            backoff: 2,
            max_cooldown_ms: 600_000,
            max_jitter_ms: 0,
        };
        let none = Seen::default();
        let paused = Upstream::default().observe(&p, 503, Some(5_000), 1_000);
        let r = route(&situation(&none, paused, 2_000, 0));
        assert!(
            matches!(
                r,
                Route::Refuse {
                    code: "upstream_paused",
                    retry_after_s: 4,
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(route(&situation(&none, paused, 6_001, 0)), Route::Primary);

        let mut u = Upstream::default();
        for _ in 0..2 {
            u = u.observe(&p, 500, None, 0);
        }
        assert_eq!(route(&situation(&none, u, 0, 0)), Route::Primary);
        u = u.observe(&p, 500, None, 0);
        assert!(matches!(
            route(&situation(&none, u, 1, 0)),
            Route::Refuse {
                code: "upstream_unhealthy",
                ..
            }
        ));
        assert_eq!(route(&situation(&none, u, 60_000, 0)), Route::Probe);
        // A failed probe reopens for twice as long; a good one closes.
        u.probe_until_ms = 70_000;
        let again = u.observe(&p, 502, None, 60_000);
        assert_eq!((again.open_until_ms, again.cooldown_ms), (180_000, 120_000));
        let healed = u.observe(&p, 200, None, 60_000);
        assert_eq!(route(&situation(&none, healed, 60_001, 0)), Route::Primary);
        assert_eq!(Upstream::decode(&again.encode()), again);
    }

    #[test]
    fn a_held_poll_is_answered_well_within_stale_after() {
        // Defaults: 30 s poll, 60 s staleness.
        assert_eq!(poll_wait_s(30_000, 60_000), 30);
        // A short staleness window shortens the poll instead of going stale
        // while the sidecar is healthy and quiet.
        assert_eq!(poll_wait_s(30_000, 2_000), 1);
        assert_eq!(poll_wait_s(30_000, 10_000), 5);
        assert_eq!(poll_wait_s(500, 60_000), 1);
        for stale_after in [2_000, 3_000, 10_000, 61_000] {
            assert!(poll_wait_s(30_000, stale_after) * 1000 * 2 <= stale_after);
        }
    }

    #[test]
    fn prompts_normalize() {
        assert_eq!(normalize_prompt("  What is   sluice?! "), "what is sluice");
        assert_eq!(parse_retry_after(" 5 "), Some(5_000));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
    }
}
