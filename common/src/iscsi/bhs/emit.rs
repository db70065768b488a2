//! Typed emitters for the PDUs a target sends (RFC 7143 chapter 11): each
//! takes the fields its opcode defines and returns a header with every other
//! byte zero. The sender stamps StatSN, ExpCmdSN and MaxCmdSN afterwards
//! with the setters, because those belong to the connection, not to the PDU,
//! and sets the data segment length when it knows the data.

use super::{scsi_rsp, Bhs, Opcode, RejectReason, WireError, RESERVED_TAG};

/// A SCSI residual (RFC 7143 11.4.5): how the bytes moved compare with the
/// initiator's expected data transfer length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residual {
    #[default]
    None,
    /// The target moved this many bytes fewer than the expected length.
    Under(u32),
    /// The command wanted this many bytes more than the expected length.
    Over(u32),
}

impl Residual {
    /// Compare the initiator's expected length with what the command moves.
    #[inline]
    pub fn between(expected: u32, actual: u32) -> Residual {
        match expected.cmp(&actual) {
            std::cmp::Ordering::Equal => Residual::None,
            std::cmp::Ordering::Greater => Residual::Under(expected - actual),
            std::cmp::Ordering::Less => Residual::Over(actual - expected),
        }
    }

    /// The U/O bits of byte 1.
    #[inline]
    pub fn flags(self) -> u8 {
        match self {
            Residual::None => 0,
            Residual::Under(_) => scsi_rsp::UNDERFLOW,
            Residual::Over(_) => scsi_rsp::OVERFLOW,
        }
    }

    /// The ResidualCount field.
    #[inline]
    pub fn count(self) -> u32 {
        match self {
            Residual::None => 0,
            Residual::Under(n) | Residual::Over(n) => n,
        }
    }
}

/// A Data-In's status part (phase collapse, RFC 7143 11.7.4): only on the
/// last PDU of a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataInStatus {
    pub scsi_status: u8,
    pub statsn: u32,
    pub residual: Residual,
}

/// A SCSI Data-In (RFC 7143 11.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataIn {
    pub lun: u64,
    pub itt: u32,
    pub datasn: u32,
    pub buffer_offset: u32,
    pub len: u32,
    /// The last PDU of a sequence (a burst, or the command).
    pub final_in_sequence: bool,
    pub status: Option<DataInStatus>,
}

/// A Ready To Transfer (RFC 7143 11.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2t {
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub r2tsn: u32,
    pub buffer_offset: u32,
    pub desired_len: u32,
}

/// A Login Response (RFC 7143 11.13) before its sequence numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginResponse {
    /// Byte 1: transit, continue, current and next stage.
    pub flags: u8,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub itt: u32,
    /// Status class and detail, as in [`super::login_status`].
    pub status: u16,
}

impl Bhs {
    /// A SCSI Response (RFC 7143 11.4) with iSCSI response 0, "command
    /// completed at target"; sense data, if any, goes in the data segment.
    #[inline]
    pub fn scsi_response(itt: u32, scsi_status: u8, residual: Residual) -> Bhs {
        let mut b = Bhs::new(Opcode::ScsiResponse);
        b.set_flags(0x80 | residual.flags()).set_itt(itt);
        b.0[3] = scsi_status;
        b.set_residual(residual.count());
        b
    }

    #[inline]
    pub fn data_in(d: DataIn) -> Bhs {
        let mut b = Bhs::new(Opcode::DataIn);
        let mut flags = if d.final_in_sequence || d.status.is_some() {
            0x80
        } else {
            0
        };
        b.set_lun(d.lun)
            .set_itt(d.itt)
            .set_ttt(RESERVED_TAG)
            .set_datasn(d.datasn)
            .set_buffer_offset(d.buffer_offset)
            .set_data_segment_len(d.len);
        if let Some(st) = d.status {
            flags |= scsi_rsp::STATUS | st.residual.flags();
            b.0[3] = st.scsi_status;
            b.set_statsn(st.statsn).set_residual(st.residual.count());
        }
        b.set_flags(flags);
        b
    }

