//! The reference count from a real server's own tokenizer: llama.cpp's
//! server (`make llamacpp`: SmolLM2-135M-Instruct, a byte-level BPE of
//! 49,152 tokens), asked over HTTP. Unlike tiktoken's published
//! accounting, this is what that server charges:
//!
//! - A text sample: `POST /tokenize` of the text, no BOS
//!   (`add_special: false`), as a completion prompt is counted.
//! - A chat body: `POST /apply-template` renders the model's own chat
//!   template (SmolLM2's adds a default system prompt when the first
//!   message is not a system one), then `POST /tokenize` counts it, special
//!   tokens parsed: the same figure the server reports as `prompt_tokens`
//!   (tests/tests/llamacpp.rs checks that on a live request). Tools are
//!   sent along; a template that has no place for them leaves them out,
//!   and the count says so.
//!
//! Start a server with
//! `.venv/llamacpp/bin/python bench/third-party/llamacpp_server.py` and pass
//! the address it prints: `estimator-accuracy --llamacpp 127.0.0.1:PORT`.

use std::time::Duration;

use serde_json::{json, Value};

use crate::{estimate, Input, Point, Sample};

/// A llama.cpp server at `base` (`http://HOST:PORT`).
pub struct Server {
    base: String,
    client: reqwest::blocking::Client,
}

impl Server {
    /// `addr` is `HOST:PORT` or a URL.
    pub fn new(addr: &str) -> Result<Server, String> {
        let base = if addr.contains("://") {
            addr.trim_end_matches('/').to_string()
        } else {
            format!("http://{addr}")
        };
        let client = reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(Server { base, client })
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let resp = self
            .client
            .post(&url)
            .json(body)
            .send()
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let text = resp.text().map_err(|e| format!("{url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{url}: {status}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{url}: {e}: {text}"))
    }

    /// Tokens of `text` as the server tokenizes it.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<usize, String> {
        let v = self.post(
            "/tokenize",
            &json!({"content": text, "add_special": add_special}),
        )?;
        v["tokens"]
            .as_array()
            .map(Vec::len)
            .ok_or_else(|| format!("/tokenize answered {v}"))
    }

    /// The prompt the server renders for a chat body.
    pub fn render(&self, body: &Value) -> Result<String, String> {
        let mut req = json!({"messages": body["messages"]});
        if let Some(tools) = body.get("tools") {
            req["tools"] = tools.clone();
        }
        let v = self.post("/apply-template", &req)?;
        v["prompt"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("/apply-template answered {v}"))
    }

    /// The server's count of an input (see the module doc).
    pub fn reference_tokens(&self, input: &Input) -> Result<usize, String> {
        match input {
            Input::Text(t) => self.tokenize(t, false),
            Input::Chat(body) => self.tokenize(&self.render(body)?, false),
        }
    }
}

/// Measures every sample against the server; a sample the server cannot
/// count (its template refuses the body) is left out and named in the
/// second list.
pub fn measure(samples: &[Sample], server: &Server) -> (Vec<Point>, Vec<String>) {
    let mut points = Vec::new();
    let mut skipped = Vec::new();
    for s in samples {
        match server.reference_tokens(&s.input) {
            Ok(real) => points.push(Point {
                class: s.class,
                name: s.name.clone(),
                estimate: estimate(&s.input),
                real: vec![real],
            }),
            Err(e) => skipped.push(format!("{} ({}): {e}", s.name, s.class)),
        }
    }
    (points, skipped)
}
