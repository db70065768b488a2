//! The one SBC-3/SPC-4 device: every LU of one target. It knows nothing of
//! how PDUs travel (TCP or iSER), but it is iSCSI's SCSI: a nexus is an
//! iSCSI session, and persistent reservations key on the iSCSI initiator
//! port name (TransportID format 01b, [`Nexus::initiator_port`]).
//!
//! Two phases per command. `prepare` decodes and validates the CDB and
//! answers everything that can be answered before data moves (unit
//! attention, NOT READY, reservation conflicts, bad fields, LBA range), and
//! says how much data flows and where. `execute` runs after the Data-Out
//! arrived. Plain READ/WRITE never allocate or lock here: when nothing is
//! pending on a LU (no unit attention, reservation or readiness problem) an
//! atomic flag lets `prepare` skip the state mutex, and the data itself is
//! copied between the transport and the store by the engine.
//!
//! Atomicity: COMPARE AND WRITE holds its block range (`ranges::RangeExclusion`),
//! which every write done *here* (WRITE SAME, WRITE AND VERIFY, COMPARE AND
//! WRITE) also takes where their blocks overlap.
//! Plain WRITEs are copied into the store by the engine without it, so a
//! plain WRITE racing a COMPARE AND WRITE to the same blocks may interleave;
//! SBC allows no such assumption for initiators anyway unless they use CAW
//! for every access to those blocks.

mod lu;
pub use lu::LogicalUnit;
mod cdb;
mod execute;
mod inquiry;
mod mode;
mod opcodes;
mod pr;
mod ranges;
mod sense;
#[cfg(test)]
mod tests;
mod vocab;

use lu::{LuState, NexusEntry, PR_OUT_PREEMPT_AND_ABORT};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ramslog_common::scsi_wire::FieldPointer;

use crate::admission::Transfers;
use crate::core::VolumeHooks;
use crate::metrics::CommandKind;
use crate::volume::{Identity, PlacingWrite, Readiness, Volume, VolumeError, VolumeId};
use pr::PrState;
use ranges::RangeExclusion;
use vocab::{opc, Geometry, Op};

/// Whether persistent reservations a kept-memory record carries are a
/// state this LU could have made; why not, if not.
pub fn check_kept_reservations(kept: &crate::volume::kept::KeptReservations) -> Result<(), String> {
    PrState::from_kept(kept).map(drop)
}

/// What a command with this operation code does, for counting.
pub fn command_kind(opcode: u8) -> CommandKind {
    match opcode {
        opc::READ6 | opc::READ10 | opc::READ12 | opc::READ16 => CommandKind::Read,
        opc::WRITE6
        | opc::WRITE10
        | opc::WRITE12
        | opc::WRITE16
        | opc::WRITE_VERIFY10
        | opc::WRITE_VERIFY12
        | opc::WRITE_VERIFY16
        | opc::WRITE_SAME10
        | opc::WRITE_SAME16
        | opc::COMPARE_AND_WRITE => CommandKind::Write,
        opc::SYNC_CACHE10 | opc::SYNC_CACHE16 => CommandKind::Flush,
        _ => CommandKind::Other,
    }
}
pub use inquiry::{block_limits, BlockLimits, BlockLimitsAdvertised};
pub use sense::SenseReason;

#[cfg(test)]
thread_local! {
    /// LUN → LU searches on this thread, for the tests that hold the I/O
    /// path to one per command.
    static LU_LOOKUPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// LUN → LU searches made on this thread so far.
#[cfg(test)]
pub fn lu_lookups() -> u64 {
    LU_LOOKUPS.with(|n| n.get())
}

/// How a command ends without GOOD status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The status (and sense) `SenseReason` names.
    Status(SenseReason),
    /// The volume was fenced for shutdown after the command's data landed:
    /// no status at all. The front end ends the connection, so the host
    /// retries the command against the next run.
    Fenced,
}

impl From<SenseReason> for Failure {
    fn from(reason: SenseReason) -> Failure {
        Failure::Status(reason)
    }
}

impl From<VolumeError> for Failure {
    fn from(e: VolumeError) -> Failure {
        match e {
            VolumeError::Fenced => Failure::Fenced,
            VolumeError::NotReady => Failure::Status(SenseReason::NotReadyManualIntervention),
        }
    }
}

/// One I_T nexus (an iSCSI session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NexusId(pub u32);

