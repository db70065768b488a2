//! The SCSI vocabulary this device speaks: opcodes, the table of supported
//! commands with their CDB usage data, the decoded command (`Op`) and the
//! limits the device advertises. A leaf: it imports nothing from the crate,
//! so decoding, INQUIRY, MODE SENSE and REPORT SUPPORTED OPERATION CODES all
//! build on it without depending on each other.

/// VPD pages we serve, in the order page 00h lists them. No B2h: the LU is
/// fully provisioned, so we do not advertise logical block provisioning.
pub(crate) const VPD_PAGES: [u8; 6] = [0x00, 0x80, 0x83, 0x86, 0xb0, 0xb1];

/// Largest READ/WRITE/VERIFY transfer, in bytes (advertised in the Block
/// Limits VPD page as blocks). Bounds the work one command can demand.
pub(crate) const MAX_TRANSFER_BYTES: u32 = 16 << 20;
/// Largest WRITE SAME, in bytes of medium touched (advertised as MAXIMUM
/// WRITE SAME LENGTH). It runs on an I/O thread holding its block range
/// exclusively, so it bounds how long one command can hold both.
pub(crate) const MAX_WRITE_SAME_BYTES: u64 = 16 << 20;
/// COMPARE AND WRITE's NUMBER OF LOGICAL BLOCKS is one byte; we can do all of it.
pub(crate) const MAX_CAW_BLOCKS: u8 = 255;

pub(crate) use ramslog_common::cdb::opcode as opc;

/// One supported command: its CDB usage data (SPC-4 6.35.3: byte 0 is the
/// opcode, every other byte has a bit set for each bit we look at). A bit
/// outside the mask is reserved or unsupported (RDPROTECT, ANCHOR, NACA…)
/// and gets INVALID FIELD IN CDB pointing at it.
pub(crate) struct CmdInfo {
    pub usage: &'static [u8],
    /// Service action, for opcodes that have them.
    pub sa: Option<u8>,
}

const fn c(usage: &'static [u8]) -> CmdInfo {
    CmdInfo { usage, sa: None }
}
const fn s(sa: u8, usage: &'static [u8]) -> CmdInfo {
    CmdInfo {
        usage,
        sa: Some(sa),
    }
}

// DPO 0x10, FUA 0x08, FUA_NV 0x02 (SBC-3; libiscsi's Write*.Flags sends it).
const RW10: &[u8] = &[0, 0x1a, 0xff, 0xff, 0xff, 0xff, 0x1f, 0xff, 0xff, 0];
const RW12: &[u8] = &[
    0, 0x1a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0,
];
const RW16: &[u8] = &[
    0, 0x1a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x1f, 0,
];

macro_rules! with_op {
    ($op:expr, $b1:expr, $tmpl:expr) => {{
        const T: &[u8] = $tmpl;
        const N: usize = T.len();
        const A: [u8; N] = {
            let mut a = [0u8; N];
            let mut i = 0;
            while i < N {
                a[i] = T[i];
                i += 1;
            }
            a[0] = $op;
            a[1] = $b1;
            a
        };
        &A
    }};
}

