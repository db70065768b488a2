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

/// An RDMA device context (`ibv_context`) that librdmacm opened, held open
/// for as long as this handle or a clone of it lives.
///
/// librdmacm closes a hot-removed device's context once nothing counts on it
/// any more, and it counts two kinds of holders: the ids bound to the device
/// and each entry of a list from `rdma_get_devices` until that list is freed
/// (`librdmacm/cma.c`, `rdma_get_devices`, `rdma_free_devices` and
/// `ucma_put_device`, rdma-core 31 and later). A `Device` is such a
/// one-entry list, so everything made from it (protection domains, CQs,
/// completion channels: each keeps a clone) can never outlive its context,
/// and two live handles are equal exactly when they name the same context
/// (an address cannot be reused while a handle keeps it allocated).
///
/// Handles are cloned (each clone counts), never copied:
///
/// ```
/// # use ramslog_common::verbs::Device;
/// fn another(d: &Device) -> Device {
///     d.clone()
/// }
/// ```
///
/// ```compile_fail,E0507
/// # use ramslog_common::verbs::Device;
/// // A bitwise copy would not count as a holder: Device is not Copy.
/// fn another(d: &Device) -> Device {
///     *d
/// }
/// ```
#[derive(Clone)]
pub struct Device {
    held: Arc<HeldContext>,
}

/// A one-entry, NULL-terminated list in the form `rdma_free_devices` takes:
/// librdmacm counts the entry as a holder of the context until it is freed.
struct HeldContext {
    ctx: NonNull<ffi::ibv_context>,
    list: NonNull<*mut ffi::ibv_context>,
}

// SAFETY: an ibv_context is a process-wide handle; libibverbs serialises the
// calls made through it (query, alloc_pd, create_cq, ...) internally. The
// list is touched only once, by rdma_free_devices in Drop (which takes
// librdmacm's lock).
unsafe impl Send for HeldContext {}
// SAFETY: see Send; nothing reachable through &HeldContext mutates.
unsafe impl Sync for HeldContext {}

impl Drop for HeldContext {
    fn drop(&mut self) {
        // SAFETY: `list` is a NULL-terminated array allocated with malloc(3)
        // holding one context counted by librdmacm (see `Device::hold`);
        // rdma_free_devices uncounts it and frees the array, once.
        unsafe { ffi::rdma_free_devices(self.list.as_ptr()) };
    }
}

/// Let librdmacm notice removed devices (it rescans the kernel's list) and
/// close the contexts of those that no id or [`Device`] holds any more.
///
/// librdmacm opens a context per device as it first needs it (and for every
/// device once anything asks for its device list) and closes a context only
/// after it saw the device gone. On providers that cannot detach a process
/// from a removed device (SoftRoCE among them), the kernel waits for that
/// close to finish the removal, so a process that holds RDMA resources
/// rescans now and then: removing a device it does not hold then completes
/// within one interval.
pub fn rescan_devices() -> Result<()> {
    with_device_list(|_| ())
}

/// `f` over librdmacm's current device list (`rdma_get_devices`).
fn with_device_list<T>(f: impl FnOnce(&[*mut ffi::ibv_context]) -> T) -> Result<T> {
    let mut n: libc::c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::rdma_get_devices(&mut n) };
    let Some(list) = NonNull::new(list) else {
        return Err(Error::last_os_error("rdma_get_devices"));
    };
    let n = usize::try_from(n).unwrap_or(0);
    // SAFETY: librdmacm returned `n` entries followed by a NULL; the slice
    // is only used before the list is freed.
    let out = f(unsafe { std::slice::from_raw_parts(list.as_ptr(), n) });
    // SAFETY: the list from rdma_get_devices, freed once.
    unsafe { ffi::rdma_free_devices(list.as_ptr()) };
    Ok(out)
}

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
    /// Count a holder of `ctx`, a context librdmacm opened, for the life of
    /// the handle. ENODEV when librdmacm no longer lists it (the device was
    /// removed): nothing new is made on a removed device.
    ///
    /// The caller keeps `ctx` open during the call (an id bound to it).
    pub(crate) fn hold(ctx: *mut ffi::ibv_context) -> Result<Device> {
        let Some(ctx) = NonNull::new(ctx) else {
            return Err(Error::from_errno("rdma_get_devices", libc::ENODEV));
        };
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the call counts every listed
        // context as held until the list is passed to rdma_free_devices.
        let list = unsafe { ffi::rdma_get_devices(&mut n) };
        let Some(list) = NonNull::new(list) else {
            return Err(Error::last_os_error("rdma_get_devices"));
        };
        let n = usize::try_from(n).unwrap_or(0);
        // SAFETY: librdmacm returned `n` entries followed by a NULL.
        let entries = unsafe { std::slice::from_raw_parts(list.as_ptr(), n) };
        let found = entries.iter().position(|&c| c == ctx.as_ptr());
        let size = 2 * std::mem::size_of::<*mut ffi::ibv_context>();
        // SAFETY: a plain allocation; rdma_free_devices frees it with free(3).
        let kept = unsafe { libc::malloc(size) }.cast::<*mut ffi::ibv_context>();
        let (Some(i), Some(kept)) = (found, NonNull::new(kept)) else {
            if !kept.is_null() {
                // SAFETY: allocated just above and not used.
                unsafe { libc::free(kept.cast()) };
            }
            // SAFETY: the list from rdma_get_devices, freed once.
            unsafe { ffi::rdma_free_devices(list.as_ptr()) };
            return Err(match found {
                None => Error::from_errno("rdma_get_devices", libc::ENODEV),
                Some(_) => Error::from_errno("malloc", libc::ENOMEM),
            });
        };
        // SAFETY: `kept` has room for two pointers. Our entry moves to it
        // and out of `list` (the entries after it, NULL included, shift down
        // by one), so freeing `list` uncounts every other device at once and
        // freeing `kept` later uncounts ours.
        unsafe {
            kept.as_ptr().write(ctx.as_ptr());
            kept.as_ptr().add(1).write(ptr::null_mut());
            ptr::copy(list.as_ptr().add(i + 1), list.as_ptr().add(i), n - i);
            ffi::rdma_free_devices(list.as_ptr());
        }
        Ok(Device {
            held: Arc::new(HeldContext { ctx, list: kept }),
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.held.ctx.as_ptr()
    }

    fn ibv_device(&self) -> *mut ffi::ibv_device {
        // SAFETY: the context is open (held by this handle); `device` is set
        // by libibverbs when the context is opened and never changes.
        unsafe { (*self.as_ptr()).device }
    }

    /// Whether the device was removed: librdmacm no longer lists it (it
    /// rescans the kernel's devices to answer, as [`rescan_devices`] does).
    /// Its context stays open until the last handle and id on it are gone.
    pub fn is_removed(&self) -> Result<bool> {
        let ctx = self.as_ptr();
        with_device_list(|entries| !entries.contains(&ctx))
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
        let rc = unsafe { ffi::ibv_query_device(self.as_ptr(), a.as_mut_ptr()) };
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
}

/// Same context. Sound as an identity because each handle keeps its context
/// allocated: a removed and re-added device gets a new context at a new
/// address for as long as any handle to the old one lives.
impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        self.held.ctx == other.held.ctx
    }
}

impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("ctx", &self.held.ctx)
            .finish()
    }
}

mod memory;
mod post;
mod queue;

pub use memory::*;
pub use post::*;
pub use queue::*;
