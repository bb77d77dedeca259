//! The ladder (docs/src/design.md, "Rerouting"): which provider serves a
//! request the primary cannot, and as what. A rung serves a request when it
//! speaks the request's API and maps its model; the first such rung of
//! `ladder` is chosen before dispatch, so the body is rewritten for it
//! (model, limit field) and reserved at its prices. Without `providers`,
//! the older `fallback` section is a ladder of one rung that takes any
//! model unchanged, priced as the primary.

use crate::admission::{Engine, RequestContext, Verdict};
use crate::policy::prices::ModelPrice;
use crate::policy::providers::{ProviderLimit, Speaks};
use crate::state::store::{SharedStore, StoreError};
use crate::usage::demand::Api;
use crate::usage::output_limit::LimitField;

/// The family of `api`; `None` for what no provider is sent (scoring,
/// `/invocations`, passthrough and unknown paths stay on the primary).
pub fn speaks(api: Api) -> Option<Speaks> {
    match api {
        Api::OpenAiChat | Api::OpenAiCompletions | Api::OpenAiEmbeddings | Api::OpenAiResponses => {
            Some(Speaks::Openai)
        }
        Api::AnthropicMessages => Some(Speaks::Anthropic),
        Api::OllamaChat | Api::OllamaGenerate | Api::OllamaEmbed => Some(Speaks::Ollama),
        // A declared API is the application's own: no provider speaks it.
        Api::Scoring | Api::Invocations | Api::Passthrough(_) | Api::Declared(_) | Api::Other => {
            None
        }
    }
}

fn limit_field(limit: ProviderLimit) -> LimitField {
    match limit {
        ProviderLimit::MaxTokens => LimitField::MaxTokens,
        ProviderLimit::MaxCompletionTokens => LimitField::MaxCompletionTokens,
    }
}

/// What admission on the ladder decided.
#[derive(Debug)]
pub struct Laddered {
    pub verdict: Verdict,
    /// The rung the request goes to (`None`: the primary, or answered).
    pub rung: Option<Box<Served>>,
    /// Providers passed over, and why: `budget` (theirs could not hold
    /// it) or `down` (the sidecar reports the rung down).
    pub skipped: Vec<(String, Skip)>,
    /// (provider, budget) whose `alert_at` fired now, once in its window.
    pub alerted: Vec<(String, String)>,
}

impl Laddered {
    /// The verdict marked with the rungs skipped.
    fn marked(mut self) -> Laddered {
        if !self.skipped.is_empty() {
            let list: Vec<String> = self
                .skipped
                .iter()
                .map(|(p, why)| format!("{p}={}", why.as_str()))
                .collect();
            self.verdict
                .push_header("x-sluice-skipped", &list.join(", "));
        }
        self
    }
}

/// Why a rung was passed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Its own budget cannot hold the request.
    Budget,
    /// The sidecar reports it down (its Envoy cluster's health checks).
    Down,
}

impl Skip {
    /// In `x-sluice-skipped` and the `outcome` label (`skipped_<it>`).
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Budget => "budget",
            Skip::Down => "down",
        }
    }
}

/// The scope of a provider's rung in the sidecar's state: an open breaker
/// there means the rung is down.
pub fn rung_scope(provider: &str) -> String {
    format!("provider:{provider}")
}

/// Compare-and-swap tries to mark a provider alert (another worker that
/// wins has alerted it).
const ALERT_TRIES: u32 = 4;

fn alert_key(rule: &str) -> String {
    format!("sluice:v1:alerted/{rule}")
}

/// The routing header when the policy names none (`fallback.header`).
pub const DEFAULT_ROUTE_HEADER: &str = "x-sluice-upstream";

