//! Who is calling, and in which tier (SPEC §2.1).
//!
//! Sources are tried in the configured order; the first that yields a
//! principal wins. Only what Envoy verified (JWT claims in `jwt_authn`
//! metadata), headers the policy names as trusted, configured API keys and
//! the connection's address are believed: any other identity or tier header a
//! client sends is never read.

use std::collections::{HashMap, HashSet};

use sha2::{Digest, Sha256};

use crate::config::{IdentityConfig, IdentitySource, Policy, UnknownKeys};

/// What the identity step may read of a request.
pub trait RequestView {
    /// A request header, by lower-case name.
    fn header(&self, name: &str) -> Option<String>;
    /// A claim of the JWT payload `jwt_authn` stored at
    /// `metadata[namespace][payload_key]`.
    fn jwt_claim(&self, namespace: &str, payload_key: &str, claim: &str) -> Option<String>;
    /// The downstream peer, `ip:port` or `ip`.
    fn client_address(&self) -> Option<String>;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Printable and safe to log: `jwt:<sub>`, `header:<value>`,
    /// `key:<hash prefix>`, `ip:<address>`. Never a raw key.
    pub principal: String,
    /// Stable 64-bit hash of `principal`, used to place its buckets.
    pub hash: u64,
    pub tier: String,
    pub source: Option<IdentitySource>,
    /// An API key declared in the policy: it has dedicated buckets and is
    /// outside its tier's `anonymous_total`.
    pub declared: bool,
}

/// The caller presented an API key the policy does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownApiKey;

/// The identity part of a policy, ready for the hot path.
#[derive(Debug, Clone)]
pub struct Resolver {
    config: IdentityConfig,
    default_tier: String,
    tiers: Vec<String>,
    /// SHA-256 (hex) of each configured key → tier.
    key_tiers: HashMap<String, String>,
    /// The principal names of those keys.
    declared_principals: HashSet<String>,
}

impl Resolver {
    pub fn new(policy: &Policy) -> Resolver {
        let key_tiers = policy
            .identity
            .api_key
            .iter()
            .flat_map(|c| c.keys.iter())
            .map(|(key, tier)| {
                let hash = match key.strip_prefix("sha256:") {
                    Some(hex) => hex.to_ascii_lowercase(),
                    None => sha256_hex(key.as_bytes()),
                };
                (hash, tier.clone())
            })
            .collect::<HashMap<String, String>>();
        let declared_principals = key_tiers.keys().map(|h| key_principal(h)).collect();
        Resolver {
            declared_principals,
            config: policy.identity.clone(),
            default_tier: policy.default_tier.clone(),
            tiers: policy.tiers.keys().cloned().collect(),
            key_tiers,
        }
    }

    /// `(principal, tier)` of every API key the policy declares, as
    /// [`Resolver::resolve`] names them: their dedicated keys are created
    /// when the policy loads.
    pub fn declared(&self) -> Vec<(String, String)> {
        self.key_tiers
            .iter()
            .map(|(hash, tier)| (key_principal(hash), tier.clone()))
            .collect()
    }

    pub fn resolve(&self, req: &dyn RequestView) -> Result<Identity, UnknownApiKey> {
        for source in &self.config.sources {
            if let Some((principal, tier)) = self.try_source(*source, req)? {
                let mut id = self.identity(principal, tier, Some(*source));
                // Only a key found in the policy's map: its tier came from it.
                id.declared = *source == IdentitySource::ApiKey
                    && self.declared_principals.contains(&id.principal);
                return Ok(id);
            }
        }
        Ok(self.identity("anonymous".into(), None, None))
    }

    fn try_source(
        &self,
        source: IdentitySource,
        req: &dyn RequestView,
    ) -> Result<Option<(String, Option<String>)>, UnknownApiKey> {
        let cfg = &self.config;
        Ok(match source {
            IdentitySource::Jwt => cfg.jwt.as_ref().and_then(|jwt| {
                let claim =
                    |name: &str| req.jwt_claim(&jwt.metadata_namespace, &jwt.payload_key, name);
                let subject = claim(&jwt.principal_claim).filter(|s| !s.is_empty())?;
                let tier = jwt.tier_claim.as_deref().and_then(claim);
                Some((format!("jwt:{subject}"), tier))
            }),
            IdentitySource::TrustedHeader => cfg.trusted_header.as_ref().and_then(|h| {
                let who = req.header(&h.principal).filter(|s| !s.is_empty())?;
                let tier = h.tier.as_deref().and_then(|name| req.header(name));
                Some((format!("header:{who}"), tier))
            }),
            IdentitySource::ApiKey => match cfg.api_key.as_ref() {
                None => None,
                Some(k) => {
                    let raw = req.header(&k.header).map(|v| {
                        if k.header == "authorization" {
                            v.strip_prefix("Bearer ").unwrap_or(&v).trim().to_string()
                        } else {
                            v.trim().to_string()
                        }
                    });
                    match raw.filter(|v| !v.is_empty()) {
                        None => None,
                        Some(raw) => {
                            let hash = sha256_hex(raw.as_bytes());
                            let tier = self.key_tiers.get(&hash).cloned();
                            if tier.is_none() && k.unknown_keys == UnknownKeys::Reject {
                                return Err(UnknownApiKey);
                            }
                            Some((key_principal(&hash), tier))
                        }
                    }
                }
            },
            IdentitySource::ClientAddress => req
                .client_address()
                .map(|addr| (format!("ip:{}", strip_port(&addr)), None)),
        })
    }

