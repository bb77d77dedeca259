//! One set of limits across every Envoy of a fleet (docs/src/design.md, "Fleet"),
//! through the sidecar beside each Envoy and the Redis behind them. The filter never
//! talks to Redis: it asks its sidecar (`/v1/fleet/take`, `/v1/fleet/give`).
//!
//! Leases. For each fleet bucket in use (per caller, or global), this Envoy
//! holds a lease in shared data: units taken from the global bucket ahead
//! of use. A request — with a body or not — debits the lease with the same
//! compare-and-swap as a local bucket (one read, one write), so it stays
//! exact across this Envoy's workers, with no network hop. The VM that
//! polls the sidecar tops up, in the background, every lease in use that
//! is down to a quarter of its last grant. When a lease still cannot cover
//! a request, the request pauses while the sidecar takes, in one Lua
//! script for all its buckets, what the lease lacks plus a top-up: the
//! last grant doubled (demand) or `initial × need` at first, at most
//! `lease.max` beyond the need, and never more than a fair share of what
//! is left globally (`left ÷ expected_replicas`). Near the end of a bucket
//! the fair share falls under the need and the grant is exactly the need:
//! the strict path. A take Redis refuses looks in the caller's lease once
//! more before the request is refused: in a burst the other paused
//! requests' top-ups may have filled it meanwhile (what Redis lacks, this
//! Envoy holds). A caller who finds no lease slot free (a bounded table
//! per bucket, like the local per-caller slots) always takes the strict
//! path. Soft caps are taken past their limit (they never refuse).
//!
//! Bounds. Overshoot of a hard fleet bucket: 0 — every unit admitted
//! anywhere was first taken from Redis (a settlement that reports more
//! than was reserved can still charge past it, as locally). Stranding
//! (units leased to one Envoy while another refuses): one lease per Envoy
//! per bucket and caller, each granted at most `left ÷ expected_replicas`
//! (and `lease.max` beyond a need); a lease falls to exact grants as the
//! bucket empties, gives what it has to the request it cannot cover, and is
//! given back after `lease.idle` unused or at `lease.ttl`. So while every
//! Envoy keeps using its lease, what no Envoy can admit is under one
//! request's need per Envoy (measured: `tests/tests/fleet.rs`); once they
//! are idle, nothing. An Envoy that dies takes its leases with it until
//! the bucket refills or its window ends (Redis cannot know how much of
//! them was used).
//!
//! Settlement. Reserve → actual usage goes to the lease first (a lease
//! still held takes it back or pays it); otherwise into a bounded outbox in
//! shared data. The polling VM sends the outbox and the returns of idle or
//! expired leases in batches with an id; the sidecar records the id with
//! the batch, atomically, so a batch retried after a lost answer is never
//! applied twice.
//!
//! Unavailable (the sidecar or Redis does not answer): leases already held
//! keep serving until `lease.ttl`; past them each bucket follows
//! `on_unavailable` for its kind (`requests`: rate buckets; `budgets`:
//! daily and monthly budgets): `local_share` (default) enforces
//! `limit ÷ expected_replicas` here, exactly, on local stand-in buckets;
//! `fail_closed` refuses by the bucket (429); `fail_open` admits. What is
//! admitted meanwhile is charged to Redis when it answers again (outbox).
//! The switch is logged once per Envoy and counted
//! (`sluice_fleet_unavailable_total`, gauge `sluice_fleet_degraded`).

use hashbrown::HashMap;
use std::sync::Arc;

pub use sluice_wire::fleet::GiveItem;
// The headers of every fleet call ([`fingerprint`] rides in the second)
// and the sidecar's answer codes that put this Envoy on `on_unavailable`
// for a reason other than an outage.
use sluice_wire::fleet::{GiveRequest, TakeAnswer, TakeClaim, TakeRequest};
use sluice_wire::fleet::{FINGERPRINT_HEADER, FLEET_DATA_LOST, FLEET_MISMATCH, SECRET_HEADER};

use crate::admission::identity::Identity;
use crate::admission::{Billed, Engine, Meter, ModelPrice};
use crate::fleet_contract::{fingerprint, fleet_rules, window_end, FleetRuleDef};
use crate::host::metrics;
use crate::host::Host;
use crate::limits::bucket::Quota;
use crate::limits::lease::{self, Leases};
use crate::limits::reservation::{Held, LeaseAsk, Placement, Rule, Scope};
use crate::limits::slot_table::{self, SlotSeen, SlotTable};
use crate::policy::fleet::{FleetConfig, Unavailable, MIN_SECRET};
use crate::policy::Limit;
use crate::state::codec::{Reader, Record, Writer};
use crate::state::store::{Cas, Updated};

const LEASE_PREFIX: &str = "sluice:v1:fleet:lease:";
pub const OUTBOX_KEY: &str = "sluice:v1:fleet:outbox";
pub const STATUS_KEY: &str = "sluice:v1:fleet:status";
/// Lease slots probed from a caller's home slot.
const PROBES: u32 = 4;
/// Most distinct buckets waiting in the outbox.
pub const OUTBOX_MAX: usize = 512;
/// After a failed call, go straight to `on_unavailable` for this long.
const DOWN_RETRY_MS: u64 = 500;
/// Lease sweeps (idle and expired leases given back), at most this often.
const SWEEP_MS: u64 = 1_000;
const GLOBAL_OWNER: u64 = 1;

// ---------------------------------------------------------------- wire

/// `:authority` of the fleet calls when neither `fleet.authority` nor
/// `sidecar.authority` names one.
pub const FLEET_AUTHORITY: &str = "localhost";

/// Units as a signed count for lease balances and give-backs (saturated:
/// a count past `i64::MAX` never turns into its opposite).
fn units_i64(units: u64) -> i64 {
    i64::try_from(units).unwrap_or(i64::MAX)
}

/// A give line: a lease returned or a settlement delta (> 0 gives back,
/// < 0 charges).
pub fn give_item(rule: &str, owner: u64, window_end_ms: u64, delta: i64) -> GiveItem {
    GiveItem {
        rule: rule.to_string(),
        owner,
        window_end_ms,
        delta,
        take: None,
    }
}

/// The line that undoes take `id` on this bucket (if Redis applied it,
/// once; and makes it refused if it arrives later).
pub fn cancel_item(rule: &str, owner: u64, window_end_ms: u64, id: &str) -> GiveItem {
    GiveItem {
        take: Some(id.to_string()),
        ..give_item(rule, owner, window_end_ms, 0)
    }
}

/// Same bucket and same kind of line: merged in the outbox.
fn same_line(a: &GiveItem, b: &GiveItem) -> bool {
    a.rule == b.rule && a.owner == b.owner && a.window_end_ms == b.window_end_ms && a.take == b.take
}

fn sends(item: &GiveItem) -> bool {
    item.delta != 0 || item.take.is_some()
}

/// What a failed fleet call says about itself: whether the sidecar may
/// have run it in Redis (then a take is undone by id), and the gauges.
pub(crate) fn failed_call(host: &dyn Host, status: Option<&str>, body: &[u8]) -> bool {
    let code = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/code")?.as_str().map(str::to_owned));
    let code = code.as_deref();
    note_refusal(host, code);
    // Refused before Redis was asked: nothing to undo.
    let never_ran = matches!(status, Some("400" | "401" | "403" | "404" | "409" | "415"))
        || matches!(code, Some(FLEET_MISMATCH | FLEET_DATA_LOST));
    !never_ran
}