/// A newly logged-in session, as the SCSI layer needs to know it.
#[derive(Clone)]
pub struct Nexus {
    pub id: NexusId,
    pub initiator_name: String,
    pub isid: [u8; 6],
    /// Its transfers into LUN memory: what an abort must wait for.
    pub transfers: Arc<Transfers>,
}

impl Nexus {
    /// The iSCSI initiator port name (RFC 7143 / SPC-4 TransportID format 01b):
    /// persistent reservations belong to this, not to the session.
    pub fn initiator_port(&self) -> String {
        let mut s = format!("{},i,0x", self.initiator_name);
        for b in self.isid {
            let _ = write!(s, "{b:02x}");
        }
        s
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetScope {
    /// LOGICAL UNIT RESET of one LUN.
    Lu(u64),
    /// TARGET WARM RESET: every LU.
    Target,
}

/// Where Data-Out goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutPlacement {
    None,
    /// Plain WRITE: the engine copies Data-Out byte `i` to byte
    /// `offset + i` of `volume` (checked to be inside it).
    Store {
        volume: VolumeId,
        offset: u64,
    },
    /// Everything else with Data-Out: the engine gathers it and passes it
    /// to `execute`.
    Buffer,
}

/// Where Data-In comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataIn {
    None,
    /// READ: `len` bytes of `volume` from `offset` (checked to be inside it).
    Store {
        volume: VolumeId,
        offset: u64,
        len: u32,
    },
    /// The first `len` bytes of the caller's `data_in` buffer (already cut
    /// to the allocation length).
    Buffer {
        len: u32,
    },
}

/// The result of phase 1. Copy and small: the engine keeps it in its task slot.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub lun: u64,
    /// Where the LU sits in its target ([`ScsiTarget::lu_of`]); `None` for
    /// a LUN with no LU. Found once, when the command is prepared: the
    /// rest of the command indexes, it never looks the LUN up again.
    lu_index: Option<usize>,
    /// Data-Out bytes the CDB demands (blocks × block size, or the
    /// parameter list length).
    pub data_out_len: u32,
    /// Most Data-In bytes the command returns (transfer length or
    /// allocation length); the command may return fewer.
    pub data_in_len: u32,
    pub out_placement: OutPlacement,
    op: Op,
    exact_out: bool,
    /// The LU's abort epoch when the command arrived (see `is_aborted`).
    abort_epoch: u64,
}

impl Plan {
    /// Check the initiator's Expected Data Transfer Length (of the write
    /// direction: 0 when the W bit is clear) against what the CDB demands.
    ///
    /// - COMPARE AND WRITE and WRITE SAME (data-out that is not "as much as
    ///   you like"): INVALID FIELD IN CDB. libiscsi's CompareAndWrite tests
    ///   depend on this: CAW of 256 blocks wraps the one-byte NUMBER OF
    ///   LOGICAL BLOCKS to 0 and must still fail.
    /// - The other commands that write or compare blocks (WRITE, WRITE AND
    ///   VERIFY, VERIFY with BYTCHK): INVALID FIELD IN COMMAND INFORMATION
    ///   UNIT, under- or overflow, as LIO's `target_cmd_size_check`. Taking
    ///   part of such a write and answering GOOD would acknowledge blocks
    ///   that were never written.
    /// - Parameter lists: a mismatch is an ordinary residual.
    pub fn check_expected_len(&self, edtl: u32) -> Result<(), SenseReason> {
        if edtl == self.data_out_len {
            return Ok(());
        }
        if self.exact_out {
            let byte = match self.op {
                Op::CompareAndWrite { .. } => 13,
                _ => 0,
            };
            return Err(SenseReason::InvalidFieldInCdb(FieldPointer::cdb(byte)));
        }
        match self.op {
            Op::Write { .. } | Op::WriteVerify { .. } => Err(SenseReason::InvalidFieldInCommandIu),
            Op::Verify { bytchk, .. } if bytchk != 0 => Err(SenseReason::InvalidFieldInCommandIu),
            _ => Ok(()),
        }
    }

    /// True for READ(6/10/12/16).
    pub fn is_read(&self) -> bool {
        matches!(self.op, Op::Read { .. })
    }

    /// True for plain WRITE(6/10/12/16).
    pub fn is_write(&self) -> bool {
        matches!(self.op, Op::Write { .. })
    }

    /// PERSISTENT RESERVE OUT, PREEMPT AND ABORT: its status waits for the
    /// aborted tasks' transfers.
    pub fn aborts_tasks(&self) -> bool {
        matches!(self.op, Op::PrOut { sa, .. } if sa == PR_OUT_PREEMPT_AND_ABORT)
    }
}

