//! `mock-llm --listen 127.0.0.1:8000 --name primary`
//!
//! Prints `mock-llm listening on ADDR` (the bound address, so `--listen
//! 127.0.0.1:0` works) once on stdout, then serves until Ctrl-C or SIGTERM.

use std::io::Write as _;

use anyhow::Context as _;
use clap::{CommandFactory as _, Parser};
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
    /// Tokens (input + output) allowed per window, with
    /// `x-ratelimit-*-tokens` headers (Anthropic: `anthropic-ratelimit-tokens-*`).
    #[arg(long)]
    ratelimit_tokens: Option<u64>,
    #[arg(long, default_value_t = 2_000)]
    ratelimit_window_ms: u64,
    /// The real server to play: mock (everything, the default), vllm,
    /// openai, ollama or anthropic.
    #[arg(long, default_value = "mock")]
    personality: mock_llm::Personality,
    /// Models served, comma-separated; any other gets the server's 404.
    /// Without it every model is served.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// Context length: what a request without a limit may generate, and
    /// what vLLM checks `max_tokens` against.
    #[arg(long, default_value_t = mock_llm::DEFAULT_MAX_MODEL_LEN)]
    max_model_len: u64,
    /// Generate all each request is allowed (the obeyed limit field, else
    /// the context), as `x-mock-output-tokens: allowed` does per request.
    #[arg(long)]
    generate_allowed: bool,
    /// The one credential the server takes, where the played server reads
    /// it (`Authorization: Bearer`, Anthropic's `x-api-key`); any other
    /// request gets that server's 401. Ollama takes none.
    #[arg(long)]
    api_key: Option<String>,
    /// A server-wide scripted fault, `<kind>[:<opt>=<value>,...]`, e.g.
    /// `429:retry_after=2,times=3`, `reset`, `stream_cut:after=2` (see the
    /// README, "Scripted faults"); `PUT /admin/fault` replaces it.
    #[arg(long, value_name = "SPEC")]
    fault: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let fault = match cli.fault.as_deref().map(mock_llm::fault::parse).transpose() {
        Ok(fault) => fault.flatten(),
        Err(e) => Cli::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for '--fault <SPEC>': {e}"),
            )
            .exit(),
    };
    let app = mock_llm::app(mock_llm::Config {
        name: cli.name,
        model: cli.model,
        ratelimit: match (cli.ratelimit_requests, cli.ratelimit_tokens) {
            (None, None) => None,
            (requests, tokens) => Some(mock_llm::load::RateLimit {
                requests: requests.unwrap_or(u64::MAX),
                tokens,
                window: std::time::Duration::from_millis(cli.ratelimit_window_ms),
            }),
        },
        personality: cli.personality,
        models: cli.models.into_iter().filter(|m| !m.is_empty()).collect(),
        max_model_len: cli.max_model_len,
        generate_allowed: cli.generate_allowed,
        api_key: cli.api_key,
        fault,
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
