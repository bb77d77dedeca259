//! The crates' import layering (issue #19): each crate's layer order is
//! declared once here, top first; `sluice_tests::layers::check` fails on an
//! import that points to a higher layer or on an import cycle, naming the
//! file and the import.
//!
//! Figures for a before/after comparison:
//! `cargo test -p sluice-tests --test integration -- --nocapture layers::figures`.

use std::path::PathBuf;

use sluice_tests::layers::{self, Layer};

fn src(krate: &str) -> PathBuf {
    sluice_tests::repo_root().join(krate).join("src")
}

/// The sidecar, top first (docs/src/design.md and the crate's own doc):
///
/// 1. root: the wiring (`serve`) and the offline checks (`--check`);
/// 2. serve: the HTTP API (routes, admin token, `/metrics`, the page);
/// 3. fleet, cache: the two capabilities that keep state in Redis, side
///    by side (neither imports the other): the fleet agent and the
///    response cache;
/// 4. watch: monitor rounds, alerts, history, traffic, the kill switch,
///    telemetry;
/// 5. sources, redis: the sidecar's ways out: the GPU and backend
///    readings, and the one Redis connection;
/// 6. config: the config file, one file per section with its check;
/// 7. breaker: the pure rules engine (samples + clock → states);
/// 8. base: an HTTP client, the answers every endpoint shares, the door,
///    the versioned state.
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
        name: "capabilities",
        modules: &["fleet", "cache"],
    },
    Layer {
        name: "watch",
        modules: &["watch"],
    },
    Layer {
        name: "outside",
        modules: &["sources", "redis", "listen"],
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

/// The most floors (modules in the longest import chain) the sidecar may
/// have (issue #30).
const SIDECAR_MAX_LEVELS: usize = 8;

/// The longest production function the core and the sidecar may have,
/// but for one with its reason written right above it:
/// `// Over 80 lines: <reason>` (`layers::function_cap`).
const MAX_FUNCTION_LINES: usize = 80;

/// [`MAX_FUNCTION_LINES`] over `krate`'s `src/`: every function over it
/// without a written reason, every stale or stray exception.
fn function_cap(krate: &str) {
    let scan = match layers::scan(&src(krate)) {
        Ok(s) => s,
        Err(e) => panic!("{krate}/src: {e}"),
    };
    if let Err(e) = layers::function_cap(&scan, MAX_FUNCTION_LINES) {
        panic!("{krate}: functions over {MAX_FUNCTION_LINES} lines:\n{e}");
    }
}

/// The policy core (crate `sluice-core`), top first (docs/src/design.md,
/// "Layers"): one method per proxy event; the fleet's leases; every decision
/// that produces a verdict; the response cache (above the usage types it
/// reuses, below the request path that drives it); the queue, bucket
/// arithmetic, what a request costs and the Host trait; shared data and the codec; the policy model,
/// which imports nothing else of the crate.
const CORE: &[Layer] = &[
    Layer {
        name: "root",
        modules: &["lib"],
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
        name: "cache, fleet contract",
        modules: &["cache", "fleet_contract"],
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

/// The core's folders whose `mod.rs` and children still import each other:
/// a type declared in `mod.rs` whose methods live in the files of their
/// topic, each file reading the type and the type calling into the file —
/// flow's `Stream` (one file per event), admission's `Engine` and
/// `Verdict` (the ladder's `Served`, `impl Engine` in `ladder.rs`), the
/// `Policy` and its sections (a section's check reads the policy). Only
/// the cycle through `mod.rs` is let through: these folders' other files,
/// like every other folder at any depth, may not import each other in a
/// cycle, and a folder whose cycle is gone must leave this list
/// (`layers::check_allowing`).
const CORE_PARENT_CYCLES: &[&str] = &["admission", "flow", "policy"];

#[test]
fn core_layers() {
    // Strict between folders and inside every folder (no cycle between
    // two files of one folder: what they share is in a leaf, as
    // `usage/shared.rs`), but for the cycles through `mod.rs` above.
    if let Err(e) = layers::check_allowing(&src("core"), CORE, CORE_PARENT_CYCLES) {
        panic!("core/src:\n{e}");
    }
    function_cap("core");
}

#[test]
fn sidecar_layers() {
    let figures = match layers::check(&src("gpu-sidecar"), SIDECAR) {
        Ok(f) => f,
        Err(e) => panic!("gpu-sidecar/src:\n{e}"),
    };
    assert!(
        figures.levels <= SIDECAR_MAX_LEVELS && SIDECAR.len() <= SIDECAR_MAX_LEVELS,
        "gpu-sidecar: {} floors ({}), {} layers: at most {SIDECAR_MAX_LEVELS}",
        figures.levels,
        figures.chain.join(" → "),
        SIDECAR.len()
    );
    function_cap("gpu-sidecar");
}

/// The figures quoted before and after a restructuring, printed, and held
/// to what they claim of each crate's `src/`: files and modules as scanned
/// (both counted, a module per file at most); the module imports, the
/// distinct pairs of the scan's imports; the longest chain, modules each
/// importing the next, none twice, as long as `levels` says; no cycle
/// between modules, so no back-import to cut; no cycle inside a folder but
/// those let through ([`CORE_PARENT_CYCLES`]); the longest functions, the
/// scan's longest first, none over [`MAX_FUNCTION_LINES`] without its
/// written exception; the exceptions, each honoured by the cap's check and
/// every one of them listed.
#[test]
fn figures() {
    use std::collections::BTreeSet;
    for krate in ["gpu-sidecar", "core", "filter"] {
        let f = match layers::figures(&src(krate)) {
            Ok(f) => f,
            Err(e) => panic!("{krate}/src: {e}"),
        };
        println!("{krate}/src:\n{f}\n");
        let scan = layers::scan(&src(krate)).expect("scanned once already");
        assert!(f.files > 0 && f.files == scan.files.len(), "{krate}: {f}");
        assert!(
            f.modules > 0 && f.modules <= f.files && f.modules == scan.modules.len(),
            "{krate}: {f}"
        );
        let pairs: BTreeSet<(&str, &str)> = scan
            .imports
            .iter()
            .map(|i| (i.from.as_str(), i.to.as_str()))
            .collect();
        assert_eq!(f.edges, pairs.len(), "{krate}: {f}");
        assert!(
            f.levels >= 1 && f.levels == f.chain.len() && f.levels <= f.modules,
            "{krate}: {f}"
        );
        for link in f.chain.windows(2) {
            assert!(
                pairs.contains(&(link[0].as_str(), link[1].as_str())),
                "{krate}: `{}` does not import `{}`: {f}",
                link[0],
                link[1]
            );
        }
        let distinct: BTreeSet<&String> = f.chain.iter().collect();
        assert_eq!(distinct.len(), f.chain.len(), "{krate}: {f}");
        assert!(f.cycles.is_empty(), "{krate}: {f}");
        assert!(
            f.back_edges.is_empty() && f.back_imports == 0,
            "{krate}: {f}"
        );
        for cycle in &f.inner_cycles {
            let folder = cycle
                .iter()
                .fold(cycle[0].clone(), |p, m| layers::folder_of(&p, m));
            assert!(
                krate == "core"
                    && CORE_PARENT_CYCLES.contains(&folder.as_str())
                    && cycle.contains(&folder),
                "{krate}: a cycle inside `{folder}`: {}",
                cycle.join(", ")
            );
        }
        assert_eq!(f.longest.len(), scan.functions.len().min(5), "{krate}: {f}");
        assert!(
            f.longest.windows(2).all(|w| w[0].lines >= w[1].lines),
            "{krate}: {f}"
        );
        assert_eq!(
            f.longest.first().map(|g| g.lines),
            scan.functions.iter().map(|g| g.lines).max(),
            "{krate}: {f}"
        );
        assert!(
            f.longest
                .iter()
                .all(|g| g.lines <= MAX_FUNCTION_LINES || g.exception.is_some()),
            "{krate}: over {MAX_FUNCTION_LINES} lines: {f}"
        );
        let honoured = match layers::function_cap(&scan, MAX_FUNCTION_LINES) {
            Ok(h) => h,
            Err(e) => panic!("{krate}: {e}"),
        };
        assert_eq!(
            f.exceptions.iter().collect::<Vec<_>>(),
            honoured,
            "{krate}: {f}"
        );
        if krate == "gpu-sidecar" {
            assert!(f.levels <= SIDECAR_MAX_LEVELS, "{krate}: {f}");
        }
    }
}

/// Each package's dependencies, from `cargo metadata` (the real resolution
/// of every Cargo.toml, not a reading of the files): name → dependency names.
fn dependencies() -> std::collections::BTreeMap<String, Vec<String>> {
    dependencies_where(|_| true)
}

/// [`dependencies`], only those its build links (no dev-dependencies).
fn linked_dependencies() -> std::collections::BTreeMap<String, Vec<String>> {
    dependencies_where(|d| d["kind"].as_str() != Some("dev"))
}

fn dependencies_where(
    keep: impl Fn(&serde_json::Value) -> bool,
) -> std::collections::BTreeMap<String, Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(sluice_tests::repo_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"].as_array().expect("dependencies");
            let names = deps
                .iter()
                .filter(|d| keep(d))
                .filter_map(|d| d["name"].as_str().map(String::from))
                .collect();
            (p["name"].as_str().expect("name").to_string(), names)
        })
        .collect()
}

/// The core knows no proxy: no proxy-wasm, no Envoy binding, no host
/// crate. A second host (a native Envoy module) reuses it as it is.
#[test]
fn the_core_has_no_proxy_dependency() {
    let deps = dependencies();
    let core = &deps["sluice-core"];
    let ours: Vec<&String> = core.iter().filter(|d| d.starts_with("sluice-")).collect();
    assert_eq!(
        ours,
        ["sluice-wire"],
        "the core depends on sluice-wire only of ours: {core:?}"
    );
    for forbidden in ["proxy-wasm", "envoy"] {
        assert!(
            !core.iter().any(|d| d.contains(forbidden)),
            "sluice-core depends on a proxy crate ({forbidden}): {core:?}"
        );
    }
    assert!(
        deps.iter()
            .all(|(name, d)| name == "sluice-filter" || !d.iter().any(|x| x == "sluice-filter")),
        "the wasm filter is a leaf: nothing depends on it"
    );
}

/// The wasm filter is a thin host: the core and proxy-wasm (proptest only
/// for its tests), and its source is the crate root, the shim, the reader
/// of proxy-wasm's header map and the VM's allocator (plain Rust, so
/// their tests run natively), nothing that decides.
#[test]
fn the_filter_is_the_core_plus_the_shim() {
    let mut filter = linked_dependencies()["sluice-filter"].clone();
    filter.sort();
    assert_eq!(filter, ["proxy-wasm", "sluice-core"]);
    let mut all = dependencies()["sluice-filter"].clone();
    all.sort();
    assert_eq!(all, ["proptest", "proxy-wasm", "sluice-core"]);
    let mut files: Vec<String> = std::fs::read_dir(src("filter"))
        .expect("filter/src")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["lib.rs", "map.rs", "pool.rs", "shim.rs"],
        "filter/src holds the root, the shim, the header map's reader and the allocator only"
    );
}

