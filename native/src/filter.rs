//! The native adapter: implements [`Host`] with the dynamic-module
//! callbacks of [`crate::abi`] and forwards each Envoy event to
//! the core ([`Poller`], [`Request`]), as filter/src/shim.rs does for proxy-wasm.
//! Nothing is decided here. Safe code only.
//!
//! Envoy's shapes, mapped onto the wasm filter's:
//! - the filter config (`config_new`, main thread) is the plugin
//!   configuration: it keeps the policy's bytes and defines the metrics
//!   (Envoy allows that only there);
//! - each worker thread gets its own [`Poller`] (the root context), made
//!   and configured on the first stream that worker sees: the core's
//!   per-VM state is `Rc`, one per thread, exactly as one wasm VM per
//!   worker;
//! - each stream is a [`Request`] (the HTTP context);
//! - shared data is one process-wide [`MemStore`] (Envoy's semantics:
//!   compare-and-swap tokens, missing keys written unconditionally), which
//!   every worker sees.
//!
//! Prototype limits (issue 32): no callouts (sidecar poll, fleet, cache,
//! failover), no tick, no wake-up queues (the queue), no request or
//! response resume, and of Envoy's attributes only the source address and
//! the response code details (no dynamic metadata: no JWT claims). The
//! calls that need them answer "cannot"; a policy that uses a feature
//! built on them is refused at load ([`crate::load`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, LazyLock, Weak};

use sluice_core::metrics::{self, Metric};
use sluice_core::{Headers, Host, MetricKind};
use sluice_core::{MemStore, Poller, Request, SharedStore, StoreError, Vm};

use crate::abi::{self, Attribute, Body, HeaderMap, LogLevel, StatKind, StatOp};
use crate::load;

/// Envoy's shared data, for the whole process (every worker, every config).
static STORE: LazyLock<MemStore> = LazyLock::new(MemStore::default);

/// The audit fragment's filter-state key: the wasm host stores a
/// property `P` as `wasm.P`, and the shipped access log reads
/// `%FILTER_STATE(wasm.sluice_audit:PLAIN)%`, so the native host writes
/// the same key and that log line works unchanged.
const PROPERTY_PREFIX: &str = "wasm.";

/// What a hook returns: `Continue`, or hold the stream (the same value,
/// 1, is `StopIteration` for headers and trailers and
/// `StopIterationAndBuffer` for a body).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Continue = 0,
    Stop = 1,
}

impl From<sluice_core::Action> for Status {
    fn from(a: sluice_core::Action) -> Status {
        match a {
            sluice_core::Action::Continue => Status::Continue,
            sluice_core::Action::Pause => Status::Stop,
        }
    }
}

/// Where a stream was when a hook panicked.
#[derive(Clone, Copy)]
pub enum Phase {
    /// Before the upstream: the client gets a 500, nothing goes upstream.
    Request,
    Response,
    Done,
}

/// A panic caught at the boundary: the request (if still before the
/// upstream) is answered 500; the response goes on as it is.
pub fn panicked(envoy: abi::Filter<'_>, phase: Phase) -> Status {
    match phase {
        Phase::Request => {
            envoy.send_response(500, &[("x-sluice-reason", "internal")], b"", "sluice_panic");
            Status::Stop
        }
        Phase::Response | Phase::Done => Status::Continue,
    }
}

/// A stat the config defined: Envoy's id and how it aggregates.
#[derive(Clone, Copy)]
struct Stat {
    kind: StatKind,
    id: usize,
}

/// One filter configuration, shared by every worker: immutable once made.
pub struct Shared {
    policy: Vec<u8>,
    /// Each stat of `metrics::ALL`, by its name (labels are Envoy's).
    stats: HashMap<&'static str, Stat>,
}

/// A line the core logged (`crate::log_lines`), to Envoy's log.
pub fn log_to_envoy(level: log::Level, message: &str) {
    let level = match level {
        log::Level::Error => LogLevel::Error,
        log::Level::Warn => LogLevel::Warn,
        _ => LogLevel::Info,
    };
    abi::log(level, message);
}

/// What Envoy holds for a filter configuration.
pub struct Config {
    shared: Arc<Shared>,
}

