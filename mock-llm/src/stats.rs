//! What reached the server: counts per path and the last request as seen,
//! so tests can prove a refused request never got here and inspect what the
//! proxy forwarded.

use std::collections::BTreeMap;
use std::sync::Mutex;

use axum::http::{HeaderMap, Method};
use serde::Serialize;
use serde_json::Value;

use crate::lock;

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

/// How each streamed body went, as the server sent it (the first
/// `MAX_TAGS`, in the order they started): shown as `streams` in
/// `/admin/stats`, so a test can see whether a proxy closed the connection
/// of an answer still being generated, and how much was generated.
#[derive(Debug, Default)]
pub struct Streams(Mutex<Vec<StreamSeen>>);

/// One streamed body.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StreamSeen {
    /// Frames handed to the connection (an SSE event, an NDJSON line).
    pub frames_sent: usize,
    /// Frames the answer has in all.
    pub frames: usize,
    pub ended: StreamEnd,
    /// Milliseconds from the first frame to the end (`None` while open).
    pub lasted_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum StreamEnd {
    /// Still sending.
    Open,
    /// Every frame sent.
    Complete,
    /// Ended by the `x-mock-reset-after-chunks` knob.
    Reset,
    /// The body was dropped before its end: the peer closed or reset the
    /// connection (seen at the next write at the latest).
    Dropped,
}

impl Streams {
    /// A new stream of `frames` frames; its index (`None` past the bound).
    pub fn start(&self, frames: usize) -> Option<usize> {
        let mut all = lock(&self.0);
        if all.len() >= MAX_TAGS {
            return None;
        }
        all.push(StreamSeen {
            frames_sent: 0,
            frames,
            ended: StreamEnd::Open,
            lasted_ms: None,
        });
        Some(all.len() - 1)
    }

    /// Applies `f` to stream `index` (none past the bound).
    pub fn update(&self, index: usize, f: impl FnOnce(&mut StreamSeen)) {
        if let Some(seen) = lock(&self.0).get_mut(index) {
            f(seen);
        }
    }

    pub fn snapshot(&self) -> Vec<StreamSeen> {
        lock(&self.0).clone()
    }

    pub fn clear(&self) {
        lock(&self.0).clear();
    }
}

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
