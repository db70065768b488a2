//! Unit tests: every command family and error class against a real Store.

use std::sync::Arc;

use proptest::prelude::*;
use ramslog_common::scsi_wire::{be16, be32, be64, sense_key, status, FieldPointer, Sense};

use super::*;
use crate::store::{HugePages, Store};
use crate::volume::{Volume, VolumeConfig};

const SIZE: u64 = 1 << 20;

fn target_with(bs: u32, readiness: Readiness) -> ScsiTarget {
    let store = Arc::new(Store::new(SIZE, HugePages::Off).expect("store"));
    let cfg = VolumeConfig {
        target: "iqn.2026-11.org.test:t".into(),
        lun: 0,
        block_size: bs,
        identity: Identity::generate(),
        readiness,
        page_crcs: false,
    };
    ScsiTarget::new(vec![Arc::new(Volume::in_memory(cfg, store))])
}

fn nexus(id: u32) -> Nexus {
    Nexus {
        id: NexusId(id),
        initiator_name: format!("iqn.2026-11.org.test:init{id}"),
        isid: [0x80, 0, 0, 0, 0, id as u8],
        transfers: crate::admission::Transfers::new(
            crate::admission::SessionControl::without_transport(),
        ),
    }
}

/// A ready target with nexus 1 attached and its power-on UA cleared.
fn setup(bs: u32) -> (ScsiTarget, NexusId) {
    let t = target_with(bs, Readiness::Ready);
    let n = attach(&t, 1);
    (t, n)
}

fn attach(t: &ScsiTarget, id: u32) -> NexusId {
    let n = nexus(id);
    t.attach(&n);
    let e = run(t, n.id, 0, &[0; 6], &[]).unwrap_err();
    assert_eq!(e, SenseReason::UnitAttention { asc: 0x29, ascq: 0 });
    run(t, n.id, 0, &[0; 6], &[]).expect("TUR after UA");
    n.id
}

/// Both phases, doing the engine's part for Store placements.
fn run(
    t: &ScsiTarget,
    n: NexusId,
    lun: u64,
    cdb: &[u8],
    out: &[u8],
) -> Result<Vec<u8>, SenseReason> {
    let plan = t.prepare(n, lun, t.lu_index(lun), cdb)?;
    let out = &out[..out.len().min(plan.data_out_len as usize)];
    let buf_out = match plan.out_placement {
        OutPlacement::Store { offset, .. } => {
            t.lu(lun)
                .unwrap()
                .volume()
                .store()
                .write(offset, out)
                .unwrap();
            &[][..]
        }
        OutPlacement::Buffer => out,
        OutPlacement::None => &[][..],
    };
    let mut data_in = vec![0xee; 7]; // execute must clear it
    let executed = t.execute(n, &plan, buf_out, &mut data_in);
    match executed.map_err(|f| match f {
        Failure::Status(reason) => reason,
        Failure::Fenced => panic!("fenced without a fence"),
    })? {
        DataIn::None => Ok(Vec::new()),
        DataIn::Buffer { len } => {
            assert!(len <= plan.data_in_len, "{len} > {}", plan.data_in_len);
            Ok(data_in[..len as usize].to_vec())
        }
        DataIn::Store { offset, len, .. } => {
            assert_eq!(len, plan.data_in_len);
            let mut v = vec![0; len as usize];
            t.lu(lun)
                .unwrap()
                .volume()
                .store()
                .read(offset, &mut v)
                .unwrap();
            Ok(v)
        }
    }
}

fn sense(r: SenseReason) -> Sense {
    assert_eq!(r.status(), status::CHECK_CONDITION);
    Sense::decode(&r.sense().unwrap().encode_fixed()).unwrap()
}

fn assert_sense(r: Result<Vec<u8>, SenseReason>, key: u8, asc: u8, ascq: u8) -> Sense {
    let s = sense(r.expect_err("command should fail"));
    assert_eq!((s.key, s.asc, s.ascq), (key, asc, ascq), "{s:?}");
    s
}

fn invalid_cdb(r: Result<Vec<u8>, SenseReason>) -> FieldPointer {
    assert_sense(r, sense_key::ILLEGAL_REQUEST, 0x24, 0)
        .field
        .unwrap()
}

fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn rw16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn rw12(op: u8, lba: u32, blocks: u32) -> [u8; 12] {
    let mut c = [0u8; 12];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[6..10].copy_from_slice(&blocks.to_be_bytes());
    c
}

const BLOCKS: u64 = SIZE / 512;

#[test]
fn power_on_ua_reported_once_and_not_consumed_by_inquiry() {
    let t = target_with(512, Readiness::Ready);
    let n = nexus(1);
    t.attach(&n);
    run(&t, n.id, 0, &[0x12, 0, 0, 0, 96, 0], &[]).expect("INQUIRY ignores UA");
    run(&t, n.id, 0, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[])
        .expect("REPORT LUNS ignores UA");
    assert_sense(
        run(&t, n.id, 0, &rw10(0x28, 0, 1), &[]),
        sense_key::UNIT_ATTENTION,
        0x29,
        0,
    );
    run(&t, n.id, 0, &rw10(0x28, 0, 1), &[]).expect("UA cleared");
}

/// A LU over memory a previous run kept: when that run served other
/// INQUIRY or VPD data (a new binary), every nexus hears INQUIRY DATA HAS
/// CHANGED after its POWER ON; with the same data, or none recorded, only
/// the POWER ON. The LU records its own data for the next run.
#[test]
fn inquiry_data_changed_since_the_previous_run_is_told_after_power_on() {
    let build = |before: Option<u32>| {
        let store = Arc::new(Store::new(SIZE, HugePages::Off).expect("store"));
        let cfg = VolumeConfig {
            target: "iqn.2026-11.org.test:t".into(),
            lun: 0,
            block_size: 512,
            identity: Identity::generate(),
            readiness: Readiness::Ready,
            page_crcs: false,
        };
        let volume = Arc::new(Volume::in_memory(cfg, store));
        if let Some(b) = before {
            volume.keep_inquiry(b);
        }
        let t = ScsiTarget::new(vec![volume.clone()]);
        (t, volume)
    };
    let uas = |t: &ScsiTarget, id: u32| {
        let n = nexus(id);
        t.attach(&n);
        let mut seen = Vec::new();
        loop {
            match run(t, n.id, 0, &rw10(0x28, 0, 1), &[]) {
                Ok(_) => return seen,
                Err(r) => {
                    let s = sense(r);
                    assert_eq!(s.key, sense_key::UNIT_ATTENTION, "{s:?}");
                    seen.push((s.asc, s.ascq));
                }
            }
        }
    };
    let (fresh, volume) = build(None);
    assert_eq!(uas(&fresh, 1), [(0x29, 0)], "no previous run");
    let ours = volume.keep_inquiry(0).expect("the LU recorded its data");
    let (same, _) = build(Some(ours));
    assert_eq!(uas(&same, 1), [(0x29, 0)], "the same data");
    let (changed, volume) = build(Some(ours ^ 1));
    for id in [1, 2] {
        assert_eq!(uas(&changed, id), [(0x29, 0), (0x3f, 3)], "nexus {id}");
    }
    assert_eq!(
        volume.keep_inquiry(0),
        Some(ours),
        "recorded for the next run"
    );
}

