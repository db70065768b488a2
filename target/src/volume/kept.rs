//! The kept-memory record: what a process that is handed a LUN's memory (a
//! restart's successor, or the start after a crash under systemd) must know
//! before it may serve that memory as the LUN's current content.
//!
//! The record lives in its own small memory area beside the LUN's memfd, as
//! two slots of [`SLOT_BYTES`]. A write goes to the slot that does not hold
//! the newest valid record, with the next sequence number, and carries a
//! CRC32C over its header and body; a reader takes the valid slot with the
//! highest sequence number. A write torn by a crash therefore leaves the
//! previous record in force. Writers lower trust before an act and raise it
//! after (RESTORING before a restore, VALID after it), so falling back to
//! the older slot is never more permissive than the truth.
//!
//! The newest checksummed slot decides: if this binary cannot read it (a
//! format it does not know, a body that does not parse), the answer is an
//! error, which the caller turns into NOT READY, never a fall-back to the
//! older slot (an older writer's record) and never a panic.
//!
//! The last [`FAULT_BYTES`] of slot 0 are no record's: they hold the fault
//! mark, which a panic or a fault signal of the writer sets as it dies
//! ([`crate::store::install_fault_handlers`]). It sits outside the
//! checksummed slots because a signal handler can only store two words.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::store::{HugePages, Store, StoreError};

/// The record format this binary writes and reads.
pub const FORMAT: u32 = 1;

/// Bytes of one slot; the area is two of them.
pub const SLOT_BYTES: usize = 128 << 10;

/// Bytes of the whole record area.
pub const AREA_BYTES: usize = 2 * SLOT_BYTES;

const MAGIC: [u8; 8] = *b"RSLOGKPT";

/// The names in systemd's fd store: a LUN's memory and its record, each
/// followed by the LUN's NAA in hex.
pub const MEMORY_PREFIX: &str = "lun-";
pub const RECORD_PREFIX: &str = "rec-";
/// magic, sequence, body length, CRC32C.
const HEADER: usize = 8 + 8 + 4 + 4;

/// The fault mark: [`crate::store::FAULT_MARK`] and the cause, at the end
/// of slot 0 (no record reaches it).
pub const FAULT_BYTES: usize = 16;
pub const FAULT_AT: usize = SLOT_BYTES - FAULT_BYTES;

/// What the memory holds, as far as its last writer knew.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeptState {
    /// Being zeroed for a new identity (accept-empty): not content yet.
    Initialising,
    /// Being filled from an image: not content until the restore verified.
    Restoring,
    /// This memory is this identity's current content.
    Valid,
    /// Handed to a successor by a planned restart; `token` is the one the
    /// successor was given, `ready` the volume's readiness then.
    HandedOver { token: u64, ready: bool },
    /// Not to be served, ever again, for this reason.
    Discarded { reason: String },
}

/// The process that may write the memory: a successor proves it gone
/// before it claims the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub pid: u32,
    /// Field 22 of /proc/PID/stat (clock ticks after boot): tells a reused
    /// pid from the owner.
    pub start_time: u64,
    /// Random per process: tells two incarnations under one pid apart.
    pub incarnation: u64,
}

/// The fault the writer marked before it died: after it, the memory may
/// hold bytes nobody wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCause {
    /// A Rust panic (the panic hook marked it; the log has its message).
    Panic,
    /// A fault signal (`store::FAULT_SIGNALS`) caught by the handler.
    Signal(i32),
    /// A mark whose cause word is not one this binary writes.
    Unknown(u64),
}

impl std::fmt::Display for ExitCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitCause::Panic => f.write_str("a panic (its message is in the log before the crash)"),
            ExitCause::Signal(s) => {
                let name = match *s {
                    libc::SIGSEGV => "SIGSEGV",
                    libc::SIGBUS => "SIGBUS",
                    libc::SIGILL => "SIGILL",
                    libc::SIGABRT => "SIGABRT",
                    libc::SIGFPE => "SIGFPE",
                    libc::SIGSYS => "SIGSYS",
                    _ => "a fault signal",
                };
                write!(f, "{name} (signal {s})")
            }
            ExitCause::Unknown(c) => write!(f, "a fault of unknown cause {c:#x}"),
        }
    }
}

impl ExitCause {
    /// The fault mark in the 16 bytes at [`FAULT_AT`], if one is set.
    fn of_mark(mark: &[u8]) -> Option<ExitCause> {
        let word = |at: usize| {
            mark.get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_ne_bytes)
        };
        if word(0)? != crate::store::FAULT_MARK {
            return None;
        }
        let cause = word(8)?;
        Some(match cause {
            crate::store::PANIC_CAUSE => ExitCause::Panic,
            s if s > 0 && s < 65 => ExitCause::Signal(s as i32),
            other => ExitCause::Unknown(other),
        })
    }
}

