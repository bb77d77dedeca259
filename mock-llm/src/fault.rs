//! Server-wide scripted faults: the whole process fails in one chosen way,
//! set by `--fault SPEC` or `PUT /admin/fault`, whatever the request's
//! headers say. A gateway that copies a request's `x-mock-*` headers to its
//! fallback cannot carry these along, so a test can fail one upstream and
//! watch the gateway move to another.
//!
//! Grammar: `<kind>[:<opt>=<value>[,<opt>=<value>...]]`, e.g. `429:retry_after=2,times=3`.
//! Options every kind takes: `times=N` (only the first N model calls after
//! the fault was set are hit) and `for_ms=N` (only calls within N ms of it
//! being set are hit). Kinds: `429`, `500`, `502`, `503` (option
//! `retry_after=S`), `reset`, `hang`, `slow_first_token:ms=N`,
//! `stream_cut:after=N`, `stream_stall:after=N`, `malformed_chunk:after=N`,
//! `no_done`, `context_length`, `content_filter`.
//!
//! The stream kinds hit streamed answers only: a call answered in one JSON
//! body is served normally and is not counted as a hit.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::connect_info::Connected;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::serve::{IncomingStream, Listener};
use axum::Json;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::framing::SSE_DONE;
use crate::generate::Api;
use crate::lock;
use crate::personality::{Personality, Refusal, Surface};

/// How the server fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 429, 500, 502 or 503 with an error body; `Retry-After` if given.
    Status {
        status: StatusCode,
        retry_after: Option<u64>,
    },
    /// The connection is dropped (TCP reset) before any response byte.
    Reset,
    /// No answer at all, until the client goes away.
    Hang,
    /// The response head (so the first byte) waits this long, then the
    /// answer is normal.
    SlowFirstToken(Duration),
    /// A streamed answer is reset after this many chunks.
    StreamCut(usize),
    /// A streamed answer sends this many chunks, then nothing, never ending.
    StreamStall(usize),
    /// A streamed answer gets a chunk that is not JSON after this many.
    MalformedChunk(usize),
    /// A streamed answer ends cleanly without its terminator.
    NoDone,
    /// 400: the prompt does not fit the context window.
    ContextLength,
    /// 400: Azure OpenAI's content filter blocked the prompt.
    ContentFilter,
}

impl Kind {
    /// Whether this kind changes a streamed body (decided once the answer
    /// is known to be a stream) rather than the whole response.
    pub fn on_stream(self) -> bool {
        matches!(
            self,
            Kind::StreamCut(_) | Kind::StreamStall(_) | Kind::MalformedChunk(_) | Kind::NoDone
        )
    }
}

/// A parsed spec: the kind and when it stops hitting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: Kind,
    /// Hit only the first N model calls.
    pub times: Option<u64>,
    /// Hit only during this long after the fault was set.
    pub for_time: Option<Duration>,
    /// The spec as written (trimmed), shown by `GET /admin/fault`.
    pub spec: String,
}

/// A spec that cannot be used; the message names the bad part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecError(pub String);

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SpecError {}

const KINDS: &str = "429, 500, 502, 503, reset, hang, slow_first_token, stream_cut, \
                     stream_stall, malformed_chunk, no_done, context_length, content_filter";

