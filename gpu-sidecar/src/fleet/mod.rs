//! The fleet agent: this sidecar's Redis connection, on behalf of the one
//! Envoy beside it (docs/src/design.md, "Fleet"). The filter never talks to
//! Redis; it asks here over the HTTP channel it already has:
//!
//! - `POST /v1/fleet/take`: every claim of one request, all or nothing,
//!   in one Lua script (atomic in Redis). Each claim names its bucket
//!   (`rule`) and caller (`owner`, a hash), what it needs now (`need`) and
//!   how big a lease it would like (`want`); the script grants at least
//!   `need` and at most a fair share of what is left (`left ÷ replicas`).
//!   Near the end of a bucket the fair share falls under `need` and the
//!   grant is exactly `need`: the strict path, with nothing stranded.
//! - `POST /v1/fleet/give`: lease returns and settlement deltas, in a
//!   batch with an id; the script records the id first (`SET NX`) so a
//!   batch retried after a lost answer is applied once.
//!
//! What this sidecar trusts (see docs/src/fleet.md, "What the fleet agent trusts"):
//! only the Envoy beside it, proven by the fleet secret both read from
//! their own config (`x-sluice-fleet-secret`, compared in constant time),
//! over loopback, as `application/json`, never with an `Origin` (no web
//! page). Even then the message says only *which* bucket and *how much*:
//! every limit, kind (soft or hard), window, fair-share divisor and key
//! name comes from this sidecar's own copy of the policy (`fleet.policy`).
//!
//! Three ways a fleet's counts stop meaning one thing are detected rather
//! than served: Envoys with different salts or rules (each sidecar
//! publishes a [`fingerprint`](sluice_core::fleet_contract::fingerprint) in Redis
//! and refuses to count while a live one differs: `fleet_mismatch`); a
//! Redis that lost its data (an epoch key written once, checked by every
//! script; hard budgets of the window it happened in answer
//! `fleet_data_lost`); and takes that arrive after the filter gave up on
//! them (each take has an id and a deadline, checked in the script by
//! Redis' clock; the filter undoes an abandoned one by id, once).
//!
//! Redis keys carry hashes (never raw API keys): salted, of the rule and
//! the caller; window keys expire with their window, token-bucket keys
//! once they would be full again. All three answer 503 `fleet_unavailable`
//! while Redis does not answer: the filter then follows `on_unavailable`.
//!
//! The kill switch and the breakers are fleet-wide too:
//! [`sync::sync_kill_switch`] keeps this sidecar's switch and the one in
//! Redis equal (a change here is written there; a newer one there is
//! applied here and so pushed to the Envoy through the long poll);
//! [`sync::sync_breakers`] publishes this sidecar's open breakers and
//! serves every other live sidecar's.

pub mod concurrency;
pub mod routes;
pub mod sync;

use std::collections::HashMap;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sluice_core::fleet_contract::{self, window_end};
use sluice_core::{Limit, Scope as RuleScope};
use tokio::sync::Mutex;

pub use crate::config::fleet::FleetConfig;
use crate::redis::{Redis, RedisError};

/// Longest batch or claim list accepted in one call.
pub const MAX_ITEMS: usize = 1024;
/// How long a batch id is remembered. A batch is
/// sent again only when its answer was lost, within a second of the
/// sidecar answering again: an hour is ample, and bounds the ids kept.
const APPLIED_TTL_MS: u64 = 3_600_000;
/// How long what a take granted is kept, to be undone by its id: the
/// filter sends the cancel with its next batch, a second or so after it
/// gave up. Short, because the strict path makes one record per request
/// (at 2,000 takes/s, about 240,000 small hashes). A cancel later than
/// this gives back nothing: the fleet over-counts, the safe side.
const TAKE_RECORD_TTL_MS: u64 = 120_000;
/// Keys outlive their window by this much (clock skew between Envoys).
const KEY_GRACE_MS: u64 = 60_000;
/// Every fleet key starts so; a bucket's is `{PREFIX}{redis_key}:{window_end_ms}`.
const PREFIX: &str = "sluice:fleet:";
const EPOCH_KEY: &str = "sluice:fleet:epoch";
const FINGERPRINTS_KEY: &str = "sluice:fleet:fingerprints";
/// Largest number accepted in a claim (exact in Lua's doubles).
const MAX_UNITS: u64 = 1 << 52;

/// Script answers other than a grant or a refusal.
const EPOCH_CHANGED: i64 = -1;
const LATE: i64 = -2;
const CANCELLED: i64 = -3;

/// The epoch check every script starts with: KEYS[1] the epoch key,
/// ARGV[1] the epoch this sidecar knows. A Redis that lost its data (or a
/// different Redis) has none, or another.
const EPOCH_CHECK: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {-1} end
"#;

/// Takes every claim or none. KEYS: the epoch key, the take's record,
/// then one bucket key per claim. ARGV[1]: epoch; [2]: replicas; [3]: the
/// deadline (ms, Redis' clock); [4]: key grace; [5]: record TTL; then per
/// claim 7 numbers: capacity, refill amount, refill period (ms), window end
/// (ms since the epoch; 0 = token bucket), need, want, soft (1: a soft
/// cap, taken even past its limit — it never refuses, the filter downshifts
/// instead). Answers `{1, grant…, left…}`, `{0, index, left}`, or `{-2}`
/// (past its deadline), `{-3}` (undone before it arrived).
const TAKE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if now > tonumber(ARGV[3]) then return {-2} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {-3} end
local replicas = math.max(1, tonumber(ARGV[2]))
local grace = tonumber(ARGV[4])
local n = #KEYS - 2
local levels = {}
for i = 1, n do
  local b = 5 + (i - 1) * 7
  local k = KEYS[i + 2]
  local cap = tonumber(ARGV[b + 1])
  local amount = tonumber(ARGV[b + 2])
  local period = tonumber(ARGV[b + 3])
  local wend = tonumber(ARGV[b + 4])
  local need = tonumber(ARGV[b + 5])
  local level
  if wend > 0 then
    level = cap - tonumber(redis.call('GET', k) or '0')
  else
    local v = redis.call('HMGET', k, 'l', 't')
    level = tonumber(v[1]) or cap
    local last = tonumber(v[2]) or now
    if now > last and period > 0 then
      level = math.min(cap, level + (now - last) * amount / period)
    end
  end
  levels[i] = level
  if level < need and tonumber(ARGV[b + 7]) == 0 then
    return {0, i, math.max(0, math.floor(level))}
  end
