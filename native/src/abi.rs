//! The bindings: every `unsafe` line of the module lives here.
//!
//! Two halves. The callbacks Envoy exports (declared below from Envoy
//! v1.40.0's `source/extensions/dynamic_modules/abi/abi.h`, only those the
//! adapter uses) are wrapped in safe methods of [`Filter`] and [`Config`],
//! handles that live only for the event hook that made them. The event
//! hooks Envoy calls (`envoy_dynamic_module_on_*`, exported with
//! `#[no_mangle]`) turn Envoy's raw pointers into those handles and the
//! module's own boxes, and call [`crate::filter`] inside `catch_unwind`:
//! a panic never unwinds into Envoy (it is logged and the stream is
//! answered 500 where it still can be).
//!
//! C enums are `int`-sized: passed here as `u32`, their values the
//! declaration order in abi.h.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::filter::{self, Phase, Status};

/// What `envoy_dynamic_module_on_program_init` returns: the ABI version
/// this module was written against (abi.h's
/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` in Envoy 1.40.0). Envoy 1.40 only
/// warns on a mismatch (`Dynamic module ABI version … is deprecated`); it
/// logs `… matched.` otherwise.
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

// ------------------------------------------------------------------ types

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    ptr: *const c_char,
    length: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    ptr: *const c_char,
    length: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHttpHeader {
    key_ptr: *const c_char,
    key_length: usize,
    value_ptr: *const c_char,
    value_length: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHttpHeader {
    key_ptr: *const c_char,
    key_length: usize,
    value_ptr: *const c_char,
    value_length: usize,
}

const NULL_BUFFER: EnvoyBuffer = EnvoyBuffer {
    ptr: std::ptr::null(),
    length: 0,
};

fn module_buffer(bytes: &[u8]) -> ModuleBuffer {
    ModuleBuffer {
        ptr: bytes.as_ptr().cast(),
        length: bytes.len(),
    }
}

/// A null buffer: "remove" for `set_header`, "none" for `details`.
const NO_VALUE: ModuleBuffer = ModuleBuffer {
    ptr: std::ptr::null(),
    length: 0,
};

/// The bytes of a buffer Envoy owns, valid until the hook returns (or a
/// setter is called; the adapter copies before it sets).
///
/// SAFETY (of the callers): `buf` came from Envoy in the current hook, and
/// `'a` does not outlive it (the callers tie it to their `Filter<'a>`).
unsafe fn envoy_bytes<'a>(buf: EnvoyBuffer) -> &'a [u8] {
    if buf.ptr.is_null() || buf.length == 0 {
        return &[];
    }
    // SAFETY: Envoy hands a pointer to `length` readable bytes, valid for
    // the current event hook (abi.h, "OWNERSHIP: Envoy owns the pointer").
    std::slice::from_raw_parts(buf.ptr.cast::<u8>(), buf.length)
}

/// Which header map (`envoy_dynamic_module_type_http_header_type`).
#[derive(Clone, Copy)]
pub enum HeaderMap {
    Request = 0,
    Response = 2,
}

/// Which body (`envoy_dynamic_module_type_http_body_type`).
#[derive(Clone, Copy)]
pub enum Body {
    ReceivedRequest = 0,
    BufferedRequest = 1,
    ReceivedResponse = 2,
    BufferedResponse = 3,
}

/// `envoy_dynamic_module_type_log_level`.
#[derive(Clone, Copy)]
pub enum LogLevel {
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

/// `envoy_dynamic_module_type_attribute_id`: the two the adapter reads.
#[derive(Clone, Copy)]
pub enum Attribute {
    ResponseCodeDetails = 16,
    SourceAddress = 24,
}

/// How Envoy aggregates a metric the config defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatKind {
    Counter,
    Gauge,
    Histogram,
}

/// What a gauge or histogram update does.
#[derive(Clone, Copy)]
pub enum StatOp {
    Add(u64),
    Sub(u64),
    Set(u64),
}

const METRICS_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_filter_stream_reset_reason_LocalReset`.
const RESET_LOCAL: u32 = 0;
/// Labels per stat: `sluice_requests_total` has the most (4).
const MAX_LABELS: usize = 8;

// -------------------------------------------------------------- callbacks

