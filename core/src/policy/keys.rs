//! How keys and names become ids: the principal of a declared API key
//! (SHA-256), the keyed hash of everything a caller can name (principals,
//! addresses, unlisted models), and the cheap unkeyed hash of names only
//! the policy writes (groups of a share, credential fingerprints).

use sha2::{Digest, Sha256};

/// The principal an API key (raw or `sha256:<hex>`) has when presented.
pub fn principal_of_key(key: &str) -> String {
    match key.strip_prefix("sha256:") {
        Some(hex) => key_principal(&hex.to_ascii_lowercase()),
        None => key_principal(&sha256_hex(key.as_bytes())),
    }
}

/// How an API key is named as a principal: a prefix of its SHA-256.
pub fn key_principal(hash: &str) -> String {
    ["key:", hash.get(..16).unwrap_or(hash)].concat()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    // No `format!` per byte: this runs on every request.
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// 64-bit FNV-1a: the cheap, unkeyed hash of names the policy writes
/// (groups of a share, credential fingerprints). Never for a name a
/// caller chooses: that is [`HashKey::hash`].
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The per-deployment secret of every hash whose input a caller chooses
/// (its principal, its address, an unlisted model's name): where such a
/// hash places a caller (a slot of a per-caller table, a sketch column, a
/// penalty-box cell, a fleet key) must not be something an outsider can
/// compute, or it can pick inputs that land on a victim's place. SipHash
/// keyed with 128 secret bits is a PRF for short inputs: without the key a
/// collision costs about as many tries as random placement (Aumasson and
/// Bernstein, "SipHash: a fast short-input PRF", 2012). Its bytes never
/// leave the VM: `Debug` prints no bytes, and nothing logs them.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct HashKey([u8; 16]);

impl std::fmt::Debug for HashKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HashKey(…)")
    }
}

impl HashKey {
    /// The length of a key as stored in shared data.
    pub const LEN: usize = 16;

    /// A key derived from a secret the operator (or the fleet) holds:
    /// SHA-256 of a purpose label and the secret, truncated. The label
    /// keeps this key distinct from any other use of the same secret.
    pub fn derive(purpose: &str, secret: &[u8]) -> HashKey {
        let mut h = Sha256::new();
        h.update(purpose.as_bytes());
        h.update([0u8]);
        h.update(secret);
        let digest = h.finalize();
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        HashKey(key)
    }

    /// 128 bits from the operating system's generator (in Envoy's VM,
    /// WASI `random_get`, which Envoy answers from BoringSSL's
    /// `RAND_bytes`); `None` when it fails.
    pub fn random() -> Option<HashKey> {
        let mut key = [0u8; 16];
        getrandom::getrandom(&mut key).ok()?;
        // All zeros is the unkeyed default: never a generated key.
        (key != [0u8; 16]).then_some(HashKey(key))
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<HashKey> {
        let key: [u8; 16] = bytes.try_into().ok()?;
        (key != [0u8; 16]).then_some(HashKey(key))
    }

    pub fn bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// SipHash-1-3 of `bytes` under this key.
    pub fn hash(&self, bytes: &[u8]) -> u64 {
        use std::hash::Hasher;
        let mut h = siphasher::sip::SipHasher13::new_with_key(&self.0);
        h.write(bytes);
        h.finish()
    }
}
