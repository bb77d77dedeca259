//! Routes and the path every request takes: record it, read the knobs, wait,
//! maybe fail on purpose, parse, generate, send (paced).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::fault::{Conn, ErrorContext, FaultListener, Faults, Kind as FaultKind};
use crate::framing::{paced_body, sse_newlines, Logged, Pacing};
use crate::generate::{Api, Generation, Reply, SSE};
use crate::knobs::Knobs;
use crate::metrics::{GaugeUpdate, Metrics};
use crate::personality::{Personality, Refusal, Surface};
use crate::stats::{Stats, Streams};
use crate::{lock, ollama, openai, tokens};

/// The model answered for when a request names none.
pub const DEFAULT_MODEL: &str = "mock-model";

/// Bodies above this are refused with 413; the filter caps far lower.
const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

const X_MOCK_NAME: HeaderName = HeaderName::from_static("x-mock-name");
const X_MOCK_MODEL: HeaderName = HeaderName::from_static("x-mock-model");

#[derive(Debug, Clone)]
pub struct Config {
    /// Sent as `x-mock-name` on every response, to tell upstreams apart.
    pub name: String,
    /// Listed by `/v1/models` and `/api/ps`, used as the `model_name` metric
    /// label, and answered for when a request names no model.
    pub model: String,
    /// A provider-style limit (`x-ratelimit-*` or `anthropic-ratelimit-*`
    /// headers, 429 past it; vLLM and Ollama answer 503).
    pub ratelimit: Option<crate::load::RateLimit>,
    /// The real server played (see [`crate::personality`]).
    pub personality: Personality,
    /// The models served (`--models a,b`): a request naming another gets
    /// the server's own 404. Empty: any model is served.
    pub models: Vec<String>,
    /// The context length: what a request without a limit may generate,
    /// and what vLLM checks a limit against.
    pub max_model_len: u64,
    /// Every request generates all it is allowed (as the knob
    /// `x-mock-output-tokens: allowed`).
    pub generate_allowed: bool,
    /// The one credential the server takes (`--api-key`), in the header
    /// and shape the played server reads it; `None`: no credential needed.
    pub api_key: Option<String>,
    /// The server-wide scripted fault at start (`--fault`); `PUT
    /// /admin/fault` replaces it.
    pub fault: Option<crate::fault::Fault>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            name: "mock-llm".into(),
            model: DEFAULT_MODEL.into(),
            ratelimit: None,
            personality: Personality::Mock,
            models: Vec::new(),
            max_model_len: DEFAULT_MAX_MODEL_LEN,
            generate_allowed: false,
            api_key: None,
            fault: None,
        }
    }
}

/// Default `--max-model-len`.
pub const DEFAULT_MAX_MODEL_LEN: u64 = 32_768;

struct AppState {
    name: HeaderValue,
    model: String,
    stats: Mutex<Stats>,
    streams: Arc<Streams>,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    limiter: Option<crate::load::Limiter>,
    personality: Personality,
    allowed_models: Vec<String>,
    max_model_len: u64,
    generate_allowed: bool,
    api_key: Option<String>,
    responses: crate::store::Store,
    faults: Faults,
}

impl AppState {
    /// The models listed by `/v1/models` and `/api/ps`.
    fn listed(&self) -> Vec<String> {
        if self.allowed_models.is_empty() {
            vec![self.model.clone()]
        } else {
            self.allowed_models.clone()
        }
    }
}

type Shared = Arc<AppState>;

/// The whole server as a router, for `serve` or for in-process tests.
pub fn app(config: Config) -> anyhow::Result<Router> {
    let name = HeaderValue::from_str(&config.name)
        .with_context(|| format!("--name {:?} is not a valid header value", config.name))?;
    let state: Shared = Arc::new(AppState {
        name,
        metrics: Arc::new(Metrics::new(config.model.clone())),
        model: config.model,
        stats: Mutex::default(),
        streams: Arc::default(),
        next_id: AtomicU64::new(1),
        limiter: config.ratelimit.map(crate::load::Limiter::new),
        personality: config.personality,
        allowed_models: config.models,
        max_model_len: config.max_model_len.max(1),
        generate_allowed: config.generate_allowed,
        api_key: config.api_key,
        responses: crate::store::Store::default(),
        faults: Faults::new(config.fault),
    });
    let infer_route =
        |api: Api| post(move |State(s): State<Shared>, req: Request| infer(s, Some(api), req));
    Ok(Router::new()
        // vLLM's SageMaker entry: the API is the body's shape.
        .route(
            "/invocations",
            post(|State(s): State<Shared>, req: Request| infer(s, None, req)),
        )
        .route("/v1/messages", infer_route(Api::Messages))
        .route("/api/embed", infer_route(Api::OllamaEmbed))
        .route("/api/embeddings", infer_route(Api::OllamaEmbeddings))
        .route("/v1/score", infer_route(Api::Score))
        .route("/score", infer_route(Api::Score))
        .route("/v1/rerank", infer_route(Api::Rerank))
        .route("/rerank", infer_route(Api::Rerank))
        .route("/v2/rerank", infer_route(Api::Rerank))
        .route("/pooling", infer_route(Api::Pooling))
        .route("/classify", infer_route(Api::Classify))
        .route("/tokenize", infer_route(Api::Tokenize))
        .route("/detokenize", infer_route(Api::Detokenize))
        .route("/v1/chat/completions", infer_route(Api::ChatCompletions))
        .route("/v1/completions", infer_route(Api::Completions))
        .route("/v1/embeddings", infer_route(Api::Embeddings))
        .route("/v1/responses", infer_route(Api::Responses))
        .route("/api/generate", infer_route(Api::OllamaGenerate))
        .route("/api/chat", infer_route(Api::OllamaChat))
        .route(
            "/v1/models",
            get(|State(s): State<Shared>, req: Request| {
                let list = s.listed();
                let body = openai::models(s.personality, &list, s.max_model_len);
                listing(s.clone(), req, body, true)
            }),
        )
        .route(
            "/api/ps",
            get(|State(s): State<Shared>, req: Request| {
                let body = ollama::ps(&s.listed());
                let served = matches!(s.personality, Personality::Mock | Personality::Ollama);
                listing(s.clone(), req, body, served)
            }),
        )
        .route("/metrics", get(metrics))
        .route("/admin/metrics", post(set_metrics))
        .route("/admin/stats", get(stats))
        .route("/admin/reset", post(reset))
        .route("/admin/fault", get(get_fault).put(put_fault))
        .fallback(not_found)
        .layer(middleware::map_response_with_state(
            state.clone(),
            stamp_name,
        ))
        .with_state(state))
}

/// Serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // Like uvicorn (vLLM's server), decode the path before routing, so
    // `/v1/chat/%63ompletions` is served as chat: tests show sluice does not
    // let such spellings through unread.
    let app = tower::util::MapRequest::new(app, decode_path);
    // Connections come through the fault listener, so a `reset` fault can
    // drop the one its request arrived on.
    let make = axum::ServiceExt::into_make_service_with_connect_info::<Conn>(app);
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopping = stop.clone();
    let server = axum::serve(FaultListener(listener), make).with_graceful_shutdown(async move {
        shutdown.await;
        stopping.notify_one();
    });
    // A `hang` or `stream_stall` fault holds its connection for good: once
    // asked to stop, connections get `DRAIN` to finish, then are dropped.
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served.context("serving HTTP"),
        () = async {
            stop.notified().await;
            tokio::time::sleep(DRAIN).await;
        } => Ok(()),
    }
}

/// How long connections may run on after the shutdown signal.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The request with its path percent-decoded (once); left as it is when the
/// decoded path would not be a valid URI path.
fn decode_path(mut req: Request) -> Request {
    let raw = req.uri().path();
    if !raw.contains('%') {
        return req;
    }
    let bytes = raw.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit));
        match (bytes[i], hex) {
            (b'%', Some(h)) => {
                let text = std::str::from_utf8(h).unwrap_or("00");
                decoded.push(u8::from_str_radix(text, 16).unwrap_or(0));
                i += 3;
            }
            (b, _) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    let Ok(path) = String::from_utf8(decoded) else {
        return req;
    };
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let mut parts = req.uri().clone().into_parts();
    if let Ok(pq) = path_and_query.parse() {
        parts.path_and_query = Some(pq);
        if let Ok(uri) = axum::http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }
    req
}

async fn stamp_name(State(s): State<Shared>, mut res: Response) -> Response {
    res.headers_mut().insert(X_MOCK_NAME, s.name.clone());
    res
}

/// An OpenAI-shaped error answer.
fn error(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Response {
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}});
    (status, Json(body)).into_response()
}

fn invalid_request(message: impl Into<String>) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_request",
        message,
    )
}

/// A request as it arrived, already counted in the stats.
struct Arrival {
    started: Instant,
    knobs: Result<Knobs, String>,
    /// `Null` for an empty body; `Err` for a body that is not JSON.
    body: Result<Value, String>,
}

