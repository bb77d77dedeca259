//! Every decision that produces a [`Verdict`], asked for by [`crate::flow`]
//! (the crate root, `lib.rs`, places it among the layers): identity,
//! demand, route, admission, the answer, and after the response,
//! settlement. It has no host of its own and reads no clock: time comes in
//! as `now_ms`, shared state through the [`SharedStore`] it is handed, and
//! what it decides is returned for `flow` to apply.
//!
//! One concern per file: this one holds the types the steps share and
//! steps 1–3 (identity through [`identity`], demand, route through
//! [`route`], [`ladder`] and `pushback`); [`compile`] builds the buckets and
//! prices of a policy once, [`admit`] reserves (step 4) and peeks (also for
//! [`no_body`], the refusal before the body), [`settle`] reconciles (step 5),
//! [`rewrite`] makes the upstream's body, [`answer`] renders every
//! refusal, [`penalty`] is the penalty box, [`passthrough`] the paths sluice
//! does not read, [`for_fleet`] what the fleet asks of the buckets.

use hashbrown::HashMap;

use serde_json::Value;

use crate::admission::identity::{Identity, RequestView, Resolver};
use crate::host::Headers;
use crate::limits::bucket::Quota;
use crate::limits::reservation::{
    prepare, Caller, Claim, Held, Layout, Refusal, Reserver, Rule, Scope,
};
use crate::policy::sidecar::OnStale;
use crate::policy::zone::Zone;
use crate::policy::{Budget, Limit, Mode, Policy, Window};
use crate::state::codec::Record;
use crate::state::store::{self, Contention, SharedStore, StoreError, Updated};
use crate::usage::anomaly::UsageRing;
use crate::usage::bound;
use crate::usage::demand::{self, Api, Demand};
use crate::usage::estimate::{self, Correction};
use crate::usage::output_limit::SentLimits;
use crate::usage::reconcile::Found;
use crate::usage::shared::BadBody;
use crate::usage::view::View;
use answer::{BucketRefusal, Decision, Degraded, Reason, Refused, Reply};
use route::{Pushback, Route, SidecarSeen, Situation};

pub mod admit;
pub mod answer;
pub mod bucket;
pub mod compile;
pub mod declared;
pub mod for_fleet;
pub mod hash_key;
pub mod identity;
pub mod ladder;
mod leased;
mod named;
pub mod no_body;
mod own_limits;
pub mod passthrough;
pub mod penalty;
pub(crate) mod pushback;
pub mod rewrite;
pub mod route;
pub mod runs;
mod screen;
pub mod settle;

#[cfg(test)]
mod ietf_tests;
#[cfg(test)]
mod multiplier_tests;
#[cfg(test)]
mod org_tests;
#[cfg(test)]
mod provider_tests;
#[cfg(test)]
mod runs_tests;
#[cfg(test)]
mod shares_tests;

pub use crate::policy::prices::{Billed, ModelPrice};
use bucket::Bucket;
pub use bucket::Meter;

/// Metric labels of one decision. Bounded: tiers and models come from the
/// policy (`other` for unlisted models), reasons from a fixed set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels {
    pub decision: Decision,
    pub tier: String,
    pub model: String,
}

/// A budget's `alert_at` crossed by a request: which bucket, and the text
/// the caller is shown (`tier/pro/daily_tokens: 82% used`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetAlert {
    /// Index into the engine's buckets.
    pub bucket: usize,
    pub text: String,
}

/// What to do with a request: send it on ([`Admitted`]), or answer it
/// here ([`Answered`]). A refusal stays typed until the edge renders it
/// ([`Answered::into_reply`]), so what the queue and the metrics read of it
/// (its bucket, its wait) comes from the decision, never from its text.
#[derive(Debug, Clone)]
// The admitted side is the common one: boxing it would add an allocation
// to every admitted request to save a few hundred bytes of stack.
#[allow(clippy::large_enum_variant)]
pub enum Verdict {
    Admit(Admitted),
    Answer(Answered),
}

/// An admitted request: what it holds and what goes upstream with it.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub labels: Labels,
    /// Compare-and-swap races lost while deciding.
    pub contention: Contention,
    /// Headers to add to the upstream's response.
    pub response_headers: Headers,
    /// The request body to send upstream instead of the client's.
    pub body: Option<Vec<u8>>,
    /// What was reserved, to settle after the response.
    pub plan: Option<Plan>,
    /// Budget alert thresholds crossed by this request.
    pub alerts: Vec<BudgetAlert>,
    /// A soft cap rewrote the model.
    pub degraded: Option<Degraded>,
    /// What an admitted request without a body plan (a GET) took, and its
    /// meters: the fleet covers those buckets too.
    pub held: Option<(Vec<Held>, Vec<Meter>)>,
}

/// A request answered here: refused, or given the static answer.
#[derive(Debug, Clone)]
pub struct Answered {
    pub labels: Labels,
    /// Compare-and-swap races lost while deciding.
    pub contention: Contention,
    pub answer: Answer,
    /// Headers added after the decision (the rungs skipped or failed).
    pub headers: Vec<(String, String)>,
}

/// What a request answered here is told.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A refusal, rendered only when it is sent.
    Refused(Refused),
    /// The static answer (a degradation, not a refusal).
    Static(Reply),
}

impl Answered {
    /// The answer the client gets: the one place a refusal is rendered.
    pub fn into_reply(self) -> Reply {
        let mut reply = match self.answer {
            Answer::Refused(refused) => refused.render(),
            Answer::Static(reply) => reply,
        };
        reply.headers.extend(self.headers);
        reply
    }

    fn refused(&self) -> Option<&Refused> {
        match &self.answer {
            Answer::Refused(refused) => Some(refused),
            Answer::Static(_) => None,
        }
    }
}

impl Verdict {
    pub fn labels(&self) -> &Labels {
        match self {
            Verdict::Admit(a) => &a.labels,
            Verdict::Answer(a) => &a.labels,
        }
    }

    pub fn contention(&self) -> Contention {
        match self {
            Verdict::Admit(a) => a.contention,
            Verdict::Answer(a) => a.contention,
        }
    }

    pub fn contention_mut(&mut self) -> &mut Contention {
        match self {
            Verdict::Admit(a) => &mut a.contention,
            Verdict::Answer(a) => &mut a.contention,
        }
    }

    pub fn is_admitted(&self) -> bool {
        matches!(self, Verdict::Admit(_))
    }

    pub fn admitted(&self) -> Option<&Admitted> {
        match self {
            Verdict::Admit(a) => Some(a),
            Verdict::Answer(_) => None,
        }
    }

    /// What an admitted request reserved, to settle after its response.
    pub fn plan(&self) -> Option<&Plan> {
        self.admitted()?.plan.as_ref()
    }

    /// Takes the body an admitted request sends upstream instead of the
    /// client's.
    pub fn take_body(&mut self) -> Option<Vec<u8>> {
        match self {
            Verdict::Admit(a) => a.body.take(),
            Verdict::Answer(_) => None,
        }
    }

    /// The headers added to an admitted request's response.
    pub fn into_response_headers(self) -> Headers {
        match self {
            Verdict::Admit(a) => a.response_headers,
            Verdict::Answer(_) => Headers::default(),
        }
    }

