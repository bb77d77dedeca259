//! The `cache:` section of the policy: which models (or routes) are cached
//! and how, whose answers an entry may serve (`scope`), how long, and what
//! a hit costs. Compiled once by [`CacheConfig::check`] into a
//! [`CachePolicy`]; every error names its field path (`cache.models.m.ttl`).
//!
//! Bounds on memory (`max_entries`, `max_bytes`) belong to the sidecar's
//! own `cache:` section, where the entries live; the policy bounds what one
//! entry may be (`max_entry_bytes`), since the filter buffers it.

use std::collections::BTreeMap;

use serde::Deserialize;

/// Whose answers an entry may serve. Every key includes the scope's value,
/// so two callers share an entry only if this says they may.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheScope {
    /// One caller (API key, JWT subject, address): the default.
    #[default]
    Principal,
    Team,
    Org,
    Tier,
    /// Everyone: only when written (check-config says what it shares).
    Global,
}

/// Who a request is, as far as the scopes need it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheCaller<'a> {
    /// The principal's identity (already hashed or raw: it only enters
    /// the salted key).
    pub principal: &'a str,
    pub team: Option<&'a str>,
    pub org: Option<&'a str>,
    pub tier: &'a str,
}

impl CacheScope {
    /// The scope value entering the key. A caller without the team (or
    /// org) the scope asks for is scoped to itself: narrower, never wider.
    pub fn value(self, c: &CacheCaller<'_>) -> String {
        match (self, c.team, c.org) {
            (CacheScope::Team, Some(t), _) => format!("team:{t}"),
            (CacheScope::Org, _, Some(o)) => format!("org:{o}"),
            (CacheScope::Tier, _, _) => format!("tier:{}", c.tier),
            (CacheScope::Global, _, _) => "global".into(),
            _ => format!("principal:{}", c.principal),
        }
    }
}

/// One model's (or route's) switches; unset fields take the section's.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    #[serde(default)]
    pub exact: bool,
    #[serde(default)]
    pub semantic: bool,
    pub scope: Option<CacheScope>,
    pub ttl: Option<String>,
    pub max_temperature: Option<f64>,
    pub threshold: Option<f64>,
    pub top_k: Option<u32>,
}

/// What a hit takes from the caller's buckets. A hit always counts as a
/// request (request rates hold for hits: a cache is no way around them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HitCost {
    /// Also reserve and charge the stored answer's tokens, and so their
    /// spend (then a caller over its token or spend budget gets no cached
    /// answer either). Default false: a hit costs 0 tokens, 0 spend.
    pub tokens: bool,
}

/// The exact cache's tier inside Envoy (`cache.in_envoy`): single-Envoy
/// mode keeps exact entries in Envoy's shared data, so an exact lookup or
/// store needs no callout (`cache::tier`). `slots: 0` turns it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InEnvoyConfig {
    /// Entries at most (rounded up to sets of 4).
    pub slots: u32,
    /// Larger answers are kept by the sidecar (bytes).
    pub max_entry_bytes: u64,
}

impl Default for InEnvoyConfig {
    fn default() -> Self {
        // 32 MiB at most; a chat answer is a few KiB, a larger one is
        // kept by the sidecar.
        InEnvoyConfig {
            slots: 2048,
            max_entry_bytes: 16 << 10,
        }
    }
}

/// Slots per set of the tier in Envoy.
pub const IN_ENVOY_WAYS: u32 = 4;
/// Bytes an entry of the tier takes beyond its answer (key, generation,
/// times, usage), and one slot's share of its set's index record.
pub const IN_ENVOY_ENTRY_HEADER: u64 = 32 + 8 * 6;
pub const IN_ENVOY_WAY_BYTES: u64 = 16 + 8 * 3 + 1;

impl InEnvoyConfig {
    /// Slots, rounded up to whole sets.
    pub fn slots_used(&self) -> u64 {
        u64::from(self.slots.div_ceil(IN_ENVOY_WAYS) * IN_ENVOY_WAYS)
    }

    /// The most bytes its values take in Envoy's shared data.
    pub fn memory_bound(&self) -> u64 {
        let slots = self.slots_used();
        slots.saturating_mul(self.max_entry_bytes + IN_ENVOY_ENTRY_HEADER + IN_ENVOY_WAY_BYTES)
    }
}