impl Arrival {
    /// Reads the request; `api`'s body as its server reads it (Ollama: as
    /// Go's decoder fills its request struct, `go_json.rs`), the stats
    /// keep it as sent.
    async fn read(s: &AppState, req: Request, api: Option<Api>) -> Result<Self, Response> {
        let started = Instant::now();
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
            .await
            .map_err(|e| {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "request_too_large",
                    format!("could not read the request body: {e}"),
                )
            })?;
        let body = if bytes.is_empty() {
            Ok(Value::Null)
        } else {
            serde_json::from_slice::<Value>(&bytes)
                .map_err(|e| format!("request body is not valid JSON: {e}"))
        };
        let query: std::collections::HashMap<String, String> =
            serde_urlencoded::from_str(parts.uri.query().unwrap_or_default()).unwrap_or_default();
        {
            let mut stats = lock(&s.stats);
            stats.record(
                &parts.method,
                parts.uri.path(),
                parts.uri.query(),
                &parts.headers,
                body.clone().unwrap_or(Value::Null),
            );
            if let Some(last) = stats.last_request.as_mut() {
                last.raw = String::from_utf8_lossy(&bytes).into_owned();
            }
        }
        let go = api
            .filter(|_| s.personality == Personality::Ollama)
            .and_then(crate::go_json::ollama_request);
        let body = match (body, go) {
            (Ok(Value::Object(_)), Some(shape)) => crate::go_json::read(&bytes, shape)
                .map_err(|e| format!("request body is not valid JSON: {e}")),
            (body, _) => body,
        };
        Ok(Arrival {
            started,
            knobs: Knobs::parse(&parts.headers, &query).map_err(|e| e.0),
            body,
        })
    }

    /// Applies the knobs that come before any answer: a bad knob is a 400,
    /// then the latency, then an injected error status, shaped as the
    /// personality sends it.
    async fn gate(&self, p: Personality, surface: Surface) -> Result<&Knobs, Response> {
        let knobs = self
            .knobs
            .as_ref()
            .map_err(|e| invalid_request(e.clone()))?;
        if !knobs.latency.is_zero() {
            tokio::time::sleep(knobs.latency).await;
        }
        if let Some(status) = knobs.status.filter(|_| p != Personality::Mock) {
            return Err(Refusal::for_status(status, injected_message(p, status)).render(p, surface));
        }
        if let Some(status) = knobs.status {
            let (kind, code) = match status {
                StatusCode::TOO_MANY_REQUESTS => ("requests", "rate_limit_exceeded"),
                s if s.is_server_error() => ("server_error", "mock_injected_error"),
                _ => ("invalid_request_error", "mock_injected_error"),
            };
            let message = format!("mock-llm answered {status} as asked by x-mock-status");
            return Err(error(status, kind, code, message));
        }
        Ok(knobs)
    }

    /// The model the request names, if any.
    fn model(&self) -> Option<&str> {
        self.body.as_ref().ok()?.get("model")?.as_str()
    }

    /// Adds `Retry-After` (knob) and `x-mock-model` (the model seen).
    fn decorate(&self, mut res: Response, model: Option<&str>) -> Response {
        let headers = res.headers_mut();
        if let Ok(Knobs {
            retry_after: Some(v),
            ..
        }) = &self.knobs
        {
            headers.insert(RETRY_AFTER, v.clone());
        }
        if let Some(v) = model.and_then(|m| HeaderValue::from_str(m).ok()) {
            headers.insert(X_MOCK_MODEL, v);
        }
        res
    }
}

/// What a server says with an error status (the knob's injected errors).
fn injected_message(p: Personality, status: StatusCode) -> String {
    match (p, status.as_u16()) {
        // ollama server/sched.go ErrMaxQueue, answered 503.
        (Personality::Ollama, 503) => {
            "server busy, please try again.  maximum pending requests exceeded".into()
        }
        // Anthropic API reference, "Errors": 529 overloaded_error.
        (Personality::Anthropic, 529) => "Overloaded".into(),
        (Personality::Anthropic, 429) => {
            "This request would exceed your organization's rate limit.".into()
        }
        (Personality::Openai, 429) => "Rate limit reached for requests".into(),
        _ => format!("mock-llm answered {status} as asked by x-mock-status"),
    }
}

