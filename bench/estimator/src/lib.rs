//! Accuracy of the filter's input-token estimate (`sluice_core::bench::input_tokens`)
//! against real BPE tokenizers (tiktoken's cl100k_base and o200k_base, both
//! bundled in `tiktoken-rs`, so this runs offline).
//!
//! The corpus is in `corpus/`, compiled in: one file per class, samples
//! separated by `---8<--- name` lines. Chat request bodies are assembled
//! from those samples by a seeded generator (`chats`), so they vary in length
//! and shape without a second copy of the text.
//!
//! Reference count of a chat body (OpenAI's published accounting for chat
//! models, as in the cookbook's `num_tokens_from_messages`): per message
//! 4 tokens of framing (which includes the one-token role) plus the tokens of
//! its content (the text of a string or of each text part) and of every
//! other field (`name`, `tool_call_id` as text; `tool_calls` and the like as
//! compact JSON), plus 3 to prime the reply, plus the compact JSON text of
//! `tools` tokenized as is. (OpenAI renders tools in an internal format of
//! its own; the JSON text is what a self-hosted model's template sees.)

use serde_json::{json, Value};
use tiktoken_rs::CoreBPE;

/// One corpus entry.
pub struct Sample {
    pub class: &'static str,
    pub name: String,
    pub input: Input,
}

pub enum Input {
    /// Scored with `text_tokens`.
    Text(String),
    /// A whole chat request body, scored with `input_tokens`.
    Chat(Value),
}

/// The classes in report order.
pub const CLASSES: [&str; 6] = ["english", "italian", "code", "json", "cjk", "chat"];

const FILES: [(&str, &str); 5] = [
    ("english", include_str!("../corpus/english.txt")),
    ("italian", include_str!("../corpus/italian.txt")),
    ("code", include_str!("../corpus/code.txt")),
    ("json", include_str!("../corpus/json.txt")),
    ("cjk", include_str!("../corpus/cjk.txt")),
];
const CHAT_PARTS: &str = include_str!("../corpus/chat-parts.txt");
const CHATS: usize = 24;

/// Splits a corpus file into (name, text) at its `---8<--- name` lines.
pub fn split(file: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in file.split_inclusive('\n') {
        if let Some(name) = line.strip_prefix("---8<--- ") {
            out.push((name.trim().to_string(), String::new()));
        } else if let Some((_, text)) = out.last_mut() {
            text.push_str(line);
        }
    }
    for (_, text) in &mut out {
        // The newline before the next separator belongs to the format.
        if text.ends_with('\n') {
            text.pop();
        }
    }
    out
}

/// The whole corpus: the text samples, then the generated chat bodies.
pub fn corpus() -> Vec<Sample> {
    let mut samples: Vec<Sample> = FILES
        .iter()
        .flat_map(|(class, file)| {
            split(file).into_iter().map(move |(name, text)| Sample {
                class,
                name,
                input: Input::Text(text),
            })
        })
        .collect();
    let chats = chats(&samples);
    samples.extend(chats);
    samples
}

