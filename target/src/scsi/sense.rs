//! Every way a SCSI command can fail, and the one mapping from a failure to
//! status + fixed-format sense data.

use ramslog_common::scsi_wire::{sense_key, status, FieldPointer, Sense};

/// Why a command did not complete with GOOD status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SenseReason {
    /// ILLEGAL REQUEST, INVALID COMMAND OPERATION CODE (20h/00h).
    InvalidOpcode,
    /// ILLEGAL REQUEST, INVALID FIELD IN CDB (24h/00h).
    InvalidFieldInCdb(FieldPointer),
    /// ILLEGAL REQUEST, INVALID FIELD IN PARAMETER LIST (26h/00h).
    InvalidFieldInParam(FieldPointer),
    /// ILLEGAL REQUEST, LOGICAL BLOCK ADDRESS OUT OF RANGE (21h/00h).
    LbaOutOfRange,
    /// ILLEGAL REQUEST, PARAMETER LIST LENGTH ERROR (1Ah/00h).
    ParamListLengthError,
    /// ILLEGAL REQUEST, SAVING PARAMETERS NOT SUPPORTED (39h/00h).
    SavingParamsNotSupported,
    /// ILLEGAL REQUEST, INVALID RELEASE OF PERSISTENT RESERVATION (26h/04h).
    InvalidReleaseOfPr,
    /// ILLEGAL REQUEST, INSUFFICIENT REGISTRATION RESOURCES (55h/04h): the
    /// LU holds `pr::MAX_REGISTRATIONS` already.
    InsufficientRegistrationResources,
    /// ILLEGAL REQUEST, LOGICAL UNIT NOT SUPPORTED (25h/00h).
    LuNotSupported,
    /// NOT READY, LOGICAL UNIT NOT READY, MANUAL INTERVENTION REQUIRED
    /// (04h/03h): the content was lost and the admin has not accepted it.
    NotReadyManualIntervention,
    /// UNIT ATTENTION with the given ASC/ASCQ.
    UnitAttention { asc: u8, ascq: u8 },
    /// RESERVATION CONFLICT status, no sense data.
    ReservationConflict,
    /// MISCOMPARE, MISCOMPARE DURING VERIFY OPERATION (1Dh/00h); `offset` is
    /// the byte offset into the Data-Out buffer of the first difference.
    Miscompare { offset: u32 },
    /// TASK SET FULL status, no sense data.
    TaskSetFull,
    /// BUSY status, no sense data.
    Busy,
    /// HARDWARE ERROR, INTERNAL TARGET FAILURE (44h/00h): a bug, not a
    /// client error (e.g. the store refused a range we already checked).
    InternalTargetFailure,
    /// ABORTED COMMAND, DATA PHASE ERROR (4Bh/00h): the command's data did
    /// not arrive as the protocol requires; the initiator may retry.
    DataPhaseError,
    /// ABORTED COMMAND, PROTOCOL SERVICE CRC ERROR (47h/05h): write data
    /// failed its digest (RFC 7143 § 7.8 option b); the host retries.
    ProtocolServiceCrcError,
    /// ILLEGAL REQUEST, INVALID FIELD IN COMMAND INFORMATION UNIT (0Eh/03h):
    /// the iSCSI command itself is inconsistent (e.g. its expected data
    /// length ends inside a block).
    InvalidFieldInCommandIu,
    /// ILLEGAL REQUEST, INVALID FIELD IN CDB (24h/00h) without a field
    /// pointer: a transfer larger than this transport's buffers can stage.
    TransferTooLargeForTransport,
}

impl SenseReason {
    /// SCSI status byte to send.
    pub fn status(&self) -> u8 {
        match self {
            SenseReason::ReservationConflict => status::RESERVATION_CONFLICT,
            SenseReason::TaskSetFull => status::TASK_SET_FULL,
            SenseReason::Busy => status::BUSY,
            _ => status::CHECK_CONDITION,
        }
    }

