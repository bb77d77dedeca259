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

/// The LLM APIs by canonical path.
const ROUTES: [(&str, Api); 6] = [
    ("/v1/chat/completions", Api::OpenAiChat),
    ("/v1/completions", Api::OpenAiCompletions),
    ("/v1/embeddings", Api::OpenAiEmbeddings),
    ("/v1/responses", Api::OpenAiResponses),
    ("/api/generate", Api::OllamaGenerate),
    ("/api/chat", Api::OllamaChat),
];

impl Api {
    /// Classifies by method and a path already in canonical form (see
    /// [`canonical_path`], computed once per request by the caller).
    pub fn classify(method: &str, canonical: &str) -> Api {
        if !method.eq_ignore_ascii_case("POST") {
            return Api::Other;
        }
        // Also under a prefix (`/openai/v1/chat/completions`): a route that
        // rewrites the prefix away runs after sluice, in Envoy's router.
        ROUTES
            .iter()
            .find(|(route, _)| canonical.ends_with(route))
            .map_or(Api::Other, |(_, api)| *api)
    }

    pub fn reads_body(self) -> bool {
        self != Api::Other
    }

    fn is_ollama(self) -> bool {
        matches!(self, Api::OllamaGenerate | Api::OllamaChat)
    }
}

/// A path whose meaning depends on how many times it is decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmbiguousPath;

/// The path as the most lenient upstream would route it, so that every
/// spelling an upstream may decode to an LLM API is classified as that API:
/// query and fragment cut; percent-escapes decoded once; `\` read as `/`;
/// empty and `.` segments dropped, `..` resolved; ASCII lower-cased; no
/// trailing slash. Classifying a spelling the upstream would not serve as an
/// LLM call costs only a reservation; the reverse would be a bypass.
///
/// Refused as ambiguous: an escape that decodes to a control character, and
/// a path that still holds an escape after one decoding (`%2563`), which a
/// server that decodes twice reads differently from one that decodes once.
pub fn canonical_path(path: &str) -> Result<String, AmbiguousPath> {
    let raw = path.split(['?', '#']).next().unwrap_or(path).as_bytes();
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
    let mut segments: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    Ok(format!("/{}", segments.join("/")).to_ascii_lowercase())
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
    pub model: Option<String>,
    pub stream: bool,
    /// Requested maximum output tokens per choice, if the client set one.
    pub max_output: Option<u64>,
    /// How many completions the upstream generates (`n`, `best_of`): each
    /// may produce the maximum output. At least 1.
    pub choices: u64,
}

impl Default for Demand {
    fn default() -> Self {
        Demand {
            model: None,
            stream: false,
            max_output: None,
            choices: 1,
        }
    }
}

/// A body sluice cannot accept: the message and the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBody {
    pub message: String,
    pub param: Option<String>,
}

impl BadBody {
    fn at(param: &str, message: impl Into<String>) -> BadBody {
        BadBody {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }
}

/// Longest model name accepted. Real names are a few dozen bytes; the name
/// is copied into audit lines, metrics lookups and upstream bodies, so an
/// unbounded one is a cheap way to hurt all of them.
pub const MAX_MODEL_BYTES: usize = 256;

/// The most completions one request may ask for (OpenAI's own cap on `n`).
pub const MAX_CHOICES: u64 = 128;

/// Parses a request body: what admission needs, and the JSON itself (for
/// the estimate and for rewriting).
///
/// A body with a duplicate key anywhere is refused: parsers disagree on
/// which of two `model`s (or `max_tokens`, or `messages`) wins, so sluice
/// could decide on one value while the upstream acts on the other.
///
/// `output_cap` is the most output one choice may ask for, by model: a
/// larger maximum is refused, never wrapped or silently trusted.
pub fn parse_body(
    api: Api,
    body: &[u8],
    output_cap: &dyn Fn(&str) -> u64,
) -> Result<(Demand, Value), BadBody> {
    scan_bounds(body)?;
    let limits = ReadLimits::default();
    let value = match read_strict(body, &limits) {
        Ok(value) => value,
        Err(e) => {
            if let Some(bounded) = limits.hit.take() {
                return Err(bounded);
            }
            let text = e.to_string();
            if let Some(key) = duplicate_key(&text) {
                // The key is the client's text: keep the answer short.
                let key: String = key.chars().take(64).collect();
                return Err(BadBody::at(
                    &key,
                    format!("request body has the key `{key}` more than once"),
                ));
            }
            return Err(BadBody {
                message: format!("request body is not valid JSON: {text}"),
                param: None,
            });
        }
    };
    let Value::Object(fields) = &value else {
        return Err(BadBody {
            message: "request body must be a JSON object".into(),
            param: None,
        });
    };
    let field = |name: &str| fields.get(name);
    let model = match field("model") {
        Some(Value::String(m)) if m.len() > MAX_MODEL_BYTES => {
            return Err(BadBody::at(
                "model",
                format!("`model` is longer than {MAX_MODEL_BYTES} bytes"),
            ))
        }
        Some(Value::String(m)) if m.chars().any(char::is_control) => {
            return Err(BadBody::at(
                "model",
                "`model` must not contain control characters",
            ))
        }
        Some(Value::String(m)) if !m.trim().is_empty() => m.clone(),
        Some(Value::String(_)) | None => return Err(BadBody::at("model", "`model` is required")),
        Some(_) => return Err(BadBody::at("model", "`model` must be a string")),
    };
    let stream = match field("stream") {
        None | Some(Value::Null) => api.is_ollama(), // Ollama streams unless told not to
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(BadBody::at("stream", "`stream` must be a boolean")),
    };
    let num_predict = match field("options") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => o.get("num_predict"),
        Some(_) => return Err(BadBody::at("options", "`options` must be an object")),
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
                let v = n.as_u64().unwrap_or(u64::MAX);
                let cap = output_cap(&model);
                if v > cap {
                    return Err(BadBody::at(
                        param,
                        format!("`{param}` is {v}, above the {cap} output tokens allowed for this model"),
                    ));
                }
                max_output = Some(max_output.map_or(v, |m: u64| m.min(v)));
            }
            Some(_) => {
                return Err(BadBody::at(
                    param,
                    format!("`{param}` must be a non-negative integer"),
                ))
            }
        }
    }
    // `best_of` generates that many completions and returns `n` of them:
    // the upstream's work is the larger of the two.
    let mut choices = 1;
    for param in ["n", "best_of"] {
        match field(param) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n))
                if n.as_u64().is_some_and(|v| (1..=MAX_CHOICES).contains(&v)) =>
            {
                choices = choices.max(n.as_u64().unwrap_or(1));
            }
            Some(_) => {
                return Err(BadBody::at(
                    param,
                    format!("`{param}` must be an integer from 1 to {MAX_CHOICES}"),
                ))
            }
        }
    }
    let demand = Demand {
        model: Some(model),
        stream,
        max_output,
        choices,
    };
    Ok((demand, value))
}

