//! One iSCSI/TCP connection: login, raw PDUs, sequence numbers.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ramslog_common::iscsi::{Bhs, Opcode, RESERVED_TAG};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpSocket, TcpStream};

use crate::exchange::{LoginMachine, LoginStep, TextExchange};
use crate::login::{random_isid, LoginOutcome, LoginParams, Negotiated};
use crate::pdu::{Digests, Pdu, PduReader, PduWriter, LOGIN_MAX_DATA};
use crate::seq::SeqState;
use crate::Error;

pub const DEFAULT_PORT: u16 = 3260;

pub(crate) type Reader = PduReader<OwnedReadHalf>;
pub(crate) type Writer = PduWriter<OwnedWriteHalf>;

/// A single connection. Nothing here interprets SCSI; `send_pdu` sends exactly
/// the header given (apart from the two length fields), so tests can send
/// anything. Sequence numbers are tracked from every received PDU but only
/// used when the caller asks for them.
pub struct Connection {
    reader: Reader,
    writer: Writer,
    seq: SeqState,
    itt: u32,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    negotiated: Option<Negotiated>,
    peer: SocketAddr,
}

/// The parts a [`crate::Session`] takes over after login.
pub(crate) struct Parts {
    pub reader: Reader,
    pub writer: Writer,
    pub seq: SeqState,
    pub itt: u32,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub cid: u16,
    pub negotiated: Negotiated,
}

impl Connection {
    pub async fn connect(addr: SocketAddr) -> std::io::Result<Connection> {
        Connection::over(TcpStream::connect(addr).await?, addr)
    }

    /// Connect from the local address `local` (a test playing many hosts
    /// on the loopback network, 127.0.0.0/8).
    pub async fn connect_from(local: IpAddr, addr: SocketAddr) -> std::io::Result<Connection> {
        let socket = match local {
            IpAddr::V4(_) => TcpSocket::new_v4()?,
            IpAddr::V6(_) => TcpSocket::new_v6()?,
        };
        socket.bind(SocketAddr::new(local, 0))?;
        Connection::over(socket.connect(addr).await?, addr)
    }

    fn over(s: TcpStream, addr: SocketAddr) -> std::io::Result<Connection> {
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(Connection {
            reader: PduReader::new(r),
            writer: PduWriter::new(w),
            seq: SeqState::default(),
            itt: rand::random::<u32>() & 0x00ff_ffff,
            isid: random_isid(),
            tsih: 0,
            cid: 0,
            negotiated: None,
            peer: addr,
        })
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    // ---------- raw PDUs ----------

    /// Send one PDU. TotalAHSLength and DataSegmentLength are filled in from
    /// `ahs` and `data`; padding and negotiated digests are added.
    pub async fn send_pdu(&mut self, bhs: &Bhs, ahs: &[u8], data: &[u8]) -> Result<(), Error> {
        self.writer.write_pdu(bhs, ahs, data).await
    }

    /// Send bytes as they are.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.writer.write_raw(bytes).await
    }

    /// Receive one PDU, verifying digests and our MaxRecvDataSegmentLength,
    /// and update ExpStatSN / ExpCmdSN / MaxCmdSN from it.
    pub async fn recv_pdu(&mut self) -> Result<Pdu, Error> {
        let p = self.reader.read_pdu().await?;
        self.seq.on_target_pdu(&p.bhs);
        Ok(p)
    }