/// Which parts of the LUN were ever written (what a dump must save).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Written {
    All,
    /// One bit per `chunk_bytes` of the LUN, least significant bit first,
    /// as hex bytes.
    Chunks {
        chunk_bytes: u64,
        bitmap: String,
    },
}

/// A LUN's persistent reservations, as the SCSI layer last made them: they
/// survive a planned restart and a crash whose memory is served again (the
/// LU did not reset; dropping them would let a host fenced by fence_scsi
/// write again). The image carries them only while `aptpl` is set (a host
/// asked them to persist through power loss); otherwise a start from the
/// image has none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptReservations {
    /// PRgeneration.
    pub generation: u32,
    /// The APTPL bit of the last REGISTER that took effect (PTPL_A).
    #[serde(default)]
    pub aptpl: bool,
    pub registrations: Vec<KeptRegistration>,
    pub reservation: Option<KeptReservation>,
}

/// One registration: an initiator port (iSCSI name and ISID) and its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptRegistration {
    pub port: String,
    pub key: u64,
}

/// The reservation: its holder's initiator port and its type code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptReservation {
    pub holder: String,
    pub kind: u8,
}

/// One kept LUN memory, as recorded by its last writer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptRecord {
    pub format: u32,
    /// The identity (NAA as 16 hex digits, serial) and where it is served.
    pub naa: String,
    pub serial: String,
    pub target: String,
    pub lun: u64,
    /// The LUN's size, and its memfd's (rounded up to whole huge pages).
    pub lun_bytes: u64,
    pub memfd_bytes: u64,
    /// The memfd's inode: binds the record to its memory when the two
    /// reach a successor apart (systemd's fd store).
    #[serde(default)]
    pub memfd_inode: u64,
    pub block_size: u32,
    /// The state directory's generation this content belongs to, and the
    /// next one while a bump is under way.
    pub generation: u64,
    pub pending_generation: Option<u64>,
    pub state: KeptState,
    /// /proc/sys/kernel/random/boot_id of the boot that filled the memory.
    pub boot_id: String,
    pub owner: Owner,
    pub written: Written,
    /// Absent in a record without any (or from a binary that kept none).
    #[serde(default)]
    pub reservations: KeptReservations,
    /// The checksum of the INQUIRY and VPD data the writer served (its
    /// identity left out); absent from a binary older than the check.
    #[serde(default)]
    pub inquiry: Option<u32>,
    /// The writer kept the page checksums after the records current
    /// (`--verify-kept-memory`): after a fault they can be checked.
    #[serde(default)]
    pub page_crcs: bool,
}

/// Why one slot holds no record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotFault {
    /// Never written (all zero magic).
    Empty,
    /// Something other than a record's magic.
    BadMagic,
    /// A body length past the slot's end.
    BadLength(u32),
    /// Torn or overwritten: the checksum does not match.
    BadChecksum,
}

impl std::fmt::Display for SlotFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotFault::Empty => f.write_str("never written"),
            SlotFault::BadMagic => f.write_str("not a record"),
            SlotFault::BadLength(n) => write!(f, "a body of {n} bytes does not fit"),
            SlotFault::BadChecksum => f.write_str("checksum mismatch (torn or overwritten)"),
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KeptError {
    #[error("the kept-memory record area is {0} bytes, not {AREA_BYTES}")]
    AreaSize(usize),
    #[error("no valid kept-memory record (slot 0: {0}; slot 1: {1})")]
    NoValidSlot(SlotFault, SlotFault),
    #[error(
        "the kept-memory record (sequence {sequence}) is in format {format}; this binary reads \
         format {FORMAT}"
    )]
    UnknownFormat { format: u64, sequence: u64 },
    #[error("the kept-memory record (sequence {sequence}) does not parse: {reason}")]
    Unparsable { sequence: u64, reason: String },
    #[error("the kept-memory record takes {0} bytes, more than a slot's {FAULT_AT}")]
    TooLarge(usize),
}

/// The record in force: the newest valid slot's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Current {
    pub record: KeptRecord,
    pub sequence: u64,
    pub slot: usize,
    /// The fault the writer marked as it died, if it did.
    pub fault: Option<ExitCause>,
}

