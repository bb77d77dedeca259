//! Deterministic embeddings that mean something, for the semantic cache's
//! tests: a text's vector is the L2-normalised count of its hashed
//! features — every lower-cased word (weight 1) and every character
//! trigram of each word framed by `^`/`$` (weight ½) — folded into
//! `dimensions` slots (default 384) with a hash-chosen sign. So texts that
//! share most words are close (a reordering or one extra word stays above
//! 0.9), texts that share few are near 0, and a one-word change of meaning
//! ("enable 2FA" → "disable 2FA") costs a whole word and several trigrams.
//! The same text always gives the same vector, on every run and machine.

/// Vectors are at most this long (a request may ask for fewer).
pub const MAX_DIMENSIONS: usize = 4096;
pub const DEFAULT_DIMENSIONS: usize = 384;

fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64 ^ seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn add(v: &mut [f64], feature: &[u8], weight: f64) {
    let n = v.len().max(1) as u64;
    let h = fnv1a(feature, 0);
    let slot = (h % n) as usize;
    let sign = if fnv1a(feature, 0x9e37_79b9) & 1 == 0 {
        1.0
    } else {
        -1.0
    };
    if let Some(x) = v.get_mut(slot) {
        *x += sign * weight;
    }
}

/// The embedding of `text` in `dimensions` (clamped to 1..=[`MAX_DIMENSIONS`]).
pub fn embed(text: &str, dimensions: usize) -> Vec<f64> {
    let dims = dimensions.clamp(1, MAX_DIMENSIONS);
    let mut v = vec![0.0; dims];
    let lower = text.to_lowercase();
    for word in lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        add(&mut v, format!("w:{word}").as_bytes(), 1.0);
        let framed: Vec<char> = format!("^{word}$").chars().collect();
        for tri in framed.windows(3) {
            let t: String = tri.iter().collect();
            add(&mut v, format!("t:{t}").as_bytes(), 0.5);
        }
    }
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x /= norm;
        }
    }
    v
}

/// The dimension a request asks for (OpenAI's `dimensions`), else the default.
pub fn dimensions_of(body: &serde_json::Value) -> usize {
    body.get("dimensions")
        .and_then(serde_json::Value::as_u64)
        .and_then(|d| usize::try_from(d).ok())
        .unwrap_or(DEFAULT_DIMENSIONS)
}

/// Cosine of two vectors (both normalised by [`embed`]: their dot product).
pub fn cosine(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim(a: &str, b: &str) -> f64 {
        cosine(&embed(a, 384), &embed(b, 384))
    }

    #[test]
    fn deterministic_and_normalised() {
        let a = embed("How do I enable 2FA?", 384);
        assert_eq!(a, embed("How do I enable 2FA?", 384));
        let norm: f64 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-9);
        assert_eq!(embed("", 16), vec![0.0; 16]);
        assert_eq!(embed("x", 0).len(), 1);
        assert_eq!(embed("x", 1 << 20).len(), MAX_DIMENSIONS);
    }

    #[test]
    fn paraphrases_are_close_and_opposites_are_not() {
        let q = "How do I enable 2FA on my account?";
        let para = "how do I enable 2FA on my account";
        let reordered = "On my account, how do I enable 2FA?";
        let opposite = "How do I disable 2FA on my account?";
        let other = "What is the capital of France?";
        for (a, b) in [(q, para), (q, reordered)] {
            assert!(sim(a, b) > 0.99, "{a} ~ {b}: {}", sim(a, b));
        }
        println!("opposite {} other {}", sim(q, opposite), sim(q, other));
        assert!(sim(q, opposite) < 0.95, "{}", sim(q, opposite));
        assert!(sim(q, other) < 0.3, "{}", sim(q, other));
        let extra = "How do I enable 2FA on my account please?";
        println!("extra word {}", sim(q, extra));
        assert!(sim(q, extra) > 0.9);
    }
}
