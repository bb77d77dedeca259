//! The semantic index's exact cosine search at 100,000 vectors of 384
//! dimensions in one context (the worst case: every entry in the same
//! scope, model, parameters and conversation), and the memory it takes.
//! `cargo run --release -p sluice-sidecar --example cache_index` prints the
//! figures (an example, not a `cargo bench` target: the release profile's
//! `panic = "abort"` is kept, so the sidecar's own build is reused).

use std::time::Instant;

use sluice_sidecar::cache::semantic::{normalise, Index};

fn vector(seed: u64, dims: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v = (0..dims)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect();
    normalise(v).unwrap_or_default()
}

fn main() {
    let dims = 384;
    for n in [10_000usize, 100_000] {
        let mut index = Index::new(n);
        for i in 0..n {
            index.insert(
                format!("{i:064x}"),
                "ctx".into(),
                vector(i as u64, dims),
                u64::MAX,
            );
        }
        let queries: Vec<Vec<f32>> = (0..50).map(|i| vector(1_000_000 + i, dims)).collect();
        let started = Instant::now();
        let mut found = 0;
        for q in &queries {
            found += index.search("ctx", q, 0.95, 5, 0).len();
        }
        let per = started.elapsed() / queries.len() as u32;
        println!(
            "semantic index: {n} vectors x {dims} dims in one context: search {:.2} ms each \
             (exact cosine, {found} hits), {:.1} MiB of vectors",
            per.as_secs_f64() * 1e3,
            index.bytes() as f64 / (1 << 20) as f64
        );
    }
}
