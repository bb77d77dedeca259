//! Where a stream is, and what exists there: each phase holds the state
//! that means something only while the stream is in it (what a stream
//! keeps for its whole life is on `Stream`).

use crate::admission::route::Pushback;
use crate::admission::{Plan, Verdict};
use crate::host::Host;
use crate::usage::reconcile::ResponseMeter;

use super::{cache, waiting};

/// A stream's phase, each holding what exists in it. `Undecided` →
/// (`LookingUp` → `Undecided`)? → (`Parked` ⇄ `Undecided`)* →
/// (`Fleet`)? → `Answered` or `Upstream`.
/// One per stream, moved rarely: the upstream phase's meter (with the
/// usage details it reads) is kept inline rather than boxed.
#[allow(clippy::large_enum_variant)]
pub(super) enum Phase {
    /// Its headers and body are being read, or it is between two tries
    /// of the gate: nothing is decided.
    Undecided,
    /// Paused for the sidecar's answer to its cache lookup.
    LookingUp(cache::Wait),
    /// Queued for the model's gate, or asleep until its buckets free up
    /// (its `gate` says which), with what it needs to be decided again.
    Parked(waiting::Parked),
    /// Admitted here and paused for the fleet.
    Fleet(Box<FleetWait>),
    /// Answered here (a refusal, a static answer, a cache hit).
    Answered,
    /// Let through to the upstream.
    Upstream(Upstream),
}

/// A request admitted here, paused until the fleet's answer decides it.
pub(super) struct FleetWait {
    pub(super) pending: crate::fleet::Pending,
    pub(super) verdict: Verdict,
    /// Sent to the primary: what its answer will feed.
    pub(super) watch: Option<Watch>,
    /// A cache hit admitted here: its reply, kept until the fleet admits it.
    pub(super) hit: Option<cache::HeldHit>,
}

/// A request sent on to the primary upstream (not the fallback): its
/// answer feeds the route's pause and error breaker.
pub(super) struct Watch {
    /// The route's pushback state as the request found it.
    pub(super) pushback: Pushback,
    /// The route's half-open probe this request holds (its lease).
    pub(super) probe_lease: Option<u64>,
}

/// What a request let through to the upstream carries until its log.
pub(super) struct Upstream {
    /// Tier and model labels of the decision, for later metrics.
    pub(super) labels: (String, String),
    /// Added to the upstream's response headers (rate limits, degraded).
    pub(super) response_headers: crate::host::Headers,
    /// What admission reserved, until it is settled.
    pub(super) plan: Option<Plan>,
    /// Sent to the primary: read once its answer's headers come.
    pub(super) watch: Option<Watch>,
    /// What the fleet buckets hold for this request, until settled.
    pub(super) fleet_claims: Vec<crate::fleet::Claimed>,
    /// Reads the response as it passes (a request with a plan).
    pub(super) meter: Option<ResponseMeter>,
    /// Whether its first response byte left.
    pub(super) first_byte: bool,
    /// The clock of the response callback running now (one read per
    /// event: its first byte, its settlement), and when the response
    /// ended (the log's end-to-end latency reads it, not the clock again).
    pub(super) event_ms: Option<u64>,
    pub(super) ended_ms: Option<u64>,
    /// The stream was reset after its cut (see `Request::on_response_body`).
    pub(super) reset: bool,
    /// The primary's watch after a good status, recorded when the answer
    /// ends: a stream its upstream breaks after that is a failure.
    pub(super) late: Option<Watch>,
}

impl Upstream {
    /// The clock of this event: read once, whatever asks for it.
    pub(super) fn event_now(&mut self, host: &dyn Host) -> u64 {
        *self.event_ms.get_or_insert_with(|| host.now_ms())
    }
}
