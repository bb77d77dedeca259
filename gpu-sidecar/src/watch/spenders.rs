//! The top spenders of the day, from the audit log Envoy writes (one JSON
//! line per request, see docs/src/observability.md): its `principal` is
//! already a salted hash (32 hex digits), never a key, and a line whose
//! principal is anything else is skipped, so a raw identity never reaches
//! the page. Read at `envoy_admin.audit_log` (optional) at each scrape,
//! from where the last read ended.
//!
//! Bounded: at most [`MAX_READ`] bytes a read (the rest at the next), at
//! most [`START_BACK`] bytes back from the end when the file is first
//! opened, [`MAX_PRINCIPALS`] principals a day (later ones summed as one
//! row), a minute's spend per principal for the last hour. A file that
//! shrank or was replaced (rotation) is read again from its start. Only
//! lines of the current UTC day (by their `time`) count.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::watch::money::{run_out, BURN_WINDOW, MIN_BURN_SPAN};

/// Bytes read at most per call.
pub const MAX_READ: u64 = 4 << 20;
/// How far back from the end a newly opened log is read.
pub const START_BACK: u64 = 16 << 20;
/// Principals kept per day; the rest are summed as [`OTHERS`].
pub const MAX_PRINCIPALS: usize = 4096;
/// The row of the principals past the bound.
pub const OTHERS: &str = "(others)";
/// Rows shown.
pub const TOP: usize = 10;
/// A line longer than this is skipped (the audit line is far shorter).
const MAX_LINE: usize = 64 * 1024;

#[derive(Debug, Default)]
struct Spender {
    tier: String,
    today: f64,
    /// (minute since the epoch, spend in it), the last hour's.
    minutes: VecDeque<(u64, f64)>,
}

#[derive(Debug, Default)]
struct Inner {
    /// (device, inode, offset) of the file as last read.
    at: Option<(u64, u64, u64)>,
    /// A line not ended yet.
    partial: Vec<u8>,
    /// Skip up to the first newline (a read that started mid-file).
    skip_first: bool,
    day: u64,
    /// When the sidecar first read the log (the day is counted from it
    /// on the day it started).
    since: Option<SystemTime>,
    by: HashMap<String, Spender>,
    error: Option<String>,
}

/// The top spenders; disabled without `envoy_admin.audit_log`.
#[derive(Debug, Default)]
pub struct Spenders {
    path: Option<PathBuf>,
    inner: Mutex<Inner>,
}

fn day_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

