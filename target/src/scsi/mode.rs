//! MODE SENSE / MODE SELECT: the caching page (WCE=0, not changeable: the
//! LUN memory is the medium, so hosts skip SYNCHRONIZE CACHE) and the
//! control page. No parameter is changeable; a MODE SELECT that repeats the
//! current values succeeds, one that changes anything is refused with the
//! field pointer on the offending bit (SPC-4 6.11, 7.5.1).

use ramslog_common::scsi_wire::{be16, be32, be64};

use super::sense::{bad_cdb, bad_cdb_bit, bad_param, bad_param_bit, SenseReason};
use super::vocab::{Geometry, ModeSenseReq};

const PAGE_CACHING: u8 = 0x08;
const PAGE_CONTROL: u8 = 0x0a;
const ALL_PAGES: u8 = 0x3f;

/// Device-specific parameter: DPOFUA=1 (we honour DPO/FUA, trivially), WP=0.
const DSP: u8 = 0x10;

/// Current (= default) contents, including the 2-byte page header.
const CACHING: [u8; 20] = {
    let mut p = [0u8; 20];
    p[0] = PAGE_CACHING;
    p[1] = 18;
    // p[2] bit 2 WCE = 0, bit 0 RCD = 0.
    p
};

const CONTROL: [u8; 12] = {
    let mut p = [0u8; 12];
    p[0] = PAGE_CONTROL;
    p[1] = 10;
    p[3] = 0x10; // QUEUE ALGORITHM MODIFIER 1: unrestricted reordering
    p[8] = 0xff; // BUSY TIMEOUT PERIOD: unlimited
    p[9] = 0xff;
    p
};

/// (page, current, changeable mask)
fn pages() -> [(u8, &'static [u8], &'static [u8]); 2] {
    const NONE_CACHING: [u8; 20] = [0; 20];
    const NONE_CONTROL: [u8; 12] = [0; 12];
    [
        (PAGE_CACHING, &CACHING, &NONE_CACHING),
        (PAGE_CONTROL, &CONTROL, &NONE_CONTROL),
    ]
}

/// Validate the page request before any data moves.
pub(crate) fn check_sense_request(req: &ModeSenseReq, subpage: u8) -> Result<(), SenseReason> {
    if req.pc == 3 {
        return Err(SenseReason::SavingParamsNotSupported);
    }
    if !matches!(req.page, PAGE_CACHING | PAGE_CONTROL | ALL_PAGES) {
        return Err(bad_cdb_bit(2, 5));
    }
    if subpage != 0 && !(req.page == ALL_PAGES && subpage == 0xff) {
        return Err(bad_cdb(3));
    }
    Ok(())
}

pub(crate) fn sense(out: &mut Vec<u8>, req: &ModeSenseReq, geo: Geometry) {
    let hdr = if req.ten { 8 } else { 4 };
    out.resize(hdr, 0);
    if !req.dbd {
        if req.llbaa {
            out.extend_from_slice(&geo.blocks.to_be_bytes());
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&geo.block_size.to_be_bytes());
        } else {
            let n = u32::try_from(geo.blocks).unwrap_or(u32::MAX);
            out.extend_from_slice(&n.to_be_bytes());
            out.push(0);
            out.extend_from_slice(&geo.block_size.to_be_bytes()[1..]);
        }
    }
    let bdl = out.len() - hdr;
    for (code, current, changeable) in pages() {
        if req.page == ALL_PAGES || req.page == code {
            if req.pc == 1 {
                out.extend_from_slice(&current[..2]);
                out.extend_from_slice(&changeable[2..]);
            } else {
                out.extend_from_slice(current);
            }
        }
    }
    let total = out.len();
    if req.ten {
        out[0..2].copy_from_slice(&((total - 2) as u16).to_be_bytes());
        out[3] = DSP;
        out[4] = u8::from(req.llbaa && !req.dbd);
        out[6..8].copy_from_slice(&(bdl as u16).to_be_bytes());
    } else {
        out[0] = (total - 1) as u8;
        out[2] = DSP;
        out[3] = bdl as u8;
    }
}

/// Check a MODE SELECT parameter list. `len` is the CDB's parameter list
/// length; `data` what arrived (the engine may deliver less).
pub(crate) fn select(data: &[u8], len: u32, ten: bool, geo: Geometry) -> Result<(), SenseReason> {
    let end = (len as usize).min(data.len());
    let data = &data[..end];
    if len == 0 {
        return Ok(());
    }
    let hdr = if ten { 8 } else { 4 };
    if data.len() < hdr {
        return Err(SenseReason::ParamListLengthError);
    }
    let (medium_off, bdl_off, bdl, long) = if ten {
        (2, 6, usize::from(be16(data, 6)), data[4] & 1 != 0)
    } else {
        (1, 3, usize::from(data[3]), false)
    };
    if data[medium_off] != 0 {
        return Err(bad_param(medium_off));
    }
    let desc_len = if long { 16 } else { 8 };
    if bdl != 0 && bdl != desc_len {
        return Err(bad_param(bdl_off));
    }
    let pages_at = hdr + bdl;
    if data.len() < pages_at {
        return Err(SenseReason::ParamListLengthError);
    }
    if bdl != 0 {
        let d = &data[hdr..pages_at];
        let (blocks, blen, blen_off) = if long {
            (be64(d, 0), be32(d, 12), 12)
        } else {
            (u64::from(be32(d, 0)), be32(d, 4) & 0x00ff_ffff, 5)
        };
        let reported = if long {
            geo.blocks
        } else {
            geo.blocks.min(u64::from(u32::MAX))
        };
        if blocks != 0 && blocks != reported {
            return Err(bad_param(hdr));
        }
        if blen != geo.block_size {
            return Err(bad_param(hdr + blen_off));
        }
    }
    let mut off = pages_at;
    while off < data.len() {
        let p = &data[off..];
        if p.len() < 2 {
            return Err(SenseReason::ParamListLengthError);
        }
        if p[0] & 0x40 != 0 {
            return Err(bad_param_bit(off, 6));
        }
        let code = p[0] & 0x3f;
        let Some((_, current, changeable)) = pages().into_iter().find(|(c, _, _)| *c == code)
        else {
            return Err(bad_param_bit(off, 5));
        };
        let plen = usize::from(p[1]) + 2;
        if plen != current.len() {
            return Err(bad_param(off + 1));
        }
        let Some(page) = p.get(..plen) else {
            return Err(SenseReason::ParamListLengthError);
        };
        for i in 2..plen {
            let diff = (page[i] ^ current[i]) & !changeable[i];
            if diff != 0 {
                let bit = 7 - diff.leading_zeros() as u8;
                return Err(bad_param_bit(off + i, bit));
            }
        }
        off += plen;
    }
    Ok(())
}
