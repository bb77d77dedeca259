//! OpenAI-compatible answers: chat completions, completions, embeddings,
//! Responses API, model list.

use axum::body::Bytes;
use serde_json::{json, Map, Value};

use crate::framing::{sse_data, sse_event, SSE_DONE};
use crate::generate::{piece, Generation, Reply, SSE};
use crate::personality::{Personality, StreamUsage};
use crate::tokens::output_text;
use crate::usage;

/// The answer's whole `usage`, as the personality reports it.
fn full_usage(g: &Generation) -> Option<Value> {
    usage::openai_for(
        g.personality,
        g.usage,
        g.input_tokens,
        g.total_output(),
        &g.details,
    )
}

/// The `usage` a content chunk carries, `so_far` output tokens into its
/// choice: nothing, null, zeros (Ollama), or the running count (vLLM's
/// `continuous_usage_stats`).
fn chunk_usage(g: &Generation, so_far: u64) -> Option<Value> {
    match g.chunk_usage {
        StreamUsage::Omitted => None,
        StreamUsage::Null => Some(Value::Null),
        StreamUsage::Zeros => {
            Some(json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}))
        }
        StreamUsage::Continuous => usage::openai(g.usage, g.input_tokens, so_far),
    }
}

/// Sets `usage` on an object, or leaves it out when the knob says `missing`.
fn with_usage(mut v: Value, usage: Option<Value>) -> Value {
    if let (Some(obj), Some(u)) = (v.as_object_mut(), usage) {
        obj.insert("usage".into(), u);
    }
    v
}

/// Closes an OpenAI SSE stream: the usage chunk when asked for (and not
/// knocked out by the knob), then `[DONE]`.
fn finish_sse(frames: &mut Vec<Bytes>, g: &Generation, base: &Value) {
    if g.include_usage {
        if let Some(u) = full_usage(g) {
            let mut chunk = base.clone();
            chunk["choices"] = json!([]);
            chunk["usage"] = u;
            frames.push(sse_data(&chunk));
        }
    }
    frames.push(Bytes::from_static(SSE_DONE));
}

pub fn chat_completion(g: &Generation) -> Reply {
    let id = format!("chatcmpl-mock-{}", g.id);
    if !g.stream {
        let choices: Vec<Value> = (0..g.returned())
            .map(|i| {
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": output_text(g.output_tokens)},
                    "logprobs": null,
                    "finish_reason": g.finish_reason,
                })
            })
            .collect();
        let v = json!({
            "id": id, "object": "chat.completion", "created": g.created, "model": g.model,
            "system_fingerprint": "mock",
            "choices": choices,
        });
        return Reply::Json(with_usage(v, full_usage(g)));
    }

    let base = json!({
        "id": id, "object": "chat.completion.chunk", "created": g.created, "model": g.model,
        "system_fingerprint": "mock",
    });
    // OpenAI marks every chunk but the last with `"usage": null`; vLLM
    // leaves it out, or counts on every chunk when asked.
    let chunk = |index: u64, so_far: u64, delta: Value, finish: Value| {
        let mut c = base.clone();
        c["choices"] =
            json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}]);
        if let Some(u) = chunk_usage(g, so_far) {
            c["usage"] = u;
        }
        sse_data(&c)
    };
    let mut frames = Vec::new();
    for index in 0..g.returned() {
        frames.push(chunk(
            index,
            0,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        ));
        frames.extend(
            (0..g.output_tokens)
                .map(|i| chunk(index, i + 1, json!({"content": piece(i)}), Value::Null)),
        );
        frames.push(chunk(
            index,
            g.output_tokens,
            json!({}),
            json!(g.finish_reason),
        ));
    }
    finish_sse(&mut frames, g, &base);
    Reply::Stream {
        content_type: SSE,
        frames,
    }
}