/// The principal of an audit line as the page may show it: 32 hex digits.
fn hashed(p: &str) -> bool {
    p.len() == 32 && p.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Spenders {
    pub fn new(path: Option<PathBuf>) -> Spenders {
        Spenders {
            path,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads what the log gained since the last call, at `now`.
    pub fn poll(&self, now: SystemTime) {
        let Some(path) = &self.path else {
            return;
        };
        let mut inner = self.lock();
        if inner.since.is_none() {
            inner.since = Some(now);
        }
        let today = day_of(now);
        if inner.day != today {
            inner.day = today;
            inner.by.clear();
        }
        match read_more(path, &mut inner) {
            Ok(bytes) => {
                inner.error = None;
                for line in split_lines(&mut inner, &bytes) {
                    count_line(&mut inner, &line, today);
                }
            }
            Err(e) => inner.error = Some(format!("reading {}: {e}", path.display())),
        }
    }
}

/// The bytes the file gained, at most [`MAX_READ`]; from the start of a
/// file that shrank or is another file.
fn read_more(path: &Path, inner: &mut Inner) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    let mut file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    let (dev, ino, len) = (meta.dev(), meta.ino(), meta.len());
    let offset = match inner.at {
        Some((d, i, off)) if d == dev && i == ino && off <= len => off,
        Some(_) => {
            inner.partial.clear();
            inner.skip_first = false;
            0
        }
        None => {
            let start = len.saturating_sub(START_BACK);
            inner.skip_first = start > 0;
            start
        }
    };
    file.seek(SeekFrom::Start(offset))?;
    let mut bytes = Vec::new();
    file.take(MAX_READ).read_to_end(&mut bytes)?;
    inner.at = Some((dev, ino, offset + bytes.len() as u64));
    Ok(bytes)
}

/// Complete lines of `bytes` after what was left over; keeps the rest.
fn split_lines(inner: &mut Inner, bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut lines = Vec::new();
    for &b in bytes {
        if b != b'\n' {
            if inner.partial.len() < MAX_LINE {
                inner.partial.push(b);
            }
            continue;
        }
        let line = std::mem::take(&mut inner.partial);
        if std::mem::take(&mut inner.skip_first) || line.len() >= MAX_LINE {
            continue;
        }
        lines.push(line);
    }
    lines
}

/// One audit line's spend, when it is today's, has a hashed principal
/// and cost something.
fn count_line(inner: &mut Inner, line: &[u8], today: u64) {
    let Ok(v) = serde_json::from_slice::<Value>(line) else {
        return;
    };
    let (Some(p), Some(cost)) = (v["principal"].as_str(), v["cost_micros"].as_u64()) else {
        return;
    };
    let Some(at) = v["time"]
        .as_str()
        .and_then(|t| humantime::parse_rfc3339_weak(t.trim_end_matches('Z')).ok())
    else {
        return;
    };
    if !hashed(p) || cost == 0 || day_of(at) != today {
        return;
    }
    let key = match inner.by.contains_key(p) || inner.by.len() < MAX_PRINCIPALS {
        true => p.to_ascii_lowercase(),
        false => OTHERS.to_string(),
    };
    let s = inner.by.entry(key).or_default();
    if let Some(tier) = v["tier"].as_str() {
        s.tier = tier.chars().take(64).collect();
    }
    s.today += cost as f64;
    let minute = at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 60);
    match s.minutes.iter_mut().find(|(m, _)| *m == minute) {
        Some((_, c)) => *c += cost as f64,
        None => s.minutes.push_back((minute, cost as f64)),
    }
    let from = minute.saturating_sub(BURN_WINDOW.as_secs() / 60);
    while s.minutes.front().is_some_and(|(m, _)| *m < from) || s.minutes.len() > 61 {
        s.minutes.pop_front();
    }
}

impl Spenders {
    /// `top_spenders` of the page's money at `now`: the [`TOP`] largest
    /// spends of the day, each with its tier's per-caller daily budget
    /// (`budgets`, micros) and when it runs out at the last hour's rate.
    pub fn to_json(&self, now: SystemTime, budgets: &BTreeMap<String, u64>) -> Value {
        if self.path.is_none() {
            return json!({"enabled": false, "rows": []});
        }
        let inner = self.lock();
        let reset = UNIX_EPOCH + Duration::from_secs((day_of(now) + 1) * 86_400);
        let now_min = now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / 60);
        let hour_ago = now_min.saturating_sub(BURN_WINDOW.as_secs() / 60);
        // The rate's span: the last hour, or what of it the sidecar saw.
        let seen = inner
            .since
            .and_then(|s| now.duration_since(s).ok())
            .unwrap_or_default()
            .min(BURN_WINDOW);
        let mut top: Vec<(&String, &Spender)> = inner.by.iter().collect();
        top.sort_by(|a, b| b.1.today.total_cmp(&a.1.today).then(a.0.cmp(b.0)));
        let rows: Vec<Value> = top
            .into_iter()
            .take(TOP)
            .map(|(p, s)| {
                let last_hour: f64 = s
                    .minutes
                    .iter()
                    .filter(|(m, _)| *m > hour_ago)
                    .map(|(_, c)| c)
                    .sum();
                let per_hour =
                    (seen >= MIN_BURN_SPAN).then(|| last_hour / seen.as_secs_f64() * 3600.0);
                let budget = budgets.get(&s.tier).copied().filter(|_| p != OTHERS);
                let out = run_out(s.today, budget, per_hour, now, reset);
                json!({
                    "principal": p,
                    "tier": s.tier,
                    "spent_today_micros": s.today.round(),
                    "daily_budget_micros": budget,
                    "burn_per_hour_micros": per_hour.map(f64::round),
                    "run_out": out.to_json(),
                })
            })
            .collect();
        json!({
            "enabled": true,
            "principals": inner.by.len(),
            "error": inner.error,
            "rows": rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// 2025-12-07T00:00:00Z.
    const DAY: u64 = 20_429 * 86_400;

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(s)
    }

    fn line(at: u64, principal: &str, tier: &str, cost: u64) -> String {
        let time = humantime::format_rfc3339_millis(t(at));
        format!(
            "{{\"time\":\"{time}\",\"status\":200,\"request_id\":\"r\",\"principal\":\"{principal}\",\"tier\":\"{tier}\",\"cost_micros\":{cost}}}\n"
        )
    }

    const A: &str = "0123456789abcdef0123456789abcdef";
    const B: &str = "fedcba9876543210fedcba9876543210";

    #[test]
    fn the_days_top_spenders_from_the_log_hashed_principals_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut f = std::fs::File::create(&path).unwrap();
        let start = DAY + 10 * 3600;
        // Yesterday's line, a raw key, a free request: none counts.
        f.write_all(line(start - 86_400, A, "pro", 1_000_000).as_bytes())
            .unwrap();
        f.write_all(line(start, "sk-live-raw-key", "pro", 9_000_000).as_bytes())
            .unwrap();
        f.write_all(line(start, B, "free", 0).as_bytes()).unwrap();
        f.write_all(line(start + 60, A, "pro", 300_000).as_bytes())
            .unwrap();
        // Half a line: counted once it ends.
        let half = line(start + 60, B, "free", 50_000);
        f.write_all(&half.as_bytes()[..20]).unwrap();
        f.flush().unwrap();
        let s = Spenders::new(Some(path.clone()));
        s.poll(t(start));
        f.write_all(&half.as_bytes()[20..]).unwrap();
        f.write_all(line(start + 1800, A, "pro", 300_000).as_bytes())
            .unwrap();
        f.flush().unwrap();
        s.poll(t(start + 3600));
        let budgets = BTreeMap::from([("pro".to_string(), 2_000_000)]);
        let v = s.to_json(t(start + 3600), &budgets);
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2, "{v}");
        assert_eq!(rows[0]["principal"], A);
        assert_eq!(rows[0]["spent_today_micros"], 600_000.0);
        assert_eq!(rows[0]["daily_budget_micros"], 2_000_000);
        // 600,000 in the last hour: the 1,400,000 left last 2 h 20 min.
        assert_eq!(rows[0]["burn_per_hour_micros"], 600_000.0);
        assert_eq!(rows[0]["run_out"]["at"], "2025-12-07T13:20:00Z");
        assert_eq!(rows[1]["principal"], B);
        assert_eq!(rows[1]["run_out"]["state"], "no_budget");
        assert!(!v.to_string().contains("sk-live"), "a raw key never shows");
        // Rotated: the new file is read from its start.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, line(start + 3700, B, "free", 1)).unwrap();
        s.poll(t(start + 3700));
        let v = s.to_json(t(start + 3700), &budgets);
        assert_eq!(v["rows"][1]["spent_today_micros"], 50_001.0);
        // A new day starts empty.
        s.poll(t(DAY + 86_400 + 1));
        assert_eq!(s.to_json(t(DAY + 86_400 + 1), &budgets)["rows"], json!([]));
    }

    #[test]
    fn principals_past_the_bound_are_one_row_and_a_missing_log_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let text: String = (0..MAX_PRINCIPALS + 5)
            .map(|i| line(DAY + 60, &format!("{i:032x}"), "free", 1))
            .collect();
        std::fs::write(&path, text).unwrap();
        let s = Spenders::new(Some(path));
        s.poll(t(DAY + 120));
        let v = s.to_json(t(DAY + 120), &BTreeMap::new());
        assert_eq!(v["principals"], MAX_PRINCIPALS + 1);
        assert_eq!(v["rows"][0]["principal"], OTHERS);
        assert_eq!(v["rows"][0]["spent_today_micros"], 5.0);
        let missing = Spenders::new(Some(dir.path().join("nope")));
        missing.poll(t(DAY));
        assert!(missing.to_json(t(DAY), &BTreeMap::new())["error"]
            .as_str()
            .unwrap()
            .contains("nope"));
        assert_eq!(
            Spenders::default().to_json(t(DAY), &BTreeMap::new())["enabled"],
            false
        );
    }
}
