//! Who may make an admin call (flip the kill switch, set the simulated
//! GPUs): a bearer token of at least [`MIN_TOKEN_BYTES`] with at least
//! [`MIN_TOKEN_DISTINCT`] different bytes, compared in constant time. The
//! right token is always served, whoever guessed before (see
//! [`crate::door`]), so the check is an oracle at any rate: the token's
//! length is what makes guessing hopeless. What the switch does is
//! [`crate::watch::kill_switch`]'s.

use std::path::{Path, PathBuf};

use crate::door::Failure;

/// The shortest admin token accepted at start: 32 bytes, what `openssl
/// rand -hex 16` makes (128 bits). Shorter ones are refused: nothing
/// throttles a guesser's rate (the right token must never be locked out),
/// so only a token no search can reach is safe.
pub const MIN_TOKEN_BYTES: usize = 32;
/// The fewest different bytes a token may hold (a hex token of 32 digits
/// has fewer than 8 with odds of about 4·10^-8): refuses `aaaa…` and short
/// patterns repeated, which a guesser tries first.
pub const MIN_TOKEN_DISTINCT: usize = 8;

/// The admin bearer token; `None`: no admin call is accepted.
#[derive(Clone, Default)]
pub struct AdminToken(Option<Vec<u8>>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "AdminToken(set)"
        } else {
            "AdminToken(none)"
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("reading the admin token file {0}: {1}")]
    TokenFile(PathBuf, std::io::Error),
    #[error("the admin token file {0} is empty")]
    EmptyToken(PathBuf),
    #[error(
        "the admin token from {from} is {len} bytes; at least {MIN_TOKEN_BYTES} are required, \
         since the right token is never throttled (make one with `openssl rand -hex 16`)"
    )]
    ShortToken { from: String, len: usize },
    #[error(
        "the admin token from {from} holds only {distinct} different characters; at least \
         {MIN_TOKEN_DISTINCT} are required: a repeated pattern is guessed first (make one \
         with `openssl rand -hex 16`)"
    )]
    PlainToken { from: String, distinct: usize },
}

impl AdminToken {
    /// From `file` if given (surrounding whitespace trimmed), else from
    /// `env_value` (`SLUICE_ADMIN_TOKEN`) when it is not empty. `file_from`
    /// names where the file came from (`--admin-token-file`,
    /// `admin.token_file`), for the error about a short token.
    pub fn load(
        file: Option<&Path>,
        file_from: &str,
        env_value: Option<String>,
    ) -> Result<AdminToken, AdminError> {
        let (token, from) = if let Some(path) = file {
            let text =
                std::fs::read_to_string(path).map_err(|e| AdminError::TokenFile(path.into(), e))?;
            let token = text.trim().to_string();
            if token.is_empty() {
                return Err(AdminError::EmptyToken(path.into()));
            }
            (token, format!("{file_from} ({})", path.display()))
        } else {
            match env_value
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
            {
                Some(token) => (token, "SLUICE_ADMIN_TOKEN".to_string()),
                None => return Ok(AdminToken(None)),
            }
        };
        if token.len() < MIN_TOKEN_BYTES {
            return Err(AdminError::ShortToken {
                from,
                len: token.len(),
            });
        }
        let distinct = distinct_bytes(token.as_bytes());
        if distinct < MIN_TOKEN_DISTINCT {
            return Err(AdminError::PlainToken { from, distinct });
        }
        Ok(AdminToken(Some(token.into_bytes())))
    }

    pub fn new(token: &str) -> AdminToken {
        AdminToken(Some(token.as_bytes().to_vec()))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// Whether an `Authorization` header value carries the token.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        self.check(authorization).is_ok()
    }

    /// Whether an `Authorization` header value carries the token, and if
    /// not, why: no bearer token given, a wrong one, or none configured.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Failure> {
        let Some(want) = &self.0 else {
            return Err(Failure::NotConfigured);
        };
        // The scheme is case-insensitive (RFC 9110 §11.1).
        let Some(given) = authorization.and_then(|header| {
            header
                .get(..7)
                .filter(|scheme| scheme.eq_ignore_ascii_case(b"Bearer "))
                .map(|_| &header[7..])
        }) else {
            return Err(Failure::Missing);
        };
        // Only the length can show, and a token has at least MIN_TOKEN_BYTES.
        if crate::door::secret_eq(given, want) {
            Ok(())
        } else {
            Err(Failure::Wrong)
        }
    }
}

