//! Which answers may be stored, what `Cache-Control` allows, and how a hit
//! is written back: the stored JSON as it was, or — for a streaming
//! request — an OpenAI SSE stream or Ollama NDJSON built from it, shaped
//! as the real servers shape them so that the real SDKs parse them.
//!
//! What is stored is always the non-streaming JSON body. A streamed answer
//! is first assembled into that shape ([`assemble_sse`],
//! [`assemble_ndjson`]); one that did not end properly assembles to
//! nothing and is not stored.

use serde_json::{json, Map, Value};

use crate::usage::demand::Api;
use crate::usage::reconcile::{self, Usage};

/// Why an answer is not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotStorable {
    Status(u16),
    NotJson,
    /// An `error` object, or no choices / no `done: true`.
    Incomplete,
    /// A finish reason other than `stop`/`length` (`content_filter`,
    /// `tool_calls` cut, none at all …).
    FinishReason(String),
    /// No usage: what a hit saves is unknown, and a partial answer looks
    /// like this too.
    NoUsage,
    /// The upstream said `Cache-Control: no-store` / `private`.
    UpstreamNoStore,
}

fn finish_ok(reason: Option<&Value>) -> Result<(), NotStorable> {
    match reason.and_then(Value::as_str) {
        Some("stop") | Some("length") => Ok(()),
        Some(other) => Err(NotStorable::FinishReason(other.into())),
        None => Err(NotStorable::FinishReason("none".into())),
    }
}

/// Whether a complete answer may be stored, and its usage. `status` and
/// the upstream's `cache-control` header are the response's.
pub fn storable(
    api: Api,
    status: u16,
    upstream_cache_control: Option<&str>,
    body: &[u8],
) -> Result<Usage, NotStorable> {
    if status != 200 {
        return Err(NotStorable::Status(status));
    }
    if let Some(cc) = upstream_cache_control {
        let d = directives(cc);
        // `no-cache`: each use must be revalidated with the upstream, which
        // a stored answer never is.
        if d.iter()
            .any(|x| x == "no-store" || x == "private" || x == "no-cache")
        {
            return Err(NotStorable::UpstreamNoStore);
        }
    }
    let v: Value = serde_json::from_slice(body).map_err(|_| NotStorable::NotJson)?;
    if v.get("error").is_some_and(|e| !e.is_null()) {
        return Err(NotStorable::Incomplete);
    }
    match api {
        Api::OpenAiChat | Api::OpenAiCompletions => {
            let choices = v
                .get("choices")
                .and_then(Value::as_array)
                .filter(|c| !c.is_empty())
                .ok_or(NotStorable::Incomplete)?;
            for c in choices {
                finish_ok(c.get("finish_reason"))?;
            }
        }
        Api::OllamaChat | Api::OllamaGenerate => {
            if v.get("done") != Some(&Value::Bool(true)) {
                return Err(NotStorable::Incomplete);
            }
            // Older Ollama reports no `done_reason`; `done: true` then is a
            // finished answer.
            if let Some(r) = v.get("done_reason") {
                finish_ok(Some(r))?;
            }
        }
        // The cache serves no other API (`key::served`).
        _ => return Err(NotStorable::Incomplete),
    }
    // Read as settlement reads it; what settlement would not believe, or
    // leaves to the estimate, is no usage: never stored.
    reconcile::reported_in(&v).ok_or(NotStorable::NoUsage)
}

fn directives(header: &str) -> Vec<String> {
    header
        .split(',')
        .map(|d| {
            d.split('=')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        })
        .filter(|d| !d.is_empty())
        .collect()
}

/// What the request's `Cache-Control` lets the cache do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    pub read: bool,
    pub store: bool,
}

/// `no-store`: neither reads nor stores; `no-cache` (or `max-age=0`):
/// stores but does not read. Any other directive changes nothing.
pub fn request_cache_control(header: Option<&str>) -> Allowed {
    let mut a = Allowed {
        read: true,
        store: true,
    };
    let Some(h) = header else {
        return a;
    };
    for part in h.split(',') {
        let mut kv = part.splitn(2, '=');
        let k = kv.next().unwrap_or_default().trim().to_ascii_lowercase();
        let v = kv.next().map(|v| v.trim().trim_matches('"'));
        match (k.as_str(), v) {
            ("no-store", _) => {
                a.read = false;
                a.store = false;
            }
            ("no-cache", _) | ("max-age", Some("0")) => a.read = false,
            _ => {}
        }
    }
    a
}

/// How a hit is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

pub const JSON: &str = "application/json";
pub const SSE: &str = "text/event-stream";
pub const NDJSON: &str = "application/x-ndjson";