fn stat_kind(kind: MetricKind) -> StatKind {
    match kind {
        MetricKind::Counter => StatKind::Counter,
        MetricKind::Gauge => StatKind::Gauge,
        MetricKind::Histogram => StatKind::Histogram,
    }
}

impl Config {
    /// Loads the policy as the module will run it ([`load::check`]: a
    /// policy it cannot run, or one the core refuses, refuses the filter
    /// config, so Envoy refuses the listener) and defines every stat.
    pub fn new(envoy: &abi::Config<'_>, policy: &[u8]) -> Option<Config> {
        if let Err(err) = load::check(policy, &*STORE, &|name| std::env::var(name).ok()) {
            abi::log(LogLevel::Error, &format!("sluice: {err}"));
            return None;
        }
        let mut stats = HashMap::new();
        for m in metrics::ALL {
            let kind = stat_kind(m.kind);
            match envoy.define(kind, m.name, m.labels) {
                Some(id) => {
                    stats.insert(m.name, Stat { kind, id });
                }
                None => abi::log(LogLevel::Warn, &format!("sluice: cannot define {}", m.name)),
            }
        }
        Some(Config {
            shared: Arc::new(Shared {
                policy: policy.to_vec(),
                stats,
            }),
        })
    }
}

/// A stat name the core used, resolved once per worker: its stat and
/// label values (`None`: no stat of the table).
type Resolved = Option<(Stat, Vec<String>)>;

/// One worker thread's state for one filter configuration.
struct Worker {
    shared: Arc<Shared>,
    poller: RefCell<Poller>,
    names: RefCell<HashMap<String, Resolved>>,
}

thread_local! {
    /// What this worker's pollers share (the wasm filter's per-VM state).
    static VM: Rc<Vm> = Rc::default();
    /// This worker's state per live filter configuration.
    static WORKERS: RefCell<Vec<(Weak<Shared>, Rc<Worker>)>> = const { RefCell::new(Vec::new()) };
}

/// This thread's worker for `config`, made and configured on first use;
/// `None` if the policy did not load here.
fn worker_for(config: &Config, envoy: abi::Filter<'_>) -> Option<Rc<Worker>> {
    let found = WORKERS.with(|all| {
        let all = all.try_borrow().ok()?;
        all.iter()
            .find(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&config.shared)))
            .map(|(_, worker)| worker.clone())
    });
    if let Some(worker) = found {
        return Some(worker);
    }
    let worker = Rc::new(Worker {
        shared: config.shared.clone(),
        poller: RefCell::new(VM.with(|vm| Poller::in_vm(vm.clone()))),
        names: RefCell::default(),
    });
    let loaded = {
        let host = NativeHost {
            envoy,
            worker: &worker,
            request_body: false,
        };
        let mut poller = worker.poller.try_borrow_mut().ok()?;
        poller.configure(&host, &worker.shared.policy)
    };
    if !loaded {
        return None;
    }
    WORKERS.with(|all| {
        if let Ok(mut all) = all.try_borrow_mut() {
            // Configurations Envoy destroyed since (a reload) leave.
            all.retain(|(w, _)| w.strong_count() > 0);
            all.push((Arc::downgrade(&config.shared), worker.clone()));
        }
    });
    Some(worker)
}

/// One HTTP stream, as Envoy holds it between hooks.
pub struct Stream {
    request: Request,
    worker: Rc<Worker>,
}

impl Stream {
    pub fn new(config: &Config, envoy: abi::Filter<'_>) -> Option<Stream> {
        let worker = worker_for(config, envoy)?;
        let request = worker.poller.try_borrow().ok()?.request()?;
        Some(Stream { request, worker })
    }