/// How many different byte values `token` holds.
fn distinct_bytes(token: &[u8]) -> usize {
    let mut seen = [false; 256];
    for &b in token {
        seen[usize::from(b)] = true;
    }
    seen.iter().filter(|s| **s).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_checks() {
        let t = AdminToken::new("s3cret");
        assert!(t.accepts(Some(b"Bearer s3cret")));
        assert!(t.accepts(Some(b"bearer s3cret")));
        assert!(!t.accepts(Some(b"Bearer s3cret ")));
        assert!(!t.accepts(Some(b"Bearer s3cre")));
        assert!(!t.accepts(Some(b"s3cret")));
        assert!(!t.accepts(None));
        assert!(!AdminToken::default().accepts(Some(b"Bearer ")));
        assert_eq!(format!("{t:?}"), "AdminToken(set)");
    }

    #[test]
    fn token_checks_say_why() {
        let t = AdminToken::new("s3cret-s3cret-s3cret");
        assert_eq!(t.check(Some(b"Bearer s3cret-s3cret-s3cret")), Ok(()));
        assert_eq!(t.check(Some(b"Bearer nope")), Err(Failure::Wrong));
        assert_eq!(t.check(Some(b"Bearer ")), Err(Failure::Wrong));
        assert_eq!(t.check(Some(b"Basic x")), Err(Failure::Missing));
        assert_eq!(t.check(None), Err(Failure::Missing));
        assert_eq!(
            AdminToken::default().check(Some(b"Bearer x")),
            Err(Failure::NotConfigured)
        );
    }

    #[test]
    fn token_sources() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "  from-file-0123456789abcdef-01234\n").unwrap();
        let env = || Some("from-env-0123456789abcdef-012345".to_string());
        let t = AdminToken::load(Some(&file), "--admin-token-file", env()).unwrap();
        assert!(t.accepts(Some(b"Bearer from-file-0123456789abcdef-01234")));
        let t = AdminToken::load(None, "-", env()).unwrap();
        assert!(t.accepts(Some(b"Bearer from-env-0123456789abcdef-012345")));
        assert!(!AdminToken::load(None, "-", Some("  ".into()))
            .unwrap()
            .is_set());
        std::fs::write(&file, "\n").unwrap();
        assert!(AdminToken::load(Some(&file), "-", None).is_err());
        assert!(AdminToken::load(Some(&dir.path().join("nope")), "-", None).is_err());
    }

    #[test]
    fn short_or_plain_tokens_are_refused_naming_where_they_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "x\n").unwrap();
        let err = AdminToken::load(Some(&file), "admin.token_file", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("admin.token_file"), "{err}");
        assert!(err.contains("is 1 bytes; at least 32"), "{err}");
        // 16 bytes were enough while a throttled client could not try the
        // right token; now they are not.
        let err = AdminToken::load(None, "-", Some("sixteen-bytes!!!".into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLUICE_ADMIN_TOKEN"), "{err}");
        assert!(err.contains("is 16 bytes; at least 32"), "{err}");
        for plain in ["a".repeat(40), "abcabcabcabcabcabcabcabcabcabcabc".into()] {
            let err = AdminToken::load(None, "-", Some(plain.clone()))
                .unwrap_err()
                .to_string();
            assert!(err.contains("different characters; at least 8"), "{err}");
            assert!(!err.contains(&plain), "never the token: {err}");
        }
        let ok = "0123456789abcdef0123456789abcdef";
        assert_eq!(ok.len(), MIN_TOKEN_BYTES);
        assert!(AdminToken::load(None, "-", Some(ok.into()))
            .unwrap()
            .is_set());
    }

    #[test]
    fn hex_tokens_of_openssl_rand_pass_the_distinct_check() {
        // 32 hex digits from a fixed generator, many times: none refused.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..10_000 {
            let token: String = (0..32)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    char::from(b"0123456789abcdef"[(x >> 60) as usize])
                })
                .collect();
            assert!(
                distinct_bytes(token.as_bytes()) >= MIN_TOKEN_DISTINCT,
                "{token}"
            );
        }
    }
}
