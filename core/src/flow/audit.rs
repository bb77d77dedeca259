//! The audit record: every field sluice adds to a request's access-log
//! line, kept in the stream as the request goes and handed to Envoy once,
//! at the end of the stream (`on_log`, which Envoy runs before its access
//! loggers), as one filter-state value: `wasm.sluice_audit`.
//!
//! The value is a JSON fragment — `,"request_id":"…","principal":"…",…` —
//! that the shipped access log's `text_format_source` splices after
//! Envoy's own fields (`time`, `status`, `latency_ms`, `upstream_cluster`):
//! one host call per request instead of one `set_property` per field (up to
//! 20). Every sluice field is in every fragment (`null` when it does not
//! apply), counts are JSON numbers, and every string is escaped here
//! (quotes, backslashes, control characters; values are already UTF-8,
//! header bytes above 0x7F having been replaced as they were read), so a
//! hostile model name or header cannot end the line, add a field or break
//! the JSON. A line Envoy writes without sluice having seen the request
//! (a codec error) has Envoy's fields only.

use std::cell::RefCell;

use crate::admission::answer::{push_decimal, truncate};
use crate::host::{metrics, Host};
use crate::usage::reconcile::Details;

use super::MAX_AUDIT_BYTES;

/// The filter-state name the access log reads
/// (`%FILTER_STATE(wasm.sluice_audit:PLAIN)%`).
pub const PROPERTY: &str = "sluice_audit";

/// One field of the record; its position is its place in the line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    RequestId,
    Method,
    Route,
    Principal,
    Tier,
    Team,
    Org,
    Decision,
    Reason,
    Bucket,
    Degraded,
    ModelRequested,
    ModelServed,
    /// The provider of the ladder that served it (absent: the primary).
    Provider,
    /// The rungs that failed before one answered, with their status
    /// (`primary=503,openai=429`; absent: the first attempt answered).
    Failed,
    TokensEstimated,
    TokensInput,
    TokensOutput,
    TokensInputCached,
    TokensInputCacheWrite,
    TokensOutputReasoning,
    UsageSource,
    /// Where the input charged came from: `reported`, `bounded`,
    /// `estimated`.
    InputSource,
    CostMicros,
    TtftMs,
    RequestSha256,
    ResponseSha256,
    Cache,
}

/// Every field's name in the access log, in [`Field`] order.
pub const NAMES: [&str; 28] = [
    "request_id",
    "method",
    "route",
    "principal",
    "tier",
    "team",
    "org",
    "decision",
    "reason",
    "bucket",
    "degraded",
    "model_requested",
    "model_served",
    "provider",
    "failed",
    "tokens_estimated",
    "tokens_input",
    "tokens_output",
    "tokens_input_cached",
    "tokens_input_cache_write",
    "tokens_output_reasoning",
    "usage_source",
    "input_source",
    "cost_micros",
    "ttft_ms",
    "request_sha256",
    "response_sha256",
    "cache",
];

/// `,"<name>":` of every field, in [`Field`] order (built at compile
/// time; a test checks them against [`NAMES`]).
const PREFIXES: [&str; 28] = [
    ",\"request_id\":",
    ",\"method\":",
    ",\"route\":",
    ",\"principal\":",
    ",\"tier\":",
    ",\"team\":",
    ",\"org\":",
    ",\"decision\":",
    ",\"reason\":",
    ",\"bucket\":",
    ",\"degraded\":",
    ",\"model_requested\":",
    ",\"model_served\":",
    ",\"provider\":",
    ",\"failed\":",
    ",\"tokens_estimated\":",
    ",\"tokens_input\":",
    ",\"tokens_output\":",
    ",\"tokens_input_cached\":",
    ",\"tokens_input_cache_write\":",
    ",\"tokens_output_reasoning\":",
    ",\"usage_source\":",
    ",\"input_source\":",
    ",\"cost_micros\":",
    ",\"ttft_ms\":",
    ",\"request_sha256\":",
    ",\"response_sha256\":",
    ",\"cache\":",
];

#[derive(Debug, Clone, Default)]
enum Value {
    #[default]
    Null,
    Code(&'static str),
    Text(String),
    Number(u64),
}

/// The fields one request has so far; a field written again is replaced.
#[derive(Debug, Clone, Default)]
pub struct AuditRecord {
    values: [Value; NAMES.len()],
}

impl AuditRecord {
    /// A text field, cut to [`MAX_AUDIT_BYTES`] in whole characters.
    pub fn text(&mut self, field: Field, value: &str) {
        let value = truncate(value, MAX_AUDIT_BYTES);
        match &mut self.values[field as usize] {
            Value::Text(held) => {
                held.clear();
                held.push_str(value);
            }
            slot => *slot = Value::Text(value.to_string()),
        }
    }

