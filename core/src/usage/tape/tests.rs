//! The tape against the strict serde read it replaces: the same bodies
//! refused, and the same values read from the ones accepted.

use super::*;
use crate::usage::demand::read_json;
use proptest::prelude::*;
use serde_json::Value;

/// The tape's value as a serde tree, built through [`View`] alone (and
/// each number's own text), to compare with the strict read's.
fn tree(v: Json<'_>) -> Value {
    match v.kind() {
        Kind::Null => Value::Null,
        Kind::Bool(b) => Value::Bool(b),
        Kind::Number => serde_json::from_str(v.text()).unwrap(),
        Kind::String => Value::String(v.str().unwrap().into_owned()),
        Kind::Array => Value::Array(v.items().map(tree).collect()),
        Kind::Object => Value::Object(
            v.members()
                .map(|(k, v)| (k.into_owned(), tree(v)))
                .collect(),
        ),
    }
}

/// Every number of a tree, by the tape and by serde: the integer reads agree.
fn same_numbers(v: Json<'_>, value: &Value) {
    match (v.kind(), value) {
        (Kind::Number, Value::Number(_)) => {
            assert_eq!(v.u64(), value.as_u64(), "{}", v.text());
            assert_eq!(v.i64(), value.as_i64(), "{}", v.text());
        }
        (Kind::Array, Value::Array(items)) => {
            for (a, b) in v.items().zip(items) {
                same_numbers(a, b);
            }
        }
        (Kind::Object, Value::Object(fields)) => {
            for (k, a) in v.members() {
                same_numbers(a, &fields[k.as_ref()]);
            }
            for (k, b) in fields {
                assert_eq!(v.get(k).map(tree).as_ref(), Some(b), "get {k}");
            }
        }
        _ => {}
    }
}

