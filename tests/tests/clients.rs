//! Real clients at the front door (issue 9, item 11): the pinned `openai`
//! Python SDK and `ollama` Python client, run by tests/clients/clients.py
//! against the shipped config in a real Envoy with mock-llm behind it. The
//! script checks what a client sees (sync, async, streams with and without
//! `stream_options.include_usage`, the SDK's retry on 429 after
//! `Retry-After`, Ollama chat/generate, refusals as the clients' own errors).
//!
//! `make test` installs the clients (`make clients`) and sets
//! `SLUICE_REQUIRE_CLIENTS=1`, so the test runs there; run by hand without
//! them, it says so and skips. `SLUICE_CLIENTS_PYTHON` picks another Python.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`), which serves
//! both the OpenAI and the Ollama APIs the clients speak.

use std::time::Duration;

use serde_yaml::Value;
use sluice_tests::{clients_python, run_client_script, Stack};

#[test]
fn openai_and_ollama_clients_work_through_sluice() {
    let Some(python) = clients_python(
        "openai_and_ollama_clients_work_through_sluice",
        "openai, ollama",
    ) else {
        return;
    };
    let stack = Stack::start(|cfg| {
        // A tier that admits one request per 5 s: the second and third
        // calls of the retry check (each a new SDK client, slow on a loaded
        // machine) still come before the refill and get 429 with
        // Retry-After, and the SDK waits it out.
        let policy = cfg.policy_mut();
        policy["tiers"]["trickle"] = serde_yaml::from_str("{requests: 1/5s}").unwrap();
        policy["identity"]["api_key"]["keys"]["clients-trickle-key"] = Value::from("trickle");
    });

    let (finished, status, output) = run_client_script(
        &python,
        "clients.py",
        &stack.envoy.url(""),
        Duration::from_secs(60),
    );
    eprintln!("{output}");
    assert!(finished, "clients.py still running after 60 s:\n{output}");
    assert!(
        status.success() && output.lines().any(|l| l == "ALL OK"),
        "clients.py failed ({status}):\n{output}\n--- envoy ---\n{}",
        stack.envoy.log()
    );
    for check in [
        "openai_sync_chat",
        "openai_unknown_key",
        "openai_async_chat",
        "openai_stream_without_usage",
        "openai_stream_with_usage",
        "openai_retry_after",
        "ollama_chat",
        "ollama_generate",
        "ollama_refusal",
    ] {
        assert!(
            output
                .lines()
                .any(|l| l.starts_with(&format!("ok {check}"))),
            "{check} did not run:\n{output}"
        );
    }
}
