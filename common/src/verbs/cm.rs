//! librdmacm: event channels, ids, connection setup and the QP of an id.

use std::cell::Cell;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Instant;

use rdma_sys as ffi;

use super::ib::{self, CompletionQueue, Device, PostError, ProtectionDomain, RecvWr, SendWr};
use super::{set_fd_nonblocking, Error, Result};

// ---------------------------------------------------------------- event channel

struct ChannelInner {
    ch: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: an rdma_event_channel is a file descriptor; rdma_get_cm_event and
// the id calls that use it are thread-safe in librdmacm. Destroyed once, in
// Drop.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: we own the channel; no id uses it any more (every CmId on
        // it holds an Arc to us).
        unsafe { ffi::rdma_destroy_event_channel(self.ch.as_ptr()) };
    }
}

/// An rdma_cm event channel: a file descriptor on which the events of the
/// ids created on (or migrated to) it arrive. Cloning gives another handle
/// to the same channel; it is destroyed when the last handle and the last
/// id on it are gone.
#[derive(Clone)]
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

impl EventChannel {
    pub fn new() -> Result<EventChannel> {
        // SAFETY: no arguments; returns a new channel or null with errno.
        let ch = unsafe { ffi::rdma_create_event_channel() };
        let ch =
            NonNull::new(ch).ok_or_else(|| Error::last_os_error("rdma_create_event_channel"))?;
        Ok(EventChannel {
            inner: Arc::new(ChannelInner { ch }),
        })
    }

