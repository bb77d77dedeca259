//! Reads a crate's own imports and checks that they point down a declared
//! order of layers, with no import cycle between its top-level modules
//! (issue #19) nor between the files of any one folder, at any depth. Used by `tests/tests/layers.rs`, which declares each
//! crate's order once.
//!
//! What counts as an import of module `m` from a file of module `f` (the
//! top-level module: `src/f.rs` or anything under `src/f/`; `src/lib.rs`
//! is the module `lib`): every path that resolves to `crate::m…` — in a
//! `use` (groups `use crate::{a, b::c}` expanded), in code and types
//! (`crate::m::f()`), in a macro's tokens, in an attribute's string
//! (`#[serde(deserialize_with = "crate::m::f")]`), `super::`/`self::`
//! paths that climb out of `f`, and in `lib.rs` a path starting with a
//! module's bare name. A path to an item of the crate root (`crate::Options`)
//! is an import of `lib`. Not read: `main.rs` and `src/bin/` (another
//! crate), files named `*tests*.rs`, `#[cfg(test)]` items and the files of
//! `#[cfg(test)] mod x;`: tests may reach anywhere.
//!
//! Parsing is `syn`'s (the real Rust grammar), so comments, strings and
//! nested groups are not guessed at. Line numbers need proc-macro2's
//! `span-locations`.
//!
//! The same scan measures each production function ([`function_cap`]): a
//! function longer than the cap needs its reason written where it stands,
//! a comment line `// Over 80 lines: <reason>` (the cap's number) right
//! above it, among or above its doc comment and attributes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// One layer: a name (for messages) and its top-level modules.
#[derive(Debug, Clone, Copy)]
pub struct Layer {
    pub name: &'static str,
    pub modules: &'static [&'static str],
}

/// One import of another top-level module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Import {
    /// Relative to the crate's directory (`src/fleet/agent.rs`).
    pub file: String,
    pub line: usize,
    /// The importing and the imported top-level module.
    pub from: String,
    pub to: String,
    /// As written, a `use` group expanded (`crate::config::duration`).
    pub path: String,
}

impl fmt::Display for Import {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: `{}`", self.file, self.line, self.path)
    }
}

/// A production function and its length in lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    pub file: String,
    pub line: usize,
    /// `Type::name` for a method.
    pub name: String,
    pub lines: usize,
    /// The `// Over N lines: <reason>` comment right above it, if any.
    pub exception: Option<Exception>,
}

/// A written exception to the function cap: `// Over {cap} lines: {reason}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exception {
    pub line: usize,
    /// The cap the comment names.
    pub cap: usize,
    pub reason: String,
}

impl Exception {
    /// Reads `// Over 80 lines: <reason>` (the reason may be empty: the
    /// check says so rather than missing the marker).
    fn parse(line: usize, text: &str) -> Option<Exception> {
        let rest = text.trim_start().strip_prefix("// Over ")?;
        let (cap, reason) = rest.split_once(" lines:")?;
        Some(Exception {
            line,
            cap: cap.parse().ok()?,
            reason: reason.trim().to_string(),
        })
    }
}

/// What a scan of `src/` found.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    pub files: Vec<String>,
    /// Top-level modules (`lib` for the crate root).
    pub modules: BTreeSet<String>,
    /// Imports of another top-level module.
    pub imports: Vec<Import>,
    /// Imports inside one top-level module, each between two members of
    /// the folder both lie in (the deepest one holding both): its files and
    /// subfolders by module path (`watch::history` for `watch/history.rs`
    /// and anything under `watch/history/`; `watch` for `watch/mod.rs`).
    /// The folder of an import is the longer common prefix of `from` and
    /// `to` ([`folder_of`]).
    pub inner: Vec<Import>,
    pub functions: Vec<Function>,
    /// `file:line` of each `// Over N lines:` comment that stands above no
    /// production function (left behind by a move, or above test code).
    pub stray_exceptions: Vec<String>,
}

/// The figures quoted before and after a restructuring.
#[derive(Debug, Clone)]
pub struct Figures {
    pub files: usize,
    pub modules: usize,
    /// Module pairs `from → to` with at least one import.
    pub edges: usize,
    /// The longest chain of modules, each importing the next, once the
    /// back-imports are cut (a chain of one module is 1 level).
    pub levels: usize,
    pub chain: Vec<String>,
    /// With a layer order: the imports pointing to a higher layer, plus,
    /// inside one layer, those closing a cycle. Without one: the imports
    /// a depth-first walk from `lib` (then modules by name) finds pointing
    /// back to a module on its path — one set whose cut leaves no cycle.
    pub back_edges: Vec<(String, String)>,
    /// Import sites behind `back_edges`.
    pub back_imports: usize,
    /// Each cycle's members (strongly connected modules), sorted.
    pub cycles: Vec<Vec<String>>,
    /// Cycles between the members of one folder, any folder at any depth
    /// (`fleet, fleet::concurrency`), each within one folder.
    pub inner_cycles: Vec<Vec<String>>,
    /// The longest production functions, longest first (at most 5).
    pub longest: Vec<Function>,
    /// Every function with a written exception to the cap, longest first.
    pub exceptions: Vec<Function>,
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "files {}, modules {}, module imports {}, levels {} ({})",
            self.files,
            self.modules,
            self.edges,
            self.levels,
            self.chain.join(" → ")
        )?;
        let back: Vec<String> = self
            .back_edges
            .iter()
            .map(|(a, b)| format!("{a} → {b}"))
            .collect();
        writeln!(
            f,
            "back-imports {} ({} sites){}{}",
            self.back_edges.len(),
            self.back_imports,
            if back.is_empty() { "" } else { ": " },
            back.join(", ")
        )?;
        let cycles: Vec<String> = self
            .cycles
            .iter()
            .map(|c| format!("{} modules [{}]", c.len(), c.join(", ")))
            .collect();
        writeln!(
            f,
            "cycles {}{}{}",
            self.cycles.len(),
            if cycles.is_empty() { "" } else { ": " },
            cycles.join("; ")
        )?;
        let show = |g: &Function| format!("{} {} ({}:{})", g.name, g.lines, g.file, g.line);
        let longest: Vec<String> = self.longest.iter().map(show).collect();
        let exceptions: Vec<String> = self.exceptions.iter().map(show).collect();
        let inner: Vec<String> = self.inner_cycles.iter().map(|c| c.join(" ↔ ")).collect();
        writeln!(
            f,
            "cycles inside a folder {}{}{}",
            self.inner_cycles.len(),
            if inner.is_empty() { "" } else { ": " },
            inner.join("; ")
        )?;
        writeln!(f, "longest functions: {}", longest.join(", "))?;
        write!(
            f,
            "functions with a written exception to the cap {}{}{}",
            exceptions.len(),
            if exceptions.is_empty() { "" } else { ": " },
            exceptions.join(", ")
        )
    }
}