/// Why a fleet call failed, for the log line of the switch.
fn why_down(status: Option<&str>, body: &[u8]) -> &'static str {
    let code = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/code")?.as_str().map(str::to_owned));
    match (status, code.as_deref()) {
        (_, Some(FLEET_MISMATCH)) => {
            "the sidecar refuses to count: the fleet's fingerprints (salt, expected_replicas, \
             fleet rules) differ (fleet_mismatch)"
        }
        (_, Some(FLEET_DATA_LOST)) => {
            "the sidecar reports that Redis lost its data in this window (fleet_data_lost)"
        }
        (Some("401"), _) => {
            "the sidecar refused this Envoy's fleet secret (401: compare fleet.secret_env here \
             with the sidecar's fleet.secret_file or secret_env)"
        }
        (Some("403" | "415" | "400"), _) => "the sidecar refused the fleet call",
        _ => "the sidecar or Redis does not answer",
    }
}

/// Sets the mismatch gauge from an answer's error code (`None`: a good
/// answer, 0) and records a data loss the answer reports. A good answer
/// does not clear the loss: it lasts until the window it happened in ends
/// ([`Fleet::expire_data_loss`]), and so does its gauge.
pub(crate) fn note_refusal(host: &dyn Host, code: Option<&str>) {
    metrics::FLEET_MISMATCH.record(host, u64::from(code == Some(FLEET_MISMATCH)));
    if code == Some(FLEET_DATA_LOST) {
        note_data_loss(host, host.now_ms());
    }
}

/// Records that Redis lost its data (first report: `now`), in shared data
/// for every worker; the worker that records it logs it.
fn note_data_loss(host: &dyn Host, now: u64) {
    let mut first = false;
    let mut cas = Cas::new(host, 4);
    cas.update(STATUS_KEY, |bytes| {
        let mut s = Status::decode(bytes.unwrap_or_default());
        first = s.lost_at_ms == 0;
        if !first {
            return None;
        }
        s.lost_at_ms = now;
        Some(s.encode())
    });
    metrics::FLEET_DATA_LOST.record(host, 1);
    if first {
        log::warn!("fleet: the sidecar reports that Redis lost its data in this window (fleet_data_lost); \
             the hard budgets of the window in progress follow on_unavailable.data_lost until \
             it ends (their fleet count is unknown)");
    }
}

// ---------------------------------------------------------------- leases

/// A lease as kept in shared data (48 bytes; all zero: free).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FleetLease {
    pub owner: u64,
    pub window_end: u64,
    /// Units left to admit; below 0 after settlements charged more.
    pub balance: i64,
    pub expires_ms: u64,
    pub last_ms: u64,
    /// The last grant, to size the next one.
    pub grant: u64,
}

impl FleetRule {
    /// A hard budget (a calendar window that refuses): what a data loss
    /// in its window makes unknown.
    fn hard_budget(&self) -> bool {
        self.rule.limit.window.is_some() && !self.soft
    }

    /// Whether a loss at `lost_at` (0: none) falls in the window ending
    /// at `window_end`, for this bucket.
    fn lost_in(&self, lost_at: u64, window_end_ms: u64) -> bool {
        lost_at > 0 && self.hard_budget() && window_end(&self.rule.limit, lost_at) == window_end_ms
    }
}

impl FleetLease {
    fn live(&self, owner: u64, window_end: u64, now: u64) -> bool {
        self.owner == owner && self.window_end == window_end && self.expires_ms > now
    }
}

impl Record for FleetLease {
    const LEN: usize = 48;

    fn write(&self, w: &mut Writer) {
        w.u64(self.owner)
            .u64(self.window_end)
            .u64(self.balance as u64)
            .u64(self.expires_ms)
            .u64(self.last_ms)
            .u64(self.grant);
    }

    fn read(r: &mut Reader) -> Self {
        FleetLease {
            owner: r.u64(),
            window_end: r.u64(),
            balance: r.u64() as i64,
            expires_ms: r.u64(),
            last_ms: r.u64(),
            grant: r.u64(),
        }
    }

    /// By prefix: a missing word reads as 0.
    fn decode(bytes: &[u8]) -> Self {
        Self::read(&mut Reader::new(bytes))
    }
}

/// Kind of a bucket, for `on_unavailable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Requests,
    Budgets,
}

/// One fleet bucket, compiled from the policy once.
#[derive(Debug, Clone)]
struct FleetRule {
    rule: Rule,
    /// A soft cap: the fleet never refuses it either.
    soft: bool,
    mode: Unavailable,
    /// The `local_share` stand-in: `limit ÷ expected_replicas`, local.
    share: Rule,
    slots: u32,
}

/// How one claim of an admitted request was covered.
#[derive(Debug, Clone)]
pub enum Via {
    /// From this lease slot.
    Lease(Arc<str>),
    /// Taken in Redis for this request alone (strict, no lease slot).
    Strict,
    /// `local_share` while the fleet was unavailable.
    Share(Held),
    /// `fail_open` while the fleet was unavailable.
    Open,
    /// `local_share` of a budget while the fleet was unavailable: this
    /// Envoy's own count of the window was under its share.
    Counted,
}

/// A fleet bucket's part of an admitted request, until it is settled.
#[derive(Debug, Clone)]
pub struct Claimed {
    rule: Arc<str>,
    owner: u64,
    amount: u64,
    window_end: u64,
    meter: Meter,
    via: Via,
}

/// A request waiting for the sidecar.
#[derive(Debug)]
pub struct Pending {
    pub token: u32,
    /// The take's id: given back by it if the answer never comes.
    id: String,
    done: Vec<Claimed>,
    short: Vec<Short>,
}

#[derive(Debug, Clone)]
struct Short {
    rule: Arc<str>,
    owner: u64,
    amount: u64,
    window_end: u64,
    meter: Meter,
    /// A lease slot this caller may hold; none: strict.
    slot: Option<String>,
    /// Units the lease still had, taken for this request: Redis is asked
    /// only for the rest (nothing left idle in a lease that falls short).
    have: u64,
}

impl Short {
    /// This claim, covered `via` there.
    fn claimed(&self, via: Via) -> Claimed {
        Claimed {
            rule: self.rule.clone(),
            owner: self.owner,
            amount: self.amount,
            window_end: self.window_end,
            meter: self.meter,
            via,
        }
    }
}

/// What a settled request really used.
#[derive(Debug, Clone, Copy)]
pub struct Used {
    pub billed: Billed,
    pub price: ModelPrice,
}

/// What the fleet says about an admitted request.
#[derive(Debug)]
pub enum Gate {
    /// Covered; settle these after the response.
    Pass(Vec<Claimed>),
    /// Paused: the sidecar was asked.
    Wait(Pending),
    /// Refused by this bucket (everything taken was given back).
    Refuse { rule: String, quota: Quota },
}

/// The fleet as this VM runs it.
#[derive(Debug)]
pub struct Fleet {
    pub config: FleetConfig,
    cluster: String,
    authority: String,
    rules: HashMap<Arc<str>, FleetRule>,
    /// Slot keys of every lease, for sweeps: bounded by the policy.
    lease_keys: Vec<(Arc<str>, String)>,
    /// [`fingerprint`] of this policy, sent on every call.
    fingerprint: String,
    /// The fleet secret, read from the environment at load.
    secret: std::cell::RefCell<Secret>,
    /// Take ids: this VM's prefix (set at load) and a counter.
    take_ids: std::cell::Cell<(u64, u64)>,
    /// `state.worker_leases`: this worker's sub-leases of the Envoy's fleet
    /// leases (`crate::limits::lease`, one level down), and how they are
    /// sized and how long they are held.
    sub: std::cell::RefCell<Leases>,
    sub_ask: Option<(LeaseAsk, u64)>,
}

/// The fleet secret; never printed.
#[derive(Default)]
struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The lease slots of a fleet bucket (`{LEASE_PREFIX}{rule}:{slot}`).
fn lease_table(rule: &str, slots: u32) -> SlotTable<'_> {
    SlotTable::named(LEASE_PREFIX, rule, slots, PROBES)
}