/// Every inference endpoint: chat, completions, embeddings, responses,
/// Anthropic messages, Ollama, the scoring family; `api: None` is
/// `/invocations`, whose body's shape says which.
async fn infer(s: Shared, api: Option<Api>, req: Request) -> Response {
    let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
    let conn = req
        .extensions()
        .get::<ConnectInfo<Conn>>()
        .map(|c| c.0.clone());
    if let Some(refused) = s.api_key.as_deref().and_then(|key| {
        s.personality
            .unauthorized(Surface::of(api), req.headers(), key)
    }) {
        return refused;
    }
    let arrival = match Arrival::read(&s, req, api).await {
        Ok(a) => a,
        Err(res) => return res,
    };
    let p = s.personality;
    // A server without the endpoint answers its own 404.
    if !p.serves(api) {
        return p.unknown_path(&method, &path);
    }
    let model = arrival.model().unwrap_or(&s.model).to_owned();
    // Counts as running from here, through the latency, until the body ends.
    let mut timer = s.metrics.start_request(arrival.started);
    // The server-wide fault comes before anything the request asks for.
    if let Some(kind) = crate::fault::applies_to(api)
        .then(|| s.faults.hit(|k| !k.on_stream()))
        .flatten()
    {
        if let Some(res) = early_fault(&s, kind, api, &arrival, conn.as_ref()).await {
            return with_model(res, &model);
        }
    }
    let knobs = match arrival.gate(p, Surface::of(api)).await {
        Ok(k) => k,
        Err(res) => return arrival.decorate(res, Some(&model)),
    };
    let mut limited_by = s.limiter.as_ref().map(|l| l.take());
    if let Some(v) = limited_by.as_ref().filter(|v| !v.allowed) {
        let res = limiter_refusal(p, Surface::of(api), v.by_tokens);
        return ratelimit_headers(arrival.decorate(res, Some(&model)), v, p);
    }
    let body = match &arrival.body {
        Ok(b @ Value::Object(_)) => b,
        Ok(_) => {
            let refusal = Refusal::invalid("request body must be a JSON object", None);
            return arrival.decorate(refuse(p, api, refusal), None);
        }
        Err(e) => return arrival.decorate(refuse(p, api, Refusal::invalid(e.clone(), None)), None),
    };

    let Some(api) = api.or_else(|| Api::of_invocation(body)) else {
        return arrival.decorate(
            invalid_request("/invocations: the body is no chat, completion or embedding request"),
            None,
        );
    };
    let prepared = match prepare(&s, api, body, knobs) {
        Ok(prepared) => prepared,
        Err(refusal) => return arrival.decorate(refuse(p, Some(api), refusal), Some(&model)),
    };
    let now = SystemTime::now();
    let g = Generation {
        id: s.next_id.fetch_add(1, Ordering::Relaxed),
        created: now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        created_at: humantime::format_rfc3339_millis(now).to_string(),
        model: &model,
        body,
        input_tokens: prepared.input_tokens,
        output_tokens: prepared.output_tokens,
        finish_reason: if prepared.limited { "length" } else { "stop" },
        usage: knobs.usage,
        stream: api.wants_stream(body),
        include_usage: prepared.report.include_usage,
        prompts: prepared.choices.prompts,
        n: prepared.choices.n,
        best_of: prepared.choices.best_of,
        personality: p,
        details: prepared.details,
        chunk_usage: prepared.report.chunks,
    };
    if api == Api::Responses
        && p.stores_responses()
        && body.get("store").and_then(Value::as_bool) != Some(false)
    {
        s.responses.put(
            openai::response_id(g.id),
            g.input_tokens.saturating_add(g.output_tokens),
        );
    }
    if let (Some(limiter), Some(v)) = (s.limiter.as_ref(), limited_by.as_mut()) {
        limiter.charge(g.input_tokens.saturating_add(g.total_output()), v);
    }
    let reply = match api {
        Api::ChatCompletions => openai::chat_completion(&g),
        Api::Completions => openai::completion(&g),
        Api::Embeddings => openai::embeddings(&g),
        Api::Responses => openai::response(&g),
        Api::OllamaGenerate => ollama::generate(&g),
        Api::OllamaChat => ollama::chat(&g),
        Api::Messages => crate::anthropic::message(&g),
        Api::OllamaEmbed
        | Api::OllamaEmbeddings
        | Api::Score
        | Api::Rerank
        | Api::Pooling
        | Api::Classify
        | Api::Tokenize
        | Api::Detokenize => crate::pooling::answer(api, &g),
    };

    let mut pacing = Pacing {
        chunk_delay: knobs.chunk_delay,
        reset_after: knobs.reset_after_chunks,
        stall_after: None,
    };
    let res = match reply {
        // A JSON answer with the reset knob is one chunk that may be cut.
        Reply::Json(v) if pacing.reset_after.is_some() => (
            [(CONTENT_TYPE, "application/json")],
            paced_body(vec![Bytes::from(v.to_string())], pacing, timer, None),
        )
            .into_response(),
        Reply::Json(v) => {
            timer.finish();
            Json(v).into_response()
        }
        Reply::Stream {
            content_type,
            mut frames,
        } => {
            match s.faults.hit(FaultKind::on_stream) {
                // The reset knob's own path, server-wide.
                Some(FaultKind::StreamCut(n)) => pacing.reset_after = Some(n),
                Some(FaultKind::StreamStall(n)) => pacing.stall_after = Some(n),
                Some(kind) => crate::fault::bend_frames(kind, &mut frames, content_type == SSE),
                None => {}
            }
            let log = Logged::start(&s.streams, frames.len());
            (
                [(CONTENT_TYPE, content_type), (CACHE_CONTROL, "no-cache")],
                paced_body(
                    if content_type == SSE {
                        sse_newlines(frames, knobs.sse_newline)
                    } else {
                        frames
                    },
                    pacing,
                    timer,
                    log,
                ),
            )
                .into_response()
        }
    };
    let res = arrival.decorate(res, Some(&model));
    match &limited_by {
        Some(v) => ratelimit_headers(res, v, p),
        None => res,
    }
}

/// Applies a fault decided before the answer: `Some` is the whole
/// response (an error, or a reset), `None` goes on to answer normally
/// (after `slow_first_token`'s wait). `hang` never returns.
async fn early_fault(
    s: &AppState,
    kind: FaultKind,
    api: Option<Api>,
    arrival: &Arrival,
    conn: Option<&Conn>,
) -> Option<Response> {
    match kind {
        FaultKind::Reset => {
            // Kill the connection so nothing at all is written; in-process
            // (no connection) the body fails before its first byte instead.
            if let Some(conn) = conn {
                conn.kill();
            }
            Some(crate::fault::reset_response(conn.is_some()))
        }
        FaultKind::Hang => {
            // Dropped by the server when the client goes away.
            std::future::pending::<()>().await;
            None
        }
        FaultKind::SlowFirstToken(wait) => {
            tokio::time::sleep(wait).await;
            None
        }
        kind => {
            let cx = ErrorContext {
                personality: s.personality,
                surface: Surface::of(api),
                max_model_len: s.max_model_len,
                input_tokens: arrival.body.as_ref().map(tokens::input_tokens).unwrap_or(0),
            };
            crate::fault::error_response(kind, &cx)
        }
    }
}

