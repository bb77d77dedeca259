//! Alerts on breaker and kill-switch changes, to webhooks: generic JSON or
//! Telegram's `{"chat_id", "text"}`. A change within the flap window of the
//! previous change of the same scope is not sent (and is counted); once the
//! scope has been quiet for the window, its settled state is sent if it
//! differs from the last one sent.
//!
//! Senders never wait: events go through a bounded queue to one task, and
//! each post runs on its own with a short timeout.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use tokio::sync::mpsc;

use crate::config::{AlertsConfig, WebhookConfig, WebhookFormat};
use crate::http::{self, Target};
use crate::state::BreakerState;
use crate::watch::snapshot::Telemetry;

#[derive(Debug, Clone, PartialEq)]
pub enum AlertEvent {
    Breaker {
        scope: String,
        from: BreakerState,
        to: BreakerState,
        reason: String,
        at: SystemTime,
    },
    KillSwitch {
        active: bool,
        reason: Option<String>,
        at: SystemTime,
    },
    /// A provider's spend budget crossed its `alert_at` in Envoy (the
    /// filter counts it once per window: `sluice_provider_budget_alerts_total`).
    ProviderBudget { provider: String, at: SystemTime },
}

impl AlertEvent {
    /// What flapping is judged per.
    fn key(&self) -> String {
        match self {
            AlertEvent::Breaker { scope, .. } => scope.clone(),
            AlertEvent::KillSwitch { .. } => "kill_switch".into(),
            AlertEvent::ProviderBudget { provider, .. } => format!("provider:{provider}"),
        }
    }

    /// The state it reports, to tell whether a settled state is news.
    fn state(&self) -> &'static str {
        match self {
            AlertEvent::Breaker { to, .. } => to.as_str(),
            AlertEvent::KillSwitch { active: true, .. } => "on",
            AlertEvent::KillSwitch { active: false, .. } => "off",
            AlertEvent::ProviderBudget { .. } => "alert",
        }
    }

    pub fn name(&self) -> String {
        match self {
            AlertEvent::Breaker { to, .. } => format!("breaker_{}", to.as_str()),
            AlertEvent::KillSwitch { .. } => format!("kill_switch_{}", self.state()),
            AlertEvent::ProviderBudget { .. } => "provider_budget_alert".into(),
        }
    }

    /// One line for people.
    pub fn text(&self, settled: bool) -> String {
        let tail = if settled {
            " (settled after flapping)"
        } else {
            ""
        };
        match self {
            AlertEvent::Breaker {
                scope, to, reason, ..
            } => {
                let word = match to {
                    BreakerState::Open => "OPEN: traffic is refused",
                    BreakerState::HalfOpen => "HALF-OPEN: a trickle goes through",
                    BreakerState::Closed => "closed: traffic flows",
                    BreakerState::Saturated => "SATURATED: batch waits, interactive is refused",
                    BreakerState::Unknown => "in a state this sidecar does not know",
                };
                format!("sluice: breaker {scope} {word} ({reason}){tail}")
            }
            AlertEvent::KillSwitch { active, reason, .. } => {
                let why = reason.as_deref().unwrap_or("no reason given");
                if *active {
                    format!("sluice: KILL SWITCH ON: traffic goes to the fallback ({why}){tail}")
                } else {
                    format!("sluice: kill switch off: traffic back to primary ({why}){tail}")
                }
            }
            AlertEvent::ProviderBudget { provider, .. } => format!(
                "sluice: provider {provider} passed its spend alert for this window; \
                 at its budget the ladder skips it{tail}"
            ),
        }
    }

    /// The webhook body in `format`.
    pub fn body(&self, hook: &WebhookConfig, settled: bool) -> serde_json::Value {
        let text = self.text(settled);
        if hook.format == WebhookFormat::Telegram {
            return json!({"chat_id": hook.chat_id, "text": text});
        }
        let at = |t: &SystemTime| humantime::format_rfc3339_seconds(*t).to_string();
        match self {
            AlertEvent::Breaker {
                scope,
                from,
                to,
                reason,
                at: t,
            } => json!({
                "source": "sluice-sidecar", "event": self.name(), "scope": scope,
                "state": to.as_str(), "previous": from.as_str(), "reason": reason,
                "at": at(t), "settled": settled, "text": text,
            }),
            AlertEvent::KillSwitch {
                active,
                reason,
                at: t,
            } => json!({
                "source": "sluice-sidecar", "event": self.name(), "scope": "kill_switch",
                "active": active, "reason": reason, "at": at(t), "settled": settled,
                "text": text,
            }),
            AlertEvent::ProviderBudget { provider, at: t } => json!({
                "source": "sluice-sidecar", "event": self.name(), "scope": self.key(),
                "provider": provider, "at": at(t), "settled": settled, "text": text,
            }),
        }
    }
}

