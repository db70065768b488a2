//! The TCP transport: listening sockets, the accept loop that admits each
//! connection through its front end's door, and each connection's
//! output-first loop with its stall limit and receive buffer.
//!
//! A front end ([`TcpFrontEnd`]: iSCSI today, NVMe/TCP next) is bound to
//! the listener it serves, and gives each connection a [`TcpSession`]: the
//! sans-IO protocol state that cuts frames out of the receive buffer and
//! encodes what it queued. The read is cancel-safe, so timers and
//! termination can interrupt it; everything queued is written in batches.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::admission::{Door, Permit, Refusal, SessionControl};
use crate::core::Core;
use crate::metrics::{self, LimitHit, Served};

/// Connections the kernel queues before `accept` (it caps this at
/// net.core.somaxconn, 4096 on Debian 12). A connect storm overflows a short
/// queue, and the kernel then answers well-behaved initiators with resets
/// before the admission pools ever see them.
const LISTEN_BACKLOG: u32 = 4096;

/// A front end served over TCP.
pub trait TcpFrontEnd: Send + Sync + 'static {
    type Session: TcpSession + Send + 'static;
    /// The door its connections are admitted through.
    fn door(&self) -> Door;
    fn core(&self) -> &Arc<Core>;
    /// A new connection's protocol state; `control` is how the daemon ends
    /// it.
    fn open(
        self: &Arc<Self>,
        local: SocketAddr,
        peer: SocketAddr,
        control: Arc<SessionControl>,
        now: Instant,
    ) -> Self::Session;
}

/// One connection's protocol, as the transport drives it.
pub trait TcpSession {
    /// Hand every whole frame in `rx` to the protocol (consuming them), and
    /// reserve room for the next one. An error ends reading: what the
    /// session queued still goes out, then the connection closes.
    fn receive(&mut self, rx: &mut RxBuffer) -> Result<(), ReceiveError>;
    /// Encode queued output into `batch` until it is full or the queue is
    /// empty.
    fn fill(&mut self, batch: &mut Batch<'_>) -> Fill;
    /// The bytes that carried `served` were written, at `at_raw`
    /// (`metrics::clock().raw()`).
    fn served(&mut self, now: Instant, served: Served, at_raw: u64);
    /// The next deadline of its timers.
    fn poll_timeout(&self) -> Option<Instant>;
    fn timeout(&mut self, now: Instant);
    /// The connection's control was terminated: the session decides whether
    /// something (a restart's notice) is sent before the close.
    fn terminated(&mut self, now: Instant);
    /// [`Self::terminated`] was handed over already.
    fn termination_seen(&self) -> bool;
    /// Closed with nothing left to send: the connection ends.
    fn has_ended(&self) -> bool;
    /// The connection is gone; called once, last.
    fn closed(&mut self, now: Instant);
}

/// Why a session stopped taking what the peer sent.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// The session closed the connection itself (nothing to report).
    #[error("the session closed the connection")]
    Closed,
    /// The byte stream broke the protocol's framing.
    #[error(transparent)]
    Framing(Box<dyn std::error::Error + Send + Sync>),
}

/// What [`TcpSession::fill`] left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Its queue is empty.
    Drained,
    /// The batch is full; more is queued.
    Full,
    /// The session asked to close (or could not encode): send what is
    /// encoded, then end.
    Close,
}

/// The output batch a session encodes into.
pub struct Batch<'a> {
    buf: &'a mut Vec<u8>,
    served: &'a mut Vec<Served>,
}

impl Batch<'_> {
    /// Where encoded bytes go.
    pub fn buf(&mut self) -> &mut Vec<u8> {
        self.buf
    }

    /// A response in the batch carried `served`: reported once written.
    pub fn served(&mut self, served: Served) {
        self.served.push(served);
    }

    /// About a batch is encoded: the rest stays queued in the session.
    pub fn is_full(&self) -> bool {
        self.buf.len() >= OUTPUT_BATCH || self.served.len() >= SERVED_PER_BATCH
    }
}

