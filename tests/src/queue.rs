//! Harness for the queue tests (`tests/tests/queue.rs`) and the queue
//! bench: a policy with a concurrency-limited model and classes picked by
//! a trusted header, and many requests fired at once with their timings.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{async_client, runtime, shipped_config_for, Envoy, MockLlm, PolicyBuilder, Stack};

/// The model the queue policy limits.
pub const MODEL: &str = "m";

/// Callers name themselves (`x-user`) and their tier (`x-tier`, one per
/// class): batch (the default, waits 10 s), inter (interactive), gold
/// and lead (weights 3 and 1).
pub fn policy(concurrency: u32) -> Value {
    PolicyBuilder::header_tiers("batch")
        .tier("batch", json!({"class": "batch"}))
        .tier("inter", json!({"class": "interactive"}))
        .tier("gold", json!({"class": "gold"}))
        .tier("lead", json!({"class": "lead"}))
        .class("interactive", json!({"queue": false}))
        .class("batch", json!({"max_wait": "10s", "max_depth": 1000}))
        .class("gold", json!({"max_wait": "20s", "weight": 3}))
        .class("lead", json!({"max_wait": "20s", "weight": 1}))
        .model(MODEL, json!({"concurrency": concurrency}))
        .build()
}

/// mock-llm (with `mock_args`) behind Envoy with `workers` threads and the
/// queue policy.
pub fn stack(workers: u32, concurrency: u32, mock_args: &[&str]) -> Stack {
    let upstream = MockLlm::start_with_args("primary", mock_args);
    let mut config = shipped_config_for(&upstream);
    config.set_policy(&policy(concurrency));
    let envoy = Envoy::start(&config, workers);
    Stack {
        envoy,
        upstream,
        config,
    }
}

/// One request's fate.
#[derive(Debug, Clone)]
pub struct Shot {
    pub user: String,
    pub status: u16,
    pub reason: Option<String>,
    /// From the start of the volley: sent, answered.
    pub sent: Duration,
    pub done: Duration,
    /// `x-sluice-queued-ms`, when admitted.
    pub queued_ms: Option<u64>,
    /// Transport error (client timeout) instead of an answer.
    pub failed: bool,
}

impl Shot {
    /// When it left the queue, from the start of the volley.
    pub fn dispatched(&self) -> Duration {
        self.sent + Duration::from_millis(self.queued_ms.unwrap_or(0))
    }
}

/// A request to fire: its user, tier, extra headers, and the delay after
/// the volley's start.
#[derive(Debug, Clone)]
pub struct Aim {
    pub user: String,
    pub tier: String,
    pub headers: Vec<(String, String)>,
    pub after: Duration,
    /// Client gives up (and disconnects) after this.
    pub timeout: Duration,
}

impl Aim {
    pub fn new(user: &str, tier: &str) -> Aim {
        Aim {
            user: user.into(),
            tier: tier.into(),
            headers: Vec::new(),
            after: Duration::ZERO,
            timeout: Duration::from_secs(60),
        }
    }
    pub fn header(mut self, name: &str, value: &str) -> Aim {
        self.headers.push((name.into(), value.into()));
        self
    }
    pub fn after_ms(mut self, ms: u64) -> Aim {
        self.after = Duration::from_millis(ms);
        self
    }
    pub fn timeout_ms(mut self, ms: u64) -> Aim {
        self.timeout = Duration::from_millis(ms);
        self
    }
    /// mock-llm's latency knob.
    pub fn latency_ms(self, ms: u64) -> Aim {
        self.header("x-mock-latency-ms", &ms.to_string())
    }
}

/// Fires every aim concurrently (each at its delay) and returns the shots
/// in the order given.
pub fn volley(envoy: &Envoy, aims: Vec<Aim>) -> Vec<Shot> {
    let url = envoy.url("/v1/chat/completions");
    let body = json!({"model": MODEL, "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    runtime().block_on(async move {
        let client = async_client();
        let start = Instant::now();
        let tasks: Vec<_> = aims
            .into_iter()
            .map(|aim| {
                let (client, url, body) = (client.clone(), url.clone(), body.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(aim.after).await;
                    let sent = start.elapsed();
                    let mut req = client
                        .post(&url)
                        .timeout(aim.timeout)
                        .header("content-type", "application/json")
                        .header("x-user", &aim.user)
                        .header("x-tier", &aim.tier);
                    for (n, v) in &aim.headers {
                        req = req.header(n, v);
                    }
                    let result = async {
                        let resp = req.body(body).send().await?;
                        let status = resp.status().as_u16();
                        let header = |n: &str| {
                            resp.headers()
                                .get(n)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned)
                        };
                        let reason = header("x-sluice-reason");
                        let queued_ms = header("x-sluice-queued-ms").and_then(|v| v.parse().ok());
                        resp.bytes().await?;
                        Ok::<_, reqwest::Error>((status, reason, queued_ms))
                    }
                    .await;
                    let done = start.elapsed();
                    match result {
                        Ok((status, reason, queued_ms)) => Shot {
                            user: aim.user,
                            status,
                            reason,
                            sent,
                            done,
                            queued_ms,
                            failed: false,
                        },
                        Err(_) => Shot {
                            user: aim.user,
                            status: 0,
                            reason: None,
                            sent,
                            done,
                            queued_ms: None,
                            failed: true,
                        },
                    }
                })
            })
            .collect();
        let mut shots = Vec::new();
        for task in tasks {
            shots.push(task.await.expect("request task"));
        }
        shots
    })
}

/// Jain's fairness index of per-party throughputs (1 = equal).
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (xs.len() as f64 * squares)
}

/// [`stack`] with another policy (the fairness tests'); requests on the
/// connections of a listener a reload replaced may run 60 s.
pub fn stack_with_policy(workers: u32, policy: Value, mock_args: &[&str]) -> Stack {
    let upstream = MockLlm::start_with_args("primary", mock_args);
    let mut config = shipped_config_for(&upstream);
    config.set_drain_time_s(60);
    config.set_policy(&policy);
    let envoy = Envoy::start(&config, workers);
    Stack {
        envoy,
        upstream,
        config,
    }
}

/// The model's queue depth in a class, as Envoy's gauge says.
pub fn depth(envoy: &Envoy, class: &str) -> f64 {
    envoy
        .metric("sluice_queue_depth", &[("model", MODEL), ("class", class)])
        .unwrap_or(0.0)
}
