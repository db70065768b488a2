//! Building blocks for the engine's integration tests and benchmarks: a
//! portal with one RAM LUN and a connection logged in to it, with no
//! transport. The daemon does not use this module.

use std::sync::Arc;
use std::time::Instant;

use ramslog_common::iscsi::{login, text, Bhs, Opcode};
use ramslog_common::iser::CmPeer;

use crate::engine::{ConnInfo, Connection, Input};
use crate::portal::{Acl, Limits, Portal, SessionControl, TargetDef};
use crate::scsi::{Identity, Readiness, ScsiTarget};
use crate::store::{HugePages, Store};
use crate::volume::{Volume, VolumeConfig};

/// A session control nobody terminates.
pub struct NoControl;

impl SessionControl for NoControl {
    fn terminate(&self) {}
}

/// A portal serving `target_name` with LUN 0 of `size` bytes (512-byte
/// blocks), open to every initiator.
pub fn ram_portal(target_name: &str, size: u64) -> Arc<Portal> {
    Arc::new(ram_portal_unshared(target_name, size))
}

/// [`ram_portal`] measuring service times, as the daemon does with `--metrics`.
pub fn ram_portal_with_metrics(target_name: &str, size: u64) -> Arc<Portal> {
    let mut portal = ram_portal_unshared(target_name, size);
    portal.service_times = true;
    Arc::new(portal)
}

fn ram_portal_unshared(target_name: &str, size: u64) -> Portal {
    let store = Arc::new(Store::new(size, HugePages::Off).expect("RAM for the test LUN"));
    let volume = Volume::in_memory(
        VolumeConfig {
            target: target_name.into(),
            lun: 0,
            block_size: 512,
            identity: Identity::generate(),
            readiness: Readiness::Ready,
        },
        store,
    );
    let target = TargetDef {
        name: target_name.into(),
        alias: None,
        scsi: Arc::new(ScsiTarget::new(vec![Arc::new(volume)])),
        acl: Acl::Any,
        chap: None,
        mutual_chap: None,
    };
    Portal::new(
        vec![target],
        Limits::default(),
        vec!["127.0.0.1:3260".parse().expect("address")],
    )
}

/// A connection to the portal's first target that has completed a one-PDU
/// login with `keys` (its successful response already drained); over iSER when
/// `iser_recv_data_len` is given (the receive buffers' data room).
pub fn logged_in(
    portal: Arc<Portal>,
    iser_recv_data_len: Option<u32>,
    keys: &[(&str, &str)],
    now: Instant,
) -> Connection {
    let info = ConnInfo {
        local: "127.0.0.1:3260".parse().expect("address"),
        peer: "127.0.0.1:5000".parse().expect("address"),
    };
    let target = portal.targets[0].name.clone();
    let mut conn = match iser_recv_data_len {
        Some(len) => Connection::iser(portal, info, Arc::new(NoControl), now, len, CmPeer::Unknown),
        None => Connection::tcp(portal, info, Arc::new(NoControl), now),
    };
    let mut data = Vec::new();
    text::encode_pair(
        &mut data,
        "InitiatorName",
        "iqn.2026-11.org.ramslog:testkit",
    );
    text::encode_pair(&mut data, "TargetName", &target);
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
        if let crate::engine::Action::Send(p) = a {
            if p.bhs.opcode() == Some(Opcode::LoginResponse) {
                status = Some(p.bhs.login_status());
            }
        }
    }
    assert_eq!(status, Some(0), "the test login must succeed");
    conn
}