/// SplitMix64: a seeded generator, so the chat bodies are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// OpenAI chat request bodies of 1 to 40 turns: a system prompt (mostly),
/// tools (two in three), user and assistant turns drawn from the text
/// samples and the short turns of `chat-parts.txt`, some multi-part user
/// content, some tool calls with their results.
fn chats(samples: &[Sample]) -> Vec<Sample> {
    let parts = split(CHAT_PARTS);
    let of = |prefix: &str| -> Vec<&str> {
        parts
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(_, t)| t.as_str())
            .collect()
    };
    let (systems, user_short, assistant_short) =
        (of("system-"), of("user-short"), of("assistant-short"));
    let text_of = |class: &str| -> Vec<(&str, &str)> {
        samples
            .iter()
            .filter(|s| s.class == class)
            .filter_map(|s| match &s.input {
                Input::Text(t) => Some((s.name.as_str(), t.as_str())),
                Input::Chat(_) => None,
            })
            .collect()
    };
    let prose: Vec<&str> = ["english", "italian", "cjk"]
        .iter()
        .flat_map(|c| text_of(c))
        .map(|(_, t)| t)
        .collect();
    let code = text_of("code");
    let json_samples = text_of("json");
    let tools: Vec<Value> = json_samples
        .iter()
        .filter(|(n, _)| n.starts_with("tool-") && *n != "tool-call-args" && *n != "tool-result")
        .filter_map(|(_, t)| serde_json::from_str(t).ok())
        .collect();
    let results: Vec<&str> = json_samples
        .iter()
        .filter(|(n, _)| {
            [
                "tool-result",
                "api-response-users",
                "nested-small",
                "event-log",
            ]
            .contains(n)
        })
        .map(|(_, t)| *t)
        .collect();
    let turns = [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 30, 40];

    (0..CHATS)
        .map(|i| {
            let mut rng = Rng(i as u64 + 1);
            let mut messages = Vec::new();
            if i % 5 != 4 {
                messages.push(json!({"role": "system", "content": rng.pick(&systems)}));
            }
            let mut body = json!({"model": "gpt-4o", "temperature": 0.2, "max_tokens": 1024});
            let chosen: Vec<Value> = if i % 3 == 0 {
                Vec::new()
            } else {
                (0..1 + rng.below(4)).map(|_| rng.pick(&tools).clone()).collect()
            };
            for turn in 0..turns[i % turns.len()] {
                // User turn.
                let text = if rng.chance(40) { rng.pick(&user_short).to_string() } else { rng.pick(&prose).to_string() };
                let content = if rng.chance(15) {
                    json!([{"type": "text", "text": text}, {"type": "text", "text": rng.pick(&user_short)}])
                } else {
                    json!(text)
                };
                messages.push(json!({"role": "user", "content": content}));
                // A tool call and its result, when there are tools.
                if !chosen.is_empty() && rng.chance(25) {
                    let tool = rng.pick(&chosen);
                    let name = tool.pointer("/function/name").cloned().unwrap_or(Value::Null);
                    let id = format!("call_{i}x{turn}q{:08x}", rng.next() as u32);
                    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                        {"id": id, "type": "function", "function": {"name": name,
                            "arguments": "{\"city\":\"Bologna\",\"unit\":\"celsius\",\"limit\":20}"}}]}));
                    messages.push(json!({"role": "tool", "tool_call_id": id, "content": rng.pick(&results)}));
                }
                // Assistant turn: prose, a short reply, or code in a fence.
                let reply = match rng.below(3) {
                    0 => rng.pick(&assistant_short).to_string(),
                    1 => rng.pick(&prose).to_string(),
                    _ => {
                        let (name, src) = rng.pick(&code);
                        let lang = name.split('-').next().unwrap_or("");
                        format!("Here is a version that handles it:\n\n```{lang}\n{src}\n```\n\nLet me know if the tests pass.")
                    }
                };
                messages.push(json!({"role": "assistant", "content": reply}));
            }
            // The conversation ends on the user's turn.
            messages.push(json!({"role": "user", "content": rng.pick(&user_short)}));
            body["messages"] = Value::Array(messages);
            if !chosen.is_empty() {
                body["tools"] = Value::Array(chosen);
            }
            Sample { class: "chat", name: format!("chat-{i:02}"), input: Input::Chat(body) }
        })
        .collect()
}

/// The tokenizers measured against, in report order.
pub const VOCABS: [&str; 2] = ["cl100k", "o200k"];

pub fn tokenizers() -> [&'static CoreBPE; 2] {
    [
        tiktoken_rs::cl100k_base_singleton(),
        tiktoken_rs::o200k_base_singleton(),
    ]
}

fn count(bpe: &CoreBPE, text: &str) -> usize {
    bpe.encode_ordinary(text).len()
}

/// The real token count of an input (see the module doc for chat bodies).
pub fn reference_tokens(bpe: &CoreBPE, input: &Input) -> usize {
    match input {
        Input::Text(t) => count(bpe, t),
        Input::Chat(body) => {
            let mut n = 3; // reply priming
            for m in body
                .get("messages")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                n += 4;
                for (key, v) in m.as_object().into_iter().flatten() {
                    n += match (key.as_str(), v) {
                        ("role", _) | (_, Value::Null) => 0,
                        ("content", Value::Array(parts)) => parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .map(|t| count(bpe, t))
                            .sum(),
                        (_, Value::String(s)) => count(bpe, s),
                        (_, other) => count(bpe, &other.to_string()),
                    };
                }
            }
            if let Some(tools) = body.get("tools") {
                n += count(bpe, &tools.to_string());
            }
            n
        }
    }
}

