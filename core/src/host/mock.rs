//! An in-memory [`Host`] for native tests: headers, bodies, shared data
//! with Envoy's CAS semantics ([`MemStore`]), metrics, filter state, a
//! settable clock, and the local replies, callouts and logs it was asked
//! for. Several mocks can share one store, as Envoy's workers do.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::{Rc, Weak};
use std::sync::Arc;

use super::{Headers, Host, MetricKind};
use crate::state::store::{MemStore, SharedStore, StoreError};

/// A local reply as the host was asked to send it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl SentReply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A callout as dispatched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub timeout_ms: u64,
}

/// The fleet secret the mock host's VM environment holds by default.
pub const MOCK_FLEET_SECRET: &str = "mock-fleet-secret-0123456789";

#[derive(Default)]
pub struct MockHost {
    pub store: Arc<MemStore>,
    pub clock_ms: Cell<u64>,
    /// Request headers in order; repeated names allowed.
    pub request_headers: RefCell<Vec<(String, String)>>,
    pub response_headers: RefCell<Vec<(String, String)>>,
    pub request_body: RefCell<Vec<u8>>,
    /// The response chunk of the current body callback.
    pub response_body: RefCell<Vec<u8>>,
    pub properties: RefCell<HashMap<String, Vec<u8>>>,
    /// Filter state written by the filter (audit fields).
    pub filter_state: RefCell<HashMap<String, Vec<u8>>>,
    pub metrics: RefCell<HashMap<String, (MetricKind, i64)>>,
    /// Every value recorded in each histogram.
    pub histograms: RefCell<HashMap<String, Vec<u64>>>,
    pub replies: RefCell<Vec<SentReply>>,
    pub route_cache_clears: Cell<u32>,
    /// How often the stream was reset (`reset_stream`).
    pub stream_resets: Cell<u32>,
    /// `Some`: clearing the route cache fails with this.
    pub route_cache_error: RefCell<Option<String>>,
    /// What the core logged (through the `log` facade) while this host
    /// was the newest on its thread; a worker shares its first host's.
    pub logs: LogCapture,
    /// The VM's environment variables; the fleet secret defaults to
    /// [`MOCK_FLEET_SECRET`].
    pub env: RefCell<HashMap<String, String>>,
    pub tick_period_ms: Cell<Option<u64>>,
    pub callouts: RefCell<Vec<Callout>>,
    /// `Some`: the next dispatch fails with this.
    pub dispatch_error: RefCell<Option<String>>,
    pub call_response_headers: RefCell<Vec<(String, String)>>,
    pub call_response_body: RefCell<Vec<u8>>,
    /// Bodies of the callouts dispatched with one, by token.
    pub posted: RefCell<Vec<(u32, Vec<u8>)>>,
    /// The next this many shared-data writes lose to a phantom writer
    /// (`CasMismatch`): a contention storm on demand.
    pub lose_writes: Cell<u32>,
    /// Wake-up queues, shared like the store: name → token, token → messages.
    pub wake_queues: Arc<std::sync::Mutex<WakeQueues>>,
    /// The context the host acts on (`set_effective_context`).
    pub effective_context: Cell<Option<u32>>,
    /// Contexts resumed, in order.
    pub resumed: RefCell<Vec<u32>>,
    /// Responses resumed after a pause at their headers.
    pub responses_resumed: Cell<u32>,
    /// Replies sent while a context was effective: (context, reply).
    pub context_replies: RefCell<Vec<(u32, SentReply)>>,
    /// How often each [`Host`] method was called: each is one hostcall
    /// (a crossing of the wasm boundary, strings copied) in the shim.
    pub calls: RefCell<BTreeMap<&'static str, u64>>,
}

#[derive(Default, Debug)]
pub struct WakeQueues {
    pub names: HashMap<String, u32>,
    pub messages: HashMap<u32, std::collections::VecDeque<Vec<u8>>>,
}

fn find(list: &[(String, String)], name: &str) -> Option<String> {
    list.iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.clone())
}

fn put(list: &mut Vec<(String, String)>, name: &str, value: Option<&str>) {
    list.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    if let Some(value) = value {
        list.push((name.to_string(), value.to_string()));
    }
}

