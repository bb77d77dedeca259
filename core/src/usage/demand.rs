//! What a request asks for (docs/src/design.md, "Demand and estimate"): which API, which
//! model, streamed or not, how much output at most, and how many times over (the
//! multipliers of work, one table per API). Read from OpenAI-, Anthropic-, vLLM- and
//! Ollama-shaped bodies; only the fields sluice needs are looked at.

use std::borrow::Cow;

use serde_json::Value;

use super::output_limit::max_output_of;
pub use super::shared::Api;
use super::shared::{
    BadBody, Multiplies, MAX_ARRAY_ITEMS, MAX_COMPLETIONS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
};
use super::tape::Tape;
use super::view::{Kind, View};

/// The API of an `/invocations` body, by its shape as vLLM dispatches it:
/// `messages` → chat, `prompt` → completion, `input` → embedding. A body
/// with none of them, or with more than one (two servers may pick two
/// different ones), is a 400.
pub fn invocation_api<'a>(body: impl View<'a>) -> Result<Api, BadBody> {
    let shapes = [
        ("messages", Api::OpenAiChat),
        ("prompt", Api::OpenAiCompletions),
        ("input", Api::OpenAiEmbeddings),
    ];
    let present: Vec<&(&str, Api)> = shapes
        .iter()
        .filter(|(field, _)| body.present(field).is_some())
        .collect();
    match present.as_slice() {
        [(_, api)] => Ok(*api),
        [] => Err(BadBody {
            message: "an /invocations body needs `messages` (chat), `prompt` (completion) or `input` (embedding)".into(),
            param: None,
        }),
        [(a, _), (b, _), ..] => Err(BadBody::at(
            b,
            format!("an /invocations body must not have both `{a}` and `{b}`: its API would be ambiguous"),
        )),
    }
}

/// A path whose meaning depends on how many times it is decoded, or on how
/// a server reads its `;` parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbiguousPath;

/// The path as the most lenient upstream would route it, so that every
/// spelling an upstream may decode to an LLM API is classified as that API:
/// query and fragment cut; percent-escapes decoded once; `\` read as `/`;
/// empty and `.` segments dropped, `..` resolved; ASCII lower-cased; no
/// trailing slash. Classifying a spelling the upstream would not serve as an
/// LLM call costs only a reservation; the reverse would be a bypass.
///
/// Path parameters (`/v1/chat/completions;x`): servers read them three
/// ways — literally, dropped from each segment (`..;` is then `..`), or
/// the path cut at the first `;`. The path is the one without them; if two
/// readings lead to different paths (`/a;/../b` is `/b` or `/a`), it is
/// ambiguous, whatever the paths are (also when neither is an LLM API: a
/// `passthrough` rule must not open one path for another).
///
/// Refused as ambiguous: an escape that decodes to a control character, and
/// a path that still holds an escape after one decoding (`%2563`), which a
/// server that decodes twice reads differently from one that decodes once.
pub fn canonical_path(path: &str) -> Result<Cow<'_, str>, AmbiguousPath> {
    let raw = path.split(['?', '#']).next().unwrap_or(path);
    if is_canonical(raw.as_bytes()) {
        // Nothing to decode, resolve or lower-case (nearly every request):
        // the path itself, lent.
        return Ok(Cow::Borrowed(raw));
    }
    decode_and_normalise(raw.as_bytes()).map(Cow::Owned)
}

/// A path that is its own canonical form: `/`, then non-empty segments
/// other than `.` and `..`, of lower-case ASCII letters, digits and
/// `-._~` (no escape, no parameter, no backslash), no trailing slash.
fn is_canonical(raw: &[u8]) -> bool {
    let Some(rest) = raw.strip_prefix(b"/") else {
        return false;
    };
    !rest.is_empty()
        && rest.split(|b| *b == b'/').all(|segment| {
            !segment.is_empty()
                && segment != b"."
                && segment != b".."
                && segment
                    .iter()
                    .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~'))
        })
}

/// [`canonical_path`] of a path that is not yet canonical.
fn decode_and_normalise(raw: &[u8]) -> Result<String, AmbiguousPath> {
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match (raw[i], escape_at(raw, i)) {
            (b'%', Some(byte)) => {
                if byte.is_ascii_control() {
                    return Err(AmbiguousPath);
                }
                decoded.push(byte);
                i += 3;
            }
            (byte, _) => {
                decoded.push(byte);
                i += 1;
            }
        }
    }
    if (0..decoded.len()).any(|i| decoded[i] == b'%' && escape_at(&decoded, i).is_some()) {
        return Err(AmbiguousPath);
    }
    let text = String::from_utf8_lossy(&decoded).replace('\\', "/");
    if !text.contains(';') {
        return Ok(normalise(&text, false));
    }
    // A literal reading that keeps a `;` names no route of a server that
    // strips parameters; any other two readings that differ would send two
    // servers to two places.
    let dropped = normalise(&text, true);
    let readings = [
        normalise(text.split(';').next().unwrap_or_default(), false),
        normalise(&text, false),
    ];
    if readings.iter().any(|r| !r.contains(';') && *r != dropped) {
        return Err(AmbiguousPath);
    }
    Ok(dropped)
}

/// Segments joined after `.`/`..`/empty ones are resolved; with
/// `drop_params`, each segment's `;…` is dropped first.
fn normalise(text: &str, drop_params: bool) -> String {
    let mut segments: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        let segment = if drop_params {
            segment.split(';').next().unwrap_or_default()
        } else {
            segment
        };
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    format!("/{}", segments.join("/")).to_ascii_lowercase()
}

/// The byte a `%XX` escape at `i` stands for.
fn escape_at(bytes: &[u8], i: usize) -> Option<u8> {
    if bytes.get(i) != Some(&b'%') {
        return None;
    }
    let hex = bytes.get(i + 1..i + 3)?;
    // Two hex digits exactly (`from_str_radix` alone would take `%+1`).
    if !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
}

