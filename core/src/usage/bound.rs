//! The most input tokens a server can charge for a request: what a hard
//! budget reserves (docs/src/design.md, "Bounded, not guessed").
//!
//! The estimate (`estimate.rs`) guesses a request's tokens and is right on
//! average; a hard budget needs a figure the server's count can never pass.
//! Byte-level BPE tokenizers (GPT-2's family: Llama 3, Qwen, SmolLM2,
//! cl100k/o200k) map every token to at least one byte of the text they
//! encode, so a text of `n` UTF-8 bytes is at most `n` tokens; SentencePiece
//! (Llama 2, Gemma, Mistral) may add one for the dummy prefix of a text,
//! hence one more per string. A token-id array is one token per id, and an
//! id is at least one byte of its JSON. What the body does not carry as
//! text is stated per model in the policy (`policy/bound.rs`): the
//! template's own tokens per message and once per request (a default
//! system prompt included), and what one image, audio clip or file may
//! cost. The model's context length caps the whole: no server charges
//! more input than it can hold.
//!
//! Which fields a server feeds the model is one table per API
//! ([`fields`]): each is counted here, or refused where its cost cannot be
//! bounded (the Responses API's `background`). A field not in an API's
//! table is not read by its servers as input.

use crate::policy::bound::InputBound;
use crate::usage::shared::Api;
use crate::usage::view::{Kind, View};

/// What one field of a body feeds the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feeds {
    /// Input the server renders: every string's bytes, every id of a
    /// token array, the keys of what it renders as JSON (tools, schemas,
    /// tool calls), media parts at the model's figure.
    Input,
    /// A list whose every item is one image (Ollama's `images`: base64).
    Media,
    /// Output the server bills beyond the output limit: OpenAI's
    /// `prediction` (rejected predicted tokens are billed as completion
    /// tokens, platform.openai.com/docs/guides/predicted-outputs).
    Output,
    /// Work the server goes on with after it answers (the Responses API's
    /// `background`): its cost is not in the answer, so it is refused
    /// unless the policy allows it, and then charged whole.
    Background,
}

/// A field of a body and what it feeds the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub feeds: Feeds,
}

const fn f(name: &'static str, feeds: Feeds) -> Field {
    Field { name, feeds }
}

use Feeds::{Background, Input, Media, Output};

/// OpenAI's chat, as OpenAI, vLLM and llama.cpp read it: the messages
/// rendered by the template with the tools (vLLM
/// `entrypoints/openai/serving_chat.py` renders `tools` into the prompt,
/// llama.cpp `tools/server/utils.hpp` `oaicompat_chat_params_parse` too);
/// `response_format` / `guided_json` constrain decoding but OpenAI also
/// injects the schema as input tokens.
const CHAT: &[Field] = &[
    f("messages", Input),
    f("tools", Input),
    f("functions", Input),
    f("response_format", Input),
    f("prediction", Output),
];
/// Legacy completions: the prompt (text, token ids, or lists of either),
/// the suffix (fill-in-the-middle), vLLM's `prompt_embeds` (base64
/// tensors: their bytes bound the positions they fill).
const COMPLETIONS: &[Field] = &[
    f("prompt", Input),
    f("suffix", Input),
    f("prompt_embeds", Input),
];
/// The Responses API: input items, instructions, tools, the text format's
/// schema; `background` answers before the work is done.
const RESPONSES: &[Field] = &[
    f("input", Input),
    f("instructions", Input),
    f("tools", Input),
    f("text", Input),
    f("background", Background),
];
/// Ollama's generate (ollama/ollama `server/routes.go` GenerateHandler):
/// the prompt rendered through `template` (the request's own template
/// replaces the model's, and its text is rendered with the prompt) with
/// `system` and `suffix`; `context` is token ids of an earlier exchange,
/// prepended as they are; `images` go to the vision encoder; `raw` skips
/// the template (fewer tokens, never more).
const OLLAMA_GENERATE: &[Field] = &[
    f("prompt", Input),
    f("system", Input),
    f("suffix", Input),
    f("template", Input),
    f("context", Input),
    f("images", Media),
    f("format", Input),
];
/// Ollama's chat: messages (each with its own `images`), tools, format.
const OLLAMA_CHAT: &[Field] = &[f("messages", Input), f("tools", Input), f("format", Input)];
const EMBED: &[Field] = &[f("input", Input), f("prompt", Input)];
/// Anthropic's Messages API: the system prompt, messages, tools.
const MESSAGES: &[Field] = &[f("system", Input), f("messages", Input), f("tools", Input)];
const SCORING: &[Field] = &[
    f("text_1", Input),
    f("text_2", Input),
    f("query", Input),
    f("documents", Input),
    f("input", Input),
    f("prompt", Input),
    f("messages", Input),
];

