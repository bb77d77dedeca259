//! sluice-sidecar: watches the GPUs and inference servers and tells the
//! Envoy filter, over a long-polled HTTP API, when to stop sending work.
//!
//! The path of a signal, bottom to top: [`sources`] (NVML, simulated GPU,
//! vLLM `/metrics`, Ollama `/api/ps`) → [`watch`] (one monitor round per
//! scrape interval, the pure [`breaker`] rules per scope, alerts, history,
//! the kill switch) → [`state`] (versioned, in a watch channel) → [`serve`]
//! (`/v1/state` long poll, `/metrics`, the operator page, admin calls).
//! Beside it: [`fleet`] (the Redis agent for the Envoy beside it) and
//! [`cache`] (the response cache), both through the one [`redis`]
//! connection. The layers, each importing only those below it (checked by
//! `tests/tests/layers.rs`):
//!
//! ```text
//! lib, check_config   wiring (`serve`) and the offline checks
//! serve/              the HTTP API: routes, admin token, /metrics, page
//! fleet/, cache/      the fleet agent (take/give/slots, syncs); the response cache
//! watch/              monitor rounds, alerts, history, traffic, kill switch, snapshot
//! sources/, redis/    GPU and backend readings; the one Redis connection
//! config/             the config file, one file per section with its check
//! breaker             the pure rules engine (samples + clock → states)
//! http, reply, door,  an HTTP client, the answers every endpoint shares,
//! state               the door (Host names, token guessing), the versioned state
//! ```

pub mod breaker;
pub mod cache;
pub mod check_config;
pub mod config;
pub mod door;
pub mod fleet;
pub mod http;
pub mod listen;
pub mod redis;
pub mod reply;
pub mod serve;
pub mod sources;
pub mod state;
pub mod watch;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use tokio::net::TcpListener;

use crate::breaker::At;
use crate::config::fleet::FleetConfig;
use crate::config::{BackendKind, Config, GpuMode, ScopePlan};
use crate::http::Target;
use crate::serve::admin::AdminToken;
use crate::sources::gpu::{NvmlSource, SimHandle, SimulatedGpus};
use crate::sources::ollama::OllamaSource;
use crate::sources::vllm::VllmSource;
use crate::sources::{BackendSource, GpuSource};
use crate::state::{SidecarState, StateStore};
use crate::watch::alerts::Alerts;
use crate::watch::history::History;
use crate::watch::kill_switch::KillSwitchControl;
use crate::watch::monitor::{Monitor, Outputs};
use crate::watch::snapshot::Telemetry;
use crate::watch::traffic::Traffic;

/// What `serve` runs with: the config plus what the command line adds.
#[derive(Debug, Clone)]
pub struct Options {
    pub config: Config,
    /// `--simulate`: the simulated GPU source, whatever the config says.
    pub simulate: bool,
    pub token: AdminToken,
}

/// Picks the GPU source. Missing NVML is said once, here, at error level:
/// the sidecar then runs on its other sources, and GPU rules see no data
/// (a scope only GPUs would feed is watched by nothing: closed, never
/// stale; `sluice_sidecar_gpu_source_missing` says why). Made-up readings come
/// only when asked for (`--simulate`, `sources.gpu: simulated`): a sidecar
/// that quietly fell back to them would keep every GPU scope fresh and
/// healthy on a host whose driver is gone. Why it is missing goes into
/// `telemetry` for `/metrics` and the operator page.
fn gpu_source(
    opts: &Options,
    telemetry: &Telemetry,
) -> (Option<Box<dyn GpuSource>>, Option<SimHandle>) {
    let mode = if opts.simulate {
        GpuMode::Simulated
    } else {
        opts.config.sources.gpu
    };
    match mode {
        GpuMode::Simulated => {
            let handle = SimHandle::default();
            let file = opts.config.sources.simulated_file.clone();
            let src = SimulatedGpus::new(handle.clone(), file);
            (Some(Box::new(src)), Some(handle))
        }
        GpuMode::None => (None, None),
        GpuMode::Auto | GpuMode::Nvml => match NvmlSource::open() {
            Ok(src) => (Some(Box::new(src)), None),
            // With DCGM exporters and `auto`, the GPUs are on other nodes:
            // no local NVML is what was expected.
            Err(e) if mode == GpuMode::Auto && !opts.config.sources.dcgm.is_empty() => {
                let why = NvmlSource::why_missing(&e);
                eprintln!("sluice-sidecar: {why}: GPU readings come from the DCGM exporters");
                (None, None)
            }
            Err(e) => {
                let why = NvmlSource::why_missing(&e);
                eprintln!(
                    "sluice-sidecar: error: {why}: no GPU readings; running on the other \
                     sources (GPU rules see no data; a scope only GPUs feed stays closed). Give \
                     --simulate (or sources.gpu: simulated) for the simulated GPU, or \
                     sources.gpu: none to run without GPUs on purpose"
                );
                let mut snap = telemetry.snapshot();
                snap.gpu_missing = Some(why);
                telemetry.replace(snap);
                (None, None)
            }
        },
    }
}