/// The most slots the tier in Envoy may have.
pub const MAX_IN_ENVOY_SLOTS: u32 = 1 << 16;
/// The largest answer the tier in Envoy keeps.
pub const MAX_IN_ENVOY_ENTRY_BYTES: u64 = 1 << 20;
/// The most memory the tier in Envoy may take (its key set is never freed).
pub const MAX_IN_ENVOY_BYTES: u64 = 1 << 30;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Per model name.
    pub models: BTreeMap<String, RuleConfig>,
    /// Per route name (used when the model has no rule of its own).
    pub routes: BTreeMap<String, RuleConfig>,
    pub scope: CacheScope,
    /// Default `24h`.
    pub ttl: String,
    /// Only requests with `temperature` at most this are cached; absent:
    /// any. A request without `temperature` has its API's default (1.0
    /// OpenAI, 0.8 Ollama).
    pub max_temperature: Option<f64>,
    /// Larger answers are not stored (the filter buffers them). Bytes.
    pub max_entry_bytes: u64,
    /// Semantic: cosine similarity at least this (default 0.95) …
    pub threshold: f64,
    /// … among this many nearest (default 5).
    pub top_k: u32,
    pub hit_cost: HitCost,
    /// How long the filter waits for the sidecar's lookup before calling
    /// it a miss. Default `100ms`.
    pub lookup_timeout: String,
    /// Mixed into every key: without it nobody can compute the key of a
    /// caller's question. Set your own.
    pub salt: String,
    /// The exact tier in Envoy (single-Envoy mode only; fleet mode keeps
    /// every entry in Redis, so each Envoy's answer is every Envoy's).
    pub in_envoy: InEnvoyConfig,
    /// The environment variable (of Envoy's wasm VM:
    /// `vm_config.environment_variables`) holding the secret the
    /// sidecar's cache endpoints require (`x-sluice-cache-secret`; the
    /// sidecar's `cache.secret_file`). Fleet mode sends the fleet secret.
    pub secret_env: Option<String>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            models: BTreeMap::new(),
            routes: BTreeMap::new(),
            scope: CacheScope::Principal,
            ttl: "24h".into(),
            max_temperature: None,
            max_entry_bytes: 1 << 20,
            threshold: 0.95,
            top_k: 5,
            hit_cost: HitCost::default(),
            lookup_timeout: "100ms".into(),
            salt: String::new(),
            in_envoy: InEnvoyConfig::default(),
            secret_env: None,
        }
    }
}

/// A field path and what is wrong there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct CacheConfigError {
    pub path: String,
    pub message: String,
}

fn err(path: impl Into<String>, message: impl Into<String>) -> CacheConfigError {
    CacheConfigError {
        path: path.into(),
        message: message.into(),
    }
}

/// One model's (or route's) compiled rule.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheRule {
    pub exact: bool,
    pub semantic: bool,
    pub scope: CacheScope,
    pub ttl_s: u64,
    pub max_temperature: Option<f64>,
    pub threshold: f32,
    pub top_k: u32,
}

/// The compiled section.
#[derive(Debug, Clone, PartialEq)]
pub struct CachePolicy {
    pub models: BTreeMap<String, CacheRule>,
    pub routes: BTreeMap<String, CacheRule>,
    pub max_entry_bytes: u64,
    pub hit_cost: HitCost,
    pub lookup_timeout_ms: u64,
    pub salt: String,
    /// `None`: off (`slots: 0`).
    pub in_envoy: Option<InEnvoyConfig>,
    pub secret_env: Option<String>,
}

/// Longest TTL a policy may ask for (the sidecar caps it again).
pub const MAX_TTL_S: u64 = 30 * 86_400;
pub const MAX_ENTRY_BYTES: u64 = 16 << 20;
pub const MAX_TOP_K: u32 = 100;
pub const MAX_LOOKUP_TIMEOUT_MS: u64 = 2_000;

/// The shortest salt not warned of: 16 bytes (128 bits) if random.
const MIN_SALT_BYTES: usize = 16;