/// Where the next write goes: the slot not holding `current`, with the
/// next sequence number (slot 0, sequence 1 on an empty area).
pub fn next_write(current: Option<&Current>) -> (usize, u64) {
    match current {
        None => (0, 1),
        Some(c) => (1 - c.slot, c.sequence + 1),
    }
}

/// `record` as slot bytes (header and body; the rest of the slot may hold
/// anything) under `sequence`. A written-chunk bitmap too long for a slot
/// (two hex digits per 8 MiB: a LUN of about 440 GiB and more) is written
/// as [`Written::All`] instead: every chunk then counts as written, which
/// makes the next dump carry the whole LUN, never less, and every binary
/// that reads records reads it.
pub fn encode_slot(record: &KeptRecord, sequence: u64) -> Result<Vec<u8>, KeptError> {
    match encode_exactly(record, sequence) {
        Err(KeptError::TooLarge(_)) if record.written != Written::All => encode_exactly(
            &KeptRecord {
                written: Written::All,
                ..record.clone()
            },
            sequence,
        ),
        encoded => encoded,
    }
}

/// [`encode_slot`] of `record` as it is.
fn encode_exactly(record: &KeptRecord, sequence: u64) -> Result<Vec<u8>, KeptError> {
    let body = serde_json::to_vec(record).map_err(|e| KeptError::Unparsable {
        sequence,
        reason: e.to_string(),
    })?;
    if HEADER + body.len() > FAULT_AT {
        return Err(KeptError::TooLarge(HEADER + body.len()));
    }
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&sequence.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out), &body);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// The sequence number and body of one slot, if it holds a whole record.
fn slot_body(slot: &[u8]) -> Result<(u64, &[u8]), SlotFault> {
    let field = |at: usize, n: usize| &slot[at..at + n];
    if field(0, 8) != MAGIC {
        return Err(if field(0, 8) == [0; 8] {
            SlotFault::Empty
        } else {
            SlotFault::BadMagic
        });
    }
    let u64_at = |at| u64::from_le_bytes(field(at, 8).try_into().unwrap_or_default());
    let u32_at = |at| u32::from_le_bytes(field(at, 4).try_into().unwrap_or_default());
    let (sequence, len, crc) = (u64_at(8), u32_at(16), u32_at(20));
    let end = HEADER
        .checked_add(len as usize)
        .filter(|&end| end <= FAULT_AT.min(slot.len()))
        .ok_or(SlotFault::BadLength(len))?;
    let body = &slot[HEADER..end];
    if crc32c::crc32c_append(crc32c::crc32c(&slot[..20]), body) != crc {
        return Err(SlotFault::BadChecksum);
    }
    Ok((sequence, body))
}

/// The record in force in `area` (both slots): the newest checksummed
/// slot's, which this binary must be able to read.
pub fn read_area(area: &[u8]) -> Result<Current, KeptError> {
    if area.len() != AREA_BYTES {
        return Err(KeptError::AreaSize(area.len()));
    }
    let (a, b) = area.split_at(SLOT_BYTES);
    let (slot, sequence, body) = match (slot_body(a), slot_body(b)) {
        (Err(fa), Err(fb)) => return Err(KeptError::NoValidSlot(fa, fb)),
        (Ok((sa, ba)), Ok((sb, _))) if sa >= sb => (0, sa, ba),
        (Ok(_), Ok((sb, bb))) | (Err(_), Ok((sb, bb))) => (1, sb, bb),
        (Ok((sa, ba)), Err(_)) => (0, sa, ba),
    };
    let unparsable = |e: serde_json::Error| KeptError::Unparsable {
        sequence,
        reason: e.to_string(),
    };
    // The format first: a newer binary's record may not parse as ours.
    let value: serde_json::Value = serde_json::from_slice(body).map_err(unparsable)?;
    let format = value.get("format").and_then(|f| f.as_u64());
    if format != Some(u64::from(FORMAT)) {
        return Err(format.map_or_else(
            || KeptError::Unparsable {
                sequence,
                reason: "no format number".into(),
            },
            |format| KeptError::UnknownFormat { format, sequence },
        ));
    }
    let record = serde_json::from_value(value).map_err(unparsable)?;
    Ok(Current {
        record,
        sequence,
        slot,
        fault: ExitCause::of_mark(&area[FAULT_AT..FAULT_AT + FAULT_BYTES]),
    })
}

/// A volume's record, in a small memfd of its own beside the LUN's memory
/// (locked and left out of core dumps like it), written at every change of
/// what the memory is.
pub struct RecordArea {
    area: Store,
    /// The record in force, as last written (the writer is the only one).
    current: Mutex<Option<Current>>,
}

