//! The decision's own time, when the policy asks for it
//! (`request.server_timing`): from the request's arrival in the filter
//! (its request headers) to the verdict applied — refused or answered
//! here, or let through — on the host's clock. It includes what sluice
//! made the request wait for (its body, a queue, a bucket's refill, the
//! fleet) and nothing after the verdict (the upstream's time is the
//! upstream's). Recorded in `sluice_decision_microseconds` and sent as
//! `Server-Timing: sluice;dur=<ms>` on the answer the client gets.

use super::*;

/// The `Server-Timing` metric name (its `dur` is in milliseconds).
pub(super) const SERVER_TIMING: &str = "server-timing";

impl Stream {
    /// The `Server-Timing` value of this request's decision, the time
    /// recorded by decision; `None` when the policy does not ask.
    pub(super) fn decision_timing(&self, host: &dyn Host, decision: Decision) -> Option<String> {
        if !self.engine().policy.request.server_timing || self.arrived_ns == 0 {
            return None;
        }
        let ns = host.now_ns().saturating_sub(self.arrived_ns);
        metrics::DECISION_US.record_at(host, &[decision.code()], ns / 1_000);
        Some(server_timing(ns))
    }

    /// Sets the response's `Server-Timing` to sluice's entry, after the
    /// upstream's own entries if it sent any (the field is a list).
    pub(super) fn add_server_timing(&self, host: &dyn Host, ours: &str) {
        let merged = match host.response_header(SERVER_TIMING) {
            Some(theirs) if !theirs.trim().is_empty() => format!("{theirs}, {ours}"),
            _ => ours.to_string(),
        };
        host.set_response_header(SERVER_TIMING, Some(&merged));
    }
}

/// `sluice;dur=<ms>` (the Server Timing spec's `dur` is milliseconds),
/// to the microsecond.
pub(super) fn server_timing(ns: u64) -> String {
    let us = ns / 1_000;
    format!("sluice;dur={}.{:03}", us / 1_000, us % 1_000)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::server_timing;
    use crate::flow::Poller;
    use crate::host::mock::MockHost;
    use crate::host::Action;

    const T0: u64 = 1_700_000_000_000;

    /// A chat request whose body comes `wait_ms` after its headers; the
    /// action of the body.
    fn chat(poller: &Poller, host: &MockHost, wait_ms: u64) -> (crate::flow::Request, Action) {
        let len = host.begin_chat(5, &[]);
        host.set_prop(&["source", "address"], b"10.0.0.1:1");
        let mut req = poller.request().unwrap();
        assert_eq!(req.on_request_headers(host, false), Action::Pause);
        host.advance(wait_ms);
        let action = req.on_request_body(host, len, true);
        (req, action)
    }

    fn load(host: &MockHost, on: bool) -> Poller {
        let policy = json!({"default_tier": "t", "tiers": {"t": {"requests": "1/min"}},
                            "request": {"server_timing": on}});
        let mut poller = Poller::new();
        assert!(poller.configure(host, policy.to_string().as_bytes()));
        poller
    }

    #[test]
    fn answers_carry_the_decision_time_when_asked_and_it_is_recorded() {
        let host = MockHost::new(T0);
        let poller = load(&host, true);
        let (mut req, action) = chat(&poller, &host, 3);
        assert_eq!(action, Action::Continue);
        // The upstream's own entry is kept, sluice's follows it.
        host.respond(&[(":status", "200"), ("server-timing", "upstream;dur=5")]);
        req.on_response_headers(&host);
        assert_eq!(
            host.resp_header("server-timing").as_deref(),
            Some("upstream;dur=5, sluice;dur=3.000")
        );
        let (_, action) = chat(&poller, &host, 0);
        assert_eq!(action, Action::Pause);
        let reply = host.last_reply().expect("refused");
        assert_eq!(reply.status, 429);
        assert_eq!(reply.header("server-timing"), Some("sluice;dur=0.000"));
        let recorded = |decision: &str| {
            let name = format!("sluice_decision_microseconds_decision={decision};");
            host.histograms.borrow().get(&name).cloned()
        };
        assert_eq!(recorded("admit"), Some(vec![3_000]));
        assert_eq!(recorded("refuse"), Some(vec![0]));
    }

    #[test]
    fn off_by_default_no_header_and_no_histogram() {
        let host = MockHost::new(T0);
        let poller = load(&host, false);
        let (mut req, _) = chat(&poller, &host, 3);
        host.respond(&[(":status", "200")]);
        req.on_response_headers(&host);
        assert_eq!(host.resp_header("server-timing"), None);
        chat(&poller, &host, 0);
        let reply = host.last_reply().expect("refused");
        assert_eq!(reply.header("server-timing"), None);
        assert!(host.histograms.borrow().is_empty());
    }

    #[test]
    fn dur_is_milliseconds_to_the_microsecond() {
        assert_eq!(server_timing(0), "sluice;dur=0.000");
        assert_eq!(server_timing(999), "sluice;dur=0.000");
        assert_eq!(server_timing(42_500), "sluice;dur=0.042");
        assert_eq!(server_timing(1_234_567), "sluice;dur=1.234");
        assert_eq!(server_timing(3_000_000_000), "sluice;dur=3000.000");
    }
}