/// The sidecar takes the core's policy model and decisions and the
/// messages of `sluice-wire`; of our crates nothing else but the shared
/// graceful-shutdown helper.
#[test]
fn the_sidecar_depends_on_the_core_and_wire_only() {
    let deps = dependencies();
    let mut ours: Vec<&String> = deps["sluice-sidecar"]
        .iter()
        .filter(|d| d.starts_with("sluice-"))
        .collect();
    ours.sort();
    ours.dedup();
    assert_eq!(ours, ["sluice-core", "sluice-shutdown", "sluice-wire"]);
}

/// The module of the core the sidecar may name besides the front door:
/// the contract it shares with the filter's fleet gate.
const SIDECAR_CONTRACT: &str = "fleet_contract";

/// The names `core/src/lib.rs` exports at the crate root: its `pub use`
/// items (as renamed) and its `pub mod`s.
fn core_front_door() -> std::collections::BTreeSet<String> {
    fn leaves(tree: &syn::UseTree, out: &mut std::collections::BTreeSet<String>) {
        match tree {
            syn::UseTree::Path(p) => leaves(&p.tree, out),
            syn::UseTree::Name(n) => {
                out.insert(n.ident.to_string());
            }
            syn::UseTree::Rename(r) => {
                out.insert(r.rename.to_string());
            }
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| leaves(t, out)),
            syn::UseTree::Glob(_) => {
                panic!("core/src/lib.rs: a glob re-export hides what it exports")
            }
        }
    }
    let text = std::fs::read_to_string(src("core").join("lib.rs")).expect("core/src/lib.rs");
    let file = syn::parse_file(&text).expect("core/src/lib.rs parses");
    let mut out = std::collections::BTreeSet::new();
    for item in &file.items {
        match item {
            syn::Item::Use(u) if matches!(u.vis, syn::Visibility::Public(_)) => {
                leaves(&u.tree, &mut out)
            }
            syn::Item::Mod(m) if matches!(m.vis, syn::Visibility::Public(_)) => {
                out.insert(m.ident.to_string());
            }
            _ => {}
        }
    }
    out
}