/// Reads every production `.rs` file under `src` (a crate's `src/`).
pub fn scan(src: &Path) -> Result<Scan, String> {
    let base = src.parent().unwrap_or(src);
    let mut files = Vec::new();
    walk(src, src, &mut files)?;
    files.sort();
    let mut modules = BTreeSet::new();
    let mut paths = BTreeSet::new();
    let mut parsed = Vec::new();
    let mut skip = BTreeSet::new();
    for path in &files {
        let rel = path.strip_prefix(src).map_err(|e| e.to_string())?;
        let Some(module) = module_path(rel) else {
            continue;
        };
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let ast = syn::parse_file(&text)
            .map_err(|e| format!("{}:{}: {e}", path.display(), e.span().start().line))?;
        modules.insert(top_of(&module));
        paths.insert(module.join("::"));
        parsed.push((path.clone(), module, ast, text));
    }
    // The files of `#[cfg(test)] mod x;` are test code.
    for (path, module, ast, _) in &parsed {
        for item in &ast.items {
            if let syn::Item::Mod(m) = item {
                if m.content.is_none() && is_test(&m.attrs) {
                    let dir = module_dir(src, path, module);
                    skip.insert(dir.join(format!("{}.rs", m.ident)));
                    skip.insert(dir.join(m.ident.to_string()).join("mod.rs"));
                }
            }
        }
    }
    let mut out = Scan {
        modules,
        ..Scan::default()
    };
    for (path, module, ast, text) in &parsed {
        if skip.contains(path) {
            continue;
        }
        let file = path
            .strip_prefix(base)
            .unwrap_or(path)
            .display()
            .to_string();
        out.files.push(file.clone());
        let mut reader = Reader {
            file,
            module: module.clone(),
            inline: Vec::new(),
            known: &out.modules,
            paths: &paths,
            imports: Vec::new(),
            inner: Vec::new(),
            functions: Vec::new(),
            self_ty: Vec::new(),
            lines: text.lines().collect(),
        };
        reader.visit_file(ast);
        let taken: BTreeSet<usize> = reader
            .functions
            .iter()
            .filter_map(|g| g.exception.as_ref().map(|e| e.line))
            .collect();
        out.stray_exceptions
            .extend(reader.lines.iter().enumerate().filter_map(|(i, l)| {
                let line = i + 1;
                (Exception::parse(line, l).is_some() && !taken.contains(&line))
                    .then(|| format!("{}:{line}", reader.file))
            }));
        out.imports.extend(reader.imports);
        out.inner.extend(reader.inner);
        out.functions.extend(reader.functions);
    }
    Ok(out)
}

/// Holds every production function of `scan` to `max` lines, but those
/// with a written exception: `Err` names each function over `max` without
/// one, each exception whose function is in fact no longer than `max` (a
/// stale one), names another cap or gives no reason, and each exception
/// comment above no function. `Ok`: the exceptions honoured, longest first.
pub fn function_cap(scan: &Scan, max: usize) -> Result<Vec<&Function>, String> {
    let mut errors = Vec::new();
    let mut honoured = Vec::new();
    for g in &scan.functions {
        let at = format!("{} ({}:{})", g.name, g.file, g.line);
        match &g.exception {
            None if g.lines > max => errors.push(format!(
                "{at} has {} lines: split it, or write `// Over {max} lines: <reason>` above it",
                g.lines
            )),
            None => {}
            Some(e) if g.lines <= max => errors.push(format!(
                "{at} has {} lines, within the cap: drop its stale exception (line {})",
                g.lines, e.line
            )),
            Some(e) if e.cap != max => errors.push(format!(
                "{at}: its exception (line {}) names a cap of {}, the cap is {max}",
                e.line, e.cap
            )),
            Some(e) if e.reason.is_empty() => errors.push(format!(
                "{at}: its exception (line {}) gives no reason",
                e.line
            )),
            Some(_) => honoured.push(g),
        }
    }
    for at in &scan.stray_exceptions {
        errors.push(format!(
            "{at}: an exception to the function cap above no production function"
        ));
    }
    if errors.is_empty() {
        honoured.sort_by(|a, b| b.lines.cmp(&a.lines).then(a.name.cmp(&b.name)));
        Ok(honoured)
    } else {
        Err(errors.join("\n"))
    }
}

