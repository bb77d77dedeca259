//! `google.protobuf.Struct` → JSON value. Envoy hands a Struct-typed plugin
//! configuration to the plugin as protobuf bytes (docs/src/design.md, "Plugin
//! configuration"), so native YAML in the Envoy config arrives here.

use prost::Message;
use prost_types::value::Kind;
use serde_json::{Map, Number, Value};

/// Decodes protobuf `Struct` bytes; `None` when they are not a Struct.
pub fn decode(bytes: &[u8]) -> Option<Value> {
    let decoded = prost_types::Struct::decode(bytes).ok()?;
    Some(struct_to_json(decoded))
}

fn struct_to_json(s: prost_types::Struct) -> Value {
    Value::Object(
        s.fields
            .into_iter()
            .map(|(k, v)| (k, value_to_json(v)))
            .collect::<Map<_, _>>(),
    )
}

fn value_to_json(v: prost_types::Value) -> Value {
    match v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::NumberValue(n)) => number(n),
        Some(Kind::StructValue(s)) => struct_to_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.into_iter().map(value_to_json).collect()),
    }
}

/// Struct numbers are all doubles; whole ones become integers so that
/// integer fields (`burst: 15`) deserialize.
fn number(n: f64) -> Value {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if n.fract() == 0.0 && n.abs() <= EXACT {
        if n >= 0.0 {
            return Value::Number(Number::from(n as u64));
        }
        return Value::Number(Number::from(n as i64));
    }
    Number::from_f64(n).map_or(Value::Null, Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_types::{ListValue, Struct, Value as PValue};
    use std::collections::BTreeMap;

    fn pv(kind: Kind) -> PValue {
        PValue { kind: Some(kind) }
    }

    #[test]
    fn struct_bytes_become_json_with_integers() {
        let mut inner = BTreeMap::new();
        inner.insert("burst".to_string(), pv(Kind::NumberValue(15.0)));
        inner.insert("ratio".to_string(), pv(Kind::NumberValue(0.5)));
        let mut fields = BTreeMap::new();
        fields.insert(
            "limit".to_string(),
            pv(Kind::StructValue(Struct { fields: inner })),
        );
        fields.insert(
            "list".to_string(),
            pv(Kind::ListValue(ListValue {
                values: vec![pv(Kind::StringValue("a".into())), pv(Kind::BoolValue(true))],
            })),
        );
        let bytes = Struct { fields }.encode_to_vec();
        let json = decode(&bytes).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"limit": {"burst": 15, "ratio": 0.5}, "list": ["a", true]})
        );
    }
}
