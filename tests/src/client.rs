//! One client for the requests the tests send through Envoy: a base URL,
//! headers sent on every request, and one method per API path, each
//! returning the whole [`Response`] (status, headers, body).

use serde_json::{json, Value as Json};

use crate::{get, post_json, Response};

/// Requests to one server (usually Envoy: [`crate::Envoy::client`]).
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    headers: Vec<(String, String)>,
}

impl Client {
    /// A client of the server at `base` (`http://127.0.0.1:port`).
    pub fn new(base: impl Into<String>) -> Client {
        Client {
            base: base.into(),
            headers: Vec::new(),
        }
    }

    /// The same client, sending `name: value` on every request as well.
    pub fn with_header(mut self, name: &str, value: &str) -> Client {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// The full URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `POST path` with a JSON body and `headers` after the client's own.
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &Json) -> Response {
        post_json(&self.url(path), &self.all(headers), body)
    }

    /// `GET path` with `headers` after the client's own.
    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Response {
        get(&self.url(path), &self.all(headers))
    }

    /// `POST /v1/chat/completions`.
    pub fn chat(&self, headers: &[(&str, &str)], body: &Json) -> Response {
        self.post("/v1/chat/completions", headers, body)
    }

    /// `POST /v1/completions`.
    pub fn completions(&self, headers: &[(&str, &str)], body: &Json) -> Response {
        self.post("/v1/completions", headers, body)
    }

    /// `POST /v1/messages` (Anthropic's API).
    pub fn messages(&self, headers: &[(&str, &str)], body: &Json) -> Response {
        self.post("/v1/messages", headers, body)
    }

    fn all<'a>(&'a self, headers: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let own = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        own.chain(headers.iter().copied()).collect()
    }
}

/// A chat-completions body: `model`, one user message `content`, and
/// `max_tokens` and `stream` only when asked for.
pub fn chat_request(model: &str, content: &str, max_tokens: Option<u64>, stream: bool) -> Json {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": content}]});
    if let Some(max) = max_tokens {
        body["max_tokens"] = max.into();
    }
    if stream {
        body["stream"] = true.into();
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_requests_carry_only_what_was_asked() {
        let plain = chat_request("m", "hi", None, false);
        assert_eq!(
            plain,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        );
        let full = chat_request("m", "hi", Some(7), true);
        assert_eq!(
            (full["max_tokens"].as_u64(), &full["stream"]),
            (Some(7), &json!(true))
        );
    }

    #[test]
    fn the_clients_headers_come_first_and_paths_join_the_base() {
        let c = Client::new("http://127.0.0.1:1").with_header("x-api-key", "k");
        assert_eq!(c.url("/v1/messages"), "http://127.0.0.1:1/v1/messages");
        assert_eq!(
            c.all(&[("x-b", "2")]),
            vec![("x-api-key", "k"), ("x-b", "2")]
        );
    }
}
