//! libibverbs objects: devices, protection domains, memory regions,
//! completion channels and queues, work requests and completions.

use std::ffi::CStr;
use std::fmt;
use std::mem::MaybeUninit;
use std::ops::{BitAnd, BitOr, BitOrAssign};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as ffi;

use super::{set_fd_nonblocking, Error, Result};

// ---------------------------------------------------------------- Device

/// An RDMA device context (`ibv_context`) that librdmacm opened for a
/// [`CmId`](super::CmId); borrowed, never closed by us (see the module
/// documentation on device removal).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    ctx: NonNull<ffi::ibv_context>,
}

// SAFETY: an ibv_context is a process-wide handle; libibverbs serialises the
// calls made through it (query, alloc_pd, create_cq, ...) internally, and
// librdmacm keeps it open for the process lifetime.
unsafe impl Send for Device {}
// SAFETY: see Send; every method takes &self and libibverbs is thread-safe.
unsafe impl Sync for Device {}

/// Limits of a device, from `ibv_query_device` (negative values read as 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceAttrs {
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_mr_size: u64,
    pub max_sge: u32,
}

impl Device {
    pub(crate) fn from_raw(ctx: *mut ffi::ibv_context) -> Option<Device> {
        NonNull::new(ctx).map(|ctx| Device { ctx })
    }

    pub(crate) fn as_ptr(self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }

    fn ibv_device(self) -> *mut ffi::ibv_device {
        // SAFETY: the context is open (type invariant); `device` is set by
        // libibverbs when the context is opened and never changes.
        unsafe { (*self.ctx.as_ptr()).device }
    }

    /// Kernel name of the device, e.g. `mlx5_0` or `rxe0`.
    pub fn name(&self) -> String {
        let dev = self.ibv_device();
        if dev.is_null() {
            return String::new();
        }
        // SAFETY: `dev` is the live ibv_device of an open context.
        let p = unsafe { ffi::ibv_get_device_name(dev) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: `p` points to the NUL-terminated name stored in the
        // ibv_device, which outlives this call; it is copied at once.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Node GUID, in host byte order.
    pub fn guid(&self) -> u64 {
        let dev = self.ibv_device();
        if dev.is_null() {
            return 0;
        }
        // SAFETY: `dev` is the live ibv_device of an open context.
        u64::from_be(unsafe { ffi::ibv_get_device_guid(dev) })
    }

    /// Device limits (`ibv_query_device`).
    pub fn attrs(&self) -> Result<DeviceAttrs> {
        let mut a = MaybeUninit::<ffi::ibv_device_attr>::zeroed();
        // SAFETY: the context is open; `a` is a writable ibv_device_attr.
        let rc = unsafe { ffi::ibv_query_device(self.ctx.as_ptr(), a.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::from_rc("ibv_query_device", rc));
        }
        // SAFETY: all-zero is a valid ibv_device_attr (integers and arrays),
        // and the call filled it in.
        let a = unsafe { a.assume_init() };
        let u = |v: libc::c_int| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttrs {
            max_qp_wr: u(a.max_qp_wr),
            max_cqe: u(a.max_cqe),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
            max_mr_size: a.max_mr_size,
            max_sge: u(a.max_sge),
        })
    }

    /// Address of the `ibv_context`, to tell devices apart.
    pub fn raw_handle(&self) -> usize {
        self.ctx.as_ptr() as usize
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("ctx", &self.ctx)
            .finish()
    }
}

// ---------------------------------------------------------------- PD

/// A protection domain (`ibv_alloc_pd`); deallocated when the last `Arc`
/// goes (memory regions and QPs hold one).
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
    pub fn new(dev: Device) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is open (Device invariant).
        let pd = unsafe { ffi::ibv_alloc_pd(dev.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::last_os_error("ibv_alloc_pd"))?;
        Ok(Arc::new(ProtectionDomain { pd, dev }))
    }

