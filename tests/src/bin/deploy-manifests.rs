//! `make deploy-manifests`: writes the files `sluice_tests::deploy` renders
//! from `envoy/` and `deploy/release.env`. `--check`: writes nothing, lists
//! the files that differ and exits 1 if any does. `SLUICE_FLEET_SALT`: the
//! fleet overlay's `fleet.salt` (default: a placeholder); `SLUICE_POLICY`: a
//! policy file to ship instead of the demo policy. Do not commit either.

use std::fs;
use std::process::ExitCode;

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let root = sluice_tests::repo_root();
    // An operator's own fleet salt and policy; the committed files carry a
    // placeholder salt and the demo policy of envoy/sluice.yaml.
    let salt = std::env::var("SLUICE_FLEET_SALT")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| sluice_tests::deploy::FLEET_SALT_PLACEHOLDER.to_string());
    let policy = std::env::var_os("SLUICE_POLICY")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from);
    let rendered = sluice_tests::deploy::generated_files_for(&root, &salt, policy.as_deref());
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
