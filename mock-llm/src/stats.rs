//! What reached the server: counts per path and the last request as seen,
//! so tests can prove a refused request never got here and inspect what the
//! proxy forwarded.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, Method};
use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Default, Serialize)]
pub struct Stats {
    pub requests_total: u64,
    pub by_path: BTreeMap<String, u64>,
    pub last_request: Option<LastRequest>,
    /// The `x-mock-tag` of each tagged request, in the order they arrived
    /// (the first `MAX_TAGS`): the order the proxy let them through, as the
    /// server saw it, free of the client's clock.
    pub tags: Vec<String>,
}

const MAX_TAGS: usize = 10_000;

#[derive(Debug, Clone, Serialize)]
pub struct LastRequest {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    /// Lowercased names; repeated headers joined with `, `.
    pub headers: BTreeMap<String, String>,
    /// The parsed JSON body, or `null` when empty or not JSON.
    pub body: Value,
    /// The body's bytes as text (lossy), as the proxy sent them: what a
    /// splice kept of the client's spelling.
    pub raw: String,
}

impl Stats {
    pub fn record(
        &mut self,
        method: &Method,
        path: &str,
        query: Option<&str>,
        headers: &HeaderMap,
        body: Value,
    ) {
        self.requests_total += 1;
        *self.by_path.entry(path.to_owned()).or_default() += 1;
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for (name, value) in headers {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            seen.entry(name.as_str().to_owned())
                .and_modify(|v| {
                    v.push_str(", ");
                    v.push_str(&value);
                })
                .or_insert(value);
        }
        if let Some(tag) = seen.get(crate::knobs::TAG) {
            if self.tags.len() < MAX_TAGS {
                self.tags.push(tag.clone());
            }
        }
        self.last_request = Some(LastRequest {
            method: method.to_string(),
            path: path.to_owned(),
            query: query.map(str::to_owned),
            headers: seen,
            body,
            raw: String::new(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    #[test]
    fn counts_paths_and_keeps_the_last_request() {
        let mut s = Stats::default();
        let mut h = HeaderMap::new();
        h.append("X-Tier", HeaderValue::from_static("free"));
        h.append("x-tier", HeaderValue::from_static("gold"));
        s.record(
            &Method::POST,
            "/v1/chat/completions",
            None,
            &h,
            json!({"model": "a"}),
        );
        s.record(
            &Method::GET,
            "/v1/models",
            Some("x=1"),
            &HeaderMap::new(),
            Value::Null,
        );
        s.record(
            &Method::POST,
            "/v1/chat/completions",
            None,
            &h,
            json!({"model": "b"}),
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["requests_total"], 3);
        assert_eq!(v["by_path"]["/v1/chat/completions"], 2);
        assert_eq!(v["last_request"]["headers"]["x-tier"], "free, gold");
        assert_eq!(v["last_request"]["body"]["model"], "b");
        assert_eq!(v["tags"], json!([]));
    }

    #[test]
    fn tags_are_kept_in_arrival_order() {
        let mut s = Stats::default();
        for tag in ["B", "A", "B"] {
            let mut h = HeaderMap::new();
            h.append("X-Mock-Tag", HeaderValue::from_static(tag));
            s.record(&Method::POST, "/v1/chat/completions", None, &h, Value::Null);
        }
        s.record(
            &Method::POST,
            "/v1/chat/completions",
            None,
            &HeaderMap::new(),
            Value::Null,
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["tags"], json!(["B", "A", "B"]));
    }
}