/// Adds `x-mock-model` (the model seen) to a fault's response.
fn with_model(mut res: Response, model: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(model) {
        res.headers_mut().insert(X_MOCK_MODEL, v);
    }
    res
}

/// A refusal as the personality sends it on this API's surface. mock-llm's
/// own keeps its historical `invalid_request` code on 400s.
fn refuse(p: Personality, api: Option<Api>, refusal: Refusal) -> Response {
    if p == Personality::Mock && refusal.status == StatusCode::BAD_REQUEST {
        return invalid_request(refusal.message);
    }
    refusal.render(p, Surface::of(api))
}

/// What the request turns into before an answer is written.
struct Prepared {
    input_tokens: u64,
    output_tokens: u64,
    limited: bool,
    choices: crate::personality::Choices,
    report: crate::personality::StreamReport,
    details: crate::usage::Details,
}

/// The personality's checks and counts: the model, the fields it refuses,
/// the stored conversation a Responses request carries, the limit it obeys
/// and how much it generates.
fn prepare(s: &AppState, api: Api, body: &Value, knobs: &Knobs) -> Result<Prepared, Refusal> {
    let p = s.personality;
    if let Some(m) = body.get("model").and_then(Value::as_str) {
        if !s.allowed_models.is_empty() && !s.allowed_models.iter().any(|a| a == m) {
            return Err(p.model_not_found(Some(api), m));
        }
    }
    p.check(api, body)?;
    let mut carried = 0;
    if api == Api::Responses && p.stores_responses() {
        if let Some(id) = body.get("previous_response_id").and_then(Value::as_str) {
            carried = s
                .responses
                .conversation(id)
                .ok_or_else(|| p.previous_response_not_found(id))?;
        }
    }
    let input = tokens::input_tokens(body).saturating_add(carried);
    let limit = p
        .output_limit(api, body)
        .and_then(|n| u64::try_from(n).ok());
    let max = s.max_model_len;
    if p.checks_context(api) {
        // vllm serving.py _validate_input.
        if input >= max {
            return Err(Refusal::invalid(
                format!(
                    "This model's maximum context length is {max} tokens. However, your \
                     request has {input} input tokens. Please reduce the length of the input \
                     messages."
                ),
                Some("input_tokens"),
            ));
        }
        if let Some(l) = limit.filter(|l| input.saturating_add(*l) > max) {
            return Err(Refusal::invalid(
                format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {l}. This model's \
                     maximum context length is {max} tokens and your request has {input} input \
                     tokens ({l} > {max} - {input})."
                ),
                Some("max_tokens"),
            ));
        }
    }
    let allowed = knobs.generate_allowed || s.generate_allowed;
    let ceiling = if p == Personality::Mock && !allowed {
        u64::MAX
    } else {
        max.saturating_sub(input)
    };
    let (output_tokens, limited) = if api.generates() {
        tokens::generate(limit, knobs.output_tokens, allowed, ceiling)
    } else {
        (0, false)
    };
    let mut details = knobs.details;
    details.cached = details.cached.min(input);
    details.cache_write = details.cache_write.min(input - details.cached);
    details.reasoning = details.reasoning.min(output_tokens);
    Ok(Prepared {
        input_tokens: input,
        output_tokens,
        limited,
        choices: p.choices(api, body),
        report: p.stream_usage(api, body),
        details,
    })
}

/// The answer past `--ratelimit-requests`/`--ratelimit-tokens`: OpenAI's
/// and Anthropic's 429; vLLM and Ollama have no request limit of their own
/// and push back with a 503 (Ollama's ErrMaxQueue, server/sched.go).
fn limiter_refusal(p: Personality, surface: Surface, by_tokens: bool) -> Response {
    match p {
        Personality::Mock => error(
            StatusCode::TOO_MANY_REQUESTS,
            "requests",
            "rate_limit_exceeded",
            String::from("mock-llm: request limit of the window reached"),
        ),
        Personality::Openai => {
            let mut r = Refusal::for_status(
                StatusCode::TOO_MANY_REQUESTS,
                if by_tokens {
                    "Rate limit reached for tokens".to_owned()
                } else {
                    injected_message(p, StatusCode::TOO_MANY_REQUESTS)
                },
            );
            r.code = Some("rate_limit_exceeded");
            if by_tokens {
                r.kind = crate::personality::Kind::TokensRateLimited;
            }
            r.render(p, surface)
        }
        Personality::Anthropic => Refusal::for_status(
            StatusCode::TOO_MANY_REQUESTS,
            injected_message(p, StatusCode::TOO_MANY_REQUESTS),
        )
        .render(p, surface),
        Personality::Vllm | Personality::Ollama => Refusal::for_status(
            StatusCode::SERVICE_UNAVAILABLE,
            injected_message(p, StatusCode::SERVICE_UNAVAILABLE),
        )
        .render(p, surface),
    }
}