/// One choice per prompt × `n`, indexed prompt by prompt, as OpenAI and
/// vLLM answer a prompt array; the usage sums them all.
pub fn completion(g: &Generation) -> Reply {
    let id = format!("cmpl-mock-{}", g.id);
    let base =
        json!({"id": id, "object": "text_completion", "created": g.created, "model": g.model});
    let choice = |index: u64, text: String, finish: Value| json!({"text": text, "index": index, "logprobs": null, "finish_reason": finish});
    let event = |c: Value, so_far: u64| {
        let mut e = base.clone();
        e["choices"] = json!([c]);
        if let Some(u) = chunk_usage(g, so_far) {
            e["usage"] = u;
        }
        sse_data(&e)
    };
    if !g.stream {
        let mut v = base.clone();
        v["choices"] = (0..g.returned())
            .map(|i| choice(i, output_text(g.output_tokens), json!(g.finish_reason)))
            .collect();
        return Reply::Json(with_usage(v, full_usage(g)));
    }
    let mut frames = Vec::new();
    for index in 0..g.returned() {
        frames.extend(
            (0..g.output_tokens).map(|i| event(choice(index, piece(i), Value::Null), i + 1)),
        );
        frames.push(event(
            choice(index, String::new(), json!(g.finish_reason)),
            g.output_tokens,
        ));
    }
    finish_sse(&mut frames, g, &base);
    Reply::Stream {
        content_type: SSE,
        frames,
    }
}

/// One deterministic vector per input: [`crate::embed`]'s rule for text
/// (paraphrases close, unrelated texts not), of the request's
/// `dimensions` (default 384); a token-id input is embedded as its digits.
pub fn embeddings(g: &Generation) -> Reply {
    let texts: Vec<String> = match g.body.get("input") {
        // An array of strings, or of token-id arrays, is a batch; a flat
        // token-id array is one input.
        Some(Value::Array(items)) if items.iter().all(|i| i.is_string() || i.is_array()) => {
            items.iter().map(text_of).collect()
        }
        Some(v) => vec![text_of(v)],
        None => vec![String::new()],
    };
    let texts = if texts.is_empty() {
        vec![String::new()]
    } else {
        texts
    };
    let dims = crate::embed::dimensions_of(g.body);
    let data: Vec<Value> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"object": "embedding", "index": i, "embedding": crate::embed::embed(t, dims)})
        })
        .collect();
    let v = json!({"object": "list", "data": data, "model": g.model});
    Reply::Json(with_usage(v, usage::embeddings(g.usage, g.input_tokens)))
}

fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Responses API. Streams as named events ending in `response.completed`,
/// which carries the usage (no `[DONE]`, as the real API).
/// The id of the `n`-th answer of the Responses API.
pub fn response_id(n: u64) -> String {
    format!("resp_mock_{n}")
}

pub fn response(g: &Generation) -> Reply {
    let id = response_id(g.id);
    let item_id = format!("msg_mock_{}", g.id);
    let text = output_text(g.output_tokens);
    let mut full = json!({
        "id": id, "object": "response", "created_at": g.created, "status": "completed",
        "model": g.model,
        "output": [{
            "type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }],
    });
    if let Some(limit) = g.body.get("max_output_tokens") {
        full["max_output_tokens"] = limit.clone();
    }
    for echoed in ["previous_response_id", "store"] {
        if let Some(v) = g.body.get(echoed) {
            full[echoed] = v.clone();
        }
    }
    let full = with_usage(
        full,
        usage::responses_for(g.usage, g.input_tokens, g.output_tokens, &g.details),
    );
    if !g.stream {
        return Reply::Json(full);
    }

    let mut seq = 0u64;
    let mut event = |name: &str, mut data: Map<String, Value>| {
        data.insert("type".into(), json!(name));
        data.insert("sequence_number".into(), json!(seq));
        seq += 1;
        sse_event(name, &Value::Object(data))
    };
    let obj = |v: Value| match v {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    let mut created = full.clone();
    created["status"] = json!("in_progress");
    created["output"] = json!([]);
    if let Some(m) = created.as_object_mut() {
        m.remove("usage");
    }
    let mut frames = vec![event("response.created", obj(json!({"response": created})))];
    for i in 0..g.output_tokens {
        frames.push(event(
            "response.output_text.delta",
            obj(json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece(i)})),
        ));
    }
    frames.push(event(
        "response.output_text.done",
        obj(json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text})),
    ));
    frames.push(event("response.completed", obj(json!({"response": full}))));
    Reply::Stream {
        content_type: SSE,
        frames,
    }
}

