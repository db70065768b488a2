//! Protection domains, access flags, memory regions and registered buffers.

use super::*;

// ---------------------------------------------------------------- PD

/// A protection domain (`ibv_alloc_pd`); deallocated when the last `Arc`
/// goes (memory regions and QPs hold one). Keeps its device open.
pub struct ProtectionDomain {
    pd: NonNull<ffi::ibv_pd>,
    dev: Device,
}

// SAFETY: the PD is only used as an argument to thread-safe verbs calls
// (reg_mr, create_qp) and freed once, in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see Send.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(dev: &Device) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is open (held by `dev`).
        let pd = unsafe { ffi::ibv_alloc_pd(dev.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::last_os_error("ibv_alloc_pd"))?;
        Ok(Arc::new(ProtectionDomain {
            pd,
            dev: dev.clone(),
        }))
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: we own the PD; nothing uses it any more (MRs and QPs hold
        // an Arc to us, so they are gone). Errors are ignored.
        let _ = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("pd", &self.pd)
            .finish()
    }
}

// ---------------------------------------------------------------- Access

/// Memory region access flags (`IBV_ACCESS_*`). Local read is implied.
/// Remote write needs local write too (the verbs reject it otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Access(u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    pub const REMOTE_WRITE: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    pub const REMOTE_READ: Access = Access(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);

    /// No flag: local read only.
    pub const fn empty() -> Access {
        Access(0)
    }
    pub const fn bits(self) -> u32 {
        self.0
    }
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// True when every flag of `other` is set in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

impl BitAnd for Access {
    type Output = Access;
    fn bitand(self, rhs: Access) -> Access {
        Access(self.0 & rhs.0)
    }
}

// ---------------------------------------------------------------- MR

/// A registered memory region (`ibv_reg_mr`); deregistered on drop.
pub struct MemoryRegion {
    mr: NonNull<ffi::ibv_mr>,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the MR handle is only read (keys cached at registration) and
// freed once, in Drop; ibv_dereg_mr may run on any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: see Send; no method mutates anything.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Register `[ptr, ptr + len)` with `access`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` stays valid and mapped for the MR's whole life
    /// (until it is dropped). With remote or local write access, the HCA
    /// writes into that memory behind the compiler's back: whoever reads it
    /// must not hold Rust references across outstanding work requests or
    /// remote access windows that write it.
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        if ptr.is_null() || len == 0 {
            return Err(Error::from_errno("ibv_reg_mr", libc::EINVAL));
        }
        let flags = libc::c_int::try_from(access.bits())
            .map_err(|_| Error::from_errno("ibv_reg_mr", libc::EINVAL))?;
        // SAFETY: the PD is alive (we hold an Arc to it from here on); the
        // caller guarantees the range stays valid for the MR's life.
        let mr = unsafe { ffi::ibv_reg_mr(pd.as_ptr(), ptr.cast(), len, flags) };
        let mr = NonNull::new(mr).ok_or_else(|| Error::last_os_error("ibv_reg_mr"))?;
        // SAFETY: `mr` was just returned by ibv_reg_mr and is valid.
        let m = unsafe { mr.as_ref() };
        Ok(MemoryRegion {
            mr,
            lkey: m.lkey,
            rkey: m.rkey,
            addr: m.addr as u64,
            len: m.length,
            _pd: Arc::clone(pd),
        })
    }

    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// Start address of the region (as registered).
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A scatter/gather entry for `[offset, offset + len)` of this region,
    /// or `None` when that range is not inside it.
    pub fn sge(&self, offset: usize, len: u32) -> Option<Sge<'_>> {
        sge_in(self.addr, self.len, self.lkey, offset, len)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: we own the MR and deregister it once. Errors are ignored.
        let _ = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

/// `[offset, offset + len)` inside a region of `region_len` bytes at `base`.
pub(crate) fn sge_in<'r>(
    base: u64,
    region_len: usize,
    lkey: u32,
    offset: usize,
    len: u32,
) -> Option<Sge<'r>> {
    let end = offset.checked_add(usize::try_from(len).ok()?)?;
    if end > region_len {
        return None;
    }
    let addr = base.checked_add(u64::try_from(offset).ok()?)?;
    addr.checked_add(u64::from(len))?;
    Some(Sge {
        addr,
        len,
        lkey,
        region: std::marker::PhantomData,
    })
}

// ---------------------------------------------------------------- buffer

