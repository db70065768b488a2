//! Regression tests for the trust defects: GOOD only with every byte in
//! place, no way around CHAP, no discovery session ending a normal one, and
//! liveness pings that really fire.

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const LUN_BYTES: u64 = 1 << 20;

/// Every byte of the LUN, read through the engine.
fn lun_bytes(h: &Harness) -> Vec<u8> {
    let mut v = vec![0u8; LUN_BYTES as usize];
    assert!(h.read_lun(0, &mut v));
    v
}

fn harness_with_limits(limits: Limits) -> Harness {
    Harness::new(RamPortal::new(IQN).size(LUN_BYTES).limits(limits).build())
}

fn fill_lun(h: &mut Harness, byte: u8) {
    let scsi = h.conn.portal().targets[0].scsi.clone();
    let lu = scsi.lu(0).expect("LUN 0");
    lu.volume()
        .store()
        .write(0, &vec![byte; LUN_BYTES as usize])
        .expect("fill");
}

/// The exact reproduction: InitialR2T=Yes, ImmediateData=No,
/// MaxOutstandingR2T=2, MaxBurstLength=64 KiB, a 256 KiB WRITE whose first
/// solicited burst ends at half its length.
#[test]
fn solicited_burst_ending_early_is_never_good() {
    let mut h = harness_with_limits(Limits::default());
    h.login(&[
        ("InitialR2T", "Yes"),
        ("ImmediateData", "No"),
        ("MaxOutstandingR2T", "2"),
        ("MaxBurstLength", "65536"),
    ]);
    fill_lun(&mut h, 0x5a);
    let before = lun_bytes(&h);
    let data = vec![0xa5u8; 262144];
    let (itt, r) = h.command(&write10(0, 512), scsi_cmd_flags(true, false), 262144, &[]);
    let mut r2ts: Vec<(u32, u32, u32)> = r
        .iter()
        .map(|p| {
            assert_eq!(p.bhs.opcode(), Some(Opcode::ReadyToTransfer));
            (p.bhs.ttt(), p.bhs.buffer_offset(), p.bhs.residual())
        })
        .collect();
    assert_eq!(r2ts.len(), 2);
    let mut status_seen = None;
    let mut first = true;
    while let Some((ttt, off, len)) = r2ts.first().copied() {
        r2ts.remove(0);
        let send_len = if first { len / 2 } else { len };
        first = false;
        let d = Bhs::data_out(itt, ttt, off, 0, true);
        for p in h.send(&d, &data[off as usize..(off + send_len) as usize]) {
            match p.bhs.opcode() {
                Some(Opcode::ReadyToTransfer) => {
                    r2ts.push((p.bhs.ttt(), p.bhs.buffer_offset(), p.bhs.residual()))
                }
                Some(Opcode::ScsiResponse) => {
                    assert!(status_seen.is_none(), "defect 1: two responses");
                    assert!(
                        r2ts.is_empty(),
                        "defect 1: status sent while a burst is still outstanding"
                    );
                    status_seen = Some(p);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let rsp = status_seen.expect("defect 1: no response after every burst ended");
    assert_ne!(
        rsp.bhs.scsi_status(),
        status::GOOD,
        "defect 1: GOOD for a write with a 32 KiB hole"
    );
    let s = sense_of(&rsp);
    assert_eq!(
        (s.key, s.asc, s.ascq),
        (sense_key::ABORTED_COMMAND, 0x4b, 0)
    );
    let after = lun_bytes(&h);
    assert_eq!(&after[262144..], &before[262144..], "outside the LBA range");
}

/// Unsolicited data may legally end early: exactly the missing range is
/// solicited, and the write completes with the right bytes.
#[test]
fn unsolicited_data_ending_early_is_solicited_exactly() {
    let mut h = harness_with_limits(Limits::default());
    h.login(&[
        ("InitialR2T", "No"),
        ("ImmediateData", "Yes"),
        ("FirstBurstLength", "65536"),
        ("MaxBurstLength", "65536"),
        ("MaxOutstandingR2T", "4"),
    ]);
    let data: Vec<u8> = (0..262144u32).map(|i| (i % 251) as u8).collect();
    let (itt, b) = h.scsi_bhs(&write10(0, 512), 0x21, 262144);
    let mut pending: Vec<(u32, u32, u32)> = Vec::new();
    let mut responses = Vec::new();
    let mut route = |h: &mut Harness, out: Vec<Rsp>, pending: &mut Vec<(u32, u32, u32)>| {
        for p in out {
            match p.bhs.opcode() {
                Some(Opcode::ReadyToTransfer) => {
                    pending.push((p.bhs.ttt(), p.bhs.buffer_offset(), p.bhs.residual()))
                }
                _ => responses.push(p),
            }
        }
        let _ = h;
    };
    // 8 KiB immediate, then unsolicited Data-Out stopping at 24 KiB (F=1).
    let out = h.send(&b, &data[..8192]);
    route(&mut h, out, &mut pending);
    let out = h.send(
        &Bhs::data_out(itt, RESERVED_TAG, 8192, 0, true),
        &data[8192..24576],
    );
    route(&mut h, out, &mut pending);
    while let Some((ttt, off, len)) = pending.pop() {
        let out = h.send(
            &Bhs::data_out(itt, ttt, off, 0, true),
            &data[off as usize..(off + len) as usize],
        );
        route(&mut h, out, &mut pending);
    }
    assert_eq!(responses.len(), 1, "defect 1: one response");
    assert_eq!(responses[0].bhs.scsi_status(), status::GOOD);
    assert_eq!(&lun_bytes(&h)[..262144], &data[..], "defect 1: bytes");
}

/// One random initiator: how it splits and orders its data, and whether it
/// ends a solicited burst early.
#[derive(Debug, Clone)]
struct WriteCase {
    seed: u64,
    initial_r2t: bool,
    immediate: bool,
    max_outstanding_r2t: u32,
    max_burst_blocks: u32,
    first_burst_blocks: u32,
    lba: u32,
    blocks: u32,
}

fn write_case() -> impl Strategy<Value = WriteCase> {
    (
        any::<u64>(),
        any::<bool>(),
        any::<bool>(),
        1u32..=4,
        1u32..=128,
        1u32..=128,
        16u32..1200,
        1u32..=512,
    )
        .prop_map(
            |(seed, initial_r2t, immediate, mort, mbl, fbl, lba, blocks)| WriteCase {
                seed,
                initial_r2t,
                immediate,
                max_outstanding_r2t: mort,
                max_burst_blocks: mbl,
                first_burst_blocks: fbl,
                lba,
                blocks: blocks.min(2048 - 16 - lba),
            },
        )
        .prop_filter("room on the LUN", |c| c.blocks > 0)
}

struct Burst {
    ttt: u32,
    next: u32,
    end: u32,
    datasn: u32,
}

fn run_write_case(c: &WriteCase) {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let mut h = harness_with_limits(Limits::default());
    let mbl = (c.max_burst_blocks * 512).to_string();
    let fbl = (c.first_burst_blocks * 512).to_string();
    let mort = c.max_outstanding_r2t.to_string();
    let r = h.login(&[
        ("InitialR2T", if c.initial_r2t { "Yes" } else { "No" }),
        ("ImmediateData", if c.immediate { "Yes" } else { "No" }),
        ("MaxOutstandingR2T", &mort),
        ("MaxBurstLength", &mbl),
        ("FirstBurstLength", &fbl),
    ]);
    let k = keys_of(&r.data);
    let num = |name: &str| -> u32 { key(&k, name).unwrap().parse().unwrap() };
    let first_burst = num("FirstBurstLength").min(num("MaxBurstLength"));
    let immediate = key(&k, "ImmediateData") == Some("Yes");
    let initial_r2t = key(&k, "InitialR2T") == Some("Yes");

    fill_lun(&mut h, 0x3c);
    let before = lun_bytes(&h);
    let total = c.blocks * 512;
    let data: Vec<u8> = (0..total).map(|_| rng.gen()).collect();

    // What the initiator sends unsolicited: immediate data, then Data-Out
    // up to `unsol_end`, which may stop short of FirstBurstLength (legal).
    let unsol_limit = first_burst.min(total);
    let imm = if immediate {
        rng.gen_range(0..=unsol_limit)
    } else {
        0
    };
    let unsol_end = if initial_r2t || imm == unsol_limit || rng.gen_bool(0.2) {
        imm
    } else {
        rng.gen_range(imm + 1..=unsol_limit)
    };
    let f = if unsol_end == imm { 0x80 } else { 0 };
    let (itt, b) = h.scsi_bhs(&write10(c.lba, c.blocks as u16), f | 0x21, total);

    let mut bursts: Vec<Burst> = Vec::new();
    let mut response: Option<Rsp> = None;
    let mut misbehaved = false;
    let handle = |out: Vec<Rsp>, bursts: &mut Vec<Burst>, response: &mut Option<Rsp>| {
        for p in out {
            match p.bhs.opcode() {
                Some(Opcode::ReadyToTransfer) => {
                    assert!(response.is_none(), "defect 1: R2T after the response");
                    let (off, len) = (p.bhs.buffer_offset(), p.bhs.residual());
                    assert!(
                        len > 0 && off + len <= total,
                        "defect 1: R2T outside the transfer"
                    );
                    bursts.push(Burst {
                        ttt: p.bhs.ttt(),
                        next: off,
                        end: off + len,
                        datasn: 0,
                    });
                }
                Some(Opcode::ScsiResponse) => {
                    assert!(response.is_none(), "defect 1: two responses");
                    assert!(
                        bursts.is_empty(),
                        "defect 1: status while {} burst(s) are outstanding",
                        bursts.len()
                    );
                    *response = Some(p);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    };
    let out = h.send(&b, &data[..imm as usize]);
    handle(out, &mut bursts, &mut response);
    // Unsolicited Data-Out in random pieces.
    let (mut off, mut datasn) = (imm, 0);
    while off < unsol_end {
        let len = rng.gen_range(1..=(unsol_end - off).min(16384));
        let last = off + len == unsol_end;
        let out = h.send(
            &Bhs::data_out(itt, RESERVED_TAG, off, datasn, last),
            &data[off as usize..(off + len) as usize],
        );
        handle(out, &mut bursts, &mut response);
        off += len;
        datasn += 1;
    }
    // Solicited data: pieces of random bursts in random order; now and then
    // a burst ends early (F=1 before its end), which must fail the command.
    let mut rounds = 0;
    while !bursts.is_empty() {
        rounds += 1;
        assert!(rounds < 100_000, "defect 1: no end");
        let i = rng.gen_range(0..bursts.len());
        let bt = &mut bursts[i];
        let left = bt.end - bt.next;
        let len = rng.gen_range(1..=left.min(8192));
        let early = len < left && rng.gen_bool(0.05);
        let last = early || len == left;
        misbehaved |= early;
        let d = Bhs::data_out(itt, bt.ttt, bt.next, bt.datasn, last);
        let piece = data[bt.next as usize..(bt.next + len) as usize].to_vec();
        bt.next += len;
        bt.datasn += 1;
        if last {
            bursts.swap_remove(i);
        }
        let out = h.send(&d, &piece);
        handle(out, &mut bursts, &mut response);
    }
    let rsp = response.expect("defect 1: every burst ended but no response came");
    let after = lun_bytes(&h);
    let start = c.lba as usize * 512;
    let end = start + total as usize;
    assert!(
        after[..start] == before[..start] && after[end..] == before[end..],
        "defect 1: a byte outside the command's LBA range changed"
    );
    if rsp.bhs.scsi_status() == status::GOOD {
        assert!(!misbehaved, "defect 1: GOOD although a burst ended early");
        assert!(
            after[start..end] == data[..],
            "defect 1: GOOD but the LUN does not hold the written bytes"
        );
    } else {
        assert!(
            misbehaved,
            "defect 1: a correct transfer failed: {:?}",
            rsp.bhs
        );
        let s = sense_of(&rsp);
        assert_eq!(
            (s.key, s.asc, s.ascq),
            (sense_key::ABORTED_COMMAND, 0x4b, 0)
        );
    }
    assert!(!h.closed);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// GOOD ⇒ the LUN holds exactly the written bytes; no byte outside the
    /// command's LBA range ever changes; the status comes only after every
    /// sequence of the task ended.
    #[test]
    fn good_only_with_every_byte_in_place(c in write_case()) {
        run_write_case(&c);
    }
}

// ---- CHAP and key order ------------------------------------------------------

fn chap_portal(discovery: bool) -> Arc<Portal> {
    let secret = ChapSecret {
        user: "alice".into(),
        secret: "0123456789abcdef".into(),
    };
    let portal = RamPortal::new(IQN).chap(secret.clone());
    if discovery {
        portal.discovery_chap(secret)
    } else {
        portal
    }
    .build()
}

fn permutations<T: Clone>(items: &[T]) -> Vec<Vec<T>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut all = Vec::new();
    for i in 0..items.len() {
        let mut rest = items.to_vec();
        let first = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, first.clone());
            all.push(p);
        }
    }
    all
}

/// Try to reach full feature phase with AuthMethod=None; true if it worked.
fn login_without_chap(portal: Arc<Portal>, keys: &[(&str, &str)], stepwise: bool) -> bool {
    let mut h = Harness::new(portal);
    let sec = if stepwise {
        login::TRANSIT | login::STAGE_OPERATIONAL
    } else {
        login::TRANSIT | login::STAGE_FULL_FEATURE
    };
    let r = h.login_pdu(sec, keys);
    if h.closed || r.is_empty() || r[0].bhs.login_status() != 0 {
        return false;
    }
    if r[0].bhs.flags() & 3 == login::STAGE_FULL_FEATURE && r[0].bhs.final_bit() {
        return true;
    }
    if !stepwise {
        return false;
    }
    let op_to_ff = login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;
    let r = h.login_pdu(op_to_ff, &[]);
    !h.closed && r[0].bhs.login_status() == 0 && r[0].bhs.final_bit()
}

#[test]
fn chap_cannot_be_bypassed_by_key_order() {
    let normal = [
        ("InitiatorName", INI),
        ("TargetName", IQN),
        ("SessionType", "Normal"),
        ("AuthMethod", "None"),
    ];
    let discovery = [
        ("InitiatorName", INI),
        ("SessionType", "Discovery"),
        ("AuthMethod", "None"),
    ];
    for (keys, to_discovery) in [(&normal[..], false), (&discovery[..], true)] {
        for order in permutations(keys) {
            for stepwise in [true, false] {
                assert!(
                    !login_without_chap(chap_portal(to_discovery), &order, stepwise),
                    "defect 2: CHAP bypassed (discovery: {to_discovery}) with key order {order:?}"
                );
            }
        }
    }
}

// ---- sessions ----------------------------------------------------------------

#[test]
fn discovery_login_never_ends_a_normal_session() {
    let portal = RamPortal::new(IQN)
        .acl(Acl::Only(vec![AclEntry::any_address(INI)]))
        .build();
    let victim_flag = SessionControl::without_transport();
    let mut victim = Harness::new(portal.clone());
    victim.conn = Connection::tcp(
        portal.clone(),
        victim.conn.info,
        victim_flag.clone(),
        victim.now,
    );
    let r = victim.login(&[]);
    assert_eq!(r.bhs.login_status(), 0);

    // The same InitiatorName, ISID and TargetName, but SessionType=Discovery.
    let mut attacker = Harness::new(portal.clone());
    let flags = login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE;
    let answer = attacker.login_pdu(
        flags,
        &[
            ("InitiatorName", INI),
            ("TargetName", IQN),
            ("SessionType", "Discovery"),
        ],
    );
    // The attack is real: the discovery session was admitted (in full
    // feature phase), so it had every chance to end the victim's.
    let answer = answer.first().expect("the attacker's login was answered");
    assert!(!attacker.closed, "the attacker's connection was closed");
    assert_eq!(
        (
            answer.bhs.login_status(),
            answer.bhs.final_bit(),
            answer.bhs.flags() & 3
        ),
        (0, true, login::STAGE_FULL_FEATURE),
        "the discovery login of the same nexus was not admitted: the test shows nothing"
    );
    assert!(
        !victim_flag.is_terminated(),
        "defect 3: a discovery login terminated a normal session"
    );
    assert_eq!(
        portal
            .sessions_info()
            .iter()
            .filter(|s| s.key.target == IQN)
            .count(),
        1,
        "defect 3: the victim's session is still registered"
    );
    let (_, r) = victim.command(&[0; 6], 0x81, 0, &[]);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);

    // A normal login of the same I_T nexus does reinstate (RFC 7143 6.3.5).
    let mut again = Harness::new(portal);
    again.login(&[]);
    assert!(victim_flag.is_terminated(), "reinstatement");
}

// ---- liveness ----------------------------------------------------------------

/// The driver advances its clock to each deadline `poll_timeout` names; an
/// initiator that never answers a ping must be dropped within
/// NopInterval + NopTimeout.
#[test]
fn unanswered_ping_closes_when_the_clock_steps_through_each_deadline() {
    let mut h = logged_in();
    let start = h.now;
    let limit = start + Limits::default().nop_interval + Limits::default().nop_timeout;
    let mut pings = 0;
    while !h.closed {
        let Some(at) = h.conn.poll_timeout() else {
            panic!("defect 7: no timer armed and not closed");
        };
        assert!(
            at <= limit,
            "defect 7: still waiting at {:?} after {pings} unanswered ping(s)",
            at - start
        );
        h.now = at;
        h.conn.handle(at, Input::Timeout);
        pings += h
            .drain()
            .iter()
            .filter(|p| p.bhs.opcode() == Some(Opcode::NopIn))
            .count();
    }
    assert_eq!(pings, 1, "one ping, then the connection is dropped");
}

#[test]
fn acl_entries_bound_to_a_network_refuse_other_sources() {
    // The harness connects from 127.0.0.1.
    let status_for = |entry: &str| {
        let acl = Acl::Only(vec![entry.parse().unwrap()]);
        let mut h = Harness::new(RamPortal::new(IQN).acl(acl).build());
        h.login_response(INI, &[]).bhs.login_status()
    };
    for (network, status) in [
        ("127.0.0.0/8", login_status::SUCCESS),
        ("127.0.0.1", login_status::SUCCESS),
        ("192.0.2.0/24", login_status::FORBIDDEN),
        ("::1/128", login_status::FORBIDDEN),
    ] {
        assert_eq!(status_for(&format!("{INI}@{network}")), status, "{network}");
    }
    assert!("iqn.x@not-a-net".parse::<AclEntry>().is_err());
}

// ---- the command window -----------------------------------------------------

/// MaxCmdSN = ExpCmdSN + window − 1 − (non-immediate commands not yet
/// answered): with every slot waiting for data the window is shut, and a
/// command beyond the advertised MaxCmdSN is dropped.
#[test]
fn max_cmdsn_closes_while_commands_wait_for_data() {
    let mut h = harness_with_limits(Limits {
        cmd_window: 4,
        ..Limits::default()
    });
    h.login(&[("InitialR2T", "Yes"), ("ImmediateData", "No")]);
    let mut last_r2t = None;
    let mut itts = Vec::new();
    for i in 0..4u32 {
        let (itt, r) = h.command(&write10(i * 8, 8), 0xa1, 4096, &[]);
        assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
        itts.push((itt, r[0].bhs.ttt()));
        last_r2t = Some(r.into_iter().next().unwrap());
    }
    let r2t = last_r2t.unwrap();
    assert_eq!(
        r2t.bhs.max_cmdsn(),
        r2t.bhs.exp_cmdsn().wrapping_sub(1),
        "defect 4: four commands wait for data, the window must be shut"
    );
    // Beyond MaxCmdSN: dropped, no answer.
    let (_, r) = h.command(&[0; 6], 0x81, 0, &[]);
    assert!(
        r.is_empty(),
        "defect 4: a command beyond MaxCmdSN was executed"
    );
    h.cmdsn -= 1;
    // Answering one write reopens the window by one.
    let (itt, ttt) = itts[0];
    let r = h.send(&Bhs::data_out(itt, ttt, 0, 0, true), &[0u8; 4096]);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    assert_eq!(r[0].bhs.max_cmdsn(), r[0].bhs.exp_cmdsn());
    let (_, r) = h.command(&[0; 6], 0x81, 0, &[]);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
}

/// Data-In is produced as the driver takes it: a 16 MiB READ to an
/// initiator that receives 512-byte segments queues one item, not 32768 PDUs.
#[test]
fn data_in_is_produced_as_the_driver_takes_it() {
    let mut h = Harness::new(RamPortal::new(IQN).size(32 << 20).build());
    h.login(&[("MaxRecvDataSegmentLength", "512")]);
    let (_, b) = h.scsi_bhs(&read10(0, 32768), 0xc1, 16 << 20);
    h.conn.handle(h.now, Input::pdu(&b, &[], &[]));
    assert!(
        h.conn.queued_actions() <= 4,
        "defect 4: {} actions queued for one READ",
        h.conn.queued_actions()
    );
    let r = h.drain();
    assert_eq!(r.len(), 32768);
    assert!(r.iter().all(|p| p.data.len() == 512));
    assert_eq!(r.last().unwrap().bhs.flags() & 0x81, 0x81);
}

// ---- PREEMPT AND ABORT ------------------------------------------------------

fn login_named(h: &mut Harness, name: &str, extra: &[(&str, &str)]) {
    let r = h.login_as(name, extra);
    assert_eq!(r.bhs.login_status(), login_status::SUCCESS);
}

/// PERSISTENT RESERVE OUT with its parameter list as immediate data.
fn pr_out(h: &mut Harness, service_action: u8, key: u64, sa_key: u64) -> u8 {
    let (cdb, params) = ramslog_common::cdb::persistent_reserve_out(service_action, key, sa_key);
    let (_, r) = h.command(&cdb, 0x81 | 0x20, 24, &params);
    r[0].bhs.scsi_status()
}

const PR_REGISTER: u8 = 0;
const PR_RESERVE: u8 = 1;
const PR_PREEMPT_AND_ABORT: u8 = 5;

/// Host A over TCP and host B (over iSER when `b_over_iser`, with
/// `b_keys`) logged in to one LUN.
fn hosts_a_and_b(b_over_iser: bool, b_keys: &[(&str, &str)]) -> (Harness, Harness) {
    let portal = RamPortal::new(IQN).size(LUN_BYTES).build();
    let mut a = Harness::new(portal.clone());
    login_named(&mut a, "iqn.2026-11.org.ramslog:host-a", &[]);
    let mut b = if b_over_iser {
        Harness::new_iser(portal)
    } else {
        Harness::new(portal)
    };
    login_named(&mut b, "iqn.2026-11.org.ramslog:host-b", b_keys);
    (a, b)
}

/// SPC-4 5.13.11.2.6: the preempted nexus's tasks are aborted. Data that
/// arrives for them afterwards must not land, and none of them gets GOOD.
#[test]
fn preempt_and_abort_fences_the_preempted_writes_over_tcp() {
    let (mut a, mut b) = hosts_a_and_b(false, &[("InitialR2T", "Yes"), ("ImmediateData", "Yes")]);
    assert_eq!(pr_out(&mut a, PR_REGISTER, 0, 0xaa), status::GOOD);
    assert_eq!(pr_out(&mut b, PR_REGISTER, 0, 0xbb), status::GOOD);
    assert_eq!(pr_out(&mut b, PR_RESERVE, 0xbb, 0), status::GOOD);
    fill_lun(&mut b, 0x11);
    // B's write waits for its data...
    let (itt, r) = b.command(&write10(64, 8), 0xa1, 4096, &[]);
    assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
    let ttt = r[0].bhs.ttt();
    // ...while A preempts B and aborts its tasks.
    assert_eq!(
        pr_out(&mut a, PR_PREEMPT_AND_ABORT, 0xaa, 0xbb),
        status::GOOD
    );
    let r = b.send(&Bhs::data_out(itt, ttt, 0, 0, true), &[0x99u8; 4096]);
    assert!(
        !r.iter()
            .any(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse)
                && p.bhs.scsi_status() == status::GOOD),
        "defect 8: a preempted write got GOOD"
    );
    assert!(
        lun_bytes(&b)[64 * 512..72 * 512].iter().all(|x| *x == 0x11),
        "defect 8: data of a preempted write landed after the preempt"
    );
}

/// The iSER case: the RDMA READ completes after the preempt.
#[test]
fn preempt_and_abort_fences_the_preempted_writes_over_iser() {
    let b_keys = [
        ("RDMAExtensions", "Yes"),
        ("ImmediateData", "Yes"),
        ("InitialR2T", "Yes"),
    ];
    let (mut a, mut b) = hosts_a_and_b(true, &b_keys);
    assert_eq!(pr_out(&mut a, PR_REGISTER, 0, 0xaa), status::GOOD);
    let (cdb, params) = ramslog_common::cdb::persistent_reserve_out(PR_REGISTER, 0, 0xbb);
    // Parameter data over iSER arrives as immediate data here.
    let (_, r) = b.iser_command(&cdb, 0xa1, 24, &params, None, None);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD);
    b.rdma.clear();
    let (_, r) = b.iser_command(&write10(64, 8), 0xa1, 4096, &[], iser_buf(0x1000), None);
    assert!(r.is_empty(), "waiting for the RDMA READ");
    let tag = match b.rdma.last() {
        Some((_, Action::RdmaRead { tag, .. })) => *tag,
        other => panic!("expected an RDMA READ, got {other:?}"),
    };
    assert_eq!(
        pr_out(&mut a, PR_PREEMPT_AND_ABORT, 0xaa, 0xbb),
        status::GOOD
    );
    b.conn.handle(b.now, Input::RdmaReadDone { tag, data: &[] });
    let r = b.drain();
    assert!(
        !r.iter()
            .any(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse)
                && p.bhs.scsi_status() == status::GOOD),
        "defect 8: a preempted iSER write got GOOD"
    );
}

