//! `GET /`: a status page for people on call. Server-rendered, no script,
//! refreshed by a meta tag every 5 s.

use std::fmt::Write as _;

use crate::breaker::num;
use crate::state::{BreakerState, SidecarState};
use crate::telemetry::Snapshot;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn when(t: Option<std::time::SystemTime>) -> String {
    t.map_or("—".into(), |t| {
        humantime::format_rfc3339_seconds(t).to_string()
    })
}

pub fn render(state: &SidecarState, snap: &Snapshot) -> String {
    let mut h = String::new();
    let ks = &state.kill_switch;
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"5\">\
<title>sluice sidecar</title><style>\
body{{font-family:system-ui,sans-serif;margin:2em;max-width:70em}}\
table{{border-collapse:collapse;margin-bottom:1.5em}}td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}\
.open{{background:#f8d0d0}}.half_open{{background:#fbeec1}}.closed{{background:#d5f0d5}}\
.ks-on{{background:#f8d0d0;padding:.6em;font-weight:bold}}.ks-off{{background:#d5f0d5;padding:.6em}}\
</style></head><body><h1>sluice sidecar</h1>\
<p>State version {} · updated {} · last round {}{}</p>",
        state.version,
        when(Some(state.updated_at)),
        when(snap.last_round),
        if state.stale { " · <b>some data is stale</b>" } else { "" }
    );

    let _ = write!(
        h,
        "<h2>Kill switch</h2><p class=\"{}\">{}{} · since {}</p>",
        if ks.active { "ks-on" } else { "ks-off" },
        if ks.active {
            "ON: traffic goes to the fallback"
        } else {
            "off"
        },
        ks.reason
            .as_deref()
            .map(|r| format!(" — {}", esc(r)))
            .unwrap_or_default(),
        when(ks.since)
    );

    let _ = write!(
        h,
        "<h2>GPUs ({})</h2>",
        esc(snap.gpu_source.unwrap_or("no GPU source"))
    );
    if let Some(e) = &snap.gpu_error {
        let _ = write!(h, "<p class=\"open\">GPU source failing: {}</p>", esc(e));
    }
    if snap.gpus.is_empty() {
        h.push_str("<p>No GPU reading.</p>");
    } else {
        h.push_str("<table><tr><th>#</th><th>Name</th><th>Utilization</th><th>Memory</th><th>Temperature</th><th>Power</th></tr>");
        for g in &snap.gpus {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{} %</td><td>{} / {} MiB ({} %)</td><td>{}</td><td>{}</td></tr>",
                g.index,
                esc(&g.name),
                num(g.utilization),
                num(g.memory_used_mb.round()),
                num(g.memory_total_mb.round()),
                num((g.memory_fraction() * 100.0).round()),
                g.temperature_c.map_or("—".into(), |t| format!("{} °C", num(t))),
                g.power_w.map_or("—".into(), |p| format!("{} W", num(p.round()))),
            );
        }
        h.push_str("</table>");
    }

    h.push_str("<h2>Breakers</h2><table><tr><th>Scope</th><th>State</th><th>Since</th><th>Reason</th><th>Latest values</th></tr>");
    for v in &snap.breakers {
        let values: Vec<String> = v
            .values
            .iter()
            .map(|(m, x)| format!("{m} {}", num(*x)))
            .collect();
        let _ = write!(
            h,
            "<tr class=\"{}\"><td>{}</td><td>{}{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            v.state.as_str(),
            esc(&v.scope),
            match v.state {
                BreakerState::Open => "open",
                BreakerState::HalfOpen => "half-open",
                BreakerState::Closed => "closed",
                BreakerState::Saturated => "saturated",
            },
            if v.stale { " (stale)" } else { "" },
            when(Some(v.since)),
            esc(v.reason.as_deref().unwrap_or("")),
            esc(&values.join(", ")),
        );
    }
    h.push_str("</table>");

    if !snap.backends.is_empty() {
        h.push_str("<h2>Backends</h2><table><tr><th>Name</th><th>Kind</th><th>Up</th><th>Signals</th><th>Error</th></tr>");
        for b in &snap.backends {
            let mut signals: Vec<String> = b
                .samples
                .iter()
                .map(|(m, x)| format!("{m} {}", num(*x)))
                .collect();
            if !b.models.is_empty() {
                signals.push(format!("models {}", b.models.join(", ")));
            }
            let _ = write!(
                h,
                "<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                if b.up { "closed" } else { "open" },
                esc(&b.name),
                b.kind,
                if b.up { "yes" } else { "no" },
                esc(&signals.join(", ")),
                esc(b.error.as_deref().unwrap_or("")),
            );
        }
        h.push_str("</table>");
    }
    h.push_str("<p><a href=\"/v1/state\">/v1/state</a> · <a href=\"/metrics\">/metrics</a> · <a href=\"/healthz\">/healthz</a></p></body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::View;
    use std::time::SystemTime;

    #[test]
    fn shows_kill_switch_and_breakers_escaped() {
        let mut state = SidecarState::initial(SystemTime::UNIX_EPOCH);
        state.kill_switch.active = true;
        state.kill_switch.reason = Some("<script>x</script>".into());
        let snap = Snapshot {
            breakers: vec![View {
                scope: "backend:a".into(),
                state: BreakerState::Open,
                reason: Some("gpu_utilization 95 >= 90 for 30s".into()),
                since: SystemTime::UNIX_EPOCH,
                stale: false,
                values: vec![],
            }],
            ..Snapshot::default()
        };
        let page = render(&state, &snap);
        assert!(page.contains("http-equiv=\"refresh\""));
        assert!(page.contains("ON: traffic goes to the fallback"));
        assert!(page.contains("&lt;script&gt;"));
        assert!(!page.contains("<script>"));
        assert!(page.contains("gpu_utilization 95 &gt;= 90 for 30s"));
    }
}
