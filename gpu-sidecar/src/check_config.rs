//! `sluice-sidecar check-config FILE`: the filter's own policy parser, run
//! offline, so a bad policy is caught before Envoy refuses it.

use serde_json::Value;
use sluice_core::Policy;

use crate::config::policy::{find_policies, load, policy_value};

/// Checks a policy given as YAML or JSON, either bare or embedded in an Envoy
/// config (every sluice wasm filter found is checked). Returns a one-line
/// summary, or the error naming the field path.
pub fn check(text: &str) -> Result<String, String> {
    let doc: Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML or JSON: {e}"))?;
    let mut found = Vec::new();
    find_policies(&doc, "", &mut found);
    if found.is_empty() {
        // A bare policy.
        return load(doc).map(|p| summary(&p)).map_err(|e| e.to_string());
    }
    let mut lines = Vec::new();
    for (at, policy) in found {
        let policy = policy_value(policy).map_err(|e| format!("{at}: {e}"))?;
        let policy = load(policy).map_err(|e| format!("{at}: {e}"))?;
        fleet_secret_reaches_the_vm(&doc, &at, &policy)?;
        cache_secret_reaches_the_vm(&doc, &at, &policy)?;
        lines.push(format!("{at}: {}", summary(&policy)));
        if let Some(cache) = &policy.cache_compiled {
            lines.extend(cache.warnings().into_iter().map(|w| format!("{at}: {w}")));
        }
        if let Some(warning) = buffer_warning(&doc, &at, &policy) {
            lines.push(warning);
        }
        lines.extend(timeout_warnings(&doc, &at, &policy));
    }
    Ok(lines.join("; "))
}

/// Checks a file that is either a sidecar config or a policy (bare or in
/// an Envoy config): a sidecar config is one with a key only a sidecar
/// config has (`listen`, `sources`, …, or `fleet.redis`). A sidecar
/// config is checked as `serve` would load it, its `fleet` section
/// included (the policy, secret, password and CA it names are read).
pub fn check_any(text: &str) -> Result<String, String> {
    let doc: Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML or JSON: {e}"))?;
    if is_sidecar_config(&doc) {
        return check_sidecar(text);
    }
    check(text)
}

/// Top-level keys of a sidecar config that no policy has.
const SIDECAR_KEYS: &[&str] = &[
    "listen",
    "scrape_interval",
    "scrape_timeout",
    "sources",
    "rules",
    "saturation",
    "breaker",
    "scopes",
    "admin",
    "long_poll",
    "state_file",
    "alerts",
    "history",
    "envoy_admin",
];

fn is_sidecar_config(doc: &Value) -> bool {
    let Some(map) = doc.as_object() else {
        return false;
    };
    // An Envoy config has an `admin` too: one with a sluice filter is one.
    let mut found = Vec::new();
    find_policies(doc, "", &mut found);
    if !found.is_empty()
        || ["static_resources", "default_tier", "tiers"]
            .iter()
            .any(|k| map.contains_key(*k))
    {
        return false;
    }
    SIDECAR_KEYS.iter().any(|k| map.contains_key(*k))
        // The sidecar's `cache:` (where entries live) vs the policy's (which
        // models): keys only the sidecar's has.
        || map.get("cache").and_then(Value::as_object).is_some_and(|c| {
            ["backend", "max_entries", "max_bytes", "max_ttl", "max_vectors", "embeddings", "min_threshold", "scope_floor", "secret_file"]
                .iter()
                .any(|k| c.contains_key(*k))
        })
        || map
            .get("fleet")
            .and_then(Value::as_object)
            .is_some_and(|f| f.contains_key("redis") || f.contains_key("policy"))
}

