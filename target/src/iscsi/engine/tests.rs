//! Engine tests: an initiator model drives a `Connection` directly — no
//! sockets, no clock but the one passed in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::iscsi::chap;
use ramslog_common::iscsi::{login, login_status, text, tmf, Bhs, Opcode, BHS_LEN, RESERVED_TAG};
use ramslog_common::iser::CmPeer;
use ramslog_common::scsi_wire::{sense_key, status, Sense};

use super::*;
use crate::admission::SessionControl;
use crate::core::CoreLimits;
use crate::iscsi::portal::{Acl, AclEntry, ChapSecret, Limits, Portal};
use crate::testkit::{conn_info, RamPortal};

const IQN: &str = "iqn.2026-11.org.ramslog:test";
const INI: &str = "iqn.1994-05.com.example:ini";

struct Rsp {
    bhs: Bhs,
    data: Vec<u8>,
}

struct Harness {
    conn: Connection,
    now: Instant,
    cmdsn: u32,
    itt: u32,
    closed: bool,
    /// iSER: RDMA actions, in order, interleaved with sends by index.
    rdma: Vec<(usize, Action)>,
}

impl Harness {
    fn new(portal: Arc<Portal>) -> Harness {
        let now = Instant::now();
        Harness {
            conn: Connection::tcp(
                portal,
                conn_info(),
                SessionControl::without_transport(),
                now,
            ),
            now,
            cmdsn: 100,
            itt: 1,
            closed: false,
            rdma: Vec::new(),
        }
    }

    fn new_iser(portal: Arc<Portal>) -> Harness {
        Harness::new_iser_from(portal, CmPeer::Unknown)
    }

    /// An iSER connection whose connect request looked like `proposed`.
    fn new_iser_from(portal: Arc<Portal>, proposed: CmPeer) -> Harness {
        let mut h = Harness::new(portal.clone());
        let control = SessionControl::without_transport();
        h.conn = Connection::iser(portal, h.conn.info, control, h.now, 8192, proposed);
        h
    }

    fn send(&mut self, bhs: &Bhs, data: &[u8]) -> Vec<Rsp> {
        let mut b = *bhs;
        b.set_data_segment_len(data.len() as u32);
        self.conn.handle(self.now, Input::pdu(&b, &[], data));
        self.drain()
    }

    fn drain(&mut self) -> Vec<Rsp> {
        let mut v = Vec::new();
        while let Some(a) = self.conn.poll_action() {
            match a {
                Action::Close => self.closed = true,
                a @ (Action::RdmaWrite { .. } | Action::RdmaRead { .. }) => {
                    self.rdma.push((v.len(), a))
                }
                Action::Send(p) => {
                    let data = match p.data {
                        OutData::None => Vec::new(),
                        OutData::Owned(d) => d,
                        OutData::Store {
                            volume,
                            offset,
                            len,
                        } => {
                            let mut d = vec![0; len as usize];
                            let volumes = &self.conn.portal().core.volumes;
                            assert!(volumes.read(volume, offset, &mut d));
                            d
                        }
                    };
                    assert_eq!(p.bhs.data_segment_len() as usize, data.len());
                    v.push(Rsp { bhs: p.bhs, data });
                }
            }
        }
        v
    }

    /// Bytes of the test portal's LUN 0, as the initiator would read them.
    fn read_lun(&self, offset: u64, out: &mut [u8]) -> bool {
        self.conn
            .portal()
            .core
            .volumes
            .read(first_volume(self), offset, out)
    }

    fn login_pdu(&mut self, flags: u8, keys: &[(&str, &str)]) -> Vec<Rsp> {
        let mut b = Bhs::new(Opcode::LoginRequest);
        b.set_immediate(true)
            .set_flags(flags)
            .set_itt(0x1000)
            .set_cmdsn(self.cmdsn);
        b.set_isid([0x40, 0, 0, 1, 0, 0]);
        let mut t = Vec::new();
        for (k, v) in keys {
            text::encode_pair(&mut t, k, v);
        }
        self.send(&b, &t)
    }

    fn login(&mut self, extra: &[(&str, &str)]) -> Rsp {
        self.login_as(INI, extra)
    }

    /// [`Self::login`] as initiator `name`.
    fn login_as(&mut self, name: &str, extra: &[(&str, &str)]) -> Rsp {
        let r = self.login_response(name, extra);
        if r.bhs.login_status() == 0 {
            self.clear_unit_attention();
        }
        r
    }

    /// A Text Request for SendTargets=All; the answers.
    fn send_targets(&mut self) -> Vec<Rsp> {
        let mut t = Bhs::new(Opcode::TextRequest);
        t.set_final(true)
            .set_itt(self.next_itt())
            .set_ttt(RESERVED_TAG)
            .set_cmdsn(self.cmdsn);
        self.cmdsn += 1;
        let mut body = Vec::new();
        text::encode_pair(&mut body, "SendTargets", "All");
        self.send(&t, &body)
    }

    /// A one-PDU login to full feature phase as `name` with `extra` keys:
    /// its one response (the unit attention left for the caller).
    fn login_response(&mut self, name: &str, extra: &[(&str, &str)]) -> Rsp {
        let mut keys = vec![
            ("InitiatorName", name),
            ("TargetName", IQN),
            ("SessionType", "Normal"),
        ];
        keys.extend_from_slice(extra);
        let flags = login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;
        let mut r = self.login_pdu(flags, &keys);
        assert_eq!(r.len(), 1);
        r.remove(0)
    }

    /// An immediate task management request `function` of this session,
    /// naming task `referenced` (RESERVED_TAG for none), for LUN 0.
    fn tmf(&mut self, function: u8, referenced: u32) -> Bhs {
        let mut t = Bhs::new(Opcode::TaskMgmtRequest);
        t.set_immediate(true)
            .set_final(true)
            .set_flags(0x80 | function)
            .set_lun(0)
            .set_itt(self.next_itt())
            .set_ttt(referenced)
            .set_cmdsn(self.cmdsn);
        t
    }

    /// What initiators do after login: TEST UNIT READY until the power-on
    /// unit attention has been reported.
    fn clear_unit_attention(&mut self) {
        let (_, r) = self.command(&[0; 6], 0x81, 0, &[]);
        let s = sense_of(&r[0]);
        assert_eq!(
            (s.key, s.asc),
            (sense_key::UNIT_ATTENTION, 0x29),
            "power-on UA first"
        );
        let (_, r) = self.command(&[0; 6], 0x81, 0, &[]);
        assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    }

    fn next_itt(&mut self) -> u32 {
        self.itt += 1;
        self.itt
    }

