//! A volume's memory and kept-memory record in systemd's file descriptor
//! store, where a crash leaves them for the next start: what was pushed,
//! and what systemd confirmed. `status` and a planned restart's choice to
//! skip the dump go by the confirmation, never by a count of descriptors.

use std::sync::atomic::Ordering;

use super::{kept, naa_hex, Volume, Volumes};
use crate::systemd;

impl Volume {
    /// Put this volume's memory and its record into systemd's fd store
    /// (when there is one) under its NAA, instead of any held under
    /// `replacing` or its own NAA before, so that a crash keeps them for
    /// the next start. True when both were sent: they are held once a
    /// barrier after them returns ([`Self::confirm_in_fd_store`]).
    pub fn hold_in_fd_store(&self, replacing: Option<&str>) -> bool {
        if !systemd::has_holder() {
            return false;
        }
        let naa = naa_hex(&self.identity().0.naa);
        let replaced = replacing
            .into_iter()
            .chain([naa.as_str()])
            .try_for_each(|old| {
                systemd::remove(&format!("{}{old}", kept::MEMORY_PREFIX))?;
                systemd::remove(&format!("{}{old}", kept::RECORD_PREFIX)).map(drop)
            });
        // Removed: not in the store until pushed and confirmed again.
        self.in_fd_store.store(false, Ordering::SeqCst);
        self.report_push(replaced.and_then(|()| self.push_to_fd_store(&naa)))
    }

    /// Memory a planned restart handed over: its predecessor may have put it
    /// into the store already, or not (kept memory was off in that run, or
    /// its push failed). Pushed again without removing anything first:
    /// systemd keeps one copy of a descriptor it is given twice (it
    /// suppresses the duplicate), and nothing is ever out of the store
    /// meanwhile. True when both were sent.
    pub fn keep_in_fd_store(&self) -> bool {
        if !systemd::has_holder() {
            return false;
        }
        let naa = naa_hex(&self.identity().0.naa);
        self.report_push(self.push_to_fd_store(&naa))
    }

    /// Memory and record are in the store: a barrier after their push
    /// returned, or the store passed them to this start.
    pub fn confirm_in_fd_store(&self) {
        self.in_fd_store.store(true, Ordering::SeqCst);
    }

    /// Whether a crash now leaves this volume's memory in the store.
    pub fn in_fd_store(&self) -> bool {
        self.in_fd_store.load(Ordering::SeqCst)
    }

    fn push_to_fd_store(&self, naa: &str) -> std::io::Result<()> {
        let Some(record) = &self.record else {
            return Err(std::io::Error::other(
                "it has no kept-memory record to go with it",
            ));
        };
        systemd::store(
            &format!("{}{naa}", kept::MEMORY_PREFIX),
            self.store.memory(),
            true,
        )?;
        systemd::store(
            &format!("{}{naa}", kept::RECORD_PREFIX),
            record.memory(),
            true,
        )
        .map(drop)
    }

    fn report_push(&self, pushed: std::io::Result<()>) -> bool {
        match pushed {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(target = %self.target, lun = self.lun, "cannot put the LUN memory into the fd store ({e}): a crash will lose what no image has");
                false
            }
        }
    }
}

impl Volumes {
    /// The READY LUNs ("TARGET LUN n") whose memory systemd's fd store is
    /// not confirmed to hold: a crash (or a take-over) loses what no image
    /// has of them, so a restart dumps them first.
    pub fn not_held_in_fd_store(&self) -> Vec<String> {
        self.iter()
            .filter(|v| v.is_ready() && v.persistence().is_some() && !v.in_fd_store())
            .map(|v| format!("{} LUN {}", v.target(), v.lun()))
            .collect()
    }
}