#[test]
fn read_write_all_sizes_round_trip() {
    let (t, n) = setup(512);
    let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
    run(&t, n, 0, &rw10(0x2a, 5, 2), &data).unwrap();
    assert_eq!(run(&t, n, 0, &rw10(0x28, 5, 2), &[]).unwrap(), data);
    assert_eq!(run(&t, n, 0, &rw16(0x88, 5, 2), &[]).unwrap(), data);
    assert_eq!(run(&t, n, 0, &rw12(0xa8, 5, 2), &[]).unwrap(), data);
    run(&t, n, 0, &rw16(0x8a, 7, 1), &data[..512]).unwrap();
    run(&t, n, 0, &rw12(0xaa, 8, 1), &data[512..]).unwrap();
    // READ(6): LBA 5, length 2.
    assert_eq!(run(&t, n, 0, &[0x08, 0, 0, 5, 2, 0], &[]).unwrap(), data);
    run(&t, n, 0, &[0x0a, 0, 0, 9, 1, 0], &data[..512]).unwrap();
    // READ(6) length 0 means 256 blocks.
    let p = t
        .prepare(n, 0, t.lu_index(0), &[0x08, 0, 0, 0, 0, 0])
        .unwrap();
    assert_eq!(p.data_in_len, 256 * 512);
    // Plain WRITE goes straight to the store at the right offset.
    let p = t.prepare(n, 0, t.lu_index(0), &rw10(0x2a, 3, 4)).unwrap();
    let volume = t.lu(0).unwrap().volume().id();
    assert_eq!(
        p.out_placement,
        OutPlacement::Store {
            volume,
            offset: 3 * 512
        }
    );
    assert_eq!(p.data_out_len, 2048);
    assert!(p.is_write() && !p.is_read());
    // Zero-length transfers move nothing.
    let p = t.prepare(n, 0, t.lu_index(0), &rw10(0x2a, 0, 0)).unwrap();
    assert_eq!(p.out_placement, OutPlacement::None);
    assert!(run(&t, n, 0, &rw10(0x28, 0, 0), &[]).unwrap().is_empty());
    // DPO/FUA/FUA_NV and a group number are accepted.
    let mut c = rw10(0x2a, 0, 1);
    c[1] = 0x1a;
    c[6] = 3;
    run(&t, n, 0, &c, &data[..512]).unwrap();
}

#[test]
fn lba_out_of_range() {
    let (t, n) = setup(512);
    let oob = |c: &[u8]| {
        assert_sense(run(&t, n, 0, c, &[]), sense_key::ILLEGAL_REQUEST, 0x21, 0);
    };
    oob(&rw10(0x28, BLOCKS as u32, 1));
    oob(&rw10(0x28, BLOCKS as u32 - 1, 2));
    oob(&rw10(0x28, BLOCKS as u32 + 1, 0));
    oob(&rw10(0x28, u32::MAX, 1));
    oob(&rw16(0x88, u64::MAX, 1));
    oob(&rw16(0x8a, u64::MAX - 1, 4));
    oob(&rw12(0xa8, 0x8000_0000, 1));
    oob(&rw10(0x34, BLOCKS as u32, 1)); // PRE-FETCH
    oob(&rw16(0x91, BLOCKS + 1, 0)); // SYNC CACHE
    oob(&rw10(0x2f, BLOCKS as u32, 0)); // VERIFY
    run(&t, n, 0, &rw10(0x28, BLOCKS as u32 - 1, 1), &[]).unwrap();
}

#[test]
fn invalid_opcode_and_reserved_bits() {
    let (t, n) = setup(512);
    let s = assert_sense(
        run(&t, n, 0, &[0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]),
        sense_key::ILLEGAL_REQUEST,
        0x20,
        0,
    );
    assert_eq!(s.field, Some(FieldPointer::cdb(0)));
    // RDPROTECT != 0: no protection information here.
    for prot in 1..8u8 {
        let mut c = rw10(0x28, 0, 1);
        c[1] = prot << 5;
        let fp = invalid_cdb(run(&t, n, 0, &c, &[]));
        assert_eq!(fp.byte, 1);
        assert!(fp.in_cdb);
    }
    // NACA in the control byte.
    let mut c = rw10(0x28, 0, 1);
    c[9] = 0x04;
    assert_eq!(
        invalid_cdb(run(&t, n, 0, &c, &[])),
        FieldPointer::cdb_bit(9, 2)
    );
    // Unknown service action of SERVICE ACTION IN(16): field pointer byte 1,
    // which libiscsi treats as "not implemented".
    let mut c = [0u8; 16];
    c[0] = 0x9e;
    c[1] = 0x12; // GET LBA STATUS
    assert_eq!(invalid_cdb(run(&t, n, 0, &c, &[])).byte, 1);
    // Truncated CDB.
    assert!(t.prepare(n, 0, t.lu_index(0), &[0x28, 0]).is_err());
    assert!(t.prepare(n, 0, t.lu_index(0), &[]).is_err());
    // Transfer longer than the advertised maximum.
    let geo = Geometry {
        blocks: 1 << 40,
        block_size: 512,
    };
    let c = rw16(0x88, 0, (vocab::MAX_TRANSFER_BYTES / 512) + 1);
    assert_eq!(
        cdb::decode(&c, geo).unwrap_err(),
        SenseReason::InvalidFieldInCdb(FieldPointer::cdb(10))
    );
    assert!(cdb::decode(&rw16(0x88, 0, vocab::MAX_TRANSFER_BYTES / 512), geo).is_ok());
}

#[test]
fn inquiry_standard_and_vpd() {
    let (t, n) = setup(512);
    let d = run(&t, n, 0, &[0x12, 0, 0, 1, 4, 0], &[]).unwrap();
    assert_eq!(d.len(), 96);
    assert_eq!(d[0], 0);
    assert_eq!(d[2], 6);
    assert_eq!(d[3] & 0x0f, 2);
    assert_eq!(usize::from(d[4]) + 5, d.len());
    assert_eq!(&d[8..16], b"RAMSLOG ");
    assert!((58..74).step_by(2).any(|i| be16(&d, i) == 0x04c0));
    // Allocation length truncates.
    assert_eq!(run(&t, n, 0, &[0x12, 0, 0, 0, 5, 0], &[]).unwrap().len(), 5);
    assert_eq!(
        invalid_cdb(run(&t, n, 0, &[0x12, 0, 1, 0, 255, 0], &[])).byte,
        2
    );
    assert_eq!(
        invalid_cdb(run(&t, n, 0, &[0x12, 1, 0xb2, 0, 255, 0], &[])).byte,
        2
    );

    let (id, _) = t.identity(0).unwrap();
    let pages = run(&t, n, 0, &[0x12, 1, 0, 0, 255, 0], &[]).unwrap();
    assert_eq!(&pages[4..], &vocab::VPD_PAGES);
    for &p in &vocab::VPD_PAGES {
        let d = run(&t, n, 0, &[0x12, 1, p, 0, 255, 0], &[]).unwrap();
        assert_eq!(d[1], p);
        assert_eq!(usize::from(be16(&d, 2)) + 4, d.len());
    }
    let serial = run(&t, n, 0, &[0x12, 1, 0x80, 0, 255, 0], &[]).unwrap();
    assert_eq!(&serial[4..], id.serial.as_bytes());
    let di = run(&t, n, 0, &[0x12, 1, 0x83, 0, 255, 0], &[]).unwrap();
    assert_eq!(&di[4..8], &[0x01, 0x03, 0, 8]);
    assert_eq!(&di[8..16], &id.naa);
    assert_eq!(di[8] >> 4, 3);
    let bl = run(&t, n, 0, &[0x12, 1, 0xb0, 0, 255, 0], &[]).unwrap();
    assert_eq!(bl[3], 0x3c);
    assert_eq!(be32(&bl, 20), 0, "no UNMAP");
    assert_eq!(bl[5], 255, "COMPARE AND WRITE length");
    let bdc = run(&t, n, 0, &[0x12, 1, 0xb1, 0, 255, 0], &[]).unwrap();
    assert_eq!(be16(&bdc, 4), 1, "non-rotating");
}

