//! The sluice policies in a file: a bare policy (YAML or JSON), or every
//! sluice wasm filter's `configuration` in an Envoy config. Parsed by the
//! filter's own parser and load ([`Policy::load`]), so a policy is
//! refused here exactly when Envoy would refuse it.

use serde_json::Value;
use sluice_core::{ConfigError, Policy};

/// A policy as the filter loads it: parsed, checked, and compiled (the
/// checks that need the compiled buckets, such as `fleet.local`, run there).
pub fn load(value: Value) -> Result<Policy, ConfigError> {
    Policy::load(value)
}

/// The policy with a `fleet` section in `text` (a policy, or an Envoy
/// config embedding one or more sluice filters), checked as Envoy would:
/// what a sidecar's `fleet.policy` points at.
pub fn fleet_policy(text: &str) -> Result<Policy, String> {
    let doc: Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML or JSON: {e}"))?;
    let mut found = Vec::new();
    find_policies(&doc, "", &mut found);
    let mut policies = Vec::new();
    if found.is_empty() {
        let bare = load(doc.clone()).map_err(|e| e.to_string())?;
        policies.push(("the policy".to_string(), bare));
    }
    for (at, value) in found {
        let value = policy_value(value).map_err(|e| format!("{at}: {e}"))?;
        let policy = load(value).map_err(|e| format!("{at}: {e}"))?;
        policies.push((at, policy));
    }
    let mut fleet: Vec<(String, Policy)> = policies
        .into_iter()
        .filter(|(_, p)| p.fleet.is_some())
        .collect();
    match fleet.len() {
        0 => Err("no sluice policy with a `fleet` section".into()),
        1 => Ok(fleet.remove(0).1),
        _ => {
            Err(format!(
            "{} sluice policies with a `fleet` section ({}): one sidecar is the fleet agent of one",
            fleet.len(),
            fleet.iter().map(|(at, _)| at.as_str()).collect::<Vec<_>>().join(", ")
        ))
        }
    }
}

/// Collects the `configuration` of every wasm filter whose root_id or name is
/// `sluice`, with a readable location.
pub fn find_policies<'a>(v: &'a Value, at: &str, out: &mut Vec<(String, &'a Value)>) {
    match v {
        Value::Object(map) => {
            let is_sluice = ["root_id", "name"]
                .iter()
                .any(|k| map.get(*k).and_then(Value::as_str) == Some("sluice"));
            if is_sluice {
                if let Some(cfg) = map.get("configuration") {
                    out.push((format!("{at}.configuration"), cfg));
                    return;
                }
            }
            for (k, child) in map {
                find_policies(child, &format!("{at}.{k}"), out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                find_policies(child, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// The policy inside an `Any`: a Struct's `value` map, or a StringValue's
/// JSON text.
pub fn policy_value(any: &Value) -> Result<Value, String> {
    match any.get("value") {
        Some(Value::String(json)) => {
            serde_json::from_str(json).map_err(|e| format!("StringValue is not JSON: {e}"))
        }
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        _ => Err("expected `value` holding the policy".into()),
    }
}
