//! The embeddings endpoint's backoff: a hung or failing endpoint costs one
//! call's timeout, not every semantic lookup's.
//!
//! While the endpoint answers, every lookup and store that needs a vector
//! calls it. When a call finds it out (unreachable, timed out, a 5xx, 408
//! or 429, an answer that is not an embedding), semantic lookups and stores
//! are skipped for [`FIRST_PAUSE`] (a miss at once; exact lookups go on),
//! then one call is let through as a probe while the others still skip.
//! Each probe that fails doubles the pause, up to [`MAX_PAUSE`]; one that
//! succeeds ends the run. The calls already in flight when the endpoint
//! went out fail too: they carry the run they started in ([`Ticket`]) and
//! count once, so 50 lookups that time out together pause for 1 s, not
//! for 2^50. A probe whose caller went away (its request was dropped)
//! never reports: after its own timeout another probe goes.
//!
//! A call whose caller gave up before the endpoint answered (the filter
//! waits `lookup_timeout`, 100 ms by default, and then drops the lookup)
//! counts as the endpoint out too ([`Call`]'s drop): otherwise a hung
//! endpoint, whose every call is abandoned before its own timeout, would
//! never pause anything and every semantic miss would cost the filter its
//! whole `lookup_timeout`. An endpoint slower than `lookup_timeout` is of
//! no use to a lookup either; it is logged the same way.
//!
//! A text the endpoint refuses (another 4xx: too long for the model, say)
//! is no outage and pauses nothing: otherwise any client could switch the
//! semantic cache off for everyone with one such message a second.
//!
//! **Bound:** while the endpoint stays out, at most one call per pause is
//! made (one a minute at the cap), each costing at most its timeout; every
//! other lookup pays nothing for it. Time is passed in (`now`).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The first pause after the endpoint is found out.
pub const FIRST_PAUSE: Duration = Duration::from_secs(1);
/// The longest pause: how late, at worst, a recovered endpoint is used.
pub const MAX_PAUSE: Duration = Duration::from_secs(60);

/// The run a call was let through in (the failures counted when it
/// started).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u32);

/// What a failed call changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failed {
    /// The first failure of a run: calls pause for this long (log it).
    Started(Duration),
    /// A probe failed: the pause is now this long.
    Longer(Duration),
    /// A call from before the current pause: counted already.
    Known,
}

#[derive(Debug, Default)]
struct State {
    /// Outages counted in this run (0: the endpoint answers).
    failures: u32,
    /// No call before this instant.
    until: Option<Instant>,
    /// Lookups skipped in this run.
    skipped: u64,
}

#[derive(Debug, Default)]
pub struct Backoff {
    state: Mutex<State>,
}

impl Backoff {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether to call the endpoint now (a ticket) or skip (none).
    /// `probe_for`: the call's timeout, for which the others keep skipping
    /// when it is a probe.
    pub fn admit(&self, now: Instant, probe_for: Duration) -> Option<Ticket> {
        let mut s = self.state();
        if s.failures == 0 {
            return Some(Ticket(0));
        }
        if s.until.is_some_and(|u| now < u) {
            s.skipped += 1;
            return None;
        }
        s.until = Some(now + probe_for);
        Some(Ticket(s.failures))
    }

    /// A call that found the endpoint out.
    pub fn failed(&self, ticket: Ticket, now: Instant) -> Failed {
        let mut s = self.state();
        if ticket.0 != s.failures {
            return Failed::Known;
        }
        s.failures = s.failures.saturating_add(1);
        let pause = pause_after(s.failures);
        s.until = Some(now + pause);
        if s.failures == 1 {
            Failed::Started(pause)
        } else {
            Failed::Longer(pause)
        }
    }

    /// A call that got its embedding: the run it ends, if one was on, as
    /// (outages counted, lookups skipped).
    pub fn succeeded(&self) -> Option<(u32, u64)> {
        let mut s = self.state();
        if s.failures == 0 {
            return None;
        }
        let ended = (s.failures, s.skipped);
        *s = State::default();
        Some(ended)
    }
}

impl Backoff {
    /// A call to make now, or none (skip: a miss at once).
    pub fn call(&self, now: Instant, probe_for: Duration) -> Option<Call<'_>> {
        let ticket = self.admit(now, probe_for)?;
        Some(Call {
            backoff: self,
            ticket,
            settled: false,
        })
    }
}

/// One call to the endpoint. Settled by what it found; dropped unsettled
/// (its caller went away first), it counts as the endpoint out.
pub struct Call<'a> {
    backoff: &'a Backoff,
    ticket: Ticket,
    settled: bool,
}

impl Call<'_> {
    /// The endpoint answered (with an embedding, or refusing the text):
    /// the line to log when that ends an outage.
    pub fn answered(mut self) -> Option<String> {
        self.settled = true;
        let (outages, skipped) = self.backoff.succeeded()?;
        Some(format!(
            "sluice-sidecar: cache: the embeddings endpoint answers again (after {outages} \
             failed call(s); {skipped} semantic lookup(s) skipped)"
        ))
    }

    /// The endpoint is out (`why`): the line to log when that starts an
    /// outage.
    pub fn out(mut self, why: &str, now: Instant) -> Option<String> {
        self.settled = true;
        out_line(self.backoff.failed(self.ticket, now), why)
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // A drop has no `now` to be given: the clock is read here.
        let failed = self.backoff.failed(self.ticket, Instant::now());
        if let Some(line) = out_line(failed, "the lookup was abandoned before it answered") {
            eprintln!("{line}");
        }
    }
}

