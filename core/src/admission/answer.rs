//! OpenAI-shaped refusals that SDKs parse and back off from, and the `X-RateLimit-*`
//! headers of admitted requests (docs/src/design.md, "What the client sees").

use serde_json::json;

use crate::limits::bucket::Quota;

/// What became of a request, as metrics and the audit log say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Went upstream (a downshift is an admission too).
    Admit,
    Refuse(Reason),
    /// Answered here instead of upstream, not refused.
    Degrade(Degraded),
}

impl Decision {
    /// The `decision` label.
    pub fn code(self) -> &'static str {
        match self {
            Decision::Admit => "admit",
            Decision::Refuse(_) => "refuse",
            Decision::Degrade(_) => "degrade",
        }
    }

    /// The `reason` label: `none` for an admission.
    pub fn reason_code(self) -> &'static str {
        match self {
            Decision::Admit => "none",
            Decision::Refuse(reason) => reason.code(),
            Decision::Degrade(kind) => kind.code(),
        }
    }
}

/// How a request was served other than as asked (`x-sluice-degraded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Degraded {
    /// Over a soft cap: sent to the model's cheaper model.
    Downshift,
    /// Answered from the static table.
    Static,
}

impl Degraded {
    pub fn code(self) -> &'static str {
        match self {
            Degraded::Downshift => "downshift",
            Degraded::Static => "static",
        }
    }
}

/// Why a request was refused; `code()` is the `x-sluice-reason` value and
/// (but for `body_code`'s exceptions) the `error.code` of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    UserRateLimit,
    ModelRateLimit,
    RouteRateLimit,
    TokenRateLimit,
    DailyBudgetExceeded,
    MonthlyBudgetExceeded,
    SpendCapExceeded,
    /// A tier's `anonymous_total`: all undeclared callers together.
    AnonymousLimit,
    /// No per-caller slot is free for a caller without a declared key.
    CapacityExhausted,
    /// A team's rate (requests or tokens), all its members together.
    TeamRateLimit,
    /// A team's daily/monthly token or spend budget.
    TeamBudgetExceeded,
    OrgRateLimit,
    OrgBudgetExceeded,
    /// In the penalty box (`abuse`) until the block ends.
    TemporarilyBlocked,
    GpuOverloaded,
    UpstreamUnhealthy,
    UpstreamPaused,
    GlobalBreakerOpen,
    RequestTooLarge,
    InvalidRequest,
    Unauthenticated,
    /// Every concurrency slot of the model (or its backend) is taken and
    /// the caller's class does not wait.
    ModelConcurrency,
    /// The caller's class queue for the model is at `max_depth`.
    QueueFull,
    /// Waited `max_wait` without a slot.
    QueueDeadline,
    /// A request with a body (or a POST) to a path sluice does not
    /// classify and no `passthrough` rule opens: deny by default.
    UnknownEndpoint,
    /// The request's input does not fit the model's `context_length` and
    /// the policy names no model to overflow to (OpenAI's code for it).
    ContextLengthExceeded,
    /// Any method but `GET` at the caller's limits path.
    MethodNotAllowed,
    /// The run's own budget (`runs`) is spent.
    RunBudgetExceeded,
    /// Every run slot the caller may use holds a live run (`runs`).
    RunLimit,
    /// The same body from the same caller too often (`loop_guard`).
    LoopDetected,
}