impl Fleet {
    /// The fleet of a policy with a `fleet` section.
    pub fn new(engine: &Engine) -> Option<Fleet> {
        let policy = &engine.policy;
        let config = policy.fleet.clone()?;
        let sidecar = policy.sidecar.as_ref()?;
        let cluster = config.cluster.clone().unwrap_or(sidecar.cluster.clone());
        // `localhost` by default: a loopback name, which a sidecar that
        // allows only loopback Host names accepts (the cluster's name is
        // no host name).
        let authority = config
            .authority
            .clone()
            .or(sidecar.authority.clone())
            .unwrap_or_else(|| FLEET_AUTHORITY.to_string());
        let replicas = config.expected_replicas.max(1);
        let mut rules = HashMap::new();
        let mut lease_keys = Vec::new();
        for FleetRuleDef { rule, soft } in fleet_rules(policy) {
            let kind = if rule.limit.window.is_some() {
                Kind::Budgets
            } else {
                Kind::Requests
            };
            let mode = match kind {
                Kind::Requests => config.on_unavailable.requests,
                Kind::Budgets => config.on_unavailable.budgets,
            };
            let mut share_limit = rule.limit;
            share_limit.burst = (share_limit.burst / replicas).max(1);
            share_limit.rate.amount = (share_limit.rate.amount / replicas).max(1);
            let share = Rule::new(format!("fleet-share/{}", rule.id), share_limit, rule.scope);
            let slots = match rule.scope {
                Scope::Global => 1,
                // (Run budgets are never fleet rules: `fleet_rules`.)
                Scope::PerPrincipal | Scope::PerRun => config.lease.slots,
            };
            for key in lease_table(&rule.id, slots).keys() {
                lease_keys.push((rule.id.clone(), key));
            }
            rules.insert(
                rule.id.clone(),
                FleetRule {
                    soft,
                    rule,
                    mode,
                    share,
                    slots,
                },
            );
        }
        Some(Fleet {
            config,
            cluster,
            authority,
            rules,
            lease_keys,
            fingerprint: fingerprint(policy),
            secret: Default::default(),
            take_ids: Default::default(),
            sub: Default::default(),
            sub_ask: engine.worker_lease(),
        })
    }

    /// Creates every shared-data key the fleet uses, up front (bounded).
    pub fn prepare(&self, engine: &Engine, host: &dyn Host) -> Result<usize, String> {
        let name = &self.config.secret_env;
        let secret = host.env_var(name).unwrap_or_default();
        let secret = secret.trim();
        if secret.len() < MIN_SECRET {
            return Err(format!(
                "fleet.secret_env: the environment variable {name} must hold the secret shared with \
                 the sidecar (at least {MIN_SECRET} bytes); give it to the VM with \
                 vm_config.environment_variables (host_env_keys: [{name}])"
            ));
        }
        *self.secret.borrow_mut() = Secret(secret.to_string());
        // Distinct per VM: VMs start at different nanoseconds.
        self.take_ids.set((host.now_ns() | 1, 0));
        let mut created = 0;
        for (_, key) in &self.lease_keys {
            if host.get(key).is_none() {
                host.set(key, &FleetLease::default().encode(), 0)
                    .map_err(|e| e.to_string())?;
                created += 1;
            }
        }
        // Not empty: Envoy reads an empty value as no key, and creating
        // again on a reload would wipe what the outbox holds.
        let initial = [
            (OUTBOX_KEY, b"[]".to_vec()),
            (STATUS_KEY, Status::default().encode()),
        ];
        for (key, value) in initial {
            if host.get(key).is_none() {
                host.set(key, &value, 0).map_err(|e| e.to_string())?;
                created += 1;
            }
        }
        // Stand-ins only where `local_share` may need them: rates (a
        // budget's share counts on the Envoy's own bucket).
        let shares: Vec<Rule> = self
            .rules
            .values()
            .filter(|r| r.mode == Unavailable::LocalShare && r.rule.limit.window.is_none())
            .map(|r| r.share.clone())
            .collect();
        created += engine
            .prepare_rules(host, &shares)
            .map_err(|e| e.to_string())?;
        Ok(created)
    }

    fn owner(rule: &FleetRule, identity: &Identity) -> u64 {
        match rule.rule.scope {
            Scope::Global => GLOBAL_OWNER,
            // 0 and 1 mean "free" and "everyone".
            Scope::PerPrincipal => identity.hash.max(2),
            Scope::PerRun => identity.run.unwrap_or(identity.hash).max(2),
        }
    }

    /// Step 4 for the fleet: every fleet bucket the request took locally
    /// (`held`, with their meters) is also covered fleet-wide.
    pub fn admit(
        &self,
        engine: &Engine,
        host: &dyn Host,
        held: &[Held],
        meters: &[Meter],
        identity: &Identity,
        now: u64,
    ) -> Gate {
        let mut done = Vec::new();
        let mut short = Vec::new();
        self.return_sub_leases(engine, host, now);
        let mut cas = Cas::new(host, engine.tries().take());
        for (h, &meter) in held.iter().zip(meters) {
            let Some(rule) = self.rules.get(&h.rule) else {
                continue;
            };
            if h.amount == 0 {
                continue;
            }
            let owner = Self::owner(rule, identity);
            let window_end = window_end(&rule.rule.limit, now);
            let amount = h.amount;
            // This worker's sub-lease first: no host call.
            let sub = self.sub.borrow_mut().debit_by(&h.rule, owner, amount, now);
            if let Some(sub) = sub {
                done.push(Claimed {
                    rule: h.rule.clone(),
                    owner,
                    amount,
                    window_end,
                    meter,
                    via: Via::Lease(sub.key),
                });
                continue;
            }
            let ask = self.sub_ask.filter(|_| !rule.soft).map(|(ask, _)| ask);
            let (slot, debited, have, extra) =
                Self::debit(&mut cas, rule, owner, window_end, amount, ask, now);
            if let (Some(key), Some((extra, lease_expires))) = (&slot, extra) {
                self.keep_sub_lease(engine, host, key, rule, owner, extra, lease_expires, now);
            }
            if debited {
                done.push(Claimed {
                    rule: h.rule.clone(),
                    owner,
                    amount,
                    window_end,
                    meter,
                    via: Via::Lease(slot.unwrap_or_default().into()),
                });
            } else {
                short.push(Short {
                    rule: h.rule.clone(),
                    owner,
                    amount,
                    window_end,
                    meter,
                    slot,
                    have,
                });
            }
        }
        if short.is_empty() {
            return Gate::Pass(done);
        }
        self.ask_fleet(engine, host, done, short, identity, now)
    }