end
local out = {1}
local left = {}
local record = {}
for i = 1, n do
  local b = 5 + (i - 1) * 7
  local k = KEYS[i + 2]
  local cap = tonumber(ARGV[b + 1])
  local amount = tonumber(ARGV[b + 2])
  local period = tonumber(ARGV[b + 3])
  local wend = tonumber(ARGV[b + 4])
  local need = tonumber(ARGV[b + 5])
  local want = tonumber(ARGV[b + 6])
  local share = math.floor(levels[i] / replicas)
  local grant = math.max(need, math.min(want, share))
  grant = math.max(need, math.min(grant, math.floor(levels[i])))
  if wend > 0 then
    redis.call('INCRBY', k, grant)
    redis.call('PEXPIREAT', k, wend + grace)
  else
    redis.call('HSET', k, 'l', tostring(levels[i] - grant), 't', now)
    local full = 0
    if amount > 0 then full = math.ceil(cap * period / amount) end
    redis.call('PEXPIRE', k, full + grace)
  end
  record[#record + 1] = k
  record[#record + 1] = grant
  out[#out + 1] = grant
  left[i] = math.max(0, math.floor(levels[i] - grant))
end
redis.call('HSET', KEYS[2], unpack(record))
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[5]))
for i = 1, n do out[#out + 1] = left[i] end
return out
"#;

/// Applies a batch once. KEYS: the epoch key, the batch id's key, then per
/// item its bucket key and its take's record (a cancel) or the bucket key
/// again. ARGV[1]: epoch; [2]: id TTL; [3]: key grace; [4]: take record
/// TTL; then per item 6
/// numbers: capacity, refill amount, period, window end (0 = token
/// bucket), delta (> 0 gives back, < 0 charges), cancel (1: give back what
/// the take granted on this bucket, once; a take not yet applied is then
/// refused when it arrives). Answers `{1}` when applied, `{0}` when this
/// id was applied before.
const GIVE: &str = r#"
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[2]) then return {0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace = tonumber(ARGV[3])
local n = (#KEYS - 2) / 2
for i = 1, n do
  local k = KEYS[1 + i * 2]
  local b = 4 + (i - 1) * 6
  local cap = tonumber(ARGV[b + 1])
  local amount = tonumber(ARGV[b + 2])
  local period = tonumber(ARGV[b + 3])
  local wend = tonumber(ARGV[b + 4])
  local delta = tonumber(ARGV[b + 5])
  if tonumber(ARGV[b + 6]) == 1 then
    local record = KEYS[2 + i * 2]
    delta = 0
    if redis.call('HSETNX', record, 'cancelled:' .. k, '1') == 1 then
      delta = tonumber(redis.call('HGET', record, k) or '0')
    end
    redis.call('PEXPIRE', record, tonumber(ARGV[4]))
  end
  if delta ~= 0 then
    if wend > 0 then
      if wend > now then
        local used = tonumber(redis.call('GET', k) or '0')
        local nextv = math.max(0, used - delta)
        redis.call('SET', k, nextv, 'PXAT', wend + grace)
      end
    else
      local v = redis.call('HMGET', k, 'l', 't')
      local level = tonumber(v[1]) or cap
      local last = tonumber(v[2]) or now
      if now > last and period > 0 then
        level = math.min(cap, level + (now - last) * amount / period)
      end
      level = math.min(cap, level + delta)
      redis.call('HSET', k, 'l', tostring(level), 't', now)
      local full = 0
      if amount > 0 then full = math.ceil(cap * period / amount) end
      redis.call('PEXPIRE', k, full + grace)
    end
  end
end
return {1}
"#;

/// The epoch: read, or written once when there is none. KEYS[1]: the
/// epoch key; ARGV[1]: a fresh id; ARGV[2]: the epoch this sidecar knew
/// (empty: none). A sidecar that knew an epoch and finds it gone or
/// replaced by a first one (`…:0`) knows the data was lost: it writes a
/// new one stamped with the time of the loss. Answers the epoch.
const EPOCH: &str = r#"
local v = redis.call('GET', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] == '' then
  if not v then
    v = ARGV[1] .. ':0'
    redis.call('SET', KEYS[1], v)
  end
  return v
end
if v == ARGV[2] then return v end
if (not v) or string.sub(v, -2) == ':0' then
  v = ARGV[1] .. ':' .. now
  redis.call('SET', KEYS[1], v)
end
return v
"#;

/// The Redis name of a bucket for one owner: a salted hash, never a raw
/// key (the filter never names one: only the sidecars of a fleet, which
/// must all spell it so).
pub fn redis_key(salt: &str, rule: &str, owner: u64) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"sluice-fleet\0");
    h.update(salt.as_bytes());
    h.update(b"\0");
    h.update(rule.as_bytes());
    h.update(b"\0");
    h.update(owner.to_le_bytes());
    // The first 16 bytes, in lower-case hex.
    let mut hex = format!("{:x}", h.finalize());
    hex.truncate(32);
    hex
}

/// A fleet bucket as this sidecar's policy defines it.
#[derive(Debug, Clone)]
struct ViewRule {
    limit: Limit,
    soft: bool,
    global: bool,
}

/// This sidecar's own view of the fleet's policy: everything a claim is
/// checked against and filled in from.
#[derive(Debug, Clone)]
pub struct PolicyView {
    salt: String,
    replicas: u64,
    rules: HashMap<String, ViewRule>,
    slots: HashMap<String, u32>,
    /// [`sluice_core::fleet_contract::fingerprint`] of the policy.
    pub fingerprint: String,
}

impl PolicyView {
    /// From a policy file or an Envoy config (the one with a `fleet`
    /// section), checked as Envoy would.
    pub fn from_text(text: &str) -> Result<PolicyView, String> {
        let policy = crate::config::policy::fleet_policy(text)?;
        Ok(PolicyView::of(policy))
    }

    pub fn of(policy: sluice_core::Policy) -> PolicyView {
        let (salt, replicas) = policy.fleet.as_ref().map_or((String::new(), 1), |f| {
            (f.salt.clone(), f.expected_replicas.max(1))
        });
        let rules = fleet_contract::fleet_rules(&policy)
            .into_iter()
            .map(|d| {
                (
                    d.rule.id.to_string(),
                    ViewRule {
                        limit: d.rule.limit,
                        soft: d.soft,
                        global: d.rule.scope == RuleScope::Global,
                    },
                )
            })
            .collect();
        PolicyView {
            slots: fleet_contract::fleet_slots(&policy).into_iter().collect(),
            fingerprint: fleet_contract::fingerprint(&policy),
            salt,
            replicas,
            rules,
        }
    }

    /// The fleet-wide limit of a slot scope, if the policy has it.
    pub fn slot_limit(&self, scope: &str) -> Option<u32> {
        self.slots.get(scope).copied()
    }
}

/// What `fleet:` needs from outside the config file, read and checked.
pub struct Loaded {
    client: redis::Client,
    view: PolicyView,
    secret: String,
}

impl Loaded {
    /// The fingerprint of the policy loaded.
    pub fn fingerprint(&self) -> &str {
        &self.view.fingerprint
    }
}

impl FleetConfig {
    /// Reads the policy, the secret, the password and the CA, and makes the
    /// client (no connection yet). Errors name the field.
    pub fn load(&self) -> Result<Loaded, FleetError> {
        let bad = |field: &str, m: String| FleetError::Invalid(format!("fleet.{field}: {m}"));
        let path = self.policy.as_ref().ok_or_else(|| {
            bad(
                "policy",
                "required: the policy (or Envoy config) the Envoy beside this sidecar loads; \
                 the fleet's limits come from it, never from the filter's calls"
                    .into(),
            )
        })?;
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad("policy", format!("reading {}: {e}", path.display())))?;
        let view = PolicyView::from_text(&text)
            .map_err(|e| bad("policy", format!("{}: {e}", path.display())))?;
        let secret = match &self.secret_file {
            Some(p) => std::fs::read_to_string(p)
                .map_err(|e| bad("secret_file", format!("reading {}: {e}", p.display())))?,
            None => std::env::var(&self.secret_env).unwrap_or_default(),
        };
        let secret = secret.trim().to_string();
        if secret.len() < sluice_wire::fleet::MIN_SECRET {
            let from = match &self.secret_file {
                Some(p) => format!("secret_file ({})", p.display()),
                None => format!("secret_env (${})", self.secret_env),
            };
            return Err(bad(
                if self.secret_file.is_some() { "secret_file" } else { "secret_env" },
                format!(
                    "{from}: the secret shared with the Envoy beside this sidecar is required, at least {} bytes",
                    sluice_wire::fleet::MIN_SECRET
                ),
            ));
        }
        let client = crate::redis::client(self).map_err(FleetError::Invalid)?;
        Ok(Loaded {
            client,
            view,
            secret,
        })
    }
}

