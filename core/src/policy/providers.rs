//! `providers` and `ladder`: the other upstreams a request may be served
//! by when the primary cannot serve it, each with its own model names and
//! prices, tried in the ladder's order (the static answer last).
//!
//! A provider is reached the way the older `fallback` section is: sluice
//! sets `x-sluice-upstream: <route>` (the header of `fallback.header`, or
//! that name by default) and refreshes the route, so the Envoy route
//! matching that value picks the provider's cluster and injects its
//! credentials. The client's own credentials never go to a provider: sluice
//! removes them from a request it sends to a rung (and the shipped routes
//! remove them too).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::policy::limit::Budget;
use crate::policy::prices::{self, ModelPrice};
use crate::policy::{ConfigError, Policy};

/// An API family a provider speaks: the shape of the request, the answer,
/// the stream and the usage it reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Speaks {
    /// `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
    /// `/v1/responses`.
    Openai,
    /// `/v1/messages`.
    Anthropic,
    /// Ollama's native `/api/chat`, `/api/generate`, `/api/embed`.
    Ollama,
}

/// The one output-limit field a provider reads (`limit_field`), for the
/// APIs whose servers read several: OpenAI's reasoning models refuse
/// `max_tokens` and a body that sets both fields, so a rung that is OpenAI
/// itself is sent only `max_completion_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderLimit {
    MaxTokens,
    MaxCompletionTokens,
}

fn default_speaks() -> Vec<Speaks> {
    vec![Speaks::Openai]
}

/// One provider.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// The value of the routing header that Envoy's route for this
    /// provider matches; default: the provider's name.
    pub route: Option<String>,
    /// The API families it serves; default: `[openai]`.
    #[serde(default = "default_speaks")]
    pub speaks: Vec<Speaks>,
    /// Requested model → the provider's model. A model neither listed
    /// nor covered by `default_model` skips this provider.
    #[serde(default)]
    pub models: BTreeMap<String, String>,
    /// The provider's model for any requested model not in `models`.
    pub default_model: Option<String>,
    /// On chat, the one limit field the provider is sent (the reserved
    /// value, any other limit field removed); default: every field chat
    /// servers read.
    pub limit_field: Option<ProviderLimit>,
    /// Prices per provider model (per 1M tokens, as `models.<m>.price`).
    #[serde(default)]
    pub prices: BTreeMap<String, Value>,
    /// A LiteLLM `model_prices_and_context_window.json` (its map of model
    /// entries, or the part of it that holds this provider's models): the
    /// entry of each provider model not priced in `prices`.
    #[serde(default)]
    pub prices_litellm: BTreeMap<String, Value>,
    /// What the provider may cost per day and per month, all requests it
    /// serves together (`alert_at`, `mode` as any budget). A request it
    /// cannot hold skips it for the next rung.
    pub daily_spend: Option<Budget>,
    pub monthly_spend: Option<Budget>,
    /// `prices` and `prices_litellm`, read at load: a price per provider
    /// model this provider may be sent.
    #[serde(skip)]
    pub priced: BTreeMap<String, ModelPrice>,
}

impl ProviderConfig {
    /// The provider's model for `requested`, if it serves it.
    pub fn model_for(&self, requested: Option<&str>) -> Option<&str> {
        requested
            .and_then(|m| self.models.get(m))
            .or(self.default_model.as_ref())
            .map(String::as_str)
    }

    /// Every provider model this provider may be sent.
    fn targets(&self) -> impl Iterator<Item = &String> {
        self.models.values().chain(self.default_model.iter())
    }
}

