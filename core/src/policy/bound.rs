//! `models.<name>.input_bound`: the figures a hard budget's reservation
//! needs to bound a request's input beside its text (see `usage/bound.rs`
//! for how they are used): the chat template's own tokens and what one
//! image (or audio clip, or file) may cost. The model's `context_length`
//! caps the bound.

use serde::Deserialize;

/// Template tokens per message when the policy states none. Chat templates
/// wrap each message in a few special tokens and the role: ChatML
/// (`<|im_start|>role\n…<|im_end|>\n`) adds 4 beside the role's own text,
/// Llama 3 (`<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>`) 4,
/// Gemma and Mistral fewer. The role's text is counted as text already.
pub const PER_MESSAGE: u64 = 8;

/// Template tokens of a request however many messages it has, when the
/// policy states none: a begin-of-sequence token, the generation prompt
/// (`<|im_start|>assistant\n`, 3) and a default system prompt the template
/// injects when the request has none (SmolLM2's "You are a helpful AI
/// assistant named SmolLM, trained by Hugging Face" is 17 tokens with its
/// framing; Qwen2.5's about 20; Llama 3.1's date preamble about 25). A
/// template that injects more (tool instructions, a long persona) needs its
/// own figure.
pub const FIXED: u64 = 32;

/// What one image, audio clip, file or video part may cost when the
/// policy states none: Qwen2-VL's default `max_pixels` gives an image up to
/// 16,384 tokens (OpenAI's high detail stays under 1,600, Anthropic's about
/// 1,600), so a model that takes such input on a small hard budget should
/// state its own figure.
pub const MEDIA: u64 = 16_384;

/// What a model's server may add to the text a request carries.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct InputBound {
    /// The template's own tokens per message (default 8).
    #[serde(default = "per_message")]
    pub per_message: u64,
    /// The template's tokens once per request, a default system prompt
    /// included (default 32).
    #[serde(default = "fixed")]
    pub fixed: u64,
    /// The most one image, audio clip, file or video part may cost
    /// (default 16,384).
    #[serde(default = "media")]
    pub media_tokens: u64,
}

fn per_message() -> u64 {
    PER_MESSAGE
}
fn fixed() -> u64 {
    FIXED
}
fn media() -> u64 {
    MEDIA
}

impl Default for InputBound {
    fn default() -> Self {
        InputBound {
            per_message: PER_MESSAGE,
            fixed: FIXED,
            media_tokens: MEDIA,
        }
    }
}
