//! Prices as providers bill them: per 1M tokens, exact, with the parts a
//! provider prices apart (cached input, cache writes, reasoning) and
//! context-length tiers, written natively or in LiteLLM's
//! `model_prices_and_context_window.json` format.
//!
//! Exactness: a price is kept as an integer of nano-units per 1M tokens,
//! parsed from its decimal text (a number Envoy hands over as a protobuf
//! double is first written back as the shortest decimal that reads as the
//! same double, which is the decimal the operator wrote for any price of
//! 15 significant digits or fewer). A price finer than a nano-unit per 1M
//! tokens is refused, not rounded. A request's cost is summed exactly in
//! 128 bits and rounded up once, to a micro-unit.
//!
//! What a count means: the usage reader (`usage/reconcile.rs`) already
//! brings every API to one convention — `input` is the whole prompt
//! (Anthropic's `input_tokens` excludes cache reads and writes, so the
//! reader adds them; OpenAI's `prompt_tokens` includes its
//! `cached_tokens`), and cached input, cache writes and reasoning are parts
//! of their totals. [`ModelPrice::cost_micros`] prices each part at its own
//! rate and the rest of each total at the plain rate, so no token is
//! charged twice whichever provider answered.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// The finest price: 10⁻⁹ of a currency unit per 1M tokens.
const NANOS: u32 = 9;

/// A price per 1M tokens, in nano-units of the currency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct PerMillion(pub u64);

impl PerMillion {
    /// Parses a decimal price per 1M tokens (`"2.50"`, `2.5`, `"1.5e-1"`).
    pub fn parse(text: &str) -> Result<PerMillion, String> {
        scaled(text, NANOS as i32).map(PerMillion)
    }

    /// A price per token (LiteLLM's unit): 10⁶ times more per 1M tokens.
    pub fn per_token(text: &str) -> Result<PerMillion, String> {
        scaled(text, NANOS as i32 + 6).map(PerMillion)
    }

    /// From a JSON value: a string (exact) or a number (its shortest
    /// decimal form), per 1M tokens, per token (LiteLLM) or per 1,000
    /// tokens (the policy's older `input_per_1k`).
    fn from_value(v: &Value, unit: Unit) -> Result<PerMillion, String> {
        let text = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => match (n.as_u64(), n.as_f64()) {
                (Some(u), _) => u.to_string(),
                (None, Some(f)) if f.is_finite() => format!("{f}"),
                _ => return Err(format!("`{n}` is not a price")),
            },
            other => return Err(format!("`{other}` is not a price")),
        };
        let shift = match unit {
            Unit::Million => 0,
            Unit::Thousand => 3,
            Unit::Token => 6,
        };
        scaled(&text, NANOS as i32 + shift).map(PerMillion)
    }
}

/// The token count a price is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Million,
    Thousand,
    Token,
}

/// `text` × 10^`shift`, which must be a whole non-negative number that
/// fits in 64 bits.
fn scaled(text: &str, shift: i32) -> Result<u64, String> {
    let bad = |why: &str| format!("`{text}` {why}");
    let t = text.trim();
    let (mantissa, exponent) = match t.find(['e', 'E']) {
        Some(i) => (
            &t[..i],
            t[i + 1..]
                .parse::<i32>()
                .map_err(|_| bad("has a bad exponent"))?,
        ),
        None => (t, 0),
    };
    let mantissa = mantissa.strip_prefix('+').unwrap_or(mantissa);
    if mantissa.starts_with('-') {
        return Err(bad("is negative"));
    }
    let (whole, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() && frac.is_empty()
        || !whole
            .bytes()
            .chain(frac.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return Err(bad("is not a decimal number"));
    }
    let digits = format!("{whole}{frac}");
    let digits = digits.trim_start_matches('0');
    // The value is digits × 10^(exponent − frac.len()); scaled, × 10^shift.
    let mut power = exponent
        .saturating_sub(frac.len() as i32)
        .saturating_add(shift);
    let mut digits = digits.to_string();
    while power < 0 {
        match digits.pop() {
            None => return Ok(0),
            Some('0') => power += 1,
            Some(_) => {
                return Err(bad(
                    "is finer than a nano-unit per 1M tokens (10⁻¹⁵ per token)",
                ))
            }
        }
    }
    if digits.is_empty() {
        return Ok(0);
    }
    let mut value: u64 = digits.parse().map_err(|_| bad("is too large"))?;
    for _ in 0..power {
        value = value.checked_mul(10).ok_or_else(|| bad("is too large"))?;
    }
    Ok(value)
}

/// The rates of one tier: plain input and output, and the parts a
/// provider prices apart (each defaults to the rate of its total).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rates {
    pub input: PerMillion,
    pub output: PerMillion,
    /// Input read from the provider's prompt cache.
    pub cached_input: Option<PerMillion>,
    /// Input written to the provider's prompt cache.
    pub cache_write: Option<PerMillion>,
    /// Output spent reasoning.
    pub reasoning: Option<PerMillion>,
}