#[test]
fn absent_lun() {
    let (t, n) = setup(512);
    let d = run(&t, n, 3, &[0x12, 0, 0, 0, 96, 0], &[]).unwrap();
    assert_eq!(d[0], 0x7f);
    assert_sense(
        run(&t, n, 3, &[0; 6], &[]),
        sense_key::ILLEGAL_REQUEST,
        0x25,
        0,
    );
    assert_sense(
        run(&t, n, 3, &rw10(0x28, 0, 1), &[]),
        sense_key::ILLEGAL_REQUEST,
        0x25,
        0,
    );
    let rs = run(&t, n, 3, &[0x03, 0, 0, 0, 18, 0], &[]).unwrap();
    let s = Sense::decode(&rs).unwrap();
    assert_eq!((s.key, s.asc), (sense_key::ILLEGAL_REQUEST, 0x25));
    let rl = run(&t, n, 3, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]).unwrap();
    assert_eq!(be32(&rl, 0), 8);
}

#[test]
fn report_luns_encoding() {
    let mk = |lun| {
        Arc::new(crate::testkit::ram_volume(
            "iqn.2026-11.org.test:t",
            lun,
            SIZE,
        ))
    };
    let t = ScsiTarget::new(vec![mk(300), mk(1)]);
    let n = NexusId(9);
    let rl = run(&t, n, 0, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]).unwrap();
    assert_eq!(be32(&rl, 0), 16);
    assert_eq!(&rl[8..10], &[0, 1]);
    assert_eq!(&rl[16..18], &[0x41, 0x2c]);
    let wk = run(&t, n, 0, &[0xa0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]).unwrap();
    assert_eq!(be32(&wk, 0), 0);
    assert_eq!(
        invalid_cdb(run(&t, n, 0, &[0xa0, 0, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[])).byte,
        2
    );
    assert_eq!(t.block_size(1), 512);
    assert!(matches!(
        ScsiTarget::try_new(vec![mk(1), mk(1)]),
        Err(ConfigError::DuplicateLun(1))
    ));
    let bad = Arc::new(Volume::in_memory(
        VolumeConfig {
            target: "iqn.2026-11.org.test:t".into(),
            lun: 2,
            block_size: 1024,
            identity: Identity::generate(),
            readiness: Readiness::Ready,
            page_crcs: false,
        },
        Arc::new(Store::new(SIZE, HugePages::Off).unwrap()),
    ));
    assert!(ScsiTarget::try_new(vec![bad]).is_err());
}

#[test]
fn read_capacity() {
    for bs in [512u32, 4096] {
        let (t, n) = setup(bs);
        let blocks = SIZE / u64::from(bs);
        let d = run(&t, n, 0, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).unwrap();
        assert_eq!(u64::from(be32(&d, 0)), blocks - 1);
        assert_eq!(be32(&d, 4), bs);
        let mut c = [0u8; 16];
        c[0] = 0x9e;
        c[1] = 0x10;
        c[13] = 32;
        let d = run(&t, n, 0, &c, &[]).unwrap();
        assert_eq!(d.len(), 32);
        assert_eq!(be64(&d, 0), blocks - 1);
        assert_eq!(be32(&d, 8), bs);
        assert_eq!(d[14] & 0xc0, 0, "LBPME/LBPRZ clear");
        for alloc in 0..16u8 {
            c[13] = alloc;
            assert_eq!(run(&t, n, 0, &c, &[]).unwrap().len(), usize::from(alloc));
        }
        // PMI=0 with a non-zero LBA.
        assert_eq!(
            invalid_cdb(run(&t, n, 0, &[0x25, 0, 0, 0, 0, 1, 0, 0, 0, 0], &[])).byte,
            2
        );
    }
}

fn mode_sense6(t: &ScsiTarget, n: NexusId, b1: u8, b2: u8) -> Result<Vec<u8>, SenseReason> {
    run(t, n, 0, &[0x1a, b1, b2, 0, 255, 0], &[])
}

#[test]
fn mode_sense() {
    let (t, n) = setup(512);
    let d = mode_sense6(&t, n, 0, 0x3f).unwrap();
    assert_eq!(usize::from(d[0]) + 1, d.len());
    assert_eq!(d[2], 0x10, "DPOFUA, not write protected");
    assert_eq!(d[3], 8);
    assert_eq!(be32(&d, 4) as u64, BLOCKS);
    let pages = &d[12..];
    assert_eq!(pages[0], 0x08);
    assert_eq!(pages[2] & 0x04, 0, "WCE=0");
    assert_eq!(pages[20], 0x0a);
    // Single page, DBD, changeable (nothing is) and default.
    let c = mode_sense6(&t, n, 0x08, 0x0a).unwrap();
    assert_eq!((c[3], c[4]), (0, 0x0a));
    let ch = mode_sense6(&t, n, 0x08, 0x48).unwrap();
    assert!(ch[6..].iter().all(|&b| b == 0));
    let def = mode_sense6(&t, n, 0x08, 0x88).unwrap();
    assert_eq!(def, mode_sense6(&t, n, 0x08, 0x08).unwrap());
    assert_sense(
        mode_sense6(&t, n, 0, 0xc8),
        sense_key::ILLEGAL_REQUEST,
        0x39,
        0,
    );
    assert_eq!(invalid_cdb(mode_sense6(&t, n, 0, 0x19)).byte, 2);
    assert_eq!(
        invalid_cdb(run(&t, n, 0, &[0x1a, 0, 0x08, 1, 255, 0], &[])).byte,
        3
    );
    run(&t, n, 0, &[0x1a, 0, 0x3f, 0xff, 255, 0], &[]).unwrap();
    // Allocation length 4: header only, no more.
    assert_eq!(
        run(&t, n, 0, &[0x1a, 0, 0x3f, 0, 4, 0], &[]).unwrap().len(),
        4
    );
    // MODE SENSE(10) with long LBA block descriptor.
    let d = run(&t, n, 0, &[0x5a, 0x10, 0x3f, 0, 0, 0, 0, 1, 0, 0], &[]).unwrap();
    assert_eq!(usize::from(be16(&d, 0)) + 2, d.len());
    assert_eq!(d[4] & 1, 1);
    assert_eq!(be16(&d, 6), 16);
    assert_eq!(be64(&d, 8), BLOCKS);
    assert_eq!(be32(&d, 20), 512);
}

#[test]
fn mode_select() {
    let (t, n) = setup(512);
    let sel6 = |data: &[u8], b1: u8| run(&t, n, 0, &[0x15, b1, 0, 0, data.len() as u8, 0], data);
    // Echoing the current caching page back is fine.
    let cur = mode_sense6(&t, n, 0, 0x08).unwrap();
    let mut p = cur.clone();
    p[0] = 0;
    sel6(&p, 0x10).unwrap();
    // WCE=1: not changeable → INVALID FIELD IN PARAMETER LIST at the bit.
    p[12 + 2] |= 0x04;
    let s = assert_sense(sel6(&p, 0x10), sense_key::ILLEGAL_REQUEST, 0x26, 0);
    assert_eq!(s.field, Some(FieldPointer::param_bit(14, 2)));
    // Without the block descriptor, through MODE SELECT(10).
    let mut p10 = vec![0u8; 8];
    p10.extend_from_slice(&cur[12..]);
    p10[8 + 2] |= 0x04;
    let c10 = [0x55, 0x10, 0, 0, 0, 0, 0, 0, p10.len() as u8, 0];
    let s = assert_sense(
        run(&t, n, 0, &c10, &p10),
        sense_key::ILLEGAL_REQUEST,
        0x26,
        0,
    );
    assert_eq!(s.field, Some(FieldPointer::param_bit(10, 2)));
    // SP=1.
    assert_sense(sel6(&cur, 0x11), sense_key::ILLEGAL_REQUEST, 0x39, 0);
    // Truncated page, wrong block size, unknown page.
    assert_sense(sel6(&p[..15], 0x10), sense_key::ILLEGAL_REQUEST, 0x1a, 0);
    let mut q = cur.clone();
    q[0] = 0;
    q[10] = 0x10; // block length 4096
    assert_sense(sel6(&q, 0x10), sense_key::ILLEGAL_REQUEST, 0x26, 0);
    let mut r = vec![0, 0, 0, 0, 0x19, 2, 0, 0];
    assert_sense(sel6(&r, 0x10), sense_key::ILLEGAL_REQUEST, 0x26, 0);
    r.truncate(2);
    assert_sense(sel6(&r, 0x10), sense_key::ILLEGAL_REQUEST, 0x1a, 0);
    run(&t, n, 0, &[0x15, 0x10, 0, 0, 0, 0], &[]).unwrap();
}

