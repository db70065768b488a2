//! The login and text exchanges without I/O: each says which request PDU to
//! send next and takes the target's responses, so the TCP [`crate::Connection`]
//! and the iSER [`crate::iser::IserSession`] drive the same negotiation code
//! over their own transports.

use ramslog_common::iscsi::{login, Bhs, Opcode, RESERVED_TAG};

use crate::chap;
use crate::login::{
    answer_target_offer, chap_answer, decode_keys, encode_keys, get, random_isid, Credentials,
    LoginOutcome, LoginParams, Negotiated,
};
use crate::pdu::LOGIN_MAX_DATA;
use crate::seq::SeqState;
use crate::Error;

/// Upper bound on login round trips in one stage before giving up on the target.
const MAX_LOGIN_ROUNDS: usize = 16;

/// What to do after a login response.
#[derive(Debug)]
pub(crate) enum LoginStep {
    /// Send this Login Request (its data segment follows) and feed the answer back.
    Send(Bhs, Vec<u8>),
    /// Login complete: the session is in full feature phase.
    Done(LoginOutcome),
}

/// One login request/response exchange: our text, split over several PDUs
/// (C bit) when it exceeds 8192 bytes, and the target's text, collected over
/// its continued responses.
struct Exchange {
    csg: u8,
    nsg: u8,
    transit: bool,
    text: Vec<u8>,
    /// Bytes of `text` the target has acknowledged.
    sent: usize,
    /// Bytes of `text` in the request in flight.
    in_flight: usize,
    /// The target's text so far (continued responses).
    gathered: Vec<u8>,
    /// Set once our text is all sent: we are collecting the answer.
    gathering: bool,
    rounds: usize,
}

impl Exchange {
    fn new(csg: u8, nsg: u8, transit: bool, keys: &[(String, String)]) -> Exchange {
        Exchange {
            csg,
            nsg,
            transit,
            text: encode_keys(keys),
            sent: 0,
            in_flight: 0,
            gathered: Vec::new(),
            gathering: false,
            rounds: 0,
        }
    }
}

/// The target's complete answer to one exchange.
struct LoginReply {
    transit: bool,
    nsg: u8,
    tsih: u16,
    keys: Vec<(String, String)>,
}

/// Where the login stands between exchanges.
enum Stage {
    /// Security stage, first exchange (AuthMethod offered).
    SecOffer,
    /// CHAP: we sent CHAP_A.
    ChapAlgorithm,
    /// CHAP: we sent CHAP_N/CHAP_R (and our own challenge when mutual).
    ChapResponse {
        mutual: Option<(Credentials, [u8; 16])>,
    },
    /// Security stage: waiting for the target to agree to move on.
    SecFinish {
        rounds: usize,
    },
    Operational {
        offered: Vec<String>,
        answered: Vec<String>,
        rounds: usize,
    },
    Done,
}

/// A full login (RFC 7143 section 6): security stage (AuthMethod None or
/// CHAP, optionally mutual), operational stage, full feature phase.
pub(crate) struct LoginMachine {
    p: LoginParams,
    itt: u32,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    /// No response seen yet: ExpStatSN is 0 in the first request.
    first: bool,
    neg: Negotiated,
    stage: Stage,
    ex: Exchange,
}

impl LoginMachine {
    /// Start a login with task tag `itt`; returns the machine and the first
    /// Login Request. Picks a CmdSN if `seq` has none yet.
    pub(crate) fn start(
        p: &LoginParams,
        itt: u32,
        seq: &mut SeqState,
    ) -> Result<(LoginMachine, Bhs, Vec<u8>), Error> {
        p.validate()?;
        if seq.next_cmdsn == 0 {
            seq.next_cmdsn = rand::random::<u32>() & 0xffff;
        }
        // With CHAP the first exchange only offers the method (T=0).
        let transit = p.chap.is_none();
        let ex = Exchange::new(
            login::STAGE_SECURITY,
            login::STAGE_OPERATIONAL,
            transit,
            &p.security_keys(),
        );
        let mut m = LoginMachine {
            p: p.clone(),
            itt,
            isid: p.isid.unwrap_or_else(random_isid),
            tsih: p.tsih,
            cid: p.cid,
            first: true,
            neg: Negotiated::defaults(p.max_recv_data_segment_length),
            stage: Stage::SecOffer,
            ex,
        };
        let (b, d) = m.request(seq);
        Ok((m, b, d))
    }

