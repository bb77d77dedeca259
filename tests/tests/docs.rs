//! The docs a newcomer reads (README.md and the book under docs/src), checked
//! without building the book (`make docs` does that, with mdBook):
//! - every relative link and `#anchor` resolves, anchors the way mdBook makes
//!   heading ids;
//! - every chapter is in docs/src/SUMMARY.md, and README.md stays short;
//! - every `docs/…` file a source file cites exists, and every section it
//!   names (`(docs/src/design.md, "Route")`) is a heading of that file;
//! - the policy reference lists exactly the fields the policy's parser
//!   accepts, section by section, as the parser itself reports them;
//! - the metrics chapter lists every metric of the filter's table and every
//!   `sluice_sidecar_*` family of the sidecar's metric table.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// README.md holds what sluice is, the two commands, what a client sees and
/// a map of the book; everything else is a chapter.
const README_MAX_LINES: usize = 200;

fn root() -> PathBuf {
    sluice_tests::repo_root()
}

fn book_src() -> PathBuf {
    root().join("docs/src")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Every `.md` file under `dir`, sorted.
fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The markdown a reader follows links in: the README, the book, and the
/// documents beside the code.
fn documents() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = [
        "README.md",
        "BENCHMARKS.md",
        "bench/ESTIMATOR.md",
        "gpu-sidecar/README.md",
        "mock-llm/README.md",
    ]
    .iter()
    .map(|p| root().join(p))
    .collect();
    docs.extend(markdown_under(&book_src()));
    docs
}

// ------------------------------------------------------------ markdown

/// The lines outside fenced code blocks (``` or ~~~), with their numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let marker = if t.starts_with("```") {
            Some("```")
        } else if t.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// `line` with its code spans removed (a link inside one is text).
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut parts = line.split('`');
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    for (i, part) in parts.enumerate() {
        if i % 2 == 1 {
            out.push_str(part);
        }
    }
    out
}

/// The targets of the inline links and images of one line: `[text](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(|c| c == '<' || c == '>').to_string());
        rest = &after[end..];
    }
    out
}

/// A heading's text as mdBook renders it to text: code spans keep their
/// content, emphasis marks go, a link keeps its text.
fn heading_text(raw: &str) -> String {
    let mut text = String::new();
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '`' | '*' => {}
            '[' => {
                let mut inner = String::new();
                for d in chars.by_ref() {
                    if d == ']' {
                        break;
                    }
                    inner.push(d);
                }
                text.push_str(&inner);
                if chars.peek() == Some(&'(') {
                    for d in chars.by_ref() {
                        if d == ')' {
                            break;
                        }
                    }
                }
            }
            _ => text.push(c),
        }
    }
    text
}