/// Configuration errors `ScsiTarget::try_new` reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("LUN {lun}: block size {size} is not 512 or 4096")]
    BlockSize { lun: u64, size: u32 },
    #[error("LUN {0} is configured twice")]
    DuplicateLun(u64),
    #[error("LUN {0} is larger than 16383, which this target cannot address")]
    LunTooLarge(u64),
}

/// The LUs of one iSCSI target.
#[derive(Debug)]
pub struct ScsiTarget {
    lus: Vec<Arc<LogicalUnit>>,
}

impl ScsiTarget {
    /// Panics on an invalid configuration; see `try_new`.
    pub fn new(volumes: Vec<Arc<Volume>>) -> Self {
        match Self::try_new(volumes) {
            Ok(t) => t,
            Err(e) => panic!("invalid SCSI target configuration: {e}"),
        }
    }

    pub fn try_new(volumes: Vec<Arc<Volume>>) -> Result<Self, ConfigError> {
        let mut out: Vec<Arc<LogicalUnit>> = Vec::with_capacity(volumes.len());
        for volume in volumes {
            let (lun, block_size) = (volume.lun(), volume.block_size());
            if !matches!(block_size, 512 | 4096) {
                return Err(ConfigError::BlockSize {
                    lun,
                    size: block_size,
                });
            }
            if ramslog_common::lun::Lun::new(lun).is_none() {
                return Err(ConfigError::LunTooLarge(lun));
            }
            if out.iter().any(|l| l.lun == lun) {
                return Err(ConfigError::DuplicateLun(lun));
            }
            // A predecessor's reservations, checked when its memory was
            // taken over (`check_kept_reservations`).
            let pr = PrState::from_kept(&volume.kept_reservations()).unwrap_or_else(|why| {
                tracing::error!(target = %volume.target(), lun, "persistent reservations not taken over: {why}");
                PrState::default()
            });
            let st = LuState {
                nexuses: HashMap::new(),
                spc2: None,
                pr,
            };
            let geo = Geometry {
                blocks: volume.size() / u64::from(block_size),
                block_size,
            };
            let digest = inquiry::digest(geo);
            let inquiry_changed = match volume.keep_inquiry(digest) {
                Some(before) if before != digest => {
                    tracing::info!(
                        target = %volume.target(),
                        lun,
                        "INQUIRY or VPD data differ from the previous run's: hosts are told INQUIRY DATA HAS CHANGED"
                    );
                    true
                }
                _ => false,
            };
            let lu = LogicalUnit {
                lun,
                geo,
                volume,
                attention: AtomicBool::new(false),
                abort_epoch: AtomicU64::new(0),
                state: Mutex::new(st),
                exclusion: RangeExclusion::default(),
                inquiry_changed,
            };
            lu.refresh(&lu.lock());
            out.push(Arc::new(lu));
        }
        out.sort_by_key(|l| l.lun);
        Ok(ScsiTarget { lus: out })
    }

    /// The LU of `lun`, for the control plane. The I/O path searches once
    /// per command, with [`Self::lu_index`].
    pub fn lu(&self, lun: u64) -> Option<&Arc<LogicalUnit>> {
        self.lu_index(lun).map(|i| &self.lus[i])
    }

    /// Where `lun`'s LU sits in this target (in `luns` order): the
    /// one search a command makes. [`Self::prepare`] takes it, and the
    /// command's later steps index with [`Self::lu_of`].
    #[inline]
    pub fn lu_index(&self, lun: u64) -> Option<usize> {
        #[cfg(test)]
        LU_LOOKUPS.with(|n| n.set(n.get() + 1));
        self.lus.iter().position(|l| l.lun == lun)
    }

    /// The LU a prepared command addresses, by index.
    #[inline]
    pub fn lu_of(&self, plan: &Plan) -> Option<&Arc<LogicalUnit>> {
        self.lus.get(plan.lu_index?)
    }

    pub(crate) fn luns(&self) -> impl Iterator<Item = &Arc<LogicalUnit>> {
        self.lus.iter()
    }

    /// Logical block size of `lun`; 512 for a LUN with no LU, so callers
    /// can divide by it unconditionally.
    pub fn block_size(&self, lun: u64) -> u32 {
        self.lu(lun).map_or(512, |l| l.geo.block_size)
    }

