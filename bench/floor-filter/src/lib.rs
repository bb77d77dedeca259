//! Floor filters for the sluice benchmark (bench/run.py, issue 10).
//!
//! Plugin configuration (a string, `google.protobuf.StringValue`):
//! - `empty`: an HTTP context whose callbacks are the SDK's defaults
//!   (Continue everywhere): the cost of V8 and the proxy-wasm dispatch.
//! - `body-reading`: what sluice must do at least with bodies — holds the
//!   request headers until the body is complete (the listener sets
//!   `allow_on_headers_stop_iteration` as for sluice), then reads the whole
//!   request body with one `get_http_request_body`, and reads each response
//!   chunk with `get_http_response_body`. The bytes are only counted.
//! - `host-calls`: no policy, only the host calls sluice's header-only
//!   policy makes per request (core/tests/hostcalls.rs, bench shape (c)),
//!   with values of the sizes sluice's have: the request-header snapshot,
//!   the clock, two shared-data records read and written back with their
//!   CAS, the route record read (absent), the decision counter; on a POST
//!   the body read, the clock again, two token counters and two latency
//!   histograms; on the answer `:status`, three `x-ratelimit-*` headers
//!   and the audit fragment in filter state. What sluice costs beyond this
//!   floor is its own code in the VM; what this floor costs beyond `empty`
//!   is Envoy's side of those calls.
//!
//! Anything else fails the configuration (Envoy then refuses the config),
//! so a typo never silently measures the wrong floor.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { mode: Mode::Empty, metrics: [0; 5] })
    });
}}

#[derive(Clone, Copy)]
enum Mode {
    Empty,
    BodyReading,
    /// (j), and its variants (k) and (l): see [`HostCalls`]'s fields.
    HostCalls {
        skip_route: bool,
        one_map: bool,
    },
}

