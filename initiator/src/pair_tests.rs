//! The initiator's sans-IO login machine and PDU handling against the
//! target's engine, in one process and in simulated time. Every PDU crosses
//! the real framing (`ramslog_common::iscsi::frame`, digests included) and a
//! wire that can drop, reorder or corrupt it, so protocol changes are tested
//! here without sockets, threads or real clocks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::cdb;
use ramslog_common::iscsi::frame::{self, Deframed, Digests, RxRules};
use ramslog_common::iscsi::{scsi_cmd, Bhs, Opcode, RejectReason, RESERVED_TAG};
use ramslog_common::scsi_wire::status;
use ramslog_target::admission::SessionControl;
use ramslog_target::iscsi::engine::{Action, Connection, Input};
use ramslog_target::iscsi::portal::Portal;
use ramslog_target::iscsi::tcp::encode_pdu;
use ramslog_target::testkit;

use crate::datain::DataInAssembler;
use crate::exchange::{LoginMachine, LoginStep};
use crate::login::{Digest, LoginOutcome, LoginParams};
use crate::pdu::Pdu;
use crate::seq::SeqState;

const IQN: &str = "iqn.2026-11.org.ramslog:pair";
const LUN_BYTES: u64 = 4 << 20;

/// What the wire does to the next PDU the initiator sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Lost on the way.
    Drop,
    /// Held back and delivered after the following PDU.
    HoldBack,
    /// One bit of the data segment flipped in transit.
    FlipDataBit,
}

struct Pair {
    target: Connection,
    /// The simulated clock both sides read.
    now: Instant,
    seq: SeqState,
    /// Digests on the initiator's side: what it sends and what it checks.
    digests: Digests,
    faults: VecDeque<Fault>,
    held: Option<Vec<u8>>,
    /// Bytes the target has not yet taken a whole PDU from.
    to_target: Vec<u8>,
    to_initiator: Vec<u8>,
    closed: bool,
    next_itt: u32,
    /// The target's declared MaxRecvDataSegmentLength: the most one PDU to
    /// it may carry.
    target_mrdsl: u32,
}

impl Pair {
    fn new(portal: Arc<Portal>) -> Pair {
        let now = Instant::now();
        Pair {
            target: Connection::tcp(
                portal,
                testkit::conn_info(),
                SessionControl::without_transport(),
                now,
            ),
            now,
            seq: SeqState::default(),
            digests: Digests::default(),
            faults: VecDeque::new(),
            held: None,
            to_target: Vec::new(),
            to_initiator: Vec::new(),
            closed: false,
            next_itt: 1,
            target_mrdsl: 8192,
        }
    }

    /// Initiator → target: frame the PDU, let the wire do its worst, and let
    /// the target take every whole PDU that arrived.
    fn send(&mut self, bhs: &Bhs, data: &[u8]) {
        let mut bytes = Vec::new();
        frame::encode(bhs, &[], data, self.digests, &mut bytes).expect("encodable PDU");
        match self.faults.pop_front() {
            Some(Fault::Drop) => return,
            Some(Fault::HoldBack) => {
                self.held = Some(bytes);
                return;
            }
            Some(Fault::FlipDataBit) => {
                let header = 48 + if self.digests.header { 4 } else { 0 };
                assert!(bytes.len() > header, "no data segment to corrupt");
                bytes[header] ^= 0x01;
            }
            None => {}
        }
        self.to_target.extend_from_slice(&bytes);
        if let Some(held) = self.held.take() {
            self.to_target.extend_from_slice(&held);
        }
        self.deliver();
    }

    fn deliver(&mut self) {
        loop {
            let rules = RxRules {
                digests: self.target.rx_digests(),
                max_data_len: self.target.max_rx_data_segment(),
            };
            let (bhs, ahs, data, ok, len) = match frame::deframe(&self.to_target, rules) {
                Ok(Deframed::Pdu(f)) => (
                    f.bhs,
                    f.ahs.to_vec(),
                    f.data.to_vec(),
                    f.data_digest_ok,
                    f.wire_len,
                ),
                Ok(Deframed::Incomplete { .. }) => break,
                Err(e) => panic!("the target's framing refused a PDU: {e}"),
            };
            self.to_target.drain(..len);
            let input = if ok {
                Input::pdu(&bhs, &ahs, &data)
            } else {
                Input::DataDigestError(&bhs)
            };
            self.target.handle(self.now, input);
            self.pump();
        }
        self.pump();
    }

