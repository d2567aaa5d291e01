//! The options a `tessera` process gives jemalloc (`tessera_common::allocator`), in a test
//! binary of their own: this test allocates 32 MiB twice, which would move the figures the other
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
#[test]
fn a_freed_large_buffer_is_reused_without_faulting_its_pages_in_again() {
    const BYTES: usize = 32 << 20;
    const PAGES: u64 = (BYTES / 4096) as u64;
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
    assert!(
        second - first >= PAGES / 2,
        "the first buffer took only {} faults for {PAGES} pages: this check sees nothing",
        second - first
    );
    assert!(
        after - second < PAGES / 8,
        "the second buffer took {} faults for {PAGES} pages: the first one's were given back",
        after - second
    );
}