/// Anonymous, page-aligned, zero-filled memory; unmapped on drop.
pub(super) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    pub(super) fn new(len: usize) -> Result<Mapping> {
        if len == 0 {
            return Err(Error::from_errno("mmap", libc::EINVAL));
        }
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // affected.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os_error("mmap"));
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::from_errno("mmap", libc::EIO))?;
        Ok(Mapping { ptr, len })
    }

    /// Copy `out.len()` bytes from `offset` into `out`; `None` (nothing
    /// copied) when the range is not inside the buffer.
    fn read(&self, offset: usize, out: &mut [u8]) -> Option<()> {
        let end = offset.checked_add(out.len())?;
        if end > self.len {
            return None;
        }
        // SAFETY: [offset, end) is inside the live mapping.
        let src = unsafe { self.ptr.as_ptr().add(offset) };
        let mut i = 0;
        while i < out.len() {
            // SAFETY: src + i is inside the mapping (i < out.len()). Volatile
            // reads through a raw pointer make no reference, so the adapter
            // may write these bytes meanwhile; whole aligned words where they
            // fit (the mapping is page-aligned), single bytes around them.
            unsafe {
                let p = src.add(i);
                if (p as usize).is_multiple_of(8) && out.len() - i >= 8 {
                    let w = p.cast::<u64>().read_volatile();
                    out[i..i + 8].copy_from_slice(&w.to_ne_bytes());
                    i += 8;
                } else {
                    out[i] = p.read_volatile();
                    i += 1;
                }
            }
        }
        Some(())
    }

    /// Copy `data` to `offset`; `None` (nothing copied) when the range is
    /// not inside the buffer.
    fn write(&self, offset: usize, data: &[u8]) -> Option<()> {
        let end = offset.checked_add(data.len())?;
        if end > self.len {
            return None;
        }
        // SAFETY: [offset, end) is inside the live mapping.
        let dst = unsafe { self.ptr.as_ptr().add(offset) };
        let mut i = 0;
        while i < data.len() {
            // SAFETY: dst + i is inside the mapping; volatile stores through a
            // raw pointer make no reference, words where aligned as in `read`.
            unsafe {
                let p = dst.add(i);
                if (p as usize).is_multiple_of(8) && data.len() - i >= 8 {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&data[i..i + 8]);
                    p.cast::<u64>().write_volatile(u64::from_ne_bytes(w));
                    i += 8;
                } else {
                    p.write_volatile(data[i]);
                    i += 1;
                }
            }
        }
        Some(())
    }

    /// Fill `len` bytes from `offset` with `byte`; `None` when the range is
    /// not inside the buffer.
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Option<()> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        for i in offset..end {
            // SAFETY: inside the live mapping, as in `write`.
            unsafe { self.ptr.as_ptr().add(i).write_volatile(byte) };
        }
        Some(())
    }

    /// The byte at `offset` by a volatile load, `None` past the end.
    fn load_volatile(&self, offset: usize) -> Option<u8> {
        if offset >= self.len {
            return None;
        }
        // SAFETY: offset < len, so the byte is inside the live mapping, and
        // initialised (zero-filled at creation). A volatile read through a
        // raw pointer makes no Rust reference, so the HCA may write the byte
        // concurrently (the value read is then the old or the new one).
        Some(unsafe { self.ptr.as_ptr().add(offset).read_volatile() })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping we created; the MR on it is
        // already deregistered (RegisteredBuffer drops `mr` before `mem`).
        let _ = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Owned page-aligned memory, registered with `LOCAL_WRITE` plus the access
/// given. For memory the adapter or a peer may write at any time: remote
/// windows, bounce buffers, the message buffers of tools.
///
/// Rust never holds a reference into it: [`read`](Self::read) and
/// [`write`](Self::write) copy with volatile loads and stores, sound while
/// the adapter writes the same bytes (the copy may then be torn: look only
/// after a completion says the bytes are in place). For slots Rust reads in
/// place, see [`SlotBuffer`](crate::verbs::SlotBuffer).
///
/// ```
/// # use ramslog_common::verbs::RegisteredBuffer;
/// fn first_byte(b: &RegisteredBuffer) -> Option<u8> {
///     let mut out = [0u8; 1];
///     b.read(0, &mut out)?;
///     Some(out[0])
/// }
/// ```
///
/// ```compile_fail,E0599
/// # use ramslog_common::verbs::RegisteredBuffer;
/// // A slice over memory the adapter may be writing: gone.
/// fn slot(b: &RegisteredBuffer) -> Option<&[u8]> {
///     b.bytes(0..512)
/// }
/// ```
pub struct RegisteredBuffer {
    // Field order matters: the MR is deregistered before the memory goes.
    mr: MemoryRegion,
    mem: Mapping,
}

// SAFETY: owns its memory and MR; every access is a volatile copy through a
// raw pointer, which makes no reference (concurrent copies race benignly,
// as the adapter's writes do).
unsafe impl Send for RegisteredBuffer {}
// SAFETY: see Send.
unsafe impl Sync for RegisteredBuffer {}

impl RegisteredBuffer {
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize, access: Access) -> Result<RegisteredBuffer> {
        let mem = Mapping::new(len)?;
        // SAFETY: the mapping lives as long as the MR: both are fields of
        // the RegisteredBuffer, and `mr` is dropped first.
        let mr = unsafe {
            MemoryRegion::register(pd, mem.ptr.as_ptr(), len, access | Access::LOCAL_WRITE)?
        };
        Ok(RegisteredBuffer { mr, mem })
    }

    /// Copy `out.len()` bytes from `offset` into `out`; `None` (nothing
    /// copied) when the range is not inside the buffer.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Option<()> {
        self.mem.read(offset, out)
    }

    /// Copy `data` to `offset`; `None` (nothing copied) when the range is
    /// not inside the buffer.
    pub fn write(&self, offset: usize, data: &[u8]) -> Option<()> {
        self.mem.write(offset, data)
    }

    /// Fill `len` bytes from `offset` with `byte`; `None` when the range is
    /// not inside the buffer.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Option<()> {
        self.mem.fill(offset, len, byte)
    }

    /// Raw pointer to the start, for callers that do their own
    /// synchronisation with the HCA (e.g. volatile reads).
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.ptr.as_ptr()
    }

    /// The byte at `offset`, read with a volatile load (`None` past the
    /// end): for polling a byte the peer RDMA-WRITEs while the region is
    /// open to it, as perftest's ib_write_lat polls the last byte of its
    /// buffer. Makes no Rust reference into the memory, so it is sound while
    /// the HCA writes it; it orders nothing else (look at the rest of the
    /// buffer only after a completion or another synchronisation).
    pub fn load_volatile(&self, offset: usize) -> Option<u8> {
        self.mem.load_volatile(offset)
    }

    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    pub fn len(&self) -> usize {
        self.mem.len
    }
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }
    pub fn mr(&self) -> &MemoryRegion {
        &self.mr
    }

    /// A scatter/gather entry for `[offset, offset + len)`, or `None` when
    /// that range is not inside the buffer.
    pub fn sge(&self, offset: usize, len: u32) -> Option<Sge<'_>> {
        self.mr.sge(offset, len)
    }
}

