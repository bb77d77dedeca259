//! The policy as operators write it (SPEC §4), its parsing from the two forms
//! Envoy hands the plugin (protobuf `Struct` bytes or a JSON string), and the
//! checks that span fields. Every error names the field path.

pub mod abuse;
pub mod cache;
pub mod fleet;
pub mod health;
pub mod keys;
pub mod passthrough;
pub(crate) mod proto_struct;
pub mod queue;
pub mod shares;
pub mod units;
pub mod zone;

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

pub use crate::policy::health::Credentials;
use crate::policy::units::{parse_rate, parse_size, Rate, MAX_UNITS, SCALE};
use crate::policy::zone::Zone;

/// A policy that could not be loaded: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sluice policy: {path}: {message}")]
pub struct ConfigError {
    /// Dotted field path, e.g. `tiers.free.requests`; `.` is the whole policy.
    pub path: String,
    pub message: String,
}

impl ConfigError {
    pub(crate) fn at(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Tier of callers whose identity names no (known) tier.
    pub default_tier: String,
    #[serde(default)]
    pub identity: IdentityConfig,
    pub tiers: BTreeMap<String, TierConfig>,
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub request: RequestConfig,
    #[serde(default)]
    pub defaults: Defaults,
    #[serde(default)]
    pub state: StateConfig,
    /// Where the GPU sidecar is; absent: no sidecar, no breakers.
    pub sidecar: Option<SidecarConfig>,
    /// How the kill switch reroutes; absent: the kill switch serves the
    /// static fallback.
    pub fallback: Option<FallbackConfig>,
    #[serde(default)]
    pub protection: ProtectionConfig,
    pub static_fallback: Option<StaticFallback>,
    /// Absent: no audit fields are written (they cost a host call each).
    pub audit: Option<AuditConfig>,
    pub anomaly: Option<AnomalyConfig>,
    /// The response cache (see `policy/cache.rs`); absent: no cache.
    pub cache: Option<crate::policy::cache::CacheConfig>,
    /// `cache`, compiled at load.
    #[serde(skip)]
    pub cache_compiled: Option<crate::policy::cache::CachePolicy>,
    /// Workload classes: who waits for capacity and how long (see `queue`).
    #[serde(default)]
    pub classes: BTreeMap<String, crate::policy::queue::ClassConfig>,
    /// The class of callers whose tier, claim or header names none;
    /// absent: such callers are refused at once when capacity is out.
    pub default_class: Option<String>,
    /// Limits per backend, all its models together.
    #[serde(default)]
    pub backends: BTreeMap<String, crate::policy::queue::BackendConfig>,
    /// Limits of each team, all its members together (see `hierarchy`).
    #[serde(default)]
    pub teams: BTreeMap<String, TierConfig>,
    /// Limits of each organisation, all its teams and members together.
    #[serde(default)]
    pub orgs: BTreeMap<String, TierConfig>,
    /// What all calendar budgets share (the timezone of their midnight).
    #[serde(default)]
    pub budgets: crate::policy::zone::BudgetsConfig,
    /// The penalty box: callers over a threshold are blocked for a while.
    pub abuse: Option<crate::policy::abuse::AbuseConfig>,
    /// Limits shared by every Envoy of a fleet (see `fleet`); absent: each
    /// Envoy counts alone (the embedded default).
    pub fleet: Option<crate::policy::fleet::FleetConfig>,
    /// Paths sluice does not read that may still go upstream, each with
    /// its own limits (see `passthrough`); every other unknown path with a
    /// body is refused (deny by default).
    #[serde(default)]
    pub passthrough: Vec<crate::policy::passthrough::PassthroughRule>,
}

/// Consumption across all callers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnomalyConfig {
    /// Tokens this minute above this multiple of the trailing average count
    /// as a surge (`sluice_usage_surge_total`).
    #[serde(default = "default_surge_ratio", deserialize_with = "de_number")]
    pub surge_ratio: f64,
    /// Minutes the trailing average looks back over.
    #[serde(default = "default_baseline_minutes")]
    pub baseline_minutes: u32,
    /// Spend in the last hour (model prices' currency) at which the global
    /// breaker refuses new requests (503 `global_breaker_open`) until the
    /// hour slides under it again (or the ceiling is raised).
    pub max_spend_per_hour: Option<Budget>,
}

fn default_surge_ratio() -> f64 {
    1.5
}
fn default_baseline_minutes() -> u32 {
    15
}

/// The per-request audit fields Envoy's access log reads from filter state
/// (`%FILTER_STATE(wasm.sluice_…:PLAIN)%`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// Mixed into the principal's hash so the log cannot be joined with
    /// other data by hashing known addresses or keys. Set your own.
    #[serde(default)]
    pub salt: String,
    /// Also record the SHA-256 of the request and response bodies.
    #[serde(default)]
    pub hash_bodies: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarConfig {
    /// The Envoy cluster of the sidecar.
    pub cluster: String,
    /// `:authority` of the poll; default: the cluster name.
    pub authority: Option<String>,
    /// How long the sidecar may hold a long poll.
    #[serde(
        default = "default_poll_wait",
        deserialize_with = "de_duration",
        rename = "poll_wait"
    )]
    pub poll_wait_ms: u64,
    /// How long the last state counts when the sidecar is unreachable.
    #[serde(
        default = "default_stale_after",
        deserialize_with = "de_duration",
        rename = "stale_after"
    )]
    pub stale_after_ms: u64,
    #[serde(default)]
    pub on_stale: crate::policy::health::OnStale,
    /// `Retry-After` of a `gpu_overloaded` 503 when the sidecar gives none.
    #[serde(
        default = "default_breaker_retry",
        deserialize_with = "de_duration",
        rename = "retry_after"
    )]
    pub retry_after_ms: u64,
}

fn default_poll_wait() -> u64 {
    30_000
}
fn default_stale_after() -> u64 {
    60_000
}
fn default_breaker_retry() -> u64 {
    30_000
}

/// The kill switch sets `header: value` on the request and refreshes the
/// route, so a route matching that header sends it to the fallback cluster
/// (whose credentials Envoy injects). Clients cannot set the header: sluice
/// removes it from every request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackConfig {
    #[serde(default = "default_fallback_header")]
    pub header: String,
    #[serde(default = "default_fallback_value")]
    pub value: String,
    /// Provider name in `x-sluice-provider`.
    #[serde(default = "default_fallback_value")]
    pub provider: String,
}

