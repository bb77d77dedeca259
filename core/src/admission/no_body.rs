//! Refusals that need no body (issue 18 item 3). A body request's caller
//! whose own bucket is already empty is refused in the headers phase, so
//! its body is never buffered, parsed or estimated: a caller with a spent
//! key cannot make sluice do that work for it.
//!
//! Exact, not a guess: only the buckets the path alone selects (the
//! caller's tier's, team's, org's, a route's without shares; not a model's:
//! the model is in the body; nor one with shares: admission decides what
//! the caller's group may take) whose meter every
//! body request costs at least one unit of (requests; tokens and input
//! tokens: the input estimate is at least 1), peeked without reserving. If
//! one cannot give 1 unit now, admission would refuse the request whatever
//! its body says, with the same bucket's 429 (its `Retry-After` is for one
//! unit: never later than the full answer's). Nothing is reserved, so
//! nothing can leak. Output-token and spend buckets are left to admission
//! (a body may ask for no output; a model may be free).
//!
//! What may differ from the answer after the body: a request whose body is
//! invalid gets this 429 rather than its 400, and one the global spend
//! breaker would refuse gets the bucket's 429 rather than
//! `global_breaker_open` — refused either way.
//!
//! The peek is the one the queue's check makes too (`Engine::short`,
//! behind [`Engine::would_admit`]); only what each asks of a bucket differs.

use super::*;

impl Engine {
    /// The 429 a body request of `identity` to `path` gets whatever its
    /// body, or `None`. `may_wait_ms`: how long its class may wait for a
    /// bucket in a queue (admission sleeps instead of refusing when the
    /// bucket refills within it): refused here only if it refills later.
    pub fn refusal_before_body(
        &self,
        store: &dyn SharedStore,
        identity: &Identity,
        path: &str,
        now_ms: u64,
        may_wait_ms: u64,
    ) -> Option<Verdict> {
        let reserver = self.reserver(store);
        let applying = self.applying(identity, None, path);
        let need = |b: &Bucket| {
            // A bucket with shares (a route's) is a commons admission
            // shares out by group: left to admission, like a model's.
            let per_request = matches!(
                b.meter,
                Meter::Requests | Meter::Tokens | Meter::InputTokens
            );
            (b.shares.is_none() && !b.soft && per_request).then_some(1)
        };
        // Admission compares the whole seconds of its Retry-After.
        let (index, shortfall) = self
            .short(&reserver, identity, &applying, need, now_ms)
            .find(|(_, s)| s.retry_after_ms / 1_000 * 1_000 >= may_wait_ms)?;
        Some(self.peeked(index, shortfall, &applying, identity, None, now_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::store::MemStore;
    use serde_json::json;

    use crate::admission::tests::Caller as From;

    fn engine(tier: Value) -> (Engine, MemStore) {
        let policy = Policy::from_value(json!({
            "default_tier": "t", "tiers": {"t": tier},
            // `x` is listed without a chat template: its bound is its
            // text's bytes.
            "models": {"m": {"requests": "1/min"},
                       "x": {"input_bound": {"fixed": 0, "per_message": 0}}},
        }))
        .unwrap();
        let store = MemStore::default();
        let e = Engine::new(policy);
        e.prepare(&store).unwrap();
        (e, store)
    }

    fn chat(e: &Engine, store: &MemStore, id: &Identity, now: u64) -> Verdict {
        let body = json!({"model": "x", "max_tokens": 5,
                          "messages": [{"role": "user", "content": "hi"}]});
        call(e, store, id, now, Api::OpenAiChat, body)
    }

    /// One token of input (`a`), no output.
    fn embed(e: &Engine, store: &MemStore, id: &Identity, now: u64) -> Verdict {
        let body = json!({"model": "x", "input": "a"});
        call(e, store, id, now, Api::OpenAiEmbeddings, body)
    }

    fn call(
        e: &Engine,
        store: &MemStore,
        id: &Identity,
        now: u64,
        api: Api,
        body: Value,
    ) -> Verdict {
        let body = body.to_string();
        let asked = e.demand(id, api, body.as_bytes()).unwrap();
        let ctx = RequestContext {
            identity: id,
            api,
            path: "/v1/chat/completions",
            asked: asked.as_ref(),
            now_ms: now,
        };
        e.admit(store, &ctx)
    }

    #[test]
    fn an_empty_request_bucket_refuses_before_the_body_with_the_same_answer() {
        let (e, store) = engine(json!({"requests": "2/min"}));
        let id = e.identify(&From("1.2.3.4:5")).unwrap();
        let path = "/v1/chat/completions";
        for t in 0..2 {
            assert!(e.refusal_before_body(&store, &id, path, t, 0).is_none());
            assert!(chat(&e, &store, &id, t).reply().is_none());
        }
        let early = e.refusal_before_body(&store, &id, path, 10, 0).unwrap();
        let late = chat(&e, &store, &id, 10);
        let (a, b) = (early.reply().unwrap(), late.reply().unwrap());
        assert_eq!(
            (a.status, a.header("x-sluice-reason")),
            (429, Some("user_rate_limit"))
        );
        assert_eq!(a.status, b.status);
        assert_eq!(a.header("x-sluice-reason"), b.header("x-sluice-reason"));
        assert_eq!(a.header("retry-after"), b.header("retry-after"));
        assert_eq!(early.bucket(), late.bucket());
        // A class that may wait out the refill is not refused early.
        assert!(e
            .refusal_before_body(&store, &id, path, 10, 60_000)
            .is_none());
        // Another caller is untouched; nothing was reserved by the peeks.
        let other = e.identify(&From("5.6.7.8:5")).unwrap();
        assert!(e.refusal_before_body(&store, &other, path, 10, 0).is_none());
    }

    #[test]
    fn a_spent_token_budget_refuses_early_and_output_only_budgets_do_not() {
        let (e, store) = engine(json!({"daily_tokens": 20}));
        let id = e.identify(&From("1.2.3.4:5")).unwrap();
        let path = "/v1/embeddings";
        assert!(e.refusal_before_body(&store, &id, path, 0, 0).is_none());
        // Spend it all, one token at a time.
        while embed(&e, &store, &id, 1).reply().is_none() {}
        let early = e.refusal_before_body(&store, &id, path, 2, 0).unwrap();
        let (a, b) = (
            early.reply().unwrap(),
            embed(&e, &store, &id, 2).reply().unwrap(),
        );
        assert_eq!(
            (a.status, a.header("x-sluice-reason")),
            (b.status, b.header("x-sluice-reason"))
        );
        assert_eq!(a.status, 429);
        // Output-only budgets: a body may ask for no output at all.
        let (e, store) = engine(json!({"output_tokens": "5/min"}));
        let id = e.identify(&From("1.2.3.4:5")).unwrap();
        while chat(&e, &store, &id, 1).reply().is_none() {}
        assert!(e.refusal_before_body(&store, &id, path, 2, 0).is_none());
    }
}
