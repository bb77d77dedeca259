//! The request body read once, without a tree: one pass over the bytes
//! checks them as strictly as the `serde_json` read it replaces on the hot
//! path (`demand::read_json`) and records each value as one entry of a
//! flat list (its kind, its bytes, where the next value starts). Strings
//! stay in the client's bytes, unescaped only when a reader asks for one
//! that has escapes; nothing is allocated per value.
//!
//! What the strict read refuses, the tape refuses, so a body sluice admits
//! is a body every JSON parser reads as sluice does (the property test
//! below holds the two equal on generated bodies):
//! - malformed JSON, anything after the value, whitespace other than
//!   space, tab, CR and LF (RFC 8259 §2);
//! - bytes that are not UTF-8, control characters (below U+0020) inside a
//!   string, an unknown escape, a `\u` escape that is a lone surrogate
//!   (serde_json 1.0.154 `read.rs`, `parse_unicode_escape`, refuses a
//!   trailing one, or a leading one not followed by a trailing one);
//! - a number outside `f64` (`1e400`; serde_json's `NumberOutOfRange`:
//!   the few literals that can be are checked by serde_json itself, so the
//!   boundary is its own), leading zeros, `1.`, `.5`, `+1`;
//! - one key twice in an object, compared unescaped (`"a"` and `"\u0061"`);
//! - more than [`MAX_JSON_VALUES`] values, or nesting past serde_json's
//!   own limit (the body's bounds, `demand::scan_bounds`, run first).
//!
//! A refusal carries no message: the caller reads the body with the strict
//! read again to say exactly what is wrong (a refused body is rare, and
//! its answer is the same as before the tape).

use std::borrow::Cow;

use super::shared::MAX_JSON_VALUES;
use super::view::{Kind, View};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Null,
    True,
    False,
    Number,
    /// A string without escapes: its bytes are its text.
    Plain,
    /// A string with escapes.
    Escaped,
    Array,
    Object,
}

/// One value. An object's members follow it as key, value, key, value…
#[derive(Debug, Clone, Copy)]
struct Node {
    tag: Tag,
    /// The value's bytes (a string's with its quotes).
    start: u32,
    end: u32,
    /// The entry after this value and everything inside it.
    next: u32,
}

/// Nesting the reader follows: serde_json's recursion limit (the body's
/// own bound, `MAX_JSON_DEPTH`, is lower and checked before).
const MAX_DEPTH: usize = 128;

/// A body read and checked, and the place of each of its values.
pub struct Tape<'a> {
    src: &'a str,
    nodes: Vec<Node>,
}

impl<'a> Tape<'a> {
    /// Reads `body`; `None` if the strict read would refuse it.
    pub fn read(body: &'a [u8]) -> Option<Tape<'a>> {
        let src = std::str::from_utf8(body).ok()?;
        u32::try_from(body.len()).ok()?;
        let mut reader = Reader {
            b: body,
            i: 0,
            // About a value per 8 bytes of a small body; a large one grows.
            nodes: Vec::with_capacity((body.len() / 8).min(4096) + 4),
            values: 0,
        };
        reader.document()?;
        Some(Tape {
            src,
            nodes: reader.nodes,
        })
    }

    /// The body's value.
    pub fn root(&self) -> Json<'_> {
        Json { tape: self, at: 0 }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
    nodes: Vec<Node>,
    values: u32,
}

impl Reader<'_> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    #[inline(always)]
    fn push(&mut self, tag: Tag, start: usize, end: usize) -> usize {
        let at = self.nodes.len();
        self.nodes.push(Node {
            tag,
            start: start as u32,
            end: end as u32,
            next: at as u32 + 1,
        });
        at
    }

