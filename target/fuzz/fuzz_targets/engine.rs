//! Arbitrary PDU sequences to a logged-in connection (TCP or iSER).
//!
//! Two modes, chosen by the first byte:
//! - raw: any BHS and data; no panic, and the action queue stays bounded;
//! - writes: WRITE commands and Data-Out with fuzzer-chosen offsets,
//!   lengths, DataSNs, TTTs and F bits, every byte an initiator sends for
//!   ITT `i` at offset `o` being `pattern(i, o)`. GOOD for a write ⇒ its LBA
//!   range holds exactly those bytes.
#![no_main]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use ramslog_common::iscsi::{Bhs, Opcode, BHS_LEN, RESERVED_TAG};
use ramslog_common::iser::RemoteBuffer;
use ramslog_target::iscsi::engine::{
    Action, Connection, Input as EngineInput, OutData, RemoteBuffers,
};
use ramslog_target::testkit;

/// `FUZZ_TRACE=1 cargo fuzz run engine ARTIFACT` prints what a case does.
macro_rules! trace {
    ($($arg:tt)*) => {
        if std::env::var_os("FUZZ_TRACE").is_some() {
            eprintln!($($arg)*);
        }
    };
}

const LUN_BYTES: u64 = 1 << 20;
/// Each write ITT owns its own 32 KiB of the LUN, so writes never overlap.
const REGION: u64 = 32 * 1024;
const WINDOW: usize = 128;

fn pattern(itt: u32, offset: u32) -> u8 {
    (itt.wrapping_mul(31) ^ offset.wrapping_mul(7) ^ (offset >> 8)) as u8
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from(self.byte()?) << 8 | u16::from(self.byte()?))
    }
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let n = n.min(self.0.len());
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(a)
    }
}

struct Run {
    conn: Connection,
    now: Instant,
    iser: bool,
    /// Writes that got R2Ts, by ITT: their open (TTT, offset, length).
    r2ts: HashMap<u32, Vec<(u32, u32, u32)>>,
    /// RDMA READs the "HCA" still has to complete.
    reads: Vec<(u32, u32, u64, u32)>,
    /// Commands sent and not yet answered, by ITT: their transfer length.
    outstanding: HashMap<u32, u32>,
    /// (ITT, length) of writes answered GOOD.
    goods: Vec<(u32, u32)>,
}

