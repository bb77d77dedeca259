//! The body the upstream gets (served model, output limit, usage chunk
//! in streams) and the canned static answer.

use super::*;
use crate::usage::output_limit::LimitField;

/// The last user prompt of a request, as text.
pub(super) fn prompt_text(body: &Value) -> String {
    let text_of = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str).or(p.as_str()))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        if let Some(last) = messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        {
            return last.get("content").map(text_of).unwrap_or_default();
        }
    }
    ["prompt", "input"]
        .iter()
        .find_map(|k| body.get(*k))
        .map(text_of)
        .unwrap_or_default()
}

/// The body the upstream gets: the served model (downshift, a rung's
/// model), the output reserved (`new_output`: in every field the API's
/// servers read, or in `only` with the API's other limit fields removed),
/// and, for streams, a request for the usage chunk (which the client then
/// does not see: the second value).
pub(super) fn rewrite(
    api: Api,
    asked: &Asked,
    model: Option<&str>,
    new_output: Option<u64>,
    only: Option<LimitField>,
) -> (Option<Vec<u8>>, bool) {
    let wants_usage = matches!(api, Api::OpenAiChat | Api::OpenAiCompletions)
        && asked.demand.stream
        && !asked.include_usage;
    if model.is_none() && new_output.is_none() && !wants_usage {
        return (None, false); // the client's body goes up as it came
    }
    let mut json = asked.body().clone();
    if let Some(m) = model {
        json["model"] = Value::String(m.to_string());
    }
    match (new_output, only) {
        (Some(max), Some(field)) => {
            if let Some(fields) = json.as_object_mut() {
                for other in api.output_limit().reads.iter().filter(|f| **f != field) {
                    fields.remove(other.name());
                }
            }
            field.set(&mut json, max);
        }
        (Some(max), None) => set_max_output(api, &mut json, max),
        (None, _) => {}
    }
    if wants_usage {
        if !json.get("stream_options").is_some_and(Value::is_object) {
            json["stream_options"] = Value::Object(Default::default());
        }
        json["stream_options"]["include_usage"] = Value::Bool(true);
    }
    (Some(spliced(asked, &json)), wants_usage)
}

/// `json` (the rewrite of the client's body) in the client's bytes, only
/// what changed written again; serialised whole where the splice cannot
/// follow the body.
pub(super) fn spliced(asked: &Asked, json: &Value) -> Vec<u8> {
    crate::usage::splice::splice(&asked.raw, asked.body(), json)
        .unwrap_or_else(|| json.to_string().into_bytes())
}

/// Writes the reserved output limit into every field the API's servers
/// read (see `usage/output_limit.rs` for which and why), so the body
/// bounds the generation whichever field the server picks.
pub(super) fn set_max_output(api: Api, json: &mut Value, max: u64) {
    let limit = api.output_limit();
    if !json.is_object() {
        return;
    }
    let written = limit.written(&SentLimits::of(&*json));
    for field in written {
        field.set(json, max);
    }
}

/// Does the client's body already carry `max` in every field the API's
/// servers read (then it needs no rewrite for the limit)?
pub(super) fn carries_max_output(api: Api, sent: &SentLimits, max: u64) -> bool {
    api.output_limit().carries(sent, max)
}