// ---- smaller items ----------------------------------------------------------

/// Peer strings end up in logs and `status`: an initiator name with control
/// characters (a terminal escape here) is refused at login.
#[test]
fn initiator_names_with_control_characters_are_refused() {
    for name in [
        "iqn.2026-11.evil:\u{1b}[2J",
        "iqn.2026-11.evil:a\nb",
        "iqn.x y",
    ] {
        let mut h = Harness::new(RamPortal::new(IQN).build());
        assert_eq!(
            h.login_response(name, &[]).bhs.login_status(),
            login_status::INITIATOR_ERROR,
            "defect 11: initiator name {name:?} accepted"
        );
    }
}

/// iSER parameter data larger than the driver's 4 MiB bounce buffer is
/// refused with CHECK CONDITION instead of an RDMA READ the driver cannot
/// take (which ended the connection).
#[test]
fn iser_parameter_data_beyond_the_bounce_buffer_is_refused() {
    let portal = RamPortal::new(IQN).size(16 << 20).build();
    let mut h = Harness::new_iser(portal);
    login_named(
        &mut h,
        INI,
        &[("RDMAExtensions", "Yes"), ("InitialR2T", "Yes")],
    );
    let mut verify = write10(0, 10240); // 5 MiB of compare data
    verify[0] = 0x2f;
    verify[1] = 0x02;
    let (_, r) = h.iser_command(&verify, 0xa1, 10240 * 512, &[], iser_buf(0x1000), None);
    assert!(
        !h.rdma
            .iter()
            .any(|(_, a)| matches!(a, Action::RdmaRead { len, .. } if *len > 4 << 20)),
        "defect 11: an RDMA READ of parameter data beyond 4 MiB"
    );
    assert_eq!(r[0].bhs.scsi_status(), status::CHECK_CONDITION);
    assert!(!h.closed);
}

