//! sluice-sidecar: watches the GPUs and inference servers and tells the
//! Envoy filter, over a long-polled HTTP API, when to stop sending work.
//!
//! The path of a signal, top to bottom:
//! [`sources`] (NVML, simulated GPU, vLLM `/metrics`, Ollama `/api/ps`) →
//! [`monitor`] (one round per scrape interval) → [`breaker`] (pure rules per
//! scope) → [`state`] (versioned, in a watch channel) → [`api`]
//! (`/v1/state` long poll, `/metrics`, the operator page with [`history`]
//! and [`traffic`]). Beside it: [`admin`]
//! (kill switch, token, state file) and [`alerts`] (webhooks).

pub mod admin;
pub mod alerts;
pub mod api;
pub mod breaker;
pub mod cache;
pub mod check_config;
pub mod config;
pub mod door;
pub mod fleet;
pub mod history;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod monitor;
pub mod page;
pub mod slots;
pub mod sources;
pub mod state;
pub mod telemetry;
pub mod traffic;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admin::{AdminToken, KillSwitchControl};
use crate::alerts::Alerts;
use crate::breaker::At;
use crate::config::{BackendKind, Config, GpuMode};
use crate::history::History;
use crate::http::Target;
use crate::monitor::{Monitor, Outputs};
use crate::sources::gpu::{NvmlSource, SimHandle, SimulatedGpus};
use crate::sources::ollama::OllamaSource;
use crate::sources::vllm::VllmSource;
use crate::sources::{BackendSource, GpuSource};
use crate::state::{SidecarState, StateStore};
use crate::telemetry::Telemetry;
use crate::traffic::Traffic;

/// What `serve` runs with: the config plus what the command line adds.
#[derive(Debug, Clone)]
pub struct Options {
    pub config: Config,
    /// `--simulate`: the simulated GPU source, whatever the config says.
    pub simulate: bool,
    pub token: AdminToken,
}

/// Picks the GPU source. Missing NVML is said once, here.
fn gpu_source(opts: &Options) -> (Option<Box<dyn GpuSource>>, Option<SimHandle>) {
    let simulated = || {
        let handle = SimHandle::default();
        let src = SimulatedGpus::new(handle.clone(), opts.config.sources.simulated_file.clone());
        (Some(Box::new(src) as Box<dyn GpuSource>), Some(handle))
    };
    let mode = if opts.simulate {
        GpuMode::Simulated
    } else {
        opts.config.sources.gpu
    };
    match mode {
        GpuMode::Simulated => simulated(),
        GpuMode::None => (None, None),
        GpuMode::Auto | GpuMode::Nvml => match NvmlSource::open() {
            Ok(src) => (Some(Box::new(src)), None),
            Err(e) => {
                let why = NvmlSource::why_missing(&e);
                if mode == GpuMode::Auto {
                    eprintln!("sluice-sidecar: {why}: using the simulated GPU source");
                    simulated()
                } else {
                    eprintln!("sluice-sidecar: {why}: running on the other sources");
                    (None, None)
                }
            }
        },
    }
}

