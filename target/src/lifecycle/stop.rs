//! The way out: fence every volume, let connections drain (bounded), and
//! dump what changed; and a stop that arrives during start-up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::core::Core;
use crate::volume::{Volume, Volumes};

/// How long shutdown waits for connections to end before it dumps anyway
/// (the volumes are fenced either way: nothing more is acknowledged).
pub const CONNECTION_DRAIN: Duration = Duration::from_secs(10);

/// Why the daemon fences its volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A stop: every changed volume is dumped.
    Stop,
    /// A planned restart; `dump` unless the fd store holds the memory.
    Restart { dump: bool },
}

/// Shut down: refuse new connections, end every connection, fence every
/// volume, wait (bounded) for connections to go, then dump what changed
/// (a restart whose memory the fd store holds skips the dump). Returns a
/// summary, or the failures.
pub fn shutdown(core: &Core, ending: Ending) -> Result<String, String> {
    // Only a restart without a dump is quick enough to ask hosts back
    // sooner than their DefaultTime2Wait.
    // The gate's close ends every connection, each session with it: every
    // session's control is the one its connection's permit watches
    // (tests/gate_close_tcp.rs).
    let told = core.gate.close(ending == Ending::Restart { dump: false });
    let volumes: Vec<&Arc<Volume>> = core.volumes.iter().collect();
    for v in &volumes {
        v.fence();
    }
    tracing::info!(
        connections = told,
        "shutting down: logins refused, connections closing, volumes fenced"
    );
    let started = Instant::now();
    let drain = match ending {
        Ending::Stop | Ending::Restart { dump: true } => CONNECTION_DRAIN,
        // Commands get no status after the fence: this bounds how long the
        // connections take to send the hosts' notice and go (the exec
        // closes any left, before the new program runs).
        Ending::Restart { dump: false } => core.limits.restart_drain,
    };
    while core.gate.counts_now().total > 0 && started.elapsed() < drain {
        std::thread::sleep(Duration::from_millis(1));
    }
    let left = core.gate.counts_now().total;
    if left == 0 {
        report_pages_left_counted_in(&volumes);
    }
    if ending == (Ending::Restart { dump: false }) {
        tracing::info!(
            left,
            drained_ms = started.elapsed().as_millis() as u64,
            "restart: no dump, systemd's fd store holds the LUN memory"
        );
        if left > 0 {
            tracing::warn!(
                left,
                "connections still open after the restart drain ({drain:?}): the exec closes them,                  and their hosts may miss the notice to come back (they reconnect after their own                  timeouts); --restart-drain-ms sets the bound"
            );
        }
        return Ok(format!("{} LUNs fenced, not dumped", volumes.len()));
    }
    if left > 0 {
        tracing::warn!(left, "connections still open after {CONNECTION_DRAIN:?}; dumping anyway (nothing is acknowledged after the fence) and verifying each image, since data may still be arriving");
    }
    dump_each(volumes, left > 0)
}

/// Once every connection is gone no write is under way, so no page may be
/// counted in (`--verify-kept-memory`): one that is would never be checked
/// again. A defect if it happens: the test harness fails a test whose
/// daemon logs this line at its stop (`TargetProcess::stop`).
fn report_pages_left_counted_in(volumes: &[&Arc<Volume>]) {
    for v in volumes {
        let pages = v.pages_being_written();
        if pages > 0 {
            tracing::error!(
                target = %v.target(),
                lun = v.lun(),
                pages,
                "pages still counted in after every connection ended: their checksums are not kept (a defect)"
            );
        }
    }
}

/// A stop during start-up, once the start-up is through: every volume
/// fenced (none served yet) and dumped where it must be (memory taken over
/// from a previous run may be the only copy; a LUN whose restore the stop
/// cut short is NOT READY, its image untouched).
pub fn stop_in_start_up(volumes: &Volumes) -> Result<String, String> {
    for v in volumes.iter() {
        v.fence();
    }
    dump_each(volumes.iter(), false)
}

/// Dump each fenced volume; a summary, or the failures.
fn dump_each<'a>(
    volumes: impl IntoIterator<Item = &'a Arc<Volume>>,
    verify: bool,
) -> Result<String, String> {
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for v in volumes {
        match v.dump(verify) {
            Ok(msg) => done.push(msg),
            Err(msg) => {
                tracing::error!(target = %v.target(), lun = v.lun(), "{msg}");
                failed.push(msg);
            }
        }
    }
    if failed.is_empty() {
        Ok(done.join("; "))
    } else {
        Err(failed.join("; "))
    }
}