/// The most context-length tiers one price may have.
pub const MAX_TIERS: usize = 4;

/// What one model costs at one provider. `Copy`, so a request's plan
/// carries its own price from admission to settlement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelPrice {
    pub base: Rates,
    /// Context-length tiers: a request whose input is above a tier's
    /// token count is priced at the tier's rates for all its tokens (how
    /// Anthropic and Google bill long prompts, and how LiteLLM's
    /// `*_above_200k_tokens` fields are meant), ascending; unused at the end.
    pub tiers: [Option<(u64, Rates)>; MAX_TIERS],
}

/// The counts of one request, each part a share of its total (as the
/// usage reader gives them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Billed {
    pub input: u64,
    pub output: u64,
    pub cached_input: u64,
    pub cache_write_input: u64,
    pub reasoning_output: u64,
}

impl ModelPrice {
    /// One rate for every token (a GPU's virtual cost, a price per 1,000
    /// tokens written as micro-units).
    pub fn flat(micros_per_1k: u64) -> ModelPrice {
        let rate = PerMillion(micros_per_1k.saturating_mul(1_000_000));
        ModelPrice {
            base: Rates {
                input: rate,
                output: rate,
                ..Rates::default()
            },
            tiers: [None; MAX_TIERS],
        }
    }

    /// The rates a request of `input` tokens is billed at.
    pub fn rates(&self, input: u64) -> Rates {
        self.tiers
            .iter()
            .flatten()
            .rev()
            .find(|(above, _)| input > *above)
            .map_or(self.base, |(_, r)| *r)
    }

    /// The cost of these totals with no part priced apart.
    pub fn plain_micros(&self, input: u64, output: u64) -> u64 {
        self.cost_micros(Billed {
            input,
            output,
            ..Billed::default()
        })
    }

    /// The most a request of these totals may cost, whatever its parts
    /// turn out to be: what is reserved before the answer says.
    pub fn bound_micros(&self, input: u64, output: u64) -> u64 {
        let r = self.rates(input);
        let input_rate = [r.cached_input, r.cache_write]
            .into_iter()
            .flatten()
            .fold(r.input, PerMillion::max);
        let output_rate = r.reasoning.map_or(r.output, |x| x.max(r.output));
        let bound = Rates {
            input: input_rate,
            output: output_rate,
            ..Rates::default()
        };
        ModelPrice {
            base: bound,
            tiers: [None; MAX_TIERS],
        }
        .cost_micros(Billed {
            input,
            output,
            ..Billed::default()
        })
    }

    /// The cost of a request in micro-units, rounded up once.
    pub fn cost_micros(&self, b: Billed) -> u64 {
        let r = self.rates(b.input);
        // Parts bounded by their totals, so a provider that reports more
        // cached input than input cannot make a part larger than its whole.
        let cached = b.cached_input.min(b.input);
        let written = b.cache_write_input.min(b.input - cached);
        let reasoning = b.reasoning_output.min(b.output);
        let line = |n: u64, rate: PerMillion| n as u128 * rate.0 as u128;
        let nanos_per_million = line(b.input - cached - written, r.input)
            + line(cached, r.cached_input.unwrap_or(r.input))
            + line(written, r.cache_write.unwrap_or(r.input))
            + line(b.output - reasoning, r.output)
            + line(reasoning, r.reasoning.unwrap_or(r.output));
        // nano-units per 1M tokens × tokens → micro-units: ÷ 10⁶ ÷ 10³.
        nanos_per_million
            .div_ceil(1_000_000_000)
            .min(u64::MAX as u128) as u64
    }
}

/// A price as the policy writes it (per 1M tokens).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NativeRates {
    input: Value,
    output: Value,
    cached_input: Option<Value>,
    cache_write: Option<Value>,
    reasoning: Option<Value>,
}