    /// The whole body: one value, then only whitespace.
    fn document(&mut self) -> Option<()> {
        // The open containers' entries (an entry's tag says whether it is
        // an object).
        let mut open = [0u32; MAX_DEPTH];
        let mut depth = 0usize;
        self.ws();
        'value: loop {
            self.values += 1;
            if self.values > MAX_JSON_VALUES {
                return None;
            }
            let start = self.i;
            match *self.b.get(self.i)? {
                open_byte @ (b'{' | b'[') => {
                    let object = open_byte == b'{';
                    let tag = if object { Tag::Object } else { Tag::Array };
                    let at = self.push(tag, start, start);
                    self.i += 1;
                    self.ws();
                    let close = if object { b'}' } else { b']' };
                    if self.b.get(self.i) == Some(&close) {
                        self.i += 1;
                        self.close(at);
                    } else {
                        *open.get_mut(depth)? = at as u32;
                        depth += 1;
                        if object {
                            self.key()?;
                        }
                        continue 'value;
                    }
                }
                b'"' => {
                    let (end, escaped) = self.string()?;
                    let tag = if escaped { Tag::Escaped } else { Tag::Plain };
                    self.push(tag, start, end);
                }
                b't' => self.literal(b"true", Tag::True)?,
                b'f' => self.literal(b"false", Tag::False)?,
                b'n' => self.literal(b"null", Tag::Null)?,
                _ => self.number()?,
            }
            // After a value: separators and the containers it closes.
            loop {
                let Some(at) = depth.checked_sub(1).and_then(|d| open.get(d)) else {
                    self.ws();
                    return (self.i == self.b.len()).then_some(());
                };
                let at = *at as usize;
                let object = self.nodes.get(at)?.tag == Tag::Object;
                self.ws();
                match (*self.b.get(self.i)?, object) {
                    (b',', _) => {
                        self.i += 1;
                        self.ws();
                        if object {
                            self.key()?;
                        }
                        continue 'value;
                    }
                    (b'}', true) | (b']', false) => {
                        self.i += 1;
                        self.close(at);
                        if object {
                            self.unique(at)?;
                        }
                        depth -= 1;
                    }
                    _ => return None,
                }
            }
        }
    }

    /// A container ends here.
    fn close(&mut self, at: usize) {
        let next = self.nodes.len() as u32;
        if let Some(node) = self.nodes.get_mut(at) {
            node.end = self.i as u32;
            node.next = next;
        }
    }

    /// An object key and its colon; the value comes next.
    fn key(&mut self) -> Option<()> {
        let start = self.i;
        if self.b.get(start) != Some(&b'"') {
            return None;
        }
        let (end, escaped) = self.string()?;
        let tag = if escaped { Tag::Escaped } else { Tag::Plain };
        self.push(tag, start, end);
        self.ws();
        if self.b.get(self.i) != Some(&b':') {
            return None;
        }
        self.i += 1;
        self.ws();
        Some(())
    }

    /// The string opening at `self.i`: its end (after the closing quote)
    /// and whether it has escapes. Leaves `self.i` at the end.
    fn string(&mut self) -> Option<(usize, bool)> {
        let b = self.b;
        let mut j = self.i + 1;
        let mut escaped = false;
        loop {
            // Eight bytes at a time while none of them is a quote, a
            // backslash or a control character (the common case: text),
            // then straight to the first one that is.
            j = first_flagged(b, j, stops);
            match *b.get(j)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    j = escape_end(b, j)?;
                }
                0..=0x1F => return None,
                _ => j += 1,
            }
        }
        self.i = j + 1;
        Some((self.i, escaped))
    }

    fn literal(&mut self, word: &[u8], tag: Tag) -> Option<()> {
        let start = self.i;
        if !self.b.get(start..)?.starts_with(word) {
            return None;
        }
        self.i += word.len();
        self.push(tag, start, self.i);
        Some(())
    }

    /// A number (RFC 8259 §6). One that may fall outside `f64` is checked
    /// by serde_json's own number reader.
    fn number(&mut self) -> Option<()> {
        let b = self.b;
        let start = self.i;
        let digits = |mut j: usize| {
            while b.get(j).is_some_and(u8::is_ascii_digit) {
                j += 1;
            }
            j
        };
        let mut j = start;
        if b.get(j) == Some(&b'-') {
            j += 1;
        }
        j = match *b.get(j)? {
            b'0' => j + 1,
            b'1'..=b'9' => digits(j + 1),
            _ => return None,
        };
        let mut integer = true;
        if b.get(j) == Some(&b'.') {
            integer = false;
            let after = digits(j + 1);
            if after == j + 1 {
                return None;
            }
            j = after;
        }
        if matches!(b.get(j), Some(b'e' | b'E')) {
            integer = false;
            j += 1;
            if matches!(b.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            let after = digits(j);
            if after == j {
                return None;
            }
            j = after;
        }
        // Up to 18 characters, an integer is within `i64` and `u64`.
        if !integer || j - start > 18 {
            serde_json::from_slice::<f64>(b.get(start..j)?).ok()?;
        }
        self.i = j;
        self.push(Tag::Number, start, j);
        Some(())
    }

    /// Refuses an object (the entry `at`) with one key twice.
    fn unique(&self, at: usize) -> Option<()> {
        const SMALL: usize = 16;
        let end = self.nodes.get(at)?.next as usize;
        let keys = || Members::new(&self.nodes, at + 1, end).map(|(key, _)| key);
        // Small objects without escaped keys (nearly all): each key's
        // bytes (inside its quotes) gathered once, compared by length
        // first, then byte for byte.
        let mut small = [(0u32, 0u32); SMALL];
        let mut count = 0usize;
        for key in keys() {
            let node = self.nodes.get(key)?;
            match small.get_mut(count) {
                Some(slot) if node.tag == Tag::Plain => *slot = (node.start + 1, node.end - 1),
                _ => return self.unique_sorted(keys()),
            }
            count += 1;
        }
        let small = small.get(..count).unwrap_or_default();
        let raw = |(start, end): (u32, u32)| self.b.get(start as usize..end as usize);
        for (i, &a) in small.iter().enumerate() {
            let len = a.1 - a.0;
            for &b in small.get(i + 1..).unwrap_or_default() {
                if b.1 - b.0 == len && raw(a) == raw(b) {
                    return None;
                }
            }
        }
        Some(())
    }

    /// [`Self::unique`] for a large object or one with an escaped key:
    /// the keys' texts, unescaped, sorted.
    fn unique_sorted(&self, keys: impl Iterator<Item = usize>) -> Option<()> {
        let mut texts: Vec<Cow<str>> = keys
            .map(|k| {
                let n = self.nodes.get(k).copied();
                let raw = n
                    .and_then(|n| self.b.get(n.start as usize + 1..n.end as usize - 1))
                    .unwrap_or_default();
                let text = std::str::from_utf8(raw).unwrap_or_default();
                match n.map(|n| n.tag) {
                    Some(Tag::Escaped) => Cow::Owned(unescape(text)),
                    _ => Cow::Borrowed(text),
                }
            })
            .collect();
        texts.sort_unstable();
        texts
            .windows(2)
            .all(|pair| pair.first() != pair.get(1))
            .then_some(())
    }
}

