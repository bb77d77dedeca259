//! The fleet endpoints' contract (docs/src/design.md, "Fleet"): the filter
//! posts `/v1/fleet/take`, `/v1/fleet/give` and `/v1/fleet/slots` to the
//! sidecar beside it, which answers from Redis. Here: the headers every
//! call carries, the error codes the sidecar answers with, and the bodies.
//! Requests refuse unknown fields (a misspelt field is an error, not a
//! default); answers do not (a newer sidecar may add one).

use serde::{Deserialize, Serialize};

// ------------------------------------------------------------ headers, codes

/// Header of every fleet call: the secret this Envoy and its sidecar share
/// (the policy's `fleet.secret_env`, the sidecar's `fleet.secret_file` or
/// `secret_env`), which the sidecar compares in constant time.
pub const SECRET_HEADER: &str = "x-sluice-fleet-secret";
/// Header of every fleet call: the fingerprint of the calling Envoy's
/// fleet rules; the sidecar refuses a call whose rules differ from its own.
pub const FINGERPRINT_HEADER: &str = "x-sluice-fleet-fingerprint";
/// Shortest fleet secret (and `fleet.salt`) either side accepts, in bytes.
pub const MIN_SECRET: usize = 16;
/// The environment variable both sides read the fleet secret from by default.
pub const DEFAULT_SECRET_ENV: &str = "SLUICE_FLEET_SECRET";

/// `error.code` of a fleet answer (`{"error": {"code", "message"}}`, 503)
/// when the fleet's fingerprints differ: the sidecar refuses to count.
pub const FLEET_MISMATCH: &str = "fleet_mismatch";
/// `error.code` when Redis lost the data of a hard budget's window.
pub const FLEET_DATA_LOST: &str = "fleet_data_lost";
/// `error.code` when Redis does not answer.
pub const FLEET_UNAVAILABLE: &str = "fleet_unavailable";
/// `error.code` of a take Redis did not apply: past its deadline, or
/// undone before it arrived.
pub const FLEET_LATE: &str = "fleet_late";

// ------------------------------------------------------------ bodies

/// One bucket's claim in a take.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TakeClaim {
    /// A fleet bucket of the sidecar's policy (`tier/free/daily_tokens`).
    pub rule: String,
    /// The caller's hash (1: a global bucket).
    pub owner: u64,
    /// The end of the claim's calendar window; 0 for a token bucket.
    pub window_end_ms: u64,
    pub need: u64,
    pub want: u64,
}

/// `POST /v1/fleet/take`: every claim of one request, all or nothing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TakeRequest {
    /// Unique per take: an abandoned take is given back by it.
    pub id: String,
    /// Past this (ms since the epoch, Redis' clock) it is not applied.
    pub deadline_ms: u64,
    pub claims: Vec<TakeClaim>,
}

/// The answer to a take.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct TakeAnswer {
    pub ok: bool,
    /// Granted per claim (ok), each at least its `need`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<u64>,
    /// Left globally per claim after the grant (ok), or in the claim that
    /// refused.
    #[serde(default)]
    pub left: Vec<u64>,
    /// The claim that refused (not ok).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<usize>,
}

/// One lease return, settlement delta or undo in a give.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GiveItem {
    pub rule: String,
    pub owner: u64,
    pub window_end_ms: u64,
    /// > 0 gives units back, < 0 charges them.
    pub delta: i64,
    /// Undo take `take` on this bucket (delta is then ignored).
    #[serde(default)]
    pub take: Option<String>,
}

/// `POST /v1/fleet/give`: a batch, applied once per id. Answered `{}`
/// with 200 (applied, or already applied).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GiveRequest {
    /// Unique per batch; a retry sends the same id.
    pub id: String,
    pub items: Vec<GiveItem>,
}

/// One concurrency scope in a slots report.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlotScope {
    /// `concurrency/<backend>` or `concurrency/<backend>/<model>`.
    pub id: String,
    /// How many slots this Envoy wants to hold (absolute).
    pub hold: u32,
}

/// `POST /v1/fleet/slots`: the absolute holdings this Envoy wants.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlotsRequest {
    pub scopes: Vec<SlotScope>,
}

/// The answer to a slots report.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct SlotsAnswer {
    /// Slots this Envoy now holds, per scope, in request order.
    pub grants: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::DeserializeOwned;

    /// `json` parses as `T` and prints back as the same JSON.
    fn round_trip<T: DeserializeOwned + Serialize + std::fmt::Debug + PartialEq>(json: &str) -> T {
        let value: T = serde_json::from_str(json).unwrap();
        assert_eq!(serde_json::to_string(&value).unwrap(), json);
        value
    }

    #[test]
    fn take_request() {
        let r: TakeRequest = round_trip(
            r#"{"id":"t-1","deadline_ms":1700000000000,"claims":[{"rule":"tier/free/daily_tokens","owner":42,"window_end_ms":1700006400000,"need":10,"want":100}]}"#,
        );
        assert_eq!(r.claims[0].need, 10);
        let typo = r#"{"id":"t","deadline_ms":1,"claims":[],"extra":1}"#;
        assert!(serde_json::from_str::<TakeRequest>(typo).is_err());
    }

    #[test]
    fn take_answer() {
        round_trip::<TakeAnswer>(r#"{"ok":true,"grants":[100],"left":[900]}"#);
        let refused: TakeAnswer = round_trip(r#"{"ok":false,"left":[0],"refused":0}"#);
        assert_eq!(refused.refused, Some(0));
        assert!(refused.grants.is_empty());
    }

    #[test]
    fn give_request() {
        let g: GiveRequest = round_trip(
            r#"{"id":"b-7","items":[{"rule":"r","owner":1,"window_end_ms":0,"delta":-3,"take":null},{"rule":"r","owner":1,"window_end_ms":0,"delta":0,"take":"t-1"}]}"#,
        );
        assert_eq!(g.items[1].take.as_deref(), Some("t-1"));
        // `take` may be left out.
        let short = r#"{"id":"b","items":[{"rule":"r","owner":1,"window_end_ms":0,"delta":5}]}"#;
        assert_eq!(
            serde_json::from_str::<GiveRequest>(short).unwrap().items[0].take,
            None
        );
    }

    #[test]
    fn slots() {
        let r: SlotsRequest = round_trip(
            r#"{"scopes":[{"id":"concurrency/vllm","hold":3},{"id":"concurrency/vllm/m","hold":0}]}"#,
        );
        assert_eq!(r.scopes[0].hold, 3);
        round_trip::<SlotsAnswer>(r#"{"grants":[3,0]}"#);
    }
}
