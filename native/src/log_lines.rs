//! The core writes its log lines through the `log` facade. In the module
//! they go to Envoy's log (the sink [`forward_to`] sets when Envoy loads
//! the module), except on a thread inside [`collecting_errors`]: a policy
//! loaded on Envoy's main thread turns its errors into the refusal's
//! message and logs nothing else (each worker logs its own load).

use std::cell::RefCell;
use std::sync::OnceLock;

/// Where a line goes outside a collection.
pub type Sink = fn(log::Level, &str);

static SINK: OnceLock<Sink> = OnceLock::new();

thread_local! {
    static COLLECTING: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
}

struct Lines;

static LINES: Lines = Lines;

impl log::Log for Lines {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let collected = COLLECTING.with(|c| match c.borrow_mut().as_mut() {
            Some(errors) => {
                if record.level() == log::Level::Error {
                    errors.push(record.args().to_string());
                }
                true
            }
            None => false,
        });
        if !collected {
            if let Some(sink) = SINK.get() {
                sink(record.level(), &record.args().to_string());
            }
        }
    }

    fn flush(&self) {}
}

fn install() {
    if log::set_logger(&LINES).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Every line from now on goes to `sink` (the first sink set stays).
pub fn forward_to(sink: Sink) {
    let _ = SINK.set(sink);
    install();
}

/// Runs `body`, collecting the error lines it logs on this thread (and
/// dropping its other lines); the collection ends even if `body` panics.
pub fn collecting_errors<T>(body: impl FnOnce() -> T) -> (T, Vec<String>) {
    struct Restore(Option<Vec<String>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            COLLECTING.with(|c| *c.borrow_mut() = previous);
        }
    }
    install();
    let previous = COLLECTING.with(|c| c.replace(Some(Vec::new())));
    let restore = Restore(previous);
    let out = body();
    let errors = COLLECTING
        .with(|c| c.borrow_mut().take())
        .unwrap_or_default();
    drop(restore);
    (out, errors)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_collection_keeps_its_errors_only_and_ends() {
        let ((), errors) = collecting_errors(|| {
            log::info!("loaded");
            log::error!("tiers.free.requests: at least 1");
            let ((), inner) = collecting_errors(|| log::error!("inner"));
            assert_eq!(inner, ["inner"]);
            log::warn!("slow");
        });
        assert_eq!(errors, ["tiers.free.requests: at least 1"]);
        let ((), after) = collecting_errors(|| ());
        assert!(after.is_empty());
    }

    #[test]
    fn a_panic_inside_ends_the_collection() {
        let caught = std::panic::catch_unwind(|| collecting_errors(|| panic!("boom")));
        assert!(caught.is_err());
        assert!(COLLECTING.with(|c| c.borrow().is_none()));
    }
}