    /// The answer of a request answered here, rendered: the edge.
    pub fn into_reply(self) -> Option<Reply> {
        match self {
            Verdict::Admit(_) => None,
            Verdict::Answer(a) => Some(a.into_reply()),
        }
    }

    /// Takes what an admitted request reserved out of the verdict.
    pub fn take_plan(&mut self) -> Option<Plan> {
        match self {
            Verdict::Admit(a) => a.plan.take(),
            Verdict::Answer(_) => None,
        }
    }

    /// The answer a request answered here gets, rendered (`None`: it goes
    /// upstream).
    pub fn reply(&self) -> Option<Reply> {
        match self {
            Verdict::Admit(_) => None,
            Verdict::Answer(a) => Some(a.clone().into_reply()),
        }
    }

    fn refused(&self) -> Option<&Refused> {
        match self {
            Verdict::Admit(_) => None,
            Verdict::Answer(a) => a.refused(),
        }
    }

    /// The rule id of the bucket that refused (`tier/free/requests`).
    pub fn bucket(&self) -> Option<&str> {
        self.refused()?.rule()
    }

    /// Refused because no per-caller slot was free (`capacity_exhausted`).
    pub fn no_slot(&self) -> bool {
        matches!(self.refused(), Some(Refused::CapacityExhausted { .. }))
    }

    /// A bucket's 429: how long (ms, as its `Retry-After` says) until the
    /// bucket would let the request through.
    pub fn bucket_retry_ms(&self) -> Option<u64> {
        let refused = self.refused()?;
        refused.rule()?;
        (refused.status() == 429).then(|| refused.retry_after_ms())?
    }

    /// A soft cap rewrote the model, or the static table answered.
    pub fn degraded(&self) -> Option<Degraded> {
        match self {
            Verdict::Admit(a) => a.degraded,
            Verdict::Answer(Answered {
                answer: Answer::Static(_),
                ..
            }) => Some(Degraded::Static),
            Verdict::Answer(_) => None,
        }
    }

    /// Budget alert thresholds crossed by this request.
    pub fn alerts(&self) -> &[BudgetAlert] {
        self.admitted().map_or(&[], |a| &a.alerts)
    }

    /// What an admitted request sends upstream instead of the client's
    /// body (tests).
    #[cfg(test)]
    pub(crate) fn body(&self) -> Option<Vec<u8>> {
        self.admitted()?.body.clone()
    }

    /// The headers an admitted request's response gets (tests).
    #[cfg(test)]
    pub(crate) fn response_headers(&self) -> &Headers {
        &self.admitted().expect("admitted").response_headers
    }

    /// What an admitted request reserved, owned (tests).
    #[cfg(test)]
    pub(crate) fn into_plan(mut self) -> Option<Plan> {
        self.take_plan()
    }

    /// Adds a header to what the client gets: the upstream's response
    /// when admitted, the answer when answered here.
    pub fn push_header(&mut self, name: &str, value: &str) {
        match self {
            Verdict::Admit(a) => a.response_headers.push(name, value),
            Verdict::Answer(a) => a.headers.push((name.to_string(), value.to_string())),
        }
    }
}

/// One request as the steps after identity see it: passed whole instead
/// of five loose arguments.
#[derive(Debug, Clone, Copy)]
pub struct RequestContext<'a> {
    pub identity: &'a Identity,
    pub api: Api,
    /// The canonical path (`demand::canonical_path`): route buckets match it.
    pub path: &'a str,
    /// The parsed body, for the APIs sluice reads.
    pub asked: Option<&'a Asked>,
    /// Arrival time: every decision of the request is made as of then.
    pub now_ms: u64,
}

/// Where a request that passed identity and parsing goes (step 3, routing).
#[derive(Debug)]
pub enum Routed {
    Primary,
    /// To a provider of the ladder (kill switch, or the primary is out).
    Rung(Box<ladder::Served>),
    /// The error breaker's half-open probe.
    Probe,
    /// Answered here: a 503, or the static fallback.
    Answered(Box<Verdict>),
}

/// Everything admission reserved for one request, kept until its response
/// is settled.
#[derive(Debug, Clone)]
pub struct Plan {
    pub held: Vec<Held>,
    pub meters: Vec<Meter>,
    pub api: Api,
    /// The model asked for (after any downshift): its buckets, its labels.
    pub model: Option<String>,
    /// The provider of the ladder that serves it, and the provider's
    /// model (`None`: the primary serves it as `model`).
    pub rung: Option<(String, Option<String>)>,
    pub input_raw: f64,
    pub input_estimate: u64,
    /// The most input the server can charge: what the hard budgets
    /// reserved (`usage/bound.rs`), and what they are charged when the
    /// upstream does not report the input.
    pub input_bound: u64,
    /// Which of `held` reserved the bound (hard token and spend budgets);
    /// the others reserved the estimate.
    pub bounded: Vec<bool>,
    /// The tier whose estimate correction this request's usage teaches.
    pub tier: String,
    /// A background response: charged everything it reserved, whatever
    /// its first answer says.
    pub background: bool,
    /// Output reserved: the most the upstream may produce, every choice
    /// (`n`, `best_of`) together.
    pub max_output: u64,
    pub stream: bool,
    /// sluice asked for the usage chunk; the client did not.
    pub strip_usage: bool,
    /// What the model costs where it is sent: reserved at its bound,
    /// settled at its rates.
    pub price: ModelPrice,
    /// The output limit was lowered to fit a budget: the upstream's
    /// answer is not what the client's request would get (not cached).
    pub output_lowered: bool,
    /// A declared API's: where its answer reports usage and text (kept
    /// with the request, so a reload does not change how it settles).
    pub answer_at: Option<crate::usage::declared::AnswerAt>,
}

impl Plan {
    /// Does this plan hold any token or spend units to settle?
    pub fn settles(&self) -> bool {
        self.meters.iter().any(|m| *m != Meter::Requests)
    }
}

/// How a response was settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    pub input: u64,
    pub output: u64,
    /// The counts came from the upstream's usage (not the estimate).
    pub from_usage: bool,
    /// The upstream's usage left the input out (or said 0 for a prompt):
    /// the input is the estimate, the output the upstream's.
    pub input_estimated: bool,
    /// Where the input charged came from: the upstream's usage, the bound
    /// a hard budget reserved, or the estimate.
    pub input_source: InputSource,
    /// The upstream sent usage sluice could not believe.
    pub invalid_usage: bool,
    /// What is charged: the totals above with the parts the usage
    /// priced apart (cached input, cache writes, reasoning).
    pub billed: Billed,
    pub cost: u64,
    /// This request's minute is a consumption surge (first time flagged).
    pub surge: bool,
    /// The global spend breaker is open after this request.
    pub global_open: bool,
    /// Buckets whose extra charge (usage past the reservation) could not be
    /// written even with the settlement's larger retry bound: counted in
    /// `sluice_cas_exhausted_total` and logged, never silently lost.
    pub charges_unwritten: u32,
}

/// Where a settled request's input figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputSource {
    /// The upstream's usage said it.
    Reported,
    /// The upstream did not say; the hard budgets were charged the bound
    /// they reserved (`usage/bound.rs`).
    Bounded,
    /// The upstream did not say and no hard budget held the request: the
    /// estimate.
    Estimated,
}

