//! The response cache on the request path (docs/src/design.md, "Response cache"): a
//! lookup in the sidecar before admission for requests of cache-enabled models, a hit
//! answered here, a complete successful answer stored after it.
//!
//! - Never blocks a request on the cache: the lookup waits at most
//!   `cache.lookup_timeout`; no answer, a bad answer or an unreachable
//!   sidecar is a miss (`sluice_cache_total{result="timeout"}` / `miss`).
//! - A hit still passes admission, with the policy's `hit_cost`: by
//!   default it counts as a request and reserves and charges 0 tokens, so
//!   a caller over its request rate is refused as ever, and one over its
//!   token budget still gets the cached answer (`hit_cost.tokens: true`
//!   reserves the stored answer's tokens instead). In fleet mode the hit
//!   passes the fleet's gate too, its reply kept until the fleet admits it.
//! - Stored only when complete and successful (`cache::answer`),
//!   and never larger than `cache.max_entry_bytes` (buffered here); never
//!   a stream sluice cut, nor an answer under an output limit lowered to
//!   fit a budget (the key is the client's body, with its own limit).

use serde_json::Value;
use sluice_wire::cache::{Entry, LookupAnswer, LookupRequest, Semantic, StoreRequest};

use super::Stream;
use crate::admission::Asked;
use crate::cache::answer::{self as cache_answer, Rendered};
use crate::cache::key as cache_key;
use crate::cache::tier::{self as cache_tier, Lookup as InEnvoy, Tier};
use crate::host::metrics;
use crate::host::{Action, Host};
use crate::policy::cache::CacheCaller;
use crate::usage::demand::Api;

/// The question's exact key and, for a semantic rule, its parts: both
/// under the deployment's salt and the scope of who may share its answer.
fn keys_of(
    salt: &str,
    rule: &crate::policy::cache::CacheRule,
    scope: &str,
    model: &str,
    api: Api,
    query: &str,
    body: &Value,
) -> Option<(String, Option<Semantic>)> {
    let key = cache_key::exact_key(salt, scope, model, api, query, body).ok()?;
    let semantic = rule
        .semantic
        .then(|| cache_key::semantic_parts(salt, scope, model, api, query, body))
        .flatten()
        .map(|p| Semantic {
            context: p.context,
            text: p.text,
        });
    Some((key, semantic))
}

/// A lookup in flight.
pub(super) struct Wait {
    pub(super) token: u32,
    /// The exact key (hex), for the flight of a miss (`flight`).
    pub(super) key: String,
    pub(super) asked: Option<Asked>,
    pub(super) api: Api,
    pub(super) model: String,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
}

impl Wait {
    /// The lookup of `asked` under `key`, before its token is known.
    fn new(key: String, asked: &Asked, api: Api, model: &str) -> Wait {
        let body = asked.body();
        Wait {
            token: 0,
            key,
            stream: api.streams(body),
            include_usage: include_usage(body),
            asked: Some(asked.clone()),
            api,
            model: model.to_string(),
        }
    }
}

/// A hit admitted locally, kept while the fleet decides.
pub(super) struct HeldHit {
    pub(super) rendered: Rendered,
    /// The stored answer's tokens (prompt + completion) and what it cost
    /// when it was first asked: what the hit saved.
    pub(super) saved_tokens: u64,
    pub(super) saved_spend: u64,
    /// What the hit is charged (its `hit_cost`).
    pub(super) input: u64,
    pub(super) output: u64,
    pub(super) age_s: u64,
    pub(super) kind: &'static str,
    /// The model as metrics name it (`Engine::model_label`).
    pub(super) label: String,
    pub(super) model: String,
    pub(super) asked: Option<Asked>,
}

impl HeldHit {
    pub(super) fn refused(&self, host: &dyn Host) {
        metrics::CACHE.add_at(host, &["refused", self.kind, &self.label], 1);
    }
}

