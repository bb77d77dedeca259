//! `POST /v1/cache/lookup`, `POST /v1/cache/store` (the Envoy beside this
//! sidecar only) and `POST /v1/cache/purge` (admin token).
//!
//! "The Envoy beside this sidecar" is proven by loopback, no `Origin`,
//! JSON and, when one is configured, the shared secret
//! (`x-sluice-cache-secret`, compared in constant time; in fleet mode the
//! fleet secret): under a mesh every inbound call arrives from loopback
//! (127.0.0.6), so the address alone proves nothing there. Refusals are
//! counted in `sluice_sidecar_cache_refused_total{reason}`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::json;
use sluice_wire::cache::{
    LookupRequest, NotStored, PurgeRequest, StoreAnswer, StoreRequest, LOOKUP_PATH, PURGE_PATH,
    SECRET_HEADER, STORE_PATH,
};

use crate::cache::{Cache, CacheError};
use crate::fleet::Fleet;
use crate::reply::{json as reply, Peer};
use crate::serve::admin::AdminToken;
use crate::state::StateStore;

#[derive(Clone)]
pub struct CacheApi {
    pub cache: Arc<Cache>,
    /// In fleet mode: the fleet's door (secret, fingerprint) applies too.
    pub fleet: Option<Arc<Fleet>>,
    pub token: AdminToken,
    /// The secret every lookup and store must carry (`cache.secret_file`
    /// or `cache.secret_env`); `None`: loopback alone, as before.
    pub secret: Option<Arc<str>>,
    /// Where a purge bumps `cache_generation`, so the entries the filter
    /// keeps in Envoy go too.
    pub state: Option<StateStore>,
}

/// Why a call to the cache endpoints was refused, for
/// `sluice_sidecar_cache_refused_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not from loopback, or from a web page (`Origin`), or not JSON.
    Door,
    /// No `x-sluice-cache-secret` (a secret is configured).
    Missing,
    /// The wrong secret.
    Wrong,
}

impl Refused {
    pub const ALL: [Refused; 3] = [Refused::Door, Refused::Missing, Refused::Wrong];

    pub fn label(self) -> &'static str {
        match self {
            Refused::Door => "door",
            Refused::Missing => "missing",
            Refused::Wrong => "wrong",
        }
    }
}

/// Process-wide: one sidecar serves one cache.
static REFUSED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// How many calls were refused for `why`.
pub fn refused_count(why: Refused) -> u64 {
    REFUSED[why as usize].load(Ordering::Relaxed)
}

fn count(why: Refused) {
    REFUSED[why as usize].fetch_add(1, Ordering::Relaxed);
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    reply(status, json!({"error": {"code": code, "message": message}}))
}

fn loopback(peer: &Peer) -> bool {
    crate::reply::is_loopback(peer)
}

/// Why a call is not from the Envoy beside this sidecar, if it is not.
fn refuse(api: &CacheApi, peer: &Peer, headers: &HeaderMap) -> Option<Response> {
    if let Some(f) = &api.fleet {
        return crate::fleet::routes::refuse(f, peer, headers);
    }
    let (why, answer) = if !loopback(peer) {
        (
            Refused::Door,
            error(
                StatusCode::FORBIDDEN,
                "forbidden",
                "the cache endpoints answer the Envoy beside this sidecar (loopback) only",
            ),
        )
    } else if headers.contains_key(axum::http::header::ORIGIN) {
        (
            Refused::Door,
            error(
                StatusCode::FORBIDDEN,
                "forbidden",
                "the cache endpoints refuse requests with an Origin (web pages)",
            ),
        )
    } else if !crate::fleet::routes::json_content(headers) {
        (
            Refused::Door,
            error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request",
                "content-type: application/json expected",
            ),
        )
    } else {
        let secret = api.secret.as_ref()?;
        let given = headers.get(SECRET_HEADER).map(|v| v.as_bytes());
        let why = match given {
            None => Refused::Missing,
            Some(g) if crate::door::secret_eq(g, secret.as_bytes()) => return None,
            Some(_) => Refused::Wrong,
        };
        (
            why,
            error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the cache secret (x-sluice-cache-secret) is missing or wrong: compare the \
                 policy's cache.secret_env with this sidecar's cache.secret_file or secret_env",
            ),
        )
    };
    count(why);
    Some(answer)
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Box<Response>> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("{}: {}", e.path(), e.inner()),
        ))
    })
}

fn invalid(e: CacheError) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request", &e.to_string())
}

async fn lookup(
    State(api): State<CacheApi>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = refuse(&api, &peer, &headers) {
        return r;
    }
    let req: LookupRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match api.cache.lookup(&req, crate::cache::now_ms()).await {
        Ok(a) => reply(StatusCode::OK, json!(a)),
        Err(e) => invalid(e),
    }
}

