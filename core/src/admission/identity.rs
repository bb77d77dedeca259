//! Who is calling, and in which tier (docs/src/design.md, "Identify").
//!
//! Sources are tried in the configured order; the first that yields a
//! principal wins. Only what Envoy verified (JWT claims in `jwt_authn`
//! metadata), headers the policy names as trusted, configured API keys and
//! the connection's address are believed: any other identity or tier header a
//! client sends is never read.
//!
//! Before any source, the credentials a request presents are read once
//! ([`Resolver::presented`]), so that the rules of the front door hold
//! whatever the order of sources:
//! - `Authorization: Bearer <token>` (scheme in any case) carries either a
//!   JWT or an API key. A token with a `.` is a JWT (Envoy's `jwt_authn`
//!   tries every such token as one); it counts only if `jwt_authn` verified
//!   it, i.e. its principal claim is in the metadata, and is refused
//!   otherwise — never read for claims, never downgraded to a key lookup.
//!   Any other token is an API key (`api_key.bearer`, on by default).
//! - The key header (`x-api-key`) carries an API key.
//! - A request presents one credential: two different ones (a bearer key
//!   and another `x-api-key`, or a JWT and an `x-api-key`), or a credential
//!   header given twice, are refused, so that nothing after sluice (the
//!   upstream with pass-through keys) can read another one than sluice did.
//! - A credential header that is present but empty is refused, not taken as
//!   "no credential".

use hashbrown::{HashMap, HashSet};
use std::borrow::Cow;
use std::cell::RefCell;
use std::net::{IpAddr, Ipv6Addr};

use crate::policy::keys::{key_principal, sha256_hex, HashKey};
use crate::policy::{IdentityConfig, IdentitySource, KeyEntry, Policy, UnknownKeys};

/// What the identity step may read of a request.
pub trait RequestView {
    /// A request header, by lower-case name (the first, if repeated);
    /// borrowed where the view holds the headers (the request's snapshot).
    fn header(&self, name: &str) -> Option<Cow<'_, str>>;
    /// How many times the header appears. Asked only of credential headers
    /// that are present, to refuse a repeated one.
    fn header_count(&self, name: &str) -> usize {
        usize::from(self.header(name).is_some())
    }
    /// A claim of the JWT payload `jwt_authn` stored at
    /// `metadata[namespace][payload_key]`.
    fn jwt_claim(&self, namespace: &str, payload_key: &str, claim: &str) -> Option<String>;
    /// The downstream peer, `ip:port` or `ip`.
    fn client_address(&self) -> Option<String>;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Printable and safe to log: `jwt:<iss>#<sub>` (see [`jwt_principal`]),
    /// `header:<value>`, `key:<hash prefix>`, `ip:<address>` (see
    /// [`caller_address`]). Never a raw key.
    pub principal: String,
    /// Stable 64-bit hash of `principal`, used to place its buckets.
    pub hash: u64,
    pub tier: String,
    pub source: Option<IdentitySource>,
    /// An API key declared in the policy: it has dedicated buckets and is
    /// outside its tier's `anonymous_total`.
    pub declared: bool,
    /// The caller's team and organisation, when the key map, a verified
    /// claim or a trusted header names one the policy declares.
    pub team: Option<String>,
    pub org: Option<String>,
    /// The request's run (`runs`): its id hashed with the principal under
    /// the deployment's key; set once the body is read.
    pub run: Option<u64>,
}

/// What a source says about the caller, before it is checked against the
/// policy.
struct Asserted {
    principal: String,
    tier: Option<String>,
    team: Option<String>,
    org: Option<String>,
}

impl Asserted {
    fn new(principal: String, tier: Option<String>) -> Asserted {
        Asserted {
            principal,
            tier,
            team: None,
            org: None,
        }
    }
}

/// Why the front door refused a request (401 `invalid_api_key`). The
/// messages never echo what the client sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthRefusal {
    /// An API key the policy does not know (`unknown_keys: reject`).
    UnknownKey,
    /// A bearer JWT that `jwt_authn` did not verify, or that names no
    /// principal or no issuer.
    UnverifiedJwt,
    /// Two different credentials in one request.
    ConflictingCredentials,
    /// A credential header with nothing in it.
    EmptyCredential,
}

