//! One logical unit: its volume, geometry and the state every nexus shares
//! (unit attentions, reservations, task aborts) under one lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::admission::Transfers;
use crate::volume::{Volume, VolumeError};

use super::pr::PrState;
use super::ranges::RangeExclusion;
use super::vocab::Geometry;
use super::NexusId;

/// A nexus's entry in its LU's shared state.
pub(super) struct NexusEntry {
    pub(super) port: Arc<str>,
    /// Pending unit attentions, oldest first.
    pub(super) uas: Vec<(u8, u8)>,
    /// The abort epoch at which this nexus's tasks were last aborted by
    /// another nexus (PREEMPT AND ABORT, LOGICAL UNIT RESET): commands that
    /// arrived before it must not complete.
    pub(super) aborted_at: u64,
    pub(super) transfers: Arc<Transfers>,
    /// The transfers of the nexuses this one aborted, which its answer
    /// must wait for (taken by [`ScsiTarget::take_aborted_transfers`]).
    pub(super) aborted_by_it: Vec<Arc<Transfers>>,
}

pub(super) struct LuState {
    pub(super) nexuses: HashMap<NexusId, NexusEntry>,
    /// SPC-2 RESERVE(6) holder.
    pub(super) spc2: Option<NexusId>,
    pub(super) pr: PrState,
}

pub(super) const MAX_PENDING_UAS: usize = 16;
/// PERSISTENT RESERVE OUT service action PREEMPT AND ABORT.
pub(super) const PR_OUT_PREEMPT_AND_ABORT: u8 = 5;

impl LuState {
    pub(super) fn port(&self, nexus: NexusId) -> Arc<str> {
        self.nexuses
            .get(&nexus)
            .map_or_else(|| Arc::from(""), |n| n.port.clone())
    }

    fn raise_on(entry: &mut NexusEntry, code: (u8, u8)) {
        // A reset supersedes whatever was pending (SAM-5 6.3.2).
        if code.0 == 0x29 {
            entry.uas.clear();
        }
        if !entry.uas.contains(&code) && entry.uas.len() < MAX_PENDING_UAS {
            entry.uas.push(code);
        }
    }

    pub(super) fn raise_all(&mut self, code: (u8, u8)) {
        for n in self.nexuses.values_mut() {
            Self::raise_on(n, code);
        }
    }

    pub(super) fn raise_port(&mut self, port: &str, except: NexusId, code: (u8, u8)) {
        for (id, n) in self.nexuses.iter_mut() {
            if *id != except && &*n.port == port {
                Self::raise_on(n, code);
            }
        }
    }

    pub(super) fn pop_ua(&mut self, nexus: NexusId) -> Option<(u8, u8)> {
        let n = self.nexuses.get_mut(&nexus)?;
        (!n.uas.is_empty()).then(|| n.uas.remove(0))
    }

    fn needs_attention(&self) -> bool {
        self.spc2.is_some()
            || self.pr.reserved()
            || self.nexuses.values().any(|n| !n.uas.is_empty())
    }
}

/// One logical unit; shared by all sessions.
pub struct LogicalUnit {
    pub(super) lun: u64,
    pub(super) geo: Geometry,
    pub(super) volume: Arc<Volume>,
    /// Something in `state` may affect a command: take the slow path.
    pub(super) attention: AtomicBool,
    /// Bumped whenever tasks of some nexus are aborted from outside its
    /// session; a command compares it with its plan's copy, so the check
    /// costs one atomic load until an abort actually happens.
    pub(super) abort_epoch: AtomicU64,
    pub(super) state: Mutex<LuState>,
    /// Makes WRITE SAME, COMPARE AND WRITE and WRITE AND VERIFY atomic
    /// against each other where their blocks overlap.
    pub(super) exclusion: RangeExclusion,
    /// The previous run (a restart or a crash whose memory this LU took
    /// over) served other INQUIRY or VPD data: every nexus of this run is
    /// told INQUIRY DATA HAS CHANGED after its POWER ON.
    pub(super) inquiry_changed: bool,
}

impl std::fmt::Debug for LogicalUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogicalUnit")
            .field("lun", &self.lun)
            .field("block_size", &self.geo.block_size)
            .field("blocks", &self.geo.blocks)
            .finish()
    }
}

impl LogicalUnit {
    pub fn lun(&self) -> u64 {
        self.lun
    }
    pub fn block_size(&self) -> u32 {
        self.geo.block_size
    }
    /// Capacity in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.geo.blocks
    }

    pub fn volume(&self) -> &Arc<Volume> {
        &self.volume
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, LuState> {
        // A panic elsewhere must not wedge the LU: the state stays consistent
        // because every mutation completes before anything can panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Abort the tasks of the nexuses `which` selects: commands that arrived
    /// before now will see it through [`ScsiTarget::is_aborted`].
    /// The aborted nexuses' transfers are recorded for `by`, whose answer
    /// waits for them.
    pub(super) fn abort_tasks(
        &self,
        st: &mut LuState,
        by: NexusId,
        which: impl Fn(NexusId, &NexusEntry) -> bool,
    ) {
        let aborted = self.abort_tasks_of(st, which);
        if let Some(me) = st.nexuses.get_mut(&by) {
            me.aborted_by_it.extend(aborted);
        }
    }

    /// Abort the tasks of the nexuses `which` selects; returns their
    /// transfers, which an answer to the abort must wait for.
    pub(super) fn abort_tasks_of(
        &self,
        st: &mut LuState,
        which: impl Fn(NexusId, &NexusEntry) -> bool,
    ) -> Vec<Arc<Transfers>> {
        let epoch = self.abort_epoch.load(Ordering::SeqCst) + 1;
        let mut aborted = Vec::new();
        for (id, entry) in st.nexuses.iter_mut() {
            if which(*id, entry) {
                entry.aborted_at = epoch;
                aborted.push(entry.transfers.clone());
            }
        }
        if !aborted.is_empty() {
            // SeqCst: a placement that raised its count before this store is
            // waited for; one that raises it after sees the abort.
            self.abort_epoch.store(epoch, Ordering::SeqCst);
        }
        aborted
    }

    pub(super) fn refresh(&self, st: &LuState) {
        self.attention
            .store(st.needs_attention(), Ordering::Release);
    }

    pub(super) fn offset(&self, lba: u64) -> u64 {
        lba * u64::from(self.geo.block_size)
    }

    /// `blocks` from `lba` changed: see [`Volume::commit_write`]; an error
    /// means the command is not acknowledged.
    pub(super) fn commit_write(&self, lba: u64, blocks: u64) -> Result<(), VolumeError> {
        self.volume
            .commit_write(self.offset(lba), blocks * u64::from(self.geo.block_size))
    }
}