async fn store(
    State(api): State<CacheApi>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = refuse(&api, &peer, &headers) {
        return r;
    }
    let req: StoreRequest = match parse(&body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    // Asked for before a purge: what was in flight at the purge is not kept.
    let current = api.state.as_ref().map(|s| s.current().cache_generation);
    if let (Some(asked), Some(current)) = (req.generation, current) {
        if asked < current {
            let no = StoreAnswer {
                stored: false,
                reason: Some(NotStored::Purged),
            };
            return reply(StatusCode::OK, json!(no));
        }
    }
    match api.cache.store(req, crate::cache::now_ms()).await {
        Ok(a) => reply(StatusCode::OK, json!(a)),
        Err(e) => invalid(e),
    }
}

/// Admin: a bearer token (which no web page can send cross-site without
/// the browser asking first), loopback, no `Origin`.
async fn purge(
    State(api): State<CacheApi>,
    peer: Peer,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !loopback(&peer) || headers.contains_key(axum::http::header::ORIGIN) {
        return error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the cache purge is accepted from loopback only, without an Origin",
        );
    }
    let auth = headers
        .get(axum::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if !api.token.accepts(auth) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        );
    }
    let req: PurgeRequest = if body.is_empty() {
        PurgeRequest::default()
    } else {
        match parse(&body) {
            Ok(r) => r,
            Err(r) => return *r,
        }
    };
    let scope = req.scope.as_deref();
    match api.cache.purge_where(req.model.as_deref(), scope).await {
        Ok(n) => {
            // The entries the filter keeps in Envoy: gone with the next
            // state push (any purge drops all of them: they carry no model).
            if let Some(state) = &api.state {
                state.update(std::time::SystemTime::now(), |s| {
                    s.cache_generation = s.cache_generation.saturating_add(1);
                });
            }
            api.cache.note_size().await;
            reply(StatusCode::OK, json!({"purged": n}))
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "cache_unavailable",
            &e.to_string(),
        ),
    }
}