    /// A session logged in. Each LU owes it a POWER ON, RESET, OR BUS DEVICE
    /// RESET OCCURRED unit attention, which initiators (libiscsi, Linux,
    /// illumos) clear with their first TEST UNIT READY.
    pub fn attach(&self, nexus: &Nexus) {
        let port: Arc<str> = Arc::from(nexus.initiator_port());
        for lu in &self.lus {
            let mut uas = vec![sense::ua::POWER_ON_RESET];
            if lu.inquiry_changed {
                uas.push(sense::ua::INQUIRY_DATA_CHANGED);
            }
            let mut st = lu.lock();
            st.nexuses.insert(
                nexus.id,
                NexusEntry {
                    port: port.clone(),
                    uas,
                    aborted_at: 0,
                    transfers: nexus.transfers.clone(),
                    aborted_by_it: Vec::new(),
                },
            );
            lu.refresh(&st);
        }
    }

    /// I_T nexus loss (logout, connection drop, session reinstatement): drop
    /// its RESERVE(6) and pending unit attentions. Persistent reservation
    /// registrations stay: they belong to the initiator port.
    pub fn detach(&self, nexus: NexusId) {
        for lu in &self.lus {
            let mut st = lu.lock();
            st.nexuses.remove(&nexus);
            if st.spc2 == Some(nexus) {
                st.spc2 = None;
            }
            lu.refresh(&st);
        }
    }

    /// LOGICAL UNIT RESET / TARGET WARM RESET: drop RESERVE(6) reservations
    /// and raise BUS DEVICE RESET FUNCTION OCCURRED (29h/03h) on every I_T
    /// nexus, the issuing one included (SAM-5 6.3; libiscsi's
    /// MultipathIO.Reset checks that every path sees it). Persistent
    /// reservations are unaffected. Other sessions' tasks are aborted through
    /// [`Self::is_aborted`]; the issuing session aborts its own.
    pub fn reset(&self, scope: ResetScope, by: NexusId) {
        for lu in &self.lus {
            if let ResetScope::Lu(lun) = scope {
                if lu.lun != lun {
                    continue;
                }
            }
            let mut st = lu.lock();
            st.spc2 = None;
            // Every task set of the LU is aborted (SAM-5 6.3); the issuing
            // session aborts its own tasks itself.
            lu.abort_tasks(&mut st, by, |id, _| id != by);
            st.raise_all(sense::ua::BUS_DEVICE_RESET);
            lu.refresh(&st);
        }
    }

    /// The admin accepted that `lun` lost its content: the volume
    /// operation [`crate::core::accept_empty`] with this target as the one
    /// front end serving it (the daemon asks every front end instead).
    /// For the tests that drive one target without a daemon.
    #[cfg(test)]
    pub(crate) fn accept_empty(&self, lun: u64, new: Identity) -> Result<(), String> {
        let Some(lu) = self.lu(lun) else {
            return Err(format!("no LUN {lun}"));
        };
        crate::core::accept_empty(&lu.volume, &[self], new)
    }

    /// The LU standing on `volume`, if this target has one.
    fn lu_on(&self, volume: VolumeId) -> Option<&Arc<LogicalUnit>> {
        self.lus.iter().find(|lu| lu.volume.id() == volume)
    }

    pub fn identity(&self, lun: u64) -> Option<(Identity, Readiness)> {
        Some(self.lu(lun)?.volume.identity())
    }

    /// The transfers of every nexus that `by` aborted tasks of since the
    /// last call: its answer (TMF response, PREEMPT AND ABORT's status) waits
    /// until each is [settled](Transfers::settled).
    pub fn take_aborted_transfers(&self, by: NexusId) -> Vec<Arc<Transfers>> {
        let mut all = Vec::new();
        for lu in &self.lus {
            let mut st = lu.lock();
            if let Some(me) = st.nexuses.get_mut(&by) {
                all.append(&mut me.aborted_by_it);
            }
        }
        all
    }

    /// Whether the command of `plan` was aborted from outside its session
    /// (PREEMPT AND ABORT, a reset by another nexus) after it arrived: it
    /// must then place no more data and complete with no status.
    pub fn is_aborted(&self, nexus: NexusId, plan: &Plan) -> bool {
        let Some(lu) = self.lu_of(plan) else {
            return false;
        };
        if lu.abort_epoch.load(Ordering::SeqCst) == plan.abort_epoch {
            return false;
        }
        lu.lock()
            .nexuses
            .get(&nexus)
            .is_some_and(|e| e.aborted_at > plan.abort_epoch)
    }