    /// An immediate WRITE (10) of 8 blocks at `lba` that waits for its data
    /// (InitialR2T): limited by the task cap, not by CmdSN.
    fn immediate_write(&mut self, lba: u32) -> Vec<Rsp> {
        let itt = self.next_itt();
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_immediate(true)
            .set_flags(0xa1)
            .set_itt(itt)
            .set_expected_data_len(4096)
            .set_cmdsn(self.cmdsn);
        b.set_cdb(&write10(lba, 8));
        self.send(&b, &[])
    }

    fn command(&mut self, cdb: &[u8], flags: u8, edtl: u32, data: &[u8]) -> (u32, Vec<Rsp>) {
        let (itt, b) = self.scsi_bhs(cdb, flags, edtl);
        (itt, self.send(&b, data))
    }

    /// The header of this session's next SCSI command (its CmdSN taken),
    /// with its task tag.
    fn scsi_bhs(&mut self, cdb: &[u8], flags: u8, edtl: u32) -> (u32, Bhs) {
        let itt = self.next_itt();
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_flags(flags)
            .set_itt(itt)
            .set_expected_data_len(edtl)
            .set_cmdsn(self.cmdsn);
        self.cmdsn = self.cmdsn.wrapping_add(1);
        b.set_cdb(cdb);
        (itt, b)
    }
}

/// LUN 0 of the test target: `size` bytes of RAM, 512-byte blocks, ready.
fn keys_of(data: &[u8]) -> Vec<(String, String)> {
    text::decode(data)
        .unwrap()
        .into_iter()
        .map(|p| (p.key.to_string(), p.value.to_string()))
        .collect()
}

fn key<'a>(keys: &'a [(String, String)], k: &str) -> Option<&'a str> {
    keys.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.as_str())
}

fn logged_in() -> Harness {
    let mut h = Harness::new(RamPortal::new(IQN).build());
    let r = h.login(&[
        ("InitialR2T", "No"),
        ("ImmediateData", "Yes"),
        ("MaxRecvDataSegmentLength", "8192"),
    ]);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
    h
}

fn write10(lba: u32, blocks: u16) -> [u8; 10] {
    ramslog_common::cdb::write10(lba.into(), blocks.into(), false).expect("fits WRITE (10)")
}

fn read10(lba: u32, blocks: u16) -> [u8; 10] {
    ramslog_common::cdb::read10(lba.into(), blocks.into()).expect("fits READ (10)")
}

fn sense_of(r: &Rsp) -> Sense {
    Sense::decode(&r.data[2..]).unwrap()
}

#[test]
fn login_in_one_round_trip_answers_every_key() {
    let mut h = Harness::new(RamPortal::new(IQN).build());
    let r = h.login(&[
        ("HeaderDigest", "None,CRC32C"),
        ("DataDigest", "None"),
        ("InitialR2T", "No"),
        ("ImmediateData", "Yes"),
        ("MaxBurstLength", "262144"),
        ("FirstBurstLength", "262144"),
        ("MaxOutstandingR2T", "1"),
        ("ErrorRecoveryLevel", "0"),
        ("MaxConnections", "1"),
        ("X-com.example.Foo", "1"),
    ]);
    assert_eq!(r.bhs.login_status(), 0);
    assert!(r.bhs.final_bit(), "T bit set");
    assert_eq!(r.bhs.flags() & 3, login::STAGE_FULL_FEATURE);
    assert_ne!(r.bhs.tsih(), 0);
    assert_eq!(
        r.bhs.exp_cmdsn(),
        100,
        "login is immediate: ExpCmdSN = its CmdSN"
    );
    let k = keys_of(&r.data);
    assert_eq!(key(&k, "HeaderDigest"), Some("None"));
    assert_eq!(key(&k, "InitialR2T"), Some("No"));
    assert_eq!(key(&k, "ImmediateData"), Some("Yes"));
    assert_eq!(key(&k, "MaxBurstLength"), Some("262144"));
    assert_eq!(key(&k, "X-com.example.Foo"), Some("NotUnderstood"));
    assert_eq!(key(&k, "TargetPortalGroupTag"), Some("1"));
    assert!(key(&k, "MaxRecvDataSegmentLength").is_some());
    assert!(!h.closed);
}

#[test]
fn login_errors_have_the_right_status() {
    let fails = |keys: &[(&str, &str)]| {
        let mut h = Harness::new(
            RamPortal::new(IQN)
                .acl(Acl::Only(vec![AclEntry::any_address("iqn.other")]))
                .build(),
        );
        let flags = login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;
        let r = h.login_pdu(flags, keys);
        assert!(h.closed);
        r[0].bhs.login_status()
    };
    assert_eq!(
        fails(&[("InitiatorName", "iqn.other"), ("TargetName", "iqn.nope")]),
        login_status::NOT_FOUND
    );
    assert_eq!(
        fails(&[("InitiatorName", INI), ("TargetName", IQN)]),
        login_status::FORBIDDEN
    );
    assert_eq!(
        fails(&[("TargetName", IQN)]),
        login_status::MISSING_PARAMETER
    );
    assert_eq!(
        fails(&[("InitiatorName", "iqn.other")]),
        login_status::MISSING_PARAMETER
    );
    assert_eq!(
        fails(&[
            ("InitiatorName", "iqn.other"),
            ("TargetName", IQN),
            ("TargetName", IQN)
        ]),
        login_status::INITIATOR_ERROR
    );
    let long = "x".repeat(300);
    assert_eq!(
        fails(&[
            ("InitiatorName", "iqn.other"),
            ("TargetName", IQN),
            ("X-long", &long)
        ]),
        login_status::INITIATOR_ERROR
    );
    // Text without '='.
    let mut h = Harness::new(RamPortal::new(IQN).build());
    let mut b = Bhs::new(Opcode::LoginRequest);
    b.set_immediate(true).set_flags(0x87);
    let r = h.send(&b, b"InitiatorName\0");
    assert_eq!(r[0].bhs.login_status(), login_status::INITIATOR_ERROR);
    assert!(h.closed);
}

#[test]
fn non_login_pdu_during_login_closes() {
    let mut h = Harness::new(RamPortal::new(IQN).build());
    let (_, r) = h.command(&[0; 6], 0x80, 0, &[]);
    assert!(r.is_empty());
    assert!(h.closed);
}

