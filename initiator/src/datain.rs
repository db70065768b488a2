//! Completing a SCSI command from the target's PDUs: Data-In reassembly by
//! buffer offset, status from a SCSI Response or a phase-collapsed Data-In.

pub use ramslog_common::iscsi::Residual;
use ramslog_common::iscsi::{scsi_rsp, Bhs, Opcode};
use ramslog_common::scsi_wire::{be16, Sense};

use crate::Error;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiResult {
    pub status: u8,
    pub sense: Option<Sense>,
    /// Sense data as sent (without the 2-byte length).
    pub sense_raw: Vec<u8>,
    /// Data-In, truncated to what the target sent.
    pub data: Vec<u8>,
    pub residual: Residual,
}

impl ScsiResult {
    pub fn is_good(&self) -> bool {
        self.status == ramslog_common::scsi_wire::status::GOOD
    }

    /// Err(Error::Scsi) unless the status is GOOD.
    pub fn check(self) -> Result<ScsiResult, Error> {
        check_status(self.status, self.sense).map(|()| self)
    }
}

/// Collects Data-In PDUs for one command.
#[derive(Debug)]
pub struct DataInAssembler {
    buf: Vec<u8>,
    expected: u32,
    next_datasn: u32,
    /// End of the contiguous prefix received (DataPDUInOrder=Yes).
    filled: u32,
}

impl DataInAssembler {
    pub fn new(expected: u32) -> Self {
        DataInAssembler {
            buf: Vec::new(),
            expected,
            next_datasn: 0,
            filled: 0,
        }
    }

    /// Bytes received so far.
    pub fn received(&self) -> u32 {
        self.filled
    }

    /// Take one Data-In PDU. Returns the result if its S bit completes the command.
    pub fn push(&mut self, bhs: &Bhs, data: &[u8]) -> Result<Option<ScsiResult>, Error> {
        debug_assert_eq!(bhs.opcode(), Some(Opcode::DataIn));
        let flags = bhs.flags();
        if bhs.datasn() != self.next_datasn {
            return Err(Error::proto(format!(
                "Data-In DataSN {}, expected {}",
                bhs.datasn(),
                self.next_datasn
            )));
        }
        self.next_datasn = self.next_datasn.wrapping_add(1);
        let off = bhs.buffer_offset();
        let len = data.len() as u32;
        let end = off
            .checked_add(len)
            .filter(|e| *e <= self.expected)
            .ok_or_else(|| {
                Error::proto(format!(
                    "Data-In at offset {off} length {len} overruns the expected {} bytes",
                    self.expected
                ))
            })?;
        // DataPDUInOrder=Yes and DataSequenceInOrder=Yes: offsets are contiguous.
        if off != self.filled {
            return Err(Error::proto(format!(
                "Data-In at offset {off}, expected {} (DataPDUInOrder=Yes)",
                self.filled
            )));
        }
        if self.buf.is_empty() && self.expected > 0 {
            self.buf.reserve_exact(self.expected as usize);
        }
        self.buf.extend_from_slice(data);
        self.filled = end;
        if flags & scsi_rsp::STATUS == 0 {
            return Ok(None);
        }
        if flags & 0x80 == 0 {
            return Err(Error::proto("Data-In with S bit but without F bit"));
        }
        let residual = bhs
            .residual_status()
            .map_err(|e| Error::proto(e.to_string()))?;
        let status = bhs.scsi_status();
        self.check_complete(residual)?;
        Ok(Some(ScsiResult {
            status,
            sense: None,
            sense_raw: Vec::new(),
            data: std::mem::take(&mut self.buf),
            residual,
        }))
    }

    fn check_complete(&self, residual: Residual) -> Result<(), Error> {
        let want = match residual {
            Residual::Under(n) => self.expected.saturating_sub(n),
            _ => self.expected,
        };
        if self.filled < want {
            return Err(Error::proto(format!(
                "status says {want} bytes were sent, only {} arrived",
                self.filled
            )));
        }
        Ok(())
    }

    /// Complete from a SCSI Response PDU.
    pub fn finish(mut self, bhs: &Bhs, data: &[u8]) -> Result<ScsiResult, Error> {
        let r = response_status(bhs, data)?;
        if r.status == ramslog_common::scsi_wire::status::GOOD {
            self.check_complete(r.residual)?;
        }
        Ok(ScsiResult {
            status: r.status,
            sense: r.sense,
            sense_raw: data.get(2..2 + r.sense_len).unwrap_or(&[]).to_vec(),
            data: std::mem::take(&mut self.buf),
            residual: r.residual,
        })
    }
}

/// Err(Error::Scsi) unless `status` is GOOD.
pub(crate) fn check_status(status: u8, sense: Option<Sense>) -> Result<(), Error> {
    if status == ramslog_common::scsi_wire::status::GOOD {
        Ok(())
    } else {
        Err(Error::Scsi { status, sense })
    }
}

