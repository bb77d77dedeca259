//! Policy compilation: the buckets a policy defines (tiers, their
//! anonymous totals, models, routes), what each counts and what a model
//! costs, built once per policy load.

use super::*;
use crate::policy::ConfigError;

/// A level of the hierarchy above the caller.
#[derive(Debug, Clone, Copy)]
enum Level {
    Team,
    Org,
}

impl Level {
    fn prefix(self) -> &'static str {
        match self {
            Level::Team => "team",
            Level::Org => "org",
        }
    }

    /// Rates refuse as `<level>_rate_limit`, calendar budgets (tokens or
    /// spend) as `<level>_budget_exceeded`.
    fn reason(self, budget: bool) -> Reason {
        match (self, budget) {
            (Level::Team, false) => Reason::TeamRateLimit,
            (Level::Team, true) => Reason::TeamBudgetExceeded,
            (Level::Org, false) => Reason::OrgRateLimit,
            (Level::Org, true) => Reason::OrgBudgetExceeded,
        }
    }
}

/// One limit of a section's configuration: what a bucket counts, how
/// much, and how it refuses.
pub(super) struct TierLimit {
    pub(super) what: &'static str,
    pub(super) limit: Limit,
    pub(super) meter: Meter,
    pub(super) reason: Reason,
    pub(super) budget: Option<Budget>,
}

/// The limits a `TierConfig` sets, in the order they are taken.
pub(super) fn tier_limits(t: &crate::policy::TierConfig, zone: Zone) -> Vec<TierLimit> {
    let rates = [
        (
            "requests",
            t.requests,
            Meter::Requests,
            Reason::UserRateLimit,
        ),
        ("tokens", t.tokens, Meter::Tokens, Reason::TokenRateLimit),
        (
            "input_tokens",
            t.input_tokens,
            Meter::InputTokens,
            Reason::TokenRateLimit,
        ),
        (
            "output_tokens",
            t.output_tokens,
            Meter::OutputTokens,
            Reason::TokenRateLimit,
        ),
    ];
    let mut out: Vec<TierLimit> = rates
        .into_iter()
        .filter_map(|(what, limit, meter, reason)| {
            limit.map(|limit| TierLimit {
                what,
                limit,
                meter,
                reason,
                budget: None,
            })
        })
        .collect();
    out.extend(budget_limits(t, zone));
    out
}

/// The budgets a `TierConfig` sets (windowed limits), in the order they
/// are taken.
fn budget_limits(t: &crate::policy::TierConfig, zone: Zone) -> Vec<TierLimit> {
    let budgets = [
        (
            "daily_tokens",
            t.daily_tokens,
            Window::Day(zone),
            Meter::Tokens,
            Reason::DailyBudgetExceeded,
        ),
        (
            "monthly_tokens",
            t.monthly_tokens,
            Window::Month(zone),
            Meter::Tokens,
            Reason::MonthlyBudgetExceeded,
        ),
        (
            "daily_spend",
            t.daily_spend,
            Window::Day(zone),
            Meter::Spend,
            Reason::SpendCapExceeded,
        ),
        (
            "monthly_spend",
            t.monthly_spend,
            Window::Month(zone),
            Meter::Spend,
            Reason::SpendCapExceeded,
        ),
    ];
    budgets
        .into_iter()
        .filter_map(|(what, budget, window, meter, reason)| {
            budget.map(|b| {
                let units = if meter == Meter::Spend {
                    (b.limit * 1e6).round() as u64
                } else {
                    b.limit as u64
                };
                TierLimit {
                    what,
                    limit: Limit::windowed(units.max(1), window),
                    meter,
                    reason,
                    budget: Some(b),
                }
            })
        })
        .collect()
}