#[derive(Debug)]
struct KeyState {
    last_change: Instant,
    last_sent: &'static str,
    pending: Option<AlertEvent>,
}

/// The flap filter. Pure: fed events and `now`.
#[derive(Debug)]
pub struct FlapGate {
    window: Duration,
    keys: HashMap<String, KeyState>,
}

impl FlapGate {
    pub fn new(window: Duration) -> Self {
        FlapGate {
            window,
            keys: HashMap::new(),
        }
    }

    /// The event if it should be sent now; `None` if suppressed as flapping.
    pub fn offer(&mut self, ev: AlertEvent, now: Instant) -> Option<AlertEvent> {
        let key = ev.key();
        if let Some(k) = self.keys.get_mut(&key) {
            let flapping = now.saturating_duration_since(k.last_change) < self.window;
            k.last_change = now;
            if flapping {
                k.pending = Some(ev);
                return None;
            }
            k.pending = None;
            k.last_sent = ev.state();
            return Some(ev);
        }
        self.keys.insert(
            key,
            KeyState {
                last_change: now,
                last_sent: ev.state(),
                pending: None,
            },
        );
        Some(ev)
    }

    /// Settled states: held suppressed changes of scopes quiet for the
    /// window, when they differ from what was last sent.
    pub fn flush(&mut self, now: Instant) -> Vec<AlertEvent> {
        let mut out = Vec::new();
        for k in self.keys.values_mut() {
            if now.saturating_duration_since(k.last_change) < self.window {
                continue;
            }
            if let Some(ev) = k.pending.take() {
                if ev.state() != k.last_sent {
                    k.last_sent = ev.state();
                    out.push(ev);
                }
            }
        }
        out
    }
}

/// Where events are handed in; cheap to clone.
#[derive(Debug, Clone)]
pub struct Alerts {
    tx: mpsc::Sender<AlertEvent>,
    telemetry: Arc<Telemetry>,
}

impl Alerts {
    /// Starts the alert task. With no webhooks it still counts flapping.
    pub fn start(config: AlertsConfig, telemetry: Arc<Telemetry>) -> Alerts {
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(run(config, rx, telemetry.clone()));
        Alerts { tx, telemetry }
    }

    /// Never waits: a full queue drops the event (counted).
    pub fn send(&self, ev: AlertEvent) {
        if self.tx.try_send(ev).is_err() {
            Telemetry::count(&self.telemetry.alerts_dropped);
        }
    }
}

async fn run(config: AlertsConfig, mut rx: mpsc::Receiver<AlertEvent>, telemetry: Arc<Telemetry>) {
    // URLs were checked with the config; one that still fails is skipped.
    let hooks: Vec<(Target, WebhookConfig)> = config
        .webhooks
        .iter()
        .filter_map(|h| Target::parse(&h.url).ok().map(|t| (t, h.clone())))
        .collect();
    let hooks = Arc::new(hooks);
    let mut gate = FlapGate::new(config.flap_window);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else { return };
                match gate.offer(ev, Instant::now()) {
                    Some(ev) => deliver(&hooks, ev, false, config.timeout, &telemetry),
                    None => Telemetry::count(&telemetry.alerts_suppressed),
                }
            }
            _ = tick.tick() => {
                for ev in gate.flush(Instant::now()) {
                    deliver(&hooks, ev, true, config.timeout, &telemetry);
                }
            }
        }
    }
}

