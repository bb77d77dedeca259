//! Micro-benchmarks of the policy core (run: `make bench-core` or
//! `cargo bench -p sluice-core --bench core`). The store is the in-process
//! `MemStore` (a mutex-guarded map, like Envoy's shared data), so these
//! figures are the core's own cost without the wasm runtime.
#![allow(clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use serde_json::json;
use sluice_core::bench::{Api, Engine, Format, RequestContext, RequestView, ResponseMeter};
use sluice_core::{MemStore, Policy};

struct Caller(String);
impl RequestView for Caller {
    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        (name == "x-api-key").then_some("bench-key".into())
    }
    fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
        None
    }
    fn client_address(&self) -> Option<String> {
        Some(self.0.clone())
    }
}

fn engine(policy: serde_json::Value) -> (Engine, MemStore) {
    let engine = Engine::new(Policy::from_value(policy).expect("bench policy"));
    let store = MemStore::default();
    engine.prepare(&store).expect("prepare");
    (engine, store)
}

fn chat_body(bytes: usize) -> Vec<u8> {
    let sentence = "The quick brown fox jumps over the lazy dog, again and again. ";
    let text: String = sentence.repeat(bytes / sentence.len() + 1)[..bytes].to_string();
    json!({"model": "llama3.1:8b", "max_tokens": 256,
           "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]})
    .to_string()
    .into_bytes()
}

fn admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission");
    // Header-only policy: identity + one request bucket.
    let (e, store) = engine(json!({
        "default_tier": "free",
        "identity": {"sources": ["api_key", "client_address"],
                     "api_key": {"keys": {"bench-key": "pro"}}},
        "tiers": {"free": {"requests": "1000000000/s"}, "pro": {"requests": "1000000000/s"}},
    }));
    let id = e.identify(&Caller("10.0.0.1:1".into())).expect("identity");
    group.bench_function("identify", |b| {
        b.iter(|| e.identify(black_box(&Caller("10.0.0.1:1".into()))))
    });
    group.bench_function("request_bucket", |b| {
        b.iter(|| {
            e.admit(
                &store,
                &RequestContext {
                    identity: &id,
                    api: Api::Other,
                    path: "/v1/models",
                    asked: None,
                    now_ms: black_box(1_000),
                },
            )
        })
    });

    // Full policy: request + token buckets, a daily budget, a model bucket,
    // a 2 KB chat body, then settlement from usage.
    let (e, store) = engine(json!({
        "default_tier": "pro",
        "identity": {"sources": ["api_key"], "api_key": {"keys": {"bench-key": "pro"}}},
        "tiers": {"pro": {"requests": "1000000000/s", "tokens": "1000000000000/s",
                          "daily_tokens": 1_000_000_000_000u64}},
        "models": {"llama3.1:8b": {"requests": "1000000000/s", "price": {"input_per_1k": 0.1, "output_per_1k": 0.2}}},
    }));
    let id = e.identify(&Caller("10.0.0.1:1".into())).expect("identity");
    let body = chat_body(2048);
    group.throughput(Throughput::Elements(1));
    group.bench_function("full_2kb_parse_estimate_reserve_settle", |b| {
        b.iter(|| {
            let asked = e
                .demand(&id, Api::OpenAiChat, black_box(&body))
                .ok()
                .flatten();
            let v = e.admit(
                &store,
                &RequestContext {
                    identity: &id,
                    api: Api::OpenAiChat,
                    path: "/v1/chat/completions",
                    asked: asked.as_ref(),
                    now_ms: 1_000,
                },
            );
            if let Some(plan) = v.plan() {
                let usage = sluice_core::bench::Found::Usage(sluice_core::bench::Usage {
                    input: 500,
                    output: 100,
                });
                e.settle(&store, plan, usage, 0, true, 1_000);
            }
        })
    });
    // Arrival on a pass-through route: the route's record and the
    // credential's fingerprint (no pause active: one read).
    let caller = Caller("10.0.0.1:1".into());
    group.bench_function("pushback_pass_through", |b| {
        b.iter(|| e.pushback(&store, Some("llama3.1:8b"), &caller, &id, black_box(1_000)))
    });
    let asked = e.demand(&id, Api::OpenAiChat, &body).ok().flatten();
    group.bench_function("reserve_and_settle_only", |b| {
        b.iter(|| {
            let v = e.admit(
                &store,
                &RequestContext {
                    identity: &id,
                    api: Api::OpenAiChat,
                    path: "/v1/chat/completions",
                    asked: asked.as_ref(),
                    now_ms: 1_000,
                },
            );
            if let Some(plan) = v.plan() {
                e.settle(
                    &store,
                    plan,
                    sluice_core::bench::Found::Nothing,
                    10,
                    true,
                    1_000,
                );
            }
        })
    });

    // The same for a caller without a declared key: a hashed slot, and the
    // daily budget's count-min sketch updated on take and settle.
    let (e, store) = engine(json!({
        "default_tier": "pro",
        "tiers": {"pro": {"requests": "1000000000/s", "tokens": "1000000000000/s",
                          "daily_tokens": 1_000_000_000_000u64}},
        "models": {"llama3.1:8b": {"requests": "1000000000/s", "price": {"input_per_1k": 0.1, "output_per_1k": 0.2}}},
    }));
    let id = e.identify(&Caller("10.0.0.1:1".into())).expect("identity");
    let asked = e.demand(&id, Api::OpenAiChat, &body).ok().flatten();
    group.bench_function("reserve_and_settle_only_hashed", |b| {
        b.iter(|| {
            let v = e.admit(
                &store,
                &RequestContext {
                    identity: &id,
                    api: Api::OpenAiChat,
                    path: "/v1/chat/completions",
                    asked: asked.as_ref(),
                    now_ms: 1_000,
                },
            );
            if let Some(plan) = v.plan() {
                e.settle(
                    &store,
                    plan,
                    sluice_core::bench::Found::Nothing,
                    10,
                    true,
                    1_000,
                );
            }
        })
    });
    group.finish();
}

fn estimate(c: &mut Criterion) {
    let mut group = c.benchmark_group("estimate");
    for kb in [1usize, 16, 256] {
        let body = chat_body(kb * 1024);
        let value: serde_json::Value = serde_json::from_slice(&body).expect("json");
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("input_tokens", format!("{kb}KB")),
            &value,
            |b, v| b.iter(|| sluice_core::bench::input_tokens(black_box(v))),
        );
    }
    group.finish();
}

