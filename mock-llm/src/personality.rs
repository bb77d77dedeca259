//! Which real server mock-llm plays: the endpoints it serves, the request
//! fields it obeys or refuses, and how it shapes its errors. Every rule cites
//! where the real server shows it; `Mock` is mock-llm's own permissive
//! behaviour (every endpoint, every limit field), the default.
//!
//! What the personalities decide, in one place each:
//! * [`Personality::serves`]: the endpoints (a path the server lacks is its
//!   own 404);
//! * [`Personality::check`]: fields refused before generating (unknown
//!   fields, a required `max_tokens`, a prompt array, stray `stream_options`);
//! * [`Personality::output_limit`]: which limit field is obeyed;
//! * [`Personality::choices`]: `n`, `best_of` and prompt arrays;
//! * [`Personality::stream_usage`]: where a stream carries its usage;
//! * [`Refusal::render`]: the error body, per server and API surface;
//! * [`crate::go_json`]: Ollama's body as Go's decoder reads it (keys
//!   without case, the last one winning), before any of the above.

use std::fmt;
use std::str::FromStr;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::generate::Api;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Personality {
    /// mock-llm's own rules: every endpoint, the first limit field found.
    #[default]
    Mock,
    Vllm,
    Openai,
    Ollama,
    Anthropic,
}

impl Personality {
    /// Every personality, mock-llm's own first.
    pub const ALL: [Personality; 5] = [
        Personality::Mock,
        Personality::Vllm,
        Personality::Openai,
        Personality::Ollama,
        Personality::Anthropic,
    ];
}

impl FromStr for Personality {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mock" => Ok(Personality::Mock),
            "vllm" => Ok(Personality::Vllm),
            "openai" => Ok(Personality::Openai),
            "ollama" => Ok(Personality::Ollama),
            "anthropic" => Ok(Personality::Anthropic),
            other => Err(format!(
                "expected mock, vllm, openai, ollama or anthropic, got {other:?}"
            )),
        }
    }
}

impl fmt::Display for Personality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Personality::Mock => "mock",
            Personality::Vllm => "vllm",
            Personality::Openai => "openai",
            Personality::Ollama => "ollama",
            Personality::Anthropic => "anthropic",
        })
    }
}

/// The wire dialect of an endpoint, which decides the error body's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// `/v1/*` OpenAI-style (and vLLM's own extras).
    OpenAi,
    /// Ollama's `/api/*`.
    OllamaNative,
    /// Anthropic Messages, wherever it is served.
    Anthropic,
}

impl Surface {
    pub fn of(api: Option<Api>) -> Surface {
        match api {
            Some(Api::Messages) => Surface::Anthropic,
            Some(
                Api::OllamaGenerate | Api::OllamaChat | Api::OllamaEmbed | Api::OllamaEmbeddings,
            ) => Surface::OllamaNative,
            _ => Surface::OpenAi,
        }
    }
}

/// What went wrong, independent of how a server spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    InvalidRequest,
    ModelNotFound,
    NotFound,
    RateLimited,
    /// Refused by a token budget (OpenAI's type `tokens`).
    TokensRateLimited,
    /// Anthropic's 529.
    Overloaded,
    Unavailable,
    Server,
}

/// A refusal decided by a personality, rendered once by [`Refusal::render`].
#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: StatusCode,
    pub kind: Kind,
    pub message: String,
    pub param: Option<&'static str>,
    /// OpenAI's machine-readable `code` where it has one.
    pub code: Option<&'static str>,
}