/// Every field of `api`'s bodies that its servers feed the model or that
/// changes what they charge. A declared API reads its own pointers (its
/// whole body bounds it, see [`declared_bound`]).
pub fn fields(api: Api) -> &'static [Field] {
    match api {
        Api::OpenAiChat => CHAT,
        Api::OpenAiCompletions => COMPLETIONS,
        Api::OpenAiResponses => RESPONSES,
        Api::OllamaGenerate => OLLAMA_GENERATE,
        Api::OllamaChat => OLLAMA_CHAT,
        Api::OpenAiEmbeddings | Api::OllamaEmbed => EMBED,
        Api::AnthropicMessages => MESSAGES,
        Api::Scoring => SCORING,
        Api::Invocations | Api::Passthrough(_) | Api::Declared(_) | Api::Other => &[],
    }
}

/// What a body feeds its server, counted so the model's figures can turn
/// it into a bound: independent of the model, so a downshift or a rung is
/// bounded at its own figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rendered {
    /// Bytes of every text (and one per string), ids of token arrays, and
    /// keys of what is rendered as JSON.
    pub bytes: u64,
    /// Messages, each wrapped by the template.
    pub messages: u64,
    /// Image, audio, file and video parts.
    pub media: u64,
    /// The most output billed beyond the output limit (a prediction).
    pub extra_output: u64,
    /// Nothing goes to a server (a cache hit that costs no tokens): the
    /// bound is 0, the template's figures included.
    pub free: bool,
}

impl Rendered {
    /// The input bound at a model's figures: the text, the template's
    /// tokens, the media, capped at the context length.
    pub fn tokens(&self, figures: &InputBound, context_length: Option<u64>) -> u64 {
        if self.free {
            return 0;
        }
        let bound = figures
            .fixed
            .saturating_add(figures.per_message.saturating_mul(self.messages))
            .saturating_add(self.bytes)
            .saturating_add(figures.media_tokens.saturating_mul(self.media));
        // Input past the context is refused or cut by the server, never
        // charged. (Not `context - output`: a server that stops early
        // charges less output, so only the whole context bounds the input.)
        context_length.map_or(bound, |c| bound.min(c))
    }
}

/// What `body` of `api` feeds the server, by the API's table.
pub fn rendered<'a>(api: Api, body: impl View<'a>) -> Rendered {
    let mut r = Rendered::default();
    if !body.is_object() {
        return r;
    }
    let table = fields(api);
    for (key, v) in body.members() {
        let Some(field) = table.iter().find(|f| f.name == key.as_ref()) else {
            continue;
        };
        match field.feeds {
            Feeds::Input => {
                if field.name == "messages" && v.is_array() {
                    r.messages = r.messages.saturating_add(v.items().count() as u64);
                }
                walk(v, &mut r);
            }
            Feeds::Media => r.media = r.media.saturating_add(items(v)),
            Feeds::Output => {
                let mut out = Rendered::default();
                walk(v.get("content").unwrap_or(v), &mut out);
                r.extra_output = r.extra_output.saturating_add(out.bytes);
            }
            Feeds::Background => {}
        }
    }
    // A text processed once per item of another field is bounded as often.
    for (text, again) in crate::usage::estimate::paired(api, body) {
        let mut once = Rendered::default();
        walk(text, &mut once);
        r.bytes = r.bytes.saturating_add(once.bytes.saturating_mul(again));
    }
    r
}

