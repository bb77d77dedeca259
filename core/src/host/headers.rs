//! A request's headers as one snapshot: every name and value in one text
//! buffer, each pair a span of it. A list of owned `(String, String)`
//! pairs costs two allocations per header (nineteen for a plain GET);
//! this costs two in all, however many headers there are.

/// Headers in order, repeats included; names compared ignoring ASCII case.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    text: String,
    /// Per header: where its name ends and where its value ends in
    /// `text`; the name starts where the previous value ended.
    ends: Vec<(u32, u32)>,
}

impl Headers {
    /// Room for `count` headers of `bytes` bytes of names and values.
    pub fn with_capacity(count: usize, bytes: usize) -> Self {
        Headers {
            text: String::with_capacity(bytes),
            ends: Vec::with_capacity(count),
        }
    }

    /// Copies pairs (text or bytes, see [`Headers::push_bytes`]) into one
    /// snapshot, sized once: how the hosts that hand over pairs (the
    /// native module, the mock) take theirs.
    pub fn of<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> Self {
        let bytes = pairs
            .iter()
            .map(|(n, v)| n.as_ref().len() + v.as_ref().len())
            .sum();
        let mut headers = Headers::with_capacity(pairs.len(), bytes);
        for (name, value) in pairs {
            headers.push_bytes(name.as_ref(), value.as_ref());
        }
        headers
    }

    /// Adds a header at the end. A snapshot past 4 GiB is not a request
    /// any proxy forwards; its tail is dropped rather than miscounted.
    pub fn push(&mut self, name: &str, value: &str) {
        if self.text.len() + name.len() + value.len() > u32::MAX as usize {
            return;
        }
        self.text.push_str(name);
        let name_end = self.text.len() as u32;
        self.text.push_str(value);
        self.ends.push((name_end, self.text.len() as u32));
    }

    /// Adds a header read as bytes: valid UTF-8 (nearly always) is taken
    /// as it is; anything else has its bad bytes replaced, as every other
    /// header read does (a byte 0x80–0xFF from a client must never panic).
    pub fn push_bytes(&mut self, name: &[u8], value: &[u8]) {
        // The plain check first: the lossy reader's chunk walk costs
        // several times as much on the text every request carries.
        match (std::str::from_utf8(name), std::str::from_utf8(value)) {
            (Ok(name), Ok(value)) => self.push(name, value),
            _ => self.push(
                &String::from_utf8_lossy(name),
                &String::from_utf8_lossy(value),
            ),
        }
    }

    /// Adds a header whose value is `n` in decimal, written in place (no
    /// formatter, no string of its own).
    pub fn push_number(&mut self, name: &str, n: u64) {
        let mut digits = [0u8; 20];
        self.push(name, decimal(n, &mut digits));
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Every header in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let mut start = 0usize;
        self.ends.iter().map(move |&(name_end, value_end)| {
            let (name_end, value_end) = (name_end as usize, value_end as usize);
            let pair = (&self.text[start..name_end], &self.text[name_end..value_end]);
            start = value_end;
            pair
        })
    }

    /// The first value of `name`: names compared as bytes, by length
    /// first (no text sliced but the value found).
    pub fn get(&self, name: &str) -> Option<&str> {
        let mut start = 0usize;
        for &(name_end, value_end) in &self.ends {
            if self.named(start, name_end, name) {
                return self.text.get(name_end as usize..value_end as usize);
            }
            start = value_end as usize;
        }
        None
    }

    /// How many times `name` appears.
    pub fn count(&self, name: &str) -> usize {
        let mut start = 0usize;
        let mut n = 0;
        for &(name_end, value_end) in &self.ends {
            n += usize::from(self.named(start, name_end, name));
            start = value_end as usize;
        }
        n
    }

    /// Is the name from `start` to `name_end` this `name`, in any case?
    #[inline(always)]
    fn named(&self, start: usize, name_end: u32, name: &str) -> bool {
        let name_end = name_end as usize;
        name_end.checked_sub(start) == Some(name.len())
            && self
                .text
                .as_bytes()
                .get(start..name_end)
                .is_some_and(|n| n.eq_ignore_ascii_case(name.as_bytes()))
    }