impl RecordArea {
    /// An empty area, with room after the records for `table_words` words
    /// of page checksums ([`super::pages`]): no record in force until the
    /// first write.
    pub fn new(name: &str, table_words: usize) -> Result<RecordArea, StoreError> {
        let table = (table_words * 8).next_multiple_of(4096);
        let area = Store::named(name, (AREA_BYTES + table) as u64, HugePages::Off)?;
        area.mark_faults_at(FAULT_AT as u64)?;
        Ok(RecordArea {
            area,
            current: Mutex::new(None),
        })
    }

    /// The area a predecessor wrote, in its memfd (sealed as [`Store`]
    /// seals LUN memory), with `current` the record read from it: the next
    /// record goes to the other slot, under the next sequence number.
    pub fn adopt(memory: OwnedFd, current: Current) -> Result<RecordArea, StoreError> {
        let size = rustix::fs::fstat(&memory)
            .map_err(|e| StoreError::NotKept(format!("cannot stat the record area: {e}")))?
            .st_size as u64;
        if size < AREA_BYTES as u64 || !size.is_multiple_of(4096) {
            return Err(StoreError::NotKept(format!(
                "the record area is {size} bytes, not {AREA_BYTES} and whole pages of checksums"
            )));
        }
        let area = Store::adopt(memory, size, size)?;
        area.mark_faults_at(FAULT_AT as u64)?;
        Ok(RecordArea {
            area,
            current: Mutex::new(Some(current)),
        })
    }

    /// Clear the fault mark: this living process vouches for the memory
    /// (it hands it over), whatever panic it survived before.
    pub fn clear_fault_mark(&self) {
        self.area.clear_fault_mark();
    }

    /// Make `record` the one in force: written to the other slot, so a
    /// crash half-way leaves the previous one. A record that cannot be
    /// encoded invalidates the area instead (no record in force is NOT
    /// READY for a successor; an outdated one could be more permissive).
    pub fn write(&self, record: &KeptRecord) -> Result<(), KeptError> {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let (slot, sequence) = next_write(current.as_ref());
        let encoded = encode_slot(record, sequence);
        // Test builds: a handed-over record that cannot be written (as one
        // too large for its slot), for the restart's failure path.
        #[cfg(debug_assertions)]
        let encoded = encoded.and_then(|bytes| {
            let handed = matches!(record.state, KeptState::HandedOver { .. });
            match std::env::var_os("RAMSLOG_TEST_HANDED_OVER_RECORD_FAILS") {
                Some(_) if handed => Err(KeptError::TooLarge(SLOT_BYTES + 1)),
                _ => Ok(bytes),
            }
        });
        let written = encoded.and_then(|bytes| {
            self.area
                .write((slot * SLOT_BYTES) as u64, &bytes)
                .map_err(|_| KeptError::TooLarge(bytes.len()))
        });
        match written {
            Ok(()) => {
                *current = Some(Current {
                    record: record.clone(),
                    sequence,
                    slot,
                    fault: None,
                });
                Ok(())
            }
            Err(e) => {
                for slot in 0..2 {
                    let _ = self.area.zero((slot * SLOT_BYTES) as u64, HEADER);
                }
                *current = None;
                Err(e)
            }
        }
    }

    /// The record in force, read back from the memory as a successor would.
    pub fn read(&self) -> Result<Current, KeptError> {
        let mut bytes = vec![0u8; AREA_BYTES];
        self.area
            .read(0, &mut bytes)
            .map_err(|_| KeptError::AreaSize(AREA_BYTES))?;
        read_area(&bytes)
    }

    /// The page checksums of `data` kept after the records, if the area
    /// has room for them.
    pub fn page_crcs<'a>(&'a self, data: &'a Store) -> Option<super::pages::PageCrcs<'a>> {
        super::pages::PageCrcs::new(data, &self.area, AREA_BYTES / 8)
    }

    /// The area's memfd, to hand on beside the LUN's.
    pub fn memory(&self) -> BorrowedFd<'_> {
        self.area.memory()
    }
}

/// The record in force in a record memfd handed over by a predecessor.
pub fn read_handed(memory: BorrowedFd<'_>) -> Result<Current, KeptError> {
    let mut bytes = vec![0u8; AREA_BYTES];
    let mut done = 0;
    while done < AREA_BYTES {
        match rustix::io::pread(memory, &mut bytes[done..], done as u64) {
            Ok(0) | Err(_) => return Err(KeptError::AreaSize(done)),
            Ok(n) => done += n,
        }
    }
    read_area(&bytes)
}

