//! Building blocks for the engine's tests, fuzz targets and benchmarks: a
//! portal with one RAM LUN, a session control that records termination, and
//! a connection logged in to it, with no transport. The daemon does not use
//! this module.

use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::{login, text, Bhs, Opcode};
use ramslog_common::iser::CmPeer;

use crate::admission::SessionControl;
use crate::core::{Core, CoreLimits, FrontEndView};
use crate::iscsi::engine::{ConnInfo, Connection, Input};
use crate::iscsi::portal::{Acl, ChapSecret, Limits, Portal, TargetDef};
use crate::scsi::ScsiTarget;
use crate::store::{HugePages, Store};
use crate::volume::{Identity, Readiness, Volumes};
use crate::volume::{Volume, VolumeConfig};

/// The address every testkit portal claims to listen on.
pub const PORTAL_ADDRESS: &str = "127.0.0.1:3260";

/// The addresses of a testkit connection: the portal's, and an initiator's
/// on loopback.
pub fn conn_info() -> ConnInfo {
    ConnInfo {
        local: PORTAL_ADDRESS.parse().expect("address"),
        peer: "127.0.0.1:40000".parse().expect("address"),
    }
}

/// A RAM volume of `size` bytes in 512-byte blocks, ready, with a fresh
/// identity: LUN `lun` of `target_name`.
pub fn ram_volume(target_name: &str, lun: u64, size: u64) -> Volume {
    ram_volume_with(target_name, lun, size, false)
}

/// [`ram_volume`], keeping page checksums (`--verify-kept-memory`) when
/// `page_crcs` is set.
pub fn ram_volume_with(target_name: &str, lun: u64, size: u64, page_crcs: bool) -> Volume {
    let store = Arc::new(Store::new(size, HugePages::Off).expect("RAM for the test LUN"));
    Volume::in_memory(
        VolumeConfig {
            target: target_name.into(),
            lun,
            block_size: 512,
            identity: Identity::generate(),
            readiness: Readiness::Ready,
            page_crcs,
        },
        store,
    )
}

/// A portal serving one target with LUN 0 in RAM, open to every initiator
/// unless told otherwise: `RamPortal::new(name).size(..).chap(..).build()`.
#[must_use]
pub struct RamPortal {
    target_name: String,
    size: u64,
    limits: Limits,
    core_limits: CoreLimits,
    acl: Acl,
    chap: Option<ChapSecret>,
    mutual_chap: Option<ChapSecret>,
    discovery_chap: Option<ChapSecret>,
    service_times: bool,
    page_crcs: bool,
}

impl RamPortal {
    /// One MiB, default limits, no CHAP, every initiator admitted.
    pub fn new(target_name: &str) -> RamPortal {
        RamPortal {
            target_name: target_name.into(),
            size: 1 << 20,
            limits: Limits::default(),
            core_limits: CoreLimits::default(),
            acl: Acl::Any,
            chap: None,
            mutual_chap: None,
            discovery_chap: None,
            service_times: false,
            page_crcs: false,
        }
    }

    pub fn size(mut self, bytes: u64) -> RamPortal {
        self.size = bytes;
        self
    }

    pub fn limits(mut self, limits: Limits) -> RamPortal {
        self.limits = limits;
        self
    }

    /// What every front end obeys (staging, stall, drain, connection caps).
    pub fn core_limits(mut self, limits: CoreLimits) -> RamPortal {
        self.core_limits = limits;
        self
    }

    pub fn acl(mut self, acl: Acl) -> RamPortal {
        self.acl = acl;
        self
    }

    /// The secret initiators must prove to log in to the target.
    pub fn chap(mut self, secret: ChapSecret) -> RamPortal {
        self.chap = Some(secret);
        self
    }

    /// The secret the target proves when an initiator asks for mutual CHAP.
    pub fn mutual_chap(mut self, secret: ChapSecret) -> RamPortal {
        self.mutual_chap = Some(secret);
        self
    }

    pub fn discovery_chap(mut self, secret: ChapSecret) -> RamPortal {
        self.discovery_chap = Some(secret);
        self
    }

    /// Measure service times, as the daemon does with `--metrics`.
    pub fn service_times(mut self) -> RamPortal {
        self.service_times = true;
        self
    }

