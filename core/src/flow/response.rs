//! The response side: its events (headers, body, log), the verdict applied
//! (`finish`), the route fed the upstream's answer, and settlement.

use super::*;

impl Stream {
    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        self.status = host
            .response_header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if matches!(&self.phase, Phase::Upstream(up) if up.watch.is_some()) {
            // The provider's own x-ratelimit-* headers, read before sluice
            // adds its own (same names: they describe the caller's buckets).
            self.observe_provider_limits(host);
        }
        let headers = self
            .upstream()
            .map(|up| std::mem::take(&mut up.response_headers));
        for (name, value) in headers.unwrap_or_default().iter() {
            match name {
                timing::SERVER_TIMING => self.add_server_timing(host, value),
                _ => host.set_response_header(name, Some(value)),
            }
        }
        self.cache_response_headers(host);
        if let Some(watch) = self.upstream().and_then(|up| up.watch.take()) {
            // A good status is recorded once the answer ends (`on_log`):
            // a stream its upstream breaks after it is a failure.
            let good = self.status < 400;
            match self.upstream().filter(|_| good) {
                Some(up) => up.late = Some(watch),
                None => self.observe_upstream(host, self.status, &watch),
            }
        }
        if let Some(action) = self.fail_over(host) {
            return action;
        }
        let Some(up) = self.upstream() else {
            return Action::Continue;
        };
        if let Some(plan) = &up.plan {
            let content_type = host.response_header("content-type");
            let ollama = matches!(plan.api, Api::OllamaChat | Api::OllamaGenerate);
            // A declared API's answer passes as it comes, read whole.
            let format = match plan.answer_at {
                Some(_) => Format::Json,
                None => Format::detect(content_type.as_deref(), plan.stream && ollama),
            };
            // A stream may run past its allowance only if the upstream
            // ignores the max output it was given; then sluice ends it.
            let allowance = plan.stream.then_some(plan.max_output);
            if format != Format::Json {
                // sluice may change the stream's length.
                host.set_response_header("content-length", None);
            }
            up.meter = Some(match &plan.answer_at {
                Some(at) => ResponseMeter::declared(at.clone(), plan.max_output),
                None => ResponseMeter::new(format, plan.strip_usage, allowance),
            });
        }
        Action::Continue
    }

    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        if self.resend.as_ref().is_some_and(|r| r.peeking) {
            return self.peeked(host, body_size, end);
        }
        if self.resend.as_ref().is_some_and(|r| r.holding) {
            // A failed answer held while the next rung is tried: buffered,
            // never sent (unless every rung fails).
            return Action::Pause;
        }
        // Latency histograms describe model calls (the LLM APIs), not
        // `/v1/models` and the like.
        let model_call = body_size > 0 && self.api.reads_body();
        self.time_response(host, model_call, end);
        let metered = matches!(&self.phase, Phase::Upstream(up) if up.meter.is_some());
        if !metered && self.response_hash.is_none() && self.cache_store.is_none() {
            self.end_event();
            return Action::Continue;
        }
        // A stream cut in an earlier callback whose upstream sends on: the
        // server ignores the limit it was sent and generates on. The cut's
        // own chunk (its error event and `[DONE]`) went to the client in
        // that callback; now the stream is reset, once, so the server stops
        // (never in the cut's own callback: the host resets before that
        // callback's chunk is passed on, and the client would lose its
        // end). An upstream that ends in this chunk is not reset.
        let reset = !end
            && self
                .upstream()
                .is_some_and(|up| !up.reset && up.meter.as_ref().is_some_and(|m| m.cut));
        let chunk = host.response_body(body_size);
        self.hash_response(&chunk, end);
        let out = self
            .upstream()
            .and_then(|up| up.meter.as_mut())
            .and_then(|m| m.feed(&chunk, end));
        // After the meter: a stream it cut is never stored.
        let cut = self
            .upstream()
            .and_then(|up| up.meter.as_ref())
            .is_some_and(|m| m.cut);
        self.cache_feed(host, &chunk, end, cut);
        if end {
            // Stored (or not): the followers look again.
            self.land_flight(host);
        }
        if let Some(out) = out.filter(|out| *out != chunk) {
            host.replace_response_body(body_size, &out);
        }
        if reset {
            if let Some(up) = self.upstream() {
                up.reset = true;
            }
            // Settled in `on_log`, which the reset brings, from what the
            // meter counted up to the cut.
            add(host, metrics::STREAM_RESET, i64::from(host.reset_stream()));
        }
        if end {
            self.settle(host);
            self.release_slot(host);
        }
        self.end_event();
        Action::Continue
    }

    /// The first byte's latency (a model call's) and the end's time, read
    /// once per callback.
    fn time_response(&mut self, host: &dyn Host, model_call: bool, end: bool) {
        let Phase::Upstream(up) = &mut self.phase else {
            return;
        };
        up.event_ms = None;
        if model_call && !up.first_byte {
            up.first_byte = true;
            let ttft = up.event_now(host).saturating_sub(self.started_ms);
            metrics::TTFT_MS.record_at(host, &[&up.labels.1], ttft);
            self.audit.number(audit::Field::TtftMs, ttft);
        }
        if end && self.api.reads_body() {
            // The log's end-to-end latency ends here (no second clock
            // read).
            up.ended_ms = Some(up.event_now(host));
        }
    }

    /// The response body's SHA-256 for the audit, when it asks for one.
    fn hash_response(&mut self, chunk: &[u8], end: bool) {
        let Some(hash) = self.response_hash.as_mut() else {
            return;
        };
        sha2::Digest::update(hash, chunk);
        if end {
            let digest = sha2::Digest::finalize(hash.clone());
            let hex = crate::policy::keys::hex(&digest);
            self.audit.text(audit::Field::ResponseSha256, &hex);
        }
    }

    /// The response callback is over: the next reads the clock again.
    pub(super) fn end_event(&mut self) {
        if let Some(up) = self.upstream() {
            up.event_ms = None;
        }
    }

    pub fn on_log(&mut self, host: &dyn Host) {
        // Still waiting for the fleet: the answer has no one to go to, and
        // what the request holds (its local reservation, the take) is given
        // back — nothing else would (it never reached the upstream phase).
        if matches!(self.phase, Phase::Fleet(_)) {
            if let Phase::Fleet(wait) = std::mem::replace(&mut self.phase, Phase::Answered) {
                self.abandon_fleet_wait(host, *wait);
            }
        }
        // The answer's outcome, for the route's breaker.
        self.observe_late(host);
        // A failover attempt still waiting for the fleet gives back its take.
        self.abandon_fleet_attempt(host);
        // Client gone, upstream reset or timeout: settle from what was seen.
        self.settle(host);
        // A claim on its question goes back (no answer will be stored).
        self.land_flight(host);
        // Its slot or queue entry is given back (once, whichever came first).
        self.leave_gate(host);
        // A probe whose answer never came (the client left first) is given
        // back, not left to block the route until its lease ends.
        let watch = self.upstream().and_then(|up| up.watch.take());
        self.give_back_probe(host, watch);
        let answered = self.status != 0 && self.api.reads_body();
        let started_ms = self.started_ms;
        if let Some(up) = self.upstream().filter(|_| answered) {
            let model = &up.labels.1;
            let ended = up.ended_ms.unwrap_or_else(|| host.now_ms());
            let elapsed = ended.saturating_sub(started_ms);
            metrics::E2E_MS.record_at(host, &[model], elapsed);
        }
        self.write_audit(host);
    }

    /// Applies a verdict: answer locally, or let the request go upstream.
    pub(super) fn finish(&mut self, host: &dyn Host, mut verdict: Verdict) -> Action {
        if let Some(timing) = self.decision_timing(host, verdict.labels().decision) {
            verdict.push_header(timing::SERVER_TIMING, &timing);
        }
        self.phase = Phase::Answered;
        self.observe(host, &verdict);
        if verdict.is_admitted() && self.engine().policy.anomaly.is_some() {
            // Admission passed the global breaker: it is closed now (else
            // the gauge would stay at 1 after the hour's window let spend
            // fall under the ceiling, until a settlement).
            set_gauge(host, metrics::GLOBAL_BREAKER, 0);
        }
        match verdict {
            Verdict::Answer(answered) => {
                // Refused after it took a slot (a budget at dispatch).
                self.release_slot(host);
                // A local answer (a refusal, the static answer) is never
                // cached.
                self.cache_store = None;
                send_reply(host, &answered.into_reply());
                Action::Pause
            }
            Verdict::Admit(verdict) => {
                let mut response_headers = verdict.response_headers;
                if let Some(waited) = self.gate.as_ref().map(|g| g.waited_ms) {
                    response_headers.push_number("x-sluice-queued-ms", waited);
                }
                let engine = &self.filter.engine;
                let plan = verdict.plan.filter(|p| engine.settles(p));
                if plan.is_some() {
                    add(host, metrics::RESERVATIONS_OUTSTANDING, 1);
                }
                self.phase = Phase::Upstream(Upstream {
                    // Latency and token metrics describe requests that
                    // went upstream.
                    labels: (verdict.labels.tier, verdict.labels.model),
                    response_headers,
                    plan,
                    watch: None,
                    fleet_claims: Vec::new(),
                    meter: None,
                    first_byte: false,
                    event_ms: None,
                    ended_ms: None,
                    reset: false,
                    late: None,
                });
                Action::Continue
            }
        }
    }

    /// Applies a verdict the fleet let through (or that never asked it):
    /// the upstream phase keeps what the primary's answer will feed and
    /// the fleet's claims until they are settled.
    pub(super) fn finish_onward(
        &mut self,
        host: &dyn Host,
        verdict: Verdict,
        watch: Option<Watch>,
        fleet_claims: Vec<crate::fleet::Claimed>,
    ) -> Action {
        let action = self.finish(host, verdict);
        match self.upstream() {
            Some(up) => {
                up.watch = watch;
                up.fleet_claims = fleet_claims;
            }
            // Answered here after all: a probe it held learned nothing.
            None => self.give_back_probe(host, watch),
        }
        action
    }

    /// The route's half-open probe, given back unanswered (the request
    /// was answered here, or its client left first), so the next request
    /// may probe at once instead of when the lease ends. A release that
    /// cannot be written leaves the lease to expire.
    pub(super) fn give_back_probe(&self, host: &dyn Host, watch: Option<Watch>) {
        let Some((lease, pushback)) = watch.and_then(|w| Some((w.probe_lease?, w.pushback))) else {
            return;
        };
        let mut cas = Cas::new(host, self.engine().tries().take());
        route::release_probe(&mut cas, &pushback.route_key, lease);
        count_contention(host, cas.contention);
    }

    /// Feeds the upstream's answer to the route's pause and error breaker.
    pub(super) fn observe_upstream(&mut self, host: &dyn Host, status: u32, watch: &Watch) {
        let (pushback, lease) = (&watch.pushback, watch.probe_lease);
        if !pushback.must_record(status, lease) {
            return;
        }
        let now = host.now_ms();
        let retry_after = host.response_header("retry-after");
        let dice = self.filter.roll(now);
        // Envoy's own answers (no healthy upstream, timeouts, resets) also
        // count, but they say nothing about a credential.
        let from_upstream = host
            .property(&["response", "code_details"])
            .is_some_and(|d| d == b"via_upstream");
        let recorded = self.filter.engine.observe_upstream(
            host,
            pushback,
            &UpstreamReply {
                status,
                from_upstream,
                retry_after: retry_after.as_deref(),
                lease,
            },
            dice,
            now,
        );
        add(
            host,
            metrics::ERROR_BREAKER_OPENED,
            i64::from(recorded.breaker_opened),
        );
        add(host, metrics::PUSHBACK_DROPPED, i64::from(recorded.dropped));
        count_contention(host, recorded.contention);
        match recorded.paused {
            Some(route::PauseScope::Route) => metrics::UPSTREAM_PAUSES.add_at(host, &["route"], 1),
            Some(route::PauseScope::Credential) => {
                metrics::UPSTREAM_PAUSES.add_at(host, &["credential"], 1)
            }
            None => {}
        }
    }

    /// The answer of a good status is over: recorded as the success it
    /// was, or — the upstream reset it, or left it silent until Envoy's
    /// idle timeout — as the failure it turned out to be.
    pub(super) fn observe_late(&mut self, host: &dyn Host) {
        // Only a model call's answer can be a stream (a GET's never ends
        // as one: no host call for it).
        let model_call = self.api.reads_body();
        let Some(up) = self.upstream() else { return };
        let Some(watch) = up.late.take() else {
            return;
        };
        let broken = model_call
            && up.ended_ms.is_none()
            && !up.reset
            && host
                .property(&["response", "code_details"])
                .is_some_and(|d| {
                    d.starts_with(b"upstream_reset_after_response_started")
                        || d == b"upstream_per_try_idle_timeout"
                        || d == b"stream_idle_timeout"
                });
        let status = if broken { 0 } else { self.status };
        self.observe_upstream(host, status, &watch);
    }

    /// Replaces the reservation with the real cost; runs once per request.
    pub(super) fn settle(&mut self, host: &dyn Host) {
        let Some(up) = self.upstream() else { return };
        let claims = std::mem::take(&mut up.fleet_claims);
        let Some(plan) = up.plan.take() else { return };
        let (found, counted, cut, details) = match &up.meter {
            Some(m) => (m.found, m.output_events, m.cut, m.details()),
            None => (Found::Nothing, 0, false, Details::default()),
        };
        let (tier, model) = up.labels.clone();
        let now = up.event_ms.unwrap_or_else(|| host.now_ms());
        let upstream_ok = self.status == 0 || self.status < 400;
        let (settled, effort) =
            self.filter
                .engine
                .settle_parts(host, &plan, found, details, counted, upstream_ok, now);
        add(host, metrics::RESERVATIONS_OUTSTANDING, -1);
        count_contention(host, effort);
        if let Some((provider, _)) = &plan.rung {
            metrics::PROVIDER_SPEND.add_at(host, &[provider], settled.cost as i64);
        }
        if let Some(fleet) = &self.filter.fleet {
            let engine = &self.filter.engine;
            let used = crate::fleet::Used {
                billed: settled.billed,
                price: plan.price,
            };
            fleet.settle(engine, host, &claims, used, now);
        }
        let labels = (tier.as_str(), model.as_str());
        self.observe_settled(host, &settled, details, labels, upstream_ok, cut);
    }
}
