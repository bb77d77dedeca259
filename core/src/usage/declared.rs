//! A declared API (`policy/apis.rs`) as requests meet it: its path and
//! methods, its body read by the declaration's pointers (the same strict
//! JSON read as every built-in API: bounds, duplicate keys), the body
//! rewritten at those pointers only, and its answer read for usage.
//!
//! What such a request reserves: the text at the `input` pointers (counted
//! as any API's text), plus the output limit at `output_limit` (the
//! model's default when the body has none), one completion. What it
//! settles at: the answer's reported counts when the declaration says
//! where they are; else the answer's text estimated; else (no text
//! declared, or an answer that is no JSON) what was reserved.

use serde_json::{Map, Value};

use super::demand::{self, Demand};
use super::estimate;
use super::shared::{Api, BadBody, Found, Usage, MAX_BELIEVABLE};
use super::spelling;
use crate::policy::apis::{segments, DeclaredAnswer, DeclaredApi};

/// A JSON pointer, as written (what errors name) and as its segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pointer {
    written: String,
    segments: Vec<String>,
}

impl Pointer {
    fn new(written: &str) -> Option<Pointer> {
        Some(Pointer {
            written: written.to_string(),
            segments: segments(written).ok()?,
        })
    }

    /// The value it points at; `null` reads as absent. A numeric segment
    /// indexes an array.
    pub fn get<'a>(&self, v: &'a Value) -> Option<&'a Value> {
        self.at(v, self.segments.len()).filter(|v| !v.is_null())
    }

    /// The value at its first `n` segments, spelled exactly.
    fn at<'a>(&self, v: &'a Value, n: usize) -> Option<&'a Value> {
        self.segments
            .get(..n)?
            .iter()
            .try_fold(v, |v, key| match v {
                Value::Object(fields) => fields.get(key),
                Value::Array(items) => items.get(key.parse::<usize>().ok()?),
                _ => None,
            })
    }

    /// A body whose value here sluice can write: every part of the path
    /// that is present is an object. Else the 400 names the part that is
    /// not.
    fn writable(&self, body: &Value) -> Result<(), BadBody> {
        let mut at = body;
        for (n, key) in self.segments.iter().enumerate() {
            let Value::Object(fields) = at else {
                let part = self.prefix(n);
                return Err(BadBody::at(&part, format!("`{part}` must be an object")));
            };
            match fields.get(key) {
                Some(next) => at = next,
                None => return Ok(()),
            }
        }
        Ok(())
    }

    /// The first `n` segments, written as a pointer.
    fn prefix(&self, n: usize) -> String {
        self.segments.iter().take(n).map(|s| child("", s)).collect()
    }

    /// Writes `new` here, creating the objects on the way (checked
    /// [`Pointer::writable`] when the body was read).
    fn set(&self, body: &mut Value, new: Value) {
        let Some((last, path)) = self.segments.split_last() else {
            return;
        };
        let mut at = body;
        for key in path {
            let Value::Object(fields) = at else {
                return;
            };
            at = fields
                .entry(key.clone())
                .or_insert_with(|| Value::Object(Map::new()));
        }
        if let Value::Object(fields) = at {
            fields.insert(last.clone(), new);
        }
    }
}

/// The pointer to the member `key` of the value at `parent` (a pointer).
fn child(parent: &str, key: &str) -> String {
    format!("{parent}/{}", key.replace('~', "~0").replace('/', "~1"))
}

/// Where a declared API's answer holds its text and usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerAt {
    text: Option<Pointer>,
    input_tokens: Option<Pointer>,
    output_tokens: Option<Pointer>,
}

impl AnswerAt {
    fn new(answer: &DeclaredAnswer) -> Option<AnswerAt> {
        let at = |p: &Option<String>| match p {
            Some(p) => Pointer::new(p).map(Some),
            None => Some(None),
        };
        Some(AnswerAt {
            text: at(&answer.text)?,
            input_tokens: at(&answer.input_tokens)?,
            output_tokens: at(&answer.output_tokens)?,
        })
    }