struct Root {
    mode: Mode,
    /// The counters and histograms `host-calls` updates (defined once).
    metrics: [u32; 5],
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        self.mode = match String::from_utf8_lossy(&config).trim() {
            "" | "empty" => Mode::Empty,
            "body-reading" => Mode::BodyReading,
            "host-calls" => Mode::HostCalls {
                skip_route: false,
                one_map: false,
            },
            "host-calls-no-route" => Mode::HostCalls {
                skip_route: true,
                one_map: false,
            },
            "host-calls-one-map" => Mode::HostCalls {
                skip_route: false,
                one_map: true,
            },
            other => {
                proxy_wasm::hostcalls::log(
                    LogLevel::Error,
                    &format!("floor filter: configuration {other:?} is not \"empty\", \"body-reading\", \"host-calls\", \"host-calls-no-route\" or \"host-calls-one-map\""),
                )
                .ok();
                return false;
            }
        };
        if let Mode::HostCalls { .. } = self.mode {
            let kinds = [
                (
                    MetricType::Counter,
                    "floor_requests_total_decision=admit;.tier=pro;",
                ),
                (
                    MetricType::Counter,
                    "floor_tokens_total_direction=input;.tier=pro;",
                ),
                (
                    MetricType::Counter,
                    "floor_tokens_total_direction=output;.tier=pro;",
                ),
                (
                    MetricType::Histogram,
                    "floor_ttft_milliseconds_model=other;",
                ),
                (MetricType::Histogram, "floor_e2e_milliseconds_model=other;"),
            ];
            for (slot, (kind, name)) in self.metrics.iter_mut().zip(kinds) {
                match hostcalls::define_metric(kind, name) {
                    Ok(id) => *slot = id,
                    Err(_) => return false,
                }
            }
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match self.mode {
            Mode::Empty => Box::new(Empty),
            Mode::BodyReading => Box::new(BodyReading::default()),
            Mode::HostCalls {
                skip_route,
                one_map,
            } => Box::new(HostCalls {
                metrics: self.metrics,
                skip_route,
                one_map,
                ..HostCalls::default()
            }),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Continue everywhere (the SDK's defaults).
struct Empty;

impl Context for Empty {}
impl HttpContext for Empty {}

#[derive(Default)]
struct BodyReading {
    /// Bytes buffered so far (for the trailers case).
    body_size: usize,
    /// Bytes read; the reads are host calls, this only gives them a use.
    read: usize,
}

impl Context for BodyReading {}

impl HttpContext for BodyReading {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause // until the whole body is buffered, as sluice does
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.body_size = body_size;
        if !end_of_stream {
            return Action::Pause; // buffer
        }
        self.read += self
            .get_http_request_body(0, body_size)
            .map_or(0, |b| b.len());
        Action::Continue
    }

    /// A body that ends with trailers has no body callback with
    /// `end_of_stream`: read the buffered body here, as sluice does.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.read += self
            .get_http_request_body(0, self.body_size)
            .map_or(0, |b| b.len());
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        self.read += self
            .get_http_response_body(0, body_size)
            .map_or(0, |b| b.len());
        Action::Continue
    }
}

/// sluice's header-only host calls without its policy (see the top).
#[derive(Default)]
struct HostCalls {
    metrics: [u32; 5],
    body_size: usize,
    /// Bytes read; the reads are host calls, this only gives them a use.
    read: usize,
    /// (k): without the route record's read.
    skip_route: bool,
    /// (l): the answer's headers in one map read and one map write.
    one_map: bool,
}

/// A record's key and the size of the value sluice writes to it.
const RECORDS: [(&str, usize); 2] = [
    ("sluice:v1:rec:route/v1", 85),
    ("sluice:v1:rec:tier/pro:declared:key:b0962662e937d44c", 54),
];
/// The route's pushback record, never written on a healthy route.
const ROUTE_RECORD: &str = "sluice:v1:upstream/none";
/// The answer's `x-ratelimit-*` headers, as sluice writes them.
const RATELIMIT_HEADERS: [(&str, &str); 3] = [
    ("x-ratelimit-limit", "1000000000"),
    ("x-ratelimit-remaining", "999999999"),
    ("x-ratelimit-reset", "1"),
];
/// The size of sluice's audit fragment on an admitted request.
const AUDIT_BYTES: usize = 700;

impl HostCalls {
    /// The clock, the records read and written back (a write that loses
    /// its CAS is simply not retried), the route record, the decision.
    fn decide(&mut self) {
        let _ = hostcalls::get_current_time();
        for (key, size) in RECORDS {
            let (value, cas) = hostcalls::get_shared_data(key).unwrap_or((None, None));
            self.read += value.as_ref().map_or(0, Vec::len);
            let _ = hostcalls::set_shared_data(key, Some(&vec![b'r'; size]), cas);
            if key == RECORDS[0].0 && !self.skip_route {
                let (route, _) = hostcalls::get_shared_data(ROUTE_RECORD).unwrap_or((None, None));
                self.read += route.map_or(0, |v| v.len());
            }
        }
        let _ = hostcalls::increment_metric(self.metrics[0], 1);
    }

    fn decide_body(&mut self, body_size: usize) {
        self.read +=
            hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .flatten()
                .map_or(0, |b| b.len());
        self.decide();
        let _ = hostcalls::get_current_time();
        let _ = hostcalls::increment_metric(self.metrics[1], 440);
        let _ = hostcalls::increment_metric(self.metrics[2], 512);
    }
}

impl Context for HostCalls {}

extern "C" {
    fn proxy_get_header_map_pairs(map: u32, data: *mut *mut u8, size: *mut usize) -> u32;
}

/// The request-header snapshot as sluice takes it (one raw call, not the
/// SDK's `get_map_bytes`, which allocates per header): its size in bytes.
fn request_header_pairs() -> usize {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: both pointers are valid for the call; on OK (0) the host
    // hands over `size` bytes it allocated through this module's
    // `proxy_on_memory_allocate` (the SDK's, a `Vec<u8>` of that
    // capacity), taken back as that `Vec` and dropped.
    unsafe {
        if proxy_get_header_map_pairs(0, &mut data, &mut size) != 0 || data.is_null() {
            return 0;
        }
        drop(Vec::from_raw_parts(data, size, size));
    }
    size
}

impl HttpContext for HostCalls {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.read += request_header_pairs();
        if end_of_stream {
            self.decide();
            Action::Continue
        } else {
            Action::Pause // until the whole body is buffered, as sluice does
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.body_size = body_size;
        if !end_of_stream {
            return Action::Pause; // buffer
        }
        self.decide_body(body_size);
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.decide_body(self.body_size);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.one_map {
            let mut pairs = hostcalls::get_map(MapType::HttpResponseHeaders).unwrap_or_default();
            self.read += pairs.len();
            for (name, value) in RATELIMIT_HEADERS {
                pairs.push((name.to_string(), value.to_string()));
            }
            let refs: Vec<(&str, &str)> = pairs
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let _ = hostcalls::set_map(MapType::HttpResponseHeaders, refs);
            return Action::Continue;
        }
        self.read += hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, ":status")
            .ok()
            .flatten()
            .map_or(0, |v| v.len());
        for (name, value) in RATELIMIT_HEADERS {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if self.body_size > 0 {
            let _ = hostcalls::record_metric(self.metrics[3], 0);
            let _ = hostcalls::record_metric(self.metrics[4], 0);
        }
        let audit = vec![b'a'; AUDIT_BYTES];
        let _ = hostcalls::set_property(vec!["sluice_audit"], Some(&audit));
    }
}
