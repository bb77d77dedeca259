//! One method per Envoy event: each hands [`crate::admission`] what Envoy
//! knows and applies the [`Verdict`] it returns through the [`Host`] trait,
//! so all of it runs natively against [`crate::host::mock::MockHost`].
//!
//! - [`Poller`] is the root context: loads the policy, and — in the one VM
//!   holding the poller lease — long-polls the sidecar and stores its state
//!   in shared data for every worker.
//! - [`Request`] is one HTTP stream (a [`Stream`], its phase a `Phase`):
//!   request headers (kill-switch header stripped, API, identity and the
//!   penalty box, canonical path, declared size, the refusal before the
//!   body: `precheck`) → body (size, then the whole body at its end or at the
//!   trailers) → decision (`Stream::decide`: demand → cache lookup →
//!   `Stream::conclude`, the tail a queued request's dispatch runs too:
//!   route → the model's gate, `waiting` → admit → probe claim →
//!   reroute/rewrite → the fleet's gate) → response headers (upstream answer fed to the
//!   route's record, meter set up) → response body (first byte, meter,
//!   settlement) → log (settle what is left, give back an unanswered
//!   probe, leave the queue).
//! - `fleet_slots` keeps the fleet's concurrency slots, `failover` sends a
//!   request again down its ladder, `cache` and `flight` are the response
//!   cache's side, `audit` the audit record's fields, [`predefined`] the
//!   stats a policy load defines.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::{Rc, Weak};

use crate::admission::answer::{Decision, Reason};
use crate::admission::identity::{Identity, RequestView};
use crate::admission::ladder::{Served, Skip};
use crate::admission::pushback::UpstreamReply;
use crate::admission::route::{self, Pushback, SidecarSeen};
use crate::admission::{Admitted, Engine, RequestContext, Routed, Verdict};
use crate::host::metrics::{self, Metric};
use crate::host::{Action, Headers, Host, LogLevel};
use crate::policy::Policy;
use crate::state::codec::{Reader, Record, Writer};
use crate::state::store::{Cas, Contention, Updated};
use crate::usage::demand::Api;
use crate::usage::reconcile::{Details, Format, Found, ResponseMeter};
use phase::{FleetWait, Phase, Upstream, Watch};

/// Longest audit field value: every field, whatever a client sent.
pub const MAX_AUDIT_BYTES: usize = 256;
/// The headers that carry a client's credential: removed from a request
/// sent to a provider of the ladder, whose own credentials Envoy injects.
const CLIENT_CREDENTIALS: [&str; 4] = ["authorization", "x-api-key", "api-key", "x-goog-api-key"];
/// The sidecar state as received: written by the one VM that polls.
pub const SIDECAR_KEY: &str = "sluice:v1:sidecar";
/// Which VM polls the sidecar: owner id and lease expiry.
pub const POLLER_KEY: &str = "sluice:v1:poller";
pub const LEASE_MS: u64 = 3_000;
pub const TICK_MS: u64 = 250;
/// After a failed poll, wait this long before the next.
const POLL_RETRY_MS: u64 = 1_000;

#[cfg(test)]
thread_local! {
    /// Runs of the decision's tail (`Stream::conclude`) on this thread: the
    /// tests see the direct and the queued request go through it.
    static CONCLUDED: Cell<u32> = const { Cell::new(0) };
}

/// Adds to a metric; nothing for 0 (no host call on the common path).
fn add(host: &dyn Host, metric: Metric, by: i64) {
    metric.add(host, by);
}

/// Lost compare-and-swap races, and updates that lost every try.
fn count_contention(host: &dyn Host, c: Contention) {
    add(host, metrics::CAS_RETRIES, i64::from(c.cas_retries));
    add(host, metrics::CAS_EXHAUSTED, i64::from(c.cas_exhausted));
}

/// Blocks the penalty box started, and callers it had no slot to track.
fn count_penalty_box(host: &dyn Host, checked: &crate::admission::penalty::Checked) {
    add(host, metrics::ABUSE_BLOCKS, i64::from(checked.started));
    add(host, metrics::ABUSE_UNTRACKED, i64::from(checked.untracked));
}

fn set_gauge(host: &dyn Host, gauge: Metric, value: u64) {
    gauge.record(host, value);
}

/// Admission on the ladder's rungs (see `Engine::admit_down_the_ladder`),
/// each rung skipped for its budget counted.
fn admit_down_the_ladder(
    host: &dyn Host,
    engine: &Engine,
    ctx: &RequestContext,
    rung: Option<Box<Served>>,
    seen: &SidecarSeen,
) -> (Verdict, Option<Box<Served>>) {
    let down = match rung {
        Some(_) => engine.rungs_down(seen, ctx.now_ms),
        None => Vec::new(),
    };
    let laddered = engine.admit_down_the_ladder(host, ctx, rung, &down);
    for (provider, why) in &laddered.skipped {
        let outcome = match why {
            Skip::Budget => "skipped_budget",
            Skip::Down => "skipped_down",
        };
        metrics::PROVIDER_REQUESTS.add_at(host, &[provider, outcome], 1);
    }
    for (provider, budget) in &laddered.alerted {
        metrics::PROVIDER_BUDGET_ALERTS.add_at(host, &[provider], 1);
        host.log(
            LogLevel::Warn,
            &format!("{budget}: past its alert_at (alerted once this window)"),
        );
    }
    (laddered.verdict, laddered.rung)
}

/// Answers the client with `reply` (sluice's own answer).
fn send_reply(host: &dyn Host, reply: &crate::admission::answer::Reply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    host.send_reply(reply.status, &headers, &reply.body);
}

/// Gives back what an admitted verdict holds locally (a body request's
/// plan, or what a GET took): it will not go upstream after all.
fn release_local(host: &dyn Host, engine: &Engine, verdict: &Verdict, now: u64) {
    let Verdict::Admit(admitted) = verdict else {
        return;
    };
    if let Some(plan) = &admitted.plan {
        count_contention(host, engine.release(host, plan, now));
    }
    if let Some((held, _)) = &admitted.held {
        count_contention(host, engine.release_held(host, held, now));
    }
}

/// A stream reached by the root context: its handle and Envoy's context id.
type StreamCall = (Weak<RefCell<Stream>>, u32);

/// What every root context of one VM (one Envoy worker) shares: its
/// queued streams, and the policies loaded, latest last. A reload makes a
/// new root context in the same VM (the old one serves its draining
/// connections meanwhile); the concurrency gate of every stream of the VM,
/// old or new, follows the latest policy still loaded, so its limits
/// govern what waits and what is in flight (see `waiting`). With two
/// listeners of different policies in one VM, the one loaded last governs
/// both's gates (their queue state is one per backend anyway).
#[derive(Default)]
pub struct Vm {
    filters: RefCell<Vec<Weak<Filter>>>,
    waiters: Waiters,
    /// Body bytes of this VM's waiting requests
    /// (`request.max_waiting_body_bytes`; see `waiting::BodyHold`).
    waiting_bytes: Rc<Cell<u64>>,
}

/// Queued and sleeping streams of one VM, by ticket.
type Waiters = Rc<RefCell<HashMap<u64, waiting::Waiter>>>;

impl Vm {
    /// The policy loaded last whose root context still lives.
    fn latest(&self) -> Option<Rc<Filter>> {
        let filters = self.filters.try_borrow().ok()?;
        filters.iter().rev().find_map(Weak::upgrade)
    }

    fn loaded(&self, filter: &Rc<Filter>) {
        if let Ok(mut filters) = self.filters.try_borrow_mut() {
            filters.retain(|f| f.strong_count() > 0);
            filters.push(Rc::downgrade(filter));
        }
    }
}

/// One VM's policy and what its HTTP contexts share: the decoded sidecar
/// state (kept until the shared-data entry changes) and a dice for
/// half-open trickles and pause jitter.
pub struct Filter {
    pub engine: Engine,
    seen: RefCell<(u32, Rc<SidecarSeen>)>,
    dice: Cell<u64>,
    /// Principal → its salted audit hash: a SHA-256 per request saved for
    /// callers seen before. Bounded like the key-hash cache.
    audit_principals: RefCell<HashMap<String, String>>,
    /// Limits shared with the other Envoys (the policy's `fleet`).
    pub fleet: Option<crate::fleet::Fleet>,
    /// Callouts a stream made while the root context was acting for it (a
    /// queued request's strict fleet take, made as the root resumed it):
    /// the SDK delivers their answers to the root, which hands each to its
    /// stream. Token → (stream, Envoy's context id); bounded by the
    /// requests in flight (removed on the answer or at the stream's end).
    stream_calls: RefCell<HashMap<u32, StreamCall>>,
    /// Concurrency gates and this VM's queued requests (see `waiting`).
    gates: crate::queue::Gates,
    /// The VM's (see [`Vm`]).
    waiters: Waiters,
    /// This VM's wake-up queue.
    wake_queue: Cell<Option<u32>>,
    /// The VM's policy loaded last (see [`Vm`]).
    vm: Rc<Vm>,
    /// The sidecar state's version the queue last re-routed its waiters by.
    seen_by_queue: Cell<u32>,
    /// Ticks since the gauges were last published from an idle tick.
    idle_ticks: Cell<u32>,
    /// The buffer each stream's audit fragment is rendered in (one per VM:
    /// no allocation per request once it has grown).
    audit_line: audit::Buffer,
    /// Requests waiting for an identical question's answer (`flight`).
    followers: RefCell<Vec<flight::Follower>>,
}