    /// What an answer (`None`: not JSON) says it cost, and the output to
    /// charge when it says nothing believable: its text's estimate, or
    /// `reserved` when there is no text to count. A count of 0 output
    /// beside a text that is not empty is not believed (a service that
    /// does not count, or counts wrong): the text's estimate is charged.
    pub fn read(&self, answer: Option<&Value>, reserved: u64) -> (Found, u64) {
        let Some(answer) = answer else {
            return (Found::Invalid, reserved);
        };
        let count = |p: &Option<Pointer>| -> Option<Result<u64, ()>> {
            let v = p.as_ref()?.get(answer)?;
            Some(v.as_u64().filter(|n| *n <= MAX_BELIEVABLE).ok_or(()))
        };
        let text = || {
            let tokens = self
                .text
                .as_ref()
                .and_then(|text| text.get(answer))
                .map_or(0.0, estimate::content_tokens);
            tokens.ceil() as u64
        };
        match (count(&self.output_tokens), count(&self.input_tokens)) {
            (Some(Err(())), _) | (Some(Ok(_)), Some(Err(()))) => (Found::Invalid, reserved),
            (Some(Ok(0)), _) if text() > 0 => (Found::Invalid, text()),
            (Some(Ok(output)), input) => {
                // An input left out is estimated (settle reads 0 so).
                let input = input.and_then(Result::ok).unwrap_or(0);
                (Found::Usage(Usage { input, output }), output)
            }
            (None, _) if self.text.is_some() => (Found::Nothing, text()),
            (None, _) => (Found::Nothing, reserved),
        }
    }

    /// A static answer with `text` where the service's answers hold theirs.
    pub fn static_body(&self, text: &str) -> Option<Vec<u8>> {
        let at = self.text.as_ref()?;
        let mut body = Value::Object(Map::new());
        at.set(&mut body, Value::String(text.to_string()));
        Some(body.to_string().into_bytes())
    }
}

/// A declaration, compiled once.
#[derive(Debug, Clone)]
pub struct Declared {
    /// Canonical.
    path: String,
    /// Upper-cased.
    methods: Vec<String>,
    model: Pointer,
    input: Vec<Pointer>,
    limit: Pointer,
    pub answer: AnswerAt,
}

