//! One iSCSI/TCP connection: login, raw PDUs, sequence numbers.

use std::net::SocketAddr;
use std::time::Duration;

use ramslog_common::iscsi::{login, Bhs, Opcode, RESERVED_TAG};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::chap;
use crate::login::{
    answer_target_offer, chap_answer, decode_keys, encode_keys, get, random_isid, LoginOutcome,
    LoginParams, Negotiated,
};
use crate::pdu::{Digests, Pdu, PduReader, PduWriter, LOGIN_MAX_DATA};
use crate::seq::SeqState;
use crate::Error;

pub const DEFAULT_PORT: u16 = 3260;

/// Upper bound on login round trips in one stage before giving up on the target.
const MAX_LOGIN_ROUNDS: usize = 16;

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

struct LoginReply {
    transit: bool,
    nsg: u8,
    tsih: u16,
    keys: Vec<(String, String)>,
}

impl Connection {
    pub async fn connect(addr: SocketAddr) -> std::io::Result<Connection> {
        let s = TcpStream::connect(addr).await?;
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
        p.validate()?;
        self.isid = p.isid.unwrap_or_else(random_isid);
        self.tsih = p.tsih;
        self.cid = p.cid;
        self.reader.digests = Digests::default();
        self.writer.digests = Digests::default();
        self.reader.max_data_len = LOGIN_MAX_DATA;
        let itt = self.next_itt();
        if self.seq.next_cmdsn == 0 {
            self.seq.next_cmdsn = rand::random::<u32>() & 0xffff;
        }
        let mut neg = Negotiated::defaults(p.max_recv_data_segment_length);
        let sec_keys = p.security_keys();
        let mut first = true;

        // --- security stage ---
        let mut reply = match &p.chap {
            None => {
                let r = self
                    .login_exchange(
                        itt,
                        login::STAGE_SECURITY,
                        login::STAGE_OPERATIONAL,
                        true,
                        &sec_keys,
                        &mut first,
                    )
                    .await?;
                if let Some(m) = get(&r.keys, "AuthMethod") {
                    if m != "None" {
                        return Err(Error::Auth(format!(
                            "target chose AuthMethod={m} though we offered None"
                        )));
                    }
                }
                r
            }
            Some(chap) => {
                let r = self
                    .login_exchange(
                        itt,
                        login::STAGE_SECURITY,
                        login::STAGE_OPERATIONAL,
                        false,
                        &sec_keys,
                        &mut first,
                    )
                    .await?;
                record(&mut neg, p, &r.keys)?;
                match get(&r.keys, "AuthMethod") {
                    Some("CHAP") => {}
                    other => {
                        return Err(Error::Auth(format!(
                            "target answered AuthMethod={other:?} to our CHAP"
                        )))
                    }
                }
                let r = self
                    .login_exchange(
                        itt,
                        login::STAGE_SECURITY,
                        login::STAGE_OPERATIONAL,
                        false,
                        &[("CHAP_A".into(), "5".into())],
                        &mut first,
                    )
                    .await?;
                record(&mut neg, p, &r.keys)?;
                if get(&r.keys, "CHAP_A") != Some("5") {
                    return Err(Error::Auth(format!(
                        "target answered CHAP_A={:?}, we offered 5 (MD5)",
                        get(&r.keys, "CHAP_A")
                    )));
                }
                let (id, c) = match (get(&r.keys, "CHAP_I"), get(&r.keys, "CHAP_C")) {
                    (Some(i), Some(c)) => (i, c),
                    _ => return Err(Error::Auth("target sent no CHAP_I/CHAP_C".into())),
                };
                let (their_challenge, resp) = chap_answer(&chap.initiator, id, c)?;
                let mut keys = vec![
                    ("CHAP_N".to_string(), chap.initiator.name.clone()),
                    ("CHAP_R".to_string(), chap::encode_hex(&resp)),
                ];
                let mut mutual = None;
                if let Some(m) = &chap.mutual {
                    let our_id: u8 = rand::random();
                    let mut our_c: [u8; 16] = rand::random();
                    if our_c[..] == their_challenge[..] {
                        our_c[0] ^= 0xff;
                    }
                    keys.push(("CHAP_I".into(), our_id.to_string()));
                    keys.push(("CHAP_C".into(), chap::encode_hex(&our_c)));
                    mutual = Some((m, chap::response(our_id, &m.secret, &our_c)));
                }
                let r = self
                    .login_exchange(
                        itt,
                        login::STAGE_SECURITY,
                        login::STAGE_OPERATIONAL,
                        true,
                        &keys,
                        &mut first,
                    )
                    .await?;
                if let Some((m, expect)) = mutual {
                    let name = get(&r.keys, "CHAP_N");
                    let got = get(&r.keys, "CHAP_R");
                    if name != Some(m.name.as_str()) {
                        return Err(Error::Auth(format!(
                            "mutual CHAP: target named itself {name:?}, expected {:?}",
                            m.name
                        )));
                    }
                    let got = chap::decode_binary(got.unwrap_or(""))
                        .map_err(|_| Error::Auth("mutual CHAP: no valid CHAP_R".into()))?;
                    if got[..] != expect[..] {
                        return Err(Error::Auth("mutual CHAP: target's CHAP_R is wrong".into()));
                    }
                }
                r
            }
        };
        let mut rounds = 0;
        while !reply.transit {
            record(&mut neg, p, &reply.keys)?;
            rounds += 1;
            if rounds > MAX_LOGIN_ROUNDS {
                return Err(Error::proto("security stage does not end"));
            }
            reply = self
                .login_exchange(
                    itt,
                    login::STAGE_SECURITY,
                    login::STAGE_OPERATIONAL,
                    true,
                    &[],
                    &mut first,
                )
                .await?;
        }
        record(&mut neg, p, &reply.keys)?;
        if reply.nsg != login::STAGE_OPERATIONAL {
            return Err(Error::proto(format!(
                "target moved to stage {} after the security stage; we asked for 1",
                reply.nsg
            )));
        }

        // --- operational stage ---
        let mut keys = p.operational_keys();
        let offered: Vec<String> = keys.iter().map(|(k, _)| k.clone()).collect();
        let mut answered: Vec<String> = Vec::new();
        let mut rounds = 0;
        loop {
            let r = self
                .login_exchange(
                    itt,
                    login::STAGE_OPERATIONAL,
                    login::STAGE_FULL_FEATURE,
                    true,
                    &keys,
                    &mut first,
                )
                .await?;
            keys.clear();
            for (k, v) in &r.keys {
                if offered.contains(k) || answered.contains(k) {
                    neg.apply(p, k, v)?;
                } else if let Some(ans) = answer_target_offer(k, v) {
                    neg.apply(p, k, &ans)?;
                    keys.push((k.clone(), ans));
                    answered.push(k.clone());
                } else {
                    neg.apply(p, k, v)?;
                }
            }
            if r.transit && keys.is_empty() {
                if r.nsg != login::STAGE_FULL_FEATURE {
                    return Err(Error::proto(format!(
                        "target ended login in stage {}; we asked for full feature (3)",
                        r.nsg
                    )));
                }
                self.tsih = r.tsih;
                break;
            }
            rounds += 1;
            if rounds > MAX_LOGIN_ROUNDS {
                return Err(Error::proto("operational stage does not end"));
            }
        }
        if self.tsih == 0 {
            return Err(Error::proto("final login response carries TSIH 0"));
        }
        neg.finish()?;
        self.writer.digests = Digests {
            header: neg.header_digest,
            data: neg.data_digest,
        };
        self.reader.digests = self.writer.digests;
        self.reader.max_data_len = neg.max_recv_data_segment_length;
        self.negotiated = Some(neg.clone());
        Ok(LoginOutcome {
            tsih: self.tsih,
            isid: self.isid,
            negotiated: neg,
        })
    }

