//! The request path, top to bottom: identity → demand → admission → answer.
//! Pure: the proxy-wasm shim feeds it what Envoy knows and applies what it
//! decides.

use std::collections::HashMap;

use crate::answer::{self, Limited, Reason, Reply};
use crate::bucket::Quota;
use crate::config::{Limit, Policy};
use crate::principal::{Identity, RequestView, Resolver};
use crate::request::{self, Api, Demand};
use crate::reservation::{Claim, Effort, Held, Refusal, Reserver, Rule, Scope};
use crate::store::SharedStore;

/// Metric labels of one decision. Bounded: tiers and models come from the
/// policy (`other` for unlisted models), reasons from a fixed set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels {
    pub decision: &'static str,
    pub reason: &'static str,
    pub tier: String,
    pub model: String,
}

/// What to do with a request.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// `Some`: answer the client with this and stop. `None`: go upstream.
    pub reply: Option<Reply>,
    /// Headers to add to the upstream's response when admitted.
    pub response_headers: Vec<(String, String)>,
    pub labels: Labels,
    pub effort: Effort,
    /// Units held, for settlement after the response.
    pub held: Vec<Held>,
}

/// A bucket definition with what answers need to say about it.
struct Bucket {
    rule: Rule,
    reason: Reason,
    /// `tier free: requests`
    name: String,
}

pub struct Engine {
    pub policy: Policy,
    resolver: Resolver,
    buckets: Vec<Bucket>,
    tier_bucket: HashMap<String, usize>,
    model_bucket: HashMap<String, usize>,
    route_bucket: Vec<(String, usize)>,
}

impl Engine {
    pub fn new(policy: Policy) -> Engine {
        let mut buckets = Vec::new();
        let mut add = |id: String, name: String, limit: Limit, scope, reason| {
            buckets.push(Bucket {
                rule: Rule { id, limit, scope },
                reason,
                name,
            });
            buckets.len() - 1
        };
        let tier_bucket = policy
            .tiers
            .iter()
            .filter_map(|(tier, cfg)| {
                let limit = cfg.requests?;
                let i = add(
                    format!("tier/{tier}/requests"),
                    format!("tier {tier}: requests per caller"),
                    limit,
                    Scope::PerPrincipal,
                    Reason::UserRateLimit,
                );
                Some((tier.clone(), i))
            })
            .collect();
        let model_bucket = policy
            .models
            .iter()
            .filter_map(|(model, cfg)| {
                let limit = cfg.requests?;
                let i = add(
                    format!("model/{model}/requests"),
                    format!("model {model}: requests"),
                    limit,
                    Scope::Global,
                    Reason::ModelRateLimit,
                );
                Some((model.clone(), i))
            })
            .collect();
        let route_bucket = policy
            .routes
            .iter()
            .map(|route| {
                let i = add(
                    format!("route/{}/requests", route.name),
                    format!("route {}: requests", route.name),
                    route.requests,
                    Scope::Global,
                    Reason::RouteRateLimit,
                );
                (route.path_prefix.clone(), i)
            })
            .collect();
        Engine {
            resolver: Resolver::new(&policy),
            policy,
            buckets,
            tier_bucket,
            model_bucket,
            route_bucket,
        }
    }

    /// Every bucket the policy defines, to create their keys up front.
    pub fn rules(&self) -> Vec<Rule> {
        self.buckets.iter().map(|b| b.rule.clone()).collect()
    }

    /// Step 1: who is calling. A refusal (unknown API key) is a verdict.
    pub fn identify(&self, req: &dyn RequestView) -> Result<Identity, Box<Verdict>> {
        self.resolver.resolve(req).map_err(|_| {
            let reply =
                answer::rejected(Reason::Unauthenticated, "The API key is not valid.", None);
            Box::new(self.refused(
                reply,
                Reason::Unauthenticated,
                &self.policy.default_tier,
                None,
            ))
        })
    }

    /// The body cap, checked against a declared or an accumulated size.
    pub fn too_large(&self, identity: &Identity, size: u64) -> Option<Verdict> {
        let cap = self.policy.request.max_body_bytes;
        (size > cap).then(|| {
            let reply = answer::rejected(
                Reason::RequestTooLarge,
                &format!("The request body is larger than the {cap}-byte limit."),
                None,
            );
            self.refused(reply, Reason::RequestTooLarge, &identity.tier, None)
        })
    }

    /// Step 2: what the body asks for (APIs sluice does not read give none).
    pub fn demand(
        &self,
        identity: &Identity,
        api: Api,
        body: &[u8],
    ) -> Result<Option<Demand>, Box<Verdict>> {
        if !api.reads_body() {
            return Ok(None);
        }
        request::parse_body(api, body).map(Some).map_err(|bad| {
            let reply = answer::rejected(Reason::InvalidRequest, &bad.message, bad.param);
            Box::new(self.refused(reply, Reason::InvalidRequest, &identity.tier, None))
        })
    }