/// The first published state: version the start time in Unix ms (so a
/// restarted sidecar never answers a version a filter already holds), the
/// kill switch as the state file kept it.
fn first_state(config: &Config, now: SystemTime) -> anyhow::Result<SidecarState> {
    let kill_switch = match &config.state_file {
        Some(path) => watch::kill_switch::load_kill_switch(path)?,
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
    let mut first = SidecarState::initial(now);
    first.version = now
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(1).max(1));
    first.kill_switch = kill_switch;
    first.cache_generation = first.version;
    Ok(first)
}

/// One source per configured backend.
fn backend_sources(config: &Config) -> anyhow::Result<Vec<Box<dyn BackendSource>>> {
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
            BackendKind::LlamaCpp => Box::new(sources::llamacpp::LlamaCppSource::new(
                b.name.clone(),
                &base,
                config.scrape_timeout,
            )),
            BackendKind::Dcgm(i) => match config.sources.dcgm.get(i) {
                Some(d) => Box::new(
                    sources::dcgm::DcgmSource::new(
                        d,
                        config.scrape_interval,
                        config.scrape_timeout,
                    )
                    .with_context(|| format!("DCGM source {}", b.name))?,
                ),
                None => anyhow::bail!("DCGM source {} is not configured", b.name),
            },
        });
    }
    Ok(backends)
}

/// The monitor over the GPU source, every backend and the scopes.
fn monitor(
    config: &Config,
    gpu: Option<Box<dyn GpuSource>>,
    plans: Vec<ScopePlan>,
    outputs: Outputs,
    now: SystemTime,
) -> anyhow::Result<Monitor> {
    let backends = backend_sources(config)?;
    for w in config::dcgm_warnings(config, &plans) {
        eprintln!("sluice-sidecar: warning: {w}");
    }
    let scopes: Vec<&str> = plans.iter().map(|p| p.scope.as_str()).collect();
    eprintln!(
        "sluice-sidecar: GPU source {}, {} backend(s), scopes {}",
        gpu.as_ref().map_or("none", |g| g.kind()),
        backends.len(),
        scopes.join(", ")
    );
    Ok(Monitor::new(
        gpu,
        backends,
        plans,
        config.policy(),
        outputs,
        At {
            mono: Instant::now(),
            wall: now,
        },
    )
    .with_saturation(config.saturation_rules()?))
}