    /// One login request/response exchange, splitting our text over several
    /// PDUs (C bit) when it exceeds 8192 bytes and collecting the target's
    /// continued responses.
    #[allow(clippy::too_many_arguments)]
    async fn login_exchange(
        &mut self,
        itt: u32,
        csg: u8,
        nsg: u8,
        transit: bool,
        keys: &[(String, String)],
        first: &mut bool,
    ) -> Result<LoginReply, Error> {
        let text = encode_keys(keys);
        let chunks: Vec<&[u8]> = if text.is_empty() {
            vec![&[][..]]
        } else {
            text.chunks(LOGIN_MAX_DATA as usize).collect()
        };
        let n = chunks.len();
        let mut last_resp = None;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let more = i + 1 < n;
            let t = transit && !more;
            let rsp = self.login_pdu(itt, csg, nsg, t, more, chunk, first).await?;
            if more {
                if !rsp.data.is_empty() || rsp.bhs.flags() & login::TRANSIT != 0 {
                    return Err(Error::proto(
                        "target answered a continued login request with data or T=1",
                    ));
                }
            } else {
                last_resp = Some(rsp);
            }
        }
        let mut rsp = last_resp.ok_or_else(|| Error::proto("no login response"))?;
        let mut data = std::mem::take(&mut rsp.data);
        let mut rounds = 0;
        while rsp.bhs.flags() & login::CONTINUE != 0 {
            if rsp.bhs.flags() & login::TRANSIT != 0 {
                return Err(Error::proto("login response with both C and T set"));
            }
            rounds += 1;
            if data.len() > 1024 * 1024 || rounds > 1024 {
                return Err(Error::proto("login response continues without end"));
            }
            rsp = self
                .login_pdu(itt, csg, nsg, transit, false, &[], first)
                .await?;
            data.extend_from_slice(&rsp.data);
        }
        let f = rsp.bhs.flags();
        let transit_set = f & login::TRANSIT != 0;
        if transit_set && !transit {
            return Err(Error::proto(
                "target set T in a login response though we did not",
            ));
        }
        if transit_set && login::nsg(f) > nsg {
            return Err(Error::proto(format!(
                "target's NSG {} is beyond the {} we asked for",
                login::nsg(f),
                nsg
            )));
        }
        Ok(LoginReply {
            transit: transit_set,
            nsg: login::nsg(f),
            tsih: rsp.bhs.tsih(),
            keys: decode_keys(&data)?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn login_pdu(
        &mut self,
        itt: u32,
        csg: u8,
        nsg: u8,
        transit: bool,
        more: bool,
        data: &[u8],
        first: &mut bool,
    ) -> Result<Pdu, Error> {
        let mut b = Bhs::new(Opcode::LoginRequest);
        b.set_immediate(true);
        let mut flags = csg << 2;
        if transit {
            flags |= login::TRANSIT | nsg;
        }
        if more {
            flags |= login::CONTINUE;
        }
        b.set_flags(flags);
        b.0[2] = 0; // Version-max
        b.0[3] = 0; // Version-min
        b.0[8..14].copy_from_slice(&self.isid);
        b.set_tsih(self.tsih);
        b.set_itt(itt);
        b.set_u16_at(20, self.cid);
        b.set_cmdsn(self.seq.next_cmdsn);
        b.set_exp_statsn(if *first { 0 } else { self.seq.exp_statsn });
        self.writer.write_pdu(&b, &[], data).await?;
        let rsp = self.reader.read_pdu().await?;
        if rsp.bhs.opcode() != Some(Opcode::LoginResponse) {
            return Err(Error::proto(format!(
                "expected a Login Response, got opcode {:#04x}",
                rsp.bhs.raw_opcode()
            )));
        }
        let class = rsp.bhs.0[36];
        let detail = rsp.bhs.0[37];
        if class != 0 {
            return Err(Error::LoginFailed { class, detail });
        }
        if rsp.bhs.itt() != itt {
            return Err(Error::proto(format!(
                "login response ITT {:#x}, expected {itt:#x}",
                rsp.bhs.itt()
            )));
        }
        if rsp.bhs.0[3] != 0 {
            return Err(Error::proto(format!(
                "login response Version-active {}",
                rsp.bhs.0[3]
            )));
        }
        if rsp.bhs.isid() != self.isid {
            return Err(Error::proto("login response carries another ISID"));
        }
        if login::csg(rsp.bhs.flags()) != csg {
            return Err(Error::proto(format!(
                "login response CSG {}, ours is {csg}",
                login::csg(rsp.bhs.flags())
            )));
        }
        *first = false;
        self.seq.on_target_pdu(&rsp.bhs);
        Ok(rsp)
    }

    // ---------- full feature helpers ----------

    /// Text request (non-immediate) with continuation handling: follows the
    /// target's C bit / TTT until the final response. NOP-In pings that
    /// arrive meanwhile are answered.
    pub async fn text_request(
        &mut self,
        keys: &[(String, String)],
    ) -> Result<Vec<(String, String)>, Error> {
        let itt = self.next_itt();
        let mut ttt = RESERVED_TAG;
        let mut payload = encode_keys(keys);
        let mut out = Vec::new();
        for _ in 0..4096 {
            let mut b = Bhs::new(Opcode::TextRequest);
            b.set_final(true).set_itt(itt).set_ttt(ttt);
            self.fill_sn(&mut b, false);
            self.send_pdu(&b, &[], &payload).await?;
            payload.clear();
            let rsp = loop {
                let p = self.recv_pdu().await?;
                match p.bhs.opcode() {
                    Some(Opcode::NopIn) => self.answer_nop_in(&p).await?,
                    Some(Opcode::AsyncMessage) => {
                        tracing::info!(event = p.bhs.0[36], "async message during text request")
                    }
                    Some(Opcode::Reject) => return Err(Error::Rejected { reason: p.bhs.0[2] }),
                    Some(Opcode::TextResponse) if p.bhs.itt() == itt => break p,
                    _ => {
                        return Err(Error::proto(format!(
                            "unexpected PDU {:?} during text request",
                            p.bhs
                        )))
                    }
                }
            };
            out.extend_from_slice(&rsp.data);
            if out.len() > 16 * 1024 * 1024 {
                return Err(Error::proto("text response without end"));
            }
            let f = rsp.bhs.flags();
            let fin = f & 0x80 != 0;
            let cont = f & 0x40 != 0;
            if fin && cont {
                return Err(Error::proto("text response with both F and C set"));
            }
            if fin {
                return decode_keys(&out);
            }
            ttt = rsp.bhs.ttt();
            if ttt == RESERVED_TAG {
                return Err(Error::proto(
                    "text response not final but its TTT is 0xffffffff",
                ));
            }
        }
        Err(Error::proto("text exchange does not end"))
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
                Some(Opcode::LogoutResponse) if p.bhs.itt() == itt => return Ok(p.bhs.0[2]),
                Some(Opcode::NopIn) => self.answer_nop_in(&p).await?,
                Some(Opcode::Reject) => return Err(Error::Rejected { reason: p.bhs.0[2] }),
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

fn record(neg: &mut Negotiated, p: &LoginParams, keys: &[(String, String)]) -> Result<(), Error> {
    for (k, v) in keys {
        if !k.starts_with("CHAP_") && k != "AuthMethod" {
            neg.apply(p, k, v)?;
        }
    }
    Ok(())
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
    b.set_u16_at(20, cid);
    b.set_cmdsn(cmdsn).set_exp_statsn(exp_statsn);
    b
}
