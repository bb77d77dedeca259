//! Every multiplier of work is reserved (docs/src/design.md, "Guarantees"): prompts ×
//! choices × max output, lowered per completion or refused, through the engine.

use super::*;
use crate::state::store::MemStore;
use crate::usage::reconcile::Usage;
use serde_json::json;

use crate::admission::tests::Caller;

const ADDR: Caller = Caller("10.0.0.9:1");

fn engine_with(policy: Value) -> (Engine, MemStore) {
    let e = Engine::new(Policy::from_value(policy).unwrap());
    let store = MemStore::default();
    e.prepare(&store).unwrap();
    (e, store)
}

fn admit(e: &Engine, store: &MemStore, api: Api, path: &str, body: Value) -> Verdict {
    let id = e.identify(&ADDR).unwrap();
    let asked = match e.demand(&id, api, body.to_string().as_bytes()) {
        Ok(asked) => asked,
        Err(verdict) => return *verdict,
    };
    e.admit(store, &ctx(&id, api, path, asked.as_ref(), 0))
}

fn budget(tokens: u64) -> Value {
    json!({"default_tier": "t", "tiers": {"t": {"daily_tokens": tokens}}})
}

#[test]
fn every_prompt_of_a_prompt_array_is_reserved() {
    let (e, store) = engine_with(budget(100_000));
    let forms = [
        (json!("one"), 1),
        (json!(["a", "b", "c"]), 3),
        (json!([1, 2, 3]), 1),
        (json!([[1, 2], [3, 4], [5]]), 3),
    ];
    for (prompt, prompts) in forms {
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 100, "n": 2});
        let v = admit(&e, &store, Api::OpenAiCompletions, "/v1/completions", body);
        let plan = v.plan().expect("admitted");
        assert_eq!(plan.max_output, prompts * 2 * 100, "{prompt}");
    }
}

#[test]
fn a_prompt_array_the_budget_cannot_cover_is_lowered_per_completion_or_refused() {
    let (e, store) = engine_with(budget(5_000));
    let prompt: Vec<String> = (0..40).map(|i| format!("prompt {i}")).collect();
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 100_000});
    // 40 × 100,000 cannot fit: each completion is lowered so that all fit.
    let v = admit(
        &e,
        &store,
        Api::OpenAiCompletions,
        "/v1/completions",
        body.clone(),
    );
    let plan = v.plan().expect("lowered, not refused");
    let sent: Value = serde_json::from_slice(&v.body().expect("rewritten")).unwrap();
    let per = sent["max_tokens"].as_u64().unwrap();
    assert!((MIN_LOWERED_OUTPUT..100_000).contains(&per), "{per}");
    assert_eq!(plan.max_output, per * 40);
    assert!(plan.input_estimate + plan.max_output <= 5_000);
    // Settled at what 40 completions really cost: the next finds too
    // little for 40 × 16 and is refused.
    e.settle(
        &store,
        plan,
        Found::Usage(Usage {
            input: plan.input_estimate,
            output: plan.max_output,
        }),
        0,
        true,
        0,
    );
    let v = admit(&e, &store, Api::OpenAiCompletions, "/v1/completions", body);
    assert_eq!(v.reply().expect("refused").status, 429);
}

#[test]
fn input_only_apis_reserve_no_output_and_count_pairs() {
    let (e, store) = engine_with(budget(100_000));
    let one = admit(
        &e,
        &store,
        Api::Scoring,
        "/v1/score",
        json!({"model": "m", "text_1": "a long query about several things", "text_2": ["d"]}),
    )
    .into_plan()
    .unwrap();
    let ten = admit(
        &e,
        &store,
        Api::Scoring,
        "/v1/score",
        json!({"model": "m", "text_1": "a long query about several things",
               "text_2": ["d", "d", "d", "d", "d", "d", "d", "d", "d", "d"]}),
    )
    .into_plan()
    .unwrap();
    assert_eq!((one.max_output, ten.max_output), (0, 0));
    // The query is scored with each document: it counts ten times.
    assert!(
        ten.input_raw > one.input_raw * 5.0,
        "{} {}",
        one.input_raw,
        ten.input_raw
    );
    let embed = admit(
        &e,
        &store,
        Api::OllamaEmbed,
        "/api/embed",
        json!({"model": "m", "input": ["a", "b"]}),
    )
    .into_plan()
    .unwrap();
    assert_eq!(embed.max_output, 0);
    assert!(!embed.stream);
}

