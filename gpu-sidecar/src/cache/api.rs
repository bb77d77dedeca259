//! `POST /v1/cache/lookup`, `POST /v1/cache/store` (the Envoy beside this
//! sidecar only) and `POST /v1/cache/purge` (admin token).

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::json;
use sluice_wire::cache::{
    LookupRequest, PurgeRequest, StoreRequest, LOOKUP_PATH, PURGE_PATH, STORE_PATH,
};

use super::{Cache, CacheError};
use crate::admin::AdminToken;
use crate::fleet::{reply, Fleet, Peer};

#[derive(Clone)]
pub struct CacheApi {
    pub cache: Arc<Cache>,
    /// In fleet mode: the fleet's door (secret, fingerprint) applies too.
    pub fleet: Option<Arc<Fleet>>,
    pub token: AdminToken,
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    reply(status, json!({"error": {"code": code, "message": message}}))
}

fn loopback(peer: &Peer) -> bool {
    peer.as_ref()
        .is_some_and(|axum::Extension(axum::extract::ConnectInfo(a))| a.ip().is_loopback())
}

/// Why a call is not from the Envoy beside this sidecar, if it is not.
fn refuse(api: &CacheApi, peer: &Peer, headers: &HeaderMap) -> Option<Response> {
    if let Some(f) = &api.fleet {
        return crate::fleet::refuse(f, peer, headers);
    }
    if !loopback(peer) {
        Some(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the cache endpoints answer the Envoy beside this sidecar (loopback) only",
        ))
    } else if headers.contains_key(axum::http::header::ORIGIN) {
        Some(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the cache endpoints refuse requests with an Origin (web pages)",
        ))
    } else if !crate::fleet::json_content(headers) {
        Some(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request",
            "content-type: application/json expected",
        ))
    } else {
        None
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Box<Response>> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("{}: {}", e.path(), e.inner()),
        ))
    })
}

fn invalid(e: CacheError) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request", &e.to_string())
}

async fn lookup(
    State(api): State<CacheApi>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = refuse(&api, &peer, &headers) {
        return r;
    }
    let req: LookupRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match api.cache.lookup(&req, super::now_ms()).await {
        Ok(a) => reply(StatusCode::OK, json!(a)),
        Err(e) => invalid(e),
    }
}

async fn store(
    State(api): State<CacheApi>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = refuse(&api, &peer, &headers) {
        return r;
    }
    let req: StoreRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match api.cache.store(req, super::now_ms()).await {
        Ok(a) => reply(StatusCode::OK, json!(a)),
        Err(e) => invalid(e),
    }
}

/// Admin: a bearer token (which no web page can send cross-site without
/// the browser asking first), loopback, no `Origin`.
async fn purge(
    State(api): State<CacheApi>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !loopback(&peer) || headers.contains_key(axum::http::header::ORIGIN) {
        return error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the cache purge is accepted from loopback only, without an Origin",
        );
    }
    let auth = headers
        .get(axum::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if !api.token.accepts(auth) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        );
    }
    let req: PurgeRequest = if body.is_empty() {
        PurgeRequest::default()
    } else {
        match parse(&body) {
            Ok(r) => r,
            Err(r) => return *r,
        }
    };
    match api.cache.purge(req.model.as_deref()).await {
        Ok(n) => {
            api.cache.note_size().await;
            reply(StatusCode::OK, json!({"purged": n}))
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "cache_unavailable",
            &e.to_string(),
        ),
    }
}

pub fn router(api: CacheApi) -> axum::Router {
    use axum::routing::post;
    // A store carries the answer JSON-escaped: up to twice its size.
    let limit = usize::try_from(api.cache.config.max_entry_bytes)
        .unwrap_or(usize::MAX)
        .saturating_mul(2)
        .saturating_add(64 << 10);
    axum::Router::new()
        .route(LOOKUP_PATH, post(lookup))
        .route(STORE_PATH, post(store))
        .route(PURGE_PATH, post(purge))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(api)
}
