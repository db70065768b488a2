//! REPORT SUPPORTED OPERATION CODES (SPC-4 6.35), generated from the same
//! command table that validates CDBs, so what we claim is what we accept.

use super::sense::{bad_cdb, SenseReason};
use super::vocab::{has_service_actions, lookup, opcode_known, Op, COMMANDS};

/// Command timeouts descriptor (RCTD=1): no nominal/recommended timeout given.
const TIMEOUTS: [u8; 12] = [0, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

pub(crate) fn check_request(op: &Op) -> Result<(), SenseReason> {
    let Op::ReportOpcodes {
        options, opcode, ..
    } = *op
    else {
        return Ok(());
    };
    // Asking about an opcode in the wrong form is INVALID FIELD IN CDB
    // (SPC-4 6.35.2) — but only when we know the opcode; unknown ones get a
    // "not supported" answer.
    match options {
        1 if has_service_actions(opcode) && opcode_known(opcode) => Err(bad_cdb(2)),
        2 if !has_service_actions(opcode) && opcode_known(opcode) => Err(bad_cdb(2)),
        _ => Ok(()),
    }
}

pub(crate) fn report(out: &mut Vec<u8>, op: &Op) {
    let Op::ReportOpcodes {
        rctd,
        options,
        opcode,
        sa,
        ..
    } = *op
    else {
        return;
    };
    if options == 0 {
        out.extend_from_slice(&[0; 4]);
        for c in COMMANDS {
            out.push(c.usage[0]);
            out.push(0);
            out.extend_from_slice(&u16::from(c.sa.unwrap_or(0)).to_be_bytes());
            out.push(0);
            out.push(u8::from(rctd) << 1 | u8::from(c.sa.is_some()));
            out.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
            if rctd {
                out.extend_from_slice(&TIMEOUTS);
            }
        }
        let len = (out.len() - 4) as u32;
        out[0..4].copy_from_slice(&len.to_be_bytes());
        return;
    }
    let want_sa = has_service_actions(opcode) && options != 1;
    let info = if want_sa {
        u8::try_from(sa)
            .ok()
            .and_then(|sa| lookup(opcode, Some(sa)))
    } else {
        lookup(opcode, None)
    };
    match info {
        Some(c) => {
            out.push(0);
            // CTDP, SUPPORT 011b: supported as the standard says.
            out.push(u8::from(rctd) << 7 | 0x03);
            out.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
            out.extend_from_slice(c.usage);
            if rctd {
                out.extend_from_slice(&TIMEOUTS);
            }
        }
        None => {
            // SUPPORT 001b: not supported; no usage data.
            out.extend_from_slice(&[0, 0x01, 0, 0]);
        }
    }
}
