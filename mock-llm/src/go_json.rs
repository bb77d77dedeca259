//! A request body as Ollama's Go server reads it. Ollama binds every body
//! with gin's `ShouldBindJSON` (`encoding/json` in a default build, gin
//! `internal/json/json.go`) into a struct (ollama `server/routes.go`,
//! `middleware/openai.go`, `middleware/anthropic.go`), and Go's decoder
//! matches an object key to a struct field "preferring an exact match but
//! also accepting a case-insensitive match" (go `encoding/json/decode.go`,
//! `Unmarshal`), folding each rune to the smallest of its simple-fold orbit
//! (`encoding/json/fold.go`): `MODEL`, `Stream`, `max_to\u{212A}ens` (KELVIN
//! SIGN) are `model`, `stream`, `max_tokens`. Each key that matches
//! overwrites the field, so the last one in the body wins (golang/go#43664).
//! A key that matches no field is dropped; a `map[string]any` (Ollama's
//! `options`) keeps its keys exactly as sent (`Options.FromMap` then
//! ignores a key that is no option name).
//!
//! [`read`] gives the body with every struct field under its own name,
//! last match winning in document order, which a `serde_json::Value` alone
//! could not tell (its map is sorted), so the bytes are read again here.

use std::fmt;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::generate::Api;

/// A Go struct's JSON field names, and the fields that are structs (or
/// slices of structs) themselves.
pub struct GoStruct {
    pub fields: &'static [&'static str],
    pub nested: &'static [(&'static str, &'static GoStruct)],
}

// The request structs, field names from their `json:` tags (ollama
// `api/types.go`, `openai/openai.go`, `openai/responses.go`,
// `anthropic/anthropic.go`). `input` and `system` are custom-decoded or
// `any`: kept as sent.
const OLLAMA_MESSAGE: GoStruct = GoStruct {
    fields: &[
        "role",
        "content",
        "thinking",
        "images",
        "tool_calls",
        "tool_name",
        "tool_call_id",
    ],
    nested: &[],
};
const CHAT: GoStruct = GoStruct {
    fields: &[
        "model",
        "messages",
        "stream",
        "format",
        "keep_alive",
        "tools",
        "options",
        "think",
        "truncate",
        "shift",
        "_debug_render_only",
        "logprobs",
        "top_logprobs",
    ],
    nested: &[("messages", &OLLAMA_MESSAGE)],
};
const GENERATE: GoStruct = GoStruct {
    fields: &[
        "model",
        "prompt",
        "suffix",
        "system",
        "template",
        "context",
        "stream",
        "raw",
        "format",
        "keep_alive",
        "images",
        "options",
        "think",
        "truncate",
        "shift",
        "_debug_render_only",
        "logprobs",
        "top_logprobs",
    ],
    nested: &[],
};
const EMBED: GoStruct = GoStruct {
    fields: &[
        "model",
        "input",
        "keep_alive",
        "truncate",
        "dimensions",
        "options",
    ],
    nested: &[],
};
const EMBEDDINGS: GoStruct = GoStruct {
    fields: &["model", "prompt", "keep_alive", "options"],
    nested: &[],
};
const OPENAI_MESSAGE: GoStruct = GoStruct {
    fields: &[
        "role",
        "content",
        "reasoning",
        "tool_calls",
        "name",
        "tool_call_id",
    ],
    nested: &[],
};
const STREAM_OPTIONS: GoStruct = GoStruct {
    fields: &["include_usage"],
    nested: &[],
};
const OPENAI_CHAT: GoStruct = GoStruct {
    fields: &[
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "seed",
        "stop",
        "temperature",
        "frequency_penalty",
        "presence_penalty",
        "top_p",
        "response_format",
        "tools",
        "reasoning",
        "reasoning_effort",
        "logprobs",
        "top_logprobs",
        "_debug_render_only",
    ],
    nested: &[
        ("messages", &OPENAI_MESSAGE),
        ("stream_options", &STREAM_OPTIONS),
    ],
};
const OPENAI_COMPLETION: GoStruct = GoStruct {
    fields: &[
        "model",
        "prompt",
        "frequency_penalty",
        "max_tokens",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "suffix",
        "logprobs",
        "_debug_render_only",
    ],
    nested: &[("stream_options", &STREAM_OPTIONS)],
};
const OPENAI_EMBED: GoStruct = GoStruct {
    fields: &["input", "model", "dimensions", "encoding_format"],
    nested: &[],
};
const RESPONSES: GoStruct = GoStruct {
    fields: &[
        "model",
        "background",
        "conversation",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "reasoning",
        "temperature",
        "text",
        "top_p",
        "truncation",
        "tools",
        "stream",
    ],
    nested: &[],
};
const MESSAGES: GoStruct = GoStruct {
    fields: &[
        "model",
        "max_tokens",
        "messages",
        "system",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "tools",
        "tool_choice",
        "thinking",
        "metadata",
        "output_config",
    ],
    nested: &[],
};

