//! The take-over rules, read from the successor's side: whether kept LUN
//! memory may be served, judged from facts alone (the record, the state
//! directory, where the memory came from, the configuration), so that every
//! branch can be shown in a table. Gathering the facts, and what the memory
//! needs once the rules allow it (its record area, its page checksums), is
//! `adopt_kept`'s. docs/restarts.md states the rules for the operator.

use crate::volume::kept::{ExitCause, KeptRecord, KeptState, Owner};
use crate::volume::{naa_hex, Identity};

/// Why a LUN's kept memory is not served, and what the LUN does instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Unkept {
    /// Its image decides, as on a start after a stop (no memory, or memory
    /// that is not this identity's current content).
    Image(String),
    /// NOT READY whatever the image says: the memory may be the only
    /// current copy, or the state directory is not the one it belongs to.
    /// It stays in the store for a start that finds the doubt gone.
    NotReady(String),
    /// NOT READY for one doubt only: its writer still runs. Once that
    /// writer ends, a start takes the memory over (`take-over`).
    WriterRunning(String),
    /// NOT READY, and no start will serve the memory: it was this LUN's
    /// content but can no longer be trusted (discarded while serving, or
    /// written by a process that died of a fault, with no image of its
    /// generation). accept-empty is the way back.
    Lost(String),
}

impl Unkept {
    pub(super) fn reason(&self) -> &str {
        match self {
            Unkept::Image(r) | Unkept::NotReady(r) | Unkept::WriterRunning(r) | Unkept::Lost(r) => {
                r
            }
        }
    }
}

/// Where the memory came from, as the rules see it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Came<'a> {
    /// A planned restart of this very process handed it over under `token`.
    Restart { token: u64 },
    /// systemd's fd store kept it: `writer` says whether the stored
    /// writers' pidfds and the unit's cgroup prove the last writer gone.
    Holder { writer: &'a Result<(), String> },
}

/// What the state directory says of the LUN, when it knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Known {
    pub identity: Identity,
    pub generation: u64,
    /// The generation's image was written by a clean stop.
    pub clean: bool,
}

/// Every fact the rules use.
#[derive(Debug, Clone)]
pub(super) struct Facts<'a> {
    pub came: Came<'a>,
    pub record: &'a KeptRecord,
    /// The fault its writer marked as it died.
    pub fault: Option<ExitCause>,
    /// This boot's and this process's.
    pub boot_id: &'a str,
    pub me: Owner,
    /// The record's owner (pid and start time) is still running.
    pub owner_running: bool,
    pub state: Option<Known>,
    /// The configured LUN size and block size.
    pub shape: (u64, u32),
    /// `--verify-kept-memory`.
    pub verify: bool,
    /// The inode of the memory passed beside the record.
    pub memory_inode: u64,
}

/// The rules hold: the memory is this LUN's content, of `generation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Allowed {
    pub generation: u64,
    /// Its writer died of a fault: every page must match the checksum the
    /// writer kept before it is served.
    pub check_every_page: bool,
}

/// Memory whose writer died of a fault and that cannot be vouched for:
/// the image decides if it holds this very generation, else nothing does.
pub(super) fn faulted(known: &Known, why: String) -> Unkept {
    if known.clean {
        Unkept::Image(why)
    } else {
        Unkept::Lost(format!(
            "{why}, and no image holds generation {}",
            known.generation
        ))
    }
}