/// The key named by a duplicate-key error of [`Strict`].
fn duplicate_key(error: &str) -> Option<String> {
    let rest = error.strip_prefix(DUPLICATE_KEY)?;
    let end = rest.find('`')?;
    Some(rest[..end].to_string())
}

const DUPLICATE_KEY: &str = "duplicate key `";

/// Bounds on what reading one body may cost (issue 18 item 3). Above any
/// real request: OpenAI takes at most 2,048 embedding inputs of at most
/// 8,192 token ids each (300,000 tokens in all); a 128k-token prompt sent
/// as ids is 131,072 items. Depth, items and containers are checked by
/// [`scan_bounds`] before anything is parsed; values as they are parsed.
/// Nesting deeper than this (objects and arrays) is refused.
pub const MAX_JSON_DEPTH: u32 = 64;
/// Items of one array.
pub const MAX_ARRAY_ITEMS: u32 = 1 << 17;
/// Arrays and objects in one body: each is an allocation in the parse.
pub const MAX_JSON_CONTAINERS: u32 = 1 << 16;
/// JSON values (each string, number, array, object…) in one body: the
/// work of the parse and of the estimate that walks it.
pub const MAX_JSON_VALUES: u32 = 1 << 19;

/// One pass over the bytes, allocating nothing, that refuses a body past
/// the depth, item or container bounds before the parser allocates a value
/// for it: `[[1],[1],…]` costs a byte scan, not a parse. Brackets inside
/// strings do not count. The error names the top-level key the bound was
/// hit under (`body` outside any). Malformed JSON is left to the parser.
fn scan_bounds(body: &[u8]) -> Result<(), BadBody> {
    // Per open container: is it an array, and its items so far.
    let mut open = [(false, 0u32); MAX_JSON_DEPTH as usize];
    let mut depth = 0usize;
    let mut containers = 0u32;
    let (mut in_string, mut escaped) = (false, false);
    // The last string closed directly inside the root object, and the key
    // the scan is under now.
    let (mut last, mut field) = ((0, 0), None::<(usize, usize)>);
    let mut string_start = 0;
    let name = |field: Option<(usize, usize)>| -> String {
        field.and_then(|(a, b)| body.get(a..b)).map_or_else(
            || "body".into(),
            |k| String::from_utf8_lossy(k).chars().take(64).collect(),
        )
    };
    for (i, &byte) in body.iter().enumerate() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => {
                    in_string = false;
                    if depth == 1 {
                        last = (string_start, i);
                    }
                }
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => {
                in_string = true;
                string_start = i + 1;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CAP: u64 = 1 << 20;

    fn classify_raw(method: &str, path: &str) -> Api {
        Api::classify(method, &canonical_path(path).unwrap_or_default())
    }

    fn demand_of(api: Api, body: &[u8]) -> Result<Demand, BadBody> {
        parse_body(api, body, &|_| CAP).map(|(d, _)| d)
    }

    #[test]
    fn a_maximum_above_the_cap_is_refused_by_name() {
        for (field, body) in [
            (
                "max_tokens",
                r#"{"model":"m","max_tokens":18446744073709551615}"#,
            ),
            (
                "max_tokens",
                r#"{"model":"m","max_tokens":18446744073709551610}"#,
            ),
            (
                "max_completion_tokens",
                r#"{"model":"m","max_completion_tokens":1048577}"#,
            ),
            (
                "options.num_predict",
                r#"{"model":"m","options":{"num_predict":4294967296}}"#,
            ),
        ] {
            let e = demand_of(Api::OpenAiChat, body.as_bytes()).unwrap_err();
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
                model: Some("llama3.1:8b".into()),
                stream: true,
                max_output: Some(64),
                choices: 1,
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
                max_output: Some(20),
                choices: 1,
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

    proptest::proptest! {
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
}