fn chap_login(secret: &str, mutual: bool) -> (Harness, u16) {
    let chap = ChapSecret {
        user: "alice".into(),
        secret: "0123456789abcdef".into(),
    };
    let m = ChapSecret {
        user: "target".into(),
        secret: "fedcba9876543210".into(),
    };
    let mut h = Harness::new(RamPortal::new(IQN).chap(chap).mutual_chap(m).build());
    let sec_to_op = login::TRANSIT | login::STAGE_OPERATIONAL;
    let r = h.login_pdu(
        0,
        &[
            ("InitiatorName", INI),
            ("TargetName", IQN),
            ("AuthMethod", "CHAP,None"),
        ],
    );
    assert_eq!(key(&keys_of(&r[0].data), "AuthMethod"), Some("CHAP"));
    let r = h.login_pdu(0, &[("CHAP_A", "7,5")]);
    let k = keys_of(&r[0].data);
    assert_eq!(key(&k, "CHAP_A"), Some("5"));
    let id: u8 = key(&k, "CHAP_I").unwrap().parse().unwrap();
    let challenge = chap::decode_binary(key(&k, "CHAP_C").unwrap()).unwrap();
    let resp = chap::encode_hex(&chap::response(id, secret.as_bytes(), &challenge));
    let mut keys = vec![("CHAP_N", "alice".to_string()), ("CHAP_R", resp)];
    if mutual {
        keys.push(("CHAP_I", "9".into()));
        keys.push(("CHAP_C", "0x0102030405060708".into()));
    }
    let keys: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let r = h.login_pdu(sec_to_op, &keys);
    let status = r[0].bhs.login_status();
    if status == 0 && mutual {
        let k = keys_of(&r[0].data);
        assert_eq!(key(&k, "CHAP_N"), Some("target"));
        let expect = chap::encode_hex(&chap::response(
            9,
            b"fedcba9876543210",
            &[1, 2, 3, 4, 5, 6, 7, 8],
        ));
        assert_eq!(key(&k, "CHAP_R"), Some(expect.as_str()));
    }
    (h, status)
}

#[test]
fn chap_one_way_mutual_and_wrong_secret() {
    let (mut h, st) = chap_login("0123456789abcdef", false);
    assert_eq!(st, 0);
    let r = h.login_pdu(login::TRANSIT | (1 << 2) | 3, &[]);
    assert_eq!(r[0].bhs.login_status(), 0);
    assert_ne!(r[0].bhs.tsih(), 0);
    let (_, st) = chap_login("0123456789abcdef", true);
    assert_eq!(st, 0);
    let (h, st) = chap_login("wrong-secret-xx", false);
    assert_eq!(st, login_status::AUTH_FAILED);
    assert!(h.closed);
}

#[test]
fn chap_cannot_be_skipped() {
    let chap = ChapSecret {
        user: "alice".into(),
        secret: "0123456789abcdef".into(),
    };
    let mut h = Harness::new(RamPortal::new(IQN).chap(chap).build());
    let r = h.login(&[]);
    assert_eq!(r.bhs.login_status(), login_status::AUTH_FAILED);
    assert!(h.closed);
}

#[test]
fn write_then_read_back_with_immediate_unsolicited_and_r2t() {
    let mut h = logged_in();
    // 16 KiB: 8 KiB immediate (MaxRecvDataSegmentLength of the initiator is
    // irrelevant here: the target's is 256 KiB), the rest unsolicited.
    let data: Vec<u8> = (0..16384u32).map(|i| (i * 7 + 3) as u8).collect();
    // F clear: unsolicited Data-Out follows the immediate data.
    let (itt, b) = h.scsi_bhs(&write10(8, 32), 0x21, 16384);
    let r = h.send(&b, &data[..8192]);
    assert!(r.is_empty(), "waiting for unsolicited data");
    let d = Bhs::data_out(itt, RESERVED_TAG, 8192, 0, true);
    let r = h.send(&d, &data[8192..]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);

    let (_, r) = h.command(&read10(8, 32), scsi_cmd_flags(false, true), 16384, &[]);
    let mut got = Vec::new();
    for p in &r {
        assert_eq!(p.bhs.opcode(), Some(Opcode::DataIn));
        assert_eq!(p.bhs.buffer_offset() as usize, got.len());
        got.extend_from_slice(&p.data);
    }
    assert_eq!(got, data);
    let last = r.last().unwrap();
    assert_eq!(last.bhs.flags() & 0x81, 0x81, "F and S on the last Data-In");
    assert!(
        r.iter().all(|p| p.data.len() <= 8192),
        "respects the initiator's MRDSL"
    );
}

fn scsi_cmd_flags(write: bool, read: bool) -> u8 {
    0x80 | if write { 0x20 } else { 0 } | if read { 0x40 } else { 0 } | 1
}

#[test]
fn r2t_path_solicits_every_byte() {
    let mut h = Harness::new(
        RamPortal::new(IQN)
            .limits(Limits {
                max_burst_len: 4096,
                max_outstanding_r2t: 2,
                ..Limits::default()
            })
            .build(),
    );
    h.login(&[
        ("InitialR2T", "Yes"),
        ("ImmediateData", "No"),
        ("MaxBurstLength", "65536"),
        ("MaxOutstandingR2T", "4"),
    ]);
    let data = vec![0xabu8; 16384];
    let (itt, r) = h.command(&write10(0, 32), scsi_cmd_flags(true, false), 16384, &[]);
    assert_eq!(r.len(), 2, "MaxOutstandingR2T=2 R2Ts");
    let mut pending: Vec<Rsp> = r;
    let mut responses = Vec::new();
    while let Some(r2t) = pending.pop() {
        assert_eq!(r2t.bhs.opcode(), Some(Opcode::ReadyToTransfer));
        let (off, len) = (r2t.bhs.buffer_offset(), r2t.bhs.residual());
        assert_eq!(len, 4096);
        let d = Bhs::data_out(itt, r2t.bhs.ttt(), off, 0, true);
        for p in h.send(&d, &data[off as usize..(off + len) as usize]) {
            if p.bhs.opcode() == Some(Opcode::ReadyToTransfer) {
                pending.push(p);
            } else {
                responses.push(p);
            }
        }
    }
    assert_eq!(responses.len(), 1);
    assert_eq!(responses[0].bhs.scsi_status(), status::GOOD);
}

/// An 8 MiB LUN's portal whose sessions share `budget` bytes of staging.
fn staging_portal(budget: u64) -> Arc<Portal> {
    RamPortal::new(IQN)
        .size(8 << 20)
        .core_limits(CoreLimits {
            staging_budget: budget,
            ..CoreLimits::default()
        })
        .build()
}

