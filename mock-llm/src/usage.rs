//! Where each API puts its usage, and how the `x-mock-usage` knob bends it.

use serde_json::{json, Map, Value};

use crate::knobs::UsageMode;
use crate::personality::Personality;

/// The parts of a count that servers report apart: prompt tokens served
/// from a prefix cache (`cached`), written to it (`cache_write`, Anthropic
/// only), and reasoning tokens inside the output (`reasoning`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Details {
    pub cached: u64,
    pub cache_write: u64,
    pub reasoning: u64,
    /// Ollama before ollama/ollama#16428 (June 2026) counted only the
    /// prompt tokens it evaluated: a prompt-cache hit lowered
    /// `prompt_eval_count`, and a full hit left it out (`omitempty`).
    pub ollama_uncounted_cache: bool,
}

/// A knob-bent number: the real count, or what `mode` makes of it.
fn bent(mode: UsageMode, n: u64) -> Value {
    match mode {
        UsageMode::Normal | UsageMode::Missing => json!(n),
        UsageMode::Garbage => json!("some"),
        UsageMode::Negative => json!(-(n as i64)),
        UsageMode::Huge => json!(HUGE),
    }
}

const HUGE: i64 = 1_000_000_000_000_000;

/// (input, output, total) as the knob wants them written, or `None` to omit.
fn counts(mode: UsageMode, input: u64, output: u64) -> Option<[Value; 3]> {
    let (i, o) = (input as i64, output as i64);
    match mode {
        UsageMode::Normal => Some([json!(i), json!(o), json!(i + o)]),
        UsageMode::Missing => None,
        UsageMode::Garbage => Some([json!("many"), json!("a few"), json!("n/a")]),
        UsageMode::Negative => Some([json!(-i), json!(-o), json!(-(i + o))]),
        UsageMode::Huge => Some([json!(HUGE), json!(HUGE), json!(2 * HUGE)]),
    }
}

/// OpenAI chat/completions `usage`.
pub fn openai(mode: UsageMode, input: u64, output: u64) -> Option<Value> {
    let [i, o, t] = counts(mode, input, output)?;
    Some(json!({"prompt_tokens": i, "completion_tokens": o, "total_tokens": t}))
}

/// Chat/completions `usage` as `p` reports it. `prompt_tokens` includes
/// cached tokens and `completion_tokens` includes reasoning tokens (OpenAI
/// API reference, the chat completion object's `usage`).
/// * OpenAI always sends `prompt_tokens_details` and
///   `completion_tokens_details`;
/// * vLLM sends `prompt_tokens_details.cached_tokens` only (with
///   `--enable-prompt-tokens-details`, modelled as "when some were
///   cached") and no completion details: its UsageInfo has none
///   (vllm/entrypoints/openai/engine/protocol.py);
/// * Ollama sends the three totals only (ollama openai/openai.go Usage);
/// * mock-llm's own adds the OpenAI details only when a knob set them.
pub fn openai_for(
    p: Personality,
    mode: UsageMode,
    input: u64,
    output: u64,
    d: &Details,
) -> Option<Value> {
    let mut u = openai(mode, input, output)?;
    let prompt = json!({"cached_tokens": bent(mode, d.cached), "audio_tokens": 0});
    let completion = json!({"reasoning_tokens": bent(mode, d.reasoning), "audio_tokens": 0,
                            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0});
    let noted = d.cached > 0 || d.reasoning > 0;
    match p {
        Personality::Openai => {
            u["prompt_tokens_details"] = prompt;
            u["completion_tokens_details"] = completion;
        }
        Personality::Mock if noted => {
            u["prompt_tokens_details"] = prompt;
            u["completion_tokens_details"] = completion;
        }
        Personality::Vllm if d.cached > 0 => {
            u["prompt_tokens_details"] = json!({"cached_tokens": bent(mode, d.cached)});
        }
        _ => {}
    }
    Some(u)
}

/// OpenAI embeddings `usage` (no completion tokens).
pub fn embeddings(mode: UsageMode, input: u64) -> Option<Value> {
    let [i, _, _] = counts(mode, input, 0)?;
    Some(json!({"prompt_tokens": i.clone(), "total_tokens": i}))
}

/// Responses API `usage`: `input_tokens` includes the cached ones (and a
/// stored conversation carried by `previous_response_id`), `output_tokens`
/// the reasoning ones (OpenAI API reference, the response object's `usage`;
/// vLLM ResponseUsage likewise).
pub fn responses(mode: UsageMode, input: u64, output: u64) -> Option<Value> {
    responses_for(mode, input, output, &Details::default())
}

pub fn responses_for(mode: UsageMode, input: u64, output: u64, d: &Details) -> Option<Value> {
    let [i, o, t] = counts(mode, input, output)?;
    Some(json!({
        "input_tokens": i, "input_tokens_details": {"cached_tokens": bent(mode, d.cached)},
        "output_tokens": o, "output_tokens_details": {"reasoning_tokens": bent(mode, d.reasoning)},
        "total_tokens": t,
    }))
}

/// Anthropic Messages `usage`.
pub fn anthropic(mode: UsageMode, input: u64, output: u64) -> Option<Value> {
    let [i, o, _] = counts(mode, input, output)?;
    Some(json!({"input_tokens": i, "output_tokens": o}))
}

