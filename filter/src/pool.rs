//! The VM's allocator: small blocks from per-size free lists.
//!
//! A request allocates ~55 (GET) to ~130 (full POST) small blocks and
//! frees them all by its end: strings, records, header snapshots, the
//! buffers the host hands over. The C library's general allocator
//! (wasi-libc's dlmalloc, behind Rust's `System` on wasm32-wasip1) splits,
//! coalesces and bins each of them. Here a block of up to
//! [`LARGEST`] bytes comes from the free list of its size class, and goes
//! back onto it when freed: a pop and a push. Classes are carved from
//! 64 KiB slabs taken from `System`; larger blocks, and any alignment
//! above 16, go to `System` as before.
//!
//! What this costs: a freed block stays in its class (the VM's memory
//! never shrinks anyway), so the pool holds at most what the busiest
//! moment of each class needed, plus the part of one slab not carved yet
//! and 16 bytes a slab (the link to the one before).
//!
//! The VM has one thread (wasm32-wasip1 has none to start, and this
//! module refuses to build with `atomics`), so the lists need no lock:
//! Envoy calls into a VM from its worker thread only, and never re-enters
//! an allocation (the host calls `proxy_on_memory_allocate` between the
//! module's calls, not inside `alloc`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
compile_error!("filter/src/pool.rs assumes one thread: build without `atomics`");

/// Block sizes, each a multiple of 16 (so every block is 16-aligned when
/// its slab is): fine steps where requests allocate most.
const CLASSES: [usize; 13] = [16, 32, 48, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024];
/// The largest block a class serves.
pub const LARGEST: usize = CLASSES[CLASSES.len() - 1];
/// Every block is aligned to this (and a request for more goes to `System`).
const ALIGN: usize = 16;
const SLAB: usize = 64 * 1024;

/// The class of each size in steps of 16 bytes: `CLASS_OF[(size + 15) / 16]`.
const CLASS_OF: [u8; LARGEST / ALIGN + 1] = {
    let mut table = [0u8; LARGEST / ALIGN + 1];
    let mut step = 0;
    let mut class = 0;
    while step < table.len() {
        while CLASSES[class] < step * ALIGN {
            class += 1;
        }
        table[step] = class as u8;
        step += 1;
    }
    table
};

/// The class of a block of `layout`, or `None` when `System` serves it.
#[inline(always)]
fn class_of(layout: Layout) -> Option<usize> {
    if layout.size() > LARGEST || layout.align() > ALIGN {
        return None;
    }
    Some(CLASS_OF[layout.size().div_ceil(ALIGN)] as usize)
}

struct Lists {
    /// The first free block of each class; each free block holds the next.
    free: [*mut u8; CLASSES.len()],
    /// Where the current slab's uncarved part starts and ends.
    next: *mut u8,
    end: *mut u8,
    /// The newest slab; each slab's first 16 bytes hold the one before.
    slabs: *mut u8,
}

/// The allocator (see the module's documentation).
pub struct Pool(UnsafeCell<Lists>);

// SAFETY: the pool is only ever used from one thread: the wasm VM has
// one (see the module's documentation; the `atomics` build is refused),
// and the native tests give each pool to one test thread.
unsafe impl Sync for Pool {}

impl Pool {
    pub const fn new() -> Pool {
        Pool(UnsafeCell::new(Lists {
            free: [ptr::null_mut(); CLASSES.len()],
            next: ptr::null_mut(),
            end: ptr::null_mut(),
            slabs: ptr::null_mut(),
        }))
    }

    /// A block of class `class`: the head of its list, else carved from
    /// the slab (a new one when the current is spent). Null when `System`
    /// has no slab to give.
    #[inline(always)]
    unsafe fn take(&self, class: usize) -> *mut u8 {
        let lists = &mut *self.0.get();
        let head = lists.free[class];
        if !head.is_null() {
            lists.free[class] = head.cast::<*mut u8>().read();
            return head;
        }
        let size = CLASSES[class];
        if (lists.end as usize) - (lists.next as usize) < size {
            // The rest of the old slab (under one block) is left unused.
            let slab = System.alloc(Layout::from_size_align_unchecked(SLAB, ALIGN));
            if slab.is_null() {
                return slab;
            }
            slab.cast::<*mut u8>().write(lists.slabs);
            lists.slabs = slab;
            lists.next = slab.add(ALIGN);
            lists.end = slab.add(SLAB);
        }
        let block = lists.next;
        lists.next = block.add(size);
        block
    }

    #[inline(always)]
    unsafe fn give(&self, block: *mut u8, class: usize) {
        let lists = &mut *self.0.get();
        block.cast::<*mut u8>().write(lists.free[class]);
        lists.free[class] = block;
    }
}

/// The slabs go back to `System` (the VM's pool is a static: it never
/// drops; a pool of the native tests does).
impl Drop for Pool {
    fn drop(&mut self) {
        let mut slab = self.0.get_mut().slabs;
        while !slab.is_null() {
            // SAFETY: each slab came from `System` with this layout and
            // holds the previous one's address in its first bytes.
            unsafe {
                let older = slab.cast::<*mut u8>().read();
                System.dealloc(slab, Layout::from_size_align_unchecked(SLAB, ALIGN));
                slab = older;
            }
        }
    }
}

impl Default for Pool {
    fn default() -> Self {
        Pool::new()
    }
}