/// The limiter's state in the server's own headers:
/// * OpenAI (and mock-llm's own): `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`,
///   resets as durations like `6m0s` (OpenAI docs, "Rate limits": headers);
/// * Anthropic: `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`,
///   resets as RFC 3339 times, and `retry-after` seconds on a 429
///   (Anthropic docs, "Rate limits": response headers);
/// * vLLM and Ollama send none.
fn ratelimit_headers(mut res: Response, v: &crate::load::Verdict, p: Personality) -> Response {
    let refused = res.status() == StatusCode::TOO_MANY_REQUESTS;
    let h = res.headers_mut();
    let mut put = |name: String, value: String| {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(name), HeaderValue::from_str(&value)) {
            h.insert(n, v);
        }
    };
    let mut families = vec![("requests", v.limit, v.remaining)];
    if let Some((limit, remaining)) = v.tokens {
        families.push(("tokens", limit, remaining));
    }
    match p {
        Personality::Mock | Personality::Openai => {
            let reset = crate::load::reset_text(v.reset);
            for (family, limit, remaining) in families {
                put(format!("x-ratelimit-limit-{family}"), limit.to_string());
                put(
                    format!("x-ratelimit-remaining-{family}"),
                    remaining.to_string(),
                );
                put(format!("x-ratelimit-reset-{family}"), reset.clone());
            }
        }
        Personality::Anthropic => {
            // Whole seconds as Anthropic writes them, rounded up so the
            // time is never before the real reset.
            let at = SystemTime::now() + v.reset + std::time::Duration::from_millis(999);
            let at = humantime::format_rfc3339_seconds(at).to_string();
            for (family, limit, remaining) in families {
                put(
                    format!("anthropic-ratelimit-{family}-limit"),
                    limit.to_string(),
                );
                put(
                    format!("anthropic-ratelimit-{family}-remaining"),
                    remaining.to_string(),
                );
                put(format!("anthropic-ratelimit-{family}-reset"), at.clone());
            }
            if refused {
                let secs = v.reset.as_millis().div_ceil(1000).max(1);
                put("retry-after".into(), secs.to_string());
            }
        }
        Personality::Vllm | Personality::Ollama => {}
    }
    res
}

/// `GET /v1/models`, `GET /api/ps`: counted and subject to the knobs; a
/// server without the endpoint answers its own 404.
async fn listing(s: Shared, req: Request, answer: Value, served: bool) -> Response {
    let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
    let arrival = match Arrival::read(&s, req, None).await {
        Ok(a) => a,
        Err(res) => return res,
    };
    if !served {
        return s.personality.unknown_path(&method, &path);
    }
    let res = match arrival.gate(s.personality, Surface::OpenAi).await {
        Ok(_) => Json(answer).into_response(),
        Err(res) => res,
    };
    arrival.decorate(res, None)
}

async fn not_found(State(s): State<Shared>, req: Request) -> Response {
    let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
    if let Err(res) = Arrival::read(&s, req, None).await {
        return res;
    }
    s.personality.unknown_path(&method, &path)
}

async fn metrics(State(s): State<Shared>, req: Request) -> Response {
    if !s.personality.serves_metrics() {
        return s
            .personality
            .unknown_path(req.method().as_str(), req.uri().path());
    }
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.render(),
    )
        .into_response()
}

/// `POST /admin/metrics`: sets the gauges named in the body.
async fn set_metrics(State(s): State<Shared>, body: Bytes) -> Response {
    let update: GaugeUpdate = match serde_json::from_slice(&body) {
        Ok(u) => u,
        Err(e) => return invalid_request(format!("/admin/metrics: {e}")),
    };
    if let Err(e) = update.validate() {
        return invalid_request(format!("/admin/metrics: {e}"));
    }
    s.metrics.apply(&update);
    Json(json!({"ok": true})).into_response()
}

async fn stats(State(s): State<Shared>) -> Response {
    match serde_json::to_value(&*lock(&s.stats)) {
        Ok(mut v) => {
            if let (Some(map), Value::Object(load)) = (v.as_object_mut(), s.metrics.load.snapshot())
            {
                map.extend(load);
            }
            if let (Some(map), Ok(streams)) = (
                v.as_object_mut(),
                serde_json::to_value(s.streams.snapshot()),
            ) {
                map.insert("streams".into(), streams);
            }
            Json(v).into_response()
        }
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal",
            e.to_string(),
        ),
    }
}

/// `GET /admin/fault`: the fault in force and its hits so far.
async fn get_fault(State(s): State<Shared>) -> Response {
    Json(s.faults.snapshot()).into_response()
}

/// `PUT /admin/fault`: the body, a spec in plain text, replaces the fault
/// (empty or `none` clears it); a bad spec is a 400 naming the bad part.
async fn put_fault(State(s): State<Shared>, body: Bytes) -> Response {
    let Ok(text) = std::str::from_utf8(&body) else {
        return invalid_request("/admin/fault: the spec is not UTF-8 text");
    };
    match crate::fault::parse(text) {
        Ok(fault) => {
            s.faults.set(fault);
            Json(s.faults.snapshot()).into_response()
        }
        Err(e) => invalid_request(format!("/admin/fault: {e}")),
    }
}