fn default_fallback_header() -> String {
    "x-sluice-upstream".into()
}
fn default_fallback_value() -> String {
    "fallback".into()
}

/// How sluice reacts to what the upstream says (SPEC §2.8, §8): pauses on
/// `Retry-After`, the per-route error breaker. One caller cannot pause,
/// break or probe-block a route for the others; see `health.rs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtectionConfig {
    /// Upstream failures in a row (5xx, reset, timeout) that open the
    /// route's error breaker, if they come from `min_callers` callers.
    #[serde(default = "default_failures")]
    pub failures_to_open: u32,
    /// Distinct principals whose failures it takes to open the breaker
    /// (1 to 8): one caller's requests alone never open it.
    #[serde(default = "default_min_callers")]
    pub min_callers: u32,
    /// The failures that open the breaker all fall within this window.
    #[serde(
        default = "default_failure_window",
        deserialize_with = "de_duration",
        rename = "failure_window"
    )]
    pub failure_window_ms: u64,
    #[serde(
        default = "default_cooldown",
        deserialize_with = "de_duration",
        rename = "cooldown"
    )]
    pub cooldown_ms: u64,
    /// Each reopening multiplies the cooldown by this.
    #[serde(default = "default_backoff")]
    pub backoff: u32,
    #[serde(
        default = "default_max_cooldown",
        deserialize_with = "de_duration",
        rename = "max_cooldown"
    )]
    pub max_cooldown_ms: u64,
    /// Added at random to an upstream's `Retry-After` pause.
    #[serde(
        default = "default_jitter",
        deserialize_with = "de_duration",
        rename = "pause_jitter"
    )]
    pub pause_jitter_ms: u64,
    /// The longest pause an upstream's `Retry-After` can cause (before
    /// jitter); `0s` ignores `Retry-After`.
    #[serde(
        default = "default_max_pause",
        deserialize_with = "de_duration",
        rename = "max_pause"
    )]
    pub max_pause_ms: u64,
    /// Whose credential the upstream sees, for every model that does not
    /// say: `pass_through` (the client's own `Authorization`/`x-api-key`:
    /// a 429 pauses that credential only) or `injected` (Envoy's, one for
    /// everyone: a 429 pauses the route).
    #[serde(default)]
    pub credentials: Credentials,
    /// The request headers that carry a pass-through credential.
    #[serde(default = "default_credential_headers")]
    pub credential_headers: Vec<String>,
    /// Shared-data slots holding per-credential pauses (the bound on their
    /// key set).
    #[serde(default = "default_credential_slots")]
    pub credential_slots: u32,
    /// Breaker slots shared by models the policy does not list, placed by a
    /// hash of the name (unlisted models in one slot share a breaker and a
    /// pause); `1` puts every unlisted model behind one breaker.
    #[serde(default = "default_unlisted_slots")]
    pub unlisted_slots: u32,
}

impl Default for ProtectionConfig {
    fn default() -> Self {
        ProtectionConfig {
            failures_to_open: default_failures(),
            min_callers: default_min_callers(),
            failure_window_ms: default_failure_window(),
            cooldown_ms: default_cooldown(),
            backoff: default_backoff(),
            max_cooldown_ms: default_max_cooldown(),
            pause_jitter_ms: default_jitter(),
            max_pause_ms: default_max_pause(),
            credentials: Credentials::default(),
            credential_headers: default_credential_headers(),
            credential_slots: default_credential_slots(),
            unlisted_slots: default_unlisted_slots(),
        }
    }
}

fn default_failures() -> u32 {
    3
}
fn default_min_callers() -> u32 {
    2
}
fn default_failure_window() -> u64 {
    60_000
}
fn default_cooldown() -> u64 {
    60_000
}
fn default_backoff() -> u32 {
    2
}
fn default_max_cooldown() -> u64 {
    600_000
}
fn default_jitter() -> u64 {
    1_000
}
fn default_max_pause() -> u64 {
    300_000
}
fn default_credential_headers() -> Vec<String> {
    vec!["authorization".into(), "x-api-key".into()]
}
fn default_credential_slots() -> u32 {
    4096
}
fn default_unlisted_slots() -> u32 {
    64
}

/// Canned answers when nothing upstream can serve a request.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticFallback {
    /// Also when the primary is out (open breaker, error breaker), not only
    /// under a kill switch without a fallback provider.
    #[serde(default = "default_true")]
    pub when_primary_out: bool,
    /// Normalized prompt (lower case, words) → answer.
    #[serde(default)]
    pub answers: BTreeMap<String, String>,
    /// The answer to anything else.
    #[serde(default = "default_static_message")]
    pub message: String,
}

impl StaticFallback {
    pub fn default_message() -> String {
        default_static_message()
    }
}

fn default_true() -> bool {
    true
}
fn default_static_message() -> String {
    "The assistant is temporarily unavailable. Please try again in a few minutes.".into()
}

pub(crate) fn de_duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let text = String::deserialize(deserializer)?;
    crate::policy::units::parse_duration(&text).map_err(de::Error::custom)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdentitySource {
    Jwt,
    TrustedHeader,
    ApiKey,
    ClientAddress,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// Where the principal comes from, first match wins.
    #[serde(default = "default_sources")]
    pub sources: Vec<IdentitySource>,
    pub jwt: Option<JwtConfig>,
    pub trusted_header: Option<TrustedHeaderConfig>,
    pub api_key: Option<ApiKeyConfig>,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            sources: default_sources(),
            jwt: None,
            trusted_header: None,
            api_key: None,
        }
    }
}

fn default_sources() -> Vec<IdentitySource> {
    vec![IdentitySource::ClientAddress]
}

/// Claims of a JWT verified by Envoy's `jwt_authn` filter, read from the
/// dynamic metadata it writes with `payload_in_metadata`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    #[serde(default = "default_jwt_namespace")]
    pub metadata_namespace: String,
    #[serde(default = "default_jwt_payload_key")]
    pub payload_key: String,
    #[serde(default = "default_principal_claim")]
    pub principal_claim: String,
    pub tier_claim: Option<String>,
    /// A verified claim naming the caller's workload class.
    pub class_claim: Option<String>,
    /// Claims naming the caller's team and organisation (declared under
    /// `teams`/`orgs`; others count as none).
    pub team_claim: Option<String>,
    pub org_claim: Option<String>,
}

fn default_jwt_namespace() -> String {
    "envoy.filters.http.jwt_authn".into()
}
fn default_jwt_payload_key() -> String {
    "jwt_payload".into()
}
fn default_principal_claim() -> String {
    "sub".into()
}

