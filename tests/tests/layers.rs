//! The crates' import layering (issue #19): each crate's layer order is
//! declared once here, top first; `sluice_tests::layers::check` fails on an
//! import that points to a higher layer or on an import cycle, naming the
//! file and the import.
//!
//! Figures for a before/after comparison:
//! `cargo test -p sluice-tests --test layers -- --nocapture figures`.

use std::path::PathBuf;

use sluice_tests::layers::{self, Layer};

fn src(krate: &str) -> PathBuf {
    sluice_tests::repo_root().join(krate).join("src")
}

/// The sidecar, top first (README, "Layout"): the wiring and the offline
/// checks; the HTTP API; the fleet agent; what it watches and concludes;
/// the sources it reads; its config file; the pure breaker rules; an HTTP
/// client, the door and the versioned state at the bottom.
const SIDECAR: &[Layer] = &[
    Layer {
        name: "root",
        modules: &["lib", "check_config"],
    },
    Layer {
        name: "serve",
        modules: &["serve"],
    },
    Layer {
        name: "cache",
        modules: &["cache"],
    },
    Layer {
        name: "fleet",
        modules: &["fleet"],
    },
    Layer {
        name: "watch",
        modules: &["watch"],
    },
    Layer {
        name: "sources",
        modules: &["sources"],
    },
    Layer {
        name: "config",
        modules: &["config"],
    },
    Layer {
        name: "breaker",
        modules: &["breaker"],
    },
    Layer {
        name: "base",
        modules: &["http", "reply", "door", "state"],
    },
];

/// The longest production function the sidecar may have (issue #19).
const MAX_FUNCTION_LINES: usize = 100;

/// The filter, top first (README, "The filter's layers"): the wasm entry;
/// one method per Envoy event; the fleet's leases; every decision that
/// produces a verdict; the queue, bucket arithmetic, what a request costs
/// and the Host trait; shared data and the codec; the policy model, which
/// imports nothing else of the crate.
const FILTER: &[Layer] = &[
    Layer {
        name: "root",
        modules: &["lib", "shim"],
    },
    Layer {
        name: "flow",
        modules: &["flow"],
    },
    Layer {
        name: "fleet",
        modules: &["fleet"],
    },
    Layer {
        name: "admission",
        modules: &["admission"],
    },
    Layer {
        name: "mechanisms",
        modules: &["queue", "limits", "usage", "host"],
    },
    Layer {
        name: "state",
        modules: &["state"],
    },
    Layer {
        name: "policy",
        modules: &["policy"],
    },
];

#[test]
fn filter_layers() {
    // Between folders: strict. Inside a folder the filter still has
    // `mod.rs` ↔ child cycles: flow's stream and its event files (one
    // `Stream` whose methods live in the file of their event), and the
    // policy and its sections (a section's check reads the policy it is
    // a section of).
    let figures = match layers::check_with(&src("filter"), FILTER, false) {
        Ok(f) => f,
        Err(e) => panic!("filter/src:\n{e}"),
    };
    let long: Vec<String> = figures
        .longest
        .iter()
        .filter(|f| f.lines > MAX_FUNCTION_LINES)
        .map(|f| format!("{} ({}:{}) has {} lines", f.name, f.file, f.line, f.lines))
        .collect();
    assert!(
        long.is_empty(),
        "filter: split functions over {MAX_FUNCTION_LINES} lines: {}",
        long.join("; ")
    );
}

#[test]
fn sidecar_layers() {
    let figures = match layers::check(&src("gpu-sidecar"), SIDECAR) {
        Ok(f) => f,
        Err(e) => panic!("gpu-sidecar/src:\n{e}"),
    };
    let long: Vec<String> = figures
        .longest
        .iter()
        .filter(|f| f.lines > MAX_FUNCTION_LINES)
        .map(|f| format!("{} ({}:{}) has {} lines", f.name, f.file, f.line, f.lines))
        .collect();
    assert!(
        long.is_empty(),
        "gpu-sidecar: split functions over {MAX_FUNCTION_LINES} lines: {}",
        long.join("; ")
    );
}

#[test]
fn figures() {
    for krate in ["gpu-sidecar", "filter"] {
        match layers::figures(&src(krate)) {
            Ok(f) => println!("{krate}/src:\n{f}\n"),
            Err(e) => panic!("{krate}/src: {e}"),
        }
    }
}