impl Filter {
    pub fn new(engine: Engine) -> Filter {
        Filter {
            fleet: crate::fleet::Fleet::new(&engine),
            stream_calls: RefCell::default(),
            gates: crate::queue::Gates::new(&engine.policy),
            waiters: Rc::default(),
            wake_queue: Cell::new(None),
            vm: Rc::default(),
            seen_by_queue: Cell::new(0),
            idle_ticks: Cell::new(0),
            engine,
            seen: RefCell::new((0, Rc::new(SidecarSeen::default()))),
            dice: Cell::new(0),
            audit_principals: RefCell::default(),
            audit_line: audit::Buffer::default(),
            followers: RefCell::default(),
        }
    }

    /// The filter whose gates govern this one's streams: the VM's policy
    /// loaded last, or this one.
    fn latest(self: &Rc<Self>) -> Rc<Filter> {
        self.vm.latest().unwrap_or_else(|| self.clone())
    }

    /// The audit log's name of a caller (salted hash), cached per VM.
    fn audit_principal(&self, identity: &Identity) -> String {
        let Ok(mut cache) = self.audit_principals.try_borrow_mut() else {
            return self.engine.audit_principal(identity);
        };
        if let Some(hash) = cache.get(&identity.principal) {
            return hash.clone();
        }
        let hash = self.engine.audit_principal(identity);
        if cache.len() >= crate::admission::identity::KEY_HASH_CACHE {
            cache.clear();
        }
        cache.insert(identity.principal.clone(), hash.clone());
        hash
    }

    /// [`Filter::audit_principal`] lent to `with`: no copy of a cached hash.
    fn audit_principal_with(&self, identity: &Identity, with: impl FnOnce(&str)) {
        if let Ok(cache) = self.audit_principals.try_borrow() {
            if let Some(hash) = cache.get(&identity.principal) {
                return with(hash);
            }
        }
        with(&self.audit_principal(identity));
    }

    /// The sidecar state in shared data, decoded again only when it changed.
    fn seen(&self, host: &dyn Host) -> Rc<SidecarSeen> {
        let Some((bytes, cas)) = host.get(SIDECAR_KEY) else {
            return Rc::new(SidecarSeen::default());
        };
        let Ok(mut cached) = self.seen.try_borrow_mut() else {
            return Rc::new(crate::admission::route::decode_seen(&bytes));
        };
        if cached.0 != cas {
            *cached = (cas, Rc::new(crate::admission::route::decode_seen(&bytes)));
        }
        cached.1.clone()
    }

    /// Uniform in 0..1000 (xorshift; fairness, not secrecy).
    fn roll(&self, now_ms: u64) -> u32 {
        let mut x = self.dice.get();
        if x == 0 {
            x = now_ms | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.dice.set(x);
        (x % 1000) as u32
    }

    /// Defines the metrics alerts and dashboards read, at 0, before
    /// anything happens: a counter that first appears at 1 hides that
    /// first increment from Prometheus' `rate()`/`increase()` (the first
    /// surge, reroute or refusal by a bucket would never alert), and a
    /// gauge that is absent reads as "no data" rather than 0.
    fn define_metrics(&self, host: &dyn Host) {
        predefined::define(host);
        for rule in self.engine.rules() {
            metrics::REFUSALS.define_at(host, &[&rule.id]);
        }
        if let Some(cache) = &self.engine.policy.cache_compiled {
            for (model, rule) in &cache.models {
                let kinds: &[&str] = if rule.semantic {
                    &["exact", "semantic"]
                } else {
                    &["exact"]
                };
                for kind in kinds {
                    for result in ["hit", "miss"] {
                        metrics::CACHE.define_at(host, &[result, kind, model]);
                    }
                }
            }
        }
    }
}

/// The root context: policy load, tick, the sidecar's long poll.
#[derive(Default)]
pub struct Poller {
    filter: Option<Rc<Filter>>,
    /// This VM's id in the poller lease.
    id: u64,
    /// The in-flight long poll, if any.
    poll: Option<u32>,
    /// After a failed poll, wait until then.
    retry_at_ms: u64,
    /// The last poll failed (logged once per outage).
    sidecar_failing: bool,
    /// Lease returns and settlement batches to the sidecar.
    fleet: crate::fleet::FleetAgent,
    /// With queues the tick is fast; the lease still moves at `TICK_MS`.
    next_lease_ms: u64,
    /// Fleet-wide concurrency slots (see `fleet_slots`).
    slots: fleet_slots::Agent,
    /// What this VM's root contexts share.
    vm: Rc<Vm>,
}

/// The policy compiled, its callers placed under the deployment's hash
/// key (`crate::admission::hash_key`); `None` (logged): refused.
fn compile_keyed(host: &dyn Host, policy: Policy) -> Option<Engine> {
    let mut engine = Engine::compile(policy)
        .map_err(|err| host.log(LogLevel::Error, &err.to_string()))
        .ok()?;
    let key = crate::admission::hash_key::load(host, &engine.policy)
        .map_err(|err| host.log(LogLevel::Error, &err))
        .ok()?;
    engine.set_hash_key(key);
    Some(engine)
}

impl Poller {
    pub fn new() -> Poller {
        Poller::default()
    }

    /// A root context of a VM whose other root contexts share `vm` (the
    /// adapter keeps one per VM).
    pub fn in_vm(vm: Rc<Vm>) -> Poller {
        Poller {
            vm,
            ..Poller::default()
        }
    }

    /// Loads a policy. On `false` Envoy refuses the listener, and this VM
    /// keeps its last good policy.
    pub fn configure(&mut self, host: &dyn Host, config: &[u8]) -> bool {
        let policy = match Policy::from_plugin_config(config) {
            Ok(policy) => policy,
            Err(err) => {
                host.log(LogLevel::Error, &err.to_string());
                add(host, metrics::CONFIG_REJECTED, 1);
                return false;
            }
        };
        let Some(engine) = compile_keyed(host, policy) else {
            add(host, metrics::CONFIG_REJECTED, 1);
            return false;
        };
        let mut filter = Filter::new(engine);
        filter.vm = self.vm.clone();
        filter.waiters = self.vm.waiters.clone();
        filter.define_metrics(host);
        let engine = &filter.engine;
        if engine.policy.failover.is_some() {
            failover::ensure_secret(host);
        }
        match engine.prepare(host) {
            Ok(created) => host.log(
                LogLevel::Info,
                &format!(
                    "policy loaded: {} tiers, {} models, {} routes, {} buckets ({} new shared-data keys)",
                    engine.policy.tiers.len(),
                    engine.policy.models.len(),
                    engine.policy.routes.len(),
                    engine.rules().len(),
                    created
                ),
            ),
            Err(err) => {
                host.log(
                    LogLevel::Error,
                    &format!("cannot create shared-data keys: {err}"),
                );
                return false;
            }
        }
        if let Some(fleet) = &filter.fleet {
            match fleet.prepare(engine, host) {
                Ok(n) => host.log(
                    LogLevel::Info,
                    &format!("fleet: {n} new shared-data keys for leases"),
                ),
                Err(err) => {
                    host.log(
                        LogLevel::Error,
                        &format!("fleet: cannot create shared-data keys: {err}"),
                    );
                    return false;
                }
            }
        }
        if let Err(err) = cache::prepare(host, engine) {
            host.log(LogLevel::Error, &err);
            return false;
        }
        let leases = engine.policy.state.worker_leases.enabled;
        if engine.policy.sidecar.is_some() || !filter.gates.is_empty() || leases {
            // Distinct per VM: VMs start at different nanoseconds.
            let ns = host.now_ns();
            let (subsec, ms) = (ns % 1_000_000_000, ns / 1_000_000);
            if self.id == 0 {
                self.id = (subsec << 20) ^ ms.rotate_left(7) | 1;
            }
            host.set_tick_period_ms(TICK_MS);
        }
        // The gates' previous policy: the VM's last (this root's, or the
        // root context this reload replaces).
        let previous = self.vm.latest().or_else(|| self.filter.clone());
        let same_root = match (&previous, &self.filter) {
            (Some(p), Some(own)) => Rc::ptr_eq(p, own),
            _ => false,
        };
        waiting::configure(&filter, previous.as_deref(), same_root, host, self.id);
        let filter = Rc::new(filter);
        self.vm.loaded(&filter);
        waiting::after_configure(&filter, host);
        // The policy replaced gives back this worker's leases (else they
        // would count as used until they drain).
        if let Some(old) = &self.filter {
            let now = host.now_ms();
            count_contention(host, old.engine.return_leases(host, now));
            if let Some(fleet) = &old.fleet {
                fleet.close_sub_leases(&old.engine, host, now);
            }
        }
        self.filter = Some(filter);
        true
    }

    /// A new HTTP stream's context; `None` before a policy loaded.
    pub fn request(&self) -> Option<Request> {
        self.request_for(0)
    }

    /// A new HTTP stream's context, with Envoy's id for it (a queued
    /// request is resumed by id).
    pub fn request_for(&self, context_id: u32) -> Option<Request> {
        self.filter
            .clone()
            .map(|filter| Request::wrap(Stream::new(filter), context_id))
    }

