//! The HTTP API: `/v1/state` (the filter's long poll), the kill switch,
//! the simulated GPU (only when it runs), `/metrics`, `/healthz` and the
//! operator page at `/` with its data at `/v1/history` ([`crate::serve::page`]).
//!
//! Who may do what: every route answers only to the sidecar's own host
//! names ([`with_door`], 421 otherwise); reads are open; every change of
//! state (kill switch, simulated GPU) needs the admin bearer token and,
//! unless `admin.allow_remote`, a loopback peer; a client that keeps
//! presenting wrong tokens is answered 429, while the right token is
//! always served ([`crate::door`]). Held long
//! polls are capped (`long_poll.max_held`); the last `long_poll.reserved`
//! slots are kept for loopback callers (the co-located Envoy) and token
//! holders.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Query, Request, State};
use axum::http::header::{
    AUTHORIZATION, CACHE_CONTROL, CONNECTION, CONTENT_TYPE, HOST, RETRY_AFTER,
};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::json;

use crate::door::{AllowedHosts, Client, Endpoint, Failure, Gate};
use crate::sources::gpu::Simulation;
use crate::watch::snapshot::{Subscriber, Telemetry};

/// How long a long poll is held when the request does not say.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// The longest a long poll is held, whatever the request says.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Longest kill-switch reason kept.
pub const MAX_REASON: usize = 500;
/// What a poll refused at the cap is told to wait, in seconds.
pub const POLL_RETRY_AFTER_S: u64 = 2;

pub use crate::serve::Api;

pub fn router(api: Api) -> Router {
    let mut router = Router::new()
        .route("/", get(crate::serve::page::index))
        .route("/page.js", get(crate::serve::page::script))
        .route("/page.css", get(crate::serve::page::style))
        .route("/v1/history", get(crate::serve::page::history))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/state", get(state))
        .route("/v1/kill-switch", post(kill_switch));
    // A production sidecar has no way to fake its GPUs: the route exists
    // only with the simulated source.
    if api.sim.is_some() {
        router = router.route("/v1/simulate", get(get_simulation).post(simulate));
    }
    router.with_state(Arc::new(api))
}

/// `app` answering only requests whose `Host` (and request-target
/// authority) is one of `hosts`: every route, the fallback too. Applied
/// last, around the fleet's routes as well.
pub fn with_door(app: Router, hosts: AllowedHosts, telemetry: Arc<Telemetry>) -> Router {
    let door = Arc::new((hosts, telemetry));
    app.layer(axum::middleware::from_fn_with_state(door, check_host))
}

async fn check_host(
    State(door): State<Arc<(AllowedHosts, Arc<Telemetry>)>>,
    req: Request,
    next: Next,
) -> Response {
    let (hosts, telemetry) = &*door;
    let mut given = req.headers().get_all(HOST).iter();
    let header = given.next();
    let twice = given.next().is_some();
    let target = req.uri().authority().map(|a| a.as_str().as_bytes());
    let presented: Vec<&[u8]> = header
        .map(|h| h.as_bytes())
        .into_iter()
        .chain(target)
        .collect();
    if !twice && !presented.is_empty() && presented.iter().all(|h| hosts.allows(h)) {
        return next.run(req).await;
    }
    let n = telemetry
        .door
        .host_refused
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    // A line for the first refusal and then at every power of two: an
    // operator learns of a misconfigured scraper, a flood cannot fill the log.
    if n.is_power_of_two() {
        let shown = presented
            .first()
            .map_or_else(|| "no Host".to_string(), |h| crate::door::loggable(h));
        eprintln!(
            "sluice-sidecar: {n} request(s) refused for their Host so far (latest: `{shown}`); \
             add a name with allowed_hosts or --allowed-host"
        );
    }
    error(
        StatusCode::MISDIRECTED_REQUEST,
        "misdirected_request",
        "this sidecar answers only to localhost, IP addresses, sluice_sidecar and the names \
         in allowed_hosts (--allowed-host)",
    )
}

async fn healthz() -> &'static str {
    "ok"
}

/// `{"error": {"code", "message"}}` with `status`.
fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    crate::reply::error(status, code, message)
}

#[derive(Debug, Deserialize)]
struct StateQuery {
    /// The version the caller already has; absent means "answer now".
    since: Option<u64>,
    /// Seconds to hold the poll; default [`DEFAULT_WAIT`], capped at [`MAX_WAIT`].
    wait: Option<u64>,
}

