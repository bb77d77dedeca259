//! Reads sample lines of the Prometheus text format.
//!
//! Hand-written on purpose: vLLM's names carry colons, which `prometheus-parse`
//! drops silently, and the crates that do parse them fail a whole scrape on
//! one odd line. This reads each sample line on its own, skips comments and
//! any line it cannot read, and needs nothing else.

/// One sample: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Every sample line of `text` that reads cleanly.
pub fn parse(text: &str) -> Vec<Sample<'_>> {
    text.lines().filter_map(parse_line).collect()
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    is_name_start(c) || c.is_ascii_digit()
}

fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    if !line.starts_with(is_name_start) {
        return None; // blank, `# HELP`, `# TYPE`, garbage
    }
    let end = line.find(|c| !is_name_char(c)).unwrap_or(line.len());
    let (name, mut rest) = line.split_at(end);
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split_whitespace();
    let value = parse_value(fields.next()?)?;
    // An optional timestamp may follow; anything more is not a sample.
    if fields.nth(1).is_some() {
        return None;
    }
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Reads `k="v",…}` and returns what follows the `}`.
fn parse_labels<'a>(mut s: &'a str, out: &mut Vec<(&'a str, String)>) -> Option<&'a str> {
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Some(rest);
        }
        let end = s.find(|c: char| !is_name_char(c))?;
        let (key, rest) = s.split_at(end);
        if key.is_empty() {
            return None;
        }
        let rest = rest.trim_start().strip_prefix('=')?.trim_start();
        let rest = rest.strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let close = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        out.push((key, value));
        s = rest[close + 1..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_lines() {
        let text = r#"
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama3.1:70b"} 12.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7
vllm:kv_cache_usage_perc 0.5 1700000000000
plain_metric 3
"#;
        let s = parse(text);
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].name, "vllm:num_requests_waiting");
        assert_eq!(s[0].label("model_name"), Some("llama3.1:70b"));
        assert_eq!(s[0].value, 12.0);
        assert_eq!(s[1].label("le"), Some("+Inf"));
        assert_eq!(s[2].name, "vllm:kv_cache_usage_perc");
        assert_eq!(s[2].value, 0.5);
        assert!(s[2].labels.is_empty());
        assert_eq!(s[3].value, 3.0);
    }

    #[test]
    fn label_values_with_escapes_and_odd_characters() {
        let s = parse(r#"m{a="x \"y\" {z}, w",b="back\\slash\nnl",} +Inf"#);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].label("a"), Some(r#"x "y" {z}, w"#));
        assert_eq!(s[0].label("b"), Some("back\\slash\nnl"));
        assert_eq!(s[0].value, f64::INFINITY);
    }

    #[test]
    fn bad_lines_are_skipped_not_fatal() {
        let text = "good 1\nbad{a=\"unterminated} 2\nworse{a=b} 3\nno_value\nx 1 2 3\nnan NaN\nalso_good{} 4\n";
        let s = parse(text);
        let names: Vec<_> = s.iter().map(|s| s.name).collect();
        assert_eq!(names, vec!["good", "nan", "also_good"]);
        assert!(s[1].value.is_nan());
    }
}
