//! Keys a server reads under another spelling. Go's `encoding/json`
//! matches an object key to a struct field "preferring an exact match but
//! also accepting a case-insensitive match" (go `src/encoding/json/decode.go`,
//! `Unmarshal`), folding each rune to the smallest of its simple-fold
//! orbit (`fold.go`, `foldRune`), and each matching key overwrites the
//! last (golang/go#14750, #43664): `{"model":"a","MODEL":"b"}` is model `b`
//! to a Go server and `a` to sluice, `{"stream":false,"Stream":true}`
//! streams, a `Messages` array is a prompt sluice never estimated.
//!
//! Ollama is such a server on every API it serves: its native handlers
//! (`server/routes.go`) and its OpenAI and Anthropic layers
//! (`middleware/openai.go`, `middleware/anthropic.go`) bind the body with
//! gin's `ShouldBindJSON`, which is `encoding/json` in a default build
//! (gin `internal/json/json.go`), into structs (`api.ChatRequest`,
//! `api.GenerateRequest`, `openai.ChatCompletionRequest`, …). vLLM's
//! pydantic models match field names exactly and keep an unknown key as an
//! ignored extra (vllm `entrypoints/openai/engine/protocol.py`,
//! `OpenAIBaseModel`: `extra="allow"`, logged as ignored), and OpenAI's and
//! Anthropic's APIs refuse unknown fields: there `MODEL` is a key both the
//! server and sluice leave alone, so those servers need nothing. Since any
//! route may have Ollama behind it, a key that folds onto a key sluice
//! reads, spelled otherwise, is a 400 naming it, whatever the API.
//!
//! Not checked, because Go reads them exactly too: the keys inside
//! Ollama's `options` (a `map[string]any`, matched key by key against the
//! option names by `Options.FromMap`, ollama `api/types.go`: a
//! `NUM_PREDICT` there is "invalid option provided" and ignored, while
//! sluice writes the `num_predict` it reserved). Inside messages, every
//! key is counted by the estimate whatever its spelling, and the semantic
//! cache key takes no message with a key it does not know.

use std::borrow::Cow;

use super::view::View;

use super::demand::{BadBody, Multiplies};
use super::output_limit::LimitField;

/// Top-level keys sluice reads from some request body, besides the limit
/// fields and the multipliers (checked from their own tables): the model,
/// streaming and its usage chunk, the texts the estimate counts, the
/// cache's temperature and images, and the Responses API's stored context.
const READ: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "messages",
    "temperature",
    "images",
    "previous_response_id",
    "conversation",
];

/// Keys sluice reads inside an object-valued key, as `(outer, inner)`.
const NESTED: &[(&str, &[&str])] = &[("stream_options", &["include_usage"])];

/// Does Go fold `key` onto `name` (all ASCII) while it is spelled
/// otherwise? ASCII letters match in either case, and the two non-ASCII
/// runes whose fold orbit holds an ASCII letter (KELVIN SIGN with `k`,
/// LONG S with `s`) match that letter; every other non-ASCII rune folds to
/// a non-ASCII one, so never onto a name. Allocates nothing: it runs on
/// every key of every body.
fn folds_to(key: &str, name: &str) -> bool {
    let fold = |c: char| match c {
        '\u{212A}' => 'k',
        '\u{017F}' => 's',
        c => c.to_ascii_lowercase(),
    };
    key != name && key.chars().map(fold).eq(name.chars())
}

/// Every top-level key sluice reads.
fn read_keys() -> impl Iterator<Item = &'static str> {
    let limits = LimitField::ALL
        .into_iter()
        .map(|f| f.name().split('.').next().unwrap_or_default());
    let estimated = super::estimate::TEXT_FIELDS
        .iter()
        .chain(super::estimate::JSON_FIELDS)
        .copied();
    READ.iter()
        .copied()
        .chain(limits)
        .chain(estimated)
        .chain(multiplier_fields())
}

/// The fields of every API's multiplier table (and the ones they pair with).
fn multiplier_fields() -> impl Iterator<Item = &'static str> {
    use super::demand::Api;
    [
        Api::OpenAiChat,
        Api::OpenAiCompletions,
        Api::OpenAiEmbeddings,
        Api::Scoring,
    ]
    .into_iter()
    .flat_map(|api| api.multipliers())
    .flat_map(|m| {
        let paired = match m.multiplies {
            Multiplies::PairedWith(other) => Some(other),
            _ => None,
        };
        std::iter::once(m.field).chain(paired)
    })
}

/// The key of an object that a Go server would read as one of `names` but
/// that is spelled otherwise, and the name it stands for; of several, the
/// first in byte order (so the answer does not depend on the key order).
fn misspelled<'a, I>(
    object: impl View<'a>,
    names: impl Fn() -> I,
) -> Option<(Cow<'a, str>, &'static str)>
where
    I: Iterator<Item = &'static str>,
{
    // A key of lower-case ASCII folds onto nothing but itself: the common
    // case costs one pass over its bytes.
    let may_fold = |key: &str| key.bytes().any(|b| b.is_ascii_uppercase() || !b.is_ascii());
    object
        .members()
        .filter(|(k, _)| may_fold(k))
        .filter_map(|(key, _)| {
            let name = names().find(|name| folds_to(&key, name))?;
            Some((key, name))
        })
        .min()
}