impl InputSource {
    pub fn code(self) -> &'static str {
        match self {
            InputSource::Reported => "reported",
            InputSource::Bounded => "bounded",
            InputSource::Estimated => "estimated",
        }
    }
}

/// A parsed request body and its raw input estimate.
#[derive(Debug, Clone)]
pub struct Asked {
    pub demand: Demand,
    /// The body as the client sent it: a rewrite is spliced into these
    /// bytes (`usage/splice.rs`), not serialised from a tree.
    pub raw: Vec<u8>,
    pub input_raw: f64,
    /// What the body feeds the server, for the bound a hard budget
    /// reserves (`usage/bound.rs`).
    pub rendered: bound::Rendered,
    /// The body asks the server to work on after it answers (allowed by
    /// the policy): charged its whole reservation.
    pub background: bool,
    /// The limit fields the body set, read with the rest of it.
    pub sent: SentLimits,
    /// `stream_options.include_usage` is `true`.
    pub include_usage: bool,
    /// The body names a listed model by another spelling (`LLAMA3.1:70B`
    /// for `llama3.1:70b`): the upstream gets the policy's name, so the
    /// server runs the very model the request was limited and priced as
    /// (see `named.rs`).
    pub respelled: bool,
    /// The body as a tree: built only for what still reads one (a cache
    /// key, a rewrite, a declared API's pointers, the static answer).
    tree: std::sync::OnceLock<Value>,
}

impl Asked {
    /// The body as a tree (built on the first call, from bytes already
    /// read strictly).
    pub fn body(&self) -> &Value {
        self.tree
            .get_or_init(|| serde_json::from_slice(&self.raw).unwrap_or(Value::Null))
    }
}

pub struct Engine {
    pub policy: Policy,
    resolver: Resolver,
    buckets: Vec<Bucket>,
    tier_buckets: HashMap<String, Vec<usize>>,
    /// Buckets of each declared team and org (see `compile`).
    team_buckets: HashMap<String, Vec<usize>>,
    org_buckets: HashMap<String, Vec<usize>>,
    model_buckets: HashMap<String, Vec<usize>>,
    route_buckets: Vec<(String, usize)>,
    /// Each provider's spend budgets (see `ladder`).
    provider_buckets: HashMap<String, Vec<usize>>,
    /// The budgets of each run (`runs`): taken when the request names one.
    run_buckets: Vec<usize>,
    /// The policy's `passthrough` rules and the bucket of each.
    pub(crate) passthrough: Vec<(crate::admission::passthrough::Compiled, usize)>,
    /// The policy's `apis`, compiled (`Api::Declared` indexes them).
    pub(crate) declared: Vec<crate::usage::declared::Declared>,
    /// The penalty box, when the policy has `abuse`.
    pub(crate) penalty: Option<crate::admission::penalty::PenaltyBox>,
    /// This worker's leases of the shared buckets (`state.worker_leases`).
    leases: std::sync::Mutex<crate::limits::lease::Leases>,
    /// The deployment's key of every hash a caller can aim (see
    /// [`Engine::set_hash_key`]).
    pub(crate) hash_key: crate::policy::keys::HashKey,
}

const CORRECTION_KEY: &str = "sluice:v1:estimate/";

/// The shared-data key of a model's estimate correction for one tier:
/// the model's length first, so no model and tier pair reads as another.
/// Bounded: the policy's models times its tiers.
fn correction_key(model: &str, tier: &str) -> String {
    format!("{CORRECTION_KEY}{}:{model}{tier}", model.len())
}
/// The global per-minute usage ring (one key).
const USAGE_KEY: &str = "sluice:v1:usage";

/// Below this many output tokens a lowered request is refused instead: an
/// answer cut to a handful of tokens is worth less than a clear 429.
pub const MIN_LOWERED_OUTPUT: u64 = 16;

impl Engine {
    /// Step 1: who is calling. A refusal (unknown API key) is a verdict.
    pub fn identify(&self, req: &dyn RequestView) -> Result<Identity, Box<Verdict>> {
        self.identify_why(req).map_err(|(verdict, _)| verdict)
    }

    /// [`Engine::identify`], and why a refused request was refused (for
    /// the penalty box and `sluice_auth_failures_total`).
    pub fn identify_why(
        &self,
        req: &dyn RequestView,
    ) -> Result<Identity, (Box<Verdict>, crate::admission::identity::AuthRefusal)> {
        self.resolver.resolve(req).map_err(|refusal| {
            let refused = Refused::rejected(Reason::Unauthenticated, refusal.message(), None);
            let verdict = Box::new(self.refuse(refused, &self.policy.default_tier, None));
            (verdict, refusal)
        })
    }

    /// Must this admitted request be settled after its response? When it
    /// holds token or spend units, and whenever the global spend breaker
    /// watches spend (else a tier with request limits only would spend
    /// without the breaker ever seeing it).
    pub fn settles(&self, plan: &Plan) -> bool {
        plan.settles() || self.policy.anomaly.is_some()
    }

    /// 400 for a path that reads differently decoded once or twice.
    pub fn ambiguous_path(&self, identity: &Identity) -> Verdict {
        let refused = Refused::rejected(
            Reason::InvalidRequest,
            "The request path is ambiguous (an escape that decodes to another escape or to a control character).",
            None,
        );
        self.refuse(refused, &identity.tier, None)
    }

    /// 404 `unknown_endpoint`: a body (or a POST) to a path sluice does
    /// not read and no `passthrough` rule opens (deny by default).
    pub fn unknown_endpoint(&self, identity: &Identity) -> Verdict {
        let refused = Refused::rejected(
            Reason::UnknownEndpoint,
            "sluice does not know this endpoint, and the policy opens it to no request with a body (see `passthrough`).",
            None,
        );
        self.refuse(refused, &identity.tier, None)
    }

    /// The API of a request to a path sluice does not classify: the
    /// `passthrough` rule that opens it, else `Other`.
    pub fn passthrough(&self, method: &str, canonical: &str) -> Api {
        let rules = self.passthrough.iter().map(|(rule, _)| rule);
        crate::admission::passthrough::find(rules, method, canonical).unwrap_or(Api::Other)
    }

    /// The model a passthrough rule counts its requests against.
    pub fn passthrough_model(&self, api: Api) -> Option<&str> {
        let Api::Passthrough(i) = api else {
            return None;
        };
        self.passthrough.get(usize::from(i))?.0.model.as_deref()
    }

    /// The body cap, checked against a declared or an accumulated size.
    pub fn too_large(&self, identity: &Identity, size: u64) -> Option<Verdict> {
        let cap = self.policy.request.max_body_bytes;
        (size > cap).then(|| {
            let refused = Refused::rejected(
                Reason::RequestTooLarge,
                format!("The request body is larger than the {cap}-byte limit."),
                None,
            );
            self.refuse(refused, &identity.tier, None)
        })
    }

    /// Step 2: what the body asks for (APIs sluice does not read give none).
    pub fn demand(
        &self,
        identity: &Identity,
        api: Api,
        raw: &[u8],
    ) -> Result<Option<Asked>, Box<Verdict>> {
        let asked = self.read_demand(identity, api, raw)?;
        match asked {
            Some(asked) => self.fit_context(identity, asked).map(Some),
            None => Ok(None),
        }
    }