/// Each name of the core a text names right after `sluice_core::` (a
/// group's top-level names one by one), with its line: what
/// `grep -rhoE "sluice_core::[a-z_]+"` sees, groups included.
fn core_names(text: &str) -> Vec<(usize, String)> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (at, _) in text.match_indices("sluice_core::") {
        let line = text[..at].lines().count().max(1);
        let rest = &text[at + "sluice_core::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.push((line, ident(rest)));
            continue;
        };
        let (mut depth, mut start) = (0usize, 0usize);
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.push((line, ident(group[start..i].trim_start())));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push((line, ident(group[start..i].trim_start())));
                    start = i + 1;
                }
                _ => {}
            }
        }
    }
    out.retain(|(_, name)| !name.is_empty());
    out
}

#[test]
fn core_names_reads_paths_and_groups() {
    let text = "use sluice_core::{Limit, fleet_contract::{self, window_end}};\n\
                // see sluice_core::policy::keys\nfn f(p: sluice_core::Policy) {}";
    let names: Vec<String> = core_names(text).into_iter().map(|(_, n)| n).collect();
    assert_eq!(names, ["Limit", "fleet_contract", "policy", "Policy"]);
}

/// The sidecar names nothing of the core but the front door's capitalised
/// re-exports and the fleet contract: it shares a contract with the
/// filter, not the filter's engine.
#[test]
fn the_sidecar_names_only_the_cores_front_door_and_the_fleet_contract() {
    let door = core_front_door();
    assert!(door.contains(SIDECAR_CONTRACT), "core/src/lib.rs: {door:?}");
    let mut stray = Vec::new();
    let mut seen = 0;
    let mut dirs = vec![src("gpu-sidecar")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("gpu-sidecar/src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a source file");
            for (line, name) in core_names(&text) {
                seen += 1;
                let capitalised = name.starts_with(|c: char| c.is_ascii_uppercase());
                if !door.contains(&name) || !(capitalised || name == SIDECAR_CONTRACT) {
                    let shown = path
                        .strip_prefix(sluice_tests::repo_root())
                        .unwrap_or(&path);
                    stray.push(format!("{}:{line}: sluice_core::{name}", shown.display()));
                }
            }
        }
    }
    assert!(
        seen > 0,
        "the sidecar names nothing of the core: is the scan reading it?"
    );
    assert!(
        stray.is_empty(),
        "the sidecar reaches past the core's front door (core/src/lib.rs) and its \
         fleet contract: {}",
        stray.join("; ")
    );
}