impl AuthRefusal {
    /// The label of `sluice_auth_failures_total{reason}`.
    pub fn code(self) -> &'static str {
        match self {
            AuthRefusal::UnknownKey => "unknown_key",
            AuthRefusal::UnverifiedJwt => "unverified_jwt",
            AuthRefusal::ConflictingCredentials => "conflicting_credentials",
            AuthRefusal::EmptyCredential => "empty_credential",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            AuthRefusal::UnknownKey => "The API key is not valid.",
            AuthRefusal::UnverifiedJwt => {
                "The bearer token is a JWT that could not be verified (or names no subject or no issuer)."
            }
            AuthRefusal::ConflictingCredentials => {
                "The request carries more than one credential (Authorization, the API key header, or one of them twice); send one."
            }
            AuthRefusal::EmptyCredential => "The credential header is empty.",
        }
    }
}

/// The credentials a request presents, read once before the sources.
#[derive(Debug, Default)]
struct Presented {
    /// The API key, from `Authorization: Bearer` or the key header.
    key: Option<String>,
}

/// The identity part of a policy, ready for the hot path.
#[derive(Debug, Clone)]
pub struct Resolver {
    config: IdentityConfig,
    default_tier: String,
    tiers: Vec<String>,
    teams: HashSet<String>,
    orgs: HashSet<String>,
    /// SHA-256 (hex) of each configured key → tier, team, org.
    key_tiers: HashMap<String, KeyEntry>,
    /// The principal names of those keys.
    declared_principals: HashSet<String>,
    /// SHA-256 (hex) of keys seen lately: a client sends the same key on
    /// every request, and hashing it each time was a measurable part of the
    /// request path. Bounded (see [`KEY_HASH_CACHE`]).
    /// Keyed by what callers send: std's map, whose SipHash a caller cannot
    /// aim collisions at (the others here are keyed by the policy).
    key_hashes: RefCell<std::collections::HashMap<String, String>>,
    /// The prefix an IPv6 client address counts by.
    ipv6_prefix: u8,
    /// The deployment's hash key (see [`HashKey`]); set when the policy
    /// loads, the unkeyed default until then (tests).
    key: HashKey,
}