/// Does `body` ask the server to go on working after it answers (a field
/// of its API's table that feeds `Background`, set to `true`)?
pub fn in_background<'a>(api: Api, body: impl View<'a>) -> bool {
    fields(api)
        .iter()
        .filter(|f| f.feeds == Feeds::Background)
        .any(|f| body.get(f.name).and_then(View::bool) == Some(true))
}

/// A declared API's bound: its whole body's bytes (every text it carries
/// is in them, escaped no shorter), one message.
pub fn declared_bound(raw: &[u8]) -> Rendered {
    Rendered {
        bytes: raw.len() as u64,
        messages: 1,
        ..Rendered::default()
    }
}

fn items<'a>(v: impl View<'a>) -> u64 {
    match v.kind() {
        Kind::Array => v.items().count() as u64,
        Kind::Null => 0,
        _ => 1,
    }
}

/// The parts that are not text: `{"type":"image_url"}` (OpenAI chat),
/// `input_image` / `input_file` / `input_audio` (Responses), `image` and
/// `document` (Anthropic), `file`, `audio`, `video_url` (vLLM's multimodal
/// chat, `entrypoints/chat_utils.py`).
const MEDIA_TYPES: &[&str] = &[
    "image_url",
    "input_image",
    "image",
    "input_audio",
    "audio",
    "audio_url",
    "file",
    "input_file",
    "document",
    "video_url",
    "video",
];

/// Keys whose presence makes a part without a `type` a media part.
const MEDIA_KEYS: &[&str] = &["image_url", "input_audio", "file", "video_url", "audio_url"];