/// Parses a spec; `Ok(None)` for an empty one or `none` (no fault).
pub fn parse(spec: &str) -> Result<Option<Fault>, SpecError> {
    let spec = spec.trim();
    if spec.is_empty() || spec == "none" {
        return Ok(None);
    }
    let (name, rest) = match spec.split_once(':') {
        Some((name, rest)) => (name.trim(), Some(rest)),
        None => (spec, None),
    };
    let mut opts: BTreeMap<&str, u64> = BTreeMap::new();
    for part in rest.into_iter().flat_map(|r| r.split(',')) {
        let part = part.trim();
        let Some((key, value)) = part.split_once('=') else {
            return Err(SpecError(format!(
                "fault option {part:?}: expected <option>=<value>"
            )));
        };
        let (key, value) = (key.trim(), value.trim());
        let n = value.parse::<u64>().map_err(|_| {
            SpecError(format!(
                "fault option {key}: expected a non-negative integer, got {value:?}"
            ))
        })?;
        if opts.insert(key, n).is_some() {
            return Err(SpecError(format!("fault option {key}: given twice")));
        }
    }
    // The options each kind takes besides `times` and `for_ms`; anything
    // else is named before a missing required option.
    let own: &[&str] = match name {
        "429" | "500" | "502" | "503" => &["retry_after"],
        "slow_first_token" => &["ms"],
        "stream_cut" | "stream_stall" | "malformed_chunk" => &["after"],
        "reset" | "hang" | "no_done" | "context_length" | "content_filter" => &[],
        other => {
            return Err(SpecError(format!(
                "unknown fault kind {other:?} (expected one of {KINDS}, or none)"
            )))
        }
    };
    if let Some(unknown) = opts
        .keys()
        .find(|k| !own.contains(k) && !["times", "for_ms"].contains(k))
    {
        let takes = own
            .iter()
            .chain(&["times", "for_ms"])
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        return Err(SpecError(format!(
            "fault {name}: unknown option {unknown:?} (it takes {takes})"
        )));
    }
    let times = opts.remove("times");
    let for_time = opts.remove("for_ms").map(Duration::from_millis);
    let mut need = |opt: &str| {
        opts.remove(opt)
            .ok_or_else(|| SpecError(format!("fault {name}: option {opt}=N is required")))
    };
    let chunks = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    let kind = match name {
        "reset" => Kind::Reset,
        "hang" => Kind::Hang,
        "slow_first_token" => Kind::SlowFirstToken(Duration::from_millis(need("ms")?)),
        "stream_cut" => Kind::StreamCut(chunks(need("after")?)),
        "stream_stall" => Kind::StreamStall(chunks(need("after")?)),
        "malformed_chunk" => Kind::MalformedChunk(chunks(need("after")?)),
        "no_done" => Kind::NoDone,
        "context_length" => Kind::ContextLength,
        "content_filter" => Kind::ContentFilter,
        status => Kind::Status {
            status: status
                .parse::<u16>()
                .ok()
                .and_then(|n| StatusCode::from_u16(n).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            retry_after: opts.remove("retry_after"),
        },
    };
    Ok(Some(Fault {
        kind,
        times,
        for_time,
        spec: spec.to_owned(),
    }))
}

/// The fault in force and how often it hit.
#[derive(Debug, Default)]
pub struct Faults(Mutex<Option<Active>>);

#[derive(Debug)]
struct Active {
    fault: Fault,
    set_at: Instant,
    hits: u64,
}

impl Active {
    fn live(&self) -> bool {
        self.times.is_none_or(|n| self.hits < n)
            && self.for_time.is_none_or(|d| self.set_at.elapsed() < d)
    }
}

impl std::ops::Deref for Active {
    type Target = Fault;
    fn deref(&self) -> &Fault {
        &self.fault
    }
}

impl Faults {
    pub fn new(fault: Option<Fault>) -> Faults {
        let f = Faults::default();
        f.set(fault);
        f
    }

    /// Replaces the fault (`None` clears it); its count and clock restart.
    pub fn set(&self, fault: Option<Fault>) {
        *lock(&self.0) = fault.map(|fault| Active {
            fault,
            set_at: Instant::now(),
            hits: 0,
        });
    }

    /// Counts a hit and says the kind, when a fault is in force and
    /// `applies` to its kind; else `None` and nothing is counted.
    pub fn hit(&self, applies: impl Fn(Kind) -> bool) -> Option<Kind> {
        let mut active = lock(&self.0);
        let a = active.as_mut().filter(|a| applies(a.kind) && a.live())?;
        a.hits += 1;
        Some(a.kind)
    }

    /// `GET /admin/fault`: the spec (`null` without one), its hits, and
    /// whether it still hits (`times`/`for_ms` not used up).
    pub fn snapshot(&self) -> Value {
        match &*lock(&self.0) {
            Some(a) => json!({"fault": a.spec, "hits": a.hits, "active": a.live()}),
            None => json!({"fault": null, "hits": 0, "active": false}),
        }
    }
}

/// Whether a call to `api` is a model call that faults apply to: every
/// inference route but vLLM's tokenizer endpoints (`None`: `/invocations`).
pub fn applies_to(api: Option<Api>) -> bool {
    !matches!(api, Some(Api::Tokenize | Api::Detokenize))
}

/// What a request needs to write a fault's error body.
pub struct ErrorContext {
    pub personality: Personality,
    pub surface: Surface,
    pub max_model_len: u64,
    pub input_tokens: u64,
}

/// The error response of an error kind (`None` for the other kinds).
///
/// mock-llm's own personality and `openai` write OpenAI's error object;
/// vllm, ollama and anthropic write each their own shape, as the
/// `x-mock-status` knob does.
pub fn error_response(kind: Kind, cx: &ErrorContext) -> Option<Response> {
    let p = cx.personality;
    let openai_shaped = matches!(p, Personality::Mock | Personality::Openai);
    let res = match kind {
        Kind::Status {
            status,
            retry_after,
        } => {
            let (kind, code, message) = status_body(status);
            let mut res = if openai_shaped {
                openai_error(status, json!(kind), Value::Null, json!(code), message)
            } else {
                Refusal::for_status(status, message).render(p, cx.surface)
            };
            if let Some(v) = retry_after.map(HeaderValue::from) {
                res.headers_mut().insert(RETRY_AFTER, v);
            }
            res
        }
        Kind::ContextLength => context_length(cx),
        Kind::ContentFilter => content_filter(),
        _ => return None,
    };
    Some(res)
}

/// The `type`, `code` and message of a status fault, after OpenAI's
/// error-code guide: a request-rate 429 is typed `requests` with code
/// `rate_limit_exceeded`; its 5xx answers are typed `server_error` with no
/// code.
fn status_body(status: StatusCode) -> (&'static str, Option<&'static str>, String) {
    match status.as_u16() {
        429 => (
            "requests",
            Some("rate_limit_exceeded"),
            "Rate limit reached for requests (mock-llm scripted fault 429).".into(),
        ),
        503 => (
            "server_error",
            None,
            "The server is overloaded or not ready yet (mock-llm scripted fault 503).".into(),
        ),
        s => (
            "server_error",
            None,
            format!(
                "The server had an error while processing your request (mock-llm scripted \
                 fault {s})."
            ),
        ),
    }
}

fn openai_error(
    status: StatusCode,
    kind: Value,
    param: Value,
    code: Value,
    message: impl Into<String>,
) -> Response {
    let body = json!({"error": {
        "message": message.into(), "type": kind, "param": param, "code": code,
    }});
    (status, Json(body)).into_response()
}

/// A prompt over the context window, as each server says it. The token
/// count reported is the request's, raised past the window so the message
/// stays self-consistent.
fn context_length(cx: &ErrorContext) -> Response {
    let max = cx.max_model_len;
    let input = cx.input_tokens.max(max.saturating_add(1));
    match cx.personality {
        // OpenAI's chat API: 400, `invalid_request_error`, param `messages`,
        // code `context_length_exceeded`, the message naming the window and
        // the prompt's size (seen in many client bug reports quoting the
        // API's answer).
        Personality::Mock | Personality::Openai => openai_error(
            StatusCode::BAD_REQUEST,
            json!("invalid_request_error"),
            json!("messages"),
            json!("context_length_exceeded"),
            format!(
                "This model's maximum context length is {max} tokens. However, your messages \
                 resulted in {input} tokens. Please reduce the length of the messages."
            ),
        ),
        // vLLM checks the prompt against max_model_len in its serving
        // layer's input validation and answers its own wording (the same
        // text `prepare` in server.rs sends for a real overflow).
        Personality::Vllm => Refusal::invalid(
            format!(
                "This model's maximum context length is {max} tokens. However, your request \
                 has {input} input tokens. Please reduce the length of the input messages."
            ),
            Some("input_tokens"),
        )
        .render(cx.personality, cx.surface),
        // Anthropic's Messages API: a 400 `invalid_request_error` saying
        // the prompt is too long, with both counts.
        Personality::Anthropic => Refusal::invalid(
            format!("prompt is too long: {input} tokens > {max} maximum"),
            None,
        )
        .render(cx.personality, cx.surface),
        // Ollama truncates an over-long chat prompt instead of refusing
        // it; its embedding endpoint refuses with this short text.
        Personality::Ollama => {
            Refusal::invalid("the input length exceeds the context length", None)
                .render(cx.personality, cx.surface)
        }
    }
}

/// Azure OpenAI's answer when its content filter blocks a prompt: 400, a
/// `null` type, param `prompt`, code `content_filter`, the status repeated
/// in the body and an `innererror` with the per-category verdicts (Azure
/// OpenAI docs, "Content filtering": the prompt-annotation error case).
fn content_filter() -> Response {
    let safe = json!({"filtered": false, "severity": "safe"});
    let body = json!({"error": {
        "message": "The response was filtered due to the prompt triggering Azure OpenAI's \
                    content management policy. Please modify your prompt and retry.",
        "type": null,
        "param": "prompt",
        "code": "content_filter",
        "status": 400,
        "innererror": {
            "code": "ResponsibleAIPolicyViolation",
            "content_filter_result": {
                "hate": safe,
                "jailbreak": {"filtered": false, "detected": false},
                "self_harm": safe,
                "sexual": safe,
                "violence": {"filtered": true, "severity": "medium"},
            },
        },
    }});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

/// The response of `reset`. With the connection killed, a body that never
/// yields: the server then writes (and fails, setting the reset) rather
/// than dropping the connection at once with a plain close. Without a
/// connection to kill (an in-process router), a body that fails before its
/// first byte.
pub fn reset_response(killed: bool) -> Response {
    if killed {
        return Body::from_stream(futures_util::stream::pending::<Result<Bytes, io::Error>>())
            .into_response();
    }
    let failed = futures_util::stream::once(async {
        Err::<Bytes, _>(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "mock-llm fault reset",
        ))
    });
    Body::from_stream(failed).into_response()
}

/// Applies a stream kind to the frames of a streamed answer (before the
/// line ends are rewritten). `sse`: the frames are SSE events, else NDJSON.
pub fn bend_frames(kind: Kind, frames: &mut Vec<Bytes>, sse: bool) {
    match kind {
        Kind::MalformedChunk(after) => {
            // Cut off inside the first object, as a truncated write would.
            let bad: &'static [u8] = if sse {
                b"data: {\"choices\":[{\n\n"
            } else {
                b"{\"message\":{\n"
            };
            frames.insert(after.min(frames.len()), Bytes::from_static(bad));
        }
        Kind::NoDone => {
            let before = frames.len();
            frames.retain(|f| f.as_ref() != SSE_DONE);
            // A stream without `[DONE]` (Responses, Anthropic, Ollama) loses
            // the event that closes it instead.
            if frames.len() == before {
                frames.pop();
            }
        }
        _ => {}
    }
}

