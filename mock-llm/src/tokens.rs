//! The deterministic token rule, so tests can predict every count.
//!
//! * **Input tokens** = `ceil(chars / 4)` over all text in the request, at
//!   least 1. Characters are Unicode scalar values, summed over every text
//!   field before rounding. Text is read from:
//!   `messages[].content` (a string, or an array of parts whose `text` is read),
//!   `prompt` (a string or an array of strings), `input` (a string, an array of
//!   strings, or an array of Responses-API items whose `content` is a string or
//!   parts with `text`), `system` (Ollama) and `instructions` (Responses API),
//!   and Ollama's `template`, which its generate renders the prompt through,
//!   so its text is input too (ollama/ollama `server/routes.go`,
//!   `GenerateHandler`: a request's `template` replaces the model's).
//!   Ollama's `context` (token ids of an earlier exchange, detokenized and
//!   prepended to the prompt by the same handler) adds one token per id.
//!   Other token-id arrays and every other field (tools, schemas, options)
//!   are ignored.
//! * **Output tokens** = the `x-mock-output-tokens` knob when given (not
//!   capped by the request); else the request's limit (`max_tokens`, `max_completion_tokens`,
//!   `max_output_tokens`, `options.num_predict`; negative means unlimited)
//!   capped at [`DEFAULT_OUTPUT_TOKENS`]; else [`DEFAULT_OUTPUT_TOKENS`].
//! * **Output text** = that many words `tok0 tok1 …`, one token per word.

use serde_json::Value;

/// Output length when neither the knob nor the request asks for less.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 16;

/// Input tokens of a parsed request body: `ceil(chars / 4)`, at least 1.
pub fn input_tokens(body: &Value) -> u64 {
    let mut chars = 0u64;
    for key in [
        "messages",
        "prompt",
        "input",
        "system",
        "instructions",
        "template",
        // Scoring: every text once (the query once per document is added
        // by `paired_chars`).
        "text_1",
        "text_2",
        "query",
        "documents",
    ] {
        if let Some(v) = body.get(key) {
            chars += text_chars(v);
        }
    }
    chars += paired_chars(body);
    let context = body
        .get("context")
        .and_then(Value::as_array)
        .map_or(0, |ids| ids.len() as u64);
    chars.div_ceil(4).max(1).saturating_add(context)
}

/// A cross-encoder reads the query again with every document after the
/// first (`text_1` with each `text_2`, `query` with each of `documents`).
fn paired_chars(body: &Value) -> u64 {
    [("text_1", "text_2"), ("query", "documents")]
        .iter()
        .filter_map(|(one, many)| {
            let text = body.get(*one).filter(|v| v.is_string())?;
            let n = body.get(*many)?.as_array()?.len() as u64;
            Some(text_chars(text).saturating_mul(n.saturating_sub(1)))
        })
        .sum()
}

/// Characters of text in a content value: a string, an array of strings or
/// parts, or a message/item object with `content` or `text`.
fn text_chars(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.chars().count() as u64,
        Value::Array(items) => items.iter().map(text_chars).sum(),
        Value::Object(map) => ["content", "text"]
            .iter()
            .filter_map(|k| map.get(*k))
            .map(text_chars)
            .sum(),
        _ => 0,
    }
}

/// The output limit the request itself asks for, if any.
pub fn requested_output_limit(body: &Value) -> Option<u64> {
    let candidates = [
        body.get("max_tokens"),
        body.get("max_completion_tokens"),
        body.get("max_output_tokens"),
        body.get("options").and_then(|o| o.get("num_predict")),
    ];
    // Ollama uses -1 (and -2) for "no limit"; a negative limit is no limit here.
    candidates
        .into_iter()
        .flatten()
        .find_map(|v| v.as_i64())
        .and_then(|n| u64::try_from(n).ok())
}

/// How many tokens to generate, and whether the request's limit cut it short
/// (which makes the finish reason `length`).
pub fn output_tokens(body: &Value, knob: Option<u64>) -> (u64, bool) {
    generate(requested_output_limit(body), knob, false, u64::MAX)
}

/// How many tokens to generate given the limit the server obeys (`limit`)
/// and what its context leaves (`ceiling`): the knob's count when given;
/// with `allowed`, everything the limit (else the ceiling) allows, as a
/// model that never stops early; otherwise the limit capped at
/// [`DEFAULT_OUTPUT_TOKENS`]. The flag says whether a limit cut it.
pub fn generate(limit: Option<u64>, knob: Option<u64>, allowed: bool, ceiling: u64) -> (u64, bool) {
    if let Some(n) = knob {
        return (n, false);
    }
    if allowed {
        let cap = ceiling.min(MAX_ALLOWED_OUTPUT);
        return match limit {
            Some(l) => (l.min(cap), true),
            None => (cap, true),
        };
    }
    match limit {
        Some(limit) if limit <= DEFAULT_OUTPUT_TOKENS => (limit.min(ceiling), true),
        _ => (DEFAULT_OUTPUT_TOKENS.min(ceiling), false),
    }
}

