//! The caller's own limits endpoint (`request.limits_path`), answered at
//! the request headers, never upstream: a `GET` is admitted like any
//! bodyless request (it takes one from each of the caller's request
//! buckets, so reading cannot flood), then the figures are read without
//! taking anything (`admission/own_limits.rs`); any other method is 405.

use super::*;

impl Stream {
    /// `Some`: the request was for the limits path, and is answered.
    pub(super) fn own_limits(
        &mut self,
        host: &dyn Host,
        identity: &Identity,
        path: &Result<Rc<str>, Rc<str>>,
    ) -> Option<Action> {
        let canonical = path.as_ref().ok()?;
        if !self.engine().is_limits_path(canonical) {
            return None;
        }
        self.path = canonical.clone();
        self.identity = Some(Rc::new(identity.clone()));
        let view = HostRequest(host, self.request_headers.as_ref());
        let method = view.header(":method").unwrap_or_default().into_owned();
        if method != "GET" {
            let verdict = self.engine().limits_method_not_allowed(identity, &method);
            return Some(self.finish(host, verdict));
        }
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let ctx = RequestContext {
            identity,
            api: Api::Other,
            path: canonical,
            asked: None,
            now_ms: self.started_ms,
        };
        let verdict = engine.admit(host, &ctx);
        let Verdict::Admit(admitted) = &verdict else {
            return Some(self.finish(host, verdict));
        };
        // What it took stays taken (a read is a request); the figures are
        // read after it, so they include it.
        let run = engine.run_in_header(identity, &view);
        let named = Identity {
            run,
            ..identity.clone()
        };
        let body = engine.own_limits(host, &named, self.started_ms);
        let timing = self.decision_timing(host, verdict.labels().decision);
        let mut headers: Vec<(&str, &str)> = admitted.response_headers.iter().collect();
        if let Some(timing) = &timing {
            headers.push((super::timing::SERVER_TIMING, timing));
        }
        headers.push(("content-type", "application/json"));
        headers.push(("cache-control", "no-store"));
        host.send_reply(200, &headers, body.to_string().as_bytes());
        self.phase = Phase::Answered;
        self.observe(host, &verdict);
        Some(Action::Pause)
    }
}
