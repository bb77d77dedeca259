//! sluice-sidecar: watches the GPUs and inference servers and tells the
//! Envoy filter, over a long-polled HTTP API, when to stop sending work.
//!
//! For now it serves a healthy state only: [`state`] holds the versioned
//! state the filter reads, [`api`] serves it. Sources, breaker rules and the
//! kill-switch admin will write into the same [`state::StateStore`].

pub mod api;
pub mod check_config;
pub mod state;

use std::future::Future;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::state::StateStore;

/// Serves the API for `store` on `listener` until `shutdown` resolves. Held
/// long polls are answered at once on shutdown, so it does not wait for them.
pub async fn serve(
    listener: TcpListener,
    store: StateStore,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (closing_tx, closing_rx) = watch::channel(false);
    let app = api::router(store, closing_rx);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            // Nobody left to receive is fine: there are no held polls then.
            let _ = closing_tx.send(true);
        })
        .await
        .context("serving HTTP")
}