fn sse(c: &mut Criterion) {
    let mut group = c.benchmark_group("sse_usage");
    let mut stream = String::new();
    let mut n = 0;
    while stream.len() < 1 << 20 {
        stream.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" tok{n}\"}}}}]}}\n\n"
        ));
        n += 1;
    }
    stream.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":5}}\n\ndata: [DONE]\n\n");
    let bytes = stream.into_bytes();
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("meter_1MB_in_16KB_chunks", |b| {
        b.iter(|| {
            let mut m = ResponseMeter::new(Format::Sse, true, None);
            for chunk in bytes.chunks(16 * 1024) {
                black_box(m.feed(chunk, false));
            }
            black_box(m.feed(&[], true));
            m.found
        })
    });
    group.finish();
}

/// A body given the reserved output limit (one field added): the whole
/// tree serialised again (what the rewrite did before) against the splice
/// into the client's bytes (`usage/splice.rs`).
fn rewrite(c: &mut Criterion) {
    let mut group = c.benchmark_group("rewrite");
    for kb in [2usize, 64] {
        let body = chat_body(kb * 1024);
        let before: serde_json::Value = serde_json::from_slice(&body).expect("json");
        let mut after = before.clone();
        after["max_completion_tokens"] = json!(512);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("serialise", format!("{kb}KB")),
            &after,
            |b, v| b.iter(|| black_box(v).to_string().into_bytes()),
        );
        group.bench_with_input(
            BenchmarkId::new("splice", format!("{kb}KB")),
            &after,
            |b, v| b.iter(|| sluice_core::bench::splice(black_box(&body), &before, black_box(v))),
        );
    }
    group.finish();
}

criterion_group!(benches, admission, estimate, sse, rewrite);
criterion_main!(benches);