/// Which of these eight bytes (little-endian) stop a string's scan: `"`,
/// `\\` or a control character, each flagged by its high bit (the bit
/// tricks of "Bit Twiddling Hacks", "Determine if a word has a byte less
/// than n"). Only the lowest flag is exact (a borrow can flag a byte above
/// a true one), and only it is read: the first byte that stops.
/// From `i`, eight bytes at a time, the first byte `flags` flags (the
/// lowest flag of a word, the only one its tests keep exact); the last
/// seven bytes or fewer are left to the caller's byte loop, which reads
/// them one by one (so `i` may come back short of a flagged byte there).
#[inline(always)]
pub(crate) fn first_flagged(bytes: &[u8], mut i: usize, flags: impl Fn(u64) -> u64) -> usize {
    while let Some(word) = bytes.get(i..i + 8) {
        let mut eight = [0u8; 8];
        eight.copy_from_slice(word);
        let flagged = flags(u64::from_le_bytes(eight));
        if flagged != 0 {
            return i + (flagged.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i
}

pub(crate) fn stops(word: u64) -> u64 {
    let below_space = word.wrapping_sub(ONES * 0x20) & !word & HIGH;
    equal_to(word, b'"') | equal_to(word, b'\\') | below_space
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Which of these eight bytes (little-endian) equal `b`, each flagged by
/// its high bit; as in [`stops`], only the lowest flag is exact (and an OR
/// of such flags keeps its lowest exact: a false flag lies above a true
/// one of its own).
pub(crate) fn equal_to(word: u64, b: u8) -> u64 {
    let x = word ^ (ONES * u64::from(b));
    x.wrapping_sub(ONES) & !x & HIGH
}

/// The index after the escape at `j` (a backslash), if it is one JSON has.
fn escape_end(b: &[u8], j: usize) -> Option<usize> {
    match *b.get(j + 1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(j + 2),
        b'u' => {
            let unit = hex4(b, j + 2)?;
            match unit {
                0xDC00..=0xDFFF => None,
                0xD800..=0xDBFF => {
                    if b.get(j + 6..j + 8)? != b"\\u" {
                        return None;
                    }
                    matches!(hex4(b, j + 8)?, 0xDC00..=0xDFFF).then_some(j + 12)
                }
                _ => Some(j + 6),
            }
        }
        _ => None,
    }
}

fn hex4(b: &[u8], at: usize) -> Option<u32> {
    let digits = std::str::from_utf8(b.get(at..at + 4)?).ok()?;
    if !digits.bytes().all(|d| d.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

/// The text of a checked string's insides (between its quotes).
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(slash) = rest.find('\\') {
        out.push_str(rest.get(..slash).unwrap_or_default());
        let b = rest.as_bytes();
        let (c, used) = match b.get(slash + 1) {
            Some(b'b') => ('\u{8}', 2),
            Some(b'f') => ('\u{c}', 2),
            Some(b'n') => ('\n', 2),
            Some(b'r') => ('\r', 2),
            Some(b't') => ('\t', 2),
            Some(b'u') => {
                let unit = hex4(b, slash + 2).unwrap_or(0xFFFD);
                if (0xD800..=0xDBFF).contains(&unit) {
                    let low = hex4(b, slash + 8).unwrap_or(0xDC00);
                    let code = 0x1_0000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
                    (char::from_u32(code).unwrap_or('\u{FFFD}'), 12)
                } else {
                    (char::from_u32(unit).unwrap_or('\u{FFFD}'), 6)
                }
            }
            Some(&other) => (other as char, 2),
            None => break,
        };
        out.push(c);
        rest = rest.get(slash + used..).unwrap_or_default();
    }
    out.push_str(rest);
    out
}

/// The entries of a container's members, from `at` to `end`: each is its
/// key's entry (an object's) or its value's (an array's).
struct Members<'n> {
    nodes: &'n [Node],
    at: usize,
    end: usize,
    /// Entries per member: 2 in an object (key, value), 1 in an array.
    object: bool,
}

impl<'n> Members<'n> {
    fn new(nodes: &'n [Node], at: usize, end: usize) -> Self {
        Members {
            nodes,
            at,
            end,
            object: true,
        }
    }
}

impl Iterator for Members<'_> {
    /// (the member's first entry, its value's)
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if self.at >= self.end {
            return None;
        }
        let first = self.at;
        let value = if self.object { first + 1 } else { first };
        self.at = self.nodes.get(value)?.next as usize;
        Some((first, value))
    }
}

/// One value of a tape.
#[derive(Clone, Copy)]
pub struct Json<'t> {
    tape: &'t Tape<'t>,
    at: usize,
}

impl<'t> Json<'t> {
    fn node(self) -> Node {
        self.tape.nodes.get(self.at).copied().unwrap_or(Node {
            tag: Tag::Null,
            start: 0,
            end: 0,
            next: 0,
        })
    }

    /// The value's bytes as the client wrote them.
    pub fn text(self) -> &'t str {
        let n = self.node();
        self.tape
            .src
            .get(n.start as usize..n.end as usize)
            .unwrap_or_default()
    }

    fn children(self, object: bool) -> Members<'t> {
        let n = self.node();
        let inside = match (n.tag, object) {
            (Tag::Object, true) | (Tag::Array, false) => self.at + 1,
            _ => n.next as usize, // none
        };
        Members {
            nodes: &self.tape.nodes,
            at: inside,
            end: n.next as usize,
            object,
        }
    }

    fn entry(self, at: usize) -> Json<'t> {
        Json {
            tape: self.tape,
            at,
        }
    }

    /// An integer literal (no fraction, no exponent).
    fn integer(self) -> Option<&'t str> {
        let text = self.text();
        (self.node().tag == Tag::Number && !text.contains(['.', 'e', 'E'])).then_some(text)
    }
}

