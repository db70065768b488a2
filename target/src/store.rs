//! The LUN memory: one anonymous mapping, prefaulted and locked in RAM.
//!
//! Everything unsafe about the LUN memory lives here. The rest of the target
//! sees range-checked copies in and out; the iSER driver sees the base address
//! and length for one memory registration per RDMA device.
//!
//! The same bytes may be written by two hosts' overlapping commands at once,
//! or by the HCA while a thread reads them. A disk may tear such writes, but
//! in Rust's memory model a plain copy racing another access is undefined
//! behaviour. So every access from Rust is an aligned 8-byte atomic (relaxed)
//! load or store of the words it covers, a partial word merged by
//! compare-and-swap: all of them the same size, never mixed with plain
//! accesses, and never a reference into the mapping.
#![allow(unsafe_code)]

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ramslog_common::verbs;

use thiserror::Error;

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
    #[error("cannot map {size} bytes of LUN memory: {source}")]
    Map { size: u64, source: std::io::Error },
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
    len: usize,
    pages: PageKind,
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

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("len", &self.len)
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

impl Store {
    /// Map `size` bytes, prefault them and lock them in RAM.
    pub fn new(size: u64, huge: HugePages) -> Result<Store, StoreError> {
        if size == 0 || !size.is_multiple_of(4096) || size > isize::MAX as u64 {
            return Err(StoreError::BadSize(size));
        }
        let len = size as usize;
        let want_huge = match huge {
            HugePages::Off => false,
            HugePages::Auto | HugePages::Require => {
                let need = size.div_ceil(HUGE_PAGE as u64);
                let free = free_huge_pages();
                if free >= need && len.is_multiple_of(HUGE_PAGE) {
                    true
                } else if huge == HugePages::Require {
                    return Err(StoreError::HugePagesUnavailable { need, free });
                } else {
                    false
                }
            }
        };
        let (ptr, pages) = match Self::map(len, want_huge) {
            Ok(p) => (
                p,
                if want_huge {
                    PageKind::Huge2M
                } else {
                    PageKind::Normal
                },
            ),
            Err(e) if want_huge && huge == HugePages::Auto => {
                tracing::info!("huge page mapping failed ({e}); using normal pages");
                (Self::map(len, false)?, PageKind::Normal)
            }
            Err(e) => return Err(e),
        };
        let store = Store {
            base: ptr,
            len,
            pages,
        };
        // SAFETY: [base, base+len) is the mapping we just created.
        if unsafe { libc::mlock(store.base.as_ptr().cast(), len) } != 0 {
            let source = std::io::Error::last_os_error();
            return Err(StoreError::Mlock {
                size,
                limit: memlock_limit(),
                source,
            });
        }
        Ok(store)
    }

