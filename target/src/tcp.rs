//! iSCSI over TCP: a thin tokio driver around the sans-IO engine.
//!
//! Per connection: read bytes into one buffer, cut whole PDUs out of it (the
//! read is cancel-safe, so timers and termination can interrupt it), hand them
//! to the engine, and write everything the engine queued in one batch.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::iscsi::frame::{self, DeframeError, Deframed, Digests, RxRules};
use ramslog_common::iscsi::BHS_LEN;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::admission::{Door, Link, Permit, Refusal, SessionControl};
use crate::iscsi::engine::{Action, ConnInfo, Connection, Event, Input, OutPdu};
use crate::iscsi::portal::Portal;
use crate::metrics::{self, LimitHit, Served};

/// Largest AHS the 8-bit TotalAHSLength field allows.
const MAX_AHS: usize = 255 * 4;

/// Connections the kernel queues before `accept` (it caps this at
/// net.core.somaxconn, 4096 on Debian 12). A connect storm overflows a short
/// queue, and the kernel then answers well-behaved initiators with resets
/// before the admission pools ever see them.
const LISTEN_BACKLOG: u32 = 4096;

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

/// Accept connections forever.
pub async fn serve(listener: TcpListener, portal: Arc<Portal>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let permit = match portal.core.gate.admit(peer.ip(), Door::iscsi(Link::Tcp)) {
                    Ok(p) => p,
                    Err(why @ Refusal::ShuttingDown) => {
                        tracing::debug!(%peer, "connection refused: {why}");
                        drop(stream);
                        continue;
                    }
                    Err(why) => {
                        portal.core.gate.log_refusal(peer, why);
                        drop(stream);
                        continue;
                    }
                };
                if has_data_waiting(&stream) {
                    // Its login is under way already: when the pending pool
                    // must make room, silent connections go first.
                    permit.heard_from();
                }
                let portal = portal.clone();
                tokio::spawn(async move {
                    if let Err(e) = run_connection(stream, peer, portal, permit).await {
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

async fn run_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    portal: Arc<Portal>,
    permit: Permit,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let local = stream.local_addr()?;
    tracing::debug!(%peer, "connection accepted");
    let control = SessionControl::new();
    permit.watch(control.clone());
    let stall_limit = portal.core.limits.output_stall_timeout;
    let mut conn = Connection::tcp(
        portal,
        ConnInfo { local, peer },
        control.clone(),
        Instant::now(),
    );
    let mut rx = RxBuffer::new();
    let mut out = Output::default();
    let result = loop {
        if out.is_empty() {
            out.fill(&mut conn);
        }
        if !out.is_empty() {
            // Output first, and no PDU is read until it is written: a peer
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
                            conn.portal().core.counters.limit_hit(LimitHit::OutputStall);
                            tracing::warn!(%peer, "no output progress for {limit:?}: the initiator reads nothing; closing the connection");
                        }
                        break Ok(());
                    }
                    conn.handle(now, Input::Timeout);
                }
                _ = control.terminated(), if !conn.termination_seen() => {
                    conn.handle(Instant::now(), Input::Terminated);
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
                conn.handle(Instant::now(), Input::Terminated);
                if !conn.has_ended() {
                    out.closing = false;
                    continue;
                }
            }
            break Ok(());
        }
        if control.is_terminated() && !conn.termination_seen() {
            conn.handle(Instant::now(), Input::Terminated);
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
                    let result = process_pdus(&mut conn, &mut rx);
                    if let Err(e) = result {
                        if !matches!(e, RxError::Closed) {
                            tracing::info!(%peer, "closing connection: {e}");
                        }
                        // What the engine queued (a Reject, Data-In before
                        // the error) still goes out, then the connection ends.
                        out.close_after_queued(&mut conn);
                    }
                }
                Err(e) => break Err(e),
            },
            _ = sleep_until(deadline) => conn.handle(Instant::now(), Input::Timeout),
            _ = control.terminated(), if !conn.termination_seen() => {
                conn.handle(Instant::now(), Input::Terminated);
                if conn.has_ended() {
                    break Ok(());
                }
            }
        }
    };
    conn.handle(Instant::now(), Input::Closed);
    result
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// Output is encoded in batches of about this size; the engine keeps the rest
/// queued (a READ's Data-In as a cursor, not as bytes).
const OUTPUT_BATCH: usize = 1 << 20;
/// How long the last output of a closing connection may take.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// Bytes encoded from the engine's actions, being written.
struct Output {
    buf: Vec<u8>,
    written: usize,
    /// The engine asked to close: send what is encoded, then end.
    closing: bool,
    /// The engine's queue is written out, then the connection ends.
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