/// The parts of a request body admission needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    /// The API the body speaks (an `/invocations` body's, resolved).
    pub api: Api,
    pub model: Option<String>,
    pub stream: bool,
    /// Requested maximum output tokens per completion, if the client set one.
    pub max_output: Option<u64>,
    /// How many completions the upstream generates per prompt (`n`,
    /// `best_of`): each may produce the maximum output. At least 1.
    pub choices: u64,
    /// How many prompts the upstream answers, each with its own choices
    /// (`/v1/completions` with a prompt array). At least 1.
    pub prompts: u64,
}

impl Demand {
    /// Completions the upstream generates: prompts × choices, each of
    /// which may produce the maximum output.
    pub fn completions(&self) -> u64 {
        self.prompts.max(1).saturating_mul(self.choices.max(1))
    }
}

impl Default for Demand {
    fn default() -> Self {
        Demand {
            api: Api::OpenAiChat,
            model: None,
            stream: false,
            max_output: None,
            choices: 1,
            prompts: 1,
        }
    }
}

/// Longest model name accepted. Real names are a few dozen bytes; the name
/// is copied into audit lines, metrics lookups and upstream bodies, so an
/// unbounded one is a cheap way to hurt all of them.
pub const MAX_MODEL_BYTES: usize = 256;

/// Parses a request body: what admission needs, and the JSON itself (for
/// the estimate and for rewriting).
///
/// A body with a duplicate key anywhere is refused: parsers disagree on
/// which of two `model`s (or `max_tokens`, or `messages`) wins, so sluice
/// could decide on one value while the upstream acts on the other.
///
/// A key that a server matching keys without case (Ollama's Go) would
/// read as one sluice reads, spelled otherwise, is refused too
/// (`usage/spelling.rs`).
///
/// `output_cap` is the most output one choice may ask for, by model: a
/// larger maximum is refused, never wrapped or silently trusted.
#[cfg(test)]
pub fn parse_body(
    api: Api,
    body: &[u8],
    output_cap: &dyn Fn(&str) -> u64,
) -> Result<Demand, BadBody> {
    let tape = read_tape(body)?;
    demand_of(api, tape.root(), output_cap)
}

/// What a body asks for, read from its value (the tape, or a tree).
pub fn demand_of<'a>(
    api: Api,
    body: impl View<'a>,
    output_cap: &dyn Fn(&str) -> u64,
) -> Result<Demand, BadBody> {
    if !body.is_object() {
        return Err(BadBody {
            message: "request body must be a JSON object".into(),
            param: None,
        });
    }
    super::spelling::refuse_case_variants(body)?;
    let api = match api {
        Api::Invocations => invocation_api(body)?,
        api => api,
    };
    let model = model_at(body.get("model"), "model")?;
    let stream = match body.get("stream").map(View::kind) {
        None | Some(Kind::Null | Kind::Bool(_)) => api.streams(body),
        Some(_) => return Err(BadBody::at("stream", "`stream` must be a boolean")),
    } && api.produces_output();
    let max_output = max_output_of(api, body, &|| output_cap(&model))?;
    let (choices, prompts) = multiplied(api, body)?;
    let demand = Demand {
        api,
        model: Some(model),
        stream,
        max_output,
        choices,
        prompts,
    };
    Ok(demand)
}

/// Does a stream ask for the usage chunk (`stream_options.include_usage`)?
pub fn include_usage<'a>(body: impl View<'a>) -> bool {
    body.get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(View::bool)
        == Some(true)
}

/// The body read once, as strictly as [`read_json`] reads it, into a tape
/// (`usage/tape.rs`): no tree. A body the tape refuses is read by
/// [`read_json`] again for the exact message.
pub fn read_tape(body: &[u8]) -> Result<Tape<'_>, BadBody> {
    scan_bounds(body)?;
    Tape::read(body).ok_or_else(|| match read_json(body) {
        Err(bad) => bad,
        // The tape refuses only what the strict read does (its property
        // test); should they ever differ, the body is refused all the same.
        Ok(_) => BadBody {
            message: "request body is not valid JSON".into(),
            param: None,
        },
    })
}

/// The body as JSON, read strictly (bounded, no duplicate key).
pub(crate) fn read_json(body: &[u8]) -> Result<Value, BadBody> {
    let limits = ReadLimits::default();
    read_strict(body, &limits).map_err(|e| {
        if let Some(bounded) = limits.hit.take() {
            return bounded;
        }
        let text = e.to_string();
        if let Some(key) = duplicate_key(&text) {
            // The key is the client's text: keep the answer short.
            let key: String = key.chars().take(64).collect();
            return BadBody::at(
                &key,
                format!("request body has the key `{key}` more than once"),
            );
        }
        BadBody {
            message: format!("request body is not valid JSON: {text}"),
            param: None,
        }
    })
}

/// A model name found at `param` (`model`, or a declared pointer): a
/// non-empty string, bounded, without control characters.
pub(crate) fn model_at<'a>(value: Option<impl View<'a>>, param: &str) -> Result<String, BadBody> {
    let Some(value) = value else {
        return Err(BadBody::at(param, format!("`{param}` is required")));
    };
    match value.str() {
        Some(m) if m.len() > MAX_MODEL_BYTES => Err(BadBody::at(
            param,
            format!("`{param}` is longer than {MAX_MODEL_BYTES} bytes"),
        )),
        Some(m) if m.chars().any(char::is_control) => Err(BadBody::at(
            param,
            format!("`{param}` must not contain control characters"),
        )),
        Some(m) if !m.trim().is_empty() => Ok(m.into_owned()),
        Some(_) => Err(BadBody::at(param, format!("`{param}` is required"))),
        None => Err(BadBody::at(param, format!("`{param}` must be a string"))),
    }
}

