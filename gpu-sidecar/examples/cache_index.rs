//! The semantic index at 10,000 and 100,000 vectors of 384 dimensions in
//! one context (the worst case: every entry in the same scope, model,
//! parameters and conversation): exact cosine search against the index's
//! own search (exact up to `EXACT_UP_TO` vectors, sign-bit prefilter and
//! exact rescoring above), time per search, recall, memory.
//! `cargo run --release -p sluice-sidecar --example cache_index` prints the
//! table (an example, not a `cargo bench` target: the release profile's
//! `panic = "abort"` is kept, so the sidecar's own build is reused).
//!
//! Two data sets: `random` (independent directions: what unrelated
//! questions look like; there are no hits at 0.9, so recall is that of the
//! 5 nearest without a threshold) and `clustered` (100-vector clusters of
//! near-duplicates, each at cosine 0.9–0.99 from its cluster's centre, and
//! queries made the same way: what a hit looks like; recall is that of
//! the hits, similarity ≥ 0.95 and ≥ 0.9, among the 5 nearest), and
//! `dense clusters` (the same with 1,000-vector clusters: more
//! near-duplicates of the query than are rescored).
//! Recall = found ∩ exact / exact, summed over the queries; "same answer":
//! the share of queries with an exact hit whose best hit is the exact
//! search's best (what the cache would serve).

use std::time::{Duration, Instant};

use sluice_sidecar::cache::semantic::{normalise, Index, Near, EXACT_UP_TO, RESCORE};

const DIMS: usize = 384;
const QUERIES: usize = 200;
const CLUSTER: usize = 100;
/// Clusters larger than what is rescored: the prefilter must pick the
/// nearest of 1,000 near-duplicates.
const DENSE: usize = 1000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Roughly normal (sum of uniforms): a direction uniform on the sphere.
    fn normal(&mut self) -> f32 {
        ((0..4).map(|_| self.unit()).sum::<f64>() - 2.0) as f32
    }
    fn direction(&mut self) -> Vec<f32> {
        let v = (0..DIMS).map(|_| self.normal()).collect();
        normalise(v).unwrap_or_default()
    }
    /// A unit vector at cosine `c` from the unit vector `centre`.
    fn near(&mut self, centre: &[f32], c: f32) -> Vec<f32> {
        let u = self.direction();
        let along: f32 = u.iter().zip(centre).map(|(a, b)| a * b).sum();
        let ortho: Vec<f32> = u.iter().zip(centre).map(|(a, b)| a - along * b).collect();
        let ortho = normalise(ortho).unwrap_or_default();
        let s = (1.0 - c * c).max(0.0).sqrt();
        let v = centre
            .iter()
            .zip(&ortho)
            .map(|(a, b)| c * a + s * b)
            .collect();
        normalise(v).unwrap_or_default()
    }
    fn cosine(&mut self) -> f32 {
        0.9 + 0.09 * self.unit() as f32
    }
}

struct Data {
    name: &'static str,
    vectors: Vec<Vec<f32>>,
    queries: Vec<Vec<f32>>,
    /// Thresholds recall is measured at.
    thresholds: &'static [f32],
}

fn random(n: usize) -> Data {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ n as u64);
    Data {
        name: "random",
        vectors: (0..n).map(|_| r.direction()).collect(),
        queries: (0..QUERIES).map(|_| r.direction()).collect(),
        thresholds: &[-1.0],
    }
}

fn clustered(n: usize, size: usize, name: &'static str) -> Data {
    let mut r = Rng(0x2545_f491_4f6c_dd1d ^ n as u64);
    let centres: Vec<Vec<f32>> = (0..n.div_ceil(size)).map(|_| r.direction()).collect();
    let mut vectors = Vec::with_capacity(n);
    for i in 0..n {
        let c = r.cosine();
        vectors.push(r.near(&centres[i / size], c));
    }
    let queries = (0..QUERIES)
        .map(|_| {
            let at = (r.next() % centres.len() as u64) as usize;
            let c = r.cosine();
            r.near(&centres[at], c)
        })
        .collect();
    Data {
        name,
        vectors,
        queries,
        thresholds: &[0.95, 0.9],
    }
}

fn percentile(times: &mut [Duration], p: f64) -> f64 {
    times.sort();
    let at = ((times.len() as f64 - 1.0) * p).round() as usize;
    times.get(at).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// Times `search` over the queries: (p50 ms, p99 ms, results per query).
fn timed(queries: &[Vec<f32>], search: impl Fn(&[f32]) -> Vec<Near>) -> (f64, f64, Vec<Vec<Near>>) {
    let mut times = Vec::with_capacity(queries.len());
    let mut found = Vec::with_capacity(queries.len());
    for q in queries {
        let started = Instant::now();
        let f = search(q);
        times.push(started.elapsed());
        found.push(f);
    }
    (
        percentile(&mut times, 0.5),
        percentile(&mut times, 0.99),
        found,
    )
}

/// (recall, same best answer, exact results in all).
fn recall(exact: &[Vec<Near>], got: &[Vec<Near>]) -> (f64, f64, usize) {
    let (mut want, mut have, mut asked, mut same) = (0usize, 0usize, 0usize, 0usize);
    for (e, g) in exact.iter().zip(got) {
        want += e.len();
        have += e
            .iter()
            .filter(|n| g.iter().any(|m| m.key == n.key))
            .count();
        if let Some(best) = e.first() {
            asked += 1;
            same += usize::from(g.first().is_some_and(|m| m.key == best.key));
        }
    }
    let ratio = |a: usize, b: usize| if b == 0 { 1.0 } else { a as f64 / b as f64 };
    (ratio(have, want), ratio(same, asked), want)
}

fn main() {
    println!(
        "semantic index, {DIMS} dims, all vectors in one context; exact up to {EXACT_UP_TO} \
         vectors, above: sign-bit prefilter, {RESCORE} rescored exactly; top_k 5; \
         {QUERIES} queries"
    );
    println!(
        "| vectors | data | search | threshold | p50 ms | p99 ms | recall | same answer | \
         exact results | MiB | bytes/vector |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for n in [10_000usize, 100_000] {
        let sets = [
            random(n),
            clustered(n, CLUSTER, "clustered"),
            clustered(n, DENSE, "dense clusters"),
        ];
        for data in sets {
            let mut index = Index::new(n);
            for (i, v) in data.vectors.iter().enumerate() {
                index.insert(format!("{i:064x}"), "ctx".into(), v.clone(), u64::MAX);
            }
            let mib = index.bytes() as f64 / (1 << 20) as f64;
            let per = index.bytes() / n as u64;
            for &t in data.thresholds {
                let (ep50, ep99, exact) =
                    timed(&data.queries, |q| index.search_exact("ctx", q, t, 5, 0));
                let (p50, p99, got) = timed(&data.queries, |q| index.search("ctx", q, t, 5, 0));
                let (r, same, want) = recall(&exact, &got);
                let shown = if t < 0.0 {
                    "none".to_string()
                } else {
                    format!("{t}")
                };
                println!(
                    "| {n} | {} | exact | {shown} | {ep50:.2} | {ep99:.2} | 1.000 | 1.000 | {want} \
                     | {mib:.1} | {per} |",
                    data.name
                );
                println!(
                    "| {n} | {} | index | {shown} | {p50:.2} | {p99:.2} | {r:.3} | {same:.3} | \
                     {want} | {mib:.1} | {per} |",
                    data.name
                );
            }
        }
    }
}
