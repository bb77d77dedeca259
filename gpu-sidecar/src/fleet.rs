//! The fleet agent: this sidecar's Redis connection, on behalf of the one
//! Envoy beside it (SPEC §7). The filter never talks to Redis; it asks
//! here over the HTTP channel it already has:
//!
//! - `POST /v1/fleet/take`: every claim of one request, all or nothing,
//!   in one Lua script (atomic in Redis). Each claim says what it needs
//!   now (`need`) and how big a lease it would like (`want`); the script
//!   grants at least `need` and at most a fair share of what is left
//!   (`left ÷ replicas`). Near the end of a bucket the fair share falls
//!   under `need` and the grant is exactly `need`: the strict path, with
//!   nothing stranded.
//! - `POST /v1/fleet/give`: lease returns and settlement deltas, in a
//!   batch with an id; the script records the id first (`SET NX`) so a
//!   batch retried after a lost answer is applied once.
//!
//! Redis keys carry hashes made by the filter (never raw API keys); window
//! keys expire with their window, token-bucket keys once they would be
//! full again. Both endpoints answer loopback callers only (they spend and
//! refund quota), and 503 `fleet_unavailable` while Redis does not answer:
//! the filter then follows its `on_unavailable` policy.
//!
//! The kill switch and the breakers are fleet-wide too: [`sync_kill_switch`]
//! keeps this sidecar's switch and the one in Redis equal (a change here is
//! written there; a newer one there is applied here and so pushed to the
//! Envoy through the long poll); [`sync_breakers`] publishes this sidecar's
//! open breakers and serves every other live sidecar's.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use crate::admin::KillSwitchControl;
use crate::state::StateStore;

/// Longest batch or claim list accepted in one call.
pub const MAX_ITEMS: usize = 1024;
/// How long a batch id is remembered. A batch is sent again only when its
/// answer was lost, within a second of the sidecar answering again: an
/// hour is ample, and bounds the ids kept (one per batch).
const APPLIED_TTL_MS: u64 = 3_600_000;
/// Keys outlive their window by this much (clock skew between Envoys).
const KEY_GRACE_MS: u64 = 60_000;
const PREFIX: &str = "sluice:fleet:";