/// Headers set by an auth filter in front of sluice. Only these names are
/// trusted; any other identity header a client sends is ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustedHeaderConfig {
    pub principal: String,
    pub tier: Option<String>,
    /// A trusted header naming the caller's workload class.
    pub class: Option<String>,
    /// Headers naming the caller's team and organisation.
    pub team: Option<String>,
    pub org: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Header carrying the key; `authorization` reads a `Bearer` token.
    #[serde(default = "default_api_key_header")]
    pub header: String,
    /// Also take the key from `Authorization: Bearer <key>`, as every
    /// OpenAI SDK sends it. A bearer token shaped like a JWT is never looked
    /// up as a key: it counts only once `jwt_authn` has verified it.
    #[serde(default = "default_true")]
    pub bearer: bool,
    /// Key → tier, or `{tier, team, org}`. A key may be written raw or as
    /// `sha256:<hex>`; either way only its hash is kept in memory.
    #[serde(default)]
    pub keys: BTreeMap<String, KeyEntry>,
    /// What a key missing from `keys` gets.
    #[serde(default)]
    pub unknown_keys: UnknownKeys,
}

/// What a declared API key stands for: `pro`, or
/// `{tier: pro, team: search, org: acme}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEntry {
    pub tier: String,
    pub team: Option<String>,
    pub org: Option<String>,
}

impl<'de> Deserialize<'de> for KeyEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            tier: String,
            team: Option<String>,
            org: Option<String>,
        }
        struct EntryVisitor;
        impl<'de> Visitor<'de> for EntryVisitor {
            type Value = KeyEntry;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tier name or a map `{tier: pro, team: search, org: acme}`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyEntry, E> {
                Ok(KeyEntry {
                    tier: v.to_string(),
                    team: None,
                    org: None,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<KeyEntry, A::Error> {
                let full = Full::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(KeyEntry {
                    tier: full.tier,
                    team: full.team,
                    org: full.org,
                })
            }
        }
        deserializer.deserialize_any(EntryVisitor)
    }
}

fn default_api_key_header() -> String {
    "x-api-key".into()
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownKeys {
    /// 401: otherwise every made-up key would be a fresh principal with a
    /// fresh budget.
    #[default]
    Reject,
    /// The key's hash is the principal, in the default tier.
    DefaultTier,
}

/// Limits per caller of a tier. Token amounts count input + output unless
/// the name says otherwise.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    /// Requests per caller.
    pub requests: Option<Limit>,
    /// Total tokens per caller, a token bucket (`20000/min`).
    pub tokens: Option<Limit>,
    pub input_tokens: Option<Limit>,
    pub output_tokens: Option<Limit>,
    /// Tokens per UTC day (resets 00:00 UTC).
    pub daily_tokens: Option<Budget>,
    /// Tokens per UTC calendar month (resets the 1st, 00:00 UTC).
    pub monthly_tokens: Option<Budget>,
    /// Spend per UTC day, in the currency of the model prices.
    pub daily_spend: Option<Budget>,
    pub monthly_spend: Option<Budget>,
    /// Limits on all callers of this tier together whose API key is not
    /// declared under `identity.api_key.keys` (JWT subjects, trusted
    /// headers, addresses, undeclared keys): the same fields as above,
    /// counted once for all of them (`anonymous_total: {requests: 600/min}`).
    /// A flood of new identities takes at most this.
    pub anonymous_total: Option<Box<TierConfig>>,
    /// The workload class of this tier's callers (a name under `classes`).
    pub class: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Requests to this model, all callers together.
    pub requests: Option<Limit>,
    /// Total tokens to this model, all callers together.
    pub tokens: Option<Limit>,
    /// Output reserved (and written into the request as its maximum) when
    /// the client sets none. Default: `defaults.max_output_tokens`.
    pub default_max_output: Option<u64>,
    /// The most output one completion of this model may ask for (its
    /// context window, say); more is a 400. Default: `request.max_output`.
    pub max_output: Option<u64>,
    /// Where a request goes when its caller is over a soft cap.
    pub downshift_to: Option<String>,
    /// The sidecar scope `backend:<name>` whose breaker guards this model.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Price per 1,000 tokens.
    pub price: Option<Price>,
    /// Virtual cost of a self-hosted model: GPU cost per hour ÷ throughput.
    pub gpu: Option<GpuCost>,
    /// Whose credential this model's upstream sees; default:
    /// `protection.credentials`.
    pub credentials: Option<Credentials>,
    /// Requests in flight to this model at once, across every worker.
    pub concurrency: Option<u32>,
    /// Fair shares of this model's buckets (`{free: 20%, anonymous: 10%}`,
    /// see `shares`); default: `defaults.shares`.
    pub shares: Option<crate::policy::shares::SharesConfig>,
}

pub fn default_backend() -> String {
    "local".into()
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    #[serde(deserialize_with = "de_number")]
    pub input_per_1k: f64,
    #[serde(deserialize_with = "de_number")]
    pub output_per_1k: f64,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuCost {
    #[serde(deserialize_with = "de_number")]
    pub cost_per_hour: f64,
    #[serde(deserialize_with = "de_number")]
    pub tokens_per_second: f64,
}

/// A number, also when a YAML tool quoted it (`"4.0"`).
fn de_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    struct NumberVisitor;
    impl Visitor<'_> for NumberVisitor {
        type Value = f64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a number")
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
            Ok(v)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
            Ok(v as f64)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|n| n.is_finite())
                .ok_or_else(|| E::custom(format!("`{v}` is not a number")))
        }
    }
    deserializer.deserialize_any(NumberVisitor)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    /// Output reserved when neither the request nor the model says.
    #[serde(default = "default_max_output")]
    pub max_output_tokens: u64,
    /// The shares of every model and route bucket that writes none;
    /// absent: `anonymous: 50%` when the policy declares API keys (see
    /// `shares`), `{}` turns that off.
    pub shares: Option<crate::policy::shares::SharesConfig>,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            max_output_tokens: default_max_output(),
            shares: None,
        }
    }
}

fn default_max_output() -> u64 {
    1024
}

/// Hard caps refuse (429); soft caps let the request go on, downshifted to
/// the model's cheaper model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Hard,
    Soft,
}