impl MockHost {
    /// A host over its own shared data, its clock at `now_ms`.
    pub fn new(now_ms: u64) -> MockHost {
        MockHost::sharing(Arc::new(MemStore::default()), now_ms)
    }

    /// Another worker: the same shared data.
    pub fn sharing(store: Arc<MemStore>, now_ms: u64) -> MockHost {
        let host = MockHost {
            store,
            ..MockHost::default()
        };
        host.clock_ms.set(now_ms);
        host
    }

    /// Another worker: the same shared data and wake-up queues.
    pub fn worker_of(other: &MockHost) -> MockHost {
        let mut host = MockHost {
            store: other.store.clone(),
            wake_queues: other.wake_queues.clone(),
            ..MockHost::default()
        };
        host.logs = other.logs.share();
        host.clock_ms.set(other.clock_ms.get());
        host
    }

    pub fn advance(&self, ms: u64) {
        self.clock_ms.set(self.clock_ms.get() + ms);
    }

    /// Starts a new request on this host: its headers and body; what the
    /// previous request left (response, replies, filter state) is cleared.
    pub fn begin(&self, headers: &[(&str, &str)], body: &[u8]) {
        *self.request_headers.borrow_mut() = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        *self.request_body.borrow_mut() = body.to_vec();
        self.response_headers.borrow_mut().clear();
        self.response_body.borrow_mut().clear();
        self.replies.borrow_mut().clear();
        self.filter_state.borrow_mut().clear();
        self.properties.borrow_mut().remove("response.code_details");
    }

    /// Starts a chat request to `/v1/chat/completions` (model `m`, one
    /// user turn "hello", `max_tokens`), with `headers` beside the method,
    /// path, content type and length; the body's length.
    pub fn begin_chat(&self, max_tokens: u64, headers: &[(&str, &str)]) -> usize {
        let body = serde_json::json!({"model": "m", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": "hello"}]})
        .to_string();
        let len = body.len().to_string();
        let mut all = vec![
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
        ];
        all.extend_from_slice(headers);
        self.begin(&all, body.as_bytes());
        body.len()
    }

    pub fn respond(&self, headers: &[(&str, &str)]) {
        *self.response_headers.borrow_mut() = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
    }

    pub fn set_prop(&self, path: &[&str], value: &[u8]) {
        self.properties
            .borrow_mut()
            .insert(path.join("."), value.to_vec());
    }

    pub fn req_header(&self, name: &str) -> Option<String> {
        find(&self.request_headers.borrow(), name)
    }

    pub fn resp_header(&self, name: &str) -> Option<String> {
        find(&self.response_headers.borrow(), name)
    }

    pub fn metric(&self, name: &str) -> Option<i64> {
        self.metrics.borrow().get(name).map(|(_, v)| *v)
    }

    /// A filter-state value; a `sluice_<field>` not written on its own is
    /// looked up in the audit record (`sluice_audit`, a JSON fragment):
    /// its text, or its number in decimal; `None` when null.
    pub fn state(&self, name: &str) -> Option<String> {
        let state = self.filter_state.borrow();
        if let Some(value) = state.get(name) {
            return Some(String::from_utf8_lossy(value).into_owned());
        }
        let field = name.strip_prefix("sluice_")?;
        let fragment = String::from_utf8_lossy(state.get("sluice_audit")?).into_owned();
        let fragment = fragment.strip_prefix(',').unwrap_or(&fragment);
        // Not JSON: no field (the tests that parse it say why).
        let line: serde_json::Value = serde_json::from_str(&format!("{{{fragment}}}")).ok()?;
        match &line[field] {
            serde_json::Value::Null => None,
            serde_json::Value::String(text) => Some(text.clone()),
            other => Some(other.to_string()),
        }
    }

    pub fn last_reply(&self) -> Option<SentReply> {
        self.replies.borrow().last().cloned()
    }

    /// Host calls by method since the last [`MockHost::take_calls`].
    pub fn take_calls(&self) -> BTreeMap<&'static str, u64> {
        std::mem::take(&mut self.calls.borrow_mut())
    }

    fn count(&self, method: &'static str) {
        *self.calls.borrow_mut().entry(method).or_default() += 1;
    }
}

impl SharedStore for MockHost {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.count("get");
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.count("set");
        if self.lose_writes.get() > 0 {
            self.lose_writes.set(self.lose_writes.get() - 1);
            return Err(StoreError::CasMismatch);
        }
        self.store.set(key, value, cas)
    }
}

