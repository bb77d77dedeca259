//! Concurrency slots across the fleet (docs/src/design.md, "Queue", "Fleet"): how many
//! requests a gated backend (and each of its models) has in flight, summed over every
//! Envoy, stays within its `concurrency`.
//!
//! `POST /v1/fleet/slots` (the Envoy beside this sidecar only, as the
//! other fleet endpoints): it reports, per scope (`concurrency/<backend>`,
//! `concurrency/<backend>/<model>`), the absolute number of slots it wants
//! to hold; one Lua script grants each `min(hold, limit − what the other
//! live Envoys hold)` and records it. The limit is this sidecar's own
//! policy's (`fleet.policy`), never the caller's: a report cannot raise it.
//! Absolute reports make a retried or lost call harmless: the next report
//! says the whole truth again. The filter lowers its own capacity *before*
//! it reports a smaller holding and raises it only *after* a grant, so what
//! it admits never exceeds what Redis counts as its holding.
//!
//! Liveness: each report renews `live:<id>` (this sidecar's id) for
//! [`LIVE_MS`]; the filter reports at least every second while it holds
//! anything. The holdings of an id whose key expired (its Envoy or sidecar
//! died) are dropped by the next script that sees them, so their slots come
//! back to the fleet within `LIVE_MS`.

use std::sync::OnceLock;

use super::{Fleet, FleetError, PolicyView};

/// How long a report keeps this Envoy's holdings alive.
pub const LIVE_MS: u64 = 5_000;
/// Most scopes in one report.
pub const MAX_SCOPES: usize = 256;
/// Largest `limit` or `hold` accepted.
const MAX_SLOTS: u32 = 1_000_000;
const PREFIX: &str = "sluice:fleet:slots:";

/// KEYS: one holdings hash per scope. ARGV[1]: this Envoy's id, ARGV[2]:
/// the liveness key prefix, ARGV[3]: liveness (ms); then per scope: limit,
/// hold. Answers the grant of each scope.
const SLOTS: &str = r#"
local me = ARGV[1]
local prefix = ARGV[2]
redis.call('SET', prefix .. me, '1', 'PX', tonumber(ARGV[3]))
local out = {}
for i = 1, #KEYS do
  local limit = tonumber(ARGV[2 + i * 2])
  local hold = tonumber(ARGV[3 + i * 2])
  local others = 0
  local h = redis.call('HGETALL', KEYS[i])
  for j = 1, #h, 2 do
    local who = h[j]
    if who ~= me then
      if redis.call('EXISTS', prefix .. who) == 1 then
        others = others + tonumber(h[j + 1])
      else
        redis.call('HDEL', KEYS[i], who)
      end
    end
  end
  local grant = math.max(0, math.min(hold, limit - others))
  if grant > 0 then
    redis.call('HSET', KEYS[i], me, grant)
  else
    redis.call('HDEL', KEYS[i], me)
  end
  out[i] = grant
end
return out
"#;

/// The body of `/v1/fleet/slots` and its answer, shared with the filter.
pub use sluice_wire::fleet::{SlotScope, SlotsAnswer, SlotsRequest};

/// This sidecar's id in the holdings: distinct per process (a restarted
/// sidecar is a new holder; the old id's slots expire with its liveness).
pub fn holder_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:x}-{:x}", std::process::id(), nanos)
    })
}

fn scope_ok(id: &str) -> bool {
    id.starts_with("concurrency/") && id.len() <= 256 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// Checks a report before Redis is asked, and finds each scope's limit in
/// this sidecar's policy; errors name the field.
pub fn check(req: &SlotsRequest, view: &PolicyView) -> Result<Vec<u32>, FleetError> {
    if req.scopes.is_empty() || req.scopes.len() > MAX_SCOPES {
        return Err(FleetError::Invalid(format!(
            "scopes: 1 to {MAX_SCOPES} entries"
        )));
    }
    let mut limits = Vec::with_capacity(req.scopes.len());
    for (i, s) in req.scopes.iter().enumerate() {
        if !scope_ok(&s.id) {
            return Err(FleetError::Invalid(format!(
                "scopes[{i}].id: `concurrency/…`, printable ASCII, at most 256 bytes"
            )));
        }
        if s.hold > MAX_SLOTS {
            return Err(FleetError::Invalid(format!(
                "scopes[{i}].hold: 0 to {MAX_SLOTS}"
            )));
        }
        match view.slot_limit(&s.id) {
            Some(limit) => limits.push(limit.min(MAX_SLOTS)),
            None => {
                return Err(FleetError::Invalid(format!(
                    "scopes[{i}].id: `{}` is no fleet-wide concurrency of this sidecar's policy",
                    s.id
                )))
            }
        }
    }
    let mut ids: Vec<&str> = req.scopes.iter().map(|s| s.id.as_str()).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err(FleetError::Invalid("scopes: an id appears twice".into()));
    }
    Ok(limits)
}

/// Records this Envoy's holdings and answers its grants.
pub async fn report(fleet: &Fleet, req: &SlotsRequest) -> Result<SlotsAnswer, FleetError> {
    let limits = check(req, &fleet.view())?;
    fleet.refuse_mismatch()?;
    let script = redis::Script::new(SLOTS);
    let mut inv = script.prepare_invoke();
    for s in &req.scopes {
        inv.key(format!("{PREFIX}{}", s.id));
    }
    inv.arg(holder_id())
        .arg(format!("{PREFIX}live:"))
        .arg(LIVE_MS);
    for (s, limit) in req.scopes.iter().zip(&limits) {
        inv.arg(*limit).arg(s.hold.min(*limit));
    }
    let grants: Vec<u32> = fleet.run(inv).await?;
    if grants.len() != req.scopes.len() {
        return Err(FleetError::Unavailable(
            "the slots script answered the wrong number of grants".into(),
        ));
    }
    Ok(SlotsAnswer { grants })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(id: &str, hold: u32) -> SlotScope {
        SlotScope {
            id: id.into(),
            hold,
        }
    }

    #[test]
    fn bad_reports_are_refused_with_the_field() {
        let view = crate::fleet::tests::view("unit-test-salt-0123");
        let bad = [
            vec![],
            vec![scope("tier/x/requests", 1)],
            vec![scope("concurrency/a b", 1)],
            vec![scope("concurrency/nope", 1)],
            vec![scope("concurrency/b/m", MAX_SLOTS + 1)],
            vec![scope("concurrency/b/m", 1), scope("concurrency/b/m", 1)],
        ];
        for scopes in bad {
            assert!(
                matches!(
                    check(
                        &SlotsRequest {
                            scopes: scopes.clone()
                        },
                        &view
                    ),
                    Err(FleetError::Invalid(_))
                ),
                "{scopes:?}"
            );
        }
        // The limit is the sidecar's own (2), whatever the report holds.
        assert_eq!(
            check(
                &SlotsRequest {
                    scopes: vec![scope("concurrency/b/m", 1_000_000)]
                },
                &view
            )
            .unwrap(),
            [2]
        );
    }

    #[tokio::test]
    async fn a_report_cannot_hold_more_than_the_sidecars_limit() {
        let Some(redis) = crate::fleet::redis_tests::server() else {
            return;
        };
        let one = crate::fleet::tests::fleet_on(&redis.url, "unit-test-salt-0123");
        let greedy = SlotsRequest {
            scopes: vec![scope("concurrency/b/m", 1_000_000)],
        };
        let got = report(&one, &greedy).await.unwrap();
        assert_eq!(got.grants, [2], "capped by the policy's concurrency");
    }
}