    /// Runs one hook on the core's request with a host for this hook.
    fn run<T>(
        &mut self,
        envoy: abi::Filter<'_>,
        request_body: bool,
        hook: impl FnOnce(&mut Request, &NativeHost<'_>) -> T,
    ) -> T {
        let host = NativeHost {
            envoy,
            worker: &self.worker,
            request_body,
        };
        hook(&mut self.request, &host)
    }

    pub fn on_request_headers(&mut self, envoy: abi::Filter<'_>, end: bool) -> Status {
        self.run(envoy, false, |r, h| r.on_request_headers(h, end).into())
    }

    pub fn on_request_body(&mut self, envoy: abi::Filter<'_>, end: bool) -> Status {
        let size = body_len(envoy, true);
        self.run(envoy, true, |r, h| r.on_request_body(h, size, end).into())
    }

    pub fn on_request_trailers(&mut self, envoy: abi::Filter<'_>) -> Status {
        self.run(envoy, false, |r, h| r.on_request_trailers(h).into())
    }

    pub fn on_response_headers(&mut self, envoy: abi::Filter<'_>) -> Status {
        self.run(envoy, false, |r, h| r.on_response_headers(h).into())
    }

    pub fn on_response_body(&mut self, envoy: abi::Filter<'_>, end: bool) -> Status {
        let size = body_len(envoy, false);
        self.run(envoy, false, |r, h| r.on_response_body(h, size, end).into())
    }

    /// Before the access log: the wasm filter's `on_log`.
    pub fn on_stream_complete(&mut self, envoy: abi::Filter<'_>) {
        self.run(envoy, false, |r, h| r.on_log(h));
    }
}

/// The body this hook sees, whole so far: what Envoy buffered before it,
/// then the chunk it just received (unless that chunk is the buffer).
fn body_parts<'a>(envoy: abi::Filter<'a>, request: bool) -> Vec<&'a [u8]> {
    let (buffered, received) = if request {
        (Body::BufferedRequest, Body::ReceivedRequest)
    } else {
        (Body::BufferedResponse, Body::ReceivedResponse)
    };
    let mut parts = envoy.body_chunks(buffered);
    if !envoy.received_is_buffered(request) {
        parts.extend(envoy.body_chunks(received));
    }
    parts
}

fn body_len(envoy: abi::Filter<'_>, request: bool) -> usize {
    let (buffered, received) = if request {
        (Body::BufferedRequest, Body::ReceivedRequest)
    } else {
        (Body::BufferedResponse, Body::ReceivedResponse)
    };
    let mut size = envoy.body_size(buffered);
    if !envoy.received_is_buffered(request) {
        size += envoy.body_size(received);
    }
    size
}

/// The first `size` bytes of the parts, copied (the `Host` trait hands
/// the core owned bytes, as the wasm host must).
fn first_bytes(parts: &[&[u8]], size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size.min(parts.iter().map(|p| p.len()).sum()));
    for part in parts {
        let room = size - out.len();
        if room == 0 {
            break;
        }
        out.extend_from_slice(&part[..part.len().min(room)]);
    }
    out
}

/// Replaces the first `size` bytes of a body (prototype: drains the
/// buffered then the received body and appends the new bytes to the one
/// that held data).
fn replace_body(envoy: abi::Filter<'_>, request: bool, size: usize, body: &[u8]) {
    let (buffered, received) = if request {
        (Body::BufferedRequest, Body::ReceivedRequest)
    } else {
        (Body::BufferedResponse, Body::ReceivedResponse)
    };
    let rest: Vec<u8> = {
        let parts = body_parts(envoy, request);
        let all = first_bytes(&parts, usize::MAX);
        all.get(size..).map(<[u8]>::to_vec).unwrap_or_default()
    };
    let target = if envoy.body_size(received) > 0 && !envoy.received_is_buffered(request) {
        received
    } else {
        buffered
    };
    envoy.drain_body(buffered, usize::MAX);
    if !envoy.received_is_buffered(request) {
        envoy.drain_body(received, usize::MAX);
    }
    envoy.append_body(target, body);
    envoy.append_body(target, &rest);
}

/// Bytes as text, bad UTF-8 replaced (a client's byte 0x80–0xFF must
/// never panic).
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Envoy, through the dynamic-module callbacks, for one hook.
struct NativeHost<'a> {
    envoy: abi::Filter<'a>,
    worker: &'a Worker,
    /// In a request-body hook (the received chunk is readable).
    request_body: bool,
}

