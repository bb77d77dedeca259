//! The headers-phase pre-check (issue 18 item 3): a body request whose
//! caller's own bucket is already empty is refused before its body is
//! buffered (the rule and why it is exact: `admission/no_body.rs`). Here only
//! how long the request could wait in a queue for that bucket, which the
//! flow knows (its class, `x-sluice-max-wait-ms`).
//!
//! Only bodies that are large, or of unknown length (chunked, HTTP/2
//! without `content-length`): a small body costs less to read than the
//! answer it gets, and reading it keeps the refusal's model label and
//! audit fields (`sluice_model_requested`) as they were.

use super::{waiting, Stream};
use crate::admission::identity::Identity;
use crate::admission::Verdict;
use crate::flow::HostRequest;
use crate::host::Host;

/// Declared bodies above this are checked before they are read.
pub(super) const EARLY_REFUSAL_BYTES: u64 = 16 * 1024;

impl Stream {
    /// `Some`: refuse now, before the body.
    pub(super) fn refused_before_body(
        &self,
        host: &dyn Host,
        identity: &Identity,
    ) -> Option<Verdict> {
        // The queue is the VM's latest policy's (as `pass_gate` sees it);
        // the buckets are this stream's own.
        let gates = self.filter.latest();
        let view = HostRequest(host, self.request_headers.as_ref());
        // A gated model's queue may hold the request until the bucket
        // refills (`bucket_wait`): the most its class could wait, over
        // every gated model (the model is in the body).
        let may_wait_ms = match (gates.gates.is_empty(), gates.wake_queue.get()) {
            (false, Some(_)) => {
                let class = waiting::class_of(&gates, identity, &view);
                let asked = waiting::asked_wait(&view).ok().flatten();
                class
                    .and_then(|c| gates.engine.policy.classes.get(&c))
                    .filter(|c| c.queue)
                    .map_or(0, |c| c.max_wait_ms.min(asked.unwrap_or(u64::MAX)))
            }
            _ => 0,
        };
        self.filter.engine.refusal_before_body(
            host,
            identity,
            &self.path,
            self.started_ms,
            may_wait_ms,
        )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::flow::Poller;
    use crate::host::mock::MockHost;
    use crate::host::Action;

    /// A POST to `/v1/embeddings` whose body is still to come; `length`:
    /// its declared `content-length`, if any. The action of the headers.
    fn headers_only(poller: &Poller, host: &MockHost, length: Option<&str>) -> Action {
        let mut headers = vec![(":method", "POST"), (":path", "/v1/embeddings")];
        if let Some(len) = length {
            headers.push(("content-length", len));
        }
        host.begin(&headers, b"");
        host.set_prop(&["source", "address"], b"10.0.0.1:1");
        let Some(mut req) = poller.request() else {
            panic!("no request context");
        };
        req.on_request_headers(host, false)
    }

    #[test]
    fn a_spent_caller_is_refused_at_the_headers_of_a_large_or_unsized_body() {
        let host = MockHost::new(1_700_000_000_000);
        let mut poller = Poller::new();
        let policy = json!({"default_tier": "t", "tiers": {"t": {"requests": "1/hour"}}});
        assert!(poller.configure(&host, policy.to_string().as_bytes()));
        // The first is read as always (it has room).
        assert_eq!(headers_only(&poller, &host, None), Action::Pause);
        assert!(host.replies.borrow().is_empty());
        // Spend the one request.
        let body = json!({"model": "m", "input": "a"}).to_string();
        host.begin(
            &[(":method", "POST"), (":path", "/v1/embeddings")],
            body.as_bytes(),
        );
        host.set_prop(&["source", "address"], b"10.0.0.1:1");
        let Some(mut req) = poller.request() else {
            panic!("no request context");
        };
        assert_eq!(req.on_request_headers(&host, false), Action::Pause);
        assert_eq!(
            req.on_request_body(&host, body.len(), true),
            Action::Continue
        );

        // Unsized, and large: answered now, before any body.
        for length in [None, Some("1048000")] {
            assert_eq!(headers_only(&poller, &host, length), Action::Pause);
            let Some(reply) = host.last_reply() else {
                panic!("no answer at the headers ({length:?})");
            };
            assert_eq!(reply.status, 429);
            assert_eq!(reply.header("x-sluice-reason"), Some("user_rate_limit"));
        }
        assert_eq!(
            host.metric(crate::host::metrics::REFUSED_BEFORE_BODY.name),
            Some(2)
        );
        // A small declared body is read first (its answer keeps its model
        // label): no answer at the headers.
        assert_eq!(headers_only(&poller, &host, Some("40")), Action::Pause);
        assert!(host.replies.borrow().is_empty(), "answered before the body");
        assert_eq!(
            host.metric(crate::host::metrics::REFUSED_BEFORE_BODY.name),
            Some(2)
        );
    }
}