    #[inline]
    pub fn r2t(r: R2t) -> Bhs {
        let mut b = Bhs::new(Opcode::ReadyToTransfer);
        b.set_final(true)
            .set_lun(r.lun)
            .set_itt(r.itt)
            .set_ttt(r.ttt)
            .set_datasn(r.r2tsn)
            .set_buffer_offset(r.buffer_offset)
            .set_residual(r.desired_len);
        b
    }

    pub fn login_response(r: LoginResponse) -> Bhs {
        let mut b = Bhs::new(Opcode::LoginResponse);
        b.set_flags(r.flags)
            .set_isid(r.isid)
            .set_tsih(r.tsih)
            .set_itt(r.itt);
        b.set_u16_at(36, r.status);
        b
    }

    /// Turn a Login Response into a failure with `status`: no stage
    /// transition, no TSIH, no data.
    pub fn fail_login(&mut self, status: u16) -> &mut Self {
        self.0[1] &= 0x0c;
        self.set_tsih(0).set_data_segment_len(0);
        self.set_u16_at(36, status);
        self
    }

    /// A Text Response (RFC 7143 11.11): `last` sets F, otherwise C asks the
    /// initiator for the rest.
    pub fn text_response(itt: u32, ttt: u32, last: bool) -> Bhs {
        let mut b = Bhs::new(Opcode::TextResponse);
        b.set_flags(if last { 0x80 } else { 0x40 })
            .set_itt(itt)
            .set_ttt(ttt);
        b
    }

    /// A Logout Response (RFC 7143 11.15) with its response code (0 closed,
    /// 1 CID not found, 2 recovery not supported, 3 cleanup failed).
    pub fn logout_response(itt: u32, response: u8) -> Bhs {
        let mut b = Bhs::new(Opcode::LogoutResponse);
        b.set_final(true).set_itt(itt);
        b.0[2] = response;
        b
    }

    /// A Task Management Function Response (RFC 7143 11.6) with its
    /// response code, as in [`super::tmf`].
    pub fn tmf_response(itt: u32, response: u8) -> Bhs {
        let mut b = Bhs::new(Opcode::TaskMgmtResponse);
        b.set_final(true).set_itt(itt);
        b.0[2] = response;
        b
    }

    /// A Reject (RFC 7143 11.17); the rejected header is its data segment.
    pub fn reject(reason: RejectReason) -> Bhs {
        let mut b = Bhs::new(Opcode::Reject);
        b.set_final(true).set_itt(RESERVED_TAG);
        b.0[2] = reason as u8;
        b
    }

    /// An Asynchronous Message (RFC 7143 11.9) with AsyncEvent 1: the
    /// target requests a logout within `seconds` (Parameter3).
    #[inline]
    pub fn async_logout_request(seconds: u16) -> Bhs {
        let mut b = Bhs::new(Opcode::AsyncMessage);
        b.set_final(true).set_itt(RESERVED_TAG);
        b.0[36] = 1;
        b.set_u16_at(42, seconds);
        b
    }

    /// An Asynchronous Message (RFC 7143 11.9) with AsyncEvent 3: the
    /// target will drop every connection of the session; the initiator may
    /// reconnect after `time2wait` seconds (Parameter2) and its tasks are
    /// kept for `time2retain` (Parameter3).
    #[inline]
    pub fn async_dropping_all_connections(time2wait: u16, time2retain: u16) -> Bhs {
        let mut b = Bhs::new(Opcode::AsyncMessage);
        b.set_final(true).set_itt(RESERVED_TAG);
        b.0[36] = 3;
        b.set_u16_at(40, time2wait);
        b.set_u16_at(42, time2retain);
        b
    }

    /// A NOP-In (RFC 7143 11.19): an answer to a NOP-Out (its ITT, TTT
    /// reserved) or a ping of the target's own (ITT reserved, a fresh TTT).
    #[inline]
    pub fn nop_in(lun: u64, itt: u32, ttt: u32) -> Bhs {
        let mut b = Bhs::new(Opcode::NopIn);
        b.set_final(true).set_lun(lun).set_itt(itt).set_ttt(ttt);
        b
    }