impl Run {
    fn drain(&mut self) {
        let mut n = 0usize;
        while let Some(a) = self.conn.poll_action() {
            n += 1;
            assert!(n < 1 << 20, "endless output");
            match a {
                Action::Send(p) => {
                    if p.bhs.opcode() == Some(Opcode::ReadyToTransfer) {
                        self.r2ts.entry(p.bhs.itt()).or_default().push((
                            p.bhs.ttt(),
                            p.bhs.buffer_offset(),
                            p.bhs.residual(),
                        ));
                    }
                    trace!(
                        "  <- {:?} itt={} st={} ttt={:#x} off={} len={}",
                        p.bhs.opcode(),
                        p.bhs.itt(),
                        p.bhs.scsi_status(),
                        p.bhs.ttt(),
                        p.bhs.buffer_offset(),
                        p.bhs.residual()
                    );
                    if p.bhs.opcode() == Some(Opcode::ScsiResponse) {
                        let len = self.outstanding.remove(&p.bhs.itt());
                        if let (Some(len), 0) = (len, p.bhs.scsi_status()) {
                            self.goods.push((p.bhs.itt(), len));
                        }
                    }
                    if p.bhs.opcode() == Some(Opcode::Reject) {
                        if let OutData::Owned(d) = &p.data {
                            if d.len() >= 20 && d[0] & 0x3f == 0x01 {
                                let itt = u32::from_be_bytes([d[16], d[17], d[18], d[19]]);
                                self.outstanding.remove(&itt);
                            }
                        }
                    }
                    if let OutData::Store {
                        volume,
                        offset,
                        len,
                    } = p.data
                    {
                        let mut buf = vec![0u8; len as usize];
                        assert!(self
                            .conn
                            .portal()
                            .core
                            .volumes
                            .read(volume, offset, &mut buf));
                    }
                }
                Action::RdmaRead { tag, len, dest, .. } => {
                    let off = match dest {
                        ramslog_target::iscsi::engine::ReadDest::Store { offset, .. } => offset,
                        ramslog_target::iscsi::engine::ReadDest::Buffer => u64::MAX,
                    };
                    trace!("  <- RDMA READ tag={tag} off={off} len={len}");
                    self.reads.push((tag, len, off, 0));
                }
                Action::RdmaWrite { .. } | Action::Close => {}
            }
        }
        assert!(
            self.conn.queued_actions() == 0,
            "the queue drains completely"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let Some(mode) = input.byte() else { return };
    let iser = mode & 1 != 0;
    let portal = testkit::RamPortal::new("iqn.2026-11.org.ramslog:fuzz")
        .size(LUN_BYTES)
        .build();
    let keys: &[(&str, &str)] = if iser {
        &[("ImmediateData", "Yes"), ("InitialR2T", "No")]
    } else {
        &[
            ("ImmediateData", "Yes"),
            ("InitialR2T", "No"),
            ("MaxBurstLength", "8192"),
            ("FirstBurstLength", "4096"),
            ("MaxOutstandingR2T", "2"),
        ]
    };
    let now = Instant::now();
    let conn = testkit::logged_in(portal, iser.then_some(8192), keys, now);
    let mut run = Run {
        conn,
        now,
        iser,
        r2ts: HashMap::new(),
        reads: Vec::new(),
        outstanding: HashMap::new(),
        goods: Vec::new(),
    };
    let store_check = mode & 2 != 0;
    let mut cmdsn = 0u32;
    let mut lengths: HashMap<u32, u32> = HashMap::new();
    let mut steps = 0;
    while steps < 256 {
        steps += 1;
        let Some(kind) = input.byte() else { break };
        if !store_check {
            // Raw: a whole BHS and a data segment.
            let Some(raw) = input.take(BHS_LEN) else {
                break;
            };
            if raw.len() < BHS_LEN {
                break;
            }
            let mut bytes = [0; BHS_LEN];
            bytes.copy_from_slice(raw);
            let mut b = Bhs::from_raw(bytes);
            let len = input.u16().unwrap_or(0) as usize;
            let d = input.take(len).unwrap_or(&[]).to_vec();
            b.set_data_segment_len(d.len() as u32);
            if kind & 1 != 0 {
                run.conn.handle(run.now, EngineInput::pdu(&b, &[], &d));
            } else {
                run.conn.handle(run.now, EngineInput::DataDigestError(&b));
            }
        } else {
            match kind % 4 {
                // A WRITE of 1..=64 blocks in its ITT's region.
                0 => {
                    let itt = u32::from(input.byte().unwrap_or(0) % 32);
                    let blocks = u32::from(input.byte().unwrap_or(0) % 64) + 1;
                    // An initiator never reuses an ITT still in use (the
                    // engine rejects it; that is tested elsewhere).
                    if run.outstanding.contains_key(&itt) {
                        continue;
                    }
                    let imm = (u32::from(input.u16().unwrap_or(0)) % (blocks * 512 + 1)).min(4096);
                    let f = input.byte().unwrap_or(0) & 1 != 0;
                    let lba = (u64::from(itt) * REGION / 512) as u32;
                    let mut b = Bhs::new(Opcode::ScsiCommand);
                    let l = lba.to_be_bytes();
                    let n = (blocks as u16).to_be_bytes();
                    b.set_cdb(&[0x2a, 0, l[0], l[1], l[2], l[3], 0, n[0], n[1], 0]);
                    b.set_flags(if f { 0x80 } else { 0 } | 0x21)
                        .set_itt(itt)
                        .set_expected_data_len(blocks * 512)
                        .set_cmdsn(cmdsn);
                    cmdsn = cmdsn.wrapping_add(1);
                    let d: Vec<u8> = (0..imm).map(|o| pattern(itt, o)).collect();
                    b.set_data_segment_len(d.len() as u32);
                    lengths.insert(itt, blocks * 512);
                    run.outstanding.insert(itt, blocks * 512);
                    trace!("WRITE itt={itt} blocks={blocks} imm={imm} F={f}");
                    let remote = Some(RemoteBuffer {
                        stag: 1,
                        va: 0x10000,
                    });
                    if run.iser {
                        run.conn.handle(
                            run.now,
                            EngineInput::Pdu {
                                bhs: &b,
                                ahs: &[],
                                data: &d,
                                buffers: RemoteBuffers {
                                    write: remote,
                                    read: None,
                                },
                            },
                        );
                    } else {
                        run.conn.handle(run.now, EngineInput::pdu(&b, &[], &d));
                    }
                }
                // Data-Out: solicited (answering a known R2T, maybe wrongly) or not.
                1 | 2 => {
                    let itt = u32::from(input.byte().unwrap_or(0) % 32);
                    let pick = input.byte().unwrap_or(0);
                    let (ttt, base, len) = match run.r2ts.get(&itt).and_then(|v| v.first().copied())
                    {
                        Some(r) if kind % 4 == 1 => r,
                        _ => (RESERVED_TAG, 0, lengths.get(&itt).copied().unwrap_or(512)),
                    };
                    let skew = u32::from(pick % 4);
                    let offset =
                        base + u32::from(input.u16().unwrap_or(0)) % (len + 1) * (skew & 1);
                    let n = u32::from(input.u16().unwrap_or(0)) % 9000;
                    let datasn = u32::from(input.byte().unwrap_or(0) % 4);
                    let last = pick & 0x80 != 0;
                    let d: Vec<u8> = (0..n).map(|o| pattern(itt, offset + o)).collect();
                    let mut b = Bhs::new(Opcode::DataOut);
                    b.set_final(last)
                        .set_itt(itt)
                        .set_ttt(ttt)
                        .set_buffer_offset(offset)
                        .set_datasn(datasn)
                        .set_data_segment_len(n);
                    if last {
                        if let Some(v) = run.r2ts.get_mut(&itt) {
                            v.retain(|r| r.0 != ttt);
                        }
                    }
                    trace!(
                        "DATA-OUT itt={itt} ttt={ttt:#x} off={offset} n={n} sn={datasn} F={last}"
                    );
                    run.conn.handle(run.now, EngineInput::pdu(&b, &[], &d));
                }
                // Time passes; RDMA READs complete (the HCA wrote the pattern).
                _ => {
                    run.now += Duration::from_secs(u64::from(input.byte().unwrap_or(0)));
                    run.conn.handle(run.now, EngineInput::Timeout);
                    for (tag, len, off, _) in std::mem::take(&mut run.reads) {
                        if off != u64::MAX {
                            let itt = (off / REGION) as u32;
                            let rel = (off % REGION) as u32;
                            let bytes: Vec<u8> = (0..len).map(|o| pattern(itt, rel + o)).collect();
                            if let Some(v) = run.conn.portal().core.volumes.iter().next() {
                                let _ = v.store().write(off, &bytes);
                            }
                        }
                        trace!("READ-DONE tag={tag} off={off} len={len}");
                        run.conn
                            .handle(run.now, EngineInput::RdmaReadDone { tag, data: &[] });
                    }
                }
            }
        }
        run.drain();
        assert!(run.r2ts.values().map(Vec::len).sum::<usize>() <= WINDOW * 16);
        if store_check {
            for (itt, len) in std::mem::take(&mut run.goods) {
                let mut got = vec![0u8; len as usize];
                let volumes = &run.conn.portal().core.volumes;
                let first = volumes.iter().next().map(|v| v.id());
                let at = u64::from(itt) * REGION;
                assert!(first.is_some_and(|v| volumes.read(v, at, &mut got)));
                for (o, b) in got.iter().enumerate() {
                    assert_eq!(
                        *b,
                        pattern(itt, o as u32),
                        "GOOD for ITT {itt} without byte {o}"
                    );
                }
            }
        }
    }
});