/// A listening socket on `addr`, as `TcpListener::bind` makes it but with
/// a longer accept queue.
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Accept connections for `front` forever.
pub async fn serve<F: TcpFrontEnd>(listener: TcpListener, front: Arc<F>) {
    let gate = &front.core().gate;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let permit = match gate.admit(peer.ip(), front.door()) {
                    Ok(p) => p,
                    Err(why @ Refusal::ShuttingDown) => {
                        tracing::debug!(%peer, "connection refused: {why}");
                        drop(stream);
                        continue;
                    }
                    Err(why) => {
                        gate.log_refusal(peer, why);
                        drop(stream);
                        continue;
                    }
                };
                if has_data_waiting(&stream) {
                    // Its login is under way already: when the pending pool
                    // must make room, silent connections go first.
                    permit.heard_from();
                }
                let front = front.clone();
                tokio::spawn(async move {
                    if let Err(e) = run_connection(stream, peer, front, permit).await {
                        tracing::debug!(%peer, "connection ended: {e}");
                    }
                });
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether the peer has sent bytes already (a look, nothing consumed).
fn has_data_waiting(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = tokio::io::ReadBuf::new(&mut byte);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    matches!(
        stream.poll_peek(&mut cx, &mut buf),
        std::task::Poll::Ready(Ok(n)) if n > 0
    )
}

async fn run_connection<F: TcpFrontEnd>(
    mut stream: TcpStream,
    peer: SocketAddr,
    front: Arc<F>,
    permit: Permit,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let local = stream.local_addr()?;
    tracing::debug!(%peer, "connection accepted");
    let control = SessionControl::new();
    permit.watch(control.clone());
    let core = front.core().clone();
    let stall_limit = core.limits.output_stall_timeout;
    let mut conn = front.open(local, peer, control.clone(), Instant::now());
    let mut rx = RxBuffer::new();
    let mut out = Output::default();
    let result = loop {
        if out.is_empty() {
            out.fill(&mut conn);
        }
        if !out.is_empty() {
            // Output first, and nothing is read until it is written: a peer
            // that does not read its answers stops being read (TCP
            // back-pressure) instead of making the daemon queue them. A peer
            // that reads nothing for `stall_limit` is dropped.
            let limit = if out.closing || out.close_when_drained {
                stall_limit.min(CLOSE_LINGER)
            } else {
                stall_limit
            };
            let stall_deadline = out.last_progress + limit;
            let deadline = match conn.poll_timeout() {
                Some(d) => d.min(stall_deadline),
                None => stall_deadline,
            };
            tokio::select! {
                r = stream.write(out.pending()) => match r {
                    Ok(0) => break Ok(()),
                    Ok(n) => out.advance(n, &mut conn),
                    Err(e) => break Err(e),
                },
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let now = Instant::now();
                    if now >= stall_deadline {
                        if !out.closing {
                            core.counters.limit_hit(LimitHit::OutputStall);
                            tracing::warn!(%peer, "no output progress for {limit:?}: the initiator reads nothing; closing the connection");
                        }
                        break Ok(());
                    }
                    conn.timeout(now);
                }
                _ = control.terminated(), if !conn.termination_seen() => {
                    conn.terminated(Instant::now());
                    if conn.has_ended() {
                        break Ok(());
                    }
                }
            }
            continue;
        }
        if out.closing {
            // A write that met a planned restart's fence before the
            // termination was seen closes the connection too: the host must
            // still learn when to come back.
            if !conn.termination_seen() && control.is_terminated() {
                conn.terminated(Instant::now());
                if !conn.has_ended() {
                    out.closing = false;
                    continue;
                }
            }
            break Ok(());
        }
        if control.is_terminated() && !conn.termination_seen() {
            conn.terminated(Instant::now());
            if conn.has_ended() {
                break Ok(());
            }
            continue;
        }
        let deadline = conn.poll_timeout();
        tokio::select! {
            r = stream.read(rx.spare()) => match r {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    rx.filled(n);
                    if let Err(e) = conn.receive(&mut rx) {
                        if !matches!(e, ReceiveError::Closed) {
                            tracing::info!(%peer, "closing connection: {e}");
                        }
                        // What the session queued (a Reject, read data
                        // before the error) still goes out, then the
                        // connection ends.
                        out.close_after_queued(&mut conn);
                    }
                }
                Err(e) => break Err(e),
            },
            _ = sleep_until(deadline) => conn.timeout(Instant::now()),
            _ = control.terminated(), if !conn.termination_seen() => {
                conn.terminated(Instant::now());
                if conn.has_ended() {
                    break Ok(());
                }
            }
        }
    };
    conn.closed(Instant::now());
    result
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// Output is encoded in batches of about this size; the session keeps the
/// rest queued (iSCSI: a READ's Data-In as a cursor, not as bytes).
const OUTPUT_BATCH: usize = 1 << 20;
/// How long the last output of a closing connection may take.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// Bytes encoded from the session's queue, being written.
struct Output {
    buf: Vec<u8>,
    written: usize,
    /// The session asked to close: send what is encoded, then end.
    closing: bool,
    /// The session's queue is written out, then the connection ends.
    close_when_drained: bool,
    /// When the current batch was started or last made progress.
    last_progress: Instant,
    /// Commands whose responses are in `buf`: served once it is written.
    served: Vec<Served>,
}

