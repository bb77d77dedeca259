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
use crate::engine::{Engine, Plan, Verdict};
use crate::metrics;
use crate::principal::{Identity, RequestView};
use crate::reconcile::{Format, Found, Meter};
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
                None => match hostcalls::define_metric(metric_type(name), name) {
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
        self.add(metrics::DEGRADED, i64::from(verdict.degraded.is_some()));
        self.add(
            metrics::BUDGET_ALERTS,
            i64::from(!verdict.alerts.is_empty()),
        );
    }
}

fn metric_type(name: &str) -> MetricType {
    if metrics::GAUGES.contains(&name) {
        MetricType::Gauge
    } else {
        MetricType::Counter
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
            plan: None,
            meter: None,
            status: 0,
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
    /// What admission reserved, until it is settled.
    plan: Option<Plan>,
    /// Reads the response as it passes.
    meter: Option<Meter>,
    status: u32,
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
                if let Some(plan) = verdict.plan.filter(Plan::settles) {
                    self.metrics.add(metrics::RESERVATIONS_OUTSTANDING, 1);
                    self.plan = Some(plan);
                }
                Action::Continue
            }
        }
    }

    /// Admission once everything the policy needs is known.
    fn decide(&mut self, body: &[u8]) -> Action {
        let Some(identity) = self.identity.clone() else {
            return Action::Continue;
        };
        let asked = match self.engine.demand(&identity, self.api, body) {
            Ok(asked) => asked,
            Err(verdict) => return self.finish(*verdict),
        };
        let now = self.now_ms();
        let mut verdict = self.engine.admit(
            &HostStore,
            &identity,
            self.api,
            &self.path,
            asked.as_ref(),
            now,
        );
        if let Some(new_body) = verdict.body.take() {
            // The upstream gets the rewritten request (model, max output,
            // usage in streams); its length changes with it.
            self.set_http_request_body(0, body.len(), &new_body);
            self.set_http_request_header("content-length", Some(&new_body.len().to_string()));
        }
        self.finish(verdict)
    }

    /// Replaces the reservation with the real cost; runs once per request.
    fn settle(&mut self) {
        let Some(plan) = self.plan.take() else { return };
        let (found, counted, cut) = match &self.meter {
            Some(m) => (m.found, m.output_events, m.cut),
            None => (Found::Nothing, 0, false),
        };
        let upstream_ok = self.status == 0 || self.status < 400;
        let now = self.now_ms();
        let (settled, effort) =
            self.engine
                .settle(&HostStore, &plan, found, counted, upstream_ok, now);
        let m = &self.metrics;
        m.add(metrics::RESERVATIONS_OUTSTANDING, -1);
        m.add(metrics::CAS_RETRIES, i64::from(effort.cas_retries));
        m.add(metrics::INPUT_TOKENS, settled.input as i64);
        m.add(metrics::OUTPUT_TOKENS, settled.output as i64);
        m.add(metrics::SPEND_MICROS, settled.cost as i64);
        m.add(metrics::USAGE_INVALID, i64::from(settled.invalid_usage));
        m.add(
            metrics::USAGE_MISSING,
            i64::from(!settled.from_usage && upstream_ok),
        );
        m.add(metrics::STREAM_CUT, i64::from(cut));
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
        self.status = self
            .get_http_response_header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        for (name, value) in std::mem::take(&mut self.response_headers) {
            self.set_http_response_header(&name, Some(&value));
        }
        if let Some(plan) = &self.plan {
            let content_type = self.get_http_response_header("content-type");
            let ollama = matches!(plan.api, Api::OllamaChat | Api::OllamaGenerate);
            let format = Format::detect(content_type.as_deref(), plan.stream && ollama);
            // A stream may run past its allowance only if the upstream
            // ignores the max output it was given; then sluice ends it.
            let allowance = plan.stream.then_some(plan.max_output);
            if format != Format::Json {
                // sluice may change the stream's length.
                self.set_http_response_header("content-length", None);
            }
            self.meter = Some(Meter::new(format, plan.strip_usage, allowance));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.meter.is_none() {
            return Action::Continue;
        }
        let chunk = self
            .get_http_response_body(0, body_size)
            .unwrap_or_default();
        let out = self
            .meter
            .as_mut()
            .and_then(|m| m.feed(&chunk, end_of_stream));
        if let Some(out) = out.filter(|out| *out != chunk) {
            self.set_http_response_body(0, body_size, &out);
        }
        if end_of_stream {
            self.settle();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // Client gone, upstream reset or timeout: settle from what was seen.
        self.settle();
    }
}