    fn advance(&mut self, n: usize, conn: &mut Connection) {
        let now = Instant::now();
        self.written += n;
        self.last_progress = now;
        if self.is_empty() {
            self.buf.clear();
            self.written = 0;
            if !self.served.is_empty() {
                let at_raw = metrics::clock().raw();
                for served in self.served.drain(..) {
                    conn.handle(now, Input::Served { served, at_raw });
                }
            }
        }
    }

    /// Encode queued actions until about a batch is ready.
    fn fill(&mut self, conn: &mut Connection) {
        if self.closing {
            return;
        }
        if self.buf.capacity() > 4 * OUTPUT_BATCH && self.buf.is_empty() {
            // One oversized PDU grew the buffer: give the memory back.
            self.buf = Vec::with_capacity(64 * 1024);
        }
        self.last_progress = Instant::now();
        // Over TCP nothing is set up per session: the events are read only
        // so the connection does not keep them.
        while let Some(Event::NormalSession { .. }) = conn.poll_event() {}
        while self.buf.len() < OUTPUT_BATCH && self.served.len() < SERVED_PER_BATCH {
            let Some(action) = conn.poll_action() else {
                self.closing |= self.close_when_drained;
                return;
            };
            match action {
                Action::Send(pdu) => {
                    if !encode_pdu(conn, &pdu, &mut self.buf) {
                        // Never put anything else where LUN data should be.
                        tracing::error!(
                            "Data-In names bytes outside the LUN; closing the connection"
                        );
                        self.closing = true;
                        return;
                    }
                    if let Some(s) = pdu.served {
                        self.served.push(s);
                    }
                }
                Action::RdmaWrite { .. } | Action::RdmaRead { .. } => {
                    // A TCP connection's engine never asks for RDMA.
                    tracing::error!("RDMA action on a TCP connection; closing it");
                    self.closing = true;
                    return;
                }
                Action::Close => {
                    self.closing = true;
                    return;
                }
            }
        }
    }

    /// End the connection once what the engine already queued is written.
    fn close_after_queued(&mut self, conn: &mut Connection) {
        self.close_when_drained = true;
        if self.is_empty() {
            self.fill(conn);
        }
    }
}

/// Append one PDU to `wbuf`; false (and `wbuf` unchanged) when its LUN data
/// cannot be read.
pub fn encode_pdu(conn: &Connection, pdu: &OutPdu, wbuf: &mut Vec<u8>) -> bool {
    let digests = Digests {
        header: pdu.header_digest,
        data: pdu.data_digest,
    };
    let encoded = frame::encode_filled(&pdu.bhs, &[], pdu.data.len(), digests, wbuf, |dst| {
        pdu.data.fill(&conn.portal().core.volumes, dst)
    });
    // The engine builds no PDU the framing cannot carry: its data segments
    // stay within the negotiated MaxRecvDataSegmentLength.
    encoded.unwrap_or(false)
}

/// A receive buffer that holds at least one whole PDU.
struct RxBuffer {
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
    fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }
    fn filled(&mut self, n: usize) {
        self.end += n;
    }
    /// Make room for at least `need` unread bytes, then return the free tail.
    fn reserve(&mut self, need: usize) {
        if self.start > 0 && self.buf.len() - self.start < need.max(BHS_LEN) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() < need {
            self.buf.resize(need, 0);
        }
    }
    fn spare(&mut self) -> &mut [u8] {
        if self.end == self.buf.len() {
            self.reserve(self.end - self.start + 4096);
        }
        &mut self.buf[self.end..]
    }
}

#[derive(Debug, thiserror::Error)]
enum RxError {
    #[error(transparent)]
    Framing(#[from] DeframeError),
    #[error("engine closed the connection")]
    Closed,
}

/// Hand every complete PDU in the buffer to the engine.
fn process_pdus(conn: &mut Connection, rx: &mut RxBuffer) -> Result<(), RxError> {
    loop {
        if conn.is_closed() {
            return Err(RxError::Closed);
        }
        let rules = RxRules {
            digests: conn.rx_digests(),
            max_data_len: conn.max_rx_data_segment(),
        };
        let frame = match frame::deframe(rx.data(), rules) {
            Ok(Deframed::Pdu(frame)) => frame,
            Ok(Deframed::Incomplete { need }) => {
                rx.reserve(need.max(BHS_LEN + MAX_AHS));
                return Ok(());
            }
            Err(e) => {
                if let DeframeError::Oversized { bhs, .. } = &e {
                    conn.handle(Instant::now(), Input::Oversized(bhs));
                }
                return Err(e.into());
            }
        };
        let now = Instant::now();
        // Unknown opcodes reach the engine too: it answers them with a Reject.
        if frame.data_digest_ok {
            conn.handle(now, Input::pdu(&frame.bhs, frame.ahs, frame.data));
        } else {
            conn.handle(now, Input::DataDigestError(&frame.bhs));
        }
        rx.consume(frame.wire_len);
    }
}