impl Engine {
    /// The canned answer for a body's last user prompt (a declared API's:
    /// the text at its first `input`), else the message.
    pub(super) fn static_text(&self, api: Api, body: Option<&Value>) -> String {
        let Some(cfg) = &self.policy.static_fallback else {
            return crate::policy::StaticFallback::default_message();
        };
        let prompt = match (body, self.declared(api)) {
            (Some(body), Some(declared)) => declared.prompt(body),
            (Some(body), None) => prompt_text(body),
            (None, _) => String::new(),
        };
        let key = route::normalize_prompt(&prompt);
        cfg.answers
            .iter()
            .find(|(k, _)| route::normalize_prompt(k) == key)
            .map_or_else(|| cfg.message.clone(), |(_, v)| v.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::ctx;
    use crate::admission::tests::Caller;
    use crate::state::store::MemStore;
    use serde_json::json;

    /// Admits `body` on `api` under a daily hard budget of `budget`
    /// tokens: the body the upstream gets (`None`: the client's, unchanged)
    /// and the output reserved per completion.
    struct Bench {
        engine: Engine,
        store: MemStore,
    }

    impl Bench {
        fn new(budget: u64) -> Bench {
            let engine = Engine::new(
                crate::policy::Policy::from_value(json!({
                    "default_tier": "t",
                    "tiers": {"t": {"daily_tokens": budget}},
                    "defaults": {"max_output_tokens": 64},
                }))
                .unwrap(),
            );
            let store = MemStore::default();
            engine.prepare(&store).unwrap();
            Bench { engine, store }
        }

        fn admit(&self, api: Api, path: &str, body: Value) -> (Value, u64) {
            let id = self.engine.identify(&Caller("7.7.7.7:1")).unwrap();
            let asked = self
                .engine
                .demand(&id, api, body.to_string().as_bytes())
                .unwrap()
                .unwrap();
            let v = self
                .engine
                .admit(&self.store, &ctx(&id, api, path, Some(&asked), 0));
            assert!(v.reply().is_none(), "{body} refused");
            let plan = v.plan().unwrap();
            let per_choice = plan.max_output / asked.demand.completions();
            let sent = v
                .body()
                .map_or(body, |b| serde_json::from_slice(&b).unwrap());
            (sent, per_choice)
        }
    }

    fn limits(sent: &Value) -> Value {
        json!({
            "max_tokens": sent["max_tokens"],
            "max_completion_tokens": sent["max_completion_tokens"],
            "max_output_tokens": sent["max_output_tokens"],
            "num_predict": sent["options"]["num_predict"],
        })
    }

    #[test]
    fn chat_gets_the_larger_limit_in_both_fields() {
        let b = Bench::new(1_000_000);
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let path = "/v1/chat/completions";
        // The reported overshoot: vLLM obeys max_completion_tokens.
        let (sent, per) = b.admit(
            Api::OpenAiChat,
            path,
            json!({"model": "m", "messages": msgs, "max_tokens": 10, "max_completion_tokens": 2000}),
        );
        assert_eq!(per, 2000);
        assert_eq!(
            limits(&sent),
            json!({"max_tokens": 2000, "max_completion_tokens": 2000, "max_output_tokens": null, "num_predict": null})
        );
        // Only max_completion_tokens: Ollama reads max_tokens alone.
        let (sent, per) = b.admit(
            Api::OpenAiChat,
            path,
            json!({"model": "m", "messages": msgs, "max_completion_tokens": 30}),
        );
        assert_eq!(
            (per, &sent["max_tokens"], &sent["max_completion_tokens"]),
            (30, &json!(30), &json!(30))
        );
        // Only max_tokens, as reserved: the body goes up untouched.
        let body = json!({"model": "m", "messages": msgs, "max_tokens": 30});
        let (sent, _) = b.admit(Api::OpenAiChat, path, body.clone());
        assert_eq!(sent, body);
        assert!(sent.get("max_completion_tokens").is_none(), "not added");
        // None: the default, in max_tokens only.
        let (sent, per) = b.admit(
            Api::OpenAiChat,
            path,
            json!({"model": "m", "messages": msgs}),
        );
        assert_eq!(per, 64);
        assert_eq!(
            limits(&sent),
            json!({"max_tokens": 64, "max_completion_tokens": null, "max_output_tokens": null, "num_predict": null})
        );
    }

    #[test]
    fn every_api_gets_its_servers_fields() {
        let b = Bench::new(1_000_000);
        let cases = [
            (
                Api::OpenAiCompletions,
                "/v1/completions",
                json!({"model": "m", "prompt": "hi"}),
                json!({"max_tokens": 64, "max_completion_tokens": null, "max_output_tokens": null, "num_predict": null}),
            ),
            (
                Api::OpenAiResponses,
                "/v1/responses",
                json!({"model": "m", "input": "hi"}),
                json!({"max_tokens": null, "max_completion_tokens": null, "max_output_tokens": 64, "num_predict": null}),
            ),
            (
                Api::OllamaChat,
                "/api/chat",
                json!({"model": "m", "messages": [], "options": {"num_predict": -1, "temperature": 0}}),
                json!({"max_tokens": null, "max_completion_tokens": null, "max_output_tokens": null, "num_predict": 64}),
            ),
            (
                Api::OllamaGenerate,
                "/api/generate",
                json!({"model": "m", "prompt": "hi", "stream": false}),
                json!({"max_tokens": null, "max_completion_tokens": null, "max_output_tokens": null, "num_predict": 64}),
            ),
        ];
        for (api, path, body, want) in cases {
            let (sent, per) = b.admit(api, path, body.clone());
            assert_eq!(per, 64, "{api:?}");
            assert_eq!(limits(&sent), want, "{api:?} {body}");
        }
        // Ollama keeps its other options.
        let (sent, _) = b.admit(
            Api::OllamaChat,
            "/api/chat",
            json!({"model": "m", "messages": [], "options": {"num_predict": -1, "temperature": 0}}),
        );
        assert_eq!(sent["options"]["temperature"], 0);
        // Anthropic's required max_tokens, as reserved: untouched.
        let body = json!({"model": "m", "messages": [], "max_tokens": 9});
        let (sent, per) = b.admit(Api::AnthropicMessages, "/v1/messages", body.clone());
        assert_eq!((sent, per), (body, 9));
        // An embedding has no limit to write.
        let body = json!({"model": "m", "input": "x"});
        let (sent, per) = b.admit(Api::OpenAiEmbeddings, "/v1/embeddings", body.clone());
        assert_eq!((sent, per), (body, 0));
    }

    #[test]
    fn a_lowered_limit_is_written_into_every_field() {
        // 400 tokens a day (a request's input bound is 57): the second
        // request's 200 no longer fit and are lowered; both chat fields
        // carry the lowered value.
        let b = Bench::new(400);
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5, "max_completion_tokens": 200});
        let (first, per) = b.admit(Api::OpenAiChat, "/v1/chat/completions", body.clone());
        assert_eq!((per, &first["max_tokens"]), (200, &json!(200)));
        let (second, per) = b.admit(Api::OpenAiChat, "/v1/chat/completions", body);
        assert!(per < 200, "{per}");
        assert_eq!(second["max_tokens"], per);
        assert_eq!(second["max_completion_tokens"], per);
    }

    #[test]
    fn carries_reads_every_written_field() {
        let chat = Api::OpenAiChat;
        let carries_max_output = |api: Api, body: Value, max: u64| {
            super::carries_max_output(api, &SentLimits::of(&body), max)
        };
        assert!(carries_max_output(chat, json!({"max_tokens": 5}), 5));
        assert!(!carries_max_output(chat, json!({"max_tokens": 5}), 4));
        assert!(
            !carries_max_output(chat, json!({}), 5),
            "max_tokens missing"
        );
        assert!(!carries_max_output(
            chat,
            json!({"max_tokens": 5, "max_completion_tokens": 6}),
            5
        ));
        assert!(!carries_max_output(
            chat,
            json!({"max_completion_tokens": 5}),
            5
        ));
        assert!(!carries_max_output(
            Api::OllamaChat,
            json!({"options": {"num_predict": -1}}),
            5
        ));
        assert!(carries_max_output(Api::OpenAiEmbeddings, json!({}), 0));
    }
}