/// What a SCSI Response PDU says about its command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResponseStatus {
    pub status: u8,
    pub sense: Option<Sense>,
    /// Bytes of sense data after the 2-byte SenseLength.
    pub sense_len: usize,
    pub residual: Residual,
}

/// Decode a SCSI Response: iSCSI response code (non-zero is
/// [`Error::TargetFailure`]), status, sense data, residual.
pub(crate) fn response_status(bhs: &Bhs, data: &[u8]) -> Result<ResponseStatus, Error> {
    let response = bhs.response();
    if response != 0 {
        return Err(Error::TargetFailure(response));
    }
    let status = bhs.scsi_status();
    let residual = bhs
        .residual_status()
        .map_err(|e| Error::proto(e.to_string()))?;
    let mut sense = None;
    let mut sense_len = 0;
    if !data.is_empty() {
        if data.len() < 2 {
            return Err(Error::proto("SCSI Response data shorter than SenseLength"));
        }
        let slen = be16(data, 0) as usize;
        let raw = data.get(2..2 + slen).ok_or_else(|| {
            Error::proto(format!(
                "SenseLength {slen} exceeds the {} bytes sent",
                data.len() - 2
            ))
        })?;
        if slen > 0 {
            sense =
                Some(Sense::decode(raw).map_err(|e| Error::proto(format!("bad sense data: {e}")))?);
            sense_len = slen;
        }
    }
    Ok(ResponseStatus {
        status,
        sense,
        sense_len,
        residual,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramslog_common::scsi_wire::{sense_key, status};

    fn data_in(sn: u32, off: u32, flags: u8) -> Bhs {
        let mut b = Bhs::new(Opcode::DataIn);
        b.set_flags(flags);
        b.set_datasn(sn).set_buffer_offset(off);
        b
    }

    #[test]
    fn reassembles_and_collapses_status() {
        let mut a = DataInAssembler::new(10);
        assert_eq!(a.push(&data_in(0, 0, 0), b"0123").unwrap(), None);
        let r = a
            .push(&data_in(1, 4, 0x80 | scsi_rsp::STATUS), b"456789")
            .unwrap()
            .unwrap();
        assert_eq!(r.data, b"0123456789");
        assert_eq!(r.status, status::GOOD);
        assert_eq!(r.residual, Residual::None);
    }

    #[test]
    fn underflow_and_response() {
        let mut a = DataInAssembler::new(16);
        a.push(&data_in(0, 0, 0x80), b"abcd").unwrap();
        let mut rsp = Bhs::new(Opcode::ScsiResponse);
        rsp.set_flags(0x80 | scsi_rsp::UNDERFLOW).set_residual(12);
        let r = a.finish(&rsp, &[]).unwrap();
        assert_eq!(r.data, b"abcd");
        assert_eq!(r.residual, Residual::Under(12));

        // Claimed underflow of 4 but only 4 of 16 bytes came.
        let mut a = DataInAssembler::new(16);
        a.push(&data_in(0, 0, 0x80), b"abcd").unwrap();
        rsp.set_residual(4);
        assert!(a.finish(&rsp, &[]).is_err());
    }

    #[test]
    fn sense_from_response() {
        let sense = Sense::new(sense_key::ILLEGAL_REQUEST, 0x24, 0);
        let mut data = vec![0, 18];
        data.extend_from_slice(&sense.encode_fixed());
        let rsp = Bhs::scsi_response(0, status::CHECK_CONDITION, Residual::None);
        let r = DataInAssembler::new(0).finish(&rsp, &data).unwrap();
        assert_eq!(r.status, status::CHECK_CONDITION);
        assert_eq!(r.sense, Some(sense));
        assert!(matches!(r.clone().check(), Err(Error::Scsi { .. })));

        assert!(DataInAssembler::new(0)
            .finish(&rsp, &[0, 30, 0x70])
            .is_err());
        // Response 1, "target failure": the command did not complete.
        let mut raw = *rsp.as_bytes();
        raw[2] = 1;
        let rsp = Bhs::from_raw(raw);
        assert!(matches!(
            DataInAssembler::new(0).finish(&rsp, &[]),
            Err(Error::TargetFailure(1))
        ));
    }

    #[test]
    fn hostile_data_in() {
        let mut a = DataInAssembler::new(8);
        assert!(a.push(&data_in(1, 0, 0), b"ab").is_err()); // DataSN skipped
        let mut a = DataInAssembler::new(8);
        assert!(a.push(&data_in(0, 6, 0), b"abcd").is_err()); // past the end
        let mut a = DataInAssembler::new(8);
        assert!(a.push(&data_in(0, 2, 0), b"ab").is_err()); // hole
        let mut a = DataInAssembler::new(8);
        assert!(a.push(&data_in(0, u32::MAX, 0), b"ab").is_err()); // overflow
        let mut a = DataInAssembler::new(8);
        assert!(a
            .push(&data_in(0, 0, scsi_rsp::STATUS), b"abcdefgh")
            .is_err()); // S without F
    }
}