    /// Target → initiator: frame what the engine queued.
    fn pump(&mut self) {
        while let Some(action) = self.target.poll_action() {
            match action {
                Action::Send(pdu) => {
                    assert!(encode_pdu(&self.target, &pdu, &mut self.to_initiator));
                }
                Action::Close => self.closed = true,
                other => panic!("a TCP connection asked for {other:?}"),
            }
        }
    }

    /// The next PDU the initiator receives, digests checked.
    fn recv(&mut self) -> Option<Pdu> {
        let rules = RxRules {
            digests: self.digests,
            max_data_len: 1 << 20,
        };
        let (pdu, len) = match frame::deframe(&self.to_initiator, rules).expect("framing") {
            Deframed::Pdu(f) => {
                assert!(f.data_digest_ok, "the target's data digest must match");
                let pdu = Pdu {
                    bhs: Bhs::decode(f.bhs.as_bytes()).expect("a known opcode"),
                    ahs: f.ahs.to_vec(),
                    data: f.data.to_vec(),
                };
                (pdu, f.wire_len)
            }
            Deframed::Incomplete { .. } => return None,
        };
        self.to_initiator.drain(..len);
        self.seq.on_target_pdu(&pdu.bhs);
        Some(pdu)
    }

    /// Move the simulated clock; the target's timers fire as they would.
    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        while let Some(deadline) = self.target.poll_timeout().filter(|d| *d <= until) {
            self.now = deadline.max(self.now);
            self.target.handle(self.now, Input::Timeout);
            self.pump();
            if self.closed {
                break;
            }
        }
        self.now = until;
    }

    fn login(&mut self, params: &LoginParams) -> LoginOutcome {
        let (mut machine, mut bhs, mut data) =
            LoginMachine::start(params, 0x4000_0000, &mut self.seq).expect("login start");
        loop {
            self.send(&bhs, &data);
            let rsp = self.recv().expect("a login response");
            match machine
                .handle(&rsp.bhs, &rsp.data, &mut self.seq)
                .expect("login step")
            {
                LoginStep::Send(b, d) => (bhs, data) = (b, d),
                LoginStep::Done(outcome) => {
                    self.digests = Digests {
                        header: outcome.negotiated.header_digest,
                        data: outcome.negotiated.data_digest,
                    };
                    self.target_mrdsl = outcome.negotiated.target_max_recv_data_segment_length;
                    return outcome;
                }
            }
        }
    }

    fn command(&mut self, cdb: &[u8], flags: u8, edtl: u32) -> Bhs {
        let mut b = Bhs::new(Opcode::ScsiCommand);
        let itt = self.next_itt;
        self.next_itt += 1;
        b.set_flags(0x80 | flags | 1)
            .set_itt(itt)
            .set_expected_data_len(edtl)
            .set_cmdsn(self.seq.take_cmdsn())
            .set_exp_statsn(self.seq.exp_statsn)
            .set_cdb(cdb);
        b
    }

    /// A WRITE(10): immediate data up to `immediate` bytes, the rest on R2Ts.
    fn write(&mut self, lba: u64, data: &[u8], immediate: usize) -> u8 {
        let blocks = (data.len() / 512) as u32;
        let cdb = cdb::write10(lba, blocks, false).expect("a WRITE(10) range");
        let cmd = self.command(&cdb, scsi_cmd::WRITE, data.len() as u32);
        let immediate = immediate.min(data.len());
        self.send(&cmd, &data[..immediate]);
        loop {
            let p = self.recv().expect("an answer to the WRITE");
            match p.opcode() {
                Some(Opcode::ReadyToTransfer) => {
                    // The burst the R2T asks for, in PDUs the target can take.
                    let (start, end) = (
                        p.bhs.buffer_offset(),
                        p.bhs.buffer_offset() + p.bhs.residual(),
                    );
                    let (mut off, mut datasn) = (start, 0);
                    while off < end {
                        let len = (end - off).min(self.target_mrdsl);
                        let mut out =
                            Bhs::data_out(cmd.itt(), p.bhs.ttt(), off, datasn, off + len == end);
                        out.set_exp_statsn(self.seq.exp_statsn);
                        self.send(&out, &data[off as usize..(off + len) as usize]);
                        off += len;
                        datasn += 1;
                    }
                }
                Some(Opcode::ScsiResponse) => return p.bhs.scsi_status(),
                other => panic!("unexpected {other:?} during a WRITE"),
            }
        }
    }

    fn read(&mut self, lba: u64, len: u32) -> Vec<u8> {
        let cdb = cdb::read10(lba, len / 512).expect("a READ(10) range");
        let cmd = self.command(&cdb, scsi_cmd::READ, len);
        self.send(&cmd, &[]);
        let mut assembler = DataInAssembler::new(len);
        loop {
            let p = self.recv().expect("Data-In");
            assert_eq!(p.bhs.itt(), cmd.itt());
            let done = match p.opcode() {
                Some(Opcode::DataIn) => assembler.push(&p.bhs, &p.data).expect("Data-In"),
                Some(Opcode::ScsiResponse) => {
                    return assembler.finish(&p.bhs, &p.data).expect("status").data
                }
                other => panic!("unexpected {other:?} during a READ"),
            };
            if let Some(result) = done {
                assert_eq!(result.status, status::GOOD);
                return result.data;
            }
        }
    }

    fn ping(&mut self) -> Option<Pdu> {
        let mut b = Bhs::new(Opcode::NopOut);
        let itt = self.next_itt;
        self.next_itt += 1;
        b.set_immediate(true)
            .set_final(true)
            .set_itt(itt)
            .set_ttt(RESERVED_TAG)
            .set_cmdsn(self.seq.next_cmdsn)
            .set_exp_statsn(self.seq.exp_statsn);
        self.send(&b, b"ping");
        self.recv()
    }
}

