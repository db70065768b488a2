//! CDB decoding: the check of each CDB against the command table (which
//! also drives REPORT SUPPORTED OPERATION CODES and the reserved-bit check),
//! and the decode of each CDB into a small `Op` the execute phase runs.

use ramslog_common::scsi_wire::{be16, be32, be64};

use super::sense::{bad_cdb, bad_cdb_bit, SenseReason};
use super::vocab::{
    has_service_actions, lookup, opc, CmdInfo, Geometry, ModeSenseReq, Op, MAX_TRANSFER_BYTES,
    MAX_WRITE_SAME_BYTES, VPD_PAGES,
};

/// What decode produces; `Plan` is built from it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decoded {
    pub op: Op,
    pub data_out_len: u32,
    pub data_in_len: u32,
    /// Data-out goes straight to the store at this byte offset.
    pub out_to_store: Option<u64>,
    /// The initiator's expected transfer length must equal `data_out_len`.
    pub exact_out: bool,
}

impl Decoded {
    fn none(op: Op) -> Self {
        Decoded {
            op,
            data_out_len: 0,
            data_in_len: 0,
            out_to_store: None,
            exact_out: false,
        }
    }
    fn data_in(op: Op, len: u32) -> Self {
        Decoded {
            data_in_len: len,
            ..Decoded::none(op)
        }
    }
    fn data_out(op: Op, len: u32) -> Self {
        Decoded {
            data_out_len: len,
            ..Decoded::none(op)
        }
    }
}

/// Check the opcode, service action, CDB length and reserved bits.
pub(crate) fn check_cdb(cdb: &[u8]) -> Result<&'static CmdInfo, SenseReason> {
    let opcode = *cdb.first().ok_or(SenseReason::InvalidOpcode)?;
    let info = if has_service_actions(opcode) {
        let sa = cdb.get(1).map_or(0, |b| b & 0x1f);
        lookup(opcode, Some(sa)).ok_or(bad_cdb_bit(1, 4))?
    } else {
        lookup(opcode, None).ok_or(SenseReason::InvalidOpcode)?
    };
    let body = cdb.get(..info.usage.len()).ok_or(bad_cdb(0))?;
    for (i, (&b, &mask)) in body.iter().zip(info.usage).enumerate().skip(1) {
        let extra = b & !mask;
        if extra != 0 {
            // Point at the highest offending bit.
            let bit = 7 - extra.leading_zeros() as u8;
            return Err(bad_cdb_bit(i as u16, bit));
        }
    }
    Ok(info)
}

fn check_range(geo: Geometry, lba: u64, blocks: u64) -> Result<(), SenseReason> {
    match lba.checked_add(blocks) {
        Some(end) if lba < geo.blocks && end <= geo.blocks => Ok(()),
        _ => Err(SenseReason::LbaOutOfRange),
    }
}

/// Blocks → bytes for a data transfer, enforcing MAXIMUM TRANSFER LENGTH.
fn xfer_bytes(geo: Geometry, blocks: u32, len_byte: u16) -> Result<u32, SenseReason> {
    let bytes = u64::from(blocks) * u64::from(geo.block_size);
    if bytes > u64::from(MAX_TRANSFER_BYTES) {
        return Err(bad_cdb(len_byte));
    }
    Ok(bytes as u32)
}