/// The bodies of `/v1/fleet/take` and `/v1/fleet/give`, shared with the
/// filter.
pub use sluice_wire::fleet::{GiveItem, GiveRequest, TakeAnswer, TakeClaim, TakeRequest};

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("{0}")]
    Invalid(String),
    #[error("redis: {0}")]
    Unavailable(String),
    /// The fleet's fingerprints differ (salt, replicas or rules).
    #[error("{0}")]
    Mismatch(String),
    /// Redis lost the data of this hard budget's window.
    #[error("{0}")]
    DataLost(String),
    /// Applied too late, or undone before it arrived: not applied.
    #[error("{0}")]
    Late(String),
}

impl From<RedisError> for FleetError {
    fn from(e: RedisError) -> FleetError {
        match e {
            RedisError::Unavailable(m) => FleetError::Unavailable(m),
            RedisError::Invalid(m) => FleetError::Invalid(m),
        }
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct FleetStats {
    pub takes: AtomicU64,
    pub takes_refused: AtomicU64,
    /// Takes Redis did not apply: past their deadline, or undone first.
    pub takes_late: AtomicU64,
    pub gives: AtomicU64,
    pub gives_repeated: AtomicU64,
    /// Calls refused: no or a wrong secret, an `Origin`, not JSON.
    pub refused_calls: AtomicU64,
    /// Times this sidecar found Redis without the epoch it knew.
    pub data_lost: AtomicU64,
    /// A live sidecar publishes another fingerprint.
    pub mismatch: AtomicBool,
}

/// The epoch this sidecar knows: its value in Redis, and when the data
/// was lost (0: never, as far as this Redis knows).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Epoch {
    value: String,
    lost_at_ms: u64,
}

impl Epoch {
    fn parse(value: String) -> Epoch {
        let lost_at_ms = value
            .rsplit(':')
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        Epoch { value, lost_at_ms }
    }
}

/// The fleet agent: this sidecar's policy view and its way to Redis.
pub struct Fleet {
    /// Shared with the cache tier.
    redis: Arc<Redis>,
    config: FleetConfig,
    /// Swapped when `fleet.policy` changes on disk (the Envoy beside it
    /// reloaded its policy): see [`Fleet::reload_policy`].
    view: std::sync::RwLock<Arc<PolicyView>>,
    policy_mtime: std::sync::Mutex<Option<SystemTime>>,
    secret: String,
    epoch: Mutex<Option<Epoch>>,
    take: redis::Script,
    give: redis::Script,
    epoch_script: redis::Script,
    pub stats: FleetStats,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("config", &self.config)
            .field("fingerprint", &self.view().fingerprint)
            .finish()
    }
}

/// A claim checked against this sidecar's policy: its key and shape.
struct Checked {
    key: String,
    rule: ViewRule,
    window_end_ms: u64,
}

impl Fleet {
    pub fn new(config: FleetConfig) -> Result<Arc<Fleet>, FleetError> {
        let loaded = config.load()?;
        Ok(Fleet::with(config, loaded))
    }

    fn with(config: FleetConfig, loaded: Loaded) -> Arc<Fleet> {
        let mtime = config
            .policy
            .as_ref()
            .and_then(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        Arc::new(Fleet {
            redis: Arc::new(Redis::new(loaded.client, &config)),
            view: std::sync::RwLock::new(Arc::new(loaded.view)),
            policy_mtime: std::sync::Mutex::new(mtime),
            secret: loaded.secret,
            config,
            epoch: Mutex::new(None),
            take: redis::Script::new(&format!("{EPOCH_CHECK}{TAKE}")),
            give: redis::Script::new(&format!("{EPOCH_CHECK}{GIVE}")),
            epoch_script: redis::Script::new(EPOCH),
            stats: FleetStats::default(),
        })
    }

    /// This sidecar's view of the policy now.
    pub fn view(&self) -> Arc<PolicyView> {
        match self.view.read() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Reads `fleet.policy` again when it changed on disk; a bad one is
    /// logged and the last good view kept (as Envoy keeps its last good
    /// policy).
    pub fn reload_policy(&self) {
        let Some(path) = self.config.policy.as_ref() else {
            return;
        };
        let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let Ok(mut seen) = self.policy_mtime.lock() else {
            return;
        };
        if mtime.is_none() || *seen == mtime {
            return;
        }
        *seen = mtime;
        let loaded = std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|t| PolicyView::from_text(&t));
        match loaded {
            Ok(view) => {
                eprintln!(
                    "sluice-sidecar: fleet: {} reloaded (fingerprint {})",
                    path.display(),
                    view.fingerprint
                );
                if let Ok(mut v) = self.view.write() {
                    *v = Arc::new(view);
                }
            }
            Err(e) => eprintln!(
                "sluice-sidecar: fleet: {} refused, keeping the last good policy: {e}",
                path.display()
            ),
        }
    }

    /// Whether `given` is the fleet secret (constant time).
    pub fn secret_ok(&self, given: &[u8]) -> bool {
        crate::door::secret_eq(given, self.secret.as_bytes())
    }

    /// The Redis connection, shared with the cache tier.
    pub fn redis(&self) -> &Arc<Redis> {
        &self.redis
    }

    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T, FleetError> {
        Ok(self.redis.run(invocation).await?)
    }

    /// The epoch this sidecar counts in: read (or written) once, renewed
    /// when a script found another (`stale`: the one it had).
    async fn epoch(&self, stale: Option<&Epoch>) -> Result<Epoch, FleetError> {
        let mut slot = self.epoch.lock().await;
        if let (Some(e), None) = (slot.as_ref(), stale) {
            return Ok(e.clone());
        }
        if let (Some(e), Some(s)) = (slot.as_ref(), stale) {
            if e != s {
                return Ok(e.clone()); // renewed meanwhile by another call
            }
        }
        let known = slot.as_ref().map(|e| e.value.clone()).unwrap_or_default();
        let mut inv = self.epoch_script.prepare_invoke();
        inv.key(EPOCH_KEY)
            .arg(format!(
                "{:x}",
                now_ms() ^ u64::from(std::process::id()) << 40
            ))
            .arg(&known);
        let value: String = self.run(inv).await?;
        let epoch = Epoch::parse(value);
        if !known.is_empty() && epoch.value != known {
            self.stats.data_lost.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "sluice-sidecar: fleet: Redis is not the one this sidecar counted in (its epoch key \
                 is gone or other: FLUSHALL, a restart without persistence, another server); hard \
                 budgets of the window in progress at the loss answer fleet_data_lost (the Envoy \
                 follows on_unavailable.data_lost) until that window ends"
            );
        }
        *slot = Some(epoch.clone());
        Ok(epoch)
    }

    fn check_rule(
        view: &PolicyView,
        rule: &str,
        owner: u64,
        path: &str,
    ) -> Result<ViewRule, FleetError> {
        let r = view.rules.get(rule).cloned().ok_or_else(|| {
            FleetError::Invalid(format!(
                "{path}.rule: `{rule}` is no fleet bucket of this sidecar's policy"
            ))
        })?;
        if (r.global && owner != 1) || (!r.global && owner < 2) {
            return Err(FleetError::Invalid(format!(
                "{path}.owner: {} expected for `{rule}`",
                if r.global {
                    "1 (a global bucket)"
                } else {
                    "a caller's hash (2 or more)"
                }
            )));
        }
        Ok(r)
    }