/// A connection as the fault listener accepted it: `reset` kills it, so it
/// fails every read and write and closes with a TCP reset.
#[derive(Debug, Clone, Default)]
pub struct Conn(Arc<ConnState>);

#[derive(Debug, Default)]
struct ConnState {
    killed: AtomicBool,
    reader: Mutex<Option<Waker>>,
}

impl Conn {
    /// Marks the connection dead and wakes its reader, so the server drops
    /// it at once without writing anything more.
    pub fn kill(&self) {
        self.0.killed.store(true, Ordering::SeqCst);
        if let Some(w) = lock(&self.0.reader).take() {
            w.wake();
        }
    }

    fn killed(&self) -> bool {
        self.0.killed.load(Ordering::SeqCst)
    }
}

impl Connected<IncomingStream<'_, FaultListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, FaultListener>) -> Self {
        stream.remote_addr().1.clone()
    }
}

/// A TCP listener whose connections a `reset` fault can kill from inside
/// a handler (the handle reaches it as `ConnectInfo<Conn>`).
pub struct FaultListener(pub TcpListener);

impl Listener for FaultListener {
    type Io = FaultIo;
    type Addr = (SocketAddr, Conn);

    async fn accept(&mut self) -> (FaultIo, (SocketAddr, Conn)) {
        let (inner, addr) = Listener::accept(&mut self.0).await;
        let conn = Conn::default();
        let io = FaultIo {
            inner,
            conn: conn.clone(),
            lingering: false,
        };
        (io, (addr, conn))
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok((self.0.local_addr()?, Conn::default()))
    }
}