impl Reason {
    pub fn code(self) -> &'static str {
        match self {
            Reason::UserRateLimit => "user_rate_limit",
            Reason::ModelRateLimit => "model_rate_limit",
            Reason::RouteRateLimit => "route_rate_limit",
            Reason::TokenRateLimit => "token_rate_limit",
            Reason::DailyBudgetExceeded => "daily_budget_exceeded",
            Reason::MonthlyBudgetExceeded => "monthly_budget_exceeded",
            Reason::SpendCapExceeded => "spend_cap_exceeded",
            Reason::AnonymousLimit => "anonymous_limit",
            Reason::CapacityExhausted => "capacity_exhausted",
            Reason::TeamRateLimit => "team_rate_limit",
            Reason::TeamBudgetExceeded => "team_budget_exceeded",
            Reason::OrgRateLimit => "org_rate_limit",
            Reason::OrgBudgetExceeded => "org_budget_exceeded",
            Reason::TemporarilyBlocked => "temporarily_blocked",
            Reason::GpuOverloaded => "gpu_overloaded",
            Reason::UpstreamUnhealthy => "upstream_unhealthy",
            Reason::UpstreamPaused => "upstream_paused",
            Reason::GlobalBreakerOpen => "global_breaker_open",
            Reason::RequestTooLarge => "request_too_large",
            Reason::InvalidRequest => "invalid_request",
            Reason::Unauthenticated => "unauthenticated",
            Reason::ModelConcurrency => "model_concurrency",
            Reason::QueueFull => "queue_full",
            Reason::QueueDeadline => "queue_deadline",
            Reason::UnknownEndpoint => "unknown_endpoint",
            Reason::ContextLengthExceeded => "context_length_exceeded",
            Reason::MethodNotAllowed => "method_not_allowed",
            Reason::RunBudgetExceeded => "run_budget_exceeded",
            Reason::RunLimit => "run_limit",
            Reason::LoopDetected => "loop_detected",
        }
    }

    /// `error.code` of the body: the `x-sluice-reason` code, except where
    /// SDKs know OpenAI's own (a 401 is `invalid_api_key` there).
    fn body_code(self) -> &'static str {
        match self {
            Reason::Unauthenticated => "invalid_api_key",
            other => other.code(),
        }
    }

    fn status(self) -> u32 {
        match self {
            Reason::UserRateLimit
            | Reason::ModelRateLimit
            | Reason::RouteRateLimit
            | Reason::TokenRateLimit
            | Reason::DailyBudgetExceeded
            | Reason::MonthlyBudgetExceeded
            | Reason::SpendCapExceeded
            | Reason::AnonymousLimit
            | Reason::CapacityExhausted
            | Reason::ModelConcurrency
            | Reason::QueueFull
            | Reason::QueueDeadline
            | Reason::TeamRateLimit
            | Reason::TeamBudgetExceeded
            | Reason::OrgRateLimit
            | Reason::OrgBudgetExceeded
            | Reason::RunBudgetExceeded
            | Reason::RunLimit
            | Reason::LoopDetected
            | Reason::TemporarilyBlocked => 429,
            Reason::GpuOverloaded
            | Reason::UpstreamUnhealthy
            | Reason::UpstreamPaused
            | Reason::GlobalBreakerOpen => 503,
            Reason::RequestTooLarge => 413,
            Reason::InvalidRequest | Reason::ContextLengthExceeded => 400,
            Reason::Unauthenticated => 401,
            Reason::UnknownEndpoint => 404,
            Reason::MethodNotAllowed => 405,
        }
    }

    fn error_type(self) -> &'static str {
        match self {
            Reason::UserRateLimit
            | Reason::ModelRateLimit
            | Reason::RouteRateLimit
            | Reason::TokenRateLimit
            | Reason::AnonymousLimit
            | Reason::CapacityExhausted
            | Reason::ModelConcurrency
            | Reason::QueueFull
            | Reason::QueueDeadline
            | Reason::TeamRateLimit
            | Reason::OrgRateLimit
            | Reason::RunLimit
            | Reason::LoopDetected
            | Reason::TemporarilyBlocked => "rate_limit_exceeded",
            // OpenAI's type for an exhausted plan (the SDKs retry any 429
            // whatever its type: `x-should-retry` is what stops them).
            Reason::DailyBudgetExceeded
            | Reason::MonthlyBudgetExceeded
            | Reason::SpendCapExceeded
            | Reason::TeamBudgetExceeded
            | Reason::OrgBudgetExceeded
            | Reason::RunBudgetExceeded => "insufficient_quota",
            // OpenAI answers a bad key with this type, code invalid_api_key.
            Reason::RequestTooLarge
            | Reason::InvalidRequest
            | Reason::Unauthenticated
            | Reason::UnknownEndpoint
            | Reason::MethodNotAllowed
            | Reason::ContextLengthExceeded => "invalid_request_error",
            Reason::GpuOverloaded
            | Reason::UpstreamUnhealthy
            | Reason::UpstreamPaused
            | Reason::GlobalBreakerOpen => "service_unavailable",
        }
    }
}

/// A refusal as it is decided: its reason and what its answer says, built
/// once where the decision is made and rendered once ([`Refused::render`]),
/// so the reason is given once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// 400, 401, 404, 413: a request sluice does not take; `param` names
    /// the offending field.
    Rejected {
        reason: Reason,
        message: String,
        param: Option<String>,
    },
    /// "Not now": a sentence and `Retry-After` (the gate and its queue).
    RetryLater {
        reason: Reason,
        message: String,
        retry_after_s: u64,
    },
    /// 503: the backend cannot take the request now, and why.
    Unavailable {
        reason: Reason,
        why: String,
        retry_after_s: u64,
    },
    /// 429 of a bucket that does not fit.
    Bucket(BucketRefusal),
    /// 429 `capacity_exhausted`: no per-caller slot of `bucket` is free.
    CapacityExhausted {
        retry_after_ms: u64,
        tier: String,
        bucket: String,
        /// The bucket's rule id (`tier/free/requests`).
        rule: String,
        now_ms: u64,
    },
    /// 429 `temporarily_blocked`: the caller is in the penalty box.
    TemporarilyBlocked { retry_after_ms: u64, now_ms: u64 },
}