/// The rung a request goes to, and what it is sent as there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The provider's name (`x-sluice-provider`, audit `provider`).
    pub provider: String,
    /// The routing header and the value Envoy's route for it matches.
    pub header: String,
    pub value: String,
    /// The provider's model; `None`: the model goes unchanged (`fallback`).
    pub model: Option<String>,
    /// Its price there; `None`: the primary's (`fallback`).
    pub price: Option<ModelPrice>,
    /// The one output-limit field the provider reads (`limit_field`);
    /// `None`: every field the API's servers read.
    pub limit_field: Option<LimitField>,
}

impl Engine {
    /// The header sluice routes on: set by sluice for a rung, removed from
    /// every client request. `None`: the policy reroutes nowhere.
    pub fn route_header(&self) -> Option<&str> {
        match (&self.policy.fallback, self.policy.providers.is_empty()) {
            (Some(f), _) => Some(f.header.as_str()),
            (None, false) => Some(DEFAULT_ROUTE_HEADER),
            (None, true) => None,
        }
    }

    /// The ladder takes requests when the primary is out (not only on the
    /// kill switch): the policy has a `ladder` and `ladder_when_out`.
    pub fn ladder_when_out(&self) -> bool {
        !self.policy.ladder.is_empty() && self.policy.ladder_when_out
    }

