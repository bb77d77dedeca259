//! Host calls per request, by kind, for the three shapes `make bench`
//! measures (bench/run.py): (c) header-only policy on a GET and on a 2 KB
//! POST, (d) full policy on a 2 KB POST settled from the response's usage;
//! both with the shipped `audit` section, as the bench runs them.
//!
//! Each host call is a crossing of the wasm boundary in Envoy (strings
//! copied both ways), so the count is a repeatable measure of the hot
//! path's cost on a machine too loaded to time it. Print the table:
//! `cargo test -p sluice-core --test hostcalls -- --nocapture`.
//! The bounds below keep a regression from slipping in unnoticed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use sluice_core::bench::MockHost;

#[path = "../benches/shapes/mod.rs"]
mod shapes;
use shapes::{chat_body, one_request, Shape, T0};

/// Host calls of one request of `shape`, after warm-up requests (metric
/// definitions and per-VM caches are paid once per VM, not per request).
fn calls_per_request(shape: Shape) -> BTreeMap<&'static str, u64> {
    calls_per_request_with(shape, false)
}

/// [`calls_per_request`], with worker leases on when `leased`.
fn calls_per_request_with(shape: Shape, leased: bool) -> BTreeMap<&'static str, u64> {
    let host = MockHost::new(T0);
    let poller = if leased {
        shape.load_leased(&host)
    } else {
        shape.load(&host)
    };
    let body = chat_body();
    for _ in 0..3 {
        one_request(&poller, &host, shape, &body);
        host.advance(1);
    }
    host.take_calls();
    const N: u64 = 10;
    for _ in 0..N {
        one_request(&poller, &host, shape, &body);
        host.advance(1);
    }
    host.take_calls()
        .into_iter()
        .map(|(k, v)| (k, v.div_ceil(N)))
        .collect()
}

fn table() -> Vec<(Shape, BTreeMap<&'static str, u64>)> {
    Shape::ALL
        .into_iter()
        .map(|s| (s, calls_per_request(s)))
        .collect()
}

fn markdown(rows: &[(Shape, BTreeMap<&'static str, u64>)]) -> String {
    let mut kinds: Vec<&str> = rows.iter().flat_map(|(_, c)| c.keys().copied()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    let mut out = String::from("| host call |");
    for (shape, _) in rows {
        out += &format!(" {} |", shape.label());
    }
    out += "\n|---|";
    out += &"---:|".repeat(rows.len());
    out += "\n";
    for kind in &kinds {
        out += &format!("| `{kind}` |");
        for (_, calls) in rows {
            out += &format!(" {} |", calls.get(kind).copied().unwrap_or(0));
        }
        out += "\n";
    }
    out += "| **total** |";
    for (_, calls) in rows {
        out += &format!(" **{}** |", calls.values().sum::<u64>());
    }
    out + "\n"
}

#[test]
fn host_calls_per_request_stay_within_their_budget() {
    let rows = table();
    println!(
        "\nHost calls per request (after warm-up):\n\n{}",
        markdown(&rows)
    );
    for (shape, calls) in &rows {
        let total: u64 = calls.values().sum();
        // Measured 13 / 19 / 38 (docs/src/benchmark-history.md, "Host
        // calls and instructions per request, the merged build":
        // one shared-data record per scope, one audit write, one clock per
        // event, no response-header read an answer does not need): a
        // little room, so a new host call on the path is a decision.
        let bound = match shape {
            Shape::HeaderGet => 14,
            Shape::HeaderPost => 21,
            Shape::FullPost => 40,
        };
        assert!(
            total <= bound,
            "{}: {total} host calls per request, over its budget of {bound}: each \
             is a crossing of the wasm boundary; raise the bound knowingly",
            shape.label()
        );
    }
}

/// With `state.worker_leases` on, a request admitted and settled within a
/// lease makes no shared-data call for its buckets (issue 21, lever 2).
#[test]
fn worker_leases_take_the_buckets_off_the_host_call_path() {
    let rows: Vec<_> = Shape::ALL
        .into_iter()
        .map(|s| (s, calls_per_request_with(s, true)))
        .collect();
    println!(
        "\nHost calls per request, worker leases on (after warm-up):\n\n{}",
        markdown(&rows)
    );
    for (shape, calls) in &rows {
        let total: u64 = calls.values().sum();
        let plain: u64 = calls_per_request(*shape).values().sum();
        // Measured 9 / 15 / 28 with the audit in one write
        // (docs/src/benchmark-history.md, "Host calls and instructions per
        // request, the merged build").
        let bound = match shape {
            Shape::HeaderGet => 10,
            Shape::HeaderPost => 16,
            Shape::FullPost => 30,
        };
        assert!(
            total <= bound && total < plain,
            "{}: {total} host calls per request with leases (without: {plain}), over {bound}",
            shape.label()
        );
    }
}
