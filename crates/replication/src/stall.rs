//! Progress deadlines (`failure.progress_timeout_ms`) for work done under an open epoch. A
//! node the cluster counts alive can still leave it unfinished: its disk hangs in an fsync
//! (it stops itself only after `failure.disk_stall_ms`), or its handling waits on something
//! that never comes. Its connections stay healthy (keep-alive pings are answered), and the
//! epoch, with its tables' lease, would stay open as long as the caller waits. So such work
//! is given up once it has made no progress for a while:
//!
//! - a prepare stream, when its peer has neither taken the next batch nor, once every batch
//!   is sent, answered ([`Progress::watch`]); time spent waiting on the stream's own
//!   producer (the coordinator's rows still arriving at a primary that forwards them) is not
//!   the peer's and never counts;
//! - a partition copy, when it has fetched and installed nothing ([`Progress::advanced`]).

use futures::Stream;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// What a watched call is waiting on.
#[derive(Debug, Clone, Copy)]
enum Waiting {
    /// The stream's producer: its next batch is not there yet.
    OnProducer,
    /// The watched work, which has made no progress since then: a peer taking the batch
    /// just handed over or answering once the stream has ended; a copy fetching or
    /// installing its next piece.
    OnWork(Instant),
}

/// Shared between a watched stream and the watchdog racing its call.
#[derive(Debug, Clone)]
pub struct Progress {
    waiting: Arc<Mutex<Waiting>>,
}

impl Progress {
    /// Starts with the work's turn: a call has not even polled its stream before the
    /// connection is up, and a peer that never accepts it has made no progress.
    pub fn new() -> Progress {
        Progress {
            waiting: Arc::new(Mutex::new(Waiting::OnWork(Instant::now()))),
        }
    }

    /// Wraps the stream of batches a call sends, so that its polls record progress.
    pub fn watch<S: Stream + Unpin>(&self, stream: S) -> Watched<S> {
        Watched {
            inner: stream,
            progress: self.clone(),
        }
    }

    /// Records that the watched work made progress just now.
    pub fn advanced(&self) {
        self.set(Waiting::OnWork(Instant::now()));
    }

    fn set(&self, waiting: Waiting) {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = waiting;
    }

    /// How long the watched work has made no progress, if it is its turn.
    fn stalled_for(&self) -> Option<Duration> {
        match *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) {
            Waiting::OnProducer => None,
            Waiting::OnWork(since) => Some(since.elapsed()),
        }
    }

    /// Resolves once the watched work has made no progress for `limit`; returns how long.
    pub async fn stalled(&self, limit: Duration) -> Duration {
        let tick = (limit / 10).max(Duration::from_millis(50));
        loop {
            match self.stalled_for() {
                Some(stalled) if stalled >= limit => return stalled,
                Some(stalled) => tokio::time::sleep((limit - stalled).min(tick)).await,
                None => tokio::time::sleep(tick).await,
            }
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new()
    }
}

/// A stream whose polls tell its [`Progress`] who the call is waiting on.
pub struct Watched<S> {
    inner: S,
    progress: Progress,
}

impl<S: Stream + Unpin> Stream for Watched<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        // A poll at all means the transport had room for the next batch: the peer took the
        // last one. Handing one over (or ending) makes it the peer's turn again.
        self.progress.set(match &polled {
            Poll::Pending => Waiting::OnProducer,
            Poll::Ready(_) => Waiting::OnWork(Instant::now()),
        });
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    const LIMIT: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn a_peer_that_stops_taking_batches_or_never_answers_is_stalled() {
        // Takes one batch, then never polls again (its flow-control window is shut).
        let progress = Progress::new();
        let mut stream = progress.watch(futures::stream::iter([1, 2, 3]));
        assert_eq!(stream.next().await, Some(1));
        let started = Instant::now();
        let stalled = noticed(&progress).await;
        assert!(stalled >= LIMIT && started.elapsed() < LIMIT * 3);

        // Takes every batch, then never answers.
        let progress = Progress::new();
        let stream = progress.watch(futures::stream::iter([1, 2, 3]));
        assert_eq!(stream.collect::<Vec<_>>().await, [1, 2, 3]);
        assert!(noticed(&progress).await >= LIMIT);
    }

    /// The stall `progress` reports, failing the test rather than hanging if none is.
    async fn noticed(progress: &Progress) -> Duration {
        tokio::time::timeout(LIMIT * 5, progress.stalled(LIMIT))
            .await
            .expect("a stall is noticed")
    }

    #[tokio::test]
    async fn waiting_on_the_producer_is_not_a_stall() {
        let progress = Progress::new();
        let (mut sender, receiver) = futures::channel::mpsc::channel::<u32>(1);
        let mut stream = progress.watch(receiver);
        // The peer keeps polling; the producer sends nothing for three limits.
        let consumer = tokio::spawn(async move { while stream.next().await.is_some() {} });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let watchdog = tokio::time::timeout(LIMIT * 3, progress.stalled(LIMIT)).await;
        assert!(
            watchdog.is_err(),
            "waiting on the producer counted as a stall"
        );

        // Batches flowing steadily are progress too.
        let feeding = async {
            for i in 0..20 {
                futures::SinkExt::send(&mut sender, i).await.unwrap();
                tokio::time::sleep(LIMIT / 4).await;
            }
        };
        tokio::select! {
            () = feeding => {}
            stalled = progress.stalled(LIMIT) => panic!("stalled for {stalled:?} while batches flowed"),
        }
        drop(sender);
        consumer.await.unwrap();
    }
}
