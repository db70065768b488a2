//! One volume's facts as an operator sees them, computed once for `status`,
//! `status --json` and `/metrics`: what it is, whether it serves and why
//! not, where its content came from, where a crash or restart leaves it,
//! and what was done with it.

use crate::metrics::LunTotals;

use super::kept::KeptReservations;
use super::{Remedy, Restored, Volume, VolumeStatus};

/// How `status` names content that is the memory a restart kept.
pub const KEPT_MEMORY: &str =
    "the memory kept from the previous run (a restart, or a crash under systemd)";

/// A volume's facts at one moment.
#[derive(Debug, Clone)]
pub struct VolumeFacts {
    pub size: u64,
    pub block_size: u32,
    /// Identity, readiness and its reason, generation, written bytes.
    pub status: VolumeStatus,
    /// What to do about a NOT READY volume (never advice that throws away
    /// content that may still be had); `None` while it is ready.
    pub advice: Option<&'static str>,
    /// Where the content comes from at the next start, by how this run ends.
    pub next_start: &'static str,
    /// Commands, bytes, service times and errors since the daemon started.
    pub io: LunTotals,
    /// The persistent reservations recorded beside the memory.
    pub reservations: KeptReservations,
}

impl VolumeFacts {
    pub fn is_ready(&self) -> bool {
        self.status.readiness == super::Readiness::Ready
    }

    /// Where the content was restored from at start: the image's path, or
    /// [`KEPT_MEMORY`].
    pub fn restored_from(&self) -> Option<String> {
        self.status
            .restored
            .as_ref()
            .map(|r: &Restored| match r.kept_from {
                Some(_) => KEPT_MEMORY.to_string(),
                None => r.image.display().to_string(),
            })
    }
}

impl Volume {
    /// Its facts now.
    pub fn facts(&self) -> VolumeFacts {
        let status = self.status();
        let ready = status.readiness == super::Readiness::Ready;
        VolumeFacts {
            size: self.size(),
            block_size: self.block_size(),
            advice: (!ready).then(|| status.remedy.unwrap_or(Remedy::AcceptEmpty).advice()),
            next_start: next_start(self.persistence().is_some(), ready, self.in_fd_store()),
            io: self.metrics().totals(),
            reservations: self.kept_reservations(),
            status,
        }
    }
}

/// [`VolumeFacts::next_start`] for a volume that is `ready` (or not), in a
/// daemon with or without a state directory and an fd store holding its
/// memory.
pub fn next_start(persistent: bool, ready: bool, store_holds_memory: bool) -> &'static str {
    match (persistent, ready, store_holds_memory) {
        (false, _, _) => "empty (--ephemeral keeps no content)",
        (true, false, _) => {
            "as now, unless it finds the doubt above gone; accept-empty makes it an empty LUN"
        }
        (true, true, true) => {
            "this memory after a restart or a crash (systemd's fd store holds it), the image after a stop"
        }
        (true, true, false) => {
            "this memory after a restart (handed over in the process), the image after a stop; \
             a crash loses the content (no fd store holds the memory)"
        }
    }
}
