//! Harness pieces for the hierarchy, penalty-box and timezone tests
//! (`tests/tests/org.rs`): requests from another loopback address, and a
//! POSIX timezone whose midnight is a given time from now.

use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{client_builder, Response};

/// A blocking client whose connections leave from `from` (any 127.0.0.0/8
/// address works on Linux loopback without configuration).
pub fn client_from(from: &str) -> reqwest::blocking::Client {
    let ip: IpAddr = from.parse().expect("a loopback address");
    client_builder()
        .local_address(ip)
        .build()
        .expect("build HTTP client")
}

/// `GET url` with `client`; panics on transport failure.
pub fn get_with(
    client: &reqwest::blocking::Client,
    url: &str,
    headers: &[(&str, &str)],
) -> Response {
    let mut req = client.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.text().unwrap_or_default();
    Response {
        status,
        headers,
        body,
    }
}

/// A POSIX TZ string for a fixed offset whose local midnight comes
/// `ahead` after now (whole seconds), and that midnight in ms since the
/// epoch. The offset is within ±12 h, as a real zone's would be.
pub fn zone_with_midnight_in(ahead: Duration) -> (String, u64) {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64;
    let midnight_ms = (now_ms + ahead.as_millis() as u64).div_ceil(1000) * 1000;
    // Local time = UTC + offset; local midnight at `midnight_ms` means
    // (midnight_ms + offset) is a multiple of a day.
    const DAY: i64 = 86_400;
    let utc_s = (midnight_ms / 1000) as i64 % DAY;
    let mut offset = (DAY - utc_s) % DAY;
    if offset > DAY / 2 {
        offset -= DAY;
    }
    let sign = if offset >= 0 { '+' } else { '-' };
    let a = offset.abs();
    let (h, m, s) = (a / 3600, a / 60 % 60, a % 60);
    // POSIX offsets are west-positive: UTC+x is written `-x`.
    let posix_sign = if offset >= 0 { '-' } else { '+' };
    let tz = format!("<{sign}{h:02}{m:02}{s:02}>{posix_sign}{h}:{m:02}:{s:02}");
    (tz, midnight_ms)
}