/// `GET /v1/models` as each server lists its models: OpenAI's list
/// (vLLM adds `root` and `max_model_len`, owned by "vllm"; Ollama's are
/// owned by "library"), Anthropic's paged `{"data", "has_more", …}`.
pub fn models(p: Personality, models: &[String], max_model_len: u64) -> Value {
    if p == Personality::Anthropic {
        let data: Vec<Value> = models
            .iter()
            .map(|m| {
                json!({"type": "model", "id": m, "display_name": m,
                            "created_at": "2025-01-01T00:00:00Z"})
            })
            .collect();
        return json!({"data": data, "has_more": false,
                      "first_id": models.first(), "last_id": models.last()});
    }
    let data: Vec<Value> = models
        .iter()
        .map(|m| {
            let mut card = json!({"id": m, "object": "model", "created": 0, "owned_by": match p {
                Personality::Vllm => "vllm",
                Personality::Ollama => "library",
                Personality::Openai => "system",
                _ => "mock-llm",
            }});
            if p == Personality::Vllm {
                card["root"] = json!(m);
                card["max_model_len"] = json!(max_model_len);
            }
            card
        })
        .collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::UsageMode;

    fn generation(body: &Value, stream: bool, include_usage: bool) -> Generation<'_> {
        Generation {
            id: 1,
            created: 0,
            created_at: "1970-01-01T00:00:00Z".into(),
            model: "m",
            body,
            input_tokens: 5,
            output_tokens: 3,
            finish_reason: "stop",
            usage: UsageMode::Normal,
            stream,
            include_usage,
            prompts: 1,
            n: 1,
            best_of: 1,
            personality: Default::default(),
            details: Default::default(),
            chunk_usage: Default::default(),
        }
    }

    fn frames(reply: Reply) -> Vec<String> {
        match reply {
            Reply::Stream { frames, .. } => frames
                .iter()
                .map(|f| String::from_utf8_lossy(f).into_owned())
                .collect(),
            Reply::Json(v) => panic!("expected a stream, got {v}"),
        }
    }

    fn data(frame: &str) -> Value {
        let json = frame
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap_or_default();
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn chat_stream_has_role_tokens_finish_usage_done() {
        let body = json!({});
        let f = frames(chat_completion(&generation(&body, true, true)));
        assert_eq!(f.len(), 1 + 3 + 1 + 1 + 1);
        assert!(f
            .iter()
            .all(|fr| fr.starts_with("data: ") && fr.ends_with("\n\n")));
        assert_eq!(data(&f[0])["choices"][0]["delta"]["role"], "assistant");
        let text: String = f[1..4]
            .iter()
            .map(|fr| {
                data(fr)["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(text, "tok0 tok1 tok2");
        assert_eq!(data(&f[4])["choices"][0]["finish_reason"], "stop");
        let usage = data(&f[5]);
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 8);
        assert_eq!(f[6], "data: [DONE]\n\n");
    }

    #[test]
    fn chat_stream_without_include_usage_has_no_usage_chunk() {
        let body = json!({});
        let f = frames(chat_completion(&generation(&body, true, false)));
        assert_eq!(f.len(), 1 + 3 + 1 + 1);
        assert!(f.iter().all(|fr| !fr.contains("usage")));
    }

    #[test]
    fn missing_usage_drops_the_usage_chunk_but_keeps_done() {
        let body = json!({});
        let mut g = generation(&body, true, true);
        g.usage = UsageMode::Missing;
        let f = frames(chat_completion(&g));
        assert_eq!(f.last().map(String::as_str), Some("data: [DONE]\n\n"));
        assert!(f.iter().all(|fr| !fr.contains("\"choices\":[]")));
    }

    #[test]
    fn responses_stream_ends_with_completed_usage() {
        let body = json!({});
        let f = frames(response(&generation(&body, true, false)));
        let last = f.last().unwrap();
        assert!(last.starts_with("event: response.completed\n"));
        assert_eq!(data(last)["response"]["usage"]["output_tokens"], 3);
        assert_eq!(data(last)["response"]["usage"]["input_tokens"], 5);
    }

    #[test]
    fn non_stream_chat_has_usage() {
        let body = json!({});
        let Reply::Json(v) = chat_completion(&generation(&body, false, false)) else {
            panic!("expected json");
        };
        assert_eq!(v["model"], "m");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})
        );
        assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2");
    }
}
