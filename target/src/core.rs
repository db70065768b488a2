//! The core every front end stands on, as LIO's target_core and nvmet stand
//! on the block layer: the volumes and their persistence, the admission gate
//! and its counters, the staging budget, the limits no protocol owns, and the
//! export table that says under which front-end names each volume is served.
//!
//! The daemon builds one `Core` and hands it to every front end (iSCSI's
//! `Portal` holds an `Arc<Core>`), transport, lifecycle step and face
//! (`control`, `exposition`). Nothing here names a protocol: a front end
//! adds its own view (targets, ACLs, sessions) beside it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::admission::{ConnectionGate, ConnectionLimits, FrontEnd, StagingBudget, Transfers};
use crate::metrics::PortalCounters;
use crate::volume::{Identity, Volume, VolumeId, Volumes};

/// Limits every front end and transport obeys alike.
#[derive(Debug, Clone)]
pub struct CoreLimits {
    /// Bytes of write data all connections together may hold in staging
    /// buffers (data a command must see whole before it runs, such as SCSI
    /// parameter lists and compare data). Beyond it such commands are
    /// refused as busy.
    pub staging_budget: u64,
    /// A connection whose output (responses, read data) makes no progress
    /// this long is closed: its peer stopped reading.
    pub output_stall_timeout: Duration,
    /// How long a planned restart waits for connections to close before the
    /// exec: long enough for each to send its restart notice.
    pub restart_drain: Duration,
    pub connections: ConnectionLimits,
}

impl Default for CoreLimits {
    fn default() -> Self {
        CoreLimits {
            staging_budget: 128 << 20,
            output_stall_timeout: Duration::from_secs(30),
            restart_drain: Duration::from_millis(100),
            connections: ConnectionLimits::default(),
        }
    }
}

/// One name a volume is served under: iSCSI's target and LUN, or (later)
/// NVMe's subsystem and namespace id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    pub front_end: FrontEnd,
    /// The target IQN or subsystem NQN.
    pub owner: String,
    /// The LUN or namespace id.
    pub unit: u64,
}

/// Which names each volume is served under, indexed by [`VolumeId`].
#[derive(Debug, Default)]
pub struct Exports {
    by_volume: Vec<Vec<Export>>,
}

impl Exports {
    /// Record that `volume` is served as `export`.
    pub fn add(&mut self, volume: VolumeId, export: Export) {
        if self.by_volume.len() <= volume.index() {
            self.by_volume.resize_with(volume.index() + 1, Vec::new);
        }
        self.by_volume[volume.index()].push(export);
    }

    /// The names `volume` is served under, in the order they were added.
    pub fn of(&self, volume: VolumeId) -> &[Export] {
        self.by_volume
            .get(volume.index())
            .map_or(&[], |v| v.as_slice())
    }
}

pub struct Core {
    /// Every volume any front end serves: what the drivers resolve a
    /// [`VolumeId`] with.
    pub volumes: Arc<Volumes>,
    pub exports: Exports,
    /// Connection counts, shared by every front end and transport.
    pub gate: Arc<ConnectionGate>,
    /// Refused logins and limits hit.
    pub counters: Arc<PortalCounters>,
    /// Daemon-wide staging memory, shared by every connection.
    pub staging: StagingBudget,
    /// Measure each command's service time: two TSC reads per command, so
    /// only when someone asked for metrics (`--metrics`).
    pub service_times: bool,
    pub limits: CoreLimits,
}

impl Core {
    pub fn new(volumes: Arc<Volumes>, exports: Exports, limits: CoreLimits) -> Core {
        let gate = Arc::new(ConnectionGate::new(limits.connections));
        Core {
            volumes,
            exports,
            counters: gate.counters().clone(),
            gate,
            staging: StagingBudget::new(limits.staging_budget),
            service_times: false,
            limits,
        }
    }

    /// Every volume with the names it is served under, in [`VolumeId`]
    /// order.
    pub fn exported(&self) -> impl Iterator<Item = (&Arc<Volume>, &[Export])> {
        self.volumes.iter().map(|v| (v, self.exports.of(v.id())))
    }
}

/// What a volume operation asks of a front end that serves the volume.
pub trait VolumeHooks: Send + Sync {
    /// Abort every command of its hosts on `volume`; returns the transfers
    /// to wait for before the volume's memory may change under them.
    fn abort_volume(&self, volume: VolumeId) -> Vec<Arc<Transfers>>;
    /// Tell its hosts that `volume` is a new, empty device under a new
    /// identity (SCSI: unit attentions). Runs while the volume is not yet
    /// READY again.
    fn announce_new_identity(&self, volume: VolumeId);
}

/// What the faces (`status`, `/metrics`) show of a front end beside the
/// volumes.
pub trait FrontEndView: VolumeHooks {
    fn front_end(&self) -> FrontEnd;
    /// The owners it serves volumes under (targets), in configured order.
    fn owners(&self) -> Vec<String>;
    fn sessions(&self) -> Vec<SessionFacts>;
}

/// One session as the faces show it, in any front end's terms.
#[derive(Debug, Clone)]
pub struct SessionFacts {
    /// The host's name (the initiator's IQN).
    pub host: String,
    /// Which instance of the host (the ISID), in hex.
    pub instance: String,
    /// The owner it logged in to (the target); empty for discovery.
    pub owner: String,
    /// The handle the target gave it (the TSIH).
    pub handle: u16,
    pub peer: SocketAddr,
}

/// `accept-empty` on a NOT READY volume: every front end serving it aborts
/// its commands on it, their transfers are waited for (none of the old
/// identity's data may land on the empty device), the volume becomes empty
/// under `new`, and each front end announces the new identity before it is
/// READY. Blocking: call it off the async workers.
pub fn accept_empty(
    volume: &Volume,
    served_by: &[&dyn VolumeHooks],
    new: Identity,
) -> Result<(), String> {
    let (target, lun) = (volume.target(), volume.lun());
    if volume.is_ready() {
        return Err(format!(
            "{target} LUN {lun} is READY: its content is intact, nothing changed"
        ));
    }
    let aborted: Vec<Arc<Transfers>> = served_by
        .iter()
        .flat_map(|f| f.abort_volume(volume.id()))
        .collect();
    if !Transfers::wait_settled(&aborted) {
        return Err(format!(
            "{target} LUN {lun}: writes of the old identity are still in flight and their \
             connections did not end; nothing changed, try again"
        ));
    }
    volume.accept_empty(new, || {
        for f in served_by {
            f.announce_new_identity(volume.id());
        }
    })
}

/// What a front end advertises of a volume that hosts cache until they
/// scan it again (SCSI: the Block Limits VPD page): a planned restart must
/// not lower it. The hand-over report carries it under [`Self::key`], so a
/// running binary compares what a new one would advertise without knowing
/// the front end's types.
pub trait Advertised: Send + Sync {
    /// Its field in the hand-over report (`block_limits`).
    fn key(&self) -> &'static str;
    /// What an operator calls it ("Block Limits").
    fn name(&self) -> &'static str;
    /// What hosts are told of a volume of `block_size`-byte blocks.
    fn of(&self, block_size: u32) -> serde_json::Value;
    /// How `new` lowers `now`, named with both values, if it does; a value
    /// it cannot read counts as lowered.
    fn lowered(&self, now: &serde_json::Value, new: &serde_json::Value) -> Option<String>;
}