/// `POST /admin/reset`: request counts, last request, gauges and histograms
/// all back to a fresh start.
async fn reset(State(s): State<Shared>) -> Response {
    *lock(&s.stats) = Stats::default();
    s.streams.clear();
    s.metrics.reset();
    s.responses.clear();
    Json(json!({"ok": true})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request as HttpRequest;
    use tower::ServiceExt as _;

    async fn call(
        app: &mut Router,
        req: HttpRequest<Body>,
    ) -> (StatusCode, axum::http::HeaderMap, Bytes) {
        let res = app.clone().oneshot(req).await.unwrap();
        let (parts, body) = res.into_parts();
        (
            parts.status,
            parts.headers,
            axum::body::to_bytes(body, usize::MAX).await.unwrap(),
        )
    }

    fn post_json(path: &str, body: &str) -> HttpRequest<Body> {
        HttpRequest::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    #[tokio::test]
    async fn an_api_key_is_asked_where_and_as_each_server_asks_it() {
        let chat = r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
        let messages =
            r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}"#;
        let cases = [
            (
                Personality::Openai,
                "/v1/chat/completions",
                chat,
                "authorization",
                "Bearer k",
                "invalid_api_key",
            ),
            (
                Personality::Vllm,
                "/v1/chat/completions",
                chat,
                "authorization",
                "Bearer k",
                "Unauthorized",
            ),
            (
                Personality::Anthropic,
                "/v1/messages",
                messages,
                "x-api-key",
                "k",
                "authentication_error",
            ),
        ];
        for (p, path, body, header, value, says) in cases {
            let mut app = app(Config {
                personality: p,
                api_key: Some("k".into()),
                ..Config::default()
            })
            .unwrap();
            let (status, _, text) = call(&mut app, post_json(path, body)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{p:?}");
            assert!(
                String::from_utf8_lossy(&text).contains(says),
                "{p:?}: {text:?}"
            );
            let mut wrong = post_json(path, body);
            wrong
                .headers_mut()
                .insert(header, "Bearer nope".parse().unwrap());
            let (status, _, _) = call(&mut app, wrong).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{p:?}: a wrong key");
            let mut right = post_json(path, body);
            right.headers_mut().insert(header, value.parse().unwrap());
            let (status, _, text) = call(&mut app, right).await;
            assert_eq!(status, StatusCode::OK, "{p:?}: {text:?}");
        }
        // Ollama has no credential: everything passes.
        let mut ollama = app(Config {
            personality: Personality::Ollama,
            api_key: Some("k".into()),
            ..Config::default()
        })
        .unwrap();
        let (status, _, _) = call(&mut ollama, post_json("/api/chat", chat)).await;
        assert_eq!(status, StatusCode::OK);
    }

    fn app_named(name: &str) -> Router {
        app(Config {
            name: name.into(),
            model: "served".into(),
            ..Config::default()
        })
        .unwrap()
    }

    #[tokio::test]
    async fn chat_echoes_model_and_counts_tokens() {
        let mut app = app_named("primary");
        let (status, headers, body) = call(
            &mut app,
            post_json(
                "/v1/chat/completions",
                r#"{"model":"cheap","max_tokens":4,"messages":[{"role":"user","content":"12345678"}]}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-mock-name"], "primary");
        assert_eq!(headers["x-mock-model"], "cheap");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["model"], "cheap");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }

    #[tokio::test]
    async fn invalid_json_is_400_openai_shaped_and_still_counted() {
        let mut app = app_named("p");
        let (status, headers, body) = call(&mut app, post_json("/v1/completions", "{nope")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(headers["x-mock-name"], "p");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let req = HttpRequest::get("/admin/stats")
            .body(Body::empty())
            .unwrap();
        let (_, _, body) = call(&mut app, req).await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["requests_total"], 1);
        assert_eq!(v["by_path"]["/v1/completions"], 1);
        assert_eq!(v["last_request"]["body"], Value::Null);
    }

    #[tokio::test]
    async fn status_knob_from_query_with_retry_after_header() {
        let mut app = app_named("p");
        let req = HttpRequest::post("/v1/chat/completions?x-mock-status=429")
            .header("x-mock-retry-after", "3")
            .body(Body::from(r#"{"model":"m","messages":[]}"#))
            .unwrap();
        let (status, headers, body) = call(&mut app, req).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers["retry-after"], "3");
        assert_eq!(headers["x-mock-model"], "m");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    }

    #[tokio::test]
    async fn ollama_streams_by_default() {
        let mut app = app_named("p");
        let (status, headers, body) = call(
            &mut app,
            post_json("/api/generate", r#"{"model":"llama3","prompt":"hi"}"#),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["content-type"], "application/x-ndjson");
        let last: Value = serde_json::from_slice(
            body.split(|b| *b == b'\n')
                .rfind(|l| !l.is_empty())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(last["done"], true);
        assert_eq!(last["eval_count"], 16);
        assert_eq!(last["prompt_eval_count"], 1);
    }

    /// Ollama reads keys as Go does: `MODEL` and `Stream` are its model
    /// and stream flag (the last spelling wins); the stats keep the body
    /// as sent.
    #[tokio::test]
    async fn ollama_reads_keys_without_case_like_go() {
        let mut app = app(Config {
            name: "p".into(),
            model: "served".into(),
            personality: Personality::Ollama,
            ..Config::default()
        })
        .unwrap();
        let body = r#"{"model":"small","stream":false,"MODEL":"big","Stream":true,
            "options":{"NUM_PREDICT":2,"num_predict":3}}"#;
        let (status, headers, body) = call(&mut app, post_json("/api/chat", body)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-mock-model"], "big");
        assert_eq!(headers["content-type"], "application/x-ndjson");
        let lines: Vec<&[u8]> = body
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        let last: Value = serde_json::from_slice(lines[lines.len() - 1]).unwrap();
        assert_eq!(last["eval_count"], 3, "options keys are read exactly");
        let req = HttpRequest::get("/admin/stats")
            .body(Body::empty())
            .unwrap();
        let (_, _, stats) = call(&mut app, req).await;
        let v: Value = serde_json::from_slice(&stats).unwrap();
        assert_eq!(v["last_request"]["body"]["MODEL"], "big");
        // Mock's own reads keys exactly.
        let mut app = app_named("p");
        let body = r#"{"model":"small","stream":false,"MODEL":"big"}"#;
        let (_, headers, _) = call(&mut app, post_json("/api/chat", body)).await;
        assert_eq!(headers["x-mock-model"], "small");
        assert_eq!(headers["content-type"], "application/json");
    }

    #[tokio::test]
    async fn admin_metrics_sets_gauges_and_reset_clears_everything() {
        let mut app = app_named("p");
        let (status, _, _) = call(
            &mut app,
            post_json(
                "/admin/metrics",
                r#"{"num_requests_waiting": 12, "kv_cache_usage_perc": 0.95}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, _) = call(&mut app, post_json("/admin/metrics", r#"{"bogus": 1}"#)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        call(
            &mut app,
            post_json("/v1/embeddings", r#"{"input":["a","b"]}"#),
        )
        .await;
        let get = || HttpRequest::get("/metrics").body(Body::empty()).unwrap();
        let (_, _, text) = call(&mut app, get()).await;
        let text = String::from_utf8_lossy(&text).into_owned();
        assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"served\"} 12.0"));
        assert!(text.contains(
            "vllm:e2e_request_latency_seconds_count{engine=\"0\",model_name=\"served\"} 1.0"
        ));
        call(&mut app, post_json("/admin/reset", "")).await;
        let (_, _, text) = call(&mut app, get()).await;
        let text = String::from_utf8_lossy(&text).into_owned();
        assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"served\"} 0.0"));
        let req = HttpRequest::get("/admin/stats")
            .body(Body::empty())
            .unwrap();
        let (_, _, body) = call(&mut app, req).await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["requests_total"], 0);
    }

    #[tokio::test]
    async fn prompt_arrays_answer_every_prompt_times_n_with_usage_summed() {
        let mut app = app_named("p");
        let (status, _, body) = call(
            &mut app,
            post_json(
                "/v1/completions",
                r#"{"model":"m","prompt":["abcd","efgh","ijkl"],"n":2,"max_tokens":5}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["choices"].as_array().unwrap().len(), 6);
        assert_eq!(v["usage"]["completion_tokens"], 30);
        assert_eq!(v["usage"]["prompt_tokens"], 3);
        let (_, _, body) = call(
            &mut app,
            post_json(
                "/v1/completions",
                r#"{"model":"m","prompt":[[1,2],[3]],"max_tokens":4}"#,
            ),
        )
        .await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 8);
    }

    #[tokio::test]
    async fn invocations_dispatch_by_shape_and_new_endpoints_answer() {
        let mut app = app_named("p");
        let (status, _, body) = call(
            &mut app,
            post_json(
                "/invocations",
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        let (status, _, _) = call(&mut app, post_json("/invocations", r#"{"model":"m"}"#)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (_, _, body) = call(
            &mut app,
            post_json(
                "/v1/messages",
                r#"{"model":"m","max_tokens":2,"messages":[]}"#,
            ),
        )
        .await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["usage"]["output_tokens"], 2);
        let (_, _, body) = call(
            &mut app,
            post_json(
                "/v1/score",
                r#"{"model":"m","text_1":"abcd","text_2":["ab","cd"]}"#,
            ),
        )
        .await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["data"].as_array().unwrap().len(), 2);
        assert_eq!(v["usage"]["prompt_tokens"], 3, "abcd twice + ab + cd");
        let (_, _, body) = call(
            &mut app,
            post_json("/api/embed", r#"{"model":"m","input":["a","b"]}"#),
        )
        .await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["embeddings"].as_array().unwrap().len(), 2);
        assert_eq!(v["prompt_eval_count"], 1);
    }

    #[tokio::test]
    async fn unknown_path_is_counted_404() {
        let mut app = app_named("p");
        let req = HttpRequest::get("/nope").body(Body::empty()).unwrap();
        let (status, headers, _) = call(&mut app, req).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(headers["x-mock-name"], "p");
    }

    #[test]
    fn bad_name_is_refused() {
        assert!(app(Config {
            name: "bad\nname".into(),
            ..Config::default()
        })
        .is_err());
    }
}
