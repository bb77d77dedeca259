//! How a limit is written: a token bucket ([`Limit`], `10/min`) or a
//! calendar budget ([`Budget`], `5000`), in any section.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use crate::policy::units::{parse_rate, Rate, MAX_UNITS};
use crate::policy::zone::Zone;

/// A token bucket: refills at `rate`, holds at most `burst` (default: the
/// rate's amount). Written `10/min` or `{rate: 10/min, burst: 15}`. With a
/// `window`, a fixed window instead: `burst` units per calendar window,
/// all back at the window's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub rate: Rate,
    pub burst: u64,
    pub window: Option<Window>,
}

/// Calendar windows, in the policy's `budgets.reset_timezone` (UTC by
/// default): each carries its zone, so a bucket's window is self-contained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Day(Zone),
    Month(Zone),
}

impl Limit {
    pub fn capacity(&self) -> u64 {
        self.burst
    }

    /// A fixed window of `amount` per `window`.
    pub fn windowed(amount: u64, window: Window) -> Limit {
        let period_ms = match window {
            Window::Day(_) => 86_400_000,
            Window::Month(_) => 30 * 86_400_000,
        };
        Limit {
            rate: Rate { amount, period_ms },
            burst: amount,
            window: Some(window),
        }
    }

    /// As written in a policy: `10/min`, `5000 per day (UTC)`.
    pub fn describe(&self) -> String {
        match self.window {
            // A run's budget (`crate::limits::run_table::run_limit`): no refill.
            None if self.rate.period_ms == u64::MAX => format!("{} per run", self.burst),
            None => self.rate.to_string(),
            Some(Window::Day(z)) => format!("{} per day ({})", self.burst, z.name()),
            Some(Window::Month(z)) => format!("{} per month ({})", self.burst, z.name()),
        }
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BudgetVisitor;

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct BudgetFields {
            limit: serde_json::Value,
            #[serde(default)]
            mode: Mode,
            alert_at: Option<serde_json::Value>,
            refuse_with: Option<u16>,
        }

        impl<'de> Visitor<'de> for BudgetVisitor {
            type Value = Budget;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "an amount like `5000` or a map `{limit: 5000, mode: soft, alert_at: 80%}`",
                )
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Budget, E> {
                self.visit_f64(v as f64)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Budget, E> {
                self.visit_f64(v as f64)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Budget, E> {
                let limit = budget_amount(&serde_json::json!(v))?;
                Ok(Budget {
                    limit,
                    mode: Mode::Hard,
                    alert_at_permille: None,
                    refuse_with: REFUSE_WITH_DEFAULT,
                })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Budget, E> {
                let limit = budget_amount(&serde_json::Value::String(v.into()))?;
                Ok(Budget {
                    limit,
                    mode: Mode::Hard,
                    alert_at_permille: None,
                    refuse_with: REFUSE_WITH_DEFAULT,
                })
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Budget, A::Error> {
                let full = BudgetFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Budget {
                    limit: budget_amount(&full.limit)?,
                    mode: full.mode,
                    alert_at_permille: full.alert_at.as_ref().map(alert_permille).transpose()?,
                    refuse_with: refuse_status(full.refuse_with, full.mode)?,
                })
            }
        }

        deserializer.deserialize_any(BudgetVisitor)
    }
}

/// A budget's limit: `5000`, `"5,000 tokens"`, `12.50`; above zero.
fn budget_amount<E: de::Error>(v: &serde_json::Value) -> Result<f64, E> {
    match v {
        serde_json::Value::Number(n) => n.as_f64().ok_or_else(|| E::custom("not a number")),
        serde_json::Value::String(s) => {
            let cleaned: String = s
                .trim()
                .trim_end_matches("tokens")
                .trim_end_matches("token")
                .chars()
                .filter(|c| *c != ',' && *c != '_')
                .collect();
            cleaned
                .trim()
                .parse::<f64>()
                .map_err(|_| E::custom(format!("`{s}` is not an amount")))
        }
        _ => Err(E::custom("expected an amount like `5000` or `12.50`")),
    }
    .and_then(|a| {
        if a.is_finite() && a > 0.0 {
            Ok(a)
        } else {
            Err(E::custom("the limit must be greater than zero"))
        }
    })
}

/// A spent hard budget's status unless the policy says otherwise.
pub const REFUSE_WITH_DEFAULT: u16 = 429;

/// `refuse_with`: 429 (retry later), 402 or 403 (do not retry: the
/// answer carries `x-should-retry: false`). Only a hard budget refuses.
fn refuse_status<E: de::Error>(status: Option<u16>, mode: Mode) -> Result<u16, E> {
    match (status, mode) {
        (None, _) => Ok(REFUSE_WITH_DEFAULT),
        (Some(402 | 403 | 429), Mode::Hard) => Ok(status.unwrap_or(REFUSE_WITH_DEFAULT)),
        (Some(_), Mode::Soft) => Err(E::custom(
            "refuse_with: a soft budget never refuses (it downshifts); remove refuse_with or make the budget hard",
        )),
        (Some(other), Mode::Hard) => Err(E::custom(format!(
            "refuse_with: {other} is not one of 429 (retry later), 402 or 403 (do not retry)"
        ))),
    }
}

/// `alert_at`: `80%`, `0.8`, or a bare `80`.
fn alert_permille<E: de::Error>(v: &serde_json::Value) -> Result<u32, E> {
    // A bare number above 1 is read as a percentage (`alert_at: 80`).
    let v = match v.as_f64() {
        Some(f) if f > 1.0 => serde_json::json!(f / 100.0),
        _ => v.clone(),
    };
    crate::policy::units::parse_permille(&v)
        .ok_or_else(|| E::custom("alert_at must be a percentage like `80%` (or 0.8)"))
}

/// Unit words a rate may name (`5000 tokens/min`).
const UNITS: &[&str] = &["requests", "request", "tokens", "token"];

/// The longest period of a token bucket: longer ones are calendar budgets
/// (`daily_tokens`, `monthly_tokens`).
pub const MAX_PERIOD_MS: u64 = 366 * 86_400_000;

/// A token bucket's rate: what the bucket math can divide by and count.
/// `0/min` would be a bucket that never refills (and once trapped the VM
/// dividing by it); an amount beyond [`MAX_UNITS`] cannot be counted.
fn bucket_rate(text: &str) -> Result<Rate, String> {
    let rate = parse_rate(text, UNITS)?;
    if rate.amount == 0 {
        return Err(format!(
            "`{text}`: the amount must be at least 1 (a rate of zero admits nothing; \
             remove the model or tier instead)"
        ));
    }
    if rate.amount > MAX_UNITS {
        return Err(format!(
            "`{text}`: the amount is too large (at most {MAX_UNITS})"
        ));
    }
    if rate.period_ms > MAX_PERIOD_MS {
        return Err(format!(
            "`{text}`: the period is longer than 366 days; use daily_tokens or monthly_tokens for calendar budgets"
        ));
    }
    Ok(rate)
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LimitVisitor;

        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct LimitFields {
            rate: String,
            burst: Option<u64>,
        }

        impl<'de> Visitor<'de> for LimitVisitor {
            type Value = Limit;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a rate like `10/min` or a map `{rate: 10/min, burst: 15}`")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Limit, E> {
                let rate = bucket_rate(text).map_err(E::custom)?;
                Ok(Limit {
                    rate,
                    burst: rate.amount,
                    window: None,
                })
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Limit, A::Error> {
                let full = LimitFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let rate = bucket_rate(&full.rate).map_err(de::Error::custom)?;
                let burst = full.burst.unwrap_or(rate.amount);
                if burst == 0 {
                    return Err(de::Error::custom("burst must be at least 1"));
                }
                if burst > MAX_UNITS {
                    return Err(de::Error::custom(format!(
                        "burst {burst} is too large (at most {MAX_UNITS})"
                    )));
                }
                Ok(Limit {
                    rate,
                    burst,
                    window: None,
                })
            }
        }

        deserializer.deserialize_any(LimitVisitor)
    }
}

/// Hard caps refuse (429); soft caps let the request go on, downshifted to
/// the model's cheaper model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Hard,
    Soft,
}

