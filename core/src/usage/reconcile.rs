//! Reconcile (docs/src/design.md, "Settle"): what a response really cost.
//!
//! One table says where each API puts its usage; one meter reads a response
//! as it streams (JSON, SSE split at any byte, Ollama NDJSON), counts the
//! output it carries, finds the usage, removes the usage chunk sluice asked
//! for on the client's behalf, and ends a stream that runs past its
//! allowance with an OpenAI-shaped error event.

use serde_json::Value;

use super::declared::AnswerAt;
use super::shared::MAX_BELIEVABLE;
pub use super::shared::{Found, Usage};
use super::tape::{Json, Tape};
use super::view::View;

use crate::usage::estimate::text_tokens;

/// Where input and output token counts live, per API shape. The first path
/// that holds a number wins.
const INPUT_PATHS: &[&[&str]] = &[
    &["usage", "prompt_tokens"], // OpenAI chat, completions, embeddings; vLLM score
    &["usage", "input_tokens"],  // OpenAI Responses API, Anthropic Messages
    &["response", "usage", "input_tokens"], // Responses API stream: response.completed
    &["message", "usage", "input_tokens"], // Anthropic stream: message_start
    &["prompt_eval_count"],      // Ollama (also /api/embed)
    &["usage", "total_tokens"],  // rerank (Jina/Cohere shape): input only
];
const OUTPUT_PATHS: &[&[&str]] = &[
    &["usage", "completion_tokens"],
    &["usage", "output_tokens"], // also Anthropic's message_delta (cumulative)
    &["response", "usage", "output_tokens"],
    &["message", "usage", "output_tokens"],
    &["eval_count"],
];
/// Input counted apart from `input_tokens` (Anthropic's prompt cache):
/// added to it, so cached input is charged too. Anthropic's Messages API
/// reference: `input_tokens` is the input after the last cache breakpoint;
/// the total input is it plus `cache_creation_input_tokens` plus
/// `cache_read_input_tokens`. (vLLM's Anthropic endpoint reports the whole
/// prompt as `input_tokens` and neither cache field:
/// vllm/entrypoints/anthropic/serving.py.)
const EXTRA_INPUT_PATHS: &[&[&str]] = &[
    &["usage", "cache_creation_input_tokens"],
    &["usage", "cache_read_input_tokens"],
    &["message", "usage", "cache_creation_input_tokens"],
    &["message", "usage", "cache_read_input_tokens"],
];

/// Input the upstream read from its prompt cache: a part of the input
/// count, never added to it.
/// - OpenAI chat and completions, vLLM (with
///   `--enable-prompt-tokens-details`, vllm/entrypoints/openai/engine/
///   protocol.py `PromptTokenUsageInfo`): `usage.prompt_tokens_details.
///   cached_tokens`, included in `prompt_tokens`;
/// - the Responses API (OpenAI; vLLM; Ollama writes 0, openai/responses.go):
///   `usage.input_tokens_details.cached_tokens`, included in `input_tokens`;
/// - Anthropic: `cache_read_input_tokens`, which [`EXTRA_INPUT_PATHS`]
///   adds to the input, so it is part of the total sluice reads.
///
/// Ollama's own API reports no cached count (api/types.go `Metrics`).
const CACHED_INPUT_PATHS: &[&[&str]] = &[
    &["usage", "prompt_tokens_details", "cached_tokens"],
    &["usage", "input_tokens_details", "cached_tokens"],
    &["response", "usage", "input_tokens_details", "cached_tokens"],
    &["usage", "cache_read_input_tokens"],
    &["message", "usage", "cache_read_input_tokens"],
];
/// Input written to the prompt cache (Anthropic's
/// `cache_creation_input_tokens`, priced above plain input): part of the
/// input total, as above.
const CACHE_WRITE_PATHS: &[&[&str]] = &[
    &["usage", "cache_creation_input_tokens"],
    &["message", "usage", "cache_creation_input_tokens"],
];
/// Output spent reasoning, included in the output count: OpenAI chat and
/// completions `usage.completion_tokens_details.reasoning_tokens`; the
/// Responses API `usage.output_tokens_details.reasoning_tokens` (vLLM's
/// Responses API writes it too). Anthropic counts thinking inside
/// `output_tokens` without a separate figure.
const REASONING_PATHS: &[&[&str]] = &[
    &["usage", "completion_tokens_details", "reasoning_tokens"],
    &["usage", "output_tokens_details", "reasoning_tokens"],
    &[
        "response",
        "usage",
        "output_tokens_details",
        "reasoning_tokens",
    ],
];

/// The parts of a usage that are priced apart. Each is a share of the
/// input or output count it belongs to (cached and cache-written input of
/// the input, reasoning of the output), never added to it: a total is
/// charged once, whatever its parts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Details {
    /// Input the upstream read from its prompt cache.
    pub cached_input: u64,
    /// Input the upstream wrote to its prompt cache.
    pub cache_write_input: u64,
    /// Output the model spent reasoning.
    pub reasoning_output: u64,
}

impl Details {
    /// The larger of each part (stream counts are cumulative).
    fn max(self, other: Details) -> Details {
        Details {
            cached_input: self.cached_input.max(other.cached_input),
            cache_write_input: self.cache_write_input.max(other.cache_write_input),
            reasoning_output: self.reasoning_output.max(other.reasoning_output),
        }
    }

    /// The parts bounded by the totals they belong to: an upstream that
    /// says more was cached than it read, or more reasoning than output,
    /// cannot make a part larger than its whole.
    pub fn within(self, usage: Usage) -> Details {
        let cached_input = self.cached_input.min(usage.input);
        Details {
            cached_input,
            cache_write_input: self.cache_write_input.min(usage.input - cached_input),
            reasoning_output: self.reasoning_output.min(usage.output),
        }
    }
}

/// The detail counts of one response object or stream event. A detail
/// that is no sane count reads as 0: the totals it belongs to are read
/// (and checked) on their own, and a part is never charged twice.
#[cfg(test)]
pub fn details_in<'a>(v: impl View<'a>) -> Details {
    details(&Heads::of(v))
}

fn details<'a, V: View<'a>>(v: &Heads<V>) -> Details {
    let part = |paths: &[&[&str]]| match count(v, paths) {
        Found::Usage(u) => u.input,
        _ => 0,
    };
    Details {
        cached_input: part(CACHED_INPUT_PATHS),
        cache_write_input: part(CACHE_WRITE_PATHS),
        reasoning_output: part(REASONING_PATHS),
    }
}

/// Ollama's final object (`done: true` with the output count) without a
/// `prompt_eval_count`: Ollama leaves the field out when it is 0
/// (api/types.go, `omitempty`), which older versions did whenever the
/// whole prompt came from the prompt cache (ollama/ollama#2068, #3427).
/// Its input is not 0 but unknown: it reads as a reported 0, which
/// settlement replaces with the estimate.
fn ollama_without_input<'a, V: View<'a>>(v: &Heads<V>) -> bool {
    let present = |v: Option<V>| v.is_some_and(|v| !v.is_null());
    v.done.and_then(View::bool) == Some(true)
        && present(v.eval_count)
        && !present(v.prompt_eval_count)
}

/// The first step of every path of the tables above (and what the Ollama
/// rule reads): the members of a response object they start at, found in
/// one pass over its members. (Each path's first step was a lookup of its
/// own: some thirty on every stream event.)
#[derive(Clone, Copy)]
struct Heads<V> {
    usage: Option<V>,
    response: Option<V>,
    message: Option<V>,
    prompt_eval_count: Option<V>,
    eval_count: Option<V>,
    done: Option<V>,
}

impl<'a, V: View<'a>> Heads<V> {
    fn of(v: V) -> Heads<V> {
        let mut heads = Heads {
            usage: None,
            response: None,
            message: None,
            prompt_eval_count: None,
            eval_count: None,
            done: None,
        };
        for (key, value) in v.members() {
            *match key.as_ref() {
                "usage" => &mut heads.usage,
                "response" => &mut heads.response,
                "message" => &mut heads.message,
                "prompt_eval_count" => &mut heads.prompt_eval_count,
                "eval_count" => &mut heads.eval_count,
                "done" => &mut heads.done,
                _ => continue,
            } = Some(value);
        }
        heads
    }