/// A bucket's 429 (what [`Limited`] says), owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketRefusal {
    pub reason: Reason,
    pub quota: Quota,
    pub retry_after_ms: u64,
    pub tier: String,
    /// Human name of the bucket, e.g. `tier free: requests`.
    pub bucket: String,
    /// Its rule id, e.g. `team/search/requests`.
    pub rule: String,
    /// The limit as written, e.g. `10/min`.
    pub limit_text: String,
    pub now_ms: u64,
    /// Its IETF `RateLimit-Policy` item when the policy turns them on
    /// (`request.rate_limit_headers.ietf`).
    pub ietf: Option<IetfPolicy>,
    /// The status of its answer: 429, or the budget's `refuse_with`
    /// (402, 403: see [`limited`]).
    pub status: u32,
}

impl Refused {
    pub fn rejected(reason: Reason, message: impl Into<String>, param: Option<&str>) -> Refused {
        Refused::Rejected {
            reason,
            message: message.into(),
            param: param.map(str::to_string),
        }
    }

    pub fn retry_later(reason: Reason, message: impl Into<String>, retry_after_s: u64) -> Refused {
        Refused::RetryLater {
            reason,
            message: message.into(),
            retry_after_s,
        }
    }

    pub fn unavailable(reason: Reason, why: impl Into<String>, retry_after_s: u64) -> Refused {
        Refused::Unavailable {
            reason,
            why: why.into(),
            retry_after_s,
        }
    }

    pub fn reason(&self) -> Reason {
        match self {
            Refused::Rejected { reason, .. }
            | Refused::RetryLater { reason, .. }
            | Refused::Unavailable { reason, .. } => *reason,
            Refused::Bucket(b) => b.reason,
            Refused::CapacityExhausted { .. } => Reason::CapacityExhausted,
            Refused::TemporarilyBlocked { .. } => Reason::TemporarilyBlocked,
        }
    }

    /// The rule id of the bucket that refused, for a bucket's refusal.
    pub fn rule(&self) -> Option<&str> {
        match self {
            Refused::Bucket(b) => Some(&b.rule),
            Refused::CapacityExhausted { rule, .. } => Some(rule),
            _ => None,
        }
    }

    /// The HTTP status its answer has.
    pub fn status(&self) -> u32 {
        match self {
            Refused::Bucket(b) => b.status,
            _ => self.reason().status(),
        }
    }

    /// The `Retry-After` its answer says, in milliseconds (whole seconds);
    /// none for a rejection, which no wait changes.
    pub fn retry_after_ms(&self) -> Option<u64> {
        let secs = match self {
            Refused::Rejected { .. } => return None,
            // A budget that refuses with 402/403 says no wait.
            Refused::Bucket(b) if b.status != 429 => return None,
            Refused::RetryLater { retry_after_s, .. }
            | Refused::Unavailable { retry_after_s, .. } => *retry_after_s,
            Refused::Bucket(BucketRefusal { retry_after_ms, .. })
            | Refused::CapacityExhausted { retry_after_ms, .. }
            | Refused::TemporarilyBlocked { retry_after_ms, .. } => {
                ceil_secs(*retry_after_ms).max(1)
            }
        };
        Some(secs.saturating_mul(1000))
    }

    /// The answer the client gets.
    pub fn render(&self) -> Reply {
        match self {
            Refused::Rejected {
                reason,
                message,
                param,
            } => rejected(*reason, message, param.as_deref()),
            Refused::RetryLater {
                reason,
                message,
                retry_after_s,
            } => retry_later(*reason, message, *retry_after_s),
            Refused::Unavailable {
                reason,
                why,
                retry_after_s,
            } => unavailable(*reason, why, *retry_after_s),
            Refused::Bucket(b) => limited(
                &Limited {
                    reason: b.reason,
                    quota: b.quota,
                    retry_after_ms: b.retry_after_ms,
                    tier: &b.tier,
                    bucket: &b.bucket,
                    rule: &b.rule,
                    limit_text: &b.limit_text,
                    ietf: b.ietf,
                    status: b.status,
                },
                b.now_ms,
            ),
            Refused::CapacityExhausted {
                retry_after_ms,
                tier,
                bucket,
                now_ms,
                ..
            } => capacity_exhausted(*retry_after_ms, tier, bucket, *now_ms),
            Refused::TemporarilyBlocked {
                retry_after_ms,
                now_ms,
            } => temporarily_blocked(*retry_after_ms, *now_ms),
        }
    }
}

/// A local reply: status, headers and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Details of a refusal by a bucket.
#[derive(Debug, Clone)]
pub struct Limited<'a> {
    pub reason: Reason,
    pub quota: Quota,
    pub retry_after_ms: u64,
    pub tier: &'a str,
    /// Human name of the bucket, e.g. `tier free: requests`.
    pub bucket: &'a str,
    /// Its rule id, e.g. `team/search/requests`: the body's `bucket`.
    pub rule: &'a str,
    /// The limit as written, e.g. `10/min`.
    pub limit_text: &'a str,
    /// Its IETF `RateLimit-Policy` item, when the policy turns them on.
    pub ietf: Option<IetfPolicy>,
    /// 429, or a budget's `refuse_with` (402, 403).
    pub status: u32,
}

