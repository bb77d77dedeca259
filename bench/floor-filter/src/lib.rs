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
//!
//! Anything else fails the configuration (Envoy then refuses the config),
//! so a typo never silently measures the wrong floor.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { mode: Mode::Empty })
    });
}}

#[derive(Clone, Copy)]
enum Mode {
    Empty,
    BodyReading,
}

struct Root {
    mode: Mode,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        self.mode = match String::from_utf8_lossy(&config).trim() {
            "" | "empty" => Mode::Empty,
            "body-reading" => Mode::BodyReading,
            other => {
                proxy_wasm::hostcalls::log(
                    LogLevel::Error,
                    &format!("floor filter: configuration {other:?} is neither \"empty\" nor \"body-reading\""),
                )
                .ok();
                return false;
            }
        };
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match self.mode {
            Mode::Empty => Box::new(Empty),
            Mode::BodyReading => Box::new(BodyReading::default()),
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