#[test]
fn verify_and_write_verify() {
    let (t, n) = setup(512);
    let data = vec![0x5a; 1024];
    let mut wv = rw10(0x2e, 10, 2);
    wv[1] = 0x12; // DPO, BYTCHK
    assert_eq!(
        t.prepare(n, 0, t.lu_index(0), &wv).unwrap().out_placement,
        OutPlacement::Buffer
    );
    run(&t, n, 0, &wv, &data).unwrap();
    assert_eq!(run(&t, n, 0, &rw10(0x28, 10, 2), &[]).unwrap(), data);
    let mut v = rw10(0x2f, 10, 2);
    v[1] = 0x02;
    run(&t, n, 0, &v, &data).unwrap();
    let mut bad = data.clone();
    bad[700] ^= b'X';
    let s = assert_sense(run(&t, n, 0, &v, &bad), sense_key::MISCOMPARE, 0x1d, 0);
    assert_eq!(s.information, Some(700));
    // BYTCHK=0: medium verify only, no data.
    let v0 = rw10(0x2f, 10, 2);
    assert_eq!(t.prepare(n, 0, t.lu_index(0), &v0).unwrap().data_out_len, 0);
    run(&t, n, 0, &v0, &[]).unwrap();
    // BYTCHK=3: one block compared against each.
    let mut v3 = rw16(0x8f, 10, 2);
    v3[1] = 0x06;
    run(&t, n, 0, &v3, &data[..512]).unwrap();
    assert_sense(
        run(&t, n, 0, &v3, &bad[512..]),
        sense_key::MISCOMPARE,
        0x1d,
        0,
    );
    // BYTCHK=2 reserved, VRPROTECT unsupported.
    let mut v2 = v;
    v2[1] = 0x04;
    assert!(run(&t, n, 0, &v2, &[]).is_err());
    let mut vp = v;
    vp[1] = 0x22;
    assert_eq!(invalid_cdb(run(&t, n, 0, &vp, &data)).byte, 1);
    // Write-and-verify that received less than asked writes whole blocks only.
    let mut wv12 = rw12(0xae, 20, 2);
    wv12[1] = 0x02;
    run(&t, n, 0, &wv12, &data[..600]).unwrap();
    let back = run(&t, n, 0, &rw10(0x28, 20, 2), &[]).unwrap();
    assert_eq!(&back[..512], &data[..512]);
    assert!(back[512..].iter().all(|&b| b == 0));
}

#[test]
fn write_same() {
    let (t, n) = setup(512);
    let mut pat = vec![0u8; 512];
    pat[0] = 0xab;
    pat[511] = 0xcd;
    let c = rw10(0x41, 100, 3);
    let p = t.prepare(n, 0, t.lu_index(0), &c).unwrap();
    assert_eq!(
        (p.data_out_len, p.out_placement),
        (512, OutPlacement::Buffer)
    );
    p.check_expected_len(512).unwrap();
    assert!(p.check_expected_len(1024).is_err());
    run(&t, n, 0, &c, &pat).unwrap();
    let back = run(&t, n, 0, &rw10(0x28, 99, 5), &[]).unwrap();
    assert!(back[..512].iter().all(|&b| b == 0));
    for i in 1..4 {
        assert_eq!(&back[i * 512..(i + 1) * 512], &pat[..]);
    }
    assert!(back[2048..].iter().all(|&b| b == 0));
    // NDOB: zeros, no data.
    let mut c16 = rw16(0x93, 101, 1);
    c16[1] = 0x01;
    assert_eq!(
        t.prepare(n, 0, t.lu_index(0), &c16).unwrap().data_out_len,
        0
    );
    run(&t, n, 0, &c16, &[]).unwrap();
    assert!(run(&t, n, 0, &rw10(0x28, 101, 1), &[])
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    // UNMAP / ANCHOR / WRPROTECT: no thin provisioning, no protection.
    for b1 in [0x08u8, 0x10, 0x20, 0xe0] {
        let mut u = rw10(0x41, 0, 1);
        u[1] = b1;
        assert_eq!(invalid_cdb(run(&t, n, 0, &u, &pat)).byte, 1);
    }
    // 0 blocks = to the end of the (small) medium.
    run(&t, n, 0, &rw10(0x41, 0, 0), &pat).unwrap();
    let last = run(&t, n, 0, &rw10(0x28, BLOCKS as u32 - 1, 1), &[]).unwrap();
    assert_eq!(last, pat);
    assert_sense(
        run(&t, n, 0, &rw10(0x41, BLOCKS as u32, 1), &pat),
        sense_key::ILLEGAL_REQUEST,
        0x21,
        0,
    );
}

#[test]
fn write_same_limit() {
    // "0 blocks" means to the end of the medium, which must fit MAXIMUM
    // WRITE SAME LENGTH.
    let max = (vocab::MAX_WRITE_SAME_BYTES / 512) as u32;
    let geo = Geometry {
        blocks: 4 * u64::from(max),
        block_size: 512,
    };
    assert!(cdb::decode(&rw10(0x41, 0, 0), geo).is_err());
    assert!(cdb::decode(&rw10(0x41, 3 * max, 0), geo).is_ok());
    assert!(cdb::decode(&rw10(0x41, 3 * max - 1, 0), geo).is_err());
}

#[test]
fn compare_and_write() {
    let (t, n) = setup(512);
    let a = vec![b'A'; 1024];
    run(&t, n, 0, &rw10(0x2a, 50, 2), &a).unwrap();
    let mut c = [0u8; 16];
    c[0] = 0x89;
    c[2..10].copy_from_slice(&50u64.to_be_bytes());
    c[13] = 2;
    let mut buf = a.clone();
    buf.extend_from_slice(&[b'B'; 1024]);
    let p = t.prepare(n, 0, t.lu_index(0), &c).unwrap();
    assert_eq!(p.data_out_len, 2048);
    p.check_expected_len(2048).unwrap();
    assert_eq!(
        p.check_expected_len(4096).unwrap_err(),
        SenseReason::InvalidFieldInCdb(FieldPointer::cdb(13))
    );
    run(&t, n, 0, &c, &buf).unwrap();
    assert_eq!(
        run(&t, n, 0, &rw10(0x28, 50, 2), &[]).unwrap(),
        vec![b'B'; 1024]
    );
    // Miscompare: nothing written, INFORMATION = offset of first difference.
    let s = assert_sense(run(&t, n, 0, &c, &buf), sense_key::MISCOMPARE, 0x1d, 0);
    assert_eq!(s.information, Some(0));
    assert_eq!(
        run(&t, n, 0, &rw10(0x28, 50, 2), &[]).unwrap(),
        vec![b'B'; 1024]
    );
    // NUMBER OF LOGICAL BLOCKS 0 with data: a CAW of 256 blocks as libiscsi
    // encodes it must fail the length check.
    c[13] = 0;
    let p = t.prepare(n, 0, t.lu_index(0), &c).unwrap();
    assert!(p.check_expected_len(2 * 256 * 512).is_err());
    run(&t, n, 0, &c, &[]).unwrap();
    // Short data.
    c[13] = 2;
    assert!(run(&t, n, 0, &c, &buf[..100]).is_err());
}

#[test]
fn sync_cache_prefetch_start_stop() {
    let (t, n) = setup(512);
    let mut sc = rw10(0x35, 0, 1);
    sc[1] = 0x06;
    assert!(run(&t, n, 0, &sc, &[]).unwrap().is_empty());
    run(&t, n, 0, &rw16(0x91, 0, 0), &[]).unwrap();
    let mut pf = rw10(0x34, 0, 1);
    pf[1] = 0x02;
    pf[6] = 3;
    run(&t, n, 0, &pf, &[]).unwrap();
    run(&t, n, 0, &rw16(0x90, BLOCKS - 256, 256), &[]).unwrap();
    run(&t, n, 0, &[0x1b, 1, 0, 0, 1, 0], &[]).unwrap();
    run(&t, n, 0, &[0x1b, 0, 0, 0, 0, 0], &[]).unwrap();
}

/// Hold the exclusion WRITE SAME, COMPARE AND WRITE and WRITE AND VERIFY
/// take for the blocks [lba, lba + blocks).
fn hold_exclusion(lu: &LogicalUnit, lba: u64, blocks: u64) -> impl Drop + '_ {
    lu.exclusion.hold(lba, blocks)
}

