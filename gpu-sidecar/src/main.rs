//! `sluice-sidecar serve --listen 127.0.0.1:9911`
//!
//! `serve` prints `sluice-sidecar listening on ADDR` (the bound address, so
//! port 0 works) once on stdout, then serves until Ctrl-C or SIGTERM.

use std::io::Write as _;
use std::time::SystemTime;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use sluice_sidecar::state::StateStore;
use tokio::net::TcpListener;

#[derive(Debug, Parser)]
#[command(
    name = "sluice-sidecar",
    version,
    about = "sluice GPU and backend health sidecar"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the state API (`/v1/state`, `/healthz`) for the Envoy filter.
    Serve(ServeArgs),
    /// Validate a sluice policy offline: a policy file (YAML or JSON) or an
    /// Envoy config that embeds one. Exit status 1 names the bad field.
    CheckConfig {
        /// The file to check.
        file: std::path::PathBuf,
    },
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:9911")]
    listen: String,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => serve(args),
        Command::CheckConfig { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            match sluice_sidecar::check_config::check(&text) {
                Ok(summary) => {
                    println!("{}: ok: {summary}", file.display());
                    Ok(())
                }
                Err(message) => {
                    eprintln!("{}: {message}", file.display());
                    std::process::exit(1);
                }
            }
        }
    }
}

#[tokio::main]
async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let store = StateStore::new(SystemTime::now());
    let listener = TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "sluice-sidecar listening on {addr}").context("writing to stdout")?;
        out.flush().context("flushing stdout")?;
    }
    sluice_sidecar::serve(listener, store, shutdown_signal()).await
}

/// Resolves on Ctrl-C or SIGTERM. If a handler cannot be installed, that
/// signal is simply not awaited (the process still dies by default action).
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("sluice-sidecar: cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                eprintln!("sluice-sidecar: cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