impl Refusal {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Refusal {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            kind: Kind::InvalidRequest,
            message: message.into(),
            param,
            code: None,
        }
    }

    fn with_code(mut self, code: &'static str) -> Refusal {
        self.code = Some(code);
        self
    }

    /// An error status asked for by a knob (or the request limiter), in the
    /// kind the status means.
    pub fn for_status(status: StatusCode, message: impl Into<String>) -> Refusal {
        let kind = match status.as_u16() {
            429 => Kind::RateLimited,
            529 => Kind::Overloaded,
            503 => Kind::Unavailable,
            404 => Kind::NotFound,
            s if s >= 500 => Kind::Server,
            _ => Kind::InvalidRequest,
        };
        Refusal {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The body as `p` sends it on `surface`.
    pub fn render(&self, p: Personality, surface: Surface) -> Response {
        let body = match (p, surface) {
            // Anthropic, and the Anthropic endpoints of vLLM and Ollama:
            // `{"type":"error","error":{"type","message"}}` (Anthropic API
            // reference, "Errors"; vllm/entrypoints/anthropic/protocol.py
            // AnthropicErrorResponse; ollama anthropic/anthropic.go NewError).
            (_, Surface::Anthropic) | (Personality::Anthropic, _) => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.message},
            }),
            // Ollama's native API: `{"error": "text"}` (ollama server/routes.go).
            (Personality::Ollama, Surface::OllamaNative) => json!({"error": self.message}),
            // Ollama's OpenAI layer: NewError maps 400 → invalid_request_error,
            // 404 → not_found_error, else api_error; `code` is null
            // (ollama openai/openai.go).
            (Personality::Ollama, _) => {
                let kind = match self.status.as_u16() {
                    400 => "invalid_request_error",
                    404 => "not_found_error",
                    _ => "api_error",
                };
                json!({"error": {"message": self.message, "type": kind, "param": null, "code": null}})
            }
            // vLLM: ErrorResponse{error: ErrorInfo{message, type, param, code:int}}
            // with type NotFoundError / BadRequestError / … and the status as
            // code (vllm/entrypoints/openai/engine/protocol.py, serving.py
            // create_error_response).
            (Personality::Vllm, _) => {
                let kind = match self.kind {
                    Kind::ModelNotFound | Kind::NotFound => "NotFoundError",
                    Kind::InvalidRequest => "BadRequestError",
                    Kind::Unavailable => "ServiceUnavailableError",
                    Kind::RateLimited | Kind::TokensRateLimited => "TooManyRequestsError",
                    Kind::Overloaded | Kind::Server => "InternalServerError",
                };
                json!({"error": {"message": self.message, "type": kind, "param": self.param,
                                 "code": self.status.as_u16()}})
            }
            // OpenAI (and mock-llm's own): `{"error":{"message","type","param","code"}}`
            // with a string code (OpenAI API reference, "Error codes").
            (Personality::Openai | Personality::Mock, _) => {
                let kind = match self.kind {
                    // OpenAI names the limit that refused: requests or tokens.
                    Kind::RateLimited => "requests",
                    Kind::TokensRateLimited => "tokens",
                    Kind::Server | Kind::Unavailable | Kind::Overloaded => "server_error",
                    _ => "invalid_request_error",
                };
                json!({"error": {"message": self.message, "type": kind, "param": self.param,
                                 "code": self.code}})
            }
        };
        (self.status, Json(body)).into_response()
    }

    fn anthropic_type(&self) -> &'static str {
        // Anthropic API reference, "Errors": the error types by status.
        match self.kind {
            Kind::InvalidRequest => "invalid_request_error",
            Kind::ModelNotFound | Kind::NotFound => "not_found_error",
            Kind::RateLimited | Kind::TokensRateLimited => "rate_limit_error",
            Kind::Overloaded | Kind::Unavailable => "overloaded_error",
            Kind::Server => "api_error",
        }
    }
}

/// Where a chat/completions stream carries usage (besides the final chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamUsage {
    /// No `usage` key on content chunks.
    #[default]
    Omitted,
    /// `"usage": null` on every chunk but the usage chunk (OpenAI).
    Null,
    /// Cumulative usage on every chunk (vLLM `continuous_usage_stats`).
    Continuous,
    /// All-zero usage on every chunk (Ollama's completions layer).
    Zeros,
}

/// How a stream reports usage: the final usage chunk, and the other chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamReport {
    pub include_usage: bool,
    pub chunks: StreamUsage,
}

/// `n` returned of `best_of` generated, for each of `prompts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choices {
    pub prompts: u64,
    pub n: u64,
    pub best_of: u64,
}

fn field<'a>(body: &'a Value, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

fn int(body: &Value, name: &str) -> Option<i64> {
    field(body, name).and_then(Value::as_i64)
}