    /// Messages on this VM's wake-up queue: queued requests granted a slot.
    pub fn on_wake(&mut self, host: &dyn Host) {
        if let Some(filter) = self.filter.clone() {
            waiting::on_wake(&filter, host);
        }
    }

    pub fn tick(&mut self, host: &dyn Host) {
        let now = host.now_ms();
        if let Some(filter) = self.filter.clone() {
            flight::tick(&filter, host, now);
        }
        // This worker's leases due back (`state.worker_leases`).
        if let Some(filter) = self.filter.clone() {
            count_contention(host, filter.engine.leases_tick(host, now));
            if let Some(fleet) = &filter.fleet {
                fleet.return_sub_leases(&filter.engine, host, now);
            }
            if filter.engine.policy.sidecar.is_none() && filter.gates.is_empty() {
                return;
            }
        }
        if let Some(filter) = self
            .filter
            .clone()
            .filter(|f| !f.gates.is_empty() || waiting::has_waiters(f))
        {
            waiting::tick(&filter, host, now);
            if filter.fleet.is_some() && self.polls(host, now) {
                self.slots.tick(&filter, host, now);
            }
            if now < self.next_lease_ms {
                return;
            }
            self.next_lease_ms = now + TICK_MS;
        }
        // The lease is renewed on every tick, also while a long poll is in
        // flight: else another VM would take it mid-poll.
        if !self.hold_lease(host, now) {
            return;
        }
        if let Some(filter) = self.filter.clone() {
            if let Some(fleet) = &filter.fleet {
                self.fleet.tick(fleet, &filter.engine, host, self.id, now);
            }
        }
        if self.poll.is_some() || now < self.retry_at_ms {
            return;
        }
        self.dispatch_poll(host, now);
    }

    /// This VM holds the poller lease (read only; `hold_lease` renews it).
    fn polls(&self, host: &dyn Host, now: u64) -> bool {
        let lease = host.get(POLLER_KEY).map(|(b, _)| b).unwrap_or_default();
        let lease = PollLease::decode(&lease);
        lease.owner == self.id && lease.expires_ms > now
    }

    /// Takes or renews the poller lease: one VM in the whole Envoy polls.
    fn hold_lease(&self, host: &dyn Host, now: u64) -> bool {
        let tries = self.filter.as_ref().map_or(1, |f| f.engine.tries().take());
        let mut cas = Cas::new(host, tries);
        let held = cas.update(POLLER_KEY, |bytes| {
            let lease = PollLease::decode(bytes.unwrap_or_default());
            if lease.owner != self.id && lease.expires_ms > now {
                return None; // another VM polls
            }
            let next = PollLease {
                owner: self.id,
                expires_ms: now + LEASE_MS,
            };
            Some(next.encode())
        });
        count_contention(host, cas.contention);
        held == Updated::Written
    }

    fn dispatch_poll(&mut self, host: &dyn Host, now: u64) {
        let Some(filter) = self.filter.clone() else {
            return;
        };
        let Some(sidecar) = filter.engine.policy.sidecar.as_ref() else {
            return;
        };
        let since = filter.seen(host).state.as_ref().map_or(0, |s| s.version);
        let wait_s = route::poll_wait_s(sidecar.poll_wait_ms, sidecar.stale_after_ms);
        let path = format!("/v1/state?since={since}&wait={wait_s}");
        let authority = sidecar.authority.as_deref().unwrap_or(&sidecar.cluster);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority),
        ];
        let timeout_ms = wait_s * 1000 + 5_000;
        match host.dispatch_call(&sidecar.cluster, &headers, timeout_ms) {
            Ok(token) => self.poll = Some(token),
            Err(why) => {
                add(host, metrics::SIDECAR_POLL_ERRORS, 1);
                host.log(
                    LogLevel::Warn,
                    &format!(
                        "cannot poll the sidecar (cluster {}): {why}",
                        sidecar.cluster
                    ),
                );
                self.retry_at_ms = now + POLL_RETRY_MS;
            }
        }
    }

    /// The sidecar's answer: stored for every worker, then the next poll.
    pub fn on_call_response(&mut self, host: &dyn Host, token: u32, body_size: usize) {
        if let Some(filter) = self.filter.clone() {
            let call = filter
                .stream_calls
                .try_borrow_mut()
                .ok()
                .and_then(|mut calls| calls.remove(&token));
            if let Some((stream, context_id)) = call {
                let stream = stream.upgrade();
                if let Some(mut stream) = stream.as_ref().and_then(|s| s.try_borrow_mut().ok()) {
                    if host.set_effective_context(context_id) {
                        stream.on_call_response(host, token, body_size);
                    }
                }
                return;
            }
        }
        if self.slots.owns(token) {
            if let Some(filter) = self.filter.clone() {
                self.slots.on_answer(&filter, host, token, body_size);
            }
            return;
        }
        if self.fleet.owns(token) {
            if let Some(filter) = self.filter.clone() {
                if let Some(fleet) = &filter.fleet {
                    let now = host.now_ms();
                    self.fleet
                        .on_answer(fleet, &filter.engine, host, token, body_size, now);
                }
            }
            return;
        }
        if self.poll != Some(token) {
            return;
        }
        self.poll = None;
        let now = host.now_ms();
        let status = host.call_response_header(":status");
        let body = host.call_response_body(body_size);
        let state = match (
            status.as_deref(),
            serde_json::from_slice::<route::SidecarState>(&body),
        ) {
            (Some("200"), Ok(state)) => state,
            (status, parsed) => {
                add(host, metrics::SIDECAR_POLL_ERRORS, 1);
                self.retry_at_ms = now + POLL_RETRY_MS;
                if !self.sidecar_failing {
                    // Said once per outage, not once per retry.
                    self.sidecar_failing = true;
                    let why = match (status, parsed) {
                        (Some("200"), Err(e)) => format!("unreadable state: {e}"),
                        (Some(code), _) => format!("status {code}"),
                        (None, _) => "no answer".into(),
                    };
                    host.log(
                        LogLevel::Warn,
                        &format!("sidecar unreachable ({why}); keeping its last state for stale_after, then the on_stale policy"),
                    );
                }
                return;
            }
        };
        if std::mem::take(&mut self.sidecar_failing) {
            host.log(LogLevel::Info, "sidecar reachable again");
        }
        add(host, metrics::SIDECAR_POLLS, 1);
        set_gauge(
            host,
            metrics::KILL_SWITCH,
            u64::from(state.kill_switch.active),
        );
        let open = state
            .breakers
            .iter()
            .filter(|b| b.state == crate::admission::route::BreakerState::Open)
            .count();
        set_gauge(host, metrics::BREAKERS_OPEN, open as u64);
        // One writer (the lease holder): no CAS needed. Every answer, even
        // an unchanged state, refreshes the receive time.
        let _ = host.set(
            SIDECAR_KEY,
            &crate::admission::route::encode_seen(now, &body),
            0,
        );
        if self.hold_lease(host, now) {
            self.dispatch_poll(host, now);
        }
    }
}

/// An HTTP stream as Envoy's callbacks reach it: a handle on the
/// [`Stream`], shared with the root context while the request waits in a
/// queue. Callbacks never nest, so a borrow always succeeds; if one did
/// not, the callback lets the stream continue rather than panic.
pub struct Request {
    stream: Rc<RefCell<Stream>>,
}

