//! The LUN memory: one sealed memfd, mapped shared, prefaulted, locked in
//! RAM and left out of core dumps.
//!
//! Everything unsafe about the LUN memory lives here. The rest of the target
//! sees range-checked copies in and out; the iSER driver sees the base address
//! and length for one memory registration per RDMA device.
//!
//! The memory is a memfd rather than an anonymous mapping so that it can
//! outlive the process that filled it (a restart hands the file on); it is
//! mapped `MAP_SHARED`, because a private mapping would keep every write in
//! copies that die with the process; it is sealed against resizing (a
//! shrunk file would fault the mapping and any RDMA landing in it); and it
//! is `MADV_DONTDUMP`, because a panic must not stream gigabytes of
//! somebody's log into a core file.
//!
//! The same bytes may be written by two hosts' overlapping commands at once,
//! or by the HCA while a thread reads them. A disk may tear such writes, but
//! in Rust's memory model a plain copy racing another access is undefined
//! behaviour. So every access from Rust is an aligned 8-byte atomic (relaxed)
//! load or store of the words it covers, a partial word merged by
//! compare-and-swap: all of them the same size, never mixed with plain
//! accesses, and never a reference into the mapping.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use ramslog_common::verbs;

use thiserror::Error;

mod access;
mod faults;
pub use faults::{install_fault_handlers, mark_faults, FAULT_MARK, FAULT_SIGNALS, PANIC_CAUSE};

const HUGE_PAGE: usize = 2 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// 2 MiB pages when enough are reserved, otherwise normal pages.
    #[default]
    Auto,
    Require,
    Off,
}

impl std::str::FromStr for HugePages {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(HugePages::Auto),
            "require" => Ok(HugePages::Require),
            "off" => Ok(HugePages::Off),
            _ => Err(format!("'{s}' is not one of auto, require, off")),
        }
    }
}

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("LUN size must be a non-zero multiple of 4096 bytes, got {0}")]
    BadSize(u64),
    #[error(
        "cannot lock {size} bytes of LUN memory in RAM: the locked-memory limit (RLIMIT_MEMLOCK) \
         is {limit}. Raise it: run as root, or `ulimit -l unlimited` in the starting shell, or \
         set LimitMEMLOCK=infinity in the systemd unit ({source})"
    )]
    Mlock {
        size: u64,
        limit: String,
        source: std::io::Error,
    },
    #[error(
        "--hugepages require: {need} free 2 MiB huge pages are needed but only {free} are free. \
         Reserve them with `echo {need} > /proc/sys/vm/nr_hugepages` (or sysctl vm.nr_hugepages), \
         or use --hugepages auto"
    )]
    HugePagesUnavailable { need: u64, free: u64 },
    #[error(
        "cannot get {size} bytes of RAM for the LUN ({source}): free memory (or lower the other \
         LUNs' sizes)"
    )]
    Populate { size: u64, source: std::io::Error },
    #[error("cannot create {size} bytes of LUN memory (memfd): {source}")]
    Create { size: u64, source: std::io::Error },
    #[error("cannot map {size} bytes of LUN memory: {source}")]
    Map { size: u64, source: std::io::Error },
    #[error("the memory handed over is not this LUN's: {0}")]
    NotKept(String),
    #[error("access of {len} bytes at offset {offset} is past the end of the {size}-byte LUN")]
    OutOfRange { offset: u64, len: usize, size: u64 },
}

/// Which page size backs the LUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    Huge2M,
    Normal,
}

impl fmt::Display for PageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageKind::Huge2M => "2 MiB huge pages",
            PageKind::Normal => "normal pages",
        })
    }
}

