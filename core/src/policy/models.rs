//! `models`: each model's own limits, caps, prices and backend; which
//! names a request may give for each (one identity per model, however the
//! client spells it); and `unlisted_models`, the opt-in that lets a model
//! the policy does not list through at a stated price.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::policy::model_name::OllamaName;
use crate::policy::prices::{self, ModelPrice};
use crate::policy::protection::Credentials;
use crate::policy::{de_number, ConfigError, Limit, Policy};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Requests to this model, all callers together.
    pub requests: Option<Limit>,
    /// Total tokens to this model, all callers together.
    pub tokens: Option<Limit>,
    /// Output reserved (and written into the request as its maximum) when
    /// the client sets none. Default: `defaults.max_output_tokens`.
    pub default_max_output: Option<u64>,
    /// The most output one completion of this model may ask for (its
    /// context window, say); more is a 400. Default: `request.max_output`.
    pub max_output: Option<u64>,
    /// Where a request goes when its caller is over a soft cap.
    pub downshift_to: Option<String>,
    /// The sidecar scope `backend:<name>` whose breaker guards this model.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// What the model costs, per 1M tokens (`{input: "2.50", output: "10",
    /// cached_input: "1.25", cache_write: …, reasoning: …, above: {200000:
    /// {…}}}`), or per 1,000 (`{input_per_1k: 0.5, output_per_1k: 1.5}`).
    /// Decimals are exact (see `policy/prices.rs`).
    pub price: Option<serde_json::Value>,
    /// The model's price as an entry of LiteLLM's
    /// `model_prices_and_context_window.json` (instead of `price`).
    pub price_litellm: Option<serde_json::Value>,
    /// `price`, `price_litellm` or `gpu`, read at load.
    #[serde(skip)]
    pub priced: Option<ModelPrice>,
    /// Virtual cost of a self-hosted model: GPU cost per hour ÷ throughput.
    pub gpu: Option<GpuCost>,
    /// Whose credential this model's upstream sees; default:
    /// `protection.credentials`.
    pub credentials: Option<Credentials>,
    /// Requests in flight to this model at once, across every worker.
    pub concurrency: Option<u32>,
    /// Fair shares of this model's buckets (`{free: 20%, anonymous: 10%}`,
    /// see `shares`); default: `defaults.shares`.
    pub shares: Option<crate::policy::shares::SharesConfig>,
    /// The model's context length in tokens: no request is charged more
    /// input than this, so it caps what a hard budget reserves.
    pub context_length: Option<u64>,
    /// The model a request goes to when its input does not fit
    /// `context_length` (a listed model with a longer context); absent:
    /// such a request is refused 400 `context_length_exceeded`.
    pub overflow: Option<String>,
    /// What the model's server adds to a request's text (its template's
    /// tokens, an image's): see `policy/bound.rs`. Default: the figures
    /// there.
    #[serde(default)]
    pub input_bound: crate::policy::bound::InputBound,
}

pub fn default_backend() -> String {
    "local".into()
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuCost {
    #[serde(deserialize_with = "de_number")]
    pub cost_per_hour: f64,
    #[serde(deserialize_with = "de_number")]
    pub tokens_per_second: f64,
}

/// `unlisted_models: {price: {input: "0.50", output: "1.50"}}`: a request
/// for a model the policy does not list under `models` goes through (else
/// it is a 400), priced at `price`, with no limits of its own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnlistedModels {
    /// What every unlisted model costs, written as `models.<name>.price`.
    /// Required: spend budgets and the hourly spend ceiling count these
    /// requests too (`{input: 0, output: 0}` says free on purpose).
    pub price: serde_json::Value,
    /// `price`, read at load.
    #[serde(skip)]
    pub priced: ModelPrice,
}

/// How a backend matches the model a request names against the models it
/// serves, by the API the request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// Ollama's rules (`policy/model_name.rs`): without case, the default
    /// host, namespace and tag filled in.
    Ollama,
    /// The name as written. vLLM serves a name only if it equals one of
    /// its served model names (`vllm/entrypoints/openai/serving_models.py`,
    /// `is_base_model`: `model.name == model_name`); OpenAI and Anthropic
    /// publish model ids as exact strings and answer any other 404.
    Exact,
}

/// The model a request names, as the policy knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named<'a> {
    /// A model listed under `models`: its key there, however the request
    /// spelled it.
    Listed(&'a str),
    /// A model the policy does not list. `identity`: the name every
    /// spelling of it shares (Ollama's shortest spelling, lower case),
    /// for its breaker slot, labels and audit, where that is not the name
    /// as written. `near`: a listed model this name is a spelling of by
    /// Ollama's rules, on an API that compares names exactly — a server
    /// that resolves names as Ollama does (Ollama's own `/v1` endpoints)
    /// would run that model, so the name is refused even when unlisted
    /// models are let through.
    Unlisted {
        identity: Option<String>,
        near: Option<&'a str>,
    },
}

