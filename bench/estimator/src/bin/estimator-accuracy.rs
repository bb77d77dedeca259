//! Prints the estimator's accuracy on the corpus as a Markdown table; with
//! `--samples`, every sample's estimate and real counts too.

use sluice_bench_estimator::{corpus, measure, table, tokenizers, VOCABS};

fn main() {
    let bpes = tokenizers();
    let points = measure(&corpus(), &bpes);
    if std::env::args().any(|a| a == "--samples") {
        println!("| sample | class | estimate | {} |", VOCABS.join(" | "));
        println!("|---|---|--:|{}", "--:|".repeat(VOCABS.len()));
        for p in &points {
            let real: Vec<String> = p.real.iter().map(usize::to_string).collect();
            println!(
                "| {} | {} | {:.0} | {} |",
                p.name,
                p.class,
                p.estimate,
                real.join(" | ")
            );
        }
        println!();
    }
    print!("{}", table(&points));
}