/// Adds what `v` feeds the server to `r`: see [`Rendered`].
fn walk<'a>(v: impl View<'a>, r: &mut Rendered) {
    match v.kind() {
        Kind::Null => {}
        Kind::String => {
            let len = v.str().map_or(0, |s| s.len() as u64);
            r.bytes = r.bytes.saturating_add(len + 1);
        }
        Kind::Array => v.items().for_each(|item| walk(item, r)),
        Kind::Object => {
            // One pass over the members: their bytes, unless a `type` (or,
            // without one, a payload key) says the part is media.
            let mut inner = Rendered::default();
            let (mut typed, mut media) = (false, false);
            for (key, x) in v.members() {
                match key.as_ref() {
                    "type" => {
                        typed = true;
                        media = x.str().is_some_and(|t| MEDIA_TYPES.contains(&t.as_ref()));
                    }
                    // Ollama's chat messages carry their images as base64.
                    "images" => {
                        inner.media = inner.media.saturating_add(items(x));
                        continue;
                    }
                    k if !typed && MEDIA_KEYS.contains(&k) => media = true,
                    _ => {}
                }
                inner.bytes = inner.bytes.saturating_add(key.len() as u64);
                walk(x, &mut inner);
            }
            if media {
                r.media = r.media.saturating_add(1);
            } else {
                r.bytes = r.bytes.saturating_add(inner.bytes);
                r.media = r.media.saturating_add(inner.media);
            }
        }
        // A number or a boolean as its text: a token id is one token, and
        // at least one byte.
        _ => r.bytes = r.bytes.saturating_add(v.compact().len() as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::bound::{FIXED, MEDIA, PER_MESSAGE};
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn bound(api: Api, body: Value) -> u64 {
        rendered(api, &body).tokens(&InputBound::default(), None)
    }

    #[test]
    fn a_chat_is_its_text_bytes_and_the_template() {
        let body = json!({"model": "m", "max_tokens": 9,
            "messages": [{"role": "user", "content": "ciao mondo"}]});
        // "role" + "user"+1 + "content" + "ciao mondo"+1
        let text = 4 + 5 + 7 + 11;
        assert_eq!(bound(Api::OpenAiChat, body), FIXED + PER_MESSAGE + text);
    }

    #[test]
    fn ollama_fields_the_estimate_missed_are_counted() {
        let template = format!("{}{{{{ .Prompt }}}}", "x".repeat(26_000));
        let body = json!({"model": "m", "prompt": "hi", "template": template,
            "context": [1, 22, 333], "images": ["aGk=", "aGk="], "system": "be"});
        let r = rendered(Api::OllamaGenerate, &body);
        assert_eq!(r.media, 2);
        assert!(r.bytes >= 26_000 + 3 + 3, "{r:?}");
        assert_eq!(
            r.tokens(&InputBound::default(), None),
            FIXED + r.bytes + 2 * MEDIA
        );
    }

    #[test]
    fn media_parts_cost_the_model_figure_not_their_bytes() {
        let data = format!("data:image/png;base64,{}", "A".repeat(100_000));
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it"},
            {"type": "image_url", "image_url": {"url": data}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        ]}, {"role": "user", "content": "x", "images": ["AAAA"]}]});
        let r = rendered(Api::OpenAiChat, &body);
        assert_eq!(r.media, 3);
        assert!(r.bytes < 200, "{r:?}");
        let figures = InputBound {
            media_tokens: 1_000,
            ..InputBound::default()
        };
        assert_eq!(
            r.tokens(&figures, None),
            FIXED + 2 * PER_MESSAGE + r.bytes + 3_000
        );
    }

    #[test]
    fn the_context_length_caps_the_bound() {
        let body = json!({"prompt": "a ".repeat(10_000)});
        let r = rendered(Api::OpenAiCompletions, &body);
        assert_eq!(r.tokens(&InputBound::default(), Some(4096)), 4096);
    }

    #[test]
    fn a_prediction_is_output_and_background_is_not_input() {
        let body = json!({"messages": [], "prediction": {"type": "content", "content": "abcdef"}});
        assert_eq!(rendered(Api::OpenAiChat, &body).extra_output, 7);
        let body = json!({"input": "hi", "background": true});
        assert_eq!(rendered(Api::OpenAiResponses, &body).bytes, 3);
    }

    #[test]
    fn a_paired_text_is_bounded_once_per_pair() {
        let body = json!({"query": "abc", "documents": ["d", "e", "f"]});
        // query 4 ×3, the documents 2 each.
        assert_eq!(rendered(Api::Scoring, &body).bytes, 4 * 3 + 2 * 3);
    }

    #[test]
    fn fields_outside_the_table_are_not_read() {
        let body = json!({"model": "a-long-model-name", "temperature": 0.5, "user": "someone"});
        assert_eq!(rendered(Api::OpenAiChat, &body), Rendered::default());
    }

    proptest! {
        /// The bound is never below the bytes of any text a chat carries
        /// (the most a byte-level BPE tokenizer can make of them).
        #[test]
        fn the_bound_covers_every_byte_of_text(
            texts in prop::collection::vec(".{0,60}", 1..8),
        ) {
            let messages: Vec<Value> = texts.iter()
                .map(|t| json!({"role": "user", "content": t})).collect();
            let body = json!({"messages": messages});
            let total: u64 = texts.iter().map(|t| t.len() as u64).sum();
            let b = bound(Api::OpenAiChat, body);
            prop_assert!(b >= total + FIXED + PER_MESSAGE * texts.len() as u64);
        }

        /// The bound of a token-id prompt is at least its ids.
        #[test]
        fn token_ids_count_one_each(ids in prop::collection::vec(0u32..200_000, 0..300)) {
            let body = json!({"prompt": ids});
            prop_assert!(rendered(Api::OpenAiCompletions, &body).bytes >= ids.len() as u64);
        }
    }
}