/// A price with its tiers (serde's `flatten` cannot deny unknown fields,
/// so the rates are written out again here).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NativePrice {
    input: Value,
    output: Value,
    cached_input: Option<Value>,
    cache_write: Option<Value>,
    reasoning: Option<Value>,
    /// Input tokens above which a tier's rates apply: `{200000: {...}}`.
    #[serde(default)]
    above: BTreeMap<String, NativeRates>,
}

fn native_rates(r: &NativeRates, at: &str) -> Result<Rates, (String, String)> {
    let one = |v: &Value, field: &str| {
        PerMillion::from_value(v, Unit::Million).map_err(|e| (format!("{at}.{field}"), e))
    };
    let opt = |v: &Option<Value>, field: &str| v.as_ref().map(|v| one(v, field)).transpose();
    Ok(Rates {
        input: one(&r.input, "input")?,
        output: one(&r.output, "output")?,
        cached_input: opt(&r.cached_input, "cached_input")?,
        cache_write: opt(&r.cache_write, "cache_write")?,
        reasoning: opt(&r.reasoning, "reasoning")?,
    })
}

/// Parses a native price (`{input: "2.50", output: "10", cached_input: …,
/// above: {200000: {…}}}`); an error names the field under `at`.
pub fn native(v: &Value, at: &str) -> Result<ModelPrice, (String, String)> {
    let p: NativePrice =
        serde_json::from_value(v.clone()).map_err(|e| (at.to_string(), e.to_string()))?;
    let base = native_rates(
        &NativeRates {
            input: p.input,
            output: p.output,
            cached_input: p.cached_input,
            cache_write: p.cache_write,
            reasoning: p.reasoning,
        },
        at,
    )?;
    let mut tiers = Vec::new();
    for (above, rates) in &p.above {
        let at = format!("{at}.above.{above}");
        let n: u64 = above
            .parse()
            .map_err(|_| (at.clone(), "must be a whole number of input tokens".into()))?;
        tiers.push((n, native_rates(rates, &at)?));
    }
    with_tiers(base, tiers, &format!("{at}.above"))
}

/// A price with its tiers in ascending order, at most [`MAX_TIERS`].
fn with_tiers(
    base: Rates,
    mut tiers: Vec<(u64, Rates)>,
    at: &str,
) -> Result<ModelPrice, (String, String)> {
    if tiers.len() > MAX_TIERS {
        return Err((
            at.into(),
            format!("at most {MAX_TIERS} context-length tiers"),
        ));
    }
    tiers.sort_by_key(|(n, _)| *n);
    let mut array = [None; MAX_TIERS];
    for (slot, tier) in array.iter_mut().zip(tiers) {
        *slot = Some(tier);
    }
    Ok(ModelPrice { base, tiers: array })
}

/// A model's `price` as the policy writes it: per 1M tokens
/// (`{input: "2.50", output: "10", cached_input: …, above: {…}}`), or the
/// older per-1,000 form `{input_per_1k: 0.5, output_per_1k: 1.5}`.
pub fn written(v: &Value, at: &str) -> Result<ModelPrice, (String, String)> {
    let Some(map) = v.as_object() else {
        return Err((at.into(), "must be a map of prices".into()));
    };
    if !map.keys().any(|k| k.ends_with("_per_1k")) {
        return native(v, at);
    }
    let mut base = Rates::default();
    for (key, value) in map {
        let slot =
            match key.as_str() {
                "input_per_1k" => &mut base.input,
                "output_per_1k" => &mut base.output,
                other => return Err((
                    format!("{at}.{other}"),
                    "unknown field: a per-1,000 price has `input_per_1k` and `output_per_1k` only"
                        .into(),
                )),
            };
        *slot = PerMillion::from_value(value, Unit::Thousand)
            .map_err(|e| (format!("{at}.{key}"), e))?;
    }
    for field in ["input_per_1k", "output_per_1k"] {
        if !map.contains_key(field) {
            return Err((format!("{at}.{field}"), "missing".into()));
        }
    }
    Ok(ModelPrice {
        base,
        tiers: [None; MAX_TIERS],
    })
}

/// LiteLLM's names for each rate (per token), base and tiered
/// (`<name>_above_<N>k_tokens`), from its `sample_spec` and entries of
/// `model_prices_and_context_window.json` (github.com/BerriAI/litellm).
const LITELLM_RATES: [(&str, Part); 5] = [
    ("input_cost_per_token", Part::Input),
    ("output_cost_per_token", Part::Output),
    ("cache_read_input_token_cost", Part::CachedInput),
    ("cache_creation_input_token_cost", Part::CacheWrite),
    ("output_cost_per_reasoning_token", Part::Reasoning),
];