impl Host for MockHost {
    fn request_header(&self, name: &str) -> Option<String> {
        self.count("request_header");
        self.req_header(name)
    }

    fn request_header_count(&self, name: &str) -> usize {
        self.count("request_header_count");
        self.request_headers
            .borrow()
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .count()
    }

    fn request_headers(&self) -> Option<Headers> {
        self.count("request_headers");
        Some(Headers::of(&self.request_headers.borrow()))
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) {
        self.count("set_request_header");
        put(&mut self.request_headers.borrow_mut(), name, value);
    }

    fn response_header(&self, name: &str) -> Option<String> {
        self.count("response_header");
        self.resp_header(name)
    }

    fn set_response_header(&self, name: &str, value: Option<&str>) {
        self.count("set_response_header");
        put(&mut self.response_headers.borrow_mut(), name, value);
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        self.count("request_body");
        let body = self.request_body.borrow();
        body[..size.min(body.len())].to_vec()
    }

    fn replace_request_body(&self, size: usize, body: &[u8]) {
        self.count("replace_request_body");
        let mut old = self.request_body.borrow_mut();
        let size = size.min(old.len());
        old.splice(..size, body.iter().copied());
    }

    fn response_body(&self, size: usize) -> Vec<u8> {
        self.count("response_body");
        let body = self.response_body.borrow();
        body[..size.min(body.len())].to_vec()
    }

    fn replace_response_body(&self, size: usize, body: &[u8]) {
        self.count("replace_response_body");
        let mut old = self.response_body.borrow_mut();
        let size = size.min(old.len());
        old.splice(..size, body.iter().copied());
    }