/// Checks `src` against `layers` (top first). `Err` lists every import
/// that points up, every cycle (with the imports that close it) between
/// top-level modules or between the members of any one folder (its files
/// and subfolders, its `mod.rs` included), and every module in no layer or
/// named by a layer but absent.
pub fn check(src: &Path, layers: &[Layer]) -> Result<Figures, String> {
    check_allowing(src, layers, &[])
}

/// [`check`], except that in each folder of `parent_cycles` (`"flow"`) a
/// cycle through the folder's `mod.rs` is let through: a type declared
/// there whose methods live in the files of their topic, each file reading
/// the type and the type's other methods calling into the file. A cycle
/// between the folder's other files is still an error, as is a folder
/// named here with no cycle through its `mod.rs` left (a stale exemption).
pub fn check_allowing(
    src: &Path,
    layers: &[Layer],
    parent_cycles: &[&str],
) -> Result<Figures, String> {
    let scan = scan(src)?;
    let mut errors = Vec::new();
    let mut layer_of: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, layer) in layers.iter().enumerate() {
        for m in layer.modules {
            if layer_of.insert(m, i).is_some() {
                errors.push(format!("module `{m}` is in two layers"));
            }
            if !scan.modules.contains(*m) {
                errors.push(format!(
                    "layer `{}` names `{m}`, which is no top-level module of {}",
                    layer.name,
                    src.display()
                ));
            }
        }
    }
    for m in &scan.modules {
        if !layer_of.contains_key(m.as_str()) {
            errors.push(format!(
                "module `{m}` is in no layer: add it to the layer order"
            ));
        }
    }
    for i in &scan.imports {
        if let (Some(&a), Some(&b)) = (layer_of.get(i.from.as_str()), layer_of.get(i.to.as_str())) {
            if b < a {
                errors.push(format!(
                    "{i} points up: `{}` (layer {} `{}`) imports `{}` (layer {} `{}`)",
                    i.from, a, layers[a].name, i.to, b, layers[b].name
                ));
            }
        }
    }
    let figures = figures_of(&scan, Some(&layer_of));
    for cycle in &figures.cycles {
        errors.push(format!(
            "import cycle between {}",
            closed_by(cycle, &scan.imports)
        ));
    }
    let graphs = folder_graphs(&scan.inner);
    let mut allowed = BTreeSet::new();
    for cycle in &figures.inner_cycles {
        let folder = common_prefix(cycle.iter().map(String::as_str));
        if !(parent_cycles.contains(&folder.as_str()) && cycle.contains(&folder)) {
            errors.push(format!(
                "import cycle inside a folder between {}",
                closed_by(cycle, &scan.inner)
            ));
            continue;
        }
        // Its other members: strict, as everywhere.
        let members: BTreeSet<&str> = cycle
            .iter()
            .map(String::as_str)
            .filter(|m| *m != folder)
            .collect();
        let others: BTreeMap<&str, BTreeSet<&str>> = graphs[&folder]
            .iter()
            .filter(|(m, _)| members.contains(*m))
            .map(|(m, tos)| (*m, tos.intersection(&members).copied().collect()))
            .collect();
        for cycle in cycles_in(&others) {
            errors.push(format!(
                "import cycle inside a folder between {}",
                closed_by(&cycle, &scan.inner)
            ));
        }
        allowed.insert(folder);
    }
    for folder in parent_cycles {
        if !allowed.contains(*folder) {
            errors.push(format!(
                "folder `{folder}` is let through for a cycle through its `mod.rs`, \
                 and has none: drop it from the exemptions"
            ));
        }
    }
    if errors.is_empty() {
        Ok(figures)
    } else {
        Err(errors.join("\n"))
    }
}

/// `a, b: <the first import of each pair of members>`.
fn closed_by(cycle: &[String], imports: &[Import]) -> String {
    let members: BTreeSet<&str> = cycle.iter().map(String::as_str).collect();
    let closing: Vec<String> = first_per_edge(imports, |i| {
        members.contains(i.from.as_str()) && members.contains(i.to.as_str())
    })
    .iter()
    .map(ToString::to_string)
    .collect();
    format!("{}: {}", cycle.join(", "), closing.join("; "))
}

/// The figures of `src` with no layer order (before a restructuring).
pub fn figures(src: &Path) -> Result<Figures, String> {
    Ok(figures_of(&scan(src)?, None))
}