/// A sidecar config, checked as `serve` loads it.
pub fn check_sidecar(text: &str) -> Result<String, String> {
    let config = crate::config::Config::from_yaml(text).map_err(|e| e.to_string())?;
    let plans = config.scope_plans().map_err(|e| e.to_string())?;
    let scopes: Vec<_> = plans.iter().map(|p| p.scope.as_str()).collect();
    let mut out = format!("sidecar config: scopes {}", scopes.join(", "));
    for w in crate::config::dcgm_warnings(&config, &plans) {
        out.push_str(&format!("; warning: {w}"));
    }
    if let Some(cache) = &config.cache {
        match cache.secret().map_err(|(p, m)| format!("{p}: {m}"))? {
            Some(_) => out.push_str("; cache endpoints: shared secret"),
            None => out.push_str(
                "; warning: cache.secret_file: unset: the cache endpoints trust loopback alone \
                 (under a mesh, every pod allowed to reach this port)",
            ),
        }
    }
    if let Some(fleet) = &config.fleet {
        let loaded = fleet.load().map_err(|e| e.to_string())?;
        out.push_str(&format!(
            "; fleet: {} ({}), policy fingerprint {}",
            fleet.redis.split('@').next_back().unwrap_or_default(),
            if fleet.redis.starts_with("rediss://") {
                "TLS"
            } else {
                "no TLS"
            },
            loaded.fingerprint()
        ));
    }
    Ok(out)
}

/// A fleet policy's secret comes from the VM's environment
/// (`fleet.secret_env`): the filter's `vm_config.environment_variables`
/// must pass that variable (`host_env_keys` or `key_values`), else the
/// filter refuses the policy when Envoy loads it.
fn fleet_secret_reaches_the_vm(doc: &Value, at: &str, policy: &Policy) -> Result<(), String> {
    let Some(fleet) = &policy.fleet else {
        return Ok(());
    };
    let filter_at = at.strip_suffix(".configuration").unwrap_or(at);
    let name = fleet.secret_env.as_str();
    if vm_gets(doc, filter_at, name) {
        return Ok(());
    }
    Err(format!(
        "{filter_at}.vm_config.environment_variables: the fleet secret's variable {name} \
         (fleet.secret_env) does not reach the VM; add `host_env_keys: [{name}]`"
    ))
}

/// The same for the cache endpoints' secret (`cache.secret_env`): the
/// filter refuses the policy when the variable is not in its VM.
fn cache_secret_reaches_the_vm(doc: &Value, at: &str, policy: &Policy) -> Result<(), String> {
    let Some(name) = policy
        .cache_compiled
        .as_ref()
        .and_then(|c| c.secret_env.as_deref())
    else {
        return Ok(());
    };
    let filter_at = at.strip_suffix(".configuration").unwrap_or(at);
    if vm_gets(doc, filter_at, name) {
        return Ok(());
    }
    Err(format!(
        "{filter_at}.vm_config.environment_variables: the cache secret's variable {name} \
         (cache.secret_env) does not reach the VM; add `host_env_keys: [{name}]`"
    ))
}

/// Whether the wasm filter at `filter_at` hands its VM the variable `name`.
fn vm_gets(doc: &Value, filter_at: &str, name: &str) -> bool {
    let env = pointer(doc, filter_at)
        .and_then(|f| f.get("vm_config"))
        .and_then(|v| v.get("environment_variables"));
    env.is_some_and(|e| {
        e.get("host_env_keys")
            .and_then(Value::as_array)
            .is_some_and(|keys| keys.iter().any(|k| k.as_str() == Some(name)))
            || e.get("key_values")
                .and_then(Value::as_object)
                .is_some_and(|kv| kv.contains_key(name))
    })
}

/// The value at a location written by [`find_policies`] (`.a.b[0].c`).
fn pointer<'a>(doc: &'a Value, at: &str) -> Option<&'a Value> {
    let mut v = doc;
    for part in at.split('.').filter(|p| !p.is_empty()) {
        let (key, rest) = part.split_once('[').map_or((part, ""), |(k, r)| (k, r));
        if !key.is_empty() {
            v = v.get(key)?;
        }
        for index in rest.split('[').filter(|i| !i.is_empty()) {
            let i: usize = index.trim_end_matches(']').parse().ok()?;
            v = v.get(i)?;
        }
    }
    Some(v)
}

