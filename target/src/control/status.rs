//! What `status` and `status --json` report: the schema, and each LU's line
//! built from its volume's facts.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::lifecycle::UnclaimedKept;
use crate::metrics::{LunIo, ProcessMemory};
use crate::volume::state::FailedStop;
use crate::volume::{naa_hex, VolumeFacts};

#[derive(Debug, Serialize, Deserialize)]
pub struct LunStatus {
    pub lun: u64,
    pub size: u64,
    pub block_size: u32,
    pub naa: String,
    pub serial: String,
    pub ready: bool,
    /// Why the LUN is NOT READY.
    #[serde(default)]
    pub not_ready_reason: Option<String>,
    /// What to do about it (never advice that throws away content that
    /// may still be had).
    #[serde(default)]
    pub not_ready_advice: Option<String>,
    #[serde(default)]
    pub generation: u64,
    /// The image the content was restored from at start.
    #[serde(default)]
    pub restored_from: Option<String>,
    /// When that image was taken (seconds since the epoch).
    #[serde(default)]
    pub restored_taken_unix: Option<u64>,
    /// For content taken over as kept memory: who wrote it before this
    /// process, and how that run ended.
    #[serde(default)]
    pub previous_writer: Option<PreviousWriter>,
    /// What the next dump writes (0 while the last clean image is current).
    #[serde(default)]
    pub written_bytes: u64,
    /// Commands, bytes, service times and errors since the daemon started.
    #[serde(default)]
    pub io: LunIo,
    /// Where the content comes from at the next start, by how this run ends.
    #[serde(default)]
    pub next_start: String,
    /// The LU's persistent reservations.
    #[serde(default)]
    pub persistent_reservations: PrStatus,
}

/// A LU's persistent reservations, as `status` shows them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PrStatus {
    pub registrations: usize,
    /// The reservation's type code (SPC-4 table: 1 write exclusive, 3
    /// exclusive access, 5/6 registrants only, 7/8 all registrants).
    pub reservation_type: Option<u8>,
    /// A host asked them to persist through power loss: the image carries
    /// them through a stop and a start.
    pub aptpl: bool,
}

/// The run whose kept memory a LUN took over at start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreviousWriter {
    pub pid: u32,
    pub ended: String,
}

/// Where a crash leaves the LUN memory, for `status`: by what systemd
/// confirmed it holds, LUN by LUN, not by whether there is a store.
pub(super) fn kept_memory_line(volumes: &crate::volume::Volumes) -> String {
    let mode = crate::systemd::kept_memory_mode();
    if !crate::systemd::has_holder() {
        return mode.into();
    }
    let missing = volumes.not_held_in_fd_store();
    if missing.is_empty() {
        mode.into()
    } else {
        format!(
            "held in systemd's fd store, except the memory of {} (not confirmed there): a crash \
             loses what no image has of it; a restart dumps first",
            missing.join(", ")
        )
    }
}

/// What `status` says of one LU: the volume's facts under the LUN it is
/// served as.
pub(super) fn lun_status(lun: u64, facts: &VolumeFacts) -> LunStatus {
    let st = &facts.status;
    let pr = &facts.reservations;
    LunStatus {
        lun,
        size: facts.size,
        block_size: facts.block_size,
        naa: naa_hex(&st.identity.naa),
        serial: st.identity.serial.clone(),
        ready: facts.is_ready(),
        not_ready_reason: st.not_ready_reason.clone(),
        not_ready_advice: facts.advice.map(str::to_string),
        generation: st.generation,
        restored_from: facts.restored_from(),
        restored_taken_unix: st.restored.as_ref().map(|r| r.taken_unix),
        previous_writer: st
            .restored
            .as_ref()
            .and_then(|r| r.kept_from.as_ref())
            .map(|k| PreviousWriter {
                pid: k.writer_pid,
                ended: k.ended.into(),
            }),
        written_bytes: st.written_bytes,
        io: facts.io.report(),
        next_start: facts.next_start.into(),
        persistent_reservations: PrStatus {
            registrations: pr.registrations.len(),
            reservation_type: pr.reservation.as_ref().map(|r| r.kind),
            aptpl: pr.aptpl,
        },
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TargetStatus {
    pub name: String,
    pub luns: Vec<LunStatus>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SessionStatus {
    pub initiator: String,
    pub isid: String,
    pub target: String,
    pub tsih: u16,
    pub peer: String,
}

/// Connections, refusals and limits of the portal.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct PortalStatus {
    pub tcp_connections: u32,
    /// RDMA connections of every front end (the name predates a second one
    /// and stays for scripts).
    pub iser_connections: u32,
    /// Open connections by front end (`iscsi`).
    #[serde(default)]
    pub front_end_connections: BTreeMap<String, u32>,
    pub staging_bytes: u64,
    pub logins_refused: BTreeMap<String, u64>,
    pub limit_hits: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Status {
    pub state_dir: Option<String>,
    pub targets: Vec<TargetStatus>,
    pub sessions: Vec<SessionStatus>,
    #[serde(default)]
    pub portal: PortalStatus,
    #[serde(default)]
    pub process: ProcessMemory,
    /// Random per executed program: a restart changes it, the pid stays.
    #[serde(default)]
    pub incarnation: u64,
    /// The last stop, if its dump failed (until a stop succeeds).
    #[serde(default)]
    pub failed_stop: Option<FailedStop>,
    /// Kept memory no configured LUN claims, held in systemd's fd store
    /// until `discard-kept` (or a start that configures its LUN again).
    #[serde(default)]
    pub unclaimed_kept: Vec<UnclaimedKept>,
    /// Where a crash or a restart leaves the LUN memory.
    #[serde(default)]
    pub kept_memory: String,
    /// The last planned restart of this program, if it failed after the
    /// fence (the new program could not be executed): it serves on.
    #[serde(default)]
    pub failed_restart: Option<FailedRestart>,
    /// Image bytes this program has written since it started (a dump's
    /// progress, which `restart --wait` watches).
    #[serde(default)]
    pub bytes_dumped: u64,
}

/// A planned restart that failed after the fence: the new program could
/// not be executed, and this one serves on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedRestart {
    /// How many restarts of this program failed so far.
    pub count: u64,
    pub at_unix: u64,
    pub reason: String,
}