/// The longest `Retry-After` the OpenAI SDKs wait out before retrying.
const SDK_MAX_RETRY_WAIT_S: u64 = 60;

/// A bucket's refusal: 429 with `Retry-After` (the wait until the request
/// fits: a rate bucket refilling is worth waiting for), or, for a budget
/// that says `refuse_with: 402` or `403`, that status with
/// `x-should-retry: false` and no `Retry-After` (the caller is told not
/// to retry; when the budget comes back is in the body's `reset_at` and
/// `X-RateLimit-Reset`).
///
/// What stops clients: the OpenAI and Anthropic SDKs (both generated,
/// `_base_client.py` `_should_retry` in openai-python and
/// anthropic-sdk-python) obey `x-should-retry: true|false` before any
/// status, and otherwise retry 408, 409, 429 and 5xx (Anthropic's also
/// 424), twice by default, waiting a `Retry-After` of up to 60 s (newer
/// openai-python: up to 120 s, and no retry past it); LiteLLM's own
/// `_should_retry` reads the status alone (408, 409, 429, 5xx), so the
/// 402/403 is what stops it.
pub fn limited(l: &Limited, now_ms: u64) -> Reply {
    let retry_after = ceil_secs(l.retry_after_ms).max(1);
    let final_answer = l.status != 429;
    let message = match final_answer {
        false => format!(
            "Rate limit reached for {} ({}). Try again in {} s.",
            l.bucket, l.limit_text, retry_after
        ),
        true => format!(
            "Budget spent: {} ({}). It comes back in {} s; retrying sooner will not help.",
            l.bucket, l.limit_text, retry_after
        ),
    };
    let body = json!({"error": {
        "message": message,
        "type": l.reason.error_type(),
        "code": l.reason.body_code(),
        "param": null,
        "sluice": {
            "limit": l.quota.limit,
            "remaining": l.quota.remaining,
            "reset_at": rfc3339(now_ms.saturating_add(retry_after.saturating_mul(1000))),
            "retry_after_seconds": retry_after,
            "tier": l.tier,
            "bucket": l.rule,
        }
    }});
    let mut headers = Vec::with_capacity(6);
    if !final_answer {
        headers.push(("retry-after".to_string(), retry_after.to_string()));
    }
    for (name, n) in rate_limit_headers(&l.quota, REQUEST_LIMIT_NAMES) {
        headers.push((name.to_string(), n.to_string()));
    }
    if let Some(item) = l.ietf {
        // The effective window of a refusal is the wait: the draft wants
        // `Retry-After` no earlier than its end.
        headers.extend(ietf_headers(l.rule, item, &l.quota, retry_after));
    }
    if final_answer || retry_after > SDK_MAX_RETRY_WAIT_S {
        // Past the SDKs' longest wait they would retry at once, into the
        // same refusal.
        headers.push(("x-should-retry".into(), "false".into()));
    }
    let mut reply = reply(l.reason, headers, &body);
    reply.status = l.status;
    reply
}

/// 429 `capacity_exhausted`: every per-caller slot this caller could use
/// is held by another active caller. Says so plainly, and when one frees.
pub fn capacity_exhausted(retry_after_ms: u64, tier: &str, bucket: &str, now_ms: u64) -> Reply {
    let reason = Reason::CapacityExhausted;
    let retry_after = ceil_secs(retry_after_ms).max(1);
    let message = format!(
        "sluice is tracking as many callers as it can for {bucket}; \
         none of its slots is free for you. Try again in {retry_after} s, \
         or call with an API key declared in the policy."
    );
    let body = json!({"error": {
        "message": message,
        "type": reason.error_type(),
        "code": reason.code(),
        "param": null,
        "sluice": {
            "reset_at": rfc3339(now_ms.saturating_add(retry_after.saturating_mul(1000))),
            "retry_after_seconds": retry_after,
            "tier": tier,
            "bucket": bucket,
        }
    }});
    reply(
        reason,
        vec![("retry-after".into(), retry_after.to_string())],
        &body,
    )
}

/// 429 `temporarily_blocked`: the caller is in the penalty box until
/// `retry_after_ms` from now.
pub fn temporarily_blocked(retry_after_ms: u64, now_ms: u64) -> Reply {
    let reason = Reason::TemporarilyBlocked;
    let retry_after = ceil_secs(retry_after_ms).max(1);
    let message =
        format!("Too many requests from this caller: blocked for the next {retry_after} s.");
    let body = json!({"error": {
        "message": message,
        "type": reason.error_type(),
        "code": reason.code(),
        "param": null,
        "sluice": {
            "reset_at": rfc3339(now_ms.saturating_add(retry_after.saturating_mul(1000))),
            "retry_after_seconds": retry_after,
        }
    }});
    let mut headers = vec![("retry-after".to_string(), retry_after.to_string())];
    if retry_after > SDK_MAX_RETRY_WAIT_S {
        headers.push(("x-should-retry".into(), "false".into()));
    }
    reply(reason, headers, &body)
}