/// A fixed-window budget: `5000`, `"5,000 tokens"`, or
/// `{limit: 50000, mode: soft, alert_at: 80%}`. For spend, `limit` is in
/// currency (`12.50`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub limit: f64,
    pub mode: Mode,
    /// Alert when use crosses this fraction, in thousandths.
    pub alert_at_permille: Option<u32>,
    /// The status a refusal by this budget answers (`refuse_with`: 429,
    /// or 402/403 that tell clients not to retry).
    pub refuse_with: u16,
}

/// `refuse_with` is a caller's budget's: a provider's budget skips its rung
/// and the hourly ceiling answers 503, neither refuses with a budget's
/// status, so writing it there is refused rather than ignored.
pub(crate) fn check(p: &crate::policy::Policy) -> Result<(), crate::policy::ConfigError> {
    let providers = p.providers.iter().flat_map(|(name, provider)| {
        [
            (
                format!("providers.{name}.daily_spend"),
                provider.daily_spend,
            ),
            (
                format!("providers.{name}.monthly_spend"),
                provider.monthly_spend,
            ),
        ]
    });
    let ceiling = p.anomaly.as_ref().map(|a| {
        (
            "anomaly.max_spend_per_hour".to_string(),
            a.max_spend_per_hour,
        )
    });
    for (path, budget) in providers.chain(ceiling) {
        if budget.is_some_and(|b| b.refuse_with != REFUSE_WITH_DEFAULT) {
            return Err(crate::policy::ConfigError::at(
                format!("{path}.refuse_with"),
                "only a tier's, team's or org's budget refuses callers with its own status",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod refuse_with_tests {
    use crate::policy::Policy;
    use serde_json::{json, Value};

    fn with_tier(budget: Value) -> Result<Policy, crate::policy::ConfigError> {
        Policy::from_value(json!({
            "default_tier": "t",
            "tiers": {"t": {"requests": "10/min", "daily_tokens": budget}},
        }))
    }

    #[test]
    fn refuse_with_is_429_by_default_402_or_403_when_written_and_checked() {
        let status = |p: Policy| p.tiers["t"].daily_tokens.map(|b| b.refuse_with);
        assert_eq!(status(with_tier(json!(5000)).unwrap()), Some(429));
        for s in [402, 403, 429] {
            let p = with_tier(json!({"limit": 5000, "refuse_with": s})).unwrap();
            assert_eq!(status(p), Some(s));
        }
        let err = with_tier(json!({"limit": 5000, "refuse_with": 418})).unwrap_err();
        assert_eq!(err.path, "tiers.t.daily_tokens", "{err}");
        assert!(err.message.contains("418"), "{err}");
        let soft = json!({"limit": 5000, "mode": "soft", "refuse_with": 402});
        let err = with_tier(soft).unwrap_err();
        assert!(err.message.contains("soft budget never refuses"), "{err}");
        let err = Policy::from_value(json!({
            "default_tier": "t",
            "tiers": {"t": {}},
            "anomaly": {"max_spend_per_hour": {"limit": 5, "refuse_with": 402}},
        }))
        .unwrap_err();
        assert_eq!(err.path, "anomaly.max_spend_per_hour.refuse_with", "{err}");
    }
}
