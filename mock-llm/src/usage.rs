//! Where each API puts its usage, and how the `x-mock-usage` knob bends it.

use serde_json::{json, Map, Value};

use crate::knobs::UsageMode;

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

/// OpenAI embeddings `usage` (no completion tokens).
pub fn embeddings(mode: UsageMode, input: u64) -> Option<Value> {
    let [i, _, _] = counts(mode, input, 0)?;
    Some(json!({"prompt_tokens": i.clone(), "total_tokens": i}))
}

/// Responses API `usage`.
pub fn responses(mode: UsageMode, input: u64, output: u64) -> Option<Value> {
    let [i, o, t] = counts(mode, input, output)?;
    Some(json!({
        "input_tokens": i, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": o, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": t,
    }))
}

/// Anthropic Messages `usage`.
pub fn anthropic(mode: UsageMode, input: u64, output: u64) -> Option<Value> {
    let [i, o, _] = counts(mode, input, output)?;
    Some(json!({"input_tokens": i, "output_tokens": o}))
}

/// Ollama's counts on the final (`done: true`) object.
pub fn add_ollama(obj: &mut Map<String, Value>, mode: UsageMode, input: u64, output: u64) {
    if let Some([i, o, _]) = counts(mode, input, output) {
        obj.insert("prompt_eval_count".into(), i);
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
}