    pub(crate) fn isid(&self) -> [u8; 6] {
        self.isid
    }

    /// The next request of the current exchange.
    fn request(&mut self, seq: &SeqState) -> (Bhs, Vec<u8>) {
        let ex = &mut self.ex;
        let (chunk, more) = if ex.gathering {
            (&[][..], false)
        } else {
            let end = (ex.sent + LOGIN_MAX_DATA as usize).min(ex.text.len());
            (&ex.text[ex.sent..end], end < ex.text.len())
        };
        ex.in_flight = chunk.len();
        let mut b = Bhs::new(Opcode::LoginRequest);
        b.set_immediate(true);
        let mut flags = ex.csg << 2;
        if ex.transit && !more {
            flags |= login::TRANSIT | ex.nsg;
        }
        if more {
            flags |= login::CONTINUE;
        }
        b.set_flags(flags);
        b.set_versions(0, 0).set_isid(self.isid);
        b.set_tsih(self.tsih);
        b.set_itt(self.itt);
        b.set_cid(self.cid);
        b.set_cmdsn(seq.next_cmdsn);
        b.set_exp_statsn(if self.first { 0 } else { seq.exp_statsn });
        let data = chunk.to_vec();
        (b, data)
    }

    /// Take the target's answer to the last request.
    pub(crate) fn handle(
        &mut self,
        rsp: &Bhs,
        data: &[u8],
        seq: &mut SeqState,
    ) -> Result<LoginStep, Error> {
        if matches!(self.stage, Stage::Done) {
            return Err(Error::proto("login response after the login ended"));
        }
        self.check_response(rsp)?;
        self.first = false;
        seq.on_target_pdu(rsp);
        let f = rsp.flags();
        let ex = &mut self.ex;
        if !ex.gathering {
            ex.sent += ex.in_flight;
            if ex.sent < ex.text.len() {
                // The target acknowledged one piece of our continued text.
                if !data.is_empty() || f & login::TRANSIT != 0 {
                    return Err(Error::proto(
                        "target answered a continued login request with data or T=1",
                    ));
                }
                return Ok(self.send(seq));
            }
            ex.gathering = true;
        }
        ex.gathered.extend_from_slice(data);
        if f & login::CONTINUE != 0 {
            if f & login::TRANSIT != 0 {
                return Err(Error::proto("login response with both C and T set"));
            }
            ex.rounds += 1;
            if ex.gathered.len() > 1024 * 1024 || ex.rounds > 1024 {
                return Err(Error::proto("login response continues without end"));
            }
            return Ok(self.send(seq));
        }
        let transit_set = f & login::TRANSIT != 0;
        if transit_set && !ex.transit {
            return Err(Error::proto(
                "target set T in a login response though we did not",
            ));
        }
        if transit_set && login::nsg(f) > ex.nsg {
            return Err(Error::proto(format!(
                "target's NSG {} is beyond the {} we asked for",
                login::nsg(f),
                ex.nsg
            )));
        }
        let reply = LoginReply {
            transit: transit_set,
            nsg: login::nsg(f),
            tsih: rsp.tsih(),
            keys: decode_keys(&ex.gathered)?,
        };
        match self.on_reply(reply)? {
            Some(outcome) => Ok(LoginStep::Done(outcome)),
            None => Ok(self.send(seq)),
        }
    }

    fn send(&mut self, seq: &SeqState) -> LoginStep {
        let (b, d) = self.request(seq);
        LoginStep::Send(b, d)
    }