#[test]
fn staging_is_bounded_across_sessions() {
    // LUN writes go straight to the LUN; only data the SCSI device must see
    // whole (here VERIFY with BYTCHK=1) is staged, from one daemon-wide budget.
    let portal = staging_portal(64 << 10);
    let mut a = Harness::new(portal.clone());
    a.login(&[("InitialR2T", "Yes"), ("ImmediateData", "Yes")]);
    let mut verify = write10(0, 64);
    verify[0] = 0x2f;
    verify[1] = 0x02; // BYTCHK=1: 32 KiB of data to compare
    let (_, r) = a.command(&verify, 0xa1, 32768, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
    let (itt, r) = a.command(&verify, 0xa1, 32768, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
    let ttt = r[0].bhs.ttt();
    // A second session shares the budget.
    let mut b = Harness::new(portal.clone());
    b.login(&[("InitialR2T", "Yes"), ("ImmediateData", "Yes")]);
    let (_, r) = b.command(&verify, 0xa1, 32768, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
    assert_eq!(r[0].bhs.scsi_status(), status::TASK_SET_FULL);
    // A LUN write of any size needs no staging.
    let (_, r) = b.command(&write10(0, 8192), 0xa1, 4 << 20, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
    // Finishing one VERIFY frees its share.
    let d = Bhs::data_out(itt, ttt, 0, 0, true);
    let r = a.send(&d, &vec![0u8; 32768]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
    assert_eq!(portal.core.staging.used(), 32768);
    let (_, r) = b.command(&verify, 0xa1, 32768, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
    // Immediate data beyond FirstBurstLength is a protocol error.
    let (_, r) = b.command(&write10(0, 256), 0xa1, 131072, &vec![0u8; 65536 + 512]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::Reject));
    drop(a);
    drop(b);
    assert_eq!(portal.core.staging.used(), 0, "every reservation returned");
}

/// The buffers a session keeps for reuse are memory a peer made the daemon
/// spend: they count against the staging budget, are kept only while the
/// budget is at most half used (so idle sessions never hold more than half
/// of it), and return to it when the session ends.
#[test]
fn pooled_staging_buffers_count_against_the_budget() {
    let portal = staging_portal(64 << 10);
    let verify = |blocks: u16| {
        let mut cdb = write10(0, blocks);
        cdb[0] = 0x2f;
        cdb[1] = 0x02; // BYTCHK=1: the data is staged whole
        cdb
    };
    let complete = |h: &mut Harness, blocks: u16| {
        let len = u32::from(blocks) * 512;
        let (itt, r) = h.command(&verify(blocks), 0xa1, len, &[]);
        assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
        let d = Bhs::data_out(itt, r[0].bhs.ttt(), 0, 0, true);
        let r = h.send(&d, &vec![0u8; len as usize]);
        assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
    };
    let mut a = Harness::new(portal.clone());
    a.login(&[("InitialR2T", "Yes"), ("ImmediateData", "Yes")]);
    complete(&mut a, 64);
    assert_eq!(portal.core.staging.used(), 32768, "pooled buffers count");
    // Beyond half the budget a finished command's buffer is freed.
    let mut b = Harness::new(portal.clone());
    b.login(&[("InitialR2T", "Yes"), ("ImmediateData", "Yes")]);
    complete(&mut b, 64);
    assert_eq!(portal.core.staging.used(), 32768, "b keeps nothing");
    // What a's pool holds is not available to b...
    let (_, r) = b.command(&verify(96), 0xa1, 49152, &[]);
    assert_eq!(r[0].bhs.scsi_status(), status::TASK_SET_FULL);
    // ...but a itself reuses it, growing it within the budget.
    complete(&mut a, 96);
    assert_eq!(portal.core.staging.used(), 0, "48 KiB is over half: freed");
    complete(&mut a, 32);
    assert_eq!(portal.core.staging.used(), 16384);
    drop(a);
    drop(b);
    assert_eq!(
        portal.core.staging.used(),
        0,
        "the pool returns with its session"
    );
}

#[test]
fn cmdsn_outside_window_is_ignored_and_session_continues() {
    let mut h = logged_in();
    let tur = [0u8; 6];
    let good = h.cmdsn;
    h.cmdsn = good.wrapping_add(10_000);
    let (_, r) = h.command(&tur, 0x81, 0, &[]);
    assert!(r.is_empty(), "too high: dropped");
    h.cmdsn = good.wrapping_sub(1);
    let (_, r) = h.command(&tur, 0x81, 0, &[]);
    assert!(r.is_empty(), "too low: dropped");
    h.cmdsn = good;
    let (_, r) = h.command(&tur, 0x81, 0, &[]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].bhs.exp_cmdsn(), good.wrapping_add(1));
    assert!(!h.closed);
}

#[test]
fn bad_datasn_fails_the_command() {
    let mut h = logged_in();
    let (itt, r) = h.command(&write10(100, 2), 0x21, 1024, &[]);
    assert!(r.is_empty());
    let mut d = Bhs::data_out(itt, RESERVED_TAG, 0, 27, false);
    // The status waits until the sequence ends: once it is out the
    // initiator may reuse the ITT, and late Data-Out would land there.
    assert!(h.send(&d, &[0u8; 512]).is_empty());
    d.set_final(true).set_datasn(28).set_buffer_offset(512);
    let r = h.send(&d, &[0u8; 512]);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].bhs.scsi_status(), status::CHECK_CONDITION);
    let s = sense_of(&r[0]);
    assert_eq!(
        (s.key, s.asc, s.ascq),
        (sense_key::ABORTED_COMMAND, 0x4b, 0)
    );
    assert!(!h.closed);
}

/// libiscsi's write residual cases accept GOOD with only the shorter
/// length written, or CHECK CONDITION 0Eh/03h with nothing written; the
/// residual is reported either way. We refuse (see transfer_length.rs).
#[test]
fn write_residuals_follow_libiscsi_rules() {
    let mut h = logged_in();
    for (edtl, data, flags, residual) in [
        // EDTL 0 for a one-block write: overflow 512, nothing solicited.
        (0u32, 0usize, 0x04u8, 512u32),
        // EDTL larger than the CDB: underflow.
        (1024, 1024, 0x02, 512),
        // EDTL inside a block: overflow.
        (200, 200, 0x04, 312),
    ] {
        let (_, r) = h.command(&write10(0, 1), 0xa1, edtl, &vec![b'b'; data]);
        assert_eq!(
            (
                r[0].bhs.scsi_status(),
                r[0].bhs.flags() & 0x06,
                r[0].bhs.residual()
            ),
            (status::CHECK_CONDITION, flags, residual),
            "EDTL {edtl}"
        );
        let s = sense_of(&r[0]);
        assert_eq!(
            (s.key, s.asc, s.ascq),
            (sense_key::ILLEGAL_REQUEST, 0x0e, 0x03)
        );
    }
}

#[test]
fn read_residuals() {
    let mut h = logged_in();
    let (_, r) = h.command(&read10(0, 1), 0xc1, 10000, &[]);
    let last = r.last().unwrap();
    assert_eq!(r.iter().map(|p| p.data.len()).sum::<usize>(), 512);
    assert_eq!((last.bhs.flags() & 0x06, last.bhs.residual()), (0x02, 9488));
    let (_, r) = h.command(&read10(0, 1), 0xc1, 200, &[]);
    assert_eq!(r.iter().map(|p| p.data.len()).sum::<usize>(), 200);
    assert_eq!(
        (
            r.last().unwrap().bhs.flags() & 0x06,
            r.last().unwrap().bhs.residual()
        ),
        (0x04, 312)
    );
    let (_, r) = h.command(&read10(0, 1), 0xc1, 0, &[]);
    assert_eq!(
        (
            r[0].bhs.opcode(),
            r[0].bhs.flags() & 0x06,
            r[0].bhs.residual()
        ),
        (Some(Opcode::ScsiResponse), 0x04, 512)
    );
}

#[test]
fn lba_past_the_end_is_check_condition() {
    let mut h = logged_in();
    let (_, r) = h.command(&read10(2048, 1), 0xc1, 512, &[]);
    assert_eq!(r[0].bhs.scsi_status(), status::CHECK_CONDITION);
    let s = sense_of(&r[0]);
    assert_eq!((s.key, s.asc), (sense_key::ILLEGAL_REQUEST, 0x21));
}

#[test]
fn nop_echo_ping_and_ping_timeout() {
    let mut h = logged_in();
    let mut n = Bhs::new(Opcode::NopOut);
    n.set_immediate(true)
        .set_final(true)
        .set_itt(77)
        .set_ttt(RESERVED_TAG)
        .set_cmdsn(h.cmdsn);
    let r = h.send(&n, b"ping-data");
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::NopIn));
    assert_eq!(r[0].bhs.itt(), 77);
    assert_eq!(r[0].data, b"ping-data");
    // Idle: the target pings; answered, nothing happens; unanswered, it closes.
    h.now += Duration::from_secs(16);
    h.conn.handle(h.now, Input::Timeout);
    let r = h.drain();
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::NopIn));
    assert_eq!(r[0].bhs.itt(), RESERVED_TAG);
    let ttt = r[0].bhs.ttt();
    let mut a = Bhs::new(Opcode::NopOut);
    a.set_immediate(true)
        .set_final(true)
        .set_itt(RESERVED_TAG)
        .set_ttt(ttt)
        .set_cmdsn(h.cmdsn);
    assert!(h.send(&a, &[]).is_empty());
    h.now += Duration::from_secs(16);
    h.conn.handle(h.now, Input::Timeout);
    assert_eq!(h.drain().len(), 1);
    h.now += Duration::from_secs(31);
    h.conn.handle(h.now, Input::Timeout);
    h.drain();
    assert!(h.closed);
}