    /// A fixed text (a decision's code): nothing copied.
    pub fn code(&mut self, field: Field, value: &'static str) {
        self.values[field as usize] = Value::Code(truncate(value, MAX_AUDIT_BYTES));
    }

    pub fn number(&mut self, field: Field, value: u64) {
        self.values[field as usize] = Value::Number(value);
    }

    /// The fragment the access log splices: `,"name":value` per field;
    /// a field in `lent` takes that text instead of the record's (the
    /// request's own headers, borrowed rather than copied in; `None`:
    /// null), cut to the bound like any other.
    pub fn render(&self, out: &mut String, lent: &[(Field, Option<&str>)]) {
        out.clear();
        for (i, (prefix, value)) in PREFIXES.iter().zip(&self.values).enumerate() {
            out.push_str(prefix);
            if let Some((_, text)) = lent.iter().find(|(f, _)| *f as usize == i) {
                match text {
                    Some(text) => quoted(out, truncate(text, MAX_AUDIT_BYTES)),
                    None => out.push_str("null"),
                }
                continue;
            }
            match value {
                Value::Null => out.push_str("null"),
                Value::Code(text) => quoted(out, text),
                Value::Text(text) => quoted(out, text),
                Value::Number(n) => push_decimal(out, *n),
            }
        }
    }
}

/// The parts of a settled usage priced apart, in the record and in
/// `sluice_tokens_total` (kinds `cached` and `cache_write` of the input,
/// `reasoning` of the output: shares of the `actual` counts, not added to
/// them). `None` (settled from the estimate: it has no parts) leaves the
/// fields null; a request settled from the upstream's usage says 0 for a
/// part it did not use.
pub fn details(
    host: &dyn Host,
    record: &mut AuditRecord,
    details: Option<Details>,
    tier: &str,
    model: &str,
) {
    let Some(details) = details else { return };
    for (field, direction, kind, n) in [
        (
            Field::TokensInputCached,
            "input",
            "cached",
            details.cached_input,
        ),
        (
            Field::TokensInputCacheWrite,
            "input",
            "cache_write",
            details.cache_write_input,
        ),
        (
            Field::TokensOutputReasoning,
            "output",
            "reasoning",
            details.reasoning_output,
        ),
    ] {
        record.number(field, n);
        metrics::TOKENS.add_at(host, &[direction, kind, tier, model], n as i64);
    }
}

/// A VM's render buffer, reused by every stream (kept at its high mark).
#[derive(Debug, Default)]
pub struct Buffer(RefCell<String>);

impl Buffer {
    pub fn with(&self, use_it: impl FnOnce(&mut String)) {
        match self.0.try_borrow_mut() {
            Ok(mut line) => use_it(&mut line),
            Err(_) => use_it(&mut String::new()),
        }
    }
}

/// `text` as a JSON string: `"`, `\` and control characters escaped
/// (DEL and the line separators U+2028/U+2029 too, for log tools that
/// split on them). Scanned byte by byte: every byte to escape is ASCII
/// but the separators' (`E2 80 A8`/`A9`), so the plain runs between them
/// are copied whole.
fn quoted(out: &mut String, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let bytes = text.as_bytes();
    let mut plain = 0;
    let mut i = 0;
    while i < bytes.len() {
        i = crate::usage::tape::first_flagged(bytes, i, needs_escape);
        let Some(&b) = bytes.get(i) else {
            break;
        };
        let (escape, len): (Option<&str>, usize) = match b {
            b'"' => (Some("\\\""), 1),
            b'\\' => (Some("\\\\"), 1),
            b'\n' => (Some("\\n"), 1),
            b'\r' => (Some("\\r"), 1),
            b'\t' => (Some("\\t"), 1),
            0..=0x1f | 0x7f => (None, 1),
            0xe2 if matches!(bytes.get(i + 1..i + 3), Some([0x80, 0xa8 | 0xa9])) => (None, 3),
            _ => {
                i += 1;
                continue;
            }
        };
        out.push_str(&text[plain..i]);
        match escape {
            Some(e) => out.push_str(e),
            None => {
                let code = match len {
                    3 => 0x2028 + u32::from(bytes[i + 2] - 0xa8),
                    _ => u32::from(b),
                };
                out.push_str("\\u");
                for shift in [12, 8, 4, 0] {
                    out.push(char::from(HEX[((code >> shift) & 0xf) as usize]));
                }
            }
        }
        i += len;
        plain = i;
    }
    out.push_str(&text[plain..]);
    out.push('"');
}

/// Which of eight bytes may need an escape in [`quoted`]: a quote, a
/// backslash, a control character, DEL, or the first byte of a line
/// separator (flags as `tape::stops` sets them).
fn needs_escape(word: u64) -> u64 {
    use crate::usage::tape::{equal_to, stops};
    stops(word) | equal_to(word, 0x7f) | equal_to(word, 0xe2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(record: &AuditRecord) -> serde_json::Value {
        let mut fragment = String::new();
        record.render(
            &mut fragment,
            &[(Field::Method, Some("GET")), (Field::Route, None)],
        );
        let text = format!("{{\"status\":200{fragment}}}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    #[test]
    fn every_field_is_in_every_fragment_null_when_unset() {
        let v = line(&AuditRecord::default());
        for name in NAMES.iter().filter(|n| **n != "method") {
            assert!(v[name].is_null(), "{name}: {v}");
        }
        assert_eq!(v["method"], "GET");
        assert_eq!(v.as_object().unwrap().len(), NAMES.len() + 1);
    }

    #[test]
    fn counts_are_numbers_and_texts_strings() {
        let mut r = AuditRecord::default();
        r.number(Field::TokensInput, 0);
        r.number(Field::CostMicros, u64::MAX);
        r.code(Field::Decision, "admit");
        r.text(Field::Tier, "free");
        r.text(Field::Tier, "pro");
        let v = line(&r);
        assert_eq!(v["tokens_input"], 0);
        assert_eq!(v["cost_micros"], u64::MAX);
        assert_eq!(v["decision"], "admit");
        assert_eq!(v["tier"], "pro");
    }

    #[test]
    fn hostile_texts_stay_one_field_of_one_line() {
        let hostile = "a\"b\\c\n\r\t\u{0}\u{1b}\u{7f}\u{2028}é\u{fffd}\",\"decision\":\"x";
        let mut r = AuditRecord::default();
        r.text(Field::ModelRequested, hostile);
        let mut fragment = String::new();
        r.render(&mut fragment, &[]);
        assert!(!fragment.contains('\n') && !fragment.contains('\u{2028}'));
        let v = line(&r);
        assert_eq!(v["model_requested"], hostile);
        assert!(v["decision"].is_null());
    }

    #[test]
    fn a_text_is_cut_to_the_bound_in_whole_characters() {
        let mut r = AuditRecord::default();
        r.text(Field::Tier, &"é".repeat(1_000));
        let long = "é".repeat(1_000);
        let mut fragment = String::new();
        r.render(&mut fragment, &[(Field::Route, Some(&long))]);
        let v: serde_json::Value =
            serde_json::from_str(&format!("{{{}}}", &fragment[1..])).unwrap();
        for field in ["tier", "route"] {
            let text = v[field].as_str().unwrap();
            assert!(text.len() <= MAX_AUDIT_BYTES && text.len() >= MAX_AUDIT_BYTES - 4);
        }
    }

    #[test]
    fn prefixes_are_the_names() {
        for (prefix, name) in PREFIXES.iter().zip(NAMES) {
            assert_eq!(*prefix, format!(",\"{name}\":"));
        }
    }

    #[test]
    fn every_char_is_escaped_as_serde_reads_it_back() {
        let mut all = String::new();
        for c in (0u32..0x3000).filter_map(char::from_u32) {
            all.push(c);
        }
        let mut out = String::new();
        quoted(&mut out, &all);
        let back: String = serde_json::from_str(&out).unwrap();
        assert_eq!(back, all);
        assert!(!out.contains('\u{2028}') && !out.contains('\u{2029}') && !out.contains('\u{7f}'));
        assert!(!out.bytes().any(|b| b < 0x20));
    }

    proptest::proptest! {
        /// Eight bytes at a time find every byte to escape wherever it
        /// falls in a word (plain runs of every length between them).
        #[test]
        fn escapes_are_found_at_any_offset(
            parts in proptest::collection::vec(
                (0usize..20, proptest::sample::select(
                    vec!['"', '\\', '\n', '\u{1}', '\u{7f}', '\u{2028}', '\u{2029}', '\u{2027}', 'é', '—'])),
                0..12,
            )
        ) {
            let mut text = String::new();
            for (run, c) in parts {
                text.push_str(&"abcdefghijklmnopqrstu"[..run]);
                text.push(c);
            }
            let mut out = String::new();
            quoted(&mut out, &text);
            let back: String = serde_json::from_str(&out).unwrap();
            proptest::prop_assert_eq!(back, text);
            let separators = ['\u{2028}', '\u{2029}'];
            proptest::prop_assert!(!out.contains(separators), "a raw separator in {}", out);
            proptest::prop_assert!(!out.bytes().any(|b| b < 0x20 || b == 0x7f));
        }
    }

    #[test]
    fn names_follow_the_fields() {
        assert_eq!(NAMES[Field::Cache as usize], "cache");
        assert_eq!(NAMES[Field::RequestId as usize], "request_id");
        assert_eq!(NAMES[Field::TtftMs as usize], "ttft_ms");
    }
}