impl NativeHost<'_> {
    /// Updates the stat `name` (a [`Metric::named`] name) by `op`. The
    /// name is taken apart once per worker.
    fn stat(&self, name: &str, op: impl FnOnce(Stat) -> StatOp) {
        let Ok(mut names) = self.worker.names.try_borrow_mut() else {
            return;
        };
        if !names.contains_key(name) {
            let resolved = metrics::find(name).and_then(|(m, values): (Metric, Vec<&str>)| {
                let stat = *self.worker.shared.stats.get(m.name)?;
                Some((stat, values.into_iter().map(str::to_string).collect()))
            });
            names.insert(name.to_string(), resolved);
        }
        if let Some(Some((stat, values))) = names.get(name) {
            let values: Vec<&str> = values.iter().map(String::as_str).collect();
            self.envoy.stat(stat.kind, stat.id, &values, op(*stat));
        }
    }
}

impl SharedStore for NativeHost<'_> {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        STORE.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        STORE.set(key, value, cas)
    }
}

impl Host for NativeHost<'_> {
    fn request_header(&self, name: &str) -> Option<String> {
        self.envoy.header(HeaderMap::Request, name).map(text)
    }

    fn request_header_count(&self, name: &str) -> usize {
        self.envoy.header_count(HeaderMap::Request, name)
    }

    fn request_headers(&self) -> Option<Headers> {
        Some(Headers::of(&self.envoy.headers(HeaderMap::Request)?))
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) {
        self.envoy.set_header(HeaderMap::Request, name, value);
    }

    fn response_header(&self, name: &str) -> Option<String> {
        self.envoy.header(HeaderMap::Response, name).map(text)
    }

    fn set_response_header(&self, name: &str, value: Option<&str>) {
        self.envoy.set_header(HeaderMap::Response, name, value);
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        let parts = if self.request_body {
            body_parts(self.envoy, true)
        } else {
            self.envoy.body_chunks(Body::BufferedRequest)
        };
        first_bytes(&parts, size)
    }

    fn replace_request_body(&self, size: usize, body: &[u8]) {
        replace_body(self.envoy, true, size, body);
    }

    fn response_body(&self, size: usize) -> Vec<u8> {
        first_bytes(&body_parts(self.envoy, false), size)
    }

    fn replace_response_body(&self, size: usize, body: &[u8]) {
        replace_body(self.envoy, false, size, body);
    }

    fn send_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.envoy.send_response(status, headers, body, "sluice");
    }

    fn reset_stream(&self) -> bool {
        self.envoy.reset_stream("sluice_stream_reset");
        true
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let id = match path {
            ["source", "address"] => Attribute::SourceAddress,
            ["response", "code_details"] => Attribute::ResponseCodeDetails,
            _ => return None,
        };
        self.envoy.attribute(id).map(<[u8]>::to_vec)
    }

    fn set_property(&self, name: &str, value: &[u8]) {
        let key = format!("{PROPERTY_PREFIX}{name}");
        self.envoy.set_filter_state(&key, value);
    }

    fn clear_route_cache(&self) -> Result<(), String> {
        self.envoy.clear_route_cache();
        Ok(())
    }

    fn metric_add(&self, _kind: MetricKind, name: &str, by: i64) {
        self.stat(name, |stat| match (stat.kind, by) {
            (StatKind::Gauge, by) if by < 0 => StatOp::Sub(by.unsigned_abs()),
            (_, by) => StatOp::Add(by.unsigned_abs()),
        });
    }

    fn metric_record(&self, _kind: MetricKind, name: &str, value: u64) {
        self.stat(name, |_| StatOp::Set(value));
    }

    fn now_ns(&self) -> u64 {
        load::now_ns()
    }

    fn set_tick_period_ms(&self, _ms: u64) {
        // Prototype: no tick (no sidecar poll, no queue, no leases).
    }

    fn dispatch_call(&self, _: &str, _: &[(&str, &str)], _: u64) -> Result<u32, String> {
        Err("callouts are not in the native prototype".into())
    }

    fn dispatch_post(&self, _: &str, _: &[(&str, &str)], _: &[u8], _: u64) -> Result<u32, String> {
        Err("callouts are not in the native prototype".into())
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