/// "Generate all that is allowed" stops here, to keep a reply in memory.
pub const MAX_ALLOWED_OUTPUT: u64 = 1_000_000;

/// The words of the output, one token each: `tok0`, `tok1`, …
pub fn output_word(i: u64) -> String {
    format!("tok{i}")
}

/// The full output text: `tok0 tok1 … tok{n-1}`.
pub fn output_text(n: u64) -> String {
    (0..n).map(output_word).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_is_ceil_of_chars_over_four_with_minimum_one() {
        assert_eq!(input_tokens(&json!({})), 1);
        assert_eq!(input_tokens(&json!({"prompt": ""})), 1);
        assert_eq!(input_tokens(&json!({"prompt": "abcd"})), 1);
        assert_eq!(input_tokens(&json!({"prompt": "abcde"})), 2);
        assert_eq!(input_tokens(&json!({"prompt": "a".repeat(400)})), 100);
    }

    #[test]
    fn chars_are_summed_across_fields_before_rounding() {
        // 2 + 3 + 3 = 8 chars -> 2 tokens (per-field rounding would give 3).
        let body = json!({"messages": [
            {"role": "system", "content": "ab"},
            {"role": "user", "content": [{"type": "text", "text": "cde"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": "fgh"}
        ]});
        assert_eq!(input_tokens(&body), 2);
    }

    #[test]
    fn ollama_renders_its_template_and_prepends_its_context() {
        let template = format!("{}{{{{ .Prompt }}}}", "x".repeat(400));
        let body = json!({"prompt": "hi", "template": template, "context": [1, 2, 3]});
        // (2 + 400 + 14) chars / 4 = 104, and three ids.
        assert_eq!(input_tokens(&body), 104 + 3);
    }

    #[test]
    fn counts_unicode_scalars_not_bytes() {
        assert_eq!(input_tokens(&json!({"prompt": "ééééé"})), 2);
    }

    #[test]
    fn reads_prompt_arrays_responses_input_and_ollama_system() {
        assert_eq!(input_tokens(&json!({"prompt": ["abcd", "efgh"]})), 2);
        assert_eq!(input_tokens(&json!({"input": "abcdefgh"})), 2);
        let responses = json!({"instructions": "abcd", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "efgh"}]},
            {"role": "user", "content": "ijkl"}
        ]});
        assert_eq!(input_tokens(&responses), 3);
        assert_eq!(
            input_tokens(&json!({"system": "abcd", "prompt": "efgh"})),
            2
        );
        // Token-id input carries no text.
        assert_eq!(input_tokens(&json!({"input": [1, 2, 3, 4, 5, 6]})), 1);
    }

    #[test]
    fn ignores_fields_that_are_not_text_content() {
        let body = json!({"model": "a-very-long-model-name", "prompt": "abcd",
                          "tools": [{"type": "function", "function": {"name": "xxxxxxxx"}}]});
        assert_eq!(input_tokens(&body), 1);
    }

    #[test]
    fn output_follows_knob_then_limit_then_default() {
        assert_eq!(output_tokens(&json!({}), None), (16, false));
        assert_eq!(output_tokens(&json!({"max_tokens": 5}), None), (5, true));
        assert_eq!(
            output_tokens(&json!({"max_completion_tokens": 3}), None),
            (3, true)
        );
        assert_eq!(
            output_tokens(&json!({"max_output_tokens": 7}), None),
            (7, true)
        );
        assert_eq!(
            output_tokens(&json!({"options": {"num_predict": 2}}), None),
            (2, true)
        );
        assert_eq!(
            output_tokens(&json!({"max_tokens": 500}), None),
            (16, false)
        );
        assert_eq!(
            output_tokens(&json!({"options": {"num_predict": -1}}), None),
            (16, false)
        );
        // The knob wins and is not capped.
        assert_eq!(
            output_tokens(&json!({"max_tokens": 5}), Some(40)),
            (40, false)
        );
    }

    #[test]
    fn allowed_generates_the_whole_limit_or_the_context() {
        assert_eq!(generate(Some(500), None, true, 4000), (500, true));
        assert_eq!(generate(None, None, true, 4000), (4000, true));
        assert_eq!(generate(Some(9000), None, true, 4000), (4000, true));
        assert_eq!(generate(Some(500), None, false, 4000), (16, false));
        assert_eq!(generate(Some(500), Some(3), true, 4000), (3, false));
    }

    #[test]
    fn output_text_is_one_word_per_token() {
        assert_eq!(output_text(0), "");
        assert_eq!(output_text(3), "tok0 tok1 tok2");
    }
}