pub struct Store {
    base: NonNull<u8>,
    /// The LUN's size: every access is checked against it.
    len: usize,
    /// The memfd's size and the mapping's: `len` rounded up to whole pages
    /// of `pages` (huge pages cannot be mapped in part).
    mapped: usize,
    pages: PageKind,
    /// The file behind the mapping. The mapping alone keeps the memory; the
    /// file is what a successor process is handed.
    memory: OwnedFd,
    /// 1 + the index in [`FAULT_MARKS`] of this store's fault mark, 0 for
    /// none.
    fault_mark: AtomicUsize,
    /// Every page is faulted in and locked. A [`Store::reserved`] one holds
    /// no page until [`Store::make_resident`].
    resident: AtomicBool,
}

// SAFETY: the mapping is owned by the Store for its whole life; all access goes
// through bounds-checked methods that copy bytes word by word with atomic
// operations (see the module comment), so threads may use one Store at once;
// concurrent overlapping writes may tear, as on a disk (SCSI gives no
// atomicity across commands).
unsafe impl Send for Store {}
// SAFETY: see Send; no method hands out references into the mapping.
unsafe impl Sync for Store {}

/// The mapping is addressed in aligned words of this many bytes.
const WORD: usize = 8;

/// The most [`Store::crc32c_small`] checksums in one call: a page.
pub const SMALL_CRC_BYTES: usize = 4096;

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("len", &self.len)
            .field("mapped", &self.mapped)
            .field("pages", &self.pages)
            .finish()
    }
}

fn free_huge_pages() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| {
                    l.strip_prefix("HugePages_Free:")
                        .map(|v| v.trim().parse().ok())
                })
                .flatten()
        })
        .unwrap_or(0)
}

fn memlock_limit() -> String {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and nothing else.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    if rc != 0 {
        return "unknown".into();
    }
    if rl.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} bytes", rl.rlim_cur)
    }
}

/// memfd names are at most 249 bytes (NAME_MAX less "memfd:").
const MEMFD_NAME_MAX: usize = 249;

/// A new close-on-exec memfd named `name` (cut to the kernel's limit; a
/// name the kernel cannot take falls back to a generic one), `len` bytes
/// long and sealed at that size.
fn sealed_memfd(name: &str, len: u64, huge: bool) -> std::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let mut end = name.len().min(MEMFD_NAME_MAX);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let name = CString::new(&name[..end]).unwrap_or_else(|_| c"ramslog LUN".to_owned());
    let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    if huge {
        flags |= MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB;
    }
    let fd = rustix::fs::memfd_create(name.as_c_str(), flags)?;
    rustix::fs::ftruncate(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(fd)
}

/// The descriptors `raws` a predecessor handed across exec, owned from now
/// on and close-on-exec again. Each must be open and named once, and none
/// may be standard input, output or error: a wrong number would otherwise
/// close (or map) somebody else's file.
pub fn inherited_fds(raws: &[RawFd]) -> Result<Vec<OwnedFd>, String> {
    for (i, &raw) in raws.iter().enumerate() {
        if raw < 3 {
            return Err(format!("descriptor {raw} is a standard stream"));
        }
        if raws[..i].contains(&raw) {
            return Err(format!("descriptor {raw} is named twice"));
        }
        // SAFETY: F_GETFD only queries the descriptor table.
        if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
            return Err(format!("descriptor {raw} is not open"));
        }
    }
    raws.iter()
        .map(|&raw| {
            // SAFETY: `raw` is open (checked above), named once, and was
            // handed to this process to own: nothing else here refers to it.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
                .map_err(|e| format!("descriptor {raw}: {e}"))?;
            Ok(fd)
        })
        .collect()
}

/// A LUN size as a length: non-zero, whole 4 KiB pages, mappable.
fn lun_len(size: u64) -> Result<usize, StoreError> {
    if size == 0 || !size.is_multiple_of(4096) || size > isize::MAX as u64 - HUGE_PAGE as u64 {
        return Err(StoreError::BadSize(size));
    }
    Ok(size as usize)
}

impl Store {
    /// `size` bytes of LUN memory under a generic name (tests, tools).
    pub fn new(size: u64, huge: HugePages) -> Result<Store, StoreError> {
        Store::named("ramslog LUN", size, huge)
    }