    /// Keep page checksums of the LUN, as the daemon does with
    /// `--verify-kept-memory`.
    pub fn page_crcs(mut self) -> RamPortal {
        self.page_crcs = true;
        self
    }

    pub fn build(self) -> Arc<Portal> {
        let volumes = Arc::new(Volumes::new(vec![ram_volume_with(
            &self.target_name,
            0,
            self.size,
            self.page_crcs,
        )]));
        let mut target = TargetDef::new(
            self.target_name,
            Arc::new(ScsiTarget::new(volumes.iter().cloned().collect())),
        );
        target.acl = self.acl;
        target.chap = self.chap;
        target.mutual_chap = self.mutual_chap;
        let address = PORTAL_ADDRESS.parse().expect("address");
        let exports = crate::iscsi::portal::lun_exports(&volumes);
        let mut core = Core::new(volumes, exports, self.core_limits);
        core.service_times = self.service_times;
        let mut portal = Portal::new(Arc::new(core), vec![target], self.limits, vec![address]);
        portal.discovery_chap = self.discovery_chap;
        Arc::new(portal)
    }
}

/// A connection to the portal's first target that has completed a one-PDU
/// login with `keys` (its successful response already drained); over iSER,
/// with RDMAExtensions=Yes, when `iser_recv_data_len` is given (the receive
/// buffers' data room).
pub fn logged_in(
    portal: Arc<Portal>,
    iser_recv_data_len: Option<u32>,
    keys: &[(&str, &str)],
    now: Instant,
) -> Connection {
    let info = conn_info();
    let target = FrontEndView::owners(&*portal).swap_remove(0);
    let mut conn = match iser_recv_data_len {
        Some(len) => Connection::iser(
            portal,
            info,
            SessionControl::without_transport(),
            now,
            len,
            CmPeer::Unknown,
        ),
        None => Connection::tcp(portal, info, SessionControl::without_transport(), now),
    };
    let mut data = Vec::new();
    text::encode_pair(
        &mut data,
        "InitiatorName",
        "iqn.2026-11.org.ramslog:testkit",
    );
    text::encode_pair(&mut data, "TargetName", &target);
    if iser_recv_data_len.is_some() {
        text::encode_pair(&mut data, "RDMAExtensions", "Yes");
    }
    for (k, v) in keys {
        text::encode_pair(&mut data, k, v);
    }
    let mut l = Bhs::new(Opcode::LoginRequest);
    l.set_immediate(true)
        .set_flags(login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE)
        .set_data_segment_len(data.len() as u32);
    conn.handle(now, Input::pdu(&l, &[], &data));
    let mut status = None;
    while let Some(a) = conn.poll_action() {
        if let crate::iscsi::engine::Action::Send(p) = a {
            if p.bhs.opcode() == Some(Opcode::LoginResponse) {
                status = Some(p.bhs.login_status());
            }
        }
    }
    assert_eq!(status, Some(0), "the test login must succeed");
    conn
}

/// An RDMA adapter in simulation, for the engine's iSER tests: it keeps
/// the initiator's registered buffers, posts the engine's RDMA READs within
/// a number of READ credits (holding the rest in order, as the driver
/// does), and when a READ completes copies the initiator's bytes into LUN
/// memory, as a real adapter's DMA does, before it tells the engine.
/// Like the driver it counts each READ into the LUN in the session's
/// transfers while posted, and asks the engine before posting a held one.
pub struct SimulatedHca {
    credits: usize,
    /// The initiator's registered buffers: stag → (address, bytes).
    host: std::collections::HashMap<u32, (u64, Vec<u8>)>,
    held: std::collections::VecDeque<PostedRead>,
    posted: std::collections::VecDeque<PostedRead>,
    /// The session's transfers, learnt at login as the driver does: they
    /// outlive the session.
    transfers: Option<Arc<crate::admission::Transfers>>,
}

/// An RDMA READ the adapter holds or has posted.
#[derive(Debug, Clone, Copy)]
pub struct PostedRead {
    pub tag: u32,
    pub stag: u32,
    pub remote_addr: u64,
    pub len: u32,
    pub dest: crate::iscsi::engine::ReadDest,
}