    /// Checks a claim or item against the policy; `current`: a take, whose
    /// window must be the one in progress (± the key grace for clock skew),
    /// else any window boundary up to the current one.
    fn check_claim(
        view: &PolicyView,
        rule_id: &str,
        owner: u64,
        window_end_ms: u64,
        current: bool,
        path: &str,
        now: u64,
    ) -> Result<Checked, FleetError> {
        let rule = Self::check_rule(view, rule_id, owner, path)?;
        let limit = &rule.limit;
        let ok = match limit.window {
            None => window_end_ms == 0,
            Some(_) if current => [now.saturating_sub(KEY_GRACE_MS), now, now + KEY_GRACE_MS]
                .iter()
                .any(|&t| window_end(limit, t) == window_end_ms),
            Some(_) => {
                window_end_ms > 0
                    && window_end(limit, window_end_ms - 1) == window_end_ms
                    && window_end_ms <= window_end(limit, now + KEY_GRACE_MS)
            }
        };
        if !ok {
            return Err(FleetError::Invalid(format!(
                "{path}.window_end_ms: {window_end_ms} is not a {} window end of `{rule_id}`",
                if current {
                    "current"
                } else {
                    "past or current"
                }
            )));
        }
        let key = redis_key(&view.salt, rule_id, owner);
        Ok(Checked {
            key: format!("{PREFIX}{key}:{window_end_ms}"),
            rule,
            window_end_ms,
        })
    }

    pub async fn take(&self, req: &TakeRequest) -> Result<TakeAnswer, FleetError> {
        let view = self.view();
        let checked = Self::check_take(&view, req, now_ms())?;
        self.refuse_mismatch()?;
        let mut epoch = self.epoch(None).await?;
        let mut renewed = false;
        loop {
            Self::refuse_lost(req, &checked, epoch.lost_at_ms)?;
            let mut inv = self.take.prepare_invoke();
            inv.key(EPOCH_KEY)
                .key(format!("{PREFIX}take:{}", req.id))
                .arg(&epoch.value)
                .arg(view.replicas)
                .arg(req.deadline_ms)
                .arg(KEY_GRACE_MS)
                .arg(TAKE_RECORD_TTL_MS);
            for (c, k) in req.claims.iter().zip(&checked) {
                let l = &k.rule.limit;
                inv.key(&k.key);
                inv.arg(l.capacity())
                    .arg(l.rate.amount)
                    .arg(l.rate.period_ms)
                    .arg(k.window_end_ms)
                    .arg(c.need)
                    .arg(c.want.max(c.need).min(MAX_UNITS))
                    .arg(u8::from(k.rule.soft));
            }
            let raw: Vec<i64> = self.run(inv).await?;
            match raw.first().copied() {
                Some(EPOCH_CHANGED) if !renewed => {
                    epoch = self.epoch(Some(&epoch)).await?;
                    renewed = true;
                    continue;
                }
                Some(EPOCH_CHANGED) => {
                    return Err(FleetError::Unavailable("the epoch keeps changing".into()))
                }
                Some(LATE) | Some(CANCELLED) => {
                    self.stats.takes_late.fetch_add(1, Ordering::Relaxed);
                    return Err(FleetError::Late(format!(
                        "take {}: {}; not applied",
                        req.id,
                        if raw.first() == Some(&LATE) {
                            "past its deadline when Redis ran it"
                        } else {
                            "undone by the filter before it arrived"
                        }
                    )));
                }
                _ => return Ok(self.take_answer(&raw, req.claims.len())),
            }
        }
    }

    /// A take's claims, each checked against the policy's view at `now`
    /// (a current window only): their Redis keys and rules.
    fn check_take(
        view: &PolicyView,
        req: &TakeRequest,
        now: u64,
    ) -> Result<Vec<Checked>, FleetError> {
        if req.claims.is_empty() || req.claims.len() > MAX_ITEMS {
            return Err(FleetError::Invalid(format!(
                "claims: 1 to {MAX_ITEMS} expected"
            )));
        }
        id_ok(&req.id, "id")?;
        let mut checked = Vec::with_capacity(req.claims.len());
        for (i, c) in req.claims.iter().enumerate() {
            let path = format!("claims[{i}]");
            if c.need > MAX_UNITS || c.want > MAX_UNITS {
                return Err(FleetError::Invalid(format!(
                    "{path}: need and want at most 2^52"
                )));
            }
            checked.push(Self::check_claim(
                view,
                &c.rule,
                c.owner,
                c.window_end_ms,
                true,
                &path,
                now,
            )?);
        }
        Ok(checked)
    }

    /// Refuses a take when Redis lost its data (at `lost_at_ms`, 0 if
    /// never) in the current window of a hard budget it claims: that
    /// budget's fleet count is unknown until the window ends.
    fn refuse_lost(
        req: &TakeRequest,
        checked: &[Checked],
        lost_at_ms: u64,
    ) -> Result<(), FleetError> {
        if lost_at_ms == 0 {
            return Ok(());
        }
        for (c, k) in req.claims.iter().zip(checked) {
            let hard_budget = k.rule.limit.window.is_some() && !k.rule.soft;
            if hard_budget && window_end(&k.rule.limit, lost_at_ms) == k.window_end_ms {
                return Err(FleetError::DataLost(format!(
                    "Redis lost its data at {lost_at_ms} (ms since the epoch), in the window of `{}`: \
                     its fleet count is unknown until the window ends",
                    c.rule
                )));
            }
        }
        Ok(())
    }

    fn take_answer(&self, raw: &[i64], n: usize) -> TakeAnswer {
        self.stats.takes.fetch_add(1, Ordering::Relaxed);
        let num = |i: usize| raw.get(i).copied().unwrap_or(0).max(0) as u64;
        if raw.first() == Some(&1) && raw.len() == 1 + 2 * n {
            TakeAnswer {
                ok: true,
                grants: (1..=n).map(num).collect(),
                left: (n + 1..=2 * n).map(num).collect(),
                refused: None,
            }
        } else {
            self.stats.takes_refused.fetch_add(1, Ordering::Relaxed);
            TakeAnswer {
                ok: false,
                grants: Vec::new(),
                left: vec![num(2)],
                refused: Some((num(1) as usize).saturating_sub(1)),
            }
        }
    }