    fn send_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.count("send_reply");
        let reply = SentReply {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
        };
        if let Some(id) = self.effective_context.get() {
            self.context_replies.borrow_mut().push((id, reply.clone()));
        }
        self.replies.borrow_mut().push(reply);
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.count("property");
        self.properties.borrow().get(&path.join(".")).cloned()
    }

    fn set_property(&self, name: &str, value: &[u8]) {
        self.count("set_property");
        self.filter_state
            .borrow_mut()
            .insert(name.to_string(), value.to_vec());
    }

    fn reset_stream(&self) -> bool {
        self.count("reset_stream");
        self.stream_resets.set(self.stream_resets.get() + 1);
        true
    }

    fn clear_route_cache(&self) -> Result<(), String> {
        self.count("clear_route_cache");
        self.route_cache_clears
            .set(self.route_cache_clears.get() + 1);
        match self.route_cache_error.borrow().clone() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    fn metric_add(&self, kind: MetricKind, name: &str, by: i64) {
        self.count("metric_add");
        let mut metrics = self.metrics.borrow_mut();
        let entry = metrics.entry(name.to_string()).or_insert((kind, 0));
        entry.1 += by;
    }

    fn metric_record(&self, kind: MetricKind, name: &str, value: u64) {
        self.count("metric_record");
        if kind == MetricKind::Histogram {
            self.histograms
                .borrow_mut()
                .entry(name.to_string())
                .or_default()
                .push(value);
        }
        self.metrics
            .borrow_mut()
            .insert(name.to_string(), (kind, value as i64));
    }

    fn now_ns(&self) -> u64 {
        self.count("now_ns");
        self.clock_ms.get() * 1_000_000
    }

    fn env_var(&self, name: &str) -> Option<String> {
        self.env.borrow().get(name).cloned().or_else(|| {
            (name == crate::policy::fleet::DEFAULT_SECRET_ENV)
                .then(|| MOCK_FLEET_SECRET.to_string())
        })
    }

    fn set_tick_period_ms(&self, ms: u64) {
        self.count("set_tick_period_ms");
        self.tick_period_ms.set(Some(ms));
    }

    fn dispatch_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> Result<u32, String> {
        if let Some(why) = self.dispatch_error.borrow_mut().take() {
            return Err(why);
        }
        let mut callouts = self.callouts.borrow_mut();
        let token = callouts.len() as u32 + 1;
        callouts.push(Callout {
            token,
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            timeout_ms,
        });
        Ok(token)
    }

    fn dispatch_post(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, String> {
        let token = self.dispatch_call(cluster, headers, timeout_ms)?;
        self.posted.borrow_mut().push((token, body.to_vec()));
        Ok(token)
    }

    fn call_response_header(&self, name: &str) -> Option<String> {
        self.count("call_response_header");
        find(&self.call_response_headers.borrow(), name)
    }

    fn call_response_headers(&self) -> Option<crate::host::Headers> {
        self.count("call_response_headers");
        Some(crate::host::Headers::of(
            &self.call_response_headers.borrow(),
        ))
    }

    fn call_response_body(&self, size: usize) -> Vec<u8> {
        self.count("call_response_body");
        let body = self.call_response_body.borrow();
        body[..size.min(body.len())].to_vec()
    }

    fn register_wake_queue(&self, name: &str) -> Option<u32> {
        self.count("register_wake_queue");
        let mut q = self.wake_queues.lock().ok()?;
        let next = q.names.len() as u32 + 1;
        let token = *q.names.entry(name.to_string()).or_insert(next);
        q.messages.entry(token).or_default();
        Some(token)
    }

    fn wake(&self, queue: u32, message: &[u8]) -> bool {
        self.count("wake");
        let Ok(mut q) = self.wake_queues.lock() else {
            return false;
        };
        match q.messages.get_mut(&queue) {
            Some(messages) => {
                messages.push_back(message.to_vec());
                true
            }
            None => false,
        }
    }

    fn take_wake(&self, queue: u32) -> Option<Vec<u8>> {
        self.count("take_wake");
        self.wake_queues
            .lock()
            .ok()?
            .messages
            .get_mut(&queue)?
            .pop_front()
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        self.count("set_effective_context");
        self.effective_context.set(Some(context_id));
        true
    }

    /// The effective context set by the root, else (0) the HTTP stream
    /// whose own callout answered.
    fn resume_response(&self) -> bool {
        self.count("resume_response");
        self.responses_resumed.set(self.responses_resumed.get() + 1);
        true
    }

    fn resume_request(&self) -> bool {
        self.count("resume_request");
        let id = self.effective_context.get().unwrap_or(0);
        self.resumed.borrow_mut().push(id);
        true
    }
}

/// The lines the core logs, caught for the tests: the core writes through
/// the `log` facade; a process-wide logger, installed the first time a
/// mock host is made, appends each line to the capture of the newest host
/// on the logging thread (each test runs on a thread of its own).
#[derive(Debug)]
pub struct LogCapture(Rc<Lines>);

/// Each logged line with its level.
type Lines = RefCell<Vec<(log::Level, String)>>;

thread_local! {
    static CAPTURE: RefCell<Weak<Lines>> = const { RefCell::new(Weak::new()) };
}

struct CaptureLogger;

impl log::Log for CaptureLogger {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        let line = (record.level(), record.args().to_string());
        CAPTURE.with(|c| {
            if let Some(lines) = c.borrow().upgrade() {
                lines.borrow_mut().push(line);
            }
        });
    }

    fn flush(&self) {}
}

static LOGGER: CaptureLogger = CaptureLogger;

impl LogCapture {
    /// This capture again, made the thread's current one.
    fn share(&self) -> LogCapture {
        CAPTURE.with(|c| *c.borrow_mut() = Rc::downgrade(&self.0));
        LogCapture(self.0.clone())
    }
}

impl Default for LogCapture {
    fn default() -> LogCapture {
        // Another logger (a test binary's own) may be set: then it wins.
        if log::set_logger(&LOGGER).is_ok() {
            log::set_max_level(log::LevelFilter::Info);
        }
        LogCapture(Rc::default()).share()
    }
}

impl std::ops::Deref for LogCapture {
    type Target = Lines;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}