#[test]
fn abort_task_on_a_waiting_write() {
    let mut h = logged_in();
    let (itt, r) = h.command(&write10(0, 8), 0x21, 4096, &[]);
    assert!(r.is_empty());
    let mut t = h.tmf(tmf::ABORT_TASK, itt);
    let r = h.send(&t, &[]);
    assert_eq!((r.len(), r[0].bhs.response()), (1, tmf::RSP_COMPLETE));
    // Its data now goes nowhere, and no response ever comes for it: a
    // pattern, so that a byte placed would show over the zeroed LUN.
    let mut d = Bhs::new(Opcode::DataOut);
    d.set_final(true).set_itt(itt).set_ttt(RESERVED_TAG);
    assert!(h.send(&d, &[0x6bu8; 4096]).is_empty());
    let mut lun = vec![0xffu8; 4096];
    assert!(h.read_lun(0, &mut lun));
    assert!(
        lun.iter().all(|&b| b == 0),
        "the aborted write's data landed"
    );
    // A finished task: "does not exist".
    t.set_itt(501).set_ttt(12345);
    assert_eq!(h.send(&t, &[])[0].bhs.response(), tmf::RSP_NO_TASK);
    t.set_itt(502).set_flags(0x80 | tmf::TARGET_COLD_RESET);
    assert_eq!(h.send(&t, &[])[0].bhs.response(), tmf::RSP_NOT_SUPPORTED);
}

#[test]
fn discovery_lists_targets_and_refuses_scsi() {
    let mut h = Harness::new(RamPortal::new(IQN).build());
    let flags = login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;
    let r = h.login_pdu(
        flags,
        &[
            ("InitiatorName", INI),
            ("SessionType", "Discovery"),
            ("MaxBurstLength", "512"),
        ],
    );
    assert_eq!(r[0].bhs.login_status(), 0);
    assert!(
        h.conn.poll_event().is_none(),
        "a discovery session sets nothing up in the driver"
    );
    assert_eq!(
        key(&keys_of(&r[0].data), "MaxBurstLength"),
        Some("Irrelevant")
    );
    let r = h.send_targets();
    let k = keys_of(&r[0].data);
    assert_eq!(key(&k, "TargetName"), Some(IQN));
    assert_eq!(key(&k, "TargetAddress"), Some("127.0.0.1:3260,1"));
    let (_, r) = h.command(&[0; 6], 0x81, 0, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::Reject));
}

/// NSG means something only with T set: without T its bits are ignored,
/// with T the reserved stage 2, or a stage that does not move forward, is
/// an initiator error.
#[test]
fn the_next_stage_counts_only_with_transit() {
    let names = [
        ("InitiatorName", INI),
        ("TargetName", IQN),
        ("SessionType", "Normal"),
    ];
    let operational = login::STAGE_OPERATIONAL << 2;
    let mut h = Harness::new(RamPortal::new(IQN).build());
    let r = h.login_pdu(operational | 2, &names);
    assert_eq!(r[0].bhs.login_status(), login_status::SUCCESS);
    assert_eq!(r[0].bhs.flags() & login::TRANSIT, 0);
    for nsg in [2, login::STAGE_OPERATIONAL, login::STAGE_SECURITY] {
        let mut h = Harness::new(RamPortal::new(IQN).build());
        let r = h.login_pdu(login::TRANSIT | operational | nsg, &names);
        assert_eq!(
            r[0].bhs.login_status(),
            login_status::INITIATOR_ERROR,
            "NSG {nsg}"
        );
        assert!(h.closed);
    }
}