/// Takes every claim or none. KEYS: one bucket key per claim. ARGV[1]:
/// replicas; then per claim 7 numbers: capacity, refill amount, refill
/// period (ms), window end (ms since the epoch; 0 = token bucket), need,
/// want, soft (1: a soft cap, taken even past its limit — it never
/// refuses, the filter downshifts instead). Answers `{1, grant…, left…}` or `{0, index, left}`.
const TAKE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replicas = math.max(1, tonumber(ARGV[1]))
local n = #KEYS
local levels = {}
for i = 1, n do
  local b = 1 + (i - 1) * 7
  local cap = tonumber(ARGV[b + 1])
  local amount = tonumber(ARGV[b + 2])
  local period = tonumber(ARGV[b + 3])
  local wend = tonumber(ARGV[b + 4])
  local need = tonumber(ARGV[b + 5])
  local level
  if wend > 0 then
    level = cap - tonumber(redis.call('GET', KEYS[i]) or '0')
  else
    local v = redis.call('HMGET', KEYS[i], 'l', 't')
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
for i = 1, n do
  local b = 1 + (i - 1) * 7
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
    redis.call('INCRBY', KEYS[i], grant)
    redis.call('PEXPIREAT', KEYS[i], wend + tonumber(ARGV[2 + n * 7]))
  else
    redis.call('HSET', KEYS[i], 'l', tostring(levels[i] - grant), 't', now)
    local full = 0
    if amount > 0 then full = math.ceil(cap * period / amount) end
    redis.call('PEXPIRE', KEYS[i], full + tonumber(ARGV[2 + n * 7]))
  end
  out[#out + 1] = grant
  left[i] = math.max(0, math.floor(levels[i] - grant))
end
for i = 1, n do out[#out + 1] = left[i] end
return out
"#;

/// Applies a batch once. KEYS[1]: the batch id's key; then one bucket key
/// per item. ARGV: per item 5 numbers: capacity, refill amount, period,
/// window end (0 = token bucket), delta (> 0 gives back, < 0 charges).
/// Answers 1 when applied, 0 when this id was applied before.
const GIVE: &str = r#"
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #KEYS do
  local b = 2 + (i - 2) * 5
  local cap = tonumber(ARGV[b])
  local amount = tonumber(ARGV[b + 1])
  local period = tonumber(ARGV[b + 2])
  local wend = tonumber(ARGV[b + 3])
  local delta = tonumber(ARGV[b + 4])
  if wend > 0 then
    if wend > now then
      local used = tonumber(redis.call('GET', KEYS[i]) or '0')
      local nextv = math.max(0, used - delta)
      redis.call('SET', KEYS[i], nextv, 'PXAT', wend + tonumber(ARGV[2 + (#KEYS - 1) * 5]))
    end
  else
    local v = redis.call('HMGET', KEYS[i], 'l', 't')
    local level = tonumber(v[1]) or cap
    local last = tonumber(v[2]) or now
    if now > last and period > 0 then
      level = math.min(cap, level + (now - last) * amount / period)
    end
    level = math.min(cap, level + delta)
    redis.call('HSET', KEYS[i], 'l', tostring(level), 't', now)
    local full = 0
    if amount > 0 then full = math.ceil(cap * period / amount) end
    redis.call('PEXPIRE', KEYS[i], full + tonumber(ARGV[2 + (#KEYS - 1) * 5]))
  end
end
return 1
"#;

/// The sidecar's `fleet:` section.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// `redis://host:port[/db]`.
    pub redis: String,
    /// Per Redis command, connection included.
    #[serde(deserialize_with = "crate::config::duration")]
    pub timeout: Duration,
    /// How often the fleet-wide kill switch is compared with Redis.
    #[serde(deserialize_with = "crate::config::duration")]
    pub sync_interval: Duration,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            redis: "redis://127.0.0.1:6379".into(),
            timeout: Duration::from_millis(250),
            sync_interval: Duration::from_millis(100),
        }
    }
}

/// A bucket as the filter describes it (its rule's limit).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Shape {
    pub capacity: u64,
    /// Refill: `amount` units every `period_ms` (token buckets).
    pub amount: u64,
    pub period_ms: u64,
    /// End of the calendar window; 0 for a token bucket.
    pub window_end_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TakeClaim {
    /// Hex hash of the rule and caller, made by the filter.
    pub key: String,
    #[serde(flatten)]
    pub shape: Shape,
    pub need: u64,
    pub want: u64,
    /// A soft cap: taken even past its limit.
    #[serde(default)]
    pub soft: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TakeRequest {
    pub replicas: u64,
    pub claims: Vec<TakeClaim>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TakeAnswer {
    pub ok: bool,
    /// Granted per claim (ok), each at least its `need`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<u64>,
    /// Left globally per claim after the grant (ok), or in the claim that
    /// refused.
    pub left: Vec<u64>,
    /// The claim that refused (not ok).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<usize>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GiveItem {
    pub key: String,
    #[serde(flatten)]
    pub shape: Shape,
    /// > 0 gives units back, < 0 charges them.
    pub delta: i64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GiveRequest {
    /// Unique per batch; a retry sends the same id.
    pub id: String,
    pub items: Vec<GiveItem>,
}

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("{0}")]
    Invalid(String),
    #[error("redis: {0}")]
    Unavailable(String),
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct FleetStats {
    pub takes: AtomicU64,
    pub takes_refused: AtomicU64,
    pub gives: AtomicU64,
    pub gives_repeated: AtomicU64,
    pub errors: AtomicU64,
    pub up: AtomicBool,
}

/// One Redis connection, reconnected on demand.
pub struct Fleet {
    client: redis::Client,
    config: FleetConfig,
    conn: Mutex<Option<ConnectionManager>>,
    take: redis::Script,
    give: redis::Script,
    pub stats: FleetStats,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("config", &self.config)
            .finish()
    }
}

fn key_ok(key: &str) -> bool {
    (16..=64).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Fleet {
    pub fn new(config: FleetConfig) -> Result<Arc<Fleet>, FleetError> {
        let client = redis::Client::open(config.redis.as_str())
            .map_err(|e| FleetError::Invalid(format!("fleet.redis: {e}")))?;
        Ok(Arc::new(Fleet {
            client,
            config,
            conn: Mutex::new(None),
            take: redis::Script::new(TAKE),
            give: redis::Script::new(GIVE),
            stats: FleetStats::default(),
        }))
    }

    /// The connection, made now if there is none (bounded by `timeout`).
    async fn connection(&self) -> Result<ConnectionManager, FleetError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.config.timeout))
            .set_response_timeout(Some(self.config.timeout))
            .set_number_of_retries(1);
        let made = tokio::time::timeout(
            self.config.timeout * 2,
            self.client.get_connection_manager_with_config(cfg),
        )
        .await
        .map_err(|_| FleetError::Unavailable("connect timed out".into()))?
        .map_err(|e| FleetError::Unavailable(e.to_string()))?;
        *slot = Some(made.clone());
        Ok(made)
    }

    fn failed(&self, e: impl std::fmt::Display) -> FleetError {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if self.stats.up.swap(false, Ordering::Relaxed) {
            eprintln!(
                "sluice-sidecar: fleet: Redis unavailable ({e}); answering 503 fleet_unavailable"
            );
        }
        FleetError::Unavailable(e.to_string())
    }

    fn ok(&self) {
        if !self.stats.up.swap(true, Ordering::Relaxed) {
            eprintln!("sluice-sidecar: fleet: Redis reachable");
        }
    }

    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T, FleetError> {
        let mut conn = self.connection().await.map_err(|e| self.failed(e))?;
        let answer = tokio::time::timeout(
            self.config.timeout * 2,
            invocation.invoke_async::<T>(&mut conn),
        )
        .await
        .map_err(|_| self.failed("timed out"))?
        .map_err(|e| self.failed(e))?;
        self.ok();
        Ok(answer)
    }

    pub async fn take(&self, req: &TakeRequest) -> Result<TakeAnswer, FleetError> {
        if req.claims.is_empty() || req.claims.len() > MAX_ITEMS {
            return Err(FleetError::Invalid(format!(
                "claims: 1 to {MAX_ITEMS} expected"
            )));
        }
        let mut inv = self.take.prepare_invoke();
        inv.arg(req.replicas.max(1));
        for (i, c) in req.claims.iter().enumerate() {
            if !key_ok(&c.key) {
                return Err(FleetError::Invalid(format!(
                    "claims[{i}].key: 16 to 64 hex digits expected"
                )));
            }
            check_shape(&c.shape, &format!("claims[{i}]"))?;
            inv.key(format!("{PREFIX}{}:{}", c.key, c.shape.window_end_ms));
            inv.arg(c.shape.capacity)
                .arg(c.shape.amount)
                .arg(c.shape.period_ms)
                .arg(c.shape.window_end_ms)
                .arg(c.need)
                .arg(c.want.max(c.need))
                .arg(u8::from(c.soft));
        }
        inv.arg(KEY_GRACE_MS);
        let raw: Vec<i64> = self.run(inv).await?;
        let n = req.claims.len();
        self.stats.takes.fetch_add(1, Ordering::Relaxed);
        let num = |i: usize| raw.get(i).copied().unwrap_or(0).max(0) as u64;
        if raw.first() == Some(&1) && raw.len() == 1 + 2 * n {
            Ok(TakeAnswer {
                ok: true,
                grants: (1..=n).map(num).collect(),
                left: (n + 1..=2 * n).map(num).collect(),
                refused: None,
            })
        } else {
            self.stats.takes_refused.fetch_add(1, Ordering::Relaxed);
            Ok(TakeAnswer {
                ok: false,
                grants: Vec::new(),
                left: vec![num(2)],
                refused: Some((num(1) as usize).saturating_sub(1)),
            })
        }
    }

    /// Applies a batch; `false` when its id was applied before.
    pub async fn give(&self, req: &GiveRequest) -> Result<bool, FleetError> {
        if req.items.len() > MAX_ITEMS {
            return Err(FleetError::Invalid(format!(
                "items: at most {MAX_ITEMS} expected"
            )));
        }
        if req.id.is_empty()
            || req.id.len() > 64
            || !req
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(FleetError::Invalid(
                "id: 1 to 64 letters, digits or '-' expected".into(),
            ));
        }
        let mut inv = self.give.prepare_invoke();
        inv.key(format!("{PREFIX}applied:{}", req.id));
        inv.arg(APPLIED_TTL_MS);
        for (i, item) in req.items.iter().enumerate() {
            if !key_ok(&item.key) {
                return Err(FleetError::Invalid(format!(
                    "items[{i}].key: 16 to 64 hex digits expected"
                )));
            }
            check_shape(&item.shape, &format!("items[{i}]"))?;
            inv.key(format!("{PREFIX}{}:{}", item.key, item.shape.window_end_ms));
            inv.arg(item.shape.capacity)
                .arg(item.shape.amount)
                .arg(item.shape.period_ms)
                .arg(item.shape.window_end_ms)
                .arg(item.delta);
        }
        inv.arg(KEY_GRACE_MS);
        let applied: i64 = self.run(inv).await?;
        self.stats.gives.fetch_add(1, Ordering::Relaxed);
        if applied == 0 {
            self.stats.gives_repeated.fetch_add(1, Ordering::Relaxed);
        }
        Ok(applied == 1)
    }

    async fn get_kill_switch(&self) -> Result<Option<Shared>, FleetError> {
        let mut conn = self.connection().await.map_err(|e| self.failed(e))?;
        let raw: Option<String> = tokio::time::timeout(
            self.config.timeout * 2,
            redis::cmd("GET")
                .arg(format!("{PREFIX}kill_switch"))
                .query_async(&mut conn),
        )
        .await
        .map_err(|_| self.failed("timed out"))?
        .map_err(|e| self.failed(e))?;
        self.ok();
        Ok(raw.and_then(|r| serde_json::from_str(&r).ok()))
    }

    /// Publishes this sidecar's breakers (`body`, written every time: it
    /// doubles as liveness) and reads every sidecar's, in one round trip.
    async fn swap_breakers(
        &self,
        id: &str,
        body: &str,
    ) -> Result<Vec<(String, String)>, FleetError> {
        let mut conn = self.connection().await.map_err(|e| self.failed(e))?;
        let key = format!("{PREFIX}breakers");
        let mut pipe = redis::pipe();
        pipe.cmd("HSET").arg(&key).arg(id).arg(body).ignore();
        pipe.cmd("HGETALL").arg(&key);
        let (all,): (Vec<(String, String)>,) =
            tokio::time::timeout(self.config.timeout * 2, pipe.query_async(&mut conn))
                .await
                .map_err(|_| self.failed("timed out"))?
                .map_err(|e| self.failed(e))?;
        Ok(all)
    }

    async fn forget_breakers(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        if let Ok(mut conn) = self.connection().await {
            let _ = tokio::time::timeout(
                self.config.timeout * 2,
                redis::cmd("HDEL")
                    .arg(format!("{PREFIX}breakers"))
                    .arg(ids)
                    .query_async::<i64>(&mut conn),
            )
            .await;
        }
    }

    async fn put_kill_switch(&self, value: &Shared) -> Result<(), FleetError> {
        let mut conn = self.connection().await.map_err(|e| self.failed(e))?;
        let body = serde_json::to_string(value).map_err(|e| FleetError::Invalid(e.to_string()))?;
        tokio::time::timeout(
            self.config.timeout * 2,
            redis::cmd("SET")
                .arg(format!("{PREFIX}kill_switch"))
                .arg(body)
                .query_async::<()>(&mut conn),
        )
        .await
        .map_err(|_| self.failed("timed out"))?
        .map_err(|e| self.failed(e))?;
        Ok(())
    }
}

fn check_shape(s: &Shape, path: &str) -> Result<(), FleetError> {
    let max = 1u64 << 52; // exact in Lua's doubles
    if s.capacity == 0 || s.capacity > max || s.amount > max || s.period_ms > max {
        return Err(FleetError::Invalid(format!(
            "{path}: capacity 1 to 2^52, amount and period_ms at most 2^52"
        )));
    }
    if s.window_end_ms == 0 && (s.amount == 0 || s.period_ms == 0) {
        return Err(FleetError::Invalid(format!(
            "{path}: a token bucket needs amount and period_ms"
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

/// A breaker as published in Redis for the other sidecars.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Published {
    scope: String,
    state: crate::state::BreakerState,
    half_open_fraction: f64,
    retry_after_seconds: u64,
    reason: Option<String>,
    since_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Board {
    at_ms: u64,
    breakers: Vec<Published>,
}

/// Another sidecar's entry counts while it was written this recently.
const BOARD_LIVE_MS: u64 = 3_000;
/// Entries older than this are removed (a sidecar gone for good).
const BOARD_FORGET_MS: u64 = 60_000;

/// Publishes this sidecar's open and half-open breakers and merges every
/// other live sidecar's into the state this sidecar serves (under its own
/// for the same scope), so a breaker opened by the sidecar that watches a
/// GPU reaches every Envoy through its own sidecar's long poll.
pub async fn sync_breakers(
    fleet: Arc<Fleet>,
    store: StateStore,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let id = format!("{:x}-{:x}", now_ms(), std::process::id());
    let mut tick = tokio::time::interval(fleet.config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = closing.changed() => return,
        }
        let now = now_ms();
        let mine: Vec<Published> = store
            .current()
            .breakers
            .iter()
            .filter(|b| !b.from_fleet)
            .map(|b| Published {
                scope: b.scope.clone(),
                state: b.state,
                half_open_fraction: b.half_open_fraction,
                retry_after_seconds: b.retry_after_seconds,
                reason: b.reason.clone(),
                since_ms: b
                    .since
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            })
            .collect();
        let body = serde_json::to_string(&Board {
            at_ms: now,
            breakers: mine,
        })
        .unwrap_or_default();
        let Ok(all) = fleet.swap_breakers(&id, &body).await else {
            // Redis away: keep the last merged view until the entries would
            // have gone stale, then serve only this sidecar's own.
            continue;
        };
        let mut merged: Vec<crate::state::Breaker> = Vec::new();
        let mut gone = Vec::new();
        for (other, raw) in all {
            if other == id {
                continue;
            }
            let Ok(board) = serde_json::from_str::<Board>(&raw) else {
                gone.push(other);
                continue;
            };
            if board.at_ms + BOARD_FORGET_MS < now {
                gone.push(other);
            }
            if board.at_ms + BOARD_LIVE_MS < now {
                continue;
            }
            for b in board.breakers {
                let view = crate::state::Breaker {
                    scope: b.scope.clone(),
                    state: b.state,
                    half_open_fraction: b.half_open_fraction,
                    retry_after_seconds: b.retry_after_seconds,
                    reason: Some(format!(
                        "fleet: {}",
                        b.reason.as_deref().unwrap_or("opened by another sidecar")
                    )),
                    since: SystemTime::UNIX_EPOCH + Duration::from_millis(b.since_ms),
                    from_fleet: true,
                };
                match merged.iter_mut().find(|m| m.scope == view.scope) {
                    Some(m) if m.state.gauge() < view.state.gauge() => *m = view,
                    Some(_) => {}
                    None => merged.push(view),
                }
            }
        }
        merged.sort_by(|a, b| a.scope.cmp(&b.scope));
        store.set_fleet_breakers(SystemTime::now(), merged);
        fleet.forget_breakers(&gone).await;
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Keeps the local kill switch and Redis' equal until `closing`: a local
/// change (admin call here) is written to Redis; a newer value in Redis
/// (pulled on another sidecar) is applied here, which bumps the state
/// version and so answers this Envoy's held long poll at once.
pub async fn sync_kill_switch(
    fleet: Arc<Fleet>,
    store: StateStore,
    control: Arc<KillSwitchControl>,
    mut closing: tokio::sync::watch::Receiver<bool>,
) {
    let local = |s: &StateStore| {
        let k = s.current().kill_switch.clone();
        (k.active, k.reason)
    };
    // What both sides agreed on last: a local value different from it is
    // a local change.
    let mut agreed: Option<(bool, Option<String>)> = None;
    let mut seen_stamp = 0u64;
    let mut tick = tokio::time::interval(fleet.config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = closing.changed() => return,
        }
        let Ok(remote) = fleet.get_kill_switch().await else {
            continue; // Redis away: the local switch still works here
        };
        let mine = local(&store);
        let changed_here = agreed.as_ref().is_some_and(|a| *a != mine);
        match remote {
            Some(r) if !changed_here && r.stamp > seen_stamp => {
                seen_stamp = r.stamp;
                if (r.active, r.reason.clone()) != mine {
                    control
                        .set(r.active, r.reason.clone(), SystemTime::now())
                        .await;
                }
                agreed = Some(local(&store));
            }
            Some(_) if !changed_here => {
                agreed = Some(mine);
            }
            _ => {
                // First start with nothing in Redis, or a change made here.
                if agreed.is_none() && !mine.0 && remote.is_none() {
                    agreed = Some(mine);
                    continue;
                }
                let stamp = now_ms().max(seen_stamp + 1);
                let value = Shared {
                    active: mine.0,
                    reason: mine.1.clone(),
                    stamp,
                };
                if fleet.put_kill_switch(&value).await.is_ok() {
                    seen_stamp = stamp;
                    agreed = Some(mine);
                }
            }
        }
    }
}

/// `/v1/fleet/take`, `/v1/fleet/give`, `/v1/fleet/slots` (loopback only) and `GET /v1/fleet`
/// (counters).
pub fn router(fleet: Arc<Fleet>) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/fleet", get(stats))
        .route("/v1/fleet/take", post(take))
        .route("/v1/fleet/give", post(give))
        .route("/v1/fleet/slots", post(crate::slots::handle))
        .with_state(fleet)
}

pub(crate) type Peer = Option<axum::Extension<axum::extract::ConnectInfo<std::net::SocketAddr>>>;

pub(crate) fn reply(
    status: axum::http::StatusCode,
    body: serde_json::Value,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        status,
        [(axum::http::header::CACHE_CONTROL, "no-store")],
        axum::Json(body),
    )
        .into_response()
}

pub(crate) fn refuse(peer: &Peer) -> Option<axum::response::Response> {
    let local = peer
        .as_ref()
        .is_some_and(|axum::Extension(axum::extract::ConnectInfo(a))| a.ip().is_loopback());
    (!local).then(|| {
        reply(
            axum::http::StatusCode::FORBIDDEN,
            serde_json::json!({"error": {"code": "forbidden",
                "message": "the fleet endpoints answer the Envoy beside this sidecar (loopback) only"}}),
        )
    })
}

pub(crate) fn failure(e: FleetError) -> axum::response::Response {
    use axum::http::StatusCode;
    match e {
        FleetError::Invalid(m) => reply(
            StatusCode::BAD_REQUEST,
            serde_json::json!({"error": {"code": "invalid_request", "message": m}}),
        ),
        FleetError::Unavailable(m) => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"error": {"code": "fleet_unavailable", "message": m}}),
        ),
    }
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FleetError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| FleetError::Invalid(e.to_string()))
}

/// Every fleet endpoint that changes something: loopback callers only, a
/// JSON body (a bad one is a 400 naming the field), then `act` on it; its
/// answer as 200 JSON, or the failure.
pub(crate) async fn serve<Req, Ans, Fut>(
    peer: &Peer,
    body: &[u8],
    act: impl FnOnce(Req) -> Fut,
) -> axum::response::Response
where
    Req: serde::de::DeserializeOwned,
    Ans: Serialize,
    Fut: std::future::Future<Output = Result<Ans, FleetError>>,
{
    if let Some(r) = refuse(peer) {
        return r;
    }
    let req = match parse(body) {
        Ok(r) => r,
        Err(e) => return failure(e),
    };
    match act(req).await {
        Ok(answer) => reply(
            axum::http::StatusCode::OK,
            serde_json::to_value(answer).unwrap_or_default(),
        ),
        Err(e) => failure(e),
    }
}

async fn take(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
    peer: Peer,
    body: axum::body::Bytes,
) -> axum::response::Response {
    serve(&peer, &body, |req: TakeRequest| async move {
        fleet.take(&req).await
    })
    .await
}

async fn give(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
    peer: Peer,
    body: axum::body::Bytes,
) -> axum::response::Response {
    serve(&peer, &body, |req: GiveRequest| async move {
        let applied = fleet.give(&req).await?;
        Ok(serde_json::json!({ "applied": applied }))
    })
    .await
}

async fn stats(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
) -> axum::response::Response {
    let s = &fleet.stats;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    reply(
        axum::http::StatusCode::OK,
        serde_json::json!({
            "redis_up": s.up.load(Ordering::Relaxed),
            "takes": n(&s.takes),
            "takes_refused": n(&s.takes_refused),
            "gives": n(&s.gives),
            "gives_repeated": n(&s.gives_repeated),
            "errors": n(&s.errors),
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Breaker, BreakerState};

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

    #[tokio::test]
    async fn bad_claims_are_refused_before_redis_is_asked() {
        // Nothing listens there: a request that got as far as Redis would
        // answer Unavailable, not Invalid.
        let fleet = Fleet::new(FleetConfig {
            redis: "redis://127.0.0.1:1".into(),
            ..FleetConfig::default()
        })
        .unwrap();
        let shape = Shape {
            capacity: 10,
            amount: 10,
            period_ms: 1000,
            window_end_ms: 0,
        };
        let claim = |key: &str, shape: Shape| TakeClaim {
            key: key.into(),
            shape,
            need: 1,
            want: 1,
            soft: false,
        };
        let bad = [
            (claim("sk-raw-api-key", shape), "claims[0].key"),
            (
                claim(
                    "0123456789abcdef",
                    Shape {
                        capacity: 0,
                        ..shape
                    },
                ),
                "claims[0]",
            ),
            (
                claim("0123456789abcdef", Shape { amount: 0, ..shape }),
                "token bucket",
            ),
        ];
        for (c, why) in bad {
            let req = TakeRequest {
                replicas: 1,
                claims: vec![c],
            };
            match fleet.take(&req).await {
                Err(FleetError::Invalid(m)) => assert!(m.contains(why), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        let empty = TakeRequest {
            replicas: 1,
            claims: Vec::new(),
        };
        assert!(matches!(
            fleet.take(&empty).await,
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
        let ok = TakeRequest {
            replicas: 1,
            claims: vec![claim("0123456789abcdef", shape)],
        };
        assert!(matches!(
            fleet.take(&ok).await,
            Err(FleetError::Unavailable(_))
        ));
    }
}
