//! A request written by hand over HTTP/1.1, and its answer read back.
//!
//! The tests here need what a client library will not do: send a body in
//! chunks of a chosen size and keep reading after Envoy answers early. The
//! answer's head is parsed by `httparse` and its chunk sizes by
//! `httparse::parse_chunk_size`; only the choice of framing (length,
//! chunked, close) is ours, because `httparse` leaves it to its caller.

use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::Duration;

use httparse::Status;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use crate::Response;

/// Sends `head` (request line and headers, without the blank line) and then
/// `body` in HTTP/1.1 chunks of `chunk` bytes over a fresh connection to
/// `addr`, and reads the answer. Envoy may answer (and close) before the
/// whole body is sent: write errors are then ignored and the answer read.
pub fn post_chunked(addr: SocketAddr, head: &str, body: &[u8], chunk: usize) -> Response {
    let mut stream = TcpStream::connect(addr).expect("connect to Envoy");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("set read timeout");
    let mut writer = stream.try_clone().expect("clone the socket");
    let head = format!("{head}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    let body = body.to_vec();
    let sender = thread::spawn(move || -> io::Result<()> {
        writer.write_all(head.as_bytes())?;
        for part in body.chunks(chunk.max(1)) {
            writer.write_all(format!("{:x}\r\n", part.len()).as_bytes())?;
            writer.write_all(part)?;
            writer.write_all(b"\r\n")?;
        }
        writer.write_all(b"0\r\n\r\n")
    });
    // Read until the answer is complete rather than until the connection
    // closes: after an early answer Envoy lingers before closing.
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let (answer, outcome) = loop {
        if let Some(whole) = parse_response(&raw, false) {
            break (Some(whole), Ok(()));
        }
        match stream.read(&mut buf) {
            Ok(0) => break (None, Ok(())),
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break (None, Err(e)),
        }
    };
    // Unblocks the sender if Envoy stopped reading the body.
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = sender.join();
    if raw.is_empty() {
        panic!("no answer to a chunked request: {outcome:?}");
    }
    answer
        .or_else(|| parse_response(&raw, true))
        .unwrap_or_else(|| panic!("no whole answer in {:?}", String::from_utf8_lossy(&raw)))
}

/// The response in `raw` once it is whole: a content-length or chunked
/// body in full, a close-delimited one only at `eof`. At `eof` a cut body
/// is returned as far as it came. Panics on bytes that are not a response.
pub(crate) fn parse_response(raw: &[u8], eof: bool) -> Option<Response> {
    let mut slots = [httparse::EMPTY_HEADER; 64];
    let mut head = httparse::Response::new(&mut slots);
    let body_at = match head.parse(raw) {
        Ok(Status::Complete(n)) => n,
        Ok(Status::Partial) if !eof => return None,
        other => panic!(
            "no HTTP/1 response head ({other:?}) in {:?}",
            String::from_utf8_lossy(raw)
        ),
    };
    let status = head.code?;
    let mut headers = HeaderMap::new();
    for h in head.headers.iter() {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) {
            headers.append(k, v);
        }
    }
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let body = &raw[body_at..];
    let body = if text("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(body, eof)?
    } else if let Some(len) = text("content-length").and_then(|v| v.trim().parse().ok()) {
        if body.len() < len && !eof {
            return None;
        }
        body[..len.min(body.len())].to_vec()
    } else if eof {
        body.to_vec()
    } else {
        return None;
    };
    Some(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// The data of a chunked body once its last chunk and trailers have come;
/// at `eof`, the whole chunks that came.
fn dechunk(mut rest: &[u8], eof: bool) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        match httparse::parse_chunk_size(rest) {
            Ok(Status::Complete((at, 0))) => {
                let trailers = &rest[at..];
                let ended =
                    trailers.starts_with(b"\r\n") || trailers.windows(4).any(|w| w == b"\r\n\r\n");
                return (ended || eof).then_some(out);
            }
            Ok(Status::Complete((at, size))) => {
                let end = usize::try_from(size).ok().and_then(|s| s.checked_add(at))?;
                if rest.len() < end + 2 {
                    break;
                }
                out.extend_from_slice(&rest[at..end]);
                rest = &rest[end + 2..];
            }
            Ok(Status::Partial) => break,
            Err(e) => panic!(
                "bad chunk size ({e:?}) in {:?}",
                String::from_utf8_lossy(rest)
            ),
        }
    }
    eof.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sized_answers_are_whole_at_their_length() {
        let sized =
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 4\r\nx-a: b\r\nx-a: c\r\n\r\nbody";
        assert!(parse_response(&sized[..sized.len() - 1], false).is_none());
        assert!(parse_response(&sized[..20], false).is_none());
        let r = parse_response(sized, false).expect("whole");
        assert_eq!(
            (r.status, r.body.as_str(), r.header("x-a")),
            (413, "body", Some("b"))
        );
        assert_eq!(r.headers.get_all("x-a").iter().count(), 2);
        let cut = parse_response(&sized[..sized.len() - 1], true).expect("at eof");
        assert_eq!(cut.body, "bod");
    }

    #[test]
    fn chunked_answers_are_whole_after_the_last_chunk() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nA;ext=1\r\n0123456789\r\n0\r\n\r\n";
        assert!(parse_response(&chunked[..chunked.len() - 2], false).is_none());
        assert!(parse_response(&chunked[..chunked.len() - 20], false).is_none());
        assert_eq!(
            parse_response(chunked, false).expect("whole").body,
            "abc0123456789"
        );
        let trailed =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nde\r\n0\r\nx-t: 1\r\n\r\n";
        assert_eq!(parse_response(trailed, false).expect("whole").body, "de");
        let cut = &chunked[..chunked.len() - 20];
        assert_eq!(parse_response(cut, true).expect("at eof").body, "abc");
    }

    #[test]
    fn close_delimited_answers_are_whole_only_at_eof() {
        let raw = b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end";
        assert!(parse_response(raw, false).is_none());
        assert_eq!(
            parse_response(raw, true).expect("eof").body,
            "until the end"
        );
    }

    #[test]
    #[should_panic(expected = "no HTTP/1 response head")]
    fn bytes_that_are_no_response_panic() {
        parse_response(b"SSH-2.0-OpenSSH\r\n\r\n", true);
    }
}