fn figures_of(scan: &Scan, layer_of: Option<&BTreeMap<&str, usize>>) -> Figures {
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for m in &scan.modules {
        graph.entry(m).or_default();
    }
    for i in &scan.imports {
        graph.entry(&i.from).or_default().insert(&i.to);
    }
    let edges = graph.values().map(BTreeSet::len).sum();
    let cycles = cycles_in(&graph);
    let mut inner_cycles: Vec<Vec<String>> = folder_graphs(&scan.inner)
        .values()
        .flat_map(cycles_in)
        .collect();
    inner_cycles.sort();
    let mut back: BTreeSet<(&str, &str)> = BTreeSet::new();
    if let Some(layer_of) = layer_of {
        for (from, tos) in &graph {
            for to in tos {
                let (a, b) = (layer_of.get(from), layer_of.get(to));
                if let (Some(a), Some(b)) = (a, b) {
                    if b < a {
                        back.insert((from, to));
                    }
                }
            }
        }
    }
    // What is left: depth-first from `lib`, then by name; an edge to a
    // module on the walk's path closes a cycle.
    let mut state: BTreeMap<&str, u8> = BTreeMap::new();
    let mut roots: Vec<&str> = graph.keys().copied().collect();
    roots.sort_by_key(|m| (*m != "lib", *m));
    for root in roots {
        dfs(root, &graph, &mut state, &mut back);
    }
    let dag: BTreeMap<&str, Vec<&str>> = graph
        .iter()
        .map(|(m, tos)| {
            let down = tos
                .iter()
                .copied()
                .filter(|t| !back.contains(&(m, t)))
                .collect();
            (*m, down)
        })
        .collect();
    let mut memo: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut chain: Vec<&str> = Vec::new();
    for m in dag.keys() {
        let c = longest_from(m, &dag, &mut memo);
        if c.len() > chain.len() {
            chain = c;
        }
    }
    let back_imports = scan
        .imports
        .iter()
        .filter(|i| back.contains(&(i.from.as_str(), i.to.as_str())))
        .count();
    let mut longest = scan.functions.clone();
    longest.sort_by(|a, b| b.lines.cmp(&a.lines).then(a.name.cmp(&b.name)));
    let exceptions = longest
        .iter()
        .filter(|g| g.exception.is_some())
        .cloned()
        .collect();
    longest.truncate(5);
    Figures {
        files: scan.files.len(),
        modules: scan.modules.len(),
        edges,
        levels: chain.len(),
        chain: chain.iter().map(|s| s.to_string()).collect(),
        back_edges: back
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
        back_imports,
        cycles,
        inner_cycles,
        longest,
        exceptions,
    }
}

fn dfs<'a>(
    m: &'a str,
    graph: &BTreeMap<&'a str, BTreeSet<&'a str>>,
    state: &mut BTreeMap<&'a str, u8>,
    back: &mut BTreeSet<(&'a str, &'a str)>,
) {
    if state.get(m).is_some() {
        return;
    }
    state.insert(m, 1);
    for &t in graph.get(m).into_iter().flatten() {
        if back.contains(&(m, t)) {
            continue;
        }
        match state.get(t) {
            Some(1) => {
                back.insert((m, t));
            }
            Some(_) => {}
            None => dfs(t, graph, state, back),
        }
    }
    state.insert(m, 2);
}

fn longest_from<'a>(
    m: &'a str,
    dag: &BTreeMap<&'a str, Vec<&'a str>>,
    memo: &mut BTreeMap<&'a str, Vec<&'a str>>,
) -> Vec<&'a str> {
    if let Some(c) = memo.get(m) {
        return c.clone();
    }
    let mut best: Vec<&str> = Vec::new();
    for &t in dag.get(m).into_iter().flatten() {
        let c = longest_from(t, dag, memo);
        if c.len() > best.len() {
            best = c;
        }
    }
    best.insert(0, m);
    memo.insert(m, best.clone());
    best
}

/// The strongly connected sets of more than one module, sorted.
fn cycles_in(graph: &BTreeMap<&str, BTreeSet<&str>>) -> Vec<Vec<String>> {
    strongly_connected(graph)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| c.into_iter().map(str::to_string).collect())
        .collect()
}

/// The graph of each folder's imports, by folder ([`folder_of`]).
fn folder_graphs(inner: &[Import]) -> BTreeMap<String, BTreeMap<&str, BTreeSet<&str>>> {
    let mut graphs: BTreeMap<String, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    for i in inner {
        let graph = graphs.entry(folder_of(&i.from, &i.to)).or_default();
        graph.entry(&i.from).or_default().insert(&i.to);
        graph.entry(&i.to).or_default();
    }
    graphs
}

/// The folder an import inside a top-level module belongs to: the common
/// prefix of its two members (`a` for `a::b → a::c` and for `a::b → a`;
/// `a::b` for `a::b → a::b::c`).
pub fn folder_of(from: &str, to: &str) -> String {
    common_prefix([from, to].into_iter())
}

/// The longest common prefix of module paths, by segment.
fn common_prefix<'a>(mut paths: impl Iterator<Item = &'a str>) -> String {
    let Some(first) = paths.next() else {
        return String::new();
    };
    let mut prefix: Vec<&str> = first.split("::").collect();
    for p in paths {
        let n = prefix
            .iter()
            .zip(p.split("::"))
            .take_while(|(a, b)| *a == b)
            .count();
        prefix.truncate(n);
    }
    prefix.join("::")
}

/// Tarjan's strongly connected components.
fn strongly_connected<'a>(graph: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Vec<Vec<&'a str>> {
    struct Walk<'a, 'g> {
        graph: &'g BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(w: &mut Walk<'a, '_>, v: &'a str) {
        let i = w.index.len();
        w.index.insert(v, i);
        w.low.insert(v, i);
        w.stack.push(v);
        w.on_stack.insert(v);
        let graph = w.graph;
        for &t in graph.get(v).into_iter().flatten() {
            if !w.index.contains_key(t) {
                visit(w, t);
                let lt = w.low[t];
                let lv = w.low[v];
                w.low.insert(v, lv.min(lt));
            } else if w.on_stack.contains(t) {
                let it = w.index[t];
                let lv = w.low[v];
                w.low.insert(v, lv.min(it));
            }
        }
        if w.low[v] == w.index[v] {
            let mut c = Vec::new();
            while let Some(t) = w.stack.pop() {
                w.on_stack.remove(t);
                c.push(t);
                if t == v {
                    break;
                }
            }
            c.sort_unstable();
            w.out.push(c);
        }
    }
    let mut w = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !w.index.contains_key(v) {
            visit(&mut w, v);
        }
    }
    w.out.sort();
    w.out
}