/// OpenAI's reasoning models refuse `max_tokens` (OpenAI API reference,
/// chat `max_tokens`: "not compatible with o-series models").
fn openai_reasoning_model(model: &str) -> bool {
    let m = model.to_ascii_lowercase();
    m.starts_with("gpt-5")
        || (m.starts_with('o') && m.chars().nth(1).is_some_and(|c| c.is_ascii_digit()))
}

impl Personality {
    /// Whether this server has the endpoint at all.
    pub fn serves(self, api: Option<Api>) -> bool {
        use Api::*;
        match self {
            Personality::Mock => true,
            // vLLM's api_server routes: the OpenAI set, Anthropic messages,
            // SageMaker /invocations, scoring/pooling, tokenize.
            Personality::Vllm => !matches!(
                api,
                Some(OllamaGenerate | OllamaChat | OllamaEmbed | OllamaEmbeddings)
            ),
            // api.openai.com: the OpenAI set only.
            Personality::Openai => matches!(
                api,
                Some(ChatCompletions | Completions | Embeddings | Responses)
            ),
            // ollama server/routes.go: /api/*, /v1/{chat/completions,
            // completions, embeddings, models, responses, messages}.
            Personality::Ollama => matches!(
                api,
                Some(
                    ChatCompletions
                        | Completions
                        | Embeddings
                        | Responses
                        | Messages
                        | OllamaGenerate
                        | OllamaChat
                        | OllamaEmbed
                        | OllamaEmbeddings
                )
            ),
            Personality::Anthropic => matches!(api, Some(Messages)),
        }
    }

    /// Whether it serves `/metrics` (vLLM's Prometheus endpoint).
    pub fn serves_metrics(self) -> bool {
        matches!(self, Personality::Mock | Personality::Vllm)
    }

