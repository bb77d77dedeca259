//! A rewritten body written into the client's own bytes: only the
//! top-level members whose value changed are serialised again, the
//! members added go at the end of the object, the members removed are cut
//! out; every other byte (key order, spacing, number spelling, escapes)
//! goes upstream as the client sent it.
//!
//! Serialising the whole rewritten tree instead would reorder the keys
//! (serde_json's map is sorted), respell numbers and escapes, and cost a
//! pass over every byte of a large prompt to change one limit field.
//!
//! The body was read by the strict read first (valid JSON, one object,
//! no key twice), so the scan below only has to find where each member
//! starts and ends; whatever it cannot follow gives `None`, and the
//! caller serialises the tree as before.

use std::borrow::Cow;
use std::ops::Range;

use serde_json::{Map, Value};

/// One member of the body's top-level object.
struct Member<'a> {
    /// The key, unescaped.
    key: Cow<'a, str>,
    /// From the key's opening quote to the end of the value.
    span: Range<usize>,
    /// The value alone.
    value: Range<usize>,
}

/// The top-level members in the order they are written, and the bytes
/// after the opening brace where the first one starts.
struct Members<'a> {
    list: Vec<Member<'a>>,
    /// The index just after the opening `{`.
    inside: usize,
}

fn skip_ws(body: &[u8], mut i: usize) -> usize {
    while body
        .get(i)
        .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
        i += 1;
    }
    i
}

/// The index after the string that opens at `i` (its closing quote).
fn string_end(body: &[u8], i: usize) -> Option<usize> {
    let mut at = i + 1;
    loop {
        at += memchr::memchr2(b'"', b'\\', body.get(at..)?)?;
        if body.get(at) == Some(&b'\\') {
            at += 2;
            continue;
        }
        return Some(at + 1);
    }
}

