//! Stored Responses-API answers, as OpenAI and vLLM keep them: with `store`
//! (default true) a response's conversation is kept under its id, and a
//! later request naming it in `previous_response_id` carries that whole
//! conversation as input, billed in its `usage.input_tokens` (OpenAI API
//! reference, "Conversation state"; vLLM serving_responses.py prepends the
//! stored messages). Only the token count of the conversation is kept.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::lock;

/// Bound on stored responses; the oldest are forgotten first.
const MAX_STORED: usize = 10_000;

#[derive(Debug, Default)]
pub struct Store {
    inner: Mutex<(HashMap<String, u64>, VecDeque<String>)>,
}

impl Store {
    /// Tokens of the conversation stored under `id` (its input and output).
    pub fn conversation(&self, id: &str) -> Option<u64> {
        lock(&self.inner).0.get(id).copied()
    }

    pub fn put(&self, id: String, tokens: u64) {
        let mut g = lock(&self.inner);
        let (map, order) = &mut *g;
        if map.insert(id.clone(), tokens).is_none() {
            order.push_back(id);
        }
        while order.len() > MAX_STORED {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    pub fn clear(&self) {
        let mut g = lock(&self.inner);
        g.0.clear();
        g.1.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_bounded_set() {
        let s = Store::default();
        s.put("a".into(), 5);
        assert_eq!(s.conversation("a"), Some(5));
        for i in 0..MAX_STORED {
            s.put(format!("r{i}"), 1);
        }
        assert_eq!(s.conversation("a"), None, "the oldest is forgotten");
        assert_eq!(s.conversation("r9"), Some(1));
        s.clear();
        assert_eq!(s.conversation("r9"), None);
    }
}
