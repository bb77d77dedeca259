//! Input-only answers: Ollama's embeddings, vLLM's score, rerank, pooling,
//! classify, tokenize and detokenize — with usage where vLLM reports it.

use serde_json::{json, Value};

use crate::generate::{Api, Generation, Reply};
use crate::usage;

/// Items of a field: an array's length, else 1 (0 when absent).
fn items(body: &Value, field: &str) -> usize {
    match body.get(field) {
        Some(Value::Array(a)) => a.len(),
        Some(Value::Null) | None => 0,
        Some(_) => 1,
    }
}

fn vector(i: usize) -> Vec<f64> {
    (0..8).map(|d| ((i + d) % 8) as f64 / 8.0).collect()
}

pub fn answer(api: Api, g: &Generation) -> Reply {
    let body = g.body;
    let input = g.input_tokens;
    let id = format!("mock-{}", g.id);
    let with = |mut v: Value, u: Option<Value>| {
        if let Some(u) = u {
            v["usage"] = u;
        }
        v
    };
    let v = match api {
        Api::OllamaEmbed => {
            let n = items(body, "input").max(1);
            let mut v = json!({"model": g.model,
                               "embeddings": (0..n).map(vector).collect::<Vec<_>>()});
            if let Some(obj) = v.as_object_mut() {
                usage::add_ollama(obj, g.usage, input, 0);
                obj.remove("eval_count");
            }
            v
        }
        // The older Ollama endpoint reports no counts at all.
        Api::OllamaEmbeddings => json!({"embedding": vector(0)}),
        Api::Score => {
            let n = items(body, "text_2").max(1);
            let data: Vec<Value> = (0..n)
                .map(|i| json!({"index": i, "object": "score", "score": 1.0 / (i as f64 + 1.0)}))
                .collect();
            with(
                json!({"id": id, "object": "list", "model": g.model, "data": data}),
                usage::embeddings(g.usage, input),
            )
        }
        Api::Rerank => {
            let n = items(body, "documents");
            let results: Vec<Value> = (0..n)
                .map(|i| json!({"index": i, "relevance_score": 1.0 / (i as f64 + 1.0)}))
                .collect();
            // Jina/Cohere shape: a total only.
            let total = usage::embeddings(g.usage, input)
                .map(|u| json!({"total_tokens": u["total_tokens"]}));
            with(
                json!({"id": id, "model": g.model, "results": results}),
                total,
            )
        }
        Api::Pooling | Api::Classify => {
            let n = items(body, "input").max(1);
            let data: Vec<Value> = (0..n)
                .map(|i| match api {
                    Api::Classify => {
                        json!({"index": i, "label": "mock", "probs": [1.0], "num_classes": 1})
                    }
                    _ => json!({"index": i, "object": "pooling", "data": vector(i)}),
                })
                .collect();
            with(
                json!({"id": id, "object": "list", "model": g.model, "data": data}),
                usage::embeddings(g.usage, input),
            )
        }
        Api::Tokenize => {
            let tokens: Vec<u64> = (0..input).collect();
            json!({"count": input, "max_model_len": 8192, "tokens": tokens})
        }
        Api::Detokenize => json!({"prompt": "tok0"}),
        // Not input-only: the caller never sends these here.
        _ => json!({}),
    };
    Reply::Json(v)
}
