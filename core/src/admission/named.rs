//! One identity per model (issue 48 item 3): the model a body names is
//! resolved to the policy's key once, as the demand is read, so every
//! later step — the model's buckets, concurrency gate, price, breaker,
//! downshift, cache scope, labels and audit — sees one name however the
//! client spelt it (`LLAMA3.1:70B`, `library/llama3.1:70b` and
//! `registry.ollama.ai/library/llama3.1:70b` are all `llama3.1:70b` on
//! Ollama's APIs; the rules are in `policy/model_name.rs`, which API reads
//! names how in `Api::naming`).
//!
//! A listed model spelt otherwise goes upstream under the policy's key:
//! the server would resolve the client's spelling to the same model by
//! the same rules, but writing the key makes that so by construction — a
//! server version whose rules differ from the copy here still runs the
//! model that was limited and priced, never another.
//!
//! When the policy lists models, a model it does not list is a 400 naming
//! the models it serves (before, such a request ran priced at 0, past
//! every per-model limit), unless `unlisted_models` lets it through at its
//! stated price. A name that only Ollama's rules tie to a listed model, on
//! an API that compares names exactly, is refused even then: Ollama's own
//! OpenAI-compatible endpoints resolve it to that listed model.

use super::answer::{Reason, Refused};
use super::Engine;
use crate::policy::models::Named;
use crate::usage::demand::Demand;

/// The most model names a refusal lists.
const NAMES_SHOWN: usize = 12;

impl Engine {
    /// The demand with its model as the policy names it, and whether the
    /// body spelt a listed model otherwise; or the refusal of a model the
    /// policy does not serve.
    pub(super) fn name_model(&self, mut demand: Demand) -> Result<(Demand, bool), Box<Refused>> {
        let Some(sent) = demand.model.as_deref() else {
            return Ok((demand, false));
        };
        let renamed = match self.policy.model_named(demand.api.naming(), sent) {
            Named::Listed(key) => (key != sent).then(|| key.to_string()),
            Named::Unlisted {
                near: Some(listed), ..
            } => {
                return Err(Box::new(Refused::rejected(
                    Reason::InvalidRequest,
                    format!("The model `{sent}` is not served here under that name: this API compares model names exactly. Send `{listed}`."),
                    Some("model"),
                )))
            }
            Named::Unlisted { .. } if self.refuses_unlisted() => {
                return Err(Box::new(Refused::rejected(
                    Reason::InvalidRequest,
                    format!(
                        "The model `{sent}` is not served here. Models: {}.",
                        self.listed_names()
                    ),
                    Some("model"),
                )))
            }
            // Not respelled upstream: an unlisted name has no policy
            // spelling, and the server reads the client's as its own.
            Named::Unlisted { identity, .. } => {
                if let Some(identity) = identity {
                    demand.model = Some(identity);
                }
                return Ok((demand, false));
            }
        };
        let respelled = renamed.is_some();
        if let Some(key) = renamed {
            demand.model = Some(key);
        }
        Ok((demand, respelled))
    }

    /// A policy that lists models serves only those, unless it opts in.
    fn refuses_unlisted(&self) -> bool {
        !self.policy.models.is_empty() && self.policy.unlisted_models.is_none()
    }