/// Responses one output batch may carry; a batch with this many ends early,
/// so `Output::served` never grows.
const SERVED_PER_BATCH: usize = 256;

impl Default for Output {
    fn default() -> Output {
        Output {
            buf: Vec::with_capacity(64 * 1024),
            written: 0,
            closing: false,
            close_when_drained: false,
            last_progress: Instant::now(),
            served: Vec::with_capacity(SERVED_PER_BATCH),
        }
    }
}

impl Output {
    fn is_empty(&self) -> bool {
        self.written == self.buf.len()
    }

    fn pending(&self) -> &[u8] {
        &self.buf[self.written..]
    }

    fn advance(&mut self, n: usize, conn: &mut impl TcpSession) {
        let now = Instant::now();
        self.written += n;
        self.last_progress = now;
        if self.is_empty() {
            self.buf.clear();
            self.written = 0;
            if !self.served.is_empty() {
                let at_raw = metrics::clock().raw();
                for served in self.served.drain(..) {
                    conn.served(now, served, at_raw);
                }
            }
        }
    }

    /// Encode queued output until about a batch is ready.
    fn fill(&mut self, conn: &mut impl TcpSession) {
        if self.closing {
            return;
        }
        if self.buf.capacity() > 4 * OUTPUT_BATCH && self.buf.is_empty() {
            // One oversized frame grew the buffer: give the memory back.
            self.buf = Vec::with_capacity(64 * 1024);
        }
        self.last_progress = Instant::now();
        let mut batch = Batch {
            buf: &mut self.buf,
            served: &mut self.served,
        };
        match conn.fill(&mut batch) {
            Fill::Drained => self.closing |= self.close_when_drained,
            Fill::Full => {}
            Fill::Close => self.closing = true,
        }
    }

    /// End the connection once what the session already queued is written.
    fn close_after_queued(&mut self, conn: &mut impl TcpSession) {
        self.close_when_drained = true;
        if self.is_empty() {
            self.fill(conn);
        }
    }
}

/// A receive buffer that holds at least one whole frame.
pub struct RxBuffer {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl RxBuffer {
    fn new() -> RxBuffer {
        RxBuffer {
            buf: vec![0; 64 * 1024],
            start: 0,
            end: 0,
        }
    }

    /// The bytes received and not yet consumed.
    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The first `n` bytes of [`Self::data`] were taken.
    pub fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    fn filled(&mut self, n: usize) {
        self.end += n;
    }

    /// Make room for at least `need` unread bytes: the next frame, whose
    /// header says how long it is.
    pub fn reserve(&mut self, need: usize) {
        if self.start > 0 && self.buf.len() - self.start < need {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() < need {
            self.buf.resize(need, 0);
        }
    }

    /// The free tail to read into.
    fn spare(&mut self) -> &mut [u8] {
        if self.end == self.buf.len() {
            self.reserve(self.end - self.start + 4096);
        }
        &mut self.buf[self.end..]
    }
}
