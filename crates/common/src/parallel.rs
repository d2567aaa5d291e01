//! CPU work split over a few threads of its own, for the steps of a request that are CPU
//! work over many independent pieces (a publish's rows routed batch by batch and partition
//! by partition) and would otherwise leave the machine's other cores idle while the rest of
//! the cluster waits for them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The most threads [`map_in_parallel`] uses: enough for the cores a node usually has to
/// itself, few enough not to crowd out the threads that answer heartbeats and Raft.
pub const MOST_THREADS: usize = 8;

/// The threads worth using for `pieces` pieces of work on this machine.
pub fn threads_for(pieces: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.min(MOST_THREADS).min(pieces).max(1)
}

/// `f` applied to each item, on up to `threads` threads (scoped: they end before this
/// returns), each taking the next item not yet taken; the results in the items' order.
/// With one thread, or one item, it runs on the calling thread alone.
pub fn map_in_parallel<T: Send, R: Send>(
    items: Vec<T>,
    threads: usize,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    let count = items.len();
    if threads <= 1 || count <= 1 {
        return items.into_iter().map(f).collect();
    }
    let items: Vec<Mutex<Option<T>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let results: Vec<Mutex<Option<R>>> = (0..count).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let work = || loop {
        let index = next.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = items.get(index) else {
            return;
        };
        let item = slot
            .lock()
            .expect("an item's lock")
            .take()
            .expect("each item is taken once");
        let result = f(item);
        *results[index].lock().expect("a result's lock") = Some(result);
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.min(count) {
            scope.spawn(work);
        }
        // The calling thread works too, rather than only waiting.
        work();
    });
    results
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .expect("a result's lock")
                .expect("every item has its result")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn results_keep_the_items_order_and_the_work_spreads_over_threads() {
        let items: Vec<u64> = (0..200).collect();
        let seen = Mutex::new(HashSet::new());
        let results = map_in_parallel(items, 4, |i| {
            seen.lock().unwrap().insert(std::thread::current().id());
            // Long enough that one thread cannot take every item before the others start.
            std::thread::sleep(std::time::Duration::from_millis(1));
            i * i
        });
        assert_eq!(results, (0..200).map(|i| i * i).collect::<Vec<_>>());
        assert!(
            seen.into_inner().unwrap().len() > 1,
            "more than one thread worked"
        );
    }

    #[test]
    fn one_thread_runs_on_the_caller() {
        let caller = std::thread::current().id();
        let ran_on = map_in_parallel(vec![1, 2, 3], 1, |_| std::thread::current().id());
        assert!(ran_on.iter().all(|id| *id == caller));
    }
}
