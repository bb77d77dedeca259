//! The docs a newcomer reads (README.md and the book under docs/src), and
//! the code's own pointers into the repository:
//! - every relative link and `#anchor` resolves, anchors the way mdBook makes
//!   heading ids: checked against the book mdBook builds where one is at
//!   hand (`SLUICE_REQUIRE_BOOK=1` makes a missing one a failure), and
//!   every heading is written in markup whose id is computed here;
//! - every chapter is in docs/src/SUMMARY.md, and README.md stays short;
//! - every path the docs name in a code span exists, from the root
//!   (`native/src/lib.rs`) or inside its crate (a file of `admission/`);
//! - every path a code comment names exists, from the commenting file's
//!   folder, its crate or the root, and every intra-doc link to a module
//!   or a function names one;
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
    /// The id was written (`{#id}`), not made from the text.
    explicit: bool,
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
        let written = explicit.is_some();
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
            explicit: written,
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
                explicit: h.explicit,
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

/// The mdBook that builds the book: the pinned one `make docs` installs
/// (.venv/bin/mdbook), else one on `PATH`; `None` when neither
/// answers `--version`.
fn mdbook() -> Option<PathBuf> {
    let pinned = root().join(".venv/bin/mdbook");
    let candidates = [pinned, PathBuf::from("mdbook")];
    candidates.into_iter().find(|bin| {
        std::process::Command::new(bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Where the book to compare against lies: built afresh by [`mdbook`]
/// into this test's own folder (so a stale or half-written target/book
/// never counts), else `make docs`'s target/book; `Err` says why there is
/// none. The bool: built here (removed afterwards).
fn built_book() -> Result<(PathBuf, bool), String> {
    if let Some(bin) = mdbook() {
        let out =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("book-{}", std::process::id()));
        let run = std::process::Command::new(&bin)
            .arg("build")
            .arg(root().join("docs"))
            .arg("--dest-dir")
            .arg(&out)
            .output()
            .map_err(|e| format!("{} build: {e}", bin.display()))?;
        if !run.status.success() {
            return Err(format!(
                "{} build docs failed:\n{}",
                bin.display(),
                String::from_utf8_lossy(&run.stderr)
            ));
        }
        return Ok((out, true));
    }
    let book = root().join("target/book");
    if book.join("index.html").exists() {
        return Ok((book, false));
    }
    Err("no mdbook (`make docs` installs it into .venv/bin) and no target/book".into())
}

/// The ids of a page's headings as mdBook wrote them (`<h2 id="…">`; the
/// page's own chrome has no heading with an id).
fn ids_in_page(page: &str) -> Vec<String> {
    page.split("<h")
        .skip(1)
        .filter(|t| t.starts_with(|c: char| ('1'..='6').contains(&c)))
        .filter_map(|t| t[1..].strip_prefix(" id=\""))
        .filter_map(|t| t.split('"').next())
        .map(str::to_string)
        .collect()
}

/// The ids mdBook gave each chapter's headings are the ones [`headings`]
/// computes: the anchors checked above are the ones a reader's browser
/// finds. The book is built here when an mdBook is at hand; else
/// `make docs`'s target/book is read, where a page older than its chapter
/// (edited since) is not compared. With `SLUICE_REQUIRE_BOOK` set (as
/// `make test`, which runs `make docs` first, sets it) a missing book, or a
/// chapter not compared, fails the test instead of skipping it.
#[test]
fn heading_ids_are_the_ones_mdbook_made() {
    let required = std::env::var_os("SLUICE_REQUIRE_BOOK").is_some_and(|v| !v.is_empty());
    let (book, fresh) = match built_book() {
        Ok(b) => b,
        Err(why) if required => panic!("SLUICE_REQUIRE_BOOK is set but {why}"),
        Err(why) => {
            eprintln!("SKIPPED: {why}; set SLUICE_REQUIRE_BOOK=1 to make this a failure");
            return;
        }
    };
    let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut wrong = Vec::new();
    let mut not_compared = Vec::new();
    let mut compared = 0;
    for md in markdown_under(&book_src()) {
        let name = md.strip_prefix(book_src()).expect("under docs/src");
        if name == Path::new("SUMMARY.md") {
            continue;
        }
        let html = book.join(name).with_extension("html");
        let current = match (modified(&html), modified(&md)) {
            (Some(_), _) if fresh => true,
            (Some(built), Some(written)) => built >= written,
            _ => false,
        };
        if !current {
            not_compared.push(rel(&md));
            continue;
        }
        compared += 1;
        let made = ids_in_page(&read(&html));
        let ours: Vec<String> = headings(&read(&md)).into_iter().map(|h| h.id).collect();
        if made != ours {
            wrong.push(format!("{}: mdBook {made:?}, ours {ours:?}", rel(&md)));
        }
    }
    if fresh {
        let _ = fs::remove_dir_all(&book);
    }
    assert!(
        wrong.is_empty(),
        "heading ids differ:\n{}",
        wrong.join("\n")
    );
    if !not_compared.is_empty() {
        let why = format!(
            "{} has no current page for {not_compared:?} (`make docs` rebuilds it)",
            rel(&book)
        );
        assert!(!required, "SLUICE_REQUIRE_BOOK is set but {why}");
        eprintln!("SKIPPED in part: {why}");
    }
    assert!(
        compared > 0 || !required,
        "SLUICE_REQUIRE_BOOK is set but no chapter was compared"
    );
}

/// Why mdBook's id for a heading written `raw` (after the `#`s) might not
/// be the one [`headings`] computes: markup [`heading_text`] does not
/// render as mdBook does (HTML, entities, escapes, `_` emphasis, images,
/// footnotes). `None`: the heading is plain text, code spans, `*`
/// emphasis and links, which it renders exactly.
fn unmodelled_markup(raw: &str) -> Option<&'static str> {
    let text = without_code_spans(raw);
    let chars: Vec<char> = text.chars().collect();
    let word = |c: Option<&char>| c.is_some_and(|c| c.is_alphanumeric());
    for (i, &c) in chars.iter().enumerate() {
        let before = i.checked_sub(1).and_then(|j| chars.get(j));
        let after = chars.get(i + 1);
        let rest: String = chars[i + 1..].iter().collect();
        let entity = rest.split_once(';').is_some_and(|(name, _)| {
            !name.is_empty()
                && name
                    .trim_start_matches('#')
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric())
        });
        match c {
            '<' if after.is_some_and(|c| c.is_ascii_alphabetic() || "/!?".contains(*c)) => {
                return Some("inline HTML or an autolink")
            }
            '\\' => return Some("a backslash escape"),
            '&' if entity => return Some("an entity"),
            '_' if !(word(before) && word(after)) => return Some("`_` emphasis"),
            '!' if after == Some(&'[') => return Some("an image"),
            '[' if after == Some(&'^') => return Some("a footnote reference"),
            _ => {}
        }
    }
    None
}

/// A setext heading (a line of text over `===` or `---`): mdBook gives it
/// an id, [`headings`] reads ATX headings only.
fn setext_headings(text: &str) -> Vec<usize> {
    let lines = prose_lines(text);
    lines
        .windows(2)
        .filter(|w| {
            let (above_n, above) = w[0];
            let (n, line) = w[1];
            let underline = line.trim();
            let is_underline = !underline.is_empty()
                && (underline.chars().all(|c| c == '=') || underline.chars().all(|c| c == '-'))
                && line.len() - line.trim_start().len() < 4;
            let a = above.trim();
            is_underline
                && above_n + 1 == n
                && !a.is_empty()
                && !a.starts_with(['#', '|', '-', '*', '>'])
                && !a.chars().all(|c| c == '-' || c == '=')
        })
        .map(|w| w[1].0)
        .collect()
}

/// Without the book: every heading of every chapter is written in the
/// markup whose ids [`headings`] computes exactly (mdBook's algorithm, its
/// own examples in `slugs_are_mdbooks`), so the anchors checked above
/// hold whether or not a book was built to compare against.
#[test]
fn every_heading_is_markup_whose_id_we_compute() {
    let mut wrong = Vec::new();
    for md in markdown_under(&book_src()) {
        let text = read(&md);
        for h in headings(&text) {
            if !h.explicit {
                if let Some(what) = unmodelled_markup(&h.raw) {
                    wrong.push(format!("{}:{}: `{}` has {what}", rel(&md), h.line, h.raw));
                }
            }
            if h.id.is_empty() {
                wrong.push(format!(
                    "{}:{}: `{}` has an empty id",
                    rel(&md),
                    h.line,
                    h.raw
                ));
            }
        }
        for line in setext_headings(&text) {
            wrong.push(format!(
                "{}:{line}: a setext heading (underlined): write it `#`-style",
                rel(&md)
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "headings whose mdBook id is not computed here (rewrite them, or give an explicit `{{#id}}`):\n{}",
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

/// The folders at the top of the repository a path in the docs starts with,
/// named so that a path into one that is gone is still caught; every
/// other folder at the top ([`top_folders`]) counts too.
const TOP_FOLDERS: &[&str] = &[
    "bench/",
    "core/",
    "deploy/",
    "docs/",
    "envoy/",
    "filter/",
    "gpu-sidecar/",
    "mock-llm/",
    "native/",
    "scripts/",
    "shutdown/",
    "tests/",
    "wire/",
];

/// Folders that hold no source: build output and tools' caches.
const NOT_SOURCE: &[&str] = &["target", ".git", ".venv", "node_modules"];

/// [`TOP_FOLDERS`] and every folder at the top of the repository (hidden
/// ones and build output aside), each with its `/`.
fn top_folders() -> BTreeSet<String> {
    let mut out: BTreeSet<String> = TOP_FOLDERS.iter().map(|t| t.to_string()).collect();
    for entry in fs::read_dir(root()).expect("the repository root") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() && !name.starts_with('.') && !NOT_SOURCE.contains(&name) {
            out.insert(format!("{name}/"));
        }
    }
    out
}

/// Every file of the repository (no build output), sorted.
fn repository_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !NOT_SOURCE.contains(&name) && !name.starts_with(".target") {
                    stack.push(path);
                }
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The files and folders of the repository, relative to its root with `/`
/// between names (a folder ends with `/`).
fn repository_paths() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in repository_files() {
        let r = rel(&file);
        let mut folder = r.as_str();
        while let Some((parent, _)) = folder.rsplit_once('/') {
            out.insert(format!("{parent}/"));
            folder = parent;
        }
        out.insert(r);
    }
    out
}

/// The code spans of a document's prose with the line each starts on; a
/// span wrapped over two lines of a paragraph is read whole (its line
/// break kept, so it is no path), one left open at a paragraph's or a
/// table row's end is none.
fn spans_by_line(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String)> = None;
    let mut previous = 0;
    for (n, l) in prose_lines(text) {
        let t = l.trim_start();
        if n != previous + 1 || t.is_empty() || t.starts_with(['|', '#']) {
            open = None;
        }
        previous = n;
        for (i, part) in l.split('`').enumerate() {
            if i > 0 {
                match open.take() {
                    Some(span) => out.push(span),
                    None => open = Some((n, String::new())),
                }
            }
            if let Some((_, span)) = open.as_mut() {
                if i == 0 {
                    span.push('\n');
                }
                span.push_str(part);
            }
        }
        if t.starts_with('|') {
            open = None;
        }
    }
    out
}

/// A path the docs name in a code span: from the root
/// (`core/src/flow/mod.rs`), or as a crate's reader knows it (the core's
/// `admission/` and a file in it, the sidecar's `watch/`); `None` for any
/// other span (a rate
/// `10/min`, a rule id, an endpoint `/v1/state`, a build output under
/// `target/`). The bool: it starts at the repository's root.
fn path_in_span(span: &str, tops: &BTreeSet<String>) -> Option<(String, bool)> {
    let path = span
        .split("::")
        .next()
        .unwrap_or("")
        .trim_end_matches([',', '.', ':']);
    let simple = !path.is_empty()
        && path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
        && !path.starts_with(['/', '.'])
        && !path.contains("//");
    if !simple || path.starts_with("target/") {
        return None;
    }
    if tops.iter().any(|t| path.starts_with(t.as_str())) {
        return Some((path.to_string(), true));
    }
    let relative = path.ends_with(".rs") && path.len() > 3 || path.ends_with('/') && path.len() > 1;
    relative.then(|| (path.to_string(), false))
}

/// A file named in the docs' prose exists: one from the root
/// (`` `core/src/usage/demand.rs` ``,
/// `` `tests/tests/cache.rs::nothing_crosses_scopes` ``, `` `native/` ``)
/// where it says; one named inside its crate (the core's admission
/// answers written as `admission/` and the file's name, a bare file name,
/// `` `fleet/` ``) as the end of some path of the repository. When code
/// moves, the chapters that send a reader to it move along.
#[test]
fn every_repository_path_the_docs_name_exists() {
    let tops = top_folders();
    let paths = repository_paths();
    let mut missing = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        for (line, span) in spans_by_line(&text) {
            {
                let Some((path, from_root)) = path_in_span(&span, &tops) else {
                    continue;
                };
                let found = if from_root {
                    root().join(&path).exists()
                } else {
                    let tail = format!("/{path}");
                    paths.iter().any(|p| *p == path || p.ends_with(&tail))
                };
                if !found {
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
    repository_files()
        .into_iter()
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            ["rs", "md", "yaml", "yml", "py", "sh", "toml", "json"].contains(&ext)
                || name == "Makefile"
        })
        .collect()
}

// ------------------------------------------------------------ paths in code comments

/// Files whose comments name paths by example, of any crate or of none:
/// the layer checker's own description of how files map to modules.
const PATHS_BY_EXAMPLE: &[&str] = &["tests/src/layers.rs"];

/// Files of other projects a comment cites by their own path: (the file
/// citing, the path as cited). Each must still be cited, so the list
/// cannot outlive its citations.
const OTHER_PROJECTS_FILES: &[(&str, &str)] = &[
    // serde_json's reader.
    ("core/src/usage/tape.rs", "read.rs"),
    // proxy-wasm's Rust SDK.
    ("filter/src/map.rs", "src/hostcalls.rs"),
    // mdbook-html's, in `slug` here.
    ("tests/tests/docs.rs", "src/utils.rs"),
];

/// The crate a file belongs to: the nearest folder above it with a
/// Cargo.toml.
fn crate_of(file: &Path) -> Option<PathBuf> {
    file.ancestors()
        .skip(1)
        .take_while(|d| d.starts_with(root()))
        .find(|d| d.join("Cargo.toml").is_file())
        .map(Path::to_path_buf)
}

/// Where a path a comment of `file` names may start: the file's folder,
/// then each folder above it up to its crate's, the crate's `src/`, and
/// the repository's root. In this file's comments `layers.rs` is
/// `tests/tests/layers.rs` (beside it), `src/lib.rs` the crate's
/// `tests/src/lib.rs` and `core/src/lib.rs` the core's (from the root);
/// the core's benchmarks name `core/src/usage/splice.rs` as its crate's
/// `src/` sees it.
fn comment_path_bases(file: &Path) -> Vec<PathBuf> {
    let krate = crate_of(file);
    let mut bases = Vec::new();
    for dir in file.ancestors().skip(1) {
        bases.push(dir.to_path_buf());
        if krate.as_deref().is_none_or(|k| dir == k) || dir == root() {
            break;
        }
    }
    if let Some(k) = &krate {
        bases.push(k.join("src"));
    }
    bases.push(root());
    bases
}

/// The full-line comments of a Rust source (`//`, `///`, `//!`), with
/// their line numbers, the comment marks removed.
fn comment_lines(text: &str) -> Vec<(usize, &str)> {
    text.lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let rest = l.trim_start().strip_prefix("//")?;
            Some((i + 1, rest.trim_start_matches(['/', '!'])))
        })
        .collect()
}

/// The paths a comment names: runs of `[A-Za-z0-9_.-/]` that end in `.rs`
/// (`docs.rs`, `src/layers.rs`) or start with a folder at the
/// top of the repository (`filter/src/shim.rs`, `tests/tests/layers.rs`,
/// `native/src/`), the trailing punctuation of a sentence dropped. Not a
/// path: part of a URL or an endpoint (`/v1/fleet/take`), a bare `mod.rs`
/// (any folder's), and a path of another project that happens to start
/// with a top folder's name (Envoy's `envoy/admin/v3/clusters.proto`: its
/// second folder is not in the repository).
fn paths_in_comment(comment: &str, tops: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_-./".contains(c);
    let mut rest = comment;
    while let Some(at) = rest.find(is_path_char) {
        let run_len = rest[at..]
            .find(|c| !is_path_char(c))
            .unwrap_or(rest.len() - at);
        let run = &rest[at..at + run_len];
        let before = rest[..at].chars().next_back();
        rest = &rest[at + run_len..];
        let path = run.trim_end_matches(['.', '-']);
        if path.starts_with(['/', '.']) || before == Some(':') || path == "mod.rs" {
            continue;
        }
        let from_top = tops.iter().any(|t| path.starts_with(t.as_str()));
        let names_rs = path
            .rsplit('/')
            .next()
            .is_some_and(|f| f.len() > 3 && f.ends_with(".rs"));
        if from_top {
            let segments: Vec<&str> = path.trim_end_matches('/').split('/').collect();
            if segments.len() >= 3 && !root().join(segments[0]).join(segments[1]).exists() {
                continue;
            }
        }
        if from_top || names_rs {
            out.push(path.to_string());
        }
    }
    out
}

/// Every Rust file of the repository (no build output).
fn rust_sources() -> Vec<PathBuf> {
    repository_files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect()
}

/// The crate of the integration tests, whose comments speak of every
/// other crate's files as that crate's readers know them (the core's
/// `admission/` and a file in it): there a path may also be the end of any
/// path of the repository.
const TESTS_OF_EVERY_CRATE: &str = "tests";

/// A path a code comment names exists: when a file is renamed or moved,
/// every comment that sends a reader to it, by its path from the root
/// (`native/src/filter.rs`) or from the commenting file's folder or crate,
/// follows ([`comment_path_bases`] for where a path starts).
#[test]
fn every_path_a_code_comment_names_exists() {
    let tops = top_folders();
    let paths = repository_paths();
    let harness = root().join(TESTS_OF_EVERY_CRATE);
    let mut missing = Vec::new();
    let mut cited_elsewhere: BTreeSet<(&str, &str)> = BTreeSet::new();
    for file in rust_sources() {
        let name = rel(&file);
        if PATHS_BY_EXAMPLE.contains(&name.as_str()) {
            continue;
        }
        let text = read(&file);
        let bases = comment_path_bases(&file);
        let anywhere = crate_of(&file).is_some_and(|k| k == harness);
        for (line, comment) in comment_lines(&text) {
            for path in paths_in_comment(comment, &tops) {
                if let Some(&(f, p)) = OTHER_PROJECTS_FILES
                    .iter()
                    .find(|(f, p)| *f == name && *p == path)
                {
                    cited_elsewhere.insert((f, p));
                    continue;
                }
                let tail = format!("/{path}");
                let found = bases.iter().any(|b| b.join(&path).exists())
                    || anywhere && paths.iter().any(|p| p.ends_with(&tail));
                if !found {
                    missing.push(format!("{name}:{line}: `{path}`"));
                }
            }
        }
    }
    let stale: Vec<_> = OTHER_PROJECTS_FILES
        .iter()
        .filter(|c| !cited_elsewhere.contains(*c))
        .collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "code comments name files that do not exist:\n{}\n\
         other projects' files no longer cited (drop them from OTHER_PROJECTS_FILES): {stale:?}",
        missing.join("\n")
    );
}

// ------------------------------------------------------------ intra-doc links

/// The crates a crate's code may name by their own name: its
/// dependencies (from its Cargo.toml, `-` read as `_`), itself and the
/// standard ones.
fn extern_crates(krate: &Path) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = ["std", "core", "alloc"].map(String::from).into();
    let Ok(manifest) = fs::read_to_string(krate.join("Cargo.toml")) else {
        return out;
    };
    let mut in_deps = false;
    for line in manifest.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_deps = l.contains("dependencies");
            continue;
        }
        let Some((key, value)) = l.split_once('=') else {
            continue;
        };
        let key = key.trim().trim_end_matches(".workspace").trim();
        if in_deps {
            out.insert(key.replace('-', "_"));
        } else if key == "name" {
            out.insert(value.trim().trim_matches('"').replace('-', "_"));
        }
    }
    out
}