/// The take-over rules, in the order a reader applies them: the record's
/// state against where the memory came from, the boot, the single writer,
/// the state directory's knowledge and identity, the shape, the
/// generation, the exit cause, and the binding of record and memory.
pub(super) fn decide(f: &Facts) -> Result<Allowed, Unkept> {
    let r = f.record;
    let image = Unkept::Image;
    match (f.came, &r.state) {
        (
            Came::Restart { token },
            KeptState::HandedOver {
                token: t,
                ready: true,
            },
        ) if *t == token => {}
        (Came::Restart { .. }, other) => {
            return Err(image(format!(
                "its record says {other:?}, not handed over by this restart"
            )))
        }
        (Came::Holder { .. }, KeptState::Valid | KeptState::HandedOver { ready: true, .. }) => {}
        (Came::Holder { .. }, KeptState::Discarded { reason }) => {
            return Err(Unkept::Lost(format!("its memory was discarded: {reason}")))
        }
        (Came::Holder { .. }, other) => {
            return Err(image(format!(
                "its record says {other:?}: the memory is not this LUN's content"
            )))
        }
    }
    if r.boot_id != f.boot_id {
        return Err(image("it was written before this boot".into()));
    }
    match f.came {
        Came::Restart { .. } => {
            if (r.owner.pid, r.owner.start_time) != (f.me.pid, f.me.start_time) {
                return Err(image(format!(
                    "its writer was process {}, not this one",
                    r.owner.pid
                )));
            }
        }
        Came::Holder { writer } => {
            if let Err(why) = writer {
                return Err(Unkept::NotReady(why.clone()));
            }
            if f.owner_running {
                return Err(Unkept::NotReady(format!(
                    "its writer, process {}, is still running",
                    r.owner.pid
                )));
            }
        }
    }
    // Only a LUN the state knows: recalling an unknown one would give it a
    // new identity.
    let Some(known) = &f.state else {
        return Err(Unkept::NotReady(
            "kept memory names this LUN but the state directory does not know it: is it the right state directory?".into(),
        ));
    };
    let naa = naa_hex(&known.identity.naa);
    if r.naa != naa || r.serial != known.identity.serial {
        return Err(image(format!(
            "it holds naa.{}, the state directory names naa.{naa}",
            r.naa
        )));
    }
    let (size, block_size) = f.shape;
    if (r.lun_bytes, r.block_size) != (size, block_size) {
        // This identity's content, in a shape the configuration no longer
        // gives: kept in the store for the configuration put back.
        return Err(Unkept::NotReady(format!(
            "its kept memory holds {} bytes of {}-byte blocks, the configuration says {size} of \
             {block_size}: put the configuration back (the memory is kept) or run accept-empty",
            r.lun_bytes, r.block_size
        )));
    }
    // The record names a bump before the state makes it durable: a state
    // at that bump means the bump happened; one behind the record means
    // the state directory went back in time.
    let generation = known.generation;
    let current = match r.pending_generation {
        None if r.generation == generation => true,
        Some(next) if next == generation && generation == r.generation + 1 => true,
        _ if r.generation > generation || r.pending_generation > Some(generation + 1) => {
            return Err(Unkept::NotReady(format!(
                "it is generation {} (pending {:?}), ahead of the state directory's {generation}: \
                 the state directory went back",
                r.generation, r.pending_generation
            )))
        }
        _ => false,
    };
    if !current {
        return Err(image(format!(
            "it is generation {} (pending {:?}), the state directory's is {generation}",
            r.generation, r.pending_generation
        )));
    }
    // A writer that died of a fault may have written anywhere: its memory
    // is served only if every page still matches the checksum its writer
    // kept (`--verify-kept-memory`, checked once the memory is mapped).
    if let Some(cause) = f.fault {
        if !(f.verify && r.page_crcs) {
            let unchecked = if f.verify {
                " (its run kept no page checksums to check it against)"
            } else {
                " (--verify-kept-memory is off)"
            };
            return Err(faulted(
                known,
                format!(
                    "its writer died of {cause}: the memory may hold bytes nobody wrote{unchecked}"
                ),
            ));
        }
    }
    if matches!(f.came, Came::Holder { .. })
        && (r.memfd_inode == 0 || r.memfd_inode != f.memory_inode)
    {
        return Err(Unkept::NotReady(format!(
            "its record names memfd inode {}, the memory passed is inode {}",
            r.memfd_inode, f.memory_inode
        )));
    }
    Ok(Allowed {
        generation,
        check_every_page: f.fault.is_some(),
    })
}

#[cfg(test)]
mod tests;