    fn identity(
        &self,
        principal: String,
        tier: Option<String>,
        source: Option<IdentitySource>,
    ) -> Identity {
        let tier = tier
            .filter(|t| self.tiers.iter().any(|known| known == t))
            .unwrap_or_else(|| self.default_tier.clone());
        let hash = principal_hash(&principal);
        Identity {
            principal,
            hash,
            tier,
            source,
            declared: false,
        }
    }
}

/// How an API key is named as a principal: a prefix of its SHA-256.
fn key_principal(hash: &str) -> String {
    format!("key:{}", hash.get(..16).unwrap_or(hash))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a, 64 bits: stable across builds (slots survive an upgrade) and
/// cheap on every request. It only places buckets: a crafted collision can
/// at worst share a slot chain or budget-sketch cells, which refuses early,
/// never admits more.
fn principal_hash(principal: &str) -> u64 {
    principal.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `1.2.3.4:5678` → `1.2.3.4`, `[::1]:5678` → `::1`.
fn strip_port(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.chars().all(|c| c.is_ascii_digit()) => {
            host
        }
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Default)]
    struct Req {
        headers: HashMap<String, String>,
        claims: HashMap<String, String>,
        addr: Option<String>,
    }
    impl RequestView for Req {
        fn header(&self, name: &str) -> Option<String> {
            self.headers.get(name).cloned()
        }
        fn jwt_claim(&self, ns: &str, key: &str, claim: &str) -> Option<String> {
            assert_eq!((ns, key), ("envoy.filters.http.jwt_authn", "jwt_payload"));
            self.claims.get(claim).cloned()
        }
        fn client_address(&self) -> Option<String> {
            self.addr.clone()
        }
    }

    fn resolver(identity: serde_json::Value) -> Resolver {
        let policy = Policy::from_value(json!({
            "default_tier": "free",
            "tiers": {"free": {}, "pro": {}, "enterprise": {}},
            "identity": identity,
        }))
        .unwrap();
        Resolver::new(&policy)
    }

    fn req(headers: &[(&str, &str)], claims: &[(&str, &str)], addr: &str) -> Req {
        Req {
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            claims: claims
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            addr: Some(addr.to_string()),
        }
    }

    #[test]
    fn order_decides_and_jwt_tier_is_honoured() {
        let r = resolver(json!({
            "sources": ["jwt", "api_key", "client_address"],
            "jwt": {"tier_claim": "tier"},
            "api_key": {"keys": {"k-pro": "pro"}},
        }));
        let id = r
            .resolve(&req(
                &[("x-api-key", "k-pro")],
                &[("sub", "alice"), ("tier", "enterprise")],
                "10.0.0.1:5",
            ))
            .unwrap();
        assert_eq!(
            (id.principal.as_str(), id.tier.as_str()),
            ("jwt:alice", "enterprise")
        );
        let id = r
            .resolve(&req(&[("x-api-key", "k-pro")], &[], "10.0.0.1:5"))
            .unwrap();
        assert_eq!(id.tier, "pro");
        assert!(id.principal.starts_with("key:") && !id.principal.contains("k-pro"));
        let id = r.resolve(&req(&[], &[], "10.0.0.1:5")).unwrap();
        assert_eq!(
            (id.principal.as_str(), id.tier.as_str()),
            ("ip:10.0.0.1", "free")
        );
    }

    #[test]
    fn untrusted_identity_headers_are_ignored() {
        let r = resolver(json!({"sources": ["client_address"]}));
        let id = r
            .resolve(&req(
                &[("x-sluice-user", "ceo"), ("x-sluice-tier", "enterprise")],
                &[],
                "127.0.0.1:9",
            ))
            .unwrap();
        assert_eq!(
            (id.principal.as_str(), id.tier.as_str()),
            ("ip:127.0.0.1", "free")
        );
    }

    #[test]
    fn trusted_header_and_unknown_tier_fall_back_to_default() {
        let r = resolver(json!({
            "sources": ["trusted_header", "client_address"],
            "trusted_header": {"principal": "x-auth-user", "tier": "x-auth-tier"},
        }));
        let id = r
            .resolve(&req(
                &[("x-auth-user", "bob"), ("x-auth-tier", "platinum")],
                &[],
                "1.1.1.1:1",
            ))
            .unwrap();
        assert_eq!(
            (id.principal.as_str(), id.tier.as_str()),
            ("header:bob", "free")
        );
    }

    #[test]
    fn unknown_keys_are_rejected_unless_allowed() {
        let r = resolver(json!({"sources": ["api_key"], "api_key": {"keys": {"good": "pro"}}}));
        assert_eq!(
            r.resolve(&req(&[("x-api-key", "made-up")], &[], "1.1.1.1:1")),
            Err(UnknownApiKey)
        );
        let r = resolver(json!({"sources": ["api_key"],
            "api_key": {"header": "authorization", "unknown_keys": "default_tier",
                        "keys": {format!("sha256:{}", sha256_hex(b"good")): "pro"}}}));
        let id = r
            .resolve(&req(&[("authorization", "Bearer good")], &[], "1.1.1.1:1"))
            .unwrap();
        assert_eq!(id.tier, "pro");
        let id = r
            .resolve(&req(&[("authorization", "Bearer other")], &[], "1.1.1.1:1"))
            .unwrap();
        assert_eq!(id.tier, "free");
    }

    #[test]
    fn addresses_lose_their_port() {
        assert_eq!(strip_port("127.0.0.1:8080"), "127.0.0.1");
        assert_eq!(strip_port("[::1]:8080"), "::1");
        assert_eq!(strip_port("::1"), "::1");
        assert_eq!(strip_port("10.0.0.1"), "10.0.0.1");
    }
}