extern "C" {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);

    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_gauge(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_decrement_gauge(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;

    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_headers_size(
        filter: *mut c_void,
        header_type: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(
        filter: *mut c_void,
        header_type: u32,
        result: *mut EnvoyHttpHeader,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status_code: u32,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );

    fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: *mut c_void,
        body_type: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: *mut c_void,
        body_type: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_size(
        filter: *mut c_void,
        body_type: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_append_body(
        filter: *mut c_void,
        body_type: u32,
        data: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(
        filter: *mut c_void,
        body_type: u32,
        number_of_bytes: usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter: *mut c_void,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_response_body(
        filter: *mut c_void,
    ) -> bool;

    fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter: *mut c_void,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(filter: *mut c_void);
    /// Checked against the pinned 1.40 binary's code, not only the header:
    /// the filter, the reason (`..._stream_reset_reason`, 0 `LocalReset`),
    /// the details; it calls `decoder_callbacks_->resetStream(reason,
    /// details)` at once.
    fn envoy_dynamic_module_callback_http_filter_reset_stream(
        filter: *mut c_void,
        reason: u32,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: *mut c_void,
        attribute_id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
}

/// Logs under Envoy's `dynamic_modules` logger.
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: the buffer points into `message`, alive for the call; Envoy
    // copies it.
    unsafe { envoy_dynamic_module_callback_log(level as u32, module_buffer(message.as_bytes())) }
}

/// Label values as module buffers, on the stack; `None` past [`MAX_LABELS`].
fn label_buffers(values: &[&str]) -> Option<[ModuleBuffer; MAX_LABELS]> {
    if values.len() > MAX_LABELS {
        return None;
    }
    let mut out = [NO_VALUE; MAX_LABELS];
    for (slot, v) in out.iter_mut().zip(values) {
        *slot = module_buffer(v.as_bytes());
    }
    Some(out)
}

/// The filter configuration in Envoy, during
/// `envoy_dynamic_module_on_http_filter_config_new` (the only time it may
/// define metrics).
pub struct Config<'a> {
    raw: *mut c_void,
    _hook: PhantomData<&'a ()>,
}

impl Config<'_> {
    /// Defines a stat with these label names; its id, or `None` if Envoy
    /// refused.
    pub fn define(&self, kind: StatKind, name: &str, labels: &[&str]) -> Option<usize> {
        let mut names = label_buffers(labels)?;
        let mut id = 0usize;
        let define = match kind {
            StatKind::Counter => envoy_dynamic_module_callback_http_filter_config_define_counter,
            StatKind::Gauge => envoy_dynamic_module_callback_http_filter_config_define_gauge,
            StatKind::Histogram => {
                envoy_dynamic_module_callback_http_filter_config_define_histogram
            }
        };
        // SAFETY: `raw` is the config pointer of the running config_new
        // hook; the name and label buffers outlive the call (Envoy copies
        // them); `id` is a valid out-pointer.
        let result = unsafe {
            define(
                self.raw,
                module_buffer(name.as_bytes()),
                names.as_mut_ptr(),
                labels.len(),
                &mut id,
            )
        };
        (result == METRICS_SUCCESS).then_some(id)
    }
}

/// One HTTP stream's filter in Envoy, valid for the event hook that made
/// this handle (the lifetime ties it there).
#[derive(Clone, Copy)]
pub struct Filter<'a> {
    raw: *mut c_void,
    _hook: PhantomData<&'a ()>,
}

impl<'a> Filter<'a> {
    /// The first value of a header, as Envoy's bytes.
    pub fn header(&self, map: HeaderMap, name: &str) -> Option<&'a [u8]> {
        let mut out = NULL_BUFFER;
        let mut count = 0usize;
        // SAFETY: `raw` is this hook's filter; key and out-pointers are valid.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.raw,
                map as u32,
                module_buffer(name.as_bytes()),
                &mut out,
                0,
                &mut count,
            )
        };
        // SAFETY: Envoy's buffer of this hook (see `envoy_bytes`).
        (ok && count > 0 && !out.ptr.is_null()).then(|| unsafe { envoy_bytes(out) })
    }

    /// How many values a header has.
    pub fn header_count(&self, map: HeaderMap, name: &str) -> usize {
        let mut out = NULL_BUFFER;
        let mut count = 0usize;
        // SAFETY: as in `header`.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.raw,
                map as u32,
                module_buffer(name.as_bytes()),
                &mut out,
                0,
                &mut count,
            )
        };
        if ok {
            count
        } else {
            usize::MAX
        }
    }

    /// Every header of a map, in order, as Envoy's bytes.
    pub fn headers(&self, map: HeaderMap) -> Option<Vec<(&'a [u8], &'a [u8])>> {
        // SAFETY: `raw` is this hook's filter.
        let n =
            unsafe { envoy_dynamic_module_callback_http_get_headers_size(self.raw, map as u32) };
        let empty = EnvoyHttpHeader {
            key_ptr: std::ptr::null(),
            key_length: 0,
            value_ptr: std::ptr::null(),
            value_length: 0,
        };
        let mut raw = vec![empty; n];
        if n > 0 {
            // SAFETY: `raw` has room for the `n` headers Envoy said it has.
            let ok = unsafe {
                envoy_dynamic_module_callback_http_get_headers(
                    self.raw,
                    map as u32,
                    raw.as_mut_ptr(),
                )
            };
            if !ok {
                return None;
            }
        }
        Some(
            raw.iter()
                .map(|h| {
                    let key = EnvoyBuffer {
                        ptr: h.key_ptr,
                        length: h.key_length,
                    };
                    let value = EnvoyBuffer {
                        ptr: h.value_ptr,
                        length: h.value_length,
                    };
                    // SAFETY: Envoy's buffers of this hook (see `envoy_bytes`).
                    let (key, value) = unsafe { (envoy_bytes(key), envoy_bytes(value)) };
                    (key, value)
                })
                .collect(),
        )
    }

    /// Sets (`Some`) or removes (`None`) a header.
    pub fn set_header(&self, map: HeaderMap, name: &str, value: Option<&str>) -> bool {
        let value = value.map_or(NO_VALUE, |v| module_buffer(v.as_bytes()));
        // SAFETY: `raw` is this hook's filter; the buffers outlive the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.raw,
                map as u32,
                module_buffer(name.as_bytes()),
                value,
            )
        }
    }

    /// Answers the client locally.
    pub fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8], details: &str) {
        let mut vector: Vec<ModuleHttpHeader> = headers
            .iter()
            .map(|(k, v)| ModuleHttpHeader {
                key_ptr: k.as_ptr().cast(),
                key_length: k.len(),
                value_ptr: v.as_ptr().cast(),
                value_length: v.len(),
            })
            .collect();
        // SAFETY: `raw` is this hook's filter; every buffer outlives the
        // call (Envoy copies them into the reply).
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.raw,
                status,
                vector.as_mut_ptr(),
                vector.len(),
                module_buffer(body),
                module_buffer(details.as_bytes()),
            )
        }
    }

    /// Resets the stream both ways (`LocalReset`; `details` becomes the
    /// response code details the access log reads).
    pub fn reset_stream(&self, details: &str) {
        // SAFETY: `raw` is this hook's filter; `details` outlives the call
        // (Envoy copies it into the stream info).
        unsafe {
            envoy_dynamic_module_callback_http_filter_reset_stream(
                self.raw,
                RESET_LOCAL,
                module_buffer(details.as_bytes()),
            )
        }
    }

    /// A body's slices as Envoy holds them (no copy).
    pub fn body_chunks(&self, body: Body) -> Vec<&'a [u8]> {
        // SAFETY: `raw` is this hook's filter.
        let n = unsafe {
            envoy_dynamic_module_callback_http_get_body_chunks_size(self.raw, body as u32)
        };
        if n == 0 {
            return Vec::new();
        }
        let mut raw = vec![NULL_BUFFER; n];
        // SAFETY: `raw` has room for the `n` slices Envoy said it has.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_body_chunks(
                self.raw,
                body as u32,
                raw.as_mut_ptr(),
            )
        };
        if !ok {
            return Vec::new();
        }
        // SAFETY: Envoy's buffers of this hook (see `envoy_bytes`).
        raw.into_iter().map(|b| unsafe { envoy_bytes(b) }).collect()
    }

    pub fn body_size(&self, body: Body) -> usize {
        // SAFETY: `raw` is this hook's filter.
        unsafe { envoy_dynamic_module_callback_http_get_body_size(self.raw, body as u32) }
    }

    pub fn append_body(&self, body: Body, data: &[u8]) -> bool {
        // SAFETY: `raw` is this hook's filter; `data` outlives the call.
        unsafe {
            envoy_dynamic_module_callback_http_append_body(
                self.raw,
                body as u32,
                module_buffer(data),
            )
        }
    }

    pub fn drain_body(&self, body: Body, bytes: usize) -> bool {
        // SAFETY: `raw` is this hook's filter.
        unsafe { envoy_dynamic_module_callback_http_drain_body(self.raw, body as u32, bytes) }
    }

    /// Whether the body this hook received is the one a filter before
    /// buffered (then "received" and "buffered" are the same bytes).
    pub fn received_is_buffered(&self, request: bool) -> bool {
        // SAFETY: `raw` is this hook's filter.
        unsafe {
            if request {
                envoy_dynamic_module_callback_http_received_buffered_request_body(self.raw)
            } else {
                envoy_dynamic_module_callback_http_received_buffered_response_body(self.raw)
            }
        }
    }

    pub fn set_filter_state(&self, key: &str, value: &[u8]) -> bool {
        // SAFETY: `raw` is this hook's filter; Envoy copies both buffers.
        unsafe {
            envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.raw,
                module_buffer(key.as_bytes()),
                module_buffer(value),
            )
        }
    }

    pub fn clear_route_cache(&self) {
        // SAFETY: `raw` is this hook's filter.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.raw) }
    }

    pub fn attribute(&self, id: Attribute) -> Option<&'a [u8]> {
        let mut out = NULL_BUFFER;
        // SAFETY: `raw` is this hook's filter; `out` is a valid out-pointer.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.raw, id as u32, &mut out,
            )
        };
        // SAFETY: Envoy's buffer of this hook (see `envoy_bytes`).
        ok.then(|| unsafe { envoy_bytes(out) })
    }

    /// Updates a stat the config defined, for these label values.
    pub fn stat(&self, kind: StatKind, id: usize, values: &[&str], op: StatOp) -> bool {
        let Some(mut labels) = label_buffers(values) else {
            return false;
        };
        let (f, v): (
            unsafe extern "C" fn(*mut c_void, usize, *mut ModuleBuffer, usize, u64) -> u32,
            u64,
        ) = match (kind, op) {
            (StatKind::Counter, StatOp::Add(v)) => (
                envoy_dynamic_module_callback_http_filter_increment_counter,
                v,
            ),
            (StatKind::Gauge, StatOp::Add(v)) => {
                (envoy_dynamic_module_callback_http_filter_increment_gauge, v)
            }
            (StatKind::Gauge, StatOp::Sub(v)) => {
                (envoy_dynamic_module_callback_http_filter_decrement_gauge, v)
            }
            (StatKind::Gauge, StatOp::Set(v)) => {
                (envoy_dynamic_module_callback_http_filter_set_gauge, v)
            }
            (StatKind::Histogram, StatOp::Set(v) | StatOp::Add(v)) => (
                envoy_dynamic_module_callback_http_filter_record_histogram_value,
                v,
            ),
            _ => return false,
        };
        // SAFETY: `raw` is this hook's filter, made from the config that
        // defined `id`; the label buffers outlive the call.
        unsafe { f(self.raw, id, labels.as_mut_ptr(), values.len(), v) == METRICS_SUCCESS }
    }
}

