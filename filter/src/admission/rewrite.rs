//! The body the upstream gets (served model, output limit, usage chunk
//! in streams) and the canned static answer.

use super::*;

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

/// The body the upstream gets: the served model (downshift), the output
/// reserved (`new_output`), and, for streams, a request for the usage chunk
/// (which the client then does not see: the second value).
pub(super) fn rewrite(
    api: Api,
    asked: &Asked,
    model: Option<&str>,
    new_output: Option<u64>,
) -> (Option<Vec<u8>>, bool) {
    let wants_usage = matches!(api, Api::OpenAiChat | Api::OpenAiCompletions)
        && asked.demand.stream
        && asked
            .body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            != Some(true);
    if model.is_none() && new_output.is_none() && !wants_usage {
        return (None, false); // the client's body goes up as it came
    }
    let mut json = asked.body.clone();
    if let Some(m) = model {
        json["model"] = Value::String(m.to_string());
    }
    if let Some(max) = new_output {
        set_max_output(api, &mut json, max);
    }
    if wants_usage {
        if !json.get("stream_options").is_some_and(Value::is_object) {
            json["stream_options"] = Value::Object(Default::default());
        }
        json["stream_options"]["include_usage"] = Value::Bool(true);
    }
    (Some(json.to_string().into_bytes()), wants_usage)
}

/// Writes the output limit where each API reads it.
pub(super) fn set_max_output(api: Api, json: &mut Value, max: u64) {
    match api {
        Api::OpenAiChat
            if json
                .get("max_completion_tokens")
                .is_some_and(|v| !v.is_null()) =>
        {
            json["max_completion_tokens"] = max.into();
        }
        Api::OpenAiChat | Api::OpenAiCompletions | Api::AnthropicMessages => {
            json["max_tokens"] = max.into()
        }
        Api::OpenAiResponses => json["max_output_tokens"] = max.into(),
        Api::OllamaGenerate | Api::OllamaChat => {
            if !json.get("options").is_some_and(Value::is_object) {
                json["options"] = Value::Object(Default::default());
            }
            json["options"]["num_predict"] = max.into();
        }
        Api::OpenAiEmbeddings
        | Api::OllamaEmbed
        | Api::Scoring
        | Api::Invocations
        | Api::Passthrough(_)
        | Api::Other => {}
    }
}

impl Engine {
    /// The canned answer for a body's last user prompt, else the message.
    pub(super) fn static_text(&self, body: Option<&Value>) -> String {
        let Some(cfg) = &self.policy.static_fallback else {
            return crate::policy::StaticFallback::default_message();
        };
        let prompt = body.map(prompt_text).unwrap_or_default();
        let key = health::normalize_prompt(&prompt);
        cfg.answers
            .iter()
            .find(|(k, _)| health::normalize_prompt(k) == key)
            .map_or_else(|| cfg.message.clone(), |(_, v)| v.clone())
    }
}