#[derive(Debug, Clone, Copy)]
enum Part {
    Input,
    Output,
    CachedInput,
    CacheWrite,
    Reasoning,
}

fn set(rates: &mut Rates, part: Part, price: PerMillion) {
    match part {
        Part::Input => rates.input = price,
        Part::Output => rates.output = price,
        Part::CachedInput => rates.cached_input = Some(price),
        Part::CacheWrite => rates.cache_write = Some(price),
        Part::Reasoning => rates.reasoning = Some(price),
    }
}

/// Reads one model's entry of a LiteLLM price file. Fields sluice does not
/// price (images, audio, search, capabilities) are ignored; an entry
/// without both token prices is refused (it is not a chat or completion
/// model's price). A tier's unwritten rates are the base ones.
pub fn litellm(entry: &Value, at: &str) -> Result<ModelPrice, (String, String)> {
    let Some(map) = entry.as_object() else {
        return Err((
            at.into(),
            "must be an object (a LiteLLM model entry)".into(),
        ));
    };
    let mut base = Rates::default();
    let mut tiered: BTreeMap<u64, Vec<(Part, PerMillion)>> = BTreeMap::new();
    for (key, value) in map {
        for (name, part) in LITELLM_RATES {
            let Some(rest) = key.strip_prefix(name) else {
                continue;
            };
            let price = |v: &Value| {
                PerMillion::from_value(v, Unit::Token).map_err(|e| (format!("{at}.{key}"), e))
            };
            if rest.is_empty() {
                set(&mut base, part, price(value)?);
            } else if let Some(k) = rest
                .strip_prefix("_above_")
                .and_then(|r| r.strip_suffix("k_tokens"))
                .and_then(|k| k.parse::<u64>().ok())
            {
                tiered
                    .entry(k.saturating_mul(1000))
                    .or_default()
                    .push((part, price(value)?));
            }
        }
    }
    for field in ["input_cost_per_token", "output_cost_per_token"] {
        if !map.contains_key(field) {
            return Err((
                format!("{at}.{field}"),
                "missing: a token price is needed".into(),
            ));
        }
    }
    let tiers: Vec<(u64, Rates)> = tiered
        .into_iter()
        .map(|(above, parts)| {
            let mut rates = base;
            parts
                .into_iter()
                .for_each(|(part, p)| set(&mut rates, part, p));
            (above, rates)
        })
        .collect();
    with_tiers(base, tiers, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pm(s: &str) -> u64 {
        PerMillion::parse(s).unwrap().0
    }

    #[test]
    fn decimals_are_exact_in_nano_units() {
        assert_eq!(pm("2.50"), 2_500_000_000);
        assert_eq!(pm("0.075"), 75_000_000);
        assert_eq!(pm("15"), 15_000_000_000);
        assert_eq!(pm("1.5e1"), 15_000_000_000);
        assert_eq!(pm("0"), 0);
        assert_eq!(pm("0.000000001"), 1);
        assert_eq!(pm("0.0000000010"), 1, "trailing zeros are not precision");
        // Per token, as LiteLLM writes: 5.46875e-07 is 0.546875 per 1M.
        assert_eq!(PerMillion::per_token("5.46875e-07").unwrap().0, 546_875_000);
        assert_eq!(PerMillion::per_token("2.5e-06").unwrap().0, 2_500_000_000);
    }

    #[test]
    fn prices_that_are_not_exact_or_not_prices_are_refused() {
        for bad in [
            "-1",
            "abc",
            "",
            ".",
            "1e",
            "0.0000000001",
            "1e30",
            "1.2.3",
            "1,5",
        ] {
            assert!(PerMillion::parse(bad).is_err(), "{bad}");
        }
        assert!(PerMillion::per_token("1e-16").is_err());
    }

    #[test]
    fn a_double_reads_back_as_the_decimal_written() {
        // Envoy hands YAML numbers over as protobuf doubles.
        for (f, nanos) in [(0.15, 150_000_000), (2.5e-6, 2_500), (0.1 + 0.2, 0)] {
            let got = PerMillion::from_value(&json!(f), Unit::Million);
            if nanos == 0 {
                // 0.30000000000000004 has 17 digits: finer than a nano-unit.
                assert!(got.is_err());
            } else {
                assert_eq!(got.unwrap().0, nanos);
            }
        }
    }

    #[test]
    fn each_part_is_priced_at_its_own_rate_and_never_twice() {
        let p = native(
            &json!({"input": "2.50", "output": "10", "cached_input": "1.25",
                    "cache_write": "3.125", "reasoning": "20"}),
            "p",
        )
        .unwrap();
        // 1M input of which 400k cached and 100k written, 1M output of
        // which 250k reasoning:
        // 500k × 2.5 + 400k × 1.25 + 100k × 3.125 + 750k × 10 + 250k × 20
        // = 1.25 + 0.5 + 0.3125 + 7.5 + 5 = 14.5625 units.
        let b = Billed {
            input: 1_000_000,
            output: 1_000_000,
            cached_input: 400_000,
            cache_write_input: 100_000,
            reasoning_output: 250_000,
        };
        assert_eq!(p.cost_micros(b), 14_562_500);
        // Parts above their totals are bounded by them.
        let over = Billed {
            input: 10,
            output: 0,
            cached_input: 50,
            ..Billed::default()
        };
        assert_eq!(p.cost_micros(over), 13, "10 × 1.25 per 1M, rounded up");
    }

    #[test]
    fn one_token_costs_its_rate_rounded_up_once() {
        let p = native(&json!({"input": "0.15", "output": "0.60"}), "p").unwrap();
        let one = |input, output| {
            p.cost_micros(Billed {
                input,
                output,
                ..Billed::default()
            })
        };
        assert_eq!(one(1, 0), 1, "0.15 micro rounds up to 1");
        assert_eq!(one(100, 100), 75, "15 + 60 micro, exact");
        assert_eq!(one(0, 0), 0);
    }

    #[test]
    fn a_long_prompt_is_priced_at_its_tier_for_every_token() {
        let p = native(
            &json!({"input": "3", "output": "15",
                    "above": {"200000": {"input": "6", "output": "22.5"}}}),
            "p",
        )
        .unwrap();
        let cost = |input| {
            p.cost_micros(Billed {
                input,
                output: 1000,
                ..Billed::default()
            })
        };
        assert_eq!(cost(200_000), 600_000 + 15_000);
        assert_eq!(cost(200_001), 1_200_006 + 22_500);
    }

    #[test]
    fn native_errors_name_the_field() {
        let e = native(
            &json!({"input": "2", "output": "-1"}),
            "providers.a.prices.m",
        )
        .unwrap_err();
        assert_eq!(e.0, "providers.a.prices.m.output");
        let e = native(&json!({"input": "2", "output": "1", "inptu": 1}), "x").unwrap_err();
        assert!(e.1.contains("inptu"), "{e:?}");
        let e = native(
            &json!({"input": "2", "output": "1", "above": {"big": {"input": 1, "output": 1}}}),
            "x",
        )
        .unwrap_err();
        assert_eq!(e.0, "x.above.big");
    }

    #[test]
    fn a_litellm_entry_reads_as_the_same_price() {
        // An entry in LiteLLM's format, with fields sluice does not price.
        let entry = json!({
            "input_cost_per_token": 3e-06,
            "output_cost_per_token": 1.5e-05,
            "cache_creation_input_token_cost": 3.75e-06,
            "cache_read_input_token_cost": 3e-07,
            "input_cost_per_token_above_200k_tokens": 6e-06,
            "output_cost_per_token_above_200k_tokens": 2.25e-05,
            "litellm_provider": "anthropic",
            "max_input_tokens": 1000000,
            "mode": "chat",
            "supports_prompt_caching": true
        });
        let from_litellm = litellm(&entry, "x").unwrap();
        let written = native(
            &json!({"input": "3", "output": "15", "cache_write": "3.75", "cached_input": "0.3",
                    "above": {"200000": {"input": "6", "output": "22.5",
                                         "cache_write": "3.75", "cached_input": "0.3"}}}),
            "x",
        )
        .unwrap();
        assert_eq!(from_litellm, written);
    }

    #[test]
    fn a_litellm_entry_without_token_prices_is_refused() {
        let image = json!({"litellm_provider": "openai", "mode": "image_generation",
                           "output_cost_per_image": 0.04});
        let e = litellm(&image, "providers.p.prices_litellm.dall-e").unwrap_err();
        assert_eq!(
            e.0,
            "providers.p.prices_litellm.dall-e.input_cost_per_token"
        );
        assert!(litellm(&json!([1]), "x").is_err());
        let e = litellm(
            &json!({"input_cost_per_token": "x", "output_cost_per_token": 1e-6}),
            "m",
        )
        .unwrap_err();
        assert_eq!(e.0, "m.input_cost_per_token");
    }
}
