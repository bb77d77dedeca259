//! The sidecar's own door: which `Host` names it answers to, and how fast
//! one client may guess the admin token.
//!
//! **Host names.** A web page can make a browser talk to the sidecar by
//! pointing its own name at 127.0.0.1 (DNS rebinding); the browser then
//! treats the sidecar's answers as the page's own and lets it read
//! `/v1/state`, `/metrics` or `/v1/fleet`. Such a request still carries the
//! page's name in `Host`, so every request, on every route, is answered
//! 421 unless its `Host` (and the authority of an absolute or HTTP/2
//! request target) is one the sidecar answers to: `localhost`, an IP
//! address (a rebinding page never has one: its origin is its name), the
//! name the shipped Envoy configs send (`sluice_sidecar`, the cluster's
//! name, which no DNS name can be), and the names in `allowed_hosts`. Any
//! port.
//!
//! **Guessing, and a door no co-tenant can hold shut.** Admin calls come
//! from loopback unless `admin.allow_remote`, so every local process (each
//! container of a pod) is the same client. A throttle that answers 429
//! *before* the token is read would let any of them keep the operator's
//! correct token refused, at one wrong guess per refill. So the token is
//! read first, in constant time ([`secret_eq`]), and **the right token is
//! always served, whatever anyone guessed**. A wrong one draws on its
//! client's failure bucket: [`FAILURE_BURST`] failures, refilled at one per
//! [`FAILURE_REFILL`] (10 per minute); past them it is answered 429 with
//! `Retry-After` instead of 401 (and not charged again). Clients are told
//! apart by address (IPv6 by its /64: one host holds a whole /64).
//!
//! What the throttle no longer does: bound how fast a token can be tested.
//! A throttled client still learns "right" (200) from "wrong" (429), so
//! the check is an oracle at the sidecar's request rate. What makes that
//! hopeless is the token: at least `MIN_TOKEN_BYTES` (32) bytes with
//! `MIN_TOKEN_DISTINCT` (8) different ones, refused at start otherwise
//! (`serve::admin`). `openssl rand -hex 16` makes 32 hex digits, 128 bits:
//! at 10^5 guesses a second (a loopback flood on many cores) the expected
//! search is about 5·10^25 years. A token a person chose is the one thing
//! this cannot save, hence the minimum length and the docs' `openssl` line.
//! The 429 stays for what it still gives: a guesser is visible at once
//! (counted apart, `throttled`), its log lines are bounded (one per
//! charged failure: B + r·t in t), and a script that backs off on 429 is
//! slowed. (The fleet and cache secrets were never throttled: they rest
//! on their length alone, as this token now does.)
//!
//! The table holds at most [`MAX_CLIENTS`]; when full, a client whose
//! bucket has refilled is forgotten first, else the one closest to
//! refilled (it had the fewest recent failures), so memory is bounded and
//! a known guesser is the last to be forgotten.
//!
//! Time is passed in (`now`), so the rules are tested without a clock.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Whether `given` is the secret `want` (the admin token, the fleet
/// secret), in constant time over the contents (`subtle`). Only the length
/// can show, and every secret has a minimum length.
pub fn secret_eq(given: &[u8], want: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(given.ct_eq(want))
}

/// Failures a client may make before it is answered 429.
pub const FAILURE_BURST: u32 = 10;
/// One failure is forgiven per this long (10 per minute).
pub const FAILURE_REFILL: Duration = Duration::from_secs(6);
/// Clients with recent failures remembered at once (a few hundred KB).
pub const MAX_CLIENTS: usize = 4096;
/// The name Envoy sends for the sidecar in the shipped configs: the
/// `:authority` of the filter's poll and fleet calls defaults to the
/// cluster's name, `sluice_sidecar`.
pub const ENVOY_CLUSTER_NAME: &str = "sluice_sidecar";
/// Longest host name (RFC 1035).
pub const MAX_HOST_NAME: usize = 253;

/// The host names the sidecar answers to.
#[derive(Debug, Clone)]
pub struct AllowedHosts {
    /// Lower-case, without port or trailing dot.
    names: Vec<String>,
}

impl Default for AllowedHosts {
    fn default() -> Self {
        AllowedHosts {
            names: vec!["localhost".into(), ENVOY_CLUSTER_NAME.into()],
        }
    }
}