/// A fixed-window budget: `5000`, `"5,000 tokens"`, or
/// `{limit: 50000, mode: soft, alert_at: 80%}`. For spend, `limit` is in
/// currency (`12.50`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub limit: f64,
    pub mode: Mode,
    /// Alert when use crosses this fraction, in thousandths.
    pub alert_at_permille: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    pub path_prefix: String,
    /// Requests on this route, all principals together.
    pub requests: Limit,
    /// Fair shares of the route's bucket; default: `defaults.shares`.
    pub shares: Option<crate::policy::shares::SharesConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestConfig {
    /// Bodies above this get 413 (`1MiB`, `512KiB` or bytes).
    #[serde(default = "default_max_body", deserialize_with = "de_size")]
    pub max_body_bytes: u64,
    /// The most output tokens one completion may ask for, any model (a
    /// model's own `max_output` may be lower). Above it: 400 naming the
    /// field. Bounds every reservation, so no client number can wrap it.
    #[serde(default = "default_output_cap")]
    pub max_output: u64,
}

impl Default for RequestConfig {
    fn default() -> Self {
        RequestConfig {
            max_body_bytes: default_max_body(),
            max_output: default_output_cap(),
        }
    }
}

/// The highest `request.max_output` accepted: with at most 128 choices and
/// a body-bounded input, every reservation stays far from `u64::MAX`.
pub const MAX_OUTPUT_CAP: u64 = 1 << 32;

fn default_output_cap() -> u64 {
    1 << 20
}

fn default_max_body() -> u64 {
    1 << 20
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// Shared-data slots per per-principal rule: the bound on the key set.
    #[serde(default = "default_slots")]
    pub principal_slots: u32,
    /// Compare-and-swap attempts on one bucket before the request is refused.
    #[serde(default = "default_cas_retries")]
    pub cas_max_retries: u32,
    /// Cells per row of the count-min sketch that remembers what callers
    /// without a slot were charged against a daily/monthly budget.
    #[serde(default = "default_sketch_width")]
    pub sketch_width: u32,
    /// A budget slot untouched this long may go to another caller (its
    /// charges stay in the sketch); touched more recently, it is active and
    /// never taken.
    #[serde(
        default = "default_slot_hold",
        deserialize_with = "de_duration",
        rename = "slot_hold"
    )]
    pub slot_hold_ms: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            principal_slots: default_slots(),
            cas_max_retries: default_cas_retries(),
            sketch_width: default_sketch_width(),
            slot_hold_ms: default_slot_hold(),
        }
    }
}

fn default_sketch_width() -> u32 {
    2048
}
fn default_slot_hold() -> u64 {
    60_000
}

fn default_slots() -> u32 {
    4096
}
fn default_cas_retries() -> u32 {
    64
}

/// A token bucket: refills at `rate`, holds at most `burst` (default: the
/// rate's amount). Written `10/min` or `{rate: 10/min, burst: 15}`. With a
/// `window`, a fixed window instead: `burst` units per calendar window,
/// all back at the window's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub rate: Rate,
    pub burst: u64,
    pub window: Option<Window>,
}

/// Calendar windows, in the policy's `budgets.reset_timezone` (UTC by
/// default): each carries its zone, so a bucket's window is self-contained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Day(Zone),
    Month(Zone),
}

impl Limit {
    pub fn capacity(&self) -> u64 {
        self.burst
    }

    /// A fixed window of `amount` per `window`.
    pub fn windowed(amount: u64, window: Window) -> Limit {
        let period_ms = match window {
            Window::Day(_) => 86_400_000,
            Window::Month(_) => 30 * 86_400_000,
        };
        Limit {
            rate: Rate { amount, period_ms },
            burst: amount,
            window: Some(window),
        }
    }

    /// As written in a policy: `10/min`, `5000 per day (UTC)`.
    pub fn describe(&self) -> String {
        match self.window {
            None => self.rate.to_string(),
            Some(Window::Day(z)) => format!("{} per day ({})", self.burst, z.name()),
            Some(Window::Month(z)) => format!("{} per month ({})", self.burst, z.name()),
        }
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BudgetVisitor;

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            limit: serde_json::Value,
            #[serde(default)]
            mode: Mode,
            alert_at: Option<serde_json::Value>,
        }

        fn amount<E: de::Error>(v: &serde_json::Value) -> Result<f64, E> {
            match v {
                serde_json::Value::Number(n) => n.as_f64().ok_or_else(|| E::custom("not a number")),
                serde_json::Value::String(s) => {
                    let cleaned: String = s
                        .trim()
                        .trim_end_matches("tokens")
                        .trim_end_matches("token")
                        .chars()
                        .filter(|c| *c != ',' && *c != '_')
                        .collect();
                    cleaned
                        .trim()
                        .parse::<f64>()
                        .map_err(|_| E::custom(format!("`{s}` is not an amount")))
                }
                _ => Err(E::custom("expected an amount like `5000` or `12.50`")),
            }
            .and_then(|a| {
                if a.is_finite() && a > 0.0 {
                    Ok(a)
                } else {
                    Err(E::custom("the limit must be greater than zero"))
                }
            })
        }

        fn percent<E: de::Error>(v: &serde_json::Value) -> Result<u32, E> {
            // A bare number above 1 is read as a percentage (`alert_at: 80`).
            let v = match v.as_f64() {
                Some(f) if f > 1.0 => serde_json::json!(f / 100.0),
                _ => v.clone(),
            };
            crate::policy::units::parse_permille(&v)
                .ok_or_else(|| E::custom("alert_at must be a percentage like `80%` (or 0.8)"))
        }

