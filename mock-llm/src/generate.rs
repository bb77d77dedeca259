//! What every API needs to write an answer, decided once per request.

use axum::body::Bytes;
use serde_json::Value;

use crate::knobs::UsageMode;

/// Which inference API a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
    OllamaGenerate,
    OllamaChat,
    /// Anthropic Messages (`/v1/messages`), as vLLM serves it too.
    Messages,
    /// Ollama `/api/embed` (`input`) and the older `/api/embeddings`
    /// (`prompt`).
    OllamaEmbed,
    OllamaEmbeddings,
    /// vLLM's scoring and pooling family.
    Score,
    Rerank,
    Pooling,
    Classify,
    Tokenize,
    Detokenize,
}

impl Api {
    /// The API of an `/invocations` body, as vLLM dispatches it by shape:
    /// `messages` → chat, `prompt` → completion, `input` → embedding.
    pub fn of_invocation(body: &Value) -> Option<Api> {
        let has = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
        if has("messages") {
            Some(Api::ChatCompletions)
        } else if has("prompt") {
            Some(Api::Completions)
        } else if has("input") {
            Some(Api::Embeddings)
        } else {
            None
        }
    }

    /// Does this API generate text (else its output is 0)?
    pub fn generates(self) -> bool {
        matches!(
            self,
            Api::ChatCompletions
                | Api::Completions
                | Api::Responses
                | Api::OllamaGenerate
                | Api::OllamaChat
                | Api::Messages
        )
    }

    /// Whether the request asks for a stream. Ollama streams unless told
    /// `"stream": false`; OpenAI only when told `"stream": true`; embeddings
    /// never do.
    pub fn wants_stream(self, body: &Value) -> bool {
        let flag = body.get("stream").and_then(Value::as_bool);
        match self {
            Api::OllamaGenerate | Api::OllamaChat => flag != Some(false),
            api if !api.generates() => false,
            _ => flag == Some(true),
        }
    }
}

/// The decided shape of one answer; the API modules only format it.
#[derive(Debug, Clone)]
pub struct Generation<'a> {
    /// Unique per server run; used in `id` fields.
    pub id: u64,
    /// Unix seconds.
    pub created: u64,
    /// RFC 3339, for Ollama's `created_at`.
    pub created_at: String,
    /// The model named in the request, echoed back.
    pub model: &'a str,
    pub body: &'a Value,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// `stop`, or `length` when the request's own limit cut the output.
    pub finish_reason: &'static str,
    pub usage: UsageMode,
    pub stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
    /// Prompts answered (a `/v1/completions` prompt array), each with
    /// `n` choices returned out of `best_of` generated. All at least 1.
    pub prompts: u64,
    pub n: u64,
    pub best_of: u64,
    /// The server played, and the usage parts it reports.
    pub personality: crate::personality::Personality,
    pub details: crate::usage::Details,
    /// Where content chunks of a stream carry usage.
    pub chunk_usage: crate::personality::StreamUsage,
}

impl Generation<'_> {
    /// Completions generated: every prompt × `max(n, best_of)`; each
    /// produces `output_tokens`, and the usage counts them all.
    pub fn generated(&self) -> u64 {
        self.prompts.saturating_mul(self.n.max(self.best_of))
    }

    /// Output tokens of the whole answer, every completion generated.
    pub fn total_output(&self) -> u64 {
        self.output_tokens.saturating_mul(self.generated())
    }

    /// Choices returned: every prompt × `n`, indexed prompt by prompt.
    pub fn returned(&self) -> u64 {
        self.prompts.saturating_mul(self.n)
    }
}

/// Prompts in a completions `prompt`, as OpenAI and vLLM count them: a
/// string or a flat token-id array is one, an array of strings or of
/// token-id arrays one per item.
pub fn prompt_count(body: &Value) -> u64 {
    match body.get("prompt") {
        Some(Value::Array(items)) if !items.iter().all(Value::is_number) => {
            (items.len() as u64).max(1)
        }
        _ => 1,
    }
}

/// A formatted answer: one JSON document, or stream frames.
#[derive(Debug)]
pub enum Reply {
    Json(Value),
    Stream {
        content_type: &'static str,
        frames: Vec<Bytes>,
    },
}

pub const SSE: &str = "text/event-stream";
pub const NDJSON: &str = "application/x-ndjson";

/// The `i`-th streamed piece of the output: `tok0`, then ` tok1`, ` tok2`, …
/// so the pieces concatenate to [`crate::tokens::output_text`].
pub fn piece(i: u64) -> String {
    let word = crate::tokens::output_word(i);
    if i == 0 {
        word
    } else {
        format!(" {word}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stream_defaults_differ_by_api() {
        assert!(!Api::ChatCompletions.wants_stream(&json!({})));
        assert!(Api::ChatCompletions.wants_stream(&json!({"stream": true})));
        assert!(Api::OllamaChat.wants_stream(&json!({})));
        assert!(!Api::OllamaGenerate.wants_stream(&json!({"stream": false})));
        assert!(!Api::Embeddings.wants_stream(&json!({"stream": true})));
    }

    #[test]
    fn pieces_concatenate_to_the_output_text() {
        let joined: String = (0..4).map(piece).collect();
        assert_eq!(joined, crate::tokens::output_text(4));
    }
}
