//! iSCSI over the TCP transport: PDU framing in and out of the engine, and
//! the portal as the front end TCP listeners serve.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::frame::{self, DeframeError, Deframed, Digests, RxRules};
use ramslog_common::iscsi::BHS_LEN;

use crate::admission::{Door, Link, SessionControl};
use crate::core::Core;
use crate::metrics::Served;
use crate::tcp::{Batch, Fill, ReceiveError, RxBuffer, TcpFrontEnd, TcpSession};

use super::engine::{Action, ConnInfo, Connection, Event, Input, OutPdu};
use super::portal::Portal;

/// Largest AHS the 8-bit TotalAHSLength field allows.
const MAX_AHS: usize = 255 * 4;

impl TcpFrontEnd for Portal {
    type Session = Connection;

    fn door(&self) -> Door {
        Door::iscsi(Link::Tcp)
    }

    fn core(&self) -> &Arc<Core> {
        &self.core
    }

    fn open(
        self: &Arc<Self>,
        local: SocketAddr,
        peer: SocketAddr,
        control: Arc<SessionControl>,
        now: Instant,
    ) -> Connection {
        Connection::tcp(self.clone(), ConnInfo { local, peer }, control, now)
    }
}

impl TcpSession for Connection {
    /// Hand every complete PDU in the buffer to the engine.
    fn receive(&mut self, rx: &mut RxBuffer) -> Result<(), ReceiveError> {
        loop {
            if self.is_closed() {
                return Err(ReceiveError::Closed);
            }
            let rules = RxRules {
                digests: self.rx_digests(),
                max_data_len: self.max_rx_data_segment(),
            };
            let frame = match frame::deframe(rx.data(), rules) {
                Ok(Deframed::Pdu(frame)) => frame,
                Ok(Deframed::Incomplete { need }) => {
                    rx.reserve(need.max(BHS_LEN + MAX_AHS));
                    return Ok(());
                }
                Err(e) => {
                    if let DeframeError::Oversized { bhs, .. } = &e {
                        self.handle(Instant::now(), Input::Oversized(bhs));
                    }
                    return Err(ReceiveError::Framing(Box::new(e)));
                }
            };
            let now = Instant::now();
            // Unknown opcodes reach the engine too: it answers them with a Reject.
            if frame.data_digest_ok {
                self.handle(now, Input::pdu(&frame.bhs, frame.ahs, frame.data));
            } else {
                self.handle(now, Input::DataDigestError(&frame.bhs));
            }
            rx.consume(frame.wire_len);
        }
    }

    fn fill(&mut self, batch: &mut Batch<'_>) -> Fill {
        // Over TCP nothing is set up per session: the events are read only
        // so the connection does not keep them.
        while let Some(Event::NormalSession { .. }) = self.poll_event() {}
        while !batch.is_full() {
            let Some(action) = self.poll_action() else {
                return Fill::Drained;
            };
            match action {
                Action::Send(pdu) => {
                    if !encode_pdu(self, &pdu, batch.buf()) {
                        // Never put anything else where LUN data should be.
                        tracing::error!(
                            "Data-In names bytes outside the LUN; closing the connection"
                        );
                        return Fill::Close;
                    }
                    if let Some(s) = pdu.served {
                        batch.served(s);
                    }
                }
                Action::RdmaWrite { .. } | Action::RdmaRead { .. } => {
                    // A TCP connection's engine never asks for RDMA.
                    tracing::error!("RDMA action on a TCP connection; closing it");
                    return Fill::Close;
                }
                Action::Close => return Fill::Close,
            }
        }
        Fill::Full
    }

    fn served(&mut self, now: Instant, served: Served, at_raw: u64) {
        self.handle(now, Input::Served { served, at_raw });
    }

    fn poll_timeout(&self) -> Option<Instant> {
        Connection::poll_timeout(self)
    }

    fn timeout(&mut self, now: Instant) {
        self.handle(now, Input::Timeout);
    }

    fn terminated(&mut self, now: Instant) {
        self.handle(now, Input::Terminated);
    }

    fn termination_seen(&self) -> bool {
        Connection::termination_seen(self)
    }

    fn has_ended(&self) -> bool {
        Connection::has_ended(self)
    }

    fn closed(&mut self, now: Instant) {
        self.handle(now, Input::Closed);
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
