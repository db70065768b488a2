//! Reads and writes of the LUN memory: every access an aligned 8-byte
//! atomic of the words it covers, a partial word merged by compare-and-swap
//! (see the module above for why), and checksums over it.
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Store, StoreError, SMALL_CRC_BYTES, WORD};

impl Store {
    pub(super) fn check(&self, offset: u64, len: usize) -> Result<usize, StoreError> {
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
    pub(super) fn words(&self, w: usize, n: usize) -> &[AtomicU64] {
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
    pub(super) fn span(
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
    pub(super) fn merge(&self, w: usize, within: std::ops::Range<usize>, bytes: &[u8]) {
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

    /// CRC32C of at most [`SMALL_CRC_BYTES`] bytes at `offset`, through a
    /// buffer on the stack (the write path's page checksums: no allocation).
    pub fn crc32c_small(&self, offset: u64, len: usize) -> Result<u32, StoreError> {
        let mut buf = [0u8; SMALL_CRC_BYTES];
        let piece = buf.get_mut(..len).ok_or(StoreError::OutOfRange {
            offset,
            len,
            size: self.len as u64,
        })?;
        self.read(offset, piece)?;
        Ok(crc32c::crc32c(piece))
    }

    /// The aligned 8-byte word `index` of the memory (counters and
    /// checksums kept in it), `None` past its end.
    pub fn word(&self, index: usize) -> Option<&AtomicU64> {
        (index < self.len / WORD).then(|| &self.words(index, 1)[0])
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
