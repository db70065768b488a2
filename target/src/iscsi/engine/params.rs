//! The operational values in force for a connection; how each key is
//! negotiated, its range and default are in `ramslog_common::iscsi::keys`.

use ramslog_common::iscsi::keys;
use ramslog_common::iser::CmPeer;

/// The values in force for a connection/session after login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment the initiator accepts: the limit for what we send.
    pub initiator_mrdsl: u32,
    /// Largest data segment we accept.
    pub target_mrdsl: u32,
    pub max_burst_len: u32,
    pub first_burst_len: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_outstanding_r2t: u32,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
    /// iSER-assisted: data moves by RDMA, digests and R2Ts are off.
    pub iser: bool,
    /// The initiator negotiated RDMAExtensions=Yes (RFC 7145, Linux); an
    /// iSER login without it follows the illumos initiator's rules.
    pub rdma_extensions: bool,
    /// iSER: the initiator family the connect request's private data
    /// proposed; the login confirms it.
    pub cm_peer: CmPeer,
}

/// Whose limits an iSER connection gets (docs/iser-compat.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IserPeer {
    /// Linux ib_iser: RFC 7145 keys, immediate data, 128-byte full-feature
    /// receive buffers.
    Linux,
    /// The illumos initiator, and any peer we cannot place: no immediate
    /// data, InitialR2T, 16 KiB messages, 4 RDMA READs in flight. Every
    /// initiator can live with these.
    Illumos,
}

impl Params {
    /// The peer an iSER connection serves, decided in one place: the connect
    /// request's private data proposes, the RDMAExtensions key confirms.
    /// Linux needs both to agree; anything else gets the illumos limits.
    pub fn iser_peer(&self) -> Option<IserPeer> {
        if !self.iser {
            return None;
        }
        Some(match (self.cm_peer, self.rdma_extensions) {
            (CmPeer::Linux | CmPeer::Unknown, true) => IserPeer::Linux,
            (CmPeer::Illumos, _) | (_, false) => IserPeer::Illumos,
        })
    }

    /// RFC 7143 defaults, with our own receive limit declared.
    pub fn defaults(target_mrdsl: u32) -> Params {
        Params {
            header_digest: false,
            data_digest: false,
            initiator_mrdsl: keys::MAX_RECV_DATA_SEGMENT_LENGTH.default_number() as u32,
            target_mrdsl,
            max_burst_len: keys::MAX_BURST_LENGTH.default_number() as u32,
            first_burst_len: keys::FIRST_BURST_LENGTH.default_number() as u32,
            initial_r2t: keys::INITIAL_R2T.default_bool(),
            immediate_data: keys::IMMEDIATE_DATA.default_bool(),
            max_outstanding_r2t: keys::MAX_OUTSTANDING_R2T.default_number() as u32,
            default_time2wait: keys::DEFAULT_TIME2WAIT.default_number() as u32,
            default_time2retain: keys::DEFAULT_TIME2RETAIN.default_number() as u32,
            iser: false,
            rdma_extensions: false,
            cm_peer: CmPeer::Unknown,
        }
    }
}
