//! rdma_cm ids: resolve, listen, connect, accept, their queue pair, and
//! posting through it.

use super::*;

/// Queue pair sizes ([`CmId::create_qp`]); after creation
/// [`CmId::qp_caps`] has what the device really gave (at least this much).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// Connection parameters for [`CmId::connect`] / [`CmId::accept`]
/// (`rdma_conn_param`; flow control on, no SRQ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnParam<'a> {
    /// At most 255 bytes here; the CM allows less (InfiniBand / RoCE: 56
    /// for connect, 196 for accept), else the call fails with EINVAL.
    pub private_data: &'a [u8],
    /// RDMA READs / atomics this side lets the peer have outstanding.
    pub responder_resources: u8,
    /// RDMA READs / atomics this side issues at a time.
    pub initiator_depth: u8,
    /// Transport retries (0-7); meaningful for connect only.
    pub retry_count: u8,
    /// RNR retries (0-7, 7 = forever); meaningful for connect only.
    pub rnr_retry_count: u8,
}

impl Default for ConnParam<'_> {
    /// No private data, 1 outstanding RDMA READ each way, 7 retries, RNR
    /// retry forever.
    fn default() -> Self {
        ConnParam {
            private_data: &[],
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
        }
    }
}

impl ConnParam<'_> {
    fn to_raw(self, op: &'static str) -> Result<ffi::rdma_conn_param> {
        let len = u8::try_from(self.private_data.len())
            .map_err(|_| Error::from_errno(op, libc::EINVAL))?;
        Ok(ffi::rdma_conn_param {
            private_data: if len == 0 {
                ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: len,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: 0,
        })
    }
}

/// A socket address in the C layout, for the calls that take `sockaddr *`.
#[repr(C)]
union RawSockAddr {
    v4: libc::sockaddr_in,
    v6: libc::sockaddr_in6,
}

impl RawSockAddr {
    fn new(addr: SocketAddr) -> RawSockAddr {
        match addr {
            SocketAddr::V4(a) => RawSockAddr {
                v4: libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                },
            },
            SocketAddr::V6(a) => RawSockAddr {
                v6: libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo().to_be(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                },
            },
        }
    }

    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        (self as *mut RawSockAddr).cast()
    }
}

fn from_v4(a: &libc::sockaddr_in) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes()),
        u16::from_be(a.sin_port),
    ))
}

fn from_v6(a: &libc::sockaddr_in6) -> SocketAddr {
    SocketAddr::V6(SocketAddrV6::new(
        Ipv6Addr::from(a.sin6_addr.s6_addr),
        u16::from_be(a.sin6_port),
        u32::from_be(a.sin6_flowinfo),
        a.sin6_scope_id,
    ))
}

/// An rdma_cm id (`RDMA_PS_TCP`), and its RC queue pair once
/// [`create_qp`](CmId::create_qp) made one. Drop destroys the QP, then the
/// id; then releases the PD, CQ and event channel it kept alive.
///
/// `Send`, not `Sync`: use an id from one thread at a time. (Its address
/// and device fields are updated by librdmacm while this id's events are
/// processed in [`EventChannel::get_event`]: read them from the thread that
/// handles its events.)
pub struct CmId {
    pub(super) id: NonNull<ffi::rdma_cm_id>,
    /// rdma_destroy_id / rdma_migrate_id write to the id's channel: keep it
    /// alive as long as the id is on it.
    pub(super) channel: Cell<Arc<ChannelInner>>,
    pub(super) qp: Option<NonNull<ffi::ibv_qp>>,
    pub(super) caps: QpCaps,
    // Dropped after the QP is destroyed (in Drop::drop, before the fields).
    pub(super) _pd: Option<Arc<ProtectionDomain>>,
    pub(super) _cq: Option<Arc<CompletionQueue>>,
    pub(super) _recv_cq: Option<Arc<CompletionQueue>>,
}

// SAFETY: the id is owned; librdmacm allows calls on an id from any thread,
// one at a time, which `!Sync` (Cell) ensures. The QP's post calls are
// thread-safe in libibverbs providers.
unsafe impl Send for CmId {}