    /// What the worker's leases could not cover: a hard budget of a window
    /// whose fleet count Redis lost goes to `on_unavailable.data_lost`,
    /// the rest is asked of the fleet (or `on_unavailable` while it is
    /// down).
    fn ask_fleet(
        &self,
        engine: &Engine,
        host: &dyn Host,
        mut done: Vec<Claimed>,
        short: Vec<Short>,
        identity: &Identity,
        now: u64,
    ) -> Gate {
        // Hard budgets of a window whose fleet count Redis lost: never
        // asked (the sidecar would refuse them), covered by
        // `on_unavailable.data_lost`; the rest is asked as usual.
        let lost_at = self.status(host).lost_at_ms;
        let (lost, short): (Vec<Short>, Vec<Short>) = short.into_iter().partition(|s| {
            self.rules
                .get(&s.rule)
                .is_some_and(|r| r.lost_in(lost_at, s.window_end))
        });
        if !lost.is_empty() {
            match self.unavailable(engine, host, done, lost, identity, now) {
                Gate::Pass(covered) => done = covered,
                refused => {
                    self.restore(engine, host, &short, now);
                    return refused;
                }
            }
        }
        if short.is_empty() {
            return Gate::Pass(done);
        }
        if self.down(host, now) {
            return self.unavailable(engine, host, done, short, identity, now);
        }
        let claims = self.take_claims(host, &short);
        let id = self.take_id();
        let body = serde_json::to_vec(&TakeRequest {
            id: id.clone(),
            deadline_ms: now.saturating_add(self.config.timeout_ms),
            claims,
        })
        .unwrap_or_default();
        match self.post(host, "/v1/fleet/take", &body) {
            Ok(token) => {
                metrics::FLEET_TAKES.add(host, 1);
                Gate::Wait(Pending {
                    token,
                    id,
                    done,
                    short,
                })
            }
            Err(_) => {
                self.mark(host, false, now);
                self.unavailable(engine, host, done, short, identity, now)
            }
        }
    }

    /// Debits `amount` from the caller's lease, probing its slots: its own
    /// live lease, else a free one. The slot (its own or a free one; none:
    /// every probed slot is another caller's), whether the lease covered
    /// all of it, and what it took when it covered only part (Redis is
    /// then asked for the rest).
    ///
    /// With `ask` (worker leases on) a lease that covers the request by far
    /// gives this worker a sub-lease on top: the units and when the
    /// Envoy's lease expires.
    #[allow(clippy::type_complexity)]
    fn debit(
        cas: &mut Cas,
        rule: &FleetRule,
        owner: u64,
        window_end: u64,
        amount: u64,
        ask: Option<LeaseAsk>,
        now: u64,
    ) -> (Option<String>, bool, u64, Option<(u64, u64)>) {
        let mut debited = false;
        let mut have = 0u64;
        let mut sub = None;
        let table = lease_table(&rule.rule.id, rule.slots);
        let slot = slot_table::claim(table.probe(owner), |key| {
            // One read and, when it is ours and live, one write: the
            // same cost as a local bucket.
            let mut seen = 0;
            let mut part = 0;
            let mut extra = (0u64, 0u64);
            let written = cas.update(key, |bytes| {
                let mut l = FleetLease::decode(bytes.unwrap_or_default());
                seen = l.owner;
                part = 0;
                extra = (0, 0);
                if !l.live(owner, window_end, now) || l.balance <= 0 {
                    return None;
                }
                // All of it when it covers the request; else what it
                // has, and Redis is asked for the rest.
                let debit = l.balance.min(units_i64(amount));
                l.balance -= debit;
                l.last_ms = now;
                part = debit as u64;
                // A sub-lease for this worker, from what is left after it.
                if let (Some(ask), true) = (ask, part == amount) {
                    let units = ask.extra(l.balance.max(0) as u64, &rule.rule.limit);
                    l.balance = l.balance.saturating_sub(units_i64(units));
                    extra = (units, l.expires_ms);
                }
                Some(l.encode())
            });
            if seen == owner {
                if written == Updated::Written {
                    debited = part == amount;
                    have = if debited { 0 } else { part };
                    sub = (extra.0 > 0).then_some(extra);
                }
                SlotSeen::Mine
            } else if seen == 0 {
                SlotSeen::Free(())
            } else {
                SlotSeen::Busy
            }
        })
        .slot();
        (slot, debited, have, sub)
    }

    /// Keeps a sub-lease just debited from the Envoy's lease at `key`: until
    /// the worker's ttl, never past the Envoy's lease (nor its window).
    #[allow(clippy::too_many_arguments)]
    fn keep_sub_lease(
        &self,
        engine: &Engine,
        host: &dyn Host,
        key: &str,
        rule: &FleetRule,
        owner: u64,
        units: u64,
        lease_expires: u64,
        now: u64,
    ) {
        let Some((_, ttl)) = self.sub_ask else {
            return;
        };
        let held = Held {
            key: key.into(),
            rule: rule.rule.id.clone(),
            placement: Placement::Global,
            owner,
            amount: units,
            limit: rule.rule.limit,
            taken_ms: now,
        };
        let quota = Quota {
            limit: rule.rule.limit.capacity(),
            remaining: units,
            reset_ms: 0,
        };
        // Never past the Envoy's lease, nor the end of the bucket's window.
        let mut expires = now.saturating_add(ttl).min(lease_expires);
        if rule.rule.limit.window.is_some() {
            expires = expires.min(window_end(&rule.rule.limit, now));
        }
        let evicted = self.sub.borrow_mut().add(held, quota, expires, now);
        if let Some(l) = evicted {
            self.give_sub_leases(engine, host, vec![lease::WorkerLease::returned(&l)], now);
        }
    }

    /// Gives every sub-lease of this worker back, for good (the policy
    /// that took them was replaced): a request of the old policy still in
    /// flight that takes one after this gives it straight back.
    pub fn close_sub_leases(&self, engine: &Engine, host: &dyn Host, now: u64) {
        let all = self.sub.borrow_mut().close();
        self.give_sub_leases(engine, host, all, now);
    }

    /// Gives this worker's sub-leases that are due back to the Envoy's
    /// lease they came from (or, when that lease is gone, to Redis through
    /// the outbox). Runs on the worker's requests and ticks.
    pub fn return_sub_leases(&self, engine: &Engine, host: &dyn Host, now: u64) {
        let due = {
            let mut sub = self.sub.borrow_mut();
            if sub.next_due() > now {
                return;
            }
            sub.due(now)
        };
        self.give_sub_leases(engine, host, due, now);
    }

    fn give_sub_leases(&self, engine: &Engine, host: &dyn Host, due: Vec<Held>, now: u64) {
        let mut items = Vec::new();
        let mut cas = Cas::new(host, engine.tries().settle());
        for h in due.into_iter().filter(|h| h.amount > 0) {
            let window_end = window_end(&h.limit, h.taken_ms);
            let written = cas.update(&h.key, |bytes| {
                let mut l = FleetLease::decode(bytes.unwrap_or_default());
                if !l.live(h.owner, window_end, now) {
                    return None;
                }
                l.balance = l.balance.saturating_add(units_i64(h.amount));
                Some(l.encode())
            });
            if written != Updated::Written {
                items.push(give_item(&h.rule, h.owner, window_end, units_i64(h.amount)));
            }
        }
        self.outbox(host, engine, items);
    }

    /// What to ask Redis for each claim the leases fell short of: the need,
    /// and for a caller with a lease slot a top-up (the last grant doubled,
    /// or `initial × need` at first; at most `lease.max`, never beyond the
    /// bucket's capacity).
    fn take_claims(&self, host: &dyn Host, short: &[Short]) -> Vec<TakeClaim> {
        short
            .iter()
            .map(|s| {
                let want = match &s.slot {
                    None => s.amount,
                    Some(key) => {
                        let last = host
                            .get(key)
                            .map_or(0, |(b, _)| FleetLease::decode(&b).grant);
                        let top_up = last
                            .saturating_mul(2)
                            .max(self.config.lease.initial.saturating_mul(s.amount.max(1)));
                        let top_up = self.config.lease.max.map_or(top_up, |m| top_up.min(m));
                        // A claim is only ever short of a fleet bucket; were
                        // it not one, no top-up (the need alone).
                        let capacity = self
                            .rules
                            .get(&s.rule)
                            .map_or(s.amount, |r| r.rule.limit.capacity());
                        s.amount.saturating_add(top_up).min(capacity)
                    }
                };
                let need = s.amount.saturating_sub(s.have);
                TakeClaim {
                    rule: s.rule.to_string(),
                    owner: s.owner,
                    window_end_ms: s.window_end,
                    need,
                    want: want.saturating_sub(s.have).max(need),
                }
            })
            .collect()
    }