/// Reads `body` both ways and holds them equal.
fn check(body: &[u8]) {
    let strict = read_json(body);
    let tape = Tape::read(body);
    match (&strict, &tape) {
        (Ok(value), Some(tape)) => {
            assert_eq!(
                &tree(tape.root()),
                value,
                "{:?}",
                String::from_utf8_lossy(body)
            );
            same_numbers(tape.root(), value);
        }
        (Err(_), None) => {}
        _ => panic!(
            "strict read {} but the tape {}: {:?}",
            if strict.is_ok() { "accepts" } else { "refuses" },
            if tape.is_some() { "accepts" } else { "refuses" },
            String::from_utf8_lossy(body)
        ),
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "-0.0",
    "01",
    "1.",
    ".5",
    "+1",
    "-",
    "1.5",
    "2e3",
    "1E5",
    "1e+2",
    "1e-400",
    "1e400",
    "-1e400",
    "1e308",
    "1.7976931348623157e308",
    "1.7976931348623159e308",
    "17976931348623157000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "-18446744073709551615",
    "123456789012345678",
    "1234567890123456789",
    "00",
    "1e",
    "1e+",
    "16",
];

const STRINGS: &[&str] = &[
    r#""""#,
    r#""plain""#,
    r#""model""#,
    r#""a""#,
    r#""\u0061""#,
    r#""A""#,
    r#""é""#,
    r#""\u00e9""#,
    r#""日本""#,
    r#""\ud83d\ude00""#,
    r#""😀""#,
    r#""\ud83d""#,
    r#""\udc00""#,
    r#""\ud83d\u0041""#,
    r#""\ud83dx""#,
    r#""\x""#,
    r#""\"\\\/\b\f\n\r\t""#,
    r#""\u00""#,
    r#""\uZZZZ""#,
    "\"tab\tinside\"",
    "\"nul\u{0}\"",
    "\"del\u{7f}\"",
    r#""unterminated"#,
    r#""a\\""#,
];

const SPACE: &[&str] = &["", " ", "\n", "\t", "\r\n", "\u{c}", "\u{a0}"];

fn value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        prop::sample::select(NUMBERS).prop_map(str::to_string),
        prop::sample::select(STRINGS).prop_map(str::to_string),
        prop::sample::select(&["true", "false", "null", "nul", "tru"][..]).prop_map(str::to_string),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
    ];
    leaf.prop_recursive(6, 48, 6, |inner| {
        let space = prop::sample::select(SPACE);
        prop_oneof![
            prop::collection::vec((inner.clone(), space.clone()), 0..6).prop_map(|items| {
                let items: Vec<String> = items
                    .into_iter()
                    .map(|(v, s)| format!("{s}{v}{s}"))
                    .collect();
                format!("[{}]", items.join(","))
            }),
            prop::collection::vec((prop::sample::select(STRINGS), inner, space), 0..6).prop_map(
                |members| {
                    let members: Vec<String> = members
                        .into_iter()
                        .map(|(k, v, s)| format!("{s}{k}{s}:{s}{v}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }
            ),
        ]
    })
}

/// A body, sometimes with one byte changed, cut or added.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let edit = prop_oneof![
        Just(None),
        (
            any::<prop::sample::Index>(),
            prop::sample::select(&b"{}[],:\"\\ 0-.eE\x00\xff\xc3"[..])
        )
            .prop_map(Some),
    ];
    (value(), prop::sample::select(SPACE), edit, any::<bool>()).prop_map(|(v, s, edit, cut)| {
        let mut bytes = format!("{s}{v}{s}").into_bytes();
        if let Some((at, byte)) = edit {
            let at = at.index(bytes.len() + 1);
            if cut && at < bytes.len() {
                bytes.remove(at);
            } else {
                bytes.insert(at, byte);
            }
        }
        bytes
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn the_tape_refuses_and_reads_what_the_strict_read_does(body in body()) {
        check(&body);
    }
}

#[test]
fn each_refusal_of_the_strict_read_is_the_tapes() {
    for body in [
        r#"{"a":1,"a":2}"#,
        r#"{"a":1,"\u0061":2}"#,
        r#"{"x":{"k":1,"k":1}}"#,
        r#"{"a":1e400}"#,
        r#"{"a":"\ud800"}"#,
        r#"{"a":"\udc00"}"#,
        "{\"a\":\"\u{1}\"}",
        r#"{"a":1}x"#,
        r#"{"a":1,}"#,
        r#"{,"a":1}"#,
        r#"[1,]"#,
        r#"[,1]"#,
        r#"{"a" 1}"#,
        r#"{"a":01}"#,
        "\u{feff}{}",
        "{}\u{c}",
        "",
        " ",
    ] {
        assert!(read_json(body.as_bytes()).is_err(), "{body}");
        assert!(Tape::read(body.as_bytes()).is_none(), "{body}");
    }
    // Invalid UTF-8 inside a string.
    assert!(Tape::read(b"{\"a\":\"\xff\"}").is_none());
}

#[test]
fn big_objects_find_a_key_twice_among_many() {
    let mut members: Vec<String> = (0..40).map(|i| format!("\"k{i}\":{i}")).collect();
    check(format!("{{{}}}", members.join(",")).as_bytes());
    members.push(r#""k\u0031":0"#.into()); // "k1" again, escaped
    let body = format!("{{{}}}", members.join(","));
    assert!(Tape::read(body.as_bytes()).is_none());
    check(body.as_bytes());
}

#[test]
fn too_many_values_are_refused_as_the_strict_read_does() {
    let n = MAX_JSON_VALUES as usize;
    // n values in all: the array and n - 1 items.
    let at_bound = format!("[{}]", vec!["0"; n - 1].join(","));
    check(at_bound.as_bytes());
    assert!(Tape::read(at_bound.as_bytes()).is_some());
    let over = format!("[{}]", vec!["0"; n].join(","));
    assert!(Tape::read(over.as_bytes()).is_none());
    check(over.as_bytes());
}

#[test]
fn strings_are_borrowed_unless_escaped() {
    let body = br#"{"plain":"abc","esc":"a\nb\u00e9\ud83d\ude00","k\u0065y":1}"#;
    let tape = Tape::read(body).unwrap();
    let root = tape.root();
    assert!(matches!(
        root.get("plain").unwrap().str(),
        Some(Cow::Borrowed("abc"))
    ));
    assert_eq!(root.get("esc").unwrap().str().unwrap(), "a\nbé😀");
    assert_eq!(
        root.get("key").unwrap().u64(),
        Some(1),
        "an escaped key is found"
    );
    assert!(root.get("missing").is_none());
}

/// A request-like body: keys every reader looks at, with any values.
fn request() -> impl Strategy<Value = Vec<u8>> {
    let keys = prop::sample::select(
        &[
            r#""model""#,
            r#""Model""#,
            r#""messages""#,
            r#""max_tokens""#,
            r#""max_completion_tokens""#,
            r#""MAX_TOKENS""#,
            r#""options""#,
            r#""stream""#,
            r#""stream_options""#,
            r#""n""#,
            r#""prompt""#,
            r#""input""#,
            r#""tools""#,
            r#""system""#,
            r#""previous_response_id""#,
        ][..],
    );
    let values = prop_oneof![
        value(),
        prop::sample::select(
            &[
                r#""m""#,
                "16",
                "-1",
                "true",
                r#"[{"role":"user","content":"hi there, 123!"},{"content":[{"type":"text","text":"x"}],"role":"system","name":"n"}]"#,
                r#"{"num_predict":8}"#,
                r#"{"include_usage":true}"#,
                r#"[[1,2],[3]]"#,
                r#"["a","b"]"#,
                r#"[{"type":"function","function":{"name":"f","parameters":{"b":1.50,"a":"\u00e9"}}}]"#,
            ][..]
        )
        .prop_map(str::to_string),
    ];
    prop::collection::vec((keys, values), 0..8).prop_map(|members| {
        let members: Vec<String> = members
            .into_iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect();
        format!("{{{}}}", members.join(",")).into_bytes()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Every reader of a body gets the same answer from the tape as from
    /// the tree: the demand or the 400, the estimate bit for bit, the
    /// limit fields, the stored context.
    #[test]
    fn each_reader_reads_the_tape_as_the_tree(body in request()) {
        use crate::usage::demand::{demand_of, stored_context, Api};
        use crate::usage::estimate::input_tokens_of;
        use crate::usage::output_limit::SentLimits;
        let (Ok(value), Some(tape)) = (read_json(&body), Tape::read(&body)) else {
            return Ok(());
        };
        let root = tape.root();
        let cap = |_: &str| 1_000;
        for api in [
            Api::OpenAiChat,
            Api::OpenAiCompletions,
            Api::OpenAiResponses,
            Api::OpenAiEmbeddings,
            Api::AnthropicMessages,
            Api::OllamaChat,
            Api::Invocations,
        ] {
            prop_assert_eq!(demand_of(api, root, &cap), demand_of(api, &value, &cap));
            prop_assert_eq!(
                input_tokens_of(api, root).to_bits(),
                input_tokens_of(api, &value).to_bits()
            );
            prop_assert_eq!(stored_context(api, root), stored_context(api, &value));
        }
        prop_assert_eq!(SentLimits::of(root), SentLimits::of(&value));
    }
}