impl Engine {
    /// Compiles a policy, then checks what only the compiled policy knows:
    /// that no passthrough rule opens a path sluice classifies, and that
    /// `fleet.local` names buckets (or gated backends) this policy makes —
    /// against the compiled ids, team and organisation buckets included.
    pub fn compile(policy: Policy) -> Result<Engine, ConfigError> {
        passthrough::check(&policy).map_err(|(path, why)| ConfigError::at(&path, why))?;
        super::declared::check(&policy).map_err(|(path, why)| ConfigError::at(&path, why))?;
        let engine = Engine::new(policy);
        engine.check_limits_path()?;
        if let Some(fleet) = &engine.policy.fleet {
            let gates = crate::queue::Gates::new(&engine.policy);
            for (i, id) in fleet.local.iter().enumerate() {
                let bucket = engine.buckets.iter().any(|b| *b.rule.id == **id);
                let gate = id
                    .strip_prefix("concurrency/")
                    .is_some_and(|backend| gates.group(backend).is_some());
                if !bucket && !gate {
                    return Err(ConfigError::at(
                        format!("fleet.local[{i}]"),
                        format!("`{id}` names no bucket of this policy (tier/T/requests, team/T/requests, org/O/daily_tokens, model/M/tokens, route/R/requests, concurrency/B …)"),
                    ));
                }
            }
        }
        Ok(engine)
    }

    /// Compiles a policy without the checks of [`Engine::compile`]: the
    /// buckets in the order a request takes them (tiers, teams, orgs,
    /// models, routes, passthrough rules), the prices, the penalty box.
    pub fn new(policy: Policy) -> Engine {
        let zone = policy.budgets.reset_timezone;
        let mut b = Builder::new(&policy);
        let tier_buckets = b.tiers(&policy);
        let team_buckets = b.level(Level::Team, &policy.teams, zone);
        let org_buckets = b.level(Level::Org, &policy.orgs, zone);
        let model_buckets = b.models(&policy);
        let route_buckets = b.routes(&policy);
        let passthrough = b.passthrough(&policy);
        let declared = super::declared::compile(&policy);
        let provider_buckets = b.providers(&policy);
        let run_buckets = b.runs(&policy);
        let mut buckets = b.buckets;
        for (tier, list) in &tier_buckets {
            for &i in list {
                if buckets[i].rule.scope == Scope::Global {
                    buckets[i].anonymous = true;
                } else {
                    buckets[i].tier = Some(tier.clone());
                }
            }
        }
        let ipv6_prefix = crate::policy::identity::ipv6_prefix(&policy);
        let penalty = policy
            .abuse
            .as_ref()
            .map(|abuse| crate::admission::penalty::PenaltyBox::new(abuse, ipv6_prefix));
        Engine {
            resolver: Resolver::new(&policy),
            policy,
            buckets,
            tier_buckets,
            team_buckets,
            org_buckets,
            model_buckets,
            route_buckets,
            provider_buckets,
            run_buckets,
            passthrough,
            declared,
            penalty,
            leases: std::sync::Mutex::default(),
            hash_key: Default::default(),
        }
    }

    /// Places every caller-chosen name (principals, addresses, unlisted
    /// models) under the deployment's key from now on: called once the
    /// key is known (`crate::admission::hash_key`), before the first
    /// request. Until then the unkeyed default (native tests).
    pub fn set_hash_key(&mut self, key: crate::policy::keys::HashKey) {
        self.hash_key = key;
        self.resolver.set_key(key);
        if let Some(pb) = &mut self.penalty {
            pb.set_key(key);
        }
    }

    /// Every bucket the policy defines.
    pub fn rules(&self) -> Vec<Rule> {
        self.buckets.iter().map(|b| b.rule.clone()).collect()
    }

    /// Creates every shared-data key the policy can use (a bounded set:
    /// see `reservation`), with dedicated keys for each declared API key
    /// in its tier's per-caller buckets. Returns how many were new.
    pub fn prepare(&self, store: &dyn SharedStore) -> Result<usize, StoreError> {
        let declared = self.resolver.declared();
        let rules: Vec<(Rule, Vec<String>)> = self
            .buckets
            .iter()
            .map(|b| {
                let mine = declared
                    .iter()
                    .filter(|(_, tier)| Some(tier) == b.tier.as_ref())
                    .map(|(principal, _)| principal.clone())
                    .collect();
                (b.rule.clone(), mine)
            })
            .collect();
        let mut created = prepare(store, &rules, &self.layout())?;
        created += self.prepare_provider_alerts(store)?;
        created += self.prepare_loop_guard(store)?;
        match &self.penalty {
            Some(pb) => Ok(created + pb.prepare(store)?),
            None => Ok(created),
        }
    }

