//! What the native module accepts when Envoy hands it a policy
//! (`config_new`, on the main thread): a policy it can run, and nothing
//! else. Safe code, no Envoy call: the unit tests run it as it is.
//!
//! Two checks, in order:
//!
//! 1. [`unsupported`]: the fields whose feature needs a host capability
//!    the prototype does not have (see `filter.rs`: no callouts, no tick,
//!    no wake-up queues, no resumed request or response, and of Envoy's
//!    attributes only the source address and the response code details).
//!    Each one is named, with what it would need; all of them at once, so
//!    an operator fixes the policy in one go.
//! 2. The core's own load, as the wasm host's root context runs it on
//!    Envoy's main thread ([`Poller::configure`]): the policy parsed and
//!    checked, compiled, its callers placed under the deployment's hash
//!    key (an operator's key shorter than `MIN_SECRET` bytes is refused
//!    with the core's message, naming `identity.hash_key_env`), its
//!    shared-data keys created. Its errors are the refusal's message.
//!
//! A refusal makes `config_new` return no configuration: Envoy then
//! refuses the filter, and with it the listener.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use sluice_core::{Headers, Host, MetricKind};
use sluice_core::{IdentitySource, Policy, Poller, SharedStore, StoreError};

/// Wall clock, nanoseconds since the Unix epoch.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A field of the policy the native module cannot run, and what it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    /// The field's path, as the core's errors name fields.
    pub field: String,
    pub needs: &'static str,
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` ({})", self.field, self.needs)
    }
}

const SIDECAR: &str = "the kill switch, the GPU breakers and the rungs' health are the sidecar's \
                       state, long-polled by a callout on the tick: the native module has neither";
const FLEET: &str = "fleet leases and slots are callouts to the sidecar, renewed on the tick";
const CACHE: &str = "lookups and stores are callouts to the sidecar, and a request waiting for \
                     one is resumed";
const FAILOVER: &str = "each attempt is a callout, and the held answer is resumed";
const QUEUE: &str = "a request that waits for a slot is paused, woken through a wake-up queue and \
                     resumed, its deadline kept by the tick; write `queue: false` to refuse it at \
                     once instead";
const WORKER_LEASES: &str = "a worker's leases are given back on its tick";
const JWT: &str = "claims are read from jwt_authn's dynamic metadata, which the native module \
                   does not read";

/// Every field of `policy` the native module cannot run, in the policy's
/// order; empty: it can run all of it.
pub fn unsupported(policy: &Policy) -> Vec<Unsupported> {
    let mut found = Vec::new();
    let mut refuse = |field: String, needs: &'static str| found.push(Unsupported { field, needs });
    let identity = &policy.identity;
    if identity.jwt.is_some() || identity.sources.contains(&IdentitySource::Jwt) {
        refuse("identity.jwt".into(), JWT);
    }
    if policy.sidecar.is_some() {
        refuse("sidecar".into(), SIDECAR);
    }
    if policy.failover.is_some() {
        refuse("failover".into(), FAILOVER);
    }
    // A `cache` section with no model nor route to cache does nothing.
    if policy
        .cache_compiled
        .as_ref()
        .is_some_and(|c| !(c.models.is_empty() && c.routes.is_empty()))
    {
        refuse("cache".into(), CACHE);
    }
    for (name, class) in &policy.classes {
        if class.queue {
            refuse(format!("classes.{name}"), QUEUE);
        }
    }
    if policy.state.worker_leases.enabled {
        refuse("state.worker_leases".into(), WORKER_LEASES);
    }
    if policy.fleet.is_some() {
        refuse("fleet".into(), FLEET);
    }
    found
}

/// The refusal of a policy with unsupported fields: every field named.
pub fn refusal(fields: &[Unsupported]) -> String {
    let list: Vec<String> = fields.iter().map(Unsupported::to_string).collect();
    format!(
        "sluice policy: the native module (prototype) cannot run these fields: {}",
        list.join("; ")
    )
}

/// Loads `config` as the native module will run it; `Err`: why not (every
/// unsupported field, or the core's own refusal). `env` reads the
/// environment (Envoy's, in the module), `store` is the shared data the
/// workers will use (a generated hash key is kept there).
pub fn check(
    config: &[u8],
    store: &dyn SharedStore,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), String> {
    let policy = Policy::from_plugin_config(config).map_err(|err| err.to_string())?;
    let fields = unsupported(&policy);
    if !fields.is_empty() {
        return Err(refusal(&fields));
    }
    let host = LoadHost { store, env };
    let (loaded, errors) =
        crate::log_lines::collecting_errors(|| Poller::new().configure(&host, config));
    if loaded {
        return Ok(());
    }
    Err(if errors.is_empty() {
        "sluice policy: the policy did not load".into()
    } else {
        errors.join("; ")
    })
}

/// The host of a load on the main thread: shared data and the
/// environment (the errors it logs are collected by `check`); no stream (Envoy gives `config_new` none), no
/// metric (the workers define them), nothing else logged (each worker
/// logs its own load).
struct LoadHost<'a> {
    store: &'a dyn SharedStore,
    env: &'a dyn Fn(&str) -> Option<String>,
}

impl SharedStore for LoadHost<'_> {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }
}

impl Host for LoadHost<'_> {
    fn request_header(&self, _: &str) -> Option<String> {
        None
    }

    fn request_header_count(&self, _: &str) -> usize {
        0
    }

    fn request_headers(&self) -> Option<Headers> {
        None
    }

    fn set_request_header(&self, _: &str, _: Option<&str>) {}

    fn response_header(&self, _: &str) -> Option<String> {
        None
    }

    fn set_response_header(&self, _: &str, _: Option<&str>) {}

    fn request_body(&self, _: usize) -> Vec<u8> {
        Vec::new()
    }

    fn replace_request_body(&self, _: usize, _: &[u8]) {}

    fn response_body(&self, _: usize) -> Vec<u8> {
        Vec::new()
    }

    fn replace_response_body(&self, _: usize, _: &[u8]) {}

    fn send_reply(&self, _: u32, _: &[(&str, &str)], _: &[u8]) {}

    fn reset_stream(&self) -> bool {
        false
    }

    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        None
    }

    fn set_property(&self, _: &str, _: &[u8]) {}

    fn clear_route_cache(&self) -> Result<(), String> {
        Err("no stream at load".into())
    }

    fn metric_add(&self, _: MetricKind, _: &str, _: i64) {}

    fn metric_record(&self, _: MetricKind, _: &str, _: u64) {}

    fn now_ns(&self) -> u64 {
        now_ns()
    }

    fn env_var(&self, name: &str) -> Option<String> {
        (self.env)(name)
    }

    fn set_tick_period_ms(&self, _: u64) {}

    fn dispatch_call(&self, _: &str, _: &[(&str, &str)], _: u64) -> Result<u32, String> {
        Err("no callout at load".into())
    }

    fn dispatch_post(&self, _: &str, _: &[(&str, &str)], _: &[u8], _: u64) -> Result<u32, String> {
        Err("no callout at load".into())
    }

    fn call_response_header(&self, _: &str) -> Option<String> {
        None
    }

    fn call_response_body(&self, _: usize) -> Vec<u8> {
        Vec::new()
    }

    fn register_wake_queue(&self, _: &str) -> Option<u32> {
        None
    }

    fn wake(&self, _: u32, _: &[u8]) -> bool {
        false
    }

    fn take_wake(&self, _: u32) -> Option<Vec<u8>> {
        None
    }

    fn set_effective_context(&self, _: u32) -> bool {
        false
    }

    fn resume_request(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use serde_json::{json, Value};
    use sluice_core::{MemStore, MIN_SECRET};

    /// The policy of the shipped demo config (envoy/sluice.yaml), as JSON.
    fn demo_policy() -> Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/sluice.yaml");
        let text = std::fs::read_to_string(path).expect("envoy/sluice.yaml");
        let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
        let mut found = None;
        find_policy(&yaml, &mut found);
        serde_json::to_value(found.expect("the `sluice` filter's policy")).expect("JSON")
    }

    /// The `configuration.value` of the `sluice` HTTP filter, anywhere.
    fn find_policy(v: &serde_yaml::Value, found: &mut Option<serde_yaml::Value>) {
        match v {
            serde_yaml::Value::Mapping(m) => {
                if m.get("name").and_then(|n| n.as_str()) == Some("sluice") {
                    if let Some(policy) = m
                        .get("typed_config")
                        .and_then(|t| t.get("config"))
                        .and_then(|c| c.get("configuration"))
                        .and_then(|c| c.get("value"))
                    {
                        *found = Some(policy.clone());
                        return;
                    }
                }
                m.values().for_each(|v| find_policy(v, found));
            }
            serde_yaml::Value::Sequence(s) => s.iter().for_each(|v| find_policy(v, found)),
            _ => {}
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn load(policy: &Value, env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
        check(policy.to_string().as_bytes(), &MemStore::default(), env)
    }

    /// A per-key bucket, a model's bucket and a daily token budget: what
    /// the native module runs.
    fn minimal() -> Value {
        json!({
            "default_tier": "free",
            "identity": {
                "sources": ["api_key", "client_address"],
                "api_key": {"header": "x-api-key", "keys": {"native-key": "free"}},
            },
            "tiers": {"free": {"requests": "3/min", "daily_tokens": 100_000}},
            "models": {"m": {"requests": "2/min"}},
        })
    }

    #[test]
    fn the_demo_policy_is_refused_with_every_field_it_cannot_run() {
        let demo = demo_policy();
        let policy = Policy::from_value(demo.clone()).expect("the demo policy loads in the core");
        let fields: Vec<String> = unsupported(&policy).into_iter().map(|u| u.field).collect();
        assert_eq!(
            fields,
            [
                "identity.jwt",
                "sidecar",
                "failover",
                "classes.batch",
                "classes.standard"
            ]
        );
        let err = load(&demo, &no_env).unwrap_err();
        for field in &fields {
            assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
        }
        assert!(err.contains("kill switch"), "{err}");
    }

    #[test]
    fn the_demo_policy_without_those_fields_is_accepted() {
        let mut demo = demo_policy();
        let p = demo.as_object_mut().unwrap();
        p.remove("sidecar");
        p.remove("failover");
        p["identity"]["sources"] = json!(["api_key", "client_address"]);
        p["identity"].as_object_mut().unwrap().remove("jwt");
        for class in p["classes"].as_object_mut().unwrap().values_mut() {
            *class = json!({"queue": false});
        }
        load(&demo, &no_env).unwrap();
    }

    #[test]
    fn a_policy_it_can_run_is_accepted() {
        assert_eq!(
            unsupported(&Policy::from_value(minimal()).unwrap()),
            Vec::new()
        );
        load(&minimal(), &no_env).unwrap();
        // Concurrency without a queue: refused at once, no wait.
        let mut p = minimal();
        p["models"]["m"]["concurrency"] = json!(2);
        p["classes"] = json!({"interactive": {"queue": false}});
        p["default_class"] = json!("interactive");
        load(&p, &no_env).unwrap();
    }

    #[test]
    fn each_feature_it_cannot_run_is_named() {
        let cases = [
            (json!({"sidecar": {"cluster": "sc"}}), "sidecar"),
            (
                json!({"failover": {"cluster": "self"}, "providers": {"p": {"route": "p", "default_model": "m", "prices": {"m": {"input": "1", "output": "1"}}}}, "ladder": ["p"]}),
                "failover",
            ),
            (
                json!({"classes": {"batch": {"max_wait": "5s"}}}),
                "classes.batch",
            ),
            (
                json!({"state": {"worker_leases": {"enabled": true}}}),
                "state.worker_leases",
            ),
            (
                json!({"identity": {"sources": ["jwt"], "jwt": {}}}),
                "identity.jwt",
            ),
            (
                json!({"sidecar": {"cluster": "sc"}, "fleet": {"salt": "a-fleet-salt-of-enough-bytes"}}),
                "fleet",
            ),
            (
                json!({"sidecar": {"cluster": "sc"}, "cache": {"salt": "a-cache-salt", "models": {"m": {"exact": true}}}}),
                "cache",
            ),
        ];
        for (extra, field) in cases {
            let mut p = minimal();
            for (k, v) in extra.as_object().unwrap() {
                p[k] = v.clone();
            }
            let policy = Policy::from_value(p.clone())
                .unwrap_or_else(|e| panic!("{field}: the core refuses the case itself: {e}"));
            let fields: Vec<String> = unsupported(&policy).into_iter().map(|u| u.field).collect();
            assert!(fields.contains(&field.to_string()), "{field}: {fields:?}");
            let err = load(&p, &no_env).unwrap_err();
            assert!(err.contains(&format!("`{field}`")), "{err}");
        }
    }

    #[test]
    fn a_short_hash_key_is_refused_as_the_wasm_host_refuses_it() {
        let short = "x".repeat(MIN_SECRET - 1);
        let env = |name: &str| (name == "SLUICE_HASH_KEY").then(|| short.clone());
        let err = load(&minimal(), &env).unwrap_err();
        assert!(err.starts_with("identity.hash_key_env:"), "{err}");
        assert!(
            err.contains("SLUICE_HASH_KEY") && !err.contains(&short),
            "{err}"
        );
        // Named by the policy: that variable.
        let mut p = minimal();
        p["identity"]["hash_key_env"] = json!("MY_KEY");
        let env = |name: &str| (name == "MY_KEY").then(|| "short".to_string());
        let err = load(&p, &env).unwrap_err();
        assert!(err.contains("MY_KEY"), "{err}");
        // Long enough: accepted.
        let long = "y".repeat(MIN_SECRET);
        let env = |name: &str| (name == "SLUICE_HASH_KEY").then(|| long.clone());
        load(&minimal(), &env).unwrap();
    }

    #[test]
    fn the_cores_own_refusals_still_name_their_field() {
        let mut p = minimal();
        p["tiers"]["free"]["requets"] = json!("5/min");
        let err = load(&p, &no_env).unwrap_err();
        assert!(err.contains("tiers.free.requets"), "{err}");
    }
}