    /// A fresh take id (hex, unique per VM and across VMs and Envoys).
    fn take_id(&self) -> String {
        let (prefix, n) = self.take_ids.get();
        self.take_ids.set((prefix, n.wrapping_add(1)));
        format!("t{prefix:x}-{n:x}")
    }

    pub(crate) fn post(&self, host: &dyn Host, path: &str, body: &[u8]) -> Result<u32, String> {
        self.post_within(host, path, body, self.config.timeout_ms)
    }

    /// [`Fleet::post`] with its own timeout (the cache's bounded lookups).
    pub(crate) fn post_within(
        &self,
        host: &dyn Host,
        path: &str,
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, String> {
        let len = body.len().to_string();
        let secret = self.secret.try_borrow().map_err(|e| e.to_string())?;
        let headers = [
            (":method", "POST"),
            (":path", path),
            (":authority", self.authority.as_str()),
            ("content-type", "application/json"),
            ("content-length", len.as_str()),
            (SECRET_HEADER, secret.0.as_str()),
            (FINGERPRINT_HEADER, self.fingerprint.as_str()),
        ];
        host.dispatch_post(&self.cluster, &headers, body, timeout_ms)
    }

    /// The sidecar's answer to a paused request.
    pub fn answer(
        &self,
        engine: &Engine,
        host: &dyn Host,
        pending: Pending,
        body_size: usize,
        identity: &Identity,
        now: u64,
    ) -> Gate {
        let Pending {
            mut done,
            short,
            id,
            ..
        } = pending;
        let status = host.call_response_header(":status");
        let body = host.call_response_body(body_size);
        let answer = match (
            status.as_deref(),
            serde_json::from_slice::<TakeAnswer>(&body),
        ) {
            (Some("200"), Ok(a)) if a.ok && a.grants.len() == short.len() => a,
            (Some("200"), Ok(a)) if !a.ok => {
                return self.refused(engine, host, &done, &short, &a, now);
            }
            _ => {
                if failed_call(host, status.as_deref(), &body) {
                    // The take may still run (or have run) in Redis: undo
                    // it by id, once; a take arriving after this is refused.
                    let cancels = short
                        .iter()
                        .map(|s| cancel_item(&s.rule, s.owner, s.window_end, &id))
                        .collect();
                    self.outbox(host, engine, cancels);
                }
                // A data loss is no outage: the sidecar goes on counting
                // everything but the lost window's hard budgets.
                if self.status(host).lost_at_ms == 0 {
                    self.mark_why(host, false, now, why_down(status.as_deref(), &body));
                }
                return self.unavailable(engine, host, done, short, identity, now);
            }
        };
        note_refusal(host, None);
        self.mark(host, true, now);
        let mut cas = Cas::new(host, engine.tries().take());
        for (s, &grant) in short.iter().zip(&answer.grants) {
            let surplus = units_i64(grant.saturating_sub(s.amount.saturating_sub(s.have)));
            let via = match &s.slot {
                Some(key) if self.keep(&mut cas, key, s, grant, surplus, now) => {
                    Via::Lease(key.as_str().into())
                }
                _ => Via::Strict,
            };
            if matches!(via, Via::Strict) && surplus > 0 {
                // No lease to keep the surplus in: straight back.
                self.outbox(
                    host,
                    engine,
                    vec![give_item(&s.rule, s.owner, s.window_end, surplus)],
                );
            }
            done.push(s.claimed(via));
        }
        Gate::Pass(done)
    }

    /// Redis refused the take (by claim `answer.refused`): everything the
    /// request holds goes back, and the refusing bucket answers.
    fn refused(
        &self,
        engine: &Engine,
        host: &dyn Host,
        done: &[Claimed],
        short: &[Short],
        answer: &TakeAnswer,
        now: u64,
    ) -> Gate {
        self.mark(host, true, now);
        // What this request took from its leases goes back first. While it
        // waited, the surplus of this Envoy's other takes (a burst pauses
        // many requests at once, each asking for a top-up) may have filled
        // its lease: Redis has nothing left because this Envoy holds it, so
        // the request is covered from there rather than refused.
        self.restore(engine, host, short, now);
        if let Some(covered) = self.covered_by_leases(engine, host, short, now) {
            let mut all = done.to_vec();
            all.extend(covered);
            return Gate::Pass(all);
        }
        metrics::FLEET_REFUSED.add(host, 1);
        let index = answer.refused.unwrap_or(0);
        let Some(refused) = short.get(index).or(short.last()) else {
            // Nothing was asked (never: a request waits only when short),
            // so nothing of it can be refused.
            return Gate::Pass(done.to_vec());
        };
        // The refusing claim is of a fleet bucket (claims are made only for
        // those); were it not, the answer says no more than "full".
        let (capacity, reset_ms) = match self.rules.get(&refused.rule) {
            Some(r) => (
                r.rule.limit.capacity(),
                retry_ms(&r.rule.limit, refused.window_end, now),
            ),
            None => (0, 1_000),
        };
        let quota = Quota {
            limit: capacity,
            remaining: answer.left.first().copied().unwrap_or(0),
            reset_ms,
        };
        self.give_back(engine, host, done, now);
        Gate::Refuse {
            rule: refused.rule.to_string(),
            quota,
        }
    }

    /// Every short claim covered whole by its caller's lease slot, or none
    /// of them (what was debited goes back). A claim without a slot (the
    /// strict path) has no lease to look in.
    fn covered_by_leases(
        &self,
        engine: &Engine,
        host: &dyn Host,
        short: &[Short],
        now: u64,
    ) -> Option<Vec<Claimed>> {
        let mut cas = Cas::new(host, engine.tries().take());
        let mut covered = Vec::with_capacity(short.len());
        for s in short {
            let whole = |key: &&str| {
                let written = cas.update(key, |bytes| {
                    let mut l = FleetLease::decode(bytes.unwrap_or_default());
                    if !l.live(s.owner, s.window_end, now) || l.balance < units_i64(s.amount) {
                        return None;
                    }
                    l.balance -= units_i64(s.amount);
                    l.last_ms = now;
                    Some(l.encode())
                });
                written == Updated::Written
            };
            let Some(key) = s.slot.as_deref().filter(whole) else {
                self.give_back(engine, host, &covered, now);
                return None;
            };
            covered.push(s.claimed(Via::Lease(key.into())));
        }
        Some(covered)
    }

    /// Keeps a grant's `surplus` in the caller's lease slot `key` (a free
    /// slot becomes its lease; a lease of an earlier window starts over).
    /// `false`: the slot went to another caller meanwhile, or could not be
    /// written.
    fn keep(
        &self,
        cas: &mut Cas,
        key: &str,
        s: &Short,
        grant: u64,
        surplus: i64,
        now: u64,
    ) -> bool {
        let ttl = self.config.lease.ttl_ms;
        let written = cas.update(key, |bytes| {
            let mut l = FleetLease::decode(bytes.unwrap_or_default());
            if l.owner != s.owner && l.owner != 0 {
                return None; // taken meanwhile by another caller
            }
            if l.owner == s.owner && l.window_end != s.window_end {
                // A lease of an earlier window: its window is over.
                l.balance = 0;
            } else if l.owner == 0 {
                l = FleetLease::default();
            }
            l.owner = s.owner;
            l.window_end = s.window_end;
            l.balance = l.balance.saturating_add(surplus);
            l.expires_ms = now + ttl;
            l.last_ms = now;
            l.grant = grant;
            Some(l.encode())
        });
        written == Updated::Written
    }

    /// Past the leases, without the fleet: each bucket's `on_unavailable`.
    fn unavailable(
        &self,
        engine: &Engine,
        host: &dyn Host,
        mut done: Vec<Claimed>,
        short: Vec<Short>,
        identity: &Identity,
        now: u64,
    ) -> Gate {
        // The modes cover whole requests: what the leases gave goes back.
        self.restore(engine, host, &short, now);
        let lost_at = self.status(host).lost_at_ms;
        let mut charges = Vec::new();
        for s in short {
            let Some(rule) = self.rules.get(&s.rule) else {
                // Not a fleet bucket (never: claims are made only for
                // those): the local bucket alone covers it, as settling
                // skips it.
                continue;
            };
            let lost = rule.lost_in(lost_at, s.window_end);
            let via = match self.cover(engine, host, rule, &s, lost, identity, now) {
                Ok(via) => via,
                Err(quota) => {
                    // The charges of the claims covered so far meet their
                    // give-backs in the outbox (merged per bucket: nothing
                    // is sent for them).
                    self.outbox(host, engine, charges);
                    self.give_back(engine, host, &done, now);
                    return Gate::Refuse {
                        rule: s.rule.to_string(),
                        quota,
                    };
                }
            };
            // What is admitted without Redis is charged there later.
            charges.push(give_item(
                &s.rule,
                s.owner,
                s.window_end,
                -units_i64(s.amount),
            ));
            done.push(s.claimed(via));
        }
        self.outbox(host, engine, charges);
        Gate::Pass(done)
    }

    /// One claim without the fleet, by its mode: `on_unavailable.data_lost`
    /// for a hard budget whose window's count Redis lost (`lost`), else
    /// `on_unavailable` for its kind; a soft cap never refuses. `Err`: the
    /// quota it is refused with.
    #[allow(clippy::too_many_arguments)]
    fn cover(
        &self,
        engine: &Engine,
        host: &dyn Host,
        rule: &FleetRule,
        s: &Short,
        lost: bool,
        identity: &Identity,
        now: u64,
    ) -> Result<Via, Quota> {
        let limit = &rule.rule.limit;
        let mode = match (rule.soft, lost) {
            (true, _) => Unavailable::FailOpen,
            (false, true) => self.config.on_unavailable.data_lost,
            (false, false) => rule.mode,
        };
        let refused = |limit_units: u64| Quota {
            limit: limit_units,
            remaining: 0,
            // A lost window's count stays unknown until the window ends.
            reset_ms: if lost {
                retry_ms(limit, s.window_end, now)
            } else {
                1_000
            },
        };
        match mode {
            Unavailable::FailOpen => Ok(Via::Open),
            Unavailable::FailClosed => Err(refused(limit.capacity())),
            Unavailable::LocalShare if limit.window.is_some() => {
                // This Envoy's own bucket has counted everything it
                // admitted in the window (this request included, taken
                // just before): a budget's share starts from that, never
                // afresh — the fleet outage or the data loss does not hand
                // out a second share of the window.
                let share = rule.share.limit.capacity();
                let used = engine
                    .local_quota(host, &s.rule, identity, now)
                    .map(|q| q.limit.saturating_sub(q.remaining));
                match used {
                    Some(used) if used <= share => Ok(Via::Counted),
                    _ => Err(Quota {
                        reset_ms: retry_ms(limit, s.window_end, now),
                        ..refused(share)
                    }),
                }
            }
            Unavailable::LocalShare => {
                let mut effort = Default::default();
                match engine.reserve_rules(
                    host,
                    &[(&rule.share, s.amount)],
                    identity,
                    now,
                    &mut effort,
                ) {
                    Ok(mut held) => Ok(held.pop().map_or(Via::Open, Via::Share)),
                    Err((_, quota)) => Err(quota),
                }
            }
        }
    }

    /// Gives the units the leases had put towards `short` back to them.
    fn restore(&self, engine: &Engine, host: &dyn Host, short: &[Short], now: u64) {
        let claims: Vec<Claimed> = short
            .iter()
            .filter(|s| s.have > 0)
            .filter_map(|s| {
                let via = Via::Lease(s.slot.as_deref()?.into());
                Some(Claimed {
                    amount: s.have,
                    ..s.claimed(via)
                })
            })
            .collect();
        self.give_back(engine, host, &claims, now);
    }

    /// Undoes the claims of a request refused after all.
    pub fn give_back(&self, engine: &Engine, host: &dyn Host, claims: &[Claimed], now: u64) {
        self.settle_with(engine, host, claims, now, |_| 0);
    }

    /// A take whose request went away before its answer came (the client
    /// left): what it claimed from leases goes back, and the take itself is
    /// undone by id (once; refused if it reaches Redis later).
    pub fn abandon(&self, engine: &Engine, host: &dyn Host, pending: Pending, now: u64) {
        self.give_back(engine, host, &pending.done, now);
        let cancels = pending
            .short
            .iter()
            .map(|s| cancel_item(&s.rule, s.owner, s.window_end, &pending.id))
            .collect();
        self.outbox(host, engine, cancels);
    }

    /// After the response: each claim's real usage replaces its amount.
    pub fn settle(
        &self,
        engine: &Engine,
        host: &dyn Host,
        claims: &[Claimed],
        used: Used,
        now: u64,
    ) {
        self.settle_with(engine, host, claims, now, |m| {
            Engine::units(m, used.billed, used.price)
        });
    }

    fn settle_with(
        &self,
        engine: &Engine,
        host: &dyn Host,
        claims: &[Claimed],
        now: u64,
        actual: impl Fn(Meter) -> u64,
    ) {
        let mut items = Vec::new();
        let mut cas = Cas::new(host, engine.tries().settle());
        for c in claims {
            if !self.rules.contains_key(&c.rule) {
                continue;
            }
            let used = actual(c.meter);
            let mut delta = units_i64(c.amount).saturating_sub(units_i64(used));
            let item = |delta| give_item(&c.rule, c.owner, c.window_end, delta);
            // Into this worker's sub-lease while it holds one.
            if let (Via::Lease(key), true) = (&c.via, delta != 0) {
                if let Some(limit) = self.rules.get(&c.rule).map(|r| r.rule.limit) {
                    let h = Held {
                        key: key.clone(),
                        rule: c.rule.clone(),
                        placement: Placement::Global,
                        owner: c.owner,
                        amount: c.amount,
                        limit,
                        taken_ms: now,
                    };
                    // A request taken in an earlier window gives nothing
                    // back to this window's sub-lease.
                    let moved = c.window_end != window_end(&limit, now);
                    match self.sub.borrow_mut().settle(&h, used, moved, now) {
                        lease::LeaseSettled::NotHeld => {}
                        lease::LeaseSettled::Absorbed(rest) => delta = -units_i64(rest),
                    }
                }
            }
            match &c.via {
                Via::Lease(key) if delta != 0 => {
                    let written = cas.update(key, |bytes| {
                        let mut l = FleetLease::decode(bytes.unwrap_or_default());
                        if !l.live(c.owner, c.window_end, now) {
                            return None;
                        }
                        l.balance = l.balance.saturating_add(delta);
                        Some(l.encode())
                    });
                    if written != Updated::Written {
                        items.push(item(delta));
                    }
                }
                Via::Strict if delta != 0 => items.push(item(delta)),
                Via::Share(h) => {
                    engine.settle_held(host, h, used, now);
                    if delta != 0 {
                        items.push(item(delta));
                    }
                }
                Via::Open | Via::Counted if delta != 0 => items.push(item(delta)),
                _ => {}
            }
        }
        self.outbox(host, engine, items);
    }

    /// Adds deltas to the shared outbox, merged per bucket. Full: a give-
    /// back or a cancel is dropped (the fleet over-counts: the safe side); a
    /// charge takes a cancel's place, and is dropped only when there is
    /// none, counted and logged.
    fn outbox(&self, host: &dyn Host, engine: &Engine, items: Vec<GiveItem>) {
        if items.is_empty() {
            return;
        }
        let mut dropped = 0i64;
        let mut cas = Cas::new(host, engine.tries().settle());
        cas.update(OUTBOX_KEY, |bytes| {
            let mut list: Vec<GiveItem> =
                serde_json::from_slice(bytes.unwrap_or_default()).unwrap_or_default();
            dropped = 0;
            for item in &items {
                let len = list.len();
                match list.iter_mut().find(|x| same_line(x, item)) {
                    Some(x) => x.delta = x.delta.saturating_add(item.delta),
                    None if len < OUTBOX_MAX => list.push(item.clone()),
                    // Full: a charge takes a cancel's place (a lost cancel
                    // over-counts, the safe side; a lost charge under-counts).
                    None if item.delta < 0 => match list.iter_mut().find(|x| x.take.is_some()) {
                        Some(x) => *x = item.clone(),
                        None => dropped += 1,
                    },
                    None => {}
                }
            }
            serde_json::to_vec(&list).ok()
        });
        if dropped > 0 {
            metrics::FLEET_OUTBOX_DROPPED.add(host, dropped);
            log::warn!(
                "fleet outbox full ({OUTBOX_MAX} buckets): {dropped} charge(s) not sent to Redis"
            );
        }
    }

    fn status(&self, host: &dyn Host) -> Status {
        let status = host.get(STATUS_KEY).map(|(b, _)| b).unwrap_or_default();
        Status::decode(&status)
    }

    /// Whether the fleet failed just now (then skip straight to the policy).
    fn down(&self, host: &dyn Host, now: u64) -> bool {
        self.status(host).retry_at_ms > now
    }

    /// Forgets a data loss once no hard budget is in the window it
    /// happened in any more (run on the agent's ticks); until then its
    /// gauge stays 1.
    pub(crate) fn expire_data_loss(&self, host: &dyn Host, now: u64) {
        let lost_at = self.status(host).lost_at_ms;
        if lost_at == 0 {
            return;
        }
        let current = self
            .rules
            .values()
            .any(|r| r.lost_in(lost_at, window_end(&r.rule.limit, now)));
        if current {
            metrics::FLEET_DATA_LOST.record(host, 1);
            return;
        }
        let mut cas = Cas::new(host, 4);
        let written = cas.update(STATUS_KEY, |bytes| {
            let mut s = Status::decode(bytes.unwrap_or_default());
            if s.lost_at_ms != lost_at {
                return None;
            }
            s.lost_at_ms = 0;
            Some(s.encode())
        });
        metrics::FLEET_DATA_LOST.record(host, 0);
        if written == Updated::Written {
            log::info!(
                "fleet: the window of the data loss is over; hard budgets count in Redis again"
            );
        }
    }

    /// Records the fleet up or down; the worker that flips it logs it.
    fn mark(&self, host: &dyn Host, up: bool, now: u64) {
        self.mark_why(host, up, now, "the sidecar or Redis does not answer");
    }

    /// Like [`Fleet::mark`]; `why` says in the log why it is down.
    fn mark_why(&self, host: &dyn Host, up: bool, now: u64, why: &str) {
        let mut flipped = false;
        let mut cas = Cas::new(host, 4);
        cas.update(STATUS_KEY, |bytes| {
            let s = Status::decode(bytes.unwrap_or_default());
            flipped = s.down == up;
            let next = Status {
                down: !up,
                retry_at_ms: if up { 0 } else { now + DOWN_RETRY_MS },
                ..s
            };
            (next != s).then(|| next.encode())
        });
        if !flipped {
            return;
        }
        if up {
            log::info!("fleet: sidecar and Redis answer again; leases resume");
        } else {
            metrics::FLEET_UNAVAILABLE.add(host, 1);
            log::warn!("fleet: {why}; leases serve until they expire, then on_unavailable (requests: {:?}, budgets: {:?})",
                    self.config.on_unavailable.requests, self.config.on_unavailable.budgets);
        }
        metrics::FLEET_DEGRADED.record(host, u64::from(!up));
    }
}

fn retry_ms(limit: &Limit, window_end: u64, now: u64) -> u64 {
    if window_end > 0 {
        window_end.saturating_sub(now)
    } else {
        // A token bucket: one unit's refill time.
        (limit.rate.period_ms / limit.rate.amount.max(1)).max(1_000)
    }
}

/// Whether the fleet is down, until when calls are not tried, and when the
/// sidecar first reported that Redis lost its data (0: no loss in a window
/// still in progress) (17 bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Status {
    pub down: bool,
    pub retry_at_ms: u64,
    pub lost_at_ms: u64,
}