impl Written {
    /// The chunks `marked` says were written, of `chunks` chunks of
    /// `chunk_bytes`.
    pub fn from_chunks(chunk_bytes: u64, chunks: u64, marked: impl Fn(u64) -> bool) -> Written {
        let mut bytes = vec![0u8; chunks.div_ceil(8) as usize];
        for c in (0..chunks).filter(|&c| marked(c)) {
            bytes[(c / 8) as usize] |= 1 << (c % 8);
        }
        Written::Chunks {
            chunk_bytes,
            bitmap: bytes.iter().map(|b| format!("{b:02x}")).collect(),
        }
    }

    /// The written chunks of a LUN of `chunks` chunks of `chunk_bytes`:
    /// every one for `All`, `None` for a bitmap of another chunk size or
    /// one that does not parse.
    pub fn chunks(&self, chunk_bytes: u64, chunks: u64) -> Option<Vec<u64>> {
        match self {
            Written::All => Some((0..chunks).collect()),
            Written::Chunks {
                chunk_bytes: c,
                bitmap,
            } if *c == chunk_bytes && bitmap.len() as u64 == chunks.div_ceil(8) * 2 => {
                let mut out = Vec::new();
                for (i, pair) in bitmap.as_bytes().chunks(2).enumerate() {
                    let byte = std::str::from_utf8(pair)
                        .ok()
                        .and_then(|p| u8::from_str_radix(p, 16).ok())?;
                    out.extend(
                        (0..8)
                            .filter(|b| byte & (1 << b) != 0)
                            .map(|b| i as u64 * 8 + b),
                    );
                }
                if out.last().is_some_and(|&c| c >= chunks) {
                    return None;
                }
                Some(out)
            }
            Written::Chunks { .. } => None,
        }
    }
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`): kept memory from
/// another boot cannot exist, a record that says so is not ours.
pub fn boot_id() -> &'static str {
    static BOOT_ID: OnceLock<String> = OnceLock::new();
    BOOT_ID.get_or_init(|| {
        // Test builds: a start "after a reboot", without one.
        #[cfg(debug_assertions)]
        if let Ok(id) = std::env::var("RAMSLOG_TEST_BOOT_ID") {
            return id;
        }
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    })
}

/// This process as a record's owner.
pub fn this_process() -> Owner {
    static OWNER: OnceLock<Owner> = OnceLock::new();
    *OWNER.get_or_init(|| {
        let pid = std::process::id();
        Owner {
            pid,
            start_time: start_time(pid).unwrap_or(0),
            incarnation: rand::random(),
        }
    })
}

/// Whether the process a pidfd names has ended: the kernel makes a pidfd
/// readable once the whole thread group is gone (a leader that exited
/// while another thread lives is not), zombie or reaped alike.
pub fn pidfd_ended(pidfd: &impl std::os::fd::AsFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&zero))
        .map(|n| n > 0 && fds[0].revents().intersects(PollFlags::IN | PollFlags::HUP))
        .unwrap_or(false)
}

/// Whether process `pid`, started at `start_time`, still has a thread that
/// may write: not once it is gone or its pid names another process, nor
/// while it is a zombie no one has reaped yet (every thread has ended, its
/// mappings and descriptors are released; only the pid is left).
pub fn still_running(pid: u32, start_time: u64) -> bool {
    let Some(id) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    match rustix::process::pidfd_open(id, rustix::process::PidfdFlags::empty()) {
        Err(rustix::io::Errno::SRCH) => false,
        // Opened first, then the start time: the pidfd is that process's.
        Ok(pidfd) => self::start_time(pid) == Some(start_time) && !pidfd_ended(&pidfd),
        // No pidfd to ask (out of descriptors): the start time alone, which
        // counts a zombie as running (the safe side).
        Err(_) => self::start_time(pid) == Some(start_time),
    }
}

/// Field 22 of /proc/PID/stat, the start time in clock ticks after boot;
/// `None` if the process is gone. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from its last ')'.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(state: KeptState) -> KeptRecord {
        KeptRecord {
            format: FORMAT,
            naa: "3a1b2c3d4e5f6071".into(),
            serial: "0b5e3c8e-4f4a-4c1e-9d55-3c0f1e2d3c4b".into(),
            target: "iqn.2026-11.org.ramslog:slog-a".into(),
            lun: 0,
            lun_bytes: 16 << 30,
            memfd_bytes: 16 << 30,
            memfd_inode: 1042,
            block_size: 512,
            generation: 7,
            pending_generation: None,
            state,
            boot_id: "c0ffee00-1111-2222-3333-444455556666".into(),
            owner: Owner {
                pid: 4242,
                start_time: 123_456,
                incarnation: 0x5eed,
            },
            written: Written::Chunks {
                chunk_bytes: 1 << 20,
                bitmap: "ff01".into(),
            },
            reservations: KeptReservations::default(),
            inquiry: Some(0x1234_5678),
            page_crcs: false,
        }
    }

    /// Write `record` the way a writer does: into the slot `next_write`
    /// names, returning the area's new record in force.
    fn write(area: &mut [u8], record: &KeptRecord) -> Current {
        let current = read_area(area).ok();
        let (slot, sequence) = next_write(current.as_ref());
        let bytes = encode_slot(record, sequence).unwrap();
        area[slot * SLOT_BYTES..slot * SLOT_BYTES + bytes.len()].copy_from_slice(&bytes);
        read_area(area).unwrap()
    }

    /// The written-chunk bitmap takes two hex digits per 8 MiB of LUN, so
    /// from about 440 GiB it no longer fits a slot beside the rest of the
    /// record. Such a record must still be written (without it no
    /// successor serves the memory, and a restart without a dump would lose
    /// the content): as every chunk written, which makes the next dump
    /// carry the whole LUN, never less.
    #[test]
    fn a_600_gib_record_fits_its_slot_with_every_chunk_counted() {
        const CHUNK: u64 = 1 << 20;
        let lun = 600u64 << 30;
        let chunks = lun / CHUNK;
        let mut r = record(KeptState::HandedOver {
            token: 9,
            ready: true,
        });
        (r.lun_bytes, r.memfd_bytes) = (lun, lun);
        r.written = Written::from_chunks(CHUNK, chunks, |c| c % 3 == 0);
        let bytes = encode_slot(&r, 1)
            .unwrap_or_else(|e| panic!("a 600 GiB record does not fit its slot: {e}"));
        let mut area = vec![0u8; AREA_BYTES];
        area[..bytes.len()].copy_from_slice(&bytes);
        let read = read_area(&area).expect("the record in force").record;
        assert_eq!(read.written, Written::All);
        assert_eq!(
            read.written.chunks(CHUNK, chunks).map(|c| c.len() as u64),
            Some(chunks),
            "every chunk counts as written"
        );
        // A LUN whose bitmap fits keeps it.
        let small = record(KeptState::Valid);
        let bytes = encode_slot(&small, 1).expect("a 16 GiB record");
        area.fill(0);
        area[..bytes.len()].copy_from_slice(&bytes);
        assert_eq!(
            read_area(&area).expect("in force").record.written,
            small.written
        );
    }

    #[test]
    fn the_newest_record_is_in_force_and_writes_alternate_slots() {
        let mut area = vec![0u8; AREA_BYTES];
        assert_eq!(
            read_area(&area),
            Err(KeptError::NoValidSlot(SlotFault::Empty, SlotFault::Empty))
        );
        let first = write(&mut area, &record(KeptState::Restoring));
        assert_eq!((first.slot, first.sequence), (0, 1));
        let second = write(&mut area, &record(KeptState::Valid));
        assert_eq!((second.slot, second.sequence), (1, 2));
        assert_eq!(second.record.state, KeptState::Valid);
        let third = write(
            &mut area,
            &record(KeptState::HandedOver {
                token: 99,
                ready: true,
            }),
        );
        assert_eq!((third.slot, third.sequence), (0, 3));
        assert_eq!(read_area(&area).unwrap(), third);
    }

    /// A crash in the middle of a write leaves the record before it in
    /// force: the writer lowered trust before the act, so that older record
    /// is never more permissive.
    #[test]
    fn a_torn_write_leaves_the_previous_record_in_force() {
        let mut area = vec![0u8; AREA_BYTES];
        write(&mut area, &record(KeptState::Valid));
        let restoring = write(&mut area, &record(KeptState::Restoring));
        let (slot, sequence) = next_write(Some(&restoring));
        // Not the record the slot held before: a tear must mix old and new.
        let bumped = KeptRecord {
            generation: 8,
            ..record(KeptState::Valid)
        };
        let bytes = encode_slot(&bumped, sequence).unwrap();
        let at = slot * SLOT_BYTES;
        // A tear past the last byte that differs from the slot's old bytes
        // has written the whole new record; every tear before it must not count.
        let last_new = (0..bytes.len())
            .rev()
            .find(|&i| bytes[i] != area[at + i])
            .unwrap();
        assert!(last_new > HEADER, "the bodies differ");
        for torn in [8, HEADER, HEADER + 1, last_new / 2, last_new] {
            let mut area = area.clone();
            area[at..at + torn].copy_from_slice(&bytes[..torn]);
            assert_eq!(
                read_area(&area).unwrap(),
                restoring,
                "torn after {torn} bytes"
            );
        }
        // A bit flipped anywhere in the newer slot's record has the same effect.
        let mut flipped = area.clone();
        flipped[at..at + bytes.len()].copy_from_slice(&bytes);
        flipped[at + bytes.len() - 3] ^= 0x10;
        assert_eq!(read_area(&flipped).unwrap(), restoring);
    }

    /// What this binary cannot read is refused, even when the older slot
    /// holds a record it can read: that one is an older writer's.
    #[test]
    fn an_unreadable_newest_record_is_an_error_not_a_fallback() {
        let mut area = vec![0u8; AREA_BYTES];
        let valid = write(&mut area, &record(KeptState::Valid));
        let newer = |body: &[u8]| {
            let mut area = area.clone();
            let mut bytes = encode_slot(&record(KeptState::Valid), valid.sequence + 1).unwrap();
            bytes.truncate(HEADER);
            bytes[16..20].copy_from_slice(&(body.len() as u32).to_le_bytes());
            let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[..20]), body);
            bytes[20..24].copy_from_slice(&crc.to_le_bytes());
            bytes.extend_from_slice(body);
            area[SLOT_BYTES..SLOT_BYTES + bytes.len()].copy_from_slice(&bytes);
            read_area(&area)
        };
        assert_eq!(
            newer(br#"{"format": 2, "whatever": true}"#),
            Err(KeptError::UnknownFormat {
                format: 2,
                sequence: 2
            })
        );
        assert!(matches!(
            newer(br#"{"format": 1, "naa": 5}"#),
            Err(KeptError::Unparsable { sequence: 2, .. })
        ));
        assert!(matches!(
            newer(b"\xff\xfe not json"),
            Err(KeptError::Unparsable { sequence: 2, .. })
        ));
        assert!(matches!(
            newer(br#"{"naa": "x"}"#),
            Err(KeptError::Unparsable { sequence: 2, .. })
        ));
        assert_eq!(
            read_area(&area[1..]),
            Err(KeptError::AreaSize(AREA_BYTES - 1))
        );
    }

    /// The fault mark lies outside both records: a writer's panic or fault
    /// signal sets it without touching them, and every record write leaves
    /// it as it is.
    #[test]
    fn the_fault_mark_is_read_beside_the_record_in_force() {
        let mut area = vec![0u8; AREA_BYTES];
        write(&mut area, &record(KeptState::Valid));
        let mark = |area: &mut [u8], cause: u64| {
            area[FAULT_AT + 8..FAULT_AT + 16].copy_from_slice(&cause.to_ne_bytes());
            area[FAULT_AT..FAULT_AT + 8].copy_from_slice(&crate::store::FAULT_MARK.to_ne_bytes());
        };
        assert_eq!(read_area(&area).unwrap().fault, None);
        for (cause, seen) in [
            (libc::SIGBUS as u64, ExitCause::Signal(libc::SIGBUS)),
            (crate::store::PANIC_CAUSE, ExitCause::Panic),
            (0, ExitCause::Unknown(0)),
        ] {
            let mut area = area.clone();
            mark(&mut area, cause);
            let current = write(&mut area, &record(KeptState::Restoring));
            assert_eq!(current.fault, Some(seen));
            let current = write(&mut area, &record(KeptState::Valid));
            assert_eq!((current.slot, current.fault), (0, Some(seen)));
        }
        assert!(ExitCause::Signal(libc::SIGSEGV)
            .to_string()
            .contains("SIGSEGV"));
        // The largest record that fits stops short of the mark (with no
        // bitmap to give up).
        let mut big = record(KeptState::Valid);
        big.written = Written::All;
        let room = FAULT_AT - HEADER - serde_json::to_vec(&big).unwrap().len();
        big.serial.push_str(&"x".repeat(room));
        assert_eq!(encode_slot(&big, 1).unwrap().len(), FAULT_AT);
        big.serial.push('x');
        assert!(matches!(encode_slot(&big, 1), Err(KeptError::TooLarge(_))));
    }

    /// Too large even with every chunk counted as written (nothing else
    /// in a record can be given up): refused.
    #[test]
    fn a_record_too_large_for_a_slot_is_refused_when_written() {
        let mut big = record(KeptState::Discarded {
            reason: "x".repeat(SLOT_BYTES),
        });
        big.written = Written::Chunks {
            chunk_bytes: 4096,
            bitmap: "0".repeat(SLOT_BYTES),
        };
        assert!(matches!(encode_slot(&big, 1), Err(KeptError::TooLarge(_))));
    }

    #[test]
    fn the_record_area_holds_what_was_written_last() {
        let area = RecordArea::new("ramslog test LUN 0 record", 0).unwrap();
        assert_eq!(
            area.read(),
            Err(KeptError::NoValidSlot(SlotFault::Empty, SlotFault::Empty))
        );
        area.write(&record(KeptState::Restoring)).unwrap();
        area.write(&record(KeptState::Valid)).unwrap();
        let current = area.read().unwrap();
        assert_eq!((current.sequence, current.slot), (2, 1));
        assert_eq!(current.record.state, KeptState::Valid);
        // One that cannot be written leaves no record in force, not the
        // older (more permissive) one.
        let huge = KeptRecord {
            state: KeptState::Discarded {
                reason: "x".repeat(SLOT_BYTES),
            },
            ..record(KeptState::Valid)
        };
        assert!(matches!(area.write(&huge), Err(KeptError::TooLarge(_))));
        assert!(matches!(area.read(), Err(KeptError::NoValidSlot(..))));
        area.write(&record(KeptState::Valid)).unwrap();
        assert_eq!(area.read().unwrap().record.state, KeptState::Valid);
    }

    #[test]
    fn written_chunks_survive_the_record() {
        let w = Written::from_chunks(1 << 20, 21, |c| c == 0 || c == 9 || c == 20);
        let json = serde_json::to_string(&w).unwrap();
        let back: Written = serde_json::from_str(&json).unwrap();
        assert_eq!(back.chunks(1 << 20, 21), Some(vec![0, 9, 20]));
        assert_eq!(back.chunks(4096, 21), None, "another chunk size");
        assert_eq!(back.chunks(1 << 20, 40), None, "another LUN size");
        assert_eq!(Written::All.chunks(1, 3), Some(vec![0, 1, 2]));
        let bad = Written::Chunks {
            chunk_bytes: 1,
            bitmap: "zz".into(),
        };
        assert_eq!(bad.chunks(1, 8), None);
        let past_end = Written::Chunks {
            chunk_bytes: 1,
            bitmap: "80".into(),
        };
        assert_eq!(past_end.chunks(1, 7), None, "a bit past the last chunk");
    }

    #[test]
    fn a_handed_record_reads_as_its_area_does() {
        let area = RecordArea::new("ramslog test LUN 1 record", 0).unwrap();
        area.write(&record(KeptState::Valid)).unwrap();
        assert_eq!(read_handed(area.memory()), area.read());
    }

    #[test]
    fn this_process_is_its_own_owner() {
        let me = this_process();
        assert_eq!(me.pid, std::process::id());
        assert!(me.start_time > 0);
        assert_eq!(start_time(me.pid), Some(me.start_time));
        assert_eq!(this_process(), me, "one incarnation per process");
        assert_eq!(boot_id().len(), 36, "{}", boot_id());
    }

    #[test]
    fn a_writer_runs_until_it_ends_and_is_then_gone_reaped_or_not() {
        let me = this_process();
        assert!(still_running(me.pid, me.start_time));
        assert!(!still_running(me.pid, me.start_time + 1), "another process");
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let pid = child.id();
        let started = start_time(pid);
        // Unreaped, it is a zombie once `true` has exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while started.is_some_and(|t| still_running(pid, t)) {
            assert!(std::time::Instant::now() < deadline, "true did not end");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(start_time(pid).is_some(), "reaped too early: not a zombie");
        child.wait().expect("reap");
        assert!(started.is_none_or(|t| !still_running(pid, t)));
    }

    proptest! {
        /// Whatever a slot holds, reading the area returns an answer: a
        /// random header, a checksummed body of random bytes.
        #[test]
        fn any_bytes_read_without_a_panic(
            slot in 0usize..2,
            sequence in any::<u64>(),
            len in any::<u32>(),
            body in proptest::collection::vec(any::<u8>(), 0..512),
            checksummed in any::<bool>(),
        ) {
            let len = if checksummed { body.len() as u32 } else { len };
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&sequence.to_le_bytes());
            bytes.extend_from_slice(&len.to_le_bytes());
            let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes), &body);
            bytes.extend_from_slice(&(if checksummed { crc } else { crc ^ 1 }).to_le_bytes());
            bytes.extend_from_slice(&body);
            let mut area = vec![0u8; AREA_BYTES];
            area[slot * SLOT_BYTES..slot * SLOT_BYTES + bytes.len()].copy_from_slice(&bytes);
            let read = read_area(&area);
            prop_assert!(read.is_err(), "random bytes taken for a record: {read:?}");
        }
    }
}
