//! The bound on open Flight SQL connections: each accepted connection holds a slot until
//! it closes; past the bound a new one is closed at once (and logged), so a flood of idle
//! clients cannot take every file descriptor the node has (its Raft and replication ports
//! need them too).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection and the slot it holds.
pub struct Slotted {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

/// The connections `listener` accepts, at most `max` open at once.
pub fn bounded(
    listener: TcpListener,
    max: usize,
) -> impl futures::Stream<Item = io::Result<Slotted>> {
    let slots = Arc::new(Semaphore::new(max));
    futures::stream::unfold((listener, slots), move |(listener, slots)| async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait, rather than spin.
                    tracing::warn!(%error, "accepting a Flight SQL connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::warn!(%peer, max, "Flight SQL connection refused: the node already serves its maximum (flightsql_max_connections)");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let accepted = Slotted {
                stream,
                _slot: slot,
            };
            return Some((Ok(accepted), (listener, slots)));
        }
    })
}

impl Connected for Slotted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Slotted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Slotted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
