//! The HTTP API the filter and people read: `/healthz`, `/v1/state`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header::CACHE_CONTROL;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use tokio::sync::watch;

use crate::state::StateStore;

/// How long a long poll is held when the request does not say.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// The longest a long poll is held, whatever the request says.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
struct Api {
    store: StateStore,
    /// Turns true when the server shuts down, releasing held polls.
    closing: watch::Receiver<bool>,
}

pub fn router(store: StateStore, closing: watch::Receiver<bool>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/state", get(state))
        .with_state(Arc::new(Api { store, closing }))
}

async fn healthz() -> &'static str {
    "ok"
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
/// and answered with whatever is current.
async fn state(State(api): State<Arc<Api>>, Query(q): Query<StateQuery>) -> impl IntoResponse {
    let current = match q.since {
        None => api.store.current(),
        Some(since) => {
            let wait = q
                .wait
                .map_or(DEFAULT_WAIT, Duration::from_secs)
                .min(MAX_WAIT);
            let mut closing = api.closing.clone();
            tokio::select! {
                s = api.store.next_after(since, wait) => s,
                _ = closing.wait_for(|c| *c) => api.store.current(),
            }
        }
    };
    ([(CACHE_CONTROL, "no-store")], Json(current))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use serde_json::Value;
    use std::time::SystemTime;
    use tower::ServiceExt as _;

    async fn get(app: &Router, uri: &str) -> (StatusCode, Vec<u8>) {
        let req = Request::get(uri).body(Body::empty()).unwrap();
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

    fn setup() -> (StateStore, watch::Sender<bool>, Router) {
        let store = StateStore::new(SystemTime::now());
        let (tx, rx) = watch::channel(false);
        let app = router(store.clone(), rx);
        (store, tx, app)
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
            serde_json::json!({"active": false, "reason": null})
        );
        assert_eq!(v["breakers"], serde_json::json!([]));
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
