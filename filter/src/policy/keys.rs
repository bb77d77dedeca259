//! How keys and names become ids: the principal of a declared API key
//! (SHA-256), and the one cheap unkeyed hash of the filter's tables.

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
    format!("key:{}", hash.get(..16).unwrap_or(hash))
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

/// 64-bit FNV-1a: the one cheap, unkeyed hash of the filter's tables
/// (principals, groups of a share, credential fingerprints).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}
