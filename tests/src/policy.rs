//! One builder for the policies the tests write, so a test names only what
//! it is about (a tier's limit, a model's price) over a common ground.
//!
//! ```
//! use serde_json::json;
//! use sluice_tests::policy::PolicyBuilder;
//! let p = PolicyBuilder::one_tier(json!({"requests": "5/min"}))
//!     .model("m", json!({"concurrency": 2}))
//!     .with("audit", json!({"salt": "s"}))
//!     .build();
//! assert_eq!(p["tiers"]["t"]["requests"], "5/min");
//! ```

use serde_json::{json, Map, Value as Json};

/// The tier [`PolicyBuilder::one_tier`] puts every caller in.
pub const TIER: &str = "t";

/// A policy as JSON, built from a common ground. What the builder has no
/// method for goes in with [`PolicyBuilder::with`]; the built value is
/// plain JSON that a test may still edit.
#[derive(Debug, Clone)]
pub struct PolicyBuilder {
    policy: Json,
}

impl PolicyBuilder {
    /// Every caller in one tier [`TIER`] with `tier`'s limits, one principal
    /// per client address; no model listed (so no learned estimate
    /// correction) and outputs capped at 512 tokens by default.
    pub fn one_tier(tier: Json) -> PolicyBuilder {
        PolicyBuilder {
            policy: json!({
                "default_tier": TIER,
                "identity": {"sources": ["client_address"]},
                "tiers": {TIER: tier},
                "models": {},
                "defaults": {"max_output_tokens": 512},
            }),
        }
    }

    /// Callers name themselves (`x-user`) and their tier (`x-tier`), and
    /// are in `default` when they do not; no tier, class or model yet.
    pub fn header_tiers(default: &str) -> PolicyBuilder {
        PolicyBuilder {
            policy: json!({
                "default_tier": default,
                "identity": {"sources": ["trusted_header"],
                             "trusted_header": {"principal": "x-user", "tier": "x-tier"}},
                "tiers": {},
                "models": {},
            }),
        }
    }

    /// Adds (or replaces) tier `name`.
    pub fn tier(self, name: &str, spec: Json) -> PolicyBuilder {
        self.entry("tiers", name, spec)
    }

    /// Adds (or replaces) queueing class `name`.
    pub fn class(self, name: &str, spec: Json) -> PolicyBuilder {
        self.entry("classes", name, spec)
    }

    /// Adds (or replaces) model `name`.
    pub fn model(self, name: &str, spec: Json) -> PolicyBuilder {
        self.entry("models", name, spec)
    }

    /// The output cap of a request that names none (`defaults`).
    pub fn max_output_tokens(mut self, tokens: u64) -> PolicyBuilder {
        self.policy["defaults"]["max_output_tokens"] = json!(tokens);
        self
    }

    /// Sets any other top-level field (`audit`, `request`, `apis`, …).
    pub fn with(mut self, field: &str, value: Json) -> PolicyBuilder {
        self.policy[field] = value;
        self
    }

    /// The policy, as JSON.
    pub fn build(self) -> Json {
        self.policy
    }

    fn entry(mut self, map: &str, name: &str, spec: Json) -> PolicyBuilder {
        if !self.policy[map].is_object() {
            self.policy[map] = Json::Object(Map::new());
        }
        self.policy[map][name] = spec;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_tier_builds_the_common_ground_and_each_addition() {
        let p = PolicyBuilder::one_tier(json!({"daily_tokens": 9}))
            .model("m", json!({"concurrency": 1}))
            .max_output_tokens(64)
            .with("audit", json!({"salt": "s"}))
            .build();
        assert_eq!(
            p,
            json!({
                "default_tier": "t",
                "identity": {"sources": ["client_address"]},
                "tiers": {"t": {"daily_tokens": 9}},
                "models": {"m": {"concurrency": 1}},
                "defaults": {"max_output_tokens": 64},
                "audit": {"salt": "s"},
            })
        );
    }

    #[test]
    fn header_tiers_adds_classes_beside_the_tiers() {
        let p = PolicyBuilder::header_tiers("batch")
            .tier("batch", json!({"class": "batch"}))
            .class("batch", json!({"max_wait": "10s"}))
            .build();
        assert_eq!(p["default_tier"], "batch");
        assert_eq!(p["identity"]["trusted_header"]["tier"], "x-tier");
        assert_eq!(p["tiers"]["batch"]["class"], "batch");
        assert_eq!(p["classes"]["batch"]["max_wait"], "10s");
        assert_eq!(p["models"], json!({}));
    }
}