/// The struct Ollama decodes a body of `api` into (`None`: an API it lacks).
pub fn ollama_request(api: Api) -> Option<&'static GoStruct> {
    Some(match api {
        Api::OllamaChat => &CHAT,
        Api::OllamaGenerate => &GENERATE,
        Api::OllamaEmbed => &EMBED,
        Api::OllamaEmbeddings => &EMBEDDINGS,
        Api::ChatCompletions => &OPENAI_CHAT,
        Api::Completions => &OPENAI_COMPLETION,
        Api::Embeddings => &OPENAI_EMBED,
        Api::Responses => &RESPONSES,
        Api::Messages => &MESSAGES,
        _ => return None,
    })
}

/// `bytes` as Go decodes them into `shape`: see the module's comment.
pub fn read(bytes: &[u8], shape: &'static GoStruct) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = Shaped(Some(shape)).deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Does Go's decoder match `key` to the field `name`? Its fold
/// (`foldRune`: the smallest rune of the simple-fold orbit) sends a letter
/// and its other case to one rune; the orbits that hold an ASCII letter
/// and a non-ASCII rune are `k`/`K`/KELVIN SIGN and `s`/`S`/LONG S.
fn go_matches(key: &str, name: &str) -> bool {
    let fold = |c: char| match c {
        '\u{212A}' => 'k',
        '\u{017F}' => 's',
        c => c.to_ascii_lowercase(),
    };
    key.chars().map(fold).eq(name.chars().map(fold))
}

/// A value read into a Go struct (`Some`) or as Go's `any` (`None`): a
/// JSON array is a slice, each item read with the same shape.
struct Shaped(Option<&'static GoStruct>);

impl<'de> DeserializeSeed<'de> for Shaped {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Shaped {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Shaped(self.0))? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Some(shape) = self.0 else {
                // `any` / a map: keys as sent (the last duplicate wins).
                out.insert(key, map.next_value_seed(Shaped(None))?);
                continue;
            };
            // An exact match first, then one without case.
            let field = shape
                .fields
                .iter()
                .find(|f| **f == key)
                .or_else(|| shape.fields.iter().find(|f| go_matches(&key, f)));
            let Some(field) = field else {
                map.next_value::<IgnoredAny>()?; // no such field: dropped
                continue;
            };
            let inner = shape
                .nested
                .iter()
                .find(|(name, _)| name == field)
                .map(|(_, s)| *s);
            out.insert((*field).to_owned(), map.next_value_seed(Shaped(inner))?);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: &str) -> Value {
        read(body.as_bytes(), &CHAT).unwrap()
    }

    #[test]
    fn keys_match_without_case_and_the_last_one_wins() {
        let v = chat(r#"{"model":"a","MODEL":"b","stream":false,"Stream":true}"#);
        assert_eq!(v, json!({"model": "b", "stream": true}));
        let v = chat(r#"{"Stream":true,"stream":false}"#);
        assert_eq!(v["stream"], false, "document order, not sorted order");
        let v = chat(r#"{"\u017Ftream":false,"mode\u006C":"m"}"#);
        assert_eq!(v, json!({"stream": false, "model": "m"}));
    }

    #[test]
    fn unknown_keys_are_dropped_and_options_keys_kept_exactly() {
        let v = chat(r#"{"model":"m","max_tokens":5,"Options":{"NUM_PREDICT":9,"num_predict":3}}"#);
        assert_eq!(
            v,
            json!({"model": "m", "options": {"NUM_PREDICT": 9, "num_predict": 3}})
        );
    }

    #[test]
    fn nested_structs_fold_too() {
        let v = chat(r#"{"Messages":[{"Role":"user","CONTENT":"hi","x":1}]}"#);
        assert_eq!(v, json!({"messages": [{"role": "user", "content": "hi"}]}));
        let v = read(
            br#"{"stream":true,"Stream_Options":{"Include_Usage":true}}"#,
            &OPENAI_CHAT,
        )
        .unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        // A type Go would refuse is kept for the caller to judge.
        assert_eq!(chat(r#"{"messages":"x"}"#)["messages"], "x");
    }
}