/// Most API keys whose hash one VM remembers. When full, the cache starts
/// over: a client sending ever new keys costs a hash per request, as without
/// a cache, and memory stays bounded.
pub const KEY_HASH_CACHE: usize = 1024;

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
            .collect::<HashMap<String, KeyEntry>>();
        let declared_principals = key_tiers.keys().map(|h| key_principal(h)).collect();
        Resolver {
            declared_principals,
            config: policy.identity.clone(),
            default_tier: policy.default_tier.clone(),
            tiers: policy.tiers.keys().cloned().collect(),
            teams: policy.teams.keys().cloned().collect(),
            orgs: policy.orgs.keys().cloned().collect(),
            key_tiers,
            key_hashes: RefCell::default(),
            ipv6_prefix: crate::policy::identity::ipv6_prefix(policy),
            key: HashKey::default(),
        }
    }

    /// Places callers with `key` from now on.
    pub fn set_key(&mut self, key: HashKey) {
        self.key = key;
    }

    /// `(principal, tier)` of every API key the policy declares, as
    /// [`Resolver::resolve`] names them: their dedicated keys are created
    /// when the policy loads.
    pub fn declared(&self) -> Vec<(String, String)> {
        self.key_tiers
            .iter()
            .map(|(hash, entry)| (key_principal(hash), entry.tier.clone()))
            .collect()
    }

    /// SHA-256 (hex) of a presented key, from the cache when seen before.
    fn key_hash(&self, key: &str) -> String {
        let Ok(mut cache) = self.key_hashes.try_borrow_mut() else {
            return sha256_hex(key.as_bytes());
        };
        if let Some(hash) = cache.get(key) {
            return hash.clone();
        }
        let hash = sha256_hex(key.as_bytes());
        if cache.len() >= KEY_HASH_CACHE {
            cache.clear();
        }
        cache.insert(key.to_string(), hash.clone());
        hash
    }

    pub fn resolve(&self, req: &dyn RequestView) -> Result<Identity, AuthRefusal> {
        let presented = self.presented(req)?;
        for source in &self.config.sources {
            if let Some(claimed) = self.try_source(*source, req, &presented)? {
                let mut id = self.identity(claimed, Some(*source));
                // Only a key found in the policy's map: its tier came from it.
                id.declared = *source == IdentitySource::ApiKey
                    && self.declared_principals.contains(&id.principal);
                return Ok(id);
            }
        }
        Ok(self.identity(Asserted::new("anonymous".into(), None), None))
    }

    /// Reads and checks the request's credentials (the rules are in the
    /// module comment).
    fn presented(&self, req: &dyn RequestView) -> Result<Presented, AuthRefusal> {
        let key_cfg = self.config.api_key.as_ref();
        let is_auth = |name: &str| name.eq_ignore_ascii_case("authorization");
        let bearer_keys = key_cfg.is_some_and(|k| k.bearer || is_auth(&k.header));
        // Envoy hands sluice the first of repeated headers; the upstream may
        // read another.
        let once = |name: &str| match req.header(name) {
            Some(_) if req.header_count(name) > 1 => Err(AuthRefusal::ConflictingCredentials),
            value => Ok(value),
        };
        let header_key = match key_cfg {
            Some(k) if !is_auth(&k.header) => match once(&k.header)? {
                None => None,
                Some(v) if v.trim().is_empty() => return Err(AuthRefusal::EmptyCredential),
                Some(v) => Some(v.trim().to_string()),
            },
            _ => None,
        };
        // Authorization is sluice's only when it may hold a JWT or a key;
        // otherwise (e.g. `Basic`, or no JWT or bearer key configured) it is
        // left to whatever reads it after sluice.
        let reads_bearer = bearer_keys || self.config.jwt.is_some();
        let bearer = match reads_bearer {
            true => once("authorization")?.map_or(Ok(None), |v| bearer_token(&v))?,
            false => None,
        };
        let mut bearer_key = None;
        if let Some(token) = bearer {
            let looks_jwt = token.contains('.');
            let known = self.key_tiers.contains_key(&self.key_hash(&token));
            if bearer_keys && (known || !looks_jwt) {
                bearer_key = Some(token);
            } else if looks_jwt {
                if self.jwt_caller(req).is_none() {
                    return Err(AuthRefusal::UnverifiedJwt);
                }
                if header_key.is_some() {
                    return Err(AuthRefusal::ConflictingCredentials);
                }
            }
            // Else bearer keys are off and this is no JWT: not sluice's.
        }
        let key = match (bearer_key, header_key) {
            (Some(a), Some(b)) if a != b => return Err(AuthRefusal::ConflictingCredentials),
            (a, b) => a.or(b),
        };
        Ok(Presented { key })
    }

    /// The principal of a JWT `jwt_authn` verified: its issuer and its
    /// principal claim, both required. A subject is unique only within its
    /// issuer (OpenID Connect Core §2), so with two providers the same `sub`
    /// may be two people; a token without `iss` could be anyone's and is
    /// refused rather than given a principal another issuer's token shares.
    fn jwt_caller(&self, req: &dyn RequestView) -> Option<String> {
        let jwt = self.config.jwt.as_ref()?;
        let claim = |name: &str| {
            req.jwt_claim(&jwt.metadata_namespace, &jwt.payload_key, name)
                .filter(|s| !s.is_empty())
        };
        let subject = claim(&jwt.principal_claim)?;
        let issuer = claim(ISSUER_CLAIM)?;
        Some(jwt_principal(&issuer, &subject))
    }

    fn try_source(
        &self,
        source: IdentitySource,
        req: &dyn RequestView,
        presented: &Presented,
    ) -> Result<Option<Asserted>, AuthRefusal> {
        let cfg = &self.config;
        Ok(match source {
            IdentitySource::Jwt => cfg.jwt.as_ref().and_then(|jwt| {
                let principal = self.jwt_caller(req)?;
                let claim = |name: Option<&String>| {
                    name.and_then(|n| req.jwt_claim(&jwt.metadata_namespace, &jwt.payload_key, n))
                };
                Some(Asserted {
                    principal,
                    tier: claim(jwt.tier_claim.as_ref()),
                    team: claim(jwt.team_claim.as_ref()),
                    org: claim(jwt.org_claim.as_ref()),
                })
            }),
            IdentitySource::TrustedHeader => cfg.trusted_header.as_ref().and_then(|h| {
                let who = req.header(&h.principal).filter(|s| !s.is_empty())?;
                let header =
                    |name: Option<&String>| name.and_then(|n| req.header(n)).map(Cow::into_owned);
                Some(Asserted {
                    principal: format!("header:{who}"),
                    tier: header(h.tier.as_ref()),
                    team: header(h.team.as_ref()),
                    org: header(h.org.as_ref()),
                })
            }),
            IdentitySource::ApiKey => match (cfg.api_key.as_ref(), presented.key.as_ref()) {
                (Some(k), Some(raw)) => {
                    let hash = self.key_hash(raw);
                    let entry = self.key_tiers.get(&hash);
                    if entry.is_none() && k.unknown_keys == UnknownKeys::Reject {
                        return Err(AuthRefusal::UnknownKey);
                    }
                    Some(Asserted {
                        principal: key_principal(&hash),
                        tier: entry.map(|e| e.tier.clone()),
                        team: entry.and_then(|e| e.team.clone()),
                        org: entry.and_then(|e| e.org.clone()),
                    })
                }
                _ => None,
            },
            IdentitySource::ClientAddress => req
                .client_address()
                .map(|addr| Asserted::new(address_principal(&addr, self.ipv6_prefix), None)),
        })
    }

    fn identity(&self, claimed: Asserted, source: Option<IdentitySource>) -> Identity {
        let Asserted {
            principal,
            tier,
            team,
            org,
        } = claimed;
        let tier = tier
            .filter(|t| self.tiers.iter().any(|known| known == t))
            .unwrap_or_else(|| self.default_tier.clone());
        // Only declared teams and orgs have buckets: an unknown name counts
        // as none (its members keep their tier's limits).
        let team = team.filter(|t| self.teams.contains(t));
        let org = org.filter(|o| self.orgs.contains(o));
        let hash = self.key.hash(principal.as_bytes());
        Identity {
            principal,
            hash,
            tier,
            source,
            declared: false,
            team,
            org,
            run: None,
        }
    }
}

