//! The sidecar's operator page (issue 13, item 4) in headless Chromium: it
//! renders; the GPU charts have data points (the simulated GPU drives
//! them); breakers show their rules and values, the timeline its reasons;
//! requests per tier come from a real Envoy's stats; the kill switch
//! control flips the state with the right token and says so with a wrong
//! one (state unchanged, checked on `/v1/state`); operator text with markup
//! in it shows as text and runs nothing.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`make test` installs
//! them and sets `SLUICE_REQUIRE_BROWSER=1`); without them and without that
//! variable the test says so and skips.
//!
//! Upstream: mock-llm's own personality (`Personality::Mock`): the page shows
//! the sidecar's state.

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::browser::Browser;
use sluice_tests::{get, post_json, repo_root, wait_for, Sidecar, Stack};

const TOKEN: &str = "operator-page-test-token-0123456789";
const MODEL: &str = "llama3.1:8b";
/// Operator text that would run if the page treated it as markup.
const EVIL_REASON: &str = "drill <img src=x onerror=\"window.__pwned=1\"> & <b>bold</b>";
const EVIL_GPU: &str = "<script>window.__pwned=2</script>H100 \"x\"";

fn simulate(sc: &Sidecar, utils: [f64; 2]) {
    let body = json!({"gpus": [
        {"utilization": utils[0], "temperature_c": 40.0 + utils[0] / 4.0,
         "memory_used_mb": 30000.0 + utils[0] * 300.0, "memory_total_mb": 81920.0,
         "name": EVIL_GPU},
        {"utilization": utils[1], "temperature_c": 38.0 + utils[1] / 5.0,
         "memory_used_mb": 12000.0, "memory_total_mb": 81920.0, "name": "H100 #2"},
    ]});
    let r = post_json(
        &sc.url("/v1/simulate"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        &body,
    );
    assert_eq!(r.status, 200, "{r:?}");
}

fn history(sc: &Sidecar) -> Value {
    get(&sc.url("/v1/history"), &[]).ok().json()
}

fn kill_switch(sc: &Sidecar) -> Value {
    get(&sc.url("/v1/state"), &[]).ok().json()["kill_switch"].clone()
}

#[test]
fn operator_page_in_headless_chromium() {
    let Some(browser) = Browser::start() else {
        return;
    };
    let stack = Stack::start(|_| {});
    let dir = tempfile::tempdir().expect("temp dir");
    fs::write(dir.path().join("token"), TOKEN).expect("token");
    let config = format!(
        "scrape_interval: 50ms\n\
         sources: {{ gpu: simulated }}\n\
         rules:\n  - {{ metric: gpu_utilization, open_at: 90, close_below: 80, \
         open_for: 300ms, close_after: 300ms }}\n\
         breaker: {{ half_open_fraction: 0 }}\n\
         history: {{ sample_every: 100ms, window: 8s }}\n\
         envoy_admin: {{ url: \"{}\", scrape_every: 100ms }}\n",
        stack.envoy.admin_url("")
    );
    fs::write(dir.path().join("sidecar.yaml"), config).expect("config");
    let path = |n: &str| dir.path().join(n).display().to_string();
    let sc = Sidecar::start_with_args(&[
        "--config",
        &path("sidecar.yaml"),
        "--admin-token-file",
        &path("token"),
        "--state-file",
        &path("state.json"),
    ]);

    // The baseline scrape of Envoy's stats comes before any request.
    assert!(
        wait_for(Duration::from_secs(10), || !history(&sc)["traffic"]
            ["last_scrape"]
            .is_null()),
        "{}",
        history(&sc)
    );
    // Free tier: 10/min, so 12 anonymous calls are 10 admitted, 2 refused;
    // and 3 pro calls.
    for _ in 0..12 {
        stack.chat(MODEL, &[]);
    }
    for _ in 0..3 {
        assert_eq!(
            stack.chat(MODEL, &[("x-api-key", "demo-pro-key")]).status,
            200
        );
    }
    // The GPUs move: a hot spell opens the breaker, a calm one closes it.
    let wave = [
        [30.0, 10.0],
        [55.0, 20.0],
        [96.0, 40.0],
        [97.0, 45.0],
        [98.0, 50.0],
        [60.0, 35.0],
        [40.0, 30.0],
        [35.0, 25.0],
    ];
    for u in wave {
        simulate(&sc, u);
        std::thread::sleep(Duration::from_millis(250));
    }
    let sum = |h: &Value, tier: &str, d: usize| -> u64 {
        h["traffic"]["minutes"]
            .as_array()
            .map(|m| {
                m.iter()
                    .map(|m| m["tiers"][tier][d].as_u64().unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0)
    };
    let ready = wait_for(Duration::from_secs(10), || {
        let h = history(&sc);
        let events = h["events"].as_array().map_or(0, Vec::len);
        sum(&h, "free", 0) == 10
            && sum(&h, "free", 2) == 2
            && sum(&h, "pro", 0) == 3
            && events >= 2
            && h["gpus"][1]["points"].as_array().map_or(0, Vec::len) >= 15
    });
    let h = history(&sc);
    assert!(ready, "{h}");
    let reasons: Vec<&str> = h["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["reason"].as_str())
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("gpu_utilization 9") && r.contains(">= 90")),
        "{reasons:?}"
    );

    browser.goto(&sc.url("/"));
    assert!(
        browser.wait_until(
            Duration::from_secs(10),
            "return document.body.dataset.loaded === 'true'"
        ),
        "the page did not load its data"
    );
    // Three charts per GPU, each with data points.
    let points: Vec<u64> = serde_json::from_value(browser.eval(
        "return [...document.querySelectorAll('svg.chart')].map(s => Number(s.dataset.points))",
        &[],
    ))
    .unwrap();
    assert_eq!(points.len(), 6, "{points:?}");
    assert!(points.iter().all(|p| *p >= 15), "{points:?}");
    let polyline_points = browser.eval(
        "return [...document.querySelectorAll('svg.chart polyline')].reduce((n, p) => n + p.points.numberOfItems, 0)",
        &[],
    );
    assert!(
        polyline_points.as_u64().unwrap_or(0) >= 6 * 15,
        "{polyline_points}"
    );
    let text = |sel: &str| -> String {
        browser
            .eval(
                "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent).join('\\n')",
                &[json!(sel)],
            )
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // The GPU name with markup in it is shown as text.
    assert!(text(".gpu h3").contains(EVIL_GPU), "{}", text(".gpu h3"));
    // Breakers: the rule next to its current value.
    let breakers = text("#breakers tbody");
    assert!(
        breakers.contains("backend:local")
            && breakers
                .contains("gpu_utilization ≥ 90 for 300ms opens · < 80 for 300ms closes — now"),
        "{breakers}"
    );
    // Timeline: the breaker opened and closed, with reasons.
    let timeline = text("#timeline tbody");
    assert!(
        timeline.contains("closed → open")
            && timeline.contains("open → closed")
            && timeline.contains(">= 90"),
        "{timeline}"
    );
    // Requests per tier over the window, from Envoy's stats.
    let free = text("#traffic tr[data-tier='free'] td.window");
    assert_eq!(free, "10 admitted · 0 degraded · 2 refused");
    let pro = text("#traffic tr[data-tier='pro'] td.window");
    assert_eq!(pro, "3 admitted · 0 degraded · 0 refused");

    // The screenshot for the book (docs/src/operations.md), with data in every section.
    let png = browser.screenshot();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let shot = repo_root().join("target/operator-page.png");
    fs::write(&shot, &png).expect("screenshot");
    eprintln!("screenshot: {}", shot.display());

    // A wrong token: said clearly, nothing changes, the field is cleared.
    assert_eq!(text("#ks-button"), "Turn the kill switch ON");
    browser.type_into("#ks-reason", EVIL_REASON);
    browser.type_into("#ks-token", "not-the-token");
    browser.click("#ks-button");
    assert!(
        browser.wait_until(
            Duration::from_secs(10),
            "return document.querySelector('#ks-result').dataset.outcome === 'error'"
        ),
        "no answer shown"
    );
    let said = text("#ks-result");
    assert!(
        said.contains("Wrong admin token") && said.contains("unchanged (still off)"),
        "{said}"
    );
    assert_eq!(kill_switch(&sc)["active"], false);
    assert_eq!(
        browser.eval("return document.querySelector('#ks-token').value", &[]),
        json!("")
    );

    // The right token: flipped, shown, and on /v1/state.
    browser.type_into("#ks-token", TOKEN);
    browser.click("#ks-button");
    assert!(
        browser.wait_until(
            Duration::from_secs(10),
            "return document.querySelector('#ks-result').dataset.outcome === 'ok'"
        ),
        "{}",
        text("#ks-result")
    );
    assert!(
        text("#ks-result").contains("now ON"),
        "{}",
        text("#ks-result")
    );
    let ks = kill_switch(&sc);
    assert_eq!(ks["active"], true);
    assert_eq!(ks["reason"], EVIL_REASON);
    assert!(text("#ks-state").starts_with("ON"), "{}", text("#ks-state"));
    assert_eq!(
        browser.eval("return document.querySelector('#ks-token').value", &[]),
        json!("")
    );
    // The reason (markup) is shown as text, on the state line and, after
    // the next refresh, on the timeline; it never ran.
    assert!(
        text("#ks-state").contains(EVIL_REASON),
        "{}",
        text("#ks-state")
    );
    assert!(
        browser.wait_until(
            Duration::from_secs(10),
            "return [...document.querySelectorAll('#timeline tr.kill_switch')].length > 0"
        ),
        "{}",
        text("#timeline tbody")
    );
    assert!(text("#timeline tr.kill_switch").contains(EVIL_REASON));
    assert_eq!(
        browser.eval(
            "return [window.__pwned === undefined, document.querySelectorAll('img, script:not([src]), b').length]",
            &[]
        ),
        json!([true, 0])
    );
    // Nothing of the token stayed in the page's storage.
    assert_eq!(
        browser.eval(
            "return [localStorage.length, sessionStorage.length, document.cookie]",
            &[]
        ),
        json!([0, 0, ""])
    );

    // And back off with the same control.
    assert_eq!(text("#ks-button"), "Turn the kill switch OFF");
    browser.type_into("#ks-token", TOKEN);
    browser.click("#ks-button");
    assert!(
        wait_for(Duration::from_secs(10), || kill_switch(&sc)["active"]
            == false),
        "{}",
        text("#ks-result")
    );
}

/// Micro-currency as the page writes it (`money()` in page.js).
fn shown(micros: f64) -> String {
    let digits = if micros != 0.0 && micros.abs() < 10_000.0 {
        6
    } else {
        2
    };
    format!("{:.*}", digits, micros / 1e6)
}

/// The page's Money section: spend today per tier, team, org and provider
/// against their budgets, the rungs with state and spend, the top
/// spenders (hashed principals from the audit log, never a key) and what
/// the cache saved, each as `/v1/history` says and drawn in Chromium.
#[test]
fn money_on_the_operator_page_in_headless_chromium() {
    let Some(browser) = Browser::start() else {
        return;
    };
    let stack = Stack::start(|cfg| {
        let policy = cfg.policy_mut();
        policy["models"][MODEL] =
            serde_yaml::from_str("{price: {input: \"10\", output: \"30\"}}").unwrap();
        policy["tiers"]["pro"]["daily_spend"] = serde_yaml::from_str("\"0.05\"").unwrap();
        policy["cache"] = serde_yaml::from_str(
            "{salt: money-page-salt-0123456789, models: {\"llama3.1:8b\": {exact: true}}}",
        )
        .unwrap();
    });
    let dir = tempfile::tempdir().expect("temp dir");
    let audit = stack.envoy.dir().join("audit.jsonl");
    let config = format!(
        "sources: {{ gpu: simulated }}\n\
         envoy_admin: {{ url: \"{}\", scrape_every: 100ms, rungs: {{ openai: llm_fallback }}, \
         audit_log: \"{}\" }}\n",
        stack.envoy.admin_url(""),
        audit.display()
    );
    fs::write(dir.path().join("sidecar.yaml"), config).expect("config");
    let sc = Sidecar::start_with_args(&[
        "--config",
        &dir.path().join("sidecar.yaml").display().to_string(),
    ]);
    // The baseline read of Envoy's stats comes before any request.
    assert!(
        wait_for(Duration::from_secs(10), || !history(&sc)["money"]
            ["last_scrape"]
            .is_null()),
        "{}",
        history(&sc)
    );
    let ask = |key: &str, q: &str| {
        let body = json!({"model": MODEL, "max_tokens": 8, "temperature": 0,
                          "messages": [{"role": "user", "content": q}]});
        let r = post_json(
            &stack.envoy.url("/v1/chat/completions"),
            &[("x-api-key", key)],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r
    };
    for i in 0..3 {
        ask("demo-search-key-1", &format!("search question {i}"));
    }
    ask("demo-pro-key", "a pro question");
    // The same question again: a hit, saved by tier and model.
    let hit = ask("demo-pro-key", "a pro question");
    assert_eq!(
        hit.header("x-sluice-cache"),
        Some("hit"),
        "{:?}",
        hit.headers
    );
    let level = |h: &Value, l: &str, n: &str| -> Value {
        h["money"]["levels"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["level"] == l && r["name"] == n))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let ready = wait_for(Duration::from_secs(15), || {
        let h = history(&sc);
        let m = &h["money"];
        level(&h, "org", "demo")["spent_today_micros"].as_f64() > Some(0.0)
            && level(&h, "tier", "pro")["spent_today_micros"].as_f64() > Some(0.0)
            && m["top_spenders"]["rows"].as_array().map_or(0, Vec::len) >= 2
            && m["saved"]
                .as_array()
                .is_some_and(|rows| rows.iter().any(|r| r["spend_micros"].as_f64() > Some(0.0)))
    });
    let h = history(&sc);
    assert!(ready, "{}", h["money"]);
    let m = &h["money"];
    // The org's spend is its team's (both search keys are in team search).
    let demo = level(&h, "org", "demo");
    assert_eq!(
        demo["spent_today_micros"],
        level(&h, "team", "search")["spent_today_micros"]
    );
    assert_eq!(demo["daily_budget_micros"], 50_000_000);
    let pro = level(&h, "tier", "pro");
    assert_eq!(pro["daily_budget_micros"], 50_000);
    assert_eq!(pro["per_caller"], true);
    let rung = &m["rungs"][0];
    assert_eq!(rung["name"], "openai");
    assert_eq!(rung["daily_budget_micros"], 10_000);
    assert!(rung["state"].is_string(), "{rung}");
    for row in m["top_spenders"]["rows"].as_array().unwrap() {
        let p = row["principal"].as_str().unwrap();
        assert!(
            p.len() == 32 && p.bytes().all(|b| b.is_ascii_hexdigit()),
            "{p}"
        );
    }
    // Every tier's row of each cached model is there from the start.
    let saved = m["saved"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tier"] == "pro" && r["model"] == MODEL)
        .unwrap_or_else(|| panic!("{}", m["saved"]));
    assert!(saved["spend_micros"].as_f64() > Some(0.0), "{saved}");

    browser.goto(&sc.url("/"));
    assert!(
        browser.wait_until(
            Duration::from_secs(10),
            "return document.body.dataset.loaded === 'true' && document.querySelectorAll('#spenders tr.spender').length >= 2"
        ),
        "the page did not draw the money"
    );
    let text = |sel: &str| -> String {
        browser
            .eval(
                "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent).join('\\n')",
                &[json!(sel)],
            )
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let h = history(&sc);
    let spent = level(&h, "org", "demo")["spent_today_micros"]
        .as_f64()
        .unwrap();
    assert_eq!(
        text("#budgets tr[data-level='org'][data-name='demo'] td.spent"),
        shown(spent)
    );
    let org_row = text("#budgets tr[data-level='org'][data-name='demo']");
    assert!(
        org_row.contains("50.00") && org_row.contains('%'),
        "{org_row}"
    );
    let pro_row = text("#budgets tr[data-level='tier'][data-name='pro']");
    assert!(pro_row.contains("per caller"), "{pro_row}");
    let rungs = text("#rungs tr[data-provider='openai']");
    assert!(
        rungs.contains("openai") && rungs.contains(&shown(10_000.0)),
        "{rungs}"
    );
    assert!(
        text("#saved tr.saved").contains(MODEL),
        "{}",
        text("#saved tbody")
    );
    // Principals are hashes; no key of the policy is anywhere on the page.
    let page = text("body");
    for key in ["demo-search-key-1", "demo-pro-key"] {
        assert!(!page.contains(key), "{key} on the page");
    }
    assert_eq!(
        browser
            .eval(
                "return document.querySelectorAll('#spenders td.principal').length",
                &[]
            )
            .as_u64(),
        Some(m["top_spenders"]["rows"].as_array().unwrap().len() as u64)
    );
}