/// The stored answer for a request: JSON as stored when it does not
/// stream; SSE (OpenAI) or NDJSON (Ollama) when it does. `include_usage`:
/// the request's `stream_options.include_usage` (the usage chunk is sent
/// only then, as OpenAI does). `None`: the stored body is not of this API
/// (treated as a miss by the caller).
pub fn render(api: Api, stored: &str, stream: bool, include_usage: bool) -> Option<Rendered> {
    if !stream {
        return Some(Rendered {
            content_type: JSON,
            body: stored.as_bytes().to_vec(),
        });
    }
    let v: Value = serde_json::from_str(stored).ok()?;
    match api {
        Api::OpenAiChat | Api::OpenAiCompletions => Some(Rendered {
            content_type: SSE,
            body: openai_sse(api, &v, include_usage)?,
        }),
        Api::OllamaChat | Api::OllamaGenerate => Some(Rendered {
            content_type: NDJSON,
            body: ollama_ndjson(api, &v)?,
        }),
        _ => None,
    }
}

fn event(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(v.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

fn openai_sse(api: Api, v: &Value, include_usage: bool) -> Option<Vec<u8>> {
    let chat = api == Api::OpenAiChat;
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let mut base = Map::new();
    for k in ["id", "created", "model", "system_fingerprint"] {
        if let Some(x) = v.get(k) {
            base.insert(k.into(), x.clone());
        }
    }
    base.insert("object".into(), json!(object));
    let chunk = |choices: Value| {
        let mut c = base.clone();
        c.insert("choices".into(), choices);
        Value::Object(c)
    };
    let mut out = Vec::new();
    for c in v.get("choices")?.as_array()? {
        let index = c.get("index").cloned().unwrap_or(json!(0));
        let finish = c.get("finish_reason").cloned().unwrap_or(Value::Null);
        if chat {
            let first = chat_delta(c.get("message")?);
            event(
                &mut out,
                &chunk(json!([{"index": index, "delta": first, "logprobs": null,
                                "finish_reason": null}])),
            );
            event(
                &mut out,
                &chunk(json!([{"index": index, "delta": {}, "logprobs": null,
                                "finish_reason": finish}])),
            );
        } else {
            let text = c.get("text").cloned().unwrap_or(json!(""));
            event(
                &mut out,
                &chunk(json!([{"index": index, "text": text, "logprobs": null,
                                "finish_reason": null}])),
            );
            event(
                &mut out,
                &chunk(json!([{"index": index, "text": "", "logprobs": null,
                                "finish_reason": finish}])),
            );
        }
    }
    if include_usage {
        if let Some(u) = v.get("usage") {
            let mut c = chunk(json!([]));
            if let Some(o) = c.as_object_mut() {
                o.insert("usage".into(), u.clone());
            }
            event(&mut out, &c);
        }
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    Some(out)
}

/// A stored chat message as the one delta that streams it whole: its
/// role, content, refusal and tool calls (each numbered, as a stream
/// numbers them).
fn chat_delta(msg: &Value) -> Map<String, Value> {
    let mut first = Map::new();
    first.insert("role".into(), json!("assistant"));
    first.insert(
        "content".into(),
        msg.get("content").cloned().unwrap_or(Value::Null),
    );
    if let Some(r) = msg.get("refusal").filter(|r| !r.is_null()) {
        first.insert("refusal".into(), r.clone());
    }
    if let Some(calls) = msg.get("tool_calls").and_then(Value::as_array) {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut t = t.clone();
                if let Some(o) = t.as_object_mut() {
                    o.insert("index".into(), json!(i));
                }
                t
            })
            .collect();
        first.insert("tool_calls".into(), Value::Array(calls));
    }
    first
}

fn ollama_ndjson(api: Api, v: &Value) -> Option<Vec<u8>> {
    let obj = v.as_object()?;
    let mut first = Map::new();
    for k in ["model", "created_at"] {
        if let Some(x) = obj.get(k) {
            first.insert(k.into(), x.clone());
        }
    }
    let mut last = obj.clone();
    match api {
        Api::OllamaChat => {
            let msg = obj.get("message")?;
            first.insert("message".into(), msg.clone());
            let mut empty = msg.as_object()?.clone();
            empty.insert("content".into(), json!(""));
            empty.remove("tool_calls");
            last.insert("message".into(), Value::Object(empty));
        }
        _ => {
            first.insert("response".into(), obj.get("response")?.clone());
            last.insert("response".into(), json!(""));
        }
    }
    first.insert("done".into(), json!(false));
    let mut out = Value::Object(first).to_string().into_bytes();
    out.push(b'\n');
    out.extend_from_slice(Value::Object(last).to_string().as_bytes());
    out.push(b'\n');
    Some(out)
}

/// An OpenAI SSE stream (the whole body) assembled into the JSON a
/// non-streaming request gets; `None` unless it ended with `[DONE]`, every
/// choice finished and usage came (the filter asks for it).
pub fn assemble_sse(api: Api, stream: &[u8]) -> Option<String> {
    // A stored answer is text.
    std::str::from_utf8(stream).ok()?;
    let chat = api == Api::OpenAiChat;
    let mut base: Option<Map<String, Value>> = None;
    // index → (content, finish_reason, tool_calls by index)
    let mut choices: std::collections::BTreeMap<u64, (String, Value, Vec<Value>)> =
        Default::default();
    let mut usage = None;
    let mut done = false;
    for data in reconcile::sse_data_events(stream) {
        if data.trim_ascii() == b"[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_slice(&data).ok()?;
        if v.get("error").is_some() {
            return None;
        }
        if base.is_none() {
            let mut b = Map::new();
            for k in ["id", "created", "model", "system_fingerprint"] {
                if let Some(x) = v.get(k) {
                    b.insert(k.into(), x.clone());
                }
            }
            base = Some(b);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        for c in v
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let i = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let e = choices
                .entry(i)
                .or_insert((String::new(), Value::Null, Vec::new()));
            let piece = if chat {
                c.get("delta").and_then(|d| d.get("content"))
            } else {
                c.get("text")
            };
            if let Some(s) = piece.and_then(Value::as_str) {
                e.0.push_str(s);
            }
            if chat {
                if let Some(calls) = c
                    .get("delta")
                    .and_then(|d| d.get("tool_calls"))
                    .and_then(Value::as_array)
                {
                    merge_tool_calls(&mut e.2, calls)?;
                }
            }
            if let Some(f) = c.get("finish_reason").filter(|f| !f.is_null()) {
                e.1 = f.clone();
            }
        }
    }
    if !done || choices.is_empty() {
        return None;
    }
    assembled(chat, base.unwrap_or_default(), choices, usage?)
}

/// The most tool calls one streamed choice may assemble: an index past it
/// is no answer to store (an upstream cannot make the filter allocate for
/// an index it names).
const MAX_TOOL_CALLS: usize = 128;

/// Appends a chunk's tool-call deltas to the calls assembled so far (by
/// their `index`); `None` past [`MAX_TOOL_CALLS`].
fn merge_tool_calls(slots: &mut Vec<Value>, calls: &[Value]) -> Option<()> {
    for t in calls {
        let ti = usize::try_from(t.get("index").and_then(Value::as_u64).unwrap_or(0)).ok()?;
        if ti >= MAX_TOOL_CALLS {
            return None;
        }
        while slots.len() <= ti {
            slots.push(json!({"type": "function", "function": {"name": "", "arguments": ""}}));
        }
        let slot = slots.get_mut(ti)?;
        if let Some(id) = t.get("id") {
            slot["id"] = id.clone();
        }
        let f = t.get("function");
        for k in ["name", "arguments"] {
            if let Some(s) = f.and_then(|f| f.get(k)).and_then(Value::as_str) {
                let cur = slot["function"][k].as_str().unwrap_or_default();
                slot["function"][k] = json!(format!("{cur}{s}"));
            }
        }
    }
    Some(())
}

/// The non-streaming answer of the assembled choices.
fn assembled(
    chat: bool,
    mut out: Map<String, Value>,
    choices: std::collections::BTreeMap<u64, (String, Value, Vec<Value>)>,
    usage: Value,
) -> Option<String> {
    out.insert(
        "object".into(),
        json!(if chat {
            "chat.completion"
        } else {
            "text_completion"
        }),
    );
    let list: Vec<Value> = choices
        .into_iter()
        .map(|(i, (text, finish, calls))| {
            if chat {
                let mut m = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    m["tool_calls"] = Value::Array(calls);
                }
                json!({"index": i, "message": m, "logprobs": null, "finish_reason": finish})
            } else {
                json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish})
            }
        })
        .collect();
    out.insert("choices".into(), Value::Array(list));
    out.insert("usage".into(), usage);
    Some(Value::Object(out).to_string())
}

