//! `make deploy-manifests`: writes the files `sluice_tests::deploy` renders
//! from `envoy/` and `deploy/release.env`. `--check`: writes nothing, lists
//! the files that differ and exits 1 if any does. `SLUICE_FLEET_SALT`: the
//! fleet overlay's `fleet.salt` (default: a placeholder; do not commit yours).

use std::fs;
use std::process::ExitCode;

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let root = sluice_tests::repo_root();
    // An operator's own fleet salt; the committed files carry a placeholder.
    let salt = std::env::var("SLUICE_FLEET_SALT")
        .ok()
        .filter(|s| !s.is_empty());
    let rendered = match &salt {
        Some(salt) => sluice_tests::deploy::generated_files_with_salt(&root, salt),
        None => sluice_tests::deploy::generated_files(&root),
    };
    let files = match rendered {
        Ok(files) => files,
        Err(e) => {
            eprintln!("deploy-manifests: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let mut stale = 0;
    for (rel, text) in files {
        let path = root.join(&rel);
        let current = fs::read_to_string(&path).unwrap_or_default();
        if current == text {
            continue;
        }
        if check {
            eprintln!("deploy-manifests: {rel} is out of date (run `make deploy-manifests`)");
            stale += 1;
            continue;
        }
        if let Some(dir) = path.parent() {
            if let Err(e) = fs::create_dir_all(dir) {
                eprintln!("deploy-manifests: {}: {e}", dir.display());
                return ExitCode::FAILURE;
            }
        }
        if let Err(e) = fs::write(&path, text) {
            eprintln!("deploy-manifests: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {rel}");
    }
    if stale > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
