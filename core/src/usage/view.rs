//! One way to read a JSON value, whoever holds it: the request body's tape
//! (`usage/tape.rs`, the hot path: no tree is built) or a `serde_json`
//! tree (a declared API's body, a rewrite, the tests). Every reader of a
//! request body (the model, the limit fields, the multipliers, the
//! spellings, the estimate) is written once, against [`View`], so the two
//! cannot disagree.

use std::borrow::Cow;

use serde_json::Value;

/// What a JSON value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Null,
    Bool(bool),
    Number,
    String,
    Array,
    Object,
}

/// A read-only JSON value. Object members come in any order: a reader
/// whose result depends on the order sorts them (a serde map's order).
pub trait View<'a>: Copy {
    fn kind(self) -> Kind;
    /// The member `key` of an object (`None` for anything else).
    fn get(self, key: &str) -> Option<Self>;
    /// The text of a string, unescaped.
    fn str(self) -> Option<Cow<'a, str>>;
    /// A non-negative integer as serde_json reads one (no fraction, no
    /// exponent, within `u64`).
    fn u64(self) -> Option<u64>;
    /// An integer within `i64` as serde_json reads one (`-0` is a float).
    fn i64(self) -> Option<i64>;
    /// The items of an array (none for anything else).
    fn items(self) -> impl Iterator<Item = Self> + 'a;
    /// The members of an object (none for anything else).
    fn members(self) -> impl Iterator<Item = (Cow<'a, str>, Self)> + 'a;
    /// The value as compact JSON text, keys sorted (serde_json's).
    fn compact(self) -> String;

    fn is_null(self) -> bool {
        self.kind() == Kind::Null
    }
    fn is_object(self) -> bool {
        self.kind() == Kind::Object
    }
    fn is_array(self) -> bool {
        self.kind() == Kind::Array
    }
    fn is_string(self) -> bool {
        self.kind() == Kind::String
    }
    fn bool(self) -> Option<bool> {
        match self.kind() {
            Kind::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// A string with at least one character.
    fn non_empty_str(self) -> bool {
        self.str().is_some_and(|s| !s.is_empty())
    }
    /// The member `key`, unless absent or `null`.
    fn present(self, key: &str) -> Option<Self> {
        self.get(key).filter(|v| !v.is_null())
    }
}

impl<'a> View<'a> for &'a Value {
    fn kind(self) -> Kind {
        match self {
            Value::Null => Kind::Null,
            Value::Bool(b) => Kind::Bool(*b),
            Value::Number(_) => Kind::Number,
            Value::String(_) => Kind::String,
            Value::Array(_) => Kind::Array,
            Value::Object(_) => Kind::Object,
        }
    }
    fn get(self, key: &str) -> Option<Self> {
        self.as_object()?.get(key)
    }
    fn str(self) -> Option<Cow<'a, str>> {
        self.as_str().map(Cow::Borrowed)
    }
    fn u64(self) -> Option<u64> {
        self.as_u64()
    }
    fn i64(self) -> Option<i64> {
        self.as_i64()
    }
    fn items(self) -> impl Iterator<Item = Self> + 'a {
        self.as_array().into_iter().flatten()
    }
    fn members(self) -> impl Iterator<Item = (Cow<'a, str>, Self)> + 'a {
        self.as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (Cow::Borrowed(k.as_str()), v))
    }
    fn compact(self) -> String {
        self.to_string()
    }
}
