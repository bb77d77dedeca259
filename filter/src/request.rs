//! What a request asks for (SPEC §2.2): which API, which model, streamed or
//! not, and how much output at most. Read from OpenAI- and Ollama-shaped
//! bodies; only the fields sluice needs are looked at.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    OpenAiChat,
    OpenAiCompletions,
    OpenAiEmbeddings,
    OpenAiResponses,
    OllamaGenerate,
    OllamaChat,
    /// Anything else: no body is read, only the request buckets apply.
    Other,
}

impl Api {
    /// Classifies by method and path (query string ignored).
    pub fn classify(method: &str, path: &str) -> Api {
        if !method.eq_ignore_ascii_case("POST") {
            return Api::Other;
        }
        let path = path.split(['?', '#']).next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Api::OpenAiChat,
            "/v1/completions" => Api::OpenAiCompletions,
            "/v1/embeddings" => Api::OpenAiEmbeddings,
            "/v1/responses" => Api::OpenAiResponses,
            "/api/generate" => Api::OllamaGenerate,
            "/api/chat" => Api::OllamaChat,
            _ => Api::Other,
        }
    }

    pub fn reads_body(self) -> bool {
        self != Api::Other
    }

    fn is_ollama(self) -> bool {
        matches!(self, Api::OllamaGenerate | Api::OllamaChat)
    }
}

/// The parts of a request body admission needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Demand {
    pub model: Option<String>,
    pub stream: bool,
    /// Requested maximum output tokens, if the client set one.
    pub max_output: Option<u64>,
}

/// A body sluice cannot accept: the message and the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBody {
    pub message: String,
    pub param: Option<&'static str>,
}

/// Parses a request body: what admission needs, and the JSON itself (for
/// the estimate and for rewriting).
pub fn parse_body(api: Api, body: &[u8]) -> Result<(Demand, Value), BadBody> {
    let value = serde_json::from_slice::<Value>(body);
    let fields = match &value {
        Ok(Value::Object(map)) => map,
        Ok(_) => {
            return Err(BadBody {
                message: "request body must be a JSON object".into(),
                param: None,
            })
        }
        Err(e) => {
            return Err(BadBody {
                message: format!("request body is not valid JSON: {e}"),
                param: None,
            })
        }
    };
    let field = |name: &str| fields.get(name).cloned();
    let model = match field("model") {
        Some(Value::String(m)) if !m.trim().is_empty() => m,
        Some(Value::String(_)) | None => {
            return Err(BadBody {
                message: "`model` is required".into(),
                param: Some("model"),
            })
        }
        Some(_) => {
            return Err(BadBody {
                message: "`model` must be a string".into(),
                param: Some("model"),
            })
        }
    };
    let stream = match field("stream") {
        None | Some(Value::Null) => api.is_ollama(), // Ollama streams unless told not to
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(BadBody {
                message: "`stream` must be a boolean".into(),
                param: Some("stream"),
            })
        }
    };
    let num_predict = match field("options") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => o.get("num_predict").cloned(),
        Some(_) => {
            return Err(BadBody {
                message: "`options` must be an object".into(),
                param: Some("options"),
            })
        }
    };
    let mut max_output = None;
    for (param, value) in [
        ("max_tokens", field("max_tokens")),
        ("max_completion_tokens", field("max_completion_tokens")),
        ("max_output_tokens", field("max_output_tokens")),
        ("options.num_predict", num_predict),
    ] {
        match value {
            None | Some(Value::Null) => {}
            // Ollama's "no limit" values.
            Some(Value::Number(n))
                if param == "options.num_predict" && n.as_i64().is_some_and(|v| v < 0) => {}
            Some(Value::Number(n)) if n.as_u64().is_some() => {
                let v = n.as_u64().unwrap_or(0);
                max_output = Some(max_output.map_or(v, |m: u64| m.min(v)));
            }
            Some(_) => {
                return Err(BadBody {
                    message: format!("`{param}` must be a non-negative integer"),
                    param: Some(param),
                })
            }
        }
    }
    let demand = Demand {
        model: Some(model),
        stream,
        max_output,
    };
    Ok((demand, value.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand_of(api: Api, body: &[u8]) -> Result<Demand, BadBody> {
        parse_body(api, body).map(|(d, _)| d)
    }

    #[test]
    fn classifies_known_endpoints() {
        assert_eq!(
            Api::classify("POST", "/v1/chat/completions?x=1"),
            Api::OpenAiChat
        );
        assert_eq!(Api::classify("POST", "/api/generate"), Api::OllamaGenerate);
        assert_eq!(Api::classify("GET", "/v1/chat/completions"), Api::Other);
        assert_eq!(Api::classify("POST", "/v1/models"), Api::Other);
    }

    #[test]
    fn reads_openai_and_ollama_bodies() {
        let d = demand_of(
            Api::OpenAiChat,
            br#"{"model":"llama3.1:8b","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":64}"#,
        )
        .unwrap();
        assert_eq!(
            d,
            Demand {
                model: Some("llama3.1:8b".into()),
                stream: true,
                max_output: Some(64)
            }
        );
        let d = demand_of(
            Api::OllamaChat,
            br#"{"model":"mistral:7b","options":{"num_predict":20}}"#,
        )
        .unwrap();
        assert_eq!(
            d,
            Demand {
                model: Some("mistral:7b".into()),
                stream: true,
                max_output: Some(20)
            }
        );
        let d = demand_of(
            Api::OllamaGenerate,
            br#"{"model":"m","stream":false,"options":{"num_predict":-1}}"#,
        )
        .unwrap();
        assert_eq!((d.stream, d.max_output), (false, None));
        let d = demand_of(
            Api::OpenAiChat,
            br#"{"model":"m","max_tokens":100,"max_completion_tokens":50}"#,
        )
        .unwrap();
        assert_eq!(d.max_output, Some(50), "the stricter of two limits");
    }

    #[test]
    fn bad_bodies_name_the_problem() {
        let e = demand_of(Api::OpenAiChat, b"{not json").unwrap_err();
        assert!(e.message.contains("not valid JSON"));
        let e = demand_of(Api::OpenAiChat, b"[1,2]").unwrap_err();
        assert!(e.message.contains("JSON object"));
        let e = demand_of(Api::OpenAiChat, br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.param, Some("model"));
        let e = demand_of(Api::OpenAiChat, br#"{"model":"m","stream":"yes"}"#).unwrap_err();
        assert_eq!(e.param, Some("stream"));
        let e = demand_of(Api::OpenAiChat, br#"{"model":"m","max_tokens":-5}"#).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        let e = demand_of(Api::OpenAiChat, br#"{"model":"m","max_tokens":1.5}"#).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
    }
}