impl CmId {
    /// A new id on `ch` (`rdma_create_id`, `RDMA_PS_TCP`, context null).
    pub fn new(ch: &EventChannel) -> Result<CmId> {
        let mut id: *mut ffi::rdma_cm_id = ptr::null_mut();
        // SAFETY: the channel is alive (and kept alive by the Arc below);
        // `id` is a valid out-pointer.
        let rc = unsafe {
            ffi::rdma_create_id(
                ch.as_ptr(),
                &mut id,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(Error::last_os_error("rdma_create_id"));
        }
        let id = NonNull::new(id).ok_or_else(|| Error::from_errno("rdma_create_id", libc::EIO))?;
        Ok(CmId {
            id,
            channel: Cell::new(Arc::clone(&ch.inner)),
            qp: None,
            caps: QpCaps::default(),
            _pd: None,
            _cq: None,
            _recv_cq: None,
        })
    }

    fn as_ptr(&self) -> *mut ffi::rdma_cm_id {
        self.id.as_ptr()
    }

    fn check(op: &'static str, rc: libc::c_int) -> Result<()> {
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::last_os_error(op))
        }
    }

    /// Address of the `rdma_cm_id`: matches [`CmEvent::id`] /
    /// [`CmEvent::listen_id`].
    pub fn raw_handle(&self) -> usize {
        self.as_ptr() as usize
    }

    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut a = RawSockAddr::new(addr);
        // SAFETY: the id is alive; `a` is a valid sockaddr of its family,
        // read during the call only.
        let rc = unsafe { ffi::rdma_bind_addr(self.as_ptr(), a.as_mut_ptr()) };
        Self::check("rdma_bind_addr", rc)
    }

    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { ffi::rdma_listen(self.as_ptr(), backlog) };
        Self::check("rdma_listen", rc)
    }

    /// Start resolving `dst` (optionally from `src`); completes with an
    /// `AddrResolved` or `AddrError` event.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: i32,
    ) -> Result<()> {
        let mut s = src.map(RawSockAddr::new);
        let mut d = RawSockAddr::new(dst);
        let sp = match s.as_mut() {
            Some(s) => s.as_mut_ptr(),
            None => ptr::null_mut(),
        };
        // SAFETY: the id is alive; `sp` is null or a valid sockaddr, `d` a
        // valid sockaddr; librdmacm copies them during the call.
        let rc = unsafe { ffi::rdma_resolve_addr(self.as_ptr(), sp, d.as_mut_ptr(), timeout_ms) };
        Self::check("rdma_resolve_addr", rc)
    }

    /// Start resolving the route; completes with `RouteResolved` or
    /// `RouteError`.
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { ffi::rdma_resolve_route(self.as_ptr(), timeout_ms) };
        Self::check("rdma_resolve_route", rc)
    }

    /// Move the id to another event channel (`rdma_migrate_id`): its later
    /// events arrive there. The id keeps the new channel alive instead of
    /// the old one.
    pub fn migrate(&self, ch: &EventChannel) -> Result<()> {
        // SAFETY: the id and both channels are alive (the old one through
        // `self.channel`, the new one through `ch`). Every event of this id
        // was acknowledged in get_event, so librdmacm does not wait.
        let rc = unsafe { ffi::rdma_migrate_id(self.as_ptr(), ch.as_ptr()) };
        Self::check("rdma_migrate_id", rc)?;
        drop(self.channel.replace(Arc::clone(&ch.inner)));
        Ok(())
    }

    /// The device the id is bound to, held open for as long as the handle
    /// lives (see [`Device`]). ENODEV before the id is bound to a device
    /// (bind to a device address, resolve_addr, or a connect request) and
    /// once that device was removed.
    pub fn device(&self) -> Result<Device> {
        // SAFETY: the id is alive; `verbs` is a pointer field librdmacm sets,
        // and the id keeps that context open while we count a holder.
        Device::hold(unsafe { (*self.as_ptr()).verbs })
    }

    /// Whether the id is bound to `dev`'s context. Works after the device was
    /// removed, when [`device`](Self::device) no longer does.
    pub fn is_on(&self, dev: &Device) -> bool {
        // SAFETY: the id is alive; `verbs` is a pointer field librdmacm sets.
        let verbs = unsafe { (*self.as_ptr()).verbs };
        verbs == dev.as_ptr()
    }

    /// Create the id's RC queue pair (`rdma_create_qp`): `cq` for both send
    /// and receive completions, sq_sig_all = 0 (only `signaled` work
    /// requests complete). `pd` and `cq` must be of the id's device. The id
    /// keeps both alive until the QP is destroyed.
    pub fn create_qp(
        &mut self,
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> Result<()> {
        self.create_qp_split(pd, cq, cq, caps)
    }

    /// [`CmId::create_qp`] with separate send and receive completion queues,
    /// so a poller can sleep on receives alone while send completions are
    /// reaped without waking it.
    pub fn create_qp_split(
        &mut self,
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> Result<()> {
        const OP: &str = "rdma_create_qp";
        if self.qp.is_some() {
            return Err(Error::from_errno(OP, libc::EEXIST));
        }
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the id, PD and CQ are alive (the Arcs are stored below on
        // success); `attr` is valid for the call (librdmacm checks the PD's
        // and CQ's device against the id's).
        let rc = unsafe { ffi::rdma_create_qp(self.as_ptr(), pd.as_ptr(), &mut attr) };
        Self::check(OP, rc)?;
        // SAFETY: the id is alive; on success librdmacm set `qp`.
        let qp = NonNull::new(unsafe { (*self.as_ptr()).qp })
            .ok_or_else(|| Error::from_errno(OP, libc::EIO))?;
        self.qp = Some(qp);
        self.caps = QpCaps {
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: attr.cap.max_recv_wr,
            max_send_sge: attr.cap.max_send_sge,
            max_recv_sge: attr.cap.max_recv_sge,
            max_inline_data: attr.cap.max_inline_data,
        };
        self._pd = Some(Arc::clone(pd));
        self._cq = Some(Arc::clone(send_cq));
        self._recv_cq = Some(Arc::clone(recv_cq));
        Ok(())
    }

    /// The QP's real sizes (`None` before create_qp).
    pub fn qp_caps(&self) -> Option<QpCaps> {
        self.qp.map(|_| self.caps)
    }

    /// The QP number (`None` before create_qp).
    pub fn qp_num(&self) -> Option<u32> {
        // SAFETY: the QP is alive while the id owns it.
        self.qp.map(|qp| unsafe { (*qp.as_ptr()).qp_num })
    }

    /// Accept a connect request (passive side, on the id from
    /// [`CmEvent::new_id`]); `Established` follows. With a QP, librdmacm
    /// moves it to RTS.
    pub fn accept(&self, p: &ConnParam) -> Result<()> {
        let mut raw = p.to_raw("rdma_accept")?;
        // SAFETY: the id is alive; `raw` and the private data it points to
        // live across the call (librdmacm copies them).
        let rc = unsafe { ffi::rdma_accept(self.as_ptr(), &mut raw) };
        Self::check("rdma_accept", rc)
    }

    /// Connect (active side, after RouteResolved). With a QP, librdmacm
    /// handles the response itself and reports `Established`.
    pub fn connect(&self, p: &ConnParam) -> Result<()> {
        let mut raw = p.to_raw("rdma_connect")?;
        // SAFETY: as in accept.
        let rc = unsafe { ffi::rdma_connect(self.as_ptr(), &mut raw) };
        Self::check("rdma_connect", rc)
    }

    /// Reject a connect request, with up to 255 bytes of private data (the
    /// CM carries 148 on InfiniBand / RoCE).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = u8::try_from(private_data.len())
            .map_err(|_| Error::from_errno("rdma_reject", libc::EINVAL))?;
        let p = if len == 0 {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        // SAFETY: the id is alive; `p` is null or points to `len` bytes that
        // live across the call.
        let rc = unsafe { ffi::rdma_reject(self.as_ptr(), p, len) };
        Self::check("rdma_reject", rc)
    }

    /// Disconnect; both sides then get `Disconnected`. The QP goes to the
    /// error state: outstanding work requests complete as flushed.
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: the id is alive.
        let rc = unsafe { ffi::rdma_disconnect(self.as_ptr()) };
        Self::check("rdma_disconnect", rc)
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is alive; the address union is plain data inside
        // it, and its family field decides which variant is read.
        unsafe {
            let a = &(*self.as_ptr()).route.addr.src_addr_union;
            match i32::from(a.src_addr.sa_family) {
                libc::AF_INET => Some(from_v4(&a.src_sin)),
                libc::AF_INET6 => Some(from_v6(&a.src_sin6)),
                _ => None,
            }
        }
    }

    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as in local_addr.
        unsafe {
            let a = &(*self.as_ptr()).route.addr.dst_addr_union;
            match i32::from(a.dst_addr.sa_family) {
                libc::AF_INET => Some(from_v4(&a.dst_sin)),
                libc::AF_INET6 => Some(from_v6(&a.dst_sin6)),
                _ => None,
            }
        }
    }

    fn qp_or_err(&self, op: &'static str) -> Result<NonNull<ffi::ibv_qp>> {
        self.qp.ok_or_else(|| Error::from_errno(op, libc::ENOTCONN))
    }

    /// Post one send-queue work request (`ibv_post_send`). ENOTCONN if the
    /// id has no QP; ENOMEM when the send queue is full.
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.post_send_batch(std::slice::from_ref(wr))
            .map_err(Error::from)
    }

    /// Post several send-queue work requests, chained (16 per call into the
    /// provider). On failure, [`PostError::posted`] says how many went.
    pub fn post_send_batch(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), PostError> {
        refuse_reserved_ids("ibv_post_send", wrs.iter().map(|w| w.wr_id))?;
        self.post_send_lent(wrs)
    }

    /// Post without the check on ids: for SlotBuffer, whose lent ids it is.
    pub(crate) fn post_send_lent(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), PostError> {
        let qp = self
            .qp_or_err("ibv_post_send")
            .map_err(|error| PostError { posted: 0, error })?;
        ib::post_send(qp, wrs)
    }

    /// Post receive work requests (`ibv_post_recv`), chained in chunks of
    /// up to 64 built on the stack. On failure some may have been posted:
    /// use [`post_recv_batch`](Self::post_recv_batch) to learn how many.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.post_recv_batch(wrs).map_err(Error::from)
    }

    /// As [`post_recv`](Self::post_recv), reporting how many were posted
    /// before a failure.
    pub fn post_recv_batch(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), PostError> {
        refuse_reserved_ids("ibv_post_recv", wrs.iter().map(|w| w.wr_id))?;
        self.post_recv_lent(wrs)
    }

    /// Post without the check on ids: for SlotBuffer, whose lent ids it is.
    pub(crate) fn post_recv_lent(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), PostError> {
        let qp = self
            .qp_or_err("ibv_post_recv")
            .map_err(|error| PostError { posted: 0, error })?;
        ib::post_recv(qp, wrs)
    }
}