/// The filter's estimate of an input.
pub fn estimate(input: &Input) -> f64 {
    match input {
        Input::Text(t) => sluice_core::bench::text_tokens(t),
        Input::Chat(body) => sluice_core::bench::input_tokens(body),
    }
}

/// One sample measured: its estimate and the real count per tokenizer.
pub struct Point {
    pub class: &'static str,
    pub name: String,
    pub estimate: f64,
    pub real: Vec<usize>,
}

/// Measures every sample against the given tokenizers.
pub fn measure(samples: &[Sample], bpes: &[&CoreBPE]) -> Vec<Point> {
    samples
        .iter()
        .map(|s| Point {
            class: s.class,
            name: s.name.clone(),
            estimate: estimate(&s.input),
            real: bpes.iter().map(|b| reference_tokens(b, &s.input)).collect(),
        })
        .collect()
}

/// Relative errors of a set of samples against one tokenizer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub n: usize,
    /// Median of |est − real| / real.
    pub median: f64,
    /// 95th percentile (nearest rank) of |est − real| / real.
    pub p95: f64,
    /// Median of (est − real) / real: negative means underestimation.
    pub bias: f64,
}

fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Stats of the points of `class` (all points when `None`) for tokenizer `vocab`.
pub fn stats(points: &[Point], class: Option<&str>, vocab: usize) -> Stats {
    let mut signed: Vec<f64> = points
        .iter()
        .filter(|p| class.is_none_or(|c| p.class == c))
        .filter_map(|p| {
            let real = *p.real.get(vocab)? as f64;
            (real > 0.0).then(|| (p.estimate - real) / real)
        })
        .collect();
    let mut abs: Vec<f64> = signed.iter().map(|e| e.abs()).collect();
    signed.sort_by(f64::total_cmp);
    abs.sort_by(f64::total_cmp);
    let n = abs.len();
    let p95 = if n == 0 {
        f64::NAN
    } else {
        abs[((0.95 * n as f64).ceil() as usize).clamp(1, n) - 1]
    };
    Stats {
        n,
        median: median(&abs),
        p95,
        bias: median(&signed),
    }
}

/// The Markdown report: one row per class and one overall, for each tokenizer.
pub fn table(points: &[Point]) -> String {
    table_for(points, &VOCABS)
}

/// [`table`] for points measured against the tokenizers `vocabs` names, in
/// that order.
pub fn table_for(points: &[Point], vocabs: &[&str]) -> String {
    let pct = |x: f64| format!("{:.1} %", x * 100.0);
    let signed = |x: f64| format!("{:+.1} %", x * 100.0);
    let mut out = String::from("| class | n |");
    for v in vocabs {
        out.push_str(&format!(" {v} median | {v} p95 | {v} bias |"));
    }
    out.push_str("\n|---|--:|");
    out.push_str(&"--:|--:|--:|".repeat(vocabs.len()));
    out.push('\n');
    let rows = CLASSES
        .iter()
        .map(|c| (*c, Some(*c)))
        .chain([("**overall**", None)]);
    for (label, class) in rows {
        let first = stats(points, class, 0);
        out.push_str(&format!("| {label} | {} |", first.n));
        for v in 0..vocabs.len() {
            let s = stats(points, class, v);
            out.push_str(&format!(
                " {} | {} | {} |",
                pct(s.median),
                pct(s.p95),
                signed(s.bias)
            ));
        }
        out.push('\n');
    }
    out
}

pub mod llamacpp;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_inner_newlines_and_drops_the_separator_line() {
        let parts = split("---8<--- a\none\n\ntwo\n---8<--- b\nthree\n");
        assert_eq!(
            parts,
            vec![
                ("a".into(), "one\n\ntwo".into()),
                ("b".into(), "three".into())
            ]
        );
    }

    #[test]
    fn chat_reference_counts_framing_content_and_tools() {
        let bpe = tiktoken_rs::cl100k_base_singleton();
        let body = json!({"messages": [{"role": "user", "content": "hello"}]});
        // 4 framing + 1 ("hello") + 3 priming.
        assert_eq!(reference_tokens(bpe, &Input::Chat(body)), 8);
        let tools = json!([{"type": "function"}]);
        let body = json!({"messages": [], "tools": tools});
        assert_eq!(
            reference_tokens(bpe, &Input::Chat(body)),
            3 + count(bpe, &tools.to_string())
        );
    }
}