fn deliver(
    hooks: &Arc<Vec<(Target, WebhookConfig)>>,
    ev: AlertEvent,
    settled: bool,
    timeout: Duration,
    telemetry: &Arc<Telemetry>,
) {
    eprintln!("sluice-sidecar: alert: {}", ev.text(settled));
    for (target, hook) in hooks.iter() {
        let body = ev.body(hook, settled).to_string().into_bytes();
        let target = target.clone();
        let url = hook.url.clone();
        let telemetry = telemetry.clone();
        tokio::spawn(async move {
            match http::post_json(&target, body, timeout).await {
                Ok(()) => Telemetry::count(&telemetry.alerts_sent),
                Err(e) => {
                    Telemetry::count(&telemetry.alerts_failed);
                    eprintln!("sluice-sidecar: alert to {url} failed: {e}");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(scope: &str, to: BreakerState) -> AlertEvent {
        AlertEvent::Breaker {
            scope: scope.into(),
            from: BreakerState::Closed,
            to,
            reason: "gpu_utilization 95 >= 90 for 30s".into(),
            at: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn changes_within_the_window_are_suppressed_then_settled() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut gate = FlapGate::new(s(60));
        assert!(gate.offer(breaker("a", BreakerState::Open), t0).is_some());
        assert!(
            gate.offer(breaker("b", BreakerState::Open), t0).is_some(),
            "other scope"
        );
        assert!(gate
            .offer(breaker("a", BreakerState::Closed), t0 + s(20))
            .is_none());
        assert!(gate
            .offer(breaker("a", BreakerState::Open), t0 + s(50))
            .is_none());
        assert!(
            gate.offer(breaker("a", BreakerState::Closed), t0 + s(100))
                .is_none(),
            "still within 60 s of the last change"
        );
        assert!(gate.flush(t0 + s(159)).is_empty());
        let settled = gate.flush(t0 + s(160));
        assert_eq!(settled, vec![breaker("a", BreakerState::Closed)]);
        assert!(gate.flush(t0 + s(300)).is_empty(), "sent once");
        assert!(gate
            .offer(breaker("a", BreakerState::Open), t0 + s(400))
            .is_some());
    }

    #[test]
    fn a_flap_back_to_the_sent_state_is_not_news() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut gate = FlapGate::new(s(60));
        assert!(gate.offer(breaker("a", BreakerState::Open), t0).is_some());
        assert!(gate
            .offer(breaker("a", BreakerState::Closed), t0 + s(1))
            .is_none());
        assert!(gate
            .offer(breaker("a", BreakerState::Open), t0 + s(2))
            .is_none());
        assert!(gate.flush(t0 + s(100)).is_empty());
    }

    #[test]
    fn bodies() {
        let generic = WebhookConfig {
            url: "http://h:1/".into(),
            format: WebhookFormat::Generic,
            chat_id: None,
        };
        let tg = WebhookConfig {
            url: "http://h:1/bot/sendMessage".into(),
            format: WebhookFormat::Telegram,
            chat_id: Some("-100123".into()),
        };
        let ev = breaker("backend:a", BreakerState::Open);
        let b = ev.body(&generic, false);
        assert_eq!(b["event"], "breaker_open");
        assert_eq!(b["scope"], "backend:a");
        assert_eq!(b["previous"], "closed");
        assert_eq!(b["at"], "1970-01-01T00:00:00Z");
        let b = ev.body(&tg, false);
        assert_eq!(b.as_object().unwrap().len(), 2);
        assert_eq!(b["chat_id"], "-100123");
        assert!(b["text"].as_str().unwrap().contains("backend:a OPEN"));
        let ks = AlertEvent::KillSwitch {
            active: true,
            reason: Some("drill".into()),
            at: SystemTime::UNIX_EPOCH,
        };
        assert_eq!(ks.body(&generic, true)["event"], "kill_switch_on");
        assert_eq!(ks.body(&generic, true)["settled"], true);
    }

    #[tokio::test]
    async fn posts_reach_a_webhook() {
        use axum::routing::post;
        let (tx, mut rx) = mpsc::channel::<serde_json::Value>(4);
        let app = axum::Router::new().route(
            "/hook",
            post(move |axum::Json(v): axum::Json<serde_json::Value>| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(v).await;
                    "ok"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let telemetry = Arc::new(Telemetry::default());
        let alerts = Alerts::start(
            AlertsConfig {
                webhooks: vec![WebhookConfig {
                    url: format!("http://{addr}/hook"),
                    format: WebhookFormat::Generic,
                    chat_id: None,
                }],
                ..AlertsConfig::default()
            },
            telemetry.clone(),
        );
        alerts.send(breaker("backend:a", BreakerState::Open));
        alerts.send(breaker("backend:a", BreakerState::Closed));
        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got["event"], "breaker_open");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Telemetry::get(&telemetry.alerts_sent) < 1
            || Telemetry::get(&telemetry.alerts_suppressed) < 1
        {
            assert!(Instant::now() < deadline, "counters never moved");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