    /// Every `name` removed (a new snapshot: rare, so simple).
    pub fn remove(&mut self, name: &str) {
        if self.count(name) == 0 {
            return;
        }
        let mut kept = Headers::with_capacity(self.len(), self.text.len());
        for (n, v) in self.iter().filter(|(n, _)| !n.eq_ignore_ascii_case(name)) {
            kept.push(n, v);
        }
        *self = kept;
    }
}

impl<N: AsRef<str>, V: AsRef<str>> Extend<(N, V)> for Headers {
    fn extend<I: IntoIterator<Item = (N, V)>>(&mut self, pairs: I) {
        for (name, value) in pairs {
            self.push(name.as_ref(), value.as_ref());
        }
    }
}

/// `n` in decimal, as `n.to_string()` writes it, in `digits`: the one
/// digit writer of the answers and the audit record (no formatter on the
/// hot path).
pub fn decimal(mut n: u64, digits: &mut [u8; 20]) -> &str {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // Only ASCII digits were written.
    std::str::from_utf8(&digits[at..]).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn headers_keep_their_order_repeats_and_empty_values() {
        let h = Headers::of(&[
            (":path", "/v1/chat/completions"),
            ("x-api-key", "a"),
            ("", ""),
            ("X-Api-Key", "b"),
            ("x-empty", ""),
        ]);
        let all: Vec<_> = h.iter().collect();
        assert_eq!(
            all,
            [
                (":path", "/v1/chat/completions"),
                ("x-api-key", "a"),
                ("", ""),
                ("X-Api-Key", "b"),
                ("x-empty", ""),
            ]
        );
        assert_eq!(h.get("X-API-KEY"), Some("a"));
        assert_eq!(h.count("x-api-key"), 2);
        assert_eq!(h.get("x-empty"), Some(""));
        assert_eq!(h.get("absent"), None);
        assert_eq!(h.len(), 5);
    }

    #[test]
    fn removing_a_name_removes_every_repeat_and_keeps_the_rest() {
        let mut h = Headers::of(&[("a", "1"), ("B", "2"), ("c", "3"), ("b", "4")]);
        h.remove("b");
        assert_eq!(h, Headers::of(&[("a", "1"), ("c", "3")]));
        h.remove("zz");
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn bytes_that_are_not_utf8_are_replaced_not_fatal() {
        let mut h = Headers::default();
        h.push_bytes(b"x-name", b"caf\xe9 \xff");
        h.push_bytes(b"k", "é".as_bytes());
        assert_eq!(h.get("x-name"), Some("caf\u{fffd} \u{fffd}"));
        assert_eq!(h.get("k"), Some("é"));
    }

    #[test]
    fn numbers_are_written_as_to_string_writes_them() {
        let mut h = Headers::default();
        for n in [0, 7, 10, 99, 1_000_000, u64::MAX] {
            h.push_number("n", n);
        }
        let all: Vec<&str> = h.iter().map(|(_, v)| v).collect();
        assert_eq!(
            all,
            ["0", "7", "10", "99", "1000000", "18446744073709551615"]
        );
    }

    proptest::proptest! {
        /// Any pairs read back exactly as they were pushed.
        #[test]
        fn any_pairs_read_back_as_pushed(
            pairs in proptest::collection::vec((".{0,12}", ".{0,24}"), 0..20)
        ) {
            let h = Headers::of(&pairs);
            let back: Vec<(String, String)> =
                h.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
            proptest::prop_assert_eq!(&back, &pairs);
            // A lookup finds the first pair of that name, in any case.
            for (name, _) in &pairs {
                let first = pairs.iter().find(|(n, _)| n.eq_ignore_ascii_case(name));
                proptest::prop_assert_eq!(h.get(&name.to_ascii_uppercase()), first.map(|(_, v)| v.as_str()));
            }
            proptest::prop_assert_eq!(h.get("absent-name-xyz"), pairs.iter().find(|(n, _)| n == "absent-name-xyz").map(|(_, v)| v.as_str()));
        }
    }
}
