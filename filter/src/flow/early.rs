//! The headers-phase pre-check (issue 18 item 3): a body request whose
//! caller's own bucket is already empty is refused before its body is
//! buffered (the rule and why it is exact: `engine/early.rs`). Here only
//! how long the request could wait in a queue for that bucket, which the
//! flow knows (its class, `x-sluice-max-wait-ms`).
//!
//! Only bodies that are large, or of unknown length (chunked, HTTP/2
//! without `content-length`): a small body costs less to read than the
//! answer it gets, and reading it keeps the refusal's model label and
//! audit fields (`sluice_model_requested`) as they were.

use super::{waiting, Stream};
use crate::engine::Verdict;
use crate::host::{Host, HostRequest};
use crate::principal::Identity;

/// Declared bodies above this are checked before they are read.
pub(super) const EARLY_REFUSAL_BYTES: u64 = 16 * 1024;

impl Stream {
    /// `Some`: refuse now, before the body.
    pub(super) fn refused_before_body(
        &self,
        host: &dyn Host,
        identity: &Identity,
    ) -> Option<Verdict> {
        let filter = &self.filter;
        let view = HostRequest(host, self.request_headers.as_deref());
        // A gated model's queue may hold the request until the bucket
        // refills (`bucket_wait`): the most its class could wait, over
        // every gated model (the model is in the body).
        let may_wait_ms = match (filter.gates.is_empty(), filter.wake_queue.get()) {
            (false, Some(_)) => {
                let class = waiting::class_of(filter, identity, &view);
                let asked = waiting::asked_wait(&view).ok().flatten();
                class
                    .and_then(|c| filter.engine.policy.classes.get(&c))
                    .filter(|c| c.queue)
                    .map_or(0, |c| c.max_wait_ms.min(asked.unwrap_or(u64::MAX)))
            }
            _ => 0,
        };
        filter
            .engine
            .refusal_before_body(host, identity, &self.path, self.started_ms, may_wait_ms)
    }
}