/// Refuses a body with a key that a server matching keys without case
/// would read as a key sluice reads, spelled otherwise: a 400 naming it.
pub fn refuse_case_variants<'a>(body: impl View<'a>) -> Result<(), BadBody> {
    if let Some((key, name)) = misspelled(body, read_keys) {
        return Err(refusal(&key, name, None));
    }
    for (outer, inner) in NESTED {
        let Some(nested) = body.get(outer) else {
            continue;
        };
        if let Some((key, name)) = misspelled(nested, || inner.iter().copied()) {
            return Err(refusal(&key, name, Some(outer)));
        }
    }
    Ok(())
}

fn refusal(key: &str, name: &str, outer: Option<&str>) -> BadBody {
    // The key is the client's text: keep the answer short.
    let key: String = key.chars().take(64).collect();
    let (shown, name) = match outer {
        Some(outer) => (format!("{outer}.{key}"), format!("{outer}.{name}")),
        None => (key, name.to_string()),
    };
    BadBody::at(
        &shown,
        format!("`{shown}` is another spelling of `{name}`, which a server that matches keys without case would read: spell it `{name}`"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn check(body: Value) -> Result<(), BadBody> {
        assert!(body.is_object(), "not an object");
        refuse_case_variants(&body)
    }

    fn param(body: Value) -> Option<String> {
        check(body).expect_err("must be refused").param
    }

    #[test]
    fn every_key_sluice_reads_is_refused_in_another_case() {
        let keys: Vec<&str> = read_keys().collect();
        for must in [
            "model",
            "stream",
            "messages",
            "prompt",
            "input",
            "system",
            "options",
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "format",
            "n",
            "best_of",
            "prompt_embeds",
            "documents",
            "text_2",
        ] {
            assert!(keys.contains(&must), "{must} is not checked");
        }
        for key in keys {
            for variant in [key.to_ascii_uppercase(), capitalised(key)] {
                if variant == key {
                    continue; // no letter to change (none today)
                }
                let body = json!({ key: 1, variant.clone(): 2 });
                assert_eq!(param(body).as_deref(), Some(variant.as_str()), "{key}");
                // Alone too: sluice would not see it at all.
                assert_eq!(
                    param(json!({ variant.clone(): 2 })).as_deref(),
                    Some(variant.as_str())
                );
            }
        }
    }

    fn capitalised(key: &str) -> String {
        let mut c = key.chars();
        c.next()
            .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
            .unwrap_or_default()
    }

    #[test]
    fn go_folds_kelvin_and_long_s_into_ascii() {
        assert_eq!(
            param(json!({"\u{17F}tream": true})).as_deref(),
            Some("\u{17F}tream")
        );
        assert_eq!(
            param(json!({"max_to\u{212A}ens": 9})).as_deref(),
            Some("max_to\u{212A}ens")
        );
        // Dotless i folds to no ASCII letter in Go's orbit: not `input`.
        check(json!({"\u{131}nput": "x"})).unwrap();
    }

    #[test]
    fn the_refusal_names_the_key_and_what_it_stands_for() {
        let e = check(json!({"model": "a", "MODEL": "b"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("MODEL"));
        assert!(
            e.message.contains("`MODEL` is another spelling of `model`"),
            "{e:?}"
        );
    }

    /// The limit keys' own cases (formerly `output_limit.rs`'s).
    #[test]
    fn case_variants_of_a_limit_key_are_refused() {
        for key in [
            "MAX_TOKENS",
            "Max_Tokens",
            "max_to\u{212A}ens",
            "max_output_to\u{212A}en\u{017F}",
            "Options",
            "max_Completion_tokens",
        ] {
            let mut body = json!({"max_tokens": 5, "options": {}});
            body[key] = json!(99_999);
            assert_eq!(param(body).as_deref(), Some(key));
        }
    }

    #[test]
    fn nested_keys_sluice_reads_are_checked_and_options_keys_are_not() {
        let e = check(json!({"stream_options": {"include_usage": true, "Include_Usage": false}}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options.Include_Usage"));
        assert!(
            e.message.contains("`stream_options.include_usage`"),
            "{e:?}"
        );
        // Ollama reads its options map exactly: both ignore `NUM_PREDICT`.
        check(json!({"options": {"NUM_PREDICT": 5, "Temperature": 2}})).unwrap();
        // Keys sluice reads nothing from, whatever their case.
        check(json!({"model": "m", "Seed": 1, "TOP_P": 0.5, "Keep_Alive": "5m"})).unwrap();
        check(json!({"stream_options": 3})).unwrap();
    }
}