/// Room the buffer needs above `request.max_body_bytes`: sluice may rewrite
/// the body (model, max output, `stream_options`) and make it longer.
pub const BUFFER_HEADROOM: u64 = 64 * 1024;

/// Envoy's default `per_connection_buffer_limit_bytes`.
const ENVOY_DEFAULT_BUFFER: u64 = 1 << 20;

/// A warning when the listener that holds the policy at `at` buffers no
/// more than the body cap: a body just under the cap would be admitted and
/// then refused with 413 by Envoy once sluice's rewrite made it longer.
fn buffer_warning(doc: &Value, at: &str, policy: &Policy) -> Option<String> {
    let listeners = doc.pointer("/static_resources/listeners")?.as_array()?;
    let (i, listener) = listeners
        .iter()
        .enumerate()
        .find(|(i, _)| at.starts_with(&format!(".static_resources.listeners[{i}]")))?;
    let limit = listener
        .get("per_connection_buffer_limit_bytes")
        .and_then(|v| v.as_u64().or_else(|| v.as_str()?.parse().ok()))
        .unwrap_or(ENVOY_DEFAULT_BUFFER);
    let needed = policy
        .request
        .max_body_bytes
        .saturating_add(BUFFER_HEADROOM);
    (limit < needed).then(|| {
        format!(
            "warning: static_resources.listeners[{i}].per_connection_buffer_limit_bytes is {limit}, \
             not above request.max_body_bytes ({}) + {BUFFER_HEADROOM}: Envoy answers 413 to a body \
             near the cap once sluice rewrites it; set it to at least {needed}",
            policy.request.max_body_bytes
        )
    })
}

/// Envoy's route timeout when a route sets none.
const ENVOY_DEFAULT_ROUTE_TIMEOUT_MS: u64 = 15_000;

/// A warning per route of the policy's listener whose timeout is shorter
/// than the longest `max_wait`: Envoy would answer 504 to a request still
/// waiting its turn in sluice's queue. `0s` (no timeout) is fine.
fn timeout_warnings(doc: &Value, at: &str, policy: &Policy) -> Vec<String> {
    let longest = policy
        .classes
        .values()
        .filter(|c| c.queue)
        .map(|c| c.max_wait_ms)
        .max()
        .unwrap_or(0);
    let listeners = doc
        .pointer("/static_resources/listeners")
        .and_then(Value::as_array);
    let Some((i, listener)) = listeners.and_then(|l| {
        l.iter()
            .enumerate()
            .find(|(i, _)| at.starts_with(&format!(".static_resources.listeners[{i}]")))
    }) else {
        return Vec::new();
    };
    if longest == 0 {
        return Vec::new();
    }
    let mut routes = Vec::new();
    collect_routes(listener, &mut routes);
    routes
        .into_iter()
        .filter_map(|(name, timeout)| {
            let ms = match timeout {
                None => ENVOY_DEFAULT_ROUTE_TIMEOUT_MS,
                Some(text) => envoy_duration_ms(&text)?,
            };
            (ms != 0 && ms <= longest).then(|| {
                format!(
                    "warning: static_resources.listeners[{i}]: route {name} has a timeout of {ms} ms, \
                     not above the longest classes.*.max_wait ({longest} ms): Envoy answers 504 to a \
                     request still queued; set the route timeout above it"
                )
            })
        })
        .collect()
}

/// Every route under a listener: its match (for the message) and timeout.
fn collect_routes(v: &Value, out: &mut Vec<(String, Option<String>)>) {
    match v {
        Value::Object(map) => {
            if let (Some(m), Some(route)) = (map.get("match"), map.get("route")) {
                let timeout = route
                    .get("timeout")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                out.push((m.to_string(), timeout));
                return;
            }
            map.values().for_each(|c| collect_routes(c, out));
        }
        Value::Array(items) => items.iter().for_each(|c| collect_routes(c, out)),
        _ => {}
    }
}