    fn check_response(&self, rsp: &Bhs) -> Result<(), Error> {
        if rsp.opcode() != Some(Opcode::LoginResponse) {
            return Err(Error::proto(format!(
                "expected a Login Response, got opcode {:#04x}",
                rsp.raw_opcode()
            )));
        }
        let [class, detail] = rsp.login_status().to_be_bytes();
        if class != 0 {
            return Err(Error::LoginFailed { class, detail });
        }
        if rsp.itt() != self.itt {
            return Err(Error::proto(format!(
                "login response ITT {:#x}, expected {:#x}",
                rsp.itt(),
                self.itt
            )));
        }
        if rsp.version_active() != 0 {
            return Err(Error::proto(format!(
                "login response Version-active {}",
                rsp.version_active()
            )));
        }
        if rsp.isid() != self.isid {
            return Err(Error::proto("login response carries another ISID"));
        }
        if login::csg(rsp.flags()) != self.ex.csg {
            return Err(Error::proto(format!(
                "login response CSG {}, ours is {}",
                login::csg(rsp.flags()),
                self.ex.csg
            )));
        }
        Ok(())
    }

    fn next_exchange(&mut self, csg: u8, nsg: u8, transit: bool, keys: &[(String, String)]) {
        self.ex = Exchange::new(csg, nsg, transit, keys);
    }

    /// A complete answer: decide the next exchange (None returned) or finish.
    fn on_reply(&mut self, r: LoginReply) -> Result<Option<LoginOutcome>, Error> {
        const SEC: u8 = login::STAGE_SECURITY;
        const OP: u8 = login::STAGE_OPERATIONAL;
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::SecOffer if self.p.chap.is_none() => {
                if let Some(m) = get(&r.keys, "AuthMethod") {
                    if m != "None" {
                        return Err(Error::Auth(format!(
                            "target chose AuthMethod={m} though we offered None"
                        )));
                    }
                }
                self.security_reply(r, 0)
            }
            Stage::SecOffer => {
                record(&mut self.neg, &self.p, &r.keys)?;
                match get(&r.keys, "AuthMethod") {
                    Some("CHAP") => {}
                    other => {
                        return Err(Error::Auth(format!(
                            "target answered AuthMethod={other:?} to our CHAP"
                        )))
                    }
                }
                self.stage = Stage::ChapAlgorithm;
                self.next_exchange(SEC, OP, false, &[("CHAP_A".into(), "5".into())]);
                Ok(None)
            }
            Stage::ChapAlgorithm => {
                record(&mut self.neg, &self.p, &r.keys)?;
                let Some(chap) = self.p.chap.clone() else {
                    return Err(Error::Auth("CHAP state without CHAP parameters".into()));
                };
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
                if let Some(m) = chap.mutual {
                    let our_id: u8 = rand::random();
                    let mut our_c: [u8; 16] = rand::random();
                    if our_c[..] == their_challenge[..] {
                        our_c[0] ^= 0xff;
                    }
                    keys.push(("CHAP_I".into(), our_id.to_string()));
                    keys.push(("CHAP_C".into(), chap::encode_hex(&our_c)));
                    let expect = chap::response(our_id, &m.secret, &our_c);
                    mutual = Some((m, expect));
                }
                self.stage = Stage::ChapResponse { mutual };
                self.next_exchange(SEC, OP, true, &keys);
                Ok(None)
            }
            Stage::ChapResponse { mutual } => {
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
                self.security_reply(r, 0)
            }
            Stage::SecFinish { rounds } => self.security_reply(r, rounds),
            Stage::Operational {
                offered,
                mut answered,
                mut rounds,
            } => {
                let mut keys = Vec::new();
                for (k, v) in &r.keys {
                    if offered.contains(k) || answered.contains(k) {
                        self.neg.apply(&self.p, k, v)?;
                    } else if let Some(ans) = answer_target_offer(k, v) {
                        self.neg.apply(&self.p, k, &ans)?;
                        keys.push((k.clone(), ans));
                        answered.push(k.clone());
                    } else {
                        self.neg.apply(&self.p, k, v)?;
                    }
                }
                if r.transit && keys.is_empty() {
                    if r.nsg != login::STAGE_FULL_FEATURE {
                        return Err(Error::proto(format!(
                            "target ended login in stage {}; we asked for full feature (3)",
                            r.nsg
                        )));
                    }
                    if r.tsih == 0 {
                        return Err(Error::proto("final login response carries TSIH 0"));
                    }
                    self.neg.finish()?;
                    return Ok(Some(LoginOutcome {
                        tsih: r.tsih,
                        isid: self.isid,
                        negotiated: self.neg.clone(),
                    }));
                }
                rounds += 1;
                if rounds > MAX_LOGIN_ROUNDS {
                    return Err(Error::proto("operational stage does not end"));
                }
                self.stage = Stage::Operational {
                    offered,
                    answered,
                    rounds,
                };
                self.next_exchange(OP, login::STAGE_FULL_FEATURE, true, &keys);
                Ok(None)
            }
            Stage::Done => Err(Error::proto("login response after the login ended")),
        }
    }

    /// The security stage's answer: wait for the target's T bit, then offer
    /// the operational keys.
    fn security_reply(
        &mut self,
        r: LoginReply,
        rounds: usize,
    ) -> Result<Option<LoginOutcome>, Error> {
        record(&mut self.neg, &self.p, &r.keys)?;
        if !r.transit {
            let rounds = rounds + 1;
            if rounds > MAX_LOGIN_ROUNDS {
                return Err(Error::proto("security stage does not end"));
            }
            self.stage = Stage::SecFinish { rounds };
            self.next_exchange(login::STAGE_SECURITY, login::STAGE_OPERATIONAL, true, &[]);
            return Ok(None);
        }
        if r.nsg != login::STAGE_OPERATIONAL {
            return Err(Error::proto(format!(
                "target moved to stage {} after the security stage; we asked for 1",
                r.nsg
            )));
        }
        let keys = self.p.operational_keys();
        self.stage = Stage::Operational {
            offered: keys.iter().map(|(k, _)| k.clone()).collect(),
            answered: Vec::new(),
            rounds: 0,
        };
        self.next_exchange(
            login::STAGE_OPERATIONAL,
            login::STAGE_FULL_FEATURE,
            true,
            &keys,
        );
        Ok(None)
    }
}

