//! Failover after dispatch (docs/src/design.md, "Failover after
//! dispatch"): a request whose rung fails before its answer starts is sent
//! again, down the same ladder, and the caller gets one answer.
//!
//! How it runs in Envoy: the filter keeps what the request asked (its
//! parsed body) while it is upstream. When the answer's headers say the
//! rung failed (a status of `failover.on`, or Envoy's own answer for a
//! connect failure, reset or timeout), the answer is held at its headers
//! (its body buffered behind them, never sent), the failed attempt's
//! reservation is given back unbilled, the next rung is admitted as at
//! dispatch (its body rewritten, reserved at its prices) and the request
//! goes to it as an HTTP callout to `failover.cluster`, a cluster that
//! leads back into this very listener. There Envoy's routes pick the
//! rung by the routing header, inject the rung's credentials and apply
//! its retries and timeouts; sluice lets that inner request pass
//! unadmitted because it carries the process's secret marker
//! ([`ATTEMPT_HEADER`]), which sluice removes from every other request.
//! The callout's answer is metered and settled at the rung's prices,
//! then sent to the caller as a local reply (Envoy sends a local reply
//! of a stream whose response headers were held straight to the codec).
//! When no rung is left, the held failure goes on as it came (or the
//! static answer, when the policy has one, ends the ladder).
//!
//! A streamed request's rescue arrives whole (a callout's answer is
//! buffered), as one response body with every event in it.

use crate::admission::ladder::Served;
use crate::admission::{Asked, RequestContext, Verdict};
use crate::host::metrics;
use crate::host::{Action, Headers, Host};
use crate::state::store::{Cas, Updated};
use crate::usage::demand::Api;
use crate::usage::reconcile::{Format, ResponseMeter};

use super::phase::Phase;
use super::{add, count_contention, Stream, CLIENT_CREDENTIALS};

/// Marks an attempt sent back into the listener: its value is the
/// process's secret ([`SECRET_KEY`]); removed from every request.
pub const ATTEMPT_HEADER: &str = "x-sluice-attempt";
/// The secret an attempt carries, made once per Envoy process.
pub const SECRET_KEY: &str = "sluice:v1:failover_secret";
/// The attempts sent this second, for the whole Envoy: `second, count`.
const BUDGET_KEY: &str = "sluice:v1:failover_budget";

/// Request headers by which a client picks the account or project a
/// provider bills (OpenAI's organization and project, Google's quota
/// project): never sent to a provider's rung, whose account is the
/// operator's.
pub const ACCOUNT_HEADERS: [&str; 3] = [
    "openai-organization",
    "openai-project",
    "x-goog-user-project",
];

/// Headers of one hop, not the request's: never copied to an attempt.
const HOP_HEADERS: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// What a request sent upstream keeps for a failover.
pub(super) struct Resend {
    /// What the request asked, for admission on the next rung.
    pub(super) asked: Asked,
    /// The rung the attempt in flight went to (`None`: the primary).
    pub(super) on: Option<Served>,
    /// The rungs that failed, each with its status (`primary=503`).
    pub(super) failed: Vec<String>,
    /// Attempts sent, the first included.
    pub(super) attempts: u32,
    /// The callout of the attempt in flight.
    pub(super) token: Option<u32>,
    /// The failed answer is held at its headers (its body buffered).
    pub(super) holding: bool,
    /// A 400 held to its end, to read whether the server refused the
    /// input's length (then the model's `overflow` gets it).
    pub(super) peeking: bool,
    /// The next attempt goes to the same rung, its model the overflow.
    pub(super) overflowing: bool,
    /// An admitted attempt waiting for the fleet's answer.
    pub(super) fleet: Option<Box<FleetAttempt>>,
}

/// An attempt admitted here and paused for the fleet (as at dispatch).
pub(super) struct FleetAttempt {
    pub(super) pending: crate::fleet::Pending,
    pub(super) verdict: Verdict,
    pub(super) served: Option<Box<Served>>,
    pub(super) deadline: u64,
}

/// What sending a failed request on did.
pub(super) enum Next {
    /// An attempt is in flight: its answer comes as a callout.
    Sent,
    /// The caller was answered here (the static answer).
    Answered,
    /// Nothing is left to try: the failure goes to the caller.
    Exhausted,
}

/// Where a request is admitted again.
pub(super) enum Again {
    /// Down the ladder from this rung (`None`: the static answer).
    Down(Option<Box<Served>>),
    /// The rung it was on (`None`: the primary), as it now asks.
    Same,
}