    /// The 404 for a path this server does not have, as it sends it.
    pub fn unknown_path(self, method: &str, path: &str) -> Response {
        match self {
            // mock-llm's own (kept as it was).
            Personality::Mock => Refusal::for_status(
                StatusCode::NOT_FOUND,
                format!("mock-llm has no endpoint {path}"),
            )
            .with_code("unknown_url")
            .render(self, Surface::OpenAi),
            // FastAPI's default 404 (vLLM runs on FastAPI/uvicorn).
            Personality::Vllm => {
                (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
            }
            // OpenAI: invalid_request_error "Invalid URL (POST /v1/x)".
            Personality::Openai => Refusal::for_status(
                StatusCode::NOT_FOUND,
                format!("Invalid URL ({method} {path})"),
            )
            .render(self, Surface::OpenAi),
            // gin's default: a plain-text "404 page not found".
            Personality::Ollama => (
                StatusCode::NOT_FOUND,
                [(axum::http::header::CONTENT_TYPE, "text/plain")],
                "404 page not found",
            )
                .into_response(),
            Personality::Anthropic => Refusal::for_status(StatusCode::NOT_FOUND, "Not Found")
                .render(self, Surface::Anthropic),
        }
    }

    /// The answer to a request without the server's one credential
    /// (`--api-key`), as the played server gives it; `None`: it may pass.
    /// - OpenAI: `Authorization: Bearer <key>`, else 401 with code
    ///   `invalid_api_key` (OpenAI API reference, "Error codes": 401
    ///   "Invalid Authentication" / "Incorrect API key provided").
    /// - vLLM `--api-key`: `Authorization: Bearer <key>` on `/v1` paths,
    ///   else 401 `{"error": "Unauthorized"}` (vllm
    ///   entrypoints/openai/server_utils.py, AuthenticationMiddleware).
    /// - Anthropic: `x-api-key: <key>`, else 401 `authentication_error`
    ///   "invalid x-api-key" (Anthropic API reference, "Errors").
    /// - Ollama has no credential of its own: it lets everything pass.
    pub fn unauthorized(
        self,
        surface: Surface,
        headers: &axum::http::HeaderMap,
        key: &str,
    ) -> Option<Response> {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let bearer = header("authorization").and_then(|v| v.strip_prefix("Bearer "));
        let (ok, body) = match (self, surface) {
            (Personality::Ollama, _) => return None,
            (Personality::Anthropic, _) | (_, Surface::Anthropic) => (
                header("x-api-key") == Some(key),
                json!({"type": "error",
                       "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
            ),
            (Personality::Vllm, _) => (bearer == Some(key), json!({"error": "Unauthorized"})),
            (Personality::Openai | Personality::Mock, _) => (
                bearer == Some(key),
                json!({"error": {
                    "message": "Incorrect API key provided. You can find your API key at \
                                https://platform.openai.com/account/api-keys.",
                    "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
            ),
        };
        (!ok).then(|| (StatusCode::UNAUTHORIZED, Json(body)).into_response())
    }

    /// The refusal for a model not in `--models`.
    pub fn model_not_found(self, api: Option<Api>, model: &str) -> Refusal {
        let message = match (self, Surface::of(api)) {
            // OpenAI API reference, "Error codes": 404 model_not_found.
            (Personality::Openai | Personality::Mock, Surface::OpenAi) => {
                format!("The model `{model}` does not exist or you do not have access to it.")
            }
            // vllm serving.py _check_model.
            (Personality::Vllm, Surface::OpenAi) => format!("The model `{model}` does not exist."),
            // ollama server/routes.go (Generate/Chat handlers).
            (Personality::Ollama, _) => format!("model '{model}' not found"),
            // Anthropic: not_found_error "model: <name>".
            _ => format!("model: {model}"),
        };
        Refusal {
            status: StatusCode::NOT_FOUND,
            kind: Kind::ModelNotFound,
            message,
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    /// Fields the server refuses before it generates anything.
    pub fn check(self, api: Api, body: &Value) -> Result<(), Refusal> {
        let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
        let has_stream_options = field(body, "stream_options").is_some();
        match (self, api) {
            (Personality::Openai, _) => {
                if let Some(name) = unknown_field(api, body) {
                    // OpenAI answers an unknown field with this 400.
                    return Err(Refusal::invalid(
                        format!("Unrecognized request argument supplied: {name}"),
                        None,
                    ));
                }
                let model = body.get("model").and_then(Value::as_str).unwrap_or("");
                if api == Api::ChatCompletions
                    && field(body, "max_tokens").is_some()
                    && openai_reasoning_model(model)
                {
                    return Err(Refusal::invalid(
                        "Unsupported parameter: 'max_tokens' is not supported with this model. \
                         Use 'max_completion_tokens' instead.",
                        Some("max_tokens"),
                    )
                    .with_code("unsupported_parameter"));
                }
                if has_stream_options
                    && !stream
                    && matches!(api, Api::ChatCompletions | Api::Completions)
                {
                    return Err(Refusal::invalid(
                        "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                        Some("stream_options"),
                    ));
                }
            }
            // vllm chat_completion/protocol.py validate_stream_options.
            (Personality::Vllm, Api::ChatCompletions | Api::Completions)
                if has_stream_options && !stream =>
            {
                return Err(Refusal::invalid(
                    "Stream options can only be defined when `stream=True`.",
                    Some("stream_options"),
                ));
            }
            // ollama openai/openai.go: CompletionRequest.Prompt is a Go
            // string, so an array fails to decode (a 400).
            (Personality::Ollama, Api::Completions)
                if field(body, "prompt").is_some_and(|p| !p.is_string()) =>
            {
                return Err(Refusal::invalid(
                    "json: cannot unmarshal array into Go struct field CompletionRequest.prompt of type string",
                    Some("prompt"),
                ));
            }
            _ => {}
        }
        if api == Api::Messages {
            self.check_messages(body)?;
        }
        Ok(())
    }

    /// `max_tokens` is required by Anthropic (API reference, Messages),
    /// by vLLM's AnthropicMessagesRequest (`max_tokens: int`, positive) and
    /// by Ollama's layer ("max_tokens is required and must be positive",
    /// ollama middleware/anthropic.go). mock-llm's own leaves it optional.
    fn check_messages(self, body: &Value) -> Result<(), Refusal> {
        if self == Personality::Mock {
            return Ok(());
        }
        if self == Personality::Anthropic {
            if let Some(name) = unknown_field(Api::Messages, body) {
                return Err(Refusal::invalid(
                    format!("{name}: Extra inputs are not permitted"),
                    None,
                ));
            }
        }
        match int(body, "max_tokens") {
            None => Err(Refusal::invalid(
                match self {
                    Personality::Ollama => "max_tokens is required and must be positive",
                    _ => "max_tokens: Field required",
                },
                Some("max_tokens"),
            )),
            Some(n) if n <= 0 && self != Personality::Anthropic => Err(Refusal::invalid(
                match self {
                    Personality::Ollama => "max_tokens is required and must be positive",
                    _ => "max_tokens must be positive",
                },
                Some("max_tokens"),
            )),
            Some(n) if n < 1 => Err(Refusal::invalid(
                "max_tokens: Input should be greater than or equal to 1",
                Some("max_tokens"),
            )),
            Some(_) => Ok(()),
        }
    }

    /// The output limit this server obeys for `api`, as the raw number
    /// (negative means none, as Ollama's `-1`); `None` when the request sets
    /// none that it reads. Fields it does not read are ignored, as the real
    /// server ignores them.
    pub fn output_limit(self, api: Api, body: &Value) -> Option<i64> {
        let first = |names: &[&str]| names.iter().find_map(|n| int(body, n));
        match (self, api) {
            (Personality::Mock, _) => {
                crate::tokens::requested_output_limit(body).and_then(|n| i64::try_from(n).ok())
            }
            // vLLM chat: max_completion_tokens, else max_tokens
            // (chat_completion/protocol.py build_tok_params); OpenAI
            // likewise (max_tokens is the deprecated spelling).
            (Personality::Vllm | Personality::Openai, Api::ChatCompletions) => {
                first(&["max_completion_tokens", "max_tokens"])
            }
            // Completions: max_tokens, default 16 when absent (vLLM
            // completion/protocol.py `max_tokens: int | None = 16`; OpenAI's
            // legacy default is 16 too); an explicit null means no limit.
            (Personality::Vllm | Personality::Openai, Api::Completions) => {
                match body.get("max_tokens") {
                    None => Some(16),
                    Some(v) => v.as_i64(),
                }
            }
            (_, Api::Responses) => first(&["max_output_tokens"]),
            (_, Api::Messages) => first(&["max_tokens"]),
            // Ollama's OpenAI layer maps only `max_tokens` to num_predict
            // (ollama openai/openai.go FromChatRequest/FromCompleteRequest).
            (Personality::Ollama, Api::ChatCompletions | Api::Completions) => {
                first(&["max_tokens"])
            }
            // Native Ollama: options.num_predict (-1: until the context ends).
            (_, Api::OllamaGenerate | Api::OllamaChat) => body
                .get("options")
                .and_then(|o| o.get("num_predict"))
                .and_then(Value::as_i64),
            _ => None,
        }
    }

    /// Whether the server refuses a limit that does not fit the context
    /// (vLLM: "'max_tokens' or 'max_completion_tokens' is too large",
    /// vllm serving.py _validate_input); the others cut the output short.
    pub fn checks_context(self, api: Api) -> bool {
        self == Personality::Vllm && matches!(api, Api::ChatCompletions | Api::Completions)
    }

    /// `n`, `best_of` and prompt arrays as this server multiplies work.
    pub fn choices(self, api: Api, body: &Value) -> Choices {
        let count = |name: &str| {
            field(body, name)
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .clamp(1, 128)
        };
        let prompts = if api == Api::Completions {
            crate::generate::prompt_count(body)
        } else {
            1
        };
        let one = Choices {
            prompts,
            n: 1,
            best_of: 1,
        };
        match (self, api) {
            (Personality::Mock, Api::ChatCompletions | Api::Completions) => Choices {
                n: count("n"),
                best_of: count("best_of"),
                ..one
            },
            // vLLM (V1 engine) has `n` but no `best_of`, an ignored extra
            // field (completion/protocol.py has none).
            (Personality::Vllm, Api::ChatCompletions | Api::Completions) => Choices {
                n: count("n"),
                ..one
            },
            (Personality::Openai, Api::ChatCompletions) => Choices {
                n: count("n"),
                ..one
            },
            // OpenAI legacy completions: best_of generated server-side.
            (Personality::Openai, Api::Completions) => Choices {
                n: count("n"),
                best_of: count("best_of"),
                ..one
            },
            // Ollama's layer has no `n` field: one choice.
            _ => one,
        }
    }

    /// How a chat/completions stream reports usage.
    pub fn stream_usage(self, api: Api, body: &Value) -> StreamReport {
        let opts = field(body, "stream_options");
        let flag = |name: &str| opts.and_then(|o| o.get(name)).and_then(Value::as_bool);
        match self {
            // vLLM StreamOptions: include_usage defaults to true once
            // stream_options is given; continuous_usage_stats puts usage on
            // every chunk (vllm engine/protocol.py StreamOptions).
            Personality::Vllm => {
                let include = opts.is_some() && flag("include_usage") != Some(false);
                StreamReport {
                    include_usage: include,
                    chunks: if include && flag("continuous_usage_stats") == Some(true) {
                        StreamUsage::Continuous
                    } else {
                        StreamUsage::Omitted
                    },
                }
            }
            // Ollama: chat chunks carry no usage; completions chunks carry
            // zeros (middleware/openai.go CompleteWriter sets &Usage{}).
            Personality::Ollama => {
                let include = flag("include_usage") == Some(true);
                StreamReport {
                    include_usage: include,
                    chunks: if include && api == Api::Completions {
                        StreamUsage::Zeros
                    } else {
                        StreamUsage::Omitted
                    },
                }
            }
            _ => {
                let include = flag("include_usage") == Some(true);
                StreamReport {
                    include_usage: include,
                    chunks: if include {
                        StreamUsage::Null
                    } else {
                        StreamUsage::Omitted
                    },
                }
            }
        }
    }

    /// Whether `/v1/responses` stores answers and reads `previous_response_id`
    /// (OpenAI: `store` defaults to true; vLLM ResponsesRequest `store: bool
    /// = True`, with VLLM_ENABLE_RESPONSES_API_STORE on; Ollama's layer sets
    /// PreviousResponseID nil, "Not supported", openai/responses.go).
    pub fn stores_responses(self) -> bool {
        matches!(
            self,
            Personality::Mock | Personality::Openai | Personality::Vllm
        )
    }

    /// The 404 for an unknown `previous_response_id`.
    pub fn previous_response_not_found(self, id: &str) -> Refusal {
        let message = match self {
            // vllm serving_responses.py _make_not_found_error.
            Personality::Vllm => format!("Response with id '{id}' not found."),
            _ => format!("Previous response with id '{id}' not found."),
        };
        Refusal {
            status: StatusCode::NOT_FOUND,
            kind: Kind::NotFound,
            message,
            param: Some("previous_response_id"),
            code: Some("previous_response_not_found"),
        }
    }
}

/// The first top-level field a strict server does not know, if any.
fn unknown_field(api: Api, body: &Value) -> Option<String> {
    let known = known_fields(api)?;
    body.as_object()?
        .keys()
        .find(|k| !known.contains(&k.as_str()))
        .cloned()
}

/// Request fields of the strict APIs (OpenAI API reference, "Create chat
/// completion", "Create completion", "Create embeddings", "Create a model
/// response"; Anthropic API reference, "Messages").
fn known_fields(api: Api) -> Option<&'static [&'static str]> {
    Some(match api {
        Api::ChatCompletions => &[
            "messages",
            "model",
            "audio",
            "frequency_penalty",
            "function_call",
            "functions",
            "logit_bias",
            "logprobs",
            "max_completion_tokens",
            "max_tokens",
            "metadata",
            "modalities",
            "n",
            "parallel_tool_calls",
            "prediction",
            "presence_penalty",
            "prompt_cache_key",
            "prompt_cache_retention",
            "reasoning_effort",
            "response_format",
            "safety_identifier",
            "seed",
            "service_tier",
            "stop",
            "store",
            "stream",
            "stream_options",
            "temperature",
            "tool_choice",
            "tools",
            "top_logprobs",
            "top_p",
            "user",
            "verbosity",
            "web_search_options",
        ],
        Api::Completions => &[
            "model",
            "prompt",
            "best_of",
            "echo",
            "frequency_penalty",
            "logit_bias",
            "logprobs",
            "max_tokens",
            "n",
            "presence_penalty",
            "seed",
            "stop",
            "stream",
            "stream_options",
            "suffix",
            "temperature",
            "top_p",
            "user",
        ],
        Api::Embeddings => &["input", "model", "dimensions", "encoding_format", "user"],
        Api::Responses => &[
            "background",
            "conversation",
            "include",
            "input",
            "instructions",
            "max_output_tokens",
            "max_tool_calls",
            "metadata",
            "model",
            "parallel_tool_calls",
            "previous_response_id",
            "prompt",
            "prompt_cache_key",
            "prompt_cache_retention",
            "reasoning",
            "safety_identifier",
            "service_tier",
            "store",
            "stream",
            "stream_options",
            "temperature",
            "text",
            "tool_choice",
            "tools",
            "top_logprobs",
            "top_p",
            "truncation",
            "user",
        ],
        Api::Messages => &[
            "model",
            "messages",
            "max_tokens",
            "container",
            "context_management",
            "mcp_servers",
            "metadata",
            "service_tier",
            "stop_sequences",
            "stream",
            "system",
            "temperature",
            "thinking",
            "tool_choice",
            "tools",
            "top_k",
            "top_p",
        ],
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(res: Response) -> (StatusCode, Value) {
        let status = res.status();
        let bytes = futures_util::FutureExt::now_or_never(axum::body::to_bytes(
            res.into_body(),
            usize::MAX,
        ))
        .and_then(Result::ok)
        .unwrap_or_default();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    #[test]
    fn parses_and_prints_every_name() {
        for p in [
            Personality::Mock,
            Personality::Vllm,
            Personality::Openai,
            Personality::Ollama,
            Personality::Anthropic,
        ] {
            assert_eq!(p.to_string().parse::<Personality>(), Ok(p));
        }
        assert!("tgi".parse::<Personality>().is_err());
    }

    #[test]
    fn limit_fields_each_server_obeys() {
        let both = json!({"max_tokens": 5, "max_completion_tokens": 50,
                          "max_output_tokens": 7, "options": {"num_predict": 9}});
        use Personality::*;
        // vLLM and OpenAI chat: max_completion_tokens wins.
        assert_eq!(Vllm.output_limit(Api::ChatCompletions, &both), Some(50));
        assert_eq!(Openai.output_limit(Api::ChatCompletions, &both), Some(50));
        // Ollama's layer reads max_tokens only.
        assert_eq!(Ollama.output_limit(Api::ChatCompletions, &both), Some(5));
        let mct = json!({"max_completion_tokens": 3});
        assert_eq!(Ollama.output_limit(Api::ChatCompletions, &mct), None);
        // vLLM chat ignores max_output_tokens and options.
        assert_eq!(
            Vllm.output_limit(
                Api::ChatCompletions,
                &json!({"max_output_tokens": 2, "options": {"num_predict": 2}})
            ),
            None
        );
        // Completions default to 16; null is no limit.
        assert_eq!(Vllm.output_limit(Api::Completions, &json!({})), Some(16));
        assert_eq!(
            Vllm.output_limit(Api::Completions, &json!({"max_tokens": null})),
            None
        );
        assert_eq!(Ollama.output_limit(Api::OllamaChat, &both), Some(9));
        assert_eq!(Vllm.output_limit(Api::Responses, &both), Some(7));
        // mock-llm's own: the first field found.
        assert_eq!(Mock.output_limit(Api::ChatCompletions, &both), Some(5));
    }

    #[test]
    fn strict_servers_refuse_unknown_fields_and_missing_max_tokens() {
        use Personality::*;
        let extra = json!({"model": "gpt-4o", "messages": [], "options": {"num_predict": 1}});
        let err = Openai.check(Api::ChatCompletions, &extra).unwrap_err();
        assert!(err.message.contains("options"), "{}", err.message);
        assert!(Vllm.check(Api::ChatCompletions, &extra).is_ok());
        assert!(Ollama.check(Api::ChatCompletions, &extra).is_ok());
        let no_max = json!({"model": "claude", "messages": []});
        for p in [Anthropic, Vllm, Ollama] {
            let err = p.check(Api::Messages, &no_max).unwrap_err();
            assert_eq!(err.param, Some("max_tokens"), "{p}");
        }
        assert!(Mock.check(Api::Messages, &no_max).is_ok());
        let err = Anthropic
            .check(
                Api::Messages,
                &json!({"model": "c", "messages": [], "max_tokens": 1, "n": 2}),
            )
            .unwrap_err();
        assert_eq!(err.message, "n: Extra inputs are not permitted");
        let o1 = json!({"model": "o3-mini", "messages": [], "max_tokens": 4});
        assert_eq!(
            Openai.check(Api::ChatCompletions, &o1).unwrap_err().param,
            Some("max_tokens")
        );
        let opts = json!({"model": "m", "messages": [], "stream_options": {"include_usage": true}});
        assert!(Vllm.check(Api::ChatCompletions, &opts).is_err());
        assert!(Openai.check(Api::ChatCompletions, &opts).is_err());
        let arr = json!({"model": "m", "prompt": ["a", "b"]});
        assert!(Ollama.check(Api::Completions, &arr).is_err());
        assert!(Vllm.check(Api::Completions, &arr).is_ok());
    }

    #[test]
    fn choices_by_server() {
        use Personality::*;
        let body = json!({"prompt": ["a", "b", "c"], "n": 2, "best_of": 4});
        let c = |p: Personality| {
            let c = p.choices(Api::Completions, &body);
            (c.prompts, c.n, c.best_of)
        };
        assert_eq!(c(Mock), (3, 2, 4));
        assert_eq!(c(Openai), (3, 2, 4));
        assert_eq!(c(Vllm), (3, 2, 1));
        assert_eq!(Ollama.choices(Api::ChatCompletions, &json!({"n": 3})).n, 1);
    }

    #[test]
    fn stream_usage_by_server() {
        use Personality::*;
        let opts = json!({"stream": true, "stream_options": {}});
        assert!(Vllm.stream_usage(Api::ChatCompletions, &opts).include_usage);
        assert!(
            !Openai
                .stream_usage(Api::ChatCompletions, &opts)
                .include_usage
        );
        let cont = json!({"stream": true, "stream_options": {"continuous_usage_stats": true}});
        assert_eq!(
            Vllm.stream_usage(Api::ChatCompletions, &cont).chunks,
            StreamUsage::Continuous
        );
        let inc = json!({"stream": true, "stream_options": {"include_usage": true}});
        assert_eq!(
            Ollama.stream_usage(Api::Completions, &inc).chunks,
            StreamUsage::Zeros
        );
        assert_eq!(
            Ollama.stream_usage(Api::ChatCompletions, &inc).chunks,
            StreamUsage::Omitted
        );
        assert_eq!(
            Openai.stream_usage(Api::ChatCompletions, &inc).chunks,
            StreamUsage::Null
        );
    }

    #[test]
    fn model_not_found_bodies() {
        use Personality::*;
        let (s, v) = body_of(
            Openai
                .model_not_found(Some(Api::ChatCompletions), "x")
                .render(Openai, Surface::OpenAi),
        );
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let (_, v) = body_of(
            Vllm.model_not_found(Some(Api::ChatCompletions), "x")
                .render(Vllm, Surface::OpenAi),
        );
        assert_eq!(v["error"]["type"], "NotFoundError");
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["message"], "The model `x` does not exist.");
        let (_, v) = body_of(
            Ollama
                .model_not_found(Some(Api::OllamaChat), "x")
                .render(Ollama, Surface::OllamaNative),
        );
        assert_eq!(v, json!({"error": "model 'x' not found"}));
        let (_, v) = body_of(
            Ollama
                .model_not_found(Some(Api::ChatCompletions), "x")
                .render(Ollama, Surface::OpenAi),
        );
        assert_eq!(v["error"]["type"], "not_found_error");
        let (_, v) = body_of(
            Anthropic
                .model_not_found(Some(Api::Messages), "x")
                .render(Anthropic, Surface::Anthropic),
        );
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
    }

    #[test]
    fn overloaded_and_busy_bodies() {
        let r = Refusal::for_status(StatusCode::from_u16(529).unwrap(), "Overloaded");
        let (s, v) = body_of(r.render(Personality::Anthropic, Surface::Anthropic));
        assert_eq!(s.as_u16(), 529);
        assert_eq!(v["error"]["type"], "overloaded_error");
        let busy = Refusal::for_status(StatusCode::SERVICE_UNAVAILABLE, "server busy");
        let (s, v) = body_of(busy.render(Personality::Ollama, Surface::OllamaNative));
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(v, json!({"error": "server busy"}));
        let (_, v) = body_of(busy.render(Personality::Vllm, Surface::OpenAi));
        assert_eq!(v["error"]["code"], 503);
    }
}
