//! The wait both native binaries (`sluice-sidecar`, `mock-llm`) stop on,
//! written once.

/// Resolves on Ctrl-C or SIGTERM. If a handler cannot be installed, that
/// signal is simply not awaited (the process still dies by default action);
/// `program` names the binary in that message.
pub async fn signal(program: &str) {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("{program}: cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                eprintln!("{program}: cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
