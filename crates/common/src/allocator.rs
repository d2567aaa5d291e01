//! The allocator a node runs with, and what it says about the memory it holds.
//!
//! The `tessera` binary makes [`Allocator`] (jemalloc) its global allocator. With glibc's
//! malloc, the nodes of an r = 3 cluster spent about a third more CPU on the replication
//! benchmark's publishes (1665 CPU ticks against 1203 over the same phase; r = 1's the same
//! either way). A replica receives each publish's rows as Flight messages of up to 32 MiB,
//! logs them and lets them go; in glibc's profile the allocator's own work (`_int_malloc`,
//! `malloc_consolidate`, `unlink_chunk`) and the kernel zeroing freshly mapped pages for
//! received bytes stood out. jemalloc keeps freed extents for reuse and gives them back to
//! the system once unused for a while (its decay, 10 s by default), so a node does not keep
//! the peak of a large publish for good either.
//!
//! One of jemalloc's defaults undid that for the largest allocations: anything of 8 MiB or
//! more (`opt.oversize_threshold`) went to an arena of its own whose freed pages go back to
//! the system at once, so each such buffer (a Flight message being decoded or encoded, a
//! routed window's columns) was faulted in and zeroed afresh. [`JEMALLOC_OPTIONS`] turns
//! that arena off. On three-node clusters publishing lineitem SF 1 (6M rows), it cut the
//! coordinating node's page faults per publish from about 1.45 M to 0.75 M, and the nodes'
//! CPU per publish by about a tenth at r = 1 and at r = 3 alike.
//!
//! The memory jemalloc maps is also marked for transparent huge pages (`thp:always`, which
//! asks with `madvise`, so it works where the kernel's setting is `madvise`, its usual
//! default, as well as `always`). Huge pages are why a node's death is seen in
//! milliseconds: a killed process's sockets close only once the kernel has taken its
//! memory back, page table entry by entry, so its peers' streams stay open meanwhile. On
//! this 2-core machine that took about 90 ms per GiB of 4 KiB pages and 6 ms per GiB of
//! 2 MiB pages; in `bench recovery` (SF 1, nodes of 150-400 MB) the initiator heard of a
//! SIGKILLed node 20-70 ms after the kill with 4 KiB pages and 11-31 ms with huge pages
//! (what is left is the dying threads' and the initiator's wait for a core), on queries of
//! 100-600 ms that lineage recovery finishes after rebuilding the dead node's channels. A
//! large buffer also takes one page fault per 2 MiB instead of 512; the replication
//! benchmark's publishes took no more CPU with huge pages than without (r = 3: 48.4
//! against 50.2 s per publish, all nodes).
//! `_RJEM_MALLOC_CONF` in a node's environment still overrides these options (jemalloc
//! reads it afterwards).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, Ordering};
use tikv_jemallocator::Jemalloc;

/// jemalloc's options for a process that allocates with [`Allocator`] (see the module's
/// comment), as the C string jemalloc reads before `main`.
pub const JEMALLOC_OPTIONS: &[u8; 32] = b"oversize_threshold:0,thp:always\0";

/// Makes [`Allocator`] the global allocator of the binary that invokes it, and gives
/// jemalloc [`JEMALLOC_OPTIONS`]: every `tessera` process, and the tests that measure or
/// check what a node's allocator does.
#[macro_export]
macro_rules! allocate_with_jemalloc {
    () => {
        #[global_allocator]
        static ALLOCATOR: $crate::allocator::Allocator = $crate::allocator::Allocator;

        // jemalloc's own `malloc_conf` is a weak symbol it reads before `main`; this
        // definition replaces it. A thin pointer to a C string, as jemalloc declares it.
        #[unsafe(export_name = "_rjem_malloc_conf")]
        #[used]
        static JEMALLOC_OPTIONS: &[u8; $crate::allocator::JEMALLOC_OPTIONS.len()] =
            $crate::allocator::JEMALLOC_OPTIONS;
    };
}

/// jemalloc, as a global allocator that notes it is one: a process that links jemalloc
/// without allocating through it (a test binary) has statistics too, which describe none
/// of the memory it holds.
pub struct Allocator;

/// Set once [`Allocator`] has served an allocation.
static SERVING: AtomicBool = AtomicBool::new(false);

fn note_serving() {
    if !SERVING.load(Ordering::Relaxed) {
        SERVING.store(true, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed on unchanged to jemalloc's own implementation.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_serving();
        unsafe { Jemalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_serving();
        unsafe { Jemalloc.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { Jemalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        unsafe { Jemalloc.realloc(ptr, layout, new_size) }
    }
}

/// jemalloc's `opt.oversize_threshold` in this process: 0 where [`JEMALLOC_OPTIONS`] took
/// effect. `None` where it cannot be read.
pub fn oversize_threshold() -> Option<usize> {
    // SAFETY: the name is a NUL-terminated mallctl name whose value is a size_t.
    unsafe { tikv_jemalloc_ctl::raw::read::<usize>(b"opt.oversize_threshold\0") }.ok()
}

/// jemalloc's `opt.thp` in this process ("always" where [`JEMALLOC_OPTIONS`] took effect,
/// "default" or "never" otherwise). `None` where it cannot be read.
pub fn transparent_huge_pages() -> Option<String> {
    // SAFETY: the name is a NUL-terminated mallctl name whose value is a C string that
    // jemalloc keeps for the life of the process.
    unsafe { tikv_jemalloc_ctl::raw::read_str(b"opt.thp\0") }
        .ok()
        .and_then(|value| std::str::from_utf8(value).ok())
        .map(|value| value.trim_end_matches('\0').to_string())
}

/// What the allocator holds, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes of live allocations the program made.
    pub allocated: u64,
    /// Bytes of memory the allocator has mapped and touched: the live allocations, freed
    /// memory kept for reuse, and the allocator's own metadata.
    pub resident: u64,
}

/// The allocator's figures now; `None` where [`Allocator`] is not this process's global
/// allocator (a test binary, which keeps the system allocator), or its statistics cannot be
/// read.
pub fn stats() -> Option<AllocatorStats> {
    use tikv_jemalloc_ctl::{epoch, stats};
    if !SERVING.load(Ordering::Relaxed) {
        return None;
    }
    // jemalloc caches its statistics; advancing its epoch refreshes them.
    epoch::advance().ok()?;
    let allocated = stats::allocated::read().ok()? as u64;
    let resident = stats::resident::read().ok()? as u64;
    Some(AllocatorStats {
        allocated,
        resident,
    })
}

#[cfg(test)]
mod tests {
    /// This test binary keeps the system allocator: jemalloc serves nothing, so there is
    /// nothing to report (jemalloc's own figures here describe none of the process's memory:
    /// they said 56 KiB allocated).
    #[test]
    fn a_process_without_jemalloc_reports_no_allocator_figures() {
        let held: Vec<u8> = vec![1; 1 << 20];
        assert_eq!(super::stats(), None);
        drop(held);
    }
}