        impl<'de> Visitor<'de> for BudgetVisitor {
            type Value = Budget;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "an amount like `5000` or a map `{limit: 5000, mode: soft, alert_at: 80%}`",
                )
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Budget, E> {
                self.visit_f64(v as f64)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Budget, E> {
                self.visit_f64(v as f64)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Budget, E> {
                let limit = amount(&serde_json::json!(v))?;
                Ok(Budget {
                    limit,
                    mode: Mode::Hard,
                    alert_at_permille: None,
                })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Budget, E> {
                let limit = amount(&serde_json::Value::String(v.into()))?;
                Ok(Budget {
                    limit,
                    mode: Mode::Hard,
                    alert_at_permille: None,
                })
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Budget, A::Error> {
                let full = Full::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Budget {
                    limit: amount(&full.limit)?,
                    mode: full.mode,
                    alert_at_permille: full.alert_at.as_ref().map(percent).transpose()?,
                })
            }
        }

        deserializer.deserialize_any(BudgetVisitor)
    }
}

/// Unit words a rate may name (`5000 tokens/min`).
const UNITS: &[&str] = &["requests", "request", "tokens", "token"];

/// The longest period of a token bucket: longer ones are calendar budgets
/// (`daily_tokens`, `monthly_tokens`).
pub const MAX_PERIOD_MS: u64 = 366 * 86_400_000;

/// A token bucket's rate: what the bucket math can divide by and count.
/// `0/min` would be a bucket that never refills (and once trapped the VM
/// dividing by it); an amount beyond [`MAX_UNITS`] cannot be counted.
fn bucket_rate(text: &str) -> Result<Rate, String> {
    let rate = parse_rate(text, UNITS)?;
    if rate.amount == 0 {
        return Err(format!(
            "`{text}`: the amount must be at least 1 (a rate of zero admits nothing; \
             remove the model or tier instead)"
        ));
    }
    if rate.amount > MAX_UNITS {
        return Err(format!(
            "`{text}`: the amount is too large (at most {MAX_UNITS})"
        ));
    }
    if rate.period_ms > MAX_PERIOD_MS {
        return Err(format!(
            "`{text}`: the period is longer than 366 days; use daily_tokens or monthly_tokens for calendar budgets"
        ));
    }
    Ok(rate)
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LimitVisitor;

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            rate: String,
            burst: Option<u64>,
        }

        impl<'de> Visitor<'de> for LimitVisitor {
            type Value = Limit;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a rate like `10/min` or a map `{rate: 10/min, burst: 15}`")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Limit, E> {
                let rate = bucket_rate(text).map_err(E::custom)?;
                Ok(Limit {
                    rate,
                    burst: rate.amount,
                    window: None,
                })
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Limit, A::Error> {
                let full = Full::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let rate = bucket_rate(&full.rate).map_err(de::Error::custom)?;
                let burst = full.burst.unwrap_or(rate.amount);
                if burst == 0 {
                    return Err(de::Error::custom("burst must be at least 1"));
                }
                if burst > MAX_UNITS {
                    return Err(de::Error::custom(format!(
                        "burst {burst} is too large (at most {MAX_UNITS})"
                    )));
                }
                Ok(Limit {
                    rate,
                    burst,
                    window: None,
                })
            }
        }

        deserializer.deserialize_any(LimitVisitor)
    }
}

fn de_size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct SizeVisitor;
    impl Visitor<'_> for SizeVisitor {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a size like `1MiB` or a number of bytes")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            parse_size(v).map_err(E::custom)
        }
    }
    deserializer.deserialize_any(SizeVisitor)
}