impl Declared {
    /// `None` for a declaration the policy's check refuses.
    pub fn compile(api: &DeclaredApi) -> Option<Declared> {
        Some(Declared {
            path: demand::canonical_path(&api.path).ok()?.into_owned(),
            methods: api.methods.iter().map(|m| m.to_ascii_uppercase()).collect(),
            model: Pointer::new(&api.model)?,
            input: api
                .input
                .iter()
                .map(|p| Pointer::new(p))
                .collect::<Option<_>>()?,
            limit: Pointer::new(&api.output_limit)?,
            answer: AnswerAt::new(&api.answer)?,
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Is this API's path (canonical) and one of its methods?
    pub fn matches(&self, method: &str, canonical: &str) -> bool {
        canonical == self.path && self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }

    /// Reads a body of this API (the `index`-th declared): its model, its
    /// output limit (a non-negative integer up to the model's cap), and
    /// the JSON for the estimate and the rewrite. Every error names the
    /// pointer of the field.
    pub fn parse(
        &self,
        index: u16,
        body: &[u8],
        output_cap: &dyn Fn(&str) -> u64,
    ) -> Result<(Demand, Value), BadBody> {
        demand::scan_bounds(body)?;
        let value = demand::read_json(body)?;
        if !value.is_object() {
            return Err(BadBody {
                message: "request body must be a JSON object".into(),
                param: None,
            });
        }
        self.refuse_case_variants(&value)?;
        self.model.writable(&value)?;
        let model = demand::model_at(self.model.get(&value), &self.model.written)?;
        self.limit.writable(&value)?;
        let param = &self.limit.written;
        let max_output = match self.limit.get(&value) {
            None => None,
            Some(v) => {
                let v = v.as_u64().ok_or_else(|| {
                    BadBody::at(param, format!("`{param}` must be a non-negative integer"))
                })?;
                let cap = output_cap(&model);
                if v > cap {
                    return Err(BadBody::at(
                        param,
                        format!("`{param}` is {v}, above the {cap} output tokens allowed for this model"),
                    ));
                }
                Some(v)
            }
        };
        let demand = Demand {
            api: Api::Declared(index),
            model: Some(model),
            stream: false,
            max_output,
            choices: 1,
            prompts: 1,
        };
        Ok((demand, value))
    }

    /// Every pointer a body is read or written at.
    fn pointers(&self) -> impl Iterator<Item = &Pointer> + Clone {
        [&self.model, &self.limit].into_iter().chain(&self.input)
    }

    /// Refuses a key that a service matching keys without case (Go's
    /// `encoding/json`, ASP.NET Core's System.Text.Json: `usage/spelling.rs`)
    /// would read as a segment of a pointer, spelled otherwise: sluice
    /// would read one value and the service another (`MAX_TOKENS` beside
    /// `max_tokens`, a `Model` sluice never sees). At every level, from the
    /// top down, below the segments spelled exactly; the 400 names the
    /// key's pointer.
    fn refuse_case_variants(&self, body: &Value) -> Result<(), BadBody> {
        let depth = self.pointers().map(|p| p.segments.len()).max();
        for level in 0..depth.unwrap_or(0) {
            for p in self.pointers().filter(|p| p.segments.len() > level) {
                let Some(object) = p.at(body, level) else {
                    continue;
                };
                let within = &p.segments[..level];
                let names = || {
                    self.pointers()
                        .filter(move |q| q.segments.len() > level && q.segments[..level] == *within)
                        .map(move |q| q.segments[level].as_str())
                };
                if let Some((key, name)) = spelling::misspelled(object, names) {
                    let parent = p.prefix(level);
                    return Err(spelling::refusal(&key, name, |k| child(&parent, k)));
                }
            }
        }
        Ok(())
    }

    /// Estimated input tokens: the text at each `input` pointer.
    pub fn input_tokens(&self, body: &Value) -> f64 {
        self.input
            .iter()
            .filter_map(|p| p.get(body))
            .map(estimate::content_tokens)
            .sum()
    }

    /// The prompt a canned static answer is matched by: the text at the
    /// first `input` pointer that holds a string.
    pub fn prompt(&self, body: &Value) -> String {
        self.input
            .iter()
            .find_map(|p| p.get(body).and_then(Value::as_str))
            .unwrap_or_default()
            .to_string()
    }

    /// Does the body carry exactly `max` at the output limit already?
    pub fn carries(&self, body: &Value, max: u64) -> bool {
        self.limit.get(body).and_then(Value::as_u64) == Some(max)
    }

    /// The body the service gets: `model` and the reserved output `max`
    /// written at their pointers; `None` when neither changes.
    pub fn rewrite(&self, body: &Value, model: Option<&str>, max: Option<u64>) -> Option<Value> {
        if model.is_none() && max.is_none() {
            return None;
        }
        let mut json = body.clone();
        if let Some(m) = model {
            self.model.set(&mut json, Value::String(m.to_string()));
        }
        if let Some(max) = max {
            self.limit.set(&mut json, max.into());
        }
        Some(json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn declared(answer: Value) -> Declared {
        let api: DeclaredApi = serde_json::from_value(json!({
            "path": "/api/v1/ai/chat",
            "model": "/model",
            "input": ["/message", "/history"],
            "output_limit": "/options/max_tokens",
            "answer": answer,
        }))
        .unwrap();
        Declared::compile(&api).unwrap()
    }

    fn parse(d: &Declared, body: Value) -> Result<(Demand, Value), BadBody> {
        d.parse(3, body.to_string().as_bytes(), &|_| 1000)
    }

    #[test]
    fn a_body_is_read_at_its_pointers() {
        let d = declared(json!({}));
        let body = json!({"model": "llama3.1:8b", "message": "hello there", "user_id": "u1",
                          "options": {"max_tokens": 200}});
        let (demand, value) = parse(&d, body).unwrap();
        assert_eq!(demand.api, Api::Declared(3));
        assert_eq!(demand.model.as_deref(), Some("llama3.1:8b"));
        assert_eq!(demand.max_output, Some(200));
        assert!(!demand.stream);
        assert!(d.input_tokens(&value) > 0.0);
        let (none, _) = parse(&d, json!({"model": "m", "message": "x"})).unwrap();
        assert_eq!(none.max_output, None);
        assert!(d.matches("post", "/api/v1/ai/chat"));
        assert!(!d.matches("GET", "/api/v1/ai/chat"));
    }

    #[test]
    fn only_the_declared_input_is_counted() {
        let d = declared(json!({}));
        let long = "word ".repeat(400);
        let (_, counted) = parse(&d, json!({"model": "m", "message": long})).unwrap();
        let (_, elsewhere) =
            parse(&d, json!({"model": "m", "message": "x", "note": long})).unwrap();
        assert!(d.input_tokens(&counted) > 300.0);
        assert!(d.input_tokens(&elsewhere) < 10.0);
        let history = json!({"model": "m", "history": [{"role": "user", "content": long}]});
        let (_, v) = parse(&d, history).unwrap();
        assert!(d.input_tokens(&v) > 300.0, "messages under a pointer count");
    }

    /// Every refusal names the declared pointer of its field.
    #[test]
    fn bad_bodies_are_refused_naming_the_pointer() {
        let d = declared(json!({}));
        let cases = [
            (json!({"message": "x"}), "/model", "required"),
            (json!({"model": 7}), "/model", "must be a string"),
            (
                json!({"model": "m", "options": {"max_tokens": -1}}),
                "/options/max_tokens",
                "non-negative",
            ),
            (
                json!({"model": "m", "options": {"max_tokens": "9"}}),
                "/options/max_tokens",
                "non-negative",
            ),
            (
                json!({"model": "m", "options": {"max_tokens": 5000}}),
                "/options/max_tokens",
                "above the 1000",
            ),
            (
                json!({"model": "m", "options": 3}),
                "/options",
                "must be an object",
            ),
        ];
        for (body, param, says) in cases {
            let err = parse(&d, body.clone()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}");
            assert!(err.message.contains(says), "{body}: {}", err.message);
        }
        let dup = br#"{"model": "a", "model": "b"}"#;
        let err = d.parse(0, dup, &|_| 1000).unwrap_err();
        assert_eq!(
            err.param.as_deref(),
            Some("model"),
            "duplicate keys refused"
        );
        assert!(d.parse(0, b"[1]", &|_| 1000).is_err());
    }

    fn declared_at(model: &str, input: &[&str], limit: &str) -> Declared {
        let api: DeclaredApi = serde_json::from_value(json!({
            "path": "/app", "model": model, "input": input, "output_limit": limit,
        }))
        .unwrap();
        Declared::compile(&api).unwrap()
    }

    fn refused_at(d: &Declared, body: Value) -> String {
        let err = parse(d, body.clone()).expect_err("must be refused");
        assert!(err.message.contains("another spelling"), "{body}: {err:?}");
        err.param.unwrap_or_default()
    }

    /// A Go or ASP.NET Core service reads `MAX_TOKENS` as its `max_tokens`
    /// and `Model` as its `model`: sluice refuses them, alone or beside
    /// the exact spelling, whatever the key order.
    #[test]
    fn a_key_that_folds_onto_a_pointer_is_refused_naming_it() {
        let d = declared_at("/model", &["/message"], "/max_tokens");
        let base = json!({"model": "llama3.1:8b", "message": "hi", "max_tokens": 16});
        for (key, value) in [
            ("MAX_TOKENS", json!(4000)),
            ("Max_Tokens", json!(4000)),
            ("max_to\u{212A}ens", json!(4000)),
            ("Model", json!("llama3.1:70b")),
            ("MODEL", json!("llama3.1:70b")),
            (
                "Me\u{17F}\u{17F}age",
                json!("a prompt sluice never counted"),
            ),
        ] {
            let mut beside = base.clone();
            beside[key] = value.clone();
            assert_eq!(refused_at(&d, beside), format!("/{key}"));
            let mut alone = base.clone();
            let exact = key
                .to_lowercase()
                .replace('\u{212A}', "k")
                .replace('\u{17F}', "s");
            alone.as_object_mut().unwrap().remove(&exact);
            alone[key] = value;
            assert_eq!(refused_at(&d, alone), format!("/{key}"), "{key} alone");
        }
        let err = parse(&d, json!({"model": "m", "MAX_TOKENS": 4000})).unwrap_err();
        assert!(
            err.message
                .contains("`/MAX_TOKENS` is another spelling of `/max_tokens`"),
            "{err:?}"
        );
        // Keys the service does not read, in any case, and runes Go does
        // not fold onto ASCII.
        parse(
            &d,
            json!({"model": "m", "User_Id": "u", "TEMPERATURE": 1, "\u{131}nput": "x", "modell": 1}),
        )
        .unwrap();
    }

    /// Every level of a pointer, arrays included, and pointers whose
    /// segments are not lower case (a C# service's `Request.MaxTokens`).
    #[test]
    fn every_level_of_a_pointer_is_checked() {
        let d = declared_at(
            "/Request/Model",
            &["/Request/Turns/0/Text", "/Request/System"],
            "/Request/Options/MaxTokens",
        );
        let ok = json!({"Request": {"Model": "m", "Turns": [{"Text": "hi"}],
                                    "Options": {"MaxTokens": 16}}});
        let (demand, _) = parse(&d, ok.clone()).unwrap();
        assert_eq!(demand.max_output, Some(16));
        let cases = [
            (json!({"request": ok["Request"].clone()}), "/request"),
            (
                json!({"Request": {"Model": "m", "model": "big"}}),
                "/Request/model",
            ),
            (
                json!({"Request": {"Model": "m", "options": {"MaxTokens": 4000}}}),
                "/Request/options",
            ),
            (
                json!({"Request": {"Model": "m", "Options": {"MaxTokens": 16, "maxTokens": 4000}}}),
                "/Request/Options/maxTokens",
            ),
            (
                json!({"Request": {"Model": "m", "Turns": [{"Text": "hi", "TEXT": "long"}]}}),
                "/Request/Turns/0/TEXT",
            ),
            (
                json!({"Request": {"Model": "m", "\u{17F}ystem": "long"}}),
                "/Request/\u{17F}ystem",
            ),
        ];
        for (body, param) in cases {
            assert_eq!(refused_at(&d, body.clone()), param, "{body}");
        }
        // Only the first item is declared: the others are not read.
        parse(
            &d,
            json!({"Request": {"Model": "m", "Turns": [{"Text": "a"}, {"TEXT": "b"}]}}),
        )
        .unwrap();
        // A segment with `/` or `~` is named escaped.
        let d = declared_at("/a~1b", &["/m"], "/max");
        assert_eq!(refused_at(&d, json!({"a/b": "m", "A/B": "x"})), "/A~1B");
    }

    #[test]
    fn the_rewrite_touches_the_pointers_only() {
        let d = declared(json!({}));
        let body = json!({"model": "big", "message": "x", "extra": {"k": [1, 2]}});
        let sent = d.rewrite(&body, Some("small"), Some(64)).unwrap();
        assert_eq!(
            sent,
            json!({"model": "small", "message": "x", "extra": {"k": [1, 2]}, "options": {"max_tokens": 64}})
        );
        assert!(d.carries(&sent, 64));
        assert!(!d.carries(&sent, 63));
        assert_eq!(d.rewrite(&body, None, None), None);
    }

    #[test]
    fn an_answer_settles_from_its_counts_its_text_or_the_reservation() {
        let full = declared(
            json!({"text": "/reply", "input_tokens": "/usage/in", "output_tokens": "/usage/out"}),
        );
        let answer = json!({"reply": "hi", "usage": {"in": 12, "out": 34}});
        assert_eq!(
            full.answer.read(Some(&answer), 500),
            (
                Found::Usage(Usage {
                    input: 12,
                    output: 34
                }),
                34
            )
        );
        let no_input = json!({"reply": "hi", "usage": {"out": 34}});
        assert_eq!(
            full.answer.read(Some(&no_input), 500).0,
            Found::Usage(Usage {
                input: 0,
                output: 34
            })
        );
        for insane in [
            json!({"usage": {"out": -1}}),
            json!({"usage": {"out": "34"}}),
            json!({"usage": {"in": "x", "out": 3}}),
            json!({"usage": {"out": 1e12}}),
        ] {
            assert_eq!(
                full.answer.read(Some(&insane), 500),
                (Found::Invalid, 500),
                "{insane}"
            );
        }
        let (found, counted) = full
            .answer
            .read(Some(&json!({"reply": "word ".repeat(100)})), 500);
        assert_eq!(found, Found::Nothing);
        assert!((80..200).contains(&counted), "{counted}");
        assert_eq!(full.answer.read(None, 500), (Found::Invalid, 500));
        // 0 output beside a text is not believed: the text is estimated.
        let zero = json!({"reply": "word ".repeat(100), "usage": {"in": 12, "out": 0}});
        let (found, counted) = full.answer.read(Some(&zero), 500);
        assert_eq!(found, Found::Invalid);
        assert!((80..200).contains(&counted), "{counted}");
        // An empty or absent text leaves nothing to doubt.
        for empty in [
            json!({"reply": "", "usage": {"in": 3, "out": 0}}),
            json!({"usage": {"in": 3, "out": 0}}),
        ] {
            assert_eq!(
                full.answer.read(Some(&empty), 500),
                (
                    Found::Usage(Usage {
                        input: 3,
                        output: 0
                    }),
                    0
                ),
                "{empty}"
            );
        }
        let bare = declared(json!({}));
        assert_eq!(bare.answer.read(Some(&answer), 500), (Found::Nothing, 500));
    }

    #[test]
    fn the_static_answer_puts_its_text_where_the_service_does() {
        let d = declared(json!({"text": "/data/reply"}));
        let body: Value = serde_json::from_slice(&d.answer.static_body("sorry").unwrap()).unwrap();
        assert_eq!(body, json!({"data": {"reply": "sorry"}}));
        assert_eq!(declared(json!({})).answer.static_body("sorry"), None);
    }
}