    /// Create the memfd `name` (shown in /proc/PID/maps and fd listings) of
    /// `size` bytes, seal its size, map it shared, prefault it, lock it in
    /// RAM and keep it out of core dumps.
    pub fn named(name: &str, size: u64, huge: HugePages) -> Result<Store, StoreError> {
        let len = lun_len(size)?;
        let want_huge = match huge {
            HugePages::Off => false,
            HugePages::Auto | HugePages::Require => {
                let need = size.div_ceil(HUGE_PAGE as u64);
                let free = free_huge_pages();
                if free >= need {
                    true
                } else if huge == HugePages::Require {
                    return Err(StoreError::HugePagesUnavailable { need, free });
                } else {
                    false
                }
            }
        };
        let store = match Self::create(name, len, want_huge, true) {
            Err(e) if want_huge && huge == HugePages::Auto => {
                tracing::info!("huge page memory failed ({e}); using normal pages");
                Self::create(name, len, false, true)?
            }
            other => other?,
        };
        store.locked()
    }

    /// `size` bytes of LUN memory named `name` that take no RAM yet: the
    /// memfd is made and mapped without reserving or faulting in a page,
    /// and nothing is locked until [`Store::make_resident`]. A NOT READY
    /// LUN serves no byte, so its memory waits for accept-empty: a LUN whose
    /// kept memory is held back for a doubt never costs a second copy, and
    /// one whose memory cannot be had does not stop the start. Huge pages
    /// only under `require`: under `auto` the pages another LUN takes
    /// meanwhile would make a huge-page memfd fail at accept-empty, where
    /// normal pages cannot fail for want of a pool.
    pub fn reserved(name: &str, size: u64, huge: HugePages) -> Result<Store, StoreError> {
        let len = lun_len(size)?;
        let store = Self::create(name, len, huge == HugePages::Require, false)?;
        store.resident.store(false, Ordering::Release);
        Ok(store)
    }

    /// Whether every page is faulted in and locked (not a
    /// [`Store::reserved`] one still waiting).
    pub fn is_resident(&self) -> bool {
        self.resident.load(Ordering::Acquire)
    }

    /// Fault in and lock every page of a [`Store::reserved`] store (nothing
    /// to do for one that is resident). When the RAM or the huge pages are
    /// not there, what was taken is given back and the store stays as it
    /// was: the error says what to free.
    pub fn make_resident(&self) -> Result<(), StoreError> {
        if self.is_resident() {
            return Ok(());
        }
        // SAFETY: advice on the mapping this Store owns. POPULATE_WRITE
        // faults every page in and returns an error where a touch would
        // raise SIGBUS (a huge page pool run dry).
        let populated = unsafe {
            libc::madvise(
                self.base.as_ptr().cast(),
                self.mapped,
                libc::MADV_POPULATE_WRITE,
            )
        };
        let failed = if populated != 0 {
            let source = std::io::Error::last_os_error();
            Some(match self.pages {
                PageKind::Huge2M => StoreError::HugePagesUnavailable {
                    need: (self.mapped / HUGE_PAGE) as u64,
                    free: free_huge_pages(),
                },
                PageKind::Normal => StoreError::Populate {
                    size: self.len as u64,
                    source,
                },
            })
        } else {
            self.lock().err()
        };
        if let Some(e) = failed {
            self.give_back();
            return Err(e);
        }
        self.resident.store(true, Ordering::Release);
        Ok(())
    }

    /// Return the pages a failed [`Store::make_resident`] took (the memfd
    /// keeps its size; its pages read as zero again).
    fn give_back(&self) {
        use rustix::fs::FallocateFlags;
        if let Err(e) = rustix::fs::fallocate(
            &self.memory,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            0,
            self.mapped as u64,
        ) {
            tracing::warn!("cannot give back the LUN memory taken: {e}");
        }
    }