impl AllowedHosts {
    /// The defaults plus `extra` (`allowed_hosts`, `--allowed-host`). An
    /// entry that is not a plain host name is refused, with its index.
    pub fn with(extra: &[String]) -> Result<AllowedHosts, (usize, String)> {
        let mut hosts = AllowedHosts::default();
        for (i, name) in extra.iter().enumerate() {
            let name = check_name(name).map_err(|m| (i, m))?;
            if !hosts.names.contains(&name) {
                hosts.names.push(name);
            }
        }
        Ok(hosts)
    }

    /// Whether a `Host` value (`name[:port]`, `[v6]:port`) is one of ours.
    pub fn allows(&self, host: &[u8]) -> bool {
        let Ok(host) = std::str::from_utf8(host) else {
            return false;
        };
        let Some(name) = host_of(host) else {
            return false;
        };
        if name.starts_with('[') {
            // `host_of` only returns a bracketed name that is an IPv6 address.
            return true;
        }
        if name.parse::<std::net::Ipv4Addr>().is_ok() {
            return true;
        }
        let name = name.strip_suffix('.').unwrap_or(name);
        self.names.iter().any(|n| n.eq_ignore_ascii_case(name))
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// The name part of `name[:port]` / `[v6][:port]`; none when malformed.
fn host_of(host: &str) -> Option<&str> {
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let end = rest.find(']')?;
        let v6 = &rest[..end];
        v6.parse::<std::net::Ipv6Addr>().ok()?;
        let after = &rest[end + 1..];
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (&host[..end + 2], port)
    } else {
        match host.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        }
    };
    if let Some(p) = port {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
    }
    (!name.is_empty()).then_some(name)
}

/// An `allowed_hosts` entry: a host name, lower-cased.
fn check_name(name: &str) -> Result<String, String> {
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if trimmed.is_empty() {
        return Err("an empty name".into());
    }
    if trimmed.len() > MAX_HOST_NAME {
        return Err(format!("longer than {MAX_HOST_NAME} bytes"));
    }
    if let Some(bad) = trimmed
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')))
    {
        return Err(format!(
            "`{}` holds `{}`: give a host name without port or scheme \
             (IP addresses are always accepted)",
            trimmed.escape_debug(),
            bad.escape_debug()
        ));
    }
    Ok(trimmed.to_ascii_lowercase())
}

/// Who a failure is charged to: an IPv4 address, or an IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Client {
    V4(u32),
    /// The top 64 bits.
    V6(u64),
}

impl Client {
    pub fn of(ip: IpAddr) -> Client {
        match ip {
            IpAddr::V4(v4) => Client::V4(u32::from(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Client::V4(u32::from(v4)),
                None => Client::V6(u64::try_from(u128::from(v6) >> 64).unwrap_or(u64::MAX)),
            },
        }
    }
}

/// What a client's failure bucket says of its next wrong token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Open,
    /// Throttled: try again after this long.
    Throttled(Duration),
}

/// Per-client failure buckets (GCRA: one instant per client, the time at
/// which its bucket is full again).
#[derive(Debug, Default)]
pub struct FailureGate {
    full_at: Mutex<HashMap<Client, Instant>>,
}

