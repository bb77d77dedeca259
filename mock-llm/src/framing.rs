//! Wire framing of streamed answers (SSE events, NDJSON lines) and the paced
//! body that sends them, with the chunk-delay and reset knobs applied.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use futures_util::stream;
use serde_json::Value;

use crate::knobs::Newline;
use crate::metrics::RequestTimer;
use crate::stats::{StreamEnd, Streams};

/// The OpenAI stream terminator.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// One SSE event carrying JSON: `data: {...}\n\n`.
pub fn sse_data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// One named SSE event, as the Responses API sends: `event: x\ndata: {...}\n\n`.
pub fn sse_event(event: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {v}\n\n"))
}

/// One NDJSON line, as Ollama streams: `{...}\n`.
pub fn ndjson_line(v: &Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

/// SSE `frames` with their line ends rewritten to `nl`. JSON escapes every
/// newline inside a value, so each LF in a frame is a line end.
pub fn sse_newlines(frames: Vec<Bytes>, nl: Newline) -> Vec<Bytes> {
    let end: &[u8] = match nl {
        Newline::Lf => return frames,
        Newline::Cr => b"\r",
        Newline::CrLf | Newline::CrLfSplit => b"\r\n",
    };
    let mut out: Vec<Vec<u8>> = frames
        .iter()
        .map(|f| {
            let mut v = Vec::with_capacity(f.len() + 4);
            for b in f.iter() {
                match b {
                    b'\n' => v.extend_from_slice(end),
                    b => v.push(*b),
                }
            }
            v
        })
        .collect();
    if nl == Newline::CrLfSplit {
        // Each frame but the last ends `\r\n\r\n`: its final LF opens the
        // next frame, so every boundary falls inside a CRLF.
        for i in 1..out.len() {
            if out[i - 1].ends_with(b"\r\n") {
                out[i - 1].pop();
                out[i].insert(0, b'\n');
            }
        }
    }
    out.into_iter().map(Bytes::from).collect()
}

/// Minimum pause before a reset, so what was sent reaches the socket.
const RESET_GRACE: Duration = Duration::from_millis(5);

/// How the frames of a body are sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pacing {
    /// Pause before every frame but the first.
    pub chunk_delay: Duration,
    /// Send this many frames, then fail the body so the server aborts the
    /// connection (HTTP/1.1: no terminating chunk; HTTP/2: RST_STREAM). When
    /// there are fewer frames, all are sent and the end is still an abort.
    pub reset_after: Option<usize>,
    /// Send this many frames, then send nothing more and never end (the
    /// `stream_stall` fault); with fewer frames, all are sent first.
    pub stall_after: Option<usize>,
}

struct State {
    frames: VecDeque<Bytes>,
    sent: usize,
    pacing: Pacing,
    timer: RequestTimer,
    done: bool,
    /// Stopped for good by `stall_after`.
    stalled: bool,
    log: Option<Logged>,
}

/// Where a body reports its progress (`/admin/stats` `streams`).
pub struct Logged {
    pub streams: Arc<Streams>,
    pub index: usize,
    started: Instant,
}

impl Logged {
    /// Records a new body of `frames` frames in `streams`.
    pub fn start(streams: &Arc<Streams>, frames: usize) -> Option<Logged> {
        Some(Logged {
            index: streams.start(frames)?,
            streams: streams.clone(),
            started: Instant::now(),
        })
    }
}