    /// Sense data to send with CHECK CONDITION; None for the statuses that
    /// carry none.
    pub fn sense(&self) -> Option<Sense> {
        use sense_key::*;
        let (key, asc, ascq, field, information) = match *self {
            SenseReason::InvalidOpcode => {
                (ILLEGAL_REQUEST, 0x20, 0, Some(FieldPointer::cdb(0)), None)
            }
            SenseReason::InvalidFieldInCdb(fp) => (ILLEGAL_REQUEST, 0x24, 0, Some(fp), None),
            SenseReason::InvalidFieldInParam(fp) => (ILLEGAL_REQUEST, 0x26, 0, Some(fp), None),
            SenseReason::LbaOutOfRange => (ILLEGAL_REQUEST, 0x21, 0, None, None),
            SenseReason::ParamListLengthError => (ILLEGAL_REQUEST, 0x1a, 0, None, None),
            SenseReason::SavingParamsNotSupported => (ILLEGAL_REQUEST, 0x39, 0, None, None),
            SenseReason::InvalidReleaseOfPr => (ILLEGAL_REQUEST, 0x26, 0x04, None, None),
            SenseReason::LuNotSupported => (ILLEGAL_REQUEST, 0x25, 0, None, None),
            SenseReason::InsufficientRegistrationResources => {
                (ILLEGAL_REQUEST, 0x55, 0x04, None, None)
            }
            SenseReason::NotReadyManualIntervention => (NOT_READY, 0x04, 0x03, None, None),
            SenseReason::UnitAttention { asc, ascq } => (UNIT_ATTENTION, asc, ascq, None, None),
            SenseReason::Miscompare { offset } => (MISCOMPARE, 0x1d, 0, None, Some(offset)),
            SenseReason::InternalTargetFailure => (HARDWARE_ERROR, 0x44, 0, None, None),
            SenseReason::DataPhaseError => (ABORTED_COMMAND, 0x4b, 0, None, None),
            SenseReason::ProtocolServiceCrcError => (ABORTED_COMMAND, 0x47, 0x05, None, None),
            SenseReason::InvalidFieldInCommandIu => (ILLEGAL_REQUEST, 0x0e, 0x03, None, None),
            SenseReason::TransferTooLargeForTransport => (ILLEGAL_REQUEST, 0x24, 0, None, None),
            SenseReason::ReservationConflict | SenseReason::TaskSetFull | SenseReason::Busy => {
                return None
            }
        };
        Some(Sense {
            key,
            asc,
            ascq,
            information,
            field,
        })
    }
}

/// REQUEST SENSE's answer when nothing is pending: NO SENSE.
pub(crate) const NO_SENSE: Sense = Sense {
    key: sense_key::NO_SENSE,
    asc: 0,
    ascq: 0,
    information: None,
    field: None,
};

pub(crate) fn bad_cdb(byte: u16) -> SenseReason {
    SenseReason::InvalidFieldInCdb(FieldPointer::cdb(byte))
}

pub(crate) fn bad_cdb_bit(byte: u16, bit: u8) -> SenseReason {
    SenseReason::InvalidFieldInCdb(FieldPointer::cdb_bit(byte, bit))
}

pub(crate) fn bad_param(byte: usize) -> SenseReason {
    SenseReason::InvalidFieldInParam(FieldPointer::param(clamp16(byte)))
}

pub(crate) fn bad_param_bit(byte: usize, bit: u8) -> SenseReason {
    SenseReason::InvalidFieldInParam(FieldPointer::param_bit(clamp16(byte), bit))
}

fn clamp16(v: usize) -> u16 {
    u16::try_from(v).unwrap_or(u16::MAX)
}

/// Unit attention codes this device raises.
pub mod ua {
    pub const POWER_ON_RESET: (u8, u8) = (0x29, 0x00);
    pub const BUS_DEVICE_RESET: (u8, u8) = (0x29, 0x03);
    pub const RESERVATIONS_PREEMPTED: (u8, u8) = (0x2a, 0x03);
    pub const RESERVATIONS_RELEASED: (u8, u8) = (0x2a, 0x04);
    pub const REGISTRATIONS_PREEMPTED: (u8, u8) = (0x2a, 0x05);
    pub const INQUIRY_DATA_CHANGED: (u8, u8) = (0x3f, 0x03);
    pub const REPORTED_LUNS_CHANGED: (u8, u8) = (0x3f, 0x0e);
}