/// Ollama NDJSON assembled into the non-streaming JSON: the last line
/// (`done: true`) with the content of every line before it.
pub fn assemble_ndjson(api: Api, stream: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(stream).ok()?;
    let mut content = String::new();
    let mut last: Option<Value> = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if last.is_some() {
            return None; // something after `done: true`
        }
        let v: Value = serde_json::from_str(line).ok()?;
        let piece = match api {
            Api::OllamaChat => v.get("message").and_then(|m| m.get("content")),
            _ => v.get("response"),
        };
        if let Some(s) = piece.and_then(Value::as_str) {
            content.push_str(s);
        }
        if v.get("done") == Some(&Value::Bool(true)) {
            last = Some(v);
        }
    }
    let mut v = last?;
    match api {
        Api::OllamaChat => v["message"]["content"] = json!(content),
        _ => v["response"] = json!(content),
    }
    Some(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_body(finish: &str) -> String {
        json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                            "finish_reason": finish}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        .to_string()
    }

    #[test]
    fn what_is_stored() {
        let ok = chat_body("stop");
        assert_eq!(
            storable(Api::OpenAiChat, 200, None, ok.as_bytes()),
            Ok(Usage {
                input: 5,
                output: 2
            })
        );
        assert!(storable(Api::OpenAiChat, 200, None, chat_body("length").as_bytes()).is_ok());
        assert_eq!(
            storable(
                Api::OpenAiChat,
                200,
                None,
                chat_body("content_filter").as_bytes()
            ),
            Err(NotStorable::FinishReason("content_filter".into()))
        );
        for s in [429, 500, 503, 206] {
            assert_eq!(
                storable(Api::OpenAiChat, s, None, ok.as_bytes()),
                Err(NotStorable::Status(s))
            );
        }
        assert_eq!(
            storable(
                Api::OpenAiChat,
                200,
                Some("private, max-age=0"),
                ok.as_bytes()
            ),
            Err(NotStorable::UpstreamNoStore)
        );
        for cc in [
            "no-cache",
            "max-age=60, No-Cache",
            "no-cache=\"set-cookie\"",
        ] {
            assert_eq!(
                storable(Api::OpenAiChat, 200, Some(cc), ok.as_bytes()),
                Err(NotStorable::UpstreamNoStore),
                "{cc}"
            );
        }
        assert!(storable(Api::OpenAiChat, 200, Some("max-age=60"), ok.as_bytes()).is_ok());
        assert_eq!(
            storable(Api::OpenAiChat, 200, None, b"{\"choi"),
            Err(NotStorable::NotJson)
        );
        let mut no_usage: Value = serde_json::from_str(&ok).unwrap();
        no_usage.as_object_mut().unwrap().remove("usage");
        assert_eq!(
            storable(Api::OpenAiChat, 200, None, no_usage.to_string().as_bytes()),
            Err(NotStorable::NoUsage)
        );
        let err = json!({"error": {"message": "x"}}).to_string();
        assert_eq!(
            storable(Api::OpenAiChat, 200, None, err.as_bytes()),
            Err(NotStorable::Incomplete)
        );
        let o = json!({"model": "m", "response": "hi", "done": true, "done_reason": "stop",
                       "prompt_eval_count": 3, "eval_count": 1});
        assert!(storable(Api::OllamaGenerate, 200, None, o.to_string().as_bytes()).is_ok());
        let mut partial = o.clone();
        partial["done"] = json!(false);
        assert_eq!(
            storable(
                Api::OllamaGenerate,
                200,
                None,
                partial.to_string().as_bytes()
            ),
            Err(NotStorable::Incomplete)
        );
    }

    #[test]
    fn cache_control() {
        let all = Allowed {
            read: true,
            store: true,
        };
        assert_eq!(request_cache_control(None), all);
        assert_eq!(request_cache_control(Some("max-age=60")), all);
        assert_eq!(
            request_cache_control(Some("No-Store")),
            Allowed {
                read: false,
                store: false
            }
        );
        assert_eq!(
            request_cache_control(Some("no-cache")),
            Allowed {
                read: false,
                store: true
            }
        );
        assert_eq!(
            request_cache_control(Some("max-age=0")),
            Allowed {
                read: false,
                store: true
            }
        );
        assert_eq!(
            request_cache_control(Some("max-age=5, no-store")),
            Allowed {
                read: false,
                store: false
            }
        );
    }

    fn events(body: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(body).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    #[test]
    fn render_json_as_stored_and_sse_round_trips() {
        let b = chat_body("stop");
        let j = render(Api::OpenAiChat, &b, false, false).unwrap();
        assert_eq!((j.content_type, j.body.as_slice()), (JSON, b.as_bytes()));
        let s = render(Api::OpenAiChat, &b, true, false).unwrap();
        assert_eq!(s.content_type, SSE);
        let ev = events(&s.body);
        assert_eq!(ev.len(), 2);
        assert!(ev
            .iter()
            .all(|e| e["object"] == "chat.completion.chunk" && e.get("usage").is_none()));
        assert_eq!(ev[0]["choices"][0]["delta"]["content"], "Hello there");
        assert_eq!(ev[1]["choices"][0]["finish_reason"], "stop");
        let u = render(Api::OpenAiChat, &b, true, true).unwrap();
        let ev = events(&u.body);
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[2]["choices"], json!([]));
        assert_eq!(ev[2]["usage"]["completion_tokens"], 2);
        // What was rendered assembles back to the same answer.
        let back: Value =
            serde_json::from_str(&assemble_sse(Api::OpenAiChat, &u.body).unwrap()).unwrap();
        let orig: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(back["choices"][0]["message"], orig["choices"][0]["message"]);
        assert_eq!(back["usage"], orig["usage"]);
        // Without the usage chunk, or cut before [DONE]: nothing to store.
        assert!(assemble_sse(Api::OpenAiChat, &s.body).is_none());
        let cut = &u.body[..u.body.len() - "data: [DONE]\n\n".len()];
        assert!(assemble_sse(Api::OpenAiChat, cut).is_none());
    }

    #[test]
    fn render_tool_calls_and_completions() {
        let b = json!({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": null,
                        "tool_calls": [{"id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]},
            "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        .to_string();
        let ev = events(&render(Api::OpenAiChat, &b, true, false).unwrap().body);
        assert_eq!(ev[0]["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        assert_eq!(
            ev[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
            "f"
        );
        let c = json!({"id": "cmpl", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 3}})
        .to_string();
        let r = render(Api::OpenAiCompletions, &c, true, true).unwrap();
        let ev = events(&r.body);
        assert_eq!(ev[0]["object"], "text_completion");
        assert_eq!(ev[0]["choices"][0]["text"], "abc");
        let back: Value =
            serde_json::from_str(&assemble_sse(Api::OpenAiCompletions, &r.body).unwrap()).unwrap();
        assert_eq!(back["choices"][0]["text"], "abc");
        assert!(render(Api::OpenAiChat, "not json", true, false).is_none());
    }

    #[test]
    fn render_ollama_ndjson() {
        let b = json!({"model": "m", "created_at": "2026-01-01T00:00:00Z",
                       "message": {"role": "assistant", "content": "Hi!"}, "done": true,
                       "done_reason": "stop", "prompt_eval_count": 3, "eval_count": 2})
        .to_string();
        let r = render(Api::OllamaChat, &b, true, false).unwrap();
        assert_eq!(r.content_type, NDJSON);
        let lines: Vec<Value> = std::str::from_utf8(&r.body)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["done"], false);
        assert_eq!(lines[0]["message"]["content"], "Hi!");
        assert_eq!(lines[1]["done"], true);
        assert_eq!(lines[1]["message"]["content"], "");
        assert_eq!(lines[1]["eval_count"], 2);
        let back: Value =
            serde_json::from_str(&assemble_ndjson(Api::OllamaChat, &r.body).unwrap()).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(&b).unwrap());
        let g = json!({"model": "m", "response": "yo", "done": true, "prompt_eval_count": 1,
                       "eval_count": 1})
        .to_string();
        let r = render(Api::OllamaGenerate, &g, true, false).unwrap();
        let back = assemble_ndjson(Api::OllamaGenerate, &r.body).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&back).unwrap()["response"],
            "yo"
        );
        // Cut before done: nothing.
        assert!(
            assemble_ndjson(Api::OllamaGenerate, br#"{"response":"a","done":false}"#).is_none()
        );
    }

    /// An upstream naming a tool call at a huge index gets no answer
    /// stored, and makes the filter allocate nothing for it.
    #[test]
    fn a_streamed_tool_call_at_a_huge_index_is_not_assembled() {
        let chunk = |index: u64| {
            format!(
                "data: {}\n\n",
                serde_json::json!({"id": "c", "model": "m", "choices": [{"index": 0,
                    "delta": {"tool_calls": [{"index": index, "id": "t",
                        "function": {"name": "f", "arguments": "{}"}}]},
                    "finish_reason": "tool_calls"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            )
        };
        let done = "data: [DONE]\n\n";
        let ok = format!("{}{done}", chunk(1));
        let json = assemble_sse(Api::OpenAiChat, ok.as_bytes()).unwrap();
        assert!(json.contains("\"tool_calls\""), "{json}");
        let hostile = format!("{}{done}", chunk(1_000_000_000_000));
        assert_eq!(assemble_sse(Api::OpenAiChat, hostile.as_bytes()), None);
    }
}