/// The line for a failure that starts an outage.
fn out_line(failed: Failed, why: &str) -> Option<String> {
    let Failed::Started(pause) = failed else {
        return None;
    };
    Some(format!(
        "sluice-sidecar: cache: error: the embeddings endpoint is out ({why}): semantic \
         lookups and stores skip it for {} s, then one call probes it; the pause doubles (up \
         to {} s) while it stays out. Exact lookups go on; skips are counted in \
         sluice_sidecar_cache_embedding_skipped_total",
        pause.as_secs(),
        MAX_PAUSE.as_secs()
    ))
}

/// The pause after `failures` outages in a row: 1 s, 2 s, 4 s … 60 s.
fn pause_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_PAUSE.saturating_mul(1 << doublings).min(MAX_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(2);

    #[test]
    fn a_healthy_endpoint_is_always_called() {
        let b = Backoff::default();
        let t0 = Instant::now();
        for i in 0..100 {
            assert_eq!(
                b.admit(t0 + Duration::from_millis(i), TIMEOUT),
                Some(Ticket(0))
            );
        }
        assert_eq!(b.succeeded(), None);
    }

    #[test]
    fn an_outage_pauses_calls_then_probes_with_growing_pauses() {
        let b = Backoff::default();
        let t0 = Instant::now();
        let first = b.admit(t0, TIMEOUT).unwrap();
        // The call times out: the run starts, calls pause for 1 s.
        let t = t0 + TIMEOUT;
        assert_eq!(b.failed(first, t), Failed::Started(FIRST_PAUSE));
        assert_eq!(b.admit(t, TIMEOUT), None);
        assert_eq!(b.admit(t + Duration::from_millis(999), TIMEOUT), None);
        // The pause is over: one probe, the others skip while it runs.
        let t = t + FIRST_PAUSE;
        let probe = b.admit(t, TIMEOUT).unwrap();
        assert_eq!(b.admit(t, TIMEOUT), None);
        assert_eq!(b.admit(t + TIMEOUT / 2, TIMEOUT), None);
        // It fails too: 2 s, then 4 s …, never more than a minute.
        let t = t + TIMEOUT;
        assert_eq!(b.failed(probe, t), Failed::Longer(Duration::from_secs(2)));
        let mut t = t;
        let mut pauses = Vec::new();
        for _ in 0..10 {
            let failed = loop {
                t += Duration::from_millis(100);
                if let Some(probe) = b.admit(t, TIMEOUT) {
                    break b.failed(probe, t);
                }
            };
            let Failed::Longer(p) = failed else {
                panic!("a probe's failure: {failed:?}");
            };
            pauses.push(p.as_secs());
        }
        assert_eq!(pauses, [4, 8, 16, 32, 60, 60, 60, 60, 60, 60]);
        // A probe that succeeds ends the run: every call goes again.
        t += MAX_PAUSE;
        assert!(b.admit(t, TIMEOUT).is_some());
        let (outages, skipped) = b.succeeded().unwrap();
        assert_eq!(outages, 12);
        assert!(skipped > 4, "{skipped}");
        assert_eq!(b.admit(t, TIMEOUT), Some(Ticket(0)));
    }

    #[test]
    fn calls_in_flight_when_it_went_out_count_once() {
        let b = Backoff::default();
        let t0 = Instant::now();
        let tickets: Vec<Ticket> = (0..50).map(|_| b.admit(t0, TIMEOUT).unwrap()).collect();
        let t = t0 + TIMEOUT;
        let results: Vec<Failed> = tickets.iter().map(|k| b.failed(*k, t)).collect();
        assert_eq!(results[0], Failed::Started(FIRST_PAUSE));
        assert!(results[1..].iter().all(|r| *r == Failed::Known));
        assert!(
            b.admit(t + FIRST_PAUSE, TIMEOUT).is_some(),
            "paused 1 s, not 2^50"
        );
    }

    #[test]
    fn a_probe_that_never_reports_is_followed_by_another() {
        let b = Backoff::default();
        let t0 = Instant::now();
        let first = b.admit(t0, TIMEOUT).unwrap();
        b.failed(first, t0);
        let _dropped = b.admit(t0 + FIRST_PAUSE, TIMEOUT).unwrap();
        assert_eq!(b.admit(t0 + FIRST_PAUSE + TIMEOUT / 2, TIMEOUT), None);
        assert!(b.admit(t0 + FIRST_PAUSE + TIMEOUT, TIMEOUT).is_some());
    }

    #[test]
    fn a_call_dropped_before_the_endpoint_answered_counts_as_out() {
        let b = Backoff::default();
        let t0 = Instant::now();
        drop(b.call(t0, TIMEOUT).unwrap());
        assert!(b.call(t0, TIMEOUT).is_none(), "paused");
        let b = Backoff::default();
        let call = b.call(t0, TIMEOUT).unwrap();
        let line = call.out("timed out", t0).unwrap();
        assert!(
            line.contains("is out (timed out)") && line.contains("for 1 s"),
            "{line}"
        );
        let probe = b.call(t0 + FIRST_PAUSE, TIMEOUT).unwrap();
        let back = probe.answered().unwrap();
        assert!(
            back.contains("answers again (after 1 failed call(s)"),
            "{back}"
        );
        let call = b.call(t0 + FIRST_PAUSE, TIMEOUT).unwrap();
        assert_eq!(call.answered(), None, "no run to end");
        assert!(b.call(t0 + FIRST_PAUSE, TIMEOUT).is_some());
    }

    #[test]
    fn pauses_double_to_the_cap_and_never_overflow() {
        assert_eq!(pause_after(1), FIRST_PAUSE);
        assert_eq!(pause_after(3), Duration::from_secs(4));
        assert_eq!(pause_after(7), MAX_PAUSE);
        assert_eq!(pause_after(u32::MAX), MAX_PAUSE);
    }
}
