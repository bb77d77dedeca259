//! proxy-wasm's serialized header map, read into one [`Headers`]
//! snapshot. The host answers `proxy_get_header_map_pairs` with one buffer:
//! the number of pairs (u32, little-endian), then each pair's name and
//! value sizes (u32 each), then each name and value in that order, each
//! followed by a NUL byte. That is what Envoy's wasm host writes
//! (proxy-wasm-cpp-host, src/pairs_util.cc, `PairsUtil::marshalPairs`,
//! called by `get_header_map_pairs` in src/exports.cc; no headers is an
//! empty buffer) and what the Rust SDK 0.2.5 reads
//! (src/hostcalls.rs, `utils::deserialize_map_bytes`). The
//! SDK turns it into a `String` and a `Vec` per header; read here, the
//! whole map costs the host's buffer and the snapshot's two.

use sluice_core::Headers;

fn word(bytes: &[u8], at: usize) -> Option<usize> {
    let raw = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize)
}

/// The map, or `None` when the buffer does not hold what its counts say
/// (never from Envoy; a short read must not panic the VM).
pub fn headers(bytes: &[u8]) -> Option<Headers> {
    if bytes.is_empty() {
        return Some(Headers::default());
    }
    let count = word(bytes, 0)?;
    let mut at = count.checked_mul(8)?.checked_add(4)?;
    if at > bytes.len() {
        return None;
    }
    let mut snapshot = Headers::with_capacity(count, bytes.len() - at);
    for pair in 0..count {
        let name_len = word(bytes, 4 + pair * 8)?;
        let value_len = word(bytes, 8 + pair * 8)?;
        let name = bytes.get(at..at.checked_add(name_len)?)?;
        at += name_len + 1;
        let value = bytes.get(at..at.checked_add(value_len)?)?;
        at += value_len + 1;
        snapshot.push_bytes(name, value);
    }
    Some(snapshot)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The encoding as the ABI describes it, written independently of
    /// the reader.
    fn encode(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (n, v) in pairs {
            out.extend_from_slice(&(n.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (n, v) in pairs {
            out.extend_from_slice(n);
            out.push(0);
            out.extend_from_slice(v);
            out.push(0);
        }
        out
    }

    #[test]
    fn a_map_reads_in_order_with_repeats_and_empty_values() {
        let bytes = encode(&[
            (b":method", b"GET"),
            (b":path", b"/v1/models"),
            (b"x-api-key", b"k1"),
            (b"x-api-key", b"k2"),
            (b"x-empty", b""),
        ]);
        let h = headers(&bytes).unwrap();
        let all: Vec<_> = h.iter().collect();
        assert_eq!(
            all,
            [
                (":method", "GET"),
                (":path", "/v1/models"),
                ("x-api-key", "k1"),
                ("x-api-key", "k2"),
                ("x-empty", ""),
            ]
        );
    }

    #[test]
    fn a_value_that_is_not_utf8_is_replaced() {
        let h = headers(&encode(&[(b"x-name", b"caf\xe9")])).unwrap();
        assert_eq!(h.get("x-name"), Some("caf\u{fffd}"));
    }

    #[test]
    fn an_empty_buffer_is_no_headers_and_a_short_one_is_refused() {
        assert_eq!(headers(b"").unwrap().len(), 0);
        assert_eq!(headers(&encode(&[])).unwrap().len(), 0);
        let whole = encode(&[(b"a", b"bcd"), (b"e", b"f")]);
        for cut in 1..whole.len() - 1 {
            assert!(headers(&whole[..cut]).is_none(), "cut at {cut}");
        }
        // A count far past the buffer.
        assert!(headers(&u32::MAX.to_le_bytes()).is_none());
    }
}