    /// A prepared command is about to place its data straight into the
    /// volume's memory (see [`Volume::will_write`]): the guard goes with
    /// the command and is dropped when it ends, however it ends.
    pub fn will_place(&self, plan: &Plan) -> PlacingWrite {
        match (plan.out_placement, self.lu_of(plan)) {
            (OutPlacement::Store { offset, .. }, Some(lu)) => {
                lu.volume.will_write(offset, u64::from(plan.data_out_len))
            }
            _ => PlacingWrite::NONE,
        }
    }

    /// Phase 1: decode and validate; see the module docs.
    /// `lu_index` is [`Self::lu_index`] of `lun`.
    #[inline]
    pub fn prepare(
        &self,
        nexus: NexusId,
        lun: u64,
        lu_index: Option<usize>,
        cdb: &[u8],
    ) -> Result<Plan, SenseReason> {
        let Some((index, lu)) =
            lu_index.and_then(|i| Some((i, self.lus.get(i).filter(|lu| lu.lun == lun)?)))
        else {
            return prepare_absent(lun, cdb);
        };
        let at = Some((index, lu.volume.id()));
        let epoch = lu.abort_epoch.load(Ordering::Acquire);
        let planned = |d| plan(lun, at, d, epoch);
        if !lu.attention.load(Ordering::Acquire) && lu.volume.is_ready() {
            return Ok(planned(cdb::decode(cdb, lu.geo)?));
        }
        let mut st = lu.lock();
        let opcode = cdb.first().copied().unwrap_or(0xff);
        if !vocab::ua_exempt(opcode) {
            if let Some((asc, ascq)) = st.pop_ua(nexus) {
                lu.refresh(&st);
                return Err(SenseReason::UnitAttention { asc, ascq });
            }
        }
        let d = cdb::decode(cdb, lu.geo)?;
        if !lu.volume.is_ready() && d.op.needs_medium() {
            return Err(SenseReason::NotReadyManualIntervention);
        }
        if matches!(st.spc2, Some(h) if h != nexus) && !d.op.spc2_allowed() {
            return Err(SenseReason::ReservationConflict);
        }
        if st.pr.conflicts(&st.port(nexus), d.op.access()) {
            return Err(SenseReason::ReservationConflict);
        }
        Ok(planned(d))
    }
}

/// The SCSI part of a volume operation: the old identity's tasks aborted,
/// and the new one announced with unit attentions.
impl VolumeHooks for ScsiTarget {
    fn abort_volume(&self, volume: VolumeId) -> Vec<Arc<Transfers>> {
        let Some(lu) = self.lu_on(volume) else {
            return Vec::new();
        };
        let mut st = lu.lock();
        lu.abort_tasks_of(&mut st, |_, _| true)
    }

    fn announce_new_identity(&self, volume: VolumeId) {
        let Some(lu) = self.lu_on(volume) else {
            return;
        };
        let mut st = lu.lock();
        // A new, empty device: the old identity's reservations go too (the
        // volume dropped them from its record already, and refuses every
        // change to them until this is done).
        st.pr = PrState::default();
        st.raise_all(sense::ua::INQUIRY_DATA_CHANGED);
        st.raise_all(sense::ua::REPORTED_LUNS_CHANGED);
        lu.refresh(&st);
    }
}

/// `at`: the LU's index and its volume, `None` for a LUN with no LU.
fn plan(lun: u64, at: Option<(usize, VolumeId)>, d: cdb::Decoded, abort_epoch: u64) -> Plan {
    let out_placement = match (d.out_to_store, at) {
        (Some(offset), Some((_, volume))) => OutPlacement::Store { volume, offset },
        _ if d.data_out_len > 0 => OutPlacement::Buffer,
        _ => OutPlacement::None,
    };
    Plan {
        lun,
        lu_index: at.map(|(index, _)| index),
        data_out_len: d.data_out_len,
        data_in_len: d.data_in_len,
        out_placement,
        op: d.op,
        exact_out: d.exact_out,
        abort_epoch,
    }
}

/// A LUN with no LU behind it: INQUIRY (peripheral qualifier 011b), REPORT
/// LUNS and REQUEST SENSE work; anything else is LOGICAL UNIT NOT SUPPORTED.
fn prepare_absent(lun: u64, cdb: &[u8]) -> Result<Plan, SenseReason> {
    match cdb.first() {
        Some(&(opc::INQUIRY | opc::REPORT_LUNS | opc::REQUEST_SENSE)) => {
            let geo = Geometry {
                blocks: 0,
                block_size: 512,
            };
            Ok(plan(lun, None, cdb::decode(cdb, geo)?, 0))
        }
        _ => Err(SenseReason::LuNotSupported),
    }
}