/// The secret made once per Envoy process (every VM reads the same key):
/// 128 random bits, from the randomly keyed std hasher.
pub fn ensure_secret(host: &dyn Host) {
    if host.get(SECRET_KEY).is_some() {
        return;
    }
    use std::hash::{BuildHasher, Hasher};
    let mut secret = String::with_capacity(32);
    for salt in [host.now_ns(), !host.now_ns()] {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(salt);
        secret.push_str(&format!("{:016x}", h.finish()));
    }
    // Another VM may win the race: its secret stands.
    let _ = host.set(SECRET_KEY, secret.as_bytes(), 0);
}

/// Does `value` equal the process's secret? (Compared in constant time.)
pub fn is_attempt(host: &dyn Host, value: &str) -> bool {
    let Some((secret, _)) = host.get(SECRET_KEY) else {
        return false;
    };
    secret.len() == value.len()
        && secret
            .iter()
            .zip(value.as_bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

impl Stream {
    /// Keeps what a request admitted on `rung` (or the primary) needs to
    /// be sent again, when the policy fails over and a rung is left.
    pub(super) fn keep_for_failover(
        &mut self,
        verdict: &Verdict,
        rung: Option<&Served>,
        asked: &mut Option<Asked>,
    ) {
        let engine = self.engine();
        let Some(cfg) = engine.policy.failover.as_ref() else {
            return;
        };
        if cfg.attempts < 2 || !verdict.is_admitted() || asked.is_none() {
            return;
        }
        let model = asked.as_ref().and_then(|a| a.demand.model.as_deref());
        let after = rung.map(|s| s.provider.as_str());
        let next = engine.rung_after(self.api, model, after).is_some();
        let ends_static = engine.policy.static_fallback.is_some() && self.api != Api::Other;
        let overflows = model
            .and_then(|m| engine.policy.models.get(m))
            .is_some_and(|m| m.overflow.is_some());
        if !(next || ends_static || overflows) {
            return;
        }
        let Some(asked) = asked.take() else { return };
        self.resend = Some(Box::new(Resend {
            asked,
            on: rung.cloned(),
            failed: Vec::new(),
            attempts: 1,
            token: None,
            holding: false,
            peeking: false,
            overflowing: false,
            fleet: None,
        }));
    }

    /// At the answer's headers: a failed attempt is held and sent on
    /// (`Some(Pause)`), or the answer goes on (`None`).
    pub(super) fn fail_over(&mut self, host: &dyn Host) -> Option<Action> {
        let cfg = self.engine().policy.failover.as_ref()?;
        self.resend.as_ref()?;
        if !matches!(self.phase, Phase::Upstream(_)) {
            return None;
        }
        if self.status == 400 && self.overflow_model().is_some() {
            // Read to its end: a refusal of the input's length goes to
            // the model's overflow (`peeked`).
            self.resend.as_mut()?.peeking = true;
            return Some(Action::Pause);
        }
        // Only a status that may fail over costs a host call.
        if !cfg.fails_over(self.status, true) {
            return None;
        }
        let local = host
            .property(&["response", "code_details"])
            .is_none_or(|d| d != b"via_upstream");
        if !cfg.fails_over(self.status, local) {
            return None;
        }
        let status = self.status;
        self.note_failure(host, status);
        match self.next_attempt(host) {
            Next::Sent => {
                if let Some(r) = self.resend.as_mut() {
                    r.holding = true;
                }
                Some(Action::Pause)
            }
            Next::Answered => Some(Action::Pause),
            Next::Exhausted => None,
        }
    }

    /// The model the request's model overflows to, if it names one.
    pub(super) fn overflow_model(&self) -> Option<String> {
        let r = self.resend.as_ref()?;
        let model = r.asked.demand.model.as_deref()?;
        self.engine().policy.models.get(model)?.overflow.clone()
    }

    /// The end of a 400 held by [`Stream::fail_over`]: a server's refusal
    /// of the input's length (OpenAI's `context_length_exceeded`, vLLM's
    /// and llama.cpp's wording) sends the request to the model's overflow
    /// as a failover attempt; any other 400 goes on as it came.
    pub(super) fn peeked(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        if !end {
            return Action::Pause;
        }
        if let Some(r) = self.resend.as_mut() {
            r.peeking = false;
        }
        let body = host.response_body(body_size);
        let text = String::from_utf8_lossy(&body).to_ascii_lowercase();
        let too_long = [
            "context_length_exceeded",
            "maximum context length",
            "exceed_context_size",
        ]
        .iter()
        .any(|needle| text.contains(needle));
        let (Some(to), true) = (self.overflow_model(), too_long) else {
            return Action::Continue;
        };
        self.note_failure(host, 400);
        if let Some(r) = self.resend.as_mut() {
            r.asked.demand.model = Some(to);
            r.asked.respelled = true;
            r.overflowing = true;
        }
        match self.next_attempt(host) {
            Next::Sent => {
                if let Some(r) = self.resend.as_mut() {
                    r.holding = true;
                }
                Action::Pause
            }
            Next::Answered => Action::Pause,
            Next::Exhausted => Action::Continue,
        }
    }

    /// The attempt in flight failed with `status` (0: no answer).
    pub(super) fn note_failure(&mut self, host: &dyn Host, status: u32) {
        let Some(r) = self.resend.as_mut() else {
            return;
        };
        let name = r.on.as_ref().map_or("primary", |s| s.provider.as_str());
        if let Some(s) = &r.on {
            metrics::PROVIDER_REQUESTS.add_at(host, &[&s.provider, "failed"], 1);
        }
        r.failed.push(format!("{name}={status}"));
    }

    /// Sends the failed request to the next rung that admits it (or
    /// answers it with the static answer), within the attempts, the
    /// deadline and the second's attempt budget.
    pub(super) fn next_attempt(&mut self, host: &dyn Host) -> Next {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        if engine.policy.failover.is_none() || self.identity.is_none() {
            return Next::Exhausted;
        }
        let now = host.now_ms();
        let Some(mut r) = self.resend.take() else {
            return Next::Exhausted;
        };
        let next = self.next_from(host, &mut r, now);
        self.resend = Some(r);
        next
    }

    /// [`Stream::next_attempt`] with the request's [`Resend`] taken out.
    pub(super) fn next_from(&mut self, host: &dyn Host, r: &mut Resend, now: u64) -> Next {
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let (Some(cfg), Some(identity)) = (engine.policy.failover.as_ref(), self.identity.clone())
        else {
            return Next::Exhausted;
        };
        let deadline = self.started_ms.saturating_add(cfg.deadline_ms);
        if r.attempts >= cfg.attempts || now >= deadline {
            metrics::FAILOVER.add_at(host, &["exhausted"], 1);
            return Next::Exhausted;
        }
        if std::mem::take(&mut r.overflowing) {
            return self.overflow_attempt(host, r, now, deadline);
        }
        let model = r.asked.demand.model.as_deref();
        let after = r.on.as_ref().map(|s| s.provider.as_str());
        let next = engine.rung_after(self.api, model, after);
        if next.is_none() && engine.policy.static_fallback.is_none() {
            metrics::FAILOVER.add_at(host, &["exhausted"], 1);
            return Next::Exhausted;
        }
        if !self.take_attempt(host, cfg.per_second, now) {
            metrics::FAILOVER.add_at(host, &["over_budget"], 1);
            return Next::Exhausted;
        }
        // The failed attempt is given back unbilled.
        self.release_attempt(host, now);
        let (mut verdict, rung) =
            self.admit_again(host, (&identity, r), now, Again::Down(next.map(Box::new)));
        count_contention(host, verdict.contention());
        let failed = r.failed.join(",");
        mark_failed(&mut verdict, &failed);
        self.audit.text(super::audit::Field::Failed, &failed);
        let Some(served) = rung.filter(|_| verdict.is_admitted()) else {
            // The static answer, or a refusal the rung's admission gave
            // (the caller's own budget cannot pay it there).
            let outcome = if verdict.degraded().is_some() {
                "static"
            } else {
                "exhausted"
            };
            metrics::FAILOVER.add_at(host, &[outcome], 1);
            r.holding = false;
            self.answer_here(host, verdict);
            return Next::Answered;
        };
        self.through_fleet(host, r, verdict, Some(served), deadline, now)
    }

    /// The request, its model now the overflow, to the rung that refused
    /// its length (the primary, or the same provider), admitted there at
    /// the overflow's limits and prices.
    pub(super) fn overflow_attempt(
        &mut self,
        host: &dyn Host,
        r: &mut Resend,
        now: u64,
        deadline: u64,
    ) -> Next {
        let Some(identity) = self.identity.clone() else {
            return Next::Exhausted;
        };
        self.release_attempt(host, now);
        let (mut verdict, _) = self.admit_again(host, (&identity, r), now, Again::Same);
        count_contention(host, verdict.contention());
        let failed = r.failed.join(",");
        mark_failed(&mut verdict, &failed);
        self.audit.text(super::audit::Field::Failed, &failed);
        if !verdict.is_admitted() {
            metrics::FAILOVER.add_at(host, &["exhausted"], 1);
            r.holding = false;
            self.answer_here(host, verdict);
            return Next::Answered;
        }
        let same = r.on.clone().map(Box::new);
        self.through_fleet(host, r, verdict, same, deadline, now)
    }

    /// Admission of the request kept in `r`, as of `now`, where `again`
    /// says: the verdict, and the rung it goes to.
    pub(super) fn admit_again(
        &self,
        host: &dyn Host,
        (identity, r): (&crate::admission::identity::Identity, &Resend),
        now: u64,
        again: Again,
    ) -> (Verdict, Option<Box<Served>>) {
        let engine = &self.filter.engine;
        let ctx = RequestContext {
            identity,
            api: self.api,
            path: &self.path,
            asked: Some(&r.asked),
            now_ms: now,
        };
        match again {
            Again::Down(Some(next)) => {
                let seen = self.filter.seen(host);
                super::admit_down_the_ladder(host, engine, &ctx, Some(next), &seen)
            }
            Again::Down(None) => (engine.static_verdict(&ctx), None),
            Again::Same => (engine.admit_on(host, &ctx, r.on.as_ref()), None),
        }
    }

    /// Counts an attempt in the second's budget (every worker's); `false`
    /// when it is spent. A budget that cannot be written lets it go.
    pub(super) fn take_attempt(&self, host: &dyn Host, per_second: u32, now: u64) -> bool {
        let second = now / 1_000;
        let mut allowed = true;
        let mut cas = Cas::new(host, self.engine().tries().take());
        let written = cas.update(BUDGET_KEY, |bytes| {
            let (at, count) = match bytes.filter(|b| b.len() == 12) {
                Some(b) => (
                    u64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
                    u32::from_le_bytes(b[8..].try_into().unwrap_or_default()),
                ),
                None => (0, 0),
            };
            let count = if at == second { count } else { 0 };
            allowed = count < per_second;
            if !allowed {
                return None;
            }
            let mut out = second.to_le_bytes().to_vec();
            out.extend_from_slice(&(count + 1).to_le_bytes());
            Some(out)
        });
        count_contention(host, cas.contention);
        allowed || !matches!(written, Updated::Unchanged)
    }

    /// Gives back what the failed attempt holds: its reservation (never
    /// billed: the upstream failed it) and its fleet claims.
    pub(super) fn release_attempt(&mut self, host: &dyn Host, now: u64) {
        let filter = self.filter.clone();
        let Some(up) = self.upstream() else { return };
        let claims = std::mem::take(&mut up.fleet_claims);
        let Some(plan) = up.plan.take() else { return };
        count_contention(host, filter.engine.release(host, &plan, now));
        add(host, metrics::RESERVATIONS_OUTSTANDING, -1);
        if let Some(fleet) = &filter.fleet {
            let used = crate::fleet::Used {
                billed: Default::default(),
                price: plan.price,
            };
            fleet.settle(&filter.engine, host, &claims, used, now);
        }
    }

    /// Answers the caller here (the static answer, a refusal) in place of
    /// the held failure; the request's decision was counted already.
    pub(super) fn answer_here(&mut self, host: &dyn Host, verdict: Verdict) {
        self.cache_store = None;
        if let Some(r) = self.resend.as_mut() {
            r.holding = false;
        }
        if let Some(reply) = verdict.into_reply() {
            super::send_reply(host, &reply);
        }
        self.phase = Phase::Answered;
        self.release_slot(host);
    }

    /// Is `token` the callout of this request's attempt in flight?
    pub(super) fn owns_attempt(&self, token: u32) -> bool {
        self.resend.as_ref().is_some_and(|r| r.token == Some(token))
    }

    /// The answer of an attempt: sent to the caller, or (a failure) the
    /// request goes on down the ladder; with nothing left, the held
    /// failure goes on as it came.
    pub(super) fn attempt_answered(&mut self, host: &dyn Host, body_size: usize) {
        if let Some(r) = self.resend.as_mut() {
            r.token = None;
        }
        let status = host
            .call_response_header(":status")
            .and_then(|s| s.parse::<u32>().ok())
            .unwrap_or(0);
        let fails = self
            .engine()
            .policy
            .failover
            .as_ref()
            .is_some_and(|cfg| cfg.fails_over(status, true));
        if !fails {
            let body = host.call_response_body(body_size);
            let headers = host.call_response_headers().unwrap_or_default();
            metrics::FAILOVER.add_at(host, &["rescued"], 1);
            return self.deliver(host, status, &headers, body);
        }
        self.note_failure(host, status);
        match self.next_attempt(host) {
            Next::Sent | Next::Answered => {}
            Next::Exhausted => self.let_failure_through(host),
        }
    }

    /// Every rung failed: the held answer of the first failure goes on,
    /// saying which rungs were tried.
    pub(super) fn let_failure_through(&mut self, host: &dyn Host) {
        let now = host.now_ms();
        self.release_attempt(host, now);
        let Some(r) = self.resend.as_mut() else {
            return;
        };
        r.holding = false;
        let failed = r.failed.join(",");
        self.audit.text(super::audit::Field::Failed, &failed);
        host.set_response_header("x-sluice-failed", Some(&failed));
        host.resume_response();
    }

    /// The rescued answer to the caller: metered and settled at the
    /// rung's prices, then sent as a local reply.
    pub(super) fn deliver(
        &mut self,
        host: &dyn Host,
        status: u32,
        headers: &Headers,
        body: Vec<u8>,
    ) {
        self.status = status;
        let content_type = headers.get("content-type").map(str::to_owned);
        let mut body = body;
        let mut out: Vec<(String, String)> = headers
            .iter()
            .filter(|(n, _)| keeps_answer_header(n))
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        if let Some(up) = self.upstream() {
            for (name, value) in up.response_headers.iter() {
                out.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
                out.push((name.to_string(), value.to_string()));
            }
            if let Some(plan) = &up.plan {
                let ollama = matches!(plan.api, Api::OllamaChat | Api::OllamaGenerate);
                let mut meter = match &plan.answer_at {
                    Some(at) => ResponseMeter::declared(at.clone(), plan.max_output),
                    None => ResponseMeter::new(
                        Format::detect(content_type.as_deref(), plan.stream && ollama),
                        plan.strip_usage,
                        plan.stream.then_some(plan.max_output),
                    ),
                };
                if let Some(fed) = meter.feed(&body, true) {
                    body = fed;
                }
                up.meter = Some(meter);
                up.first_byte = true;
                up.ended_ms = Some(host.now_ms());
            }
        }
        self.settle(host);
        if let Some(r) = self.resend.as_mut() {
            r.holding = false;
        }
        let pairs: Vec<(&str, &str)> = out.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        host.send_reply(status, &pairs, &body);
        self.release_slot(host);
    }
}

/// Adds the rungs that failed to the verdict's `x-sluice-failed`.
pub(super) fn mark_failed(verdict: &mut Verdict, failed: &str) {
    verdict.push_header("x-sluice-failed", failed);
}

/// The client's request headers an attempt carries: all but, to a
/// provider, its credentials and account choice (the rung's route injects
/// its own),
/// the headers of one hop, sluice's and Envoy's own, and the length
/// (the body is rewritten for the rung).
pub(super) fn attempt_headers(
    request: Option<&Headers>,
    to_provider: bool,
) -> Vec<(String, String)> {
    let Some(request) = request else {
        return Vec::new();
    };
    let own = |n: &str| CLIENT_CREDENTIALS.contains(&n) || ACCOUNT_HEADERS.contains(&n);
    request
        .iter()
        .filter(|(name, _)| {
            let n = name.to_ascii_lowercase();
            let pseudo_kept = matches!(n.as_str(), ":method" | ":path" | ":authority");
            let dropped = (n.starts_with(':') && !pseudo_kept)
                || n == "content-length"
                || n.starts_with("x-sluice-")
                || n.starts_with("x-envoy-")
                || HOP_HEADERS.contains(&n.as_str())
                || (to_provider && own(n.as_str()));
            !dropped
        })
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

/// Does an attempt's answer header go to the caller? Not the status (the
/// reply carries it), the length (the body may be metered shorter) or one
/// hop's.
pub(super) fn keeps_answer_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    !n.starts_with(':')
        && n != "content-length"
        && !n.starts_with("x-envoy-")
        && !HOP_HEADERS.contains(&n.as_str())
}

/// Only the marker's owner may skip admission: what a client sent under
/// that name is removed (and its request admitted as any other).
pub(super) fn strip_attempt(host: &dyn Host, headers: &mut Option<Headers>) -> bool {
    let value = headers
        .as_ref()
        .and_then(|h| h.get(ATTEMPT_HEADER))
        .map(str::to_owned);
    let Some(value) = value else {
        return false;
    };
    host.set_request_header(ATTEMPT_HEADER, None);
    if let Some(h) = headers.as_mut() {
        h.remove(ATTEMPT_HEADER);
    }
    is_attempt(host, &value)
}