impl fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("mr", &self.mr)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_copies_in_and_out_at_any_alignment() {
        let m = Mapping::new(4096).unwrap();
        let data: Vec<u8> = (0..100u8).collect();
        for offset in [0, 1, 7, 8, 9, 4096 - 100] {
            for len in [0, 1, 7, 8, 9, 17, 100] {
                m.fill(0, 4096, 0xee).unwrap();
                m.write(offset, &data[..len]).unwrap();
                let mut back = vec![0u8; len + 2];
                let start = offset.saturating_sub(1);
                let n = (len + 2).min(4096 - start);
                m.read(start, &mut back[..n]).unwrap();
                let lead = offset - start;
                assert_eq!(
                    &back[lead..lead + len],
                    &data[..len],
                    "offset {offset} len {len}"
                );
                if lead == 1 {
                    assert_eq!(back[0], 0xee, "the byte before, offset {offset} len {len}");
                }
                if lead + len < n {
                    assert_eq!(
                        back[lead + len],
                        0xee,
                        "the byte after, offset {offset} len {len}"
                    );
                }
            }
        }
        let mut one = [0u8; 1];
        assert_eq!(m.read(4096, &mut one), None);
        assert_eq!(m.write(4095, &[1, 2]), None);
        assert_eq!(m.fill(usize::MAX, 2, 0), None);
        assert_eq!(m.read(usize::MAX, &mut one), None);
    }

    #[test]
    fn mapping_load_volatile() {
        let m = Mapping::new(4096).unwrap();
        assert_eq!(m.load_volatile(0), Some(0));
        assert_eq!(m.load_volatile(4095), Some(0));
        assert_eq!(m.load_volatile(4096), None);
        assert_eq!(m.load_volatile(usize::MAX), None);
        // SAFETY: writing one byte inside the mapping we own; no reference
        // into it exists.
        unsafe { m.ptr.as_ptr().add(4095).write_volatile(0xa5) };
        assert_eq!(m.load_volatile(4095), Some(0xa5));
    }
}
