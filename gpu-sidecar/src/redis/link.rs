//! What the operator hears of this sidecar's Redis connection: one line
//! when a run of failures starts, with Redis' own reason and a hint for
//! the usual mistakes (a CA that does not sign the server's certificate,
//! plain text to a TLS port or TLS to a plain one, a missing or refused
//! password, nothing listening), and one line when Redis answers again.
//! A Redis that is down from the start is said at the first call (the
//! fleet sync makes one within a `sync_interval`), not only after it was
//! once up. Between the two lines nothing more is logged however many
//! calls fail: they are counted (`sluice_sidecar_redis_errors_total`,
//! `sluice_sidecar_redis_up`).
//!
//! The password never shows: a URL with one is refused at load (the
//! password comes from a file or the environment), and Redis' errors name
//! the failure (`NOAUTH`, `WRONGPASS`), never the password sent.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The state of the connection as the calls found it.
#[derive(Debug, Default)]
pub struct Link {
    /// The last call succeeded.
    up: AtomicBool,
    /// A run of failures is on (and was logged).
    failing: AtomicBool,
    /// Failed calls in the current run.
    run: AtomicU64,
    /// Failed calls since start.
    errors: AtomicU64,
}

impl Link {
    /// Counts a failed call; the line to log when it starts a run of
    /// failures (`target`: the configured URL, which holds no password).
    pub fn failed(&self, target: &str, reason: &str) -> Option<String> {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.run.fetch_add(1, Ordering::Relaxed);
        self.up.store(false, Ordering::Relaxed);
        if self.failing.swap(true, Ordering::Relaxed) {
            return None;
        }
        let hint = hint(reason).map_or(String::new(), |h| format!(" ({h})"));
        Some(format!(
            "sluice-sidecar: fleet: error: Redis {target} unavailable: {reason}{hint}; \
             fleet calls answer 503 fleet_unavailable and the cache misses until it \
             answers (said once per outage; counted in sluice_sidecar_redis_errors_total)"
        ))
    }

    /// Records a call that succeeded; the line to log when it is the first
    /// or ends a run of failures.
    pub fn ok(&self, target: &str) -> Option<String> {
        let was_up = self.up.swap(true, Ordering::Relaxed);
        if self.failing.swap(false, Ordering::Relaxed) {
            let n = self.run.swap(0, Ordering::Relaxed);
            return Some(format!(
                "sluice-sidecar: fleet: Redis {target} answers again (after {n} failed call(s))"
            ));
        }
        (!was_up).then(|| format!("sluice-sidecar: fleet: Redis {target} reachable"))
    }

    /// Whether the last call succeeded.
    pub fn up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Failed calls since start.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

/// What to check, for the failures a configuration causes. Matched on
/// the text of redis-rs and rustls errors (lower-cased).
pub fn hint(reason: &str) -> Option<&'static str> {
    const HINTS: &[(&[&str], &str)] = &[
        (
            &["noauth"],
            "Redis wants a password: set fleet.password_file or fleet.password_env",
        ),
        (
            &[
                "wrongpass",
                "invalid password",
                "invalid username-password",
                "authentication failed",
            ],
            "Redis refused the password: check fleet.password_file or fleet.password_env",
        ),
        (
            &["certificate", "unknownissuer", "unknown issuer"],
            "the server's certificate is not signed by fleet.tls_ca_file, or does not name \
             the host in fleet.redis",
        ),
        (
            &["corrupt message", "invalidcontenttype", "handshake", "tls"],
            "TLS failed: is that port plain text? `redis://` is plain, `rediss://` TLS",
        ),
        (
            &["connection refused"],
            "nothing listens there: check the host and port of fleet.redis",
        ),
        (
            &[
                "connection reset",
                "broken pipe",
                "unexpected eof",
                "connection closed",
            ],
            "the server closed the connection: plain text (`redis://`) to a TLS port, or a \
             wrong port",
        ),
        (
            &["timed out"],
            "no answer within fleet.timeout: TLS (`rediss://`) to a plain port, a wrong \
             port, a firewall, or a Redis too busy",
        ),
    ];
    let lower = reason.to_ascii_lowercase();
    HINTS
        .iter()
        .find(|(needles, _)| needles.iter().any(|n| lower.contains(n)))
        .map(|(_, h)| *h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_failures_is_said_once_and_its_end_once() {
        let l = Link::default();
        let url = "rediss://redis.example:6380";
        assert!(!l.up(), "not up before the first answer");
        let first = l.failed(url, "Connection refused (os error 111)").unwrap();
        assert!(first.contains("error: Redis rediss://redis.example:6380 unavailable"));
        assert!(first.contains("Connection refused (os error 111) (nothing listens there"));
        for _ in 0..100 {
            assert_eq!(l.failed(url, "Connection refused"), None);
        }
        assert_eq!(l.errors(), 101);
        let back = l.ok(url).unwrap();
        assert!(
            back.contains("answers again (after 101 failed call(s))"),
            "{back}"
        );
        assert!(l.up());
        assert_eq!(l.ok(url), None, "no line while it stays up");
        // The next outage is said again, with its own count.
        assert!(l.failed(url, "timed out").is_some());
        assert!(l.ok(url).unwrap().contains("after 1 failed"));
    }

    #[test]
    fn the_first_answer_is_said_once() {
        let l = Link::default();
        assert!(l.ok("redis://r:6379").unwrap().ends_with("reachable"));
        assert_eq!(l.ok("redis://r:6379"), None);
    }

    #[test]
    fn hints_for_the_usual_mistakes() {
        let cases = [
            ("NOAUTH: Authentication required.", "wants a password"),
            (
                "WRONGPASS: invalid username-password pair",
                "refused the password",
            ),
            (
                "Password authentication failed - AuthenticationFailed",
                "refused the password",
            ),
            (
                "invalid peer certificate: UnknownIssuer",
                "not signed by fleet.tls_ca_file",
            ),
            (
                "received corrupt message of type InvalidContentType",
                "TLS failed",
            ),
            ("Connection refused (os error 111)", "nothing listens"),
            (
                "Connection reset by peer (os error 104)",
                "plain text (`redis://`) to a TLS",
            ),
            ("connect timed out", "TLS (`rediss://`) to a plain port"),
        ];
        for (reason, says) in cases {
            let h = hint(reason).unwrap_or_else(|| panic!("no hint for {reason}"));
            assert!(h.contains(says), "{reason}: {h}");
        }
        assert_eq!(hint("ERR unknown command"), None);
    }
}