/// `GET /v1/state[?since=V[&wait=S]]`: the state, at once unless the caller
/// already has version `since`; then held until it changes or `wait` passes,
/// and answered with whatever is current. A poll that would be held past
/// the cap is answered 503 at once (see [`LongPollConfig`]).
async fn state(
    State(api): State<Arc<Api>>,
    peer: Peer,
    headers: HeaderMap,
    Query(q): Query<StateQuery>,
) -> Response {
    let current = api.store.current();
    let Some(since) = q.since.filter(|v| *v == current.version) else {
        return crate::reply::json(StatusCode::OK, current);
    };
    let privileged = is_loopback(&peer) || holds_token(&api, &peer, &headers);
    let limit = if privileged {
        api.long_poll.max_held
    } else {
        api.long_poll.max_held - api.long_poll.reserved
    };
    let Some(_held) = Subscriber::try_enter(&api.telemetry, limit) else {
        let refused = if privileged {
            &api.telemetry.polls_refused_local
        } else {
            &api.telemetry.polls_refused_remote
        };
        Telemetry::count(refused);
        return too_many_polls(limit);
    };
    let wait = q
        .wait
        .map_or(DEFAULT_WAIT, Duration::from_secs)
        .min(MAX_WAIT);
    let mut closing = api.closing.clone();
    let current = tokio::select! {
        s = api.store.next_after(since, wait) => s,
        _ = closing.wait_for(|c| *c) => api.store.current(),
    };
    crate::reply::json(StatusCode::OK, current)
}

/// 503 for a poll past the cap. The connection is closed with it, so a
/// flood of refused pollers does not keep connections (and their buffers).
fn too_many_polls(limit: usize) -> Response {
    let body = json!({"error": {
        "code": "too_many_polls",
        "message": format!(
            "{limit} long polls are already held; try again in {POLL_RETRY_AFTER_S} s \
             (or poll without `since` for the state at once)"
        ),
    }});
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [
            (CACHE_CONTROL, "no-store".to_string()),
            (RETRY_AFTER, POLL_RETRY_AFTER_S.to_string()),
            (CONNECTION, "close".to_string()),
        ],
        Json(body),
    )
        .into_response()
}

async fn metrics(State(api): State<Arc<Api>>) -> impl IntoResponse {
    let mut text = crate::serve::metrics::render(
        &api.store.current(),
        &api.telemetry.snapshot(),
        &api.telemetry,
    );
    if let Some(cache) = &api.cache {
        text.push_str(&crate::serve::metrics::render_cache(cache));
    }
    if let Some(redis) = &api.redis {
        text.push_str(&crate::serve::metrics::render_redis(redis));
    }
    (
        [
            (CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8"),
            (CACHE_CONTROL, "no-store"),
        ],
        text,
    )
}

use crate::reply::{is_loopback, Peer};

/// Who a peer's failures are charged to; an unknown peer (only in tests,
/// without connect info) is one client.
fn client(peer: &Peer) -> Client {
    peer.as_ref()
        .map_or(Client::V4(0), |Extension(ConnectInfo(a))| {
            Client::of(a.ip())
        })
}

fn peer_text(peer: &Peer) -> String {
    peer.as_ref()
        .map_or("an unknown peer".into(), |Extension(ConnectInfo(a))| {
            a.ip().to_string()
        })
}

/// Checks the bearer token of a call to `endpoint`: the right token is
/// served whatever the caller's failure bucket says (no co-tenant can hold
/// the operator's token shut, see [`crate::door`]); a wrong one is charged,
/// counted and logged (never the token itself) while the client has
/// failures left, and answered 429 once it has none.
fn check_token(
    api: &Api,
    peer: &Peer,
    headers: &HeaderMap,
    endpoint: Endpoint,
) -> Result<(), (Failure, Option<Duration>)> {
    let counters = &api.telemetry.door;
    let why = match api
        .token
        .check(headers.get(AUTHORIZATION).map(|v| v.as_bytes()))
    {
        Ok(()) => return Ok(()),
        Err(why) => why,
    };
    if why != Failure::Wrong {
        counters.count(endpoint, why);
        return Err((why, None));
    }
    let who = client(peer);
    let now = Instant::now();
    if let Gate::Throttled(wait) = api.failures.check(who, now) {
        counters.count(endpoint, Failure::Throttled);
        return Err((Failure::Throttled, Some(wait)));
    }
    let left = api.failures.fail(who, now);
    counters.count(endpoint, Failure::Wrong);
    let then = if left == 0 {
        format!(
            "its next wrong tokens get 429 for {} s",
            crate::door::FAILURE_REFILL.as_secs()
        )
    } else {
        format!("{left} more before its wrong tokens get 429")
    };
    eprintln!(
        "sluice-sidecar: wrong admin token for {} from {}: {then}",
        endpoint.path(),
        peer_text(peer)
    );
    Err((Failure::Wrong, None))
}

/// Whether a long poll presents the admin token (for the reserved slots).
/// Without an `Authorization` header nothing is checked or counted.
fn holds_token(api: &Api, peer: &Peer, headers: &HeaderMap) -> bool {
    headers.contains_key(AUTHORIZATION) && check_token(api, peer, headers, Endpoint::State).is_ok()
}

/// Whether an admin call may go on: 403 unless the client is on loopback
/// (or remote admin is allowed); with the right bearer token, yes; else
/// 401, or 429 for a wrong token from a client that made too many.
fn refuse_admin(
    api: &Api,
    peer: &Peer,
    headers: &HeaderMap,
    endpoint: Endpoint,
) -> Option<Response> {
    if !(is_loopback(peer) || api.allow_remote) {
        return Some(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "admin calls are accepted from loopback only (admin.allow_remote is off)",
        ));
    }
    let (why, wait) = check_token(api, peer, headers, endpoint).err()?;
    let message = match why {
        Failure::NotConfigured => {
            "no admin token is configured (admin.token_file, --admin-token-file or SLUICE_ADMIN_TOKEN)"
        }
        Failure::Throttled => {
            return Some(too_many_failures(wait.unwrap_or(crate::door::FAILURE_REFILL)))
        }
        Failure::Missing | Failure::Wrong => "missing or wrong bearer token",
    };
    Some(error(StatusCode::UNAUTHORIZED, "unauthorized", message))
}