/// Reads each provider's prices: every model it may be sent needs one
/// (else nothing would bound what it costs), from `prices` or from the
/// LiteLLM entries; an error names the field.
pub(crate) fn read_prices(p: &mut Policy) -> Result<(), ConfigError> {
    for (name, provider) in p.providers.iter_mut() {
        let at = format!("providers.{name}");
        let err = |(path, message): (String, String)| ConfigError { path, message };
        let mut priced = BTreeMap::new();
        for (model, v) in &provider.prices {
            let price = prices::written(v, &format!("{at}.prices.{model}")).map_err(err)?;
            priced.insert(model.clone(), price);
        }
        let targets: Vec<String> = provider.targets().cloned().collect();
        for target in targets {
            if priced.contains_key(&target) {
                continue;
            }
            let entry = provider
                .prices_litellm
                .get(&target)
                .map(|e| (target.clone(), e))
                .or_else(|| {
                    let prefixed = format!("{name}/{target}");
                    provider
                        .prices_litellm
                        .get(&prefixed)
                        .map(|e| (prefixed, e))
                });
            let Some((key, entry)) = entry else {
                return Err(ConfigError::at(
                    format!("{at}.prices"),
                    format!(
                        "no price for `{target}`, a model this provider is sent: \
                         give it in `prices` or `prices_litellm`"
                    ),
                ));
            };
            let price =
                prices::litellm(entry, &format!("{at}.prices_litellm.{key}")).map_err(err)?;
            priced.insert(target, price);
        }
        // A spend budget over a model priced 0 in and out bounds nothing:
        // every request there would be free to it.
        let budgeted = provider.daily_spend.is_some() || provider.monthly_spend.is_some();
        if let Some((model, _)) = priced
            .iter()
            .find(|(_, price)| budgeted && price.base.input.0 == 0 && price.base.output.0 == 0)
        {
            return Err(ConfigError::at(
                format!("{at}.prices.{model}"),
                "priced 0 for input and output under a spend budget, which then bounds nothing: \
                 give its real price",
            ));
        }
        provider.priced = priced;
    }
    Ok(())
}

/// Names, routes and the ladder.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    if !p.providers.is_empty()
        && p.fallback
            .as_ref()
            .is_some_and(|f| f.value != "fallback" || f.provider != "fallback")
    {
        // `fallback.header` may still name the routing header.
        return Err(ConfigError::at(
            "fallback",
            "with `providers`, give only `fallback.header` (each provider has its `route`)",
        ));
    }
    let mut routes = BTreeMap::new();
    for (name, provider) in &p.providers {
        let at = format!("providers.{name}");
        if name.is_empty() || name == "primary" || name == "static" || !name.chars().all(label_char)
        {
            return Err(ConfigError::at(
                at,
                "a provider's name is a metric label and a header value: letters, digits, \
                 `-`, `_`, `.`, and neither `primary` nor `static`",
            ));
        }
        let route = provider.route.as_deref().unwrap_or(name);
        if route.is_empty() || !route.chars().all(label_char) {
            return Err(ConfigError::at(
                format!("{at}.route"),
                "a header value of letters, digits, `-`, `_`, `.`",
            ));
        }
        if let Some(other) = routes.insert(route.to_string(), name) {
            return Err(ConfigError::at(
                format!("{at}.route"),
                format!("`{route}` is the route of `{other}` too"),
            ));
        }
        if provider.speaks.is_empty() {
            return Err(ConfigError::at(format!("{at}.speaks"), "names no API"));
        }
        if provider.models.is_empty() && provider.default_model.is_none() {
            return Err(ConfigError::at(
                format!("{at}.models"),
                "maps no model: give `models` or `default_model`",
            ));
        }
        if let Some((from, _)) = provider.models.iter().find(|(_, to)| to.is_empty()) {
            return Err(ConfigError::at(
                format!("{at}.models.{from}"),
                "an empty model name",
            ));
        }
    }
    for (i, rung) in p.ladder.iter().enumerate() {
        if !p.providers.contains_key(rung) {
            return Err(ConfigError::at(
                format!("ladder[{i}]"),
                format!("`{rung}` is not a provider under `providers`"),
            ));
        }
        if p.ladder[..i].contains(rung) {
            return Err(ConfigError::at(
                format!("ladder[{i}]"),
                format!("`{rung}` twice"),
            ));
        }
    }
    if let Some(unused) = p.providers.keys().find(|n| !p.ladder.contains(n)) {
        return Err(ConfigError::at(
            format!("providers.{unused}"),
            "not on the `ladder`: no request would reach it",
        ));
    }
    Ok(())
}

fn label_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

#[cfg(test)]
mod tests {
    use crate::policy::Policy;
    use serde_json::{json, Value};

    fn with(providers: Value, ladder: Value) -> Result<Policy, crate::policy::ConfigError> {
        Policy::from_value(json!({
            "default_tier": "t", "tiers": {"t": {}},
            "providers": providers, "ladder": ladder,
        }))
    }

