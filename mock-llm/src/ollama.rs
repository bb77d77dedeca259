//! Ollama-compatible answers: `/api/generate`, `/api/chat`, `/api/ps`.
//! Streams are NDJSON; the last line has `done: true` and the counts.

use serde_json::{json, Map, Value};

use crate::framing::ndjson_line;
use crate::generate::{piece, Generation, Reply, NDJSON};
use crate::tokens::output_text;
use crate::usage;

/// Generate and chat differ only in where the text goes.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Generate,
    Chat,
}

impl Shape {
    fn with_text(self, obj: &mut Map<String, Value>, text: String) {
        match self {
            Shape::Generate => obj.insert("response".into(), json!(text)),
            Shape::Chat => obj.insert(
                "message".into(),
                json!({"role": "assistant", "content": text}),
            ),
        };
    }
}

pub fn generate(g: &Generation) -> Reply {
    answer(g, Shape::Generate)
}

pub fn chat(g: &Generation) -> Reply {
    answer(g, Shape::Chat)
}

fn answer(g: &Generation, shape: Shape) -> Reply {
    let object = |text: String, done: bool| {
        let mut obj = Map::new();
        obj.insert("model".into(), json!(g.model));
        obj.insert("created_at".into(), json!(g.created_at));
        shape.with_text(&mut obj, text);
        obj.insert("done".into(), json!(done));
        obj
    };
    let last = |text: String| {
        let mut obj = object(text, true);
        obj.insert("done_reason".into(), json!(g.finish_reason));
        obj.insert("total_duration".into(), json!(0));
        obj.insert("load_duration".into(), json!(0));
        obj.insert("prompt_eval_duration".into(), json!(0));
        obj.insert("eval_duration".into(), json!(0));
        usage::add_ollama_for(
            &mut obj,
            g.usage,
            g.input_tokens,
            g.output_tokens,
            &g.details,
        );
        Value::Object(obj)
    };
    if !g.stream {
        return Reply::Json(last(output_text(g.output_tokens)));
    }
    let mut frames: Vec<_> = (0..g.output_tokens)
        .map(|i| ndjson_line(&Value::Object(object(piece(i), false))))
        .collect();
    frames.push(ndjson_line(&last(String::new())));
    Reply::Stream {
        content_type: NDJSON,
        frames,
    }
}

/// `/api/ps`: the models this server "has loaded".
pub fn ps(models: &[String]) -> Value {
    let loaded: Vec<Value> = models
        .iter()
        .map(|model| {
            json!({
                "name": model, "model": model, "size": 0, "digest": "mock",
                "details": {"format": "gguf", "family": "mock", "parameter_size": "0B",
                            "quantization_level": "none"},
                "expires_at": "2099-01-01T00:00:00Z", "size_vram": 0,
            })
        })
        .collect();
    json!({"models": loaded})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::UsageMode;

    fn generation(body: &Value, stream: bool) -> Generation<'_> {
        Generation {
            id: 1,
            created: 0,
            created_at: "1970-01-01T00:00:00Z".into(),
            model: "llama",
            body,
            input_tokens: 4,
            output_tokens: 2,
            finish_reason: "stop",
            usage: UsageMode::Normal,
            stream,
            include_usage: false,
            prompts: 1,
            n: 1,
            best_of: 1,
            personality: Default::default(),
            details: Default::default(),
            chunk_usage: Default::default(),
        }
    }

    #[test]
    fn chat_stream_is_ndjson_ending_done_with_counts() {
        let body = json!({});
        let Reply::Stream {
            frames,
            content_type,
        } = chat(&generation(&body, true))
        else {
            panic!("expected a stream");
        };
        assert_eq!(content_type, NDJSON);
        assert_eq!(frames.len(), 3);
        let lines: Vec<Value> = frames
            .iter()
            .map(|f| {
                assert!(f.ends_with(b"\n") && f.iter().filter(|b| **b == b'\n').count() == 1);
                serde_json::from_slice(f).unwrap()
            })
            .collect();
        assert_eq!(lines[0]["message"]["content"], "tok0");
        assert_eq!(lines[1]["message"]["content"], " tok1");
        assert_eq!(lines[0]["done"], false);
        assert_eq!(lines[2]["done"], true);
        assert_eq!(lines[2]["prompt_eval_count"], 4);
        assert_eq!(lines[2]["eval_count"], 2);
    }

    #[test]
    fn generate_non_stream_is_one_final_object() {
        let body = json!({});
        let Reply::Json(v) = generate(&generation(&body, false)) else {
            panic!("expected json");
        };
        assert_eq!(v["response"], "tok0 tok1");
        assert_eq!(v["done"], true);
        assert_eq!(v["model"], "llama");
        assert_eq!(v["eval_count"], 2);
    }
}