/// The first import of each module pair that `keep` accepts.
fn first_per_edge(imports: &[Import], keep: impl Fn(&Import) -> bool) -> Vec<&Import> {
    let mut seen = BTreeSet::new();
    imports
        .iter()
        .filter(|i| keep(i) && seen.insert((i.from.clone(), i.to.clone())))
        .collect()
}

fn walk(dir: &Path, src: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        let name = name.unwrap_or_default();
        if path.is_dir() {
            if !(dir == src && name == "bin") {
                walk(&path, src, out)?;
            }
        } else if name.ends_with(".rs")
            && !name.contains("tests")
            && !(dir == src && name == "main.rs")
        {
            out.push(path);
        }
    }
    Ok(())
}

/// `lib.rs` → [], `a.rs`, `a/mod.rs` → [a], `a/b.rs` → [a, b].
fn module_path(rel: &Path) -> Option<Vec<String>> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    if parts.is_empty() && stem == "lib" {
        return Some(Vec::new());
    }
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    Some(parts)
}

/// Where the files of a module's `mod x;` children lie.
fn module_dir(src: &Path, file: &Path, module: &[String]) -> PathBuf {
    let is_dir_root = module.is_empty() || file.file_name().is_some_and(|n| n == "mod.rs");
    if is_dir_root {
        file.parent().unwrap_or(src).to_path_buf()
    } else {
        file.with_extension("")
    }
}

fn top_of(module: &[String]) -> String {
    module.first().cloned().unwrap_or_else(|| "lib".to_string())
}

fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && matches!(&a.meta, syn::Meta::List(l) if {
                let t = l.tokens.to_string();
                t == "test" || t.starts_with("all(test") || t.starts_with("any(test")
            })
    })
}

struct Reader<'a> {
    file: String,
    /// The file's module path from the crate root.
    module: Vec<String>,
    /// Inline `mod x { … }` blocks around the current item.
    inline: Vec<String>,
    known: &'a BTreeSet<String>,
    /// The module path of every file (`watch::history`).
    paths: &'a BTreeSet<String>,
    imports: Vec<Import>,
    inner: Vec<Import>,
    functions: Vec<Function>,
    self_ty: Vec<String>,
    /// The file's text, for the comments syn drops.
    lines: Vec<&'a str>,
}

