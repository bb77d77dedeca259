//! `sluice-sidecar serve [--config FILE] [--listen ADDR] [--simulate]
//! [--admin-token-file FILE] [--state-file FILE] [--allowed-host NAME]…`
//!
//! `serve` prints `sluice-sidecar listening on ADDR` (the bound address, so
//! port 0 works) once on stdout, then serves until Ctrl-C or SIGTERM. Logs
//! go to stderr.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use sluice_sidecar::config::envoy_admin::EnvoyAdminConfig;
use sluice_sidecar::config::Config;
use sluice_sidecar::serve::admin::AdminToken;
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
    /// Watch GPUs and backends and serve the state API for the Envoy filter
    /// (`/v1/state`, `/v1/kill-switch`, `/metrics`, `/healthz`, `/`).
    Serve(ServeArgs),
    /// Validate a sidecar config file (YAML) offline. Exit status 1 names
    /// the bad field.
    CheckSidecarConfig {
        /// The file to check.
        file: PathBuf,
    },
    /// Validate a sluice policy offline (a policy file, YAML or JSON, or an
    /// Envoy config that embeds one), or a sidecar config (recognised by
    /// its keys; its `fleet` section's policy, secret, password and CA are
    /// read as `serve` would). Exit status 1 names the bad field.
    CheckConfig {
        /// The file to check.
        file: std::path::PathBuf,
    },
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The sidecar config (YAML); without it, the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on (default: the config's `listen`,
    /// 127.0.0.1:9911); port 0 picks a free port.
    #[arg(long)]
    listen: Option<String>,
    /// Use the simulated GPU source (set with `POST /v1/simulate`).
    #[arg(long)]
    simulate: bool,
    /// File holding the admin bearer token (else the config's
    /// `admin.token_file`, else `SLUICE_ADMIN_TOKEN`).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Where the kill switch is kept across restarts (overrides the
    /// config's `state_file`).
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Envoy's admin URL (`http://127.0.0.1:9901`), read for requests per
    /// tier on the operator page (overrides the config's `envoy_admin.url`).
    #[arg(long)]
    envoy_admin: Option<String>,
    /// A host name the API answers to besides `localhost`, IP addresses
    /// and `sluice_sidecar` (e.g. a Kubernetes Service name); repeatable,
    /// added to the config's `allowed_hosts`. Any other `Host` gets 421.
    #[arg(long = "allowed-host", value_name = "NAME")]
    allowed_host: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => serve(args),
        Command::CheckSidecarConfig { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            match sluice_sidecar::check_config::check_sidecar(&text) {
                Ok(summary) => {
                    println!("{}: ok: {summary}", file.display());
                    Ok(())
                }
                Err(e) => {
                    eprintln!("{}: {e}", file.display());
                    std::process::exit(1);
                }
            }
        }
        Command::CheckConfig { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            match sluice_sidecar::check_config::check_any(&text) {
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
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Config::from_yaml(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => Config::default(),
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(state_file) = args.state_file {
        config.state_file = Some(state_file);
    }
    if let Some(url) = args.envoy_admin {
        let mut admin = config
            .envoy_admin
            .take()
            .unwrap_or_else(|| EnvoyAdminConfig::from_url(&url));
        admin.url = url;
        admin
            .check()
            .map_err(|e| anyhow::anyhow!("--envoy-admin ({}): {}", e.path(), e.message()))?;
        config.envoy_admin = Some(admin);
    }
    let (token_file, token_from) = match args.admin_token_file {
        Some(file) => (Some(file), "--admin-token-file"),
        None => (config.admin.token_file.clone(), "admin.token_file"),
    };
    let token = AdminToken::load(
        token_file.as_deref(),
        token_from,
        std::env::var("SLUICE_ADMIN_TOKEN").ok(),
    )?;
    config.allowed_hosts.extend(args.allowed_host);
    sluice_sidecar::door::AllowedHosts::with(&config.allowed_hosts).map_err(|(i, m)| {
        anyhow::anyhow!(
            "allowed_hosts / --allowed-host `{}`: {m}",
            config.allowed_hosts.get(i).map_or("", String::as_str)
        )
    })?;
    let listener = TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "sluice-sidecar listening on {addr}").context("writing to stdout")?;
        out.flush().context("flushing stdout")?;
    }
    let opts = sluice_sidecar::Options {
        config,
        simulate: args.simulate,
        token,
    };
    sluice_sidecar::serve(listener, opts, sluice_shutdown::signal("sluice-sidecar")).await
}