/// A salt that is short or a placeholder copied from an example
/// ("…-change-me"): public in effect.
fn public_salt(salt: &str) -> bool {
    let lower = salt.to_ascii_lowercase();
    salt.len() < MIN_SALT_BYTES
        || [
            "change-me",
            "changeme",
            "change_me",
            "example",
            "placeholder",
        ]
        .iter()
        .any(|p| lower.contains(p))
}

fn duration_ms(text: &str) -> Result<u64, String> {
    crate::policy::units::parse_duration(text)
}

fn ttl_s(text: &str, path: &str) -> Result<u64, CacheConfigError> {
    let ms = duration_ms(text).map_err(|m| err(path, m))?;
    let s = ms / 1000;
    if s == 0 || s > MAX_TTL_S {
        return Err(err(
            path,
            format!("must be between 1s and 30d, not `{text}`"),
        ));
    }
    Ok(s)
}

fn temperature(t: Option<f64>, path: &str) -> Result<Option<f64>, CacheConfigError> {
    match t {
        Some(t) if !t.is_finite() || t < 0.0 => {
            Err(err(path, format!("must be a number ≥ 0, not {t}")))
        }
        other => Ok(other),
    }
}

impl CacheConfig {
    /// Compiles the section; the first problem found, with its path.
    pub fn check(&self) -> Result<CachePolicy, CacheConfigError> {
        let ttl = ttl_s(&self.ttl, "cache.ttl")?;
        let max_t = temperature(self.max_temperature, "cache.max_temperature")?;
        if !(self.threshold > 0.0 && self.threshold <= 1.0) {
            return Err(err(
                "cache.threshold",
                format!("a cosine similarity in (0, 1], not {}", self.threshold),
            ));
        }
        if self.top_k == 0 || self.top_k > MAX_TOP_K {
            return Err(err(
                "cache.top_k",
                format!("between 1 and {MAX_TOP_K}, not {}", self.top_k),
            ));
        }
        if self.max_entry_bytes == 0 || self.max_entry_bytes > MAX_ENTRY_BYTES {
            return Err(err(
                "cache.max_entry_bytes",
                format!(
                    "between 1 and {MAX_ENTRY_BYTES}, not {}",
                    self.max_entry_bytes
                ),
            ));
        }
        let lookup_timeout_ms =
            duration_ms(&self.lookup_timeout).map_err(|m| err("cache.lookup_timeout", m))?;
        if lookup_timeout_ms == 0 || lookup_timeout_ms > MAX_LOOKUP_TIMEOUT_MS {
            return Err(err(
                "cache.lookup_timeout",
                format!("between 1ms and {MAX_LOOKUP_TIMEOUT_MS}ms (a slow cache is a miss, never a wait)"),
            ));
        }
        let in_envoy = self.in_envoy_checked()?;
        if self.secret_env.as_deref().is_some_and(|n| {
            n.is_empty() || !n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        }) {
            return Err(err(
                "cache.secret_env",
                "an environment variable's name (letters, digits, `_`)",
            ));
        }
        let mut models = BTreeMap::new();
        for (name, r) in &self.models {
            models.insert(
                name.clone(),
                self.rule(&format!("cache.models.{name}"), r, ttl, max_t)?,
            );
        }
        let mut routes = BTreeMap::new();
        for (name, r) in &self.routes {
            routes.insert(
                name.clone(),
                self.rule(&format!("cache.routes.{name}"), r, ttl, max_t)?,
            );
        }
        Ok(CachePolicy {
            models,
            routes,
            max_entry_bytes: self.max_entry_bytes,
            hit_cost: self.hit_cost,
            lookup_timeout_ms,
            salt: self.salt.clone(),
            in_envoy,
            secret_env: self.secret_env.clone(),
        })
    }