    /// The listed models, for a refusal: the first few, and how many more.
    fn listed_names(&self) -> String {
        let models = &self.policy.models;
        let mut names: Vec<String> = models
            .keys()
            .take(NAMES_SHOWN)
            .map(|k| format!("`{k}`"))
            .collect();
        if models.len() > NAMES_SHOWN {
            names.push(format!("and {} more", models.len() - NAMES_SHOWN));
        }
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::super::tests::Caller;
    use super::super::{ctx, Verdict};
    use super::*;
    use crate::policy::prices::ModelPrice;
    use crate::policy::Policy;
    use crate::state::store::MemStore;
    use crate::usage::demand::Api;

    /// `llama3.1:70b` as the clients spell it, and more.
    const SPELLINGS: [&str; 8] = [
        "LLAMA3.1:70B",
        "library/llama3.1:70b",
        "registry.ollama.ai/library/llama3.1:70b",
        "llama3.1:70b",
        "Llama3.1:70b:local",
        " llama3.1:70B ",
        "https://Registry.Ollama.AI/Library/llama3.1:70b",
        "LIBRARY/LLAMA3.1:70b",
    ];

    fn engine(extra: Value) -> (Engine, MemStore) {
        let mut policy = json!({
            "default_tier": "t",
            "tiers": {"t": {"requests": "100/min", "daily_spend": 1.0}},
            "models": {
                "llama3.1:70b": {"requests": "5/min",
                                 "price": {"input_per_1k": 1.0, "output_per_1k": 2.0}},
                "llama3.1:8b": {"requests": "200/min"},
            },
        });
        if let (Some(p), Some(extra)) = (policy.as_object_mut(), extra.as_object()) {
            p.extend(extra.clone());
        }
        let e = Engine::new(Policy::from_value(policy).unwrap());
        let store = MemStore::default();
        e.prepare(&store).unwrap();
        (e, store)
    }

    /// The verdict on one request for `model` (its demand's refusal, or
    /// admission's).
    fn admit(e: &Engine, store: &MemStore, api: Api, model: &str) -> Verdict {
        let id = e.identify(&Caller("10.1.1.1:1")).unwrap();
        let body = match api {
            Api::OllamaChat => json!({"model": model, "options": {"num_predict": 10},
                                      "messages": [{"role": "user", "content": "hi"}]}),
            _ => json!({"model": model, "max_tokens": 10,
                        "messages": [{"role": "user", "content": "hi"}]}),
        };
        let asked = match e.demand(&id, api, body.to_string().as_bytes()) {
            Ok(asked) => asked,
            Err(refused) => return *refused,
        };
        let path = match api {
            Api::OllamaChat => "/api/chat",
            _ => "/v1/chat/completions",
        };
        e.admit(store, &ctx(&id, api, path, asked.as_ref(), 0))
    }

    fn error(v: &Verdict) -> Value {
        let reply = v.reply().expect("refused");
        assert_eq!(reply.status, 400);
        serde_json::from_slice(&reply.body).unwrap()
    }

    fn model_sent(v: &Verdict) -> Option<String> {
        let body: Value = serde_json::from_slice(v.body().as_ref()?).unwrap();
        body["model"].as_str().map(str::to_string)
    }

    #[test]
    fn every_spelling_hits_the_models_own_limit_and_price() {
        let (e, store) = engine(json!({}));
        let price = e.policy.models["llama3.1:70b"].priced.unwrap();
        assert_ne!(price, ModelPrice::default());
        let verdicts: Vec<Verdict> = SPELLINGS
            .iter()
            .map(|m| admit(&e, &store, Api::OllamaChat, m))
            .collect();
        for (v, spelt) in verdicts.iter().zip(SPELLINGS).take(5) {
            assert!(v.reply().is_none(), "{spelt}: {:?}", v.reply());
            assert_eq!(v.labels().model, "llama3.1:70b");
            let plan = v.plan().unwrap();
            assert_eq!(plan.model.as_deref(), Some("llama3.1:70b"));
            assert_eq!(plan.price, price, "{spelt}");
            // Spelt otherwise, it goes up under the policy's name; spelt
            // as the policy does, the body goes up as it came.
            let want = (spelt != "llama3.1:70b").then(|| "llama3.1:70b".to_string());
            assert_eq!(model_sent(v), want, "{spelt}");
        }
        for v in &verdicts[5..] {
            assert_eq!(v.labels().decision.reason_code(), "model_rate_limit");
            assert_eq!(v.labels().model, "llama3.1:70b");
        }
    }

    #[test]
    fn a_model_the_policy_does_not_list_is_a_400_naming_the_models() {
        let (e, store) = engine(json!({}));
        for (api, model) in [
            (Api::OllamaChat, "mistral:7b"),
            (Api::OllamaChat, "llama3.1:70b-cloud"),
            (Api::OpenAiChat, "gpt-made-up"),
        ] {
            let v = admit(&e, &store, api, model);
            let err = error(&v);
            assert_eq!(err["error"]["code"], "invalid_request", "{err}");
            assert_eq!(err["error"]["param"], "model");
            let message = err["error"]["message"].as_str().unwrap();
            assert!(message.contains(&format!("`{model}`")), "{message}");
            assert!(
                message.contains("`llama3.1:70b`, `llama3.1:8b`"),
                "{message}"
            );
        }
        // Listing no models lets every model through, as before.
        let e = Engine::new(
            Policy::from_value(json!({"default_tier": "t", "tiers": {"t": {"requests": "9/min"}}}))
                .unwrap(),
        );
        let store = MemStore::default();
        e.prepare(&store).unwrap();
        assert!(admit(&e, &store, Api::OpenAiChat, "any").reply().is_none());
    }

    #[test]
    fn unlisted_models_opt_in_prices_them_at_the_stated_price() {
        let unlisted = json!({"unlisted_models": {"price": {"input": "3", "output": "6"}}});
        let (e, store) = engine(unlisted);
        let stated = e.policy.unlisted_price();
        assert_eq!(stated.base.input.0, 3_000_000_000);
        let v = admit(&e, &store, Api::OllamaChat, "Mistral:7B");
        assert!(v.reply().is_none(), "{:?}", v.reply());
        let plan = v.plan().unwrap();
        assert_eq!(plan.price, stated);
        // One identity for every spelling (its breaker slot, its audit),
        // the body as the client wrote it.
        assert_eq!(plan.model.as_deref(), Some("mistral:7b"));
        assert_eq!(v.labels().model, "other");
        assert_eq!(model_sent(&v), None);
        // A listed model keeps its own price.
        let v = admit(&e, &store, Api::OllamaChat, "LLAMA3.1:8B");
        assert_eq!(v.plan().unwrap().price, ModelPrice::default());
    }

    #[test]
    fn exact_apis_compare_names_as_written() {
        let unlisted = json!({"unlisted_models": {"price": {"input": 0, "output": 0}}});
        for extra in [json!({}), unlisted] {
            let (e, store) = engine(extra);
            let v = admit(&e, &store, Api::OpenAiChat, "llama3.1:70b");
            assert_eq!(v.plan().unwrap().model.as_deref(), Some("llama3.1:70b"));
            // Ollama's own `/v1` would run llama3.1:70b for this name: it is
            // refused, even where unlisted models are let through.
            let v = admit(&e, &store, Api::OpenAiChat, "LLAMA3.1:70B");
            let err = error(&v);
            let message = err["error"]["message"].as_str().unwrap();
            assert!(message.contains("Send `llama3.1:70b`"), "{message}");
        }
        // Names Ollama would refuse still match as written.
        let (e, store) = engine(json!({"models": {"Qwen/Qwen2.5-7B@main": {"requests": "1/min"}}}));
        let v = admit(&e, &store, Api::OpenAiChat, "Qwen/Qwen2.5-7B@main");
        assert_eq!(v.labels().model, "Qwen/Qwen2.5-7B@main");
        let v = admit(&e, &store, Api::OpenAiChat, "qwen/qwen2.5-7b@main");
        assert_eq!(error(&v)["error"]["param"], "model");
    }

    #[test]
    fn the_output_cap_is_the_models_whatever_its_spelling() {
        let (e, _) = engine(json!({"models": {"llama3.1:70b": {"max_output": 64}}}));
        let id = e.identify(&Caller("10.1.1.1:1")).unwrap();
        let body = json!({"model": "LLAMA3.1:70B", "options": {"num_predict": 65}});
        let refused = e
            .demand(&id, Api::OllamaGenerate, body.to_string().as_bytes())
            .err()
            .unwrap();
        let err: Value = serde_json::from_slice(&refused.reply().unwrap().body).unwrap();
        assert_eq!(err["error"]["param"], "options.num_predict", "{err}");
    }

    #[test]
    fn the_configuration_names_its_fields() {
        let load = |extra: Value| {
            let mut p = json!({"default_tier": "t", "tiers": {"t": {"requests": "1/min"}}});
            if let (Some(p), Some(extra)) = (p.as_object_mut(), extra.as_object()) {
                p.extend(extra.clone());
            }
            Policy::from_value(p).map(|_| ()).unwrap_err()
        };
        let err = load(json!({"models": {"LLAMA3.1:70b": {}, "llama3.1:70b": {}}}));
        assert_eq!(err.path, "models.llama3.1:70b");
        assert!(err.message.contains("`LLAMA3.1:70b`"), "{err}");
        let err =
            load(json!({"models": {"llama3": {}, "registry.ollama.ai/library/llama3:latest": {}}}));
        assert!(err.message.contains("`llama3:latest`"), "{err}");
        let err = load(json!({"unlisted_models": {}}));
        assert_eq!(err.path, "unlisted_models");
        assert!(err.message.contains("price"), "{err}");
        let err = load(json!({"unlisted_models": {"price": {"input": 1}, "allow": true}}));
        assert_eq!(err.path, "unlisted_models.allow");
        assert!(err.message.contains("allow"), "{err}");
        let err = load(json!({"unlisted_models": {"price": {"input": "-1"}}}));
        assert!(err.path.starts_with("unlisted_models.price"), "{err}");
    }
}