impl Drop for State {
    /// The body ends: sent whole, reset by the knob, or dropped by hyper
    /// because the peer went away (the unfold's state is dropped with it).
    fn drop(&mut self) {
        let Some(log) = &self.log else { return };
        let ended = if self.pacing.reset_after.is_some() && self.done {
            StreamEnd::Reset
        } else if self.frames.is_empty() && !self.stalled {
            StreamEnd::Complete
        } else {
            StreamEnd::Dropped
        };
        let lasted = u64::try_from(log.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        log.streams.update(log.index, |seen| {
            seen.ended = ended;
            seen.lasted_ms = Some(lasted);
        });
    }
}

/// A body that sends `frames` one by one. The first frame marks time to first
/// token; the last one, sent without a reset, marks the request complete.
/// `log`: where it reports each frame sent and how it ended.
pub fn paced_body(
    frames: Vec<Bytes>,
    pacing: Pacing,
    timer: RequestTimer,
    log: Option<Logged>,
) -> Body {
    let state = State {
        frames: frames.into(),
        sent: 0,
        pacing,
        timer,
        done: false,
        stalled: false,
        log,
    };
    Body::from_stream(stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        if let Some(n) = s.pacing.stall_after {
            if s.sent >= n || s.frames.is_empty() {
                // Pending for good: the server flushes what was sent and
                // holds the connection until the peer goes away.
                s.stalled = true;
                std::future::pending::<()>().await;
            }
        }
        if let Some(n) = s.pacing.reset_after {
            if s.sent >= n || s.frames.is_empty() {
                s.done = true;
                // Pause first: the server flushes what it has buffered (the
                // head and the frames so far) only when the body is pending;
                // failing at once would drop them along with the connection.
                tokio::time::sleep(s.pacing.chunk_delay.max(RESET_GRACE)).await;
                let err =
                    io::Error::new(io::ErrorKind::ConnectionReset, "x-mock-reset-after-chunks");
                return Some((Err(err), s));
            }
        }
        let frame = match s.frames.pop_front() {
            Some(frame) => frame,
            None => {
                s.timer.finish();
                return None;
            }
        };
        if s.sent > 0 && !s.pacing.chunk_delay.is_zero() {
            tokio::time::sleep(s.pacing.chunk_delay).await;
        }
        s.sent += 1;
        if let Some(log) = &s.log {
            log.streams.update(log.index, |seen| seen.frames_sent += 1);
        }
        s.timer.first_token();
        if s.frames.is_empty() && s.pacing.reset_after.is_none() && s.pacing.stall_after.is_none() {
            s.timer.finish();
        }
        Some((Ok(frame), s))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use futures_util::StreamExt;
    use serde_json::json;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn sse_and_ndjson_framing() {
        let v = json!({"a": 1});
        assert_eq!(sse_data(&v), Bytes::from_static(b"data: {\"a\":1}\n\n"));
        assert_eq!(
            sse_event("response.completed", &v),
            Bytes::from_static(b"event: response.completed\ndata: {\"a\":1}\n\n")
        );
        assert_eq!(ndjson_line(&v), Bytes::from_static(b"{\"a\":1}\n"));
        // A JSON string with a newline stays on one line.
        let multi = json!({"t": "x\ny"});
        assert_eq!(
            ndjson_line(&multi).iter().filter(|b| **b == b'\n').count(),
            1
        );
        assert_eq!(sse_data(&multi).iter().filter(|b| **b == b'\n').count(), 2);
    }

    #[test]
    fn sse_line_ends() {
        let frames = || {
            vec![
                sse_data(&json!({"a": "x\ny"})),
                Bytes::from_static(SSE_DONE),
            ]
        };
        let joined = |f: Vec<Bytes>| f.concat();
        assert_eq!(
            joined(sse_newlines(frames(), Newline::Lf)),
            joined(frames())
        );
        assert_eq!(
            joined(sse_newlines(frames(), Newline::CrLf)),
            b"data: {\"a\":\"x\\ny\"}\r\n\r\ndata: [DONE]\r\n\r\n".to_vec()
        );
        assert_eq!(
            joined(sse_newlines(frames(), Newline::Cr)),
            b"data: {\"a\":\"x\\ny\"}\r\rdata: [DONE]\r\r".to_vec()
        );
        let split = sse_newlines(frames(), Newline::CrLfSplit);
        assert!(split[0].ends_with(b"\r\n\r"));
        assert!(split[1].starts_with(b"\ndata"));
        assert_eq!(joined(split), joined(sse_newlines(frames(), Newline::CrLf)));
    }

    async fn collect(frames: usize, reset_after: Option<usize>) -> (usize, bool) {
        let metrics = Arc::new(Metrics::new("m".into()));
        let frames = (0..frames).map(|i| Bytes::from(i.to_string())).collect();
        let pacing = Pacing {
            reset_after,
            ..Pacing::default()
        };
        let mut body = paced_body(frames, pacing, metrics.start_request(Instant::now()), None)
            .into_data_stream();
        let (mut ok, mut failed) = (0, false);
        while let Some(item) = body.next().await {
            match item {
                Ok(_) => ok += 1,
                Err(_) => failed = true,
            }
        }
        (ok, failed)
    }

    #[tokio::test]
    async fn the_log_tells_a_dropped_body_from_a_complete_one() {
        let metrics = Arc::new(Metrics::new("m".into()));
        let streams = Arc::new(Streams::default());
        let body = |log| {
            let frames = (0..5).map(|i| Bytes::from(i.to_string())).collect();
            let timer = metrics.start_request(Instant::now());
            paced_body(frames, Pacing::default(), timer, log).into_data_stream()
        };
        let mut whole = body(Logged::start(&streams, 5));
        while whole.next().await.is_some() {}
        drop(whole);
        let mut cut = body(Logged::start(&streams, 5));
        cut.next().await;
        cut.next().await;
        assert_eq!(streams.snapshot()[1].ended, StreamEnd::Open);
        // What hyper does when the peer closes the connection.
        drop(cut);
        let seen = streams.snapshot();
        assert_eq!(
            (seen[0].frames_sent, seen[0].ended),
            (5, StreamEnd::Complete)
        );
        assert_eq!(
            (seen[1].frames_sent, seen[1].ended),
            (2, StreamEnd::Dropped)
        );
        assert!(seen.iter().all(|s| s.frames == 5 && s.lasted_ms.is_some()));
    }

    #[tokio::test]
    async fn sends_all_frames_then_ends() {
        assert_eq!(collect(3, None).await, (3, false));
    }

    #[tokio::test]
    async fn reset_cuts_the_body_after_n_frames() {
        assert_eq!(collect(5, Some(2)).await, (2, true));
        assert_eq!(collect(5, Some(0)).await, (0, true));
        assert_eq!(collect(2, Some(9)).await, (2, true));
    }
}
