//! Prints the estimator's accuracy on the corpus as a Markdown table; with
//! `--samples`, every sample's estimate and real counts too. With
//! `--llamacpp HOST:PORT`, against that llama.cpp server's own tokenizer
//! and chat template instead of tiktoken's (`src/llamacpp.rs`).

use sluice_bench_estimator::{corpus, llamacpp, measure, table_for, tokenizers, VOCABS};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let samples_too = args.iter().any(|a| a == "--samples");
    let server = args
        .iter()
        .position(|a| a == "--llamacpp")
        .map(|i| args.get(i + 1).cloned().unwrap_or_default());
    let (points, vocabs): (_, Vec<&str>) = match server {
        Some(addr) => {
            let server = match llamacpp::Server::new(&addr) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("--llamacpp {addr}: {e}");
                    std::process::exit(2);
                }
            };
            let (points, skipped) = llamacpp::measure(&corpus(), &server);
            for s in &skipped {
                eprintln!("left out: {s}");
            }
            (points, vec!["smollm2"])
        }
        None => (measure(&corpus(), &tokenizers()), VOCABS.to_vec()),
    };
    if samples_too {
        println!("| sample | class | estimate | {} |", vocabs.join(" | "));
        println!("|---|---|--:|{}", "--:|".repeat(vocabs.len()));
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
    print!("{}", table_for(&points, &vocabs));
}