/// EINVAL, with nothing posted, when an id is one only a SlotBuffer may
/// post (its completion would give one of its slots back).
fn refuse_reserved_ids(
    op: &'static str,
    mut ids: impl Iterator<Item = ib::WrId>,
) -> std::result::Result<(), PostError> {
    if ids.any(|id| id.is_reserved()) {
        return Err(PostError {
            posted: 0,
            error: Error::from_errno(op, libc::EINVAL),
        });
    }
    Ok(())
}

impl CmId {
    /// Destroy the id's QP now. After this the adapter touches none of the
    /// memory the QP's requests named, so those buffers may be deregistered.
    /// Idempotent; `Drop` does it too.
    pub fn destroy_qp(&mut self) {
        if self.qp.take().is_some() {
            // SAFETY: the id owns a QP created by rdma_create_qp; destroyed
            // once (`qp` is now None). It uses our CQs, which librdmacm does
            // not destroy.
            unsafe { ffi::rdma_destroy_qp(self.as_ptr()) };
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.destroy_qp();
        // SAFETY: we own the id; destroyed once. Its channel is alive
        // (`self.channel` is dropped after this). All its events were
        // acknowledged, so this does not wait. Errors are ignored.
        let _ = unsafe { ffi::rdma_destroy_id(self.as_ptr()) };
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("id", &self.id)
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

#[cfg(test)]
mod tests;
