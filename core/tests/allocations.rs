//! Heap allocations per request, for the three shapes of
//! `tests/hostcalls.rs` (bench/run.py's (c) GET, (c) POST 2 KB, (d) POST
//! 2 KB with the full policy): a counting global allocator, counting only
//! while the filter's callbacks run (not while the harness builds the
//! request or the mock's answer).
//!
//! An allocation is the commonest cost of the wasm path that a host-call
//! count does not see (and in the VM it is dlmalloc's, slower than the
//! native one), so the count is held here as the host calls are in
//! `hostcalls.rs`. The count includes the mock host's answers (an owned
//! `String` per header read, as the proxy-wasm SDK returns in Envoy too)
//! and the whole request body's copy. Print the table:
//! `cargo test -p sluice-core --release --test allocations -- --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use sluice_core::bench::MockHost;

#[path = "../benches/shapes/mod.rs"]
mod shapes;
use shapes::{chat_body, one_request, one_request_watched, Shape, T0};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static WATCHING: Cell<bool> = const { Cell::new(false) };
}

fn watching() -> bool {
    WATCHING.try_with(Cell::get).unwrap_or(false)
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters are atomics and the flag a thread-local `Cell` (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if watching() {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        }
        // SAFETY: forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if watching() {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        }
        // SAFETY: forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations and bytes of one request of `shape`, after warm-up (per-VM
/// caches and the mock's call-count map are filled once).
fn per_request(shape: Shape) -> (u64, u64) {
    let host = MockHost::new(T0);
    let poller = shape.load(&host);
    let body = chat_body();
    for _ in 0..3 {
        one_request(&poller, &host, shape, &body);
        host.advance(1);
    }
    const N: u64 = 10;
    let (a0, b0) = (
        ALLOCATIONS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    for _ in 0..N {
        let mut watch = |on: bool| WATCHING.with(|w| w.set(on));
        one_request_watched(&poller, &host, shape, &body, &mut watch);
        host.advance(1);
    }
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - a0;
    let bytes = BYTES.load(Ordering::Relaxed) - b0;
    (allocations.div_ceil(N), bytes.div_ceil(N))
}

#[test]
fn allocations_per_request_stay_within_their_budget() {
    println!("\nHeap allocations per request (after warm-up):\n");
    println!("| shape | allocations | bytes |\n|---|---:|---:|");
    for shape in Shape::ALL {
        let (allocations, bytes) = per_request(shape);
        println!("| {} | {allocations} | {bytes} |", shape.label());
        // Measured (docs/src/benchmark-history.md, "Second design: the
        // goal's own baseline, and what was still copied"), with a
        // little room, so a new allocation on the path is a decision:
        // 55 / 72 / 128 with this harness (the mock's own copies
        // included: the header snapshot is two, where Envoy's is three
        // with the host's buffer); 69 / 87 / 153 before the identity and
        // path were shared, a fair-shares take stopped copying its
        // record and a record kept the value it was read from, 124 / 157 / 285 at the first levers, 129 / 162
        // / 314 on main when issue 31 was filed (ff33c4f, measured again
        // with its own harness). A GET's bound stays under the issue's
        // goal (half of 129).
        let bound = match shape {
            Shape::HeaderGet => 58,
            Shape::HeaderPost => 76,
            Shape::FullPost => 134,
        };
        assert!(
            allocations <= bound,
            "{}: {allocations} allocations per request, over its budget of {bound}",
            shape.label()
        );
    }
}