    /// Applies a batch; `false` when its id was applied before.
    pub async fn give(&self, req: &GiveRequest) -> Result<bool, FleetError> {
        if req.items.len() > MAX_ITEMS {
            return Err(FleetError::Invalid(format!(
                "items: at most {MAX_ITEMS} expected"
            )));
        }
        id_ok(&req.id, "id")?;
        let now = now_ms();
        let view = self.view();
        let mut checked = Vec::with_capacity(req.items.len());
        for (i, item) in req.items.iter().enumerate() {
            let path = format!("items[{i}]");
            let k = Self::check_claim(
                &view,
                &item.rule,
                item.owner,
                item.window_end_ms,
                false,
                &path,
                now,
            )?;
            if item.delta.unsigned_abs() > k.rule.limit.capacity() {
                return Err(FleetError::Invalid(format!(
                    "{path}.delta: at most the bucket's capacity ({}) either way",
                    k.rule.limit.capacity()
                )));
            }
            if let Some(take) = &item.take {
                id_ok(take, &format!("{path}.take"))?;
            }
            checked.push(k);
        }
        self.refuse_mismatch()?;
        let mut epoch = self.epoch(None).await?;
        let mut renewed = false;
        loop {
            let mut inv = self.give.prepare_invoke();
            inv.key(EPOCH_KEY)
                .key(format!("{PREFIX}applied:{}", req.id))
                .arg(&epoch.value)
                .arg(APPLIED_TTL_MS)
                .arg(KEY_GRACE_MS)
                .arg(TAKE_RECORD_TTL_MS);
            for (item, k) in req.items.iter().zip(&checked) {
                let l = &k.rule.limit;
                inv.key(&k.key);
                match &item.take {
                    Some(take) => inv.key(format!("{PREFIX}take:{take}")),
                    None => inv.key(&k.key),
                };
                inv.arg(l.capacity())
                    .arg(l.rate.amount)
                    .arg(l.rate.period_ms)
                    .arg(k.window_end_ms)
                    .arg(item.delta)
                    .arg(u8::from(item.take.is_some()));
            }
            let raw: Vec<i64> = self.run(inv).await?;
            match raw.first().copied() {
                Some(EPOCH_CHANGED) if !renewed => {
                    epoch = self.epoch(Some(&epoch)).await?;
                    renewed = true;
                }
                Some(EPOCH_CHANGED) => {
                    return Err(FleetError::Unavailable("the epoch keeps changing".into()))
                }
                applied => {
                    self.stats.gives.fetch_add(1, Ordering::Relaxed);
                    if applied != Some(1) {
                        self.stats.gives_repeated.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(applied == Some(1));
                }
            }
        }
    }

    /// Refuses to count while the fleet's fingerprints differ.
    pub(crate) fn refuse_mismatch(&self) -> Result<(), FleetError> {
        if self.stats.mismatch.load(Ordering::Relaxed) {
            return Err(FleetError::Mismatch(
                "another live sidecar of this Redis has another fleet fingerprint (salt, \
                 expected_replicas or fleet rules differ): not counting in a parallel universe"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Compares the epoch in Redis with the one this sidecar knows (renewed,
    /// and the loss logged, when it differs): a loss is noticed within a
    /// sync interval even without traffic here, before a sidecar that never
    /// knew the old epoch could take it for a first start.
    async fn check_epoch(&self) -> Result<(), FleetError> {
        let Some(known) = self.epoch.lock().await.clone() else {
            return Ok(());
        };
        let now: Option<String> = self.redis.command(redis::cmd("GET").arg(EPOCH_KEY)).await?;
        if now.as_deref() != Some(known.value.as_str()) {
            self.epoch(Some(&known)).await?;
        }
        Ok(())
    }

    /// Publishes this sidecar's fingerprint and compares every live one:
    /// whether they all agree.
    async fn compare_fingerprints(&self, id: &str) -> Result<bool, FleetError> {
        let now = now_ms();
        let mut pipe = redis::pipe();
        pipe.cmd("HSET")
            .arg(FINGERPRINTS_KEY)
            .arg(id)
            .arg(format!("{}:{now}", self.view().fingerprint))
            .ignore();
        pipe.cmd("HGETALL").arg(FINGERPRINTS_KEY);
        let (all,): (Vec<(String, String)>,) = self.redis.query(&pipe).await?;
        let mut agree = true;
        let mut gone = Vec::new();
        for (other, raw) in all {
            if other == id {
                continue;
            }
            let (fp, at) = raw.rsplit_once(':').unwrap_or(("", "0"));
            let at: u64 = at.parse().unwrap_or(0);
            if at + BOARD_FORGET_MS < now {
                gone.push(other);
            } else if at + BOARD_LIVE_MS >= now && fp != self.view().fingerprint {
                agree = false;
            }
        }
        if !gone.is_empty() {
            self.redis
                .tidy(redis::cmd("HDEL").arg(FINGERPRINTS_KEY).arg(&gone))
                .await;
        }
        Ok(agree)
    }

    async fn get_kill_switch(&self) -> Result<Option<Shared>, FleetError> {
        let raw: Option<String> = self
            .redis
            .command(redis::cmd("GET").arg(format!("{PREFIX}kill_switch")))
            .await?;
        Ok(raw.and_then(|r| serde_json::from_str(&r).ok()))
    }

    /// Publishes this sidecar's breakers (`body`, written every time: it
    /// doubles as liveness) and reads every sidecar's, in one round trip.
    async fn swap_breakers(
        &self,
        id: &str,
        body: &str,
    ) -> Result<Vec<(String, String)>, FleetError> {
        let key = format!("{PREFIX}breakers");
        let mut pipe = redis::pipe();
        pipe.cmd("HSET").arg(&key).arg(id).arg(body).ignore();
        pipe.cmd("HGETALL").arg(&key);
        let (all,): (Vec<(String, String)>,) = self.redis.query(&pipe).await?;
        Ok(all)
    }

    async fn forget_breakers(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        self.redis
            .tidy(redis::cmd("HDEL").arg(format!("{PREFIX}breakers")).arg(ids))
            .await;
    }

    async fn put_kill_switch(&self, value: &Shared) -> Result<(), FleetError> {
        let body = serde_json::to_string(value).map_err(|e| FleetError::Invalid(e.to_string()))?;
        self.redis
            .command::<()>(
                redis::cmd("SET")
                    .arg(format!("{PREFIX}kill_switch"))
                    .arg(body),
            )
            .await?;
        Ok(())
    }
}

fn id_ok(id: &str, path: &str) -> Result<(), FleetError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(FleetError::Invalid(format!(
            "{path}: 1 to 64 letters, digits or '-' expected"
        )));
    }
    Ok(())
}

/// The kill switch as kept in Redis: what it is and a stamp that orders
/// changes from different sidecars.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Shared {
    pub active: bool,
    pub reason: Option<String>,
    /// Milliseconds since the epoch of the change (ties: the first wins).
    pub stamp: u64,
}

/// Another sidecar's entry counts while it was written this recently.
pub(crate) const BOARD_LIVE_MS: u64 = 3_000;
/// Entries older than this are removed (a sidecar gone for good).
pub(crate) const BOARD_FORGET_MS: u64 = 60_000;

/// Milliseconds since the epoch, by this host's clock.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::routes::*;
    use super::*;
    use crate::state::StateStore;
    use crate::state::{Breaker, BreakerState};
    use std::time::Duration;

    fn breaker(scope: &str, state: BreakerState, from_fleet: bool) -> Breaker {
        Breaker {
            scope: scope.into(),
            state,
            half_open_fraction: 0.0,
            retry_after_seconds: 5,
            reason: None,
            since: SystemTime::UNIX_EPOCH,
            from_fleet,
        }
    }

    #[test]
    fn fleet_breakers_merge_under_local_ones_and_survive_local_rounds() {
        let store = StateStore::new(SystemTime::UNIX_EPOCH);
        assert!(store.set_fleet_breakers(
            SystemTime::now(),
            vec![
                breaker("backend:a", BreakerState::Open, true),
                breaker("backend:b", BreakerState::Open, true),
            ],
        ));
        assert_eq!(store.current().breakers.len(), 2);
        // A monitor round writes the local breakers: the fleet's stay, and
        // a local one of the same scope wins.
        store.update(SystemTime::now(), |s| {
            s.breakers = vec![breaker("backend:a", BreakerState::HalfOpen, false)];
        });
        let now = store.current();
        let scopes: Vec<(&str, BreakerState)> = now
            .breakers
            .iter()
            .map(|b| (b.scope.as_str(), b.state))
            .collect();
        assert_eq!(
            scopes,
            [
                ("backend:a", BreakerState::HalfOpen),
                ("backend:b", BreakerState::Open)
            ]
        );
        let version = now.version;
        // Nothing new: no new version (no needless long-poll answers).
        store.set_fleet_breakers(
            SystemTime::now(),
            vec![breaker("backend:b", BreakerState::Open, true)],
        );
        assert_eq!(store.current().version, version);
        store.set_fleet_breakers(SystemTime::now(), Vec::new());
        assert_eq!(store.current().breakers.len(), 1);
    }

    const SECRET: &str = "unit-test-fleet-secret";

    /// A policy with a per-caller rate, a per-caller daily budget (hard), a
    /// soft daily cap and a global rate, and one fleet-wide concurrency.
    pub(crate) fn view(salt: &str) -> PolicyView {
        let policy = serde_json::json!({
            "default_tier": "t",
            "identity": {"sources": ["client_address"]},
            "tiers": {"t": {"requests": "10/min", "daily_tokens": "5000"}},
            "routes": [{"name": "chat", "path_prefix": "/", "requests": "100/min"}],
            "models": {"m": {"concurrency": 2, "backend": "b"}},
            "sidecar": {"cluster": "sc"},
            "fleet": {"salt": salt, "expected_replicas": 2},
        });
        PolicyView::of(sluice_core::Policy::from_value(policy).unwrap())
    }

    #[test]
    fn redis_key_names_are_salted_hashes() {
        let a = redis_key("", "tier/free/requests", 42);
        let b = redis_key("fleet-secret", "tier/free/requests", 42);
        let c = redis_key("fleet-secret", "tier/free/requests", 43);
        assert_ne!(a, b, "the salt changes every name");
        assert_ne!(b, c, "owners have their own names");
        // Pinned: a fleet's sidecars of two releases count in the same keys.
        assert_eq!(b, "ad918153b31e4bad099618bb98f27676");
    }

    pub(crate) fn fleet_on(redis: &str, salt: &str) -> Arc<Fleet> {
        let config = FleetConfig {
            redis: redis.into(),
            ..FleetConfig::default()
        };
        let loaded = Loaded {
            client: redis::Client::open(redis).unwrap(),
            view: view(salt),
            secret: SECRET.into(),
        };
        Fleet::with(config, loaded)
    }

    fn claim(rule: &str, owner: u64, window_end_ms: u64, need: u64) -> TakeClaim {
        TakeClaim {
            rule: rule.into(),
            owner,
            window_end_ms,
            need,
            want: need,
        }
    }

    fn take_req(id: &str, deadline_ms: u64, claims: Vec<TakeClaim>) -> TakeRequest {
        TakeRequest {
            id: id.into(),
            deadline_ms,
            claims,
        }
    }

    fn day_end(fleet: &Fleet) -> u64 {
        window_end(&fleet.view().rules["tier/t/daily_tokens"].limit, now_ms())
    }

    #[tokio::test]
    async fn bad_claims_are_refused_before_redis_is_asked() {
        // Nothing listens there: a request that got as far as Redis would
        // answer Unavailable, not Invalid.
        let fleet = fleet_on("redis://127.0.0.1:1", "unit-test-salt-0123");
        let far = now_ms() + 60_000;
        let end = day_end(&fleet);
        let bad = [
            (claim("tier/nope/requests", 7, 0, 1), "claims[0].rule"),
            (claim("tier/t/requests", 1, 0, 1), "claims[0].owner"),
            (claim("route/chat/requests", 7, 0, 1), "claims[0].owner"),
            (
                claim("tier/t/requests", 7, end, 1),
                "claims[0].window_end_ms",
            ),
            (
                claim("tier/t/daily_tokens", 7, 0, 1),
                "claims[0].window_end_ms",
            ),
            (
                claim("tier/t/daily_tokens", 7, end + 86_400_000, 1),
                "claims[0].window_end_ms",
            ),
            (claim("tier/t/requests", 7, 0, 1 << 53), "claims[0]"),
        ];
        for (c, why) in bad {
            match fleet.take(&take_req("t1", far, vec![c])).await {
                Err(FleetError::Invalid(m)) => assert!(m.contains(why), "{m}"),
                other => panic!("{why}: {other:?}"),
            }
        }
        assert!(matches!(
            fleet.take(&take_req("t1", far, Vec::new())).await,
            Err(FleetError::Invalid(_))
        ));
        assert!(matches!(
            fleet
                .take(&take_req(
                    "no spaces",
                    far,
                    vec![claim("tier/t/requests", 7, 0, 1)]
                ))
                .await,
            Err(FleetError::Invalid(_))
        ));
        let give = GiveRequest {
            id: "no spaces allowed".into(),
            items: Vec::new(),
        };
        assert!(matches!(
            fleet.give(&give).await,
            Err(FleetError::Invalid(_))
        ));
        // A give-back larger than the bucket could reset it: refused.
        let give = GiveRequest {
            id: "g1".into(),
            items: vec![GiveItem {
                rule: "tier/t/daily_tokens".into(),
                owner: 7,
                window_end_ms: end,
                delta: 5_001,
                take: None,
            }],
        };
        match fleet.give(&give).await {
            Err(FleetError::Invalid(m)) => assert!(m.contains("items[0].delta"), "{m}"),
            other => panic!("{other:?}"),
        }
        let ok = take_req("t1", far, vec![claim("tier/t/daily_tokens", 7, end, 1)]);
        assert!(matches!(
            fleet.take(&ok).await,
            Err(FleetError::Unavailable(_))
        ));
    }

    #[test]
    fn the_secret_is_compared_whole() {
        let fleet = fleet_on("redis://127.0.0.1:1", "unit-test-salt-0123");
        assert!(fleet.secret_ok(SECRET.as_bytes()));
        for bad in [
            "",
            "unit-test-fleet-secre",
            "unit-test-fleet-secret!",
            "UNIT-test-fleet-secret",
        ] {
            assert!(!fleet.secret_ok(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn only_the_envoy_beside_the_sidecar_is_heard() {
        use axum::http::{HeaderMap, HeaderValue};
        let fleet = fleet_on("redis://127.0.0.1:1", "unit-test-salt-0123");
        let local: Peer = Some(axum::Extension(axum::extract::ConnectInfo(
            "127.0.0.1:5000".parse().unwrap(),
        )));
        let remote: Peer = Some(axum::Extension(axum::extract::ConnectInfo(
            "10.0.0.9:5000".parse().unwrap(),
        )));
        let good = || {
            let mut h = HeaderMap::new();
            h.insert("content-type", HeaderValue::from_static("application/json"));
            h.insert(
                sluice_wire::fleet::SECRET_HEADER,
                HeaderValue::from_static(SECRET),
            );
            h.insert(
                sluice_wire::fleet::FINGERPRINT_HEADER,
                HeaderValue::from_str(&fleet.view().fingerprint).unwrap(),
            );
            h
        };
        assert!(refuse(&fleet, &local, &good()).is_none());
        let status =
            |peer: &Peer, h: &HeaderMap| refuse(&fleet, peer, h).map(|r| r.status().as_u16());
        assert_eq!(status(&remote, &good()), Some(403));
        assert_eq!(status(&None, &good()), Some(403));
        let mut h = good();
        h.insert("origin", HeaderValue::from_static("https://evil.example"));
        assert_eq!(status(&local, &h), Some(403), "a web page");
        for ct in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/jsonx",
        ] {
            let mut h = good();
            h.insert("content-type", HeaderValue::from_str(ct).unwrap());
            assert_eq!(status(&local, &h), Some(415), "{ct}");
        }
        let mut h = good();
        h.insert(
            "content-type",
            HeaderValue::from_static("Application/JSON; charset=utf-8"),
        );
        assert_eq!(status(&local, &h), None);
        let mut h = good();
        h.remove("content-type");
        assert_eq!(status(&local, &h), Some(415));
        let mut h = good();
        h.remove(sluice_wire::fleet::SECRET_HEADER);
        assert_eq!(status(&local, &h), Some(401));
        let mut h = good();
        h.insert(
            sluice_wire::fleet::SECRET_HEADER,
            HeaderValue::from_static("guess-guess-guess-1"),
        );
        assert_eq!(status(&local, &h), Some(401));
        let mut h = good();
        h.insert(
            sluice_wire::fleet::FINGERPRINT_HEADER,
            HeaderValue::from_static("00"),
        );
        assert_eq!(
            status(&local, &h),
            Some(409),
            "another policy than the sidecar's"
        );
        assert_eq!(fleet.stats.refused_calls.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn the_fleet_section_reads_its_secrets_from_outside_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("policy.yaml");
        std::fs::write(
            &policy,
            "default_tier: t\nidentity: {sources: [client_address]}\ntiers: {t: {requests: 10/min}}\n\
             sidecar: {cluster: sc}\nfleet: {salt: unit-test-salt-0123}\n",
        )
        .unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
        let ok = FleetConfig {
            policy: Some(policy.clone()),
            secret_file: Some(secret.clone()),
            ..FleetConfig::default()
        };
        let loaded = ok.load().unwrap();
        assert_eq!(
            loaded.secret, SECRET,
            "the trailing newline is no part of it"
        );
        let err = |c: FleetConfig| c.load().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(FleetConfig {
            policy: None,
            ..ok.clone()
        })
        .contains("fleet.policy"));
        let short = dir.path().join("short");
        std::fs::write(&short, "short").unwrap();
        assert!(err(FleetConfig {
            secret_file: Some(short),
            ..ok.clone()
        })
        .contains("fleet.secret_file"));
        assert!(err(FleetConfig {
            secret_file: None,
            secret_env: "SLUICE_TEST_UNSET_SECRET".into(),
            ..ok.clone()
        })
        .contains("fleet.secret_env"));
        assert!(err(FleetConfig {
            redis: "redis://:hunter2@127.0.0.1:6379".into(),
            ..ok.clone()
        })
        .contains("fleet.redis: no password in the URL"));
        assert!(err(FleetConfig {
            redis: "http://127.0.0.1".into(),
            ..ok.clone()
        })
        .contains("fleet.redis"));
        assert!(err(FleetConfig {
            password_env: Some("SLUICE_TEST_UNSET_PASSWORD".into()),
            ..ok.clone()
        })
        .contains("fleet.password_env"));
        assert!(err(FleetConfig {
            tls_ca_file: Some(secret.clone()),
            ..ok.clone()
        })
        .contains("fleet.tls_ca_file: needs a `rediss://` URL"));
        let password = dir.path().join("password");
        std::fs::write(&password, "hunter2\n").unwrap();
        assert!(
            FleetConfig {
                redis: "rediss://127.0.0.1:6380".into(),
                password_file: Some(password),
                ..ok.clone()
            }
            .load()
            .is_ok(),
            "rediss:// builds with rustls"
        );
        // A policy without a fleet section is no fleet agent's policy.
        std::fs::write(
            &policy,
            "default_tier: t\nidentity: {sources: [client_address]}\ntiers: {t: {}}\n",
        )
        .unwrap();
        assert!(err(ok).contains("fleet.policy"));
    }

    #[test]
    fn a_changed_policy_file_is_read_again_and_a_bad_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("policy.yaml");
        let text = |salt: &str| {
            format!(
                "default_tier: t\nidentity: {{sources: [client_address]}}\ntiers: {{t: {{requests: 10/min}}}}\n\
                 sidecar: {{cluster: sc}}\nfleet: {{salt: {salt}}}\n"
            )
        };
        let write = |body: &str, secs: u64| {
            std::fs::write(&policy, body).unwrap();
            let f = std::fs::File::options().write(true).open(&policy).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
                .unwrap();
        };
        write(&text("unit-test-salt-0123"), 1_000);
        std::env::set_var("SLUICE_TEST_RELOAD_SECRET", SECRET);
        let config = FleetConfig {
            policy: Some(policy.clone()),
            secret_env: "SLUICE_TEST_RELOAD_SECRET".into(),
            ..FleetConfig::default()
        };
        let fleet = Fleet::new(config).unwrap();
        let first = fleet.view().fingerprint.clone();
        fleet.reload_policy();
        assert_eq!(fleet.view().fingerprint, first, "unchanged: not read again");
        write(&text("unit-test-salt-4567"), 2_000);
        fleet.reload_policy();
        let second = fleet.view().fingerprint.clone();
        assert_ne!(second, first, "the new salt is this sidecar's view now");
        write(&text("short"), 3_000);
        fleet.reload_policy();
        assert_eq!(
            fleet.view().fingerprint,
            second,
            "a bad policy is not taken"
        );
    }

    #[test]
    fn an_epoch_carries_the_time_of_the_loss() {
        assert_eq!(Epoch::parse("ab12:0".into()).lost_at_ms, 0);
        assert_eq!(
            Epoch::parse("ab12:1700000000000".into()).lost_at_ms,
            1_700_000_000_000
        );
    }
}

/// The scripts against a real `redis-server` (Debian's; skipped, saying
/// so, where there is none).
#[cfg(test)]
pub(crate) mod redis_tests {
    #[allow(unused_imports)]
    use super::routes::*;
    use super::tests::fleet_on;
    use super::*;
    pub(crate) use crate::redis::testing::{server, Server};
    use std::time::Duration;

    async fn cmd(url: &str, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(url).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query_async(&mut conn).await.unwrap()
    }

    async fn used(fleet: &Fleet, url: &str, owner: u64, end: u64) -> i64 {
        let key = super::redis_key(&fleet.view().salt, "tier/t/daily_tokens", owner);
        match cmd(url, &["GET", &format!("{PREFIX}{key}:{end}")]).await {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).parse().unwrap(),
            _ => 0,
        }
    }

    fn budget(owner: u64, end: u64, need: u64) -> TakeClaim {
        TakeClaim {
            rule: "tier/t/daily_tokens".into(),
            owner,
            window_end_ms: end,
            need,
            want: need,
        }
    }

    fn req(id: &str, deadline_ms: u64, claims: Vec<TakeClaim>) -> TakeRequest {
        TakeRequest {
            id: id.into(),
            deadline_ms,
            claims,
        }
    }

    fn cancel(id: &str, owner: u64, end: u64) -> GiveItem {
        GiveItem {
            rule: "tier/t/daily_tokens".into(),
            owner,
            window_end_ms: end,
            delta: 0,
            take: Some(id.into()),
        }
    }

    #[tokio::test]
    async fn late_takes_are_not_applied_and_abandoned_ones_are_given_back_once() {
        let Some(redis) = server() else { return };
        let fleet = fleet_on(&redis.url, "unit-test-salt-0123");
        let end = window_end(&fleet.view().rules["tier/t/daily_tokens"].limit, now_ms());
        let soon = now_ms() + 60_000;
        // Applied, then abandoned by the filter: given back once.
        let a = fleet
            .take(&req("take-a", soon, vec![budget(7, end, 100)]))
            .await
            .unwrap();
        assert!(a.ok && a.grants == [100], "{a:?}");
        assert_eq!(used(&fleet, &redis.url, 7, end).await, 100);
        for batch in ["g1", "g2"] {
            let give = GiveRequest {
                id: batch.into(),
                items: vec![cancel("take-a", 7, end)],
            };
            assert!(fleet.give(&give).await.unwrap());
        }
        assert_eq!(
            used(&fleet, &redis.url, 7, end).await,
            0,
            "given back once, not twice"
        );
        // Past its deadline when Redis runs it: not applied.
        let late = fleet
            .take(&req("take-b", now_ms() - 1, vec![budget(7, end, 100)]))
            .await;
        assert!(matches!(late, Err(FleetError::Late(_))), "{late:?}");
        assert_eq!(used(&fleet, &redis.url, 7, end).await, 0);
        // Undone before it arrived: refused when it does.
        let give = GiveRequest {
            id: "g3".into(),
            items: vec![cancel("take-c", 7, end)],
        };
        assert!(fleet.give(&give).await.unwrap());
        let c = fleet
            .take(&req("take-c", soon, vec![budget(7, end, 100)]))
            .await;
        assert!(matches!(c, Err(FleetError::Late(_))), "{c:?}");
        assert_eq!(used(&fleet, &redis.url, 7, end).await, 0);
        assert_eq!(fleet.stats.takes_late.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_redis_that_lost_its_data_refuses_the_hard_budgets_of_that_window() {
        let Some(redis) = server() else { return };
        let one = fleet_on(&redis.url, "unit-test-salt-0123");
        let two = fleet_on(&redis.url, "unit-test-salt-0123");
        let end = window_end(&one.view().rules["tier/t/daily_tokens"].limit, now_ms());
        let soon = now_ms() + 60_000;
        assert!(
            one.take(&req("e1", soon, vec![budget(7, end, 4_000)]))
                .await
                .unwrap()
                .ok
        );
        assert!(
            two.take(&req("e2", soon, vec![budget(8, end, 10)]))
                .await
                .unwrap()
                .ok
        );
        cmd(&redis.url, &["FLUSHALL"]).await;
        // The budget's count is gone: refused, on both sidecars, for the
        // rest of the window (the filter follows on_unavailable.data_lost).
        for (fleet, id) in [(&one, "e3"), (&two, "e4"), (&one, "e5")] {
            let r = fleet
                .take(&req(id, soon, vec![budget(7, end, 4_000)]))
                .await;
            assert!(matches!(r, Err(FleetError::DataLost(_))), "{r:?}");
        }
        assert_eq!(one.stats.data_lost.load(Ordering::Relaxed), 1);
        assert_eq!(two.stats.data_lost.load(Ordering::Relaxed), 1);
        // A rate (token bucket) refills anyway: it goes on in Redis.
        let rate = TakeClaim {
            rule: "tier/t/requests".into(),
            owner: 7,
            window_end_ms: 0,
            need: 1,
            want: 1,
        };
        assert!(one.take(&req("e6", soon, vec![rate])).await.unwrap().ok);
        // The next window is counted in Redis again.
        let next = window_end(&one.view().rules["tier/t/daily_tokens"].limit, end);
        let mut epoch = one.epoch(None).await.unwrap();
        assert!(
            epoch.lost_at_ms > 0
                && window_end(
                    &one.view().rules["tier/t/daily_tokens"].limit,
                    epoch.lost_at_ms
                ) == end
        );
        epoch.lost_at_ms = 0;
        assert!(next > end);
    }

    /// `rediss://` with a throwaway CA (openssl, at test time) and a
    /// password from a file, against Debian's redis-server (built with TLS).
    #[tokio::test]
    async fn rediss_with_a_ca_file_and_a_password_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let openssl = |args: &[&str]| {
            std::process::Command::new("openssl")
                .args(args)
                .current_dir(d)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        std::fs::write(d.join("ext"), "subjectAltName=DNS:localhost\n").unwrap();
        let made = openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "1",
            "-subj",
            "/CN=sluice test CA",
        ]) && openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]) && openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "1",
            "-extfile",
            "ext",
        ]);
        if !made {
            eprintln!("openssl missing: skipping the TLS test");
            return;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                "server.pem",
                "--tls-key-file",
                "server.key",
                "--tls-ca-cert-file",
                "ca.pem",
                "--tls-auth-clients",
                "no",
                "--requirepass",
                "tls-test-password",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .current_dir(d)
            .stdout(std::process::Stdio::null())
            .spawn();
        let Ok(child) = child else {
            eprintln!("redis-server missing: skipping the TLS test");
            return;
        };
        let _server = Server {
            child,
            url: String::new(),
            _dir: tempfile::tempdir().unwrap(),
        };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        std::fs::write(d.join("password"), "tls-test-password\n").unwrap();
        let url = format!("rediss://localhost:{port}");
        let config = |password: bool, ca: bool| FleetConfig {
            redis: url.clone(),
            timeout: Duration::from_secs(2),
            password_file: password.then(|| d.join("password")),
            tls_ca_file: ca.then(|| d.join("ca.pem")),
            ..FleetConfig::default()
        };
        let fleet = |c: FleetConfig| {
            let client = crate::redis::client(&c).unwrap();
            Fleet::with(
                c,
                Loaded {
                    client,
                    view: super::tests::view("unit-test-salt-0123"),
                    secret: "unit-test-fleet-secret".into(),
                },
            )
        };
        let rate = || TakeClaim {
            rule: "tier/t/requests".into(),
            owner: 7,
            window_end_ms: 0,
            need: 1,
            want: 1,
        };
        let ok = fleet(config(true, true));
        let got = ok
            .take(&req("tls-1", now_ms() + 60_000, vec![rate()]))
            .await;
        assert!(got.as_ref().is_ok_and(|a| a.ok), "{got:?}");
        // Without the password, without trusting the CA, or in plain text
        // to the TLS port: no Redis, and the reason says which.
        let plain = FleetConfig {
            redis: format!("redis://localhost:{port}"),
            ..config(true, false)
        };
        for (c, says) in [
            (config(false, true), "wants a password"),
            (config(true, false), "not signed by fleet.tls_ca_file"),
            (plain, "plain text (`redis://`) to a TLS port"),
        ] {
            let f = fleet(c);
            let got = f.take(&req("tls-2", now_ms() + 60_000, vec![rate()])).await;
            let Err(FleetError::Unavailable(why)) = &got else {
                panic!("{got:?}");
            };
            let hint = crate::redis::link::hint(why).unwrap_or_default();
            assert!(hint.contains(says), "{why}: {hint}");
            assert!(!why.contains("tls-test-password"), "{why}");
            assert_eq!(f.redis().link.errors(), 1);
            assert!(!f.redis().link.up());
        }
    }

    #[tokio::test]
    async fn sidecars_with_different_salts_see_the_mismatch() {
        let Some(redis) = server() else { return };
        let one = fleet_on(&redis.url, "unit-test-salt-0123");
        let two = fleet_on(&redis.url, "unit-test-salt-4567");
        let same = fleet_on(&redis.url, "unit-test-salt-0123");
        assert!(
            one.compare_fingerprints("one").await.unwrap(),
            "alone: agrees"
        );
        assert!(same.compare_fingerprints("same").await.unwrap());
        assert!(!two.compare_fingerprints("two").await.unwrap());
        assert!(!one.compare_fingerprints("one").await.unwrap());
        cmd(&redis.url, &["HDEL", FINGERPRINTS_KEY, "two"]).await;
        assert!(
            one.compare_fingerprints("one").await.unwrap(),
            "gone: agrees again"
        );
        one.stats.mismatch.store(true, Ordering::Relaxed);
        let end = window_end(&one.view().rules["tier/t/daily_tokens"].limit, now_ms());
        let r = one
            .take(&req("m1", now_ms() + 60_000, vec![budget(7, end, 1)]))
            .await;
        assert!(matches!(r, Err(FleetError::Mismatch(_))), "{r:?}");
    }
}