impl Reader<'_> {
    /// Records `segments` (as written) if they reach another top-level
    /// module.
    fn path(&mut self, segments: &[String], line: usize) {
        let Some(first) = segments.first() else {
            return;
        };
        let here: Vec<String> = self.module.iter().chain(&self.inline).cloned().collect();
        let resolved: Vec<String> = match first.as_str() {
            "crate" => segments[1..].to_vec(),
            "self" => here.iter().chain(&segments[1..]).cloned().collect(),
            "super" => {
                let ups = segments.iter().take_while(|s| *s == "super").count();
                let Some(keep) = here.len().checked_sub(ups) else {
                    return;
                };
                here[..keep]
                    .iter()
                    .chain(&segments[ups..])
                    .cloned()
                    .collect()
            }
            // In the crate root a module is named bare (`admin::load()`).
            name if here.is_empty() && segments.len() > 1 && self.known.contains(name) => {
                segments.to_vec()
            }
            // So is a child module in its parent (`history::HistoryConfig`
            // in `config/mod.rs`), at any depth.
            name if !here.is_empty()
                && segments.len() > 1
                && self.paths.contains(&format!("{}::{name}", here.join("::"))) =>
            {
                here.iter().chain(segments).cloned().collect()
            }
            _ => return,
        };
        let to = match resolved.first() {
            Some(m) if self.known.contains(m) && m != "lib" => m.clone(),
            // `crate::Item`, `crate::{…}` resolved to the root.
            _ => "lib".to_string(),
        };
        let from = top_of(&self.module);
        if to != from {
            self.imports.push(Import {
                file: self.file.clone(),
                line,
                from,
                to,
                path: segments.join("::"),
            });
            return;
        }
        // The file the path lands in (its longest prefix that is one), and
        // the members of the deepest folder holding both files.
        let to_file: &[String] = (1..=resolved.len())
            .rev()
            .map(|n| &resolved[..n])
            .find(|p| self.paths.contains(&p.join("::")))
            .unwrap_or(&[]);
        let from_file = &self.module;
        let k = from_file
            .iter()
            .zip(to_file)
            .take_while(|(a, b)| a == b)
            .count();
        if k == from_file.len() && k == to_file.len() {
            return;
        }
        let member = |m: &[String]| m[..m.len().min(k + 1)].join("::");
        self.inner.push(Import {
            file: self.file.clone(),
            line,
            from: member(from_file),
            to: member(to_file),
            path: segments.join("::"),
        });
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let line = n.ident.span().start().line;
                if n.ident == "self" {
                    let p = prefix.clone();
                    self.path(&p, line);
                } else {
                    prefix.push(n.ident.to_string());
                    let p = prefix.clone();
                    self.path(&p, line);
                    prefix.pop();
                }
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                let p = prefix.clone();
                self.path(&p, r.ident.span().start().line);
                prefix.pop();
            }
            syn::UseTree::Glob(g) => {
                let p = prefix.clone();
                self.path(&p, g.star_token.span.start().line);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    /// `crate::a::b`, `super::x` sequences in raw tokens (macro bodies,
    /// attribute arguments) and in their string literals.
    fn tokens(&mut self, tokens: proc_macro2::TokenStream) {
        use proc_macro2::TokenTree;
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(g) => self.tokens(g.stream()),
                TokenTree::Literal(l) => {
                    let text = l.to_string();
                    if let Ok(syn::Lit::Str(s)) = syn::parse_str::<syn::Lit>(&text) {
                        let value = s.value();
                        let value = value.trim();
                        if value.starts_with("crate::") || value.starts_with("super::") {
                            let segs: Vec<String> =
                                value.split("::").map(|s| s.trim().to_string()).collect();
                            self.path(&segs, l.span().start().line);
                        }
                    }
                }
                TokenTree::Ident(id) if id == "crate" || id == "super" || id == "self" => {
                    let line = id.span().start().line;
                    let mut segs = vec![id.to_string()];
                    let mut j = i + 1;
                    loop {
                        let colons = matches!((&trees.get(j), &trees.get(j + 1)),
                            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                                if a.as_char() == ':' && b.as_char() == ':');
                        match (colons, trees.get(j + 2)) {
                            (true, Some(TokenTree::Ident(next))) => {
                                segs.push(next.to_string());
                                j += 3;
                            }
                            _ => break,
                        }
                    }
                    if segs.len() > 1 {
                        self.path(&segs, line);
                    }
                    i = j;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }

    fn function(
        &mut self,
        attrs: &[syn::Attribute],
        name: &syn::Ident,
        fn_token: &syn::token::Fn,
        block: &syn::Block,
    ) {
        let start = fn_token.span.start().line;
        let end = block.brace_token.span.close().end().line;
        let name = match self.self_ty.last() {
            Some(t) => format!("{t}::{name}"),
            None => name.to_string(),
        };
        let exception = self.exception_above(attrs, start);
        self.functions.push(Function {
            file: self.file.clone(),
            line: start,
            name,
            lines: end.saturating_sub(start) + 1,
            exception,
        });
    }

    /// The `// Over N lines:` comment among the function's doc comment and
    /// attributes (from the first of them to its `fn` line), or in the
    /// comment lines right above them.
    fn exception_above(&self, attrs: &[syn::Attribute], fn_line: usize) -> Option<Exception> {
        use syn::spanned::Spanned;
        let first = attrs
            .iter()
            .map(|a| a.span().start().line)
            .min()
            .unwrap_or(fn_line)
            .min(fn_line);
        // Lines are 1-based; `self.lines[n - 1]` is line n.
        let mut top = first;
        while top > 1 && self.lines[top - 2].trim_start().starts_with("//") {
            top -= 1;
        }
        (top..fn_line).find_map(|n| Exception::parse(n, self.lines[n - 1]))
    }
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item;
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

impl<'ast> Visit<'ast> for Reader<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if is_test(item_attrs(item)) {
            return;
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if let Some((_, items)) = &m.content {
            self.inline.push(m.ident.to_string());
            for a in &m.attrs {
                self.visit_attribute(a);
            }
            for item in items {
                self.visit_item(item);
            }
            self.inline.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let mut prefix = Vec::new();
        if u.leading_colon.is_some() {
            return; // `::x`: an external crate
        }
        self.use_tree(&mut prefix, &u.tree);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() {
            let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
            let line = p
                .segments
                .first()
                .map_or(0, |s| s.ident.span().start().line);
            self.path(&segs, line);
        }
        syn::visit::visit_path(self, p);
    }

    /// `pub(crate)`, `pub(super)`: no import.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.tokens(m.tokens.clone());
    }

    fn visit_attribute(&mut self, a: &'ast syn::Attribute) {
        if let syn::Meta::List(l) = &a.meta {
            self.tokens(l.tokens.clone());
        } else if let syn::Meta::NameValue(nv) = &a.meta {
            self.visit_expr(&nv.value);
        }
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        let ty = match &*i.self_ty {
            syn::Type::Path(p) => p
                .path
                .segments
                .last()
                .map_or_else(|| "_".to_string(), |s| s.ident.to_string()),
            _ => "_".to_string(),
        };
        self.self_ty.push(ty);
        syn::visit::visit_item_impl(self, i);
        self.self_ty.pop();
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs = match item {
            syn::ImplItem::Fn(f) => &f.attrs,
            syn::ImplItem::Const(c) => &c.attrs,
            syn::ImplItem::Type(t) => &t.attrs,
            _ => return syn::visit::visit_impl_item(self, item),
        };
        if !is_test(attrs) {
            syn::visit::visit_impl_item(self, item);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        // A free function inside an impl's method is not the impl's.
        let outer = std::mem::take(&mut self.self_ty);
        self.function(&f.attrs, &f.sig.ident, &f.sig.fn_token, &f.block);
        syn::visit::visit_item_fn(self, f);
        self.self_ty = outer;
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.function(&f.attrs, &f.sig.ident, &f.sig.fn_token, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if is_test(&f.attrs) {
            return;
        }
        if let Some(block) = &f.default {
            self.function(&f.attrs, &f.sig.ident, &f.sig.fn_token, block);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate tree in a temp dir: `(path under src/, text)`.
    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join("src").join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    const TOP: Layer = Layer {
        name: "top",
        modules: &["lib", "top"],
    };
    const LOW: Layer = Layer {
        name: "low",
        modules: &["low", "base"],
    };

    #[test]
    fn an_import_that_points_up_is_named_with_its_file_and_line() {
        let d = tree(&[
            ("lib.rs", "pub mod top;\npub mod low;\npub mod base;\n"),
            ("top.rs", "use crate::low::Thing;\n"),
            (
                "low.rs",
                "//! low\n\nuse crate::{base, top::Up};\npub struct Thing;\n",
            ),
            ("base.rs", ""),
        ]);
        let err = check(&d.path().join("src"), &[TOP, LOW]).unwrap_err();
        assert!(
            err.contains("src/low.rs:3: `crate::top::Up` points up"),
            "{err}"
        );
        // `low` → `base` is within a layer and acyclic: fine.
        assert!(!err.contains("crate::base"), "{err}");
        // top → low → top is also a cycle.
        assert!(err.contains("import cycle between low, top"), "{err}");
    }

    #[test]
    fn a_cycle_inside_one_layer_names_its_members_and_imports() {
        let d = tree(&[
            ("lib.rs", "pub mod top;\npub mod low;\npub mod base;\n"),
            ("top.rs", ""),
            ("low.rs", "pub fn f() { crate::base::g(); }\n"),
            (
                "base/mod.rs",
                "pub mod inner;\npub fn g() {}\n",
            ),
            (
                "base/inner.rs",
                "#[derive(serde::Deserialize)]\npub struct S {\n    #[serde(deserialize_with = \"super::super::low::de\")]\n    x: u8,\n}\n",
            ),
        ]);
        let err = check(&d.path().join("src"), &[TOP, LOW]).unwrap_err();
        assert_eq!(
            err,
            "import cycle between base, low: src/base/inner.rs:3: `super::super::low::de`; \
             src/low.rs:1: `crate::base::g`",
        );
    }

    #[test]
    fn a_cycle_between_the_files_of_one_folder_is_reported() {
        let d = tree(&[
            ("lib.rs", "pub mod top;\npub mod low;\npub mod base;\n"),
            ("top.rs", ""),
            ("low/mod.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
            ("low/a.rs", "use super::b::B;\npub struct A;\n"),
            (
                "low/b.rs",
                "pub struct B;\npub fn f(_: crate::low::a::A) {}\n",
            ),
            ("low/c.rs", "use super::a::A;\n"),
            ("base.rs", ""),
        ]);
        let err = check(&d.path().join("src"), &[TOP, LOW]).unwrap_err();
        assert_eq!(
            err,
            "import cycle inside a folder between low::a, low::b: \
             src/low/a.rs:1: `super::b::B`; src/low/b.rs:2: `crate::low::a::A`"
        );
    }

    #[test]
    fn a_cycle_in_a_nested_folder_is_reported_in_that_folder() {
        let d = tree(&[
            ("lib.rs", "pub mod top;\npub mod low;\npub mod base;\n"),
            ("top.rs", ""),
            ("low/mod.rs", "pub mod x;\npub mod y;\n"),
            ("low/x/mod.rs", "pub mod a;\npub mod b;\n"),
            ("low/x/a.rs", "use super::b::B;\npub struct A;\n"),
            (
                "low/x/b.rs",
                "pub struct B;\npub fn f(_: crate::low::x::a::A) {}\n",
            ),
            // Into the subfolder from beside it: `low::y → low::x`, no cycle.
            ("low/y.rs", "use super::x::a::A;\n"),
            ("base.rs", ""),
        ]);
        let err = check(&d.path().join("src"), &[TOP, LOW]).unwrap_err();
        assert_eq!(
            err,
            "import cycle inside a folder between low::x::a, low::x::b: \
             src/low/x/a.rs:1: `super::b::B`; src/low/x/b.rs:2: `crate::low::x::a::A`"
        );
        let scan = scan(&d.path().join("src")).unwrap();
        let y = scan
            .inner
            .iter()
            .find(|i| i.file == "src/low/y.rs")
            .unwrap();
        assert_eq!((y.from.as_str(), y.to.as_str()), ("low::y", "low::x"));
        assert_eq!(folder_of(&y.from, &y.to), "low");
    }

    #[test]
    fn a_cycle_through_a_mod_rs_is_let_through_only_where_named() {
        let d = tree(&[
            ("lib.rs", "pub mod top;\npub mod low;\npub mod base;\n"),
            ("top.rs", ""),
            (
                "low/mod.rs",
                "pub mod a;\npub mod b;\npub mod c;\npub struct S;\nfn f() { a::g(); c::h(S); }\n",
            ),
            ("low/a.rs", "use super::S;\npub fn g() {}\n"),
            // `b ↔ c`, and through `c` in the cycle through `mod.rs` too.
            ("low/b.rs", "use super::c::C;\npub struct B;\n"),
            (
                "low/c.rs",
                "use super::b::B;\npub struct C;\npub fn h(_: super::S) {}\n",
            ),
            ("base.rs", ""),
        ]);
        let src = d.path().join("src");
        let err = check(&src, &[TOP, LOW]).unwrap_err();
        assert!(
            err.contains("import cycle inside a folder between low, low::a, low::b, low::c: "),
            "{err}"
        );
        // Let through in `low`: its other files are still strict.
        let err = check_allowing(&src, &[TOP, LOW], &["low"]).unwrap_err();
        assert_eq!(
            err,
            "import cycle inside a folder between low::b, low::c: \
             src/low/b.rs:1: `super::c::C`; src/low/c.rs:1: `super::b::B`"
        );
        // A folder named with no such cycle is a stale exemption.
        let err = check_allowing(&src, &[TOP, LOW], &["low", "base"]).unwrap_err();
        assert!(
            err.contains(
                "folder `base` is let through for a cycle through its `mod.rs`, and has none"
            ),
            "{err}"
        );
    }

    #[test]
    fn test_code_and_paths_inside_one_module_are_not_imports() {
        let d = tree(&[
            ("lib.rs", "pub mod top;\npub mod low;\npub mod base;\n"),
            ("top.rs", "use crate::low::X;\n"),
            (
                "low/mod.rs",
                "pub mod a;\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline { use crate::top::Y; }\n\
                 pub struct X;\nimpl X {\n    #[cfg(test)]\n    fn t() { crate::top::f(); }\n}\n",
            ),
            ("low/a.rs", "use super::X;\nuse self::b::Z;\nmod b { pub struct Z; }\n"),
            ("low/tests.rs", "use crate::top::Y;\n"),
            ("low/more_tests.rs", "use crate::top::Y;\n"),
            ("base.rs", ""),
        ]);
        let figures = check(&d.path().join("src"), &[TOP, LOW]).unwrap();
        assert_eq!(figures.files, 5, "{figures}");
        assert_eq!(figures.cycles.len(), 0);
        assert_eq!(figures.levels, 2, "{figures}");
    }

    #[test]
    fn macros_the_root_and_modules_in_no_layer() {
        let d = tree(&[
            (
                "lib.rs",
                "pub mod top;\npub mod low;\npub mod base;\npub mod stray;\npub struct Options;\n\
                 fn run() { low::go(); }\n",
            ),
            ("top.rs", ""),
            (
                "low.rs",
                "pub fn go() { println!(\"{}\", crate::base::N); }\n",
            ),
            (
                "base.rs",
                "pub const N: u8 = 1;\npub fn o(_: crate::Options) {}\n",
            ),
            ("stray.rs", ""),
        ]);
        let err = check(&d.path().join("src"), &[TOP, LOW]).unwrap_err();
        assert!(err.contains("module `stray` is in no layer"), "{err}");
        assert!(
            err.contains(
                "src/base.rs:2: `crate::Options` points up: `base` (layer 1 `low`) imports `lib`"
            ),
            "{err}"
        );
        let f = figures(&d.path().join("src")).unwrap();
        // lib → low → base, and base → lib closes a cycle.
        assert_eq!(f.levels, 3, "{f}");
        assert_eq!(f.back_edges, vec![("base".to_string(), "lib".to_string())]);
        assert_eq!(f.cycles, vec![vec!["base", "lib", "low"]]);
    }

    #[test]
    fn the_longest_functions_are_measured_without_test_code() {
        let d = tree(&[(
            "lib.rs",
            "fn short() {}\nstruct S;\nimpl S {\n    fn long(&self) {\n        let _ = 1;\n        let _ = 2;\n    }\n}\n\
             #[cfg(test)]\nmod tests {\n    fn longest() {\n\n\n\n\n\n\n\n\n    }\n}\n",
        )]);
        let f = figures(&d.path().join("src")).unwrap();
        assert_eq!(f.longest[0].name, "S::long");
        assert_eq!(f.longest[0].lines, 4);
        assert_eq!(f.longest[1].name, "short");
    }

    /// `fn name() {` and `lines - 2` body lines: a function of `lines` lines.
    fn of_lines(name: &str, lines: usize) -> String {
        format!(
            "fn {name}() {{\n{}}}\n",
            "    let _ = 0;\n".repeat(lines - 2)
        )
    }

    #[test]
    fn a_function_over_the_cap_needs_a_reason_written_above_it() {
        let text = [
            // Justified above its doc comment and attribute: honoured.
            "// Over 4 lines: one table, read top to bottom.\n/// Doc.\n#[inline]\n".to_string(),
            of_lines("justified", 6),
            // Between its doc comment and its `fn`: honoured.
            "/// Doc.\n// Over 4 lines: one match over every variant.\n".to_string(),
            of_lines("inside", 5),
            of_lines("unjustified", 5),
            of_lines("short", 4),
            "// Over 4 lines: stale.\n".to_string(),
            of_lines("stale", 4),
            "// Over 4 lines:\n".to_string(),
            of_lines("no_reason", 7),
            "// Over 9 lines: another cap.\n".to_string(),
            of_lines("other_cap", 7),
            "// Over 4 lines: left behind by a move.\n\nconst X: u8 = 1;\n".to_string(),
            "#[cfg(test)]\nmod tests {\n    // Over 4 lines: test code.\n    fn t() {}\n}\n"
                .to_string(),
        ]
        .concat();
        let d = tree(&[("lib.rs", &text)]);
        let scan = scan(&d.path().join("src")).unwrap();
        let err = function_cap(&scan, 4).unwrap_err();
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 6, "{err}");
        assert!(lines[0].starts_with("unjustified (src/lib.rs:"), "{err}");
        assert!(lines[0].contains("has 5 lines: split it"), "{err}");
        assert!(lines[1].starts_with("stale (src/lib.rs:"), "{err}");
        assert!(lines[1].contains("stale exception"), "{err}");
        assert!(lines[2].contains("no_reason") && lines[2].contains("gives no reason"));
        assert!(lines[3].contains("other_cap") && lines[3].contains("names a cap of 9"));
        assert!(lines[4].contains("above no production function"), "{err}");
        assert!(lines[5].contains("above no production function"), "{err}");
        // What is left once the faults are gone: the two justified.
        let ok: Scan = Scan {
            functions: scan
                .functions
                .iter()
                .filter(|g| ["justified", "inside", "short"].contains(&g.name.as_str()))
                .cloned()
                .collect(),
            ..Scan::default()
        };
        let honoured = function_cap(&ok, 4).unwrap();
        let names: Vec<&str> = honoured.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["justified", "inside"]);
        assert_eq!(
            honoured[0].exception.as_ref().unwrap().reason,
            "one table, read top to bottom."
        );
        assert_eq!(function_cap(&ok, 6).unwrap_err().lines().count(), 2);
    }
}