impl Policy {
    /// Parses the plugin configuration as Envoy delivers it: the protobuf
    /// bytes of a `google.protobuf.Struct` (native YAML in the Envoy config)
    /// or a JSON document (`google.protobuf.StringValue`).
    pub fn from_plugin_config(bytes: &[u8]) -> Result<Policy, ConfigError> {
        let value = match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(value) => value,
            Err(json_err) => match crate::policy::proto_struct::decode(bytes) {
                Some(value) => value,
                None if looks_like_json(bytes) => {
                    return Err(ConfigError::at(".", format!("invalid JSON: {json_err}")))
                }
                None => {
                    return Err(ConfigError::at(
                        ".",
                        "neither a google.protobuf.Struct nor a JSON document",
                    ))
                }
            },
        };
        Policy::from_value(value)
    }

    /// Parses and checks a policy given as a JSON value.
    pub fn from_value(value: serde_json::Value) -> Result<Policy, ConfigError> {
        if !value.is_object() {
            return Err(ConfigError::at(".", "the policy must be a map"));
        }
        let policy: Policy = serde_path_to_error::deserialize(value).map_err(|err| {
            let path = err.path().to_string();
            ConfigError::at(path, err.into_inner().to_string())
        })?;
        policy.check()?;
        let mut policy = policy;
        if let Some(c) = &policy.cache {
            let compiled = c.check().map_err(|e| ConfigError::at(e.path, e.message))?;
            let enabled = !(compiled.models.is_empty() && compiled.routes.is_empty());
            if enabled && policy.sidecar.is_none() {
                return Err(ConfigError::at(
                    "cache",
                    "the cache's entries live in the sidecar: set `sidecar`",
                ));
            }
            policy.cache_compiled = Some(compiled);
        }
        Ok(policy)
    }

    /// Rules that span fields, which serde cannot see.
    fn check(&self) -> Result<(), ConfigError> {
        if let Some(fleet) = &self.fleet {
            fleet
                .check(self)
                .map_err(|(path, why)| ConfigError::at(&path, why))?;
        }
        if !self.tiers.contains_key(&self.default_tier) {
            return Err(ConfigError::at(
                "default_tier",
                format!("tier `{}` is not defined under `tiers`", self.default_tier),
            ));
        }
        let id = &self.identity;
        if id.sources.is_empty() {
            return Err(ConfigError::at(
                "identity.sources",
                "list at least one source",
            ));
        }
        for (i, source) in id.sources.iter().enumerate() {
            let missing = match source {
                IdentitySource::Jwt => id.jwt.is_none().then_some("jwt"),
                IdentitySource::TrustedHeader => {
                    id.trusted_header.is_none().then_some("trusted_header")
                }
                IdentitySource::ApiKey => id.api_key.is_none().then_some("api_key"),
                IdentitySource::ClientAddress => None,
            };
            if let Some(section) = missing {
                return Err(ConfigError::at(
                    format!("identity.sources[{i}]"),
                    format!("`{section}` is listed but `identity.{section}` is not configured"),
                ));
            }
        }
        if let Some(keys) = &id.api_key {
            for (key, entry) in &keys.keys {
                let tier = &entry.tier;
                for (field, name, declared) in [
                    ("team", &entry.team, &self.teams),
                    ("org", &entry.org, &self.orgs),
                ] {
                    if let Some(name) = name.as_ref().filter(|n| !declared.contains_key(*n)) {
                        return Err(ConfigError::at(
                            format!("identity.api_key.keys.{}.{field}", redact_key(key)),
                            format!("{field} `{name}` is not declared under `{field}s`"),
                        ));
                    }
                }
                if !self.tiers.contains_key(tier) {
                    return Err(ConfigError::at(
                        format!("identity.api_key.keys.{}", redact_key(key)),
                        format!("tier `{tier}` is not defined under `tiers`"),
                    ));
                }
                if let Some(hex) = key.strip_prefix("sha256:") {
                    if hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                        return Err(ConfigError::at(
                            format!("identity.api_key.keys.{}", redact_key(key)),
                            "a `sha256:` key needs 64 hex digits",
                        ));
                    }
                }
            }
            if keys.header.trim().is_empty() {
                return Err(ConfigError::at(
                    "identity.api_key.header",
                    "must not be empty",
                ));
            }
        }
        for (i, route) in self.routes.iter().enumerate() {
            if !route.path_prefix.starts_with('/') {
                return Err(ConfigError::at(
                    format!("routes[{i}].path_prefix"),
                    "must start with `/`",
                ));
            }
            if self.routes[..i].iter().any(|r| r.name == route.name) {
                return Err(ConfigError::at(
                    format!("routes[{i}].name"),
                    format!("route name `{}` is used twice", route.name),
                ));
            }
        }
        for (name, what) in self
            .tiers
            .keys()
            .map(|t| (t, "tiers"))
            .chain(self.models.keys().map(|m| (m, "models")))
            .chain(self.routes.iter().map(|r| (&r.name, "routes")))
            .chain(self.teams.keys().map(|t| (t, "teams")))
            .chain(self.orgs.keys().map(|o| (o, "orgs")))
        {
            if name.is_empty() || name.contains(';') || name.contains('=') {
                return Err(ConfigError::at(
                    format!("{what}.{name}"),
                    "names must be non-empty and contain neither `;` nor `=`",
                ));
            }
        }
        for (name, model) in &self.models {
            if let Some(target) = &model.downshift_to {
                if !self.models.contains_key(target) || target == name {
                    return Err(ConfigError::at(
                        format!("models.{name}.downshift_to"),
                        format!("`{target}` must be another model listed under `models`"),
                    ));
                }
            }
            if model
                .max_output
                .is_some_and(|m| m == 0 || m > self.request.max_output)
            {
                return Err(ConfigError::at(
                    format!("models.{name}.max_output"),
                    format!(
                        "must be between 1 and request.max_output ({})",
                        self.request.max_output
                    ),
                ));
            }
            let cap = model.max_output.unwrap_or(self.request.max_output);
            if model.default_max_output.is_some_and(|d| d > cap) {
                return Err(ConfigError::at(
                    format!("models.{name}.default_max_output"),
                    format!("must not be above the model's output cap ({cap})"),
                ));
            }
            if model.default_max_output == Some(0) {
                return Err(ConfigError::at(
                    format!("models.{name}.default_max_output"),
                    "must be at least 1",
                ));
            }
            if let Some(p) = model.price {
                if !(p.input_per_1k >= 0.0 && p.output_per_1k >= 0.0) {
                    return Err(ConfigError::at(
                        format!("models.{name}.price"),
                        "prices must not be negative",
                    ));
                }
            }
            if let Some(g) = model.gpu {
                if !(g.cost_per_hour >= 0.0 && g.tokens_per_second > 0.0) {
                    return Err(ConfigError::at(
                        format!("models.{name}.gpu"),
                        "cost_per_hour must not be negative and tokens_per_second must be positive",
                    ));
                }
            }
        }
        for (name, t) in self
            .teams
            .iter()
            .map(|(n, t)| (format!("teams.{n}"), t))
            .chain(self.orgs.iter().map(|(n, t)| (format!("orgs.{n}"), t)))
        {
            if t.anonymous_total.is_some() {
                return Err(ConfigError::at(
                    format!("{name}.anonymous_total"),
                    "only tiers have an anonymous total (a team or org limit already counts all its members together)",
                ));
            }
        }
        let levels = self
            .tiers
            .iter()
            .map(|(n, t)| (format!("tiers.{n}"), t))
            .chain(self.teams.iter().map(|(n, t)| (format!("teams.{n}"), t)))
            .chain(self.orgs.iter().map(|(n, t)| (format!("orgs.{n}"), t)));
        for (level, t) in levels {
            let total = t.anonymous_total.as_deref();
            if total.is_some_and(|a| a.anonymous_total.is_some()) {
                return Err(ConfigError::at(
                    format!("{level}.anonymous_total.anonymous_total"),
                    "an anonymous total has no anonymous total of its own",
                ));
            }
            for (prefix, limits) in [(level.clone(), Some(t))]
                .into_iter()
                .chain(total.map(|a| (format!("{level}.anonymous_total"), Some(a))))
            {
                let Some(limits) = limits else { continue };
                for (field, budget) in [
                    ("daily_tokens", limits.daily_tokens),
                    ("monthly_tokens", limits.monthly_tokens),
                ] {
                    let Some(b) = budget else { continue };
                    if b.limit.fract() != 0.0 {
                        return Err(ConfigError::at(
                            format!("{prefix}.{field}.limit"),
                            "a token budget is a whole number",
                        ));
                    }
                    if b.limit > MAX_UNITS as f64 {
                        return Err(ConfigError::at(
                            format!("{prefix}.{field}.limit"),
                            format!("too large (at most {MAX_UNITS} tokens)"),
                        ));
                    }
                }
                // Spend is counted in millionths of the currency.
                let max_spend = (MAX_UNITS / SCALE) as f64;
                for (field, budget) in [
                    ("daily_spend", limits.daily_spend),
                    ("monthly_spend", limits.monthly_spend),
                ] {
                    if budget.is_some_and(|b| b.limit > max_spend) {
                        return Err(ConfigError::at(
                            format!("{prefix}.{field}.limit"),
                            format!("too large (at most {max_spend})"),
                        ));
                    }
                }
            }
        }
        if let Some(sc) = &self.sidecar {
            if sc.cluster.trim().is_empty() {
                return Err(ConfigError::at(
                    "sidecar.cluster",
                    "must name an Envoy cluster",
                ));
            }
            // A quiet sidecar answers a poll once a second at the most:
            // a shorter window would call a healthy sidecar stale.
            if sc.stale_after_ms < 2_000 {
                return Err(ConfigError::at(
                    "sidecar.stale_after",
                    "must be at least 2s (the long poll is held up to half of it, 1s at least)",
                ));
            }
        }
        if let Some(f) = &self.fallback {
            if f.header.is_empty() || f.header.chars().any(|c| c.is_ascii_uppercase() || c == ':') {
                return Err(ConfigError::at(
                    "fallback.header",
                    "must be a lower-case header name",
                ));
            }
        }
        let pr = &self.protection;
        if pr.failures_to_open == 0 || pr.backoff == 0 {
            return Err(ConfigError::at(
                "protection",
                "failures_to_open and backoff must be at least 1",
            ));
        }
        if pr.min_callers == 0 || pr.min_callers as usize > crate::policy::health::MAX_CALLERS {
            return Err(ConfigError::at(
                "protection.min_callers",
                format!(
                    "must be between 1 and {}",
                    crate::policy::health::MAX_CALLERS
                ),
            ));
        }
        if pr.failure_window_ms == 0 {
            return Err(ConfigError::at(
                "protection.failure_window",
                "must be longer than 0s",
            ));
        }
        if pr.credential_slots == 0 || pr.credential_slots > 1 << 16 {
            return Err(ConfigError::at(
                "protection.credential_slots",
                "must be between 1 and 65536",
            ));
        }
        if pr.unlisted_slots == 0 || pr.unlisted_slots > 4096 {
            return Err(ConfigError::at(
                "protection.unlisted_slots",
                "must be between 1 and 4096",
            ));
        }
        if let Some(i) = pr.credential_headers.iter().position(|h| {
            h.is_empty() || h.starts_with(':') || h.chars().any(|c| c.is_ascii_uppercase())
        }) {
            return Err(ConfigError::at(
                format!("protection.credential_headers[{i}]"),
                "must be a lower-case header name",
            ));
        }
        if let Some(abuse) = &self.abuse {
            abuse.check(self)?;
        }
        if let Some(a) = &self.anomaly {
            if a.surge_ratio.is_nan()
                || a.surge_ratio <= 1.0
                || a.baseline_minutes == 0
                || a.baseline_minutes > 59
            {
                return Err(ConfigError::at(
                    "anomaly",
                    "surge_ratio must be above 1 and baseline_minutes between 1 and 59",
                ));
            }
        }
        if self.request.max_output == 0 || self.request.max_output > MAX_OUTPUT_CAP {
            return Err(ConfigError::at(
                "request.max_output",
                format!("must be between 1 and {MAX_OUTPUT_CAP}"),
            ));
        }
        if self.defaults.max_output_tokens > self.request.max_output {
            return Err(ConfigError::at(
                "defaults.max_output_tokens",
                "must not be above request.max_output",
            ));
        }
        if self.defaults.max_output_tokens == 0 {
            return Err(ConfigError::at(
                "defaults.max_output_tokens",
                "must be at least 1",
            ));
        }
        if self.state.principal_slots == 0 || self.state.principal_slots > 1 << 20 {
            return Err(ConfigError::at(
                "state.principal_slots",
                "must be between 1 and 1048576",
            ));
        }
        if !(64..=1 << 20).contains(&self.state.sketch_width) {
            return Err(ConfigError::at(
                "state.sketch_width",
                "must be between 64 and 1048576",
            ));
        }
        if self.state.slot_hold_ms < 1_000 {
            return Err(ConfigError::at("state.slot_hold", "must be at least 1s"));
        }
        if self.state.cas_max_retries == 0 {
            return Err(ConfigError::at(
                "state.cas_max_retries",
                "must be at least 1",
            ));
        }
        crate::policy::shares::check(self)?;
        crate::policy::queue::check(self)
    }
}

