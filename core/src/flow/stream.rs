//! One stream's request side: its events (headers, body, trailers) and
//! the decision (`decide`, then the steps: `steps`), and on to the
//! upstream (`send_on`).

use super::*;

impl Request {
    pub(super) fn with(&self, f: impl FnOnce(&mut Stream) -> Action) -> Action {
        match self.stream.try_borrow_mut() {
            Ok(mut stream) => f(&mut stream),
            Err(_) => Action::Continue,
        }
    }

    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        self.with(|s| s.on_request_headers(host, end_of_stream))
    }

    pub fn on_request_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        self.with(|s| s.on_request_body(host, body_size, end))
    }

    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        self.with(|s| s.on_request_trailers(host))
    }

    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        self.with(|s| s.on_response_headers(host))
    }

    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        self.with(|s| s.on_response_body(host, body_size, end))
    }

    pub fn on_log(&mut self, host: &dyn Host) {
        self.with(|s| {
            s.on_log(host);
            Action::Continue
        });
    }

    /// The answer to a callout this stream made (the fleet's strict take).
    pub fn on_call_response(&mut self, host: &dyn Host, token: u32, body_size: usize) {
        self.with(|s| {
            s.on_call_response(host, token, body_size);
            Action::Continue
        });
    }

    /// The audit fragment this stream would write now, as a JSON object.
    #[cfg(test)]
    pub(super) fn audit_line(&self) -> serde_json::Value {
        let mut fragment = String::new();
        if let Ok(s) = self.stream.try_borrow() {
            s.audit.render(&mut fragment, &[]);
        }
        let text = format!("{{\"status\":0{fragment}}}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }
}

impl Stream {
    pub fn new(filter: Rc<Filter>) -> Stream {
        Stream {
            context_id: 0,
            me: Weak::new(),
            gate: None,
            filter,
            identity: None,
            api: Api::Other,
            path: EMPTY_PATH.with(Rc::clone),
            request_headers: None,
            body_size: 0,
            phase: Phase::Undecided,
            status: 0,
            started_ms: 0,
            arrived_ns: 0,
            response_hash: None,
            cache_looked: false,
            cache_store: None,
            flight: None,
            follow_until: None,
            audit: audit::AuditRecord::default(),
            resend: None,
            sent_len: 0,
        }
    }

    pub(super) fn engine(&self) -> &Engine {
        &self.filter.engine
    }

    /// The verdict is applied: answered here, or let through.
    pub(super) fn decided(&self) -> bool {
        matches!(self.phase, Phase::Answered | Phase::Upstream(_))
    }

    pub(super) fn upstream(&mut self) -> Option<&mut Upstream> {
        match &mut self.phase {
            Phase::Upstream(up) => Some(up),
            _ => None,
        }
    }

    /// A request header, from the snapshot of the request headers.
    pub(super) fn header(&self, host: &dyn Host, name: &str) -> Option<String> {
        crate::admission::identity::RequestView::header(
            &HostRequest(host, self.request_headers.as_ref()),
            name,
        )
        .map(Cow::into_owned)
    }

    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        // One clock read: the arrival, in ms for the decision, in ns for
        // the decision's own time.
        self.arrived_ns = host.now_ns();
        self.started_ms = self.arrived_ns / 1_000_000;
        if self.strip_fallback_header(host) {
            // An attempt of this Envoy's own failover: admitted already.
            self.phase = Phase::Answered;
            return Action::Continue;
        }
        // The path, method and length are read where the snapshot holds
        // them (not copied out): only the path the stream keeps is.
        let view = HostRequest(host, self.request_headers.as_ref());
        let raw_path = view.header(":path").unwrap_or_default();
        let path = match crate::usage::demand::canonical_path(&raw_path) {
            Ok(canonical) => Ok(Rc::<str>::from(canonical.as_ref())),
            Err(_) => Err(Rc::<str>::from(raw_path.as_ref())),
        };
        // A body on any method is read (a lenient server may serve it);
        // a bodyless POST is classified too (and refused if it is no API).
        let length = view.header("content-length");
        let with_body = self.carries_body(host, length.as_deref(), end_of_stream);
        let post = view
            .header(":method")
            .is_some_and(|m| m.eq_ignore_ascii_case("POST"));
        let work = with_body || post;
        let length = length.and_then(|v| v.trim().parse::<u64>().ok());
        self.api = match path.as_deref() {
            Ok(path) if work => Api::of_path(path),
            _ => Api::Other,
        };
        let identity = match self.caller(host) {
            Ok(identity) => identity,
            Err(refused) => return refused,
        };
        if let Some(answered) = self.own_limits(host, &identity, &path) {
            return answered;
        }
        if let Some(verdict) = self.endpoint(host, &identity, path, work) {
            return self.finish(host, verdict);
        }
        let declared = if self.api.reads_body() { length } else { None };
        if let Some(verdict) = declared.and_then(|len| self.engine().too_large(&identity, len)) {
            return self.finish(host, verdict);
        }
        let large = declared.is_none_or(|len| len > precheck::EARLY_REFUSAL_BYTES);
        if self.api.reads_body() && !end_of_stream && large {
            // The caller's own empty bucket refuses it before its body is
            // buffered and parsed (`flow/precheck.rs`).
            if let Some(verdict) = self.refused_before_body(host, &identity) {
                add(host, metrics::REFUSED_BEFORE_BODY, 1);
                self.identity = Some(Rc::new(identity));
                return self.finish(host, verdict);
            }
        }
        self.identity = Some(Rc::new(identity));
        if self.api.reads_body() && !end_of_stream {
            return Action::Pause; // wait for the body
        }
        self.decide(host, &[])
    }

    /// Only sluice may choose the fallback route, also when the policy has
    /// no `fallback` section but the Envoy routes still match it: the
    /// routing header is removed, and the request headers kept without it.
    ///
    /// `true`: the request is an attempt of this Envoy's own failover
    /// (`failover`), its marker checked and removed; its routing header
    /// stays, it was set by sluice.
    pub(super) fn strip_fallback_header(&mut self, host: &dyn Host) -> bool {
        let header = self
            .engine()
            .route_header()
            .unwrap_or(crate::admission::ladder::DEFAULT_ROUTE_HEADER);
        let mut headers = host.request_headers();
        if failover::strip_attempt(host, &mut headers) {
            self.request_headers = headers;
            return true;
        }
        // Removed only when sent (a host call saved on every other
        // request); a host that cannot list the headers removes it anyway.
        let sent = headers.as_ref().is_none_or(|all| all.count(header) > 0);
        if sent {
            host.set_request_header(header, None);
            if let Some(all) = headers.as_mut() {
                all.remove(header);
            }
        }
        self.request_headers = headers;
        false
    }

    /// Who is calling, unless the penalty box holds them: the identity, or
    /// the action of the refusal already answered (an unknown key's 401, or
    /// the box's 429).
    pub(super) fn caller(&mut self, host: &dyn Host) -> Result<Identity, Action> {
        let view = HostRequest(host, self.request_headers.as_ref());
        let identity = match self.engine().identify_why(&view) {
            Ok(identity) => identity,
            Err((verdict, why)) => {
                // A failed authentication counts toward its address's box
                // (guessing keys is what the box is for); once blocked, the
                // address gets 429 `temporarily_blocked` instead of 401.
                metrics::AUTH_FAILURES.add_at(host, &[why.code()], 1);
                let (blocked, checked) =
                    self.engine()
                        .penalty_box_failed(host, &view, self.started_ms);
                count_penalty_box(host, &checked);
                if blocked.is_none() {
                    // (A block's verdict carries its contention.)
                    count_contention(host, checked.contention);
                }
                return Err(self.finish(host, blocked.unwrap_or(*verdict)));
            }
        };
        let (blocked, checked) = self
            .engine()
            .penalty_box(host, &view, &identity, self.started_ms);
        count_penalty_box(host, &checked);
        if let Some(verdict) = blocked {
            self.identity = Some(Rc::new(identity));
            return Err(self.finish(host, verdict));
        }
        count_contention(host, checked.contention);
        Ok(identity)
    }

    /// The path the request is matched by (canonical, or the raw one when
    /// it has none) and the API it speaks; or the refusal of a request
    /// that may be an LLM call sluice cannot read: a path with no
    /// canonical form (whatever the upstream decodes it to, sluice cannot
    /// know), or work outside every `passthrough` rule (deny by default).
    pub(super) fn endpoint(
        &mut self,
        host: &dyn Host,
        identity: &Identity,
        path: Result<Rc<str>, Rc<str>>,
        work: bool,
    ) -> Option<Verdict> {
        match path {
            Ok(path) => self.path = path,
            Err(_) if work => return Some(self.engine().ambiguous_path(identity)),
            Err(raw) => self.path = raw,
        }
        if self.api == Api::Other && work {
            // A declared API first (the policy refuses a path that is
            // both), then the passthrough rules.
            let view = HostRequest(host, self.request_headers.as_ref());
            let method = view.header(":method").unwrap_or_default();
            self.api = self
                .engine()
                .declared_api(&method, &self.path)
                .unwrap_or_else(|| self.engine().passthrough(&method, &self.path));
            if self.api == Api::Other {
                return Some(self.engine().unknown_endpoint(identity));
            }
        }
        None
    }

    /// Does a body follow the request headers? The stream not ending with
    /// them (HTTP/2 DATA frames, also on a GET), a non-zero
    /// `content-length`, or any `transfer-encoding` say so.
    pub(super) fn carries_body(
        &self,
        host: &dyn Host,
        length: Option<&str>,
        end_of_stream: bool,
    ) -> bool {
        let declared = length.is_some_and(|v| v.trim().parse::<u64>() != Ok(0));
        !end_of_stream || declared || self.header(host, "transfer-encoding").is_some()
    }

    pub fn on_request_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        if self.decided() {
            return Action::Continue;
        }
        let Some(identity) = self.identity.as_ref() else {
            return Action::Continue;
        };
        if let Some(verdict) = self.engine().too_large(identity, body_size as u64) {
            return self.finish(host, verdict);
        }
        self.body_size = body_size;
        if !end {
            // Buffer until the whole body is here: the end of the body, or
            // trailers after it (HTTP/2, HTTP/3).
            return Action::Pause;
        }
        let body = host.request_body(body_size);
        self.decide(host, &body)
    }

    /// A request that ends with trailers never has a body callback with
    /// `end_of_stream`: this is where it is decided, on the buffered body.
    /// Without it, Envoy would resume the paused request on its own when
    /// the trailers arrive — upstream, undecided.
    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        if self.decided() || self.identity.is_none() {
            return Action::Continue;
        }
        let body = host.request_body(self.body_size);
        self.decide(host, &body)
    }

    /// Admission once everything the policy needs is known: demand → the
    /// cache → the decision's steps (`steps`).
    pub(super) fn decide(&mut self, host: &dyn Host, body: &[u8]) -> Action {
        let Some(identity) = self.identity.clone() else {
            return Action::Continue;
        };
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let asked = match engine.demand(&identity, self.api, body) {
            Ok(asked) => asked,
            Err(verdict) => return self.finish(host, *verdict),
        };
        if let Some(a) = &asked {
            // An `/invocations` body's API, as its shape says.
            self.api = a.demand.api;
        }
        let identity = match self.runs_and_loops(host, identity, asked.as_ref(), body) {
            Ok(identity) => identity,
            Err(action) => return action,
        };
        // Admission time is arrival time (one clock read per request).
        let now = self.started_ms;
        let model = asked
            .as_ref()
            .and_then(|a| a.demand.model.as_deref())
            .or(engine.passthrough_model(self.api));
        self.audit_request(model, body);
        if let Some(action) = self.cache_lookup(host, asked.as_ref(), model) {
            return action;
        }
        let parked = waiting::Parked {
            asked,
            body_len: body.len(),
            hold: None,
        };
        self.run_steps(host, steps::Step::Route, identity, parked, now)
    }

    /// An admitted request goes on: rerouted to the fallback or watched on
    /// the primary, its body rewritten, then through the fleet's gate.
    pub(super) fn send_on(
        &mut self,
        host: &dyn Host,
        mut verdict: Verdict,
        rung: Option<&Served>,
        body_len: usize,
        watch: Option<Watch>,
    ) -> Action {
        let mut watched = None;
        if let Verdict::Admit(admitted) = &mut verdict {
            if let Some(served) = rung {
                self.reroute(host, admitted, served);
                // Another provider's answer is not the primary's to cache.
                self.cache_store = None;
            } else {
                watched = watch;
            }
        }
        self.sent_len = body_len;
        if let Some(new_body) = verdict.take_body() {
            // The upstream gets the rewritten request (model, max output,
            // usage in streams); its length changes with it.
            host.replace_request_body(body_len, &new_body);
            host.set_request_header("content-length", Some(&new_body.len().to_string()));
            self.sent_len = new_body.len();
        }
        self.fleet_gate(host, verdict, watched)
    }

    /// A rung of the ladder: the request goes to that provider's route
    /// (header + route cache refresh), without the client's credentials
    /// (Envoy's route injects the provider's).
    pub(super) fn reroute(&self, host: &dyn Host, verdict: &mut Admitted, served: &Served) {
        for credential in CLIENT_CREDENTIALS.iter().chain(&failover::ACCOUNT_HEADERS) {
            host.set_request_header(credential, None);
        }
        host.set_request_header(&served.header, Some(&served.value));
        if let Err(why) = host.clear_route_cache() {
            log::warn!("clear_route_cache failed: {why}");
        }
        verdict
            .response_headers
            .push("x-sluice-provider", &served.provider);
        let seen = self.filter.seen(host);
        if seen.state.as_ref().is_some_and(|s| s.kill_switch.active) {
            verdict.response_headers.push("x-sluice-kill-switch", "1");
        }
        add(host, metrics::REROUTED, 1);
        metrics::PROVIDER_REQUESTS.add_at(host, &[&served.provider, "served"], 1);
    }
}