fn caw(lba: u64, blocks: u8) -> [u8; 16] {
    let mut c = rw16(0x89, lba, 0);
    c[10..14].fill(0);
    c[13] = blocks;
    c
}

/// The commands that read and change the medium in one step exclude each
/// other only where their blocks overlap: a transport worker running one
/// never waits for another range, so a host's connections cannot stall
/// every session with them on one LU.
#[test]
fn medium_exclusion_is_per_range() {
    let (t, n) = setup(512);
    let lu = t.lu(0).expect("LU 0").clone();
    let held = hold_exclusion(&lu, 0, 8);
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        let done =
            |tx: std::sync::mpsc::Sender<&'static str>, what, cdb: Vec<u8>, data: Vec<u8>| {
                let t = &t;
                move || {
                    run(t, n, 0, &cdb, &data).expect(what);
                    let _ = tx.send(what);
                }
            };
        scope.spawn(done(
            tx.clone(),
            "WRITE SAME",
            rw16(0x93, 64, 8).to_vec(),
            vec![0xab; 512],
        ));
        let elsewhere = rx.recv_timeout(std::time::Duration::from_secs(2));
        // Blocks 4..6 overlap the held range: this one must wait.
        scope.spawn(done(
            tx.clone(),
            "COMPARE AND WRITE",
            caw(4, 2).to_vec(),
            vec![0; 2048],
        ));
        let overlapping = rx.recv_timeout(std::time::Duration::from_millis(300));
        drop(held);
        let after = rx.recv_timeout(std::time::Duration::from_secs(2));
        assert_eq!(
            elsewhere,
            Ok("WRITE SAME"),
            "a disjoint WRITE SAME waited for another range's exclusion"
        );
        assert!(
            overlapping.is_err(),
            "an overlapping COMPARE AND WRITE did not wait"
        );
        assert!(after.is_ok(), "released: the overlapping command ran");
    });
}

