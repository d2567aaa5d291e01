//! A process whose global allocator is `tessera_common::allocator::Allocator`, as the
//! `tessera` binary's is: its figures follow the memory the process allocates and frees.

use tessera_common::allocator::stats;

tessera_common::allocate_with_jemalloc!();

#[test]
fn the_allocator_counts_what_the_process_allocates_and_frees() {
    const HELD: usize = 64 << 20;
    let before = stats().expect("jemalloc serves this process");
    let held = std::hint::black_box(vec![7u8; HELD]);
    let during = stats().expect("figures");
    assert!(
        during.allocated >= before.allocated + HELD as u64,
        "allocated {} bytes with {HELD} more held than at {}",
        during.allocated,
        before.allocated
    );
    assert!(
        during.resident >= during.allocated,
        "{during:?}: fewer bytes resident than allocated"
    );
    drop(held);
    let after = stats().expect("figures");
    assert!(
        after.allocated + HELD as u64 <= during.allocated,
        "allocated {} bytes after freeing {HELD} of {}",
        after.allocated,
        during.allocated
    );
}