/// A TCP stream that fails once its connection is killed.
pub struct FaultIo {
    inner: TcpStream,
    conn: Conn,
    lingering: bool,
}

impl FaultIo {
    /// The error of a killed connection; the socket is set to close with
    /// RST (zero linger) when the server drops it.
    fn dead(&mut self) -> Option<io::Error> {
        if !self.conn.killed() {
            return None;
        }
        if !self.lingering {
            self.lingering = true;
            // Without it the close is a FIN, an orderly end; a reset is
            // what a crashed upstream looks like. Best effort.
            let _ = self.inner.set_zero_linger();
        }
        Some(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "mock-llm fault reset",
        ))
    }
}

impl AsyncRead for FaultIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        *lock(&self.conn.0.reader) = Some(cx.waker().clone());
        if let Some(e) = self.dead() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for FaultIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.dead() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.dead() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = self.dead() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = self.dead() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(spec: &str) -> Fault {
        parse(spec).unwrap().unwrap()
    }

    #[test]
    fn parses_every_kind_and_the_common_options() {
        assert_eq!(
            ok("429:retry_after=7,times=2").kind,
            Kind::Status {
                status: StatusCode::TOO_MANY_REQUESTS,
                retry_after: Some(7)
            }
        );
        assert_eq!(ok("429:retry_after=7,times=2").times, Some(2));
        assert_eq!(
            ok(" 503 ").kind,
            Kind::Status {
                status: StatusCode::SERVICE_UNAVAILABLE,
                retry_after: None
            }
        );
        assert_eq!(ok("reset").kind, Kind::Reset);
        assert_eq!(
            ok("hang:for_ms=50").for_time,
            Some(Duration::from_millis(50))
        );
        assert_eq!(
            ok("slow_first_token:ms=300").kind,
            Kind::SlowFirstToken(Duration::from_millis(300))
        );
        assert_eq!(ok("stream_cut:after=2").kind, Kind::StreamCut(2));
        assert_eq!(ok("stream_stall:after=0").kind, Kind::StreamStall(0));
        assert_eq!(
            ok("malformed_chunk: after = 1").kind,
            Kind::MalformedChunk(1)
        );
        assert_eq!(ok("no_done").kind, Kind::NoDone);
        assert_eq!(ok("context_length").kind, Kind::ContextLength);
        assert_eq!(ok("content_filter:times=1").kind, Kind::ContentFilter);
        assert_eq!(parse("").unwrap(), None);
        assert_eq!(parse("none").unwrap(), None);
        assert_eq!(ok("no_done").spec, "no_done");
    }

    #[test]
    fn bad_specs_name_the_bad_part() {
        for (spec, names) in [
            ("418", "\"418\""),
            ("explode", "\"explode\""),
            ("stream_cut", "after=N"),
            ("slow_first_token:after=3", "\"after\" (it takes ms"),
            ("slow_first_token", "ms=N"),
            ("429:retry_after=soon", "retry_after"),
            ("reset:retry_after=1", "\"retry_after\""),
            ("500:times=1,times=2", "times"),
            ("hang:times", "\"times\""),
            ("no_done:", "\"\""),
            ("503:for_ms=-1", "for_ms"),
            ("stream_stall:after=2,bogus=1", "\"bogus\""),
        ] {
            let err = parse(spec).unwrap_err();
            assert!(err.0.contains(names), "{spec}: {err}");
        }
    }

    #[test]
    fn times_and_for_ms_bound_the_hits() {
        let faults = Faults::new(Some(ok("500:times=2")));
        let any = |_: Kind| true;
        assert!(faults.hit(any).is_some());
        assert!(faults.hit(|k| k.on_stream()).is_none(), "not its kind");
        assert!(faults.hit(any).is_some());
        assert!(faults.hit(any).is_none());
        assert_eq!(faults.snapshot()["hits"], 2);
        assert_eq!(faults.snapshot()["active"], false);
        faults.set(Some(ok("500:for_ms=30")));
        assert!(faults.hit(any).is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(faults.hit(any).is_none());
        faults.set(None);
        assert_eq!(
            faults.snapshot(),
            json!({"fault": null, "hits": 0, "active": false})
        );
    }

    #[test]
    fn stream_kinds_bend_the_frames() {
        let frames = || {
            vec![
                Bytes::from_static(b"data: {\"a\":1}\n\n"),
                Bytes::from_static(b"data: {\"a\":2}\n\n"),
                Bytes::from_static(SSE_DONE),
            ]
        };
        let mut f = frames();
        bend_frames(Kind::MalformedChunk(1), &mut f, true);
        assert_eq!(f.len(), 4);
        assert_eq!(f[1].as_ref(), b"data: {\"choices\":[{\n\n");
        let mut f = frames();
        bend_frames(Kind::NoDone, &mut f, true);
        assert_eq!(f, frames()[..2].to_vec());
        let mut f = vec![
            Bytes::from_static(b"{\"done\":false}\n"),
            Bytes::from_static(b"{\"done\":true}\n"),
        ];
        bend_frames(Kind::NoDone, &mut f, false);
        assert_eq!(f.len(), 1);
    }
}