impl FailureGate {
    /// The longest a full bucket's debt can be ahead of now and still let
    /// one more failure in.
    const SLACK: Duration = FAILURE_REFILL.saturating_mul(FAILURE_BURST - 1);

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<Client, Instant>> {
        self.full_at.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a wrong token from `client` now is answered 401 (and
    /// charged) or 429. Never asked for the right token.
    pub fn check(&self, client: Client, now: Instant) -> Gate {
        let Some(full_at) = self.table().get(&client).copied() else {
            return Gate::Open;
        };
        let ahead = full_at.saturating_duration_since(now);
        match ahead.checked_sub(Self::SLACK) {
            Some(wait) if !wait.is_zero() => Gate::Throttled(wait),
            _ => Gate::Open,
        }
    }

    /// Charges one failure to `client`; returns the failures it has left
    /// before it is throttled.
    pub fn fail(&self, client: Client, now: Instant) -> u32 {
        let mut table = self.table();
        if !table.contains_key(&client) && table.len() >= MAX_CLIENTS {
            forget_one(&mut table, now);
        }
        let full_at = table.entry(client).or_insert(now);
        *full_at = (*full_at).max(now) + FAILURE_REFILL;
        let ahead = full_at.saturating_duration_since(now);
        let used = ahead.as_millis() / FAILURE_REFILL.as_millis().max(1);
        u32::try_from(u128::from(FAILURE_BURST).saturating_sub(used)).unwrap_or(0)
    }

    /// Clients remembered now.
    pub fn len(&self) -> usize {
        self.table().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Makes room for one: every refilled bucket goes; if none has, the one
/// closest to refilled.
fn forget_one(table: &mut HashMap<Client, Instant>, now: Instant) {
    table.retain(|_, full_at| *full_at > now);
    if table.len() < MAX_CLIENTS {
        return;
    }
    if let Some(k) = table.iter().min_by_key(|(_, at)| **at).map(|(k, _)| *k) {
        table.remove(&k);
    }
}

/// The admin-token checks, for the failure metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    KillSwitch,
    Simulate,
    /// A long poll presenting a token for the reserved slots.
    State,
}

impl Endpoint {
    pub const ALL: [Endpoint; 3] = [Endpoint::KillSwitch, Endpoint::Simulate, Endpoint::State];

    pub fn label(self) -> &'static str {
        match self {
            Endpoint::KillSwitch => "kill_switch",
            Endpoint::Simulate => "simulate",
            Endpoint::State => "state",
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::KillSwitch => "/v1/kill-switch",
            Endpoint::Simulate => "/v1/simulate",
            Endpoint::State => "/v1/state",
        }
    }
}

/// Why an admin call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No `Authorization: Bearer …` at all (not a guess: not throttled).
    Missing,
    /// A bearer token that is not the one (a guess: charged).
    Wrong,
    /// No admin token is configured (nothing to guess: not throttled).
    NotConfigured,
    /// A wrong token from a client past its allowance (429, not charged).
    Throttled,
}

impl Failure {
    pub const ALL: [Failure; 4] = [
        Failure::Missing,
        Failure::Wrong,
        Failure::NotConfigured,
        Failure::Throttled,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Failure::Missing => "missing",
            Failure::Wrong => "wrong",
            Failure::NotConfigured => "not_configured",
            Failure::Throttled => "throttled",
        }
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct DoorCounters {
    /// By [`Endpoint`] × [`Failure`].
    failures: [[AtomicU64; 4]; 3],
    /// Requests answered 421 for their `Host`.
    pub host_refused: AtomicU64,
}

impl DoorCounters {
    pub fn count(&self, endpoint: Endpoint, failure: Failure) -> u64 {
        self.failures[endpoint as usize][failure as usize].fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn failures(&self, endpoint: Endpoint, failure: Failure) -> u64 {
        self.failures[endpoint as usize][failure as usize].load(Ordering::Relaxed)
    }
}

/// A `Host` value fit for a log line: printable ASCII, at most 64 bytes.
pub fn loggable(host: &[u8]) -> String {
    host.iter()
        .take(64)
        .map(|&b| {
            if b.is_ascii_graphic() {
                char::from(b)
            } else {
                '?'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_addresses_and_the_cluster_name_are_ours() {
        let h = AllowedHosts::default();
        for ok in [
            "localhost",
            "localhost:9911",
            "LocalHost:1",
            "localhost.:9911",
            "127.0.0.1",
            "127.0.0.1:9911",
            "[::1]",
            "[::1]:9911",
            "10.1.2.3:9911",
            "[fd00::7]:80",
            "sluice_sidecar",
            "sluice_sidecar:9911",
        ] {
            assert!(h.allows(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:9911",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "sluice-sidecar",
            "",
            ":9911",
            "localhost:",
            "localhost:99999x",
            "[::1",
            "[evil.example]:1",
            "[::1]x",
            "::1",
            "localhost:9911:1",
            "local\u{0}host",
        ] {
            assert!(!h.allows(bad.as_bytes()), "{bad:?}");
        }
        assert!(!h.allows(b"\xfflocalhost"));
    }

    #[test]
    fn configured_names_are_added_and_checked() {
        let h = AllowedHosts::with(&["Sluice-Sidecar.prod.svc.cluster.local.".into()]).unwrap();
        assert!(h.allows(b"sluice-sidecar.prod.svc.cluster.local:9911"));
        assert!(h.allows(b"localhost"), "the defaults stay");
        assert!(!h.allows(b"evil.example"));
        for bad in ["", "a b", "http://x", "x:80", "*", "*.example", "é"] {
            let err = AllowedHosts::with(&["ok".into(), bad.into()]).unwrap_err();
            assert_eq!(err.0, 1, "{bad}");
        }
        assert!(AllowedHosts::with(&["a".repeat(254)]).is_err());
    }

    #[test]
    fn clients_are_addresses_and_ipv6_slash_64s() {
        let ip = |s: &str| Client::of(s.parse().unwrap());
        assert_eq!(ip("2001:db8:1:2::1"), ip("2001:db8:1:2:ffff::9"));
        assert_ne!(ip("2001:db8:1:2::1"), ip("2001:db8:1:3::1"));
        assert_eq!(ip("::ffff:10.0.0.1"), ip("10.0.0.1"));
        assert_ne!(ip("10.0.0.1"), ip("10.0.0.2"));
        assert_ne!(ip("::"), ip("0.0.0.0"));
    }

    #[test]
    fn a_client_gets_a_burst_of_failures_then_one_per_refill() {
        let gate = FailureGate::default();
        let c = Client::of("127.0.0.1".parse().unwrap());
        let other = Client::of("127.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for left in (0..FAILURE_BURST).rev() {
            assert_eq!(gate.check(c, t0), Gate::Open);
            assert_eq!(gate.fail(c, t0), left);
        }
        assert_eq!(gate.check(c, t0), Gate::Throttled(FAILURE_REFILL));
        assert_eq!(gate.check(other, t0), Gate::Open, "per client");
        let t = t0 + Duration::from_secs(2);
        assert_eq!(gate.check(c, t), Gate::Throttled(Duration::from_secs(4)));
        let t = t0 + FAILURE_REFILL;
        assert_eq!(gate.check(c, t), Gate::Open, "one more after a refill");
        assert_eq!(gate.fail(c, t), 0);
        assert!(matches!(gate.check(c, t), Gate::Throttled(_)));
        // A minute of guessing: at most BURST + minute / REFILL failures.
        let mut failed = 0;
        for ms in (0..60_000).step_by(10) {
            let now = t0 + Duration::from_millis(ms);
            if gate.check(other, now) == Gate::Open {
                gate.fail(other, now);
                failed += 1;
            }
        }
        assert_eq!(failed, FAILURE_BURST + 9, "10 at once, then one per 6 s");
        let later = t0 + FAILURE_REFILL * (2 * FAILURE_BURST);
        assert_eq!(gate.check(c, later), Gate::Open);
    }

    #[test]
    fn the_table_is_bounded_and_forgets_the_least_suspicious_first() {
        let gate = FailureGate::default();
        let t0 = Instant::now();
        let guesser = Client::of("10.0.0.1".parse().unwrap());
        for _ in 0..FAILURE_BURST {
            gate.fail(guesser, t0);
        }
        for i in 0..(MAX_CLIENTS as u32 * 2) {
            let c = Client::of(IpAddr::V4((0x0b00_0000 + i).into()));
            gate.fail(c, t0 + Duration::from_millis(u64::from(i % 1000)));
        }
        assert_eq!(gate.len(), MAX_CLIENTS);
        assert!(
            matches!(gate.check(guesser, t0), Gate::Throttled(_)),
            "a flood of one-time failures does not free the guesser"
        );
        // Refilled buckets are forgotten when room is needed.
        let late = t0 + Duration::from_secs(3600);
        gate.fail(Client::of("10.9.9.9".parse().unwrap()), late);
        assert_eq!(gate.len(), 1);
    }

    #[test]
    fn counters_and_log_text() {
        let c = DoorCounters::default();
        assert_eq!(c.count(Endpoint::KillSwitch, Failure::Wrong), 1);
        assert_eq!(c.count(Endpoint::KillSwitch, Failure::Wrong), 2);
        assert_eq!(c.failures(Endpoint::State, Failure::Wrong), 0);
        assert_eq!(loggable(b"evil\n.example\x00"), "evil?.example?");
        assert_eq!(loggable(&[b'a'; 100]).len(), 64);
    }
}
