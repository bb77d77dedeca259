//! Runs N requests of one bench shape through the whole request path on
//! the mock host, natively: a deterministic workload for an instruction
//! count (`valgrind --tool=callgrind`), which a loaded machine cannot
//! blur as it does wall or CPU time. Usage: `path_loop get|post|full N`.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use sluice_core::bench::MockHost;

#[path = "../benches/shapes/mod.rs"]
mod shapes;
use shapes::{chat_body, one_request, Shape, T0};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let shape = match args.get(1).map(String::as_str) {
        Some("get") => Shape::HeaderGet,
        Some("post") => Shape::HeaderPost,
        Some("full") => Shape::FullPost,
        _ => panic!("usage: path_loop get|post|full N"),
    };
    let n: u64 = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(1000);
    let host = MockHost::new(T0);
    let poller = shape.load(&host);
    let body = chat_body();
    for _ in 0..n {
        one_request(&poller, &host, shape, &body);
        host.take_calls();
        host.advance(1);
    }
}
