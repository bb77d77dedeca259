//! The fleet endpoints: `/v1/fleet/take`, `/v1/fleet/give`,
//! `/v1/fleet/slots` (the Envoy beside this sidecar only: [`refuse`]) and
//! `GET /v1/fleet` (counters).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::Serialize;
use sluice_wire::fleet::{
    FINGERPRINT_HEADER, FLEET_DATA_LOST, FLEET_LATE, FLEET_MISMATCH, FLEET_UNAVAILABLE,
    SECRET_HEADER,
};

use super::{concurrency, Fleet, FleetError, GiveRequest, TakeRequest};
pub use crate::reply::Peer;

/// `/v1/fleet/take`, `/v1/fleet/give`, `/v1/fleet/slots` (the Envoy beside
/// this sidecar only: see [`serve`]) and `GET /v1/fleet` (counters).
pub fn router(fleet: Arc<Fleet>) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/fleet", get(stats))
        .route("/v1/fleet/take", post(take))
        .route("/v1/fleet/give", post(give))
        .route("/v1/fleet/slots", post(slots_handle))
        .with_state(fleet)
}

use crate::reply::{error, json as reply};

/// Why a call is not from the Envoy beside this sidecar, if it is not:
/// not loopback; from a web page (`Origin`); not `application/json` (a
/// page's form or `text/plain` post); without the fleet secret; or from an
/// Envoy whose fleet rules are not this sidecar's.
pub(crate) fn refuse(
    fleet: &Fleet,
    peer: &Peer,
    headers: &axum::http::HeaderMap,
) -> Option<axum::response::Response> {
    use axum::http::StatusCode;
    let refused = if !crate::reply::is_loopback(peer) {
        Some(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the fleet endpoints answer the Envoy beside this sidecar (loopback) only",
        ))
    } else if headers.contains_key(axum::http::header::ORIGIN) {
        Some(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "the fleet endpoints refuse requests with an Origin (web pages)",
        ))
    } else if !json_content(headers) {
        Some(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request",
            "content-type: application/json expected",
        ))
    } else if !headers
        .get(SECRET_HEADER)
        .is_some_and(|v| fleet.secret_ok(v.as_bytes()))
    {
        Some(error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the fleet secret (x-sluice-fleet-secret) is missing or wrong",
        ))
    } else if headers
        .get(FINGERPRINT_HEADER)
        .and_then(|v| v.to_str().ok())
        != Some(fleet.view().fingerprint.as_str())
    {
        Some(error(
            StatusCode::CONFLICT,
            FLEET_MISMATCH,
            "this Envoy's fleet policy (salt, expected_replicas or fleet rules) is not the one \
             this sidecar loaded (fleet.policy)",
        ))
    } else {
        None
    };
    if refused.is_some() {
        fleet.stats.refused_calls.fetch_add(1, Ordering::Relaxed);
    }
    refused
}

pub(crate) fn json_content(headers: &axum::http::HeaderMap) -> bool {
    let mut all = headers.get_all(axum::http::header::CONTENT_TYPE).iter();
    let (Some(v), None) = (all.next(), all.next()) else {
        return false;
    };
    v.to_str().ok().is_some_and(|v| {
        v.split(';')
            .next()
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
    })
}

pub(crate) fn failure(e: FleetError) -> axum::response::Response {
    use axum::http::StatusCode;
    match e {
        FleetError::Invalid(m) => error(StatusCode::BAD_REQUEST, "invalid_request", &m),
        FleetError::Unavailable(m) => error(StatusCode::SERVICE_UNAVAILABLE, FLEET_UNAVAILABLE, &m),
        FleetError::Mismatch(m) => error(StatusCode::SERVICE_UNAVAILABLE, FLEET_MISMATCH, &m),
        FleetError::DataLost(m) => error(StatusCode::SERVICE_UNAVAILABLE, FLEET_DATA_LOST, &m),
        FleetError::Late(m) => error(StatusCode::SERVICE_UNAVAILABLE, FLEET_LATE, &m),
    }
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FleetError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| FleetError::Invalid(e.to_string()))
}

/// Every fleet endpoint that changes something: the Envoy beside this
/// sidecar only ([`refuse`]), a JSON body (a bad one is a 400 naming the
/// field), then `act` on it; its answer as 200 JSON, or the failure.
pub(crate) async fn serve<Req, Ans, Fut>(
    fleet: &Fleet,
    peer: &Peer,
    headers: &axum::http::HeaderMap,
    body: &[u8],
    act: impl FnOnce(Req) -> Fut,
) -> axum::response::Response
where
    Req: serde::de::DeserializeOwned,
    Ans: Serialize,
    Fut: std::future::Future<Output = Result<Ans, FleetError>>,
{
    if let Some(r) = refuse(fleet, peer, headers) {
        return r;
    }
    let req = match parse(body) {
        Ok(r) => r,
        Err(e) => return failure(e),
    };
    match act(req).await {
        Ok(answer) => reply(
            axum::http::StatusCode::OK,
            serde_json::to_value(answer).unwrap_or_default(),
        ),
        Err(e) => failure(e),
    }
}

async fn take(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
    peer: Peer,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let f = fleet.clone();
    serve(
        &fleet,
        &peer,
        &headers,
        &body,
        |req: TakeRequest| async move { f.take(&req).await },
    )
    .await
}

async fn give(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
    peer: Peer,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let f = fleet.clone();
    serve(
        &fleet,
        &peer,
        &headers,
        &body,
        |req: GiveRequest| async move {
            let applied = f.give(&req).await?;
            Ok(serde_json::json!({ "applied": applied }))
        },
    )
    .await
}

async fn stats(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
) -> axum::response::Response {
    let s = &fleet.stats;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let lost_at = fleet
        .epoch
        .lock()
        .await
        .as_ref()
        .map_or(0, |e| e.lost_at_ms);
    reply(
        axum::http::StatusCode::OK,
        serde_json::json!({
            "redis_up": fleet.redis().link.up(),
            "takes": n(&s.takes),
            "takes_refused": n(&s.takes_refused),
            "takes_late": n(&s.takes_late),
            "gives": n(&s.gives),
            "gives_repeated": n(&s.gives_repeated),
            "errors": fleet.redis().link.errors(),
            "refused_calls": n(&s.refused_calls),
            "data_lost": n(&s.data_lost),
            "data_lost_at_ms": lost_at,
            "mismatch": s.mismatch.load(Ordering::Relaxed),
            "fingerprint": fleet.view().fingerprint,
        }),
    )
}

/// `/v1/fleet/slots` ([`concurrency::report`]).
pub async fn slots_handle(
    axum::extract::State(fleet): axum::extract::State<Arc<Fleet>>,
    peer: Peer,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let f = fleet.clone();
    serve(
        &fleet,
        &peer,
        &headers,
        &body,
        |req: concurrency::SlotsRequest| async move { concurrency::report(&f, &req).await },
    )
    .await
}
