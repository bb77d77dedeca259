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
}

impl Api {
    /// Whether the request asks for a stream. Ollama streams unless told
    /// `"stream": false`; OpenAI only when told `"stream": true`; embeddings
    /// never do.
    pub fn wants_stream(self, body: &Value) -> bool {
        let flag = body.get("stream").and_then(Value::as_bool);
        match self {
            Api::Embeddings => false,
            Api::OllamaGenerate | Api::OllamaChat => flag != Some(false),
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
