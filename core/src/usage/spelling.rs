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
//! A declared API (`usage/declared.rs`) is an application's own service,
//! as likely written in Go as in ASP.NET Core, where System.Text.Json
//! matches keys without case under `PropertyNameCaseInsensitive` (the web
//! default) by `StringComparer.OrdinalIgnoreCase` (dotnet/runtime
//! `System.Text.Json`, `JsonPropertyDictionary`), which upper-cases each
//! UTF-16 unit by its simple mapping and keeps `ı` and `ſ` as they are
//! (`System.Globalization.Native/pal_casing.c`,
//! `InitOrdinalCasingPage`): for ASCII names a subset of what Go folds.
//! Its pointers' segments are checked at every level with the same
//! folding ([`misspelled`], [`refusal`]).
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

use super::output_limit::LimitField;
use super::shared::{BadBody, Multiplies};

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

/// The representative of `c`'s fold set: two runes match without case
/// exactly when their folds are equal. Go folds ASCII letters by case and
/// every other rune to the smallest of its `unicode.SimpleFold` orbit
/// (`encoding/json/fold.go`, `foldRune`): Unicode's simple case folding,
/// which puts KELVIN SIGN with `k`, LONG S with `s`, `ς` with `σ`, and
/// leaves the Turkish `ı` and `İ` alone. std has no simple folding, so the
/// lower case of the upper case stands for it; it agrees for every rune
/// whose case mappings are single runes. A rune whose upper case is
/// several (`ß`, ligatures, some accented Greek) is compared as itself,
/// which misses the few orbits among those (`ß` with `ẞ` is still found).
/// Allocates nothing: it runs on keys of every body.
fn fold(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_lowercase();
    }
    if matches!(c, '\u{130}' | '\u{131}') {
        return c;
    }
    let upper = single(c.to_uppercase()).unwrap_or(c);
    single(upper.to_lowercase()).unwrap_or(upper)
}

/// The one rune a case mapping gives, if it gives one.
fn single(mut mapped: impl Iterator<Item = char>) -> Option<char> {
    match (mapped.next(), mapped.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    }
}

/// Does a server matching keys without case read `key` as `name`, while
/// it is spelled otherwise?
fn folds_to(key: &str, name: &str) -> bool {
    key != name && key.chars().map(fold).eq(name.chars().map(fold))
}

/// A name no other spelling folds onto but itself, once the key is plain
/// too: lower-case ASCII (the built-in keys all are).
fn plain(s: &str) -> bool {
    !s.bytes().any(|b| b.is_ascii_uppercase() || !b.is_ascii())
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
    use super::shared::Api;
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

/// The key of an object that a server matching keys without case would
/// read as one of `names` but that is spelled otherwise, and the name it
/// stands for; of several, the first in byte order (so the answer does not
/// depend on the key order). A key spelled exactly as one of the names is
/// that name, whatever else it folds onto.
pub(crate) fn misspelled<'a, 'n, I>(
    object: impl View<'a>,
    names: impl Fn() -> I,
) -> Option<(Cow<'a, str>, &'n str)>
where
    I: Iterator<Item = &'n str>,
{
    let names_plain = names().all(plain);
    find(object, names, names_plain)
}

/// [`misspelled`], told whether every name is plain: then a plain key
/// folds onto none of them but itself, and the common key costs one pass
/// over its bytes.
fn find<'a, 'n, I>(
    object: impl View<'a>,
    names: impl Fn() -> I,
    names_plain: bool,
) -> Option<(Cow<'a, str>, &'n str)>
where
    I: Iterator<Item = &'n str>,
{
    object
        .members()
        .filter(|(key, _)| !(names_plain && plain(key)))
        .filter(|(key, _)| !names().any(|name| name == key))
        .filter_map(|(key, _)| {
            let name = names().find(|name| folds_to(&key, name))?;
            Some((key, name))
        })
        .min()
}

/// Refuses a body with a key that a server matching keys without case
/// would read as a key sluice reads, spelled otherwise: a 400 naming it.
pub fn refuse_case_variants<'a>(body: impl View<'a>) -> Result<(), BadBody> {
    // Every built-in name is plain (a test holds it).
    if let Some((key, name)) = find(body, read_keys, true) {
        return Err(refusal(&key, name, |k| k.to_string()));
    }
    for (outer, inner) in NESTED {
        let Some(nested) = body.get(outer) else {
            continue;
        };
        if let Some((key, name)) = find(nested, || inner.iter().copied(), true) {
            return Err(refusal(&key, name, |k| format!("{outer}.{k}")));
        }
    }
    Ok(())
}

/// The 400 for `key`, another spelling of `name`; `path` writes a key of
/// the object that holds them as the API's errors write a field.
pub(crate) fn refusal(key: &str, name: &str, path: impl Fn(&str) -> String) -> BadBody {
    // The key is the client's text: keep the answer short.
    let key: String = key.chars().take(64).collect();
    let (shown, name) = (path(&key), path(name));
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

    /// The built-in check skips plain keys, which is right only while
    /// every built-in name is plain.
    #[test]
    fn every_built_in_name_is_plain() {
        for name in read_keys().chain(
            NESTED
                .iter()
                .flat_map(|(o, i)| std::iter::once(*o).chain(i.iter().copied())),
        ) {
            assert!(plain(name), "{name}");
        }
    }

    /// Go's orbits (`unicode.SimpleFold`, golang/go
    /// `src/unicode/letter_test.go`, `simpleFoldTests`), and the runes it
    /// leaves alone.
    #[test]
    fn runes_fold_as_go_folds_them() {
        for orbit in [
            "Aa",
            "δΔ",
            "KkK",
            "Ssſ",
            "ρϱΡ",
            "ͅΙιι",
            "Σσς",
            "ẞß",
            "Ǆǅǆ",
            "\u{13b0}\u{ab80}",
        ] {
            let folds: Vec<char> = orbit.chars().map(fold).collect();
            assert!(folds.windows(2).all(|w| w[0] == w[1]), "{orbit}: {folds:?}");
        }
        // Cased, but no simple case folding: none of them is `i`.
        for alone in ['\u{130}', '\u{131}'] {
            assert_ne!(fold(alone), 'i');
            assert_ne!(fold(alone), fold('I'));
        }
        assert!(folds_to("\u{212A}elvin", "kelvin"));
        assert!(folds_to("Model", "model") && folds_to("model", "Model"));
        assert!(!folds_to("model", "model"));
        assert!(!folds_to("models", "model"));
    }

    /// Names of any case (a declared pointer's segments): a plain key may
    /// fold onto one, and a key spelled as one of them is that one.
    #[test]
    fn names_of_any_case_are_matched_both_ways() {
        let body = json!({"model": "m", "Input": "x"});
        let names = || ["Model", "Input"].into_iter();
        assert_eq!(
            misspelled(&body, names),
            Some((Cow::Borrowed("model"), "Model"))
        );
        let both = json!({"Model": "a", "model": "b"});
        let names = || ["Model", "model"].into_iter();
        assert_eq!(misspelled(&both, names), None, "each spelled exactly");
        let names = || ["Ärger"].into_iter();
        assert_eq!(
            misspelled(&json!({"äRGER": 1}), names),
            Some((Cow::Borrowed("äRGER"), "Ärger"))
        );
        assert_eq!(misspelled(&json!({"Ärger": 1, "arger": 2}), names), None);
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
