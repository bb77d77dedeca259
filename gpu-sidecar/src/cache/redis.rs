//! The fleet's store: entries in Redis, so one Envoy's answer serves every
//! Envoy of the fleet. Through the fleet agent's connection
//! ([`crate::fleet::Fleet::query`] and its scripts), never a second client.
//!
//! Key names are the filter's salted hashes (`sluice:cache:e:<key>`), each
//! with its own expiry (`PX`). The bounds are kept in one script, atomic
//! in Redis: a sorted set by last use and a byte counter; a store evicts
//! least recently used entries until both hold. An entry that expired on
//! its own still counts until it reaches the end of the use order (the
//! count is then over, never under, what Redis holds).
//!
//! Semantic entries are also appended to a stream (`sluice:cache:learn`,
//! capped at `max_entries`) that every sidecar reads to learn the vectors
//! into its own index; the answer itself is read from Redis on a match.

use std::sync::Arc;

use super::entry::{Limits, Stored};
use crate::fleet::{Fleet, FleetError};

pub const PREFIX: &str = "sluice:cache:e:";
const LRU: &str = "sluice:cache:lru";
const SIZES: &str = "sluice:cache:size";
const MODELS: &str = "sluice:cache:model";
const BYTES: &str = "sluice:cache:bytes";
/// member → the filter's scope id (purges by scope).
const SCOPES: &str = "sluice:cache:scope";
pub const LEARN: &str = "sluice:cache:learn";

/// KEYS: entry, lru, sizes, models, bytes, learn, scopes. ARGV: value,
/// ttl_ms, now_ms, size, max_entries, max_bytes, member, model, prefix,
/// scope id ('' = none), and when semantic: context, vector (JSON),
/// expires_at_ms.
const STORE: &str = r#"
local member = ARGV[7]
local old = redis.call('HGET', KEYS[3], member)
if old then redis.call('DECRBY', KEYS[5], old) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], member)
redis.call('HSET', KEYS[3], member, ARGV[4])
redis.call('HSET', KEYS[4], member, ARGV[8])
if ARGV[10] ~= '' then redis.call('HSET', KEYS[7], member, ARGV[10]) end
redis.call('INCRBY', KEYS[5], ARGV[4])
local max_entries = tonumber(ARGV[5])
local max_bytes = tonumber(ARGV[6])
local evicted = {}
while redis.call('ZCARD', KEYS[2]) > max_entries
      or tonumber(redis.call('GET', KEYS[5]) or '0') > max_bytes do
  local m = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if (not m) or m == member then break end
  redis.call('ZREM', KEYS[2], m)
  local s = redis.call('HGET', KEYS[3], m)
  if s then redis.call('DECRBY', KEYS[5], s) end
  local model = redis.call('HGET', KEYS[4], m) or ''
  redis.call('HDEL', KEYS[3], m)
  redis.call('HDEL', KEYS[4], m)
  redis.call('HDEL', KEYS[7], m)
  if redis.call('DEL', ARGV[9] .. m) == 1 then
    table.insert(evicted, model)
  end
end
if ARGV[11] then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*',
             'k', member, 'c', ARGV[11], 'v', ARGV[12], 'x', ARGV[13])
end
return evicted
"#;

/// KEYS: lru, sizes, models, bytes, learn, scopes. ARGV: prefix, model
/// ('' = any), scope id ('' = any). Returns the members removed.
const PURGE: &str = r#"
local removed = {}
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all, 2 do
  local m, model = all[i], all[i + 1]
  local scope = redis.call('HGET', KEYS[6], m) or ''
  if (ARGV[2] == '' or ARGV[2] == model) and (ARGV[3] == '' or ARGV[3] == scope) then
    if redis.call('DEL', ARGV[1] .. m) == 1 then table.insert(removed, m) end
    redis.call('ZREM', KEYS[1], m)
    local s = redis.call('HGET', KEYS[2], m)
    if s then redis.call('DECRBY', KEYS[4], s) end
    redis.call('HDEL', KEYS[2], m)
    redis.call('HDEL', KEYS[3], m)
    redis.call('HDEL', KEYS[6], m)
  end