/// What to store once the answer is complete.
pub(super) struct ToStore {
    pub(super) api: Api,
    pub(super) key: String,
    pub(super) model: String,
    pub(super) ttl_s: u64,
    pub(super) semantic: Option<Semantic>,
    pub(super) max_bytes: u64,
    /// The upstream's answer so far (`None` once it outgrew the bound).
    pub(super) buf: Option<Vec<u8>>,
    framing: Framing,
    pub(super) upstream_cache_control: Option<String>,
    /// The exact tier in Envoy keeps it (single-Envoy mode, `exact` on).
    pub(super) tier: Option<Tier>,
    /// Hex SHA-256 of the scope value: the sidecar's bounds per scope and
    /// purges by scope go by it.
    pub(super) scope_id: String,
    /// The sidecar's cache generation when the request was looked up: an
    /// answer that comes back after a purge is stored dead (the purge is a
    /// barrier for what was in flight).
    pub(super) generation: u64,
    /// The sidecar keeps it too: the semantic cache needs it (and fleet
    /// mode, or no tier, keeps every entry there).
    pub(super) sidecar: bool,
    /// The caller lets the cache answer it (not `no-cache`).
    pub(super) read: bool,
    /// The caller is not declared in the policy: its answers hold at most
    /// part of each set of the tier in Envoy (`cache::tier`, "Eviction").
    pub(super) undeclared: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    Json,
    Sse,
    Ndjson,
}

pub(super) fn kind_label(k: sluice_wire::cache::Kind) -> &'static str {
    match k {
        sluice_wire::cache::Kind::Exact => "exact",
        sluice_wire::cache::Kind::Semantic => "semantic",
    }
}

/// Sends a lookup or a store to the sidecar: through the fleet's channel
/// (its secret and fingerprint) in fleet mode, else straight to the
/// sidecar cluster.
pub(super) fn post_to_sidecar(
    filter: &super::Filter,
    sidecar: &crate::policy::SidecarConfig,
    host: &dyn Host,
    path: &str,
    payload: &[u8],
    timeout: u64,
) -> Result<u32, String> {
    if let Some(fleet) = &filter.fleet {
        return fleet.post_within(host, path, payload, timeout);
    }
    let authority = sidecar.authority.as_deref().unwrap_or(&sidecar.cluster);
    let len = payload.len().to_string();
    let secret = SECRET.with(|s| s.borrow().clone());
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/json"),
        ("content-length", len.as_str()),
    ];
    if let Some(secret) = secret.as_deref() {
        headers.push((sluice_wire::cache::SECRET_HEADER, secret));
    }
    host.dispatch_post(&sidecar.cluster, &headers, payload, timeout)
}