impl Record for Status {
    const LEN: usize = 17;

    fn write(&self, w: &mut Writer) {
        w.u8(u8::from(self.down))
            .u64(self.retry_at_ms)
            .u64(self.lost_at_ms);
    }

    fn read(r: &mut Reader) -> Self {
        Status {
            down: r.u8() == 1,
            retry_at_ms: r.u64(),
            lost_at_ms: r.u64(),
        }
    }

    /// By prefix: a missing field reads as up, no retry time, no loss.
    fn decode(bytes: &[u8]) -> Self {
        Self::read(&mut Reader::new(bytes))
    }
}

// ---------------------------------------------------------------- agent

/// The background half, run by the one VM that polls the sidecar: gives
/// back idle and expired leases and sends the outbox, one batch at a time,
/// retried with the same id until the sidecar says it is applied.
#[derive(Debug, Default)]
pub struct FleetAgent {
    inflight: Option<(u32, String, Vec<GiveItem>)>,
    /// A top-up in flight: its token and the leases it is for.
    topping: Option<(u32, String, Vec<TopUp>)>,
    /// A batch whose send failed: sent again, same id.
    unsent: Option<(String, Vec<GiveItem>)>,
    last_sweep_ms: u64,
    retry_at_ms: u64,
    seq: u64,
    failing: bool,
}