/// Where the children of the module in `file` live: beside it for a
/// crate root or a `mod.rs`, in the folder of its own name otherwise.
fn children_folder(file: &Path) -> PathBuf {
    let parent = file.parent().expect("a file has a folder");
    match file.file_name().and_then(|n| n.to_str()) {
        Some("lib.rs" | "main.rs" | "mod.rs") => parent.to_path_buf(),
        _ => parent.join(file.file_stem().expect("a file name")),
    }
}

/// The file of the child module `name` of the module in `file`.
fn child_module(file: &Path, name: &str) -> Option<PathBuf> {
    let folder = children_folder(file);
    [
        folder.join(format!("{name}.rs")),
        folder.join(name).join("mod.rs"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// `text` defines or imports an item called `name`: `fn name`, `mod
/// name`, `struct name`, … or a `use` that names it.
fn declares(text: &str, name: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let words: Vec<&str> = text
        .split(|c: char| !is_ident(c) && c != '!')
        .filter(|w| !w.is_empty())
        .collect();
    let kinds = [
        "fn",
        "mod",
        "macro_rules!",
        "struct",
        "enum",
        "trait",
        "type",
        "const",
        "static",
        "union",
    ];
    if words
        .windows(2)
        .any(|w| kinds.contains(&w[0]) && w[1] == name)
    {
        return true;
    }
    let mut rest = text;
    while let Some(at) = rest.find("use ") {
        let starts_a_statement = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| c.is_whitespace() || c == ')' || c == ';' || c == '{');
        let statement = rest[at..].split(';').next().unwrap_or("");
        rest = &rest[at + 4..];
        if starts_a_statement && statement.split(|c: char| !is_ident(c)).any(|w| w == name) {
            return true;
        }
    }
    false
}

/// The intra-doc links of a doc comment line whose path starts lowercase
/// (a module, a function, a macro), as segments: the bracketed code spans
/// `route`, `crate::flow`, `sync::sync_breakers`. A link with its own
/// target (followed by a parenthesised or bracketed one, or a definition:
/// a colon right after it at the start of the line) is not one.
fn module_links(doc: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = doc.trim_start();
    let mut first = true;
    while let Some(at) = rest.find("[`") {
        let after = &rest[at + 2..];
        let Some(end) = after.find("`]") else { break };
        let inner = after[..end].trim_end_matches("()").trim_end_matches('!');
        let next = after[end + 2..].chars().next();
        rest = &after[end + 2..];
        let segments: Vec<String> = inner.split("::").map(str::to_string).collect();
        let idents = segments.iter().all(|s| {
            !s.is_empty()
                && !s.starts_with(|c: char| c.is_ascii_digit())
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        let lowercase = inner.starts_with(|c: char| c.is_ascii_lowercase() || c == '_');
        let definition = at == 0 && first && next == Some(':');
        first = false;
        if idents && lowercase && !definition && !matches!(next, Some('(' | '[')) {
            out.push(segments);
        }
    }
    out
}

/// The primitive types a bare intra-doc link may name.
const PRIMITIVES: &[&str] = &[
    "bool",
    "char",
    "str",
    "u8",
    "u16",
    "u32",
    "u64",
    "u128",
    "usize",
    "i8",
    "i16",
    "i32",
    "i64",
    "i128",
    "isize",
    "f32",
    "f64",
    "slice",
    "array",
    "tuple",
    "unit",
    "never",
    "pointer",
    "reference",
    "fn",
];

/// Why an intra-doc link in `file` names nothing, walking its path module
/// by module: `crate` is the crate's root, a child module goes on into
/// it, and the first segment that is no module must be declared in the
/// module reached (the file itself for a bare name), or be a crate or a
/// primitive. `None`: it resolves, or is not checked (`super`, `Self`, or
/// `crate` outside a crate's `src/`).
fn broken_link(file: &Path, segments: &[String], crates: &BTreeSet<String>) -> Option<String> {
    let krate = crate_of(file)?;
    let mut module = file.to_path_buf();
    let mut rest = segments;
    match segments.first().map(String::as_str) {
        Some("crate") => {
            if !file.starts_with(krate.join("src")) {
                return None;
            }
            module = ["lib.rs", "main.rs"]
                .iter()
                .map(|r| krate.join("src").join(r))
                .find(|p| p.is_file())?;
            rest = &segments[1..];
        }
        Some("self") => rest = &segments[1..],
        Some("super") | None => return None,
        Some(first) if segments.len() == 1 || child_module(file, first).is_none() => {
            if crates.contains(first) || PRIMITIVES.contains(&first) {
                return None;
            }
        }
        Some(_) => {}
    }
    for segment in rest {
        if let Some(child) = child_module(&module, segment) {
            module = child;
            continue;
        }
        if declares(&read(&module), segment) {
            return None;
        }
        return Some(format!(
            "`{segment}` is no module of, nor declared in, {}",
            rel(&module)
        ));
    }
    None
}

/// The intra-doc links to modules and functions resolve: a doc comment
/// that still links a module since renamed, or a function its module
/// neither defines nor imports, is caught here without building the
/// docs.
#[test]
fn every_module_a_doc_link_names_exists() {
    let mut broken = Vec::new();
    let mut crates_of: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    for file in rust_sources() {
        let Some(krate) = crate_of(&file) else {
            continue;
        };
        let crates = crates_of
            .entry(krate.clone())
            .or_insert_with(|| extern_crates(&krate));
        let text = read(&file);
        for (line, l) in text.lines().enumerate() {
            let t = l.trim_start();
            let Some(doc) = t.strip_prefix("///").or_else(|| t.strip_prefix("//!")) else {
                continue;
            };
            for link in module_links(doc) {
                if let Some(why) = broken_link(&file, &link, crates) {
                    broken.push(format!(
                        "{}:{}: [`{}`]: {why}",
                        rel(&file),
                        line + 1,
                        link.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "doc links that name nothing:\n{}",
        broken.join("\n")
    );
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
    let message = match sluice_core::Policy::from_value(policy) {
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
    use sluice_core::metrics::ALL;
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

#[test]
fn stale_module_links_are_caught() {
    let crates = BTreeSet::new();
    let admission = root().join("core/src/admission/mod.rs");
    let link = |s: &str| -> Vec<String> { s.split("::").map(str::to_string).collect() };
    // A module renamed away, a function of another module, a path through
    // a module that is gone.
    for gone in [
        "health",
        "early",
        "crate::flow::telemetry",
        "crate::admission::health::x",
    ] {
        assert!(
            broken_link(&admission, &link(gone), &crates).is_some(),
            "{gone} is not caught"
        );
    }
    for there in [
        "route",
        "no_body",
        "crate::flow",
        "crate::host::mock::MockHost",
        "route::Pushback",
        "u64",
    ] {
        assert_eq!(
            broken_link(&admission, &link(there), &crates),
            None,
            "{there}"
        );
    }
    let fleet = root().join("gpu-sidecar/src/fleet/mod.rs");
    assert!(broken_link(&fleet, &link("sync_breakers"), &crates).is_some());
    assert_eq!(
        broken_link(&fleet, &link("sync::sync_breakers"), &crates),
        None
    );
    let links: Vec<String> = module_links(" [`a`], [`b::c()`], [`D`], [`e`](x), [`f`][g], [`h!`]")
        .into_iter()
        .map(|l| l.join("::"))
        .collect();
    assert_eq!(links, ["a", "b::c", "h"]);
    assert!(module_links(" [`a`]: crate::a").is_empty());
}

#[test]
fn stale_paths_in_comments_are_caught() {
    let tops = top_folders();
    let flow = root().join("core/src/flow/mod.rs");
    let resolves = |file: &Path, path: &str| {
        comment_path_bases(file)
            .iter()
            .any(|b| b.join(path).exists())
    };
    // Beside the file, from the crate's src/, from the root.
    for there in [
        "waiting.rs",
        "admission/no_body.rs",
        "native/src/filter.rs",
        "tests/tests/docs.rs",
    ] {
        assert!(resolves(&flow, there), "{there}");
    }
    for gone in [
        "early.rs",
        "admission/health.rs",
        "native/src/early.rs",
        "filter/src/flow/mod.rs",
    ] {
        assert!(!resolves(&flow, gone), "{gone}");
    }
    // A crate's own tests/ from its benchmarks.
    assert!(resolves(
        &root().join("core/benches/shapes/mod.rs"),
        "tests/hostcalls.rs"
    ));
    assert_eq!(
        paths_in_comment(
            " see `admission/no_body.rs`, native/src/abi.rs and tests/tests/docs.rs::x.",
            &tops
        ),
        [
            "admission/no_body.rs",
            "native/src/abi.rs",
            "tests/tests/docs.rs"
        ]
    );
    // Endpoints, URLs, rates, any folder's mod.rs and another project's
    // path under a top folder's name are no paths of ours.
    assert!(paths_in_comment(
        " /v1/fleet/take, https://x.io/core/a.rs, 10/min, mod.rs, envoy/admin/v3/clusters.proto",
        &tops
    )
    .is_empty());
}

#[test]
fn stale_paths_in_the_docs_are_caught() {
    let tops = top_folders();
    assert_eq!(
        path_in_span("native/src/lib.rs", &tops),
        Some(("native/src/lib.rs".into(), true))
    );
    assert_eq!(
        path_in_span("health.rs", &tops),
        Some(("health.rs".into(), false))
    );
    assert_eq!(
        path_in_span("watch/", &tops),
        Some(("watch/".into(), false))
    );
    for not_a_path in [
        "10/min",
        "/v1/state",
        "target/book/",
        "tier/free/requests",
        "a b.rs",
    ] {
        assert_eq!(path_in_span(not_a_path, &tops), None, "{not_a_path}");
    }
    let spans = spans_by_line("keyed by (`tier/free/\nrequests`) and `core/`\n\n`open\n\nx`\n");
    assert_eq!(
        spans,
        [
            (1, "tier/free/\nrequests".to_string()),
            (2, "core/".to_string())
        ]
    );
}

#[test]
fn markup_whose_id_is_not_computed_is_named() {
    for plain in [
        "The sidecar's door",
        "`tiers.<tier>` and `a_b`",
        "snake_case words, [a link](x.md) and *emphasis*",
        "A < B & C",
    ] {
        assert_eq!(unmodelled_markup(plain), None, "{plain}");
    }
    for odd in [
        "<em>x</em>",
        "a \\* b",
        "AT&amp;T",
        "_x_",
        "![i](x.png)",
        "a[^1]",
    ] {
        assert!(unmodelled_markup(odd).is_some(), "{odd}");
    }
    assert_eq!(setext_headings("Title\n=====\n\ntext\n\n---\n"), [2]);
}
