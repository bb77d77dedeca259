//! Telemetry of a decision in one place: its metrics and its audit fields
//! ([`Stream::observe`]), and the audit record written at the end.

use super::*;

impl Stream {
    /// A decision's telemetry: its metrics, then its audit fields.
    pub(super) fn observe(&mut self, host: &dyn Host, verdict: &Verdict) {
        self.record(host, verdict);
        self.audit_decision(verdict);
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

    /// The audit record in filter state, in one host call: the fragment
    /// Envoy's access log splices in as
    /// `%FILTER_STATE(wasm.sluice_audit:PLAIN)%` (see `audit`); only with
    /// an `audit` policy. The request's own fields come from the headers
    /// read at its start (no host call when they were read).
    pub(super) fn write_audit(&mut self, host: &dyn Host) {
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

    /// The request's audit fields known once its body is read.
    pub(super) fn audit_request(&mut self, model: Option<&str>, body: &[u8]) {
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

    /// A settled request's telemetry: its metrics and its audit fields.
    pub(super) fn observe_settled(
        &mut self,
        host: &dyn Host,
        settled: &crate::admission::Settled,
        details: Details,
        (tier, model): (&str, &str),
        upstream_ok: bool,
        cut: bool,
    ) {
        if settled.charges_unwritten > 0 {
            // Counted in `sluice_cas_exhausted_total` too; said here so
            // an under-charge is never silent.
            log::warn!("{} bucket charge(s) of a settled request could not be written (shared-data contention); the caller is under-charged by them",
                    settled.charges_unwritten);
        }
        metrics::TOKENS.add_at(
            host,
            &["input", "actual", tier, model],
            settled.input as i64,
        );
        metrics::TOKENS.add_at(
            host,
            &["output", "actual", tier, model],
            settled.output as i64,
        );
        let details = settled.from_usage.then_some(details);
        audit::details(host, &mut self.audit, details, tier, model);
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
        super::money::count_spend(host, tier, self.identity.as_deref(), settled.cost);
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
