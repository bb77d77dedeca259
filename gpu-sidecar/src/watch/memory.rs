//! Handing freed heap back to the OS after a burst of connections.
//!
//! glibc's malloc keeps what a burst freed in its per-thread arenas: 5,000
//! held long polls took the sidecar from 4 MB to 86 MB, and it stayed there
//! after they were released. `malloc_trim(0)` returns the free pages of every
//! arena. The long-poll cap bounds the burst; this gives it back afterwards.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use crate::watch::snapshot::Telemetry;

/// How often the held-poll peak is looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);
/// Trim once this many more polls were held than are held now.
const TRIM_AFTER_DROP: i64 = 32;

/// Gives free heap pages back to the OS; returns whether anything was
/// released. A no-op where the allocator is not glibc's.
pub fn release_free_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks glibc's own arenas under their
        // locks; it takes no pointers from us and is safe to call from any
        // thread at any time.
        unsafe { libc::malloc_trim(0) != 0 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Whether the burst is over: the peak was well above what is held now.
/// Resets the peak to now when it is.
pub fn burst_ended(tel: &Telemetry) -> bool {
    let now = tel.subscribers.load(Ordering::Acquire);
    let peak = tel.subscribers_peak.swap(now, Ordering::AcqRel);
    peak - now >= TRIM_AFTER_DROP
}

/// Runs until `closing` turns true: trims after each burst of held polls.
pub async fn trim_after_bursts(tel: std::sync::Arc<Telemetry>, mut closing: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(CHECK_EVERY) => {}
            _ = closing.wait_for(|c| *c) => return,
        }
        if burst_ended(&tel) {
            // Off the async workers: trimming a large heap takes a while.
            let _ = tokio::task::spawn_blocking(release_free_heap).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_ends_when_the_peak_is_well_above_now() {
        let tel = Telemetry::default();
        tel.subscribers.store(10, Ordering::Relaxed);
        tel.subscribers_peak.store(20, Ordering::Relaxed);
        assert!(!burst_ended(&tel));
        tel.subscribers_peak.store(100, Ordering::Relaxed);
        tel.subscribers.store(3, Ordering::Relaxed);
        assert!(burst_ended(&tel));
        assert_eq!(tel.subscribers_peak.load(Ordering::Relaxed), 3);
        assert!(!burst_ended(&tel), "once per burst");
        // Callable anywhere; the result depends on the allocator.
        let _ = release_free_heap();
    }
}