pub fn router(api: CacheApi) -> axum::Router {
    use axum::routing::post;
    // A store carries the answer JSON-escaped: up to twice its size.
    let limit = usize::try_from(api.cache.max_entry_bytes())
        .unwrap_or(usize::MAX)
        .saturating_mul(2)
        .saturating_add(64 << 10);
    axum::Router::new()
        .route(LOOKUP_PATH, post(lookup))
        .route(STORE_PATH, post(store))
        .route(PURGE_PATH, post(purge))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(api)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use axum::http::{Request, StatusCode};
    use serde_json::{json, Value};
    use tower::ServiceExt as _;

    use super::*;
    use crate::cache::tests::{lookup_req, memory_cache, store_req};

    fn post(uri: &str, from: &str, body: &str, headers: &[(&str, &str)]) -> Request<Body> {
        let mut req = Request::post(uri).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let mut req = req.body(Body::from(body.to_string())).unwrap();
        req.extensions_mut()
            .insert(ConnectInfo(from.parse::<SocketAddr>().unwrap()));
        req
    }

    async fn send(app: &axum::Router, req: Request<Body>) -> (StatusCode, Value) {
        let res = app.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 24)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    #[tokio::test]
    async fn endpoints_answer_the_envoy_beside_only() {
        let cache = memory_cache(None);
        let app = router(CacheApi {
            cache: cache.clone(),
            fleet: None,
            token: crate::serve::admin::AdminToken::new("t0ken"),
            secret: None,
            state: None,
        });
        let local = "127.0.0.1:5000";
        let store = serde_json::to_string(&store_req("k", "answer", None)).unwrap();
        let lookup = serde_json::to_string(&lookup_req("k", None)).unwrap();
        let (s, v) = send(&app, post("/v1/cache/store", local, &store, &[])).await;
        assert_eq!((s, v["stored"].clone()), (StatusCode::OK, json!(true)));
        let (s, v) = send(&app, post("/v1/cache/lookup", local, &lookup, &[])).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["hit"]["entry"]["body"], "answer");
        // Not loopback, a web page, not JSON: refused.
        let (s, _) = send(
            &app,
            post("/v1/cache/lookup", "10.0.0.2:5000", &lookup, &[]),
        )
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        let (s, _) = send(
            &app,
            post(
                "/v1/cache/store",
                local,
                &store,
                &[("origin", "http://evil.example")],
            ),
        )
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        let mut plain = post("/v1/cache/lookup", local, &lookup, &[]);
        plain
            .headers_mut()
            .insert("content-type", "text/plain".parse().unwrap());
        assert_eq!(
            send(&app, plain).await.0,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        // A bad message names the field.
        let (s, v) = send(
            &app,
            post(
                "/v1/cache/lookup",
                local,
                r#"{"key": 1, "model": "m"}"#,
                &[],
            ),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(v["error"]["message"].as_str().unwrap().starts_with("key"));
        // Purge needs the token.
        let (s, _) = send(&app, post("/v1/cache/purge", local, "{}", &[])).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        let (s, v) = send(
            &app,
            post(
                "/v1/cache/purge",
                local,
                "{}",
                &[("authorization", "Bearer t0ken")],
            ),
        )
        .await;
        assert_eq!((s, v["purged"].clone()), (StatusCode::OK, json!(1)));
        let (_, v) = send(&app, post("/v1/cache/lookup", local, &lookup, &[])).await;
        assert_eq!(v["hit"], Value::Null);
    }

    #[tokio::test]
    async fn with_a_secret_only_its_holder_reads_and_writes() {
        let cache = memory_cache(None);
        let state = StateStore::new(std::time::SystemTime::UNIX_EPOCH);
        let app = router(CacheApi {
            cache: cache.clone(),
            fleet: None,
            token: crate::serve::admin::AdminToken::new("t0ken"),
            secret: Some(Arc::from("the-cache-secret-0123")),
            state: Some(state.clone()),
        });
        let local = "127.0.0.1:5000";
        let store = serde_json::to_string(&store_req("k", "answer", None)).unwrap();
        let lookup = serde_json::to_string(&lookup_req("k", None)).unwrap();
        let (missing, wrong) = (
            refused_count(Refused::Missing),
            refused_count(Refused::Wrong),
        );
        for (path, body) in [("/v1/cache/store", &store), ("/v1/cache/lookup", &lookup)] {
            let (s, v) = send(&app, post(path, local, body, &[])).await;
            assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}: {v}");
            assert!(v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("x-sluice-cache-secret"));
            let wrong = [(SECRET_HEADER, "the-cache-secret-0124")];
            let (s, _) = send(&app, post(path, local, body, &wrong)).await;
            assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        }
        assert!(refused_count(Refused::Missing) >= missing + 2);
        assert!(refused_count(Refused::Wrong) >= wrong + 2);
        assert_eq!(
            cache.lookup(&lookup_req("k", None), 0).await.unwrap().hit,
            None
        );
        let right = [(SECRET_HEADER, "the-cache-secret-0123")];
        let (s, _) = send(&app, post("/v1/cache/store", local, &store, &right)).await;
        assert_eq!(s, StatusCode::OK);
        let (_, v) = send(&app, post("/v1/cache/lookup", local, &lookup, &right)).await;
        assert_eq!(v["hit"]["entry"]["body"], "answer");
        // The right secret from elsewhere is still refused.
        let (s, _) = send(
            &app,
            post("/v1/cache/lookup", "10.0.0.9:1", &lookup, &right),
        )
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
        // A purge moves the generation the filter's tier in Envoy reads.
        let before = state.current().cache_generation;
        let auth = [("authorization", "Bearer t0ken")];
        let (s, _) = send(&app, post("/v1/cache/purge", local, "{}", &auth)).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(state.current().cache_generation, before + 1);
        // An answer asked for before that purge (a stream in flight across
        // it) is not kept; one asked for after it is.
        let lookup2 = serde_json::to_string(&lookup_req("k2", None)).unwrap();
        for (generation, kept) in [(before, false), (before + 1, true)] {
            let mut req = store_req("k2", "late answer", None);
            req.generation = Some(generation);
            let body = serde_json::to_string(&req).unwrap();
            let (s, v) = send(&app, post("/v1/cache/store", local, &body, &right)).await;
            assert_eq!(s, StatusCode::OK);
            assert_eq!(v["stored"], kept, "{v}");
            if !kept {
                assert_eq!(v["reason"], "purged");
            }
            let (_, v) = send(&app, post("/v1/cache/lookup", local, &lookup2, &right)).await;
            assert_eq!(v["hit"].is_null(), !kept, "{v}");
        }
    }

    #[tokio::test]
    async fn metrics_render() {
        let c = memory_cache(None);
        c.store(store_req("k", "a", None), 0).await.unwrap();
        c.lookup(&lookup_req("k", None), 0).await.unwrap();
        let text = &crate::serve::metrics::render_cache(&c);
        let samples = crate::sources::prom::parse(text);
        let find = |name: &str, result: Option<&str>| {
            samples
                .iter()
                .find(|s| s.name == name && result.is_none_or(|r| s.label("result") == Some(r)))
                .unwrap_or_else(|| panic!("{name} in\n{text}"))
                .value
        };
        assert_eq!(find("sluice_sidecar_cache_total", Some("hit")), 1.0);
        assert_eq!(find("sluice_sidecar_cache_total", Some("store")), 1.0);
        assert_eq!(find("sluice_sidecar_cache_saved_tokens_total", None), 6.0);
        assert_eq!(find("sluice_sidecar_cache_entries", None), 1.0);
        assert_eq!(find("sluice_sidecar_cache_lookup_seconds_count", None), 1.0);
        let cache_families: Vec<&str> = crate::serve::metric_table::ALL
            .iter()
            .map(|f| f.name)
            .filter(|n| n.starts_with("sluice_sidecar_cache_"))
            .collect();
        assert_eq!(crate::serve::metrics::tests::declared(text), cache_families);
    }
}
