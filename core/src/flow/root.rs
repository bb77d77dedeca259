//! The VM root: one VM's policies and queued streams ([`Vm`]), a loaded
//! policy and what its streams share ([`Filter`]), and the root context
//! ([`Poller`]: configure, tick, the sidecar's long poll, callouts).

use super::*;

impl Vm {
    /// The policy loaded last whose root context still lives.
    pub(super) fn latest(&self) -> Option<Rc<Filter>> {
        let filters = self.filters.try_borrow().ok()?;
        filters.iter().rev().find_map(Weak::upgrade)
    }

    pub(super) fn loaded(&self, filter: &Rc<Filter>) {
        if let Ok(mut filters) = self.filters.try_borrow_mut() {
            filters.retain(|f| f.strong_count() > 0);
            filters.push(Rc::downgrade(filter));
        }
    }
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
    pub(super) fn latest(self: &Rc<Self>) -> Rc<Filter> {
        self.vm.latest().unwrap_or_else(|| self.clone())
    }

    /// The audit log's name of a caller (salted hash), cached per VM.
    pub(super) fn audit_principal(&self, identity: &Identity) -> String {
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
    pub(super) fn audit_principal_with(&self, identity: &Identity, with: impl FnOnce(&str)) {
        if let Ok(cache) = self.audit_principals.try_borrow() {
            if let Some(hash) = cache.get(&identity.principal) {
                return with(hash);
            }
        }
        with(&self.audit_principal(identity));
    }

    /// The sidecar state in shared data, decoded again only when it changed.
    pub(super) fn seen(&self, host: &dyn Host) -> Rc<SidecarSeen> {
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
    pub(super) fn roll(&self, now_ms: u64) -> u32 {
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
    pub(super) fn define_metrics(&self, host: &dyn Host) {
        predefined::define(host);
        super::money::define_budgets(host, &self.engine.policy);
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

/// The shared-data keys a policy needs (its buckets', the fleet's
/// leases', the cache's), made at load; `false` (logged): refused.
fn prepare_shared(host: &dyn Host, filter: &Filter) -> bool {
    let engine = &filter.engine;
    match engine.prepare(host) {
        Ok(created) => log::info!(
            "policy loaded: {} tiers, {} models, {} routes, {} buckets ({} new shared-data keys)",
            engine.policy.tiers.len(),
            engine.policy.models.len(),
            engine.policy.routes.len(),
            engine.rules().len(),
            created
        ),
        Err(err) => {
            log::error!("cannot create shared-data keys: {err}");
            return false;
        }
    }
    if let Some(fleet) = &filter.fleet {
        match fleet.prepare(engine, host) {
            Ok(n) => log::info!("fleet: {n} new shared-data keys for leases"),
            Err(err) => {
                log::error!("fleet: cannot create shared-data keys: {err}");
                return false;
            }
        }
    }
    if let Err(err) = cache::prepare(host, engine) {
        log::error!("{err}");
        return false;
    }
    true
}

/// The policy compiled, its callers placed under the deployment's hash
/// key (`crate::admission::hash_key`); `None` (logged): refused.
fn compile_keyed(host: &dyn Host, policy: Policy) -> Option<Engine> {
    let mut engine = Engine::compile(policy)
        .map_err(|err| log::error!("{err}"))
        .ok()?;
    let key = crate::admission::hash_key::load(host, &engine.policy)
        .map_err(|err| log::error!("{err}"))
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
                log::error!("{err}");
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
        if !prepare_shared(host, &filter) {
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
        wakes::configure(&filter, previous.as_deref(), same_root, host, self.id);
        let filter = Rc::new(filter);
        self.vm.loaded(&filter);
        wakes::after_configure(&filter, host);
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
            wakes::on_wake(&filter, host);
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
            .filter(|f| !f.gates.is_empty() || wakes::has_waiters(f))
        {
            wakes::tick(&filter, host, now);
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
    pub(super) fn polls(&self, host: &dyn Host, now: u64) -> bool {
        let lease = host.get(POLLER_KEY).map(|(b, _)| b).unwrap_or_default();
        let lease = PollLease::decode(&lease);
        lease.owner == self.id && lease.expires_ms > now
    }

    /// Takes or renews the poller lease: one VM in the whole Envoy polls.
    pub(super) fn hold_lease(&self, host: &dyn Host, now: u64) -> bool {
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

    pub(super) fn dispatch_poll(&mut self, host: &dyn Host, now: u64) {
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
                log::warn!(
                    "cannot poll the sidecar (cluster {}): {why}",
                    sidecar.cluster
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
        if self.poll == Some(token) {
            self.poll = None;
            self.on_poll_answer(host, body_size);
        }
    }

    /// The sidecar's answer to the long poll: its state stored in shared
    /// data for every worker, and the next poll sent.
    fn on_poll_answer(&mut self, host: &dyn Host, body_size: usize) {
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
                    log::warn!("sidecar unreachable ({why}); keeping its last state for stale_after, then the on_stale policy");
                }
                return;
            }
        };
        if std::mem::take(&mut self.sidecar_failing) {
            log::info!("sidecar reachable again");
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