/// Decode a CDB already accepted by `check_cdb`.
pub(crate) fn decode(cdb: &[u8], geo: Geometry) -> Result<Decoded, SenseReason> {
    check_cdb(cdb)?;
    let b = |i: usize| cdb.get(i).copied().unwrap_or(0);
    let bs = geo.block_size;
    let d = match b(0) {
        opc::TEST_UNIT_READY => Decoded::none(Op::TestUnitReady),
        opc::REQUEST_SENSE => {
            let alloc = u32::from(b(4));
            Decoded::data_in(
                Op::RequestSense {
                    desc: b(1) & 1 != 0,
                    alloc,
                },
                alloc,
            )
        }
        opc::INQUIRY => {
            let evpd = b(1) & 1 != 0;
            let page = b(2);
            if !evpd && page != 0 {
                return Err(bad_cdb(2));
            }
            if evpd && !VPD_PAGES.contains(&page) {
                return Err(bad_cdb(2));
            }
            let alloc = u32::from(be16(cdb, 3));
            Decoded::data_in(Op::Inquiry { evpd, page, alloc }, alloc)
        }
        opc::REPORT_LUNS => {
            let select = b(2);
            if select > 2 {
                return Err(bad_cdb(2));
            }
            let alloc = be32(cdb, 6);
            Decoded::data_in(Op::ReportLuns { select, alloc }, alloc)
        }
        opc::START_STOP_UNIT => Decoded::none(Op::StartStop {
            start: b(4) & 1 != 0,
        }),
        opc::READ_CAPACITY10 => {
            if b(8) & 1 == 0 && be32(cdb, 2) != 0 {
                return Err(bad_cdb(2));
            }
            Decoded::data_in(Op::ReadCapacity10, 8)
        }
        opc::SERVICE_ACTION_IN16 => {
            let alloc = be32(cdb, 10);
            Decoded::data_in(Op::ReadCapacity16 { alloc }, alloc)
        }
        opc::READ6 | opc::WRITE6 => {
            let lba = u64::from(u32::from(b(1) & 0x1f) << 16 | u32::from(be16(cdb, 2)));
            // SBC: a TRANSFER LENGTH of 0 in the 6-byte CDBs means 256 blocks.
            let blocks = if b(4) == 0 { 256 } else { u32::from(b(4)) };
            rw(b(0) == opc::WRITE6, geo, lba, blocks, 4)?
        }
        opc::READ10 | opc::WRITE10 => rw(
            b(0) == opc::WRITE10,
            geo,
            u64::from(be32(cdb, 2)),
            u32::from(be16(cdb, 7)),
            7,
        )?,
        opc::READ12 | opc::WRITE12 => rw(
            b(0) == opc::WRITE12,
            geo,
            u64::from(be32(cdb, 2)),
            be32(cdb, 6),
            6,
        )?,
        opc::READ16 | opc::WRITE16 => {
            rw(b(0) == opc::WRITE16, geo, be64(cdb, 2), be32(cdb, 10), 10)?
        }
        opc::WRITE_VERIFY10 | opc::WRITE_VERIFY12 | opc::WRITE_VERIFY16 => {
            let (lba, blocks, len_byte) = lba_len(cdb);
            check_range(geo, lba, u64::from(blocks))?;
            let bytes = xfer_bytes(geo, blocks, len_byte)?;
            Decoded::data_out(Op::WriteVerify { lba, blocks }, bytes)
        }
        opc::VERIFY10 | opc::VERIFY12 | opc::VERIFY16 => {
            let (lba, blocks, len_byte) = lba_len(cdb);
            let bytchk = (b(1) >> 1) & 3;
            if bytchk == 2 {
                return Err(bad_cdb_bit(1, 2));
            }
            check_range(geo, lba, u64::from(blocks))?;
            // BYTCHK=3 sends one block but compares every block of the
            // range: the work is the range, so it obeys MAXIMUM TRANSFER LENGTH.
            if u64::from(blocks) * u64::from(bs) > u64::from(MAX_TRANSFER_BYTES) {
                return Err(bad_cdb(len_byte));
            }
            let out = match (bytchk, blocks) {
                (0, _) | (_, 0) => 0,
                (1, _) => xfer_bytes(geo, blocks, len_byte)?,
                _ => bs,
            };
            Decoded::data_out(
                Op::Verify {
                    lba,
                    blocks,
                    bytchk,
                },
                out,
            )
        }
        opc::PRE_FETCH10 | opc::PRE_FETCH16 | opc::SYNC_CACHE10 | opc::SYNC_CACHE16 => {
            let (lba, blocks, _) = lba_len(cdb);
            // NUMBER OF LOGICAL BLOCKS 0 means "to the end of the medium".
            check_range(geo, lba, u64::from(blocks))?;
            Decoded::none(Op::NoData)
        }
        opc::WRITE_SAME10 | opc::WRITE_SAME16 => {
            let (lba, n, len_byte) = lba_len(cdb);
            let ndob = b(0) == opc::WRITE_SAME16 && b(1) & 1 != 0;
            check_range(geo, lba, u64::from(n))?;
            let blocks = if n == 0 {
                geo.blocks - lba
            } else {
                u64::from(n)
            };
            if blocks * u64::from(bs) > MAX_WRITE_SAME_BYTES {
                return Err(bad_cdb(len_byte));
            }
            Decoded {
                exact_out: !ndob,
                ..Decoded::data_out(
                    Op::WriteSame { lba, blocks, ndob },
                    if ndob { 0 } else { bs },
                )
            }
        }
        opc::COMPARE_AND_WRITE => {
            let lba = be64(cdb, 2);
            let blocks = u32::from(b(13));
            check_range(geo, lba, u64::from(blocks))?;
            Decoded {
                exact_out: true,
                ..Decoded::data_out(Op::CompareAndWrite { lba, blocks }, 2 * blocks * bs)
            }
        }
        opc::MODE_SENSE6 | opc::MODE_SENSE10 => {
            let ten = b(0) == opc::MODE_SENSE10;
            let req = ModeSenseReq {
                ten,
                dbd: b(1) & 0x08 != 0,
                llbaa: ten && b(1) & 0x10 != 0,
                pc: b(2) >> 6,
                page: b(2) & 0x3f,
                alloc: if ten {
                    u32::from(be16(cdb, 7))
                } else {
                    u32::from(b(4))
                },
            };
            super::mode::check_sense_request(&req, b(3))?;
            Decoded::data_in(Op::ModeSense(req), req.alloc)
        }
        opc::MODE_SELECT6 | opc::MODE_SELECT10 => {
            let ten = b(0) == opc::MODE_SELECT10;
            if b(1) & 1 != 0 {
                return Err(SenseReason::SavingParamsNotSupported);
            }
            let len = if ten {
                u32::from(be16(cdb, 7))
            } else {
                u32::from(b(4))
            };
            Decoded::data_out(Op::ModeSelect { ten, len }, len)
        }
        opc::PR_IN => {
            let alloc = u32::from(be16(cdb, 7));
            Decoded::data_in(
                Op::PrIn {
                    sa: b(1) & 0x1f,
                    alloc,
                },
                alloc,
            )
        }
        opc::PR_OUT => {
            let len = be32(cdb, 5);
            // Without SPEC_I_PT (unsupported) every service action we take
            // has a 24-byte parameter list (SPC-4 6.17.3).
            if len != 24 {
                return Err(SenseReason::ParamListLengthError);
            }
            Decoded::data_out(
                Op::PrOut {
                    sa: b(1) & 0x1f,
                    scope: b(2) >> 4,
                    ty: b(2) & 0x0f,
                },
                len,
            )
        }
        opc::RESERVE6 => Decoded::none(Op::Reserve6),
        opc::RELEASE6 => Decoded::none(Op::Release6),
        opc::MAINTENANCE_IN => {
            let options = b(2) & 0x07;
            if options > 3 {
                return Err(bad_cdb_bit(2, 2));
            }
            let alloc = be32(cdb, 6);
            let op = Op::ReportOpcodes {
                rctd: b(2) & 0x80 != 0,
                options,
                opcode: b(3),
                sa: be16(cdb, 4),
                alloc,
            };
            super::opcodes::check_request(&op)?;
            Decoded::data_in(op, alloc)
        }
        _ => return Err(SenseReason::InvalidOpcode),
    };
    Ok(d)
}

/// LBA, length and the byte offset of the length field, for the 10/12/16
/// byte forms of the block commands.
fn lba_len(cdb: &[u8]) -> (u64, u32, u16) {
    // The opcode's group code gives the CDB size (SPC-4 4.2.5.1).
    match cdb.first().map(|op| op >> 5) {
        Some(4) => (be64(cdb, 2), be32(cdb, 10), 10),
        Some(5) => (u64::from(be32(cdb, 2)), be32(cdb, 6), 6),
        _ => (u64::from(be32(cdb, 2)), u32::from(be16(cdb, 7)), 7),
    }
}

fn rw(
    write: bool,
    geo: Geometry,
    lba: u64,
    blocks: u32,
    len_byte: u16,
) -> Result<Decoded, SenseReason> {
    check_range(geo, lba, u64::from(blocks))?;
    let bytes = xfer_bytes(geo, blocks, len_byte)?;
    let offset = lba * u64::from(geo.block_size);
    Ok(if write {
        Decoded {
            out_to_store: (bytes > 0).then_some(offset),
            ..Decoded::data_out(Op::Write { lba, blocks }, bytes)
        }
    } else {
        Decoded::data_in(Op::Read { lba, blocks }, bytes)
    })
}