thread_local! {
    /// The cache endpoints' secret (`cache.secret_env`), read once per
    /// policy load: one VM per worker thread.
    static SECRET: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Reads the secret `cache.secret_env` names, when it names one: the
/// policy is refused if the variable is unset or shorter than 16 bytes.
pub(super) fn prepare(host: &dyn Host, engine: &crate::admission::Engine) -> Result<(), String> {
    let name = engine
        .policy
        .cache_compiled
        .as_ref()
        .and_then(|c| c.secret_env.as_deref());
    let secret = match name {
        None => None,
        Some(name) => {
            let value = host.env_var(name).unwrap_or_default();
            let value = value.trim();
            if value.len() < crate::policy::fleet::MIN_SECRET {
                return Err(format!(
                    "cache.secret_env: the environment variable {name} must hold the secret the \
                     sidecar's cache endpoints require (at least {} bytes); give it to the VM \
                     with vm_config.environment_variables (host_env_keys: [{name}])",
                    crate::policy::fleet::MIN_SECRET
                ));
            }
            Some(value.to_string())
        }
    };
    SECRET.with(|s| *s.borrow_mut() = secret);
    if engine.policy.cache_compiled.is_some() {
        super::flight::prepare(host);
    }
    Ok(())
}

/// The tier in Envoy for this request's rule: single-Envoy mode only
/// (fleet mode keeps entries in Redis, shared by every Envoy).
pub(super) fn tier_for(
    filter: &super::Filter,
    rule: &crate::policy::cache::CacheRule,
) -> Option<Tier> {
    let c = filter.engine.policy.cache_compiled.as_ref()?.in_envoy?;
    (filter.fleet.is_none() && rule.exact).then(|| Tier::new(c))
}

/// The sidecar's cache generation, as its last state push said (0 before
/// any): entries in Envoy answer only under the one they were stored in.
pub(super) fn generation(filter: &super::Filter, host: &dyn Host) -> u64 {
    filter
        .seen(host)
        .state
        .as_ref()
        .map_or(0, |s| s.cache_generation)
}

/// The model as metrics name it: the client's name only for a model the
/// policy knows, so a client cannot mint label values.
pub(super) fn policy_label(filter: &super::Filter, model: &str) -> String {
    filter.engine.model_label(Some(model))
}

/// Whether a streaming request asked for the usage chunk.
pub(super) fn include_usage(body: &Value) -> bool {
    crate::usage::demand::include_usage(body)
}

impl Stream {
    /// Before admission: starts a lookup (the request pauses for it) when
    /// the model is cached and the caller allows reading; notes what to
    /// store when it allows storing. `None`: go on without the cache.
    pub(super) fn cache_lookup(
        &mut self,
        host: &dyn Host,
        asked: Option<&Asked>,
        model: Option<&str>,
    ) -> Option<Action> {
        if std::mem::replace(&mut self.cache_looked, true) {
            return None;
        }
        let filter = self.filter.clone();
        let policy = &filter.engine.policy;
        let (Some(cache), Some(sidecar), Some(asked), Some(model), Some(api), Some(identity)) = (
            policy.cache_compiled.as_ref(),
            policy.sidecar.as_ref(),
            asked,
            model,
            cache_key::served(self.api),
            self.identity.as_ref(),
        ) else {
            return None;
        };
        let route = (!cache.routes.is_empty()).then(|| filter.engine.route_of(&self.path));
        let rule = cache.rule(model, route.flatten())?;
        let allowed =
            cache_answer::request_cache_control(self.header(host, "cache-control").as_deref());
        let body = asked.body();
        if !rule.temperature_ok(body, api.is_ollama()) || !(allowed.read || allowed.store) {
            metrics::CACHE.add_at(host, &["skip", "exact", &policy_label(&filter, model)], 1);
            return None;
        }
        let scope = rule.scope.value(&CacheCaller {
            principal: &identity.principal,
            team: identity.team.as_deref(),
            org: identity.org.as_deref(),
            tier: &identity.tier,
        });
        let raw_path = self.header(host, ":path").unwrap_or_default();
        let query = cache_key::query_of(&raw_path);
        let (key, semantic) = keys_of(&cache.salt, rule, &scope, model, api, query, body)?;
        let tier = tier_for(&filter, rule);
        if allowed.store {
            self.cache_store = Some(ToStore {
                api,
                key: key.clone(),
                model: model.to_string(),
                ttl_s: rule.ttl_s,
                semantic: semantic.clone(),
                max_bytes: cache.max_entry_bytes,
                buf: Some(Vec::new()),
                framing: Framing::Json,
                upstream_cache_control: None,
                tier,
                scope_id: crate::policy::keys::sha256_hex(scope.as_bytes()),
                generation: generation(&filter, host),
                sidecar: tier.is_none() || rule.semantic,
                read: allowed.read,
                undeclared: !identity.declared,
            });
        }
        if !allowed.read {
            return None;
        }
        let wait = Wait::new(key.clone(), asked, api, model);
        match self.tier_first(host, tier, &key, &wait, semantic.is_some()) {
            // A miss, decided here: one upstream call per question in
            // flight (`flight`).
            Some(None) => return self.take_flight(host, &key, model),
            Some(decided) => return decided,
            None => {}
        }
        let req = LookupRequest {
            key,
            model: model.to_string(),
            exact: rule.exact,
            threshold: semantic.as_ref().map(|_| rule.threshold),
            top_k: semantic.as_ref().map(|_| rule.top_k),
            semantic,
        };
        self.ask_sidecar(host, sidecar, cache.lookup_timeout_ms, &req, wait)
    }

    /// The tier in Envoy, first: `Some` when it decided (a hit served, or
    /// a miss with nothing more to ask), `None`: ask the sidecar.
    pub(super) fn tier_first(
        &mut self,
        host: &dyn Host,
        tier: Option<Tier>,
        key: &str,
        wait: &Wait,
        semantic: bool,
    ) -> Option<Option<Action>> {
        match self.tier_lookup(host, &tier?, key, wait) {
            InEnvoy::Hit(_) => Some(Some(Action::Pause)),
            // Too large for the tier: the sidecar holds it.
            InEnvoy::Remote => None,
            // The semantic cache may still answer; else a miss, here.
            InEnvoy::Miss if semantic => None,
            InEnvoy::Miss => {
                let label = policy_label(&self.filter, &wait.model);
                metrics::CACHE.add_at(host, &["miss", "exact", &label], 1);
                Some(None)
            }
        }
    }

    /// The lookup callout; the request pauses until its answer.
    pub(super) fn ask_sidecar(
        &mut self,
        host: &dyn Host,
        sidecar: &crate::policy::SidecarConfig,
        timeout: u64,
        req: &LookupRequest,
        wait: Wait,
    ) -> Option<Action> {
        let filter = self.filter.clone();
        let payload = serde_json::to_vec(req).ok()?;
        let path = sluice_wire::cache::LOOKUP_PATH;
        match post_to_sidecar(&filter, sidecar, host, path, &payload, timeout) {
            Ok(token) => {
                self.phase = super::Phase::LookingUp(Wait { token, ..wait });
                Some(Action::Pause)
            }
            Err(why) => {
                let label = policy_label(&filter, &req.model);
                metrics::CACHE.add_at(host, &["timeout", "exact", &label], 1);
                log::warn!("cache lookup not sent: {why}");
                None
            }
        }
    }

    /// The exact tier in Envoy: a hit is served here at once (no callout);
    /// what it found otherwise. A hit that cannot be rendered is a miss.
    pub(super) fn tier_lookup(
        &mut self,
        host: &dyn Host,
        tier: &Tier,
        key: &str,
        wait: &Wait,
    ) -> InEnvoy {
        let Some(raw) = cache_tier::key_of_hex(key) else {
            return InEnvoy::Miss;
        };
        let filter = self.filter.clone();
        let now = self.started_ms;
        match tier.lookup(host, &raw, now, generation(&filter, host)) {
            InEnvoy::Hit(s) => {
                let Some(r) =
                    cache_answer::render(wait.api, &s.body, wait.stream, wait.include_usage)
                else {
                    return InEnvoy::Miss;
                };
                let age_s = now.saturating_sub(s.stored_ms) / 1000;
                let entry = Entry {
                    body: String::new(),
                    prompt_tokens: s.prompt_tokens,
                    completion_tokens: s.completion_tokens,
                    spend_micros: s.spend_micros,
                };
                self.serve_hit(host, wait, r, &entry, age_s, "exact");
                InEnvoy::Hit(s)
            }
            other => other,
        }
    }

    /// Whether `token` is this stream's lookup.
    pub(super) fn cache_owns(&self, token: u32) -> bool {
        matches!(&self.phase, super::Phase::LookingUp(w) if w.token == token)
    }

    /// The sidecar's answer to the lookup: a hit is answered here, a miss
    /// (or no answer) goes on to admission.
    pub(super) fn cache_answer(&mut self, host: &dyn Host, body_size: usize) {
        let wait = match std::mem::replace(&mut self.phase, super::Phase::Undecided) {
            super::Phase::LookingUp(wait) => wait,
            other => {
                self.phase = other;
                return;
            }
        };
        let status = host.call_response_header(":status");
        let answer = match status.as_deref() {
            Some("200") => {
                serde_json::from_slice::<LookupAnswer>(&host.call_response_body(body_size)).ok()
            }
            _ => None,
        };
        let hit = match answer {
            Some(LookupAnswer { hit: Some(hit) }) => Some(hit),
            Some(_) => {
                metrics::CACHE.add_at(
                    host,
                    &[
                        "miss",
                        "exact",
                        &self.filter.engine.model_label(Some(&wait.model)),
                    ],
                    1,
                );
                None
            }
            None => {
                metrics::CACHE.add_at(
                    host,
                    &[
                        "timeout",
                        "exact",
                        &self.filter.engine.model_label(Some(&wait.model)),
                    ],
                    1,
                );
                None
            }
        };
        if let Some(hit) = hit {
            let rendered =
                cache_answer::render(wait.api, &hit.entry.body, wait.stream, wait.include_usage);
            if let Some(r) = rendered {
                let kind = kind_label(hit.kind);
                self.serve_hit(host, &wait, r, &hit.entry, hit.age_s, kind);
                return;
            }
        }
        // A miss: the same question in flight is waited for (`flight`),
        // else admission as if there were no cache (the body is still
        // buffered in Envoy).
        if self.take_flight(host, &wait.key, &wait.model).is_some() {
            return;
        }
        let body = host.request_body(self.body_size);
        if self.decide(host, &body) == Action::Continue {
            host.resume_request();
        }
    }

    /// The upstream's answer begins: only a 200 may be stored.
    pub(super) fn cache_response_headers(&mut self, host: &dyn Host) {
        if self.status != 200 {
            if let Some(s) = self.cache_store.take() {
                let label = self.filter.engine.model_label(Some(&s.model));
                metrics::CACHE.add_at(host, &["skip", "exact", &label], 1);
            }
            return;
        }
        // Read only for an answer to store (no host call otherwise).
        if let Some(s) = self.cache_store.as_mut() {
            let content_type = host.response_header("content-type").unwrap_or_default();
            let cc = host.response_header("cache-control");
            s.framing = if content_type.contains("event-stream") {
                Framing::Sse
            } else if content_type.contains("ndjson") {
                Framing::Ndjson
            } else {
                Framing::Json
            };
            s.upstream_cache_control = cc;
            host.set_response_header("x-sluice-cache", Some("miss"));
        }
    }

    /// A piece of the upstream's answer (before any rewrite); at its end,
    /// the store when it is complete and successful. `cut`: sluice ended
    /// the client's stream (past its allowance, an oversized event), so
    /// the client never got this answer whole: nothing is stored.
    pub(super) fn cache_feed(&mut self, host: &dyn Host, chunk: &[u8], end: bool, cut: bool) {
        if !self.buffer_for_cache(host, chunk, end, cut) {
            return;
        }
        if let Some(s) = self.cache_store.take() {
            self.store_answer(host, s);
        }
    }

    /// Buffers a chunk of an answer to be stored (a stream the meter cut
    /// is not); `true` at the answer's end with a store still pending.
    fn buffer_for_cache(&mut self, host: &dyn Host, chunk: &[u8], end: bool, cut: bool) -> bool {
        if cut {
            if let Some(s) = self.cache_store.take() {
                let label = self.filter.engine.model_label(Some(&s.model));
                metrics::CACHE.add_at(host, &["skip", "exact", &label], 1);
            }
            return false;
        }
        let Some(s) = self.cache_store.as_mut() else {
            return false;
        };
        if let Some(buf) = s.buf.as_mut() {
            if (buf.len() + chunk.len()) as u64 > s.max_bytes.saturating_mul(2) {
                s.buf = None;
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        end
    }

    /// A complete answer stored, when it may be: in the tier in Envoy,
    /// the sidecar's store, or both.
    fn store_answer(&mut self, host: &dyn Host, s: ToStore) {
        let model = s.model.clone();
        // Metrics name the model as everywhere (unknown models: "other").
        let label = self.filter.engine.model_label(Some(&model));
        let skip = |host: &dyn Host| metrics::CACHE.add_at(host, &["skip", "exact", &label], 1);
        // Downshifted to a cheaper model: its answer is not the requested
        // model's, and the key names the requested one.
        let plan = self.upstream().and_then(|up| up.plan.as_ref());
        let served = plan.and_then(|p| p.model.clone());
        let price = plan.map(|p| p.price);
        if served.is_some_and(|m| m != model) {
            return skip(host);
        }
        // Produced under an output limit lowered to fit a budget: the key
        // is the client's body (its own limit), so the answer is not its.
        if plan.is_some_and(|p| p.output_lowered) {
            return skip(host);
        }
        let Some(buf) = s.buf else {
            return skip(host);
        };
        let json = match s.framing {
            Framing::Json => String::from_utf8(buf).ok(),
            Framing::Sse => cache_answer::assemble_sse(s.api, &buf),
            Framing::Ndjson => cache_answer::assemble_ndjson(s.api, &buf),
        };
        let Some(json) = json.filter(|j| j.len() as u64 <= s.max_bytes) else {
            return skip(host);
        };
        let usage = match cache_answer::storable(
            s.api,
            200,
            s.upstream_cache_control.as_deref(),
            json.as_bytes(),
        ) {
            Ok(u) => u,
            Err(_) => return skip(host),
        };
        let spend = price.map_or(0, |p| p.plain_micros(usage.input, usage.output));
        let req = StoreRequest {
            key: s.key,
            model: s.model,
            ttl_s: s.ttl_s,
            semantic: s.semantic,
            entry: Entry {
                body: json,
                prompt_tokens: usage.input,
                completion_tokens: usage.output,
                spend_micros: spend,
            },
            scope: Some(s.scope_id),
            generation: (s.generation > 0).then_some(s.generation),
        };
        let mut to_sidecar = s.sidecar;
        if let Some(tier) = s.tier {
            let kept = self.tier_store(host, &tier, &req, s.generation, s.undeclared);
            // Too large for the tier (or not kept there): the sidecar's.
            to_sidecar |= !kept;
        }
        if !to_sidecar {
            return metrics::CACHE.add_at(host, &["store", "exact", &label], 1);
        }
        let Ok(payload) = serde_json::to_vec(&req) else {
            return skip(host);
        };
        let filter = self.filter.clone();
        let Some(sidecar) = filter.engine.policy.sidecar.as_ref() else {
            return;
        };
        let path = sluice_wire::cache::STORE_PATH;
        if post_to_sidecar(&filter, sidecar, host, path, &payload, 5_000).is_ok() {
            metrics::CACHE.add_at(host, &["store", "exact", &label], 1);
        } else {
            skip(host);
        }
    }

    /// Keeps an answer in the tier in Envoy; `false` when only its marker
    /// is there (larger than the tier takes) or nothing could be written.
    pub(super) fn tier_store(
        &self,
        host: &dyn Host,
        tier: &Tier,
        req: &StoreRequest,
        gen: u64,
        undeclared: bool,
    ) -> bool {
        let Some(raw) = cache_tier::key_of_hex(&req.key) else {
            return false;
        };
        let now = host.now_ms();
        let fits = req.entry.body.len() as u64 <= tier.max_entry_bytes;
        let stored = cache_tier::Stored {
            body: req.entry.body.clone(),
            prompt_tokens: req.entry.prompt_tokens,
            completion_tokens: req.entry.completion_tokens,
            spend_micros: req.entry.spend_micros,
            stored_ms: now,
        };
        let ttl_ms = req.ttl_s.saturating_mul(1000);
        match tier.store(
            host,
            &raw,
            fits.then_some(&stored),
            ttl_ms,
            now,
            gen,
            undeclared,
        ) {
            Ok(()) => fits,
            // The set's ways are the declared callers': not an error.
            Err(cache_tier::NotKept::Reserved) => false,
            Err(why) => {
                log::warn!("cache: not kept in Envoy: {why:?}");
                false
            }
        }
    }
}
