//! Where each API's servers read the output limit, one row per API: which
//! limit fields a body of that API may carry (the ones its real servers
//! read), which of them sluice writes upstream, and whether one is
//! required. Reading a body reserves the largest limit it sets; a limit
//! field of another API is a 400 naming it, never trusted; the body the
//! upstream gets carries the reserved limit in every field that API's
//! servers read (`admission/rewrite.rs`).
//!
//! Why the largest: different servers of one API pick different fields
//! (vLLM's chat reads `max_completion_tokens` first, Ollama's OpenAI layer
//! only `max_tokens`), so "the field the server obeys" depends on which
//! server is behind the route, which sluice cannot know. The largest bounds
//! whatever it picks, and since the reserved value is then written into
//! every field, no server generates more than was reserved.
//!
//! What each server reads (checked in each server's source or reference):
//! - OpenAI chat (`/v1/chat/completions`): vLLM's `ChatCompletionRequest`
//!   takes `max_completion_tokens` when set, else `max_tokens`
//!   (vllm `entrypoints/openai/chat_completion/protocol.py`,
//!   `build_tok_params`); OpenAI's reference has `max_completion_tokens`,
//!   `max_tokens` deprecated and refused by reasoning models; Ollama's
//!   OpenAI layer has `max_tokens` only, mapped to `num_predict`
//!   (ollama `openai/openai.go`, `ChatCompletionRequest`).
//! - OpenAI completions (`/v1/completions`): `max_tokens` in vLLM
//!   (`entrypoints/openai/completion/protocol.py`, default 16), OpenAI's
//!   legacy reference and Ollama (`openai/openai.go`, `CompletionRequest`).
//! - Responses API (`/v1/responses`): `max_output_tokens` in vLLM
//!   (`entrypoints/openai/responses/protocol.py`, `to_sampling_params`),
//!   OpenAI's reference and Ollama (`openai/responses.go`).
//! - Anthropic Messages (`/v1/messages`): `max_tokens`, required, in
//!   Anthropic's reference, vLLM (`entrypoints/anthropic/protocol.py`) and
//!   Ollama (`anthropic/anthropic.go`, mapped to `num_predict`).
//! - Ollama native (`/api/generate`, `/api/chat`): `options.num_predict`
//!   only (ollama `api/types.go`, `Options`); a negative value is "no
//!   limit" (ollama `llm/llama_server.go`, `boundedNumPredict`), which
//!   sluice reads as "not set": the model's default is reserved and written.
//! - llama.cpp's server on the OpenAI chat and completions paths reads its
//!   own `n_predict` first, then `max_completion_tokens`, then `max_tokens`
//!   (ggml-org/llama.cpp `tools/server/server-task.cpp`,
//!   `params_from_json_cmpl`); `-1` is "no limit". Read on those two APIs
//!   like the others (a negative value as "not set"), so the largest is
//!   reserved and written into it too.
//! - Embeddings, scoring, pooling: no output, so no limit field at all.
//!
//! The servers these APIs talk to accept unknown fields silently (vLLM's
//! models allow extras, Ollama's Go decoder drops them): a foreign limit
//! field would reach the server and be ignored, leaving the generation
//! unbounded by anything sluice reserved. Hence the 400.
//!
//! Chat and OpenAI's reasoning models: OpenAI refuses `max_tokens` on
//! reasoning models and refuses a body that sets both fields. sluice still
//! always writes `max_tokens` on chat, because a server that reads nothing
//! else (Ollama) may be behind the route, and without it that server
//! generates until its own default, unbounded by the reservation.
//! `max_completion_tokens` is written (at the reserved value) where the
//! client sent it, since vLLM reads it first. A client that sends only
//! `max_completion_tokens` to OpenAI itself therefore gets OpenAI's
//! both-fields refusal: fail closed, nothing generated, nothing overshot.
//! A deployment that fronts only OpenAI's reasoning models needs a
//! per-upstream row (which fields that upstream reads) — not built yet.

use serde_json::{Map, Value};

use super::shared::{Api, BadBody};
use super::view::{Kind, View};

/// A field of a request body that limits the output of one completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitField {
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    /// Ollama's `options.num_predict`.
    NumPredict,
    /// llama.cpp's top-level `n_predict`.
    NPredict,
}

impl LimitField {
    /// Every limit field any API knows, in the order bodies are checked.
    pub const ALL: [LimitField; 5] = [
        LimitField::MaxTokens,
        LimitField::MaxCompletionTokens,
        LimitField::MaxOutputTokens,
        LimitField::NumPredict,
        LimitField::NPredict,
    ];