// ------------------------------------------------------------ event hooks

/// Runs a hook's body; a panic is logged, never unwound into Envoy.
fn guarded<T>(hook: &str, body: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => Some(value),
        Err(_) => {
            log(LogLevel::Critical, &format!("sluice panicked in {hook}"));
            None
        }
    }
}

fn filter<'a>(raw: *mut c_void) -> Filter<'a> {
    Filter {
        raw,
        _hook: PhantomData,
    }
}

/// The module's stream behind `module_ptr`.
///
/// SAFETY (of the callers): `module_ptr` is what
/// `envoy_dynamic_module_on_http_filter_new` returned (a leaked
/// `Box<filter::Stream>`), not yet destroyed; Envoy calls one stream's
/// hooks one at a time on its worker thread, so the `&mut` is unique.
unsafe fn stream<'a>(module_ptr: *const c_void) -> Option<&'a mut filter::Stream> {
    (module_ptr as *mut filter::Stream).as_mut()
}

/// A stream hook: the stream and its filter handle, the phase for a
/// panic's answer, and the status a panic (or a missing stream) returns.
fn on_stream(
    hook: &str,
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
    phase: Phase,
    run: impl FnOnce(&mut filter::Stream, Filter<'_>) -> Status,
) -> u32 {
    let envoy = filter(envoy_ptr);
    // SAFETY: see `stream`.
    let Some(s) = (unsafe { stream(module_ptr) }) else {
        return Status::Continue as u32;
    };
    match guarded(hook, || run(s, envoy)) {
        Some(status) => status as u32,
        None => filter::panicked(envoy, phase) as u32,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    crate::log_lines::forward_to(filter::log_to_envoy);
    ABI_VERSION.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy_ptr: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    let envoy = Config {
        raw: config_envoy_ptr,
        _hook: PhantomData,
    };
    // SAFETY: Envoy's buffer, valid for this hook (see `envoy_bytes`).
    let bytes = unsafe { envoy_bytes(config) };
    match guarded("config_new", || filter::Config::new(&envoy, bytes)) {
        Some(Some(config)) => Box::into_raw(Box::new(config)) as *const c_void,
        _ => std::ptr::null(),
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config_ptr: *const c_void) {
    if config_ptr.is_null() {
        return;
    }
    // SAFETY: `config_ptr` is the box config_new leaked; Envoy destroys
    // each config once.
    let config = unsafe { Box::from_raw(config_ptr as *mut filter::Config) };
    let _ = guarded("config_destroy", || drop(config));
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config_ptr: *const c_void,
    envoy_ptr: *mut c_void,
) -> *const c_void {
    // SAFETY: `config_ptr` is the box config_new leaked, alive while Envoy
    // makes filters from it.
    let Some(config) = (unsafe { (config_ptr as *const filter::Config).as_ref() }) else {
        return std::ptr::null();
    };
    let envoy = filter(envoy_ptr);
    match guarded("filter_new", || filter::Stream::new(config, envoy)) {
        Some(Some(s)) => Box::into_raw(Box::new(s)) as *const c_void,
        _ => std::ptr::null(),
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(
        "request_headers",
        envoy_ptr,
        module_ptr,
        Phase::Request,
        |s, f| s.on_request_headers(f, end_of_stream),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(
        "request_body",
        envoy_ptr,
        module_ptr,
        Phase::Request,
        |s, f| s.on_request_body(f, end_of_stream),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
) -> u32 {
    on_stream(
        "request_trailers",
        envoy_ptr,
        module_ptr,
        Phase::Request,
        |s, f| s.on_request_trailers(f),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    on_stream(
        "response_headers",
        envoy_ptr,
        module_ptr,
        Phase::Response,
        |s, f| s.on_response_headers(f),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(
        "response_body",
        envoy_ptr,
        module_ptr,
        Phase::Response,
        |s, f| s.on_response_body(f, end_of_stream),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
) -> u32 {
    Status::Continue as u32
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy_ptr: *mut c_void,
    module_ptr: *const c_void,
) {
    on_stream(
        "stream_complete",
        envoy_ptr,
        module_ptr,
        Phase::Done,
        |s, f| {
            s.on_stream_complete(f);
            Status::Continue
        },
    );
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module_ptr: *const c_void) {
    if module_ptr.is_null() {
        return;
    }
    // SAFETY: `module_ptr` is the box filter_new leaked; Envoy destroys
    // each filter once, after its last hook.
    let s = unsafe { Box::from_raw(module_ptr as *mut filter::Stream) };
    let _ = guarded("filter_destroy", || drop(s));
}

// Hooks Envoy requires but the prototype never triggers (no callouts,
// streams or scheduler; not a terminal filter): they do nothing.

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _callout_id: u64,
    _result: u32,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _body_chunks: *mut EnvoyBuffer,
    _body_chunks_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _stream_id: u64,
    _reason: u32,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
    _event_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy_ptr: *mut c_void,
    _module_ptr: *const c_void,
) {
}