fn pr_out(
    t: &ScsiTarget,
    n: NexusId,
    sa: u8,
    ty: u8,
    key: u64,
    sa_key: u64,
) -> Result<Vec<u8>, SenseReason> {
    let mut p = [0u8; 24];
    p[0..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    run(t, n, 0, &[0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0], &p)
}

fn pr_in(t: &ScsiTarget, n: NexusId, sa: u8) -> Vec<u8> {
    run(t, n, 0, &[0x5e, sa, 0, 0, 0, 0, 0, 0x40, 0, 0], &[]).expect("PR IN")
}

fn conflict(r: Result<Vec<u8>, SenseReason>) {
    let e = r.expect_err("expected conflict");
    assert_eq!(e, SenseReason::ReservationConflict);
    assert_eq!(e.status(), status::RESERVATION_CONFLICT);
    assert_eq!(e.sense(), None);
}

#[test]
fn persistent_reservation_types() {
    let (t, a) = setup(512);
    let b = attach(&t, 2);
    let blk = vec![1u8; 512];
    // (type, registered b can read, can write, unregistered b can read, can write)
    let table = [
        (pr::WE, true, false, true, false),
        (pr::EA, false, false, false, false),
        (pr::WE_RO, true, true, true, false),
        (pr::EA_RO, true, true, false, false),
        (pr::WE_AR, true, true, true, false),
        (pr::EA_AR, true, true, false, false),
    ];
    for (ty, rr, rw, ur, uw) in table {
        pr_out(&t, a, 6, 0, 0, 0xa).unwrap();
        pr_out(&t, b, 6, 0, 0, 0xb).unwrap();
        pr_out(&t, a, 1, ty, 0xa, 0).unwrap();
        let rr_ = pr_in(&t, a, 1);
        assert_eq!(be32(&rr_, 4), 16);
        let want_key = if matches!(ty, pr::WE_AR | pr::EA_AR) {
            0
        } else {
            0xa
        };
        assert_eq!((be64(&rr_, 8), rr_[21]), (want_key, ty));
        run(&t, a, 0, &rw10(0x28, 1, 1), &[]).unwrap();
        run(&t, a, 0, &rw10(0x2a, 1, 1), &blk).unwrap();
        let check = |ok: bool, r: Result<Vec<u8>, SenseReason>| {
            if ok {
                r.unwrap();
            } else {
                conflict(r);
            }
        };
        check(rr, run(&t, b, 0, &rw10(0x28, 1, 1), &[]));
        check(rw, run(&t, b, 0, &rw10(0x2a, 1, 1), &blk));
        // TEST UNIT READY, INQUIRY and READ CAPACITY are always allowed.
        run(&t, b, 0, &[0; 6], &[]).unwrap();
        run(&t, b, 0, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).unwrap();
        pr_out(&t, b, 0, 0, 0xb, 0).unwrap(); // unregister b
        check(ur, run(&t, b, 0, &rw10(0x28, 1, 1), &[]));
        check(uw, run(&t, b, 0, &rw10(0x2a, 1, 1), &blk));
        pr_out(&t, a, 2, ty, 0xa, 0).unwrap(); // release
        assert_eq!(be32(&pr_in(&t, a, 1), 4), 0);
        pr_out(&t, a, 0, 0, 0xa, 0).unwrap(); // unregister a
        assert_eq!(be32(&pr_in(&t, a, 0), 4), 0);
        run(&t, b, 0, &rw10(0x2a, 1, 1), &blk).unwrap();
    }
}

#[test]
fn persistent_reservation_rules() {
    let (t, a) = setup(512);
    let b = attach(&t, 2);
    // REGISTER with a wrong key when not registered: conflict.
    conflict(pr_out(&t, a, 0, 0, 5, 6));
    pr_out(&t, a, 0, 0, 0, 0xa).unwrap();
    let gen0 = be32(&pr_in(&t, a, 0), 0);
    // Re-register with the wrong current key.
    conflict(pr_out(&t, a, 0, 0, 0xb, 0xc));
    // RESERVE without registration / wrong key; bad type and scope.
    conflict(pr_out(&t, b, 1, pr::WE, 0xb, 0));
    conflict(pr_out(&t, a, 1, pr::WE, 0xb, 0));
    assert_eq!(invalid_cdb(pr_out(&t, a, 1, 2, 0xa, 0)).byte, 2);
    assert_eq!(invalid_cdb(pr_out(&t, a, 1, 0x11, 0xa, 0)).byte, 2);
    pr_out(&t, a, 1, pr::EA, 0xa, 0).unwrap();
    assert_eq!(
        be32(&pr_in(&t, a, 0), 0),
        gen0,
        "RESERVE does not bump the generation"
    );
    // Reserving again with the same type is fine, another type conflicts.
    pr_out(&t, a, 1, pr::EA, 0xa, 0).unwrap();
    conflict(pr_out(&t, a, 1, pr::WE, 0xa, 0));
    // RELEASE with the wrong type.
    assert_sense(
        pr_out(&t, a, 2, pr::WE, 0xa, 0),
        sense_key::ILLEGAL_REQUEST,
        0x26,
        0x04,
    );
    // PREEMPT by b of a's key: a loses registration and reservation.
    pr_out(&t, b, 6, 0, 0, 0xb).unwrap();
    conflict(run(&t, b, 0, &rw10(0x28, 0, 1), &[]));
    pr_out(&t, b, 4, pr::WE, 0xb, 0xa).unwrap();
    assert_sense(
        run(&t, a, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x2a,
        0x05,
    );
    let keys = pr_in(&t, a, 0);
    assert_eq!(be32(&keys, 4), 8);
    assert_eq!(be64(&keys, 8), 0xb);
    let rr = pr_in(&t, a, 1);
    assert_eq!((be64(&rr, 8), rr[21]), (0xb, pr::WE));
    // PREEMPT of a key nobody holds.
    conflict(pr_out(&t, b, 4, pr::WE, 0xb, 0x77));
    // CLEAR from b: a (re-registered) gets RESERVATIONS PREEMPTED.
    pr_out(&t, a, 6, 0, 0, 0xa).unwrap();
    let g = be32(&pr_in(&t, a, 0), 0);
    pr_out(&t, b, 3, 0, 0xb, 0).unwrap();
    assert_sense(
        run(&t, a, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x2a,
        0x03,
    );
    let keys = pr_in(&t, a, 0);
    assert_eq!((be32(&keys, 0), be32(&keys, 4)), (g + 1, 0));
    // Holder of a registrants-only reservation unregisters: released, UA to others.
    pr_out(&t, a, 6, 0, 0, 0xa).unwrap();
    pr_out(&t, b, 6, 0, 0, 0xb).unwrap();
    pr_out(&t, a, 1, pr::WE_RO, 0xa, 0).unwrap();
    pr_out(&t, a, 0, 0, 0xa, 0).unwrap();
    assert_eq!(be32(&pr_in(&t, a, 1), 4), 0);
    assert_sense(
        run(&t, b, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x2a,
        0x04,
    );
    // Unsupported parameter bits and lengths.
    let mut p = [0u8; 24];
    p[20] = 0x01; // APTPL
    let s = assert_sense(
        run(&t, b, 0, &[0x5f, 6, 0, 0, 0, 0, 0, 0, 24, 0], &p),
        sense_key::ILLEGAL_REQUEST,
        0x26,
        0,
    );
    assert_eq!(s.field, Some(FieldPointer::param_bit(20, 0)));
    assert_sense(
        run(&t, b, 0, &[0x5f, 6, 0, 0, 0, 0, 0, 0, 20, 0], &p),
        sense_key::ILLEGAL_REQUEST,
        0x1a,
        0,
    );
    assert_eq!(invalid_cdb(pr_out(&t, b, 7, 0, 0, 0)).byte, 1);
    // Registrations outlive the session; the new session of the same port sees them.
    t.detach(b);
    let b2 = attach(&t, 2);
    assert_eq!(be32(&pr_in(&t, b2, 0), 4), 8);
    pr_out(&t, b2, 0, 0, 0xb, 0).unwrap();
}

/// Registrations outlive their sessions, so a host that logs in with ever
/// new ISIDs could grow them without end: 64 per LU, the 65th refused with
/// INSUFFICIENT REGISTRATION RESOURCES; changing or dropping a key, and
/// registering once a place is free, still work.
#[test]
fn registrations_are_capped_per_lu() {
    let (t, first) = setup(512);
    pr_out(&t, first, 6, 0, 0, 1).unwrap();
    let mut nexuses = vec![first];
    for i in 2..=pr::MAX_REGISTRATIONS as u32 {
        let n = attach(&t, i);
        pr_out(&t, n, 6, 0, 0, u64::from(i)).unwrap();
        nexuses.push(n);
    }
    let late = attach(&t, 1000);
    let e = pr_out(&t, late, 6, 0, 0, 0x65).expect_err("the 65th registration");
    assert_eq!(e.status(), status::CHECK_CONDITION);
    let sense = e.sense().expect("sense");
    assert_eq!(
        (sense.key, sense.asc, sense.ascq),
        (sense_key::ILLEGAL_REQUEST, 0x55, 0x04),
        "INSUFFICIENT REGISTRATION RESOURCES"
    );
    // REGISTER (not IGNORE EXISTING) is refused the same way.
    let e = pr_out(&t, late, 0, 0, 0, 0x65).expect_err("the 65th registration");
    assert_eq!(e.sense().map(|s| (s.asc, s.ascq)), Some((0x55, 0x04)));
    // Those registered may still change their key and leave.
    pr_out(&t, first, 0, 0, 1, 0x1111).unwrap();
    pr_out(&t, first, 0, 0, 0x1111, 0).unwrap();
    pr_out(&t, late, 6, 0, 0, 0x65).expect("a place was freed");
    assert_eq!(be32(&pr_in(&t, late, 0), 4), 64 * 8, "64 keys");
}

#[test]
fn persistent_reserve_in() {
    let (t, a) = setup(512);
    pr_out(&t, a, 6, 0, 0, 0x1234).unwrap();
    pr_out(&t, a, 1, pr::EA, 0x1234, 0).unwrap();
    let caps = pr_in(&t, a, 2);
    assert_eq!(be16(&caps, 0), 8);
    assert_eq!(caps[3] & 0x80, 0x80);
    assert_eq!(be16(&caps, 4), 0xea01);
    let fs = pr_in(&t, a, 3);
    let len = be32(&fs, 4) as usize;
    assert_eq!(len + 8, fs.len());
    assert_eq!(be64(&fs, 8), 0x1234);
    assert_eq!(fs[8 + 12] & 1, 1, "R_HOLDER");
    assert_eq!(fs[8 + 13], pr::EA);
    let tid_len = be32(&fs, 8 + 20) as usize;
    let tid = &fs[8 + 24..8 + 24 + tid_len];
    assert_eq!(tid[0], 0x45);
    let port = nexus(1).initiator_port();
    assert_eq!(&tid[4..4 + port.len()], port.as_bytes());
    assert_eq!(tid_len % 4, 0);
    for sa in 4..0x20 {
        assert_eq!(
            invalid_cdb(run(&t, a, 0, &[0x5e, sa, 0, 0, 0, 0, 0, 0x40, 0, 0], &[])).byte,
            1
        );
    }
    // Allocation length 8: header only, ADDITIONAL LENGTH unchanged.
    let k = run(&t, a, 0, &[0x5e, 0, 0, 0, 0, 0, 0, 0, 8, 0], &[]).unwrap();
    assert_eq!((k.len(), be32(&k, 4)), (8, 8));
}

#[test]
fn reserve6_release6() {
    let (t, a) = setup(512);
    let b = attach(&t, 2);
    let c = attach(&t, 3);
    let ms = [0x1a, 0, 0x3f, 0, 255, 0];
    run(&t, a, 0, &[0x16, 0, 0, 0, 0, 0], &[]).unwrap();
    run(&t, a, 0, &[0x16, 0, 0, 0, 0, 0], &[]).unwrap();
    conflict(run(&t, b, 0, &[0x16, 0, 0, 0, 0, 0], &[]));
    conflict(run(&t, b, 0, &ms, &[]));
    conflict(run(&t, b, 0, &rw10(0x28, 0, 1), &[]));
    run(&t, b, 0, &[0x12, 0, 0, 0, 96, 0], &[]).unwrap();
    run(&t, b, 0, &[0x17, 0, 0, 0, 0, 0], &[]).unwrap(); // no-op
    conflict(run(&t, b, 0, &ms, &[]));
    run(&t, a, 0, &ms, &[]).unwrap();
    run(&t, a, 0, &[0x17, 0, 0, 0, 0, 0], &[]).unwrap();
    run(&t, b, 0, &[0x16, 0, 0, 0, 0, 0], &[]).unwrap();
    // Nexus loss drops it.
    t.detach(b);
    run(&t, a, 0, &[0x16, 0, 0, 0, 0, 0], &[]).unwrap();
    // A reset drops it too, and every nexus (issuer included) gets 29h/03h.
    let reset_reported = |nexuses: &[NexusId]| {
        for &n in nexuses {
            assert_sense(
                run(&t, n, 0, &[0; 6], &[]),
                sense_key::UNIT_ATTENTION,
                0x29,
                0x03,
            );
        }
    };
    t.reset(ResetScope::Lu(0), a);
    reset_reported(&[a, c]);
    run(&t, c, 0, &[0x16, 0, 0, 0, 0, 0], &[]).unwrap();
    t.reset(ResetScope::Target, c);
    reset_reported(&[a]);
    run(&t, a, 0, &[0x16, 0, 0, 0, 0, 0], &[]).unwrap();
    // RESERVE(6) yields to persistent reservation registrations.
    run(&t, a, 0, &[0x17, 0, 0, 0, 0, 0], &[]).unwrap();
    assert_sense(
        run(&t, c, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x29,
        0x03,
    );
    pr_out(&t, c, 6, 0, 0, 1).unwrap();
    conflict(run(&t, a, 0, &[0x16, 0, 0, 0, 0, 0], &[]));
}

#[test]
fn needs_acceptance_then_accept_empty() {
    let t = target_with(512, Readiness::NeedsAcceptance);
    let n = nexus(1);
    t.attach(&n);
    let n = n.id;
    assert_sense(
        run(&t, n, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x29,
        0,
    );
    for c in [
        &[0u8; 6][..],
        &rw10(0x28, 0, 1),
        &rw10(0x2a, 0, 1),
        &rw10(0x35, 0, 0),
        &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ] {
        assert_sense(
            run(&t, n, 0, c, &[0; 512]),
            sense_key::NOT_READY,
            0x04,
            0x03,
        );
    }
    run(&t, n, 0, &[0x12, 0, 0, 0, 96, 0], &[]).unwrap();
    run(&t, n, 0, &[0x1a, 0, 0x3f, 0, 255, 0], &[]).unwrap();
    let rs = run(&t, n, 0, &[0x03, 0, 0, 0, 18, 0], &[]).unwrap();
    let s = Sense::decode(&rs).unwrap();
    assert_eq!((s.key, s.asc, s.ascq), (sense_key::NOT_READY, 4, 3));
    let (old, r) = t.identity(0).unwrap();
    assert_eq!(r, Readiness::NeedsAcceptance);
    let new = Identity::generate();
    t.accept_empty(0, new.clone()).expect("accept-empty");
    assert!(t.accept_empty(7, Identity::generate()).is_err());
    assert_eq!(t.identity(0).unwrap(), (new.clone(), Readiness::Ready));
    assert_ne!(old, new);
    assert_sense(
        run(&t, n, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x3f,
        0x03,
    );
    assert_sense(
        run(&t, n, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x3f,
        0x0e,
    );
    run(&t, n, 0, &[0; 6], &[]).unwrap();
    let serial = run(&t, n, 0, &[0x12, 1, 0x80, 0, 255, 0], &[]).unwrap();
    assert_eq!(&serial[4..], new.serial.as_bytes());
}

#[test]
fn request_sense_reports_and_clears_ua() {
    let t = target_with(512, Readiness::Ready);
    let n = nexus(1);
    t.attach(&n);
    let rs = run(&t, n.id, 0, &[0x03, 0, 0, 0, 252, 0], &[]).unwrap();
    assert_eq!(rs.len(), 18);
    let s = Sense::decode(&rs).unwrap();
    assert_eq!((s.key, s.asc, s.ascq), (sense_key::UNIT_ATTENTION, 0x29, 0));
    let rs = run(&t, n.id, 0, &[0x03, 1, 0, 0, 252, 0], &[]).unwrap();
    assert_eq!(rs, vec![0x72, 0, 0, 0, 0, 0, 0, 0]);
    run(&t, n.id, 0, &[0; 6], &[]).unwrap();
}

fn rsoc(t: &ScsiTarget, n: NexusId, b2: u8, op: u8, sa: u16) -> Result<Vec<u8>, SenseReason> {
    let mut c = [0u8; 12];
    c[0] = 0xa3;
    c[1] = 0x0c;
    c[2] = b2;
    c[3] = op;
    c[4..6].copy_from_slice(&sa.to_be_bytes());
    c[6..10].copy_from_slice(&65535u32.to_be_bytes());
    run(t, n, 0, &c, &[])
}

#[test]
fn report_supported_opcodes() {
    let (t, n) = setup(512);
    for rctd in [false, true] {
        let d = rsoc(&t, n, u8::from(rctd) << 7, 0, 0).unwrap();
        assert_eq!(be32(&d, 0) as usize + 4, d.len());
        let step = if rctd { 20 } else { 8 };
        let mut off = 4;
        let mut count = 0;
        while off < d.len() {
            let (op, sa, flags, len) = (d[off], be16(&d, off + 2), d[off + 5], be16(&d, off + 6));
            assert_eq!(flags & 2 != 0, rctd);
            if rctd {
                assert_eq!(be16(&d, off + 8), 0x0a);
            }
            let servactv = flags & 1 != 0;
            if !servactv {
                assert_eq!(sa, 0);
            }
            // Every listed command answers the one-command query in the right form.
            let one = rsoc(&t, n, if servactv { 2 } else { 1 }, op, sa).unwrap();
            assert_eq!(one[1] & 7, 3);
            assert_eq!(be16(&one, 2), len);
            assert_eq!(one[4], op);
            let wrong = rsoc(&t, n, if servactv { 1 } else { 2 }, op, sa);
            assert_eq!(invalid_cdb(wrong).byte, 2);
            off += step;
            count += 1;
        }
        assert_eq!(count, vocab::COMMANDS.len());
    }
    // READ(10)/WRITE(10)/COMPARE AND WRITE usage data shows DPO and FUA,
    // matching DPOFUA in MODE SENSE.
    for op in [0x28u8, 0x2a, 0x89] {
        let one = rsoc(&t, n, 1, op, 0).unwrap();
        assert_eq!(one[5] & 0x18, 0x18);
    }
    assert_eq!(rsoc(&t, n, 1, 0x2f, 0).unwrap()[5] & 0x10, 0x10);
    // Unknown opcode: "not supported", GOOD.
    let one = rsoc(&t, n, 1, 0x42, 0).unwrap();
    assert_eq!((one[1] & 7, be16(&one, 2)), (1, 0));
    assert!(rsoc(&t, n, 5, 0, 0).is_err());
}

#[test]
fn ua_queue_and_detach() {
    let (t, a) = setup(512);
    // A reset supersedes queued UAs and they stay bounded.
    for _ in 0..40 {
        t.lu(0)
            .expect("LU")
            .volume()
            .set_not_ready("lost".into(), crate::volume::Remedy::AcceptEmpty);
        t.accept_empty(0, Identity::generate())
            .expect("accept-empty");
    }
    t.reset(ResetScope::Target, a);
    assert_sense(
        run(&t, a, 0, &[0; 6], &[]),
        sense_key::UNIT_ATTENTION,
        0x29,
        3,
    );
    run(&t, a, 0, &[0; 6], &[]).unwrap();
    t.detach(a);
    // A command from a nexus the LU no longer knows is simply served.
    run(&t, a, 0, &rw10(0x28, 0, 1), &[]).unwrap();
    assert!(!t.lu(0).unwrap().attention.load(Ordering::Relaxed));
}

#[test]
fn identity_and_port_format() {
    let id = Identity::generate();
    assert_eq!(id.naa[0] >> 4, 3);
    assert_eq!(id.serial.len(), 36);
    assert_eq!(id.serial.matches('-').count(), 4);
    assert_ne!(id, Identity::generate());
    let n = Nexus {
        id: NexusId(1),
        initiator_name: "iqn.x".into(),
        isid: [0x80, 0x12, 0x34, 0x56, 0x78, 0x9a],
        transfers: crate::admission::Transfers::new(
            crate::admission::SessionControl::without_transport(),
        ),
    };
    assert_eq!(n.initiator_port(), "iqn.x,i,0x80123456789a");
}

#[test]
fn sense_mapping() {
    assert_eq!(SenseReason::TaskSetFull.status(), status::TASK_SET_FULL);
    assert_eq!(SenseReason::TaskSetFull.sense(), None);
    assert_eq!(SenseReason::Busy.status(), status::BUSY);
    let s = sense(SenseReason::LbaOutOfRange);
    assert_eq!((s.key, s.asc), (sense_key::ILLEGAL_REQUEST, 0x21));
    let s = sense(SenseReason::InternalTargetFailure);
    assert_eq!((s.key, s.asc), (sense_key::HARDWARE_ERROR, 0x44));
    let s = sense(SenseReason::ParamListLengthError);
    assert_eq!(s.asc, 0x1a);
}

#[test]
fn fast_path_read_write_do_not_lock() {
    let (t, n) = setup(512);
    let lu = t.lu(0).unwrap();
    assert!(!lu.attention.load(Ordering::Relaxed));
    // Hold the state lock: READ/WRITE must still get through both phases.
    let _g = lu.lock();
    let p = t.prepare(n, 0, t.lu_index(0), &rw16(0x88, 8, 8)).unwrap();
    let mut v = Vec::new();
    assert_eq!(
        t.execute(n, &p, &[], &mut v).unwrap(),
        DataIn::Store {
            volume: lu.volume().id(),
            offset: 8 * 512,
            len: 4096
        }
    );
    let p = t.prepare(n, 0, t.lu_index(0), &rw10(0x2a, 8, 8)).unwrap();
    assert_eq!(t.execute(n, &p, &[], &mut v).unwrap(), DataIn::None);
}

/// The volume's refusals reach the front end as what they are: NOT READY
/// as its sense, the shutdown fence as no status at all (never a sense).
#[test]
fn volume_refusals_end_commands_as_status_or_fence() {
    let (t, n) = setup(512);
    let write = t.prepare(n, 0, t.lu_index(0), &rw10(0x2a, 0, 1)).unwrap();
    let mut v = Vec::new();
    t.lu(0).unwrap().volume().fence();
    assert_eq!(t.execute(n, &write, &[], &mut v), Err(Failure::Fenced));

    assert_eq!(
        Failure::from(VolumeError::NotReady),
        Failure::Status(SenseReason::NotReadyManualIntervention)
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn random_cdbs_never_panic(op in prop::sample::select(
            vocab::COMMANDS.iter().map(|c| c.usage[0]).chain([0x42u8, 0xff]).collect::<Vec<_>>()),
        rest in proptest::collection::vec(any::<u8>(), 0..16),
        data in proptest::collection::vec(any::<u8>(), 0..1100),
        lun in 0u64..2) {
        static T: std::sync::OnceLock<ScsiTarget> = std::sync::OnceLock::new();
        let t = T.get_or_init(|| target_with(512, Readiness::Ready));
        let n = nexus(1);
        t.attach(&n);
        let mut cdb = vec![op];
        cdb.extend_from_slice(&rest);
        let _ = run(t, n.id, lun, &cdb, &data);
        let _ = run(t, n.id, lun, &cdb, &data);
    }
}

/// Heavy commands are bounded by what VPD B0h advertises: a VERIFY with
/// BYTCHK=3 compares at most MAXIMUM TRANSFER LENGTH blocks, and a WRITE SAME
/// touches at most MAXIMUM WRITE SAME LENGTH (≤ 16 MiB).
#[test]
fn heavy_commands_are_bounded_by_the_block_limits() {
    let geo = Geometry {
        blocks: 1 << 30,
        block_size: 512,
    };
    let too_many = vocab::MAX_TRANSFER_BYTES / 512 + 1;
    let mut verify = rw16(0x8f, 0, too_many);
    verify[1] = 3 << 1; // BYTCHK=3: one block compared against every block
    assert_eq!(
        cdb::decode(&verify, geo).err(),
        Some(SenseReason::InvalidFieldInCdb(FieldPointer::cdb(10))),
        "defect 9: VERIFY BYTCHK=3 over more than the transfer limit"
    );
    verify[1] = 1 << 1;
    assert!(cdb::decode(&verify, geo).is_err());
    let (t, n) = setup(512);
    let bl = run(&t, n, 0, &[0x12, 1, 0xb0, 0, 255, 0], &[]).unwrap();
    let max_ws_blocks = be64(&bl, 36);
    assert!(
        max_ws_blocks * 512 <= 16 << 20,
        "defect 9: MAXIMUM WRITE SAME LENGTH {max_ws_blocks} blocks"
    );
    let ws = rw16(0x93, 0, (16 << 20) / 512 + 1);
    assert!(
        cdb::decode(&ws, geo).is_err(),
        "defect 9: WRITE SAME over 16 MiB accepted"
    );
    assert!(cdb::decode(&rw16(0x93, 0, (16 << 20) / 512), geo).is_ok());
}

/// The vocabulary is a leaf: decoding, INQUIRY, MODE SENSE and REPORT
/// SUPPORTED OPERATION CODES build on it, so it must build on none of them.
#[test]
fn the_vocabulary_imports_nothing_from_the_crate() {
    for (n, line) in include_str!("vocab.rs").lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        assert!(
            !["crate::", "super::", "self::"]
                .iter()
                .any(|path| code.contains(path)),
            "vocab.rs:{}: {line}",
            n + 1
        );
    }
}

/// accept-empty aborts the writes of the old identity still under way:
/// none of their data may land on the empty device.
#[test]
fn accept_empty_aborts_the_old_identitys_writes() {
    let t = target_with(512, Readiness::Ready);
    let n = nexus(1);
    t.attach(&n);
    let n = n.id;
    let _ = run(&t, n, 0, &[0; 6], &[]);
    let plan = t
        .prepare(n, 0, t.lu_index(0), &rw10(0x2a, 0, 1))
        .expect("a write, under way");
    t.lu(0)
        .expect("LU")
        .volume()
        .set_not_ready("lost".into(), crate::volume::Remedy::AcceptEmpty);
    t.accept_empty(0, Identity::generate())
        .expect("accept-empty");
    assert!(
        t.is_aborted(n, &plan),
        "an old-identity write survived accept-empty"
    );
}