    /// Like [`Connection::recv_pdu`], `Ok(None)` if nothing complete arrived
    /// within `dur`. A clean EOF is `Err(Error::Closed)`. Cancel-safe: a PDU
    /// half received at the timeout stays buffered.
    pub async fn recv_pdu_timeout(&mut self, dur: Duration) -> Result<Option<Pdu>, Error> {
        match tokio::time::timeout(dur, self.recv_pdu()).await {
            Ok(r) => r.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Half-close the write side (FIN).
    pub async fn shutdown_write(&mut self) -> Result<(), Error> {
        self.writer.shutdown().await
    }

    // ---------- sequence numbers ----------

    /// CmdSN the next non-immediate command should carry (immediate PDUs carry it too, unadvanced).
    pub fn next_cmdsn(&self) -> u32 {
        self.seq.next_cmdsn
    }
    /// Return the CmdSN for a non-immediate command and advance.
    pub fn take_cmdsn(&mut self) -> u32 {
        self.seq.take_cmdsn()
    }
    pub fn set_next_cmdsn(&mut self, sn: u32) {
        self.seq.next_cmdsn = sn;
    }
    pub fn exp_statsn(&self) -> u32 {
        self.seq.exp_statsn
    }
    pub fn set_exp_statsn(&mut self, sn: u32) {
        self.seq.exp_statsn = sn;
    }
    pub fn exp_cmdsn(&self) -> u32 {
        self.seq.exp_cmdsn
    }
    pub fn max_cmdsn(&self) -> u32 {
        self.seq.max_cmdsn
    }
    pub fn seq(&self) -> SeqState {
        self.seq
    }
    /// A fresh initiator task tag (never 0xffffffff).
    pub fn next_itt(&mut self) -> u32 {
        self.itt = self.itt.wrapping_add(1);
        if self.itt == RESERVED_TAG {
            self.itt = 0;
        }
        self.itt
    }
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }
    pub fn isid(&self) -> [u8; 6] {
        self.isid
    }
    pub fn tsih(&self) -> u16 {
        self.tsih
    }
    pub fn cid(&self) -> u16 {
        self.cid
    }
    pub fn digests(&self) -> Digests {
        self.writer.digests
    }
    /// Override the digests used from now on, per direction (tests).
    pub fn set_digests(&mut self, send: Digests, recv: Digests) {
        self.writer.digests = send;
        self.reader.digests = recv;
    }
    /// Override the largest data segment accepted from the target.
    pub fn set_max_recv_data_len(&mut self, len: u32) {
        self.reader.max_data_len = len;
    }

    /// Fill CmdSN (taken and advanced unless `immediate`) and ExpStatSN.
    pub fn fill_sn(&mut self, bhs: &mut Bhs, immediate: bool) {
        bhs.set_immediate(immediate);
        let sn = if immediate {
            self.seq.next_cmdsn
        } else {
            self.seq.take_cmdsn()
        };
        bhs.set_cmdsn(sn).set_exp_statsn(self.seq.exp_statsn);
    }

    // ---------- login ----------

    /// Full login (RFC 7143 section 6): security stage (AuthMethod None or
    /// CHAP, optionally mutual), operational stage, full feature phase.
    pub async fn login(&mut self, p: &LoginParams) -> Result<LoginOutcome, Error> {
        self.tsih = p.tsih;
        self.cid = p.cid;
        self.reader.digests = Digests::default();
        self.writer.digests = Digests::default();
        self.reader.max_data_len = LOGIN_MAX_DATA;
        let itt = self.next_itt();
        let (mut m, mut b, mut data) = LoginMachine::start(p, itt, &mut self.seq)?;
        self.isid = m.isid();
        let outcome = loop {
            self.writer.write_pdu(&b, &[], &data).await?;
            let rsp = self.reader.read_pdu().await?;
            match m.handle(&rsp.bhs, &rsp.data, &mut self.seq)? {
                LoginStep::Send(nb, nd) => (b, data) = (nb, nd),
                LoginStep::Done(o) => break o,
            }
        };
        let neg = &outcome.negotiated;
        self.tsih = outcome.tsih;
        self.writer.digests = Digests {
            header: neg.header_digest,
            data: neg.data_digest,
        };
        self.reader.digests = self.writer.digests;
        self.reader.max_data_len = neg.max_recv_data_segment_length;
        self.negotiated = Some(neg.clone());
        Ok(outcome)
    }

    // ---------- full feature helpers ----------

    /// Text request (non-immediate) with continuation handling: follows the
    /// target's C bit / TTT until the final response. NOP-In pings that
    /// arrive meanwhile are answered.
    pub async fn text_request(
        &mut self,
        keys: &[(String, String)],
    ) -> Result<Vec<(String, String)>, Error> {
        let mut x = TextExchange::new(self.next_itt(), keys);
        loop {
            let (mut b, payload) = x.request()?;
            self.fill_sn(&mut b, false);
            self.send_pdu(&b, &[], &payload).await?;
            let rsp = loop {
                let p = self.recv_pdu().await?;
                match p.bhs.opcode() {
                    Some(Opcode::NopIn) => self.answer_nop_in(&p).await?,
                    Some(Opcode::AsyncMessage) => {
                        tracing::info!(
                            event = p.bhs.async_event().0,
                            "async message during text request"
                        )
                    }
                    Some(Opcode::Reject) => {
                        return Err(Error::Rejected {
                            reason: p.bhs.reject_reason(),
                        })
                    }
                    Some(Opcode::TextResponse) if p.bhs.itt() == x.itt() => break p,
                    _ => {
                        return Err(Error::proto(format!(
                            "unexpected PDU {:?} during text request",
                            p.bhs
                        )))
                    }
                }
            };
            if let Some(keys) = x.response(&rsp.bhs, &rsp.data)? {
                return Ok(keys);
            }
        }
    }

    /// Answer a NOP-In ping (TTT != 0xffffffff) with a NOP-Out echoing its data.
    pub async fn answer_nop_in(&mut self, p: &Pdu) -> Result<(), Error> {
        if p.bhs.ttt() == RESERVED_TAG {
            return Ok(());
        }
        let b = nop_out_reply(&p.bhs, self.seq.next_cmdsn, self.seq.exp_statsn);
        self.send_pdu(&b, &[], &p.data).await
    }

    /// Logout (reason 0: close the session); returns the Logout Response's
    /// response code (0 = success).
    pub async fn logout(&mut self) -> Result<u8, Error> {
        let itt = self.next_itt();
        let b = logout_request(itt, self.cid, self.seq.next_cmdsn, self.seq.exp_statsn);
        self.send_pdu(&b, &[], &[]).await?;
        loop {
            let p = self.recv_pdu().await?;
            match p.bhs.opcode() {
                Some(Opcode::LogoutResponse) if p.bhs.itt() == itt => return Ok(p.bhs.response()),
                Some(Opcode::NopIn) => self.answer_nop_in(&p).await?,
                Some(Opcode::Reject) => {
                    return Err(Error::Rejected {
                        reason: p.bhs.reject_reason(),
                    })
                }
                _ => tracing::debug!(bhs = ?p.bhs, "PDU ignored while logging out"),
            }
        }
    }

    pub(crate) fn into_parts(self) -> Result<Parts, Error> {
        let negotiated = self
            .negotiated
            .ok_or_else(|| Error::InvalidArgument("connection is not logged in".into()))?;
        Ok(Parts {
            reader: self.reader,
            writer: self.writer,
            seq: self.seq,
            itt: self.itt,
            isid: self.isid,
            tsih: self.tsih,
            cid: self.cid,
            negotiated,
        })
    }
}

/// NOP-Out answering a target ping: immediate, ITT reserved, TTT echoed.
pub(crate) fn nop_out_reply(nop_in: &Bhs, cmdsn: u32, exp_statsn: u32) -> Bhs {
    let mut b = Bhs::new(Opcode::NopOut);
    b.set_immediate(true);
    b.set_final(true)
        .set_lun(nop_in.lun())
        .set_itt(RESERVED_TAG)
        .set_ttt(nop_in.ttt())
        .set_cmdsn(cmdsn)
        .set_exp_statsn(exp_statsn);
    b
}

/// Logout Request, reason "close the session", immediate.
pub(crate) fn logout_request(itt: u32, cid: u16, cmdsn: u32, exp_statsn: u32) -> Bhs {
    let mut b = Bhs::new(Opcode::LogoutRequest);
    b.set_immediate(true);
    b.set_flags(0x80);
    b.set_itt(itt);
    b.set_cid(cid);
    b.set_cmdsn(cmdsn).set_exp_statsn(exp_statsn);
    b
}
