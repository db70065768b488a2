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

mod memory;
mod post;
mod queue;

pub use memory::*;
pub use post::*;
pub use queue::*;
