//! What bounding costs: the input bound a hard budget reserves
//! (`core/src/usage/bound.rs`, the default figures) against the real
//! count of two BPE tokenizers and against the estimate, per corpus class.
//!
//!     cargo run --release -p sluice-bench-estimator --bin bound-cost
//!
//! Each sample is sent as one chat message (a chat sample as it is). The
//! bound must never be below the real count (the worst ratio is printed:
//! below 1.00 would be an overshoot). "In flight" is how many requests of
//! the class a 5,000-token daily budget holds at once with `max_tokens:
//! 256`, at the bound and at the estimate; "tail" the median tokens a
//! budget used one request after another refuses earlier (a request's
//! bound less its real count: what the last request needs beyond what it
//! will cost).

use serde_json::{json, Value};
use sluice_bench_estimator::{corpus, reference_tokens, tokenizers, Input, CLASSES};
use sluice_core::bench::{input_tokens, rendered, Api, InputBound};

const BUDGET: f64 = 5_000.0;
const MAX_TOKENS: f64 = 256.0;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    let bpes = tokenizers();
    println!("| class | n | bound / real, median | bound / real, worst | in flight at the bound | at the estimate | tail (tokens) |");
    println!("|---|--:|--:|--:|--:|--:|--:|");
    let samples = corpus();
    for class in CLASSES.iter().copied().chain(["overall"]) {
        let (mut ratios, mut worst, mut at_bound, mut at_est, mut tails) =
            (Vec::new(), f64::MAX, Vec::new(), Vec::new(), Vec::new());
        for s in samples
            .iter()
            .filter(|s| class == "overall" || s.class == class)
        {
            let body: Value = match &s.input {
                Input::Text(t) => json!({"messages": [{"role": "user", "content": t}]}),
                Input::Chat(b) => b.clone(),
            };
            let bound =
                rendered(Api::OpenAiChat, &body).tokens(&InputBound::default(), None) as f64;
            let estimate = input_tokens(&body);
            let chat = Input::Chat(body);
            for bpe in &bpes {
                let real = reference_tokens(bpe, &chat) as f64;
                ratios.push(bound / real);
                worst = worst.min(bound / real);
                tails.push(bound - real);
            }
            at_bound.push((BUDGET / (bound + MAX_TOKENS)).floor());
            at_est.push((BUDGET / (estimate.ceil() + MAX_TOKENS)).floor());
        }
        let n = at_bound.len();
        println!(
            "| {class} | {n} | {:.2} | {worst:.2} | {} | {} | {} |",
            median(ratios),
            median(at_bound),
            median(at_est),
            median(tails).round(),
        );
    }
}