    fn error(providers: Value, ladder: Value) -> (String, String) {
        let e = with(providers, ladder).unwrap_err();
        (e.path, e.message)
    }

    #[test]
    fn a_provider_maps_models_and_prices_each_model_it_is_sent() {
        let p = with(
            json!({"openai": {
                "models": {"llama3.1:8b": "gpt-4o-mini"},
                "prices": {"gpt-4o-mini": {"input": "0.15", "output": "0.60", "cached_input": "0.075"}},
            }}),
            json!(["openai"]),
        )
        .unwrap();
        let openai = &p.providers["openai"];
        assert_eq!(openai.model_for(Some("llama3.1:8b")), Some("gpt-4o-mini"));
        assert_eq!(openai.model_for(Some("mistral")), None, "unmapped");
        assert_eq!(openai.model_for(None), None);
        assert_eq!(openai.priced["gpt-4o-mini"].base.input.0, 150_000_000);
    }

    #[test]
    fn litellm_entries_price_what_prices_does_not() {
        let p = with(
            json!({"openai": {
                "models": {"a": "gpt-4o-mini"}, "default_model": "gpt-4o",
                "prices_litellm": {
                    "gpt-4o-mini": {"input_cost_per_token": 1.5e-7, "output_cost_per_token": 6e-7},
                    "openai/gpt-4o": {"input_cost_per_token": "0.0000025", "output_cost_per_token": "0.00001"},
                    "unrelated-model": {"mode": "image_generation"},
                },
            }}),
            json!(["openai"]),
        )
        .unwrap();
        let priced = &p.providers["openai"].priced;
        assert_eq!(priced["gpt-4o-mini"].base.output.0, 600_000_000);
        assert_eq!(priced["gpt-4o"].base.input.0, 2_500_000_000);
        assert_eq!(p.providers["openai"].model_for(Some("zzz")), Some("gpt-4o"));
    }

    #[test]
    fn errors_name_the_field() {
        let openai = |extra: Value| {
            let mut v = json!({"models": {"a": "gpt-4o-mini"},
                               "prices": {"gpt-4o-mini": {"input": 1, "output": 2}}});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            json!({ "openai": v })
        };
        let cases = [
            (
                json!({"openai": {"models": {"a": "gpt-4o-mini"}}}),
                json!(["openai"]),
                "providers.openai.prices",
                "no price for `gpt-4o-mini`",
            ),
            (
                json!({"openai": {"models": {"a": "free"}, "daily_spend": 5,
                                  "prices": {"free": {"input": 0, "output": 0}}}}),
                json!(["openai"]),
                "providers.openai.prices.free",
                "bounds nothing",
            ),
            (
                openai(json!({})),
                json!(["nope"]),
                "ladder[0]",
                "not a provider",
            ),
            (
                openai(json!({})),
                json!([]),
                "providers.openai",
                "not on the `ladder`",
            ),
            (
                openai(json!({})),
                json!(["openai", "openai"]),
                "ladder[1]",
                "twice",
            ),
            (
                openai(json!({"route": "a b"})),
                json!(["openai"]),
                "providers.openai.route",
                "header value",
            ),
            (
                openai(json!({"speaks": ["grpc"]})),
                json!(["openai"]),
                "providers.openai.speaks[0]",
                "unknown variant",
            ),
            (
                openai(json!({"models": {}})),
                json!(["openai"]),
                "providers.openai.models",
                "maps no model",
            ),
            (
                openai(json!({"prices": {"gpt-4o-mini": {"input": "0.0000000001", "output": 1}}})),
                json!(["openai"]),
                "providers.openai.prices.gpt-4o-mini",
                "",
            ),
        ];
        for (providers, ladder, path, message) in cases {
            let (p, m) = error(providers.clone(), ladder.clone());
            assert!(p.starts_with(path), "{providers} {ladder}: {p}: {m}");
            assert!(m.contains(message), "{providers} {ladder}: {p}: {m}");
        }
        let (p, _) = error(
            json!({"static": {"default_model": "x", "prices": {"x": {"input": 1, "output": 1}}}}),
            json!(["static"]),
        );
        assert_eq!(p, "providers.static");
    }
}
