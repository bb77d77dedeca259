//! `apis:` — an application's own LLM endpoint declared to sluice, so it
//! is read and reserved like a built-in API: where its body names the
//! model, carries the text the model reads and the output limit the
//! service obeys, and where its answer reports usage and its text.
//!
//! ```yaml
//! apis:
//!   - path: /api/v1/ai/chat
//!     model: /model                # JSON pointers (RFC 6901) into the body
//!     input: [/message, /history]
//!     output_limit: /max_tokens    # the service obeys it; sluice writes it
//!     answer:                      # optional, each field optional
//!       text: /reply
//!       input_tokens: /usage/prompt_tokens
//!       output_tokens: /usage/completion_tokens
//! ```
//!
//! The pointers' syntax is checked here; that the path is no built-in API
//! and no `passthrough` rule's is checked where requests are classified
//! (`admission::declared::check`).

use serde::Deserialize;

use crate::policy::{ConfigError, Policy};

/// One declared API.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredApi {
    /// The one path it is served at (compared in canonical form).
    pub path: String,
    /// The methods it answers (default: `[POST]`).
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// Where the body names the model: a non-empty string, required.
    pub model: String,
    /// Where the text the model reads is: strings, arrays of strings or of
    /// `{role, content}` messages, any JSON (counted as its text).
    pub input: Vec<String>,
    /// Where the service reads the most output it may generate: sluice
    /// reserves the value there (the model's default when absent) and
    /// writes the reserved value there, lowered if a budget requires.
    pub output_limit: String,
    /// What the service's JSON answer reports.
    #[serde(default)]
    pub answer: DeclaredAnswer,
}

/// Where a declared API's answer holds its text and its usage.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredAnswer {
    /// The generated text: counted when the answer reports no usage, and
    /// where the static answer puts its text.
    pub text: Option<String>,
    /// The input tokens the service reports.
    pub input_tokens: Option<String>,
    /// The output tokens the service reports.
    pub output_tokens: Option<String>,
}

fn default_methods() -> Vec<String> {
    vec!["POST".into()]
}

/// The most APIs a policy may declare (an index fits the API's `u16`, and
/// each request's path is compared with each).
pub const MAX_DECLARED: usize = 64;

/// The longest pointer accepted (each is walked per request).
const MAX_POINTER_BYTES: usize = 256;

/// The most segments a pointer may have.
const MAX_SEGMENTS: usize = 16;

/// The segments of a JSON pointer (RFC 6901: `/a/b~1c` is `a`, `b/c`), or
/// why it is none. Empty segments are refused: `/a//b` names a key `""`,
/// which is a typo far more often than a field.
pub fn segments(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.len() > MAX_POINTER_BYTES {
        return Err(format!("longer than {MAX_POINTER_BYTES} bytes"));
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(format!(
            "`{pointer}` is not a JSON pointer: it must start with `/` (`/model`, `/options/max_tokens`)"
        ));
    };
    let mut out = Vec::new();
    for raw in rest.split('/') {
        if raw.is_empty() {
            return Err(format!("`{pointer}` has an empty segment"));
        }
        let mut segment = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            match (c, c == '~') {
                (_, true) => match chars.next() {
                    Some('0') => segment.push('~'),
                    Some('1') => segment.push('/'),
                    _ => {
                        return Err(format!(
                            "`{pointer}`: `~` must be followed by `0` (for `~`) or `1` (for `/`)"
                        ))
                    }
                },
                (c, false) => segment.push(c),
            }
        }
        out.push(segment);
    }
    if out.len() > MAX_SEGMENTS {
        return Err(format!("`{pointer}` has more than {MAX_SEGMENTS} segments"));
    }
    Ok(out)
}

/// Is `inner` the same field as `outer`, or inside it?
fn within(inner: &[String], outer: &[String]) -> bool {
    inner.starts_with(outer)
}

/// Syntax and consistency of every declaration: (field path, problem).
pub fn check(policy: &Policy) -> Result<(), ConfigError> {
    if policy.apis.len() > MAX_DECLARED {
        return Err(ConfigError::at(
            "apis",
            format!("at most {MAX_DECLARED} APIs"),
        ));
    }
    for (i, api) in policy.apis.iter().enumerate() {
        check_one(api)
            .map_err(|(field, why)| ConfigError::at(format!("apis[{i}].{field}"), why))?;
    }
    Ok(())
}