// SAFETY: a block of class `c` is `CLASSES[c]` bytes (at least the
// layout's size), 16-aligned (slabs are, and classes are multiples of
// 16), and lent to one owner at a time: it is on no list while lent, and
// `dealloc` puts it back on the list of the class its layout names, the
// class it came from (the caller passes the layout it was allocated
// with). Blocks `System` serves go back to `System`.
unsafe impl GlobalAlloc for Pool {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match class_of(layout) {
            Some(class) => self.take(class),
            None => System.alloc(layout),
        }
    }

    #[inline]
    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        match class_of(layout) {
            Some(class) => self.give(block, class),
            None => System.dealloc(block, layout),
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match class_of(layout) {
            Some(class) => {
                let block = self.take(class);
                if !block.is_null() {
                    block.write_bytes(0, layout.size());
                }
                block
            }
            None => System.alloc_zeroed(layout),
        }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = Layout::from_size_align_unchecked(new_size, layout.align());
        match (class_of(layout), class_of(new)) {
            // Still fits its block.
            (Some(old), Some(class)) if old == class => block,
            (None, None) => System.realloc(block, layout, new_size),
            _ => {
                let moved = self.alloc(new);
                if !moved.is_null() {
                    ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                    self.dealloc(block, layout);
                }
                moved
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_size_has_the_smallest_class_that_holds_it() {
        for size in 1..=LARGEST {
            let layout = Layout::from_size_align(size, 1).unwrap();
            let class = class_of(layout).unwrap();
            assert!(CLASSES[class] >= size, "{size} in {}", CLASSES[class]);
            assert!(class == 0 || CLASSES[class - 1] < size, "{size}");
        }
        assert_eq!(
            class_of(Layout::from_size_align(LARGEST + 1, 1).unwrap()),
            None
        );
        assert_eq!(class_of(Layout::from_size_align(64, 32).unwrap()), None);
        assert!(CLASSES.iter().all(|c| c % ALIGN == 0));
    }

    /// One block as the test holds it: where, its layout, the byte it is
    /// filled with.
    struct Held {
        at: *mut u8,
        layout: Layout,
        fill: u8,
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc {
            size: usize,
            align: usize,
            zeroed: bool,
        },
        Free(usize),
        Realloc(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Sizes around every class's edges and past the largest.
        let size = prop_oneof![1usize..=LARGEST + 64, 1usize..=4096];
        let align = prop_oneof![Just(1usize), Just(8), Just(16), Just(32)];
        prop_oneof![
            (size.clone(), align, any::<bool>()).prop_map(|(size, align, zeroed)| Op::Alloc {
                size,
                align,
                zeroed
            }),
            any::<usize>().prop_map(Op::Free),
            (any::<usize>(), size).prop_map(|(i, s)| Op::Realloc(i, s)),
        ]
    }

    proptest! {
        /// Any sequence of allocations, frees and reallocations: every block
        /// is aligned, keeps its bytes (a reallocation the common prefix),
        /// and no two live blocks overlap.
        #[test]
        fn blocks_are_aligned_disjoint_and_keep_their_bytes(
            ops in proptest::collection::vec(op(), 1..300)
        ) {
            let pool = Pool::new();
            let mut held: Vec<Held> = Vec::new();
            let mut fill = 0u8;
            for op in ops {
                unsafe {
                    match op {
                        Op::Alloc { size, align, zeroed } => {
                            let layout = Layout::from_size_align(size, align).unwrap();
                            let at = if zeroed { pool.alloc_zeroed(layout) } else { pool.alloc(layout) };
                            prop_assert!(!at.is_null());
                            prop_assert_eq!(at as usize % align, 0);
                            if zeroed {
                                prop_assert!((0..size).all(|i| *at.add(i) == 0));
                            }
                            fill = fill.wrapping_add(1);
                            at.write_bytes(fill, size);
                            held.push(Held { at, layout, fill });
                        }
                        Op::Free(i) if !held.is_empty() => {
                            let h = held.swap_remove(i % held.len());
                            pool.dealloc(h.at, h.layout);
                        }
                        Op::Realloc(i, size) if !held.is_empty() => {
                            let i = i % held.len();
                            let h = &mut held[i];
                            let at = pool.realloc(h.at, h.layout, size);
                            prop_assert!(!at.is_null());
                            prop_assert_eq!(at as usize % h.layout.align(), 0);
                            let kept = h.layout.size().min(size);
                            prop_assert!((0..kept).all(|b| *at.add(b) == h.fill));
                            h.at = at;
                            h.layout = Layout::from_size_align(size, h.layout.align()).unwrap();
                            at.write_bytes(h.fill, size);
                        }
                        _ => {}
                    }
                }
                for h in &held {
                    let bytes = unsafe { std::slice::from_raw_parts(h.at, h.layout.size()) };
                    prop_assert!(bytes.iter().all(|b| *b == h.fill), "a block was overwritten");
                }
                let mut spans: Vec<(usize, usize)> = held
                    .iter()
                    .map(|h| (h.at as usize, h.at as usize + h.layout.size()))
                    .collect();
                spans.sort_unstable();
                prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "two blocks overlap");
            }
            for h in held {
                unsafe { pool.dealloc(h.at, h.layout) };
            }
        }
    }

    #[test]
    fn a_freed_block_is_the_next_one_of_its_class() {
        let pool = Pool::new();
        let small = Layout::from_size_align(40, 8).unwrap();
        unsafe {
            let a = pool.alloc(small);
            pool.dealloc(a, small);
            let b = pool.alloc(Layout::from_size_align(33, 1).unwrap());
            assert_eq!(a, b, "33 and 40 bytes share the 48-byte class");
            pool.dealloc(b, Layout::from_size_align(33, 1).unwrap());
        }
    }
}