/// The listed models by the name Ollama resolves each key to (a key Ollama
/// would refuse has none), built at load.
#[derive(Debug, Clone, Default)]
pub struct ModelNames {
    by_ollama: BTreeMap<OllamaName, String>,
}

impl crate::policy::Policy {
    /// The model `sent` names on an API whose servers read names by
    /// `naming`: the policy's key of a listed model (compared as written
    /// first, then as Ollama resolves it), or an unlisted one. Nothing is
    /// allocated for a name written as the policy writes it.
    pub fn model_named<'a>(&'a self, naming: Naming, sent: &str) -> Named<'a> {
        if let Some((key, _)) = self.models.get_key_value(sent) {
            return Named::Listed(key);
        }
        if naming == Naming::Exact && self.model_names.by_ollama.is_empty() {
            return Named::Unlisted {
                identity: None,
                near: None,
            };
        }
        let ollama = OllamaName::parse(sent);
        let listed = ollama
            .as_ref()
            .and_then(|n| self.model_names.by_ollama.get(n))
            .map(String::as_str);
        match (naming, listed) {
            (Naming::Ollama, Some(key)) => Named::Listed(key),
            (Naming::Ollama, None) => Named::Unlisted {
                identity: ollama.map(|n| n.shortest()).filter(|s| s != sent),
                near: None,
            },
            (Naming::Exact, near) => Named::Unlisted {
                identity: None,
                near,
            },
        }
    }

    /// The key of the listed model `sent` names, if any: whose per-model
    /// settings (its output cap) apply.
    pub fn listed_model<'a>(&'a self, naming: Naming, sent: &str) -> Option<&'a str> {
        match self.model_named(naming, sent) {
            Named::Listed(key) => Some(key),
            Named::Unlisted { .. } => None,
        }
    }

    /// The price of a model the policy does not list: `unlisted_models`'
    /// (0 when the policy lets every model through by listing none).
    pub fn unlisted_price(&self) -> ModelPrice {
        self.unlisted_models
            .as_ref()
            .map(|u| u.priced)
            .unwrap_or_default()
    }
}

/// Builds [`ModelNames`]; two keys Ollama reads as one model are an error
/// naming both (they would split one model's limits in two).
pub(crate) fn index_names(p: &mut crate::policy::Policy) -> Result<(), ConfigError> {
    let mut by_ollama: BTreeMap<OllamaName, String> = BTreeMap::new();
    for key in p.models.keys() {
        let Some(name) = OllamaName::parse(key) else {
            continue;
        };
        if let Some(first) = by_ollama.get(&name) {
            return Err(ConfigError::at(
                format!("models.{key}"),
                format!(
                    "`{key}` and `{first}` are one model to Ollama (`{}`): list it once",
                    name.shortest()
                ),
            ));
        }
        by_ollama.insert(name, key.clone());
    }
    p.model_names = ModelNames { by_ollama };
    if let Some(u) = p.unlisted_models.as_mut() {
        u.priced = prices::written(&u.price, "unlisted_models.price")
            .map_err(|(path, message)| ConfigError { path, message })?;
    }
    Ok(())
}

/// Reads each model's price (`price`, `price_litellm` or `gpu`: one of
/// them), exactly; an error names the field.
pub(crate) fn read_prices(p: &mut Policy) -> Result<(), ConfigError> {
    for (name, model) in p.models.iter_mut() {
        let at = format!("models.{name}");
        let err = |(path, message): (String, String)| ConfigError { path, message };
        let written = [
            model.price.is_some(),
            model.price_litellm.is_some(),
            model.gpu.is_some(),
        ];
        if written.iter().filter(|w| **w).count() > 1 {
            return Err(ConfigError::at(
                at,
                "give one of `price`, `price_litellm` and `gpu`",
            ));
        }
        model.priced = match (&model.price, &model.price_litellm, model.gpu) {
            (Some(v), _, _) => Some(prices::written(v, &format!("{at}.price")).map_err(err)?),
            (_, Some(v), _) => {
                Some(prices::litellm(v, &format!("{at}.price_litellm")).map_err(err)?)
            }
            (_, _, Some(g)) if g.cost_per_hour >= 0.0 && g.tokens_per_second > 0.0 => {
                // Micro-units per 1,000 tokens: the hour's cost over the
                // tokens served in an hour.
                let per_1k = g.cost_per_hour * 1000.0 / (g.tokens_per_second * 3600.0);
                Some(ModelPrice::flat((per_1k * 1e6).round().max(0.0) as u64))
            }
            _ => None,
        };
    }
    Ok(())
}