/// `300s`, `1.5s` (protobuf JSON durations) in ms.
fn envoy_duration_ms(text: &str) -> Option<u64> {
    let secs: f64 = text.trim().strip_suffix('s')?.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| (secs * 1000.0).round() as u64)
}

fn summary(p: &Policy) -> String {
    format!(
        "{} tiers, {} models, {} routes, default tier `{}`",
        p.tiers.len(),
        p.models.len(),
        p.routes.len(),
        p.default_tier
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::policy::fleet_policy;

    #[test]
    fn the_shipped_envoy_config_passes() {
        let text = include_str!("../../envoy/sluice.yaml");
        let summary = check(text).unwrap();
        assert!(summary.contains("3 tiers, 3 models"), "{summary}");
    }

    #[test]
    fn a_bad_field_is_named() {
        let text = "default_tier: free\ntiers:\n  free: {requets: 10/min}\n";
        let err = check(text).unwrap_err();
        assert!(err.contains("tiers.free.requets"), "{err}");
        let shipped = include_str!("../../envoy/sluice.yaml");
        assert_eq!(
            shipped.matches("requests: 60/min").count(),
            1,
            "the pro tier's rate"
        );
        let text = shipped.replace("requests: 60/min", "requests: 60/fortnight");
        let err = check(&text).unwrap_err();
        assert!(err.contains("tiers.pro.requests"), "{err}");
    }

    #[test]
    fn a_buffer_without_headroom_is_warned_about() {
        let shipped = include_str!("../../envoy/sluice.yaml");
        assert!(!check(shipped).unwrap().contains("warning"));
        let limit = "per_connection_buffer_limit_bytes: 1114112";
        assert_eq!(
            shipped.matches(limit).count(),
            1,
            "the shipped listener's limit"
        );
        let tight = shipped.replace(limit, "per_connection_buffer_limit_bytes: 1048576");
        let summary = check(&tight).unwrap();
        assert!(
            summary.contains(
                "warning: static_resources.listeners[0].per_connection_buffer_limit_bytes"
            ),
            "{summary}"
        );
        // Envoy's default (1 MiB) is the cap itself: warned about too.
        let default = shipped.replace(limit, "");
        assert!(check(&default).unwrap().contains("warning"));
    }

    #[test]
    fn a_route_timeout_under_the_longest_wait_is_warned_about() {
        let shipped = include_str!("../../envoy/sluice.yaml");
        assert!(!check(shipped).unwrap().contains("timeout"));
        assert_eq!(shipped.matches("timeout: 300s").count(), 2);
        let short = shipped.replacen("timeout: 300s", "timeout: 20s", 1);
        let summary = check(&short).unwrap();
        assert!(summary.contains("has a timeout of 20000 ms"), "{summary}");
        assert!(summary.contains("max_wait (30000 ms)"), "{summary}");
        // No timeout at all (Envoy's default, 15 s) is warned about too.
        let none = shipped.replace("timeout: 300s", "");
        assert!(check(&none).unwrap().contains("timeout of 15000 ms"));
        assert!(!check(&shipped.replace("timeout: 300s", "timeout: 0s"))
            .unwrap()
            .contains("timeout"));
    }

    #[test]
    fn a_sidecar_config_is_checked_with_what_its_fleet_section_names() {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("policy.yaml");
        std::fs::write(
            &policy,
            "default_tier: t\nidentity: {sources: [client_address]}\ntiers: {t: {requests: 10/min}}\n\
             sidecar: {cluster: sc}\nfleet: {salt: check-config-salt-0123}\n",
        )
        .unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "check-config-secret-0123").unwrap();
        let config = |redis: &str| {
            format!(
                "listen: 127.0.0.1:0\nfleet:\n  redis: {redis}\n  policy: {}\n  secret_file: {}\n",
                policy.display(),
                secret.display()
            )
        };
        let ok = check_any(&config("rediss://redis.example:6380")).unwrap();
        assert!(
            ok.starts_with("sidecar config:") && ok.contains("(TLS)"),
            "{ok}"
        );
        assert!(ok.contains("policy fingerprint"), "{ok}");
        let err = check_any(&config("rediss://:hunter2@redis.example:6380")).unwrap_err();
        assert!(err.contains("fleet.redis"), "{err}");
        assert!(
            !err.contains("hunter2"),
            "the password is not echoed: {err}"
        );
        // `fleet.redis` alone makes it a sidecar config (a policy's fleet
        // has no `redis`).
        let err = check_any("fleet: {redis: 'redis://127.0.0.1:6379'}").unwrap_err();
        assert!(err.contains("fleet.policy"), "{err}");
        let err = check_any("listen: 127.0.0.1:0\nfleet: {redis: 'redis://x', surprise: 1}\n")
            .unwrap_err();
        assert!(err.contains("surprise"), "{err}");
    }

    #[test]
    fn an_envoy_config_whose_fleet_secret_does_not_reach_the_vm_is_refused() {
        let shipped = include_str!("../../envoy/sluice.yaml");
        let marker = "                              on_stale: fail_open\n";
        assert_eq!(shipped.matches(marker).count(), 1, "the sidecar section");
        let fleet = format!(
            "{marker}                            fleet: {{ salt: check-config-salt-0123 }}\n"
        );
        let with_fleet = shipped.replace(marker, &fleet);
        let err = check(&with_fleet).unwrap_err();
        assert!(
            err.contains("vm_config.environment_variables") && err.contains("SLUICE_FLEET_SECRET"),
            "{err}"
        );
        let vm = "                          vm_id: sluice\n";
        assert_eq!(with_fleet.matches(vm).count(), 1);
        let passed = with_fleet.replace(
            vm,
            &format!("{vm}                          environment_variables: {{ host_env_keys: [SLUICE_FLEET_SECRET] }}\n"),
        );
        assert!(check(&passed).is_ok(), "{:?}", check(&passed));
        assert!(fleet_policy(&passed).is_ok_and(|p| p.fleet.is_some()));
        // A salt too short is refused as the filter would.
        let short = passed.replace("check-config-salt-0123", "short");
        assert!(check(&short).unwrap_err().contains("fleet.salt"));
    }

    #[test]
    fn the_cache_secret_is_checked_on_both_sides() {
        let shipped = include_str!("../../envoy/sluice.yaml");
        let marker = "                              on_stale: fail_open\n";
        let cache = format!(
            "{marker}                            cache: {{ salt: s, secret_env: SLUICE_CACHE_SECRET, \
             models: {{ m: {{ exact: true }} }} }}\n"
        );
        let with_cache = shipped.replace(marker, &cache);
        let err = check(&with_cache).unwrap_err();
        assert!(
            err.contains("vm_config.environment_variables") && err.contains("SLUICE_CACHE_SECRET"),
            "{err}"
        );
        let vm = "                          vm_id: sluice\n";
        let passed = with_cache.replace(
            vm,
            &format!("{vm}                          environment_variables: {{ host_env_keys: [SLUICE_CACHE_SECRET] }}\n"),
        );
        let ok = check(&passed).unwrap();
        assert!(!ok.contains("cache.secret_env: unset"), "{ok}");
        // The sidecar's side: a file, at least 16 bytes, named when wrong.
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "short").unwrap();
        let config = format!("cache: {{ secret_file: {} }}\n", secret.display());
        assert!(check_any(&config)
            .unwrap_err()
            .contains("cache.secret_file"));
        std::fs::write(&secret, "check-config-cache-secret-0123").unwrap();
        assert!(check_any(&config)
            .unwrap()
            .contains("cache endpoints: shared secret"));
        let unset = check_any("cache: { max_entries: 10 }\n").unwrap();
        assert!(
            unset.contains("warning: cache.secret_file: unset"),
            "{unset}"
        );
    }

    #[test]
    fn string_value_form() {
        let text = r#"{"name": "sluice", "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": "{\"default_tier\": \"a\", \"tiers\": {\"a\": {}}}"}}"#;
        assert!(check(text).unwrap().contains("1 tiers"));
    }
}
