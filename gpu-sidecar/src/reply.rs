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

/// Whether the caller is on this host; an unknown peer counts as remote,
/// and so does a mesh proxy's inbound passthrough: with sidecar injection
/// (Istio) every connection from another pod is delivered from
/// `127.0.0.6` (`::6` on IPv6), a loopback address that is not the Envoy
/// beside this sidecar nor an operator's shell.
pub fn is_loopback(peer: &Peer) -> bool {
    peer.as_ref()
        .is_some_and(|Extension(ConnectInfo(a))| is_local(a.ip()))
}

/// The mesh's inbound passthrough sources (Istio's
/// `InboundPassthroughBindIpv4` / `…Ipv6`).
const MESH_INBOUND: [std::net::IpAddr; 2] = [
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 6)),
    std::net::IpAddr::V6(std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6)),
];

fn is_local(ip: std::net::IpAddr) -> bool {
    let ip = match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    };
    ip.is_loopback() && !MESH_INBOUND.contains(&ip)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(addr: &str) -> Peer {
        Some(Extension(ConnectInfo(addr.parse().unwrap())))
    }

    #[test]
    fn the_mesh_proxys_inbound_passthrough_is_not_this_host() {
        for local in [
            "127.0.0.1:5000",
            "127.1.2.3:5000",
            "[::1]:5000",
            "[::ffff:127.0.0.1]:5000",
        ] {
            assert!(is_loopback(&peer(local)), "{local}");
        }
        for remote in [
            "127.0.0.6:5000",
            "[::6]:5000",
            "[::ffff:127.0.0.6]:5000",
            "10.0.0.9:5000",
            "[2001:db8::1]:5000",
        ] {
            assert!(!is_loopback(&peer(remote)), "{remote}");
        }
        assert!(!is_loopback(&None));
    }
}