/// Anthropic Messages `usage` as `p` reports it: `input_tokens` counts only
/// the tokens after the last cache breakpoint; cache reads and writes are
/// reported beside it, NOT inside it (Anthropic docs, "Prompt caching":
/// total input = input_tokens + cache_creation_input_tokens +
/// cache_read_input_tokens). Anthropic always sends both cache fields;
/// mock-llm's own only when a knob set them.
pub fn anthropic_for(
    p: Personality,
    mode: UsageMode,
    input: u64,
    output: u64,
    d: &Details,
) -> Option<Value> {
    let cached = d.cached.min(input);
    let write = d.cache_write.min(input - cached);
    let mut u = anthropic(mode, input - cached - write, output)?;
    if p != Personality::Mock || cached > 0 || write > 0 {
        u["cache_creation_input_tokens"] = bent(mode, write);
        u["cache_read_input_tokens"] = bent(mode, cached);
    }
    Some(u)
}

/// Ollama's counts on the final (`done: true`) object.
pub fn add_ollama(obj: &mut Map<String, Value>, mode: UsageMode, input: u64, output: u64) {
    add_ollama_for(obj, mode, input, output, &Details::default());
}

/// Ollama's counts; current Ollama includes cached prompt tokens in
/// `prompt_eval_count` (llm/llama_server.go: cache_n + prompt_n), older
/// Ollama did not (see [`Details::ollama_uncounted_cache`]).
pub fn add_ollama_for(
    obj: &mut Map<String, Value>,
    mode: UsageMode,
    input: u64,
    output: u64,
    d: &Details,
) {
    let evaluated = if d.ollama_uncounted_cache {
        input - d.cached.min(input)
    } else {
        input
    };
    if let Some([i, o, _]) = counts(mode, evaluated, output) {
        if evaluated > 0 || mode != UsageMode::Normal {
            obj.insert("prompt_eval_count".into(), i);
        }
        obj.insert("eval_count".into(), o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_shape_the_counts() {
        assert_eq!(
            openai(UsageMode::Normal, 3, 4),
            Some(json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}))
        );
        assert_eq!(openai(UsageMode::Missing, 3, 4), None);
        assert_eq!(
            openai(UsageMode::Negative, 3, 4).unwrap()["total_tokens"],
            json!(-7)
        );
        assert!(openai(UsageMode::Garbage, 3, 4).unwrap()["prompt_tokens"].is_string());
        assert_eq!(
            responses(UsageMode::Huge, 3, 4).unwrap()["input_tokens"],
            json!(HUGE)
        );
        assert_eq!(
            embeddings(UsageMode::Normal, 5),
            Some(json!({"prompt_tokens": 5, "total_tokens": 5}))
        );
        let mut m = Map::new();
        add_ollama(&mut m, UsageMode::Normal, 2, 9);
        assert_eq!(
            Value::Object(m),
            json!({"prompt_eval_count": 2, "eval_count": 9})
        );
    }

    #[test]
    fn details_as_each_server_reports_them() {
        let d = Details {
            cached: 3,
            reasoning: 2,
            ..Details::default()
        };
        let n = UsageMode::Normal;
        let o = openai_for(Personality::Openai, n, 10, 5, &d).unwrap();
        assert_eq!(
            o["prompt_tokens"], 10,
            "cached tokens are inside prompt_tokens"
        );
        assert_eq!(o["prompt_tokens_details"]["cached_tokens"], 3);
        assert_eq!(o["completion_tokens_details"]["reasoning_tokens"], 2);
        let v = openai_for(Personality::Vllm, n, 10, 5, &d).unwrap();
        assert_eq!(v["prompt_tokens_details"], json!({"cached_tokens": 3}));
        assert!(v.get("completion_tokens_details").is_none());
        let plain = openai_for(Personality::Mock, n, 10, 5, &Details::default()).unwrap();
        assert_eq!(plain, openai(n, 10, 5).unwrap());
        assert!(openai_for(Personality::Ollama, n, 10, 5, &d)
            .unwrap()
            .get("prompt_tokens_details")
            .is_none());
        let a = anthropic_for(
            Personality::Anthropic,
            n,
            10,
            5,
            &Details {
                cached: 6,
                cache_write: 3,
                ..Details::default()
            },
        )
        .unwrap();
        assert_eq!(
            a,
            json!({"input_tokens": 1, "output_tokens": 5,
                   "cache_creation_input_tokens": 3, "cache_read_input_tokens": 6})
        );
        let mut m = Map::new();
        add_ollama_for(
            &mut m,
            n,
            4,
            2,
            &Details {
                cached: 4,
                ..Details::default()
            },
        );
        assert_eq!(
            m["prompt_eval_count"], 4,
            "current Ollama counts cached tokens"
        );
        let mut m = Map::new();
        let legacy = Details {
            cached: 4,
            ollama_uncounted_cache: true,
            ..Details::default()
        };
        add_ollama_for(&mut m, n, 4, 2, &legacy);
        assert!(
            m.get("prompt_eval_count").is_none(),
            "a full hit left it out"
        );
    }
}