/// mdBook's heading id: `id_from_content` in mdbook-html 0.5.4
/// (`src/utils.rs`): trimmed, lower-cased, alphanumerics, `_` and `-` kept,
/// whitespace made `-`, everything else dropped.
fn slug(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|ch| {
            if ch.is_alphanumeric() || ch == '_' || ch == '-' {
                Some(ch)
            } else if ch.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

struct Heading {
    level: usize,
    /// As written, after the `#`s.
    raw: String,
    /// As rendered to text.
    text: String,
    id: String,
    line: usize,
}

/// The ATX headings of a document, with the ids mdBook gives them: an
/// explicit `{#id}`, else the slug, made unique in document order with
/// `-1`, `-2`, … (`unique_id`, same file).
fn headings(text: &str) -> Vec<Heading> {
    let mut used = HashSet::new();
    let mut out = Vec::new();
    for (line, l) in prose_lines(text) {
        let level = l.chars().take_while(|&c| c == '#').count();
        if level == 0 || level > 6 || !l[level..].starts_with(' ') {
            continue;
        }
        let mut raw = l[level..].trim().trim_end_matches('#').trim().to_string();
        let mut explicit = None;
        if let Some(open) = raw.rfind("{#") {
            if raw.ends_with('}') {
                explicit = Some(raw[open + 2..raw.len() - 1].to_string());
                raw = raw[..open].trim().to_string();
            }
        }
        let text = heading_text(&raw);
        let base = explicit.unwrap_or_else(|| slug(&text));
        let mut id = base.clone();
        let mut n = 0;
        while !used.insert(id.clone()) {
            n += 1;
            id = format!("{base}-{n}");
        }
        out.push(Heading {
            level,
            raw,
            text,
            id,
            line,
        });
    }
    out
}

/// The table rows (cells trimmed, header and separator rows skipped) of
/// each heading's section, up to the next heading of any level.
fn tables_by_heading(text: &str) -> Vec<(Heading, Vec<Vec<String>>)> {
    let hs = headings(text);
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, h) in hs.iter().enumerate() {
        let end = hs.get(i + 1).map(|n| n.line - 1).unwrap_or(lines.len());
        let mut rows = Vec::new();
        let mut in_table = false;
        for l in &lines[h.line..end] {
            let t = l.trim();
            if !t.starts_with('|') {
                in_table = false;
                continue;
            }
            let cells: Vec<String> = t
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect();
            if !in_table {
                in_table = true; // the header row
                continue;
            }
            if cells.iter().all(|c| c.chars().all(|ch| "-: ".contains(ch))) {
                continue;
            }
            rows.push(cells);
        }
        out.push((
            Heading {
                level: h.level,
                raw: h.raw.clone(),
                text: h.text.clone(),
                id: h.id.clone(),
                line: h.line,
            },
            rows,
        ));
    }
    out
}

/// The code spans of a cell: `` `a`, `b` `` → [a, b].
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_string())
        .collect()
}