/// Serves until `shutdown` resolves: the monitor rounds, the API on
/// `listener`. Held long polls are answered at once on shutdown.
pub async fn serve(
    listener: TcpListener,
    opts: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let config = &opts.config;
    let plans = config.scope_plans()?;
    let kill_switch = match &config.state_file {
        Some(path) => admin::load_kill_switch(path)?,
        None => {
            eprintln!("sluice-sidecar: no state_file: a restart forgets the kill switch");
            Default::default()
        }
    };
    if kill_switch.active {
        eprintln!(
            "sluice-sidecar: kill switch is ON from the state file ({})",
            kill_switch.reason.as_deref().unwrap_or("no reason given")
        );
    }
    if !opts.token.is_set() {
        eprintln!("sluice-sidecar: no admin token: POST /v1/kill-switch answers 401");
    }
    let now = SystemTime::now();
    let mut first = SidecarState::initial(now);
    first.version = now
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(1).max(1));
    first.kill_switch = kill_switch;
    let store = StateStore::starting(first);
    let telemetry = Arc::new(Telemetry::default());
    let history = Arc::new(History::new(
        config.history.clone(),
        Traffic::new(config.envoy_admin.clone()),
    ));
    history.set_rules(&plans);
    let alerts = Alerts::start(config.alerts.clone(), telemetry.clone());

    let (gpu, sim) = gpu_source(&opts);
    let mut backends: Vec<Box<dyn BackendSource>> = Vec::new();
    for (kind, b) in config.backends() {
        let base = Target::parse(&b.url).with_context(|| format!("backend {}", b.name))?;
        backends.push(match kind {
            BackendKind::Vllm => Box::new(VllmSource::new(
                b.name.clone(),
                &base,
                config.scrape_timeout,
                config.sources.latency_window,
            )),
            BackendKind::Ollama => Box::new(OllamaSource::new(
                b.name.clone(),
                &base,
                config.scrape_timeout,
            )),
        });
    }
    let scopes: Vec<&str> = plans.iter().map(|p| p.scope.as_str()).collect();
    eprintln!(
        "sluice-sidecar: GPU source {}, {} backend(s), scopes {}",
        gpu.as_ref().map_or("none", |g| g.kind()),
        backends.len(),
        scopes.join(", ")
    );
    let monitor = Monitor::new(
        gpu,
        backends,
        plans,
        config.policy(),
        Outputs {
            store: store.clone(),
            telemetry: telemetry.clone(),
            alerts: Some(alerts.clone()),
            history: Some(history.clone()),
        },
        At {
            mono: Instant::now(),
            wall: now,
        },
    )
    .with_saturation(config.saturation_rules()?);

    let (closing_tx, closing_rx) = watch::channel(false);
    let monitor_task = tokio::spawn(monitor.run(config.scrape_interval, closing_rx.clone()));
    tokio::spawn(history::watch_kill_switch(
        store.clone(),
        history.clone(),
        closing_rx.clone(),
    ));
    tokio::spawn(traffic::run(
        history.clone(),
        config.scrape_timeout,
        closing_rx.clone(),
    ));
    tokio::spawn(memory::trim_after_bursts(
        telemetry.clone(),
        closing_rx.clone(),
    ));
    let kill_switch = Arc::new(KillSwitchControl::new(
        store.clone(),
        config.state_file.clone(),
        Some(alerts),
    ));
    let fleet = match &config.fleet {
        Some(f) => Some(fleet::Fleet::new(f.clone())?),
        None => None,
    };
    if let Some(f) = &fleet {
        tokio::spawn(fleet::sync_kill_switch(
            f.clone(),
            store.clone(),
            kill_switch.clone(),
            closing_rx.clone(),
        ));
        tokio::spawn(fleet::sync_breakers(
            f.clone(),
            store.clone(),
            closing_rx.clone(),
        ));
        tokio::spawn(fleet::sync_fingerprints(f.clone(), closing_rx.clone()));
    }
    let cache_router = match &config.cache {
        Some(c) => {
            let cache = cache::Cache::new(c.clone(), fleet.clone()).map_err(anyhow::Error::msg)?;
            let _ = telemetry.cache.set(cache.clone());
            tokio::spawn(cache.clone().learn(closing_rx.clone()));
            eprintln!(
                "sluice-sidecar: response cache in {}, semantic {}",
                if cache.in_redis() { "Redis" } else { "memory" },
                if c.embeddings.is_some() { "on" } else { "off" }
            );
            Some(cache::api::router(cache::api::CacheApi {
                cache,
                fleet: fleet.clone(),
                token: opts.token.clone(),
            }))
        }
        None => None,
    };
    let door_telemetry = telemetry.clone();
    let mut app = api::router(api::Api {
        store: store.clone(),
        closing: closing_rx,
        telemetry,
        token: opts.token.clone(),
        allow_remote: config.admin.allow_remote,
        kill_switch,
        sim,
        long_poll: config.long_poll,
        history,
        failures: Arc::new(door::FailureGate::default()),
    });
    if let Some(f) = fleet {
        app = app.merge(fleet::router(f));
    }
    if let Some(c) = cache_router {
        app = app.merge(c);
    }
    let hosts = door::AllowedHosts::with(&config.allowed_hosts)
        .map_err(|(i, m)| anyhow::anyhow!("allowed_hosts[{i}]: {m}"))?;
    let app = api::with_door(app, hosts, door_telemetry);
    let served = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async move {
        shutdown.await;
        // Nobody left to receive is fine: there are no held polls then.
        let _ = closing_tx.send(true);
    })
    .await
    .context("serving HTTP");
    // The monitor stops on the same signal; a round in flight is bounded by
    // the scrape timeout.
    let _ = tokio::time::timeout(Duration::from_secs(5), monitor_task).await;
    served
}
