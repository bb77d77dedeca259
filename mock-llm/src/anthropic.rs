//! Anthropic Messages answers (`/v1/messages`), as Anthropic and vLLM send
//! them: one `message` object, or named SSE events with the input count in
//! `message_start` and the cumulative output count in `message_delta`.

use serde_json::{json, Value};

use crate::framing::sse_event;
use crate::generate::{piece, Generation, Reply, SSE};
use crate::tokens::output_text;
use crate::usage;

pub fn message(g: &Generation) -> Reply {
    let id = format!("msg_mock_{}", g.id);
    let stop = if g.finish_reason == "length" {
        "max_tokens"
    } else {
        "end_turn"
    };
    let mut full = json!({
        "id": id, "type": "message", "role": "assistant", "model": g.model,
        "content": [{"type": "text", "text": output_text(g.output_tokens)}],
        "stop_reason": stop, "stop_sequence": null,
    });
    let usage =
        |output| usage::anthropic_for(g.personality, g.usage, g.input_tokens, output, &g.details);
    if let Some(u) = usage(g.output_tokens) {
        full["usage"] = u;
    }
    if !g.stream {
        return Reply::Json(full);
    }
    let mut start = full.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    if let Some(u) = usage(1) {
        start["usage"] = u;
    }
    let mut frames = vec![
        sse_event(
            "message_start",
            &json!({"type": "message_start", "message": start}),
        ),
        sse_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
        ),
    ];
    for i in 0..g.output_tokens {
        frames.push(sse_event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": piece(i)}}),
        ));
    }
    frames.push(sse_event(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
    ));
    let mut delta = json!({"type": "message_delta",
                           "delta": {"stop_reason": stop, "stop_sequence": null}});
    if let Some(u) = usage(g.output_tokens) {
        // Only the output, cumulative, as Anthropic sends it.
        delta["usage"] = json!({"output_tokens": u["output_tokens"]});
    }
    frames.push(sse_event("message_delta", &delta));
    frames.push(sse_event("message_stop", &json!({"type": "message_stop"})));
    Reply::Stream {
        content_type: SSE,
        frames,
    }
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
            model: "claude",
            body,
            input_tokens: 6,
            output_tokens: 3,
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
    fn json_and_stream_carry_anthropic_usage() {
        let body = json!({});
        let Reply::Json(v) = message(&generation(&body, false)) else {
            panic!("expected json");
        };
        assert_eq!(v["usage"], json!({"input_tokens": 6, "output_tokens": 3}));
        assert_eq!(v["content"][0]["text"], "tok0 tok1 tok2");
        let Reply::Stream { frames, .. } = message(&generation(&body, true)) else {
            panic!("expected a stream");
        };
        let text: Vec<String> = frames
            .iter()
            .map(|f| String::from_utf8_lossy(f).into_owned())
            .collect();
        assert!(text[0].starts_with("event: message_start\n"));
        assert!(text[0].contains("\"input_tokens\":6"));
        let delta = text
            .iter()
            .find(|f| f.starts_with("event: message_delta"))
            .unwrap();
        assert!(delta.contains("\"output_tokens\":3"), "{delta}");
        assert_eq!(text.iter().filter(|f| f.contains("text_delta")).count(), 3);
    }
}
