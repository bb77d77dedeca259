//! Everything the request path needs from Envoy, as one small trait.
//!
//! The core ([`crate::flow`]) decides; a [`Host`] only carries out. The
//! proxy-wasm shim implements it with hostcalls (one per method, nothing
//! decided there); [`mock::MockHost`] implements it in memory, so the
//! whole path — identity to settlement, probes, breakers, the poll lease —
//! runs in native tests. Every method takes `&self` and no generics, so the
//! core holds it as `&dyn Host`.

use crate::state::store::SharedStore;

pub use headers::{decimal, Headers};

mod headers;
pub mod metrics;
#[cfg(not(target_arch = "wasm32"))]
pub mod mock;

/// What Envoy does with the stream after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Hold the stream: waiting for the body, or answered locally.
    Pause,
}

/// How Envoy aggregates a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Envoy as the filter sees it. Shared data (with compare-and-swap) is the
/// [`SharedStore`] supertrait. Headers are read as text with non-UTF-8
/// bytes replaced: a byte 0x80–0xFF from a client must never panic.
pub trait Host: SharedStore {
    // Request path (HTTP context).
    /// A request header by lower-case name (the first, if repeated).
    fn request_header(&self, name: &str) -> Option<String>;
    /// How many times a request header appears; `usize::MAX` when the host
    /// cannot say (a credential is then refused as repeated).
    fn request_header_count(&self, name: &str) -> usize;
    /// Every request header in order, repeats included, in one host call;
    /// `None` when the host cannot say.
    fn request_headers(&self) -> Option<Headers>;
    /// Sets (`Some`) or removes (`None`) a request header.
    fn set_request_header(&self, name: &str, value: Option<&str>);
    fn response_header(&self, name: &str) -> Option<String>;
    fn set_response_header(&self, name: &str, value: Option<&str>);
    /// The buffered request body, `size` bytes from the start.
    fn request_body(&self, size: usize) -> Vec<u8>;
    /// Replaces the first `size` bytes of the request body.
    fn replace_request_body(&self, size: usize, body: &[u8]);
    /// The response body chunk of this callback, `size` bytes.
    fn response_body(&self, size: usize) -> Vec<u8>;
    fn replace_response_body(&self, size: usize, body: &[u8]);
    /// Answers the client locally; the upstream never sees the request.
    fn send_reply(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Resets the stream both ways, once its response has started: the
    /// upstream request is reset (an HTTP/1.1 upstream connection is
    /// closed), so the server stops generating, and the client's response
    /// ends where it is. What earlier callbacks passed on has gone to the
    /// client; the chunk of the callback that calls this has not: the host
    /// resets before that chunk is passed on (Envoy's proxy-wasm
    /// `closeStream` runs it right after the VM call; the native module's
    /// reset is immediate). Neither ABI can end a response cleanly (with
    /// end of stream) while its upstream still sends: an HTTP/1.1 client
    /// sees its connection closed after the bytes already written (Envoy
    /// flushes them first), an HTTP/2 client a `RST_STREAM`, which cancels
    /// the frames Envoy still holds for it (a client reading slower than
    /// the upstream sends loses that tail). `false`: the host cannot.
    fn reset_stream(&self) -> bool;
    /// A stream property (`["source", "address"]`, dynamic metadata …).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Writes filter state (the access log reads audit fields there).
    fn set_property(&self, name: &str, value: &[u8]);
    /// Makes Envoy pick the route again after a routing header changed.
    fn clear_route_cache(&self) -> Result<(), String>;

    // Metrics, by name; the host defines each on first use.
    /// Adds to a counter or gauge (`by` 0 only defines it, at 0).
    fn metric_add(&self, kind: MetricKind, name: &str, by: i64);
    /// Sets a gauge, or records a value in a histogram.
    fn metric_record(&self, kind: MetricKind, name: &str, value: u64);

    /// Wall clock, nanoseconds since the Unix epoch.
    fn now_ns(&self) -> u64;
    fn now_ms(&self) -> u64 {
        self.now_ns() / 1_000_000
    }
    /// An environment variable of the VM (Envoy passes them in
    /// `vm_config.environment_variables`; WASI environ in the wasm VM).
    fn env_var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }

    // Root context.
    fn set_tick_period_ms(&self, ms: u64);
    /// Starts an HTTP callout; its token, or why it could not start.
    fn dispatch_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        timeout_ms: u64,
    ) -> Result<u32, String>;
    /// Starts a callout with a body (the fleet's POSTs to the sidecar);
    /// from an HTTP context its answer comes to that context.
    fn dispatch_post(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, String>;
    /// A header of the callout answer being delivered.
    fn call_response_header(&self, name: &str) -> Option<String>;
    fn call_response_body(&self, size: usize) -> Vec<u8>;
    /// Every header of the callout answer being delivered (`None`: the
    /// host cannot list them).
    fn call_response_headers(&self) -> Option<Headers> {
        None
    }

    // Waking paused requests (see `queue`): one wake-up queue per worker.
    /// Registers this worker's wake-up queue; its process-wide token.
    fn register_wake_queue(&self, name: &str) -> Option<u32>;
    /// Sends a message to a worker's wake-up queue (any worker's token).
    fn wake(&self, queue: u32, message: &[u8]) -> bool;
    /// The next message of this worker's queue.
    fn take_wake(&self, queue: u32) -> Option<Vec<u8>>;
    /// Makes the root context act on an HTTP stream (reply, resume).
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Resumes the paused request: this HTTP context's (after its callout
    /// answered), or from the root the effective context's. `false`: the
    /// stream is gone.
    fn resume_request(&self) -> bool;
    /// Resumes the response this HTTP context paused at its headers (its
    /// body, buffered meanwhile, follows). `false`: the stream is gone or
    /// the host cannot.
    fn resume_response(&self) -> bool {
        false
    }
}