    /// One entry of `models` or `routes` at path `at`, its unset fields
    /// taken from the section's (`ttl`, `max_t` already checked).
    fn rule(
        &self,
        at: &str,
        r: &RuleConfig,
        ttl: u64,
        max_t: Option<f64>,
    ) -> Result<CacheRule, CacheConfigError> {
        let threshold = r.threshold.unwrap_or(self.threshold);
        if !(threshold > 0.0 && threshold <= 1.0) {
            return Err(err(
                format!("{at}.threshold"),
                format!("a cosine similarity in (0, 1], not {threshold}"),
            ));
        }
        let top_k = r.top_k.unwrap_or(self.top_k);
        if top_k == 0 || top_k > MAX_TOP_K {
            return Err(err(
                format!("{at}.top_k"),
                format!("between 1 and {MAX_TOP_K}"),
            ));
        }
        if !r.exact && !r.semantic {
            return Err(err(
                at,
                "neither `exact` nor `semantic` is on: remove the entry or turn one on",
            ));
        }
        Ok(CacheRule {
            exact: r.exact,
            semantic: r.semantic,
            scope: r.scope.unwrap_or(self.scope),
            ttl_s: match &r.ttl {
                Some(t) => ttl_s(t, &format!("{at}.ttl"))?,
                None => ttl,
            },
            max_temperature: temperature(r.max_temperature, &format!("{at}.max_temperature"))?
                .or(max_t),
            // In (0, 1]: exact enough as f32 for a cosine.
            threshold: threshold as f32,
            top_k,
        })
    }

    fn in_envoy_checked(&self) -> Result<Option<InEnvoyConfig>, CacheConfigError> {
        let t = self.in_envoy;
        if t.slots == 0 {
            return Ok(None);
        }
        if t.slots > MAX_IN_ENVOY_SLOTS {
            return Err(err(
                "cache.in_envoy.slots",
                format!(
                    "at most {MAX_IN_ENVOY_SLOTS} (0 turns the tier off), not {}",
                    t.slots
                ),
            ));
        }
        let most = self.max_entry_bytes.min(MAX_IN_ENVOY_ENTRY_BYTES);
        if t.max_entry_bytes == 0 || t.max_entry_bytes > most {
            return Err(err(
                "cache.in_envoy.max_entry_bytes",
                format!(
                    "between 1 and {most} (cache.max_entry_bytes, at most 1 MiB), not {}",
                    t.max_entry_bytes
                ),
            ));
        }
        if t.memory_bound() > MAX_IN_ENVOY_BYTES {
            return Err(err(
                "cache.in_envoy",
                format!(
                    "slots × (max_entry_bytes + {}) is {} bytes, over the {} MiB the tier may \
                     take of Envoy's memory (shared data is never freed): fewer slots or a \
                     smaller max_entry_bytes",
                    IN_ENVOY_ENTRY_HEADER + IN_ENVOY_WAY_BYTES,
                    t.memory_bound(),
                    MAX_IN_ENVOY_BYTES >> 20
                ),
            ));
        }
        Ok(Some(t))
    }
}

impl CachePolicy {
    /// The rule for a request: its model's, else its route's, else none
    /// (not cached: no lookup, no store, no sidecar call).
    pub fn rule(&self, model: &str, route: Option<&str>) -> Option<&CacheRule> {
        self.models
            .get(model)
            .or_else(|| route.and_then(|r| self.routes.get(r)))
    }

    /// What check-config should say about the section beyond "valid".
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let rules = self
            .models
            .iter()
            .map(|(n, r)| (format!("cache.models.{n}"), r))
            .chain(
                self.routes
                    .iter()
                    .map(|(n, r)| (format!("cache.routes.{n}"), r)),
            );
        for (at, r) in rules {
            match r.scope {
                CacheScope::Global => out.push(format!(
                    "{at}: scope global: one caller's cached answer is served to every caller of \
                     this model"
                )),
                CacheScope::Tier => out.push(format!(
                    "{at}: scope tier: cached answers are shared by every caller of a tier"
                )),
                _ => {}
            }
        }
        let cached = !(self.models.is_empty() && self.routes.is_empty());
        if let (Some(t), true) = (self.in_envoy, cached) {
            out.push(format!(
                "cache.in_envoy: without fleet, exact entries live in Envoy's shared data: {} \
                 slots, at most {} KiB (slots × (max_entry_bytes + 121))",
                t.slots_used(),
                t.memory_bound().div_ceil(1024)
            ));
        }
        if self.secret_env.is_none() && cached {
            out.push(
                "cache.secret_env: unset: outside fleet mode the sidecar's cache endpoints trust \
                 loopback alone, which under a mesh (Istio) is every pod allowed to reach it; set \
                 a secret here and in the sidecar's cache.secret_file"
                    .into(),
            );
        }
        if self.salt.is_empty() && cached {
            out.push(
                "cache.salt: empty: anyone who can reach the sidecar could compute cache keys; \
                 set a secret salt"
                    .into(),
            );
        } else if cached && public_salt(&self.salt) {
            out.push(format!(
                "cache.salt: looks public ({} bytes{}): anyone who knows it can compute the key \
                 of another caller's question; set at least {MIN_SALT_BYTES} random bytes",
                self.salt.len(),
                if self.salt.to_ascii_lowercase().contains("change") {
                    ", a placeholder"
                } else {
                    ""
                }
            ));
        }
        out
    }
}

