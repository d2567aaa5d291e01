//! The options a `tessera` process gives jemalloc (`tessera_common::allocator`), in a test
//! binary of their own: this test allocates 32 MiB twice, which would move the figures the other
//! allocator tests read.

use tessera_common::allocator::{oversize_threshold, transparent_huge_pages};

tessera_common::allocate_with_jemalloc!();

/// Page faults this thread has taken (from `/proc/thread-self/stat`, field 10).
fn minor_faults_of_this_thread() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("this thread's stat");
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let after_name = &stat[stat.rfind(')').expect("a command name") + 1..];
    after_name
        .split_whitespace()
        .nth(7)
        .and_then(|field| field.parse().ok())
        .expect("minflt")
}

/// jemalloc's default (8 MiB) sends every large buffer to an arena that returns its pages
/// to the system as soon as the buffer is freed, so the next one is faulted in afresh.
#[test]
fn a_freed_large_buffer_is_reused_without_faulting_its_pages_in_again() {
    const BYTES: usize = 32 << 20;
    assert_eq!(
        oversize_threshold(),
        Some(0),
        "jemalloc's dedicated arena for large allocations is on"
    );
    let first = minor_faults_of_this_thread();
    drop(std::hint::black_box(vec![1u8; BYTES]));
    let second = minor_faults_of_this_thread();
    drop(std::hint::black_box(vec![2u8; BYTES]));
    let after = minor_faults_of_this_thread();
    // One fault per page: 8192 of 4 KiB, or 16 of 2 MiB where the buffer got huge pages.
    let faulted_in = second - first;
    assert!(
        faulted_in >= (BYTES / (2 << 20)) as u64,
        "the first buffer took only {faulted_in} faults for {BYTES} bytes: this check sees nothing"
    );
    assert!(
        after - second <= faulted_in / 8,
        "the second buffer took {} faults, the first {faulted_in}: the first one's pages were given back",
        after - second
    );
}

/// Bytes of this process's memory in transparent huge pages.
fn huge_page_bytes() -> u64 {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").expect("smaps_rollup");
    let line = rollup
        .lines()
        .find(|line| line.starts_with("AnonHugePages:"))
        .expect("an AnonHugePages line");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|kib| kib.parse().ok())
        .expect("a size in kB");
    kib << 10
}

/// The memory jemalloc maps asks for huge pages: a killed node's memory is taken back, and
/// its sockets closed, in a fraction of the time (see `tessera_common::allocator`).
#[test]
fn a_large_buffer_is_held_in_huge_pages() {
    const BYTES: usize = 64 << 20;
    assert_eq!(
        transparent_huge_pages().as_deref(),
        Some("always"),
        "jemalloc's memory is not marked for huge pages"
    );
    let kernel =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if !kernel.contains("[always]") && !kernel.contains("[madvise]") {
        eprintln!("this kernel gives no process huge pages ({kernel:?}): nothing to measure");
        return;
    }
    let before = huge_page_bytes();
    let held = std::hint::black_box(vec![3u8; BYTES]);
    let during = huge_page_bytes();
    drop(held);
    // All but the buffer's unaligned ends, with room for the kernel finding no free huge
    // page now and then.
    assert!(
        during >= before + (BYTES as u64) / 2,
        "{} MiB in huge pages while holding {} MiB, {} MiB before",
        during >> 20,
        BYTES >> 20,
        before >> 20
    );
}