    /// This store with its whole mapping locked in RAM.
    fn locked(self) -> Result<Store, StoreError> {
        self.lock()?;
        Ok(self)
    }

    fn lock(&self) -> Result<(), StoreError> {
        // SAFETY: [base, base+mapped) is the mapping this Store owns.
        if unsafe { libc::mlock(self.base.as_ptr().cast(), self.mapped) } != 0 {
            let source = std::io::Error::last_os_error();
            return Err(StoreError::Mlock {
                size: self.len as u64,
                limit: memlock_limit(),
                source,
            });
        }
        Ok(())
    }

    /// The sealed memfd and its shared, undumped mapping (prefaulted when
    /// `populate`); `len` rounded up to whole huge pages when `huge`.
    fn create(name: &str, len: usize, huge: bool, populate: bool) -> Result<Store, StoreError> {
        let (mapped, pages) = if huge {
            (len.div_ceil(HUGE_PAGE) * HUGE_PAGE, PageKind::Huge2M)
        } else {
            (len, PageKind::Normal)
        };
        let memory =
            sealed_memfd(name, mapped as u64, huge).map_err(|source| StoreError::Create {
                size: mapped as u64,
                source,
            })?;
        Self::map_memory(memory, len, mapped, pages, populate)
    }

    /// Take over the memory a predecessor handed on: `memory` must be a
    /// memfd sealed the way [`Store::named`] seals it, `mapped` bytes long,
    /// holding a LUN of `len` bytes. It is mapped, prefaulted, locked and
    /// kept out of core dumps like new memory, its content untouched.
    pub fn adopt(memory: OwnedFd, len: u64, mapped: u64) -> Result<Store, StoreError> {
        use rustix::fs::SealFlags;
        let not_kept = |why: String| StoreError::NotKept(why);
        let link = std::fs::read_link(format!("/proc/self/fd/{}", memory.as_raw_fd()))
            .map_err(|e| not_kept(format!("cannot inspect the descriptor: {e}")))?;
        if !link.to_string_lossy().starts_with("/memfd:") {
            return Err(not_kept(format!("{} is not a memfd", link.display())));
        }
        let seals = rustix::fs::fcntl_get_seals(&memory)
            .map_err(|e| not_kept(format!("cannot read its seals: {e}")))?;
        let want = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        if seals != want {
            return Err(not_kept(format!("sealed {seals:?}, not {want:?}")));
        }
        let stat =
            rustix::fs::fstat(&memory).map_err(|e| not_kept(format!("cannot stat it: {e}")))?;
        if u64::try_from(stat.st_size) != Ok(mapped) || len == 0 || len > mapped {
            return Err(not_kept(format!(
                "{} bytes, not the {mapped} its record names for a {len}-byte LUN",
                stat.st_size
            )));
        }
        // hugetlbfs reports its page size as the block size.
        let pages = if stat.st_blksize as usize == HUGE_PAGE {
            PageKind::Huge2M
        } else {
            PageKind::Normal
        };
        Self::map_memory(memory, len as usize, mapped as usize, pages, true)?.locked()
    }