    pub fn device(&self) -> Device {
        self.dev
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
    pub fn sge(&self, offset: usize, len: u32) -> Option<Sge> {
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
pub(crate) fn sge_in(
    base: u64,
    region_len: usize,
    lkey: u32,
    offset: usize,
    len: u32,
) -> Option<Sge> {
    let end = offset.checked_add(usize::try_from(len).ok()?)?;
    if end > region_len {
        return None;
    }
    let addr = base.checked_add(u64::try_from(offset).ok()?)?;
    addr.checked_add(u64::from(len))?;
    Some(Sge { addr, len, lkey })
}

// ---------------------------------------------------------------- buffer

/// Anonymous, page-aligned, zero-filled memory; unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Result<Mapping> {
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
/// given. For message buffers and bounce buffers.
///
/// The HCA writes into this memory (receives, RDMA READ results, remote
/// writes): look at a range with [`bytes`](Self::bytes) only when no work
/// request or remote access that writes it is outstanding. Access is by
/// range (a slot), never the whole buffer at once.
///
/// ```
/// # use ramslog_common::verbs::RegisteredBuffer;
/// fn first_slot(b: &RegisteredBuffer) -> Option<&[u8]> {
///     b.bytes(0..512)
/// }
/// ```
///
/// ```compile_fail,E0599
/// # use ramslog_common::verbs::RegisteredBuffer;
/// // The whole buffer, while the adapter may write other slots: gone.
/// fn everything(b: &RegisteredBuffer) -> &[u8] {
///     b.as_slice()
/// }
/// ```
pub struct RegisteredBuffer {
    // Field order matters: the MR is deregistered before the memory goes.
    mr: MemoryRegion,
    mem: Mapping,
}

// SAFETY: owns its memory and MR; shared access hands out only &[u8], and
// mutable access needs &mut self.
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

    /// The bytes in `range`, or `None` when it is not inside the buffer.
    ///
    /// Only the range is borrowed: the adapter may be writing other parts
    /// of the buffer (other slots' receives) meanwhile. The caller looks
    /// only at a range no outstanding work request or remote access writes.
    pub fn bytes(&self, range: std::ops::Range<usize>) -> Option<&[u8]> {
        if range.start > range.end || range.end > self.mem.len {
            return None;
        }
        // SAFETY: the range lies inside `mem`, a live mapping zero-filled at
        // creation (every byte initialised). The reference covers this range
        // only, which the caller owns for as long as it holds it.
        Some(unsafe {
            std::slice::from_raw_parts(self.mem.ptr.as_ptr().add(range.start), range.len())
        })
    }

    /// The bytes in `range` for writing, or `None` when it is not inside
    /// the buffer. As [`bytes`](Self::bytes); `&mut self` makes this the
    /// only Rust reference into the buffer.
    pub fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> Option<&mut [u8]> {
        if range.start > range.end || range.end > self.mem.len {
            return None;
        }
        // SAFETY: as in `bytes`, and no other Rust reference exists.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.mem.ptr.as_ptr().add(range.start), range.len())
        })
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
    pub fn sge(&self, offset: usize, len: u32) -> Option<Sge> {
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

// ---------------------------------------------------------------- completion channel

/// A completion channel (`ibv_comp_channel`): a file descriptor that becomes
/// readable when an armed CQ gets a completion. Share it with the CQs as an
/// `Arc` ([`CompletionQueue::new`] keeps a clone: a channel cannot be
/// destroyed while CQs use it).
pub struct CompletionChannel {
    ch: NonNull<ffi::ibv_comp_channel>,
    dev: Device,
}

// SAFETY: ibv_get_cq_event is a read(2) on the channel fd plus a lookup;
// it may run on any thread. The channel is destroyed once, in Drop.
unsafe impl Send for CompletionChannel {}
// SAFETY: see Send; concurrent consume_event calls are each a read(2).
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    pub fn new(dev: Device) -> Result<CompletionChannel> {
        // SAFETY: the context is open (Device invariant).
        let ch = unsafe { ffi::ibv_create_comp_channel(dev.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(|| Error::last_os_error("ibv_create_comp_channel"))?;
        Ok(CompletionChannel { ch, dev })
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive; `fd` is set at creation and constant.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        set_fd_nonblocking(self.fd(), on)
    }

    /// After poll(2) says the fd is readable: `ibv_get_cq_event` and
    /// `ibv_ack_cq_events(1)`. `Ok(None)` when there was no event
    /// (non-blocking and EAGAIN, or EINTR); blocks when the channel is
    /// blocking. Otherwise which CQ fired: its index in `cqs`, or
    /// `cqs.len()` for a CQ on this channel that `cqs` does not list (its
    /// event is acknowledged all the same).
    pub fn consume_event(&self, cqs: &[&CompletionQueue]) -> Result<Option<usize>> {
        let mut got: *mut ffi::ibv_cq = ptr::null_mut();
        let mut ctx: *mut libc::c_void = ptr::null_mut();
        // SAFETY: the channel is alive; both out-pointers are valid.
        let rc = unsafe { ffi::ibv_get_cq_event(self.ch.as_ptr(), &mut got, &mut ctx) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(None),
                _ => Err(Error::new("ibv_get_cq_event", e)),
            };
        }
        if got.is_null() {
            return Err(Error::from_errno("ibv_get_cq_event", libc::EIO));
        }
        let fired = cqs
            .iter()
            .position(|cq| cq.as_ptr() == got)
            .unwrap_or(cqs.len());
        // SAFETY: `got` is the CQ the event was reported for. A CQ with an
        // unacknowledged event cannot finish ibv_destroy_cq (libibverbs
        // waits for the ack), so it is alive here.
        unsafe { ffi::ibv_ack_cq_events(got, 1) };
        Ok(Some(fired))
    }

    pub fn device(&self) -> Device {
        self.dev
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: we own the channel; no CQ uses it (each holds an Arc to
        // us). Errors are ignored.
        let _ = unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) };
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

// ---------------------------------------------------------------- CQ

/// Most completions [`CompletionQueue::poll`] asks the provider for at a
/// time (the size of its stack array of `ibv_wc`).
pub const MAX_POLL_BATCH: usize = 32;

/// A completion queue (`ibv_create_cq`), destroyed when the last `Arc` goes
/// (QPs using it hold one).
pub struct CompletionQueue {
    cq: NonNull<ffi::ibv_cq>,
    dev: Device,
    cqe: u32,
    _channel: Option<Arc<CompletionChannel>>,
}

// SAFETY: ibv_poll_cq / ibv_req_notify_cq are thread-safe in libibverbs
// providers (they lock the CQ); the CQ is destroyed once, in Drop.
unsafe impl Send for CompletionQueue {}
// SAFETY: see Send. (Concurrent pollers are memory-safe but split the
// completions between them; the user serialises polling.)
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A CQ with room for at least `cqe` completions, optionally reporting
    /// to `channel` (which must belong to the same device).
    pub fn new(
        dev: Device,
        cqe: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>> {
        let n = libc::c_int::try_from(cqe)
            .map_err(|_| Error::from_errno("ibv_create_cq", libc::EINVAL))?;
        let ch = match channel {
            Some(c) if c.dev != dev => {
                return Err(Error::from_errno("ibv_create_cq", libc::EINVAL))
            }
            Some(c) => c.ch.as_ptr(),
            None => ptr::null_mut(),
        };
        // SAFETY: the context is open; `ch` is null or a live channel of the
        // same context, kept alive by the Arc stored below.
        let cq = unsafe { ffi::ibv_create_cq(dev.as_ptr(), n, ptr::null_mut(), ch, 0) };
        let cq = NonNull::new(cq).ok_or_else(|| Error::last_os_error("ibv_create_cq"))?;
        // SAFETY: `cq` was just created; `cqe` holds the real size.
        let real = unsafe { cq.as_ref() }.cqe;
        Ok(Arc::new(CompletionQueue {
            cq,
            dev,
            cqe: u32::try_from(real).unwrap_or(cqe),
            _channel: channel.cloned(),
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    pub fn device(&self) -> Device {
        self.dev
    }

    /// The CQ's real capacity (at least what was asked for).
    pub fn capacity(&self) -> u32 {
        self.cqe
    }

    /// Arm the CQ: the next completion signals the completion channel
    /// (`ibv_req_notify_cq`, solicited_only = 0). Poll once more after
    /// arming, or a completion that raced the arming is missed.
    pub fn req_notify(&self) -> Result<()> {
        let cq = self.cq.as_ptr();
        // SAFETY: the CQ is alive; its context pointer is set by libibverbs
        // and valid while the CQ exists.
        let f = unsafe { (*(*cq).context).ops.req_notify_cq };
        let Some(f) = f else {
            return Err(Error::from_errno("ibv_req_notify_cq", libc::EOPNOTSUPP));
        };
        // SAFETY: the provider's own req_notify_cq on its own live CQ (what
        // the inline ibv_req_notify_cq does).
        let rc = unsafe { f(cq, 0) };
        if rc != 0 {
            return Err(Error::from_rc("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Reap completions into `out`; returns how many were written. Asks the
    /// provider for up to [`MAX_POLL_BATCH`] at a time and keeps going until
    /// `out` is full or the CQ is empty, so a return value below
    /// `out.len()` means the CQ was drained. No allocation.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let cq = self.cq.as_ptr();
        // SAFETY: the CQ is alive; its context pointer is valid while it is.
        let f = unsafe { (*(*cq).context).ops.poll_cq };
        let Some(f) = f else {
            return Err(Error::from_errno("ibv_poll_cq", libc::EOPNOTSUPP));
        };
        let mut wcs = MaybeUninit::<[ffi::ibv_wc; MAX_POLL_BATCH]>::uninit();
        let base = wcs.as_mut_ptr().cast::<ffi::ibv_wc>();
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(MAX_POLL_BATCH);
            // want <= MAX_POLL_BATCH, so the cast cannot truncate.
            // SAFETY: the provider's own poll_cq on its live CQ, writing at
            // most `want` entries into our stack array of MAX_POLL_BATCH.
            let rc = unsafe { f(cq, want as libc::c_int, base) };
            if rc < 0 {
                return Err(Error::from_rc("ibv_poll_cq", rc));
            }
            let got = usize::try_from(rc).unwrap_or(0).min(want);
            for i in 0..got {
                // SAFETY: the provider initialised the first `got` entries.
                let wc = unsafe { &*base.add(i) };
                out[done + i] = WorkCompletion::from_raw(wc);
            }
            done += got;
            if got < want {
                break;
            }
        }
        Ok(done)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: we own the CQ; no QP uses it any more (each holds an Arc
        // to us). Errors are ignored.
        let _ = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cq", &self.cq)
            .field("capacity", &self.cqe)
            .finish()
    }
}

// ---------------------------------------------------------------- work completions

/// What a completed work request did. Meaningful only when the completion
/// succeeded: for a failed one the verbs define only `wr_id`, `status` and
/// `vendor_err` (encode the kind in `wr_id`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WcOpcode {
    #[default]
    Send,
    RdmaWrite,
    RdmaRead,
    Recv,
    Other(u32),
}

impl WcOpcode {
    fn from_raw(op: u32) -> WcOpcode {
        use ffi::ibv_wc_opcode as o;
        match op {
            o::IBV_WC_SEND => WcOpcode::Send,
            o::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            o::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            o::IBV_WC_RECV => WcOpcode::Recv,
            other => WcOpcode::Other(other),
        }
    }
}

/// A work request's id, the one encoding every user of this module shares:
/// what kind of request it was (each user numbers its own kinds) and which
/// slot of that kind it used. A completion hands it back unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WrId {
    pub kind: u32,
    pub slot: u32,
}

impl WrId {
    pub const fn new(kind: u32, slot: u32) -> WrId {
        WrId { kind, slot }
    }

    pub(crate) const fn to_raw(self) -> u64 {
        ((self.kind as u64) << 32) | self.slot as u64
    }

    pub(crate) const fn from_raw(raw: u64) -> WrId {
        WrId {
            kind: (raw >> 32) as u32,
            slot: raw as u32,
        }
    }
}

/// How a work request ended (`ibv_wc_status`), named where a user acts on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WcStatus {
    #[default]
    Success,
    /// A receive buffer was too small for the message (`IBV_WC_LOC_LEN_ERR`).
    LocalLength,
    /// The queue pair went to the error state with the request still queued
    /// (`IBV_WC_WR_FLUSH_ERR`): a disconnect, not a fault of this request.
    Flushed,
    /// Any other failure, by its `ibv_wc_status` number.
    Other(u32),
}

impl WcStatus {
    pub(crate) fn from_raw(status: u32) -> WcStatus {
        use ffi::ibv_wc_status as s;
        match status {
            s::IBV_WC_SUCCESS => WcStatus::Success,
            s::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
            s::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
            other => WcStatus::Other(other),
        }
    }

    /// The `ibv_wc_status` number.
    pub fn raw(self) -> u32 {
        use ffi::ibv_wc_status as s;
        match self {
            WcStatus::Success => s::IBV_WC_SUCCESS,
            WcStatus::LocalLength => s::IBV_WC_LOC_LEN_ERR,
            WcStatus::Flushed => s::IBV_WC_WR_FLUSH_ERR,
            WcStatus::Other(other) => other,
        }
    }
}

/// One completion (the parts of `ibv_wc` an RC user needs).
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkCompletion {
    pub wr_id: WrId,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// Bytes received (receive completions only).
    pub byte_len: u32,
    pub vendor_err: u32,
}

impl WorkCompletion {
    fn from_raw(wc: &ffi::ibv_wc) -> WorkCompletion {
        WorkCompletion {
            wr_id: WrId::from_raw(wc.wr_id),
            status: WcStatus::from_raw(wc.status),
            opcode: WcOpcode::from_raw(wc.opcode),
            byte_len: wc.byte_len,
            vendor_err: wc.vendor_err,
        }
    }

    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }

    /// Text for `status` (`ibv_wc_status_str`).
    pub fn status_str(&self) -> &'static str {
        // SAFETY: ibv_wc_status_str accepts any value and returns a pointer
        // to a static string in libibverbs (or "unknown").
        let p = unsafe { ffi::ibv_wc_status_str(self.status.raw()) };
        if p.is_null() {
            return "unknown";
        }
        // SAFETY: `p` is a NUL-terminated string in libibverbs' read-only
        // data, which stays mapped for the life of the process (the library
        // is linked, never unloaded).
        let s: &'static CStr = unsafe { CStr::from_ptr(p) };
        s.to_str().unwrap_or("unknown")
    }
}

// ---------------------------------------------------------------- work requests

/// A scatter/gather entry: `len` bytes at `addr` in a region with `lkey`.
///
/// Made only by [`MemoryRegion::sge`] and [`RegisteredBuffer::sge`], which
/// check the range against the registered memory: safe code cannot point
/// the adapter at memory it does not own. The default is the empty entry
/// (no bytes), a placeholder to be overwritten before posting.
///
/// ```
/// use ramslog_common::verbs::{RegisteredBuffer, Sge};
/// // The way to an entry: a range of registered memory, checked.
/// fn slot(b: &RegisteredBuffer, i: usize) -> Option<Sge> {
///     b.sge(i * 512, 512)
/// }
/// ```
///
/// ```compile_fail,E0451
/// // Any address and key from safe code: refused by the compiler.
/// let _ = ramslog_common::verbs::Sge { addr: 0x1000, len: 4096, lkey: 1 };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    addr: u64,
    len: u32,
    lkey: u32,
}

impl Sge {
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
}

/// The send-queue operations we use. (Never SEND_WITH_INV: the target
/// never lets an initiator invalidate its keys.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    Send,
    /// Write the local `sge` to the peer's `remote_addr` (`rkey`).
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
    },
    /// Read the peer's `remote_addr` (`rkey`) into the local `sge`.
    RdmaRead {
        remote_addr: u64,
        rkey: u32,
    },
}

/// One send-queue work request with a single SGE (`len == 0`: no SGE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: WrId,
    pub op: SendOp,
    pub sge: Sge,
    /// Generate a completion (the QP has sq_sig_all = 0).
    pub signaled: bool,
    /// Copy the data into the WQE (`IBV_SEND_INLINE`): the buffer is free as
    /// soon as the post returns and needs no valid lkey. SEND and RDMA WRITE
    /// only, up to the QP's `max_inline_data`.
    pub inline: bool,
}

/// One receive work request with a single SGE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: WrId,
    pub sge: Sge,
}

/// A batch post that failed part-way: the first `posted` work requests were
/// posted (they complete normally, or flushed when the QP goes down); the
/// rest were not.
#[derive(Debug, thiserror::Error)]
#[error("{error} ({posted} work requests were posted before the failure)")]
pub struct PostError {
    pub posted: usize,
    pub error: Error,
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Error {
        e.error
    }
}

const SEND_CHUNK: usize = 16;
const RECV_CHUNK: usize = 64;

fn raw_sge(s: &Sge) -> ffi::ibv_sge {
    ffi::ibv_sge {
        addr: s.addr,
        length: s.len,
        lkey: s.lkey,
    }
}

/// Index of `bad` among the `n` elements starting at `base`, if it points
/// at one of them.
fn index_of<T>(base: *const T, n: usize, bad: *const T) -> Option<usize> {
    let size = std::mem::size_of::<T>();
    let (start, b) = (base as usize, bad as usize);
    if size == 0 || b < start {
        return None;
    }
    let i = (b - start) / size;
    (i < n).then_some(i)
}

/// Post `wrs` on `qp`'s send queue, chained in chunks of SEND_CHUNK built on
/// the stack.
pub(crate) fn post_send(
    qp: NonNull<ffi::ibv_qp>,
    wrs: &[SendWr],
) -> std::result::Result<(), PostError> {
    const OP: &str = "ibv_post_send";
    let qp = qp.as_ptr();
    // SAFETY: the QP is alive (owned by the calling CmId); its context
    // pointer is set by libibverbs and valid while the QP exists.
    let f = unsafe { (*(*qp).context).ops.post_send };
    let Some(f) = f else {
        return Err(PostError {
            posted: 0,
            error: Error::from_errno(OP, libc::EOPNOTSUPP),
        });
    };
    // SAFETY: all-zero is a valid ibv_send_wr (null pointers, zero integers,
    // unions of plain data).
    let mut raw: [ffi::ibv_send_wr; SEND_CHUNK] = unsafe { MaybeUninit::zeroed().assume_init() };
    let mut sges = [ffi::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    }; SEND_CHUNK];
    // Every access below goes through these two pointers, so the links
    // between the entries stay valid.
    let wr_base = raw.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    let mut posted = 0;
    for chunk in wrs.chunks(SEND_CHUNK) {
        let n = chunk.len();
        for (i, w) in chunk.iter().enumerate() {
            let (opcode, remote_addr, rkey) = match w.op {
                SendOp::Send => (ffi::ibv_wr_opcode::IBV_WR_SEND, 0, 0),
                SendOp::RdmaWrite { remote_addr, rkey } => {
                    (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, remote_addr, rkey)
                }
                SendOp::RdmaRead { remote_addr, rkey } => {
                    if w.inline {
                        return Err(PostError {
                            posted,
                            error: Error::from_errno(OP, libc::EINVAL),
                        });
                    }
                    (ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, remote_addr, rkey)
                }
            };
            let mut flags = 0;
            if w.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if w.inline {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            // SAFETY: i < n <= SEND_CHUNK, so entry i (and i + 1 when
            // i + 1 < n) is inside `raw` / `sges`, which outlive this loop.
            unsafe {
                sge_base.add(i).write(raw_sge(&w.sge));
                let r = wr_base.add(i);
                (*r).wr_id = w.wr_id.to_raw();
                (*r).next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    ptr::null_mut()
                };
                (*r).sg_list = sge_base.add(i);
                // A zero-length SGE means 2 GiB on some HCAs: post none.
                (*r).num_sge = if w.sge.len == 0 { 0 } else { 1 };
                (*r).opcode = opcode;
                (*r).send_flags = flags;
                (*r).wr.rdma = ffi::rdma_t { remote_addr, rkey };
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the provider's post_send on its live QP (what the inline
        // ibv_post_send does). The chain of `n` WRs and their SGEs lives on
        // our stack across the call; the provider copies them into the WQ.
        let rc = unsafe { f(qp, wr_base, &mut bad) };
        if rc != 0 {
            let ok = index_of(wr_base, n, bad).unwrap_or(0);
            return Err(PostError {
                posted: posted + ok,
                error: Error::from_rc(OP, rc),
            });
        }
        posted += n;
    }
    Ok(())
}

/// Post `wrs` on `qp`'s receive queue, chained in chunks of RECV_CHUNK built
/// on the stack.
pub(crate) fn post_recv(
    qp: NonNull<ffi::ibv_qp>,
    wrs: &[RecvWr],
) -> std::result::Result<(), PostError> {
    const OP: &str = "ibv_post_recv";
    let qp = qp.as_ptr();
    // SAFETY: the QP is alive (owned by the calling CmId); its context
    // pointer is valid while the QP exists.
    let f = unsafe { (*(*qp).context).ops.post_recv };
    let Some(f) = f else {
        return Err(PostError {
            posted: 0,
            error: Error::from_errno(OP, libc::EOPNOTSUPP),
        });
    };
    let mut raw = [ffi::ibv_recv_wr {
        wr_id: 0,
        next: ptr::null_mut(),
        sg_list: ptr::null_mut(),
        num_sge: 0,
    }; RECV_CHUNK];
    let mut sges = [ffi::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    }; RECV_CHUNK];
    let wr_base = raw.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    let mut posted = 0;
    for chunk in wrs.chunks(RECV_CHUNK) {
        let n = chunk.len();
        for (i, w) in chunk.iter().enumerate() {
            // SAFETY: i < n <= RECV_CHUNK, so entry i (and i + 1 when
            // i + 1 < n) is inside `raw` / `sges`, which outlive this loop.
            unsafe {
                sge_base.add(i).write(raw_sge(&w.sge));
                wr_base.add(i).write(ffi::ibv_recv_wr {
                    wr_id: w.wr_id.to_raw(),
                    next: if i + 1 < n {
                        wr_base.add(i + 1)
                    } else {
                        ptr::null_mut()
                    },
                    sg_list: sge_base.add(i),
                    num_sge: if w.sge.len == 0 { 0 } else { 1 },
                });
            }
        }
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the provider's post_recv on its live QP (what the inline
        // ibv_post_recv does); the chain lives on our stack across the call.
        let rc = unsafe { f(qp, wr_base, &mut bad) };
        if rc != 0 {
            let ok = index_of(wr_base, n, bad).unwrap_or(0);
            return Err(PostError {
                posted: posted + ok,
                error: Error::from_rc(OP, rc),
            });
        }
        posted += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