impl<'t> View<'t> for Json<'t> {
    fn kind(self) -> Kind {
        match self.node().tag {
            Tag::Null => Kind::Null,
            Tag::True => Kind::Bool(true),
            Tag::False => Kind::Bool(false),
            Tag::Number => Kind::Number,
            Tag::Plain | Tag::Escaped => Kind::String,
            Tag::Array => Kind::Array,
            Tag::Object => Kind::Object,
        }
    }

    fn get(self, key: &str) -> Option<Self> {
        let nodes = &self.tape.nodes;
        let src = self.tape.src.as_bytes();
        let n = self.node();
        if n.tag != Tag::Object {
            return None;
        }
        let (mut k, end) = (self.at + 1, n.next as usize);
        while k < end {
            let key_node = nodes.get(k)?;
            let same = match key_node.tag {
                // Its bytes are its text: compared in place.
                Tag::Plain => {
                    key_node.end - key_node.start == key.len() as u32 + 2
                        && src.get(key_node.start as usize + 1..key_node.end as usize - 1)
                            == Some(key.as_bytes())
                }
                _ => self.entry(k).str().is_some_and(|text| text == key),
            };
            if same {
                return Some(self.entry(k + 1));
            }
            k = nodes.get(k + 1)?.next as usize;
        }
        None
    }

    fn str(self) -> Option<Cow<'t, str>> {
        let text = self.text();
        let inside = text.get(1..text.len().saturating_sub(1))?;
        match self.node().tag {
            Tag::Plain => Some(Cow::Borrowed(inside)),
            Tag::Escaped => Some(Cow::Owned(unescape(inside))),
            _ => None,
        }
    }

    fn non_empty_str(self) -> bool {
        // Quotes and at least one character (an escape is never empty).
        matches!(self.node().tag, Tag::Plain | Tag::Escaped) && self.text().len() > 2
    }

    fn u64(self) -> Option<u64> {
        self.integer()?.parse().ok()
    }

    fn i64(self) -> Option<i64> {
        let text = self.integer()?;
        // serde_json reads `-0` as a float.
        text.parse()
            .ok()
            .filter(|v| *v != 0 || !text.starts_with('-'))
    }

    fn items(self) -> impl Iterator<Item = Self> + 't {
        self.children(false).map(move |(_, v)| self.entry(v))
    }

    fn members(self) -> impl Iterator<Item = (Cow<'t, str>, Self)> + 't {
        self.children(true)
            .map(move |(k, v)| (self.entry(k).str().unwrap_or_default(), self.entry(v)))
    }

    fn compact(self) -> String {
        serde_json::from_str::<serde_json::Value>(self.text())
            .map(|v| v.to_string())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