impl Request {
    fn with(&self, f: impl FnOnce(&mut Stream) -> Action) -> Action {
        match self.stream.try_borrow_mut() {
            Ok(mut stream) => f(&mut stream),
            Err(_) => Action::Continue,
        }
    }

    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        self.with(|s| s.on_request_headers(host, end_of_stream))
    }

    pub fn on_request_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        self.with(|s| s.on_request_body(host, body_size, end))
    }

    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        self.with(|s| s.on_request_trailers(host))
    }

    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        self.with(|s| s.on_response_headers(host))
    }

    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        self.with(|s| s.on_response_body(host, body_size, end))
    }

    pub fn on_log(&mut self, host: &dyn Host) {
        self.with(|s| {
            s.on_log(host);
            Action::Continue
        });
    }

    /// The answer to a callout this stream made (the fleet's strict take).
    pub fn on_call_response(&mut self, host: &dyn Host, token: u32, body_size: usize) {
        self.with(|s| {
            s.on_call_response(host, token, body_size);
            Action::Continue
        });
    }

    /// The audit fragment this stream would write now, as a JSON object.
    #[cfg(test)]
    fn audit_line(&self) -> serde_json::Value {
        let mut fragment = String::new();
        if let Ok(s) = self.stream.try_borrow() {
            s.audit.render(&mut fragment, &[]);
        }
        let text = format!("{{\"status\":0{fragment}}}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }
}

thread_local! {
    /// A stream's path until its request headers are read (one per VM,
    /// shared: a stream copies nothing for it).
    static EMPTY_PATH: Rc<str> = Rc::from("");
}

/// One HTTP stream, from its request headers to its access log (behind
/// [`Request`], which the root context can also reach while it waits).
pub struct Stream {
    filter: Rc<Filter>,
    /// Shared, not copied, by the steps that outlive a borrow of the
    /// stream (its two strings were copied twice a request).
    identity: Option<Rc<Identity>>,
    api: Api,
    /// The canonical path (`demand::canonical_path`), for route buckets
    /// (shared by the steps that borrow the stream meanwhile).
    path: Rc<str>,
    /// The request headers, read once (after the fallback header is
    /// removed) for every header the path reads: one host call.
    request_headers: Option<Headers>,
    /// Request body bytes buffered so far (for a request that ends with
    /// trailers, the body is read in the trailers callback).
    body_size: usize,
    /// Where the stream is, with what exists only there (`phase`).
    phase: Phase,
    /// The response's status (0 before its headers).
    status: u32,
    /// When the request arrived.
    started_ms: u64,
    /// SHA-256 of the response body, when the audit asks for it.
    response_hash: Option<sha2::Sha256>,
    /// Envoy's id of this stream, and the handle the root wakes it by.
    context_id: u32,
    me: Weak<RefCell<Stream>>,
    /// Its concurrency slot, queue entry or sleep: from the gate to the
    /// end of the answer, across phases (it is given back exactly once).
    gate: Option<waiting::GateState>,
    /// The response cache: asked once per request; what to store after
    /// the answer, from the lookup to the answer's end (see `cache`).
    cache_looked: bool,
    cache_store: Option<cache::ToStore>,
    /// This request's claim on its question in flight (it leads), and
    /// until when it may follow another's (see `flight`).
    flight: Option<flight::FlightSlot>,
    follow_until: Option<u64>,
    /// The audit fields so far, written once at the end (`audit`).
    audit: audit::AuditRecord,
    /// What a request sent upstream keeps to be sent down the ladder
    /// should its rung fail (`failover`).
    resend: Option<Box<failover::Resend>>,
    /// The length of the body as it is to be sent (after a rewrite).
    sent_len: usize,
}

impl Stream {
    pub fn new(filter: Rc<Filter>) -> Stream {
        Stream {
            context_id: 0,
            me: Weak::new(),
            gate: None,
            filter,
            identity: None,
            api: Api::Other,
            path: EMPTY_PATH.with(Rc::clone),
            request_headers: None,
            body_size: 0,
            phase: Phase::Undecided,
            status: 0,
            started_ms: 0,
            response_hash: None,
            cache_looked: false,
            cache_store: None,
            flight: None,
            follow_until: None,
            audit: audit::AuditRecord::default(),
            resend: None,
            sent_len: 0,
        }
    }

    fn engine(&self) -> &Engine {
        &self.filter.engine
    }

    /// The verdict is applied: answered here, or let through.
    fn decided(&self) -> bool {
        matches!(self.phase, Phase::Answered | Phase::Upstream(_))
    }

    fn upstream(&mut self) -> Option<&mut Upstream> {
        match &mut self.phase {
            Phase::Upstream(up) => Some(up),
            _ => None,
        }
    }

    /// A request header, from the snapshot of the request headers.
    fn header(&self, host: &dyn Host, name: &str) -> Option<String> {
        crate::admission::identity::RequestView::header(
            &HostRequest(host, self.request_headers.as_ref()),
            name,
        )
        .map(Cow::into_owned)
    }

    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        self.started_ms = host.now_ms();
        if self.strip_fallback_header(host) {
            // An attempt of this Envoy's own failover: admitted already.
            self.phase = Phase::Answered;
            return Action::Continue;
        }
        // The path, method and length are read where the snapshot holds
        // them (not copied out): only the path the stream keeps is.
        let view = HostRequest(host, self.request_headers.as_ref());
        let raw_path = view.header(":path").unwrap_or_default();
        let path = match crate::usage::demand::canonical_path(&raw_path) {
            Ok(canonical) => Ok(Rc::<str>::from(canonical.as_ref())),
            Err(_) => Err(Rc::<str>::from(raw_path.as_ref())),
        };
        // A body on any method is read (a lenient server may serve it);
        // a bodyless POST is classified too (and refused if it is no API).
        let length = view.header("content-length");
        let with_body = self.carries_body(host, length.as_deref(), end_of_stream);
        let post = view
            .header(":method")
            .is_some_and(|m| m.eq_ignore_ascii_case("POST"));
        let work = with_body || post;
        let length = length.and_then(|v| v.trim().parse::<u64>().ok());
        self.api = match path.as_deref() {
            Ok(path) if work => Api::of_path(path),
            _ => Api::Other,
        };
        let identity = match self.caller(host) {
            Ok(identity) => identity,
            Err(refused) => return refused,
        };
        if let Some(verdict) = self.endpoint(host, &identity, path, work) {
            return self.finish(host, verdict);
        }
        let declared = if self.api.reads_body() { length } else { None };
        if let Some(verdict) = declared.and_then(|len| self.engine().too_large(&identity, len)) {
            return self.finish(host, verdict);
        }
        let large = declared.is_none_or(|len| len > precheck::EARLY_REFUSAL_BYTES);
        if self.api.reads_body() && !end_of_stream && large {
            // The caller's own empty bucket refuses it before its body is
            // buffered and parsed (`flow/precheck.rs`).
            if let Some(verdict) = self.refused_before_body(host, &identity) {
                add(host, metrics::REFUSED_BEFORE_BODY, 1);
                self.identity = Some(Rc::new(identity));
                return self.finish(host, verdict);
            }
        }
        self.identity = Some(Rc::new(identity));
        if self.api.reads_body() && !end_of_stream {
            return Action::Pause; // wait for the body
        }
        self.decide(host, &[])
    }

    /// Only sluice may choose the fallback route, also when the policy has
    /// no `fallback` section but the Envoy routes still match it: the
    /// routing header is removed, and the request headers kept without it.
    ///
    /// `true`: the request is an attempt of this Envoy's own failover
    /// (`failover`), its marker checked and removed; its routing header
    /// stays, it was set by sluice.
    fn strip_fallback_header(&mut self, host: &dyn Host) -> bool {
        let header = self
            .engine()
            .route_header()
            .unwrap_or(crate::admission::ladder::DEFAULT_ROUTE_HEADER);
        let mut headers = host.request_headers();
        if failover::strip_attempt(host, &mut headers) {
            self.request_headers = headers;
            return true;
        }
        // Removed only when sent (a host call saved on every other
        // request); a host that cannot list the headers removes it anyway.
        let sent = headers.as_ref().is_none_or(|all| all.count(header) > 0);
        if sent {
            host.set_request_header(header, None);
            if let Some(all) = headers.as_mut() {
                all.remove(header);
            }
        }
        self.request_headers = headers;
        false
    }

    /// Who is calling, unless the penalty box holds them: the identity, or
    /// the action of the refusal already answered (an unknown key's 401, or
    /// the box's 429).
    fn caller(&mut self, host: &dyn Host) -> Result<Identity, Action> {
        let view = HostRequest(host, self.request_headers.as_ref());
        let identity = match self.engine().identify_why(&view) {
            Ok(identity) => identity,
            Err((verdict, why)) => {
                // A failed authentication counts toward its address's box
                // (guessing keys is what the box is for); once blocked, the
                // address gets 429 `temporarily_blocked` instead of 401.
                metrics::AUTH_FAILURES.add_at(host, &[why.code()], 1);
                let (blocked, checked) =
                    self.engine()
                        .penalty_box_failed(host, &view, self.started_ms);
                count_penalty_box(host, &checked);
                if blocked.is_none() {
                    // (A block's verdict carries its contention.)
                    count_contention(host, checked.contention);
                }
                return Err(self.finish(host, blocked.unwrap_or(*verdict)));
            }
        };
        let (blocked, checked) = self
            .engine()
            .penalty_box(host, &view, &identity, self.started_ms);
        count_penalty_box(host, &checked);
        if let Some(verdict) = blocked {
            self.identity = Some(Rc::new(identity));
            return Err(self.finish(host, verdict));
        }
        count_contention(host, checked.contention);
        Ok(identity)
    }

    /// The path the request is matched by (canonical, or the raw one when
    /// it has none) and the API it speaks; or the refusal of a request
    /// that may be an LLM call sluice cannot read: a path with no
    /// canonical form (whatever the upstream decodes it to, sluice cannot
    /// know), or work outside every `passthrough` rule (deny by default).
    fn endpoint(
        &mut self,
        host: &dyn Host,
        identity: &Identity,
        path: Result<Rc<str>, Rc<str>>,
        work: bool,
    ) -> Option<Verdict> {
        match path {
            Ok(path) => self.path = path,
            Err(_) if work => return Some(self.engine().ambiguous_path(identity)),
            Err(raw) => self.path = raw,
        }
        if self.api == Api::Other && work {
            // A declared API first (the policy refuses a path that is
            // both), then the passthrough rules.
            let view = HostRequest(host, self.request_headers.as_ref());
            let method = view.header(":method").unwrap_or_default();
            self.api = self
                .engine()
                .declared_api(&method, &self.path)
                .unwrap_or_else(|| self.engine().passthrough(&method, &self.path));
            if self.api == Api::Other {
                return Some(self.engine().unknown_endpoint(identity));
            }
        }
        None
    }

    /// Does a body follow the request headers? The stream not ending with
    /// them (HTTP/2 DATA frames, also on a GET), a non-zero
    /// `content-length`, or any `transfer-encoding` say so.
    fn carries_body(&self, host: &dyn Host, length: Option<&str>, end_of_stream: bool) -> bool {
        let declared = length.is_some_and(|v| v.trim().parse::<u64>() != Ok(0));
        !end_of_stream || declared || self.header(host, "transfer-encoding").is_some()
    }

    pub fn on_request_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        if self.decided() {
            return Action::Continue;
        }
        let Some(identity) = self.identity.as_ref() else {
            return Action::Continue;
        };
        if let Some(verdict) = self.engine().too_large(identity, body_size as u64) {
            return self.finish(host, verdict);
        }
        self.body_size = body_size;
        if !end {
            // Buffer until the whole body is here: the end of the body, or
            // trailers after it (HTTP/2, HTTP/3).
            return Action::Pause;
        }
        let body = host.request_body(body_size);
        self.decide(host, &body)
    }

    /// A request that ends with trailers never has a body callback with
    /// `end_of_stream`: this is where it is decided, on the buffered body.
    /// Without it, Envoy would resume the paused request on its own when
    /// the trailers arrive — upstream, undecided.
    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        if self.decided() || self.identity.is_none() {
            return Action::Continue;
        }
        let body = host.request_body(self.body_size);
        self.decide(host, &body)
    }

    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        self.status = host
            .response_header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if matches!(&self.phase, Phase::Upstream(up) if up.watch.is_some()) {
            // The provider's own x-ratelimit-* headers, read before sluice
            // adds its own (same names: they describe the caller's buckets).
            self.observe_provider_limits(host);
        }
        let headers = self
            .upstream()
            .map(|up| std::mem::take(&mut up.response_headers));
        for (name, value) in headers.unwrap_or_default().iter() {
            host.set_response_header(name, Some(value));
        }
        self.cache_response_headers(host);
        if let Some(watch) = self.upstream().and_then(|up| up.watch.take()) {
            // A good status is recorded once the answer ends (`on_log`):
            // a stream its upstream breaks after it is a failure.
            let good = self.status < 400;
            match self.upstream().filter(|_| good) {
                Some(up) => up.late = Some(watch),
                None => self.observe_upstream(host, self.status, &watch),
            }
        }
        if let Some(action) = self.fail_over(host) {
            return action;
        }
        let Some(up) = self.upstream() else {
            return Action::Continue;
        };
        if let Some(plan) = &up.plan {
            let content_type = host.response_header("content-type");
            let ollama = matches!(plan.api, Api::OllamaChat | Api::OllamaGenerate);
            // A declared API's answer passes as it comes, read whole.
            let format = match plan.answer_at {
                Some(_) => Format::Json,
                None => Format::detect(content_type.as_deref(), plan.stream && ollama),
            };
            // A stream may run past its allowance only if the upstream
            // ignores the max output it was given; then sluice ends it.
            let allowance = plan.stream.then_some(plan.max_output);
            if format != Format::Json {
                // sluice may change the stream's length.
                host.set_response_header("content-length", None);
            }
            up.meter = Some(match &plan.answer_at {
                Some(at) => ResponseMeter::declared(at.clone(), plan.max_output),
                None => ResponseMeter::new(format, plan.strip_usage, allowance),
            });
        }
        Action::Continue
    }

    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize, end: bool) -> Action {
        if self.resend.as_ref().is_some_and(|r| r.peeking) {
            return self.peeked(host, body_size, end);
        }
        if self.resend.as_ref().is_some_and(|r| r.holding) {
            // A failed answer held while the next rung is tried: buffered,
            // never sent (unless every rung fails).
            return Action::Pause;
        }
        // Latency histograms describe model calls (the LLM APIs), not
        // `/v1/models` and the like.
        let model_call = body_size > 0 && self.api.reads_body();
        if let Phase::Upstream(up) = &mut self.phase {
            up.event_ms = None;
            if model_call && !up.first_byte {
                up.first_byte = true;
                let ttft = up.event_now(host).saturating_sub(self.started_ms);
                metrics::TTFT_MS.record_at(host, &[&up.labels.1], ttft);
                self.audit.number(audit::Field::TtftMs, ttft);
            }
            if end && self.api.reads_body() {
                // The log's end-to-end latency ends here (no second clock
                // read).
                up.ended_ms = Some(up.event_now(host));
            }
        }
        let metered = matches!(&self.phase, Phase::Upstream(up) if up.meter.is_some());
        if !metered && self.response_hash.is_none() && self.cache_store.is_none() {
            self.end_event();
            return Action::Continue;
        }
        // A stream cut in an earlier callback whose upstream sends on: the
        // server ignores the limit it was sent and generates on. The cut's
        // own chunk (its error event and `[DONE]`) went to the client in
        // that callback; now the stream is reset, once, so the server stops
        // (never in the cut's own callback: the host resets before that
        // callback's chunk is passed on, and the client would lose its
        // end). An upstream that ends in this chunk is not reset.
        let reset = !end
            && self
                .upstream()
                .is_some_and(|up| !up.reset && up.meter.as_ref().is_some_and(|m| m.cut));
        let chunk = host.response_body(body_size);
        if let Some(hash) = self.response_hash.as_mut() {
            sha2::Digest::update(hash, &chunk);
            if end {
                let digest = sha2::Digest::finalize(hash.clone());
                let hex = crate::policy::keys::hex(&digest);
                self.audit.text(audit::Field::ResponseSha256, &hex);
            }
        }
        let out = self
            .upstream()
            .and_then(|up| up.meter.as_mut())
            .and_then(|m| m.feed(&chunk, end));
        // After the meter: a stream it cut is never stored.
        let cut = self
            .upstream()
            .and_then(|up| up.meter.as_ref())
            .is_some_and(|m| m.cut);
        self.cache_feed(host, &chunk, end, cut);
        if end {
            // Stored (or not): the followers look again.
            self.land_flight(host);
        }
        if let Some(out) = out.filter(|out| *out != chunk) {
            host.replace_response_body(body_size, &out);
        }
        if reset {
            if let Some(up) = self.upstream() {
                up.reset = true;
            }
            // Settled in `on_log`, which the reset brings, from what the
            // meter counted up to the cut.
            add(host, metrics::STREAM_RESET, i64::from(host.reset_stream()));
        }
        if end {
            self.settle(host);
            self.release_slot(host);
        }
        self.end_event();
        Action::Continue
    }

    /// The response callback is over: the next reads the clock again.
    fn end_event(&mut self) {
        if let Some(up) = self.upstream() {
            up.event_ms = None;
        }
    }

    pub fn on_log(&mut self, host: &dyn Host) {
        // Still waiting for the fleet: the answer has no one to go to, and
        // what the request holds (its local reservation, the take) is given
        // back — nothing else would (it never reached the upstream phase).
        if matches!(self.phase, Phase::Fleet(_)) {
            if let Phase::Fleet(wait) = std::mem::replace(&mut self.phase, Phase::Answered) {
                self.abandon_fleet_wait(host, *wait);
            }
        }
        // The answer's outcome, for the route's breaker.
        self.observe_late(host);
        // A failover attempt still waiting for the fleet gives back its take.
        self.abandon_fleet_attempt(host);
        // Client gone, upstream reset or timeout: settle from what was seen.
        self.settle(host);
        // A claim on its question goes back (no answer will be stored).
        self.land_flight(host);
        // Its slot or queue entry is given back (once, whichever came first).
        self.leave_gate(host);
        // A probe whose answer never came (the client left first) is given
        // back, not left to block the route until its lease ends.
        let watch = self.upstream().and_then(|up| up.watch.take());
        self.give_back_probe(host, watch);
        let answered = self.status != 0 && self.api.reads_body();
        let started_ms = self.started_ms;
        if let Some(up) = self.upstream().filter(|_| answered) {
            let model = &up.labels.1;
            let ended = up.ended_ms.unwrap_or_else(|| host.now_ms());
            let elapsed = ended.saturating_sub(started_ms);
            metrics::E2E_MS.record_at(host, &[model], elapsed);
        }
        self.write_audit(host);
    }

    /// The audit record in filter state, in one host call: the fragment
    /// Envoy's access log splices in as
    /// `%FILTER_STATE(wasm.sluice_audit:PLAIN)%` (see `audit`); only with
    /// an `audit` policy. The request's own fields come from the headers
    /// read at its start (no host call when they were read).
    fn write_audit(&mut self, host: &dyn Host) {
        if self.engine().policy.audit.is_none() {
            return;
        }
        let read;
        let request = match self.request_headers.as_ref() {
            Some(headers) => headers,
            // Never read (a stream Envoy ended before its headers): ask.
            None => {
                read = host.request_headers().unwrap_or_default();
                &read
            }
        };
        let find = |name: &str| request.get(name);
        let own = [
            (audit::Field::RequestId, find("x-request-id")),
            (audit::Field::Method, find(":method")),
            (audit::Field::Route, find(":path")),
        ];
        self.filter.audit_line.with(|line| {
            self.audit.render(line, &own);
            host.set_property(audit::PROPERTY, line.as_bytes());
        });
    }

    /// Applies a verdict: answer locally, or let the request go upstream.
    fn finish(&mut self, host: &dyn Host, verdict: Verdict) -> Action {
        self.phase = Phase::Answered;
        self.record(host, &verdict);
        if verdict.is_admitted() && self.engine().policy.anomaly.is_some() {
            // Admission passed the global breaker: it is closed now (else
            // the gauge would stay at 1 after the hour's window let spend
            // fall under the ceiling, until a settlement).
            set_gauge(host, metrics::GLOBAL_BREAKER, 0);
        }
        self.audit_decision(&verdict);
        match verdict {
            Verdict::Answer(answered) => {
                // Refused after it took a slot (a budget at dispatch).
                self.release_slot(host);
                // A local answer (a refusal, the static answer) is never
                // cached.
                self.cache_store = None;
                send_reply(host, &answered.into_reply());
                Action::Pause
            }
            Verdict::Admit(verdict) => {
                let mut response_headers = verdict.response_headers;
                if let Some(waited) = self.gate.as_ref().map(|g| g.waited_ms) {
                    response_headers.push_number("x-sluice-queued-ms", waited);
                }
                let engine = &self.filter.engine;
                let plan = verdict.plan.filter(|p| engine.settles(p));
                if plan.is_some() {
                    add(host, metrics::RESERVATIONS_OUTSTANDING, 1);
                }
                self.phase = Phase::Upstream(Upstream {
                    // Latency and token metrics describe requests that
                    // went upstream.
                    labels: (verdict.labels.tier, verdict.labels.model),
                    response_headers,
                    plan,
                    watch: None,
                    fleet_claims: Vec::new(),
                    meter: None,
                    first_byte: false,
                    event_ms: None,
                    ended_ms: None,
                    reset: false,
                    late: None,
                });
                Action::Continue
            }
        }
    }

    /// Applies a verdict the fleet let through (or that never asked it):
    /// the upstream phase keeps what the primary's answer will feed and
    /// the fleet's claims until they are settled.
    fn finish_onward(
        &mut self,
        host: &dyn Host,
        verdict: Verdict,
        watch: Option<Watch>,
        fleet_claims: Vec<crate::fleet::Claimed>,
    ) -> Action {
        let action = self.finish(host, verdict);
        match self.upstream() {
            Some(up) => {
                up.watch = watch;
                up.fleet_claims = fleet_claims;
            }
            // Answered here after all: a probe it held learned nothing.
            None => self.give_back_probe(host, watch),
        }
        action
    }

    /// The route's half-open probe, given back unanswered (the request
    /// was answered here, or its client left first), so the next request
    /// may probe at once instead of when the lease ends. A release that
    /// cannot be written leaves the lease to expire.
    fn give_back_probe(&self, host: &dyn Host, watch: Option<Watch>) {
        let Some((lease, pushback)) = watch.and_then(|w| Some((w.probe_lease?, w.pushback))) else {
            return;
        };
        let mut cas = Cas::new(host, self.engine().tries().take());
        route::release_probe(&mut cas, &pushback.route_key, lease);
        count_contention(host, cas.contention);
    }

    /// The decision's metrics.
    fn record(&self, host: &dyn Host, verdict: &Verdict) {
        let l = verdict.labels();
        metrics::REQUESTS.add_at(
            host,
            &[
                l.decision.code(),
                l.decision.reason_code(),
                &l.tier,
                &l.model,
            ],
            1,
        );
        count_contention(host, verdict.contention());
        add(
            host,
            metrics::CAPACITY_EXHAUSTED,
            i64::from(verdict.no_slot()),
        );
        add(
            host,
            metrics::BUDGET_ALERTS,
            i64::from(!verdict.alerts().is_empty()),
        );
        if let Some(bucket) = verdict.bucket() {
            metrics::REFUSALS.add_at(host, &[bucket], 1);
        }
        if let Some(id) = self
            .identity
            .as_ref()
            .filter(|id| id.team.is_some() || id.org.is_some())
        {
            let (team, org) = (id.team.as_deref(), id.org.as_deref());
            metrics::TEAM_REQUESTS.add_at(
                host,
                &[
                    l.decision.code(),
                    l.decision.reason_code(),
                    team.unwrap_or("none"),
                    org.unwrap_or("none"),
                ],
                1,
            );
        }
        if l.decision == Decision::Refuse(Reason::GlobalBreakerOpen) {
            set_gauge(host, metrics::GLOBAL_BREAKER, 1);
        }
        if let Some(kind) = verdict.degraded() {
            metrics::DEGRADED.add_at(host, &[kind.code(), &l.tier, &l.model], 1);
        }
        if let Some(plan) = verdict.plan() {
            let tokens = |direction| [direction, "estimated", l.tier.as_str(), l.model.as_str()];
            metrics::TOKENS.add_at(host, &tokens("input"), plan.input_estimate as i64);
            metrics::TOKENS.add_at(host, &tokens("output"), plan.max_output as i64);
        }
    }

    /// The decision's audit fields (nothing without an `audit` policy).
    fn audit_decision(&mut self, verdict: &Verdict) {
        use audit::Field;
        if self.engine().policy.audit.is_none() {
            return;
        }
        let l = verdict.labels();
        let record = &mut self.audit;
        record.code(Field::Decision, l.decision.code());
        record.code(Field::Reason, l.decision.reason_code());
        record.text(Field::Tier, &l.tier);
        if let Some(identity) = &self.identity {
            self.filter
                .audit_principal_with(identity, |hash| record.text(Field::Principal, hash));
            if let Some(team) = &identity.team {
                record.text(Field::Team, team);
            }
            if let Some(org) = &identity.org {
                record.text(Field::Org, org);
            }
        }
        if let Some(bucket) = verdict.bucket() {
            record.text(Field::Bucket, bucket);
        }
        if let Some(kind) = verdict.degraded() {
            record.code(Field::Degraded, kind.code());
        }
        if let Some(plan) = verdict.plan() {
            let served = plan.rung.as_ref().and_then(|(_, m)| m.as_deref());
            record.text(
                Field::ModelServed,
                served.or(plan.model.as_deref()).unwrap_or(""),
            );
            if let Some((provider, _)) = &plan.rung {
                record.text(Field::Provider, provider);
            }
            let reserved = plan.input_estimate.saturating_add(plan.max_output);
            record.number(Field::TokensEstimated, reserved);
        }
    }

    /// Admission once everything the policy needs is known: demand → the
    /// cache → the decision's tail (`conclude`).
    fn decide(&mut self, host: &dyn Host, body: &[u8]) -> Action {
        let Some(identity) = self.identity.clone() else {
            return Action::Continue;
        };
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let asked = match engine.demand(&identity, self.api, body) {
            Ok(asked) => asked,
            Err(verdict) => return self.finish(host, *verdict),
        };
        if let Some(a) = &asked {
            // An `/invocations` body's API, as its shape says.
            self.api = a.demand.api;
        }
        // Admission time is arrival time (one clock read per request).
        let now = self.started_ms;
        let model = asked
            .as_ref()
            .and_then(|a| a.demand.model.as_deref())
            .or(engine.passthrough_model(self.api));
        self.audit_request(model, body);
        if let Some(action) = self.cache_lookup(host, asked.as_ref(), model) {
            return action;
        }
        let parked = waiting::Parked {
            asked,
            body_len: body.len(),
            hold: None,
        };
        self.conclude(host, identity, parked, now)
    }

    /// The decision's tail, the same for a request as it arrives and for
    /// one whose turn in the queue came (`dispatch`): route (as of `now`)
    /// → the model's gate unless it holds a slot already → admit → a
    /// bucket wait → probe claim → on to the upstream (`send_on`: rerouted
    /// or watched, rewritten, through the fleet's gate).
    fn conclude(
        &mut self,
        host: &dyn Host,
        identity: Rc<Identity>,
        mut parked: waiting::Parked,
        now: u64,
    ) -> Action {
        #[cfg(test)]
        CONCLUDED.with(|c| c.set(c.get() + 1));
        let filter = self.filter.clone();
        let engine = &filter.engine;
        let path = self.path.clone();
        let ctx = RequestContext {
            identity: &identity,
            api: self.api,
            path: &path,
            asked: parked.asked.as_ref(),
            now_ms: now,
        };
        let model = ctx
            .asked
            .and_then(|a| a.demand.model.as_deref())
            .or(engine.passthrough_model(self.api));
        let (mut pushback, seen, dice) = self.world(host, &identity, model, now);
        let route = |pushback: &Pushback| engine.route(&ctx, &seen, pushback, dice);
        let holds_slot = self.gate.as_ref().is_some_and(|g| g.slot);
        let (rung, probe, gate) = match route(&pushback) {
            // A route paused by the upstream's Retry-After: a caller whose
            // class may wait that long waits the pause out in the model's
            // queue (a slot it held goes to the next waiter meanwhile).
            Routed::Answered(verdict) if self.pause_gate(host, &verdict, &pushback, model, now) => {
                self.release_slot(host);
                (None, false, true)
            }
            // A 503 or the static answer (a slot it held is given back
            // as the answer goes).
            Routed::Answered(verdict) => return self.finish(host, *verdict),
            Routed::Rung(served) => {
                // A queued request's slot of the primary goes to the next
                // waiter.
                self.leave_for_fallback(host);
                (Some(served), false, false)
            }
            // The model's concurrency gate, unless its turn in the queue
            // already gave it a slot.
            Routed::Primary => (None, false, !holds_slot),
            // The half-open probe is one request: it takes no slot.
            Routed::Probe => (None, true, false),
        };
        if gate {
            // Its body must fit the VM's bound on waiting bodies, should it
            // wait: else 429 `queue_full` before it takes a place.
            if !self.hold_body(&mut parked.hold, parked.body_len) {
                return self.refuse_waiting_body(host, &identity, model);
            }
            // A slot, a place in the queue (budgets are reserved when its
            // turn comes), or a refusal; a request that waited already
            // waits at most what is left of its class's wait.
            let since = self.gate.as_ref().map_or(now, |g| g.arrived_ms);
            let (gated, gate) = self.pass_gate(host, &identity, ctx.asked, since, now);
            self.gate = gate;
            match gated {
                waiting::Gated::Go => {}
                waiting::Gated::Answered(verdict) => return self.finish(host, *verdict),
                waiting::Gated::Wait => {
                    self.phase = Phase::Parked(parked);
                    return Action::Pause;
                }
                waiting::Gated::Sleep(until) => {
                    // Its buckets free up within its wait: it sleeps,
                    // holding no place, then tries the gate again.
                    self.phase = Phase::Parked(parked);
                    return self.sleep(host, until);
                }
            }
        }
        let (mut verdict, rung) = admit_down_the_ladder(host, engine, &ctx, rung, &seen);
        if let Some(retry_ms) = self.bucket_wait(&verdict, now) {
            // A bucket frees up within the class's wait: the request
            // gives its slot back and tries again then, instead of a 429
            // (which it gets if the VM cannot hold its body meanwhile).
            if self.hold_body(&mut parked.hold, parked.body_len) {
                self.phase = Phase::Parked(parked);
                return self.sleep(host, now + retry_ms);
            }
        }
        let mut probe_lease = None;
        if probe {
            // Claimed only now, by an admitted request: a refused one never
            // holds the probe.
            let (decided, lease) =
                engine.take_probe(host, &mut pushback, verdict, &identity, now, route);
            (verdict, probe_lease) = (decided, lease);
        }
        let watch = Watch {
            pushback,
            probe_lease,
        };
        self.send_decided(host, verdict, rung.as_deref(), parked, watch)
    }

    /// The decided request goes on (`send_on`), keeping what it asked
    /// should its rung fail it (`failover`).
    fn send_decided(
        &mut self,
        host: &dyn Host,
        verdict: Verdict,
        rung: Option<&Served>,
        mut parked: waiting::Parked,
        watch: Watch,
    ) -> Action {
        self.keep_for_failover(&verdict, rung, &mut parked.asked);
        self.send_on(host, verdict, rung, parked.body_len, Some(watch))
    }

    /// The request's audit fields known once its body is read.
    fn audit_request(&mut self, model: Option<&str>, body: &[u8]) {
        let Some(config) = self.engine().policy.audit.as_ref() else {
            return;
        };
        let hash_bodies = config.hash_bodies;
        if let Some(model) = model {
            self.audit.text(audit::Field::ModelRequested, model);
        }
        if hash_bodies {
            let hash = crate::policy::keys::sha256_hex(body);
            self.audit.text(audit::Field::RequestSha256, &hash);
            self.response_hash = Some(sha2::Digest::new());
        }
    }

    /// An admitted request goes on: rerouted to the fallback or watched on
    /// the primary, its body rewritten, then through the fleet's gate.
    fn send_on(
        &mut self,
        host: &dyn Host,
        mut verdict: Verdict,
        rung: Option<&Served>,
        body_len: usize,
        watch: Option<Watch>,
    ) -> Action {
        let mut watched = None;
        if let Verdict::Admit(admitted) = &mut verdict {
            if let Some(served) = rung {
                self.reroute(host, admitted, served);
                // Another provider's answer is not the primary's to cache.
                self.cache_store = None;
            } else {
                watched = watch;
            }
        }
        self.sent_len = body_len;
        if let Some(new_body) = verdict.take_body() {
            // The upstream gets the rewritten request (model, max output,
            // usage in streams); its length changes with it.
            host.replace_request_body(body_len, &new_body);
            host.set_request_header("content-length", Some(&new_body.len().to_string()));
            self.sent_len = new_body.len();
        }
        self.fleet_gate(host, verdict, watched)
    }

    /// An admitted request's fleet buckets: covered by the leases (go on),
    /// waiting for the sidecar (pause), or refused fleet-wide.
    fn fleet_gate(&mut self, host: &dyn Host, verdict: Verdict, watch: Option<Watch>) -> Action {
        let filter = self.filter.clone();
        // A body request's plan, or what a GET took.
        let held = verdict.admitted().and_then(|a| {
            a.plan
                .as_ref()
                .map(|p| (&p.held, &p.meters))
                .or(a.held.as_ref().map(|(h, m)| (h, m)))
        });
        let (Some(fleet), Some((held, meters)), Some(identity)) =
            (filter.fleet.as_ref(), held, self.identity.clone())
        else {
            return self.finish_onward(host, verdict, watch, Vec::new());
        };
        let now = self.started_ms;
        match fleet.admit(&filter.engine, host, held, meters, &identity, now) {
            crate::fleet::Gate::Pass(claims) => self.finish_onward(host, verdict, watch, claims),
            crate::fleet::Gate::Wait(pending) => {
                // Its answer comes to this stream, or to the root when the
                // root made the call while resuming this stream.
                if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
                    calls.insert(pending.token, (self.me.clone(), self.context_id));
                }
                self.phase = Phase::Fleet(Box::new(FleetWait {
                    pending,
                    verdict,
                    watch,
                    hit: None,
                }));
                Action::Pause
            }
            crate::fleet::Gate::Refuse { rule, quota } => {
                self.fleet_refuse(host, verdict, watch, &rule, quota)
            }
        }
    }

    /// The sidecar's answer to a request paused for the fleet.
    pub fn on_call_response(&mut self, host: &dyn Host, token: u32, body_size: usize) {
        if self.owns_attempt(token) {
            self.attempt_answered(host, body_size);
            return;
        }
        if self.owns_fleet_attempt(token) {
            self.fleet_attempt_answered(host, body_size);
            return;
        }
        if self.cache_owns(token) {
            self.cache_answer(host, body_size);
            return;
        }
        let wait = match std::mem::replace(&mut self.phase, Phase::Undecided) {
            Phase::Fleet(wait) if wait.pending.token == token => wait,
            other => {
                self.phase = other;
                return;
            }
        };
        let FleetWait {
            pending,
            verdict,
            watch,
            hit,
        } = *wait;
        let filter = self.filter.clone();
        if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
            calls.remove(&token);
        }
        let (Some(fleet), Some(identity)) = (filter.fleet.as_ref(), self.identity.clone()) else {
            return self.give_back_probe(host, watch);
        };
        let now = host.now_ms();
        let gate = fleet.answer(&filter.engine, host, pending, body_size, &identity, now);
        // A cache hit waiting for the fleet: its kept reply, or the 429.
        if let Some(hit) = hit {
            match gate {
                crate::fleet::Gate::Refuse { rule, quota } => {
                    hit.refused(host);
                    self.fleet_refuse(host, verdict, None, &rule, quota);
                }
                crate::fleet::Gate::Pass(claims) => self.deliver_hit(host, hit, verdict, claims),
                crate::fleet::Gate::Wait(_) => self.deliver_hit(host, hit, verdict, Vec::new()),
            }
            return;
        }
        let claims = match gate {
            crate::fleet::Gate::Refuse { rule, quota } => {
                // Sent on down the ladder, it may go upstream now.
                if self.fleet_refuse(host, verdict, watch, &rule, quota) == Action::Continue {
                    host.resume_request();
                }
                return;
            }
            crate::fleet::Gate::Pass(claims) => claims,
            // `answer` never waits again; should it, the request goes on
            // covered locally rather than hang.
            crate::fleet::Gate::Wait(_) => Vec::new(),
        };
        if self.finish_onward(host, verdict, watch, claims) == Action::Continue {
            host.resume_request();
        }
    }

    /// The client left while its request waited for the fleet: the take,
    /// what the request holds here and a probe it claimed go back (a cache
    /// hit's kept reply is dropped).
    fn abandon_fleet_wait(&mut self, host: &dyn Host, wait: FleetWait) {
        let FleetWait {
            pending,
            verdict,
            watch,
            ..
        } = wait;
        let filter = self.filter.clone();
        if let Ok(mut calls) = filter.stream_calls.try_borrow_mut() {
            calls.remove(&pending.token);
        }
        let engine = &filter.engine;
        let now = host.now_ms();
        if let Some(fleet) = &filter.fleet {
            fleet.abandon(engine, host, pending, now);
        }
        // (Counted outstanding only once `finish` sends it on: not yet.)
        release_local(host, engine, &verdict, now);
        self.give_back_probe(host, watch);
    }

    /// Refused fleet-wide: what the request took locally is given back
    /// (a probe it claimed too) and the bucket answers 429.
    fn fleet_refuse(
        &mut self,
        host: &dyn Host,
        verdict: Verdict,
        watch: Option<Watch>,
        rule: &str,
        quota: crate::limits::bucket::Quota,
    ) -> Action {
        let engine = &self.filter.engine;
        let now = host.now_ms();
        let model = verdict.plan().and_then(|p| p.model.clone());
        release_local(host, engine, &verdict, now);
        if let Some(action) = self.fleet_refused_rung(host, rule) {
            self.give_back_probe(host, watch);
            return action;
        }
        let engine = &self.filter.engine;
        let refusal = self.identity.as_ref().and_then(|identity| {
            engine.fleet_refusal(rule, quota, identity, model.as_deref(), now)
        });
        match refusal {
            Some(r) => {
                self.give_back_probe(host, watch);
                self.finish(host, r)
            }
            None => self.finish_onward(host, verdict, watch, Vec::new()),
        }
    }

    /// A rung of the ladder: the request goes to that provider's route
    /// (header + route cache refresh), without the client's credentials
    /// (Envoy's route injects the provider's).
    fn reroute(&self, host: &dyn Host, verdict: &mut Admitted, served: &Served) {
        for credential in CLIENT_CREDENTIALS.iter().chain(&failover::ACCOUNT_HEADERS) {
            host.set_request_header(credential, None);
        }
        host.set_request_header(&served.header, Some(&served.value));
        if let Err(why) = host.clear_route_cache() {
            host.log(LogLevel::Warn, &format!("clear_route_cache failed: {why}"));
        }
        verdict
            .response_headers
            .push("x-sluice-provider", &served.provider);
        let seen = self.filter.seen(host);
        if seen.state.as_ref().is_some_and(|s| s.kill_switch.active) {
            verdict.response_headers.push("x-sluice-kill-switch", "1");
        }
        add(host, metrics::REROUTED, 1);
        metrics::PROVIDER_REQUESTS.add_at(host, &[&served.provider, "served"], 1);
    }

    /// Feeds the upstream's answer to the route's pause and error breaker.
    fn observe_upstream(&mut self, host: &dyn Host, status: u32, watch: &Watch) {
        let (pushback, lease) = (&watch.pushback, watch.probe_lease);
        if !pushback.must_record(status, lease) {
            return;
        }
        let now = host.now_ms();
        let retry_after = host.response_header("retry-after");
        let dice = self.filter.roll(now);
        // Envoy's own answers (no healthy upstream, timeouts, resets) also
        // count, but they say nothing about a credential.
        let from_upstream = host
            .property(&["response", "code_details"])
            .is_some_and(|d| d == b"via_upstream");
        let recorded = self.filter.engine.observe_upstream(
            host,
            pushback,
            &UpstreamReply {
                status,
                from_upstream,
                retry_after: retry_after.as_deref(),
                lease,
            },
            dice,
            now,
        );
        add(
            host,
            metrics::ERROR_BREAKER_OPENED,
            i64::from(recorded.breaker_opened),
        );
        add(host, metrics::PUSHBACK_DROPPED, i64::from(recorded.dropped));
        count_contention(host, recorded.contention);
        match recorded.paused {
            Some(route::PauseScope::Route) => metrics::UPSTREAM_PAUSES.add_at(host, &["route"], 1),
            Some(route::PauseScope::Credential) => {
                metrics::UPSTREAM_PAUSES.add_at(host, &["credential"], 1)
            }
            None => {}
        }
    }

    /// The answer of a good status is over: recorded as the success it
    /// was, or — the upstream reset it, or left it silent until Envoy's
    /// idle timeout — as the failure it turned out to be.
    fn observe_late(&mut self, host: &dyn Host) {
        // Only a model call's answer can be a stream (a GET's never ends
        // as one: no host call for it).
        let model_call = self.api.reads_body();
        let Some(up) = self.upstream() else { return };
        let Some(watch) = up.late.take() else {
            return;
        };
        let broken = model_call
            && up.ended_ms.is_none()
            && !up.reset
            && host
                .property(&["response", "code_details"])
                .is_some_and(|d| {
                    d.starts_with(b"upstream_reset_after_response_started")
                        || d == b"upstream_per_try_idle_timeout"
                        || d == b"stream_idle_timeout"
                });
        let status = if broken { 0 } else { self.status };
        self.observe_upstream(host, status, &watch);
    }

    /// Replaces the reservation with the real cost; runs once per request.
    fn settle(&mut self, host: &dyn Host) {
        let Some(up) = self.upstream() else { return };
        let claims = std::mem::take(&mut up.fleet_claims);
        let Some(plan) = up.plan.take() else { return };
        let (found, counted, cut, details) = match &up.meter {
            Some(m) => (m.found, m.output_events, m.cut, m.details()),
            None => (Found::Nothing, 0, false, Details::default()),
        };
        let (tier, model) = up.labels.clone();
        let now = up.event_ms.unwrap_or_else(|| host.now_ms());
        let upstream_ok = self.status == 0 || self.status < 400;
        let (settled, effort) =
            self.filter
                .engine
                .settle_parts(host, &plan, found, details, counted, upstream_ok, now);
        add(host, metrics::RESERVATIONS_OUTSTANDING, -1);
        count_contention(host, effort);
        if let Some((provider, _)) = &plan.rung {
            metrics::PROVIDER_SPEND.add_at(host, &[provider], settled.cost as i64);
        }
        if let Some(fleet) = &self.filter.fleet {
            let engine = &self.filter.engine;
            let used = crate::fleet::Used {
                billed: settled.billed,
                price: plan.price,
            };
            fleet.settle(engine, host, &claims, used, now);
        }
        if settled.charges_unwritten > 0 {
            // Counted in `sluice_cas_exhausted_total` too; said here so
            // an under-charge is never silent.
            host.log(
                LogLevel::Warn,
                &format!(
                    "{} bucket charge(s) of a settled request could not be written (shared-data contention); the caller is under-charged by them",
                    settled.charges_unwritten
                ),
            );
        }
        metrics::TOKENS.add_at(
            host,
            &["input", "actual", &tier, &model],
            settled.input as i64,
        );
        metrics::TOKENS.add_at(
            host,
            &["output", "actual", &tier, &model],
            settled.output as i64,
        );
        let details = settled.from_usage.then_some(details);
        audit::details(host, &mut self.audit, details, &tier, &model);
        add(host, metrics::USAGE_SURGES, i64::from(settled.surge));
        if self.engine().policy.anomaly.is_some() {
            set_gauge(
                host,
                metrics::GLOBAL_BREAKER,
                u64::from(settled.global_open),
            );
        }
        self.audit.number(audit::Field::TokensInput, settled.input);
        self.audit
            .number(audit::Field::TokensOutput, settled.output);
        self.audit.number(audit::Field::CostMicros, settled.cost);
        let source = match (settled.from_usage, settled.input_estimated) {
            (true, false) => "upstream",
            (true, true) => "upstream_input_estimated",
            (false, _) => "estimate",
        };
        self.audit.code(audit::Field::UsageSource, source);
        let input_source = settled.input_source.code();
        self.audit.code(audit::Field::InputSource, input_source);
        metrics::INPUT_SOURCE.add_at(host, &[input_source], 1);
        add(host, metrics::SPEND_MICROS, settled.cost as i64);
        add(
            host,
            metrics::USAGE_INVALID,
            i64::from(settled.invalid_usage),
        );
        add(
            host,
            metrics::USAGE_MISSING,
            i64::from(!settled.from_usage && upstream_ok),
        );
        add(host, metrics::STREAM_CUT, i64::from(cut));
    }
}