/// The temperature a request runs at: its own, else the API's default.
pub fn request_temperature(body: &serde_json::Value, ollama: bool) -> Option<f64> {
    let t = if ollama {
        body.get("options").and_then(|o| o.get("temperature"))
    } else {
        body.get("temperature")
    };
    match t {
        None | Some(serde_json::Value::Null) => Some(if ollama { 0.8 } else { 1.0 }),
        Some(v) => v.as_f64(),
    }
}

impl CacheRule {
    /// Whether the request's temperature allows caching (a temperature
    /// that is no number is not cached).
    pub fn temperature_ok(&self, body: &serde_json::Value, ollama: bool) -> bool {
        match self.max_temperature {
            None => true,
            Some(max) => request_temperature(body, ollama).is_some_and(|t| t <= max),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<CachePolicy, String> {
        let c: CacheConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        c.check().map_err(|e| e.to_string())
    }

    #[test]
    fn defaults() {
        let p = parse(json!({"models": {"m": {"exact": true}}})).unwrap();
        let r = p.rule("m", None).unwrap();
        assert_eq!(r.scope, CacheScope::Principal);
        assert_eq!(r.ttl_s, 86_400);
        assert!((r.threshold - 0.95).abs() < 1e-6);
        assert_eq!(r.top_k, 5);
        assert_eq!(r.max_temperature, None);
        assert_eq!(p.hit_cost, HitCost { tokens: false });
        assert_eq!(p.lookup_timeout_ms, 100);
        assert!(p.rule("other", None).is_none());
        assert_eq!(p.in_envoy, Some(InEnvoyConfig::default()));
        assert_eq!(p.secret_env, None);
        assert!(parse(json!({"in_envoy": {"slots": 0}}))
            .unwrap()
            .in_envoy
            .is_none());
        assert!(parse(json!({"in_envoy": {"slot": 1}}))
            .unwrap_err()
            .contains("unknown field"));
    }

    #[test]
    fn model_before_route_and_overrides() {
        let p = parse(json!({
            "scope": "team", "ttl": "1h", "max_temperature": 0.5,
            "models": {"m": {"exact": true, "semantic": true, "scope": "org", "ttl": "10m",
                             "threshold": 0.9, "top_k": 3}},
            "routes": {"r": {"exact": true}}
        }))
        .unwrap();
        let m = p.rule("m", Some("r")).unwrap();
        assert_eq!(
            (m.scope, m.ttl_s, m.top_k, m.semantic),
            (CacheScope::Org, 600, 3, true)
        );
        let r = p.rule("x", Some("r")).unwrap();
        assert_eq!(
            (r.scope, r.ttl_s, r.max_temperature),
            (CacheScope::Team, 3600, Some(0.5))
        );
    }

    #[test]
    fn errors_name_the_field() {
        for (v, path) in [
            (json!({"ttl": "forever"}), "cache.ttl"),
            (json!({"ttl": "0s"}), "cache.ttl"),
            (json!({"threshold": 1.5}), "cache.threshold"),
            (json!({"top_k": 0}), "cache.top_k"),
            (json!({"max_entry_bytes": 0}), "cache.max_entry_bytes"),
            (json!({"lookup_timeout": "1h"}), "cache.lookup_timeout"),
            (json!({"max_temperature": -1.0}), "cache.max_temperature"),
            (
                json!({"in_envoy": {"slots": 70000}}),
                "cache.in_envoy.slots",
            ),
            (
                json!({"in_envoy": {"max_entry_bytes": 0}}),
                "cache.in_envoy.max_entry_bytes",
            ),
            (
                json!({"max_entry_bytes": 1000, "in_envoy": {"max_entry_bytes": 2000}}),
                "cache.in_envoy.max_entry_bytes",
            ),
            (
                // 65,536 × (1 MiB + header): about 64 GiB never freed.
                json!({"max_entry_bytes": 1048576, "in_envoy": {"slots": 65536, "max_entry_bytes": 1048576}}),
                "cache.in_envoy",
            ),
            (json!({"secret_env": "A B"}), "cache.secret_env"),
            (
                json!({"models": {"m": {"exact": true, "ttl": "31d"}}}),
                "cache.models.m.ttl",
            ),
            (
                json!({"models": {"m": {"semantic": true, "threshold": 0.0}}}),
                "cache.models.m.threshold",
            ),
            (json!({"models": {"m": {}}}), "cache.models.m"),
            (
                json!({"routes": {"r": {"exact": true, "top_k": 1000}}}),
                "cache.routes.r.top_k",
            ),
        ] {
            let e = parse(v.clone()).unwrap_err();
            assert!(e.starts_with(&format!("{path}:")), "{v}: {e}");
        }
        assert!(parse(json!({"modles": {}}))
            .unwrap_err()
            .contains("unknown field"));
        assert!(parse(json!({"models": {"m": {"exact": true, "x": 1}}}))
            .unwrap_err()
            .contains("unknown field"));
        assert!(parse(json!({"scope": "everyone"})).is_err());
    }

    #[test]
    fn global_is_said() {
        let p = parse(
            json!({"salt": "a5f0c3e19b7d2468ac13", "secret_env": "S", "in_envoy": {"slots": 0},
                             "models": {"m": {"exact": true, "scope": "global"}}}),
        )
        .unwrap();
        let w = p.warnings();
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("cache.models.m: scope global"));
        let p = parse(json!({"models": {"m": {"exact": true}}})).unwrap();
        let w = p.warnings();
        assert!(w[0].starts_with("cache.in_envoy: "), "{w:?}");
        assert!(w[0].contains("2048 slots, at most 33010 KiB"), "{w:?}");
        assert!(w[1].starts_with("cache.secret_env: unset"), "{w:?}");
        assert!(w[2].starts_with("cache.salt"), "{w:?}");
    }

    #[test]
    fn a_public_salt_is_said() {
        let warned = |salt: &str| {
            parse(
                json!({"salt": salt, "secret_env": "S", "in_envoy": {"slots": 0},
                         "models": {"m": {"exact": true}}}),
            )
            .unwrap()
            .warnings()
            .iter()
            .any(|w| w.starts_with("cache.salt: looks public"))
        };
        // The demo's old salt, an example's placeholder, a short one.
        assert!(warned("demo-cache-salt-change-me"));
        assert!(warned("please-CHANGEME-before-prod-000"));
        assert!(warned("short"));
        assert!(!warned("ae705ee6031692bf35f5a8cc29d66ecf"));
    }

    #[test]
    fn scope_values_never_widen() {
        let c = CacheCaller {
            principal: "p",
            team: Some("t"),
            org: None,
            tier: "free",
        };
        assert_eq!(CacheScope::Principal.value(&c), "principal:p");
        assert_eq!(CacheScope::Team.value(&c), "team:t");
        assert_eq!(CacheScope::Org.value(&c), "principal:p");
        assert_eq!(CacheScope::Tier.value(&c), "tier:free");
        assert_eq!(CacheScope::Global.value(&c), "global");
    }

    #[test]
    fn temperature_rule() {
        let p = parse(json!({"max_temperature": 0.5, "models": {"m": {"exact": true}}})).unwrap();
        let r = p.rule("m", None).unwrap();
        assert!(r.temperature_ok(&json!({"temperature": 0.2}), false));
        assert!(!r.temperature_ok(&json!({"temperature": 0.7}), false));
        assert!(!r.temperature_ok(&json!({}), false)); // OpenAI default 1.0
        assert!(!r.temperature_ok(&json!({"temperature": "hot"}), false));
        assert!(r.temperature_ok(&json!({"options": {"temperature": 0}}), true));
        assert!(!r.temperature_ok(&json!({}), true)); // Ollama default 0.8
    }
}