/// A lease being topped up ahead of need.
#[derive(Debug, Clone)]
struct TopUp {
    slot: String,
    rule: String,
    owner: u64,
    window_end: u64,
}

/// Most leases topped up in one call.
const TOP_UP_MAX: usize = 64;

impl FleetAgent {
    pub fn owns(&self, token: u32) -> bool {
        self.inflight.as_ref().is_some_and(|(t, _, _)| *t == token)
            || self.topping.as_ref().is_some_and(|(t, _, _)| *t == token)
    }

    pub fn tick(&mut self, fleet: &Fleet, engine: &Engine, host: &dyn Host, vm_id: u64, now: u64) {
        if now >= self.last_sweep_ms + SWEEP_MS {
            self.last_sweep_ms = now;
            self.sweep(fleet, engine, host, now);
            fleet.expire_data_loss(host, now);
        }
        if self.topping.is_none() && now >= self.retry_at_ms && !fleet.down(host, now) {
            self.top_up(fleet, host, now);
        }
        if self.inflight.is_some() || now < self.retry_at_ms {
            return;
        }
        let (id, items) = match self.unsent.take() {
            Some(batch) => batch,
            None => {
                let mut taken = Vec::new();
                let mut cas = Cas::new(host, engine.tries().settle());
                cas.update(OUTBOX_KEY, |bytes| {
                    taken = serde_json::from_slice(bytes.unwrap_or_default()).unwrap_or_default();
                    (!taken.is_empty()).then(|| b"[]".to_vec())
                });
                taken.retain(sends);
                if taken.is_empty() {
                    return;
                }
                self.seq += 1;
                (format!("{vm_id:x}-{now:x}-{:x}", self.seq), taken)
            }
        };
        let request = GiveRequest { id, items };
        let body = serde_json::to_vec(&request).unwrap_or_default();
        let GiveRequest { id, items } = request;
        match fleet.post(host, "/v1/fleet/give", &body) {
            Ok(token) => self.inflight = Some((token, id, items)),
            Err(_) => {
                self.unsent = Some((id, items));
                self.retry_at_ms = now + DOWN_RETRY_MS;
            }
        }
    }

