//! `models`: each model's own limits, caps, prices and backend.

use serde::Deserialize;

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