/// The index after the value that starts at `i`.
fn value_end(body: &[u8], i: usize) -> Option<usize> {
    match body.get(i)? {
        b'"' => string_end(body, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = i;
            loop {
                match body.get(at)? {
                    b'"' => {
                        at = string_end(body, at)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        _ => {
            // A number, `true`, `false` or `null`: up to the next
            // delimiter.
            let mut at = i;
            while body
                .get(at)
                .is_some_and(|b| !matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
            {
                at += 1;
            }
            (at > i).then_some(at)
        }
    }
}

fn members(body: &[u8]) -> Option<Members<'_>> {
    let open = skip_ws(body, 0);
    if body.get(open) != Some(&b'{') {
        return None;
    }
    let inside = open + 1;
    let mut list = Vec::new();
    let mut i = skip_ws(body, inside);
    if body.get(i) == Some(&b'}') {
        return Some(Members { list, inside });
    }
    loop {
        if body.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(body, i)?;
        let raw = body.get(i..key_end)?;
        let key = match raw.contains(&b'\\') {
            false => Cow::Borrowed(std::str::from_utf8(raw.get(1..raw.len() - 1)?).ok()?),
            true => Cow::Owned(serde_json::from_slice::<String>(raw).ok()?),
        };
        let colon = skip_ws(body, key_end);
        if body.get(colon) != Some(&b':') {
            return None;
        }
        let start = skip_ws(body, colon + 1);
        let end = value_end(body, start)?;
        list.push(Member {
            key,
            span: i..end,
            value: start..end,
        });
        i = skip_ws(body, end);
        match body.get(i)? {
            b',' => i = skip_ws(body, i + 1),
            b'}' => return Some(Members { list, inside }),
            _ => return None,
        }
    }
}

/// `after` (a rewrite of `before`, which is what `body` reads as) written
/// into `body`'s bytes. `None`: `body` or either value is not an object,
/// or its members do not match `before` (the caller serialises `after`).
pub fn splice(body: &[u8], before: &Value, after: &Value) -> Option<Vec<u8>> {
    let (Value::Object(old), Value::Object(new)) = (before, after) else {
        return None;
    };
    let found = members(body)?;
    if found.list.len() != old.len() || found.list.iter().any(|m| !old.contains_key(&*m.key)) {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + 64);
    let first = found.list.first().map_or(found.inside, |m| m.span.start);
    out.extend_from_slice(body.get(..first)?);
    let mut written = 0usize;
    // The member just before was written: the separator the client wrote
    // between the two (a comma and its spacing) is kept.
    let mut kept_previous = false;
    for (j, m) in found.list.iter().enumerate() {
        let Some(value) = new.get(&*m.key) else {
            kept_previous = false; // cut out, with the comma after it
            continue;
        };
        if written > 0 {
            match j.checked_sub(1).and_then(|p| found.list.get(p)) {
                Some(before) if kept_previous => {
                    out.extend_from_slice(body.get(before.span.end..m.span.start)?);
                }
                _ => out.push(b','),
            }
        }
        if old.get(&*m.key) == Some(value) {
            out.extend_from_slice(body.get(m.span.clone())?);
        } else {
            out.extend_from_slice(body.get(m.span.start..m.value.start)?);
            out.extend_from_slice(&serde_json::to_vec(value).ok()?);
        }
        written += 1;
        kept_previous = true;
    }
    let added: Map<String, Value> = new
        .iter()
        .filter(|(k, _)| !old.contains_key(*k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in &added {
        if written > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&serde_json::to_vec(k).ok()?);
        out.push(b':');
        out.extend_from_slice(&serde_json::to_vec(v).ok()?);
        written += 1;
    }
    let last = found.list.last().map_or(found.inside, |m| m.span.end);
    out.extend_from_slice(body.get(last..)?);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn spliced(body: &str, change: impl Fn(&mut Value)) -> String {
        let before: Value = serde_json::from_str(body).unwrap();
        let mut after = before.clone();
        change(&mut after);
        let out = splice(body.as_bytes(), &before, &after).unwrap();
        let back: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(back, after, "{}", String::from_utf8_lossy(&out));
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn only_what_changed_is_written_again() {
        let body = r#"{ "model" : "a",
  "messages": [{"role":"user","content":"caf\u00e9 1.50"}],
  "temperature": 1.0, "max_tokens": 4096 }"#;
        let out = spliced(body, |v| v["max_tokens"] = json!(512));
        assert_eq!(out, body.replace("4096", "512"));
        let out = spliced(body, |v| v["model"] = json!("b"));
        assert_eq!(out, body.replace(r#""a""#, r#""b""#));
        // Added at the end; the client's members as they were.
        let out = spliced(body, |v| v["max_completion_tokens"] = json!(512));
        assert_eq!(
            out,
            body.replace(" 4096 }", " 4096,\"max_completion_tokens\":512 }")
        );
    }

    #[test]
    fn members_cut_out_take_their_comma_with_them() {
        let body = r#"{"max_tokens":1,"model":"a","max_completion_tokens":2}"#;
        let cut = |keys: &'static [&'static str]| {
            spliced(body, move |v| {
                for k in keys {
                    v.as_object_mut().unwrap().remove(*k);
                }
            })
        };
        assert_eq!(
            cut(&["max_tokens"]),
            r#"{"model":"a","max_completion_tokens":2}"#
        );
        assert_eq!(
            cut(&["max_completion_tokens"]),
            r#"{"max_tokens":1,"model":"a"}"#
        );
        assert_eq!(
            cut(&["model"]),
            r#"{"max_tokens":1,"max_completion_tokens":2}"#
        );
        assert_eq!(cut(&["max_tokens", "model", "max_completion_tokens"]), "{}");
        let out = spliced(body, |v| {
            v.as_object_mut().unwrap().remove("max_tokens");
            v["stream_options"] = json!({"include_usage": true});
        });
        assert_eq!(
            out,
            r#"{"model":"a","max_completion_tokens":2,"stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn escaped_keys_and_nested_values_are_followed() {
        let body = r#"{"max\u005ftokens":7,"options":{"num_predict":9,"x":"}]\"["},"s":"\\"}"#;
        let out = spliced(body, |v| v["max_tokens"] = json!(3));
        assert_eq!(out, body.replace(":7,", ":3,"));
        let out = spliced(body, |v| v["options"]["num_predict"] = json!(1));
        assert!(out.ends_with(r#","s":"\\"}"#), "{out}");
        assert_eq!(spliced("{}", |v| v["a"] = json!(1)), r#"{"a":1}"#);
    }

    #[test]
    fn what_is_not_an_object_it_matches_is_left_to_the_caller() {
        let v = json!({"a": 1});
        assert_eq!(splice(b"[1]", &json!([1]), &json!([2])), None);
        assert_eq!(splice(br#"{"b":1}"#, &v, &json!({"a": 2})), None);
        assert_eq!(splice(br#"{"a":1"#, &v, &json!({"a": 2})), None);
    }

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z\"\\\\/é😀\u{1}]{0,8}".prop_map(Value::String),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        leaf().prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z_\"]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever the body and the rewrite (members changed, cut out,
        /// added; the body compact or pretty), the spliced bytes read as
        /// the rewritten value.
        #[test]
        fn a_spliced_body_reads_as_the_rewrite(
            members in prop::collection::btree_map("[a-z_\"\\\\]{1,6}", json_value(), 0..6),
            changes in prop::collection::vec(("[a-z_]{1,6}", prop::option::of(json_value())), 0..4),
            pretty in any::<bool>(),
        ) {
            let before = Value::Object(members.into_iter().collect());
            let body = if pretty {
                serde_json::to_vec_pretty(&before).unwrap()
            } else {
                serde_json::to_vec(&before).unwrap()
            };
            let mut after = before.clone();
            let fields = after.as_object_mut().unwrap();
            for (key, value) in changes {
                match value {
                    Some(v) => { fields.insert(key, v); }
                    None => { fields.remove(&key); }
                }
            }
            let out = splice(&body, &before, &after).unwrap();
            let back: Value = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(back, after);
        }
    }
}