/// Every command we implement, in opcode order (the order REPORT SUPPORTED
/// OPERATION CODES lists them).
// One command a row: its CDB usage mask reads across, as in SPC's tables.
#[rustfmt::skip]
pub(crate) static COMMANDS: &[CmdInfo] = &[
    c(&[opc::TEST_UNIT_READY, 0, 0, 0, 0, 0]),
    c(&[opc::REQUEST_SENSE, 0x01, 0, 0, 0xff, 0]),
    c(&[opc::READ6, 0x1f, 0xff, 0xff, 0xff, 0]),
    c(&[opc::WRITE6, 0x1f, 0xff, 0xff, 0xff, 0]),
    c(&[opc::INQUIRY, 0x01, 0xff, 0xff, 0xff, 0]),
    c(&[opc::MODE_SELECT6, 0x11, 0, 0, 0xff, 0]),
    c(&[opc::RESERVE6, 0, 0, 0, 0, 0]),
    c(&[opc::RELEASE6, 0, 0, 0, 0, 0]),
    c(&[opc::MODE_SENSE6, 0x08, 0xff, 0xff, 0xff, 0]),
    c(&[opc::START_STOP_UNIT, 0x01, 0, 0x0f, 0xf7, 0]),
    c(&[opc::READ_CAPACITY10, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0x01, 0]),
    c(with_op!(opc::READ10, 0x1a, RW10)),
    c(with_op!(opc::WRITE10, 0x1a, RW10)),
    c(with_op!(opc::WRITE_VERIFY10, 0x12, RW10)),
    c(with_op!(opc::VERIFY10, 0x16, RW10)),
    c(with_op!(opc::PRE_FETCH10, 0x02, RW10)),
    c(with_op!(opc::SYNC_CACHE10, 0x06, RW10)),
    c(with_op!(opc::WRITE_SAME10, 0x00, RW10)),
    c(&[opc::MODE_SELECT10, 0x11, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    c(&[opc::MODE_SENSE10, 0x18, 0xff, 0xff, 0, 0, 0, 0xff, 0xff, 0]),
    s(0, &[opc::PR_IN, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    s(1, &[opc::PR_IN, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    s(2, &[opc::PR_IN, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    s(3, &[opc::PR_IN, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    s(0, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    s(1, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    s(2, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    s(3, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    s(4, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    s(5, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    s(6, &[opc::PR_OUT, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0]),
    c(with_op!(opc::READ16, 0x1a, RW16)),
    c(&[opc::COMPARE_AND_WRITE, 0x1a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0xff, 0x1f, 0]),
    c(with_op!(opc::WRITE16, 0x1a, RW16)),
    c(with_op!(opc::WRITE_VERIFY16, 0x12, RW16)),
    c(with_op!(opc::VERIFY16, 0x16, RW16)),
    c(with_op!(opc::PRE_FETCH16, 0x02, RW16)),
    c(with_op!(opc::SYNC_CACHE16, 0x06, RW16)),
    c(with_op!(opc::WRITE_SAME16, 0x01, RW16)),
    s(opc::SA_READ_CAPACITY16, &[opc::SERVICE_ACTION_IN16, 0x1f, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0]),
    c(&[opc::REPORT_LUNS, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0]),
    s(opc::SA_REPORT_SUPPORTED_OPCODES, &[opc::MAINTENANCE_IN, 0x1f, 0x87, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0]),
    c(with_op!(opc::READ12, 0x1a, RW12)),
    c(with_op!(opc::WRITE12, 0x1a, RW12)),
    c(with_op!(opc::WRITE_VERIFY12, 0x12, RW12)),
    c(with_op!(opc::VERIFY12, 0x16, RW12)),
];

/// Opcodes whose second byte carries a service action.
pub(crate) fn has_service_actions(opcode: u8) -> bool {
    matches!(
        opcode,
        opc::PR_IN | opc::PR_OUT | opc::SERVICE_ACTION_IN16 | opc::MAINTENANCE_IN
    )
}

pub(crate) fn opcode_known(opcode: u8) -> bool {
    COMMANDS.iter().any(|c| c.usage[0] == opcode)
}

pub(crate) fn lookup(opcode: u8, sa: Option<u8>) -> Option<&'static CmdInfo> {
    COMMANDS.iter().find(|c| c.usage[0] == opcode && c.sa == sa)
}

/// The geometry decode needs; fixed for the life of a LU.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub blocks: u64,
    pub block_size: u32,
}

/// A decoded command. Small and Copy: it rides in the `Plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    TestUnitReady,
    RequestSense {
        desc: bool,
        alloc: u32,
    },
    Inquiry {
        evpd: bool,
        page: u8,
        alloc: u32,
    },
    ReportLuns {
        select: u8,
        alloc: u32,
    },
    StartStop {
        start: bool,
    },
    ReadCapacity10,
    ReadCapacity16 {
        alloc: u32,
    },
    Read {
        lba: u64,
        blocks: u32,
    },
    Write {
        lba: u64,
        blocks: u32,
    },
    WriteVerify {
        lba: u64,
        blocks: u32,
    },
    Verify {
        lba: u64,
        blocks: u32,
        bytchk: u8,
    },
    /// PRE-FETCH and SYNCHRONIZE CACHE: range-checked, then nothing to do
    /// (every acknowledged write already is in the LUN memory).
    NoData,
    WriteSame {
        lba: u64,
        blocks: u64,
        ndob: bool,
    },
    CompareAndWrite {
        lba: u64,
        blocks: u32,
    },
    ModeSense(ModeSenseReq),
    ModeSelect {
        ten: bool,
        len: u32,
    },
    PrIn {
        sa: u8,
        alloc: u32,
    },
    PrOut {
        sa: u8,
        scope: u8,
        ty: u8,
    },
    Reserve6,
    Release6,
    ReportOpcodes {
        rctd: bool,
        options: u8,
        opcode: u8,
        sa: u16,
        alloc: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ModeSenseReq {
    pub ten: bool,
    pub dbd: bool,
    pub llbaa: bool,
    pub pc: u8,
    pub page: u8,
    pub alloc: u32,
}

/// How a command interacts with reservations (SPC-4 table 47 / SBC-3 table 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Allowed whatever reservation exists.
    Free,
    /// Conflicts with exclusive-access reservations held by others.
    Read,
    /// Conflicts with every reservation type held by others.
    Write,
    /// PERSISTENT RESERVE OUT: judged by its own rules.
    PrOut,
    /// RESERVE(6)/RELEASE(6): judged by their own rules.
    Spc2,
}

impl Op {
    pub fn access(&self) -> Access {
        match self {
            Op::TestUnitReady
            | Op::RequestSense { .. }
            | Op::Inquiry { .. }
            | Op::ReportLuns { .. }
            | Op::ReadCapacity10
            | Op::ReadCapacity16 { .. }
            | Op::PrIn { .. }
            | Op::ReportOpcodes { .. }
            | Op::StartStop { start: true } => Access::Free,
            Op::Read { .. } | Op::Verify { .. } | Op::ModeSense(_) => Access::Read,
            Op::StartStop { start: false }
            | Op::Write { .. }
            | Op::WriteVerify { .. }
            | Op::NoData
            | Op::WriteSame { .. }
            | Op::CompareAndWrite { .. }
            | Op::ModeSelect { .. } => Access::Write,
            Op::PrOut { .. } => Access::PrOut,
            Op::Reserve6 | Op::Release6 => Access::Spc2,
        }
    }

    /// Commands a RESERVE(6) held by another I_T nexus lets through.
    pub fn spc2_allowed(&self) -> bool {
        matches!(
            self,
            Op::Inquiry { .. }
                | Op::ReportLuns { .. }
                | Op::RequestSense { .. }
                | Op::Release6
                | Op::ReportOpcodes { .. }
        )
    }

    /// Commands that touch (or report on) the medium and so fail while the
    /// LU waits for the admin to accept lost content.
    pub fn needs_medium(&self) -> bool {
        matches!(
            self,
            Op::TestUnitReady
                | Op::StartStop { start: true }
                | Op::ReadCapacity10
                | Op::ReadCapacity16 { .. }
                | Op::Read { .. }
                | Op::Write { .. }
                | Op::WriteVerify { .. }
                | Op::Verify { .. }
                | Op::NoData
                | Op::WriteSame { .. }
                | Op::CompareAndWrite { .. }
        )
    }
}

/// Commands that neither report nor clear a pending unit attention (SAM-5
/// 5.14: INQUIRY, REPORT LUNS; REQUEST SENSE returns it as data instead).
pub(crate) fn ua_exempt(opcode: u8) -> bool {
    matches!(opcode, opc::INQUIRY | opc::REPORT_LUNS | opc::REQUEST_SENSE)
}