/// Defect 11: a unit attention must not be used up by a command that is then
/// refused with TASK SET FULL. Here the engine decides the unit attention
/// before the task-set check, so the refused command carries it; whichever
/// order, the nexus sees each condition exactly once.
#[test]
fn a_unit_attention_is_not_lost_to_task_set_full() {
    let mut h = harness_with_limits(Limits {
        cmd_window: 4,
        ..Limits::default()
    });
    h.login(&[("InitialR2T", "Yes")]);
    let tur = [0u8; 6];
    while h.command(&tur, 0x80, 0, &[]).1[0].bhs.scsi_status() != status::GOOD {}
    for i in 0..4 {
        let r = h.immediate_write(i * 8);
        assert_eq!(r[0].bhs.opcode(), Some(Opcode::ReadyToTransfer));
    }
    // Another session's admin action raises two unit attentions.
    let scsi = h.conn.portal().targets[0].scsi.clone();
    scsi.lu(0).expect("LUN 0").volume().set_not_ready(
        "the test lost its content".into(),
        crate::volume::Remedy::AcceptEmpty,
    );
    scsi.accept_empty(0, crate::volume::Identity::generate())
        .expect("accept-empty");
    let (mut seen, mut full) = (Vec::new(), 0);
    for _ in 0..4 {
        let r = h.immediate_write(64);
        assert_eq!(r[0].bhs.opcode(), Some(Opcode::ScsiResponse));
        match r[0].bhs.scsi_status() {
            status::CHECK_CONDITION => {
                let s = sense_of(&r[0]);
                seen.push((s.key, s.asc, s.ascq));
            }
            status::TASK_SET_FULL => full += 1,
            other => panic!("unexpected status {other:#x}"),
        }
    }
    assert!(full > 0, "the task set never filled");
    // TEST UNIT READY needs no task slot: any condition not yet reported
    // comes with it.
    for _ in 0..4 {
        let r = h.command(&tur, 0x80, 0, &[]).1;
        if r[0].bhs.scsi_status() == status::CHECK_CONDITION {
            let s = sense_of(&r[0]);
            seen.push((s.key, s.asc, s.ascq));
        }
    }
    assert_eq!(
        seen,
        vec![
            (sense_key::UNIT_ATTENTION, 0x3f, 0x03),
            (sense_key::UNIT_ATTENTION, 0x3f, 0x0e)
        ],
        "defect 11: each unit attention is reported exactly once"
    );
}