/// 429 for a client over its wrong-token allowance; `Retry-After` in whole
/// seconds, rounded up.
fn too_many_failures(wait: Duration) -> Response {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let body = json!({"error": {
        "code": "too_many_failures",
        "message": format!(
            "too many wrong admin tokens from this client; try again in {secs} s \
             (the right token is always accepted)"
        ),
    }});
    (
        StatusCode::TOO_MANY_REQUESTS,
        [
            (CACHE_CONTROL, "no-store".to_string()),
            (RETRY_AFTER, secs.to_string()),
        ],
        Json(body),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KillSwitchBody {
    active: bool,
    #[serde(default)]
    reason: Option<String>,
}

/// `POST /v1/kill-switch` `{"active": bool, "reason": "…"}` with
/// `Authorization: Bearer <token>`.
async fn kill_switch(
    State(api): State<Arc<Api>>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = refuse_admin(&api, &peer, &headers, Endpoint::KillSwitch) {
        return r;
    }
    let req: KillSwitchBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("expected {{\"active\": true|false, \"reason\": \"…\"}}: {e}"),
            )
        }
    };
    let reason = req
        .reason
        .map(|r| r.trim().chars().take(MAX_REASON).collect::<String>())
        .filter(|r| !r.is_empty());
    let out = api
        .kill_switch
        .set(req.active, reason, SystemTime::now())
        .await;
    crate::reply::json(StatusCode::OK, out)
}

/// `GET /v1/simulate`: what the simulated GPU source reports.
async fn get_simulation(State(api): State<Arc<Api>>) -> Response {
    match &api.sim {
        Some(sim) => Json(sim.get()).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "the simulated GPU source is not running",
        ),
    }
}

