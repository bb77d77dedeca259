//! The sidecar's listener: how many connections it holds, and how long and
//! how large a request's head may be.
//!
//! The API port is reachable from any pod when the sidecar listens beyond
//! loopback (fleet, cache), so a client that opens connections and sends
//! a head slowly, or sends a huge one, must not be able to hold the
//! sidecar's memory or its file descriptors. Three bounds, from
//! `connections:` in the config:
//! - **`header_timeout`**: a request's head (its first line and headers)
//!   must arrive whole within this, on a new connection and on each
//!   request of a kept-alive one; else the connection is closed. hyper's
//!   own timer does it (`http1::Builder::header_read_timeout`, which runs
//!   from the first poll for a head until the head is parsed).
//! - **`max_header_bytes`**: a longer head is answered 431 and the
//!   connection closed (`http1::Builder::max_header_size`), so a head costs
//!   at most this much buffer. A body is not bounded here: it streams to
//!   the handler, which bounds what it reads (`serve::api`, `serve::cache`).
//! - **`max`** open connections, of which **`reserved`** only loopback
//!   clients (the co-located Envoy, whose long polls and callouts these
//!   are) may take: a remote flood can hold at most `max - reserved`, and
//!   the filter's own connections still get in. Past the cap a connection
//!   is closed as it is accepted, before anything is read or allocated for
//!   it, and counted.
//!
//! Each connection is served by hyper's HTTP/1 server with the API's
//! router; the peer's address goes to the handlers as axum's
//! `ConnectInfo`, as `axum::serve` gives it. On shutdown the listener
//! stops accepting and every connection is closed once its request in
//! flight is answered (held long polls are answered at once by the
//! caller's closing signal).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::config::ConnectionsConfig;

/// Open connections and what the listener refused or closed, for
/// `/metrics`.
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Closed as accepted, the cap reached: loopback clients, then others.
    pub refused_local: AtomicU64,
    pub refused_remote: AtomicU64,
    /// Closed because a head did not arrive whole within `header_timeout`.
    pub header_timeouts: AtomicU64,
    /// Answered 431: a head over `max_header_bytes`.
    pub header_too_large: AtomicU64,
}

/// One connection's place under the cap, given back when it closes.
struct Slot(Arc<ConnectionCounters>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A place for a new connection from a loopback client (`local`) or
/// another, or `None` (counted) when the cap leaves it none.
fn take_slot(
    counters: &Arc<ConnectionCounters>,
    limits: &ConnectionsConfig,
    local: bool,
) -> Option<Slot> {
    let cap = if local {
        limits.max
    } else {
        limits.max - limits.reserved
    };
    let taken = counters
        .open
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
            (open < cap).then_some(open + 1)
        });
    match taken {
        Ok(_) => Some(Slot(counters.clone())),
        Err(_) => {
            let refused = if local {
                &counters.refused_local
            } else {
                &counters.refused_remote
            };
            refused.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, within `limits`;
/// then waits for the connections to finish (their requests in flight)
/// for at most `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionsConfig,
    counters: Arc<ConnectionCounters>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) -> io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_header_size(limits.max_header_bytes);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors or a connection reset before it
                // was accepted: the listener itself is fine; wait a moment
                // rather than spin on an error that repeats at once.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = take_slot(&counters, &limits, peer.ip().is_loopback()) else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let connection = graceful
            .watch(builder.serve_connection(TokioIo::new(stream), service(app.clone(), peer)));
        let counters = counters.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                count_closed(&counters, &e);
            }
            drop(slot);
        });
    }
    drop(listener);
    // Connections that outlive the drain are dropped with the runtime.
    let _ = tokio::time::timeout(drain, graceful.shutdown()).await;
    Ok(())
}

/// The router as hyper's service for one connection: each request carries
/// its peer's address as `ConnectInfo` (the door and the admin checks read
/// it).
fn service(
    app: Router,
    peer: SocketAddr,
) -> impl hyper::service::Service<
    hyper::Request<hyper::body::Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        app.clone().oneshot(request.map(axum::body::Body::new))
    })
}

/// Why a connection ended in an error, where it is one the limits caused.
fn count_closed(counters: &ConnectionCounters, error: &hyper::Error) {
    if error.is_timeout() {
        counters.header_timeouts.fetch_add(1, Ordering::Relaxed);
    } else if error.is_parse_too_large() {
        counters.header_too_large.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, reserved: usize) -> ConnectionsConfig {
        ConnectionsConfig {
            max,
            reserved,
            ..ConnectionsConfig::default()
        }
    }

    #[test]
    fn remote_clients_cannot_take_the_reserved_slots_and_a_closed_connection_frees_its_own() {
        let counters = Arc::new(ConnectionCounters::default());
        let limits = limits(3, 1);
        let a = take_slot(&counters, &limits, false).expect("first remote");
        let _b = take_slot(&counters, &limits, false).expect("second remote");
        assert!(
            take_slot(&counters, &limits, false).is_none(),
            "remote past max - reserved"
        );
        let local = take_slot(&counters, &limits, true).expect("loopback takes the reserved slot");
        assert!(
            take_slot(&counters, &limits, true).is_none(),
            "nobody past max"
        );
        assert_eq!(counters.open.load(Ordering::Acquire), 3);
        assert_eq!(counters.refused_remote.load(Ordering::Relaxed), 1);
        assert_eq!(counters.refused_local.load(Ordering::Relaxed), 1);
        drop(a);
        drop(local);
        assert_eq!(counters.open.load(Ordering::Acquire), 1);
        assert!(
            take_slot(&counters, &limits, false).is_some(),
            "a freed slot is taken again"
        );
    }
}