/// A model's downshift names another model, its output caps fit under
/// `request.max_output`, and its GPU cost is sane.
pub(crate) fn check(p: &Policy) -> Result<(), ConfigError> {
    for (name, model) in &p.models {
        model.check(name, p)?;
    }
    Ok(())
}

impl ModelConfig {
    fn check(&self, name: &str, p: &Policy) -> Result<(), ConfigError> {
        if let Some(target) = &self.downshift_to {
            if !p.models.contains_key(target) || target == name {
                return Err(ConfigError::at(
                    format!("models.{name}.downshift_to"),
                    format!("`{target}` must be another model listed under `models`"),
                ));
            }
        }
        if self
            .max_output
            .is_some_and(|m| m == 0 || m > p.request.max_output)
        {
            return Err(ConfigError::at(
                format!("models.{name}.max_output"),
                format!(
                    "must be between 1 and request.max_output ({})",
                    p.request.max_output
                ),
            ));
        }
        let cap = self.max_output.unwrap_or(p.request.max_output);
        if self.default_max_output.is_some_and(|d| d > cap) {
            return Err(ConfigError::at(
                format!("models.{name}.default_max_output"),
                format!("must not be above the model's output cap ({cap})"),
            ));
        }
        if self.context_length == Some(0) {
            return Err(ConfigError::at(
                format!("models.{name}.context_length"),
                "must be at least 1",
            ));
        }
        if let Some(to) = &self.overflow {
            let longer = p.models.get(to).filter(|m| {
                to != name
                    && m.context_length
                        .is_none_or(|c| Some(c) > self.context_length)
            });
            if self.context_length.is_none() || longer.is_none() {
                return Err(ConfigError::at(
                    format!("models.{name}.overflow"),
                    "must name another listed model with a longer `context_length`, \
                     and the model its own `context_length`",
                ));
            }
        }
        if self.default_max_output == Some(0) {
            return Err(ConfigError::at(
                format!("models.{name}.default_max_output"),
                "must be at least 1",
            ));
        }
        if let Some(g) = self.gpu {
            if !(g.cost_per_hour >= 0.0 && g.tokens_per_second > 0.0) {
                return Err(ConfigError::at(
                    format!("models.{name}.gpu"),
                    "cost_per_hour must not be negative and tokens_per_second must be positive",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::policy::Policy;

    fn policy(models: &[String]) -> Result<Policy, ConfigError> {
        let models: serde_json::Map<String, serde_json::Value> =
            models.iter().map(|m| (m.clone(), json!({}))).collect();
        Policy::from_value(json!({
            "default_tier": "t",
            "tiers": {"t": {"requests": "1/min"}},
            "models": models,
        }))
    }

    proptest! {
        /// Listed names that are one model to Ollama are refused at load;
        /// otherwise every Ollama spelling of each listed name resolves to
        /// that key and no other, and an exact API takes only the key.
        #[test]
        fn every_spelling_resolves_to_its_own_key_and_keys_never_collide(
            names in proptest::collection::vec(
                ("[a-c]{1,3}", proptest::option::of("[0-2]b"), any::<bool>()), 1..6),
            form in 0u8..4,
        ) {
            let keys: Vec<String> = names
                .iter()
                .map(|(m, tag, upper)| {
                    let m = if *upper { m.to_ascii_uppercase() } else { m.clone() };
                    tag.as_ref().map_or(m.clone(), |t| format!("{m}:{t}"))
                })
                .collect();
            let mut distinct: Vec<OllamaName> =
                keys.iter().filter_map(|k| OllamaName::parse(k)).collect();
            distinct.sort();
            let collide = distinct.windows(2).any(|w| w[0] == w[1]);
            let mut unique = keys.clone();
            unique.sort();
            unique.dedup();
            let loaded = policy(&unique);
            let same_key_twice = unique.len() < keys.len();
            if collide && !same_key_twice {
                prop_assert!(loaded.is_err());
                return Ok(());
            }
            let Ok(p) = loaded else {
                // Only a repeated key collides with itself (one map entry).
                prop_assert!(same_key_twice);
                return Ok(());
            };
            for key in p.models.keys() {
                let name = OllamaName::parse(key).unwrap();
                let spelt = match form {
                    0 => key.to_ascii_uppercase(),
                    1 => format!("library/{key}"),
                    2 => format!("registry.ollama.ai/library/{}:{}", name.model, name.tag),
                    _ => format!(" {}:{} ", name.model.to_ascii_uppercase(), name.tag),
                };
                prop_assert_eq!(
                    p.model_named(Naming::Ollama, &spelt),
                    Named::Listed(key),
                    "{}", spelt
                );
                prop_assert_eq!(p.model_named(Naming::Exact, key), Named::Listed(key));
            }
        }
    }
}