impl SimulatedHca {
    /// An adapter that keeps at most `credits` RDMA READs in flight.
    pub fn new(credits: usize) -> SimulatedHca {
        SimulatedHca {
            credits,
            host: std::collections::HashMap::new(),
            held: std::collections::VecDeque::new(),
            posted: std::collections::VecDeque::new(),
            transfers: None,
        }
    }

    /// The initiator registered `bytes` at `va` under `stag`.
    pub fn register(&mut self, stag: u32, va: u64, bytes: Vec<u8>) {
        self.host.insert(stag, (va, bytes));
    }

    /// READs posted and not completed.
    pub fn in_flight(&self) -> usize {
        self.posted.len()
    }

    /// READs waiting for a credit.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Take every action the engine queued, as the driver does: RDMA READs
    /// are posted or held; everything else is returned in order.
    pub fn drain(&mut self, conn: &mut Connection) -> Vec<crate::iscsi::engine::Action> {
        let mut actions = Vec::new();
        while let Some(a) = conn.poll_action() {
            actions.push(a);
        }
        self.take(conn, actions)
    }

    /// Take `actions` the engine produced (already polled from `conn`):
    /// RDMA READs are posted or held; everything else is returned in order.
    pub fn take(
        &mut self,
        conn: &Connection,
        actions: impl IntoIterator<Item = crate::iscsi::engine::Action>,
    ) -> Vec<crate::iscsi::engine::Action> {
        if self.transfers.is_none() {
            self.transfers = conn.transfers();
        }
        let mut other = Vec::new();
        for a in actions {
            match a {
                crate::iscsi::engine::Action::RdmaRead {
                    tag,
                    stag,
                    remote_addr,
                    len,
                    dest,
                } => self.held.push_back(PostedRead {
                    tag,
                    stag,
                    remote_addr,
                    len,
                    dest,
                }),
                a => other.push(a),
            }
        }
        self.post_held(conn);
        other
    }

    fn post_held(&mut self, conn: &Connection) {
        while self.posted.len() < self.credits {
            let Some(read) = self.held.pop_front() else {
                return;
            };
            let into_lun = matches!(read.dest, crate::iscsi::engine::ReadDest::Store { .. });
            if into_lun {
                if let Some(t) = &self.transfers {
                    t.begin();
                }
            }
            if !conn.may_post_rdma_read(read.tag) {
                if let (true, Some(t)) = (into_lun, &self.transfers) {
                    t.end();
                }
                continue;
            }
            self.posted.push_back(read);
        }
    }

    /// The oldest posted READ completes: its bytes land, the engine hears
    /// of it, and a held READ takes its credit. False when none was posted.
    pub fn complete_one(&mut self, conn: &mut Connection, now: Instant) -> bool {
        let Some(read) = self.posted.pop_front() else {
            return false;
        };
        let bytes = self
            .host
            .get(&read.stag)
            .and_then(|(va, b)| {
                let start = usize::try_from(read.remote_addr.checked_sub(*va)?).ok()?;
                b.get(start..start + read.len as usize)
            })
            .map(<[u8]>::to_vec)
            .expect("the initiator registered the buffer the READ names");
        let data = match read.dest {
            crate::iscsi::engine::ReadDest::Store { volume, offset } => {
                let volumes = &conn.portal().core.volumes;
                let volume = volumes.get(volume).expect("a volume of the portal");
                volume.store().write(offset, &bytes).expect("in the volume");
                if let Some(t) = &self.transfers {
                    t.end();
                }
                Vec::new()
            }
            crate::iscsi::engine::ReadDest::Buffer => bytes,
        };
        conn.handle(
            now,
            Input::RdmaReadDone {
                tag: read.tag,
                data: &data,
            },
        );
        self.post_held(conn);
        true
    }

    /// The queue pair is destroyed: every posted READ is flushed and none
    /// of their bytes lands.
    pub fn destroy(&mut self) {
        for read in self.posted.drain(..) {
            if let (crate::iscsi::engine::ReadDest::Store { .. }, Some(t)) =
                (read.dest, &self.transfers)
            {
                t.end();
            }
        }
        self.held.clear();
    }
}
