//! The proxy-wasm adapter: hands Envoy's view of a request to the
//! [`Engine`] and applies its verdict. No policy is decided here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType, Status};

use crate::config::Policy;
use crate::engine::{Engine, Verdict};
use crate::metrics;
use crate::principal::{Identity, RequestView};
use crate::request::Api;
use crate::reservation::prepare;
use crate::store::{SharedStore, StoreError};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { engine: None, metrics: Rc::new(Metrics::default()) })
    });
}}

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// Envoy's shared data for this `vm_id`.
struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Some((bytes, cas.unwrap_or(0))),
            _ => None,
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let cas = (cas != 0).then_some(cas);
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|status| match status {
            Status::CasMismatch => StoreError::CasMismatch,
            other => StoreError::Host(format!("{other:?}")),
        })
    }
}

/// Counters defined on first use, one id per name, per VM.
#[derive(Default)]
struct Metrics {
    ids: RefCell<HashMap<String, u32>>,
}

impl Metrics {
    fn add(&self, name: &str, by: i64) {
        if by == 0 {
            return;
        }
        let id = {
            let mut ids = self.ids.borrow_mut();
            match ids.get(name) {
                Some(id) => *id,
                None => match hostcalls::define_metric(MetricType::Counter, name) {
                    Ok(id) => *ids.entry(name.to_string()).or_insert(id),
                    Err(_) => return,
                },
            }
        };
        let _ = hostcalls::increment_metric(id, by);
    }

    fn record(&self, verdict: &Verdict) {
        self.add(&metrics::requests_total(&verdict.labels), 1);
        self.add(metrics::CAS_RETRIES, i64::from(verdict.effort.cas_retries));
        self.add(metrics::CAS_EXHAUSTED, i64::from(verdict.effort.exhausted));
        self.add(
            metrics::BUCKET_OVERFLOW,
            i64::from(verdict.effort.overflowed),
        );
    }
}

struct Root {
    engine: Option<Rc<Engine>>,
    metrics: Rc<Metrics>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        let policy = match Policy::from_plugin_config(&bytes) {
            Ok(policy) => policy,
            Err(err) => {
                // Envoy refuses the listener and keeps the last good policy.
                log(LogLevel::Error, &err.to_string());
                self.metrics.add(metrics::CONFIG_REJECTED, 1);
                return false;
            }
        };
        let engine = Engine::new(policy);
        let rules = engine.rules();
        match prepare(&HostStore, &rules, engine.policy.state.principal_slots) {
            Ok(created) => log(
                LogLevel::Info,
                &format!(
                    "policy loaded: {} tiers, {} models, {} routes, {} buckets ({} new shared-data keys)",
                    engine.policy.tiers.len(),
                    engine.policy.models.len(),
                    engine.policy.routes.len(),
                    rules.len(),
                    created
                ),
            ),
            Err(err) => {
                log(LogLevel::Error, &format!("cannot create shared-data keys: {err}"));
                return false;
            }
        }
        self.engine = Some(Rc::new(engine));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let engine = self.engine.clone()?;
        Some(Box::new(Http {
            engine,
            metrics: self.metrics.clone(),
            identity: None,
            api: Api::Other,
            path: String::new(),
            response_headers: Vec::new(),
            decided: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The request as Envoy holds it, read on demand.
struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(proxy_wasm::types::MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn jwt_claim(&self, namespace: &str, payload_key: &str, claim: &str) -> Option<String> {
        let path = vec!["metadata", "filter_metadata", namespace, payload_key, claim];
        let bytes = hostcalls::get_property(path).ok().flatten()?;
        String::from_utf8(bytes).ok()
    }

    fn client_address(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["source", "address"])
            .ok()
            .flatten()?;
        String::from_utf8(bytes).ok()
    }
}

struct Http {
    engine: Rc<Engine>,
    metrics: Rc<Metrics>,
    identity: Option<Identity>,
    api: Api,
    path: String,
    response_headers: Vec<(String, String)>,
    decided: bool,
}

impl Http {
    fn now_ms(&self) -> u64 {
        self.get_current_time()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    /// Applies a verdict: answer locally, or let the request go upstream.
    fn finish(&mut self, verdict: Verdict) -> Action {
        self.decided = true;
        self.metrics.record(&verdict);
        match verdict.reply {
            Some(reply) => {
                let headers: Vec<(&str, &str)> = reply
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str(), v.as_str()))
                    .collect();
                self.send_http_response(reply.status, headers, Some(&reply.body));
                Action::Pause
            }
            None => {
                self.response_headers = verdict.response_headers;
                Action::Continue
            }
        }
    }

    /// Admission once everything the policy needs is known.
    fn decide(&mut self, body: &[u8]) -> Action {
        let Some(identity) = self.identity.clone() else {
            return Action::Continue;
        };
        let demand = match self.engine.demand(&identity, self.api, body) {
            Ok(demand) => demand,
            Err(verdict) => return self.finish(*verdict),
        };
        let now = self.now_ms();
        let verdict = self
            .engine
            .admit(&HostStore, &identity, &self.path, demand.as_ref(), now);
        self.finish(verdict)
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.path = self.get_http_request_header(":path").unwrap_or_default();
        let method = self.get_http_request_header(":method").unwrap_or_default();
        self.api = Api::classify(&method, &self.path);
        let identity = match self.engine.identify(&HostRequest) {
            Ok(identity) => identity,
            Err(verdict) => return self.finish(*verdict),
        };
        let declared = self
            .get_http_request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(verdict) = declared.and_then(|len| self.engine.too_large(&identity, len)) {
            return self.finish(verdict);
        }
        self.identity = Some(identity);
        if self.api.reads_body() && !end_of_stream {
            return Action::Pause; // wait for the body
        }
        self.decide(&[])
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let Some(identity) = self.identity.as_ref() else {
            return Action::Continue;
        };
        if let Some(verdict) = self.engine.too_large(identity, body_size as u64) {
            return self.finish(verdict);
        }
        if !end_of_stream {
            return Action::Pause; // buffer until the whole body is here
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        self.decide(&body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in std::mem::take(&mut self.response_headers) {
            self.set_http_response_header(&name, Some(&value));
        }
        Action::Continue
    }
}
