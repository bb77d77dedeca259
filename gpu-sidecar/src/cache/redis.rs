//! The fleet's store: entries in Redis, so one Envoy's answer serves every
//! Envoy of the fleet. Through the sidecar's one Redis connection
//! ([`crate::redis`], the fleet agent's too), never a second client.
//!
//! Key names are the filter's salted hashes (`sluice:cache:e:<key>`), each
//! with its own expiry (`PX`). The bounds are kept in one script, atomic
//! in Redis: a sorted set by last use, a byte counter, and per scope its
//! members by last use and its entries and bytes; a store evicts by the
//! memory store's rule (the largest scope over the floor gives way, least
//! recently used first; see `super::memory`; among scopes holding as much,
//! by name rather than by use) until both bounds hold. Members stored
//! before scopes were kept (no scope) are evicted first. An
//! entry that expired on its own still counts until it is evicted (the
//! count is then over, never under, what Redis holds).
//!
//! Semantic entries are also appended to a stream (`sluice:cache:learn`,
//! capped at `max_entries`) that every sidecar reads to learn the vectors
//! into its own index; the answer itself is read from Redis on a match.

use std::sync::Arc;

use super::entry::{Limits, Stored};
use crate::redis::{Redis, RedisError};

pub const PREFIX: &str = "sluice:cache:e:";
const LRU: &str = "sluice:cache:lru";
const SIZES: &str = "sluice:cache:size";
const MODELS: &str = "sluice:cache:model";
const BYTES: &str = "sluice:cache:bytes";
/// member → the filter's scope id (purges by scope).
const SCOPES: &str = "sluice:cache:scope";
pub const LEARN: &str = "sluice:cache:learn";

/// Per scope: its members by last use (`<SCOPE_LRU><scope>`), and every
/// scope's entries and bytes (`SCOPE_COUNT`, `SCOPE_BYTES`). `-` is the
/// scope of answers stored without a scope id.
const SCOPE_LRU: &str = "sluice:cache:slru:";
const SCOPE_COUNT: &str = "sluice:cache:scount";
const SCOPE_BYTES: &str = "sluice:cache:sbytes";

/// Shared by the scripts. KEYS (all of them): 1 entry, 2 lru, 3 sizes,
/// 4 models, 5 bytes, 6 learn, 7 scopes, 8 scope counts, 9 scope bytes.
/// `forget(m, prefix, slru)` removes member `m` everywhere; true when its
/// entry was still there.
const FORGET: &str = r#"
local function forget(m, prefix, slru)
  redis.call('ZREM', KEYS[2], m)
  local size = tonumber(redis.call('HGET', KEYS[3], m) or '0')
  redis.call('DECRBY', KEYS[5], size)
  local sc = redis.call('HGET', KEYS[7], m)
  if sc then
    redis.call('ZREM', slru .. sc, m)
    if tonumber(redis.call('ZINCRBY', KEYS[8], -1, sc)) <= 0 then
      redis.call('ZREM', KEYS[8], sc)
      redis.call('ZREM', KEYS[9], sc)
    else
      redis.call('ZINCRBY', KEYS[9], -size, sc)
    end
  end
  redis.call('HDEL', KEYS[3], m)
  redis.call('HDEL', KEYS[4], m)
  redis.call('HDEL', KEYS[7], m)
  return redis.call('DEL', prefix .. m) == 1
end
"#;

/// ARGV: 1 value, 2 ttl_ms, 3 now_ms, 4 size, 5 max_entries, 6 max_bytes,
/// 7 member, 8 model, 9 prefix, 10 scope ('-' = none), 11 scope lru
/// prefix, 12 floor entries, 13 floor bytes, and when semantic: 14
/// context, 15 vector (JSON), 16 expires_at_ms. Returns {kept (1/0),
/// evicted models…}. The rule is the memory store's: the largest scope
/// over the floor gives way, else the storing scope from its own older
/// entries, else the answer is not kept.
const STORE: &str = r#"
local member, sc, slru = ARGV[7], ARGV[10], ARGV[11]
if redis.call('HEXISTS', KEYS[3], member) == 1 then forget(member, ARGV[9], slru) end
local size = tonumber(ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], member)
redis.call('HSET', KEYS[3], member, size)
redis.call('HSET', KEYS[4], member, ARGV[8])
redis.call('HSET', KEYS[7], member, sc)
redis.call('INCRBY', KEYS[5], size)
redis.call('ZADD', slru .. sc, ARGV[3], member)
redis.call('ZINCRBY', KEYS[8], 1, sc)
redis.call('ZINCRBY', KEYS[9], size, sc)
local floors = {[8] = tonumber(ARGV[12]), [9] = tonumber(ARGV[13])}
local function only_new(s)
  return s == sc and tonumber(redis.call('ZSCORE', KEYS[8], s) or '0') <= 1