    /// Step 3: reserve every bucket that applies, all or nothing.
    pub fn admit(
        &self,
        store: &dyn SharedStore,
        identity: &Identity,
        path: &str,
        demand: Option<&Demand>,
        now_ms: u64,
    ) -> Verdict {
        let model = demand.and_then(|d| d.model.as_deref());
        let applying: Vec<usize> = self
            .tier_bucket
            .get(&identity.tier)
            .into_iter()
            .chain(model.and_then(|m| self.model_bucket.get(m)))
            .copied()
            .chain(
                self.route_bucket
                    .iter()
                    .filter(|(prefix, _)| path.starts_with(prefix.as_str()))
                    .map(|(_, i)| *i),
            )
            .collect();
        let claims: Vec<Claim> = applying
            .iter()
            .map(|&i| Claim::hard(&self.buckets[i].rule, 1))
            .collect();
        let reserver = Reserver {
            store,
            slots: self.policy.state.principal_slots,
            max_retries: self.policy.state.cas_max_retries,
        };
        let mut effort = Effort::default();
        let outcome = reserver.reserve(&claims, identity.hash, now_ms, &mut effort);
        let labels = |decision, reason: &'static str| Labels {
            decision,
            reason,
            tier: identity.tier.clone(),
            model: self.model_label(model),
        };
        match outcome {
            Ok(reservation) => Verdict {
                reply: None,
                response_headers: reservation
                    .tightest
                    .map(|(_, q)| answer::rate_limit_headers(&q))
                    .unwrap_or_default(),
                labels: labels("admit", "none"),
                effort,
                held: reservation.held,
            },
            Err(refusal) => {
                let (index, quota, retry_after_ms) = match refusal {
                    Refusal::Full { index, shortfall } => {
                        (index, shortfall.quota, shortfall.retry_after_ms)
                    }
                    // Lost every CAS race: refuse by that bucket, briefly.
                    Refusal::Contended { index } | Refusal::Host { index, .. } => {
                        effort.exhausted = true;
                        let limit = claims[index].rule.limit;
                        let quota = Quota {
                            limit: limit.capacity(),
                            remaining: 0,
                            reset_ms: 1_000,
                        };
                        (index, quota, 1_000)
                    }
                };
                let bucket = &self.buckets[applying[index]];
                let limit_text = bucket.rule.limit.rate.to_string();
                let reply = answer::limited(
                    &Limited {
                        reason: bucket.reason,
                        quota,
                        retry_after_ms,
                        tier: &identity.tier,
                        bucket: &bucket.name,
                        limit_text: &limit_text,
                    },
                    now_ms,
                );
                Verdict {
                    reply: Some(reply),
                    response_headers: Vec::new(),
                    labels: labels("refuse", bucket.reason.code()),
                    effort,
                    held: Vec::new(),
                }
            }
        }
    }

    /// `model` as a metric label: configured models by name, others as
    /// `other`, none as `none`, so a client cannot mint label values.
    pub fn model_label(&self, model: Option<&str>) -> String {
        match model {
            None => "none".into(),
            Some(m) if self.policy.models.contains_key(m) => m.into(),
            Some(_) => "other".into(),
        }
    }

    fn refused(&self, reply: Reply, reason: Reason, tier: &str, model: Option<&str>) -> Verdict {
        Verdict {
            reply: Some(reply),
            response_headers: Vec::new(),
            labels: Labels {
                decision: "refuse",
                reason: reason.code(),
                tier: tier.into(),
                model: self.model_label(model),
            },
            effort: Effort::default(),
            held: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reservation::prepare;
    use crate::store::MemStore;
    use serde_json::json;

    struct Caller(&'static str);
    impl RequestView for Caller {
        fn header(&self, _: &str) -> Option<String> {
            None
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some(self.0.into())
        }
    }

    fn engine() -> Engine {
        Engine::new(
            Policy::from_value(json!({
                "default_tier": "free",
                "tiers": {"free": {"requests": "10/min"}},
                "models": {"big": {"requests": "3/min"}},
                "routes": [{"name": "chat", "path_prefix": "/v1/chat/", "requests": "100/s"}],
            }))
            .unwrap(),
        )
    }

    fn demand(model: &str) -> Demand {
        Demand {
            model: Some(model.into()),
            stream: false,
            max_output: None,
        }
    }

    #[test]
    fn free_tier_gets_ten_then_a_full_429() {
        let e = engine();
        let store = MemStore::default();
        prepare(&store, &e.rules(), e.policy.state.principal_slots).unwrap();
        let id = e.identify(&Caller("10.0.0.1:1234")).unwrap();
        let results: Vec<Verdict> = (0..12)
            .map(|_| e.admit(&store, &id, "/v1/models", None, 1_000))
            .collect();
        assert_eq!(results.iter().filter(|v| v.reply.is_none()).count(), 10);
        assert_eq!(
            results[0].response_headers[1],
            ("x-ratelimit-remaining".into(), "9".into())
        );
        let refused = results[11].reply.as_ref().unwrap();
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-sluice-reason"), Some("user_rate_limit"));
        assert_eq!(results[11].labels.reason, "user_rate_limit");
    }

    #[test]
    fn model_limit_applies_across_callers_and_labels_are_bounded() {
        let e = engine();
        let store = MemStore::default();
        prepare(&store, &e.rules(), e.policy.state.principal_slots).unwrap();
        for i in 0..3 {
            let id = e
                .identify(&Caller(["1.1.1.1:1", "2.2.2.2:1", "3.3.3.3:1"][i]))
                .unwrap();
            assert!(e
                .admit(&store, &id, "/v1/chat/completions", Some(&demand("big")), 0)
                .reply
                .is_none());
        }
        let id = e.identify(&Caller("4.4.4.4:1")).unwrap();
        let v = e.admit(&store, &id, "/v1/chat/completions", Some(&demand("big")), 0);
        assert_eq!(v.labels.reason, "model_rate_limit");
        assert_eq!(v.labels.model, "big");
        let v = e.admit(
            &store,
            &id,
            "/v1/chat/completions",
            Some(&demand("gpt-made-up")),
            0,
        );
        assert!(v.reply.is_none());
        assert_eq!(v.labels.model, "other");
    }
}