#[test]
fn unknown_opcode_is_rejected_and_logout_closes() {
    let mut h = logged_in();
    let mut raw = [0; BHS_LEN];
    raw[0] = 0x1c;
    let mut b = Bhs::from_raw(raw);
    b.set_itt(3);
    let r = h.send(&b, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::Reject));
    assert_eq!(
        r[0].bhs.reject_reason(),
        RejectReason::CommandNotSupported as u8
    );
    assert_eq!(&r[0].data[..48], &b.as_bytes()[..]);
    let mut l = Bhs::new(Opcode::LogoutRequest);
    l.set_immediate(true)
        .set_flags(0x80)
        .set_itt(4)
        .set_cmdsn(h.cmdsn);
    let r = h.send(&l, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::LogoutResponse));
    assert_eq!(r[0].bhs.response(), 0);
    assert!(h.closed);
}

mod hostile {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Arbitrary PDUs after login never panic the engine, never produce a
        /// PDU whose length field disagrees with its data, and leave it either
        /// serving or closed.
        #[test]
        fn random_pdus_never_panic(pdus in proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 48), proptest::collection::vec(any::<u8>(), 0..600), 0u8..8),
            1..24,
        )) {
            let mut h = logged_in();
            for (raw, data, ahs_words) in pdus {
                let mut raw: [u8; BHS_LEN] = raw.try_into().unwrap();
                // Mostly real opcodes, so the handlers themselves get exercised.
                raw[0] &= 0x47;
                let mut b = Bhs::from_raw(raw);
                b.set_total_ahs_len(ahs_words as usize * 4).unwrap();
                let ahs = vec![0u8; ahs_words as usize * 4];
                b.set_data_segment_len(data.len() as u32);
                h.conn.handle(h.now, Input::pdu(&b, &ahs, &data));
                h.drain();
                if h.closed {
                    break;
                }
            }
        }
    }
}

#[test]
fn data_in_queued_before_a_fatal_error_carries_the_real_bytes() {
    let mut h = logged_in();
    let pattern = vec![0xc3u8; 4096];
    let (_, r) = h.command(&write10(16, 8), 0xa1, 4096, &pattern);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    // A READ and then, in the same receive batch, a fatal protocol error.
    let mut b = Bhs::new(Opcode::ScsiCommand);
    b.set_flags(0xc1)
        .set_itt(900)
        .set_expected_data_len(4096)
        .set_cmdsn(h.cmdsn);
    b.set_cdb(&read10(16, 8));
    h.conn.handle(h.now, Input::pdu(&b, &[], &[]));
    let mut huge = Bhs::new(Opcode::ScsiCommand);
    huge.set_data_segment_len((1 << 24) - 1);
    h.conn.handle(h.now, Input::Oversized(&huge));
    let r = h.drain();
    assert!(h.closed);
    let data: Vec<u8> = r
        .iter()
        .filter(|p| p.bhs.opcode() == Some(Opcode::DataIn))
        .flat_map(|p| p.data.clone())
        .collect();
    assert_eq!(
        data, pattern,
        "Data-In must hold the LUN's bytes, never zeros"
    );
}

#[test]
fn waiting_commands_are_bounded_by_the_window() {
    let mut h = Harness::new(
        RamPortal::new(IQN)
            .size(8 << 20)
            .limits(Limits {
                cmd_window: 4,
                ..Limits::default()
            })
            .build(),
    );
    h.login(&[("InitialR2T", "Yes")]);
    let mut statuses = Vec::new();
    for i in 0..6u32 {
        let r = h.immediate_write(i * 8);
        statuses.push((r[0].bhs.opcode(), r[0].bhs.scsi_status()));
    }
    let full = statuses
        .iter()
        .filter(|s| **s == (Some(Opcode::ScsiResponse), status::TASK_SET_FULL))
        .count();
    assert_eq!(full, 2, "{statuses:?}");
}

// ---- iSER ------------------------------------------------------------------

/// The volume of the test portal's LUN 0.
fn lun_volume(h: &Harness) -> &Arc<crate::volume::Volume> {
    h.conn
        .portal()
        .core
        .volumes
        .iter()
        .next()
        .expect("a volume")
}

/// [`lun_volume`]'s place.
fn first_volume(h: &Harness) -> crate::volume::VolumeId {
    lun_volume(h).id()
}

fn iser_buf(va: u64) -> Option<ramslog_common::iser::RemoteBuffer> {
    Some(ramslog_common::iser::RemoteBuffer { stag: 0x77, va })
}

impl Harness {
    fn iser_command(
        &mut self,
        cdb: &[u8],
        flags: u8,
        edtl: u32,
        data: &[u8],
        write: Option<ramslog_common::iser::RemoteBuffer>,
        read: Option<ramslog_common::iser::RemoteBuffer>,
    ) -> (u32, Vec<Rsp>) {
        let itt = self.next_itt();
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_flags(flags)
            .set_itt(itt)
            .set_expected_data_len(edtl)
            .set_cmdsn(self.cmdsn)
            .set_data_segment_len(data.len() as u32);
        self.cmdsn = self.cmdsn.wrapping_add(1);
        b.set_cdb(cdb);
        self.conn.handle(
            self.now,
            Input::Pdu {
                bhs: &b,
                ahs: &[],
                data,
                buffers: RemoteBuffers { write, read },
            },
        );
        (itt, self.drain())
    }
}

fn iser_login(extra: &[(&str, &str)]) -> (Harness, Vec<(String, String)>) {
    iser_login_from(CmPeer::Unknown, extra)
}

/// An iSER login whose connect request's private data looked like `proposed`.
fn iser_login_from(proposed: CmPeer, extra: &[(&str, &str)]) -> (Harness, Vec<(String, String)>) {
    let portal = RamPortal::new(IQN).build();
    let mut h = Harness::new_iser_from(portal, proposed);
    let r = h.login_response(INI, extra);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
    let k = keys_of(&r.data);
    h.clear_unit_attention();
    (h, k)
}

/// The connect request proposes the peer, the RDMAExtensions key confirms
/// it. An illumos-looking connect that negotiates RFC 7145 keys is a peer we
/// cannot place, so it gets the illumos limits, which every peer can take:
/// no immediate data, InitialR2T.
#[test]
fn an_illumos_connect_with_rdma_extensions_gets_the_illumos_limits() {
    let (_, k) = iser_login_from(
        CmPeer::Illumos,
        &[
            ("RDMAExtensions", "Yes"),
            ("InitiatorRecvDataSegmentLength", "262144"),
            ("TargetRecvDataSegmentLength", "262144"),
            ("ImmediateData", "Yes"),
            ("InitialR2T", "No"),
        ],
    );
    assert_eq!(key(&k, "RDMAExtensions"), Some("Yes"));
    assert_eq!(
        (key(&k, "ImmediateData"), key(&k, "InitialR2T")),
        (Some("No"), Some("Yes")),
        "illumos limits when the connect request and the keys disagree"
    );
}