/// Record the target's non-authentication keys of a security-stage answer.
fn record(neg: &mut Negotiated, p: &LoginParams, keys: &[(String, String)]) -> Result<(), Error> {
    for (k, v) in keys {
        if !k.starts_with("CHAP_") && k != "AuthMethod" {
            neg.apply(p, k, v)?;
        }
    }
    Ok(())
}

/// Most request/response rounds of one text exchange.
const MAX_TEXT_ROUNDS: usize = 4096;

/// A Text Request exchange (RFC 7143 11.10-11.11) with continuation: follows
/// the target's C bit and TTT until the final response.
pub(crate) struct TextExchange {
    itt: u32,
    ttt: u32,
    payload: Vec<u8>,
    out: Vec<u8>,
    rounds: usize,
}

impl TextExchange {
    pub(crate) fn new(itt: u32, keys: &[(String, String)]) -> TextExchange {
        TextExchange {
            itt,
            ttt: RESERVED_TAG,
            payload: encode_keys(keys),
            out: Vec::new(),
            rounds: 0,
        }
    }

    pub(crate) fn itt(&self) -> u32 {
        self.itt
    }

    /// The next Text Request (the caller fills CmdSN and ExpStatSN; it is
    /// not immediate) and its data.
    pub(crate) fn request(&mut self) -> Result<(Bhs, Vec<u8>), Error> {
        self.rounds += 1;
        if self.rounds > MAX_TEXT_ROUNDS {
            return Err(Error::proto("text exchange does not end"));
        }
        let mut b = Bhs::new(Opcode::TextRequest);
        b.set_final(true).set_itt(self.itt).set_ttt(self.ttt);
        Ok((b, std::mem::take(&mut self.payload)))
    }

    /// Take a Text Response with our ITT: the keys once it is final.
    pub(crate) fn response(
        &mut self,
        rsp: &Bhs,
        data: &[u8],
    ) -> Result<Option<Vec<(String, String)>>, Error> {
        self.out.extend_from_slice(data);
        if self.out.len() > 16 * 1024 * 1024 {
            return Err(Error::proto("text response without end"));
        }
        let f = rsp.flags();
        let fin = f & 0x80 != 0;
        let cont = f & 0x40 != 0;
        if fin && cont {
            return Err(Error::proto("text response with both F and C set"));
        }
        if fin {
            return decode_keys(&self.out).map(Some);
        }
        self.ttt = rsp.ttt();
        if self.ttt == RESERVED_TAG {
            return Err(Error::proto(
                "text response not final but its TTT is 0xffffffff",
            ));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests;
