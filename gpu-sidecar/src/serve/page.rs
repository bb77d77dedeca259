//! The operator page at `/` and its read-only data, `GET /v1/history`.
//!
//! The page is static (HTML, CSS and script compiled into the binary, no
//! CDN, nothing external); its script reads `/v1/history` every few seconds
//! and draws the charts as inline SVG. Operator text (kill switch and
//! breaker reasons, GPU names, tiers) only ever reaches the page through
//! `textContent`, never as markup, and the Content-Security-Policy below
//! allows no inline script and no other origin: an injected string shows
//! as text and cannot run.
//!
//! The kill switch control sends the admin token the operator types as
//! `Authorization: Bearer` with `fetch` to the existing
//! `POST /v1/kill-switch` (token and loopback rules unchanged) and clears
//! the field; the page never stores it (no cookie, no web storage). A
//! cross-site page cannot do the same: the browser sends no credential on
//! its own, and a cross-origin request with an `Authorization` header needs
//! a CORS preflight the sidecar never grants.

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::State;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
    X_FRAME_OPTIONS,
};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::serve::Api;

const HTML: &str = include_str!("../../assets/page.html");
const JS: &str = include_str!("../../assets/page.js");
const CSS: &str = include_str!("../../assets/page.css");

/// Same-origin script, style and fetches only; no frames (the control
/// cannot be clickjacked), no forms posted anywhere, no plugins.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "no-store"),
            (CONTENT_SECURITY_POLICY, CSP),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (X_FRAME_OPTIONS, "DENY"),
            (REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

/// `GET /`.
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", HTML)
}

/// `GET /page.js`.
pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", JS)
}

/// `GET /page.css`.
pub async fn style() -> Response {
    asset("text/css; charset=utf-8", CSS)
}

/// `GET /v1/history`: read-only, open like `/v1/state` (see `api.rs`).
pub async fn history(State(api): State<Arc<Api>>) -> Response {
    let snap = api.telemetry.snapshot();
    let mut body = api
        .history
        .to_json(SystemTime::now(), &api.store.current(), &snap.breakers);
    // What the monitor's last round saw of its sources, beside the rings.
    let backends: Vec<_> = snap
        .backends
        .iter()
        .map(|b| {
            let samples: serde_json::Map<String, serde_json::Value> = b
                .samples
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(m, v)| (m.name().to_string(), json!(v)))
                .collect();
            json!({"name": b.name, "kind": b.kind, "up": b.up, "samples": samples,
                   "models": b.models, "error": b.error})
        })
        .collect();
    if let Some(o) = body.as_object_mut() {
        o.insert("gpu_source".into(), json!(snap.gpu_source));
        o.insert("gpu_error".into(), json!(snap.gpu_error));
        o.insert("gpu_missing".into(), json!(snap.gpu_missing));
        o.insert("backends".into(), json!(backends));
        // The response cache's panel: hit rate, entries, bytes, savings.
        let cache = api.cache.as_ref().map(|c| c.summary());
        o.insert("cache".into(), json!(cache));
    }
    crate::reply::json(axum::http::StatusCode::OK, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_asset_carries_the_policy() {
        for res in [index().await, script().await, style().await] {
            let h = res.headers();
            assert_eq!(h[CONTENT_SECURITY_POLICY], CSP);
            assert_eq!(h[X_FRAME_OPTIONS], "DENY");
            assert_eq!(h[X_CONTENT_TYPE_OPTIONS], "nosniff");
            assert_eq!(h[CACHE_CONTROL], "no-store");
        }
        assert!(!CSP.contains("unsafe"), "no inline script or eval");
    }

    #[test]
    fn the_page_has_no_external_asset_and_no_inline_script() {
        for text in [HTML, JS, CSS] {
            // The SVG namespace is a name, not something fetched.
            let text = text.replace("\"http://www.w3.org/2000/svg\"", "");
            for bad in [
                "http://",
                "https://",
                "@import",
                "url(",
                "localStorage",
                "sessionStorage",
                "indexedDB",
                "document.cookie",
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
            ] {
                assert!(!text.contains(bad), "{bad} in an asset");
            }
        }
        // Scripts only by src (the CSP would block inline ones anyway).
        assert_eq!(HTML.matches("<script").count(), 1);
        assert!(HTML.contains("<script src=\"/page.js\" defer></script>"));
        let inline_handler = HTML
            .split(|c: char| c.is_whitespace())
            .any(|w| w.starts_with("on") && w.contains('='));
        assert!(!inline_handler, "no inline event handlers");
        assert!(HTML.contains("type=\"password\""));
    }
}
