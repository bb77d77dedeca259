//! One method per Envoy event: each hands [`crate::admission`] what Envoy
//! knows and applies the [`Verdict`] it returns through the [`Host`] trait,
//! so all of it runs natively against [`crate::host::mock::MockHost`].
//!
//! This file holds the types the others share; one concern per file:
//!
//! - `root`: the VM root ([`Vm`], [`Filter`], [`Poller`]: loads the
//!   policy, ticks, and — in the one VM holding the poller lease —
//!   long-polls the sidecar and stores its state for every worker).
//! - `stream`: one HTTP stream's request side ([`Request`], a [`Stream`],
//!   its phase a `Phase`): request headers (kill-switch header stripped,
//!   API, identity and the penalty box, canonical path, declared size,
//!   the refusal before the body: `precheck`) → body → decision
//!   (`Stream::decide`: demand → cache lookup → the decision's steps).
//! - `steps`: the decision as a list of steps and the one driver that
//!   runs them, also for a request resumed from the queue or a sleep:
//!   route → the model's gate (`waiting`) → admit → a bucket wait → probe
//!   claim → on to the upstream (reroute/rewrite → the fleet's gate,
//!   `fleet_gate`).
//! - `response`: the verdict applied (`finish`), response headers
//!   (upstream answer fed to the route's record, meter set up), response
//!   body (first byte, meter, settlement) and log (settle what is left,
//!   give back an unanswered probe, leave the queue).
//! - `observe`: a decision's telemetry (metrics and audit fields) in one
//!   place, and the audit record written at the end (`audit`).
//! - `waiting` and `wakes`: the concurrency gate, from the stream's side
//!   and from the root's (dispatch, wakes, sleeps, expiry).
//! - `fleet_slots` keeps the fleet's concurrency slots, `failover` and
//!   `attempt` send a request again down its ladder, `cache`,
//!   `cache_hit` and `flight` are the response cache's side,
//!   [`predefined`] the stats a policy load defines.

use hashbrown::HashMap;
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};

use crate::admission::answer::{Decision, Reason};
use crate::admission::identity::{Identity, RequestView};
use crate::admission::ladder::{Served, Skip};
use crate::admission::pushback::UpstreamReply;
use crate::admission::route::{self, SidecarSeen};
use crate::admission::{Admitted, Engine, RequestContext, Verdict};
use crate::host::metrics::{self, Metric};
use crate::host::{Action, Headers, Host};
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
    /// Runs of the decision's steps (`Stream::run_steps`) on this thread: the
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
        log::warn!("{budget}: past its alert_at (alerted once this window)");
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

/// One VM's policy and what its HTTP contexts share: the decoded sidecar
/// state (kept until the shared-data entry changes) and a dice for
/// half-open trickles and pause jitter.
pub struct Filter {
    pub engine: Engine,
    seen: RefCell<(u32, Rc<SidecarSeen>)>,
    dice: Cell<u64>,
    /// Principal → its salted audit hash: a SHA-256 per request saved for
    /// callers seen before. Bounded like the key-hash cache.
    /// Keyed by callers' principals: std's map, whose SipHash a caller
    /// cannot aim collisions at.
    audit_principals: RefCell<std::collections::HashMap<String, String>>,
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

/// An HTTP stream as Envoy's callbacks reach it: a handle on the
/// [`Stream`], shared with the root context while the request waits in a
/// queue. Callbacks never nest, so a borrow always succeeds; if one did
/// not, the callback lets the stream continue rather than panic.
pub struct Request {
    stream: Rc<RefCell<Stream>>,
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
    /// The same, in nanoseconds (the decision's time: `timing`).
    arrived_ns: u64,
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

mod attempt;
mod audit;
mod cache;
mod cache_hit;
#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod declared_tests;
#[cfg(test)]
mod endpoint_tests;
mod failover;
#[cfg(test)]
mod failover_tests;
mod fleet_gate;
pub(crate) mod fleet_slots;
mod flight;
#[cfg(test)]
mod ladder_tests;
mod money;
mod observe;
mod own_limits;
#[cfg(test)]
mod own_limits_tests;
mod phase;
mod precheck;
pub mod predefined;
#[cfg(test)]
mod refuse_with_tests;
mod response;
mod root;
mod runs;
mod steps;
mod stream;
#[cfg(test)]
mod tail_tests;
mod timing;
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
mod wakes;