    /// The memory of the file for `len` bytes of LUN: mapped shared and
    /// left out of core dumps (not yet locked); prefaulted when `populate`,
    /// otherwise reserving nothing (huge pages included) until touched.
    fn map_memory(
        memory: OwnedFd,
        len: usize,
        mapped: usize,
        pages: PageKind,
        populate: bool,
    ) -> Result<Store, StoreError> {
        let how = if populate {
            libc::MAP_POPULATE
        } else {
            libc::MAP_NORESERVE
        };
        // SAFETY: a shared mapping of the whole file, with no address hint;
        // the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | how,
                memory.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(StoreError::Map {
                size: mapped as u64,
                source: std::io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(p.cast()).ok_or(StoreError::Map {
            size: mapped as u64,
            source: std::io::Error::other("mmap returned NULL"),
        })?;
        // From here on the Store owns the mapping: an early return unmaps it.
        let store = Store {
            base,
            len,
            mapped,
            pages,
            memory,
            fault_mark: AtomicUsize::new(0),
            resident: AtomicBool::new(true),
        };
        // SAFETY: advice on the mapping made above, which the Store owns.
        if unsafe { libc::madvise(p, mapped, libc::MADV_DONTDUMP) } != 0 {
            return Err(StoreError::Map {
                size: mapped as u64,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(store)
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd's size: the LUN's, rounded up to whole huge pages.
    pub fn mapped_len(&self) -> u64 {
        self.mapped as u64
    }

    /// The memfd, to hand on to a successor.
    pub fn memory(&self) -> BorrowedFd<'_> {
        self.memory.as_fd()
    }

    /// The memfd's inode number: a kept-memory record names it, so a
    /// successor given the memory and the record apart can tell they belong
    /// together (0 if it cannot be read, which no memfd has).
    pub fn inode(&self) -> u64 {
        rustix::fs::fstat(&self.memory).map_or(0, |s| s.st_ino)
    }

    pub fn page_kind(&self) -> PageKind {
        self.pages
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.unmark_faults();
        // SAFETY: unmapping the region this Store owns; nothing refers to it
        // after drop. The memfd closes after this, with the last of the pages.
        unsafe {
            libc::munlock(self.base.as_ptr().cast(), self.mapped);
            libc::munmap(self.base.as_ptr().cast(), self.mapped);
        }
    }
}

impl Store {
    /// Register the whole LUN with an RDMA device, once, for local access
    /// only: the HCA reads and writes it on our behalf (RDMA WRITE source,
    /// RDMA READ destination), and no peer ever gets a key to it.
    pub fn register_rdma(
        self: &Arc<Self>,
        pd: &Arc<verbs::ProtectionDomain>,
    ) -> Result<RdmaRegion, verbs::Error> {
        // SAFETY: the mapping stays valid and mapped while the region lives:
        // RdmaRegion holds an Arc of this Store, and its MR field is declared
        // (so dropped, deregistered) before that Arc.
        let mr = unsafe {
            verbs::MemoryRegion::register(
                pd,
                self.base.as_ptr(),
                // The whole mapping: a length ending inside a huge page is
                // refused by some drivers. Accesses stay inside `len` (`sge`).
                self.mapped,
                verbs::Access::LOCAL_WRITE,
            )
        }?;
        Ok(RdmaRegion {
            mr,
            store: self.clone(),
        })
    }
}

/// A LUN's memory registered with one RDMA device.
pub struct RdmaRegion {
    mr: verbs::MemoryRegion,
    store: Arc<Store>,
}

impl RdmaRegion {
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The scatter entry for `len` bytes at `offset`, if they lie inside the LUN.
    pub fn sge(&self, offset: u64, len: u32) -> Option<verbs::Sge<'_>> {
        let off = self.store.check(offset, len as usize).ok()?;
        self.mr.sge(off, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every offset and length around word boundaries, against a plain
    /// vector: partial words keep their neighbours' bytes.
    #[test]
    fn unaligned_copies_match_a_model() {
        let s = Store::new(1 << 20, HugePages::Off).unwrap();
        let mut model = vec![0u8; 64];
        let mut n = 1u8;
        for off in 0..24usize {
            for len in 0..24usize {
                let data: Vec<u8> = (0..len).map(|i| n.wrapping_add(i as u8)).collect();
                n = n.wrapping_add(7);
                s.write(off as u64, &data).unwrap();
                model[off..off + len].copy_from_slice(&data);
                let mut got = vec![0u8; 64];
                s.read(0, &mut got).unwrap();
                assert_eq!(got, model, "write of {len} at {off}");
                if len % 5 == 0 {
                    s.zero(off as u64, len).unwrap();
                    model[off..off + len].fill(0);
                }
                let want = crc32c::crc32c_append(3, &model[off..off + len]);
                assert_eq!(s.crc32c_append(3, off as u64, len).unwrap(), want);
            }
        }
    }

    /// Overlapping writers and a reader at once: each 8-byte-aligned word
    /// holds one writer's bytes whole (words never tear), and nothing is
    /// undefined about it.
    #[test]
    fn concurrent_overlapping_access_is_sound() {
        let s = Store::new(1 << 20, HugePages::Off).unwrap();
        std::thread::scope(|scope| {
            for fill in [0x11u8, 0x22] {
                let s = &s;
                scope.spawn(move || {
                    for _ in 0..200 {
                        s.write(0, &[fill; 4096]).unwrap();
                    }
                });
            }
            let s = &s;
            scope.spawn(move || {
                let mut b = [0u8; 4096];
                for _ in 0..200 {
                    s.read(0, &mut b).unwrap();
                    for w in b.chunks(8) {
                        assert!(w.iter().all(|&x| x == w[0]), "a word tore: {w:?}");
                    }
                }
            });
        });
    }

    /// The mapping's line in /proc/self/smaps and its VmFlags.
    fn smaps_entry(s: &Store) -> (String, String) {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let start = format!("{:x}-", s.base.as_ptr() as usize);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
        let header = lines.next().expect("the LUN mapping in smaps").to_string();
        let flags = lines
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .expect("VmFlags")
            .to_string();
        (header, flags)
    }

    /// `Rss:` and `Locked:` of the store's mapping, in KiB.
    fn smaps_rss_locked(s: &Store) -> (u64, u64) {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let start = format!("{:x}-", s.base.as_ptr() as usize);
        let lines: Vec<&str> = smaps
            .lines()
            .skip_while(|l| !l.starts_with(&start))
            .skip(1)
            .take_while(|l| !l.starts_with("VmFlags:"))
            .collect();
        let kib = |key: &str| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {lines:?}"))
        };
        (kib("Rss:"), kib("Locked:"))
    }

    /// Reserved memory holds no page until made resident; then every page
    /// is in and locked, and a second call changes nothing.
    #[test]
    fn reserved_memory_takes_no_ram_until_made_resident() {
        let s = Store::reserved("ramslog reserved LUN", 8 << 20, HugePages::Off).expect("store");
        assert!(!s.is_resident());
        assert_eq!(smaps_rss_locked(&s), (0, 0), "pages taken before use");
        s.make_resident().expect("resident");
        assert!(s.is_resident());
        assert_eq!(smaps_rss_locked(&s), (8 << 10, 8 << 10));
        s.make_resident().expect("again");
        s.write(4096, &[9; 16]).expect("write");
        let mut b = [0; 16];
        s.read(4096, &mut b).expect("read");
        assert_eq!(b, [9; 16]);
    }

    /// The LUN memory can outlive the process only as a shared mapping of a
    /// file whose size nobody can change, and it must never reach a core
    /// dump.
    #[test]
    fn the_lunmemory_is_a_sealed_shared_memfd_left_out_of_core_dumps() {
        let s = Store::named("ramslog iqn.2026-11.test:a LUN 3", 1 << 20, HugePages::Off).unwrap();
        let (header, flags) = smaps_entry(&s);
        let fields: Vec<&str> = header.split_whitespace().collect();
        assert_eq!(fields[1], "rw-s", "a shared mapping: {header}");
        assert!(
            header.ends_with("/memfd:ramslog iqn.2026-11.test:a LUN 3 (deleted)"),
            "named after its LUN: {header}"
        );
        let flags: Vec<&str> = flags.split_whitespace().collect();
        assert!(flags.contains(&"dd"), "MADV_DONTDUMP: {flags:?}");
        assert!(flags.contains(&"lo"), "locked in RAM: {flags:?}");
        use rustix::fs::SealFlags;
        assert_eq!(
            rustix::fs::fcntl_get_seals(&s.memory).unwrap(),
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
        );
        assert!(
            rustix::io::fcntl_getfd(&s.memory)
                .unwrap()
                .contains(rustix::io::FdFlags::CLOEXEC),
            "never leaked to a child"
        );
        assert_eq!(rustix::fs::fstat(&s.memory).unwrap().st_size, 1 << 20);
        // Writes land in the file, not in private copies.
        s.write(4096, b"kept").unwrap();
        let mut b = [0u8; 4];
        assert_eq!(rustix::io::pread(&s.memory, &mut b, 4096).unwrap(), 4);
        assert_eq!(&b, b"kept");
        // A name the kernel would refuse is cut, not an error.
        let long = "x".repeat(400);
        assert!(Store::named(&long, 4096, HugePages::Off).is_ok());
        assert!(Store::named("nul\0inside", 4096, HugePages::Off).is_ok());
    }

    /// A successor takes over the memory its predecessor filled, and
    /// nothing else: not a memfd of another size, not an unsealed one, not
    /// a plain file.
    #[test]
    fn adopted_memory_is_the_predecessors_and_nothing_else() {
        let s = Store::named("ramslog adopt LUN 0", 1 << 20, HugePages::Off).unwrap();
        s.write(8192, b"survives").unwrap();
        let handed = rustix::io::dup(s.memory()).unwrap();
        let other_size = rustix::io::dup(s.memory()).unwrap();
        drop(s);
        let mut b = [0u8; 8];
        let wrong = Store::adopt(other_size, 1 << 20, 2 << 20).unwrap_err();
        assert!(matches!(wrong, StoreError::NotKept(_)), "{wrong}");
        let adopted = Store::adopt(handed, 1 << 20, 1 << 20).unwrap();
        adopted.read(8192, &mut b).unwrap();
        assert_eq!(&b, b"survives");
        assert_eq!(adopted.page_kind(), PageKind::Normal);
        let (_, flags) = smaps_entry(&adopted);
        assert!(flags.contains(" dd") && flags.contains(" lo"), "{flags}");

        use rustix::fs::MemfdFlags;
        let unsealed = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, 1 << 20).unwrap();
        assert!(matches!(
            Store::adopt(unsealed, 1 << 20, 1 << 20),
            Err(StoreError::NotKept(_))
        ));
        let file: OwnedFd = std::fs::File::open("/proc/self/stat").unwrap().into();
        let err = Store::adopt(file, 4096, 4096).unwrap_err();
        assert!(err.to_string().contains("not a memfd"), "{err}");
    }

    #[test]
    fn inherited_descriptors_are_checked_before_they_are_owned() {
        assert!(inherited_fds(&[1]).unwrap_err().contains("standard stream"));
        let open = rustix::io::dup(std::io::stdin()).unwrap();
        let raw = open.as_raw_fd();
        assert!(inherited_fds(&[raw, raw]).unwrap_err().contains("twice"));
        drop(open);
        assert!(inherited_fds(&[raw]).unwrap_err().contains("not open"));
        let handed = rustix::io::dup(std::io::stdin()).unwrap();
        let raw = std::os::fd::IntoRawFd::into_raw_fd(handed);
        let owned = inherited_fds(&[raw]).unwrap();
        assert_eq!(owned[0].as_raw_fd(), raw);
        assert!(rustix::io::fcntl_getfd(&owned[0])
            .unwrap()
            .contains(rustix::io::FdFlags::CLOEXEC));
    }

    #[test]
    fn read_write_and_bounds() {
        let s = Store::new(1 << 20, HugePages::Off).unwrap();
        s.write(4096, b"hello").unwrap();
        let mut b = [0u8; 5];
        s.read(4096, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(s.read((1 << 20) - 2, &mut b).is_err());
        assert!(s.write(u64::MAX, b"x").is_err());
        assert!(matches!(
            Store::new(1000, HugePages::Off),
            Err(StoreError::BadSize(1000))
        ));
    }
}