    pub(super) fn layout(&self) -> Layout {
        let s = &self.policy.state;
        Layout {
            slots: s.principal_slots,
            sketch_width: s.sketch_width,
            hold_ms: s.slot_hold_ms,
            runs: crate::limits::run_table::run_table(&self.policy),
        }
    }

    pub(super) fn reserver<'a>(&self, store: &'a dyn SharedStore) -> Reserver<'a> {
        Reserver {
            store,
            layout: self.layout(),
            tries: self.tries(),
        }
    }

    /// The compare-and-swap bound of this policy: the one place it is read
    /// (`state.cas_max_retries`); everything else is handed this value.
    pub fn tries(&self) -> crate::state::store::Tries {
        crate::state::store::Tries::new(self.policy.state.cas_max_retries)
    }

    /// Indexes of the buckets that apply to a request, in the order they
    /// are taken (the first that refuses decides the answer).
    pub(super) fn applying<'a>(
        &'a self,
        identity: &Identity,
        model: Option<&str>,
        path: &str,
    ) -> Vec<usize> {
        let none = Vec::new();
        let level = |map: &'a HashMap<String, Vec<usize>>, name: Option<&str>| {
            name.and_then(|n| map.get(n)).into_iter().flatten()
        };
        self.tier_buckets
            .get(&identity.tier)
            .unwrap_or(&none)
            .iter()
            .filter(|&&i| !(identity.declared && self.buckets[i].anonymous))
            .chain(level(&self.team_buckets, identity.team.as_deref()))
            .chain(level(&self.org_buckets, identity.org.as_deref()))
            .chain(
                model
                    .and_then(|m| self.model_buckets.get(m))
                    .unwrap_or(&none),
            )
            .copied()
            .chain(
                self.route_buckets
                    .iter()
                    .filter(|(prefix, _)| path.starts_with(prefix.as_str()))
                    .map(|(_, i)| *i),
            )
            .chain(
                identity
                    .run
                    .iter()
                    .flat_map(|_| self.run_buckets.iter().copied()),
            )
            .collect()
    }

    /// The policy route a canonical path falls under (the first whose
    /// compiled prefix it starts with, as its route bucket is found).
    pub fn route_of(&self, path: &str) -> Option<&str> {
        let j = self
            .route_buckets
            .iter()
            .position(|(prefix, _)| path.starts_with(prefix.as_str()))?;
        self.policy.routes.get(j).map(|r| r.name.as_str())
    }

    /// The most output one choice of `model` may ask for.
    pub(super) fn output_cap(&self, model: &str) -> u64 {
        self.policy
            .models
            .get(model)
            .and_then(|m| m.max_output)
            .unwrap_or(self.policy.request.max_output)
    }

    pub(super) fn default_output(&self, model: Option<&str>) -> u64 {
        model
            .and_then(|m| self.policy.models.get(m))
            .and_then(|m| m.default_max_output)
            .unwrap_or(self.policy.defaults.max_output_tokens)
    }

    /// A listed model's price; a model the policy does not list (let
    /// through by `unlisted_models`) at the price stated there.
    pub(super) fn price_of(&self, model: Option<&str>) -> ModelPrice {
        match model.map(|m| self.policy.models.get(m)) {
            Some(Some(listed)) => listed.priced.unwrap_or_default(),
            Some(None) => self.policy.unlisted_price(),
            None => ModelPrice::default(),
        }
    }
}

