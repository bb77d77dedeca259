//! `mock-llm --listen 127.0.0.1:8000 --name primary`
//!
//! Prints `mock-llm listening on ADDR` (the bound address, so `--listen
//! 127.0.0.1:0` works) once on stdout, then serves until Ctrl-C or SIGTERM.

use std::io::Write as _;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;

#[derive(Debug, Parser)]
#[command(version, about = "Fake OpenAI- and Ollama-compatible inference server")]
struct Cli {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Sent back as `x-mock-name` on every response.
    #[arg(long, default_value = "mock-llm")]
    name: String,
    /// Model listed by /v1/models and /api/ps and used as the metrics label.
    #[arg(long, default_value = mock_llm::DEFAULT_MODEL)]
    model: String,
    /// Requests allowed per `--ratelimit-window-ms`, answered with OpenAI's
    /// `x-ratelimit-remaining-requests`/`x-ratelimit-reset-requests` (429 past it).
    #[arg(long)]
    ratelimit_requests: Option<u64>,
    #[arg(long, default_value_t = 2_000)]
    ratelimit_window_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let app = mock_llm::app(mock_llm::Config {
        name: cli.name,
        model: cli.model,
        ratelimit: cli
            .ratelimit_requests
            .map(|requests| mock_llm::load::RateLimit {
                requests,
                window: std::time::Duration::from_millis(cli.ratelimit_window_ms),
            }),
    })?;
    let listener = TcpListener::bind(&cli.listen)
        .await
        .with_context(|| format!("binding {}", cli.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "mock-llm listening on {addr}").context("writing to stdout")?;
        out.flush().context("flushing stdout")?;
    }
    mock_llm::serve(listener, app, sluice_shutdown::signal("mock-llm")).await
}