    /// The field's path, as errors name it.
    pub fn name(self) -> &'static str {
        match self {
            LimitField::MaxTokens => "max_tokens",
            LimitField::MaxCompletionTokens => "max_completion_tokens",
            LimitField::MaxOutputTokens => "max_output_tokens",
            LimitField::NumPredict => "options.num_predict",
            LimitField::NPredict => "n_predict",
        }
    }

    /// The field's value in a body; `null` counts as absent (every server
    /// reads it so). `options` that is not an object is the caller's 400.
    pub fn get<'a, J: View<'a>>(self, body: J) -> Option<J> {
        match self {
            LimitField::NumPredict => body.get("options")?.present("num_predict"),
            field => body.present(field.name()),
        }
    }

    /// Writes `max` into the field, creating `options` if needed.
    pub fn set(self, body: &mut Value, max: u64) {
        match self {
            LimitField::NumPredict => {
                if !body.get("options").is_some_and(Value::is_object) {
                    body["options"] = Value::Object(Map::new());
                }
                body["options"]["num_predict"] = max.into();
            }
            field => body[field.name()] = max.into(),
        }
    }
}

/// Where one API's servers read the output limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputLimit {
    /// The fields its servers read (the first server's order first). Any
    /// other limit field in a body of this API is a 400.
    pub reads: &'static [LimitField],
    /// Written upstream even when the client did not send them: a server
    /// that reads only these may be behind the route. The fields of
    /// `reads` the client sent are written too.
    pub always_written: &'static [LimitField],
    /// A body without one is a 400 naming the first field (Anthropic).
    pub required: bool,
}

use LimitField::{MaxCompletionTokens, MaxOutputTokens, MaxTokens, NPredict, NumPredict};

/// One row per API; the next API is a row.
const CHAT: OutputLimit = OutputLimit {
    reads: &[MaxCompletionTokens, MaxTokens, NPredict],
    always_written: &[MaxTokens],
    required: false,
};
const COMPLETIONS: OutputLimit = OutputLimit {
    reads: &[MaxTokens, NPredict],
    always_written: &[MaxTokens],
    required: false,
};
const RESPONSES: OutputLimit = OutputLimit {
    reads: &[MaxOutputTokens],
    always_written: &[MaxOutputTokens],
    required: false,
};
const MESSAGES: OutputLimit = OutputLimit {
    reads: &[MaxTokens],
    always_written: &[MaxTokens],
    required: true,
};
const OLLAMA: OutputLimit = OutputLimit {
    reads: &[NumPredict],
    always_written: &[NumPredict],
    required: false,
};
/// No output: no limit field belongs here.
const NO_OUTPUT: OutputLimit = OutputLimit {
    reads: &[],
    always_written: &[],
    required: false,
};

impl Api {
    /// Where this API's servers read the output limit.
    pub fn output_limit(self) -> &'static OutputLimit {
        match self {
            Api::OpenAiChat => &CHAT,
            Api::OpenAiCompletions => &COMPLETIONS,
            Api::OpenAiResponses => &RESPONSES,
            Api::AnthropicMessages => &MESSAGES,
            Api::OllamaGenerate | Api::OllamaChat => &OLLAMA,
            // `/invocations` is resolved to its body's API before reading.
            Api::OpenAiEmbeddings
            | Api::OllamaEmbed
            | Api::Scoring
            | Api::Invocations
            | Api::Passthrough(_)
            // A declared API's limit is at its own pointer.
            | Api::Declared(_)
            | Api::Other => &NO_OUTPUT,
        }
    }
}

/// The limit fields a body sent, as read when it was (so that deciding on
/// a rewrite needs no second read of the body): for each of
/// [`LimitField::ALL`], absent, or set to this non-negative integer (or to
/// something else: `Some(None)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SentLimits([Option<Option<u64>>; 5]);

impl SentLimits {
    pub fn of<'a>(body: impl View<'a>) -> SentLimits {
        SentLimits(LimitField::ALL.map(|f| f.get(body).map(View::u64)))
    }

    fn get(&self, field: LimitField) -> Option<Option<u64>> {
        let at = LimitField::ALL.iter().position(|f| *f == field)?;
        self.0.get(at).copied().flatten()
    }
}

impl OutputLimit {
    /// The fields the upstream body must carry the reserved limit in: the
    /// ones always written, and the ones of `reads` the client sent.
    pub fn written(&self, sent: &SentLimits) -> Vec<LimitField> {
        self.reads
            .iter()
            .copied()
            .filter(|f| self.always_written.contains(f) || sent.get(*f).is_some())
            .collect()
    }