#[test]
fn invocations_are_the_api_their_shape_says() {
    let (e, store) = engine_with(budget(100_000));
    let chat = admit(
        &e,
        &store,
        Api::Invocations,
        "/invocations",
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "n": 3}),
    )
    .into_plan()
    .unwrap();
    assert_eq!((chat.api, chat.max_output), (Api::OpenAiChat, 150));
    let completion = admit(
        &e,
        &store,
        Api::Invocations,
        "/invocations",
        json!({"model": "m", "prompt": ["a", "b"], "max_tokens": 10}),
    )
    .into_plan()
    .unwrap();
    assert_eq!(
        (completion.api, completion.max_output),
        (Api::OpenAiCompletions, 20)
    );
    let embedding = admit(
        &e,
        &store,
        Api::Invocations,
        "/invocations",
        json!({"model": "m", "input": "x"}),
    )
    .into_plan()
    .unwrap();
    assert_eq!(
        (embedding.api, embedding.max_output),
        (Api::OpenAiEmbeddings, 0)
    );
    for bad in [
        json!({"model": "m"}),
        json!({"model": "m", "messages": [], "prompt": "x"}),
    ] {
        let v = admit(&e, &store, Api::Invocations, "/invocations", bad.clone());
        assert_eq!(v.reply().expect("refused").status, 400, "{bad}");
    }
}

#[test]
fn anthropic_messages_reserve_max_tokens_and_require_it() {
    let (e, store) = engine_with(budget(100_000));
    let body = json!({"model": "m", "max_tokens": 300, "system": "be brief",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
    let plan = admit(&e, &store, Api::AnthropicMessages, "/v1/messages", body)
        .into_plan()
        .unwrap();
    assert_eq!(plan.max_output, 300);
    assert!(plan.input_estimate > 3);
    let v = admit(
        &e,
        &store,
        Api::AnthropicMessages,
        "/v1/messages",
        json!({"model": "m", "messages": []}),
    );
    let reply = v.reply().expect("refused");
    assert_eq!(reply.status, 400);
    assert!(String::from_utf8_lossy(&reply.body).contains("\"param\":\"max_tokens\""));
    // Lowered where Anthropic reads it.
    let (e, store) = engine_with(budget(1_000));
    let v = admit(
        &e,
        &store,
        Api::AnthropicMessages,
        "/v1/messages",
        json!({"model": "m", "max_tokens": 100_000, "messages": [{"role": "user", "content": "hi"}]}),
    );
    let sent: Value = serde_json::from_slice(&v.body().expect("lowered")).unwrap();
    assert!(sent["max_tokens"].as_u64().unwrap() < 1_000);
}

#[test]
fn a_passthrough_rule_counts_its_own_limit_and_its_models() {
    let (e, store) = engine_with(json!({
        "default_tier": "t",
        "tiers": {"t": {"requests": "100/min"}},
        "models": {"whisper": {"requests": "2/min"}},
        "passthrough": [
            {"path": "/v1/audio/transcriptions", "requests": "3/min", "model": "whisper"},
            {"path": "/v1/audio/speech", "requests": "1/min"},
        ],
    }));
    let api = e.passthrough("POST", "/v1/audio/transcriptions");
    assert_eq!(api, Api::Passthrough(0));
    assert_eq!(e.passthrough_model(api), Some("whisper"));
    assert_eq!(e.passthrough("POST", "/v1/audio/other"), Api::Other);
    let id = e.identify(&ADDR).unwrap();
    let go = |api: Api, path: &str| e.admit(&store, &ctx(&id, api, path, None, 0));
    let t = "/v1/audio/transcriptions";
    // The model's 2/min binds before the rule's 3/min.
    assert!(go(api, t).reply().is_none());
    assert!(go(api, t).reply().is_none());
    let third = go(api, t);
    assert_eq!(third.bucket(), Some("model/whisper/requests"));
    let speech = e.passthrough("POST", "/v1/audio/speech");
    assert!(go(speech, "/v1/audio/speech").reply().is_none());
    let second = go(speech, "/v1/audio/speech");
    assert_eq!(second.bucket(), Some("passthrough/1/requests"));
}