/// A refusal that is not about a bucket (400, 401, 413).
pub fn rejected(reason: Reason, message: &str, param: Option<&str>) -> Reply {
    let body = json!({"error": {
        "message": message,
        "type": reason.error_type(),
        "code": reason.body_code(),
        "param": param,
    }});
    reply(reason, Vec::new(), &body)
}

fn reply(reason: Reason, mut headers: Vec<(String, String)>, body: &serde_json::Value) -> Reply {
    headers.push(("content-type".into(), "application/json".into()));
    headers.push(("x-sluice-reason".into(), reason.code().into()));
    Reply {
        status: reason.status(),
        headers,
        body: body.to_string().into_bytes(),
    }
}

/// An answer that only says "not now": the reason, a sentence and
/// `Retry-After` — the concurrency gate and its queue (429
/// `model_concurrency`, `queue_full`, `queue_deadline`) and the 503s of a
/// backend that cannot take the request ([`unavailable`]).
pub fn retry_later(reason: Reason, message: &str, retry_after_s: u64) -> Reply {
    let body = json!({"error": {
        "message": message,
        "type": reason.error_type(),
        "code": reason.body_code(),
        "param": null,
        "sluice": {"retry_after_seconds": retry_after_s},
    }});
    reply(
        reason,
        vec![("retry-after".into(), retry_after_s.to_string())],
        &body,
    )
}

/// 503: the backend cannot take the request now.
pub fn unavailable(reason: Reason, why: &str, retry_after_s: u64) -> Reply {
    retry_later(
        reason,
        &format!(
            "The model is not taking requests right now ({why}). Try again in {retry_after_s} s."
        ),
        retry_after_s,
    )
}

/// A canned answer in the shape of the API asked (`x-sluice-degraded:
/// static`), so clients parse it like any completion.
pub fn static_answer(
    api: crate::usage::demand::Api,
    model: &str,
    text: &str,
    stream: bool,
    now_ms: u64,
) -> Reply {
    use crate::usage::demand::Api;
    let created = now_ms / 1000;
    let id = format!("sluice-static-{now_ms}");
    let usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
    let (content_type, body) = match (api, stream) {
        (Api::OpenAiChat, false) => ("application/json", json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop", "logprobs": null}],
            "usage": usage,
        }).to_string()),
        (Api::OpenAiChat, true) => {
            let chunk = |delta: serde_json::Value, finish: serde_json::Value| json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
            });
            ("text/event-stream", format!(
                "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                chunk(json!({"role": "assistant", "content": text}), serde_json::Value::Null),
                chunk(json!({}), json!("stop")),
            ))
        }
        (Api::OpenAiCompletions, false) => ("application/json", json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
            "usage": usage,
        }).to_string()),
        (Api::OpenAiCompletions, true) => ("text/event-stream", format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}]}),
        )),
        (Api::OpenAiResponses, _) => ("application/json", json!({
            "id": id, "object": "response", "created_at": created, "model": model, "status": "completed",
            "output": [{"type": "message", "id": format!("msg-{id}"), "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
        }).to_string()),
        (Api::OllamaChat, _) => ("application/x-ndjson", format!("{}\n", json!({
            "model": model, "created_at": rfc3339(now_ms), "message": {"role": "assistant", "content": text},
            "done": true, "done_reason": "stop",
        }))),
        (Api::OllamaGenerate, _) => ("application/x-ndjson", format!("{}\n", json!({
            "model": model, "created_at": rfc3339(now_ms), "response": text, "done": true, "done_reason": "stop",
        }))),
        (Api::AnthropicMessages, false) => ("application/json", json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }).to_string()),
        (
            Api::OpenAiEmbeddings
            | Api::OllamaEmbed
            | Api::Scoring
            | Api::AnthropicMessages
            | Api::Invocations
            | Api::Passthrough(_)
            | Api::Declared(_)
            | Api::Other,
            _,
        ) => {
            return unavailable(Reason::UpstreamUnhealthy, "no upstream can serve it", 30);
        }
    };
    Reply {
        status: 200,
        headers: vec![
            ("content-type".into(), content_type.into()),
            ("x-sluice-degraded".into(), "static".into()),
        ],
        body: body.into_bytes(),
    }
}

/// The static answer of a declared API: the text where the service's
/// answers hold theirs (`answer.text`); without one, no shape is known and
/// the request gets the 503 any API without a static shape gets.
pub fn declared_static(declared: &crate::usage::declared::Declared, text: &str) -> Reply {
    let Some(body) = declared.answer.static_body(text) else {
        return unavailable(Reason::UpstreamUnhealthy, "no upstream can serve it", 30);
    };
    Reply {
        status: 200,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("x-sluice-degraded".into(), "static".into()),
        ],
        body,
    }
}