    /// Does the body already carry exactly `max` in every field written?
    /// Then it goes upstream as the client sent it.
    pub fn carries(&self, sent: &SentLimits, max: u64) -> bool {
        self.written(sent)
            .iter()
            .all(|f| sent.get(*f) == Some(Some(max)))
    }
}

/// The maximum output per completion a body asks for: the largest of the
/// API's own limit fields (each checked against the model's cap, asked
/// only when one is set), or none. A limit field of another API, a value
/// that is not a non-negative integer (Ollama's negative `num_predict`
/// aside) or one above the cap is a 400 naming the field.
pub fn max_output_of<'a>(
    api: Api,
    body: impl View<'a>,
    output_cap: &dyn Fn() -> u64,
) -> Result<Option<u64>, BadBody> {
    match body.get("options").map(View::kind) {
        None | Some(Kind::Null | Kind::Object) => {}
        Some(_) => return Err(BadBody::at("options", "`options` must be an object")),
    }
    let limit = api.output_limit();
    let mut max_output = None;
    for field in LimitField::ALL {
        let Some(value) = field.get(body) else {
            continue;
        };
        let param = field.name();
        if !limit.reads.contains(&field) {
            return Err(BadBody::at(param, foreign(api, limit, param)));
        }
        let v = match value.u64() {
            Some(v) => v,
            // Ollama's "no limit" values: the model's default applies.
            None if matches!(field, NumPredict | NPredict)
                && value.i64().is_some_and(|v| v < 0) =>
            {
                continue
            }
            None => {
                return Err(BadBody::at(
                    param,
                    format!("`{param}` must be a non-negative integer"),
                ))
            }
        };
        let cap = output_cap();
        if v > cap {
            return Err(BadBody::at(
                param,
                format!("`{param}` is {v}, above the {cap} output tokens allowed for this model"),
            ));
        }
        max_output = Some(max_output.map_or(v, |m: u64| m.max(v)));
    }
    if limit.required && max_output.is_none() {
        if let Some(first) = limit.reads.first() {
            let param = first.name();
            return Err(BadBody::at(param, format!("`{param}` is required")));
        }
    }
    Ok(max_output)
}