/// Reads every multiplier of `api` from a body: (choices, prompts), each
/// at least 1. Counts past a row's maximum, of the wrong type, or whose
/// product passes [`MAX_COMPLETIONS`], are 400s naming the field.
fn multiplied<'a>(api: Api, body: impl View<'a>) -> Result<(u64, u64), BadBody> {
    let mut choices = 1u64;
    let mut prompts = 0u64;
    let mut prompt_field = None;
    for m in api.multipliers() {
        let Some(value) = body.present(m.field) else {
            continue;
        };
        let field = m.field;
        let max = m.max;
        match m.multiplies {
            Multiplies::Choices => match value.u64() {
                Some(v) if (1..=max).contains(&v) => choices = choices.max(v),
                _ => {
                    return Err(BadBody::at(
                        field,
                        format!("`{field}` must be an integer from 1 to {max}"),
                    ))
                }
            },
            Multiplies::Prompts => {
                let count = prompt_count(value).ok_or_else(|| {
                    BadBody::at(
                        field,
                        format!("`{field}` must be a string, an array of strings, an array of token ids or an array of token-id arrays, not empty"),
                    )
                })?;
                if count > max {
                    return Err(BadBody::at(
                        field,
                        format!("`{field}` has {count} prompts, more than the {max} allowed"),
                    ));
                }
                prompts = prompts.saturating_add(count);
                if prompts > max {
                    return Err(BadBody::at(
                        field,
                        format!("{prompts} prompts in all, more than the {max} allowed"),
                    ));
                }
                prompt_field = Some(field);
            }
            Multiplies::Inputs | Multiplies::PairedWith(_) => {
                let count = match value.kind() {
                    Kind::Array => value.items().count() as u64,
                    _ => 1,
                };
                if count > max {
                    return Err(BadBody::at(
                        field,
                        format!("`{field}` has {count} items, more than the {max} allowed"),
                    ));
                }
            }
        }
    }
    let prompts = prompts.max(1);
    let completions = prompts.saturating_mul(choices);
    if completions > MAX_COMPLETIONS {
        let field = prompt_field.unwrap_or("n");
        return Err(BadBody::at(
            field,
            format!("{prompts} prompts × {choices} choices is {completions} completions, more than the {MAX_COMPLETIONS} allowed"),
        ));
    }
    Ok((choices, prompts))
}

/// Prompts in a `prompt` value, as OpenAI and vLLM read it: a string or a
/// flat token-id array is one; an array of strings or of token-id arrays
/// is one per item. `None`: another shape (or an empty array).
pub fn prompt_count<'a>(value: impl View<'a>) -> Option<u64> {
    fn id<'a>(v: impl View<'a>) -> bool {
        v.u64().is_some()
    }
    fn ids<'a>(v: impl View<'a>) -> bool {
        v.is_array() && v.items().all(id)
    }
    match value.kind() {
        Kind::String => Some(1),
        Kind::Array if value.items().next().is_none() => None,
        Kind::Array if value.items().all(id) => Some(1),
        Kind::Array if value.items().all(|i| i.is_string() || ids(i)) => {
            Some(value.items().count() as u64)
        }
        _ => None,
    }
}

/// The key named by a duplicate-key error of [`Strict`].
fn duplicate_key(error: &str) -> Option<String> {
    let rest = error.strip_prefix(DUPLICATE_KEY)?;
    let end = rest.find('`')?;
    Some(rest[..end].to_string())
}

const DUPLICATE_KEY: &str = "duplicate key `";