    fn map(len: usize, huge: bool) -> Result<NonNull<u8>, StoreError> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
        if huge {
            flags |= libc::MAP_HUGETLB;
        }
        // SAFETY: anonymous mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(StoreError::Map {
                size: len as u64,
                source: std::io::Error::last_os_error(),
            });
        }
        NonNull::new(p.cast()).ok_or(StoreError::Map {
            size: len as u64,
            source: std::io::Error::other("mmap returned NULL"),
        })
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn page_kind(&self) -> PageKind {
        self.pages
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, StoreError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len as u64 => Ok(offset as usize),
            _ => Err(StoreError::OutOfRange {
                offset,
                len,
                size: self.len as u64,
            }),
        }
    }

    /// The words `w..w + n` of the mapping.
    fn words(&self, w: usize, n: usize) -> &[AtomicU64] {
        assert!(w + n <= self.len / WORD, "word range past the mapping");
        // SAFETY: the mapping is page-aligned and a whole number of pages,
        // so these words (in range, asserted above) are aligned and inside
        // it for as long as `self` lives. Every access to them from Rust is
        // through AtomicU64 (no plain or other-sized access), which may be
        // shared between threads; the HCA's and the kernel's accesses are
        // outside Rust's model.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(w * WORD).cast(), n) }
    }

    /// Splits [off, off + len) into a partial first word, whole words and a
    /// partial last word: (word index, byte range within it) for the
    /// partial ones, (first word, count) for the whole ones.
    #[allow(clippy::type_complexity)]
    fn span(
        off: usize,
        len: usize,
    ) -> (
        Option<(usize, std::ops::Range<usize>)>,
        (usize, usize),
        Option<(usize, std::ops::Range<usize>)>,
    ) {
        let end = off + len;
        let (first, last) = (off.div_ceil(WORD), end / WORD);
        if first > last {
            // Inside one word, touching neither of its ends.
            return (Some((off / WORD, off % WORD..end % WORD)), (first, 0), None);
        }
        let head = (!off.is_multiple_of(WORD)).then_some((off / WORD, off % WORD..WORD));
        let tail = (!end.is_multiple_of(WORD)).then_some((last, 0..end % WORD));
        (head, (first, last - first), tail)
    }

    /// Store `bytes` into the part `within` of word `w`, merged with the
    /// rest of it.
    fn merge(&self, w: usize, within: std::ops::Range<usize>, bytes: &[u8]) {
        let _ = self.words(w, 1)[0].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            let mut v = old.to_ne_bytes();
            v[within.clone()].copy_from_slice(bytes);
            Some(u64::from_ne_bytes(v))
        });
    }

    /// Copy `out.len()` bytes from the LUN at `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), StoreError> {
        let off = self.check(offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let (head, (first, count), tail) = Self::span(off, out.len());
        let mut at = 0;
        if let Some((w, within)) = head {
            let v = self.words(w, 1)[0].load(Ordering::Relaxed).to_ne_bytes();
            at = within.len();
            out[..at].copy_from_slice(&v[within]);
        }
        let body = &mut out[at..at + count * WORD];
        for (word, dst) in self
            .words(first, count)
            .iter()
            .zip(body.chunks_exact_mut(WORD))
        {
            dst.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        if let Some((w, within)) = tail {
            let v = self.words(w, 1)[0].load(Ordering::Relaxed).to_ne_bytes();
            let n = within.len();
            let start = out.len() - n;
            out[start..].copy_from_slice(&v[within]);
        }
        Ok(())
    }

    /// Copy `data` into the LUN at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), StoreError> {
        let off = self.check(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let (head, (first, count), tail) = Self::span(off, data.len());
        let mut at = 0;
        if let Some((w, within)) = head {
            at = within.len();
            self.merge(w, within, &data[..at]);
        }
        let body = &data[at..at + count * WORD];
        for (word, src) in self.words(first, count).iter().zip(body.chunks_exact(WORD)) {
            let mut v = [0u8; WORD];
            v.copy_from_slice(src);
            word.store(u64::from_ne_bytes(v), Ordering::Relaxed);
        }
        if let Some((w, within)) = tail {
            let n = within.len();
            self.merge(w, within, &data[data.len() - n..]);
        }
        Ok(())
    }

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
                self.len,
                verbs::Access::LOCAL_WRITE,
            )
        }?;
        Ok(RdmaRegion {
            mr,
            store: self.clone(),
        })
    }

    /// CRC32C of `len` bytes at `offset`, continuing `seed` (the image's
    /// chunk checksums), read in pieces through a small buffer: a slice over
    /// the mapping would be a reference to memory others may write.
    pub fn crc32c_append(&self, seed: u32, offset: u64, len: usize) -> Result<u32, StoreError> {
        self.check(offset, len)?;
        const PIECE: usize = 64 << 10;
        let mut buf = vec![0u8; PIECE.min(len)];
        let mut crc = seed;
        let mut done = 0usize;
        while done < len {
            let n = PIECE.min(len - done);
            self.read(offset + done as u64, &mut buf[..n])?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            done += n;
        }
        Ok(crc)
    }

    /// One `pwritev` to `file` at `file_offset` of, for each part, its head
    /// (the caller's bytes) followed by `len` bytes of the LUN at `offset`:
    /// the kernel (with O_DIRECT, the device) reads the LUN memory itself,
    /// with no copy through a buffer. A short write is an error.
    pub fn write_parts_to(
        &self,
        file: &std::fs::File,
        file_offset: u64,
        parts: &[(&[u8], u64, usize)],
    ) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        let mut iov = Vec::with_capacity(parts.len() * 2);
        let mut total = 0usize;
        for &(head, offset, len) in parts {
            let off = self
                .check(offset, len)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            iov.push(libc::iovec {
                iov_base: head.as_ptr() as *mut libc::c_void,
                iov_len: head.len(),
            });
            iov.push(libc::iovec {
                // SAFETY: `off` is inside the mapping (checked above).
                iov_base: unsafe { self.base.as_ptr().add(off) }.cast(),
                iov_len: len,
            });
            total += head.len() + len;
        }
        let offset = libc::off_t::try_from(file_offset)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        // SAFETY: every iovec names memory valid for the whole call: the
        // caller's borrowed heads and checked ranges of this mapping, which
        // lives as long as `self`. The kernel only reads them.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                offset,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n as usize != total {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("short write: {n} of {total} bytes (is the disk full?)"),
            ));
        }
        Ok(total)
    }

    /// Set `len` bytes at `offset` to zero.
    pub fn zero(&self, offset: u64, len: usize) -> Result<(), StoreError> {
        let off = self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        const ZEROS: [u8; WORD] = [0; WORD];
        let (head, (first, count), tail) = Self::span(off, len);
        for (w, within) in head.into_iter().chain(tail) {
            let n = within.len();
            self.merge(w, within, &ZEROS[..n]);
        }
        for word in self.words(first, count) {
            word.store(0, Ordering::Relaxed);
        }
        Ok(())
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: unmapping the region this Store owns; nothing refers to it after drop.
        unsafe {
            libc::munlock(self.base.as_ptr().cast(), self.len);
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
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
    pub fn sge(&self, offset: u64, len: u32) -> Option<verbs::Sge> {
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