/// The `X-RateLimit-*` names of a request bucket.
pub const REQUEST_LIMIT_NAMES: [&str; 3] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];
/// The `X-RateLimit-*-Tokens` names of a token bucket (OpenAI's).
pub const TOKEN_LIMIT_NAMES: [&str; 3] = [
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
];

/// `X-RateLimit-*` of one bucket under `names` (limit, remaining,
/// reset), each with its number; `Reset` is seconds until it is full. On
/// every admitted request: the caller writes the numbers where they go,
/// digit by digit, not through the formatter.
pub fn rate_limit_headers(q: &Quota, names: [&'static str; 3]) -> [(&'static str, u64); 3] {
    let [limit, remaining, reset] = names;
    [
        (limit, q.limit),
        (remaining, q.remaining),
        (reset, ceil_secs(q.reset_ms)),
    ]
}

/// Appends `n` in decimal (see [`crate::host::decimal`]).
pub fn push_decimal(out: &mut String, n: u64) {
    let mut digits = [0u8; 20];
    out.push_str(crate::host::decimal(n, &mut digits));
}

/// What the IETF `RateLimit-Policy` item of a bucket says beyond its
/// name and quota (draft-ietf-httpapi-ratelimit-headers-11, §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IetfPolicy {
    /// `w`: seconds the whole quota takes to come back (a token bucket's
    /// refill from empty, a calendar budget's window).
    pub window_s: u64,
    /// sluice's unit when the bucket does not count requests (the draft's
    /// default unit, and the only one of its registry sluice meters), as
    /// the vendor parameter `sluice-unit`.
    pub unit: Option<&'static str>,
}

impl IetfPolicy {
    /// The item of a bucket with `limit`, counting `unit` (`None`: requests).
    pub fn of(limit: &crate::policy::limit::Limit, unit: Option<&'static str>) -> IetfPolicy {
        let window_ms = match limit.window {
            Some(_) => limit.rate.period_ms,
            None => {
                let ms = u128::from(limit.burst) * u128::from(limit.rate.period_ms)
                    / u128::from(limit.rate.amount.max(1));
                u64::try_from(ms).unwrap_or(u64::MAX)
            }
        };
        IetfPolicy {
            window_s: ceil_secs(window_ms).max(1),
            unit,
        }
    }
}

/// The largest sf-integer (RFC 9651 §3.3.1: at most 15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// `RateLimit-Policy` and `RateLimit` of one bucket, named by its rule id
/// (bounded by the policy; never the caller, and no `pk`, which would be
/// one): `"tier/free/requests";q=10;w=60` and
/// `"tier/free/requests";r=9;t=6`, `t` in seconds.
pub fn ietf_headers(rule: &str, item: IetfPolicy, q: &Quota, t_s: u64) -> Vec<(String, String)> {
    let name = sf_string(rule);
    let int = |n: u64| n.min(SF_INTEGER_MAX);
    let mut policy = format!("{name};q={};w={}", int(q.limit), int(item.window_s.max(1)));
    if let Some(unit) = item.unit {
        policy.push_str(";sluice-unit=");
        policy.push_str(&sf_string(unit));
    }
    vec![
        ("ratelimit-policy".into(), policy),
        (
            "ratelimit".into(),
            format!("{name};r={};t={}", int(q.remaining), int(t_s)),
        ),
    ]
}

/// `text` as an sf-string (RFC 9651 §3.3.3): quoted, `"` and `\`
/// escaped. An sf-string holds printable ASCII only, so any other byte
/// (a non-ASCII or control character of a name) is written `%XX`, as
/// RFC 9651's display strings do: nothing can end the field or the item.
pub fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for &b in text.as_bytes() {
        match b {
            b'"' | b'\\' => {
                out.push('\\');
                out.push(char::from(b));
            }
            0x20..=0x7e => out.push(char::from(b)),
            _ => out.push_str(&format!("%{b:02x}")),
        }
    }
    out.push('"');
    out
}

fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// Milliseconds since the epoch as `2026-11-30T00:00:00Z` (whole seconds,
/// UTC). A time past jiff's range (late 9999) is written as its last instant.
pub fn rfc3339(ms: u64) -> String {
    let ts = i64::try_from(ms / 1000)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .unwrap_or(jiff::Timestamp::MAX);
    ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// `text` cut to at most `max` bytes, at a character boundary.
pub fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    #[test]
    fn decimal_writes_what_to_string_writes() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            12_345,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ] {
            let mut out = String::from("x");
            super::push_decimal(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    use super::*;

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_996_800_000), "2026-11-30T00:00:00Z");
        assert_eq!(rfc3339(951_782_400_000 + 3_661_000), "2000-02-29T01:01:01Z");
        assert_eq!(rfc3339(u64::MAX), "9999-12-30T22:00:00Z");
    }

    #[test]
    fn a_429_carries_the_whole_contract() {
        let quota = Quota {
            limit: 10,
            remaining: 0,
            reset_ms: 60_000,
        };
        let l = Limited {
            reason: Reason::UserRateLimit,
            quota,
            retry_after_ms: 5_500,
            tier: "free",
            bucket: "tier free: requests",
            rule: "tier/free/requests",
            limit_text: "10/min",
            ietf: None,
            status: 429,
        };
        let r = limited(&l, 1_795_996_800_000);
        assert_eq!(r.header("RateLimit"), None, "off unless the policy says");
        assert_eq!(r.header("RateLimit-Policy"), None);
        assert_eq!(r.status, 429);
        assert_eq!(r.header("Retry-After"), Some("6"));
        assert_eq!(r.header("X-RateLimit-Limit"), Some("10"));
        assert_eq!(r.header("X-RateLimit-Remaining"), Some("0"));
        assert_eq!(r.header("X-RateLimit-Reset"), Some("60"));
        assert_eq!(r.header("x-sluice-reason"), Some("user_rate_limit"));
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["error"]["type"], "rate_limit_exceeded");
        assert_eq!(body["error"]["code"], "user_rate_limit");
        assert_eq!(body["error"]["param"], serde_json::Value::Null);
        assert_eq!(body["error"]["sluice"]["retry_after_seconds"], 6);
        assert_eq!(body["error"]["sluice"]["reset_at"], "2026-11-30T00:00:06Z");
        assert_eq!(body["error"]["sluice"]["tier"], "free");
        assert_eq!(
            r.header("x-should-retry"),
            None,
            "the SDKs wait 6 s and retry"
        );
        let daily = Limited {
            reason: Reason::DailyBudgetExceeded,
            retry_after_ms: 3_600_000,
            ..l
        };
        let r = limited(&daily, 1_795_996_800_000);
        assert_eq!(
            r.header("x-should-retry"),
            Some("false"),
            "an hour: no retry"
        );
    }

    /// A bucket's 429 with the IETF fields on: `r` is `X-RateLimit-Remaining`,
    /// `t` is `Retry-After` (never earlier than it, as the draft asks).
    #[test]
    fn a_429_carries_the_ietf_fields_when_asked() {
        let l = Limited {
            reason: Reason::UserRateLimit,
            quota: Quota {
                limit: 10,
                remaining: 0,
                reset_ms: 60_000,
            },
            retry_after_ms: 5_500,
            tier: "free",
            bucket: "tier free: requests",
            rule: "tier/free/requests",
            limit_text: "10/min",
            ietf: Some(IetfPolicy {
                window_s: 60,
                unit: None,
            }),
            status: 429,
        };
        let r = limited(&l, 0);
        assert_eq!(r.header("retry-after"), Some("6"));
        assert_eq!(
            r.header("RateLimit-Policy"),
            Some(r#""tier/free/requests";q=10;w=60"#)
        );
        assert_eq!(
            r.header("RateLimit"),
            Some(r#""tier/free/requests";r=0;t=6"#)
        );
    }

    #[test]
    fn ietf_fields_are_structured_field_lists_of_one_item() {
        let q = Quota {
            limit: 1000,
            remaining: 999,
            reset_ms: 1_500,
        };
        let item = IetfPolicy {
            window_s: 3600,
            unit: Some("tokens"),
        };
        let h = ietf_headers("tier/pro/tokens", item, &q, 2);
        assert_eq!(
            h,
            vec![
                (
                    "ratelimit-policy".to_string(),
                    r#""tier/pro/tokens";q=1000;w=3600;sluice-unit="tokens""#.to_string()
                ),
                (
                    "ratelimit".to_string(),
                    r#""tier/pro/tokens";r=999;t=2"#.to_string()
                ),
            ]
        );
        // sf-integers have at most 15 digits; `w` is never 0.
        let huge = Quota {
            limit: u64::MAX,
            remaining: u64::MAX,
            reset_ms: 0,
        };
        let zero = IetfPolicy {
            window_s: 0,
            unit: None,
        };
        let h = ietf_headers("m", zero, &huge, u64::MAX);
        assert_eq!(h[0].1, r#""m";q=999999999999999;w=1"#);
        assert_eq!(h[1].1, r#""m";r=999999999999999;t=999999999999999"#);
    }

    /// Rule ids come from policy names, which hold no `"` today; escaping
    /// is checked anyway, and nothing outside printable ASCII (a CR, LF,
    /// a non-ASCII name) reaches the header.
    #[test]
    fn sf_strings_escape_quotes_backslashes_and_non_printable_bytes() {
        assert_eq!(sf_string("tier/free/requests"), r#""tier/free/requests""#);
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(sf_string("a\r\nb"), r#""a%0d%0ab""#);
        assert_eq!(sf_string("tier/é"), r#""tier/%c3%a9""#);
        assert_eq!(sf_string(""), "\"\"");
        // A hostile-looking name stays one item: no `"` of its own can end
        // the string, so its `;` and `,` stay inside it.
        let s = sf_string(r#"x";r=999999, "y"#);
        assert_eq!(s, r#""x\";r=999999, \"y""#);
        assert!(s.bytes().all(|b| (0x20..=0x7e).contains(&b)));
    }

    #[test]
    fn the_ietf_window_is_the_time_the_whole_quota_takes_to_return() {
        use crate::policy::limit::{Limit, Window};
        use crate::policy::units::Rate;
        use crate::policy::zone::Zone;
        let per_min = Limit {
            rate: Rate {
                amount: 10,
                period_ms: 60_000,
            },
            burst: 10,
            window: None,
        };
        assert_eq!(IetfPolicy::of(&per_min, None).window_s, 60);
        let bursty = Limit {
            burst: 15,
            ..per_min
        };
        assert_eq!(IetfPolicy::of(&bursty, None).window_s, 90);
        let fast = Limit {
            rate: Rate {
                amount: 3,
                period_ms: 1_000,
            },
            burst: 1,
            window: None,
        };
        assert_eq!(IetfPolicy::of(&fast, None).window_s, 1, "never 0");
        let daily = Limit::windowed(5000, Window::Day(Zone::UTC));
        assert_eq!(IetfPolicy::of(&daily, None).window_s, 86_400);
    }

    /// What a refusal carries as its wait is what its answer says.
    #[test]
    fn a_refusal_carries_the_retry_after_its_answer_says() {
        let quota = Quota {
            limit: 10,
            remaining: 0,
            reset_ms: 60_000,
        };
        let bucket = BucketRefusal {
            reason: Reason::UserRateLimit,
            quota,
            retry_after_ms: 5_500,
            tier: "free".into(),
            bucket: "tier free: requests".into(),
            rule: "tier/free/requests".into(),
            limit_text: "10/min".into(),
            now_ms: 0,
            ietf: None,
            status: 429,
        };
        for refused in [
            Refused::rejected(Reason::InvalidRequest, "no", Some("model")),
            Refused::retry_later(Reason::QueueFull, "full", 1),
            Refused::unavailable(Reason::GpuOverloaded, "saturated", 7),
            Refused::Bucket(bucket),
            Refused::CapacityExhausted {
                retry_after_ms: 1,
                tier: "free".into(),
                bucket: "b".into(),
                rule: "tier/free/b".into(),
                now_ms: 0,
            },
            Refused::TemporarilyBlocked {
                retry_after_ms: 61_001,
                now_ms: 0,
            },
        ] {
            let reply = refused.render();
            let said = reply
                .header("retry-after")
                .map(|s| s.parse::<u64>().unwrap() * 1000);
            assert_eq!(refused.retry_after_ms(), said, "{refused:?}");
            assert_eq!(
                reply.header("x-sluice-reason"),
                Some(refused.reason().code())
            );
        }
    }

    /// A budget that refuses with 402/403: that status, `x-should-retry:
    /// false`, no `Retry-After` (and no wait the queue could sleep on).
    #[test]
    fn a_budget_refusing_with_402_or_403_tells_clients_not_to_retry() {
        for status in [402, 403] {
            let bucket = BucketRefusal {
                reason: Reason::DailyBudgetExceeded,
                quota: Quota {
                    limit: 100,
                    remaining: 3,
                    reset_ms: 3_600_000,
                },
                retry_after_ms: 3_600_000,
                tier: "free".into(),
                bucket: "tier free: daily tokens per caller".into(),
                rule: "tier/free/daily_tokens".into(),
                limit_text: "100 per day (UTC)".into(),
                now_ms: 1_795_996_800_000,
                ietf: None,
                status,
            };
            let refused = Refused::Bucket(bucket);
            assert_eq!(refused.status(), status);
            assert_eq!(refused.retry_after_ms(), None);
            let r = refused.render();
            assert_eq!(r.status, status);
            assert_eq!(r.header("retry-after"), None, "{r:?}");
            assert_eq!(r.header("x-should-retry"), Some("false"));
            assert_eq!(r.header("x-ratelimit-reset"), Some("3600"));
            assert_eq!(r.header("x-sluice-reason"), Some("daily_budget_exceeded"));
            let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(body["error"]["type"], "insufficient_quota");
            assert_eq!(body["error"]["sluice"]["reset_at"], "2026-11-30T01:00:00Z");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains("will not help"), "{message}");
        }
    }

    #[test]
    fn other_refusals() {
        let r = rejected(Reason::RequestTooLarge, "too big", None);
        assert_eq!(r.status, 413);
        let r = rejected(Reason::InvalidRequest, "`model` is required", Some("model"));
        assert_eq!(r.status, 400);
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["error"]["param"], "model");
    }

    #[test]
    fn truncate_keeps_whole_characters() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate("", 0), "");
    }
}