fn params(digests: bool) -> LoginParams {
    let mut p = LoginParams::normal("iqn.2026-11.org.ramslog:pair-initiator", IQN);
    if digests {
        p.header_digest = Digest::Crc32c;
        p.data_digest = Digest::Crc32c;
    }
    p
}

fn logged_in(digests: bool) -> Pair {
    let mut pair = Pair::new(testkit::RamPortal::new(IQN).size(LUN_BYTES).build());
    let outcome = pair.login(&params(digests));
    assert_eq!(outcome.negotiated.data_digest, digests);
    // The power-on unit attention, as every real initiator meets it first.
    let tur = pair.command(&cdb::test_unit_ready(), 0, 0);
    pair.send(&tur, &[]);
    assert_eq!(
        pair.recv().map(|p| p.opcode()),
        Some(Some(Opcode::ScsiResponse))
    );
    pair
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn login_write_and_read_back_with_and_without_digests() {
    for digests in [false, true] {
        let mut pair = logged_in(digests);
        let small = pattern(4096, 1);
        assert_eq!(pair.write(8, &small, 4096), status::GOOD, "immediate data");
        let big = pattern(256 * 1024, 2);
        assert_eq!(pair.write(64, &big, 0), status::GOOD, "data on R2Ts");
        assert_eq!(pair.read(8, 4096), small);
        assert_eq!(pair.read(64, 256 * 1024), big);
        assert!(!pair.closed);
    }
}

#[test]
fn corrupted_immediate_data_is_rejected_and_the_connection_closes() {
    let mut pair = logged_in(true);
    let data = pattern(8192, 3);
    let cdb = cdb::write10(100, 16, false).expect("range");
    let cmd = pair.command(&cdb, scsi_cmd::WRITE, 8192);
    pair.faults.push_back(Fault::FlipDataBit);
    pair.send(&cmd, &data[..4096]);
    let reject = pair.recv().expect("a Reject");
    assert_eq!(reject.opcode(), Some(Opcode::Reject));
    assert_eq!(
        reject.bhs.reject_reason(),
        RejectReason::DataDigestError as u8
    );
    // The command was never accounted for: at ErrorRecoveryLevel 0 the
    // host recovers the session (RFC 7143 § 7.8), so it ends now.
    assert!(
        pair.closed,
        "a command whose immediate data is lost closes the connection"
    );
}

/// A damaged Data-Out has a sound header: Rejected, its task ends with
/// PROTOCOL SERVICE CRC ERROR once its sequence has, and the connection
/// goes on (RFC 7143 § 7.8 option b).
#[test]
fn a_corrupted_data_out_ends_its_task_and_the_connection_goes_on() {
    let mut pair = logged_in(true);
    let cdb = cdb::write10(100, 16, false).expect("range");
    let cmd = pair.command(&cdb, scsi_cmd::WRITE, 8192);
    pair.send(&cmd, &[]);
    let r2t = pair.recv().expect("an R2T");
    assert_eq!(r2t.opcode(), Some(Opcode::ReadyToTransfer));
    let mut out = Bhs::data_out(cmd.itt(), r2t.bhs.ttt(), 0, 0, true);
    out.set_exp_statsn(pair.seq.exp_statsn);
    pair.faults.push_back(Fault::FlipDataBit);
    pair.send(&out, &pattern(8192, 5));
    let reject = pair.recv().expect("a Reject");
    assert_eq!(
        reject.bhs.reject_reason(),
        RejectReason::DataDigestError as u8
    );
    let response = pair.recv().expect("the task's end");
    assert_eq!(response.opcode(), Some(Opcode::ScsiResponse));
    assert_eq!(response.bhs.scsi_status(), status::CHECK_CONDITION);
    assert!(
        !pair.closed,
        "a damaged Data-Out loses the task, not the connection"
    );
    let nop = pair.ping().expect("the NOP-In");
    assert_eq!(
        (nop.opcode(), nop.data.as_slice()),
        (Some(Opcode::NopIn), &b"ping"[..])
    );
    assert_eq!(pair.read(100, 8192), vec![0; 8192], "nothing placed");
}

#[test]
fn a_command_that_skips_ahead_of_cmdsn_is_dropped() {
    let mut pair = logged_in(false);
    // The first command is held back and arrives after the second: one
    // connection delivers in order, so the target drops the one that skips
    // ahead (ERL 0) and serves the other.
    pair.faults.push_back(Fault::HoldBack);
    let first = pair.command(&cdb::test_unit_ready(), 0, 0);
    pair.send(&first, &[]);
    let second = pair.command(&cdb::test_unit_ready(), 0, 0);
    pair.send(&second, &[]);
    let answer = pair.recv().expect("one answer");
    assert_eq!(answer.bhs.itt(), first.itt());
    assert!(pair.recv().is_none(), "the early command was dropped");
    assert!(!pair.closed);
}

#[test]
fn a_login_whose_request_is_lost_times_out_in_simulated_time() {
    let mut pair = Pair::new(testkit::RamPortal::new(IQN).size(LUN_BYTES).build());
    pair.faults.push_back(Fault::Drop);
    let (_machine, bhs, data) =
        LoginMachine::start(&params(false), 1, &mut pair.seq).expect("login start");
    pair.send(&bhs, &data);
    // Nothing reached the target: the first-PDU timeout (5 s), not the
    // login timeout (30 s), ends the connection.
    pair.advance(Duration::from_secs(4));
    assert!(!pair.closed, "the first-PDU timer has not fired yet");
    pair.advance(Duration::from_secs(2));
    assert!(
        pair.closed,
        "the target gives up on a login that never arrives"
    );
}

#[test]
fn an_idle_session_is_pinged_and_dropped_when_the_ping_goes_unanswered() {
    let mut pair = logged_in(false);
    pair.advance(Duration::from_secs(16));
    let ping = pair.recv().expect("a NOP-In ping after the idle interval");
    assert_eq!(ping.opcode(), Some(Opcode::NopIn));
    assert_eq!(ping.bhs.itt(), RESERVED_TAG);
    assert!(!pair.closed);
    pair.advance(Duration::from_secs(31));
    assert!(pair.closed, "an unanswered ping ends the connection");
}
