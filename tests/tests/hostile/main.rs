//! Hostile clients against the real `ramslog-target` binary: raw PDUs over
//! TCP on 127.0.0.1, one case per class of abuse. Each case checks the
//! answer (Reject, sense, closed connection), that memory stays bounded, and
//! that a bystander session keeps working with no block changed.
//!
//! Memory is peak VmRSS minus the LUN bytes (the LUN is locked in RAM at
//! start), sampled every 100 ms; each case records its figure in
//! `build/hostile/memory.json`.

mod admission;
mod classes;
mod flood;
mod malformed;
mod memory;

use std::time::Duration;

use rand::Rng;

use ramslog_common::iscsi::{Bhs, Opcode, RESERVED_TAG};
use ramslog_common::scsi_wire::sense_key;
use ramslog_initiator::{Connection, LoginParams, Pdu, Session};
use ramslog_tests::TargetProcess;

pub const INITIATOR: &str = "iqn.2026-11.org.ramslog:hostile";
pub const BYSTANDER: &str = "iqn.2026-11.org.ramslog:bystander";
/// Per-connection and total bounds the issue sets (bytes above the LUN).
pub const PER_CONNECTION_LIMIT: u64 = 64 << 20;
pub const TOTAL_LIMIT: u64 = 256 << 20;

/// A well-behaved session with a known pattern on the LUN, checked after the abuse.
pub struct Bystander {
    pub s: Session,
    pattern: Vec<u8>,
    lba: u64,
}

impl Bystander {
    pub async fn new(t: &TargetProcess, lba: u64) -> Bystander {
        let s = open(t, BYSTANDER).await;
        let pattern = random_bytes(64 * 1024);
        s.write(0, lba, &pattern, true).await.expect("canary write");
        Bystander { s, pattern, lba }
    }

    pub async fn still_fine(&self) {
        let got = tokio::time::timeout(Duration::from_secs(20), self.s.read(0, self.lba, 128, 512))
            .await
            .expect("bystander read timed out: the target stopped serving")
            .expect("bystander read");
        assert!(got == self.pattern, "a block changed under the bystander");
    }
}

pub async fn raw_login(t: &TargetProcess, tweak: impl FnOnce(&mut LoginParams)) -> Connection {
    let mut c = Connection::connect(t.addr()).await.expect("connect");
    let mut p = LoginParams::normal(INITIATOR, t.target_name());
    tweak(&mut p);
    c.login(&p).await.expect("login");
    c
}

pub fn scsi_cmd(c: &mut Connection, cdb: &[u8], flags: u8, edtl: u32) -> Bhs {
    let mut b = Bhs::new(Opcode::ScsiCommand);
    b.set_flags(flags)
        .set_itt(c.next_itt())
        .set_expected_data_len(edtl);
    b.set_cdb(cdb);
    c.fill_sn(&mut b, false);
    b
}

/// WRITE(10) of `blocks` at `lba` sent without data (the connection
/// negotiated InitialR2T=Yes, ImmediateData=No): its header and the R2T the
/// target answers with.
pub async fn write_awaiting_r2t(c: &mut Connection, lba: u32, blocks: u16) -> (Bhs, Pdu) {
    let l = lba.to_be_bytes();
    let n = blocks.to_be_bytes();
    let cdb = [0x2a, 0, l[0], l[1], l[2], l[3], 0, n[0], n[1], 0];
    let b = scsi_cmd(c, &cdb, 0xa1, u32::from(blocks) * 512);
    c.send_pdu(&b, &[], &[]).await.expect("send");
    let r2t = c
        .recv_pdu_timeout(Duration::from_secs(5))
        .await
        .expect("recv")
        .expect("R2T");
    assert_eq!(r2t.opcode(), Some(Opcode::ReadyToTransfer));
    (b, r2t)
}

/// Data-Out number `datasn` of the command `cmd`, at `offset` of the burst
/// the R2T `r2t` asked for.
pub fn data_out(cmd: &Bhs, r2t: &Pdu, offset: u32, datasn: u32, last: bool) -> Bhs {
    Bhs::data_out(cmd.itt(), r2t.bhs.ttt(), offset, datasn, last)
}

/// Log in and consume the power-on unit attention, as real initiators do.
pub async fn open(t: &TargetProcess, initiator: &str) -> Session {
    let s = Session::login(t.addr(), LoginParams::normal(initiator, t.target_name()))
        .await
        .unwrap_or_else(|e| panic!("login to {}: {e}", t.addr()));
    for _ in 0..8 {
        let r = s.test_unit_ready(0).await.expect("TEST UNIT READY");
        if r.sense.is_none_or(|x| x.key != sense_key::UNIT_ATTENTION) {
            return s;
        }
    }
    panic!("unit attentions never cleared");
}

pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut rng = rand::thread_rng();
    (0..n).map(|_| rng.gen::<u8>()).collect()
}

pub fn sense(r: &ramslog_initiator::ScsiResult) -> (u8, u8, u8) {
    let s = r
        .sense
        .unwrap_or_else(|| panic!("expected sense, got status {:#x}", r.status));
    (s.key, s.asc, s.ascq)
}

pub fn read10(lba: u32, blocks: u16) -> [u8; 10] {
    let l = lba.to_be_bytes();
    let n = blocks.to_be_bytes();
    [0x28, 0, l[0], l[1], l[2], l[3], 0, n[0], n[1], 0]
}

/// Everything the target sends before it answers a NOP-Out ping sent now.
/// It handles one connection's PDUs in order and answers a command it
/// executes (or an R2T it owes) while handling it, so what it would say to
/// anything sent before the ping comes before the ping's NOP-In: "no answer"
/// is then an event, not a quiet window. Its own pings are left out.
pub async fn before_a_ping(c: &mut Connection) -> Vec<Pdu> {
    let mut b = Bhs::new(Opcode::NopOut);
    let itt = c.next_itt();
    b.set_final(true).set_itt(itt).set_ttt(RESERVED_TAG);
    c.fill_sn(&mut b, true);
    c.send_pdu(&b, &[], &[]).await.expect("send NOP-Out");
    let mut seen = Vec::new();
    loop {
        let p = c
            .recv_pdu_timeout(Duration::from_secs(10))
            .await
            .expect("recv")
            .expect("the NOP-In answering the ping");
        match (p.opcode(), p.bhs.itt()) {
            (Some(Opcode::NopIn), i) if i == itt => return seen,
            (Some(Opcode::NopIn), RESERVED_TAG) => {}
            _ => seen.push(p),
        }
    }
}