    fn as_ptr(&self) -> *mut ffi::rdma_event_channel {
        self.inner.ch.as_ptr()
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is alive; `fd` is set at creation and constant.
        unsafe { (*self.as_ptr()).fd }
    }

    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        set_fd_nonblocking(self.fd(), on)
    }

    /// Wait on this non-blocking channel until `want` arrives or `deadline`
    /// passes. A rejection or another event that ends the connection fails
    /// the wait; events that neither answer nor end it are skipped.
    pub fn wait_for(
        &self,
        want: CmEventKind,
        deadline: Instant,
    ) -> std::result::Result<CmEvent, CmWaitError> {
        loop {
            match self.get_event() {
                Ok(e) if e.kind == want => return Ok(e),
                Ok(e) if e.kind == CmEventKind::Rejected => {
                    return Err(CmWaitError::Rejected {
                        want,
                        reason: e.status,
                    })
                }
                Ok(e) if e.kind.ends_connection() => {
                    return Err(CmWaitError::Ended {
                        want,
                        kind: e.kind,
                        status: e.status,
                    })
                }
                Ok(_) => {}
                Err(e) if e.is_would_block() => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(CmWaitError::Timeout { want });
                    }
                    let mut ready = [false];
                    super::wait_readable(&[self.fd()], Some(deadline - now), &mut ready)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The next event (`rdma_get_cm_event`), copied out and acknowledged
    /// (`rdma_ack_cm_event`) before returning. Blocks unless the channel is
    /// non-blocking; then "no event" is an `Err` whose
    /// [`is_would_block`](Error::is_would_block) is true.
    ///
    /// For `ConnectRequest` the new connection's id is handed over as an
    /// owned [`CmId`] in [`CmEvent::new_id`]; it is on this channel (use
    /// [`CmId::migrate`] to move it), and dropping it rejects the request.
    pub fn get_event(&self) -> Result<CmEvent> {
        let mut ev: *mut ffi::rdma_cm_event = ptr::null_mut();
        // SAFETY: the channel is alive; `ev` is a valid out-pointer.
        let rc = unsafe { ffi::rdma_get_cm_event(self.as_ptr(), &mut ev) };
        if rc != 0 {
            return Err(Error::last_os_error("rdma_get_cm_event"));
        }
        let ev =
            NonNull::new(ev).ok_or_else(|| Error::from_errno("rdma_get_cm_event", libc::EIO))?;
        let out = {
            // SAFETY: librdmacm returned a valid event that stays valid until
            // it is acknowledged below; we only read it.
            let e = unsafe { ev.as_ref() };
            let kind = CmEventKind::from_raw(e.event);
            let has_conn_param = matches!(
                kind,
                CmEventKind::ConnectRequest
                    | CmEventKind::ConnectResponse
                    | CmEventKind::Established
                    | CmEventKind::Rejected
                    | CmEventKind::Disconnected
            );
            let (private_data, responder_resources, initiator_depth) = if has_conn_param {
                // SAFETY: for connection events on RC ids (all ours are
                // RDMA_PS_TCP / RC) librdmacm fills `param.conn`.
                let c = unsafe { e.param.conn };
                let data = if c.private_data.is_null() || c.private_data_len == 0 {
                    Vec::new()
                } else {
                    // SAFETY: `private_data` points to `private_data_len`
                    // bytes inside the event, valid until the ack below;
                    // copied at once.
                    unsafe {
                        std::slice::from_raw_parts(
                            c.private_data.cast::<u8>(),
                            usize::from(c.private_data_len),
                        )
                    }
                    .to_vec()
                };
                (data, c.responder_resources, c.initiator_depth)
            } else {
                (Vec::new(), 0, 0)
            };
            let new_id = match kind {
                CmEventKind::ConnectRequest => NonNull::new(e.id).map(|id| CmId {
                    id,
                    channel: Cell::new(Arc::clone(&self.inner)),
                    qp: None,
                    caps: QpCaps::default(),
                    _pd: None,
                    _cq: None,
                    _recv_cq: None,
                }),
                _ => None,
            };
            let listen_id = if e.listen_id.is_null() {
                e.id as usize
            } else {
                e.listen_id as usize
            };
            CmEvent {
                kind,
                status: e.status,
                private_data,
                responder_resources,
                initiator_depth,
                new_id,
                id: e.id as usize,
                listen_id,
            }
        };
        // SAFETY: acknowledging the event we got, exactly once; nothing
        // borrowed from it survives (everything was copied above). For a
        // connect request this does not destroy the new id, which `out` owns.
        let _ = unsafe { ffi::rdma_ack_cm_event(ev.as_ptr()) };
        Ok(out)
    }

    /// Address of the `rdma_event_channel`, to tell channels apart.
    pub fn raw_handle(&self) -> usize {
        self.as_ptr() as usize
    }
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

// ---------------------------------------------------------------- events

/// `rdma_cm_event_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmEventKind {
    AddrResolved,
    AddrError,
    RouteResolved,
    RouteError,
    ConnectRequest,
    ConnectResponse,
    ConnectError,
    Unreachable,
    Rejected,
    Established,
    Disconnected,
    DeviceRemoval,
    TimewaitExit,
    AddrChange,
    Other(u32),
}

impl CmEventKind {
    /// The connection (or the attempt to make one) is over.
    pub fn ends_connection(self) -> bool {
        use CmEventKind as K;
        matches!(
            self,
            K::AddrError
                | K::RouteError
                | K::ConnectError
                | K::Unreachable
                | K::Rejected
                | K::Disconnected
                | K::DeviceRemoval
                | K::TimewaitExit
        )
    }

    fn from_raw(e: u32) -> CmEventKind {
        use ffi::rdma_cm_event_type as t;
        match e {
            t::RDMA_CM_EVENT_ADDR_RESOLVED => CmEventKind::AddrResolved,
            t::RDMA_CM_EVENT_ADDR_ERROR => CmEventKind::AddrError,
            t::RDMA_CM_EVENT_ROUTE_RESOLVED => CmEventKind::RouteResolved,
            t::RDMA_CM_EVENT_ROUTE_ERROR => CmEventKind::RouteError,
            t::RDMA_CM_EVENT_CONNECT_REQUEST => CmEventKind::ConnectRequest,
            t::RDMA_CM_EVENT_CONNECT_RESPONSE => CmEventKind::ConnectResponse,
            t::RDMA_CM_EVENT_CONNECT_ERROR => CmEventKind::ConnectError,
            t::RDMA_CM_EVENT_UNREACHABLE => CmEventKind::Unreachable,
            t::RDMA_CM_EVENT_REJECTED => CmEventKind::Rejected,
            t::RDMA_CM_EVENT_ESTABLISHED => CmEventKind::Established,
            t::RDMA_CM_EVENT_DISCONNECTED => CmEventKind::Disconnected,
            t::RDMA_CM_EVENT_DEVICE_REMOVAL => CmEventKind::DeviceRemoval,
            t::RDMA_CM_EVENT_TIMEWAIT_EXIT => CmEventKind::TimewaitExit,
            t::RDMA_CM_EVENT_ADDR_CHANGE => CmEventKind::AddrChange,
            other => CmEventKind::Other(other),
        }
    }
}

/// Why [`EventChannel::wait_for`] returned without its event.
#[derive(Debug, thiserror::Error)]
pub enum CmWaitError {
    /// The peer (or its CM) rejected the connection; `reason` is the CM
    /// reject reason.
    #[error("the peer rejected the connection (CM reason {reason}) while waiting for {want:?}")]
    Rejected { want: CmEventKind, reason: i32 },
    /// An event that ends the connection; `status` is 0 or a negative errno
    /// (`AddrError` and `RouteError`: the address is not reachable over RDMA).
    #[error("{kind:?} ({}) while waiting for {want:?}", std::io::Error::from_raw_os_error(status.saturating_abs()))]
    Ended {
        want: CmEventKind,
        kind: CmEventKind,
        status: i32,
    },
    #[error("no rdma_cm {want:?} in time")]
    Timeout { want: CmEventKind },
    #[error(transparent)]
    Verbs(#[from] Error),
}

/// One rdma_cm event, copied out of librdmacm (already acknowledged).
#[derive(Debug)]
pub struct CmEvent {
    pub kind: CmEventKind,
    /// The event's status: 0, a negative errno (e.g. for `AddrError`,
    /// `RouteError`, `Unreachable`), or for `Rejected` the CM reject reason.
    pub status: i32,
    /// `param.conn.private_data` of connection events (ConnectRequest,
    /// ConnectResponse, Established, Rejected, Disconnected); may be empty.
    /// On InfiniBand / RoCE it is padded with zeros to the CM's fixed size.
    pub private_data: Vec<u8>,
    /// `param.conn` values as librdmacm reports them, already from this
    /// side's point of view (0 for other events).
    pub responder_resources: u8,
    pub initiator_depth: u8,
    /// For `ConnectRequest`: the new connection's id, owned. Dropping it
    /// rejects and destroys it.
    pub new_id: Option<CmId>,
    /// Address of `event->id` (compare with [`CmId::raw_handle`]). For
    /// `ConnectRequest` that is the new id.
    pub id: usize,
    /// Address of `event->listen_id` if set (`ConnectRequest`: the
    /// listener), else of `event->id`: the id of ours this event is for.
    pub listen_id: usize,
}

mod id;

pub use id::*;