    /// The value at `path`; `None` for a path that starts elsewhere.
    fn at(&self, path: &[&str]) -> Option<V> {
        let (first, rest) = path.split_first()?;
        let head = match *first {
            "usage" => self.usage,
            "response" => self.response,
            "message" => self.message,
            "prompt_eval_count" => self.prompt_eval_count,
            "eval_count" => self.eval_count,
            _ => None,
        };
        at(head?, rest)
    }
}

/// One response object (a JSON answer, one stream event) read once: into
/// a tape (`usage/tape.rs`: no tree, the text skipped as bytes) when the
/// strict read takes it, else into a tree, which also takes what the tape
/// refuses on purpose (a key twice: the last one wins, as it always did).
/// `None`: not JSON.
fn read_object<T>(data: &[u8], read: impl FnOnce(Either<'_>) -> T) -> Option<T> {
    match Tape::read(data) {
        Some(tape) => Some(read(Either::Tape(tape.root()))),
        None => serde_json::from_slice::<Value>(data)
            .ok()
            .map(|v| read(Either::Tree(&v))),
    }
}

/// What [`read_object`] hands its reader: one of the two views (a closure
/// cannot be generic over them).
#[derive(Clone, Copy)]
enum Either<'a> {
    Tape(Json<'a>),
    Tree(&'a Value),
}

/// What a whole JSON answer tells the meter: its usage, the parts priced
/// apart, and, without believable usage, the output its text is estimated
/// at.
#[derive(Debug, PartialEq)]
struct Answer {
    found: Found,
    details: Details,
    output: u64,
}

impl Answer {
    fn of<'a>(v: impl View<'a>) -> Answer {
        let heads = Heads::of(v);
        let found = usage(&heads);
        Answer {
            found,
            details: details(&heads),
            output: match found {
                Found::Usage(_) => 0,
                _ => answer_tokens(v),
            },
        }
    }
}

/// What the meter needs of one stream event: whether it carries output,
/// its usage (input, output, details) when it reports any, and whether it
/// is a usage-only chunk (an empty `choices`).
#[derive(Debug, PartialEq)]
struct StreamEvent {
    carries: bool,
    usage: Option<(Found, Found, Details)>,
    usage_only: bool,
}

impl StreamEvent {
    /// One event's data read once ([`read_object`]); `None` if not JSON.
    fn read(data: &[u8]) -> Option<StreamEvent> {
        read_object(data, |v| match v {
            Either::Tape(v) => StreamEvent::of(v),
            Either::Tree(v) => StreamEvent::of(v),
        })
    }

    fn of<'a>(v: impl View<'a>) -> StreamEvent {
        let heads = Heads::of(v);
        let (input, output) = (input_count(&heads), count(&heads, OUTPUT_PATHS));
        let usage = match usage_of(&heads, input, output) {
            Found::Nothing => None,
            _ => Some((input, output, details(&heads))),
        };
        StreamEvent {
            carries: carries_output(v),
            usage,
            usage_only: v
                .get("choices")
                .is_some_and(|c| c.is_array() && c.items().next().is_none()),
        }
    }
}

fn at<'a, V: View<'a>>(v: V, path: &[&str]) -> Option<V> {
    path.iter().try_fold(v, |v, key| v.get(key))
}

fn count<'a, V: View<'a>>(v: &Heads<V>, paths: &[&[&str]]) -> Found {
    for path in paths {
        match v.at(path) {
            None => continue,
            Some(n) if n.is_null() => continue,
            Some(n) => {
                return match n.u64() {
                    Some(n) if n <= MAX_BELIEVABLE => Found::Usage(Usage {
                        input: n,
                        output: n,
                    }),
                    _ => Found::Invalid,
                }
            }
        }
    }
    Found::Nothing
}

/// The input count with the extra input fields added; `Invalid` if any of
/// them is not a sane count.
fn input_count<'a, V: View<'a>>(v: &Heads<V>) -> Found {
    match reported_input(v) {
        Found::Nothing if ollama_without_input(v) => Found::Usage(Usage::default()),
        found => found,
    }
}

/// The input count as reported (with the extra input fields), with no
/// count inferred for a field left out.
fn reported_input<'a, V: View<'a>>(v: &Heads<V>) -> Found {
    let found = count(v, INPUT_PATHS);
    let Found::Usage(mut base) = found else {
        return found;
    };
    for path in EXTRA_INPUT_PATHS {
        match count(v, &[path]) {
            Found::Nothing => {}
            Found::Invalid => return Found::Invalid,
            Found::Usage(extra) => {
                base.input = base.input.saturating_add(extra.input).min(MAX_BELIEVABLE);
            }
        }
    }
    Found::Usage(base)
}

/// Reads the usage of one response object (a JSON body or one stream event).
#[cfg(test)]
pub fn usage_in<'a>(v: impl View<'a>) -> Found {
    usage(&Heads::of(v))
}

fn usage<'a, V: View<'a>>(v: &Heads<V>) -> Found {
    usage_of(v, input_count(v), count(v, OUTPUT_PATHS))
}

/// The usage of one response object when it reports both its input and
/// its output as sane counts: nothing left out, nothing to estimate (what
/// the response cache records of an answer it stores).
pub fn reported_in<'a>(v: impl View<'a>) -> Option<Usage> {
    let v = &Heads::of(v);
    match (reported_input(v), count(v, OUTPUT_PATHS)) {
        (Found::Usage(i), Found::Usage(o)) => Some(Usage {
            input: i.input,
            output: o.output,
        }),
        _ => None,
    }
}

/// The usage of `v` from its input and output counts, read once.
fn usage_of<'a, V: View<'a>>(v: &Heads<V>, input: Found, output: Found) -> Found {
    match (input, output) {
        (Found::Invalid, _) | (_, Found::Invalid) => Found::Invalid,
        (Found::Usage(i), Found::Usage(o)) => Found::Usage(Usage {
            input: i.input,
            output: o.output,
        }),
        // Embeddings report input only.
        (Found::Usage(i), Found::Nothing) => Found::Usage(Usage {
            input: i.input,
            output: 0,
        }),
        (Found::Nothing, Found::Usage(_)) => Found::Invalid,
        (Found::Nothing, Found::Nothing) => {
            if v.usage.is_some_and(|u| !u.is_null()) {
                Found::Invalid
            } else {
                Found::Nothing
            }
        }
    }
}

/// Does this stream event carry generated text? OpenAI streams send about
/// one token per event, so each such event counts as one output token.
fn carries_output<'a>(v: impl View<'a>) -> bool {
    let text = |v: Option<_>| v.is_some_and(View::non_empty_str);
    if let Some(choices) = v.get("choices").filter(|c| c.is_array()) {
        return choices.items().any(|c| {
            text(at(c, &["delta", "content"]))
                || text(c.get("text"))
                || text(at(c, &["delta", "reasoning_content"]))
                || at(c, &["delta", "tool_calls"]).is_some_and(|t| !t.is_null())
        });
    }
    // Responses API delta events; Anthropic content deltas; Ollama lines.
    text(v.get("delta"))
        || text(at(v, &["delta", "text"]))
        || text(at(v, &["delta", "partial_json"]))
        || text(at(v, &["delta", "thinking"]))
        || text(at(v, &["message", "content"]))
        || text(v.get("response"))
}