end
-- The scope to lose an entry by ranking k (8: entries, 9: bytes).
local function victim(k)
  local top = redis.call('ZREVRANGE', KEYS[k], 0, 1, 'WITHSCORES')
  for i = 1, #top, 2 do
    if tonumber(top[i + 1]) > floors[k] and not only_new(top[i]) then return top[i] end
  end
  if not only_new(sc) then return sc end
  return nil
end
local evicted = {}
local function over(k)
  if k == 8 then return redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[5]) end
  return tonumber(redis.call('GET', KEYS[5]) or '0') > tonumber(ARGV[6])
end
for _, k in ipairs({8, 9}) do
  while over(k) do
    local v = victim(k)
    -- A member without a scope (stored before scopes were kept) goes
    -- first, least recently used: it is in no ranking.
    local old = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    if old and old ~= member and not redis.call('HGET', KEYS[7], old) then
      local model = redis.call('HGET', KEYS[4], old) or ''
      if forget(old, ARGV[9], slru) then table.insert(evicted, model) end
    elseif not v then
      forget(member, ARGV[9], slru)
      return {0, unpack(evicted)}
    else
      local m = nil
      for _, c in ipairs(redis.call('ZRANGE', slru .. v, 0, 1)) do
        if c ~= member and not m then m = c end
      end
      if not m then break end
      local model = redis.call('HGET', KEYS[4], m) or ''
      if forget(m, ARGV[9], slru) then table.insert(evicted, model) end
    end
  end
end
if ARGV[14] then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*',
             'k', member, 'c', ARGV[14], 'v', ARGV[15], 'x', ARGV[16])
end
return {1, unpack(evicted)}
"#;

/// KEYS: as [`FORGET`]'s. ARGV: 1 member, 2 now_ms, 3 scope lru prefix.
/// The entry's value, marked used (in its scope too).
const GET: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then
  redis.call('ZADD', KEYS[2], 'XX', ARGV[2], ARGV[1])
  local sc = redis.call('HGET', KEYS[7], ARGV[1])
  if sc then redis.call('ZADD', ARGV[3] .. sc, 'XX', ARGV[2], ARGV[1]) end
end
return v
"#;

/// KEYS: as [`FORGET`]'s. ARGV: 1 prefix, 2 model ('' = any), 3 scope id
/// ('' = any), 4 scope lru prefix. Returns the members removed.
const PURGE: &str = r#"
local removed = {}
local all = redis.call('HGETALL', KEYS[4])
for i = 1, #all, 2 do
  local m, model = all[i], all[i + 1]
  local scope = redis.call('HGET', KEYS[7], m) or ''
  if (ARGV[2] == '' or ARGV[2] == model) and (ARGV[3] == '' or ARGV[3] == scope) then
    if forget(m, ARGV[1], ARGV[4]) then table.insert(removed, m) end
  end
end
if ARGV[2] == '' and ARGV[3] == '' then
  for _, sc in ipairs(redis.call('ZRANGE', KEYS[8], 0, -1)) do
    redis.call('DEL', ARGV[4] .. sc)
  end
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9])
end
return removed
"#;

pub struct RedisStore {
    redis: Arc<Redis>,
    limits: Limits,
    store: redis::Script,
    get: redis::Script,
    purge: redis::Script,
}

/// One vector another sidecar stored, read from the learn stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Learned {
    pub key: String,
    pub context: String,
    pub vector: Vec<f32>,
    pub expires_at_ms: u64,
}

impl RedisStore {
    pub fn new(redis: Arc<Redis>, limits: Limits) -> RedisStore {
        RedisStore {
            redis,
            limits,
            store: redis::Script::new(&format!("{FORGET}{STORE}")),
            get: redis::Script::new(GET),
            purge: redis::Script::new(&format!("{FORGET}{PURGE}")),
        }
    }

    pub fn redis(&self) -> &Arc<Redis> {
        &self.redis
    }

