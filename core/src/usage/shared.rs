//! What the files of `usage/` share: the API a body speaks and the fields
//! that multiply its work, the answer to a body sluice cannot accept, the
//! bounds on reading a body's JSON, and the usage an answer reports.
//!
//! A leaf of the folder: it imports nothing of `usage/` but [`super::view`]
//! (itself a leaf), so the readers of a body (`demand`, `output_limit`,
//! `spelling`, `estimate`, `tape`) and of an answer (`declared`,
//! `reconcile`) share these without importing each other (no import cycle
//! inside the folder: `tests/tests/layers.rs`). `demand` and `reconcile`
//! re-export the items other crates name by their old path
//! (`usage::demand::Api`, `usage::reconcile::{Found, Usage}`).

use super::view::View;
use crate::policy::models::Naming;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    OpenAiChat,
    OpenAiCompletions,
    OpenAiEmbeddings,
    OpenAiResponses,
    OllamaGenerate,
    OllamaChat,
    /// Ollama's `/api/embed` and `/api/embeddings`.
    OllamaEmbed,
    /// Anthropic's Messages API (`/v1/messages`), which vLLM serves too.
    AnthropicMessages,
    /// The scoring / pooling family (`/v1/score`, `/rerank`, `/pooling`,
    /// `/classify`, `/tokenize`, …): input-only work.
    Scoring,
    /// vLLM's (SageMaker's) `/invocations`: chat, completion or embedding
    /// by the body's shape, resolved by `demand::parse_body`.
    Invocations,
    /// Not an LLM API sluice reads, let through by the policy's
    /// `passthrough` rule of this index: only request limits apply.
    Passthrough(u16),
    /// An application's own API, the policy's `apis` entry of this index
    /// (`usage/declared.rs`): read at its pointers, reserved, settled.
    Declared(u16),
    /// Anything else: no body is read, only the request buckets apply; with
    /// a body (or as a POST), refused unless a `passthrough` rule opens it.
    Other,
}

/// The LLM APIs by canonical path. Matched as a suffix (see
/// [`Api::of_path`]), so `/score` also covers `/v1/score`, `/rerank`
/// covers `/v1/rerank` and `/v2/rerank`.
const ROUTES: [(&str, Api); 16] = [
    ("/v1/chat/completions", Api::OpenAiChat),
    ("/v1/completions", Api::OpenAiCompletions),
    ("/v1/embeddings", Api::OpenAiEmbeddings),
    ("/v1/responses", Api::OpenAiResponses),
    ("/api/generate", Api::OllamaGenerate),
    ("/api/chat", Api::OllamaChat),
    ("/api/embed", Api::OllamaEmbed),
    ("/api/embeddings", Api::OllamaEmbed),
    ("/v1/messages", Api::AnthropicMessages),
    ("/invocations", Api::Invocations),
    ("/score", Api::Scoring),
    ("/rerank", Api::Scoring),
    ("/pooling", Api::Scoring),
    ("/classify", Api::Scoring),
    ("/tokenize", Api::Scoring),
    ("/detokenize", Api::Scoring),
];

/// What one field of a body multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Multiplies {
    /// Completions generated per prompt (`n`, `best_of`): an integer from 1
    /// to the row's maximum; the largest such field counts.
    Choices,
    /// Prompts, each answered on its own with its own choices: a string or
    /// a flat token-id array is one prompt, an array of strings or of
    /// token-id arrays is one per item. Prompts of all such fields add up.
    Prompts,
    /// Inputs processed each on its own, none producing output
    /// (embeddings, documents to score): a string is one, an array one per
    /// item. Their text is all counted as input already; the count is
    /// bounded.
    Inputs,
    /// A text processed once per item of the named field (a cross-encoder
    /// scores the query with every document): its input counts that often.
    PairedWith(&'static str),
}

/// A field of a request body that multiplies the upstream's work, and the
/// most it may say (more is a 400 naming the field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Multiplier {
    pub field: &'static str,
    pub multiplies: Multiplies,
    pub max: u64,
}

const fn row(field: &'static str, multiplies: Multiplies, max: u64) -> Multiplier {
    Multiplier {
        field,
        multiplies,
        max,
    }
}

/// The most completions one request may ask for (OpenAI's own cap on `n`).
pub const MAX_CHOICES: u64 = 128;
/// The most prompts or inputs one request may carry (OpenAI's cap on an
/// embeddings batch).
pub const MAX_PROMPTS: u64 = 2048;
/// The most completions (prompts × choices) one request may ask for.
pub const MAX_COMPLETIONS: u64 = 4096;