fn check_one(api: &DeclaredApi) -> Result<(), (String, String)> {
    let pointer = |field: &str, p: &str| segments(p).map_err(|why| (field.to_string(), why));
    let model = pointer("model", &api.model)?;
    let limit = pointer("output_limit", &api.output_limit)?;
    if within(&model, &limit) || within(&limit, &model) {
        return Err((
            "output_limit".into(),
            format!(
                "`{}` and the model's `{}` overlap: sluice writes both",
                api.output_limit, api.model
            ),
        ));
    }
    // sluice writes these two: a segment that reads as an array index
    // would be written as a key into an object the service reads as one.
    for (field, segs) in [("model", &model), ("output_limit", &limit)] {
        if segs.iter().any(|s| s.parse::<u64>().is_ok() || s == "-") {
            return Err((
                field.into(),
                "sluice writes this field: name object keys only, no array index".into(),
            ));
        }
    }
    if api.input.is_empty() {
        return Err((
            "input".into(),
            "name at least one field the model reads (`/message`)".into(),
        ));
    }
    for (n, p) in api.input.iter().enumerate() {
        pointer(&format!("input[{n}]"), p)?;
    }
    let answer = &api.answer;
    for (field, p) in [
        ("answer.text", &answer.text),
        ("answer.input_tokens", &answer.input_tokens),
        ("answer.output_tokens", &answer.output_tokens),
    ] {
        if let Some(p) = p {
            pointer(field, p)?;
        }
    }
    if answer.input_tokens.is_some() && answer.output_tokens.is_none() {
        return Err((
            "answer.output_tokens".into(),
            "required with `answer.input_tokens`: input alone cannot settle what the answer cost"
                .into(),
        ));
    }
    if api.methods.is_empty() {
        return Err(("methods".into(), "name at least one method".into()));
    }
    if let Some(m) = api
        .methods
        .iter()
        .find(|m| m.is_empty() || !m.chars().all(|c| c.is_ascii_alphabetic()))
    {
        return Err(("methods".into(), format!("`{m}` is no HTTP method")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(api: serde_json::Value) -> Result<Policy, ConfigError> {
        Policy::from_value(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 1000}},
            "apis": [api],
        }))
    }

    fn declared() -> serde_json::Value {
        json!({
            "path": "/api/v1/ai/chat",
            "model": "/model",
            "input": ["/message"],
            "output_limit": "/max_tokens",
            "answer": {"text": "/reply", "input_tokens": "/usage/in", "output_tokens": "/usage/out"},
        })
    }

    #[test]
    fn a_declaration_loads_with_its_defaults() {
        let p = policy(declared()).unwrap();
        let api = &p.apis[0];
        assert_eq!(api.methods, ["POST"]);
        assert_eq!(api.answer.text.as_deref(), Some("/reply"));
    }

    #[test]
    fn pointers_read_as_rfc_6901_says() {
        assert_eq!(segments("/a/b~1c/d~0e").unwrap(), ["a", "b/c", "d~e"]);
        assert_eq!(segments("/max_tokens").unwrap(), ["max_tokens"]);
        for bad in ["model", "", "/a//b", "/a~2", "/a~", "/"] {
            assert!(segments(bad).is_err(), "{bad}");
        }
        let deep = "/a".repeat(17);
        assert!(segments(&deep).unwrap_err().contains("16 segments"));
    }

    /// Each bad declaration names its field (what `check-config` prints).
    #[test]
    fn a_bad_pointer_is_named_by_its_field() {
        let cases = [
            ("model", json!("model"), "apis[0].model", "start with `/`"),
            (
                "model",
                json!("/messages/0"),
                "apis[0].model",
                "array index",
            ),
            (
                "output_limit",
                json!("/a//b"),
                "apis[0].output_limit",
                "empty segment",
            ),
            (
                "output_limit",
                json!("/model"),
                "apis[0].output_limit",
                "overlap",
            ),
            ("input", json!([]), "apis[0].input", "at least one"),
            (
                "input",
                json!(["/ok", "bad"]),
                "apis[0].input[1]",
                "start with `/`",
            ),
            (
                "answer",
                json!({"text": "/x~3"}),
                "apis[0].answer.text",
                "`~`",
            ),
            (
                "answer",
                json!({"input_tokens": "/u/i"}),
                "apis[0].answer.output_tokens",
                "required",
            ),
            (
                "methods",
                json!(["PO ST"]),
                "apis[0].methods",
                "no HTTP method",
            ),
        ];
        for (field, value, path, says) in cases {
            let mut api = declared();
            api[field] = value;
            let err = policy(api).unwrap_err();
            assert_eq!(err.path, path, "{err}");
            assert!(err.message.contains(says), "{err}");
        }
        let mut api = declared();
        api["modle"] = json!("/model");
        assert_eq!(policy(api).unwrap_err().path, "apis[0].modle");
        let mut api = declared();
        api.as_object_mut().unwrap().remove("output_limit");
        let err = policy(api).unwrap_err();
        assert!(err.message.contains("output_limit"), "{err}");
    }
}