    /// Asks for more, in the background, for the leases in use that are
    /// down to a quarter of their last grant: the requests behind them then
    /// find the lease filled instead of waiting for the sidecar.
    fn top_up(&mut self, fleet: &Fleet, host: &dyn Host, now: u64) {
        let cfg = &fleet.config.lease;
        let mut wants = Vec::new();
        let mut claims = Vec::new();
        for (rule_id, key) in &fleet.lease_keys {
            if wants.len() >= TOP_UP_MAX {
                break;
            }
            let Some((bytes, _)) = host.get(key) else {
                continue;
            };
            let l = FleetLease::decode(&bytes);
            let Some(rule) = fleet.rules.get(rule_id) else {
                continue;
            };
            let current = window_end(&rule.rule.limit, now);
            let in_use = l.owner != 0 && l.last_ms + cfg.idle_ms > now && l.expires_ms > now;
            if !in_use
                || l.window_end != current
                || l.balance.saturating_mul(4) >= units_i64(l.grant)
            {
                continue;
            }
            let want = cfg.max.map_or(l.grant, |m| l.grant.min(m));
            if want == 0 {
                continue;
            }
            claims.push((rule_id.clone(), l.owner, current, want));
            wants.push(TopUp {
                slot: key.clone(),
                rule: rule_id.to_string(),
                owner: l.owner,
                window_end: l.window_end,
            });
        }
        if wants.is_empty() {
            return;
        }
        let id = fleet.take_id();
        let body = serde_json::to_vec(&TakeRequest {
            id: id.clone(),
            deadline_ms: now.saturating_add(fleet.config.timeout_ms),
            claims: claims
                .iter()
                .map(|(rule, owner, window_end_ms, want)| TakeClaim {
                    rule: rule.to_string(),
                    owner: *owner,
                    window_end_ms: *window_end_ms,
                    need: 0,
                    want: *want,
                })
                .collect(),
        })
        .unwrap_or_default();
        if let Ok(token) = fleet.post(host, "/v1/fleet/take", &body) {
            metrics::FLEET_TAKES.add(host, 1);
            self.topping = Some((token, id, wants));
        }
    }

    /// What a top-up brought: into the leases still held, else straight
    /// back. A top-up that failed is undone by its id (Redis gives back
    /// what it granted, once, or refuses it if it arrives later).
    fn topped_up(
        &mut self,
        fleet: &Fleet,
        engine: &Engine,
        host: &dyn Host,
        (id, wants): (String, Vec<TopUp>),
        body_size: usize,
        now: u64,
    ) {
        let status = host.call_response_header(":status");
        let body = host.call_response_body(body_size);
        let answer = match (
            status.as_deref(),
            serde_json::from_slice::<TakeAnswer>(&body),
        ) {
            (Some("200"), Ok(a)) if a.ok && a.grants.len() == wants.len() => a,
            (Some("200"), Ok(_)) => return,
            _ => {
                if failed_call(host, status.as_deref(), &body) {
                    // It may still be applied in Redis: undone by id, once.
                    let cancels = wants
                        .iter()
                        .map(|w| cancel_item(&w.rule, w.owner, w.window_end, &id))
                        .collect();
                    fleet.outbox(host, engine, cancels);
                }
                self.retry_at_ms = now + DOWN_RETRY_MS;
                return;
            }
        };
        let ttl = fleet.config.lease.ttl_ms;
        let mut back = Vec::new();
        let mut cas = Cas::new(host, engine.tries().take());
        for (w, &grant) in wants.iter().zip(&answer.grants) {
            if grant == 0 {
                continue;
            }
            let written = cas.update(&w.slot, |bytes| {
                let mut l = FleetLease::decode(bytes.unwrap_or_default());
                if l.owner != w.owner || l.window_end != w.window_end || l.expires_ms <= now {
                    return None;
                }
                l.balance = l.balance.saturating_add(units_i64(grant));
                l.expires_ms = now + ttl;
                l.grant = grant;
                Some(l.encode())
            });
            if written != Updated::Written {
                back.push(give_item(&w.rule, w.owner, w.window_end, units_i64(grant)));
            }
        }
        fleet.outbox(host, engine, back);
    }

    /// The answer to a call of this agent: a top-up, or a batch (done, or
    /// kept to be sent again with the same id).
    pub fn on_answer(
        &mut self,
        fleet: &Fleet,
        engine: &Engine,
        host: &dyn Host,
        token: u32,
        body_size: usize,
        now: u64,
    ) {
        if let Some((_, id, wants)) = self.topping.take_if(|(t, _, _)| *t == token) {
            self.topped_up(fleet, engine, host, (id, wants), body_size, now);
            return;
        }
        let Some((_, id, items)) = self.inflight.take_if(|(t, _, _)| *t == token) else {
            return;
        };
        let status = host.call_response_header(":status");
        let body = host.call_response_body(body_size);
        if status.as_deref() == Some("200") {
            note_refusal(host, None);
            metrics::FLEET_BATCHES.add(host, 1);
            if std::mem::take(&mut self.failing) {
                log::info!("fleet: held settlements sent");
            }
            return;
        }
        let _ = failed_call(host, status.as_deref(), &body);
        if status.as_deref() == Some("400") {
            // Never accepted: sending it again cannot help.
            log::error!("fleet: the sidecar refused a settlement batch (400); dropped");
            return;
        }
        if !self.failing {
            self.failing = true;
            log::warn!(
                "fleet: settlements held until the sidecar and Redis answer (sent once, by id)"
            );
        }
        self.unsent = Some((id, items));
        self.retry_at_ms = now + DOWN_RETRY_MS;
    }

    /// Frees leases unused for `idle` or past `ttl` (or of a past window),
    /// their balance to the outbox.
    fn sweep(&mut self, fleet: &Fleet, engine: &Engine, host: &dyn Host, now: u64) {
        let cfg = &fleet.config.lease;
        let mut items = Vec::new();
        let mut cas = Cas::new(host, engine.tries().take());
        for (rule_id, key) in &fleet.lease_keys {
            let Some((bytes, _)) = host.get(key) else {
                continue;
            };
            let l = FleetLease::decode(&bytes);
            if l.owner == 0 {
                continue;
            }
            let over = l.window_end != 0 && l.window_end <= now;
            let stale = l.last_ms + cfg.idle_ms <= now || l.expires_ms <= now || over;
            if !stale {
                continue;
            }
            let mut freed = None;
            let written = cas.update(key, |bytes| {
                let l = FleetLease::decode(bytes.unwrap_or_default());
                let over = l.window_end != 0 && l.window_end <= now;
                if l.owner == 0 || !(l.last_ms + cfg.idle_ms <= now || l.expires_ms <= now || over)
                {
                    return None;
                }
                freed = Some(l);
                Some(FleetLease::default().encode())
            });
            if let (Updated::Written, Some(l)) = (written, freed) {
                let over = l.window_end != 0 && l.window_end <= now;
                if l.balance != 0 && !over {
                    items.push(give_item(rule_id, l.owner, l.window_end, l.balance));
                }
            }
        }
        fleet.outbox(host, engine, items);
    }
}

#[cfg(test)]
mod tests;