/// The registered claim naming who issued a JWT (RFC 7519 §4.1.1).
const ISSUER_CLAIM: &str = "iss";

/// `jwt:<issuer>#<subject>`, with `%` and `#` in the issuer written `%25`
/// and `%23`: the first `#` always ends the issuer, so no two (issuer,
/// subject) pairs share a principal, whatever characters either holds.
fn jwt_principal(issuer: &str, subject: &str) -> String {
    let mut principal = String::with_capacity(5 + issuer.len() + subject.len());
    principal.push_str("jwt:");
    for c in issuer.chars() {
        match c {
            '%' => principal.push_str("%25"),
            '#' => principal.push_str("%23"),
            c => principal.push(c),
        }
    }
    principal.push('#');
    principal.push_str(subject);
    principal
}

/// The token of `Bearer <token>`, the scheme in any case (RFC 9110 §11.1);
/// `None` for another scheme, a refusal for a bearer with no token.
fn bearer_token(value: &str) -> Result<Option<String>, AuthRefusal> {
    let value = value.trim();
    let (scheme, token) = value.split_once([' ', '\t']).unwrap_or((value, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Ok(None);
    }
    match token.trim() {
        "" => Err(AuthRefusal::EmptyCredential),
        token => Ok(Some(token.to_string())),
    }
}

/// The one place that says which addresses are one caller: an IPv4
/// address whole, an IPv4 address mapped into IPv6 (`::ffff:1.2.3.4`, how a
/// dual-stack listener sees IPv4 clients) as that IPv4 address, an IPv6
/// address by its first `v6_prefix` bits, written `<network>/<bits>`
/// (whole, without `/128`, at 128). The port is dropped; anything that does
/// not parse as an address counts as written.
pub(crate) fn caller_address(addr: &str, v6_prefix: u8) -> String {
    let bare = strip_port(addr);
    match bare.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.to_string(),
        Ok(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None if v6_prefix >= 128 => v6.to_string(),
            None => {
                let bits = u32::from(v6_prefix);
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                format!("{}/{bits}", Ipv6Addr::from(u128::from(v6) & mask))
            }
        },
        Err(_) => bare.to_string(),
    }
}