end
if ARGV[2] == '' and ARGV[3] == '' then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
end
return removed
"#;

pub struct RedisStore {
    fleet: Arc<Fleet>,
    limits: Limits,
    store: redis::Script,
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
    pub fn new(fleet: Arc<Fleet>, limits: Limits) -> RedisStore {
        RedisStore {
            fleet,
            limits,
            store: redis::Script::new(STORE),
            purge: redis::Script::new(PURGE),
        }
    }

    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// The entry under `key` (marked used), if Redis has it and it is live.
    pub async fn get(&self, key: &str, now_ms: u64) -> Result<Option<Stored>, FleetError> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET")
            .arg(format!("{PREFIX}{key}"))
            .cmd("ZADD")
            .arg(LRU)
            .arg("XX")
            .arg(now_ms)
            .arg(key)
            .ignore();
        let (value,): (Option<String>,) = self.fleet.query(&pipe).await?;
        Ok(value
            .and_then(|v| serde_json::from_str::<Stored>(&v).ok())
            .filter(|s| s.expires_at_ms > now_ms))
    }

    /// Stores; the models of the entries it evicted.
    pub async fn put(
        &self,
        key: &str,
        stored: &Stored,
        now_ms: u64,
    ) -> Result<Vec<String>, FleetError> {
        let value =
            serde_json::to_string(stored).map_err(|e| FleetError::Invalid(e.to_string()))?;
        let ttl_ms = stored.expires_at_ms.saturating_sub(now_ms).max(1);
        let mut inv = self.store.prepare_invoke();
        inv.key(format!("{PREFIX}{key}"))
            .key(LRU)
            .key(SIZES)
            .key(MODELS)
            .key(BYTES)
            .key(LEARN)
            .key(SCOPES)
            .arg(value)
            .arg(ttl_ms)
            .arg(now_ms)
            .arg(stored.bytes(key))
            .arg(self.limits.max_entries)
            .arg(self.limits.max_bytes)
            .arg(key)
            .arg(&stored.model)
            .arg(PREFIX)
            .arg(stored.scope.as_deref().unwrap_or(""));
        if let (Some(c), Some(v)) = (&stored.context, &stored.vector) {
            let vector =
                serde_json::to_string(v).map_err(|e| FleetError::Invalid(e.to_string()))?;
            inv.arg(c).arg(vector).arg(stored.expires_at_ms);
        }
        self.fleet.run(inv).await
    }

    /// Removes every entry (or a model's, a scope id's, or both); the
    /// keys removed.
    pub async fn purge(
        &self,
        model: Option<&str>,
        scope: Option<&str>,
    ) -> Result<Vec<String>, FleetError> {
        let mut inv = self.purge.prepare_invoke();
        inv.key(LRU)
            .key(SIZES)
            .key(MODELS)
            .key(BYTES)
            .key(LEARN)
            .key(SCOPES)
            .arg(PREFIX)
            .arg(model.unwrap_or(""))
            .arg(scope.unwrap_or(""));
        self.fleet.run(inv).await
    }

    /// Entries and bytes as Redis counts them.
    pub async fn size(&self) -> Result<(u64, u64), FleetError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZCARD").arg(LRU).cmd("GET").arg(BYTES);
        let (n, b): (u64, Option<u64>) = self.fleet.query(&pipe).await?;
        Ok((n, b.unwrap_or(0)))
    }

    /// Vectors appended after stream id `after` (`0`: from the start), and
    /// the last id read.
    pub async fn learn(&self, after: &str) -> Result<(Vec<Learned>, String), FleetError> {
        let mut pipe = redis::pipe();
        pipe.cmd("XREAD")
            .arg("COUNT")
            .arg(1000)
            .arg("STREAMS")
            .arg(LEARN)
            .arg(after);
        let (reply,): (redis::Value,) = self.fleet.query(&pipe).await?;
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
