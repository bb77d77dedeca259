//! Where the deployment's hash key comes from (see
//! [`HashKey`](crate::policy::keys::HashKey) for what it protects).
//!
//! First match wins:
//! 1. **The operator's**: the environment variable named by
//!    `identity.hash_key_env` (default `SLUICE_HASH_KEY`), handed to the
//!    VM with `vm_config.environment_variables`, at least
//!    [`MIN_SECRET`] bytes. Every worker and every Envoy given the same
//!    secret places callers the same way.
//! 2. **The fleet's**: with a `fleet` section, a key derived from the
//!    fleet secret (which every Envoy of the fleet and its sidecar already
//!    share), so fleet keys agree across Envoys with no second secret.
//! 3. **Generated**: 128 random bits, kept in shared data
//!    ([`STORE_KEY`]) so that every worker of this Envoy, and every reload
//!    of its policy, uses the one key that was generated first. Envoy
//!    configures the plugin on its main thread's VM before it clones that
//!    VM to the workers ("Execution model for filters", Envoy's Wasm
//!    architecture overview), so the first configuration creates the key
//!    and the workers read it. A restart generates a new one, and loses
//!    nothing the key placed: shared data does not outlive the process.
//!
//! The key's bytes are never logged; the log says only which source won.

use crate::host::Host;
use crate::policy::fleet::MIN_SECRET;
use crate::policy::keys::HashKey;
use crate::policy::Policy;
use crate::state::store::{SharedStore, StoreError};

/// The variable read when `identity.hash_key_env` is not written.
pub const DEFAULT_ENV: &str = "SLUICE_HASH_KEY";
/// Where a generated key is kept (16 bytes).
pub const STORE_KEY: &str = "sluice:v1:hash-key";
/// Labels that keep a derived key apart from other uses of its secret.
const OPERATOR_PURPOSE: &str = "sluice hash key";
const FLEET_PURPOSE: &str = "sluice hash key from the fleet secret";

/// Which source gave the key (logged when the policy loads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Operator,
    Fleet,
    Generated,
}

impl Source {
    pub fn describe(self) -> &'static str {
        match self {
            Source::Operator => "from the operator's environment variable",
            Source::Fleet => "derived from the fleet secret",
            Source::Generated => "generated for this Envoy (kept in shared data)",
        }
    }
}

/// The key this VM places callers with. `Err`: a configuration error
/// (a secret too short to be one) or no way to make a key.
pub fn resolve(host: &dyn Host, policy: &Policy) -> Result<(HashKey, Source), String> {
    let name = policy
        .identity
        .hash_key_env
        .as_deref()
        .unwrap_or(DEFAULT_ENV);
    if let Some(secret) = env_secret(host, name) {
        if secret.len() < MIN_SECRET {
            return Err(format!(
                "identity.hash_key_env: the environment variable {name} holds {} bytes; a hash \
                 key needs at least {MIN_SECRET} (or leave it unset: sluice then generates one)",
                secret.len()
            ));
        }
        return Ok((
            HashKey::derive(OPERATOR_PURPOSE, secret.as_bytes()),
            Source::Operator,
        ));
    }
    if let Some(fleet) = &policy.fleet {
        // Too short or missing: the fleet refuses the policy itself, with
        // its own message; until then a generated key.
        if let Some(secret) = env_secret(host, &fleet.secret_env).filter(|s| s.len() >= MIN_SECRET)
        {
            return Ok((
                HashKey::derive(FLEET_PURPOSE, secret.as_bytes()),
                Source::Fleet,
            ));
        }
    }
    let key = generated(host)?;
    Ok((key, Source::Generated))
}

fn env_secret(host: &dyn Host, name: &str) -> Option<String> {
    let value = host.env_var(name)?;
    let value = value.trim();
    (!value.is_empty()).then(|| value.to_string())
}

/// The generated key in shared data, made here if there is none yet. What
/// is stored wins: a key is only ever written where none is, and read
/// back before use.
pub fn generated(store: &dyn SharedStore) -> Result<HashKey, String> {
    for _ in 0..8 {
        let (bytes, cas) = store.get(STORE_KEY).unwrap_or_default();
        if let Some(key) = HashKey::from_bytes(&bytes) {
            return Ok(key);
        }
        let fresh = HashKey::random().ok_or_else(|| {
            "cannot generate a hash key: the host gave no random bytes".to_string()
        })?;
        match store.set(STORE_KEY, fresh.bytes(), cas) {
            Ok(()) | Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Host(message)) => {
                return Err(format!("cannot store the generated hash key: {message}"))
            }
        }
    }
    Err("cannot agree on a hash key with the other workers (shared data kept changing)".into())
}

/// [`resolve`], logged: which source won, never the key.
pub fn load(host: &dyn Host, policy: &Policy) -> Result<HashKey, String> {
    let (key, source) = resolve(host, policy)?;
    log::info!("hash key: {}", source.describe());
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mock::MockHost;
    use serde_json::json;

    fn policy(extra: serde_json::Value) -> Policy {
        let mut v = json!({"default_tier": "free", "tiers": {"free": {}}});
        if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            v.extend(extra.clone());
        }
        Policy::from_value(v).unwrap()
    }

    #[test]
    fn a_generated_key_is_made_once_and_shared_by_every_worker() {
        let host = MockHost::default();
        let p = policy(json!({}));
        let (a, source) = resolve(&host, &p).unwrap();
        assert_eq!(source, Source::Generated);
        assert_ne!(a, HashKey::default(), "never the unkeyed default");
        // Another worker (and a reload) of the same Envoy: the same key.
        let (b, _) = resolve(&host, &p).unwrap();
        assert_eq!(a, b);
        // Another Envoy (its own shared data): another key.
        let (c, _) = resolve(&MockHost::default(), &p).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn the_operators_secret_wins_and_is_checked_with_its_field() {
        let host = MockHost::default();
        host.env.borrow_mut().insert(
            "SLUICE_HASH_KEY".into(),
            "an-operator-secret-0123456789".into(),
        );
        let p = policy(json!({}));
        let (a, source) = resolve(&host, &p).unwrap();
        assert_eq!(source, Source::Operator);
        let other = MockHost::default();
        other.env.borrow_mut().insert(
            "SLUICE_HASH_KEY".into(),
            "an-operator-secret-0123456789".into(),
        );
        assert_eq!(a, resolve(&other, &p).unwrap().0, "same secret, same key");
        assert!(host.get(STORE_KEY).is_none(), "nothing generated");
        host.env
            .borrow_mut()
            .insert("MY_KEY".into(), "short".into());
        let named = policy(json!({"identity": {"hash_key_env": "MY_KEY"}}));
        let err = resolve(&host, &named).unwrap_err();
        assert!(err.starts_with("identity.hash_key_env:"), "{err}");
        assert!(err.contains("MY_KEY") && !err.contains("short"), "{err}");
    }

    #[test]
    fn a_fleet_derives_its_key_from_the_fleet_secret() {
        let p = policy(json!({
            "sidecar": {"cluster": "sc"},
            "fleet": {"salt": "fleet-unit-test-salt"},
        }));
        let (a, source) = resolve(&MockHost::default(), &p).unwrap();
        assert_eq!(source, Source::Fleet);
        // Every Envoy of the fleet holds the secret: one placement.
        assert_eq!(a, resolve(&MockHost::default(), &p).unwrap().0);
    }
}