/// Output tokens of a whole (not streamed) answer, estimated from its text
/// like input is: what an answer without believable usage is charged.
fn answer_tokens<'a>(v: impl View<'a>) -> u64 {
    let text = |v: Option<_>| {
        v.and_then(View::str)
            .map_or(0.0, |s: std::borrow::Cow<str>| text_tokens(&s))
    };
    let json = |v: Option<_>| {
        v.filter(|v: &_| !View::is_null(*v))
            .map_or(0.0, |v| text_tokens(&View::compact(v)))
    };
    let mut tokens = text(v.get("response")) + text(at(v, &["message", "content"])); // Ollama
    for c in v.get("choices").into_iter().flat_map(View::items) {
        tokens += text(at(c, &["message", "content"]))
            + text(at(c, &["message", "reasoning_content"]))
            + json(at(c, &["message", "tool_calls"]))
            + text(c.get("text"));
    }
    for part in v.get("content").into_iter().flat_map(View::items) {
        // Anthropic Messages: text blocks, tool inputs.
        tokens += text(part.get("text")) + json(part.get("input"));
    }
    for item in v.get("output").into_iter().flat_map(View::items) {
        for part in item.get("content").into_iter().flat_map(View::items) {
            tokens += text(part.get("text")); // Responses API
        }
    }
    tokens.ceil() as u64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON document, read whole at the end.
    Json,
    /// Server-sent events (`data: {...}` blocks).
    Sse,
    /// One JSON object per line (Ollama).
    Ndjson,
}

impl Format {
    pub fn detect(content_type: Option<&str>, ollama_stream: bool) -> Format {
        let ct = content_type.unwrap_or("").to_ascii_lowercase();
        if ct.contains("text/event-stream") {
            Format::Sse
        } else if ct.contains("ndjson") || (ollama_stream && !ct.contains("application/json")) {
            Format::Ndjson
        } else {
            Format::Json
        }
    }
}

/// Largest JSON body kept for reading its usage.
const MAX_JSON_BODY: usize = 8 << 20;

/// Largest unfinished stream event (SSE event or NDJSON line) held while
/// waiting for its end. Real events are a few hundred bytes; an upstream
/// that never ends one would otherwise grow the VM's memory without bound
/// while the client receives nothing. Past it the stream is ended, as for
/// a budget that ran out, and the event counts as output.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// The code of the error event that ends a stream whose event is too long.
pub const OVERSIZED_CODE: &str = "upstream_event_too_large";

/// Reads a response as it passes and decides what the client gets.
#[derive(Debug)]
pub struct ResponseMeter {
    format: Format,
    /// Bytes of an incomplete event or line, held until it completes.
    pending: Vec<u8>,
    /// Output counted: events seen (SSE/NDJSON), or the estimated tokens of
    /// a JSON answer without believable usage.
    pub output_events: u64,
    pub found: Found,
    /// The parts of the usage priced apart, as read (see [`Self::details`]).
    details: Details,
    /// Drop the usage-only chunk (sluice asked for it, the client did not).
    strip_usage: bool,
    /// End the stream once this many output events went by.
    allowance: Option<u64>,
    /// The stream was ended early by sluice.
    pub cut: bool,
    /// The largest input and output counts a stream's events carried.
    stream_input: Option<u64>,
    stream_output: Option<u64>,
    /// An event carried a count that is no sane number: the stream's usage
    /// cannot be believed, and the reservation stands.
    stream_invalid: bool,
    /// SSE: the last event ended with a CR at the end of a chunk; an LF
    /// starting the next chunk belongs to it (a CRLF split in two).
    open_cr: Option<LastEvent>,
    /// A declared API's answer: where it reports usage and text, and the
    /// output reserved (charged when it says nothing believable).
    declared: Option<(AnswerAt, u64)>,
}

/// What happened to the SSE event whose CR may still get its LF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LastEvent {
    Kept,
    Dropped,
}

/// The OpenAI-shaped error event that ends a stream past its budget.
pub const MIDSTREAM_CODE: &str = "budget_exhausted_midstream";

impl ResponseMeter {
    pub fn new(format: Format, strip_usage: bool, allowance: Option<u64>) -> ResponseMeter {
        ResponseMeter {
            format,
            pending: Vec::new(),
            output_events: 0,
            found: Found::Nothing,
            details: Details::default(),
            strip_usage,
            allowance,
            cut: false,
            stream_input: None,
            stream_output: None,
            stream_invalid: false,
            open_cr: None,
            declared: None,
        }
    }

    /// The meter of a declared API's answer: one JSON document, read at
    /// the declaration's pointers (`usage/declared.rs`).
    pub fn declared(at: AnswerAt, reserved: u64) -> ResponseMeter {
        let mut meter = ResponseMeter::new(Format::Json, false, None);
        meter.declared = Some((at, reserved));
        meter
    }

    /// Feeds one chunk of the body; returns what to send the client in its
    /// place (`None`: send the chunk unchanged).
    pub fn feed(&mut self, chunk: &[u8], end: bool) -> Option<Vec<u8>> {
        match self.format {
            Format::Json => {
                if self.pending.len() + chunk.len() <= MAX_JSON_BODY {
                    self.pending.extend_from_slice(chunk);
                }
                if end {
                    if let Some((at, reserved)) = &self.declared {
                        let v = serde_json::from_slice::<Value>(&self.pending).ok();
                        (self.found, self.output_events) = at.read(v.as_ref(), *reserved);
                    } else if let Some(read) = read_object(&self.pending, |v| match v {
                        Either::Tape(v) => Answer::of(v),
                        Either::Tree(v) => Answer::of(v),
                    }) {
                        (self.found, self.details, self.output_events) =
                            (read.found, read.details, read.output);
                    }
                    self.pending.clear();
                }
                None
            }
            Format::Sse | Format::Ndjson => Some(self.feed_stream(chunk, end)),
        }
    }