    /// The residual of a SCSI Response or a status-carrying Data-In.
    #[inline]
    pub fn residual_status(&self) -> Result<Residual, WireError> {
        let count = self.residual();
        match (
            self.flags() & scsi_rsp::UNDERFLOW != 0,
            self.flags() & scsi_rsp::OVERFLOW != 0,
        ) {
            (false, false) => Ok(Residual::None),
            (true, false) => Ok(Residual::Under(count)),
            (false, true) => Ok(Residual::Over(count)),
            (true, true) => Err(WireError::BothResiduals),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iscsi::login_status;

    #[test]
    fn a_final_data_in_carries_status_and_residual() {
        let b = Bhs::data_in(DataIn {
            lun: 1 << 48,
            itt: 7,
            datasn: 2,
            buffer_offset: 8192,
            len: 4096,
            final_in_sequence: false,
            status: Some(DataInStatus {
                scsi_status: 0,
                statsn: 9,
                residual: Residual::Under(512),
            }),
        });
        assert_eq!(b.flags(), 0x80 | scsi_rsp::STATUS | scsi_rsp::UNDERFLOW);
        assert_eq!(b.ttt(), RESERVED_TAG);
        assert_eq!(b.statsn(), 9);
        assert_eq!(b.residual_status(), Ok(Residual::Under(512)));
        assert_eq!(b.data_segment_len(), 4096);
        assert_eq!((b.datasn(), b.buffer_offset()), (2, 8192));
    }

    #[test]
    fn a_mid_burst_data_in_has_neither_f_nor_s() {
        let b = Bhs::data_in(DataIn {
            lun: 0,
            itt: 1,
            datasn: 0,
            buffer_offset: 0,
            len: 8192,
            final_in_sequence: false,
            status: None,
        });
        assert_eq!(b.flags(), 0);
        assert_eq!(b.statsn(), 0);
    }

    #[test]
    fn a_failed_login_keeps_only_its_current_stage() {
        let mut b = Bhs::login_response(LoginResponse {
            flags: 0x87,
            isid: [1, 2, 3, 4, 5, 6],
            tsih: 5,
            itt: 3,
            status: 0,
        });
        b.set_data_segment_len(100);
        b.fail_login(login_status::OUT_OF_RESOURCES);
        assert_eq!(b.flags(), 0x04);
        assert_eq!((b.tsih(), b.data_segment_len()), (0, 0));
        assert_eq!(b.login_status(), login_status::OUT_OF_RESOURCES);
        assert_eq!(b.isid(), [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn both_residual_bits_are_an_error() {
        let mut b = Bhs::scsi_response(1, 0, Residual::Over(3));
        assert_eq!(b.residual_status(), Ok(Residual::Over(3)));
        b.set_flags(b.flags() | scsi_rsp::UNDERFLOW);
        assert_eq!(b.residual_status(), Err(WireError::BothResiduals));
    }

    #[test]
    fn each_emitter_names_its_opcode() {
        let r2t = Bhs::r2t(R2t {
            lun: 0,
            itt: 1,
            ttt: 2,
            r2tsn: 3,
            buffer_offset: 4,
            desired_len: 5,
        });
        assert_eq!(r2t.opcode(), Some(Opcode::ReadyToTransfer));
        assert_eq!((r2t.datasn(), r2t.residual()), (3, 5));
        assert_eq!(
            Bhs::reject(RejectReason::ProtocolError).reject_reason(),
            RejectReason::ProtocolError as u8
        );
        assert_eq!(Bhs::logout_response(1, 2).response(), 2);
        assert_eq!(Bhs::tmf_response(1, 5).response(), 5);
        assert_eq!(Bhs::text_response(1, 2, false).flags(), 0x40);
        assert_eq!(Bhs::nop_in(0, 1, 2).opcode(), Some(Opcode::NopIn));
    }
}