/// One pass over the bytes, allocating nothing, that refuses a body past
/// the depth, item or container bounds before the parser allocates a value
/// for it: `[[1],[1],…]` costs a byte scan, not a parse. Brackets inside
/// strings do not count. The error names the top-level key the bound was
/// hit under (`body` outside any). Malformed JSON is left to the parser.
pub(crate) fn scan_bounds(body: &[u8]) -> Result<(), BadBody> {
    // Per open container: is it an array, and its items so far.
    let mut open = [(false, 0u32); MAX_JSON_DEPTH as usize];
    let mut depth = 0usize;
    let mut containers = 0u32;
    // The last string closed directly inside the root object, and the key
    // the scan is under now.
    let (mut last, mut field) = ((0, 0), None::<(usize, usize)>);
    let name = |field| key_name(body, field);
    let mut i = 0;
    while let Some(&byte) = body.get(i) {
        if byte == b'"' {
            // A string: skipped to its closing quote at once.
            let start = i + 1;
            let Some(at) = string_end(body, start) else {
                return Ok(()); // unterminated: the parser says how
            };
            if depth == 1 {
                last = (start, at);
            }
            i = at + 1;
            continue;
        }
        i += 1;
        match byte {
            b':' if depth == 1 => field = Some(last),
            b'[' | b'{' => {
                let Some(slot) = open.get_mut(depth) else {
                    let at = name(field);
                    return Err(BadBody::at(
                        &at,
                        format!("`{at}` is nested deeper than {MAX_JSON_DEPTH} levels"),
                    ));
                };
                *slot = (byte == b'[', 0);
                depth += 1;
                containers += 1;
                if containers > MAX_JSON_CONTAINERS {
                    let at = name(field);
                    return Err(BadBody::at(
                        &at,
                        format!(
                            "request body has more than {MAX_JSON_CONTAINERS} arrays and objects (in `{at}`)"
                        ),
                    ));
                }
            }
            b']' | b'}' => {
                let Some(next) = depth.checked_sub(1) else {
                    return Ok(()); // malformed: the parser says how
                };
                depth = next;
                if depth == 0 {
                    field = None;
                }
            }
            b',' if depth > 0 => {
                if let Some((true, items)) = open.get_mut(depth - 1) {
                    *items += 1;
                    // n commas: n + 1 items.
                    if *items >= MAX_ARRAY_ITEMS {
                        let at = name(field);
                        return Err(BadBody::at(
                            &at,
                            format!("an array in `{at}` has more than {MAX_ARRAY_ITEMS} items"),
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The index of the quote that closes the string whose text starts at
/// `start` (memchr's word-at-a-time search, escapes stepped over); `None`
/// when it is unterminated.
#[inline]
fn string_end(body: &[u8], start: usize) -> Option<usize> {
    let mut at = start;
    loop {
        at += body
            .get(at..)
            .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))?;
        if body.get(at) == Some(&b'\\') {
            at += 2;
            continue;
        }
        return Some(at);
    }
}

/// The top-level key at `field` (its first 64 characters), for an error;
/// `body` outside any.
fn key_name(body: &[u8], field: Option<(usize, usize)>) -> String {
    field.and_then(|(a, b)| body.get(a..b)).map_or_else(
        || "body".into(),
        |k| String::from_utf8_lossy(k).chars().take(64).collect(),
    )
}

/// How many values one parse has read, and the bound it hit.
#[derive(Default)]
struct ReadLimits {
    values: std::cell::Cell<u32>,
    hit: std::cell::RefCell<Option<BadBody>>,
}

impl ReadLimits {
    /// Counts one value (under the top-level key `field`); past the bound,
    /// records it and stops the parse with an error `parse_body` replaces
    /// by the record.
    fn value<E: serde::de::Error>(&self, field: &str) -> Result<(), E> {
        let n = self.values.get().saturating_add(1);
        self.values.set(n);
        if n > MAX_JSON_VALUES {
            let field: String = field.chars().take(64).collect();
            let field = if field.is_empty() {
                "body".into()
            } else {
                field
            };
            let message =
                format!("request body has more than {MAX_JSON_VALUES} JSON values (in `{field}`)");
            self.hit
                .borrow_mut()
                .get_or_insert_with(|| BadBody::at(&field, message));
            return Err(E::custom("a read bound was exceeded"));
        }
        Ok(())
    }
}

fn read_strict(body: &[u8], limits: &ReadLimits) -> Result<Value, serde_json::Error> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_slice(body);
    let seed = Strict {
        limits,
        top: true,
        field: "",
    };
    let value = seed.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Reads a JSON value that refuses duplicate object keys at any depth
/// (serde_json keeps the last one silently), counting its values.
struct Strict<'a> {
    limits: &'a ReadLimits,
    /// The body itself (its keys name the fields of errors).
    top: bool,
    /// The top-level key this value is under ("" for the body itself).
    field: &'a str,
}

impl<'de> serde::de::DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(Value::from(v))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(Value::from(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.limits.value(self.field)?;
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.limits.value(self.field)?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Strict {
            limits: self.limits,
            top: false,
            field: self.field,
        })? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.limits.value(self.field)?;
        let mut object = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(serde::de::Error::custom(format!("{DUPLICATE_KEY}{key}`")));
            }
            let field = if self.top { key.as_str() } else { self.field };
            let value = map.next_value_seed(Strict {
                limits: self.limits,
                top: false,
                field,
            })?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// The field by which a Responses API body has the server add input it
/// does not show, or `None`. The server bills that input (a stored
/// conversation, earlier responses, a stored prompt) as input tokens of
/// this request, so an estimate of the body alone under-reserves by all
/// of it, and a hard budget can be overshot by a whole conversation:
/// - `previous_response_id`: the earlier response's input and output are
///   prepended (OpenAI's Responses API reference; vLLM keeps stored
///   responses and reads the field, vllm/entrypoints/openai/engine/
///   protocol.py `ResponsesRequest`);
/// - `conversation`: a stored conversation's items are prepended (OpenAI);
/// - `prompt`: a stored prompt template by id (OpenAI; vLLM refuses it);
/// - an `input` item that is a stored item by id: one of type
///   `item_reference`, or one with an `id` and no content of its own (no
///   `type`, or a `null` one, and no `content`). OpenAI's `ItemReference`
///   is `{id, type?}` with `type` optional and nullable (openai-python
///   `src/openai/types/responses/response_input_item_param.py`), so
///   `{"id": "msg_1"}` is one; an item with an `id` and its own content
///   (an assistant message sent back, a function call) is not.
///
/// Other APIs carry their whole context in the body.
pub fn stored_context<'a>(api: Api, body: impl View<'a>) -> Option<&'static str> {
    if api != Api::OpenAiResponses {
        return None;
    }
    const BY_ID: [&str; 3] = ["previous_response_id", "conversation", "prompt"];
    if let Some(field) = BY_ID.into_iter().find(|f| body.present(f).is_some()) {
        return Some(field);
    }
    let references = body
        .get("input")
        .is_some_and(|input| input.items().any(is_reference));
    references.then_some("input")
}

/// Is this Responses API input item a stored item by id?
fn is_reference<'a>(item: impl View<'a>) -> bool {
    match item.present("type") {
        Some(kind) => kind.str().as_deref() == Some("item_reference"),
        None => item.present("id").is_some() && item.present("content").is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::shared::MAX_PROMPTS;
    use proptest::prelude::*;

    const CAP: u64 = 1 << 20;

    /// A bodyless request is no work: what the flow classifies is a POST
    /// (or a body) to a path.
    fn classify_raw(method: &str, path: &str) -> Api {
        if !method.eq_ignore_ascii_case("POST") {
            return Api::Other;
        }
        Api::of_path(&canonical_path(path).unwrap_or_default())
    }

    fn demand_of(api: Api, body: &[u8]) -> Result<Demand, BadBody> {
        parse_body(api, body, &|_| CAP)
    }

    #[test]
    fn a_maximum_above_the_cap_is_refused_by_name() {
        for (api, field, body) in [
            (
                Api::OpenAiChat,
                "max_tokens",
                r#"{"model":"m","max_tokens":18446744073709551615}"#,
            ),
            (
                Api::OpenAiChat,
                "max_tokens",
                r#"{"model":"m","max_tokens":18446744073709551610}"#,
            ),
            (
                Api::OpenAiChat,
                "max_completion_tokens",
                r#"{"model":"m","max_completion_tokens":1048577}"#,
            ),
            (
                Api::OllamaChat,
                "options.num_predict",
                r#"{"model":"m","options":{"num_predict":4294967296}}"#,
            ),
        ] {
            let e = demand_of(api, body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
            assert!(e.message.contains("above"), "{e:?}");
        }
        let d = demand_of(Api::OpenAiChat, br#"{"model":"m","max_tokens":1048576}"#).unwrap();
        assert_eq!(d.max_output, Some(CAP));
        let per_model = |m: &str| if m == "small" { 100 } else { CAP };
        let e = parse_body(
            Api::OpenAiChat,
            br#"{"model":"small","max_tokens":101}"#,
            &per_model,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn classifies_known_endpoints() {
        assert_eq!(
            classify_raw("POST", "/v1/chat/completions?x=1"),
            Api::OpenAiChat
        );
        assert_eq!(classify_raw("POST", "/api/generate"), Api::OllamaGenerate);
        assert_eq!(classify_raw("GET", "/v1/chat/completions"), Api::Other);
        assert_eq!(classify_raw("POST", "/v1/models"), Api::Other);
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
                api: Api::OpenAiChat,
                model: Some("llama3.1:8b".into()),
                stream: true,
                max_output: Some(64),
                choices: 1,
                prompts: 1,
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
                api: Api::OllamaChat,
                model: Some("mistral:7b".into()),
                stream: true,
                max_output: Some(20),
                choices: 1,
                prompts: 1,
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
        // Servers pick different fields (vLLM `max_completion_tokens`,
        // Ollama `max_tokens`): the larger bounds both, and is written into
        // both.
        assert_eq!(d.max_output, Some(100), "the larger of two limits");
    }

    #[test]
    fn bad_bodies_name_the_problem() {
        let e = demand_of(Api::OpenAiChat, b"{not json").unwrap_err();
        assert!(e.message.contains("not valid JSON"));
        let e = demand_of(Api::OpenAiChat, b"[1,2]").unwrap_err();
        assert!(e.message.contains("JSON object"));
        let e = demand_of(Api::OpenAiChat, br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        let e = demand_of(Api::OpenAiChat, br#"{"model":"m","stream":"yes"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
        let e = demand_of(Api::OpenAiChat, br#"{"model":"m","max_tokens":-5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = demand_of(Api::OpenAiChat, br#"{"model":"m","max_tokens":1.5}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn every_spelling_of_an_llm_path_is_classified() {
        for path in [
            "/v1/chat/completions",
            "/v1/chat/completions/",
            "/v1/chat/%63ompletions",
            "/v1/chat%2Fcompletions",
            "/v1%2fchat%2fcompletions",
            "/%761/chat/completions",
            "//v1//chat/completions",
            "/v1/./chat/completions",
            "/v1/x/../chat/completions",
            "/V1/Chat/Completions",
            "/v1\\chat\\completions",
            "/v1/chat/completions?x=1#y",
            "/v1/chat/completions%3Fx=1",
        ] {
            let expected = if path.contains("%3F") {
                Api::Other // decodes to a path with `?` in it: not the route
            } else {
                Api::OpenAiChat
            };
            assert_eq!(classify_raw("POST", path), expected, "{path}");
        }
        assert_eq!(classify_raw("post", "/api/%63hat"), Api::OllamaChat);
        assert_eq!(classify_raw("POST", "/v1/chat/completions%"), Api::Other);
        assert_eq!(
            classify_raw("POST", "/openai/v1/chat/completions"),
            Api::OpenAiChat
        );
        assert_eq!(
            classify_raw("POST", "/ollama/api/generate"),
            Api::OllamaGenerate
        );
        assert_eq!(classify_raw("POST", "/x/v1/chat/completionsx"), Api::Other);
        assert_eq!(classify_raw("POST", "/xv1/chat/completions"), Api::Other);
    }

    #[test]
    fn double_encoding_and_control_escapes_are_ambiguous() {
        assert_eq!(
            canonical_path("/v1/chat/%2563ompletions"),
            Err(AmbiguousPath)
        );
        assert_eq!(
            canonical_path("/v1/chat/completions%00"),
            Err(AmbiguousPath)
        );
        assert_eq!(
            canonical_path("/v1/chat/completions%0a"),
            Err(AmbiguousPath)
        );
        // Not escapes: left as they are.
        assert_eq!(canonical_path("/a/%zz/%+1/%").unwrap(), "/a/%zz/%+1/%");
        assert_eq!(canonical_path("/a/%25zz").unwrap(), "/a/%zz");
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        let e = demand_of(
            Api::OpenAiChat,
            br#"{"model":"llama3.1:70b","model":"mistral:7b"}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"), "{e:?}");
        assert!(e.message.contains("more than once"), "{e:?}");
        let e = demand_of(
            Api::OllamaChat,
            br#"{"model":"m","options":{"num_predict":5,"num_predict":99999}}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("num_predict"));
        let e = demand_of(
            Api::OpenAiChat,
            br#"{"model":"m","messages":[{"role":"user","role":"system","content":"x"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("role"));
        // The same key in sibling objects is fine.
        demand_of(
            Api::OpenAiChat,
            br#"{"model":"m","messages":[{"role":"user"},{"role":"user"}]}"#,
        )
        .unwrap();
    }

    /// Ollama's Go decoder reads `MODEL` as `model` and `Stream` as
    /// `stream` (last one wins): such a body is refused before it is read.
    #[test]
    fn a_key_a_go_server_reads_as_a_read_key_is_refused_by_name() {
        for (api, body, param) in [
            (Api::OllamaChat, r#"{"model":"a","MODEL":"b"}"#, "MODEL"),
            (
                Api::OllamaChat,
                r#"{"model":"a","stream":false,"Stream":true}"#,
                "Stream",
            ),
            (
                Api::OllamaGenerate,
                r#"{"model":"a","Prompt":"long text"}"#,
                "Prompt",
            ),
            (
                Api::OpenAiChat,
                r#"{"model":"a","Messages":[]}"#,
                "Messages",
            ),
            (
                Api::Invocations,
                r#"{"model":"a","messages":[],"Input":"x"}"#,
                "Input",
            ),
        ] {
            let e = demand_of(api, body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        // Keys sluice reads nothing from may be spelled any way.
        demand_of(
            Api::OllamaChat,
            br#"{"model":"a","Think":true,"KEEP_ALIVE":"1m"}"#,
        )
        .unwrap();
    }

    #[test]
    fn model_names_are_bounded() {
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_BYTES + 1));
        let e = demand_of(Api::OpenAiChat, long.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        let ok = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_BYTES));
        demand_of(Api::OpenAiChat, ok.as_bytes()).unwrap();
        let e = demand_of(Api::OpenAiChat, br#"{"model":"a\nb"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    #[test]
    fn choices_come_from_n_and_best_of() {
        let d = demand_of(Api::OpenAiChat, br#"{"model":"m","n":4}"#).unwrap();
        assert_eq!(d.choices, 4);
        let d = demand_of(
            Api::OpenAiCompletions,
            br#"{"model":"m","n":2,"best_of":5}"#,
        )
        .unwrap();
        assert_eq!(d.choices, 5);
        for bad in ["0", "-1", "1.5", "129", "\"3\"", "18446744073709551615"] {
            let body = format!(r#"{{"model":"m","n":{bad}}}"#);
            let e = demand_of(Api::OpenAiChat, body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("n"), "{bad}");
        }
    }

    #[test]
    fn the_multiplier_table_counts_prompts_and_refuses_absurd_values_by_name() {
        let d = |body: &str| demand_of(Api::OpenAiCompletions, body.as_bytes());
        assert_eq!(
            d(r#"{"model":"m","prompt":["a","b","c"],"n":2}"#)
                .unwrap()
                .completions(),
            6
        );
        assert_eq!(
            d(r#"{"model":"m","prompt":[[1],[2,3]],"best_of":3,"n":1}"#)
                .unwrap()
                .completions(),
            6
        );
        assert_eq!(
            d(r#"{"model":"m","prompt":[1,2,3]}"#)
                .unwrap()
                .completions(),
            1
        );
        assert_eq!(d(r#"{"model":"m","prompt":"x"}"#).unwrap().completions(), 1);
        let both = r#"{"model":"m","prompt":["a","b"],"prompt_embeds":["AAA=","AAA="],"n":2}"#;
        assert_eq!(
            d(both).unwrap().completions(),
            8,
            "text and embedded prompts add up"
        );
        let many = format!(
            r#"{{"model":"m","prompt":{}}}"#,
            json_strings(MAX_PROMPTS + 1)
        );
        for (body, param) in [
            (r#"{"model":"m","prompt":[]}"#.to_string(), "prompt"),
            (r#"{"model":"m","prompt":[1,"a"]}"#.to_string(), "prompt"),
            (r#"{"model":"m","prompt":[[1,-2]]}"#.to_string(), "prompt"),
            (
                r#"{"model":"m","prompt":{"text":"a"}}"#.to_string(),
                "prompt",
            ),
            (r#"{"model":"m","prompt":7}"#.to_string(), "prompt"),
            (many, "prompt"),
            (
                format!(r#"{{"model":"m","n":128,"prompt":{}}}"#, json_strings(40)),
                "prompt",
            ),
            (r#"{"model":"m","best_of":0}"#.to_string(), "best_of"),
        ] {
            let e = d(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        // Chat has no prompt multiplier: a `prompt` there is just text.
        let chat = demand_of(
            Api::OpenAiChat,
            br#"{"model":"m","prompt":["a","b"],"n":2}"#,
        );
        assert_eq!(chat.unwrap().completions(), 2);
        let inputs = format!(
            r#"{{"model":"m","input":{}}}"#,
            json_strings(MAX_PROMPTS + 1)
        );
        let e = demand_of(Api::OpenAiEmbeddings, inputs.as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = demand_of(
            Api::Scoring,
            format!(
                r#"{{"model":"m","documents":{}}}"#,
                json_strings(MAX_PROMPTS + 1)
            )
            .as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("documents"));
    }

    fn json_strings(n: u64) -> String {
        let items: Vec<String> = (0..n).map(|i| format!("\"p{i}\"")).collect();
        format!("[{}]", items.join(","))
    }

    #[test]
    fn every_api_of_the_issue_is_classified() {
        for (path, api) in [
            ("/invocations", Api::Invocations),
            ("/v1/messages", Api::AnthropicMessages),
            ("/api/embed", Api::OllamaEmbed),
            ("/api/embeddings", Api::OllamaEmbed),
            ("/v1/score", Api::Scoring),
            ("/score", Api::Scoring),
            ("/v1/rerank", Api::Scoring),
            ("/rerank", Api::Scoring),
            ("/v2/rerank", Api::Scoring),
            ("/pooling", Api::Scoring),
            ("/classify", Api::Scoring),
            ("/tokenize", Api::Scoring),
            ("/detokenize", Api::Scoring),
            ("/v1/audio/transcriptions", Api::Other),
            ("/v1/audio/speech", Api::Other),
            ("/v1/images/generations", Api::Other),
            ("/v1/messages/count_tokens", Api::Other),
        ] {
            assert_eq!(classify_raw("POST", path), api, "{path}");
        }
        assert!(!Api::Scoring.produces_output());
        assert!(Api::AnthropicMessages.produces_output());
    }

    #[test]
    fn path_parameters_are_the_path_or_ambiguous() {
        for path in [
            "/v1/chat/completions;x",
            "/v1/chat/completions;x=1/",
            "/v1/chat/completions;a;b",
            "/v1/chat/completions%3Bjsessionid=1",
        ] {
            assert_eq!(classify_raw("POST", path), Api::OpenAiChat, "{path}");
        }
        for path in [
            // Cut at the first `;`, chat; segment by segment, embeddings.
            "/v1/chat/completions;/../../embeddings",
            // `/` cut at the `;`, chat with `..;` read as `..`.
            "/x/..;/v1/chat/completions",
            "/v1;a/chat;b/completions;c",
            // Neither is an LLM API, but a rule opening one must not open
            // the other.
            "/v1/images/generations;/../../audio/transcriptions",
        ] {
            assert_eq!(canonical_path(path), Err(AmbiguousPath), "{path}");
        }
        assert_eq!(canonical_path("/v1/models;x").unwrap(), "/v1/models");
    }

    #[test]
    fn invocations_resolve_by_shape_and_anthropic_needs_max_tokens() {
        let api =
            |body: &str| parse_body(Api::Invocations, body.as_bytes(), &|_| CAP).map(|d| d.api);
        assert_eq!(api(r#"{"model":"m","messages":[]}"#), Ok(Api::OpenAiChat));
        assert_eq!(
            api(r#"{"model":"m","prompt":"x"}"#),
            Ok(Api::OpenAiCompletions)
        );
        assert_eq!(
            api(r#"{"model":"m","input":"x"}"#),
            Ok(Api::OpenAiEmbeddings)
        );
        assert!(api(r#"{"model":"m","text_1":"x"}"#).is_err());
        let e = api(r#"{"model":"m","messages":[],"input":"x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = demand_of(Api::AnthropicMessages, br#"{"model":"m","messages":[]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let d = demand_of(
            Api::AnthropicMessages,
            br#"{"model":"m","messages":[],"max_tokens":5,"stream":true}"#,
        )
        .unwrap();
        assert_eq!((d.max_output, d.stream), (Some(5), true));
        let d = demand_of(Api::OllamaEmbed, br#"{"model":"m","input":"x"}"#).unwrap();
        assert!(!d.stream, "embeddings never stream");
    }

    #[test]
    fn common_paths_take_the_fast_path_and_odd_ones_do_not() {
        for path in [
            "/v1/chat/completions",
            "/v1/models",
            "/api/chat",
            "/a.b/c~d_e-f",
        ] {
            assert!(is_canonical(path.as_bytes()), "{path}");
        }
        for path in [
            "/", "", "v1/x", "/v1/", "/v1//x", "/v1/./x", "/v1/../x", "/V1/x", "/v1/x;p",
            "/v1/%78", "/v1\\x", "/v1/é",
        ] {
            assert!(!is_canonical(path.as_bytes()), "{path}");
        }
    }

    proptest::proptest! {
        /// The fast path takes only paths the full reading leaves as they
        /// are: for any path of these bytes, both say the same.
        #[test]
        fn a_path_taken_as_canonical_is_what_the_full_reading_gives(
            path in "(/|/v1|[a-zA-Z0-9._~;%-]|\\\\){0,24}"
        ) {
            let full = decode_and_normalise(path.as_bytes());
            if is_canonical(path.as_bytes()) {
                proptest::prop_assert_eq!(full, Ok(path.clone()));
            }
            proptest::prop_assert_eq!(
                canonical_path(&path).map(Cow::into_owned),
                decode_and_normalise(path.as_bytes())
            );
        }

        /// Whatever number a client writes, parsing never panics and the
        /// maximum read is exactly the integer written, or a 400.
        #[test]
        fn max_tokens_extremes(v in proptest::prop_oneof![
            any::<u64>().prop_map(|v| v.to_string()),
            any::<i64>().prop_map(|v| v.to_string()),
            any::<f64>().prop_map(|v| format!("{v:e}")),
            proptest::sample::select(vec![
                "0".to_string(), "1".into(), "4294967295".into(), "4294967296".into(),
                "18446744073709551615".into(), "18446744073709551616".into(),
                "-9223372036854775808".into(), "1e308".into(), "1e400".into(),
                "1.0".into(), "NaN".into(),
            ]),
        ]) {
            let body = format!(r#"{{"model":"m","max_tokens":{v}}}"#);
            match demand_of(Api::OpenAiChat, body.as_bytes()) {
                Ok(d) => {
                    proptest::prop_assert_eq!(d.max_output, v.parse::<u64>().ok());
                    proptest::prop_assert!(d.max_output.is_some_and(|m| m <= CAP));
                }
                Err(e) => proptest::prop_assert!(
                    v.parse::<u64>().map_or(true, |n| n > CAP),
                    "{:?}", e
                ),
            }
        }
    }

    /// Issue 18 item 3: a body's parse stops at its bounds, with a 400
    /// naming the top-level field, and real bodies are far inside them.
    #[test]
    fn the_parse_is_bounded_in_depth_items_and_values() {
        let cap = |_: &str| CAP;
        let parse = |body: &str| parse_body(Api::OpenAiEmbeddings, body.as_bytes(), &cap);
        let deep = format!(
            r#"{{"model":"m","input":{}1{}}}"#,
            "[".repeat(MAX_JSON_DEPTH as usize),
            "]".repeat(MAX_JSON_DEPTH as usize)
        );
        let bad = parse(&deep).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("input"), "{}", bad.message);
        assert!(bad.message.contains("nested deeper"), "{}", bad.message);
        let ok = format!(
            r#"{{"model":"m","input":{}1{}}}"#,
            "[".repeat(MAX_JSON_DEPTH as usize - 1),
            "]".repeat(MAX_JSON_DEPTH as usize - 1)
        );
        assert!(parse(&ok).is_ok());
        // The issue's body: 1 MB of `[[1],[1],…]`.
        let attack = format!(r#"{{"model":"m","input":[{}[1]]}}"#, "[1],".repeat(262_000));
        let bad = parse(&attack).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("input"));
        assert!(bad.message.contains("more than"), "{}", bad.message);
        // Values in all: many small arrays under the item bound.
        let row = format!("[{}1]", "1,".repeat(1_000));
        let many = format!(
            r#"{{"model":"m","input":[{}{row}]}}"#,
            format!("{row},").repeat(600)
        );
        let bad = parse(&many).unwrap_err();
        assert!(bad.message.contains("JSON values"), "{}", bad.message);
        // OpenAI's largest embeddings request: 2,048 inputs of token ids
        // (300,000 tokens in all).
        let ids = format!("[{}1]", "1,".repeat(145));
        let big = format!(
            r#"{{"model":"m","input":[{}{ids}]}}"#,
            format!("{ids},").repeat(2_047)
        );
        assert!(parse(&big).is_ok());
        // Items: a prompt of token ids, one past the bound.
        let ids = format!(
            r#"{{"model":"m","prompt":[{}1]}}"#,
            "1,".repeat(MAX_ARRAY_ITEMS as usize)
        );
        let bad = parse(&ids).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("prompt"));
        assert!(bad.message.contains("131072 items"), "{}", bad.message);
        let ids = format!(
            r#"{{"model":"m","prompt":[{}1]}}"#,
            "1,".repeat(MAX_ARRAY_ITEMS as usize - 1)
        );
        assert!(parse(&ids).is_ok());
        // Containers: the issue's body is stopped by the scan, before any
        // value is built.
        let inner = format!(
            r#"{{"model":"m","input":[{}[1]]}}"#,
            "[1],".repeat(MAX_JSON_CONTAINERS as usize)
        );
        let bad = parse(&inner).unwrap_err();
        assert!(
            bad.message
                .contains("65536 arrays and objects (in `input`)"),
            "{}",
            bad.message
        );
        // Brackets and commas inside strings (escaped quotes too) count
        // for nothing.
        let text = format!(
            r#"{{"model":"m","input":"{}\"[,{{"}}"#,
            "[[[,,,{{{".repeat(100_000)
        );
        assert!(parse(&text).is_ok());
        // Duplicate keys are still found, at any depth.
        let dup = parse(r#"{"model":"m","input":[{"a":1,"a":2}]}"#).unwrap_err();
        assert_eq!(dup.param.as_deref(), Some("a"));
    }

    #[test]
    fn stored_context_is_named_on_the_responses_api_only() {
        use serde_json::json;
        let on = |api, body: Value| stored_context(api, &body);
        let r = Api::OpenAiResponses;
        assert_eq!(on(r, json!({"model": "m", "input": "hi"})), None);
        assert_eq!(
            on(
                r,
                json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"})
            ),
            Some("previous_response_id")
        );
        assert_eq!(
            on(
                r,
                json!({"model": "m", "input": "hi", "conversation": {"id": "conv_1"}})
            ),
            Some("conversation")
        );
        assert_eq!(
            on(r, json!({"model": "m", "conversation": "conv_1"})),
            Some("conversation")
        );
        assert_eq!(
            on(r, json!({"model": "m", "prompt": {"id": "pmpt_1"}})),
            Some("prompt")
        );
        assert_eq!(
            on(
                r,
                json!({"model": "m", "input": [
                {"role": "user", "content": "hi"},
                {"type": "item_reference", "id": "msg_1"}]})
            ),
            Some("input")
        );
        // A stored item by id with no type, or a null one.
        for item in [
            json!({"id": "msg_1"}),
            json!({"id": "msg_1", "type": null}),
            json!({"id": "msg_1", "type": null, "content": null}),
            json!({"id": "msg_1", "role": "user"}),
            json!({"id": "msg_1", "type": "item_reference", "content": "x"}),
        ] {
            let body = json!({"model": "m", "input": [{"role": "user", "content": "hi"}, item]});
            assert_eq!(on(r, body.clone()), Some("input"), "{body}");
        }
        // Items with an id and content of their own are no references.
        for item in [
            json!({"id": "msg_1", "type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "hello"}]}),
            json!({"id": "msg_1", "role": "assistant", "content": "hello"}),
            json!({"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f",
                   "arguments": "{}"}),
            json!({"type": "message", "role": "user", "content": "no id"}),
            json!({"id": null, "role": "user", "content": "x"}),
        ] {
            let body = json!({"model": "m", "input": [item]});
            assert_eq!(on(r, body.clone()), None, "{body}");
        }
        // Explicit nulls carry nothing.
        assert_eq!(
            on(
                r,
                json!({"model": "m", "input": "hi", "previous_response_id": null,
                         "conversation": null, "prompt": null})
            ),
            None
        );
        // Chat has no stored context (its `store` only keeps the answer).
        assert_eq!(
            on(
                Api::OpenAiChat,
                json!({"model": "m", "previous_response_id": "x"})
            ),
            None
        );
    }
}