/// Every multiplier of work, one table per API: the next one is a row.
const CHAT: &[Multiplier] = &[
    row("n", Multiplies::Choices, MAX_CHOICES),
    // vLLM's chat accepts `best_of` as an extra sampling parameter.
    row("best_of", Multiplies::Choices, MAX_CHOICES),
];
const COMPLETIONS: &[Multiplier] = &[
    row("n", Multiplies::Choices, MAX_CHOICES),
    // `best_of` generates that many and returns `n` of them.
    row("best_of", Multiplies::Choices, MAX_CHOICES),
    row("prompt", Multiplies::Prompts, MAX_PROMPTS),
    // vLLM: prompts given as embeddings (base64 tensors), answered after
    // the text prompts.
    row("prompt_embeds", Multiplies::Prompts, MAX_PROMPTS),
];
const EMBEDDINGS: &[Multiplier] = &[row("input", Multiplies::Inputs, MAX_PROMPTS)];
const SCORING: &[Multiplier] = &[
    // vLLM `/score`: `text_1` against each of `text_2`.
    row("text_1", Multiplies::PairedWith("text_2"), MAX_PROMPTS),
    row("text_2", Multiplies::Inputs, MAX_PROMPTS),
    // `/rerank`: the query against each document.
    row("query", Multiplies::PairedWith("documents"), MAX_PROMPTS),
    row("documents", Multiplies::Inputs, MAX_PROMPTS),
    // `/pooling`, `/classify`, `/tokenize`.
    row("input", Multiplies::Inputs, MAX_PROMPTS),
    row("prompt", Multiplies::Inputs, MAX_PROMPTS),
];
const NONE: &[Multiplier] = &[];

impl Api {
    /// The API a canonical path names, whatever the method (a body on any
    /// method is read: a lenient server may serve it).
    pub fn of_path(canonical: &str) -> Api {
        // Also under a prefix (`/openai/v1/chat/completions`): a route that
        // rewrites the prefix away runs after sluice, in Envoy's router.
        ROUTES
            .iter()
            .find(|(route, _)| canonical.ends_with(route))
            .map_or(Api::Other, |(_, api)| *api)
    }

    pub fn reads_body(self) -> bool {
        !matches!(self, Api::Other | Api::Passthrough(_))
    }

    /// How this API's servers match the model a request names: Ollama's
    /// own endpoints by Ollama's rules; every other API (vLLM, OpenAI,
    /// Anthropic, an application's own) as written.
    pub fn naming(self) -> Naming {
        match self {
            Api::OllamaGenerate | Api::OllamaChat | Api::OllamaEmbed => Naming::Ollama,
            _ => Naming::Exact,
        }
    }

    /// Does the upstream generate output for this API (else output is 0)?
    pub fn produces_output(self) -> bool {
        matches!(
            self,
            Api::OpenAiChat
                | Api::OpenAiCompletions
                | Api::OpenAiResponses
                | Api::OllamaGenerate
                | Api::OllamaChat
                | Api::AnthropicMessages
                | Api::Declared(_)
        )
    }

    /// Every field of this API's bodies that multiplies work.
    pub fn multipliers(self) -> &'static [Multiplier] {
        match self {
            Api::OpenAiChat => CHAT,
            Api::OpenAiCompletions => COMPLETIONS,
            Api::OpenAiEmbeddings | Api::OllamaEmbed => EMBEDDINGS,
            Api::Scoring => SCORING,
            // One prompt, one answer: no multiplier (yet).
            Api::OpenAiResponses
            | Api::OllamaGenerate
            | Api::OllamaChat
            | Api::AnthropicMessages
            | Api::Invocations
            | Api::Passthrough(_)
            | Api::Declared(_)
            | Api::Other => NONE,
        }
    }

    pub fn is_ollama(self) -> bool {
        matches!(self, Api::OllamaGenerate | Api::OllamaChat)
    }

    /// Whether a request of this API streams, by its `stream` field:
    /// Ollama streams unless told `stream: false`, the others only when
    /// told `stream: true`.
    pub fn streams<'a>(self, body: impl View<'a>) -> bool {
        match body.get("stream").and_then(View::bool) {
            Some(b) => b,
            None => self.is_ollama(),
        }
    }
}

/// A body sluice cannot accept: the message and the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBody {
    pub message: String,
    pub param: Option<String>,
}

impl BadBody {
    pub(crate) fn at(param: &str, message: impl Into<String>) -> BadBody {
        BadBody {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }
}

/// Bounds on what reading one body may cost (issue 18 item 3). Above any
/// real request: OpenAI takes at most 2,048 embedding inputs of at most
/// 8,192 token ids each (300,000 tokens in all); a 128k-token prompt sent
/// as ids is 131,072 items. Depth, items and containers are checked by
/// [`scan_bounds`](super::demand::scan_bounds) before anything is parsed;
/// values as they are parsed. Nesting deeper than this (objects and
/// arrays) is refused.
pub const MAX_JSON_DEPTH: u32 = 64;
/// Items of one array.
pub const MAX_ARRAY_ITEMS: u32 = 1 << 17;
/// Arrays and objects in one body: each is an allocation in the parse.
pub const MAX_JSON_CONTAINERS: u32 = 1 << 16;
/// JSON values (each string, number, array, object…) in one body: the
/// work of the parse and of the estimate that walks it.
pub const MAX_JSON_VALUES: u32 = 1 << 19;

/// Counts above this are not believed (a misbehaving upstream, not a model).
pub(crate) const MAX_BELIEVABLE: u64 = 100_000_000;

/// Usage reported by the upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
}

/// What a JSON object says about usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// No usage fields at all.
    Nothing,
    /// Usage fields that are not sane counts (strings, negative, enormous).
    Invalid,
    Usage(Usage),
}
