//! The proxy-wasm adapter: implements [`Host`] with hostcalls and forwards
//! each Envoy callback to the core ([`Poller`], [`Request`]). Nothing is decided here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use sluice_core::{Headers, Host, MetricKind};
use sluice_core::{Poller, Request, SharedStore, StoreError, Vm};

proxy_wasm::main! {{
    // Also installs the SDK's logger for the `log` facade, through which
    // the core writes its lines: each goes to Envoy's log (`proxy_log`).
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic aborts the VM and fails every request on this worker: say
    // why first (the SDK's own hook, if any, only prints to stderr).
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("sluice panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root {
            // Every root context of this VM (a reload makes a new one) shares it.
            poller: VM.with(|vm| Poller::in_vm(vm.clone())),
            host: WasmHost::default(),
        })
    });
}}

thread_local! {
    /// What the root contexts of this VM share (one VM per worker thread).
    static VM: Rc<Vm> = Rc::default();
}

/// Envoy, through hostcalls. Metric ids are defined on first use, once
/// per name per VM; the map is shared by the root and every HTTP context.
#[derive(Default, Clone)]
struct WasmHost {
    metric_ids: Rc<RefCell<HashMap<String, u32>>>,
}

impl WasmHost {
    fn metric_id(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let mut ids = self.metric_ids.try_borrow_mut().ok()?;
        if let Some(id) = ids.get(name) {
            return Some(*id);
        }
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        let id = hostcalls::define_metric(kind, name).ok()?;
        ids.insert(name.to_string(), id);
        Some(id)
    }
}

/// A header as text. Envoy lets bytes 0x80–0xFF through in values, and the
/// SDK's string getters (`get_map_value`, `get_http_request_header`, …)
/// unwrap UTF-8 and so kill the VM on one such byte from a client: read
/// bytes and replace what is not UTF-8.
fn header_text(map: MapType, name: &str) -> Option<String> {
    let bytes = hostcalls::get_map_value_bytes(map, name).ok().flatten()?;
    Some(text(bytes))
}

/// Bytes as text: valid UTF-8 (nearly always) is taken as it is, without
/// a copy; anything else has its bad bytes replaced.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes)
        .unwrap_or_else(|err| String::from_utf8_lossy(err.as_bytes()).into_owned())
}

fn buffer(kind: BufferType, size: usize) -> Vec<u8> {
    hostcalls::get_buffer(kind, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

impl SharedStore for WasmHost {
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

impl Host for WasmHost {
    fn request_header(&self, name: &str) -> Option<String> {
        header_text(MapType::HttpRequestHeaders, name)
    }

    fn request_header_count(&self, name: &str) -> usize {
        // The same raw read as `request_headers` (the SDK's would panic on
        // the status that made the snapshot fail).
        self.request_headers().map_or(usize::MAX, |h| h.count(name))
    }

    fn request_headers(&self) -> Option<Headers> {
        header_map(raw::HTTP_REQUEST_HEADERS)
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
    }

    fn response_header(&self, name: &str) -> Option<String> {
        header_text(MapType::HttpResponseHeaders, name)
    }

    fn set_response_header(&self, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, value);
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        buffer(BufferType::HttpRequestBody, size)
    }

    fn replace_request_body(&self, size: usize, body: &[u8]) {
        let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, body);
    }

    fn response_body(&self, size: usize) -> Vec<u8> {
        buffer(BufferType::HttpResponseBody, size)
    }

    fn replace_response_body(&self, size: usize, body: &[u8]) {
        let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, size, body);
    }

    fn send_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }

    fn reset_stream(&self) -> bool {
        // `proxy_close_stream(HttpResponse)`: Envoy's `Context::closeStream`
        // (source/extensions/common/wasm/context.cc) queues
        // `encoder_callbacks_->resetStream()` as an after-VM-call action,
        // the reset of the whole stream (the router resets its upstream
        // request). proxy-wasm-cpp-host runs those actions as
        // `ContextBase::onResponseBody` returns (src/context.cc,
        // `DeferAfterCallActions`): before Envoy passes this callback's
        // chunk on. Raw: the SDK's `reset_http_response` panics on any
        // status but OK.
        // SAFETY: plain value call.
        unsafe { raw::proxy_close_stream(raw::HTTP_RESPONSE) == raw::OK }
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn set_property(&self, name: &str, value: &[u8]) {
        let _ = hostcalls::set_property(vec![name], Some(value));
    }

    fn clear_route_cache(&self) -> Result<(), String> {
        hostcalls::call_foreign_function("clear_route_cache", Some(&[]))
            .map(drop)
            .map_err(|status| format!("{status:?}"))
    }

    fn metric_add(&self, kind: MetricKind, name: &str, by: i64) {
        if let Some(id) = self.metric_id(kind, name) {
            if by != 0 {
                let _ = hostcalls::increment_metric(id, by);
            }
        }
    }

    fn metric_record(&self, kind: MetricKind, name: &str, value: u64) {
        if let Some(id) = self.metric_id(kind, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn now_ns(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64)
    }

    fn set_tick_period_ms(&self, ms: u64) {
        let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
    }

    fn dispatch_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> Result<u32, String> {
        let timeout = Duration::from_millis(timeout_ms);
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), None, vec![], timeout)
            .map_err(|status| format!("{status:?}"))
    }

    fn dispatch_post(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, String> {
        let timeout = Duration::from_millis(timeout_ms);
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), Some(body), vec![], timeout)
            .map_err(|status| format!("{status:?}"))
    }

    fn call_response_header(&self, name: &str) -> Option<String> {
        header_text(MapType::HttpCallResponseHeaders, name)
    }

    fn call_response_body(&self, size: usize) -> Vec<u8> {
        buffer(BufferType::HttpCallResponseBody, size)
    }

    fn call_response_headers(&self) -> Option<Headers> {
        header_map(raw::HTTP_CALL_RESPONSE_HEADERS)
    }

    fn register_wake_queue(&self, name: &str) -> Option<u32> {
        let mut id = 0u32;
        // SAFETY: the pointers are valid for the call; the host writes one u32.
        let status =
            unsafe { raw::proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) };
        (status == raw::OK).then_some(id)
    }

    fn wake(&self, queue: u32, message: &[u8]) -> bool {
        // SAFETY: the message outlives the call; the host copies it.
        unsafe {
            raw::proxy_enqueue_shared_queue(queue, message.as_ptr(), message.len()) == raw::OK
        }
    }

    fn take_wake(&self, queue: u32) -> Option<Vec<u8>> {
        // Empty and not-found are `Ok(None)`/`Err`; other statuses do not
        // occur for a queue this VM registered.
        hostcalls::dequeue_shared_queue(queue).ok().flatten()
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        // SAFETY: plain value call.
        unsafe { raw::proxy_set_effective_context(context_id) == raw::OK }
    }

    fn resume_request(&self) -> bool {
        // SAFETY: plain value call.
        unsafe { raw::proxy_continue_stream(raw::HTTP_REQUEST) == raw::OK }
    }

    fn resume_response(&self) -> bool {
        // SAFETY: plain value call.
        unsafe { raw::proxy_continue_stream(raw::HTTP_RESPONSE) == raw::OK }
    }
}