/// The buckets being compiled, each section's in turn.
struct Builder {
    buckets: Vec<Bucket>,
    /// The shares of a shared bucket that writes none.
    default_shares: crate::policy::shares::SharesConfig,
}

impl Builder {
    fn new(policy: &Policy) -> Builder {
        Builder {
            buckets: Vec::new(),
            default_shares: crate::policy::shares::default_for(policy),
        }
    }

    /// Adds a bucket counting what `l` counts; returns its index.
    fn add(
        &mut self,
        id: String,
        name: String,
        scope: Scope,
        reason: Reason,
        l: &TierLimit,
    ) -> usize {
        self.buckets.push(Bucket {
            rule: Rule::new(id, l.limit, scope),
            tier: None,
            anonymous: false,
            reason,
            name,
            meter: l.meter,
            soft: l.budget.is_some_and(|b| b.mode == Mode::Soft),
            alert_permille: l.budget.and_then(|b| b.alert_at_permille),
            refuse_with: l.budget.map_or(429, |b| u32::from(b.refuse_with)),
            shares: None,
        });
        self.buckets.len() - 1
    }

    /// A bucket every caller shares (a model's, a route's): its fair
    /// shares are the ones written, or `defaults.shares`.
    fn add_shared(
        &mut self,
        id: String,
        name: String,
        l: &TierLimit,
        written: &Option<crate::policy::shares::SharesConfig>,
    ) -> usize {
        let i = self.add(id, name, Scope::Global, l.reason, l);
        let table = crate::limits::shares::ShareTable::compile(
            written.as_ref().unwrap_or(&self.default_shares),
        );
        self.buckets[i].shares = table;
        i
    }

    /// Each tier's buckets: its shared total for undeclared callers first
    /// (a flood refused there never reaches the per-caller slots), then
    /// its per-caller limits.
    fn tiers(&mut self, policy: &Policy) -> HashMap<String, Vec<usize>> {
        let zone = policy.budgets.reset_timezone;
        let mut out = HashMap::new();
        for (tier, t) in &policy.tiers {
            let mut mine = Vec::new();
            if let Some(total) = &t.anonymous_total {
                for l in tier_limits(total, zone) {
                    mine.push(self.add(
                        format!("tier/{tier}/anonymous/{}", l.what),
                        format!(
                            "tier {tier}: {}, all callers without a declared key",
                            l.what.replace('_', " ")
                        ),
                        Scope::Global,
                        Reason::AnonymousLimit,
                        &l,
                    ));
                }
            }
            for l in tier_limits(t, zone) {
                mine.push(self.add(
                    format!("tier/{tier}/{}", l.what),
                    format!("tier {tier}: {} per caller", l.what.replace('_', " ")),
                    Scope::PerPrincipal,
                    l.reason,
                    &l,
                ));
            }
            out.insert(tier.clone(), mine);
        }
        out
    }

    /// Teams and orgs: one shared bucket per limit (they are declared, so
    /// the key set stays bounded), taken after the caller's own.
    fn level(
        &mut self,
        level: Level,
        configs: &std::collections::BTreeMap<String, crate::policy::TierConfig>,
        zone: Zone,
    ) -> HashMap<String, Vec<usize>> {
        let mut out = HashMap::new();
        for (name, t) in configs {
            let mine = tier_limits(t, zone)
                .iter()
                .map(|l| {
                    self.add(
                        format!("{}/{name}/{}", level.prefix(), l.what),
                        format!(
                            "{} {name}: {}, all its members together",
                            level.prefix(),
                            l.what.replace('_', " ")
                        ),
                        Scope::Global,
                        level.reason(l.budget.is_some()),
                        l,
                    )
                })
                .collect();
            out.insert(name.clone(), mine);
        }
        out
    }