    /// A request whose input, as estimated, does not fit its model's
    /// `context_length` goes to the model's `overflow` (the body rewritten
    /// to name it; its limits and prices apply), or is refused 400
    /// `context_length_exceeded` naming the limit: the server would refuse
    /// it anyway, after it was sent.
    fn fit_context(&self, identity: &Identity, mut asked: Asked) -> Result<Asked, Box<Verdict>> {
        let Some((name, model)) = asked
            .demand
            .model
            .as_deref()
            .and_then(|m| self.policy.models.get_key_value(m))
        else {
            return Ok(asked);
        };
        let Some(context) = model.context_length else {
            return Ok(asked);
        };
        let input = asked.input_raw.ceil() as u64;
        if input <= context {
            return Ok(asked);
        }
        if let Some(to) = &model.overflow {
            asked.demand.model = Some(to.clone());
            asked.respelled = true;
            return Ok(asked);
        }
        let message = format!(
            "This model's maximum context length is {context} tokens; this request's input is about {input} tokens. Shorten the input, or ask for a model with a longer context."
        );
        let refused = Refused::rejected(Reason::ContextLengthExceeded, message, Some("messages"));
        Err(Box::new(self.refuse(
            refused,
            &identity.tier,
            Some(name.as_str()),
        )))
    }

    fn read_demand(
        &self,
        identity: &Identity,
        api: Api,
        raw: &[u8],
    ) -> Result<Option<Asked>, Box<Verdict>> {
        if !api.reads_body() {
            return Ok(None);
        }
        // The cap of the model as the policy names it (`named.rs`).
        let naming = api.naming();
        let cap =
            |model: &str| self.output_cap(self.policy.listed_model(naming, model).unwrap_or(model));
        let refuse = |refused: Refused| Box::new(self.refuse(refused, &identity.tier, None));
        let invalid = |bad: BadBody| {
            refuse(Refused::rejected(
                Reason::InvalidRequest,
                bad.message,
                bad.param.as_deref(),
            ))
        };
        let stored = |field: &'static str| {
            refuse(Refused::rejected(
                Reason::InvalidRequest,
                format!("`{field}` makes the server add stored context to this request's input, which this gateway cannot see or reserve against the token budget; send the whole context in `input` (the policy's `request.allow_stored_context` allows such requests)."),
                Some(field),
            ))
        };
        if let (Api::Declared(i), Some(declared)) = (api, self.declared(api)) {
            // A declared API's body is read at its pointers, from a tree.
            let (demand, body) = declared.parse(i, raw, &cap).map_err(invalid)?;
            let (demand, respelled) = self.name_model(demand).map_err(|r| refuse(*r))?;
            if let Some(field) = self.refuses_stored_context(&demand, &body) {
                return Err(stored(field));
            }
            return Ok(Some(Asked {
                background: false,
                input_raw: declared.input_tokens(&body),
                rendered: bound::declared_bound(raw),
                sent: SentLimits::of(&body),
                include_usage: false,
                respelled,
                tree: body.into(),
                demand,
                raw: raw.to_vec(),
            }));
        }
        // Every other body: read once into a tape, no tree.
        let tape = demand::read_tape(raw).map_err(invalid)?;
        let body = tape.root();
        let demand = demand::demand_of(api, body, &cap).map_err(invalid)?;
        let (demand, respelled) = self.name_model(demand).map_err(|r| refuse(*r))?;
        if let Some(field) = self.refuses_stored_context(&demand, body) {
            return Err(stored(field));
        }
        let background = bound::in_background(demand.api, body);
        if background && !self.policy.request.allow_background {
            return Err(refuse(Refused::rejected(
                Reason::InvalidRequest,
                "`background: true` has the server answer before it generates, so the answer carries no usage to charge and the work goes on after this gateway lets go; send the request without it (the policy's `request.allow_background` allows such requests, charged their whole reservation).".to_string(),
                Some("background"),
            )));
        }
        let include_usage = demand::include_usage(body);
        Ok(Some(Asked {
            background,
            input_raw: estimate::input_tokens_of(demand.api, body),
            rendered: bound::rendered(demand.api, body),
            sent: SentLimits::of(body),
            include_usage,
            respelled,
            tree: Default::default(),
            demand,
            raw: raw.to_vec(),
        }))
    }

    /// The field by which the body asks the server for context it does not
    /// show, unless the policy allows such requests.
    fn refuses_stored_context<'a>(
        &self,
        demand: &Demand,
        body: impl View<'a>,
    ) -> Option<&'static str> {
        if self.policy.request.allow_stored_context {
            return None;
        }
        demand::stored_context(demand.api, body)
    }

    /// Step 3: where the request may go, given the sidecar's state and the
    /// upstream's recent answers.
    /// `dice` in 0..1000 draws the half-open trickle.
    pub fn route(
        &self,
        ctx: &RequestContext,
        seen: &SidecarSeen,
        pushback: &Pushback,
        dice: u32,
    ) -> Routed {
        let RequestContext {
            identity,
            api,
            asked,
            now_ms,
            ..
        } = *ctx;
        let model = asked.and_then(|a| a.demand.model.as_deref());
        let backend = model
            .and_then(|m| self.policy.models.get(m))
            .map_or("local", |m| m.backend.as_str());
        let sidecar = self.policy.sidecar.as_ref();
        let served = self.rung_for(api, model);
        let situation = Situation {
            seen,
            stale_after_ms: sidecar.map_or(u64::MAX, |s| s.stale_after_ms),
            on_stale: sidecar.map_or(OnStale::FailOpen, |s| s.on_stale),
            model,
            backend,
            upstream: pushback.record,
            credential_paused_until_ms: pushback.credential_paused_until_ms,
            caller: pushback.caller,
            has_fallback: served.is_some(),
            rung_when_out: served.is_some() && self.ladder_when_out(),
            static_when_out: self
                .policy
                .static_fallback
                .as_ref()
                .is_some_and(|s| s.when_primary_out),
            default_retry_after_s: sidecar.map_or(30, |s| s.retry_after_ms / 1000),
            now_ms,
            dice,
        };
        let route = match (route::route(&situation), served) {
            (Route::Fallback, Some(served)) => return Routed::Rung(Box::new(served)),
            (Route::Fallback, None) => Route::Static,
            (route, _) => route,
        };
        match route {
            Route::Primary => Routed::Primary,
            Route::Probe => Routed::Probe,
            Route::Fallback | Route::Static => Routed::Answered(Box::new(self.static_verdict(ctx))),
            Route::Refuse {
                reason,
                retry_after_s,
                why,
            } => {
                let refused = Refused::unavailable(reason, why, retry_after_s);
                Routed::Answered(Box::new(self.refuse(refused, &identity.tier, model)))
            }
        }
    }

    /// The static answer to a request nothing upstream may serve (a
    /// degradation, not a refusal).
    pub fn static_verdict(&self, ctx: &RequestContext) -> Verdict {
        let RequestContext {
            identity,
            api,
            asked,
            now_ms,
            ..
        } = *ctx;
        let model = asked.and_then(|a| a.demand.model.as_deref());
        let text = self.static_text(api, asked.map(Asked::body));
        let stream = asked.is_some_and(|a| a.demand.stream);
        let reply = match self.declared(api) {
            Some(declared) => answer::declared_static(declared, &text),
            None => {
                answer::static_answer(api, model.unwrap_or("sluice-static"), &text, stream, now_ms)
            }
        };
        let decision = Decision::Degrade(Degraded::Static);
        self.answered(Answer::Static(reply), decision, &identity.tier, model)
    }

    /// `model` as a metric label: configured models by name, others as
    /// `other`, none as `none`, so a client cannot mint label values.
    pub fn model_label(&self, model: Option<&str>) -> String {
        match model {
            None => "none".into(),
            Some(m) if self.policy.models.contains_key(m) => m.into(),
            Some(_) => "other".into(),
        }
    }

    /// The verdict of a refusal: kept typed, its reason in the labels.
    pub(crate) fn refuse(&self, refused: Refused, tier: &str, model: Option<&str>) -> Verdict {
        let decision = Decision::Refuse(refused.reason());
        self.answered(Answer::Refused(refused), decision, tier, model)
    }

    /// A request answered here as `decision`.
    fn answered(
        &self,
        answer: Answer,
        decision: Decision,
        tier: &str,
        model: Option<&str>,
    ) -> Verdict {
        Verdict::Answer(Answered {
            labels: Labels {
                decision,
                tier: tier.into(),
                model: self.model_label(model),
            },
            contention: Contention::default(),
            answer,
            headers: Vec::new(),
        })
    }

    /// The principal as the audit log shows it: a salted SHA-256, never the
    /// raw key, address or subject.
    pub fn audit_principal(&self, identity: &Identity) -> String {
        let salt = self.policy.audit.as_ref().map_or("", |a| a.salt.as_str());
        let salted = format!("{salt}\n{}", identity.principal);
        crate::policy::keys::sha256_hex(salted.as_bytes())[..32].to_string()
    }
}