mod audit;
mod cache;
#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod declared_tests;
#[cfg(test)]
mod endpoint_tests;
mod failover;
#[cfg(test)]
mod failover_tests;
pub(crate) mod fleet_slots;
mod flight;
#[cfg(test)]
mod ladder_tests;
mod phase;
mod precheck;
pub mod predefined;
#[cfg(test)]
mod tail_tests;
/// Which VM polls the sidecar (see `flow::POLLER_KEY`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PollLease {
    pub owner: u64,
    pub expires_ms: u64,
}

impl Record for PollLease {
    const LEN: usize = 16;

    fn write(&self, w: &mut Writer) {
        w.u64(self.owner).u64(self.expires_ms);
    }

    fn read(r: &mut Reader) -> Self {
        PollLease {
            owner: r.u64(),
            expires_ms: r.u64(),
        }
    }

    /// By prefix: a missing word reads as 0 (a free lease).
    fn decode(bytes: &[u8]) -> Self {
        Self::read(&mut Reader::new(bytes))
    }
}

/// The request as identity reads it: headers from a snapshot taken once
/// (one host call instead of one per header), or from the host when there
/// is none; claims and address through the host.
pub struct HostRequest<'a>(pub &'a dyn Host, pub Option<&'a Headers>);

impl crate::admission::identity::RequestView for HostRequest<'_> {
    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        match self.1 {
            Some(headers) => headers.get(name).map(Cow::Borrowed),
            None => self.0.request_header(name).map(Cow::Owned),
        }
    }

    fn header_count(&self, name: &str) -> usize {
        match self.1 {
            Some(headers) => headers.count(name),
            None => self.0.request_header_count(name),
        }
    }

    fn jwt_claim(&self, namespace: &str, payload_key: &str, claim: &str) -> Option<String> {
        let path = ["metadata", "filter_metadata", namespace, payload_key, claim];
        String::from_utf8(self.0.property(&path)?).ok()
    }

    fn client_address(&self) -> Option<String> {
        String::from_utf8(self.0.property(&["source", "address"])?).ok()
    }
}

#[cfg(test)]
mod tests;
mod waiting;