#[test]
fn the_peer_is_linux_only_when_the_connect_request_and_the_keys_agree() {
    let linux_keys = [
        ("RDMAExtensions", "Yes"),
        ("InitiatorRecvDataSegmentLength", "262144"),
        ("TargetRecvDataSegmentLength", "262144"),
        ("ImmediateData", "Yes"),
        ("InitialR2T", "No"),
    ];
    let (mut h, k) = iser_login_from(CmPeer::Linux, &linux_keys);
    assert_eq!(session_peer(&mut h), Some(IserPeer::Linux));
    assert_eq!(key(&k, "ImmediateData"), Some("Yes"));
    let (mut h, _) = iser_login_from(CmPeer::Illumos, &linux_keys);
    assert_eq!(session_peer(&mut h), Some(IserPeer::Illumos));
    // A Linux-looking connect that logs in like illumos (no RFC 7145 keys).
    let (mut h, k) = iser_login_from(
        CmPeer::Linux,
        &[("ImmediateData", "Yes"), ("InitialR2T", "No")],
    );
    assert_eq!(session_peer(&mut h), Some(IserPeer::Illumos));
    assert_eq!(key(&k, "ImmediateData"), Some("No"));
    assert_eq!(session_peer(&mut logged_in()), None);
}

/// The one event a normal login produces, which the driver acts on once:
/// whose limits the session settled on.
fn session_peer(h: &mut Harness) -> Option<IserPeer> {
    let Some(Event::NormalSession { iser_peer, .. }) = h.conn.poll_event() else {
        panic!("a normal login announces its session");
    };
    assert!(h.conn.poll_event().is_none(), "announced once");
    iser_peer
}

#[test]
fn iser_login_linux_keys() {
    let (h, k) = iser_login(&[
        ("RDMAExtensions", "Yes"),
        ("HeaderDigest", "CRC32C,None"),
        ("DataDigest", "CRC32C,None"),
        ("InitiatorRecvDataSegmentLength", "262144"),
        ("TargetRecvDataSegmentLength", "262144"),
        ("ImmediateData", "Yes"),
        ("InitialR2T", "No"),
        ("MaxOutstandingUnexpectedPDUs", "0"),
    ]);
    assert_eq!(key(&k, "RDMAExtensions"), Some("Yes"));
    assert_eq!(
        key(&k, "HeaderDigest"),
        Some("None"),
        "no digests over iSER"
    );
    assert_eq!(key(&k, "DataDigest"), Some("None"));
    assert_eq!(key(&k, "TargetRecvDataSegmentLength"), Some("8192"));
    assert_eq!(key(&k, "MaxRecvDataSegmentLength"), None);
    assert_eq!(key(&k, "ImmediateData"), Some("Yes"));
    assert_eq!(key(&k, "MaxOutstandingUnexpectedPDUs"), Some("0"));
    assert_eq!(h.conn.rx_digests(), Default::default());
}

#[test]
fn iser_login_illumos_profile_gets_what_illumos_requires() {
    // What iscsi_login.c sends: no iSER keys at all.
    let (_h, k) = iser_login(&[
        ("HeaderDigest", "None"),
        ("DataDigest", "None"),
        ("MaxRecvDataSegmentLength", "8192"),
        ("DefaultTime2Wait", "2"),
        ("DefaultTime2Retain", "20"),
        ("ErrorRecoveryLevel", "0"),
        ("IFMarker", "No"),
        ("OFMarker", "No"),
        ("InitialR2T", "Yes"),
        ("ImmediateData", "Yes"),
        ("MaxBurstLength", "262144"),
        ("FirstBurstLength", "65536"),
        ("MaxOutstandingR2T", "1"),
        ("MaxConnections", "1"),
        ("DataPDUInOrder", "Yes"),
        ("DataSequenceInOrder", "Yes"),
    ]);
    assert_eq!(key(&k, "ImmediateData"), Some("No"));
    assert_eq!(key(&k, "InitialR2T"), Some("Yes"));
    assert_eq!(key(&k, "MaxOutstandingR2T"), Some("1"));
    assert_eq!(key(&k, "MaxConnections"), Some("1"));
    assert_eq!(key(&k, "ErrorRecoveryLevel"), Some("0"));
    let mrdsl: u32 = key(&k, "MaxRecvDataSegmentLength")
        .unwrap()
        .parse()
        .unwrap();
    assert!(mrdsl <= 8192);
    assert_eq!(key(&k, "RDMAExtensions"), None);
}

#[test]
fn iser_read_is_one_rdma_write_before_the_response() {
    let (mut h, _) = iser_login(&[("RDMAExtensions", "Yes")]);
    let (_, r) = h.iser_command(
        &read10(0, 16),
        scsi_cmd_flags(false, true),
        8192,
        &[],
        None,
        iser_buf(0x1000),
    );
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    assert_eq!(h.rdma.len(), 1);
    let (at, ref a) = h.rdma[0];
    assert_eq!(at, 0, "the RDMA WRITE is queued before the response");
    assert_eq!(
        *a,
        Action::RdmaWrite {
            stag: 0x77,
            remote_addr: 0x1000,
            data: OutData::Store {
                volume: first_volume(&h),
                offset: 0,
                len: 8192
            }
        }
    );
}

#[test]
fn iser_read_without_a_read_buffer_is_rejected() {
    let (mut h, _) = iser_login(&[("RDMAExtensions", "Yes")]);
    let (_, r) = h.iser_command(
        &read10(0, 1),
        scsi_cmd_flags(false, true),
        512,
        &[],
        None,
        None,
    );
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::Reject));
    assert!(h.rdma.is_empty());
}

