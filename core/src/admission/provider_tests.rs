//! A provider's spend budget is debited by what a request it serves
//! settled, whatever API the request speaks (the integration test
//! `conformance` does the same for every other budget kind through Envoy;
//! a provider's rung needs the primary out, so its row is read here).

use serde_json::{json, Value};

use super::tests::Caller;
use super::*;
use crate::state::store::MemStore;
use crate::usage::reconcile::Usage;

const RULE: &str = "provider/p/daily_spend";

#[test]
fn every_api_a_provider_speaks_debits_its_spend_budget_by_what_it_settled() {
    let policy = json!({
        "default_tier": "t",
        "tiers": {"t": {}},
        "models": {"m": {}},
        "providers": {"p": {"speaks": ["openai", "anthropic", "ollama"], "default_model": "pm",
                            "prices": {"pm": {"input": "100", "output": "300"}},
                            "daily_spend": 10}},
        "ladder": ["p"],
    });
    let e = Engine::new(Policy::from_value(policy).unwrap());
    let store = MemStore::default();
    e.prepare(&store).unwrap();
    let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
    let msgs = json!([{"role": "user", "content": "hello"}]);
    let calls: [(Api, &str, Value); 8] = [
        (
            Api::OpenAiChat,
            "/v1/chat/completions",
            json!({"model": "m", "max_tokens": 8, "messages": msgs}),
        ),
        (
            Api::OpenAiCompletions,
            "/v1/completions",
            json!({"model": "m", "max_tokens": 8, "prompt": "hi"}),
        ),
        (
            Api::OpenAiEmbeddings,
            "/v1/embeddings",
            json!({"model": "m", "input": "hi"}),
        ),
        (
            Api::OpenAiResponses,
            "/v1/responses",
            json!({"model": "m", "max_output_tokens": 8, "input": "hi"}),
        ),
        (
            Api::AnthropicMessages,
            "/v1/messages",
            json!({"model": "m", "max_tokens": 8, "messages": msgs}),
        ),
        (
            Api::OllamaChat,
            "/api/chat",
            json!({"model": "m", "messages": msgs, "options": {"num_predict": 8}}),
        ),
        (
            Api::OllamaGenerate,
            "/api/generate",
            json!({"model": "m", "prompt": "hi", "options": {"num_predict": 8}}),
        ),
        (
            Api::OllamaEmbed,
            "/api/embed",
            json!({"model": "m", "input": "hi"}),
        ),
    ];
    let left = || e.local_quota(&store, RULE, &id, 0).unwrap().remaining;
    for (api, path, body) in calls {
        let asked = e
            .demand(&id, api, body.to_string().as_bytes())
            .unwrap()
            .unwrap();
        let served = e.rung_for(api, Some("m")).expect("p serves it");
        let before = left();
        let v = e.admit_on(&store, &ctx(&id, api, path, Some(&asked), 0), Some(&served));
        let plan = v.into_plan().unwrap_or_else(|| panic!("{api:?} refused"));
        let output = if api.produces_output() { 5 } else { 0 };
        let usage = Found::Usage(Usage { input: 10, output });
        let (settled, _) = e.settle(&store, &plan, usage, 0, true, 0);
        assert!(settled.cost > 0, "{api:?}");
        assert_eq!(before - left(), settled.cost, "{api:?}");
    }
}