/// A whole header map of the host (`raw::HTTP_*_HEADERS`), in one call.
/// Raw, not the SDK's `get_map_bytes`: that allocates a `String` and a
/// `Vec` per header (and panics on a status it did not expect); bytes, for
/// the reason in `header_text`.
#[allow(unsafe_code)]
fn header_map(map_type: u32) -> Option<Headers> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: both pointers are valid for the call; on OK the host hands
    // over a buffer of `size` bytes it allocated through this module's
    // `proxy_on_memory_allocate` (the SDK's, a `Vec<u8>` of that
    // capacity), so it is taken back as that `Vec`.
    let bytes = unsafe {
        if raw::proxy_get_header_map_pairs(map_type, &mut data, &mut size) != raw::OK {
            return None;
        }
        if data.is_null() {
            return Some(Headers::default());
        }
        Vec::from_raw_parts(data, size, size)
    };
    crate::map::headers(&bytes)
}

/// Hostcalls whose SDK wrappers panic on a status they did not expect (a
/// stream that ended before its wake-up, say): called raw, the status read
/// as a number, so such a status is a `false`, never a dead VM.
#[allow(unsafe_code)]
mod raw {
    pub const OK: u32 = 0;
    pub const HTTP_REQUEST: u32 = 0;
    pub const HTTP_RESPONSE: u32 = 1;
    /// `MapType::HttpRequestHeaders`.
    pub const HTTP_REQUEST_HEADERS: u32 = 0;
    /// `MapType::HttpCallResponseHeaders`.
    pub const HTTP_CALL_RESPONSE_HEADERS: u32 = 6;
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_register_shared_queue(
            name_data: *const u8,
            name_size: usize,
            return_id: *mut u32,
        ) -> u32;
        pub fn proxy_enqueue_shared_queue(
            queue_id: u32,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_set_effective_context(context_id: u32) -> u32;
        pub fn proxy_continue_stream(stream_type: u32) -> u32;
        pub fn proxy_close_stream(stream_type: u32) -> u32;
        pub fn proxy_get_header_map_pairs(
            map_type: u32,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> u32;
    }
}

fn action(a: sluice_core::Action) -> Action {
    match a {
        sluice_core::Action::Continue => Action::Continue,
        sluice_core::Action::Pause => Action::Pause,
    }
}

struct Root {
    poller: Poller,
    host: WasmHost,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        self.poller.on_call_response(&self.host, token, body_size);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        self.poller.configure(&self.host, &config)
    }

    fn on_tick(&mut self) {
        self.poller.tick(&self.host);
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        self.poller.on_wake(&self.host);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let request = self.poller.request_for(context_id)?;
        Some(Box::new(Http {
            request,
            host: self.host.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    request: Request,
    host: WasmHost,
}

impl Context for Http {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        self.request.on_call_response(&self.host, token, body_size);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        action(self.request.on_request_headers(&self.host, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.request
                .on_request_body(&self.host, body_size, end_of_stream),
        )
    }

    fn on_http_request_trailers(&mut self, _: usize) -> Action {
        action(self.request.on_request_trailers(&self.host))
    }

    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        action(self.request.on_response_headers(&self.host))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.request
                .on_response_body(&self.host, body_size, end_of_stream),
        )
    }

    fn on_log(&mut self) {
        self.request.on_log(&self.host);
    }
}