/// Shutdown: a write whose data lands after its volume was fenced gets no
/// status at all (not a CHECK CONDITION the host would count as a failed
/// write) and the connection closes, so the host retries it after the
/// restart. Found by the ZFS lab: a clean restart left one WRITE error on
/// the restarted half.
#[test]
fn a_write_that_meets_the_fence_gets_no_status() {
    let mut h = harness_with_limits(Limits::default());
    h.login(&[("InitialR2T", "No"), ("ImmediateData", "Yes")]);
    let tur = [0u8; 6];
    while h.command(&tur, 0x80, 0, &[]).1[0].bhs.scsi_status() != status::GOOD {}
    let (_, r) = h.command(&write10(0, 8), 0xa1, 4096, &[7u8; 4096]);
    assert_eq!(r[0].bhs.scsi_status(), status::GOOD, "before the fence");
    let scsi = h.conn.portal().targets[0].scsi.clone();
    scsi.lu(0).expect("LUN 0").volume().fence();
    let (_, r) = h.command(&write10(8, 8), 0xa1, 4096, &[9u8; 4096]);
    assert!(
        r.iter()
            .all(|p| p.bhs.opcode() != Some(Opcode::ScsiResponse)),
        "a status went out after the fence: {:?}",
        r.iter()
            .map(|p| (p.bhs.opcode(), p.bhs.scsi_status()))
            .collect::<Vec<_>>()
    );
    assert!(h.closed, "the connection closes instead");
}
