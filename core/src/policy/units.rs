//! Human-friendly quantities in the policy: rates (`10/min`, `5000 tokens/day`,
//! `5/s`, `100/30s`), durations (`30s`, `500ms`, `2m`) and sizes (`1MiB`).
//! Hand-written: three tiny grammars do not justify a parser dependency in the
//! wasm binary.

use std::fmt;

/// `amount` units every `period_ms` milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub amount: u64,
    pub period_ms: u64,
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.period_ms {
            1_000 => "s".to_string(),
            60_000 => "min".to_string(),
            3_600_000 => "hour".to_string(),
            86_400_000 => "day".to_string(),
            ms => format!("{}", Duration(ms)),
        };
        write!(f, "{}/{}", self.amount, unit)
    }
}

/// A duration in milliseconds, displayed in the largest whole unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Duration(pub u64);

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0;
        for (unit, size) in [
            ("d", 86_400_000),
            ("h", 3_600_000),
            ("m", 60_000),
            ("s", 1_000),
        ] {
            if ms >= size && ms.is_multiple_of(size) {
                return write!(f, "{}{}", ms / size, unit);
            }
        }
        write!(f, "{ms}ms")
    }
}

/// Parses `N/period` where period is a unit (`s`, `min`, `hour`, `day`, with
/// the usual spellings) or a duration (`30s`). A word between the number and
/// the slash names the unit of the bucket and must be one of `allowed_units`
/// (e.g. `5000 tokens/day`); an empty list forbids a unit word.
pub fn parse_rate(text: &str, allowed_units: &[&str]) -> Result<Rate, String> {
    let (lhs, rhs) = text
        .split_once('/')
        .ok_or_else(|| format!("`{text}` is not a rate; write it like `10/min` or `5/s`"))?;
    let mut words = lhs.split_whitespace();
    let number = words
        .next()
        .ok_or_else(|| format!("`{text}`: the rate has no amount before `/`"))?;
    let amount = parse_count(number).map_err(|e| format!("`{text}`: {e}"))?;
    if let Some(unit) = words.next() {
        if !allowed_units.contains(&unit) {
            return Err(if allowed_units.is_empty() {
                format!("`{text}`: no unit word is expected here (found `{unit}`)")
            } else {
                format!(
                    "`{text}`: unit `{unit}` is not one of {}",
                    allowed_units.join(", ")
                )
            });
        }
    }
    if let Some(extra) = words.next() {
        return Err(format!("`{text}`: unexpected `{extra}`"));
    }
    let period = rhs.trim();
    let period_ms = match period {
        "s" | "sec" | "second" => 1_000,
        "m" | "min" | "minute" => 60_000,
        "h" | "hour" => 3_600_000,
        "d" | "day" => 86_400_000,
        other => parse_duration(other).map_err(|e| format!("`{text}`: {e}"))?,
    };
    if period_ms == 0 {
        return Err(format!("`{text}`: the period must be longer than zero"));
    }
    Ok(Rate { amount, period_ms })
}

/// A share of something in thousandths: `"20%"`, `"12.5 %"` or a fraction
/// like `0.2`; above 0 and at most 100 %. `None` otherwise.
pub fn parse_permille(v: &serde_json::Value) -> Option<u32> {
    let fraction = match v {
        serde_json::Value::Number(n) => n.as_f64().filter(|f| *f <= 1.0),
        serde_json::Value::String(s) => s
            .trim()
            .strip_suffix('%')
            .and_then(|p| p.trim().parse::<f64>().ok())
            .map(|p| p / 100.0),
        _ => None,
    }?;
    let permille = (fraction * 1000.0).round();
    (fraction.is_finite() && (1.0..=1000.0).contains(&permille)).then_some(permille as u32)
}

/// Parses `500ms`, `30s`, `2m`, `1h`, `1d` (a bare number is refused: the
/// unit of a duration is never guessed).
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("`{text}` is not a duration; write it like `30s` or `500ms`"))?;
    let (number, unit) = text.split_at(split);
    let value = parse_count(number).map_err(|_| format!("`{text}` is not a duration"))?;
    let scale = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => return Err(format!("`{text}`: unknown duration unit `{other}`")),
    };
    value
        .checked_mul(scale)
        .ok_or_else(|| format!("`{text}` is too long"))
}

/// Parses a byte size: a plain number or one with `KB`, `MB`, `KiB`, `MiB`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value = parse_count(number).map_err(|_| format!("`{text}` is not a size"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        other => return Err(format!("`{text}`: unknown size unit `{other}`")),
    };
    value
        .checked_mul(scale)
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// A non-negative integer, `_` and `,` allowed as digit separators.
fn parse_count(text: &str) -> Result<u64, String> {
    let digits: String = text.chars().filter(|c| *c != '_' && *c != ',').collect();
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("`{text}` is not a whole number"));
    }
    digits.parse().map_err(|_| format!("`{text}` is too large"))
}

/// Millionths of a unit per unit.
pub const SCALE: u64 = 1_000_000;

/// The most units a bucket can count: `used` holds millionths in a u64.
pub const MAX_UNITS: u64 = u64::MAX / SCALE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_like_prose() {
        assert_eq!(
            parse_rate("10/min", &[]),
            Ok(Rate {
                amount: 10,
                period_ms: 60_000
            })
        );
        assert_eq!(
            parse_rate("5/s", &[]),
            Ok(Rate {
                amount: 5,
                period_ms: 1_000
            })
        );
        assert_eq!(
            parse_rate("5,000 tokens/day", &["tokens"]),
            Ok(Rate {
                amount: 5000,
                period_ms: 86_400_000
            })
        );
        assert_eq!(
            parse_rate("100/30s", &[]),
            Ok(Rate {
                amount: 100,
                period_ms: 30_000
            })
        );
        assert_eq!(
            parse_rate(" 300 / minute ", &[]),
            Ok(Rate {
                amount: 300,
                period_ms: 60_000
            })
        );
    }

    #[test]
    fn bad_rates_say_why() {
        assert!(parse_rate("10", &[]).unwrap_err().contains("not a rate"));
        assert!(parse_rate("ten/min", &[])
            .unwrap_err()
            .contains("whole number"));
        assert!(parse_rate("10/fortnight", &[])
            .unwrap_err()
            .contains("duration"));
        assert!(parse_rate("10 apples/min", &["tokens"])
            .unwrap_err()
            .contains("apples"));
        assert!(parse_rate("10/0s", &[])
            .unwrap_err()
            .contains("longer than zero"));
        assert!(parse_rate("-1/min", &[]).is_err());
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("30s"), Ok(30_000));
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("2m"), Ok(120_000));
        assert!(parse_duration("30").is_err());
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("2048"), Ok(2048));
        assert!(parse_size("1 parsec").is_err());
    }

    #[test]
    fn display_round_trips() {
        assert_eq!(
            Rate {
                amount: 10,
                period_ms: 60_000
            }
            .to_string(),
            "10/min"
        );
        assert_eq!(
            Rate {
                amount: 1,
                period_ms: 30_000
            }
            .to_string(),
            "1/30s"
        );
        assert_eq!(Duration(1500).to_string(), "1500ms");
    }
}