/// The fleet agent and its sync loops (until `closing`).
fn start_fleet(
    config: &FleetConfig,
    store: &StateStore,
    kill_switch: &Arc<KillSwitchControl>,
    closing: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Arc<fleet::Fleet>> {
    let f = fleet::Fleet::new(config.clone())?;
    tokio::spawn(fleet::sync::sync_kill_switch(
        f.clone(),
        store.clone(),
        kill_switch.clone(),
        closing.clone(),
    ));
    tokio::spawn(fleet::sync::sync_breakers(
        f.clone(),
        store.clone(),
        closing.clone(),
    ));
    tokio::spawn(fleet::sync::sync_fingerprints(f.clone(), closing.clone()));
    Ok(f)
}

/// The response cache (in Redis when this sidecar is a fleet agent) and
/// its loop learning the fleet's vectors (until `closing`).
fn start_cache(
    config: &config::cache::CacheConfig,
    redis: Option<Arc<redis::Redis>>,
    closing: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Arc<cache::Cache>> {
    let c = cache::Cache::new(config.clone(), redis).map_err(anyhow::Error::msg)?;
    tokio::spawn(c.clone().learn(closing.clone()));
    eprintln!(
        "sluice-sidecar: response cache in {}, semantic {}",
        if c.in_redis() { "Redis" } else { "memory" },
        if config.embeddings.is_some() {
            "on"
        } else {
            "off"
        }
    );
    Ok(c)
}

/// `app` with the cache's routes, when there is a cache.
fn with_cache(
    app: axum::Router,
    cache: Option<Arc<cache::Cache>>,
    config: &Config,
    fleet: Option<&Arc<fleet::Fleet>>,
    token: &AdminToken,
    state: &StateStore,
) -> anyhow::Result<axum::Router> {
    let (Some(cache), Some(config)) = (cache, config.cache.as_ref()) else {
        return Ok(app);
    };
    let secret = cache_secret(config)?;
    Ok(app.merge(serve::cache::router(serve::cache::CacheApi {
        cache,
        fleet: fleet.cloned(),
        token: token.clone(),
        secret,
        state: Some(state.clone()),
    })))
}

/// The cache endpoints' secret, when the sidecar's `cache:` names one.
fn cache_secret(config: &config::cache::CacheConfig) -> anyhow::Result<Option<Arc<str>>> {
    let secret = config
        .secret()
        .map_err(|(p, m)| anyhow::anyhow!("{p}: {m}"))?;
    if secret.is_none() {
        eprintln!(
            "sluice-sidecar: cache endpoints without a secret (cache.secret_file): any local \
             process, and under a mesh any pod allowed to reach this port, can read and write \
             entries whose key it can compute"
        );
    }
    Ok(secret.map(Arc::from))
}

/// The watchers beside the monitor: the kill switch's history, Envoy's
/// traffic, provider alerts and rungs, memory trimming after bursts.
fn spawn_watchers(
    config: &Config,
    store: &StateStore,
    history: &Arc<History>,
    alerts: &Alerts,
    telemetry: &Arc<Telemetry>,
    closing: &tokio::sync::watch::Receiver<bool>,
) {
    tokio::spawn(watch::history::watch_kill_switch(
        store.clone(),
        history.clone(),
        closing.clone(),
    ));
    let traffic = (history.traffic.clone(), config.scrape_timeout);
    tokio::spawn(watch::traffic::run(
        traffic,
        Some(alerts.clone()),
        store.clone(),
        closing.clone(),
    ));
    tokio::spawn(watch::memory::trim_after_bursts(
        telemetry.clone(),
        closing.clone(),
    ));
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
    if !opts.token.is_set() {
        eprintln!("sluice-sidecar: no admin token: POST /v1/kill-switch answers 401");
    }
    let now = SystemTime::now();
    let store = StateStore::starting(first_state(config, now)?);
    let telemetry = Arc::new(Telemetry::default());
    let history = Arc::new(History::new(
        config.history.clone(),
        Traffic::new(config.envoy_admin.clone()),
    ));
    history.set_rules(&plans);
    let alerts = Alerts::start(config.alerts.clone(), telemetry.clone());
    let (gpu, sim) = gpu_source(&opts, &telemetry);
    let outputs = Outputs {
        store: store.clone(),
        telemetry: telemetry.clone(),
        alerts: Some(alerts.clone()),
        history: Some(history.clone()),
    };
    let monitor = monitor(config, gpu, plans, outputs, now)?;

    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let monitor_task = tokio::spawn(monitor.run(config.scrape_interval, closing_rx.clone()));
    spawn_watchers(config, &store, &history, &alerts, &telemetry, &closing_rx);
    let kill_switch = Arc::new(KillSwitchControl::new(
        store.clone(),
        config.state_file.clone(),
        Some(alerts),
    ));
    let fleet = match &config.fleet {
        Some(f) => Some(start_fleet(f, &store, &kill_switch, &closing_rx)?),
        None => None,
    };
    let cache = match &config.cache {
        Some(c) => Some(start_cache(
            c,
            fleet.as_ref().map(|f| f.redis().clone()),
            &closing_rx,
        )?),
        None => None,
    };
    let door_telemetry = telemetry.clone();
    let door_connections = telemetry.connections.clone();
    let mut app = serve::api::router(serve::api::Api {
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
        cache: cache.clone(),
        redis: fleet.as_ref().map(|f| f.redis().clone()),
    });
    app = with_cache(app, cache, config, fleet.as_ref(), &opts.token, &store)?;
    if let Some(f) = fleet {
        app = app.merge(fleet::routes::router(f));
    }
    let hosts = door::AllowedHosts::with(&config.allowed_hosts)
        .map_err(|(i, m)| anyhow::anyhow!("allowed_hosts[{i}]: {m}"))?;
    let app = serve::api::with_door(app, hosts, door_telemetry);
    let limits = (config.connections, door_connections);
    serve_until(listener, app, limits, shutdown, closing_tx, monitor_task).await
}

/// Serves `app` on `listener` within the connection `limits` until
/// `shutdown` resolves, then tells the held long polls and the monitor
/// (`closing`) and waits a little for the monitor's round in flight.
async fn serve_until(
    listener: TcpListener,
    app: axum::Router,
    limits: (config::ConnectionsConfig, Arc<listen::ConnectionCounters>),
    shutdown: impl Future<Output = ()> + Send + 'static,
    closing: tokio::sync::watch::Sender<bool>,
    monitor_task: tokio::task::JoinHandle<()>,
) -> anyhow::Result<()> {
    let served = listen::serve(
        listener,
        app,
        limits.0,
        limits.1,
        async move {
            shutdown.await;
            // Nobody left to receive is fine: there are no held polls then.
            let _ = closing.send(true);
        },
        Duration::from_secs(5),
    )
    .await
    .context("serving HTTP");
    // The monitor stops on the same signal; a round in flight is bounded by
    // the scrape timeout.
    let _ = tokio::time::timeout(Duration::from_secs(5), monitor_task).await;
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(yaml: &str, simulate: bool) -> Options {
        Options {
            config: Config::from_yaml(yaml).unwrap(),
            simulate,
            token: AdminToken::default(),
        }
    }

    #[test]
    fn the_simulated_gpu_runs_only_when_asked_for() {
        let t = Telemetry::default();
        let (gpu, sim) = gpu_source(&opts("{}", true), &t);
        assert_eq!(gpu.map(|g| g.kind()), Some("simulated"));
        assert!(sim.is_some());
        let (gpu, sim) = gpu_source(&opts("sources: {gpu: simulated}\n", false), &t);
        assert_eq!(gpu.map(|g| g.kind()), Some("simulated"));
        assert!(sim.is_some());
        let (gpu, sim) = gpu_source(&opts("sources: {gpu: none}\n", false), &t);
        assert!(gpu.is_none() && sim.is_none());
        assert_eq!(t.snapshot().gpu_missing, None, "none was asked for");
        for mode in ["auto", "nvml"] {
            let t = Telemetry::default();
            let (gpu, sim) = gpu_source(&opts(&format!("sources: {{gpu: {mode}}}\n"), false), &t);
            assert!(sim.is_none(), "{mode}: never the simulated GPU");
            match gpu {
                // A host with the driver.
                Some(g) => assert_eq!(g.kind(), "nvml"),
                None => {
                    let why = t.snapshot().gpu_missing.unwrap_or_default();
                    assert!(why.starts_with("no NVML"), "{mode}: {why}");
                }
            }
        }
    }
}