#[test]
fn iser_write_takes_immediate_data_and_rdma_reads_the_rest() {
    let (mut h, _) = iser_login(&[("RDMAExtensions", "Yes"), ("ImmediateData", "Yes")]);
    let data: Vec<u8> = (0..16384u32).map(|i| (i * 13 + 1) as u8).collect();
    let (itt, r) = h.iser_command(
        &write10(4, 32),
        scsi_cmd_flags(true, false),
        16384,
        &data[..4096],
        iser_buf(0x9000),
        None,
    );
    assert!(r.is_empty(), "waits for the RDMA READ");
    let Some((
        _,
        Action::RdmaRead {
            tag,
            stag,
            remote_addr,
            len,
            dest,
        },
    )) = h.rdma.pop()
    else {
        panic!("expected an RDMA READ");
    };
    // Linux points the write VA at the first byte not sent as immediate data.
    assert_eq!((stag, remote_addr, len), (0x77, 0x9000, 12288));
    let ReadDest::Store { volume, offset } = dest else {
        panic!("LUN writes are read straight into the store: {dest:?}");
    };
    assert_eq!(offset, 4 * 512 + 4096);
    // Play the HCA: place the bytes, then report the completion.
    assert_eq!(volume, first_volume(&h));
    let lu_store = h
        .conn
        .portal()
        .core
        .volumes
        .iter()
        .next()
        .unwrap()
        .store()
        .clone();
    lu_store.write(offset, &data[4096..]).unwrap();
    h.conn.handle(h.now, Input::RdmaReadDone { tag, data: &[] });
    let r = h.drain();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].bhs.itt(), r[0].bhs.scsi_status()),
        (itt, status::GOOD)
    );
    let mut back = vec![0u8; 16384];
    lu_store.read(4 * 512, &mut back).unwrap();
    assert_eq!(back, data);
    // A late completion for a tag no task owns is ignored.
    h.conn.handle(h.now, Input::RdmaReadDone { tag, data: &[] });
    assert!(h.drain().is_empty());
}

#[test]
fn iser_write_without_a_write_buffer_is_rejected() {
    let (mut h, _) = iser_login(&[("RDMAExtensions", "Yes")]);
    let (_, r) = h.iser_command(
        &write10(0, 8),
        scsi_cmd_flags(true, false),
        4096,
        &[],
        None,
        None,
    );
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::Reject));
}

#[test]
fn iser_parameter_data_is_read_into_the_driver_buffer() {
    let (mut h, _) = iser_login(&[]);
    // MODE SELECT(6) with a 12-byte header + block descriptor-less caching page.
    let mut param = vec![0u8; 4 + 20];
    param[4] = 0x08;
    param[5] = 0x12;
    let cdb = [0x15, 0x10, 0, 0, param.len() as u8, 0];
    let (_, r) = h.iser_command(
        &cdb,
        scsi_cmd_flags(true, false),
        param.len() as u32,
        &[],
        iser_buf(0x5000),
        None,
    );
    assert!(r.is_empty());
    let Some((_, Action::RdmaRead { tag, len, dest, .. })) = h.rdma.pop() else {
        panic!("expected an RDMA READ");
    };
    assert_eq!((len, dest), (param.len() as u32, ReadDest::Buffer));
    h.conn
        .handle(h.now, Input::RdmaReadDone { tag, data: &param });
    let r = h.drain();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
    assert_eq!(
        r[0].bhs.scsi_status(),
        status::GOOD,
        "the caching page as it is"
    );
    // The bytes read are the ones judged: a caching page asking for a
    // volatile write cache (WCE) is refused.
    param[6] |= 0x04;
    let (_, r) = h.iser_command(
        &cdb,
        scsi_cmd_flags(true, false),
        param.len() as u32,
        &[],
        iser_buf(0x6000),
        None,
    );
    assert!(r.is_empty());
    let Some((_, Action::RdmaRead { tag, .. })) = h.rdma.pop() else {
        panic!("expected an RDMA READ");
    };
    h.conn
        .handle(h.now, Input::RdmaReadDone { tag, data: &param });
    let r = h.drain();
    assert_eq!(r[0].bhs.scsi_status(), status::CHECK_CONDITION);
    assert_eq!(sense_of(&r[0]).key, sense_key::ILLEGAL_REQUEST);
}

#[test]
fn iser_linux_full_feature_data_stays_within_128_bytes() {
    let (mut h, _) = iser_login(&[
        ("RDMAExtensions", "Yes"),
        ("InitiatorRecvDataSegmentLength", "8192"),
    ]);
    let mut b = Bhs::new(Opcode::NopOut);
    b.set_final(true)
        .set_itt(0x55)
        .set_ttt(RESERVED_TAG)
        .set_cmdsn(h.cmdsn);
    h.cmdsn += 1;
    let r = h.send(&b, &[0x5a; 1000]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::NopIn));
    assert!(r[0].data.len() <= 128);
}

mod abort_fencing;
mod cmdsn;
mod lifetimes;
mod page_settle;
mod reinstatement;
mod restart_notice;
mod transfer_length;
mod trust;

/// The I/O path searches for a command's LU once; every later step (the
/// placement of its data, the abort check, execution, its counters)
/// indexes. Checked for a 4 KiB WRITE over TCP (immediate data) and over
/// iSER (an RDMA READ the simulated adapter completes).
#[test]
fn a_write_searches_for_its_lu_once() {
    const WRITES: u32 = 4;
    let mut h = Harness::new(RamPortal::new(IQN).build());
    h.login(&[("ImmediateData", "Yes"), ("InitialR2T", "No")]);
    let before = crate::scsi::lu_lookups();
    for i in 0..WRITES {
        let (_, r) = h.command(&write10(i * 8, 8), 0xa1, 4096, &[0x5a; 4096]);
        assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    }
    assert_eq!(crate::scsi::lu_lookups() - before, u64::from(WRITES), "TCP");

    let (mut h, _) = iser_login(&[("RDMAExtensions", "Yes")]);
    let mut hca = crate::testkit::SimulatedHca::new(4);
    let before = crate::scsi::lu_lookups();
    for i in 0..WRITES {
        let (stag, va) = (0x100 + i, 0x10_0000 * u64::from(i + 1));
        hca.register(stag, va, vec![0xa5; 4096]);
        let buf = Some(ramslog_common::iser::RemoteBuffer { stag, va });
        let (_, r) = h.iser_command(&write10(i * 8, 8), 0xa1, 4096, &[], buf, None);
        assert!(r.is_empty(), "the write waits for its data");
        let actions: Vec<Action> = h.rdma.drain(..).map(|(_, a)| a).collect();
        assert!(hca.take(&h.conn, actions).is_empty());
        assert!(hca.complete_one(&mut h.conn, h.now));
        let r = h.drain();
        assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    }
    assert_eq!(
        crate::scsi::lu_lookups() - before,
        u64::from(WRITES),
        "iSER"
    );
    let mut lun = vec![0u8; 4096];
    assert!(h.read_lun(0, &mut lun));
    assert!(lun.iter().all(|&b| b == 0xa5), "the READ's bytes landed");
}