    /// The buckets of `provider`'s own budgets.
    pub(crate) fn provider_buckets(&self, provider: &str) -> impl Iterator<Item = usize> + '_ {
        self.provider_buckets
            .get(provider)
            .into_iter()
            .flatten()
            .copied()
    }

    /// Is the bucket of rule `rule_id` one of `provider`'s own budgets?
    pub fn is_rung_budget(&self, provider: &str, rule_id: &str) -> bool {
        self.provider_buckets(provider)
            .any(|i| *self.buckets[i].rule.id == *rule_id)
    }

    /// Is bucket `i` a provider's own budget (the operator's, never shown
    /// to a caller)?
    pub(crate) fn is_provider_bucket(&self, i: usize) -> bool {
        self.provider_buckets.values().any(|b| b.contains(&i))
    }

    /// Was `verdict` refused by `served`'s own budget (then the next rung
    /// is tried), not by the caller's?
    pub fn refused_by_rung(&self, verdict: &Verdict, served: &Served) -> bool {
        verdict.bucket().is_some_and(|refused| {
            self.provider_buckets(&served.provider)
                .any(|i| *self.buckets[i].rule.id == *refused)
        })
    }

    /// The record of each provider budget with an `alert_at`: the start of
    /// the window last alerted (one key per budget, made at load).
    pub(crate) fn prepare_provider_alerts(
        &self,
        store: &dyn SharedStore,
    ) -> Result<usize, StoreError> {
        let mut created = 0;
        for i in self.provider_buckets.values().flatten() {
            let b = &self.buckets[*i];
            let key = alert_key(&b.rule.id);
            if b.alert_permille.is_some() && store.get(&key).is_none() {
                store.set(&key, &0u64.to_le_bytes(), 0)?;
                created += 1;
            }
        }
        Ok(created)
    }

    /// The budgets of `provider` whose `alert_at` `verdict` crossed (an
    /// admission past it, or a refusal by it) and that were not alerted yet
    /// in their window: marked alerted now, so each alerts once per window
    /// (per Envoy: shared data is its own).
    fn alerts_due(
        &self,
        store: &dyn SharedStore,
        provider: &str,
        verdict: &Verdict,
        now_ms: u64,
    ) -> Vec<String> {
        self.provider_buckets(provider)
            .filter(|&i| {
                let b = &self.buckets[i];
                let crossed = verdict.bucket() == Some(&*b.rule.id)
                    || verdict.alerts().iter().any(|a| a.bucket == i);
                crossed && b.alert_permille.is_some() && self.mark_alerted(store, i, now_ms)
            })
            .map(|i| self.buckets[i].name.clone())
            .collect()
    }

    /// Marks bucket `i` alerted for its current window; `false` when it
    /// already was (or another worker won the mark).
    fn mark_alerted(&self, store: &dyn SharedStore, i: usize, now_ms: u64) -> bool {
        let b = &self.buckets[i];
        let Some(window) = b.rule.limit.window else {
            return false;
        };
        let start = crate::limits::bucket::window_start(window, now_ms);
        let key = alert_key(&b.rule.id);
        for _ in 0..ALERT_TRIES {
            let Some((bytes, cas)) = store.get(&key) else {
                return false;
            };
            let seen = bytes
                .get(..8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_le_bytes);
            if seen == start {
                return false;
            }
            if store.set(&key, &start.to_le_bytes(), cas).is_ok() {
                return true;
            }
        }
        false
    }

    /// The first rung that serves a request of `api` for `model`.
    pub fn rung_for(&self, api: Api, model: Option<&str>) -> Option<Served> {
        self.rung_after(api, model, None)
    }

    /// The providers the sidecar reports down (an open `provider:<name>`
    /// breaker), as far as its state is trusted now (fresh, or kept under
    /// `on_stale: fail_closed`).
    pub fn rungs_down(
        &self,
        seen: &crate::admission::route::SidecarSeen,
        now_ms: u64,
    ) -> Vec<String> {
        let Some(sidecar) = self.policy.sidecar.as_ref() else {
            return Vec::new();
        };
        let Some(state) = seen.trusted(now_ms, sidecar.stale_after_ms, sidecar.on_stale) else {
            return Vec::new();
        };
        self.policy
            .ladder
            .iter()
            .filter(|name| {
                let scope = rung_scope(name);
                state.breakers.iter().any(|b| {
                    b.scope == scope && b.state == crate::admission::route::BreakerState::Open
                })
            })
            .cloned()
            .collect()
    }

    /// Admits a request on `first` and, when a rung is `down` or its own
    /// budget cannot hold the request, on the next rung that serves it,
    /// down to the static answer. The verdict says which rungs were
    /// skipped (`x-sluice-skipped: openai=budget`).
    pub fn admit_down_the_ladder(
        &self,
        store: &dyn SharedStore,
        ctx: &RequestContext,
        first: Option<Box<Served>>,
        down: &[String],
    ) -> Laddered {
        let (mut skipped, mut alerted) = (Vec::new(), Vec::new());
        let Some(mut served) = first else {
            let verdict = self.admit_on(store, ctx, None);
            return Laddered {
                verdict,
                rung: None,
                skipped,
                alerted,
            };
        };
        let model = ctx.asked.and_then(|a| a.demand.model.as_deref());
        loop {
            let why = if down.contains(&served.provider) {
                Skip::Down
            } else {
                let verdict = self.admit_on(store, ctx, Some(&served));
                for budget in self.alerts_due(store, &served.provider, &verdict, ctx.now_ms) {
                    alerted.push((served.provider.clone(), budget));
                }
                if !self.refused_by_rung(&verdict, &served) {
                    let rung = Some(served);
                    return Laddered {
                        verdict,
                        rung,
                        skipped,
                        alerted,
                    }
                    .marked();
                }
                Skip::Budget
            };
            skipped.push((served.provider.clone(), why));
            match self.rung_after(ctx.api, model, Some(&served.provider)) {
                Some(next) => served = Box::new(next),
                None => {
                    let verdict = self.static_verdict(ctx);
                    return Laddered {
                        verdict,
                        rung: None,
                        skipped,
                        alerted,
                    }
                    .marked();
                }
            }
        }
    }

    /// The first rung after `after` (from the top: `None`) that serves a
    /// request of `api` for `model`.
    pub(crate) fn rung_after(
        &self,
        api: Api,
        model: Option<&str>,
        after: Option<&str>,
    ) -> Option<Served> {
        let header = self.route_header()?.to_string();
        if self.policy.providers.is_empty() {
            if after.is_some() {
                return None;
            }
            let fb = self.policy.fallback.as_ref()?;
            return Some(Served {
                provider: fb.provider.clone(),
                header,
                value: fb.value.clone(),
                model: None,
                price: None,
                limit_field: None,
            });
        }
        let speaks = speaks(api)?;
        let start = after
            .and_then(|a| self.policy.ladder.iter().position(|n| n == a))
            .map_or(0, |i| i + 1);
        self.policy.ladder[start..].iter().find_map(|name| {
            let provider = self.policy.providers.get(name)?;
            if !provider.speaks.contains(&speaks) {
                return None;
            }
            let target = provider.model_for(model)?;
            Some(Served {
                provider: name.clone(),
                header: header.clone(),
                value: provider.route.clone().unwrap_or_else(|| name.clone()),
                model: Some(target.to_string()),
                price: provider.priced.get(target).copied(),
                limit_field: provider.limit_field.map(limit_field),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;
    use serde_json::json;

    fn engine(extra: serde_json::Value) -> Engine {
        let mut policy = json!({"default_tier": "t", "tiers": {"t": {}}});
        for (k, v) in extra.as_object().unwrap() {
            policy[k] = v.clone();
        }
        Engine::new(Policy::from_value(policy).unwrap())
    }

    fn priced(model: &str) -> serde_json::Value {
        json!({ model: {"input": "1", "output": "2"} })
    }

    #[test]
    fn the_first_rung_that_speaks_the_api_and_maps_the_model_serves() {
        let e = engine(json!({
            "providers": {
                "anthropic": {"speaks": ["anthropic"], "default_model": "claude-haiku",
                              "prices": priced("claude-haiku")},
                "openai": {"models": {"llama3.1:8b": "gpt-4o-mini"}, "route": "oai",
                           "limit_field": "max_completion_tokens",
                           "prices": priced("gpt-4o-mini")},
                "together": {"speaks": ["openai", "ollama"], "default_model": "meta-llama-3.1-8b",
                             "prices": priced("meta-llama-3.1-8b")},
            },
            "ladder": ["anthropic", "openai", "together"],
        }));
        let chat = e.rung_for(Api::OpenAiChat, Some("llama3.1:8b")).unwrap();
        assert_eq!(
            (
                chat.provider.as_str(),
                chat.value.as_str(),
                chat.model.as_deref()
            ),
            ("openai", "oai", Some("gpt-4o-mini"))
        );
        assert_eq!(chat.header, DEFAULT_ROUTE_HEADER);
        assert_eq!(chat.limit_field, Some(LimitField::MaxCompletionTokens));
        assert_eq!(chat.price.unwrap().base.output.0, 2_000_000_000);
        // Unmapped by openai: the next rung's default.
        let other = e.rung_for(Api::OpenAiChat, Some("mistral")).unwrap();
        assert_eq!(other.provider, "together");
        assert_eq!(other.limit_field, None);
        // Only anthropic speaks Messages; nobody takes scoring.
        let messages = e.rung_for(Api::AnthropicMessages, Some("x")).unwrap();
        assert_eq!(messages.model.as_deref(), Some("claude-haiku"));
        assert_eq!(e.rung_for(Api::Scoring, Some("llama3.1:8b")), None);
        assert_eq!(
            e.rung_for(Api::OllamaChat, Some("llama3.1:8b"))
                .unwrap()
                .provider,
            "together"
        );
        assert!(e.ladder_when_out());
    }

    #[test]
    fn the_older_fallback_is_one_rung_for_any_model_on_the_kill_switch_only() {
        let e = engine(json!({"fallback": {"provider": "acme", "value": "backup"}}));
        let s = e.rung_for(Api::OpenAiChat, Some("whatever")).unwrap();
        assert_eq!(
            (s.provider.as_str(), s.value.as_str(), s.model, s.price),
            ("acme", "backup", None, None)
        );
        assert!(!e.ladder_when_out());
        assert_eq!(engine(json!({})).rung_for(Api::OpenAiChat, None), None);
        assert_eq!(engine(json!({})).route_header(), None);
    }
}
