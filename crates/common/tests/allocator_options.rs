//! The options a `tessera` process gives jemalloc (`tessera_common::allocator`), in a test
//! binary of their own: these tests allocate 32 MiB twice and 64 MiB, which would move the figures the other
//! allocator tests read.

use tessera_common::allocator::oversize_threshold;

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
/// Counted in faults, not pages: with huge pages one fault maps 2 MiB.
#[test]
fn a_freed_large_buffer_is_reused_without_faulting_its_pages_in_again() {
    const BYTES: usize = 32 << 20;
    const HUGE_PAGES: u64 = (BYTES / (2 << 20)) as u64;
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
    let first_faults = second - first;
    assert!(
        first_faults >= HUGE_PAGES / 2,
        "the first buffer took only {first_faults} faults for {BYTES} bytes: this check sees nothing"
    );
    assert!(
        after - second <= first_faults / 8,
        "the second buffer took {} faults, the first {first_faults}: the first one's pages were given back",
        after - second
    );
}

/// The kernel's THP mode (`always`, `madvise` or `never`), where it has one.
fn kernel_thp_mode() -> Option<String> {
    let modes = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let chosen = modes.split_whitespace().find(|m| m.starts_with('['))?;
    Some(chosen.trim_matches(|c| c == '[' || c == ']').to_string())
}

/// This process's anonymous memory in transparent huge pages, in bytes.
fn anon_huge_page_bytes() -> u64 {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").expect("smaps_rollup");
    let line = rollup
        .lines()
        .find(|line| line.starts_with("AnonHugePages:"))
        .expect("an AnonHugePages line");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .expect("AnonHugePages in kB");
    kib * 1024
}

/// A SIGKILLed node's peers see its connections drop only after the kernel has freed all of
/// its memory; in 2 MiB pages that is about fifteen times quicker for a node's 500 MiB (see
/// `tessera_common::allocator`). Where the kernel leaves THP to the program (`madvise`,
/// this machine's and most distributions' default), only jemalloc's `thp:always` asks.
#[test]
fn large_buffers_are_mapped_in_huge_pages_where_the_kernel_allows_it() {
    match kernel_thp_mode().as_deref() {
        Some("always") | Some("madvise") => {}
        other => {
            eprintln!(
                "skipped: this kernel's THP mode is {other:?}, so no process gets huge pages"
            );
            return;
        }
    }
    const BYTES: usize = 64 << 20;
    let held = std::hint::black_box(vec![3u8; BYTES]);
    let huge = anon_huge_page_bytes();
    assert!(
        huge >= (BYTES / 2) as u64,
        "a touched {} MiB buffer left the process with {} KiB in huge pages",
        BYTES >> 20,
        huge >> 10
    );
    drop(held);
}