/// Why a limit field of another API is refused.
fn foreign(api: Api, limit: &OutputLimit, param: &str) -> String {
    if limit.reads.is_empty() {
        return format!("`{param}` has no meaning here: this API generates no output");
    }
    let read: Vec<String> = limit
        .reads
        .iter()
        .map(|f| format!("`{}`", f.name()))
        .collect();
    format!(
        "`{param}` is not an output limit of this API ({api:?}): its servers read {} and would ignore it",
        read.join(" or ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CAP: u64 = 1_000;

    #[test]
    fn llamacpps_n_predict_is_read_on_chat_and_completions_and_its_largest_reserved() {
        let chat = Api::OpenAiChat;
        assert_eq!(
            read(chat, json!({"max_tokens": 4, "n_predict": 64})).unwrap(),
            Some(64)
        );
        assert_eq!(
            read(Api::OpenAiCompletions, json!({"n_predict": 9})).unwrap(),
            Some(9)
        );
        // llama.cpp's -1 is "no limit": the model's default is reserved
        // and written over it.
        assert_eq!(read(chat, json!({"n_predict": -1})).unwrap(), None);
        let e = read(Api::OpenAiResponses, json!({"n_predict": 9})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n_predict"));
        let e = read(Api::OllamaGenerate, json!({"n_predict": 9})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n_predict"));
    }

    fn read(api: Api, body: Value) -> Result<Option<u64>, BadBody> {
        assert!(body.is_object(), "not an object");
        max_output_of(api, &body, &|| CAP)
    }

    /// Every API × every limit field: what is reserved, or which field the
    /// 400 names.
    #[test]
    fn each_api_reserves_its_own_fields_and_refuses_the_others() {
        use Api::*;
        let generating = [
            OpenAiChat,
            OpenAiCompletions,
            OpenAiResponses,
            AnthropicMessages,
            OllamaGenerate,
            OllamaChat,
        ];
        let no_output = [OpenAiEmbeddings, OllamaEmbed, Scoring];
        for api in generating.into_iter().chain(no_output) {
            for field in LimitField::ALL {
                let mut body = json!({"model": "m"});
                field.set(&mut body, 7);
                let got = read(api, body.clone());
                if api.output_limit().reads.contains(&field) {
                    assert_eq!(got, Ok(Some(7)), "{api:?} {body}");
                } else {
                    let e = got.expect_err(&format!("{api:?} must refuse {body}"));
                    assert_eq!(e.param.as_deref(), Some(field.name()), "{api:?}");
                    assert!(
                        e.message.contains("ignore") || e.message.contains("no output"),
                        "{e:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_table_is_what_the_servers_read() {
        let reads =
            |api: Api| -> Vec<&str> { api.output_limit().reads.iter().map(|f| f.name()).collect() };
        assert_eq!(
            reads(Api::OpenAiChat),
            ["max_completion_tokens", "max_tokens", "n_predict"]
        );
        assert_eq!(reads(Api::OpenAiCompletions), ["max_tokens", "n_predict"]);
        assert_eq!(reads(Api::OpenAiResponses), ["max_output_tokens"]);
        assert_eq!(reads(Api::AnthropicMessages), ["max_tokens"]);
        assert_eq!(reads(Api::OllamaChat), ["options.num_predict"]);
        assert_eq!(reads(Api::OllamaGenerate), ["options.num_predict"]);
        for api in [Api::OpenAiEmbeddings, Api::OllamaEmbed, Api::Scoring] {
            assert!(reads(api).is_empty(), "{api:?}");
        }
    }

    #[test]
    fn of_two_chat_limits_the_larger_is_reserved_whichever_comes_first() {
        for body in [
            json!({"max_tokens": 10, "max_completion_tokens": 900}),
            json!({"max_completion_tokens": 900, "max_tokens": 10}),
            json!({"max_tokens": 900, "max_completion_tokens": 10}),
        ] {
            assert_eq!(read(Api::OpenAiChat, body.clone()), Ok(Some(900)), "{body}");
        }
        // Each is checked against the cap, the smaller one too.
        let e = read(
            Api::OpenAiChat,
            json!({"max_tokens": 1_001, "max_completion_tokens": 5}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = read(
            Api::OpenAiChat,
            json!({"max_tokens": 5, "max_completion_tokens": -1}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
    }

    #[test]
    fn existing_refusals_stay() {
        let param = |api, body| read(api, body).unwrap_err().param;
        for bad in [json!(-5), json!(1.5), json!("10"), json!(true)] {
            let body = json!({"max_tokens": bad});
            assert_eq!(
                param(Api::OpenAiCompletions, body).as_deref(),
                Some("max_tokens")
            );
        }
        assert_eq!(
            param(Api::OllamaChat, json!({"options": {"num_predict": 2.5}})).as_deref(),
            Some("options.num_predict")
        );
        assert_eq!(
            param(Api::OllamaChat, json!({"options": 3})).as_deref(),
            Some("options")
        );
        assert_eq!(
            param(Api::AnthropicMessages, json!({"model": "m"})).as_deref(),
            Some("max_tokens"),
            "required"
        );
        // Ollama's "no limit": the model's default.
        for v in [-1, -2] {
            assert_eq!(
                read(Api::OllamaGenerate, json!({"options": {"num_predict": v}})),
                Ok(None)
            );
        }
        // `null` is absent everywhere, a foreign field too.
        assert_eq!(
            read(
                Api::OpenAiChat,
                json!({"max_output_tokens": null, "options": {"num_predict": null}})
            ),
            Ok(None)
        );
        // `options` without `num_predict` is not a limit (vLLM ignores it).
        assert_eq!(
            read(Api::OpenAiChat, json!({"options": {"temperature": 0}})),
            Ok(None)
        );
    }

    #[test]
    fn written_fields_are_the_servers_fields_the_client_used_plus_the_always_written() {
        let written = |api: Api, body: Value| -> Vec<&str> {
            api.output_limit()
                .written(&SentLimits::of(&body))
                .iter()
                .map(|f| f.name())
                .collect()
        };
        assert_eq!(written(Api::OpenAiChat, json!({})), ["max_tokens"]);
        assert_eq!(
            written(Api::OpenAiChat, json!({"max_completion_tokens": 3})),
            ["max_completion_tokens", "max_tokens"]
        );
        assert_eq!(written(Api::OpenAiCompletions, json!({})), ["max_tokens"]);
        assert_eq!(
            written(Api::OpenAiResponses, json!({})),
            ["max_output_tokens"]
        );
        assert_eq!(
            written(Api::OllamaChat, json!({"options": {"num_predict": -1}})),
            ["options.num_predict"]
        );
        assert!(written(Api::OpenAiEmbeddings, json!({"input": "x"})).is_empty());
    }
}