    /// Each model's requests and tokens, all callers together.
    fn models(&mut self, policy: &Policy) -> HashMap<String, Vec<usize>> {
        let mut out = HashMap::new();
        for (model, m) in &policy.models {
            let rates = [
                (
                    "requests",
                    m.requests,
                    Meter::Requests,
                    Reason::ModelRateLimit,
                ),
                ("tokens", m.tokens, Meter::Tokens, Reason::TokenRateLimit),
            ];
            let mut mine = Vec::new();
            for (what, limit, meter, reason) in rates {
                let Some(limit) = limit else { continue };
                let l = TierLimit {
                    what,
                    limit,
                    meter,
                    reason,
                    budget: None,
                };
                mine.push(self.add_shared(
                    format!("model/{model}/{what}"),
                    format!("model {model}: {what}"),
                    &l,
                    &m.shares,
                ));
            }
            out.insert(model.clone(), mine);
        }
        out
    }

    /// Each route's requests, keyed by its prefix in canonical form (the
    /// form requests' paths are matched in, see `canonical_path`).
    fn routes(&mut self, policy: &Policy) -> Vec<(String, usize)> {
        policy
            .routes
            .iter()
            .map(|route| {
                let i = self.add_shared(
                    format!("route/{}/requests", route.name),
                    format!("route {}: requests", route.name),
                    &requests(route.requests),
                    &route.shares,
                );
                let prefix = demand::canonical_path(&route.path_prefix)
                    .map(std::borrow::Cow::into_owned)
                    .unwrap_or_else(|_| route.path_prefix.to_ascii_lowercase());
                (prefix, i)
            })
            .collect()
    }

    /// Each provider's spend budgets, every request it serves together:
    /// taken last, so a caller's own limit refuses first.
    fn providers(&mut self, policy: &Policy) -> HashMap<String, Vec<usize>> {
        let zone = policy.budgets.reset_timezone;
        let mut out = HashMap::new();
        for (name, provider) in &policy.providers {
            let budgets = crate::policy::TierConfig {
                daily_spend: provider.daily_spend,
                monthly_spend: provider.monthly_spend,
                ..Default::default()
            };
            let mine = tier_limits(&budgets, zone)
                .iter()
                .map(|l| {
                    self.add(
                        format!("provider/{name}/{}", l.what),
                        format!("provider {name}: {}", l.what.replace('_', " ")),
                        Scope::Global,
                        l.reason,
                        l,
                    )
                })
                .collect();
            out.insert(name.clone(), mine);
        }
        out
    }

    /// The budgets of each run (`runs`), taken after the caller's own and
    /// before the provider's: one record per run of a caller.
    fn runs(&mut self, policy: &Policy) -> Vec<usize> {
        crate::limits::run_table::run_budgets(policy)
            .into_iter()
            .map(|(what, limit, budget)| {
                let meter = match what {
                    "spend" => Meter::Spend,
                    _ => Meter::Tokens,
                };
                let l = TierLimit {
                    what,
                    limit,
                    meter,
                    reason: Reason::RunBudgetExceeded,
                    budget: Some(budget),
                };
                self.add(
                    format!("run/{what}"),
                    format!("run: {what} per run"),
                    Scope::PerRun,
                    Reason::RunBudgetExceeded,
                    &l,
                )
            })
            .collect()
    }

    /// Each passthrough rule's own request limit, all callers together (a
    /// commons too: the default shares apply).
    fn passthrough(&mut self, policy: &Policy) -> Vec<(passthrough::Compiled, usize)> {
        passthrough::compile(&policy.passthrough)
            .into_iter()
            .zip(&policy.passthrough)
            .enumerate()
            .map(|(n, (rule, written))| {
                let shown = written.path.as_ref().or(written.prefix.as_ref());
                let i = self.add_shared(
                    format!("passthrough/{n}/requests"),
                    format!("passthrough {}: requests", shown.map_or("", String::as_str)),
                    &requests(written.requests),
                    &None,
                );
                (rule, i)
            })
            .collect()
    }
}

/// A route's (or passthrough rule's) request limit.
fn requests(limit: Limit) -> TierLimit {
    TierLimit {
        what: "requests",
        limit,
        meter: Meter::Requests,
        reason: Reason::RouteRateLimit,
        budget: None,
    }
}
