//! What every endpoint of the sidecar shares, written once: answers are
//! JSON marked `Cache-Control: no-store` (state, counters and refusals
//! must never be served from a cache), refusals have one shape
//! (`{"error": {"code", "message"}}`), and "is the caller on this host"
//! is one test of the peer's address (an unknown peer counts as remote).

use std::net::SocketAddr;

use axum::extract::ConnectInfo;
use axum::http::header::CACHE_CONTROL;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

/// The caller's address, when the server was started with connect info.
pub type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// Whether the caller is on this host; an unknown peer counts as remote.
pub fn is_loopback(peer: &Peer) -> bool {
    peer.as_ref()
        .is_some_and(|Extension(ConnectInfo(a))| a.ip().is_loopback())
}

/// `body` as JSON with `status`, never cached.
pub fn json(status: StatusCode, body: impl serde::Serialize) -> Response {
    (status, [(CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

/// `{"error": {"code", "message"}}` with `status`, never cached.
pub fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    json(
        status,
        serde_json::json!({"error": {"code": code, "message": message.into()}}),
    )
}
