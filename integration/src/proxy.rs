//! A TCP fault proxy for tests, on loopback only: put it between a client and a broker
//! node and inject network faults into the client's connections while it runs.
//!
//! - [`FaultProxy::set_latency`]: every chunk is delivered `latency` after it was read,
//!   in both directions (a delay on the wire, not a throughput limit: chunks in flight
//!   overlap).
//! - [`FaultProxy::stall`] / [`FaultProxy::resume`]: the connections stay open but no
//!   byte moves either way (a hung network path: the peers see no error, only silence;
//!   once the proxy's small buffers are full, TCP flow control holds the senders).
//! - [`FaultProxy::stall_answers`]: requests reach the node, its answers do not (an
//!   asymmetric partition: the node acts on what it is sent — commits, acknowledges —
//!   and the client hears nothing until [`FaultProxy::resume`]).
//! - [`FaultProxy::cut`]: every open connection is reset; new ones are accepted.
//!
//! Each accepted connection opens its own upstream connection; bytes are forwarded
//! unchanged and in order.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Chunks read but not yet written, per direction: with 16 KiB reads, at most 1 MiB
/// buffered before the proxy stops reading and TCP holds the sender.
const CHUNKS_IN_FLIGHT: usize = 64;
const CHUNK: usize = 16 * 1024;

/// What the proxy does to its connections now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Faults {
    latency: Duration,
    stalled: bool,
    /// Only the upstream's bytes are held ([`FaultProxy::stall_answers`]).
    answers_stalled: bool,
    /// Bumped by [`FaultProxy::cut`]: connections accepted before it are reset.
    cuts: u64,
}

/// A running proxy (stopped when dropped).
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    faults: watch::Sender<Faults>,
    open: Arc<AtomicUsize>,
    moved: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy to `upstream` on a free loopback port.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), upstream).await
    }

    /// A proxy listening on `listen`, forwarding to `upstream`, a loopback address (a
    /// fault proxy never reaches into a real network). It listens on loopback too, or on
    /// a private address of this host — the host's end of the test bridge, where the
    /// chaos tests' consumer in its network namespace reaches its database.
    pub async fn start_on(listen: SocketAddr, upstream: SocketAddr) -> io::Result<Self> {
        let private = |a: SocketAddr| match a.ip() {
            std::net::IpAddr::V4(ip) => ip.is_loopback() || ip.is_private(),
            std::net::IpAddr::V6(ip) => ip.is_loopback(),
        };
        for (what, a, ok) in [
            ("listen", listen, private(listen)),
            ("upstream", upstream, upstream.ip().is_loopback()),
        ] {
            if !ok {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "fault proxy: {what} address {a} is not a loopback address{}",
                        if what == "listen" {
                            " or a private one"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (faults, _) = watch::channel(Faults::default());
        let open = Arc::new(AtomicUsize::new(0));
        let moved = Arc::new(AtomicU64::new(0));
        let accept = tokio::spawn(accept_loop(
            listener,
            upstream,
            faults.clone(),
            open.clone(),
            moved.clone(),
        ));
        Ok(Self {
            addr,
            upstream,
            faults,
            open,
            moved,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Connections open through the proxy now.
    pub fn connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Bytes forwarded so far, both ways, over every connection (how busy the links
    /// were during a fault).
    pub fn bytes_moved(&self) -> u64 {
        self.moved.load(Ordering::SeqCst)
    }

    /// Deliver every chunk `latency` after it was read (zero: no added latency).
    pub fn set_latency(&self, latency: Duration) {
        self.faults.send_modify(|f| f.latency = latency);
    }

    /// Stop moving bytes on every connection (open and new) until [`resume`](Self::resume).
    pub fn stall(&self) {
        self.faults.send_modify(|f| f.stalled = true);
    }

    /// Hold every byte the upstream sends (open and new connections) while the client's
    /// still reach it, until [`resume`](Self::resume).
    pub fn stall_answers(&self) {
        self.faults.send_modify(|f| f.answers_stalled = true);
    }

    /// Move bytes again, both ways; what was held is delivered in order.
    pub fn resume(&self) {
        self.faults.send_modify(|f| {
            f.stalled = false;
            f.answers_stalled = false;
        });
    }

    /// Reset every open connection (both sides see the connection reset); connections
    /// accepted afterwards are served.
    pub fn cut(&self) {
        self.faults.send_modify(|f| f.cuts += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    faults: watch::Sender<Faults>,
    open: Arc<AtomicUsize>,
    moved: Arc<AtomicU64>,
) {
    loop {
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "fault proxy: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (faults, open, moved) = (faults.subscribe(), open.clone(), moved.clone());
        tokio::spawn(async move {
            let server = match TcpStream::connect(upstream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, %upstream, error = %e, "fault proxy: upstream refused; closing the client");
                    reset(&client);
                    return;
                }
            };
            open.fetch_add(1, Ordering::SeqCst);
            serve(client, server, faults, &moved).await;
            open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Forward both ways until both sides have closed or the connection is cut.
async fn serve(
    mut client: TcpStream,
    mut server: TcpStream,
    mut faults: watch::Receiver<Faults>,
    moved: &AtomicU64,
) {
    let cuts_at_start = faults.borrow_and_update().cuts;
    for s in [&client, &server] {
        let _ = s.set_nodelay(true);
    }
    let was_cut = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let both_ways = futures::future::join(
            pump(
                client_read,
                server_write,
                faults.clone(),
                Direction::Requests,
                moved,
            ),
            pump(
                server_read,
                client_write,
                faults.clone(),
                Direction::Answers,
                moved,
            ),
        );
        let cut = faults.wait_for(|f| f.cuts != cuts_at_start);
        tokio::select! {
            _ = both_ways => false,
            _ = cut => true,
        }
    };
    if was_cut {
        // SO_LINGER 0: closing sends RST (a cut wire, as the peers see it), not FIN.
        for s in [&client, &server] {
            let _ = s.set_zero_linger();
        }
    }
}

/// Which way a [`pump`] moves bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Client to upstream.
    Requests,
    /// Upstream to client.
    Answers,
}

impl Faults {
    fn holds(&self, direction: Direction) -> bool {
        self.stalled || (direction == Direction::Answers && self.answers_stalled)
    }
}

/// One direction: a reader stamps each chunk with the moment it was read, a writer
/// delivers it `latency` later, holding everything while stalled. Ends when the reading
/// side closes (the writing side is then shut down: the close is passed on) or fails.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    mut faults: watch::Receiver<Faults>,
    direction: Direction,
    moved: &AtomicU64,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(CHUNKS_IN_FLIGHT);
    let read = async move {
        loop {
            let mut buf = vec![0; CHUNK];
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send((Instant::now(), buf)).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((read_at, chunk)) = rx.recv().await {
            let latency = faults.borrow().latency;
            tokio::time::sleep_until(read_at + latency).await;
            if faults.wait_for(|f| !f.holds(direction)).await.is_err()
                || to.write_all(&chunk).await.is_err()
            {
                return;
            }
            moved.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

/// SO_LINGER 0: closing the socket sends RST instead of FIN.
fn reset(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

#[cfg(test)]
mod tests;