    /// Every key the scripts touch, in [`FORGET`]'s order (the entry's
    /// first).
    fn keys<'a>(&self, inv: &mut redis::ScriptInvocation<'a>, key: &str) {
        inv.key(format!("{PREFIX}{key}"))
            .key(LRU)
            .key(SIZES)
            .key(MODELS)
            .key(BYTES)
            .key(LEARN)
            .key(SCOPES)
            .key(SCOPE_COUNT)
            .key(SCOPE_BYTES);
    }

    /// The entry under `key` (marked used), if Redis has it and it is live.
    pub async fn get(&self, key: &str, now_ms: u64) -> Result<Option<Stored>, RedisError> {
        let mut inv = self.get.prepare_invoke();
        self.keys(&mut inv, key);
        inv.arg(key).arg(now_ms).arg(SCOPE_LRU);
        let value: Option<String> = self.redis.run(inv).await?;
        Ok(value
            .and_then(|v| serde_json::from_str::<Stored>(&v).ok())
            .filter(|s| s.expires_at_ms > now_ms))
    }

    /// Stores: whether it was kept (see [`STORE`]), and the models of the
    /// entries it evicted.
    pub async fn put(
        &self,
        key: &str,
        stored: &Stored,
        now_ms: u64,
    ) -> Result<(bool, Vec<String>), RedisError> {
        let value =
            serde_json::to_string(stored).map_err(|e| RedisError::Invalid(e.to_string()))?;
        let ttl_ms = stored.expires_at_ms.saturating_sub(now_ms).max(1);
        let floor_bytes = u128::from(self.limits.max_bytes) * self.limits.scope_floor as u128
            / (self.limits.max_entries.max(1) as u128);
        let mut inv = self.store.prepare_invoke();
        self.keys(&mut inv, key);
        inv.arg(value)
            .arg(ttl_ms)
            .arg(now_ms)
            .arg(stored.bytes(key))
            .arg(self.limits.max_entries)
            .arg(self.limits.max_bytes)
            .arg(key)
            .arg(&stored.model)
            .arg(PREFIX)
            .arg(stored.scope.as_deref().unwrap_or("-"))
            .arg(SCOPE_LRU)
            .arg(self.limits.scope_floor)
            .arg(u64::try_from(floor_bytes).unwrap_or(u64::MAX));
        if let (Some(c), Some(v)) = (&stored.context, &stored.vector) {
            let vector =
                serde_json::to_string(v).map_err(|e| RedisError::Invalid(e.to_string()))?;
            inv.arg(c).arg(vector).arg(stored.expires_at_ms);
        }
        let reply: Vec<redis::Value> = self.redis.run(inv).await?;
        let kept = matches!(reply.first(), Some(redis::Value::Int(1)));
        let evicted = reply.iter().skip(1).filter_map(text).collect();
        Ok((kept, evicted))
    }

    /// Removes every entry (or a model's, a scope id's, or both); the
    /// keys removed.
    pub async fn purge(
        &self,
        model: Option<&str>,
        scope: Option<&str>,
    ) -> Result<Vec<String>, RedisError> {
        let mut inv = self.purge.prepare_invoke();
        self.keys(&mut inv, "-");
        inv.arg(PREFIX)
            .arg(model.unwrap_or(""))
            .arg(scope.unwrap_or(""))
            .arg(SCOPE_LRU);
        self.redis.run(inv).await
    }

    /// Entries and bytes as Redis counts them.
    pub async fn size(&self) -> Result<(u64, u64), RedisError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZCARD").arg(LRU).cmd("GET").arg(BYTES);
        let (n, b): (u64, Option<u64>) = self.redis.query(&pipe).await?;
        Ok((n, b.unwrap_or(0)))
    }

    /// Vectors appended after stream id `after` (`0`: from the start), and
    /// the last id read.
    pub async fn learn(&self, after: &str) -> Result<(Vec<Learned>, String), RedisError> {
        let mut pipe = redis::pipe();
        pipe.cmd("XREAD")
            .arg("COUNT")
            .arg(1000)
            .arg("STREAMS")
            .arg(LEARN)
            .arg(after);
        let (reply,): (redis::Value,) = self.redis.query(&pipe).await?;
        let mut out = Vec::new();
        let mut last = after.to_string();
        for (id, fields) in stream_entries(&reply) {
            last = id;
            let get = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            let (Some(k), Some(c), Some(v), Some(x)) = (get("k"), get("c"), get("v"), get("x"))
            else {
                continue;
            };
            let (Ok(vector), Ok(x)) = (serde_json::from_str::<Vec<f32>>(v), x.parse::<u64>())
            else {
                continue;
            };
            out.push(Learned {
                key: k.into(),
                context: c.into(),
                vector,
                expires_at_ms: x,
            });
        }
        Ok((out, last))
    }
}

fn text(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn items(v: &redis::Value) -> Vec<&redis::Value> {
    match v {
        redis::Value::Array(a) | redis::Value::Set(a) => a.iter().collect(),
        redis::Value::Map(m) => m.iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => Vec::new(),
    }
}

/// `XREAD`'s reply (RESP2 arrays or RESP3 maps) as (id, fields) pairs.
fn stream_entries(reply: &redis::Value) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    // [[stream, [[id, [k, v, …]], …]], …] or {stream: [[id, [k, v, …]]]}
    let top = items(reply);
    let streams: Vec<&redis::Value> = match reply {
        redis::Value::Map(_) => top.chunks(2).filter_map(|p| p.get(1).copied()).collect(),
        _ => top
            .iter()
            .filter_map(|s| items(s).get(1).copied())
            .collect(),
    };
    for entries in streams {
        for e in items(entries) {
            let parts = items(e);
            let (Some(id), Some(kv)) = (parts.first().and_then(|v| text(v)), parts.get(1)) else {
                continue;
            };
            let kv = items(kv);
            let fields = kv
                .chunks(2)
                .filter_map(|p| Some((text(p.first()?)?, text(p.get(1)?)?)))
                .collect();
            out.push((id, fields));
        }
    }
    out
}
