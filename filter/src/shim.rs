//! The proxy-wasm adapter: hands Envoy's view of a request to the
//! [`Engine`] and applies its verdict. No policy is decided here.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType, Status};

use crate::config::Policy;
use crate::engine::{Engine, Plan, Routed, Verdict};
use crate::health::{self, Pushback, Seen};
use crate::metrics;
use crate::principal::{Identity, RequestView};
use crate::reconcile::{Format, Found, Meter};
use crate::request::Api;
use crate::store::{SharedStore, StoreError};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root {
            engine: None,
            metrics: Rc::new(Metrics::default()),
            shared: Rc::new(Shared::default()),
            id: 0,
            poll: None,
            retry_at_ms: 0,
            sidecar_failing: false,
        })
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
    /// The metric's id, defined on first use (at 0).
    fn id(&self, name: &str, kind: MetricType) -> Option<u32> {
        let mut ids = self.ids.borrow_mut();
        if let Some(id) = ids.get(name) {
            return Some(*id);
        }
        let id = hostcalls::define_metric(kind, name).ok()?;
        ids.insert(name.to_string(), id);
        Some(id)
    }

    /// Defines the metrics alerts and dashboards read, at 0, before
    /// anything happens: a counter that first appears at 1 hides that
    /// first increment from Prometheus' `rate()`/`increase()` (the first
    /// surge, reroute or refusal by a bucket would never alert), and a
    /// gauge that is absent reads as "no data" rather than 0.
    fn define_known(&self, engine: &Engine) {
        for name in metrics::FIXED {
            self.id(name, metric_type(name));
        }
        for rule in engine.rules() {
            self.id(&metrics::refusals_total(&rule.id), MetricType::Counter);
        }
    }

    fn add(&self, name: &str, by: i64) {
        if by == 0 {
            return;
        }
        if let Some(id) = self.id(name, metric_type(name)) {
            let _ = hostcalls::increment_metric(id, by);
        }
    }

    fn record(&self, verdict: &Verdict) {
        let l = &verdict.labels;
        self.add(&metrics::requests_total(l), 1);
        self.add(metrics::CAS_RETRIES, i64::from(verdict.effort.cas_retries));
        self.add(metrics::CAS_EXHAUSTED, i64::from(verdict.effort.exhausted));
        self.add(
            metrics::CAPACITY_EXHAUSTED,
            i64::from(verdict.effort.no_slot),
        );
        self.add(
            metrics::BUDGET_ALERTS,
            i64::from(!verdict.alerts.is_empty()),
        );
        if let Some(bucket) = &verdict.bucket {
            self.add(&metrics::refusals_total(bucket), 1);
        }
        if l.reason == "global_breaker_open" {
            self.set(metrics::GLOBAL_BREAKER, 1);
        }
        if let Some(kind) = verdict.degraded {
            self.add(&metrics::degraded_total(kind, &l.tier, &l.model), 1);
        }
        if let Some(plan) = verdict.plan.as_ref().filter(|_| verdict.reply.is_none()) {
            let tokens =
                |direction| metrics::tokens_total(direction, "estimated", &l.tier, &l.model);
            self.add(&tokens("input"), plan.input_estimate as i64);
            self.add(&tokens("output"), plan.max_output as i64);
        }
    }

    /// Records one value in a histogram.
    fn observe(&self, name: &str, value: u64) {
        if let Some(id) = self.id(name, MetricType::Histogram) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    /// Sets a gauge to a value.
    fn set(&self, name: &str, value: u64) {
        if let Some(id) = self.id(name, MetricType::Gauge) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

fn metric_type(name: &str) -> MetricType {
    if metrics::GAUGES.contains(&name) {
        MetricType::Gauge
    } else {
        MetricType::Counter
    }
}

/// Per-VM state the HTTP contexts share: the decoded sidecar state (kept
/// until the shared-data entry changes) and a dice for half-open trickles.
#[derive(Default)]
struct Shared {
    seen: RefCell<(u32, Rc<Seen>)>,
    dice: Cell<u64>,
}

impl Shared {
    /// The sidecar state in shared data, decoded again only when it changed.
    fn seen(&self) -> Rc<Seen> {
        let Some((bytes, cas)) = HostStore.get(SIDECAR_KEY) else {
            return Rc::new(Seen::default());
        };
        let mut cached = self.seen.borrow_mut();
        if cached.0 != cas {
            *cached = (cas, Rc::new(health::decode_seen(&bytes)));
        }
        cached.1.clone()
    }

    /// Uniform in 0..1000 (xorshift; fairness, not secrecy).
    fn roll(&self, now_ms: u64) -> u32 {
        let mut x = self.dice.get();
        if x == 0 {
            x = now_ms | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.dice.set(x);
        (x % 1000) as u32
    }
}

/// Longest audit field value: every field, whatever a client sent.
const MAX_AUDIT_BYTES: usize = 256;
/// The routing header the kill switch sets (see `FallbackConfig`).
const DEFAULT_FALLBACK_HEADER: &str = "x-sluice-upstream";
/// The sidecar state as received: written by the one VM that polls.
const SIDECAR_KEY: &str = "sluice:v1:sidecar";
/// Which VM polls the sidecar: owner id and lease expiry.
const POLLER_KEY: &str = "sluice:v1:poller";
const LEASE_MS: u64 = 3_000;
const TICK: Duration = Duration::from_millis(250);

struct Root {
    engine: Option<Rc<Engine>>,
    metrics: Rc<Metrics>,
    shared: Rc<Shared>,
    /// This VM's id in the poller lease.
    id: u64,
    /// The in-flight long poll, if any.
    poll: Option<u32>,
    /// After a failed poll, wait until then.
    retry_at_ms: u64,
    /// The last poll failed (logged once per outage).
    sidecar_failing: bool,
}

impl Root {
    fn now_ms(&self) -> u64 {
        self.get_current_time()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    /// Takes or renews the poller lease: one VM in the whole Envoy polls.
    fn hold_lease(&self, now: u64) -> bool {
        let (bytes, cas) = HostStore.get(POLLER_KEY).unwrap_or_default();
        let word = |i: usize| {
            bytes
                .get(i..i + 8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_le_bytes)
        };
        let (owner, expires) = (word(0), word(8));
        if owner != self.id && expires > now {
            return false;
        }
        let mut next = self.id.to_le_bytes().to_vec();
        next.extend_from_slice(&(now + LEASE_MS).to_le_bytes());
        HostStore.set(POLLER_KEY, &next, cas).is_ok()
    }

    fn dispatch_poll(&mut self, now: u64) {
        let Some(engine) = self.engine.clone() else {
            return;
        };
        let Some(sidecar) = engine.policy.sidecar.as_ref() else {
            return;
        };
        let since = self.shared.seen().state.as_ref().map_or(0, |s| s.version);
        let wait_s = health::poll_wait_s(sidecar.poll_wait_ms, sidecar.stale_after_ms);
        let path = format!("/v1/state?since={since}&wait={wait_s}");
        let authority = sidecar
            .authority
            .clone()
            .unwrap_or_else(|| sidecar.cluster.clone());
        let headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority.as_str()),
        ];
        let timeout = Duration::from_millis(wait_s * 1000 + 5_000);
        match self.dispatch_http_call(&sidecar.cluster, headers, None, vec![], timeout) {
            Ok(token) => self.poll = Some(token),
            Err(status) => {
                self.metrics.add(metrics::SIDECAR_POLL_ERRORS, 1);
                log(
                    LogLevel::Warn,
                    &format!(
                        "cannot poll the sidecar (cluster {}): {status:?}",
                        sidecar.cluster
                    ),
                );
                self.retry_at_ms = now + 1_000;
            }
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if self.poll != Some(token) {
            return;
        }
        self.poll = None;
        let now = self.now_ms();
        let status = self.get_http_call_response_header(":status");
        let body = self
            .get_http_call_response_body(0, body_size)
            .unwrap_or_default();
        let state = match (
            status.as_deref(),
            serde_json::from_slice::<health::SidecarState>(&body),
        ) {
            (Some("200"), Ok(state)) => state,
            (status, parsed) => {
                self.metrics.add(metrics::SIDECAR_POLL_ERRORS, 1);
                self.retry_at_ms = now + 1_000;
                if !self.sidecar_failing {
                    // Said once per outage, not once per retry.
                    self.sidecar_failing = true;
                    let why = match (status, parsed) {
                        (Some("200"), Err(e)) => format!("unreadable state: {e}"),
                        (Some(code), _) => format!("status {code}"),
                        (None, _) => "no answer".into(),
                    };
                    log(
                        LogLevel::Warn,
                        &format!("sidecar unreachable ({why}); keeping its last state for stale_after, then the on_stale policy"),
                    );
                }
                return;
            }
        };
        if std::mem::take(&mut self.sidecar_failing) {
            log(LogLevel::Info, "sidecar reachable again");
        }
        self.metrics.add(metrics::SIDECAR_POLLS, 1);
        self.metrics
            .set(metrics::KILL_SWITCH, u64::from(state.kill_switch.active));
        let open = state.breakers.iter().filter(|b| b.state == "open").count();
        self.metrics.set(metrics::BREAKERS_OPEN, open as u64);
        // One writer (the lease holder): no CAS needed. Every answer, even
        // an unchanged state, refreshes the receive time.
        let _ = HostStore.set(SIDECAR_KEY, &health::encode_seen(now, &body), 0);
        if self.hold_lease(now) {
            self.dispatch_poll(now);
        }
    }
}

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
        self.metrics.define_known(&engine);
        let rules = engine.rules();
        match engine.prepare(&HostStore) {
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
        if engine.policy.sidecar.is_some() {
            let now = self.now_ms();
            self.id = (u64::from(
                self.get_current_time()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0),
            ) << 20)
                ^ now.rotate_left(7)
                | 1;
            self.set_tick_period(TICK);
        }
        self.engine = Some(Rc::new(engine));
        true
    }

    fn on_tick(&mut self) {
        let now = self.now_ms();
        if !self.hold_lease(now) || self.poll.is_some() || now < self.retry_at_ms {
            return;
        }
        self.dispatch_poll(now);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let engine = self.engine.clone()?;
        Some(Box::new(Http {
            engine,
            metrics: self.metrics.clone(),
            shared: self.shared.clone(),
            watch_upstream: false,
            pushback: None,
            probe_lease: None,
            identity: None,
            api: Api::Other,
            path: String::new(),
            response_headers: Vec::new(),
            decided: false,
            body_size: 0,
            plan: None,
            meter: None,
            status: 0,
            started_ms: 0,
            first_byte: false,
            labels: None,
            response_hash: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// A header as text. Envoy lets bytes 0x80–0xFF through in values, and the
/// SDK's string getters (`get_map_value`, `get_http_request_header`, …)
/// unwrap UTF-8 and so kill the VM on one such byte from a client: read
/// bytes and replace what is not UTF-8.
fn header_text(map: MapType, name: &str) -> Option<String> {
    let bytes = hostcalls::get_map_value_bytes(map, name).ok().flatten()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

fn request_header(name: &str) -> Option<String> {
    header_text(MapType::HttpRequestHeaders, name)
}

fn response_header(name: &str) -> Option<String> {
    header_text(MapType::HttpResponseHeaders, name)
}

/// The request as Envoy holds it, read on demand.
struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<String> {
        request_header(name)
    }

    fn header_count(&self, name: &str) -> usize {
        // Bytes again (see `header_text`); names are tokens, always ASCII.
        // A host error counts as repeated: the credential is refused.
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
            .map(|headers| {
                headers
                    .iter()
                    .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                    .count()
            })
            .unwrap_or(usize::MAX)
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
    shared: Rc<Shared>,
    /// The request went to the primary upstream: its answer feeds the
    /// route's pause and error breaker.
    watch_upstream: bool,
    /// The route's pushback state as the request found it.
    pushback: Option<Pushback>,
    /// This request holds the route's half-open probe (its lease).
    probe_lease: Option<u64>,
    identity: Option<Identity>,
    api: Api,
    /// The canonical path (`request::canonical_path`), for route buckets.
    path: String,
    response_headers: Vec<(String, String)>,
    decided: bool,
    /// Request body bytes buffered so far (for a request that ends with
    /// trailers, the body is read in the trailers callback).
    body_size: usize,
    /// What admission reserved, until it is settled.
    plan: Option<Plan>,
    /// Reads the response as it passes.
    meter: Option<Meter>,
    status: u32,
    /// When the request arrived; whether its first response byte left.
    started_ms: u64,
    first_byte: bool,
    /// Tier and model labels of the decision, for later metrics.
    labels: Option<(String, String)>,
    /// SHA-256 of the response body, when the audit asks for it.
    response_hash: Option<sha2::Sha256>,
}

impl Http {
    /// One audit field in filter state, read by Envoy's access log as
    /// `%FILTER_STATE(wasm.<name>:PLAIN)%`; only with an `audit` policy.
    fn audit(&self, name: &str, value: &str) {
        if self.engine.policy.audit.is_some() {
            let value = crate::answer::truncate(value, MAX_AUDIT_BYTES);
            let _ = hostcalls::set_property(vec![name], Some(value.as_bytes()));
        }
    }

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
        let l = &verdict.labels;
        if verdict.reply.is_none() {
            // Latency and token metrics describe requests that went upstream.
            self.labels = Some((l.tier.clone(), l.model.clone()));
            if self.engine.policy.anomaly.is_some() {
                // Admission passed the global breaker: it is closed now
                // (else the gauge would stay at 1 after the hour's window
                // let spend fall under the ceiling, until a settlement).
                self.metrics.set(metrics::GLOBAL_BREAKER, 0);
            }
        }
        self.audit_decision(&verdict);
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

    /// The decision's audit fields (nothing without an `audit` policy).
    fn audit_decision(&self, verdict: &Verdict) {
        if self.engine.policy.audit.is_none() {
            return;
        }
        let l = &verdict.labels;
        self.audit("sluice_decision", l.decision);
        self.audit("sluice_reason", l.reason);
        self.audit("sluice_tier", &l.tier);
        if let Some(identity) = &self.identity {
            self.audit("sluice_principal", &self.engine.audit_principal(identity));
        }
        if let Some(bucket) = &verdict.bucket {
            self.audit("sluice_bucket", bucket);
        }
        if let Some(kind) = verdict.degraded {
            self.audit("sluice_degraded", kind);
        }
        if let Some(plan) = verdict.plan.as_ref().filter(|_| verdict.reply.is_none()) {
            self.audit("sluice_model_served", plan.model.as_deref().unwrap_or(""));
            let reserved = plan.input_estimate.saturating_add(plan.max_output);
            self.audit("sluice_tokens_estimated", &reserved.to_string());
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
        // Admission time is arrival time (one clock read per request).
        let now = self.started_ms;
        let model = asked.as_ref().and_then(|a| a.demand.model.as_deref());
        if let Some(model) = model {
            self.audit("sluice_model_requested", model);
        }
        if self
            .engine
            .policy
            .audit
            .as_ref()
            .is_some_and(|a| a.hash_bodies)
        {
            self.audit("sluice_request_sha256", &crate::principal::sha256_hex(body));
            self.response_hash = Some(sha2::Digest::new());
        }
        let mut pushback = self
            .engine
            .pushback(&HostStore, model, &HostRequest, &identity, now);
        let seen = if self.engine.policy.sidecar.is_some() {
            self.shared.seen()
        } else {
            Rc::new(Seen::default())
        };
        let dice = self.shared.roll(now);
        let engine = self.engine.clone();
        let api = self.api;
        let route = |pushback: &Pushback| {
            engine.route(&seen, pushback, &identity, api, asked.as_ref(), now, dice)
        };
        let (fallback, probe) = match route(&pushback) {
            Routed::Answered(verdict) => return self.finish(*verdict),
            Routed::Fallback => (true, false),
            Routed::Primary => (false, false),
            Routed::Probe => (false, true),
        };
        let mut verdict = self.engine.admit(
            &HostStore,
            &identity,
            self.api,
            &self.path,
            asked.as_ref(),
            now,
        );
        if probe {
            // Claimed only now, by an admitted request: a refused one never
            // holds the probe.
            let (decided, lease) =
                engine.take_probe(&HostStore, &mut pushback, verdict, &identity, now, route);
            verdict = decided;
            self.probe_lease = lease;
        }
        self.pushback = Some(pushback);
        if verdict.reply.is_none() {
            if fallback {
                self.reroute(&mut verdict);
            } else {
                self.watch_upstream = true;
            }
        }
        if let Some(new_body) = verdict.body.take() {
            // The upstream gets the rewritten request (model, max output,
            // usage in streams); its length changes with it.
            self.set_http_request_body(0, body.len(), &new_body);
            self.set_http_request_header("content-length", Some(&new_body.len().to_string()));
        }
        self.finish(verdict)
    }

    /// Kill switch: the request goes to the fallback route (header + route
    /// cache refresh); Envoy's route injects the fallback's credentials.
    fn reroute(&mut self, verdict: &mut Verdict) {
        let Some(fb) = self.engine.policy.fallback.clone() else {
            return;
        };
        self.set_http_request_header(&fb.header, Some(&fb.value));
        if let Err(status) = hostcalls::call_foreign_function("clear_route_cache", Some(&[])) {
            log(
                LogLevel::Warn,
                &format!("clear_route_cache failed: {status:?}"),
            );
        }
        verdict
            .response_headers
            .push(("x-sluice-provider".into(), fb.provider.clone()));
        verdict
            .response_headers
            .push(("x-sluice-kill-switch".into(), "1".into()));
        self.metrics.add(metrics::REROUTED, 1);
    }

    /// Feeds the upstream's answer to the route's pause and error breaker.
    fn observe_upstream(&mut self, status: u32) {
        let lease = self.probe_lease.take();
        let Some(pushback) = self
            .pushback
            .as_ref()
            .filter(|p| p.must_record(status, lease))
        else {
            return;
        };
        let now = self.now_ms();
        let retry_after = response_header("retry-after");
        let dice = self.shared.roll(now);
        let from_upstream = hostcalls::get_property(vec!["response", "code_details"])
            .ok()
            .flatten()
            .is_some_and(|d| d == b"via_upstream");
        let recorded = self.engine.observe_upstream(
            &HostStore,
            pushback,
            status,
            from_upstream,
            retry_after.as_deref(),
            lease,
            dice,
            now,
        );
        let m = &self.metrics;
        m.add(
            metrics::ERROR_BREAKER_OPENED,
            i64::from(recorded.breaker_opened),
        );
        m.add(metrics::PUSHBACK_DROPPED, i64::from(recorded.dropped));
        match recorded.paused {
            Some(health::PauseScope::Route) => m.add(metrics::PAUSES_ROUTE, 1),
            Some(health::PauseScope::Credential) => m.add(metrics::PAUSES_CREDENTIAL, 1),
            None => {}
        }
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
        let (tier, model) = self.labels.clone().unwrap_or_default();
        m.add(
            &metrics::tokens_total("input", "actual", &tier, &model),
            settled.input as i64,
        );
        m.add(
            &metrics::tokens_total("output", "actual", &tier, &model),
            settled.output as i64,
        );
        m.add(metrics::USAGE_SURGES, i64::from(settled.surge));
        if self.engine.policy.anomaly.is_some() {
            m.set(metrics::GLOBAL_BREAKER, u64::from(settled.global_open));
        }
        self.audit("sluice_tokens_input", &settled.input.to_string());
        self.audit("sluice_tokens_output", &settled.output.to_string());
        self.audit("sluice_cost_micros", &settled.cost.to_string());
        self.audit(
            "sluice_usage_source",
            if settled.from_usage {
                "upstream"
            } else {
                "estimate"
            },
        );
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
        self.started_ms = self.now_ms();
        // Only sluice may choose the fallback route, also when the policy
        // has no `fallback` section but the Envoy routes still match it.
        let header = self
            .engine
            .policy
            .fallback
            .as_ref()
            .map(|f| f.header.clone());
        self.set_http_request_header(header.as_deref().unwrap_or(DEFAULT_FALLBACK_HEADER), None);
        let raw_path = request_header(":path").unwrap_or_default();
        let method = request_header(":method").unwrap_or_default();
        self.api = Api::classify(&method, &raw_path);
        let identity = match self.engine.identify(&HostRequest) {
            Ok(identity) => identity,
            Err(verdict) => return self.finish(*verdict),
        };
        match crate::request::canonical_path(&raw_path) {
            Ok(path) => self.path = path,
            // Whatever the upstream decodes it to, sluice cannot know: a
            // request that may be an LLM call does not go up unread.
            Err(_) if method.eq_ignore_ascii_case("POST") => {
                let verdict = self.engine.ambiguous_path(&identity);
                return self.finish(verdict);
            }
            Err(_) => self.path = raw_path,
        }
        let declared = if self.api.reads_body() {
            request_header("content-length").and_then(|v| v.trim().parse::<u64>().ok())
        } else {
            None
        };
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
        self.body_size = body_size;
        if !end_of_stream {
            // Buffer until the whole body is here: the end of the body, or
            // trailers after it (HTTP/2, HTTP/3).
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        self.decide(&body)
    }

    /// A request that ends with trailers never has a body callback with
    /// `end_of_stream`: this is where it is decided, on the buffered body.
    /// Without it, Envoy would resume the paused request on its own when
    /// the trailers arrive — upstream, undecided.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.decided || self.identity.is_none() {
            return Action::Continue;
        }
        let body = self
            .get_http_request_body(0, self.body_size)
            .unwrap_or_default();
        self.decide(&body)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.status = response_header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        for (name, value) in std::mem::take(&mut self.response_headers) {
            self.set_http_response_header(&name, Some(&value));
        }
        if std::mem::take(&mut self.watch_upstream) {
            self.observe_upstream(self.status);
        }
        if let Some(plan) = &self.plan {
            let content_type = response_header("content-type");
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
        // Latency histograms describe model calls (the LLM APIs), not
        // `/v1/models` and the like.
        if !self.first_byte && body_size > 0 && self.labels.is_some() && self.api.reads_body() {
            self.first_byte = true;
            let ttft = self.now_ms().saturating_sub(self.started_ms);
            let model = self
                .labels
                .as_ref()
                .map(|(_, m)| m.clone())
                .unwrap_or_default();
            self.metrics.observe(&metrics::ttft_ms(&model), ttft);
            self.audit("sluice_ttft_ms", &ttft.to_string());
        }
        if self.meter.is_none() && self.response_hash.is_none() {
            return Action::Continue;
        }
        let chunk = self
            .get_http_response_body(0, body_size)
            .unwrap_or_default();
        if let Some(hash) = self.response_hash.as_mut() {
            sha2::Digest::update(hash, &chunk);
            if end_of_stream {
                let digest = sha2::Digest::finalize(hash.clone());
                let hex = crate::principal::hex(&digest);
                self.audit("sluice_response_sha256", &hex);
            }
        }
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
        // A probe whose answer never came (the client left first) is given
        // back, not left to block the route until its lease ends.
        if let (Some(lease), Some(pushback)) = (self.probe_lease.take(), &self.pushback) {
            let _ = health::release_probe(&HostStore, &pushback.route_key, lease);
        }
        if let Some((_, model)) = self
            .labels
            .as_ref()
            .filter(|_| self.status != 0 && self.api.reads_body())
        {
            let elapsed = self.now_ms().saturating_sub(self.started_ms);
            self.metrics.observe(&metrics::e2e_ms(model), elapsed);
        }
    }
}
