//! `GET /v1/state` (the filter's long poll of the sidecar), as the filter
//! reads it: the kill switch and every breaker that is not plainly closed.
//! The sidecar sends more (`updated_at`, each breaker's `since`): a reader
//! ignores fields it does not know, so either side may add one.

use serde::{Deserialize, Serialize};

/// A scope's state. `closed` breakers are not listed; `saturated` is a
/// saturation rule's verdict (serving but full: queue batch traffic, refuse
/// interactive), not a breaker's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
    Saturated,
    /// A state this build does not know (a newer sidecar): read, never
    /// sent, so one new state does not make the whole answer unreadable.
    #[serde(other, skip_serializing)]
    Unknown,
}

impl BreakerState {
    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Saturated => "saturated",
            BreakerState::Unknown => "unknown",
        }
    }
}

/// The body of `GET /v1/state`, as far as the filter needs it.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct State {
    /// +1 on every change; a long poll asks for one newer than it holds.
    pub version: u64,
    #[serde(default)]
    pub kill_switch: KillSwitch,
    #[serde(default)]
    pub breakers: Vec<Breaker>,
    /// Some scope has had no fresh data for the sidecar's `stale_after`.
    #[serde(default)]
    pub stale: bool,
    /// Changes on every cache purge (and on a sidecar restart): entries
    /// the filter keeps in Envoy were stored under a generation and are
    /// served only while it is the current one.
    #[serde(default)]
    pub cache_generation: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct KillSwitch {
    pub active: bool,
    #[serde(default)]
    pub reason: Option<String>,
}

/// One scope's verdict.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Breaker {
    /// `backend:NAME` or `model:NAME`.
    pub scope: String,
    pub state: BreakerState,
    /// The share of requests let through: the trickle when half-open, 0
    /// when open.
    #[serde(default)]
    pub half_open_fraction: f64,
    /// What refused clients are told to wait.
    #[serde(default)]
    pub retry_after_seconds: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_states_are_their_snake_case_names() {
        for (s, text) in [
            (BreakerState::Closed, "\"closed\""),
            (BreakerState::Open, "\"open\""),
            (BreakerState::HalfOpen, "\"half_open\""),
            (BreakerState::Saturated, "\"saturated\""),
        ] {
            assert_eq!(serde_json::to_string(&s).unwrap(), text);
            assert_eq!(serde_json::from_str::<BreakerState>(text).unwrap(), s);
            assert_eq!(format!("\"{}\"", s.as_str()), text);
        }
        assert_eq!(
            serde_json::from_str::<BreakerState>("\"melting\"").unwrap(),
            BreakerState::Unknown
        );
        assert!(serde_json::to_string(&BreakerState::Unknown).is_err());
    }

    #[test]
    fn state() {
        let json = r#"{"version":7,"kill_switch":{"active":true,"reason":"drill"},"breakers":[{"scope":"model:big","state":"open","half_open_fraction":0.0,"retry_after_seconds":30,"reason":"gpu_memory_pct 97 >= 95"},{"scope":"backend:vllm","state":"saturated","half_open_fraction":0.0,"retry_after_seconds":null,"reason":null}],"stale":false,"cache_generation":5}"#;
        let s: State = serde_json::from_str(json).unwrap();
        assert_eq!(serde_json::to_string(&s).unwrap(), json);
        assert_eq!(s.cache_generation, 5);
        assert_eq!(s.breakers[0].state, BreakerState::Open);
        assert_eq!(s.breakers[1].state, BreakerState::Saturated);
        // What the sidecar adds is ignored; what it leaves out defaults.
        let sent = r#"{"version":3,"updated_at":"2026-01-01T00:00:00Z","kill_switch":{"active":false,"reason":null,"since":null},"breakers":[{"scope":"model:m","state":"half_open","half_open_fraction":0.1,"retry_after_seconds":5,"reason":null,"since":"2026-01-01T00:00:00Z"}],"stale":true}"#;
        let s: State = serde_json::from_str(sent).unwrap();
        assert_eq!(s.breakers[0].state, BreakerState::HalfOpen);
        assert!(s.stale);
        let bare: State = serde_json::from_str(r#"{"version":1}"#).unwrap();
        assert_eq!(
            bare,
            State {
                version: 1,
                ..State::default()
            }
        );
    }
}
