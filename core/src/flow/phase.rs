//! Where a stream is, and what exists there: each phase holds the state
//! that means something only while the stream is in it.

use crate::admission::{Plan, Verdict};
use crate::usage::reconcile::ResponseMeter;

use super::waiting;

/// A stream's phase, each holding what exists in it. `Undecided` →
/// (`Parked` ⇄ `Undecided`)* → (`Fleet`)? → `Answered` or `Upstream`.
/// One per stream, moved rarely: the upstream phase's meter (with the
/// usage details it reads) is kept inline rather than boxed.
#[allow(clippy::large_enum_variant)]
pub(super) enum Phase {
    /// Its headers and body are being read, or it is between two tries
    /// of the gate: nothing is decided.
    Undecided,
    /// Queued for the model's gate, or asleep until its buckets free up
    /// (its `gate` says which), with what it needs to be decided again.
    Parked(waiting::Parked),
    /// Admitted and paused for the fleet: the sidecar's answer decides
    /// this verdict.
    Fleet {
        pending: crate::fleet::Pending,
        verdict: Box<Verdict>,
    },
    /// Answered here (a refusal, a static answer).
    Answered,
    /// Let through to the upstream.
    Upstream(Upstream),
}

/// What a request let through to the upstream carries until its log.
pub(super) struct Upstream {
    /// Tier and model labels of the decision, for later metrics.
    pub(super) labels: (String, String),
    /// Added to the upstream's response headers (rate limits, degraded).
    pub(super) response_headers: Vec<(String, String)>,
    /// What admission reserved, until it is settled.
    pub(super) plan: Option<Plan>,
    /// Reads the response as it passes (a request with a plan).
    pub(super) meter: Option<ResponseMeter>,
    /// Whether its first response byte left.
    pub(super) first_byte: bool,
}