// ------------------------------------------------------------ links

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        for (line, l) in prose_lines(&text) {
            for target in link_targets(l) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let file = if path.is_empty() {
                    doc.clone()
                } else {
                    doc.parent().expect("a parent").join(path)
                };
                let at = format!("{}:{line}: `{target}`", rel(&doc));
                if !file.exists() {
                    broken.push(format!("{at}: no file {}", file.display()));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                if file.extension().is_none_or(|e| e != "md") {
                    broken.push(format!("{at}: an anchor into a file that is not markdown"));
                    continue;
                }
                let ids: Vec<String> = headings(&read(&file)).into_iter().map(|h| h.id).collect();
                if !ids.iter().any(|id| id == anchor) {
                    broken.push(format!(
                        "{at}: no heading with id `{anchor}` in {}",
                        rel(&file)
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Where `make docs` has built the book (`make test` builds it first), the
/// ids mdBook gave each chapter's headings are the ones [`headings`]
/// computes: the anchors checked above are the ones a reader's browser
/// finds. A page older than its chapter (edited since) is not compared.
#[test]
fn heading_ids_are_the_ones_mdbook_made() {
    let mut wrong = Vec::new();
    for md in markdown_under(&book_src()) {
        let name = md.strip_prefix(book_src()).expect("under docs/src");
        let html = root().join("target/book").join(name).with_extension("html");
        let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
        match (modified(&html), modified(&md)) {
            (Some(built), Some(written)) if built >= written => {}
            _ => continue,
        }
        let page = read(&html);
        let made: Vec<String> = page
            .split("<h")
            .skip(1)
            .filter(|t| t.starts_with(|c: char| ('1'..='6').contains(&c)))
            .filter_map(|t| t[1..].strip_prefix(" id=\""))
            .filter_map(|t| t.split('"').next())
            .map(str::to_string)
            .collect();
        let ours: Vec<String> = headings(&read(&md)).into_iter().map(|h| h.id).collect();
        if made != ours {
            wrong.push(format!("{}: mdBook {made:?}, ours {ours:?}", rel(&md)));
        }
    }
    assert!(
        wrong.is_empty(),
        "heading ids differ:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn every_chapter_is_in_the_summary() {
    let summary_path = book_src().join("SUMMARY.md");
    let summary = read(&summary_path);
    let listed: BTreeSet<PathBuf> = prose_lines(&summary)
        .into_iter()
        .flat_map(|(_, l)| link_targets(l))
        .filter(|t| !t.is_empty())
        .map(|t| book_src().join(t.split('#').next().unwrap_or("")))
        .collect();
    let missing: Vec<String> = markdown_under(&book_src())
        .into_iter()
        .filter(|p| *p != summary_path && !listed.contains(p))
        .map(|p| rel(&p))
        .collect();
    assert!(
        missing.is_empty(),
        "chapters missing from SUMMARY.md: {missing:?}"
    );
}

#[test]
fn the_readme_stays_short() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into a chapter of docs/src"
    );
}

/// The folders at the top of the repository a path in the docs starts with.
const TOP_FOLDERS: &[&str] = &[
    "bench/",
    "core/",
    "deploy/",
    "docs/",
    "envoy/",
    "filter/",
    "gpu-sidecar/",
    "mock-llm/",
    "scripts/",
    "shutdown/",
    "tests/",
    "wire/",
];

/// A file named in the docs' prose (`` `filter/src/usage/demand.rs` ``,
/// `` `tests/tests/cache.rs::nothing_crosses_scopes` ``) exists: when code
/// moves, the chapters that send a reader to it move along.
#[test]
fn every_repository_path_the_docs_name_exists() {
    let mut missing = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        for (line, l) in prose_lines(&text) {
            for span in code_spans(l) {
                let path = span
                    .split("::")
                    .next()
                    .unwrap_or("")
                    .trim_end_matches([',', '.', ':']);
                let named = TOP_FOLDERS.iter().any(|t| path.starts_with(t))
                    && !path.contains([' ', '{', '*', '<', '…', '|']);
                if named && !root().join(path).exists() {
                    missing.push(format!("{}:{line}: `{path}`", rel(&doc)));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name files that do not exist:\n{}",
        missing.join("\n")
    );
}

/// The files of the repository a citation may sit in (no build output).
fn cited_sources() -> Vec<PathBuf> {
    let skip = ["target", ".git", ".venv", "node_modules"];
    let mut out = Vec::new();
    let mut stack = vec![root()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !skip.contains(&name) && !name.starts_with(".target") {
                    stack.push(path);
                }
                continue;
            }
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if ["rs", "md", "yaml", "yml", "py", "sh", "toml", "json"].contains(&ext)
                || name == "Makefile"
            {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// `(docs/src/design.md, "Route", "Guarantees")` → ["Route", "Guarantees"]:
/// the quoted names right after the path, also when a comment wraps one
/// over two lines.
fn cited_sections(after: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = after;
    loop {
        let t = rest.trim_start();
        let Some(t) = t.strip_prefix(',') else { break };
        let t = t.trim_start();
        let Some(t) = t.strip_prefix('"') else { break };
        let Some(end) = t.find('"') else { break };
        let name: Vec<&str> = t[..end]
            .lines()
            .map(|l| {
                l.trim()
                    .trim_start_matches("//!")
                    .trim_start_matches("///")
                    .trim_start_matches("//")
                    .trim_start_matches('#')
                    .trim()
            })
            .collect();
        names.push(name.join(" "));
        rest = &t[end + 1..];
    }
    names
}

#[test]
fn every_cited_doc_and_section_exists() {
    let mut broken = Vec::new();
    for file in cited_sources() {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        let mut rest = text.as_str();
        while let Some(at) = rest.find("docs/") {
            let cited: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "/_-.".contains(*c))
                .collect();
            let cited = cited.trim_end_matches('.');
            let before = &rest[..at];
            let tail = &rest[at + cited.len()..];
            rest = &rest[at + 5..];
            let is_doc = cited.ends_with(".md") || cited.ends_with(".png");
            // From the root, or `../` and on from a crate; not a `docs/`
            // folder inside someone's URL or another folder.
            let starts_a_path = before.ends_with("../")
                || !before
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || "/._-".contains(c));
            if !is_doc || !starts_a_path {
                continue;
            }
            if !root().join(cited).exists() {
                broken.push(format!(
                    "{}: cites {cited}, which does not exist",
                    rel(&file)
                ));
                continue;
            }
            if cited.ends_with(".md") {
                let headings: BTreeSet<String> = headings(&read(&root().join(cited)))
                    .into_iter()
                    .map(|h| h.text)
                    .collect();
                for name in cited_sections(tail) {
                    if !headings.contains(&name) {
                        broken.push(format!(
                            "{}: cites {cited}, \"{name}\": no such heading",
                            rel(&file)
                        ));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "stale citations:\n{}", broken.join("\n"));
}

// ------------------------------------------------------------ the policy reference

const REFERENCE: &str = "policy-reference.md";
const BOGUS: &str = "zz_bogus";
const KEY: &str = "zz_key";

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Seg {
    /// A field of a section.
    Field(String),
    /// Any key of a map (`tiers.<tier>`).
    Key,
    /// Any item of a list (`routes[]`).
    Item,
}

fn show(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Field(f) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(f);
            }
            Seg::Key => out.push_str(".<…>"),
            Seg::Item => out.push_str("[]"),
        }
    }
    if out.is_empty() {
        ".".into()
    } else {
        out
    }
}

/// `tiers.<tier>.requests`, `routes[]`, `.` (the top level) → segments.
fn parse_path(text: &str) -> Vec<Seg> {
    if text == "." {
        return Vec::new();
    }
    let mut out = Vec::new();
    for part in text.split('.') {
        if part.starts_with('<') && part.ends_with('>') {
            out.push(Seg::Key);
            continue;
        }
        let (name, items) = match part.find("[]") {
            Some(i) => (&part[..i], part[i..].matches("[]").count()),
            None => (part, 0),
        };
        out.push(Seg::Field(name.to_string()));
        out.extend(std::iter::repeat_n(Seg::Item, items));
    }
    out
}

/// The smallest policy the parser accepts, with `value` placed at `path`.
fn policy_with(path: &[Seg], value: Value) -> Value {
    fn place(into: &mut Value, path: &[Seg], value: Value) {
        let Some((first, rest)) = path.split_first() else {
            *into = value;
            return;
        };
        let child = match first {
            Seg::Field(f) => obj(into).entry(f.clone()).or_insert(Value::Null),
            Seg::Key => obj(into).entry(KEY.to_string()).or_insert(Value::Null),
            Seg::Item => {
                *into = Value::Array(vec![Value::Null]);
                &mut into.as_array_mut().expect("just made")[0]
            }
        };
        place(child, rest, value);
    }
    fn obj(v: &mut Value) -> &mut Map<String, Value> {
        if !v.is_object() {
            *v = Value::Object(Map::new());
        }
        v.as_object_mut().expect("just made")
    }
    let mut policy = json!({"default_tier": "free", "tiers": {"free": {}}});
    place(&mut policy, path, value);
    policy
}

/// The fields the real parser accepts at `path`, read from its refusal of
/// an unknown one (serde's `unknown field `x`, expected one of `a`, `b``);
/// `None` when what sits at `path` is not a section with fields.
fn fields_at(path: &[Seg]) -> Option<BTreeSet<String>> {
    let policy = policy_with(path, json!({ BOGUS: 1 }));
    let message = match sluice_core::policy::Policy::from_value(policy) {
        Ok(_) => return None,
        Err(e) => e.message,
    };
    let rest = message.split_once(&format!("unknown field `{BOGUS}`"))?.1;
    if rest.contains("there are no fields") {
        return Some(BTreeSet::new());
    }
    Some(code_spans(rest).into_iter().collect())
}

/// Every section of the policy, found from the top by asking the parser:
/// a field is a section when it refuses an unknown field, a map of
/// sections or a list of sections when its key or its item does.
fn sections_of_the_policy() -> BTreeMap<Vec<Seg>, BTreeSet<String>> {
    let mut found = BTreeMap::new();
    let mut todo: Vec<(Vec<Seg>, Option<BTreeSet<String>>)> = vec![(Vec::new(), None)];
    while let Some((path, parent)) = todo.pop() {
        let Some(fields) = fields_at(&path) else {
            continue;
        };
        // A section that holds its own kind (a tier's `anonymous_total` is
        // a tier) is listed once, not followed down forever.
        let recursive = parent.as_ref() == Some(&fields);
        for f in fields.iter().filter(|_| !recursive) {
            let mut child = path.clone();
            child.push(Seg::Field(f.clone()));
            for candidate in [
                child.clone(),
                [child.clone(), vec![Seg::Key]].concat(),
                [child.clone(), vec![Seg::Item]].concat(),
            ] {
                if fields_at(&candidate).is_some() {
                    todo.push((candidate, Some(fields.clone())));
                    break;
                }
            }
        }
        found.insert(path, fields);
    }
    found
}

struct DocSection {
    heading: String,
    id: String,
    paths: Vec<Vec<Seg>>,
    /// Field → the row's other cells.
    rows: BTreeMap<String, String>,
}

/// The reference's sections: a heading made of paths in code spans
/// (`` ### `identity.jwt` ``, `` ### `tiers.<tier>`, `teams.<team>` ``,
/// `` ### `.` (the top level) ``) or any other heading with a table (a
/// shape other rows link to, such as a limit), each with its table of
/// fields, one or more per row in code spans in the first cell.
fn documented_sections() -> Vec<DocSection> {
    let text = read(&book_src().join(REFERENCE));
    let mut out = Vec::new();
    for (h, rows) in tables_by_heading(&text) {
        let raw = h.raw.trim();
        let mut paths = Vec::new();
        if raw.starts_with('`') {
            let head = raw.split(" (").next().unwrap_or(raw);
            paths = code_spans(head).iter().map(|p| parse_path(p)).collect();
        }
        if paths.is_empty() && rows.is_empty() {
            continue;
        }
        let mut fields = BTreeMap::new();
        for row in rows {
            let rest = row[1..].join(" | ");
            for name in code_spans(&row[0]) {
                fields.insert(name, rest.clone());
            }
        }
        out.push(DocSection {
            heading: h.text,
            id: h.id,
            paths,
            rows: fields,
        });
    }
    out
}

/// Where the reference documents the section at `path`: a heading naming
/// it, else the section its parent's row for it links to (`[a limit](#a-limit)`).
fn doc_for<'a>(docs: &'a [DocSection], path: &[Seg]) -> Option<&'a DocSection> {
    if let Some(d) = docs.iter().find(|d| d.paths.iter().any(|p| p == path)) {
        return Some(d);
    }
    let field = path.iter().rposition(|s| matches!(s, Seg::Field(_)))?;
    let Seg::Field(name) = &path[field] else {
        return None;
    };
    let parent = doc_for(docs, &path[..field])?;
    let row = parent.rows.get(name)?;
    let anchor = row.split("](#").nth(1)?.split(')').next()?;
    docs.iter().find(|d| d.id == anchor)
}

#[test]
fn the_policy_reference_lists_every_field_the_parser_accepts() {
    let docs = documented_sections();
    let sections = sections_of_the_policy();
    assert!(
        sections.len() > 20
            && sections
                .get(&Vec::new())
                .is_some_and(|f| f.contains("tiers")),
        "the parser was not probed as expected: {sections:?}"
    );
    let mut wrong = Vec::new();
    for (path, fields) in &sections {
        let Some(doc) = doc_for(&docs, path) else {
            wrong.push(format!(
                "`{}` (fields {fields:?}) has no table in {REFERENCE}: a heading `{}` or a link from its parent's row",
                show(path),
                show(path)
            ));
            continue;
        };
        let documented: BTreeSet<String> = doc.rows.keys().cloned().collect();
        for f in fields.difference(&documented) {
            wrong.push(format!(
                "`{}.{f}` is accepted but not in \"{}\"",
                show(path),
                doc.heading
            ));
        }
        for f in documented.difference(fields) {
            wrong.push(format!(
                "\"{}\" lists `{f}`, which `{}` does not accept",
                doc.heading,
                show(path)
            ));
        }
    }
    for doc in &docs {
        for p in &doc.paths {
            if !sections.contains_key(p) {
                wrong.push(format!(
                    "\"{}\": `{}` is not a section of the policy",
                    doc.heading,
                    show(p)
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{REFERENCE} and the policy types differ:\n{}",
        wrong.join("\n")
    );
}

// ------------------------------------------------------------ metrics

const METRICS: &str = "metrics.md";

/// The rows of the metrics chapter's table under the heading `title`:
/// name → (type, labels).
fn metric_rows(title: &str) -> BTreeMap<String, (String, Vec<String>)> {
    let text = read(&book_src().join(METRICS));
    let (_, rows) = tables_by_heading(&text)
        .into_iter()
        .find(|(h, _)| h.text == title)
        .unwrap_or_else(|| panic!("{METRICS} has no heading \"{title}\""));
    let mut out = BTreeMap::new();
    for row in rows {
        let name = code_spans(&row[0]).into_iter().next().unwrap_or_default();
        let kind = row.get(1).cloned().unwrap_or_default();
        let labels = row.get(2).map(|c| code_spans(c)).unwrap_or_default();
        out.insert(name, (kind, labels));
    }
    out
}

#[test]
fn the_metrics_chapter_lists_every_metric_of_the_filters_table() {
    use sluice_core::host::metrics::ALL;
    let rows = metric_rows("The filter's metrics");
    let mut wrong = Vec::new();
    for m in ALL {
        let kind = format!("{:?}", m.kind).to_lowercase();
        let labels: Vec<String> = m.labels.iter().map(|l| l.to_string()).collect();
        match rows.get(m.name) {
            None => wrong.push(format!("`{}` is not in the table", m.name)),
            Some((k, l)) if *k != kind || *l != labels => wrong.push(format!(
                "`{}`: the chapter says {k} {l:?}, the table {kind} {labels:?}",
                m.name
            )),
            Some(_) => {}
        }
    }
    let defined: BTreeSet<&str> = ALL.iter().map(|m| m.name).collect();
    for name in rows.keys() {
        if !defined.contains(name.as_str()) {
            wrong.push(format!(
                "`{name}` is in the chapter but not in host::metrics::ALL"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{METRICS}, \"The filter's metrics\":\n{}",
        wrong.join("\n")
    );
}

/// Every family of the sidecar's metric table (`name: "sluice_sidecar_…"`
/// of `gpu-sidecar/src/serve/metric_table.rs`, the one place a name is
/// spelled).
fn sidecar_metric_names() -> BTreeSet<String> {
    let text = read(&root().join("gpu-sidecar/src/serve/metric_table.rs"));
    text.match_indices("\"sluice_sidecar_")
        .map(|(i, _)| {
            text[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| name.len() > "sluice_sidecar_".len())
        .collect()
}

#[test]
fn the_metrics_chapter_lists_every_metric_the_sidecar_names() {
    let names = sidecar_metric_names();
    assert!(
        names.len() > 20,
        "the sidecar's metric table was not read: {names:?}"
    );
    let rows = metric_rows("The sidecar's metrics");
    let listed: BTreeSet<String> = rows.keys().cloned().collect();
    let missing: Vec<_> = names.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&names).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{METRICS}, \"The sidecar's metrics\": missing {missing:?}; not in gpu-sidecar/src {extra:?}"
    );
}

// ------------------------------------------------------------ the checker itself

#[test]
fn slugs_are_mdbooks() {
    // mdbook-html 0.5.4's own examples (`it_normalizes_ids`).
    assert_eq!(
        slug(&heading_text("`--passes`: add more rustdoc passes")),
        "--passes-add-more-rustdoc-passes"
    );
    assert_eq!(slug("Über"), "über");
    assert_eq!(
        slug(&heading_text("The sidecar's door")),
        "the-sidecars-door"
    );
    let hs = headings("# A\n```\n# not a heading\n```\n## A\n### B {#custom}\n");
    let ids: Vec<&str> = hs.iter().map(|h| h.id.as_str()).collect();
    assert_eq!(ids, ["a", "a-1", "custom"]);
}

#[test]
fn citations_spanning_a_wrapped_comment_are_read_whole() {
    assert_eq!(
        cited_sections(", \"Observability and\n//! audit\"): more"),
        ["Observability and audit"]
    );
    assert_eq!(
        cited_sections(", \"Route\", \"Guarantees\"; issue 9)"),
        ["Route", "Guarantees"]
    );
}