/// A request context from its parts (tests of the engine and pushback).
#[cfg(test)]
pub(crate) fn ctx<'a>(
    identity: &'a Identity,
    api: Api,
    path: &'a str,
    asked: Option<&'a Asked>,
    now_ms: u64,
) -> RequestContext<'a> {
    RequestContext {
        identity,
        api,
        path,
        asked,
        now_ms,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use crate::state::store::MemStore;
    use crate::usage::reconcile::Usage;
    use serde_json::json;

    /// A caller known only by its address (shared with the engine's other
    /// test modules).
    pub(crate) struct Caller(pub &'static str);
    impl RequestView for Caller {
        fn header(&self, _: &str) -> Option<std::borrow::Cow<'_, str>> {
            None
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some(self.0.into())
        }
    }

    fn engine_with(policy: Value) -> (Engine, MemStore) {
        let e = Engine::new(Policy::from_value(policy).unwrap());
        let store = MemStore::default();
        e.prepare(&store).unwrap();
        (e, store)
    }

    fn engine() -> (Engine, MemStore) {
        engine_with(json!({
            "default_tier": "free",
            "tiers": {"free": {"requests": "10/min"}},
            "models": {"big": {"requests": "3/min"}},
            "routes": [{"name": "chat", "path_prefix": "/v1/chat/", "requests": "100/s"}],
        }))
    }

    fn asked(e: &Engine, body: Value) -> Asked {
        let id = e.identify(&Caller("9.9.9.9:1")).unwrap();
        e.demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
            .unwrap()
            .unwrap()
    }

    fn chat(model: &str, max_tokens: u64) -> Value {
        json!({"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
    }

    #[test]
    fn the_queues_peek_sizes_a_request_as_admission_does() {
        // Output tokens under the least admission would lower a chat to:
        // the peek declines a chat, but an embedding produces no output
        // (as admission reserves none) and is not declined.
        let (e, store) = engine_with(json!({
            "default_tier": "free",
            "tiers": {"free": {"requests": "10/min", "output_tokens": "5/min"}},
        }));
        let id = e.identify(&Caller("9.9.9.9:1")).unwrap();
        let embed = e
            .demand(&id, Api::OllamaEmbed, br#"{"model":"m","input":["a","b"]}"#)
            .unwrap()
            .unwrap();
        let embed_ctx = ctx(&id, Api::OllamaEmbed, "/api/embed", Some(&embed), 0);
        assert!(e.would_admit(&store, &embed_ctx, 0).is_none());
        assert!(e.admit(&store, &embed_ctx).reply().is_none());
        let chat = asked(&e, chat("m", 100));
        let chat_ctx = ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&chat), 0);
        let declined = e.would_admit(&store, &chat_ctx, 0).expect("declined");
        assert_eq!(declined.reply().unwrap().status, 429);
    }

    #[test]
    fn free_tier_gets_ten_then_a_full_429() {
        let (e, store) = engine();
        let id = e.identify(&Caller("10.0.0.1:1234")).unwrap();
        let results: Vec<Verdict> = (0..12)
            .map(|_| e.admit(&store, &ctx(&id, Api::Other, "/v1/models", None, 1_000)))
            .collect();
        assert_eq!(results.iter().filter(|v| v.reply().is_none()).count(), 10);
        assert_eq!(
            results[0].response_headers().iter().nth(1),
            Some(("x-ratelimit-remaining", "9"))
        );
        let refused = results[11].reply().unwrap();
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-sluice-reason"), Some("user_rate_limit"));
        assert_eq!(
            results[11].labels().decision.reason_code(),
            "user_rate_limit"
        );
    }

    #[test]
    fn model_limit_applies_across_callers_and_labels_are_bounded() {
        let (e, store) = engine();
        let big = asked(&e, chat("big", 10));
        for caller in ["1.1.1.1:1", "2.2.2.2:1", "3.3.3.3:1"] {
            let id = e.identify(&Caller(caller)).unwrap();
            assert!(e
                .admit(
                    &store,
                    &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&big), 0)
                )
                .reply()
                .is_none());
        }
        let id = e.identify(&Caller("4.4.4.4:1")).unwrap();
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&big), 0),
        );
        assert_eq!(v.labels().decision.reason_code(), "model_rate_limit");
        assert_eq!(v.labels().model, "big");
        let (e, store) = engine_with(json!({
            "default_tier": "free",
            "tiers": {"free": {"requests": "10/min"}},
            "models": {"big": {"requests": "3/min"}},
            "unlisted_models": {"price": {"input": 0, "output": 0}},
        }));
        let other = asked(&e, chat("gpt-made-up", 10));
        let v = e.admit(
            &store,
            &ctx(
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&other),
                0,
            ),
        );
        assert!(v.reply().is_none());
        assert_eq!(v.labels().model, "other");
    }

    #[test]
    fn token_budget_admits_exactly_what_fits_and_settles_to_usage() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 10_000}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("m", 490));
        let mut plans = Vec::new();
        for _ in 0..30 {
            let v = e.admit(
                &store,
                &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
            );
            if let Some(plan) = v.into_plan() {
                plans.push(plan);
            }
        }
        // A hard budget reserves the input's bound, not its estimate.
        assert!(plans[0].input_bound > plans[0].input_estimate);
        let each = plans[0].input_bound + 490;
        let full = plans.iter().filter(|p| p.max_output == 490).count() as u64;
        assert_eq!(full, 10_000 / each, "reserved {each} each");
        // What was left is given to one more request, with its output
        // lowered to fit: never a token over the budget.
        let reserved: u64 = plans.iter().map(|p| p.input_bound + p.max_output).sum();
        assert!(
            reserved <= 10_000 && 10_000 - reserved < MIN_LOWERED_OUTPUT + each,
            "{reserved}"
        );
        // The real usage is smaller: settling frees room for more.
        for p in &plans {
            let usage = Found::Usage(Usage {
                input: 10,
                output: 90,
            });
            let (s, _) = e.settle(&store, p, usage, 0, true, 0);
            assert_eq!((s.input, s.output, s.from_usage), (10, 90, true));
        }
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert!(v.reply().is_none());
    }

    #[test]
    fn output_is_lowered_to_what_a_hard_budget_covers() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 1_000}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("m", 800));
        let first = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert!(
            first.reply().is_none() && first.body().is_none(),
            "fits as asked"
        );
        let second = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert!(second.reply().is_none());
        let body: Value = serde_json::from_slice(&second.body().unwrap()).unwrap();
        let lowered = body["max_tokens"].as_u64().unwrap();
        let plan = second.plan().unwrap();
        assert_eq!(lowered, plan.max_output);
        assert_eq!(first.plan().unwrap().input_bound * 2 + 800 + lowered, 1_000);
        let third = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert_eq!(
            third.labels().decision.reason_code(),
            "daily_budget_exceeded"
        );
        let reply = third.reply().unwrap();
        let json: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(json["error"]["code"], "daily_budget_exceeded");
        assert!(json["error"]["sluice"]["reset_at"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00Z"));
    }

    #[test]
    fn soft_cap_downshifts_and_alerts() {
        let (e, store) = engine_with(json!({
            "default_tier": "pro",
            "tiers": {"pro": {"daily_tokens": {"limit": 1_000, "mode": "soft", "alert_at": "50%"}}},
            "models": {"big": {"downshift_to": "small"}, "small": {}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("big", 600));
        let first = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert_eq!(first.degraded(), None);
        assert_eq!(first.alerts().len(), 1, "{:?}", first.alerts());
        let second = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert!(second.reply().is_none(), "soft caps never refuse");
        assert_eq!(second.degraded().map(Degraded::code), Some("downshift"));
        let body: Value = serde_json::from_slice(&second.body().unwrap()).unwrap();
        assert_eq!(body["model"], "small");
        assert_eq!(
            second.response_headers().get("x-sluice-degraded"),
            Some("downshift")
        );
    }

    #[test]
    fn spend_is_settled_with_each_part_at_its_own_rate() {
        // Per 1M tokens: input 2, cached input 0.5, output 8, reasoning 8.
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_spend": 1.0}},
            "models": {"paid": {"price": {"input": "2", "output": "8",
                                          "cached_input": "0.5", "reasoning": "8"}}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("paid", 100));
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        let plan = v.plan().unwrap();
        let usage = Found::Usage(Usage {
            input: 1000,
            output: 100,
        });
        let details = crate::usage::reconcile::Details {
            cached_input: 800,
            cache_write_input: 0,
            reasoning_output: 40,
        };
        let (s, _) = e.settle_parts(&store, plan, usage, details, 0, true, 0);
        // 200 × 2 + 800 × 0.5 + 100 × 8 = 400 + 400 + 800 per 1M = 1,600 µ.
        assert_eq!(s.cost, 1600);
        assert_eq!(s.billed.cached_input, 800);
        // Without parts every input token is plain: 1000 × 2 + 100 × 8.
        let (plain, _) = e.settle(&store, plan, usage, 0, true, 0);
        assert_eq!(plain.cost, 2800);
    }

    #[test]
    fn a_price_is_written_one_way_and_errors_name_its_field() {
        let with = |model: Value| {
            Policy::from_value(json!({"default_tier": "t", "tiers": {"t": {}},
                                      "models": {"m": model}}))
        };
        let e = with(json!({"price": {"input": "1", "output": "1"}, "gpu":
                            {"cost_per_hour": 1, "tokens_per_second": 1}}))
        .unwrap_err();
        assert_eq!(e.path, "models.m");
        let e = with(json!({"price": {"input": "1", "output": "-2"}})).unwrap_err();
        assert_eq!(e.path, "models.m.price.output");
        let e = with(json!({"price": {"input_per_1k": 1, "output": 2}})).unwrap_err();
        assert_eq!(e.path, "models.m.price.output");
        let e = with(json!({"price_litellm": {"input_cost_per_token": 1e-6}})).unwrap_err();
        assert_eq!(e.path, "models.m.price_litellm.output_cost_per_token");
        let p = with(json!({"price_litellm": {"input_cost_per_token": 2.5e-6,
                                              "output_cost_per_token": 1e-5,
                                              "litellm_provider": "openai"}}))
        .unwrap();
        let written = with(json!({"price": {"input": "2.5", "output": "10"}})).unwrap();
        assert_eq!(p.models["m"].priced, written.models["m"].priced);
        // The per-1,000 form is the same price ×1000 per 1M, exactly.
        let k = with(json!({"price": {"input_per_1k": 0.0025, "output_per_1k": 0.01}})).unwrap();
        assert_eq!(k.models["m"].priced, written.models["m"].priced);
    }

    #[test]
    fn spend_caps_price_input_and_output() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_spend": 0.1}},
            "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 2.0}}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("paid", 4));
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        let plan = v.plan().unwrap();
        let cost = plan.price.bound_micros(plan.input_estimate, 4);
        assert_eq!(cost, plan.input_estimate * 1000 + 8000);
        let a = asked(&e, chat("paid", 5000));
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        assert_eq!(v.labels().decision.reason_code(), "spend_cap_exceeded");
    }

    #[test]
    fn streams_ask_for_usage_and_missing_usage_settles_from_the_estimate() {
        let (e, store) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}}));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let mut body = chat("m", 50);
        body["stream"] = json!(true);
        let a = asked(&e, body);
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        let rewritten: Value = serde_json::from_slice(&v.body().unwrap()).unwrap();
        assert_eq!(rewritten["stream_options"]["include_usage"], true);
        let plan = v.plan().unwrap();
        assert!(plan.strip_usage);
        let (s, _) = e.settle(&store, plan, Found::Invalid, 7, true, 0);
        assert_eq!(
            (s.input, s.output, s.from_usage, s.invalid_usage),
            (plan.input_estimate, 7, false, true)
        );
        let (s, _) = e.settle(&store, plan, Found::Nothing, 0, false, 0);
        assert_eq!(
            (s.input, s.output),
            (0, 0),
            "an upstream error costs nothing"
        );
    }

    #[test]
    fn a_usage_without_its_input_settles_the_input_from_the_estimate() {
        // Ollama's cached prompt: no `prompt_eval_count` (reads as 0), or
        // `prompt_tokens: 0` through its OpenAI API.
        let (e, store) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {"tokens": "10000/min"}}}));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("m", 50));
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        let plan = v.plan().unwrap();
        assert!(plan.input_estimate > 0);
        let usage = Found::Usage(Usage {
            input: 0,
            output: 9,
        });
        let (s, _) = e.settle(&store, plan, usage, 3, true, 0);
        assert_eq!(
            (s.input, s.output, s.from_usage, s.input_estimated),
            (plan.input_estimate, 9, true, true)
        );
        let usage = Found::Usage(Usage {
            input: 4,
            output: 9,
        });
        let (s, _) = e.settle(&store, plan, usage, 3, true, 0);
        assert_eq!((s.input, s.output, s.input_estimated), (4, 9, false));
    }

    #[test]
    fn the_global_breaker_opens_at_the_spend_ceiling() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {}},
            "models": {"paid": {"price": {"input_per_1k": 1.0, "output_per_1k": 1.0}}},
            "anomaly": {"max_spend_per_hour": 0.05},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("paid", 10));
        let mut opened = false;
        for _ in 0..10 {
            let v = e.admit(
                &store,
                &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
            );
            if let Some(reply) = &v.reply() {
                assert_eq!(v.labels().decision.reason_code(), "global_breaker_open");
                assert_eq!(reply.status, 503);
                opened = true;
                break;
            }
            let usage = Found::Usage(Usage {
                input: 10_000,
                output: 0,
            });
            e.settle(&store, v.plan().unwrap(), usage, 0, true, 0);
        }
        assert!(opened, "0.05 spent after 5 requests of 0.01");
        // An hour later the window has slid past it.
        let v = e.admit(
            &store,
            &ctx(
                &id,
                Api::OpenAiChat,
                "/v1/chat/completions",
                Some(&a),
                3_600_000,
            ),
        );
        assert!(v.reply().is_none());
    }

    struct Keyed(&'static str, &'static str);
    impl RequestView for Keyed {
        fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
            (name == "x-api-key" && !self.0.is_empty())
                .then(|| self.0.to_string())
                .map(std::borrow::Cow::Owned)
        }
        fn jwt_claim(&self, _: &str, _: &str, _: &str) -> Option<String> {
            None
        }
        fn client_address(&self) -> Option<String> {
            Some(self.1.into())
        }
    }

    #[test]
    fn a_flood_leaves_declared_keys_alone_and_new_callers_get_capacity_exhausted() {
        let (e, store) = engine_with(json!({
            "default_tier": "free",
            "identity": {"sources": ["api_key", "client_address"],
                         "api_key": {"keys": {"k-free": "free"}}},
            "tiers": {"free": {"requests": "10/min", "daily_tokens": 5_000,
                               "anonymous_total": {"requests": "1000/min"}}},
            "state": {"principal_slots": 8},
        }));
        let declared = e.identify(&Keyed("k-free", "1.1.1.1:1")).unwrap();
        assert!(declared.declared);
        let admit =
            |id: &Identity| e.admit(&store, &ctx(id, Api::Other, "/v1/models", None, 1_000));
        for i in 0..600u32 {
            let addr: &'static str = format!("10.0.{}.{}:1", i / 250, i % 250).leak();
            admit(&e.identify(&Keyed("", addr)).unwrap());
        }
        let late = e.identify(&Keyed("", "192.168.1.1:1")).unwrap();
        assert!(!late.declared);
        let v = admit(&late);
        assert_eq!(v.labels().decision.reason_code(), "capacity_exhausted");
        assert!(v.no_slot());
        let reply = v.reply().unwrap();
        assert_eq!(
            (reply.status, reply.header("retry-after")),
            (429, Some("6"))
        );
        let admitted = (0..10)
            .filter(|_| admit(&declared).reply().is_none())
            .count();
        assert_eq!(admitted, 10, "the declared key keeps all of its capacity");
    }

    #[test]
    fn the_anonymous_total_binds_undeclared_callers_only() {
        let (e, store) = engine_with(json!({
            "default_tier": "free",
            "identity": {"sources": ["api_key", "client_address"],
                         "api_key": {"keys": {"k-free": "free"}}},
            "tiers": {"free": {"requests": "10/min", "anonymous_total": {"requests": "5/min"}}},
        }));
        let admit = |id: &Identity| e.admit(&store, &ctx(id, Api::Other, "/v1/models", None, 0));
        let results: Vec<Verdict> = (0..8u8)
            .map(|i| {
                admit(
                    &e.identify(&Keyed("", format!("10.0.0.{i}:1").leak()))
                        .unwrap(),
                )
            })
            .collect();
        assert_eq!(results.iter().filter(|v| v.reply().is_none()).count(), 5);
        assert_eq!(
            results[7].labels().decision.reason_code(),
            "anonymous_limit"
        );
        assert_eq!(results[7].bucket(), Some("tier/free/anonymous/requests"));
        let declared = e.identify(&Keyed("k-free", "10.0.0.1:1")).unwrap();
        assert!(
            admit(&declared).reply().is_none(),
            "declared keys are outside it"
        );
    }

    #[test]
    fn a_hard_budget_is_charged_the_bound_for_input_nobody_reported() {
        let (e, store) = engine_with(json!({"default_tier": "t",
            "tiers": {"t": {"daily_tokens": 100_000, "tokens": "100000/min"}}}));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let a = asked(&e, chat("m", 50));
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        let plan = v.plan().unwrap();
        // The daily budget holds the bound, the rate the estimate.
        let mut bounded = plan.bounded.clone();
        bounded.sort();
        assert_eq!(bounded, vec![false, true]);
        assert!(plan.input_bound > plan.input_estimate);
        let (s, _) = e.settle(&store, plan, Found::Nothing, 7, true, 0);
        assert_eq!(s.input_source, InputSource::Bounded);
        assert_eq!((s.input, s.output), (plan.input_bound, 7));
        let (s, _) = e.settle(
            &store,
            plan,
            Found::Usage(Usage {
                input: 3,
                output: 7,
            }),
            7,
            true,
            0,
        );
        assert_eq!((s.input_source, s.input), (InputSource::Reported, 3));
        // Without a hard budget, the estimate.
        let (e, store) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {"tokens": "100000/min"}}}));
        let v = e.admit(
            &store,
            &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
        );
        let plan = v.plan().unwrap();
        let (s, _) = e.settle(&store, plan, Found::Nothing, 7, true, 0);
        assert_eq!(
            (s.input_source, s.input),
            (InputSource::Estimated, plan.input_estimate)
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// A server that counts more input than the estimate (its own
        /// tokenizer, up to a token per byte of the text) and generates up
        /// to the limit never takes a hard budget past its limit: every
        /// reservation covers what settlement charges.
        #[test]
        fn a_hard_budget_is_never_overshot_whatever_the_server_counts(
            requests in proptest::collection::vec(
                ("[a-zà-ù ,.]{20,400}", 0.0f64..=1.0, 1u64..300, 0.0f64..=1.0), 1..40),
        ) {
            let (e, store) = engine_with(json!({"default_tier": "t",
                "tiers": {"t": {"daily_tokens": 5_000}}}));
            let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
            let mut charged = 0u64;
            for (text, input_share, max_tokens, output_share) in requests {
                let body = json!({"model": "m", "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": text}]});
                let a = asked(&e, body);
                let v = e.admit(&store, &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0));
                let Some(plan) = v.plan() else { continue };
                // The most a byte-level tokenizer makes of the text, and a
                // template of a few tokens.
                let most = text.len() as u64 + 30;
                let input = (most as f64 * input_share) as u64 + 1;
                let output = (plan.max_output as f64 * output_share) as u64;
                let (s, _) = e.settle(&store, plan, Found::Usage(Usage { input, output }), output, true, 0);
                proptest::prop_assert_eq!(s.charges_unwritten, 0);
                charged += s.input + s.output;
            }
            proptest::prop_assert!(charged <= 5_000, "{charged} charged on 5,000");
        }
    }

    #[test]
    fn a_background_response_is_refused_unless_allowed_then_charged_whole() {
        let body =
            json!({"model": "m", "input": "hi", "max_output_tokens": 100, "background": true});
        let responses = |e: &Engine| {
            let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
            e.demand(&id, Api::OpenAiResponses, body.to_string().as_bytes())
        };
        let (e, _) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {"daily_tokens": 5_000}}}));
        let refused = responses(&e).unwrap_err().reply().unwrap();
        assert_eq!(refused.status, 400);
        let got: Value = serde_json::from_slice(&refused.body).unwrap();
        assert_eq!(got["error"]["param"], "background", "{got}");
        // `background: false` is an ordinary request.
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let plain = json!({"model": "m", "input": "hi", "background": false});
        assert!(e
            .demand(&id, Api::OpenAiResponses, plain.to_string().as_bytes())
            .is_ok());

        let (e, store) = engine_with(json!({"default_tier": "t",
            "tiers": {"t": {"daily_tokens": 5_000}}, "request": {"allow_background": true}}));
        let a = responses(&e).unwrap().unwrap();
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let plan = e
            .admit(
                &store,
                &ctx(&id, Api::OpenAiResponses, "/v1/responses", Some(&a), 0),
            )
            .into_plan()
            .unwrap();
        // `{"status": "queued", "usage": null}`: nothing reported, yet the
        // model goes on; charged all it reserved.
        let (s, _) = e.settle(&store, &plan, Found::Nothing, 0, true, 0);
        assert_eq!((s.input, s.output), (plan.input_bound, 100));
        let (s, _) = e.settle(
            &store,
            &plan,
            Found::Usage(Usage {
                input: 3,
                output: 1,
            }),
            1,
            true,
            0,
        );
        assert_eq!((s.input, s.output), (plan.input_bound, 100));
    }

    #[test]
    fn one_tier_cannot_move_another_tiers_estimate_or_a_hard_reservation() {
        let (e, store) = engine_with(json!({"default_tier": "a",
            "identity": {"sources": ["api_key", "client_address"], "api_key": {"keys": {"kb": "b"}}},
            "tiers": {"a": {"daily_tokens": 1_000_000}, "b": {"daily_tokens": 1_000_000}},
            "models": {"m": {}}}));
        let a_id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        assert_eq!(a_id.tier, "a");
        let long = "word ".repeat(200);
        let body =
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": long}]});
        let a = asked(&e, body);
        let admit = |id: &Identity| {
            e.admit(
                &store,
                &ctx(id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
            )
            .into_plan()
            .unwrap()
        };
        let before = admit(&a_id);
        // Tier a's usage says its requests cost 0.6 of the estimate.
        for _ in 0..50 {
            let truth = (before.input_raw * 0.6) as u64;
            e.settle(
                &store,
                &before,
                Found::Usage(Usage {
                    input: truth,
                    output: 1,
                }),
                0,
                true,
                0,
            );
        }
        let after = admit(&a_id);
        assert!(after.input_estimate < before.input_estimate);
        assert_eq!(
            after.input_bound, before.input_bound,
            "the bound never learns"
        );
        // Tier b's estimate is its own.
        let b_id = e.identify(&Keyed("kb", "5.6.7.8:9")).unwrap();
        assert_eq!(b_id.tier, "b");
        assert_eq!(admit(&b_id).input_estimate, before.input_estimate);
    }

    #[test]
    fn usage_teaches_the_estimate() {
        let (e, store) =
            engine_with(json!({"default_tier": "t", "tiers": {"t": {}}, "models": {"m": {}}}));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let long = "word ".repeat(200);
        let a = asked(
            &e,
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": long}]}),
        );
        let before = e
            .admit(
                &store,
                &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
            )
            .into_plan()
            .unwrap();
        for _ in 0..50 {
            let truth = (before.input_raw * 1.5) as u64;
            e.settle(
                &store,
                &before,
                Found::Usage(Usage {
                    input: truth,
                    output: 1,
                }),
                0,
                true,
                0,
            );
        }
        let after = e
            .admit(
                &store,
                &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
            )
            .into_plan()
            .unwrap();
        let ratio = after.input_estimate as f64 / before.input_estimate as f64;
        assert!((1.4..1.6).contains(&ratio), "{ratio}");
    }

    #[test]
    fn every_choice_is_reserved_and_lowered_per_choice() {
        let (e, store) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"daily_tokens": 1_000}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let admit = |body: Value| {
            let a = asked(&e, body);
            e.admit(
                &store,
                &ctx(&id, Api::OpenAiChat, "/v1/chat/completions", Some(&a), 0),
            )
        };
        let mut body = chat("m", 200);
        body["n"] = json!(4);
        let first = admit(body.clone());
        let plan = first.plan().unwrap();
        assert_eq!(plan.max_output, 800, "4 choices × 200");
        assert!(
            first.body().is_none(),
            "fits as asked: the body goes up untouched"
        );
        // 1,000 − 800 − input left: 4 choices of 200 do not fit any more;
        // each choice is lowered so that all four fit.
        let second = admit(body.clone());
        let plan2 = second.plan().unwrap();
        let sent: Value = serde_json::from_slice(&second.body().unwrap()).unwrap();
        let per_choice = sent["max_tokens"].as_u64().unwrap();
        assert!(
            (MIN_LOWERED_OUTPUT..200).contains(&per_choice),
            "{per_choice}"
        );
        assert_eq!(plan2.max_output, per_choice * 4);
        assert!(plan.input_estimate + 800 + plan2.input_estimate + plan2.max_output <= 1_000);
        // `best_of` counts the same way; past what the budget covers: 429.
        let mut greedy = chat("m", 100);
        greedy["best_of"] = json!(128);
        let refused = admit(greedy);
        assert_eq!(refused.reply().unwrap().status, 429);
    }

    #[test]
    fn the_output_cap_is_the_models_or_the_gateways() {
        let (e, _) = engine_with(json!({
            "default_tier": "t",
            "tiers": {"t": {"requests": "10/min"}},
            "models": {"small": {"max_output": 4096}},
            "request": {"max_output": 100_000},
            "unlisted_models": {"price": {"input": 0, "output": 0}},
        }));
        let id = e.identify(&Caller("1.2.3.4:5")).unwrap();
        let refused = |body: Value| {
            e.demand(&id, Api::OpenAiChat, body.to_string().as_bytes())
                .err()
                .map(|v| serde_json::from_slice::<Value>(&v.reply().unwrap().body).unwrap())
        };
        let err = refused(chat("small", 4097)).unwrap();
        assert_eq!(err["error"]["param"], "max_tokens");
        assert!(refused(chat("small", 4096)).is_none());
        assert!(refused(chat("other", 100_000)).is_none());
        let err = refused(json!({"model": "other", "max_tokens": u64::MAX})).unwrap();
        assert_eq!(err["error"]["param"], "max_tokens");
    }
}