    fn feed_stream(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        if self.cut {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(self.pending.len() + chunk.len());
        let mut chunk = chunk;
        if !chunk.is_empty() {
            if let Some(last) = self.open_cr.take() {
                if let Some(rest) = chunk.strip_prefix(b"\n") {
                    // The LF of the previous event's CRLF: it goes (or is
                    // dropped) with that event.
                    if last == LastEvent::Kept {
                        out.push(b'\n');
                    }
                    chunk = rest;
                }
            }
        }
        self.pending.extend_from_slice(chunk);
        // The events are read in place (the buffer is taken while they
        // are, and put back with what is left of it).
        let pending = std::mem::take(&mut self.pending);
        let mut start = 0;
        loop {
            let next = match self.format {
                Format::Sse => sse_event_end(&pending[start..], end),
                _ => find(&pending[start..], b"\n").map(|p| (p + 1, false)),
            };
            let Some((len, open_cr)) = next else { break };
            let stop = start + len;
            let event = &pending[start..stop];
            start = stop;
            let before = out.len();
            if self.event(event, &mut out) {
                return out;
            }
            if open_cr {
                self.open_cr = Some(if out.len() > before {
                    LastEvent::Kept
                } else {
                    LastEvent::Dropped
                });
            }
        }
        self.pending = pending;
        self.pending.drain(..start);
        if end && !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending);
            self.event(&rest, &mut out);
        } else if self.pending.len() > MAX_EVENT_BYTES {
            self.pending = Vec::new();
            self.output_events = self.output_events.saturating_add(1);
            self.cut = true;
            out.extend_from_slice(&self.end_message(
                "The upstream sent a stream event too long to read; the stream was ended.",
                "upstream_error",
                OVERSIZED_CODE,
            ));
        }
        out
    }

    /// Handles one complete event or line; true when the stream was cut.
    fn event(&mut self, raw: &[u8], out: &mut Vec<u8>) -> bool {
        let json = match self.format {
            Format::Sse => sse_data(raw),
            _ => Some(std::borrow::Cow::Borrowed(trim(raw))),
        };
        let data = json.filter(|d| !trim(d).is_empty() && trim(d) != b"[DONE]");
        let read = data.as_deref().and_then(StreamEvent::read);
        let mut keep = true;
        if let Some(event) = read {
            if event.carries {
                if self.allowance.is_some_and(|a| self.output_events >= a) {
                    // Output past what was reserved: end the stream here.
                    // (A stream that stops at its allowance passes whole,
                    // with its finish and usage chunks.)
                    self.cut = true;
                    out.extend_from_slice(&self.cut_message());
                    return true;
                }
                self.output_events += 1;
            }
            if let Some((input, output, details)) = event.usage {
                self.merge(input, output);
                self.details = self.details.max(details);
                if self.strip_usage && event.usage_only {
                    keep = false;
                }
            }
        }
        if keep {
            out.extend_from_slice(raw);
        }
        false
    }

    /// Folds one stream event's counts into the stream's usage. Counts in
    /// a stream are cumulative (vLLM's continuous usage stats, Anthropic's
    /// `message_start` input then `message_delta` output): the largest seen
    /// is the total, wherever each half came from. Input never seen, or a
    /// count that is no sane number in any event: `Invalid`, as for a
    /// single object.
    fn merge(&mut self, input: Found, output: Found) {
        self.stream_invalid |= input == Found::Invalid || output == Found::Invalid;
        if let Found::Usage(u) = input {
            self.stream_input = self.stream_input.max(Some(u.input));
        }
        if let Found::Usage(u) = output {
            self.stream_output = self.stream_output.max(Some(u.output));
        }
        self.found = match self.stream_input {
            _ if self.stream_invalid => Found::Invalid,
            Some(input) => Found::Usage(Usage {
                input,
                output: self.stream_output.unwrap_or(0),
            }),
            None => Found::Invalid,
        };
    }

    /// The parts of the settled usage priced apart, bounded by its
    /// totals; none without believable usage (the estimate has no parts).
    pub fn details(&self) -> Details {
        match self.found {
            Found::Usage(u) => self.details.within(u),
            _ => Details::default(),
        }
    }

    fn cut_message(&self) -> Vec<u8> {
        self.end_message(
            "The budget for this request ran out during the response; the stream was ended.",
            "rate_limit_exceeded",
            MIDSTREAM_CODE,
        )
    }

    /// The error event (SSE) or line (NDJSON) that ends a stream early.
    fn end_message(&self, message: &str, kind: &str, code: &str) -> Vec<u8> {
        let error = serde_json::json!({"error": {
            "message": message,
            "type": kind,
            "code": code,
            "param": null,
        }});
        match self.format {
            Format::Sse => format!("data: {error}\n\ndata: [DONE]\n\n").into_bytes(),
            _ => {
                let mut line = error;
                line["done"] = Value::Bool(true);
                format!("{line}\n").into_bytes()
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    match needle {
        [byte] => memchr::memchr(*byte, haystack),
        _ => haystack.windows(needle.len()).position(|w| w == needle),
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end]
}

/// Where the first complete SSE event of `buf` ends: just past the line
/// break of the blank line that ends it. Lines end with CRLF, LF or CR (the
/// SSE spec allows all three, mixed). The bool says the event ended with a
/// CR that is the last byte of `buf`: its LF, if any, is in the next chunk.
/// A lone CR before the end of the stream ends a line, so a stream split
/// between CR and LF neither stalls nor sees a blank line that is not there.
fn sse_event_end(buf: &[u8], end: bool) -> Option<(usize, bool)> {
    let mut line_start = 0;
    let mut i = 0;
    while let Some(p) = buf
        .get(i..)
        .and_then(|rest| memchr::memchr2(b'\r', b'\n', rest))
    {
        let at = i + p;
        let (next, open_cr) = match (buf[at], buf.get(at + 1)) {
            (b'\r', Some(b'\n')) => (at + 2, false),
            (b'\r', None) => (at + 1, !end),
            _ => (at + 1, false),
        };
        if at == line_start {
            return Some((next, open_cr));
        }
        line_start = next;
        i = next;
    }
    None
}

/// The data of each event of a whole SSE stream, in order, read as
/// [`ResponseMeter`] reads a stream split at any byte; a last event with
/// no blank line after it counts too, as at a stream's end.
pub fn sse_data_events(stream: &[u8]) -> Vec<Vec<u8>> {
    let mut events = Vec::new();
    let mut rest = stream;
    while let Some((len, _)) = sse_event_end(rest, true) {
        events.extend(sse_data(&rest[..len]).map(|d| d.into_owned()));
        rest = &rest[len..];
    }
    events.extend(sse_data(rest).map(|d| d.into_owned()));
    events
}

/// The lines of one SSE event, whatever their line ends.
fn sse_lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    event
        .split(|c| *c == b'\n' || *c == b'\r')
        .filter(|line| !line.is_empty())
}

/// The data of one SSE event: its `data:` lines joined with LF, as a client
/// joins them (a JSON object may be spread over several data lines).
/// One data line is the event's data as it is (borrowed); several are
/// joined into a copy.
fn sse_data(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    let mut data: Option<Cow<[u8]>> = None;
    for line in sse_lines(event) {
        let Some(value) = line.strip_prefix(b"data") else {
            continue;
        };
        let value = match value {
            [] => value,
            [b':', rest @ ..] => rest.strip_prefix(b" ").unwrap_or(rest),
            _ => continue, // another field, e.g. `dataset:`
        };
        match &mut data {
            None => data = Some(Cow::Borrowed(value)),
            Some(d) => {
                let d = d.to_mut();
                d.push(b'\n');
                d.extend_from_slice(value);
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_whole_stream_reads_event_by_event() {
        let stream = b"data: {\"a\":1}\r\n\r\n: comment\n\nevent: x\ndata: {\"b\":\ndata: 2}\n\ndata: [DONE]";
        assert_eq!(
            sse_data_events(stream),
            vec![
                b"{\"a\":1}".to_vec(),
                b"{\"b\":\n2}".to_vec(),
                b"[DONE]".to_vec()
            ]
        );
    }

    /// A stream event read from its tape tells the meter what its tree
    /// tells it, for every upstream's events and for shapes around them;
    /// what the tape refuses (a key twice) is read as a tree.
    #[test]
    fn a_stream_event_read_from_its_tape_agrees_with_its_tree() {
        let events = [
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":" tok"}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"é"}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":null,"reasoning_content":"think"}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"tool_calls":null}}]}"#,
            r#"{"id":"c","choices":[{"index":0,"text":"x","finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":2},"completion_tokens_details":{"reasoning_tokens":1}}}"#,
            r#"{"id":"c","choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":9,"completion_tokens":1}}"#,
            r#"{"choices":null,"usage":null}"#,
            r#"{"choices":"x"}"#,
            r#"{"choices":[null]}"#,
            r#"{"choices":[{"delta":"text"}]}"#,
            r#"{"choices":[{"delta":{"content":["a"]}}]}"#,
            r#"{"choices":[{"delta":{"content":7}}]}"#,
            r#"{"choices":[{"delta":{"content":"a"},"delta":{"content":""}}]}"#,
            r#"{"choices":[],"choices":[{"delta":{"content":"a"}}]}"#,
            r#"{"type":"message_start","message":{"usage":{"input_tokens":12,"cache_read_input_tokens":5,"output_tokens":1}}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{"a"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":7}}"#,
            r#"{"type":"response.output_text.delta","delta":"hi"}"#,
            r#"{"type":"response.completed","response":{"output":[],"usage":{"input_tokens":3,"output_tokens":4,"output_tokens_details":{"reasoning_tokens":2}}}}"#,
            r#"{"model":"m","message":{"role":"assistant","content":"hi"},"done":false}"#,
            r#"{"model":"m","response":"","done":true,"prompt_eval_count":4,"eval_count":6}"#,
            r#"{"model":"m","message":{"content":""},"done":true,"eval_count":6}"#,
            r#"{"usage":{"prompt_tokens":"3","completion_tokens":4}}"#,
            r#"[1,2]"#,
            r#"{"choices":[{"delta":{"content":"cut"#,
        ];
        for data in events {
            let tree = serde_json::from_slice::<Value>(data.as_bytes())
                .ok()
                .map(|v| StreamEvent::of(&v));
            assert_eq!(StreamEvent::read(data.as_bytes()), tree, "{data}");
            if let Some(tape) = Tape::read(data.as_bytes()) {
                assert_eq!(Some(StreamEvent::of(tape.root())), tree, "{data}");
            }
        }
        // The tape takes the common shapes (else it saves nothing).
        for data in &events[..10] {
            assert!(Tape::read(data.as_bytes()).is_some(), "{data}");
        }
    }

    fn event_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let key = prop::sample::select(vec![
            "choices",
            "delta",
            "content",
            "text",
            "reasoning_content",
            "tool_calls",
            "usage",
            "prompt_tokens",
            "completion_tokens",
            "input_tokens",
            "output_tokens",
            "message",
            "response",
            "done",
            "eval_count",
            "prompt_eval_count",
            "cached_tokens",
            "prompt_tokens_details",
            "cache_read_input_tokens",
            "partial_json",
            "thinking",
            "id",
        ]);
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (0u64..20).prop_map(Value::from),
            prop::sample::select(vec!["", "a", "\u{e9}", "\"q\""]).prop_map(Value::from),
        ];
        let object = |key: BoxedStrategy<&'static str>, inner: BoxedStrategy<Value>| {
            prop::collection::btree_map(key, inner, 0..4).prop_map(|m| {
                Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            })
        };
        let key = key.boxed();
        let top_key = key.clone();
        let value = leaf.prop_recursive(4, 32, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                object(key.clone(), inner.boxed()),
            ]
        });
        // Chat chunks' choices, with every delta field sometimes there.
        let part = prop_oneof![
            Just(Value::Null),
            Just(Value::from("")),
            Just(Value::from("tok")),
            Just(serde_json::json!([{"index": 0}])),
            Just(Value::from(3)),
        ];
        let delta = prop::collection::btree_map(
            prop::sample::select(vec!["content", "reasoning_content", "tool_calls", "role"]),
            part.clone(),
            0..3,
        )
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()));
        let choice = (prop::option::of(delta), prop::option::of(part)).prop_map(|(d, t)| {
            let mut c = serde_json::Map::new();
            c.insert("index".into(), Value::from(0));
            if let Some(d) = d {
                c.insert("delta".into(), d);
            }
            if let Some(t) = t {
                c.insert("text".into(), t);
            }
            Value::Object(c)
        });
        let choices = prop::option::of(prop::collection::vec(choice, 0..3));
        // An event is an object.
        (object(top_key, value.boxed()), choices).prop_map(|(mut event, choices)| {
            if let (Some(c), Value::Object(m)) = (choices, &mut event) {
                m.insert("choices".into(), Value::Array(c));
            }
            event
        })
    }

    proptest::proptest! {
        /// Random events built of the fields the meter reads: the tape
        /// says what the tree says.
        #[test]
        fn random_stream_events_read_the_same_from_tape_and_tree(v in event_value()) {
            let data = serde_json::to_vec(&v).unwrap();
            let tape = Tape::read(&data).unwrap();
            proptest::prop_assert_eq!(StreamEvent::of(tape.root()), StreamEvent::of(&v));
            proptest::prop_assert_eq!(Answer::of(tape.root()), Answer::of(&v));
        }
    }

    /// An answer read from its tape gives what its tree gives, for every
    /// upstream's shape and the text estimate of one without usage; what
    /// the tape refuses (a duplicate field) is read as a tree.
    #[test]
    fn an_answer_read_from_its_tape_agrees_with_its_tree() {
        let answers = [
            r#"{"id":"x","choices":[{"message":{"content":"hi \"there\""}}],"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8},"completion_tokens_details":{"reasoning_tokens":2}}}"#,
            r#"{"content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":5,"cache_read_input_tokens":100,"cache_creation_input_tokens":7,"output_tokens":9}}"#,
            r#"{"model":"m","message":{"role":"assistant","content":"hi"},"done":true,"prompt_eval_count":4,"eval_count":6}"#,
            r#"{"model":"m","response":"hi","done":true,"eval_count":6}"#,
            r#"{"data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":3,"total_tokens":3}}"#,
            r#"{"output":[],"usage":{"input_tokens":3,"output_tokens":4,"output_tokens_details":{"reasoning_tokens":1}}}"#,
            r#"{"choices":[{"message":{"content":"no usage here"}}]}"#,
            r#"{"choices":[{"message":{"content":"line\nbreak \u00e9t\u00e9","reasoning_content":"hm","tool_calls":[{"function":{"name":"f","arguments":"{\"b\":1,\"a\":2}"}}]}},{"text":"two"}]}"#,
            r#"{"content":[{"type":"text","text":"hi"},{"type":"tool_use","input":{"z":[1,2.5,"\u2028"],"a":null}}]}"#,
            r#"{"output":[{"content":[{"text":"\ud83d\ude00 x"}]}],"usage":null}"#,
            r#"{"model":"m","response":"  spaced  out ","done":false}"#,
            r#"{"choices":[],"usage":null}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":"3","completion_tokens":4}}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4},"usage":{"prompt_tokens":30,"completion_tokens":40}}"#,
            r#"{"choices":[],"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
            r#"[{"usage":{"prompt_tokens":3,"completion_tokens":4}}]"#,
            r#"{"choices":[{"message":{"content":"cut"#,
        ];
        for answer in answers {
            let whole = |bytes: &[u8]| {
                let mut m = ResponseMeter::new(Format::Json, false, None);
                let v = serde_json::from_slice::<Value>(bytes).ok();
                m.found = v.as_ref().map_or(Found::Nothing, usage_in);
                m.details = v.as_ref().map_or_else(Details::default, details_in);
                if let (Some(v), false) = (&v, matches!(m.found, Found::Usage(_))) {
                    m.output_events = answer_tokens(v);
                }
                (m.found, m.details(), m.output_events)
            };
            let mut meter = ResponseMeter::new(Format::Json, false, None);
            let (head, tail) = answer.as_bytes().split_at(answer.len() / 2);
            assert_eq!(meter.feed(head, false), None);
            assert_eq!(meter.feed(tail, true), None);
            assert_eq!(
                (meter.found, meter.details(), meter.output_events),
                whole(answer.as_bytes()),
                "{answer}"
            );
        }
    }

    /// Every path of the tables starts at a member [`Heads`] finds (one
    /// that did not would never be read).
    #[test]
    fn every_usage_path_starts_at_a_head() {
        let tables = [
            INPUT_PATHS,
            OUTPUT_PATHS,
            EXTRA_INPUT_PATHS,
            CACHED_INPUT_PATHS,
            CACHE_WRITE_PATHS,
            REASONING_PATHS,
        ];
        for path in tables.into_iter().flatten() {
            let mut object = json!(7);
            for key in path.iter().rev() {
                object = json!({ *key: object });
            }
            let heads = Heads::of(&object);
            assert_eq!(heads.at(path), Some(&json!(7)), "{path:?}");
        }
    }

    #[test]
    fn reported_usage_needs_both_counts() {
        let ok = json!({"usage": {"prompt_tokens": 3, "completion_tokens": 4}});
        assert_eq!(
            reported_in(&ok),
            Some(Usage {
                input: 3,
                output: 4
            })
        );
        // Settlement reads Ollama's missing input as 0; a report it is not.
        let ollama = json!({"done": true, "eval_count": 4});
        assert_eq!(
            usage_in(&ollama),
            Found::Usage(Usage {
                input: 0,
                output: 4
            })
        );
        assert_eq!(reported_in(&ollama), None);
        assert_eq!(reported_in(&json!({"usage": {"prompt_tokens": 3}})), None);
        let huge = json!({"usage": {"prompt_tokens": 3, "completion_tokens": MAX_BELIEVABLE + 1}});
        assert_eq!(reported_in(&huge), None);
    }

    #[test]
    fn usage_table_covers_every_shape() {
        let openai =
            json!({"usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}});
        assert_eq!(
            usage_in(&openai),
            Found::Usage(Usage {
                input: 12,
                output: 30
            })
        );
        let responses = json!({"usage": {"input_tokens": 5, "output_tokens": 7}});
        assert_eq!(
            usage_in(&responses),
            Found::Usage(Usage {
                input: 5,
                output: 7
            })
        );
        let completed = json!({"type": "response.completed", "response": {"usage": {"input_tokens": 1, "output_tokens": 2}}});
        assert_eq!(
            usage_in(&completed),
            Found::Usage(Usage {
                input: 1,
                output: 2
            })
        );
        let ollama = json!({"done": true, "prompt_eval_count": 9, "eval_count": 4});
        assert_eq!(
            usage_in(&ollama),
            Found::Usage(Usage {
                input: 9,
                output: 4
            })
        );
        let embeddings = json!({"usage": {"prompt_tokens": 3, "total_tokens": 3}});
        assert_eq!(
            usage_in(&embeddings),
            Found::Usage(Usage {
                input: 3,
                output: 0
            })
        );
        assert_eq!(usage_in(&json!({"choices": []})), Found::Nothing);
    }

    #[test]
    fn garbage_usage_is_invalid_not_trusted() {
        for bad in [
            json!({"usage": {"prompt_tokens": "12", "completion_tokens": 3}}),
            json!({"usage": {"prompt_tokens": -1, "completion_tokens": 3}}),
            json!({"usage": {"prompt_tokens": 1e15, "completion_tokens": 3}}),
            json!({"usage": {"prompt_tokens": 5, "completion_tokens": 1_000_000_000_000u64}}),
            json!({"usage": "lots"}),
            json!({"usage": {}}),
        ] {
            assert_eq!(usage_in(&bad), Found::Invalid, "{bad}");
        }
    }

    fn sse(events: &[Value], done: bool) -> Vec<u8> {
        let mut s: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        if done {
            s.push_str("data: [DONE]\n\n");
        }
        s.into_bytes()
    }

    fn chunk(text: &str) -> Value {
        json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]})
    }

    #[test]
    fn sse_split_at_every_byte_reads_the_same() {
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}});
        let body = sse(&[chunk("a"), chunk(" b"), chunk(" c"), usage], true);
        for split in 1..body.len() {
            let mut m = ResponseMeter::new(Format::Sse, false, None);
            let mut out = m.feed(&body[..split], false).unwrap();
            out.extend(m.feed(&body[split..], true).unwrap());
            assert_eq!(out, body, "split at {split}");
            assert_eq!(m.output_events, 3);
            assert_eq!(
                m.found,
                Found::Usage(Usage {
                    input: 4,
                    output: 3
                })
            );
        }
    }

    /// The three line ends the SSE spec allows.
    const NEWLINES: [&str; 3] = ["\n", "\r\n", "\r"];

    /// `events` framed with `nl`: `event:` lines where given, data split
    /// over two lines for the second event, a comment, and `[DONE]`.
    fn framed(events: &[Value], nl: &str) -> Vec<u8> {
        let mut s = format!(": keep-alive{nl}{nl}");
        for (i, e) in events.iter().enumerate() {
            let text = e.to_string();
            if i == 1 {
                // One JSON object over two data lines, joined by the client.
                // Split between JSON tokens (after the first key).
                let (a, b) = text.split_at(text.find(':').map_or(0, |i| i + 1));
                s.push_str(&format!("event: message{nl}data: {a}{nl}data:{b}{nl}{nl}"));
            } else {
                s.push_str(&format!("data: {text}{nl}{nl}"));
            }
        }
        s.push_str(&format!("data: [DONE]{nl}{nl}"));
        s.into_bytes()
    }

    /// Feeds `body` cut at `cuts` (sorted positions); returns the output
    /// and the meter.
    fn feed_cut(
        body: &[u8],
        cuts: &[usize],
        strip: bool,
        allowance: Option<u64>,
    ) -> (Vec<u8>, ResponseMeter) {
        let mut m = ResponseMeter::new(Format::Sse, strip, allowance);
        let mut out = Vec::new();
        let mut from = 0;
        for &c in cuts.iter().chain(std::iter::once(&body.len())) {
            out.extend(m.feed(&body[from..c], c == body.len()).unwrap());
            from = c;
        }
        (out, m)
    }

    #[test]
    fn sse_in_lf_crlf_and_cr_reads_the_same_split_anywhere() {
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}});
        let events = [chunk("a"), chunk(" b"), chunk(" c"), usage];
        let want = Found::Usage(Usage {
            input: 4,
            output: 3,
        });
        for nl in NEWLINES {
            let body = framed(&events, nl);
            let stripped = framed(&events[..3], nl);
            for split in 0..=body.len() {
                for strip in [false, true] {
                    let (out, m) = feed_cut(&body, &[split], strip, None);
                    assert_eq!(m.output_events, 3, "{nl:?} split at {split}");
                    assert_eq!(m.found, want, "{nl:?} split at {split}");
                    let expected = if strip { &stripped } else { &body };
                    assert_eq!(&out, expected, "{nl:?} split at {split}, strip {strip}");
                }
                // Cut past its allowance the same way in every framing.
                let (out, m) = feed_cut(&body, &[split], false, Some(2));
                assert!(m.cut, "{nl:?} split at {split}");
                assert_eq!(m.output_events, 2);
                assert!(String::from_utf8_lossy(&out).contains(MIDSTREAM_CODE));
            }
            // And byte by byte.
            let every: Vec<usize> = (1..body.len()).collect();
            let (out, m) = feed_cut(&body, &every, false, None);
            assert_eq!(
                (out, m.output_events, m.found),
                (body.clone(), 3, want),
                "{nl:?}"
            );
        }
    }

    #[test]
    fn a_crlf_split_between_its_cr_and_lf_is_one_line_end() {
        // "\r" | "\n\r\n": not a blank line after the first CR.
        let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n";
        let at = body.len() - 3;
        let mut m = ResponseMeter::new(Format::Sse, false, None);
        let first = m.feed(&body[..at], false).unwrap();
        assert!(first.is_empty(), "event not complete yet");
        let rest = m.feed(&body[at..], false).unwrap();
        assert_eq!(rest, body.to_vec());
        assert_eq!(m.output_events, 1);
        // An event dropped at a CR takes its LF along.
        let usage =
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\r\n\r";
        let mut m = ResponseMeter::new(Format::Sse, true, None);
        assert!(m.feed(usage, false).unwrap().is_empty());
        assert_eq!(
            m.feed(b"\ndata: [DONE]\r\n\r\n", true).unwrap(),
            b"data: [DONE]\r\n\r\n".to_vec()
        );
        assert!(matches!(m.found, Found::Usage(_)));
    }

    #[test]
    fn sse_data_lines_join_like_a_client() {
        assert_eq!(
            sse_data(b"data: a\ndata: b\n\n").map(|d| d.into_owned()),
            Some(b"a\nb".to_vec())
        );
        assert_eq!(
            sse_data(b"data:a\r\n\r\n").map(|d| d.into_owned()),
            Some(b"a".to_vec())
        );
        assert_eq!(
            sse_data(b"event: x\rdata: {}\r\r").map(|d| d.into_owned()),
            Some(b"{}".to_vec())
        );
        assert_eq!(sse_data(b"dataset: x\n\n").map(|d| d.into_owned()), None);
        assert_eq!(sse_data(b": comment\n\n").map(|d| d.into_owned()), None);
    }

    #[test]
    fn the_usage_chunk_sluice_asked_for_is_removed() {
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}});
        let body = sse(&[chunk("a"), usage], true);
        let mut m = ResponseMeter::new(Format::Sse, true, None);
        let out = m.feed(&body, true).unwrap();
        assert_eq!(out, sse(&[chunk("a")], true));
        assert!(matches!(m.found, Found::Usage(_)));
    }

    #[test]
    fn a_stream_past_its_allowance_ends_with_an_error_event() {
        let body = sse(&[chunk("a"), chunk("b"), chunk("c"), chunk("d")], true);
        let mut m = ResponseMeter::new(Format::Sse, false, Some(2));
        let mut out = m.feed(&body[..10], false).unwrap();
        out.extend(m.feed(&body[10..], false).unwrap());
        out.extend(m.feed(b"data: more\n\n", true).unwrap());
        let text = String::from_utf8(out).unwrap();
        assert!(m.cut);
        assert_eq!(m.output_events, 2);
        assert_eq!(text.matches("delta").count(), 2);
        assert!(text.contains(MIDSTREAM_CODE));
        assert!(text.ends_with("data: [DONE]\n\n"));
    }

    #[test]
    fn a_stream_that_uses_exactly_its_allowance_is_not_cut() {
        let finish = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]});
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}});
        let body = sse(&[chunk("a"), chunk("b"), finish, usage], true);
        let mut m = ResponseMeter::new(Format::Sse, false, Some(2));
        assert_eq!(m.feed(&body, true).unwrap(), body);
        assert!(!m.cut);
        assert_eq!(m.output_events, 2);
        assert!(matches!(m.found, Found::Usage(_)));
    }

    #[test]
    fn a_json_answer_without_usage_counts_its_text() {
        let body = json!({"choices": [{"message": {"content": "hello there world"}}]});
        let mut m = ResponseMeter::new(Format::Json, false, None);
        m.feed(body.to_string().as_bytes(), true);
        assert_eq!(m.found, Found::Nothing);
        assert_eq!(
            m.output_events,
            text_tokens("hello there world").ceil() as u64
        );
        let body = json!({"response": "hi", "done": true, "prompt_eval_count": "x"});
        let mut m = ResponseMeter::new(Format::Json, false, None);
        m.feed(body.to_string().as_bytes(), true);
        assert_eq!((m.found, m.output_events), (Found::Invalid, 1));
    }

    #[test]
    fn ollama_lines_and_json_bodies() {
        let lines = b"{\"message\":{\"content\":\"a\"},\"done\":false}\n{\"message\":{\"content\":\"b\"},\"done\":false}\n{\"done\":true,\"prompt_eval_count\":7,\"eval_count\":2}\n";
        let mut m = ResponseMeter::new(Format::Ndjson, false, None);
        let out = m.feed(&lines[..20], false).unwrap();
        let out2 = m.feed(&lines[20..], true).unwrap();
        assert_eq!([out, out2].concat(), lines.to_vec());
        assert_eq!(
            (m.output_events, m.found),
            (
                2,
                Found::Usage(Usage {
                    input: 7,
                    output: 2
                })
            )
        );

        let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let mut m = ResponseMeter::new(Format::Json, false, None);
        assert_eq!(m.feed(&body[..9], false), None);
        assert_eq!(m.feed(&body[9..], true), None);
        assert_eq!(
            m.found,
            Found::Usage(Usage {
                input: 3,
                output: 1
            })
        );
        let mut m = ResponseMeter::new(Format::Json, false, None);
        m.feed(b"not json", true);
        assert_eq!(m.found, Found::Nothing);
    }

    #[test]
    fn an_event_that_never_ends_is_bounded() {
        for format in [Format::Sse, Format::Ndjson] {
            let mut m = ResponseMeter::new(format, false, None);
            let mut sent = Vec::new();
            let chunk = vec![b'x'; 64 * 1024];
            let mut fed = 0;
            while !m.cut && fed < 4 * MAX_EVENT_BYTES {
                sent.extend(m.feed(&chunk, false).unwrap_or_default());
                fed += chunk.len();
            }
            assert!(m.cut, "{format:?}");
            assert!(fed <= MAX_EVENT_BYTES + chunk.len(), "{format:?}: {fed}");
            assert!(m.pending.capacity() == 0, "memory given back");
            assert_eq!(m.output_events, 1, "the unread event counts as output");
            let text = String::from_utf8_lossy(&sent);
            assert!(text.contains(OVERSIZED_CODE), "{text}");
            // Whatever follows is dropped.
            assert_eq!(m.feed(b"data: {}\n\n", true), Some(Vec::new()));
        }
    }

    /// Anthropic's stream as vLLM and Anthropic send it: input in
    /// `message_start`, cumulative output in `message_delta`.
    fn anthropic_sse(deltas: usize) -> Vec<u8> {
        let mut out = String::new();
        let mut event = |name: &str, data: Value| {
            out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
        };
        event(
            "message_start",
            json!({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant",
                   "content": [], "usage": {"input_tokens": 25, "output_tokens": 1,
                   "cache_read_input_tokens": 5}}}),
        );
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        );
        for i in 0..deltas {
            event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": format!("w{i} ")}}),
            );
        }
        event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        );
        event(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                   "usage": {"output_tokens": deltas}}),
        );
        event("message_stop", json!({"type": "message_stop"}));
        out.into_bytes()
    }

    #[test]
    fn anthropic_usage_is_read_from_json_and_from_its_stream_events() {
        let body = json!({"type": "message", "content": [{"type": "text", "text": "hi"}],
                          "usage": {"input_tokens": 10, "output_tokens": 4,
                                    "cache_creation_input_tokens": 3}});
        assert_eq!(
            usage_in(&body),
            Found::Usage(Usage {
                input: 13,
                output: 4
            })
        );
        let bytes = anthropic_sse(7);
        for split in [1, 7, bytes.len()] {
            let mut m = ResponseMeter::new(Format::Sse, false, Some(100));
            let mut out = Vec::new();
            let chunks: Vec<&[u8]> = bytes.chunks(split).collect();
            for (i, c) in chunks.iter().enumerate() {
                out.extend(m.feed(c, i + 1 == chunks.len()).unwrap());
            }
            assert_eq!(out, bytes, "passes whole");
            assert_eq!(
                m.found,
                Found::Usage(Usage {
                    input: 30,
                    output: 7
                }),
                "split {split}"
            );
            assert_eq!(m.output_events, 7, "each text delta counts");
        }
        // Past its allowance, the stream is ended like any other.
        let mut m = ResponseMeter::new(Format::Sse, false, Some(3));
        m.feed(&anthropic_sse(10), true);
        assert!(m.cut);
    }

    #[test]
    fn a_stream_event_with_an_insane_count_leaves_the_reservation_standing() {
        // A valid input and an output that is no count: not settled as 0
        // output (that would under-charge), whatever came before or after.
        let mut bad = chunk("x");
        bad["usage"] = json!({"prompt_tokens": 9, "completion_tokens": "many"});
        let mut good = chunk("y");
        good["usage"] = json!({"prompt_tokens": 9, "completion_tokens": 2});
        for events in [
            vec![bad.clone()],
            vec![good.clone(), bad.clone()],
            vec![bad, good],
        ] {
            let mut m = ResponseMeter::new(Format::Sse, false, None);
            m.feed(&sse(&events, true), true);
            assert_eq!(m.found, Found::Invalid, "{events:?}");
        }
    }

    #[test]
    fn cumulative_stream_usage_settles_at_its_largest_count() {
        // vLLM's continuous_usage_stats: every chunk carries the usage so far.
        let events: Vec<Value> = (1..=5)
            .map(|n| {
                let mut c = chunk("x");
                c["usage"] =
                    json!({"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n});
                c
            })
            .collect();
        let mut m = ResponseMeter::new(Format::Sse, false, None);
        m.feed(&sse(&events, true), true);
        assert_eq!(
            m.found,
            Found::Usage(Usage {
                input: 9,
                output: 5
            })
        );
        // Several prompts answered: the usage is their total.
        let several = json!({"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}],
                             "usage": {"prompt_tokens": 8, "completion_tokens": 32, "total_tokens": 40}});
        assert_eq!(
            usage_in(&several),
            Found::Usage(Usage {
                input: 8,
                output: 32
            })
        );
        // Rerank's usage has only a total: it is input.
        assert_eq!(
            usage_in(&json!({"results": [], "usage": {"total_tokens": 12}})),
            Found::Usage(Usage {
                input: 12,
                output: 0
            })
        );
    }

    /// Feeds `body` in pieces of `size` bytes; the meter at the end.
    fn fed_in_pieces(format: Format, body: &[u8], size: usize) -> ResponseMeter {
        let mut m = ResponseMeter::new(format, false, None);
        let pieces: Vec<&[u8]> = body.chunks(size.max(1)).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let out = m.feed(piece, i + 1 == pieces.len());
            if format != Format::Json {
                assert!(out.is_some());
            }
        }
        m
    }

    fn usage(input: u64, output: u64) -> Found {
        Found::Usage(Usage { input, output })
    }

    fn details(cached_input: u64, cache_write_input: u64, reasoning_output: u64) -> Details {
        Details {
            cached_input,
            cache_write_input,
            reasoning_output,
        }
    }

    #[test]
    fn openai_and_vllm_details_are_parts_of_their_totals() {
        // OpenAI chat / vLLM: cached inside prompt_tokens, reasoning inside
        // completion_tokens.
        let body = json!({"choices": [{"message": {"content": "x"}}],
            "usage": {"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500,
                      "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
                      "completion_tokens_details": {"reasoning_tokens": 256, "audio_tokens": 0}}});
        let bytes = body.to_string().into_bytes();
        for size in [1, 7, bytes.len()] {
            let m = fed_in_pieces(Format::Json, &bytes, size);
            assert_eq!(m.found, usage(1200, 300), "not added: {size}");
            assert_eq!(m.details(), details(1024, 0, 256));
        }
        // vLLM without the details flag writes `prompt_tokens_details: null`.
        let plain = json!({"usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                     "prompt_tokens_details": null}});
        assert_eq!(usage_in(&plain), usage(5, 2));
        assert_eq!(details_in(&plain), Details::default());
    }

    #[test]
    fn responses_api_details_json_and_stream_split_anywhere() {
        let u = json!({"input_tokens": 900, "input_tokens_details": {"cached_tokens": 512},
                       "output_tokens": 120, "output_tokens_details": {"reasoning_tokens": 100},
                       "total_tokens": 1020});
        let body = json!({"object": "response", "output": [], "usage": u});
        let m = fed_in_pieces(Format::Json, body.to_string().as_bytes(), 5);
        assert_eq!(
            (m.found, m.details()),
            (usage(900, 120), details(512, 0, 100))
        );
        let mut stream = String::new();
        for e in [
            json!({"type": "response.created", "response": {"usage": null}}),
            json!({"type": "response.output_text.delta", "delta": "hi"}),
            json!({"type": "response.completed", "response": {"usage": u}}),
        ] {
            stream.push_str(&format!(
                "event: {}\ndata: {e}\n\n",
                e["type"].as_str().unwrap()
            ));
        }
        let bytes = stream.into_bytes();
        for size in 1..=bytes.len() {
            let m = fed_in_pieces(Format::Sse, &bytes, size);
            assert_eq!(m.found, usage(900, 120), "pieces of {size}");
            assert_eq!(m.details(), details(512, 0, 100), "pieces of {size}");
        }
    }

    #[test]
    fn anthropic_cache_counts_are_added_once_and_recorded_apart() {
        // input_tokens excludes both cache counts: the total is the sum.
        let body = json!({"type": "message", "content": [{"type": "text", "text": "hi"}],
            "usage": {"input_tokens": 50, "cache_creation_input_tokens": 2000,
                      "cache_read_input_tokens": 3000, "output_tokens": 40}});
        assert_eq!(usage_in(&body), usage(5050, 40));
        let m = fed_in_pieces(Format::Json, body.to_string().as_bytes(), 3);
        assert_eq!(m.details(), details(3000, 2000, 0));
        // The stream: input in message_start, cumulative output in
        // message_delta (which may repeat the input counts), split anywhere.
        let mut stream = String::new();
        for (name, e) in [
            (
                "message_start",
                json!({"type": "message_start", "message": {"id": "m", "content": [],
                "usage": {"input_tokens": 50, "cache_creation_input_tokens": 2000,
                          "cache_read_input_tokens": 3000, "output_tokens": 1}}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": "hello"}}),
            ),
            (
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"input_tokens": 50, "cache_creation_input_tokens": 2000,
                          "cache_read_input_tokens": 3000, "output_tokens": 40}}),
            ),
            ("message_stop", json!({"type": "message_stop"})),
        ] {
            stream.push_str(&format!("event: {name}\ndata: {e}\n\n"));
        }
        let bytes = stream.into_bytes();
        for size in 1..=bytes.len() {
            let m = fed_in_pieces(Format::Sse, &bytes, size);
            assert_eq!(m.found, usage(5050, 40), "pieces of {size}");
            assert_eq!(m.details(), details(3000, 2000, 0), "pieces of {size}");
        }
    }

    #[test]
    fn ollama_without_prompt_eval_count_reports_its_output_and_no_input() {
        // The cached-prompt answer: input unknown (read as 0, which
        // settlement replaces with the estimate), output believed.
        let body = json!({"model": "m", "message": {"role": "assistant", "content": "hi"},
                          "done": true, "eval_count": 6});
        assert_eq!(usage_in(&body), usage(0, 6));
        let lines = b"{\"message\":{\"content\":\"a\"},\"done\":false}\n{\"message\":{\"content\":\"b\"},\"done\":false}\n{\"message\":{\"content\":\"\"},\"done\":true,\"done_reason\":\"stop\",\"eval_count\":2}\n";
        for size in 1..=lines.len() {
            let m = fed_in_pieces(Format::Ndjson, lines, size);
            assert_eq!(
                (m.found, m.output_events),
                (usage(0, 2), 2),
                "pieces of {size}"
            );
            assert_eq!(m.details(), Details::default());
        }
        // A line that is not done, or has no output count, is no usage.
        assert_eq!(
            usage_in(&json!({"done": false, "eval_count": 3})),
            Found::Invalid
        );
        assert_eq!(usage_in(&json!({"done": true})), Found::Nothing);
    }

    #[test]
    fn details_never_exceed_their_totals_and_garbage_details_read_as_none() {
        let lying = json!({"usage": {"prompt_tokens": 10, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 99},
            "completion_tokens_details": {"reasoning_tokens": 1_000_000}}});
        let m = fed_in_pieces(Format::Json, lying.to_string().as_bytes(), 4096);
        assert_eq!((m.found, m.details()), (usage(10, 4), details(10, 0, 4)));
        let garbage = json!({"usage": {"prompt_tokens": 10, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": "lots"},
            "completion_tokens_details": {"reasoning_tokens": -3}}});
        let m = fed_in_pieces(Format::Json, garbage.to_string().as_bytes(), 4096);
        assert_eq!((m.found, m.details()), (usage(10, 4), Details::default()));
        // Cached and cache-written together stay within the input.
        assert_eq!(
            details(8, 8, 0).within(Usage {
                input: 10,
                output: 0
            }),
            details(8, 2, 0)
        );
        // Without believable usage there are no parts.
        let bad = json!({"usage": {"prompt_tokens": "x", "completion_tokens": 1,
                                   "prompt_tokens_details": {"cached_tokens": 5}}});
        let m = fed_in_pieces(Format::Json, bad.to_string().as_bytes(), 4096);
        assert_eq!((m.found, m.details()), (Found::Invalid, Details::default()));
    }

    #[test]
    fn streamed_details_settle_at_their_largest_count() {
        // vLLM's continuous usage stats repeat the (cumulative) details.
        let events: Vec<Value> = (1..=4u64)
            .map(|n| {
                let mut c = chunk("x");
                c["usage"] = json!({"prompt_tokens": 30, "completion_tokens": n,
                                    "prompt_tokens_details": {"cached_tokens": 16},
                                    "completion_tokens_details": {"reasoning_tokens": n / 2}});
                c
            })
            .collect();
        let body = sse(&events, true);
        for size in [1, 13, body.len()] {
            let m = fed_in_pieces(Format::Sse, &body, size);
            assert_eq!((m.found, m.details()), (usage(30, 4), details(16, 0, 2)));
        }
    }
}
