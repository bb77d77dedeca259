//! A small plain-HTTP/1.1 client for scrapes and webhooks, on hyper's
//! connection-level API (hyper is already here for the server). One
//! connection per request, a hard timeout over the whole exchange, a cap on
//! the body: scrapes are a few per second, so pooling would buy nothing.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{CONTENT_TYPE, HOST};
pub use hyper::Method;
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Bodies above this are refused (a vLLM `/metrics` is tens of KB).
pub const MAX_BODY: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("bad URL `{0}`: {1}")]
    Url(String, String),
    #[error("connecting to {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("HTTP: {0}")]
    Protocol(#[from] hyper::Error),
    #[error("building the request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("reading the body: {0}")]
    Body(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("status {0}")]
    Status(u16),
}

/// Where a URL points: `http://host[:port]/path?query`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, as connected to and sent in `Host`.
    pub authority: String,
    pub path_and_query: String,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, HttpError> {
        let bad = |why: &str| HttpError::Url(url.to_string(), why.to_string());
        let uri: Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only plain http:// URLs are supported"));
        }
        let auth = uri.authority().ok_or_else(|| bad("no host"))?;
        let authority = match auth.port_u16() {
            Some(_) => auth.as_str().to_string(),
            None => format!("{}:80", auth.host()),
        };
        let path_and_query = uri
            .path_and_query()
            .map_or("/".to_string(), |p| p.as_str().to_string());
        Ok(Target {
            authority,
            path_and_query,
        })
    }

    /// The same host with `path` appended to the URL's own path.
    pub fn join(&self, path: &str) -> Target {
        let base = self.path_and_query.trim_end_matches('/');
        Target {
            authority: self.authority.clone(),
            path_and_query: format!("{base}{path}"),
        }
    }
}

/// `GET`; the body of a 2xx answer, else [`HttpError::Status`].
pub async fn get(target: &Target, timeout: Duration) -> Result<Bytes, HttpError> {
    ok(request(target, Method::GET, &[], None, timeout).await?)
}

/// `POST` a JSON body; Ok on a 2xx answer.
pub async fn post_json(target: &Target, body: Vec<u8>, timeout: Duration) -> Result<(), HttpError> {
    ok(request(target, Method::POST, &[], Some(body), timeout).await?).map(|_| ())
}

fn ok((status, body): (u16, Bytes)) -> Result<Bytes, HttpError> {
    if (200..300).contains(&status) {
        Ok(body)
    } else {
        Err(HttpError::Status(status))
    }
}

/// Any request; the status and body whatever the status. A body is sent as
/// JSON.
pub async fn request(
    target: &Target,
    method: Method,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<(u16, Bytes), HttpError> {
    tokio::time::timeout(timeout, exchange(target, method, headers, body))
        .await
        .map_err(|_| HttpError::Timeout(timeout))?
}

async fn exchange(
    target: &Target,
    method: Method,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Result<(u16, Bytes), HttpError> {
    let stream = TcpStream::connect(&target.authority)
        .await
        .map_err(|e| HttpError::Connect(target.authority.clone(), e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    // The connection task ends when the exchange does (or is dropped with
    // the timeout); its own error shows up in `send_request`.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder()
        .method(method)
        .uri(target.path_and_query.as_str())
        .header(HOST, target.authority.as_str());
    if body.is_some() {
        req = req.header(CONTENT_TYPE, "application/json");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    let res = sender.send_request(req).await?;
    let status = res.status();
    let body = Limited::new(res.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| HttpError::Body(e.to_string()))?
        .to_bytes();
    Ok((status.as_u16(), body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let t = Target::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!(t.authority, "127.0.0.1:8000");
        assert_eq!(t.join("/metrics").path_and_query, "/metrics");
        let t = Target::parse("http://vllm.local/base/").unwrap();
        assert_eq!(t.authority, "vllm.local:80");
        assert_eq!(t.join("/metrics").path_and_query, "/base/metrics");
        let t = Target::parse("http://h:1/hook?x=1").unwrap();
        assert_eq!(t.path_and_query, "/hook?x=1");
        assert!(Target::parse("https://h/").is_err());
        assert!(Target::parse("not a url").is_err());
        assert!(Target::parse("/relative").is_err());
    }

    #[tokio::test]
    async fn get_and_post_against_a_local_server() {
        use axum::routing::{get as aget, post};
        let app = axum::Router::new()
            .route("/ok", aget(|| async { "hello" }))
            .route(
                "/missing",
                aget(|| async { (axum::http::StatusCode::NOT_FOUND, "no") }),
            )
            .route("/hook", post(|body: String| async move { body }))
            .route(
                "/slow",
                aget(|| async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    "late"
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let base = Target::parse(&format!("http://{addr}")).unwrap();
        let t = Duration::from_secs(2);
        assert_eq!(&get(&base.join("/ok"), t).await.unwrap()[..], b"hello");
        assert!(matches!(
            get(&base.join("/missing"), t).await,
            Err(HttpError::Status(404))
        ));
        post_json(&base.join("/hook"), b"{}".to_vec(), t)
            .await
            .unwrap();
        assert!(matches!(
            get(&base.join("/slow"), Duration::from_millis(100)).await,
            Err(HttpError::Timeout(_))
        ));
        let closed = Target::parse("http://127.0.0.1:1").unwrap();
        assert!(matches!(get(&closed, t).await, Err(HttpError::Connect(..))));
    }
}