/// The principal of a caller known by its address, `ip:<caller_address>`.
fn address_principal(addr: &str, v6_prefix: u8) -> String {
    format!("ip:{}", caller_address(addr, v6_prefix))
}

/// The hash of a client address as a principal: what the penalty box
/// counts an address by, the same value the address's buckets are placed
/// by (both under the deployment's key).
pub(crate) fn address_hash(key: &HashKey, addr: &str, v6_prefix: u8) -> u64 {
    key.hash(address_principal(addr, v6_prefix).as_bytes())
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
        /// Headers that appear a second time.
        repeated: Vec<String>,
        claims: HashMap<String, String>,
        addr: Option<String>,
    }
    impl RequestView for Req {
        fn header(&self, name: &str) -> Option<Cow<'_, str>> {
            self.headers.get(name).cloned().map(Cow::Owned)
        }
        fn header_count(&self, name: &str) -> usize {
            usize::from(self.headers.contains_key(name))
                + self.repeated.iter().filter(|r| *r == name).count()
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
            repeated: Vec::new(),
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
                &[("iss", "idp"), ("sub", "alice"), ("tier", "enterprise")],
                "10.0.0.1:5",
            ))
            .unwrap();
        assert_eq!(
            (id.principal.as_str(), id.tier.as_str()),
            ("jwt:idp#alice", "enterprise")
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
            Err(AuthRefusal::UnknownKey)
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

    /// The shipped identity section: JWT, then API key, then address.
    fn front_door() -> Resolver {
        resolver(json!({
            "sources": ["jwt", "api_key", "client_address"],
            "jwt": {"tier_claim": "tier"},
            "api_key": {"keys": {"k-free": "free", "k-pro": "pro"}},
        }))
    }

    fn who(
        r: &Resolver,
        headers: &[(&str, &str)],
        claims: &[(&str, &str)],
    ) -> Result<(String, String), AuthRefusal> {
        r.resolve(&req(headers, claims, "10.0.0.9:1"))
            .map(|id| (id.principal, id.tier))
    }

    #[test]
    fn bearer_keys_are_api_keys_in_any_case_of_the_scheme() {
        let r = front_door();
        for auth in [
            "Bearer k-pro",
            "bearer k-pro",
            "BEARER  k-pro ",
            "Bearer\tk-pro",
        ] {
            let (principal, tier) = who(&r, &[("authorization", auth)], &[]).unwrap();
            assert_eq!(tier, "pro", "{auth:?}");
            assert!(principal.starts_with("key:") && !principal.contains("k-pro"));
        }
        // The same key in either place is the same principal.
        assert_eq!(
            who(&r, &[("authorization", "Bearer k-pro")], &[]),
            who(&r, &[("x-api-key", "k-pro")], &[])
        );
        assert_eq!(
            who(&r, &[("authorization", "Bearer made-up")], &[]),
            Err(AuthRefusal::UnknownKey)
        );
        // Another scheme is not sluice's (it may be the upstream's).
        let (principal, _) = who(&r, &[("authorization", "Basic a2V5OnB3")], &[]).unwrap();
        assert_eq!(principal, "ip:10.0.0.9");
    }

    #[test]
    fn empty_credentials_are_refused_not_ignored() {
        let r = front_door();
        for headers in [
            &[("authorization", "Bearer")][..],
            &[("authorization", "Bearer   ")],
            &[("x-api-key", "")],
            &[("x-api-key", "  ")],
        ] {
            assert_eq!(
                who(&r, headers, &[]),
                Err(AuthRefusal::EmptyCredential),
                "{headers:?}"
            );
        }
    }

    #[test]
    fn two_different_credentials_are_refused() {
        let r = front_door();
        let both = |a: &str, b: &str| who(&r, &[("authorization", a), ("x-api-key", b)], &[]);
        assert_eq!(both("Bearer k-pro", "k-pro").unwrap().1, "pro");
        assert_eq!(
            both("Bearer k-free", "k-pro"),
            Err(AuthRefusal::ConflictingCredentials)
        );
        assert_eq!(
            both("Bearer made-up", "k-pro"),
            Err(AuthRefusal::ConflictingCredentials)
        );
        // One credential header twice, even with one value.
        for name in ["authorization", "x-api-key"] {
            let mut twice = req(
                &[("authorization", "Bearer k-pro"), ("x-api-key", "k-pro")],
                &[],
                "1.1.1.1:1",
            );
            twice.repeated.push(name.into());
            assert_eq!(
                r.resolve(&twice),
                Err(AuthRefusal::ConflictingCredentials),
                "{name}"
            );
        }
        // A verified JWT and a key: still two credentials.
        assert_eq!(
            who(
                &r,
                &[("authorization", "Bearer h.p.s"), ("x-api-key", "k-pro")],
                &[("iss", "idp"), ("sub", "alice")]
            ),
            Err(AuthRefusal::ConflictingCredentials)
        );
    }

    #[test]
    fn a_bearer_jwt_counts_only_when_verified() {
        let r = front_door();
        let jwt = [("authorization", "Bearer eyJh.eyJz.c2ln")];
        // jwt_authn verified it: its claims, and only those.
        assert_eq!(
            who(
                &r,
                &jwt,
                &[("iss", "idp"), ("sub", "alice"), ("tier", "pro")]
            ),
            Ok(("jwt:idp#alice".into(), "pro".into()))
        );
        // Verified, but naming no issuer: whose alice would it be?
        for claims in [&[("sub", "alice")][..], &[("iss", ""), ("sub", "alice")]] {
            assert_eq!(who(&r, &jwt, claims), Err(AuthRefusal::UnverifiedJwt));
        }
        // Not verified (no metadata), or verified but with no subject.
        assert_eq!(who(&r, &jwt, &[]), Err(AuthRefusal::UnverifiedJwt));
        assert_eq!(
            who(&r, &jwt, &[("tier", "pro")]),
            Err(AuthRefusal::UnverifiedJwt)
        );
        // Anything with a dot is a JWT to jwt_authn: never a key lookup,
        // even where unknown keys would get the default tier.
        let lenient = resolver(json!({
            "sources": ["api_key", "client_address"],
            "api_key": {"unknown_keys": "default_tier"},
        }));
        assert_eq!(
            who(&lenient, &[("authorization", "Bearer not.a-key")], &[]),
            Err(AuthRefusal::UnverifiedJwt)
        );
        assert_eq!(
            who(&lenient, &[("authorization", "Bearer other")], &[])
                .unwrap()
                .1,
            "free"
        );
        // A configured key that happens to hold dots is still that key.
        let dotted = resolver(json!({
            "sources": ["api_key"], "api_key": {"keys": {"k.pro.1": "pro"}},
        }));
        assert_eq!(
            who(&dotted, &[("authorization", "Bearer k.pro.1")], &[])
                .unwrap()
                .1,
            "pro"
        );
    }

    #[test]
    fn a_jwt_subject_is_a_principal_only_with_its_issuer() {
        let r = front_door();
        let jwt = [("authorization", "Bearer eyJh.eyJz.c2ln")];
        let principal =
            |iss: &str, sub: &str| who(&r, &jwt, &[("iss", iss), ("sub", sub)]).map(|(p, _)| p);
        assert_ne!(
            principal("https://a.example", "alice"),
            principal("https://b.example", "alice")
        );
        // Pairs that a plain `iss#sub` (or `iss:sub`) would join into one
        // string stay apart, and each reads back as what it was.
        let pairs = [
            ("a", "b#c"),
            ("a#b", "c"),
            ("a%23b", "c"),
            ("a", "%23b#c"),
            ("a%", "23#b"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("", "x"),
        ];
        let mut seen = HashSet::new();
        for (iss, sub) in pairs {
            let p = jwt_principal(iss, sub);
            assert!(seen.insert(p.clone()), "{iss:?} {sub:?} → {p:?} collides");
            let (enc, back_sub) = p["jwt:".len()..].split_once('#').unwrap();
            let mut back_iss = String::new();
            let mut rest = enc;
            while let Some((head, tail)) = rest.split_once('%') {
                back_iss.push_str(head);
                back_iss.push(match &tail[..2] {
                    "23" => '#',
                    "25" => '%',
                    other => unreachable!("an escape sluice never writes: %{other}"),
                });
                rest = &tail[2..];
            }
            back_iss.push_str(rest);
            assert_eq!((back_iss.as_str(), back_sub), (iss, sub), "{p}");
        }
        assert_eq!(
            principal("https://idp.example/realms/x#y%z", "alice").unwrap(),
            "jwt:https://idp.example/realms/x%23y%25z#alice"
        );
    }

    #[test]
    fn bearer_lookup_can_be_turned_off() {
        let r = resolver(json!({
            "sources": ["api_key", "client_address"],
            "api_key": {"bearer": false, "keys": {"k-pro": "pro"}},
        }));
        // Authorization is left alone: neither a key nor a refusal.
        for auth in ["Bearer k-pro", "Bearer a.b.c", "Bearer"] {
            let (principal, tier) = who(&r, &[("authorization", auth)], &[]).unwrap();
            assert_eq!((principal.as_str(), tier.as_str()), ("ip:10.0.0.9", "free"));
        }
        assert_eq!(who(&r, &[("x-api-key", "k-pro")], &[]).unwrap().1, "pro");
    }

    #[test]
    fn key_hashes_are_cached_bounded_and_equal_to_sha256() {
        let r = front_door();
        assert_eq!(
            crate::policy::keys::hex(&[0x00, 0x0f, 0xa5, 0xff]),
            "000fa5ff",
            "hex is lower-case, two digits a byte"
        );
        let first = r.key_hash("some-key");
        assert_eq!(first, sha256_hex(b"some-key"));
        assert_eq!(r.key_hash("some-key"), first, "from the cache");
        for i in 0..KEY_HASH_CACHE + 10 {
            let key = format!("k{i}");
            assert_eq!(r.key_hash(&key), sha256_hex(key.as_bytes()));
        }
        assert!(r.key_hashes.borrow().len() <= KEY_HASH_CACHE);
        assert_eq!(
            r.key_hash("some-key"),
            first,
            "after the cache started over"
        );
    }

    #[test]
    fn an_ipv6_caller_is_its_prefix_and_a_mapped_ipv4_its_ipv4() {
        let at = |addr: &str| caller_address(addr, 64);
        assert_eq!(at("[2001:db8:1:2::1]:443"), "2001:db8:1:2::/64");
        assert_eq!(
            at("[2001:db8:1:2:ffff:ffff:ffff:ffff]:1"),
            "2001:db8:1:2::/64"
        );
        assert_eq!(at("2001:db8:1:3::1"), "2001:db8:1:3::/64");
        assert_eq!(at("[::ffff:10.1.2.3]:80"), "10.1.2.3");
        assert_eq!(at("10.1.2.3:80"), "10.1.2.3");
        assert_eq!(caller_address("[2001:db8:1:2::1]:1", 48), "2001:db8:1::/48");
        assert_eq!(caller_address("[2001:db8::1]:1", 128), "2001:db8::1");
        assert_eq!(caller_address("[::1]:1", 1), "::/1");
        assert_eq!(at("not-an-address"), "not-an-address");
        // Principal, bucket placement and the penalty box's count all
        // follow: one /64 is one caller.
        let r = resolver(json!({"sources": ["client_address"]}));
        let id = |addr: &str| r.resolve(&req(&[], &[], addr)).unwrap();
        let (a, b) = (id("[2001:db8:1:2::1]:5"), id("[2001:db8:1:2::beef]:6"));
        assert_eq!(a, b);
        assert_eq!(a.principal, "ip:2001:db8:1:2::/64");
        assert_eq!(
            a.hash,
            address_hash(&HashKey::default(), "[2001:db8:1:2::77]:9", 64)
        );
        assert_ne!(a.hash, id("[2001:db8:1:3::1]:5").hash);
        assert_eq!(id("[::ffff:1.2.3.4]:5"), id("1.2.3.4:6"));
        // The prefix is the policy's, written once.
        let wide = resolver(json!({"sources": ["client_address"], "ipv6_prefix": 48}));
        let w = |addr: &str| wide.resolve(&req(&[], &[], addr)).unwrap().principal;
        assert_eq!(w("[2001:db8:1:2::1]:5"), w("[2001:db8:1:ff::1]:5"));
        assert_eq!(w("[2001:db8:1:2::1]:5"), "ip:2001:db8:1::/48");
    }

    #[test]
    fn where_a_caller_lands_depends_on_the_deployment_key() {
        let keyed = |key: HashKey| {
            let mut r = resolver(json!({"sources": ["client_address"]}));
            r.set_key(key);
            r.resolve(&req(&[], &[], "10.0.0.7:1")).unwrap()
        };
        let (a, b) = (HashKey::derive("t", b"one"), HashKey::derive("t", b"two"));
        // The same key places a caller the same way in every worker and
        // every Envoy that holds it; another key, elsewhere: an outsider
        // who does not hold it cannot compute where anyone lands.
        assert_eq!(keyed(a).hash, keyed(a).hash);
        assert_ne!(keyed(a).hash, keyed(b).hash);
        assert_eq!(keyed(a).principal, keyed(b).principal);
        assert_eq!(
            keyed(a).hash,
            address_hash(&a, "10.0.0.7:2", 64),
            "the penalty box counts an address where its buckets are"
        );
    }

    #[test]
    fn the_ipv6_prefix_is_one_value_checked_with_its_path() {
        let policy = |identity: serde_json::Value, abuse: Option<serde_json::Value>| {
            let mut v =
                json!({"default_tier": "free", "tiers": {"free": {}}, "identity": identity});
            if let Some(a) = abuse {
                v["abuse"] = a;
            }
            Policy::from_value(v)
        };
        let abuse =
            |bits: u8| json!({"threshold": "5/min", "block_for": "1m", "ipv6_prefix": bits});
        let prefix = |p: Result<Policy, crate::policy::ConfigError>| {
            crate::policy::identity::ipv6_prefix(&p.unwrap())
        };
        assert_eq!(prefix(policy(json!({}), None)), 64);
        assert_eq!(prefix(policy(json!({"ipv6_prefix": 56}), None)), 56);
        // Where older configs wrote it: it counts for identity too.
        assert_eq!(prefix(policy(json!({}), Some(abuse(48)))), 48);
        assert_eq!(
            prefix(policy(json!({"ipv6_prefix": 48}), Some(abuse(48)))),
            48
        );
        for (identity, abuse, path) in [
            (json!({"ipv6_prefix": 0}), None, "identity.ipv6_prefix"),
            (json!({"ipv6_prefix": 129}), None, "identity.ipv6_prefix"),
            (json!({}), Some(abuse(0)), "abuse.ipv6_prefix"),
            (
                json!({"ipv6_prefix": 64}),
                Some(abuse(48)),
                "abuse.ipv6_prefix",
            ),
        ] {
            let err = policy(identity, abuse).unwrap_err();
            assert_eq!(err.path, path, "{err}");
        }
    }

    #[test]
    fn addresses_lose_their_port() {
        assert_eq!(strip_port("127.0.0.1:8080"), "127.0.0.1");
        assert_eq!(strip_port("[::1]:8080"), "::1");
        assert_eq!(strip_port("::1"), "::1");
        assert_eq!(strip_port("10.0.0.1"), "10.0.0.1");
    }
}