fn looks_like_json(bytes: &[u8]) -> bool {
    matches!(
        bytes.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{') | Some(b'[')
    )
}

/// Names a configured key in an error without printing the key itself.
pub(crate) fn redact_key(key: &str) -> String {
    if key.starts_with("sha256:") {
        key.chars().take(15).collect::<String>() + "…"
    } else {
        format!("<key of {} chars>", key.chars().count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn minimal() -> serde_json::Value {
        json!({"default_tier": "free", "tiers": {"free": {"requests": "10/min"}}})
    }

    #[test]
    fn minimal_policy_loads_with_defaults() {
        let p = Policy::from_value(minimal()).unwrap();
        assert_eq!(p.tiers["free"].requests.unwrap().capacity(), 10);
        assert_eq!(p.request.max_body_bytes, 1 << 20);
        assert_eq!(p.identity.sources, vec![IdentitySource::ClientAddress]);
    }

    #[test]
    fn protection_defaults_and_bad_values_name_the_field() {
        let p = Policy::from_value(minimal()).unwrap().protection;
        assert_eq!((p.min_callers, p.max_pause_ms), (2, 300_000));
        assert_eq!(p.credentials, Credentials::PassThrough);
        assert_eq!((p.credential_slots, p.unlisted_slots), (4096, 64));
        for (field, value) in [
            ("min_callers", json!(0)),
            ("min_callers", json!(9)),
            ("credential_slots", json!(0)),
            ("unlisted_slots", json!(5000)),
            ("failure_window", json!("0s")),
            ("credential_headers", json!(["Authorization"])),
        ] {
            let mut v = minimal();
            v["protection"] = json!({ field: value });
            let err = Policy::from_value(v).unwrap_err();
            assert!(
                err.path.starts_with(&format!("protection.{field}")),
                "{err}"
            );
        }
        let mut v = minimal();
        v["protection"] = json!({"credentials": "shared"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "protection.credentials"
        );
        let mut v = minimal();
        v["models"] = json!({"m": {"credentials": "injected"}});
        let p = Policy::from_value(v).unwrap();
        assert_eq!(p.models["m"].credentials, Some(Credentials::Injected));
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let mut v = minimal();
        v["tiers"]["free"]["requets"] = json!("5/min");
        let err = Policy::from_value(v).unwrap_err();
        assert_eq!(err.path, "tiers.free.requets");
        assert!(err.message.contains("unknown field `requets`"), "{err}");
        assert!(err.to_string().contains("tiers.free.requets"));
    }

    #[test]
    fn bad_rate_is_named_with_its_path() {
        let mut v = minimal();
        v["tiers"]["free"]["requests"] = json!("10/fortnight");
        let err = Policy::from_value(v).unwrap_err();
        assert_eq!(err.path, "tiers.free.requests");
        assert!(err.message.contains("fortnight"));
    }

    #[test]
    fn zero_and_absurd_rates_are_refused_with_their_path() {
        let cases = [
            (
                json!({"tiers": {"free": {"requests": "0/min"}}}),
                "tiers.free.requests",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "tokens": "0 tokens/day"}}}),
                "tiers.free.tokens",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": {"rate": "0/s", "burst": 5}}}}),
                "tiers.free.requests",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": {"rate": "5/s", "burst": 0}}}}),
                "tiers.free.requests",
                "burst",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "output_tokens": "18446744073709551615/min"}}}),
                "tiers.free.output_tokens",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": {"rate": "1/s", "burst": 18446744073709551615u64}}}}),
                "tiers.free.requests",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": "1/400d"}}}),
                "tiers.free.requests",
                "366 days",
            ),
            (
                json!({"tiers": {"free": {"requests": "1/0ms"}}}),
                "tiers.free.requests",
                "longer than zero",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "daily_tokens": 0}}}),
                "tiers.free.daily_tokens",
                "greater than zero",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "daily_tokens": 1e30}}}),
                "tiers.free.daily_tokens.limit",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min", "daily_spend": 1e12}}}),
                "tiers.free.daily_spend.limit",
                "too large",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min"}}, "models": {"m": {"requests": "0/min"}}}),
                "models.m.requests",
                "at least 1",
            ),
            (
                json!({"tiers": {"free": {"requests": "10/min"}}, "routes": [{"name": "r", "path_prefix": "/v1", "requests": "0/s"}]}),
                "routes[0].requests",
                "at least 1",
            ),
        ];
        for (mut v, path, says) in cases {
            v["default_tier"] = json!("free");
            let err = Policy::from_value(v.clone()).unwrap_err();
            assert_eq!(err.path, path, "{v}: {err:?}");
            assert!(err.message.contains(says), "{v}: {err:?}");
        }
        // The largest countable amount still loads.
        let mut v = minimal();
        v["tiers"]["free"]["tokens"] = json!(format!("{MAX_UNITS} tokens/day"));
        assert!(Policy::from_value(v).is_ok());
    }

    #[test]
    fn limit_in_long_form_with_burst() {
        let mut v = minimal();
        v["tiers"]["free"]["requests"] = json!({"rate": "10/min", "burst": 15});
        let p = Policy::from_value(v).unwrap();
        let limit = p.tiers["free"].requests.unwrap();
        assert_eq!((limit.rate.amount, limit.burst), (10, 15));
        let mut v = minimal();
        v["tiers"]["free"]["requests"] = json!({"rate": "10/min", "brust": 15});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.requests.brust"
        );
    }

    #[test]
    fn cross_field_rules() {
        let mut v = minimal();
        v["default_tier"] = json!("gold");
        assert_eq!(Policy::from_value(v).unwrap_err().path, "default_tier");

        let mut v = minimal();
        v["identity"] = json!({"sources": ["api_key"]});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "identity.sources[0]"
        );

        let mut v = minimal();
        v["identity"] = json!({"sources": ["api_key"],
            "api_key": {"keys": {"secret-123": "gold"}}});
        let err = Policy::from_value(v).unwrap_err();
        assert!(err.path.starts_with("identity.api_key.keys."));
        assert!(!err.to_string().contains("secret-123"), "never echo a key");

        let mut v = minimal();
        v["sidecar"] = json!({"cluster": "sc", "stale_after": "1500ms"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "sidecar.stale_after"
        );
        let mut v = minimal();
        v["sidecar"] = json!({"cluster": "sc", "stale_after": "2s"});
        assert_eq!(
            Policy::from_value(v)
                .unwrap()
                .sidecar
                .unwrap()
                .stale_after_ms,
            2_000
        );
    }

    #[test]
    fn slot_settings_and_anonymous_totals_are_checked() {
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] =
            json!({"requests": "600/min", "daily_tokens": 100_000});
        let p = Policy::from_value(v).unwrap();
        let total = p.tiers["free"].anonymous_total.as_deref().unwrap();
        assert_eq!(total.requests.unwrap().capacity(), 600);
        assert_eq!((p.state.sketch_width, p.state.slot_hold_ms), (2048, 60_000));
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] = json!({"reqests": "600/min"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.anonymous_total.reqests"
        );
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] = json!({"anonymous_total": {}});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.anonymous_total.anonymous_total"
        );
        let mut v = minimal();
        v["tiers"]["free"]["anonymous_total"] = json!({"daily_tokens": 10.5});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.anonymous_total.daily_tokens.limit"
        );
        for (field, value) in [("sketch_width", json!(8)), ("slot_hold", json!("10ms"))] {
            let mut v = minimal();
            v["state"] = json!({ field: value });
            assert_eq!(
                Policy::from_value(v).unwrap_err().path,
                format!("state.{field}")
            );
        }
    }

    #[test]
    fn token_budgets_and_models() {
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!(5000);
        v["tiers"]["free"]["monthly_tokens"] = json!("1,000,000 tokens");
        v["tiers"]["free"]["daily_spend"] =
            json!({"limit": 2.5, "mode": "soft", "alert_at": "80%"});
        v["tiers"]["free"]["tokens"] = json!("20000 tokens/min");
        v["models"] = json!({"big": {"downshift_to": "small", "price": {"input_per_1k": 0.5, "output_per_1k": 1.5}},
                             "small": {"gpu": {"cost_per_hour": 4.0, "tokens_per_second": 2000}}});
        let p = Policy::from_value(v).unwrap();
        let free = &p.tiers["free"];
        assert_eq!(free.daily_tokens.unwrap().limit, 5000.0);
        assert_eq!(free.monthly_tokens.unwrap().limit, 1_000_000.0);
        let spend = free.daily_spend.unwrap();
        assert_eq!(
            (spend.limit, spend.mode, spend.alert_at_permille),
            (2.5, Mode::Soft, Some(800))
        );
        assert_eq!(free.tokens.unwrap().capacity(), 20_000);

        let mut v = minimal();
        v["models"] = json!({"big": {"downshift_to": "nowhere"}});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "models.big.downshift_to"
        );
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!({"limit": 10, "mode": "sometimes"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.daily_tokens.mode"
        );
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!({"limit": 10, "alert_at": "180%"});
        assert_eq!(
            Policy::from_value(v).unwrap_err().path,
            "tiers.free.daily_tokens"
        );
        let mut v = minimal();
        v["tiers"]["free"]["daily_tokens"] = json!(-3);
        assert!(Policy::from_value(v).is_err());
    }

    #[test]
    fn sizes_and_numbers() {
        let mut v = minimal();
        v["request"] = json!({"max_body_bytes": "64KiB"});
        assert_eq!(Policy::from_value(v).unwrap().request.max_body_bytes, 65536);
        let mut v = minimal();
        v["request"] = json!({"max_body_bytes": 1000});
        assert_eq!(Policy::from_value(v).unwrap().request.max_body_bytes, 1000);
    }

    #[test]
    fn json_string_form() {
        let bytes = serde_json::to_vec(&minimal()).unwrap();
        assert!(Policy::from_plugin_config(&bytes).is_ok());
        let err = Policy::from_plugin_config(b"{\"default_tier\": ").unwrap_err();
        assert!(err.message.contains("invalid JSON"));
    }
}