/// `POST /v1/simulate` `{"gpus": [{"utilization": 95, …}], "fail": false}`
/// with `Authorization: Bearer <token>`: sets the simulated GPUs (tests and
/// the demo). Faked GPUs open and close breakers, so this is an admin call.
async fn simulate(
    State(api): State<Arc<Api>>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = refuse_admin(&api, &peer, &headers, Endpoint::Simulate) {
        return r;
    }
    let Some(handle) = &api.sim else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            "the simulated GPU source is not running (serve --simulate, or sources.gpu: simulated)",
        );
    };
    let sim: Simulation = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
    };
    match handle.set(sim) {
        Ok(()) => Json(handle.get()).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, "invalid_request", e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LongPollConfig;
    use crate::door::FailureGate;
    use crate::serve::admin::AdminToken;
    use crate::sources::gpu::SimHandle;
    use crate::state::StateStore;
    use crate::watch::history::History;
    use crate::watch::kill_switch::KillSwitchControl;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use serde_json::Value;
    use std::net::SocketAddr;
    use std::time::SystemTime;
    use tokio::sync::watch;
    use tower::ServiceExt as _;

    async fn get(app: &Router, uri: &str) -> (StatusCode, Vec<u8>) {
        let req = Request::get(uri).body(Body::empty()).unwrap();
        send(app, req).await
    }

    async fn send(app: &Router, req: Request<Body>) -> (StatusCode, Vec<u8>) {
        let res = app.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let body = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, body.to_vec())
    }

    async fn get_state(app: &Router, uri: &str) -> Value {
        let (status, body) = get(app, uri).await;
        assert_eq!(status, StatusCode::OK);
        serde_json::from_slice(&body).unwrap()
    }

    fn api(store: &StateStore, closing: watch::Receiver<bool>) -> Api {
        Api {
            store: store.clone(),
            closing,
            telemetry: Arc::new(Telemetry::default()),
            token: AdminToken::new("t0ken"),
            allow_remote: false,
            kill_switch: Arc::new(KillSwitchControl::new(store.clone(), None, None)),
            sim: Some(SimHandle::default()),
            long_poll: LongPollConfig::default(),
            history: Arc::new(History::default()),
            failures: Arc::new(FailureGate::default()),
            cache: None,
            redis: None,
        }
    }

    fn setup() -> (StateStore, watch::Sender<bool>, Router) {
        let store = StateStore::new(SystemTime::now());
        let (tx, rx) = watch::channel(false);
        let app = router(api(&store, rx));
        (store, tx, app)
    }

    fn post_from(uri: &str, from: &str, token: Option<&str>, body: &str) -> Request<Body> {
        let mut req = Request::post(uri);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let mut req = req.body(Body::from(body.to_string())).unwrap();
        let addr: SocketAddr = from.parse().unwrap();
        req.extensions_mut().insert(ConnectInfo(addr));
        req
    }

    fn json_of(body: &[u8]) -> Value {
        serde_json::from_slice(body).unwrap()
    }

    #[tokio::test]
    async fn kill_switch_needs_the_token() {
        let (store, _closing, app) = setup();
        let on = r#"{"active": true, "reason": "drill"}"#;
        let local = "127.0.0.1:5000";
        for token in [None, Some("wrong"), Some("t0ke"), Some("t0ken ")] {
            let (status, body) = send(&app, post_from("/v1/kill-switch", local, token, on)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{token:?}");
            assert_eq!(json_of(&body)["error"]["code"], "unauthorized");
        }
        assert!(!store.current().kill_switch.active);
        let (status, body) =
            send(&app, post_from("/v1/kill-switch", local, Some("t0ken"), on)).await;
        assert_eq!(status, StatusCode::OK);
        let v = json_of(&body);
        assert_eq!(v["kill_switch"]["active"], true);
        assert_eq!(v["persisted"], false);
        let st = get_state(&app, "/v1/state").await;
        assert_eq!(st["kill_switch"]["active"], true);
        assert_eq!(st["kill_switch"]["reason"], "drill");
        assert!(st["kill_switch"]["since"].is_string());
        assert_eq!(st["version"], 2);
    }

    #[tokio::test]
    async fn kill_switch_is_loopback_only_by_default() {
        let (_, _closing, app) = setup();
        let on = r#"{"active": true}"#;
        let (status, body) = send(
            &app,
            post_from("/v1/kill-switch", "10.1.2.3:5000", Some("t0ken"), on),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(json_of(&body)["error"]["code"], "forbidden");
        let (status, _) = send(
            &app,
            post_from("/v1/kill-switch", "[::1]:5000", Some("t0ken"), on),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        // Remote allowed by config.
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let app = router(Api {
            allow_remote: true,
            ..api(&store, rx)
        });
        let (status, _) = send(
            &app,
            post_from("/v1/kill-switch", "10.1.2.3:5000", Some("t0ken"), on),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn kill_switch_bad_bodies_are_400() {
        let (_, _closing, app) = setup();
        for body in [
            "",
            "{",
            r#"{"active": "yes"}"#,
            r#"{"active": true, "why": "x"}"#,
        ] {
            let (status, b) = send(
                &app,
                post_from("/v1/kill-switch", "127.0.0.1:1", Some("t0ken"), body),
            )
            .await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(json_of(&b)["error"]["code"], "invalid_request");
        }
    }

    #[tokio::test]
    async fn no_token_configured_refuses_everyone() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let app = router(Api {
            token: AdminToken::default(),
            ..api(&store, rx)
        });
        let (status, body) = send(
            &app,
            post_from(
                "/v1/kill-switch",
                "127.0.0.1:1",
                Some(""),
                r#"{"active":true}"#,
            ),
        )
        .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(String::from_utf8_lossy(&body).contains("no admin token"));
    }

    #[tokio::test]
    async fn simulate_sets_the_gpus_with_the_token() {
        let (_, _closing, app) = setup();
        let body = r#"{"gpus":[{"utilization":95}]}"#;
        let local = "127.0.0.1:1";
        let token = Some("t0ken");
        let (status, b) = send(&app, post_from("/v1/simulate", local, token, body)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(json_of(&b)["gpus"][0]["utilization"], 95.0);
        let (status, b) = get(&app, "/v1/simulate").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(json_of(&b)["gpus"][0]["utilization"], 95.0);
        let bad = r#"{"gpus":[{"utilization":101}]}"#;
        let (status, _) = send(&app, post_from("/v1/simulate", local, token, bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _) = send(
            &app,
            post_from("/v1/simulate", "192.168.0.9:1", token, body),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    }

    #[tokio::test]
    async fn simulate_needs_the_token() {
        let (_, _closing, app) = setup();
        let hot = r#"{"gpus":[{"utilization":99}]}"#;
        for token in [None, Some("wrong"), Some("t0ke"), Some("")] {
            let (status, b) =
                send(&app, post_from("/v1/simulate", "127.0.0.1:1", token, hot)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{token:?}");
            assert_eq!(json_of(&b)["error"]["code"], "unauthorized");
        }
        let (_, b) = get(&app, "/v1/simulate").await;
        assert_ne!(
            json_of(&b)["gpus"][0]["utilization"],
            99.0,
            "nothing changed"
        );
        // No token configured: nobody can fake the GPUs.
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let app = router(Api {
            token: AdminToken::default(),
            ..api(&store, rx)
        });
        let (status, _) = send(
            &app,
            post_from("/v1/simulate", "127.0.0.1:1", Some(""), hot),
        )
        .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn simulate_does_not_exist_without_the_simulated_source() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let app = router(Api {
            sim: None,
            ..api(&store, rx)
        });
        let body = r#"{"gpus":[]}"#;
        for token in [None, Some("t0ken")] {
            let (status, _) =
                send(&app, post_from("/v1/simulate", "127.0.0.1:1", token, body)).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{token:?}");
        }
        assert_eq!(get(&app, "/v1/simulate").await.0, StatusCode::NOT_FOUND);
    }

    fn poll_from(uri: &str, from: &str, token: Option<&str>) -> Request<Body> {
        let mut req = Request::get(uri);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let mut req = req.body(Body::empty()).unwrap();
        req.extensions_mut()
            .insert(ConnectInfo(from.parse::<SocketAddr>().unwrap()));
        req
    }

    /// Holds `n` polls from `from`; returns their tasks.
    async fn hold(
        app: &Router,
        n: usize,
        from: &str,
        since: u64,
    ) -> Vec<tokio::task::JoinHandle<StatusCode>> {
        let tasks = (0..n)
            .map(|_| {
                let app = app.clone();
                let req = poll_from(&format!("/v1/state?since={since}&wait=60"), from, None);
                tokio::spawn(async move { send(&app, req).await.0 })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(10)).await;
        tasks
    }

    #[tokio::test(start_paused = true)]
    async fn held_polls_are_capped_with_slots_kept_for_the_local_envoy() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let api = Api {
            long_poll: LongPollConfig {
                max_held: 4,
                reserved: 1,
            },
            ..api(&store, rx)
        };
        let telemetry = api.telemetry.clone();
        let app = router(api);
        let remote = "10.0.0.7:4000";
        let held = hold(&app, 3, remote, 1).await;
        // The fourth remote poll finds only the reserved slot: 503 at once.
        let res = app
            .clone()
            .oneshot(poll_from("/v1/state?since=1&wait=60", remote, None))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()["retry-after"], "2");
        assert_eq!(res.headers()["connection"], "close");
        let body = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(json_of(&body)["error"]["code"], "too_many_polls");
        // A poll that would not be held is answered as ever.
        assert_eq!(get_state(&app, "/v1/state").await["version"], 1);
        assert_eq!(get_state(&app, "/v1/state?since=0").await["version"], 1);
        // The filter's poll (loopback) takes the reserved slot…
        let envoy = hold(&app, 1, "127.0.0.1:5000", 1).await;
        // …and after it, loopback is refused too.
        let (status, _) = send(&app, poll_from("/v1/state?since=1", "[::1]:1", None)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            telemetry
                .polls_refused_remote
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        assert_eq!(
            telemetry
                .polls_refused_local
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        let (_, text) = get(&app, "/metrics").await;
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains("sluice_sidecar_long_poll_refused_total{caller=\"remote\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sluice_sidecar_long_poll_subscribers 4"),
            "{text}"
        );
        // A change releases everyone; the slots come back.
        store.update(SystemTime::now(), |s| s.kill_switch.active = true);
        for t in held.into_iter().chain(envoy) {
            assert_eq!(t.await.unwrap(), StatusCode::OK);
        }
        assert_eq!(
            telemetry
                .subscribers
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        let again = hold(&app, 3, remote, 2).await;
        assert_eq!(
            telemetry
                .subscribers
                .load(std::sync::atomic::Ordering::Relaxed),
            3
        );
        store.update(SystemTime::now(), |s| s.kill_switch.active = false);
        for t in again {
            assert_eq!(t.await.unwrap(), StatusCode::OK);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_remote_token_holder_may_use_the_reserved_slots() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let app = router(Api {
            long_poll: LongPollConfig {
                max_held: 2,
                reserved: 1,
            },
            ..api(&store, rx)
        });
        let remote = "10.0.0.7:4000";
        let _held = hold(&app, 1, remote, 1).await;
        let (status, _) = send(
            &app,
            poll_from("/v1/state?since=1&wait=1", remote, Some("nope")),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let (status, _) = send(
            &app,
            poll_from("/v1/state?since=1&wait=1", remote, Some("t0ken")),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_and_page() {
        let (_, _closing, app) = setup();
        let (status, body) = get(&app, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        let text = String::from_utf8(body).unwrap();
        assert!(
            text.contains("sluice_sidecar_kill_switch_active 0"),
            "{text}"
        );
        assert!(
            text.contains("sluice_sidecar_long_poll_subscribers 0"),
            "{text}"
        );
        let (status, body) = get(&app, "/").await;
        assert_eq!(status, StatusCode::OK);
        assert!(String::from_utf8(body)
            .unwrap()
            .contains("<h2>Kill switch</h2>"));
        for path in ["/page.js", "/page.css"] {
            assert_eq!(get(&app, path).await.0, StatusCode::OK, "{path}");
        }
        let (status, body) = get(&app, "/v1/history").await;
        assert_eq!(status, StatusCode::OK);
        let v = json_of(&body);
        assert_eq!(v["state"]["kill_switch"]["active"], false);
        assert_eq!(v["traffic"]["enabled"], false);
    }

    #[tokio::test(start_paused = true)]
    async fn held_polls_are_counted() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let api = api(&store, rx);
        let telemetry = api.telemetry.clone();
        let app = router(api);
        let poll = tokio::spawn({
            let app = app.clone();
            async move { get_state(&app, "/v1/state?since=1&wait=10").await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            telemetry
                .subscribers
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        poll.await.unwrap();
        assert_eq!(
            telemetry
                .subscribers
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    fn with_host(uri: &str, host: Option<&str>) -> Request<Body> {
        let mut req = Request::get(uri);
        if let Some(h) = host {
            req = req.header("host", h);
        }
        req.body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn every_route_answers_only_to_its_own_host_names() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let api = api(&store, rx);
        let telemetry = api.telemetry.clone();
        let extra = AllowedHosts::with(&["sluice.prod.svc".into()]).unwrap();
        let app = with_door(router(api), extra, telemetry.clone());
        let paths = [
            "/",
            "/page.js",
            "/v1/history",
            "/metrics",
            "/v1/state",
            "/healthz",
            "/v1/simulate",
            "/no-such-path",
        ];
        for path in paths {
            for host in [
                Some("evil.example"),
                Some("evil.example:9911"),
                Some("localhost.evil.example"),
                None,
            ] {
                let (status, body) = send(&app, with_host(path, host)).await;
                assert_eq!(status, StatusCode::MISDIRECTED_REQUEST, "{path} {host:?}");
                assert_eq!(json_of(&body)["error"]["code"], "misdirected_request");
            }
            for host in [
                "localhost:9911",
                "127.0.0.1:9911",
                "[::1]:9911",
                "sluice_sidecar",
                "sluice.prod.svc:9911",
            ] {
                let (status, _) = send(&app, with_host(path, Some(host))).await;
                let want = if path == "/no-such-path" {
                    StatusCode::NOT_FOUND
                } else {
                    StatusCode::OK
                };
                assert_eq!(status, want, "{path} {host}");
            }
        }
        // A request target naming another host, or Host given twice.
        let req = with_host("http://evil.example/v1/state", Some("localhost"));
        assert_eq!(send(&app, req).await.0, StatusCode::MISDIRECTED_REQUEST);
        let req = Request::get("/v1/state")
            .header("host", "localhost")
            .header("host", "evil.example")
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, req).await.0, StatusCode::MISDIRECTED_REQUEST);
        // Admin calls too, before any token is read.
        let mut req = post_from("/v1/kill-switch", "127.0.0.1:1", Some("t0ken"), "{}");
        req.headers_mut()
            .insert("host", "evil.example".parse().unwrap());
        assert_eq!(send(&app, req).await.0, StatusCode::MISDIRECTED_REQUEST);
        assert!(!store.current().kill_switch.active);
        let refused = paths.len() as u64 * 4 + 3;
        assert_eq!(Telemetry::get(&telemetry.door.host_refused), refused);
        let (_, text) = send(&app, with_host("/metrics", Some("localhost"))).await;
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains(&format!("sluice_sidecar_host_refused_total {refused}")),
            "{text}"
        );
    }

    #[tokio::test]
    async fn wrong_tokens_are_throttled_per_client_and_counted() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let api = api(&store, rx);
        let telemetry = api.telemetry.clone();
        let app = router(api);
        let on = r#"{"active": true}"#;
        let local = "127.0.0.1:5000";
        // Calls without a bearer token are not guesses: never throttled.
        for _ in 0..20 {
            let (status, _) = send(&app, post_from("/v1/kill-switch", local, None, on)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
        }
        for i in 0..crate::door::FAILURE_BURST {
            let (status, _) = send(
                &app,
                post_from("/v1/kill-switch", local, Some(&format!("guess{i}")), on),
            )
            .await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "guess {i}");
        }
        // Wrong tokens are now 429 (not charged again); no token is 401.
        for token in ["guess-more", "guess-again"] {
            let res = app
                .clone()
                .oneshot(post_from("/v1/kill-switch", local, Some(token), on))
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{token:?}");
            let wait: u64 = res.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!((1..=6).contains(&wait), "{wait}");
            let body = axum::body::to_bytes(res.into_body(), usize::MAX)
                .await
                .unwrap();
            assert_eq!(json_of(&body)["error"]["code"], "too_many_failures");
        }
        let (status, _) = send(&app, post_from("/v1/kill-switch", local, None, on)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(!store.current().kill_switch.active);
        // The right token is served at once, from the throttled client too,
        // on every admin endpoint.
        let (status, _) = send(&app, post_from("/v1/kill-switch", local, Some("t0ken"), on)).await;
        assert_eq!(status, StatusCode::OK);
        assert!(store.current().kill_switch.active);
        let sim = r#"{"gpus":[]}"#;
        let (status, _) = send(&app, post_from("/v1/simulate", local, Some("t0ken"), sim)).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _) = send(&app, post_from("/v1/simulate", local, Some("nope"), sim)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        // Another client (IPv6 /64) has its own bucket.
        let (status, _) = send(
            &app,
            post_from("/v1/kill-switch", "[::1]:5000", Some("nope"), on),
        )
        .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let d = &telemetry.door;
        assert_eq!(d.failures(Endpoint::KillSwitch, Failure::Missing), 21);
        assert_eq!(
            d.failures(Endpoint::KillSwitch, Failure::Wrong),
            u64::from(crate::door::FAILURE_BURST) + 1
        );
        assert_eq!(d.failures(Endpoint::KillSwitch, Failure::Throttled), 2);
        assert_eq!(d.failures(Endpoint::Simulate, Failure::Throttled), 1);
        let (_, text) = get(&app, "/metrics").await;
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains(
                "sluice_sidecar_admin_auth_failures_total{endpoint=\"kill_switch\",reason=\"wrong\"} 11"
            ),
            "{text}"
        );
        assert!(!text.contains("guess0"), "never the guess: {text}");
    }

    #[tokio::test]
    async fn a_wrong_token_on_a_long_poll_is_a_guess_too() {
        let store = StateStore::new(SystemTime::now());
        let (_tx, rx) = watch::channel(false);
        let api = Api {
            allow_remote: true,
            ..api(&store, rx)
        };
        let failures = api.failures.clone();
        let telemetry = api.telemetry.clone();
        let app = router(api);
        let remote = "10.0.0.7:4000";
        for i in 0..crate::door::FAILURE_BURST {
            let (status, _) = send(
                &app,
                poll_from("/v1/state?since=0", remote, Some(&format!("g{i}"))),
            )
            .await;
            assert_eq!(status, StatusCode::OK, "not held: the token is not read");
        }
        assert!(failures.is_empty());
        for i in 0..crate::door::FAILURE_BURST {
            let req = poll_from("/v1/state?since=1&wait=0", remote, Some(&format!("g{i}")));
            assert_eq!(send(&app, req).await.0, StatusCode::OK);
        }
        let d = &telemetry.door;
        assert_eq!(d.failures(Endpoint::State, Failure::Wrong), 10);
        // The guesses on the poll count against the admin calls as well;
        // the right token still gets through.
        let on = r#"{"active":true}"#;
        let (status, _) = send(&app, post_from("/v1/kill-switch", remote, Some("g"), on)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let (status, _) = send(
            &app,
            post_from("/v1/kill-switch", remote, Some("t0ken"), on),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn healthz_is_ok() {
        let (_, _, app) = setup();
        assert_eq!(
            get(&app, "/healthz").await,
            (StatusCode::OK, b"ok".to_vec())
        );
    }

    #[tokio::test]
    async fn state_starts_healthy() {
        let (_, _, app) = setup();
        let v = get_state(&app, "/v1/state").await;
        assert_eq!(v["version"], 1);
        assert_eq!(
            v["kill_switch"],
            serde_json::json!({"active": false, "reason": null, "since": null})
        );
        assert_eq!(v["breakers"], serde_json::json!([]));
        assert_eq!(v["stale"], false);
        let at = v["updated_at"].as_str().unwrap();
        assert!(humantime::parse_rfc3339(at).is_ok(), "{at}");
    }

    #[tokio::test(start_paused = true)]
    async fn long_poll_answers_at_once_when_version_differs() {
        let (_, _, app) = setup();
        let start = tokio::time::Instant::now();
        assert_eq!(get_state(&app, "/v1/state?since=0").await["version"], 1);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn long_poll_is_released_by_a_change() {
        let (store, _closing, app) = setup();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            store.update(SystemTime::now(), |s| s.kill_switch.active = true);
        });
        let start = tokio::time::Instant::now();
        let v = get_state(&app, "/v1/state?since=1&wait=20").await;
        assert_eq!(v["version"], 2);
        assert_eq!(v["kill_switch"]["active"], true);
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn long_poll_wait_defaults_to_30s_and_is_capped_at_60s() {
        let (_, _closing, app) = setup();
        let start = tokio::time::Instant::now();
        assert_eq!(get_state(&app, "/v1/state?since=1").await["version"], 1);
        assert_eq!(start.elapsed(), DEFAULT_WAIT);
        let start = tokio::time::Instant::now();
        get_state(&app, "/v1/state?since=1&wait=3600").await;
        assert_eq!(start.elapsed(), MAX_WAIT);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_releases_held_polls() {
        let (_, closing, app) = setup();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = closing.send(true);
        });
        let start = tokio::time::Instant::now();
        get_state(&app, "/v1/state?since=1&wait=60").await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn bad_query_is_400() {
        let (_, _, app) = setup();
        assert_eq!(
            get(&app, "/v1/state?since=abc").await.0,
            StatusCode::BAD_REQUEST
        );
    }
}
