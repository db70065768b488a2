//! What crosses the engine's boundary: the inputs a transport delivers and
//! the actions it carries out.

use std::net::SocketAddr;
use std::sync::Arc;

use ramslog_common::iscsi::Bhs;
use ramslog_common::iser::{ControlPdu, RemoteBuffer};

use super::params::IserPeer;
use crate::admission::Transfers;
use crate::metrics::Served;
use crate::volume::{VolumeId, Volumes};

/// Where a connection runs, for logs, `status` and SendTargets.
#[derive(Debug, Clone, Copy)]
pub struct ConnInfo {
    pub local: SocketAddr,
    pub peer: SocketAddr,
}

/// The data segment of an outgoing PDU.
#[derive(Debug, PartialEq, Eq)]
pub enum OutData {
    None,
    Owned(Vec<u8>),
    /// Bytes of a volume, by its id in the portal's [`Volumes`]: the driver
    /// copies (TCP) or RDMA-writes (iSER) them. SCSI checked the range.
    Store {
        volume: VolumeId,
        offset: u64,
        len: u32,
    },
}

impl OutData {
    /// Write the data segment's bytes into `dst` (exactly [`Self::len`]
    /// long), reading volume bytes through `volumes`; false when the bytes
    /// are not there, and then nothing must be sent in their place.
    #[inline]
    pub fn fill(&self, volumes: &Volumes, dst: &mut [u8]) -> bool {
        match self {
            OutData::None => true,
            OutData::Owned(v) => {
                dst.copy_from_slice(v);
                true
            }
            OutData::Store { volume, offset, .. } => volumes.read(*volume, *offset, dst),
        }
    }

    /// Owned bytes, or no data segment at all when there are none.
    pub fn bytes(v: Vec<u8>) -> OutData {
        if v.is_empty() {
            OutData::None
        } else {
            OutData::Owned(v)
        }
    }

    pub fn len(&self) -> usize {
        match self {
            OutData::None => 0,
            OutData::Owned(v) => v.len(),
            OutData::Store { len, .. } => *len as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct OutPdu {
    /// The data segment length field is already set.
    pub bhs: Bhs,
    pub data: OutData,
    pub header_digest: bool,
    pub data_digest: bool,
    /// This response ends a counted SCSI command: once it is posted or
    /// written, the driver hands this back as [`Input::Served`].
    pub served: Option<Served>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    Send(OutPdu),
    /// iSER: RDMA-WRITE `data` to the initiator's buffer at `remote_addr`. It
    /// is queued before the SCSI Response of the same command, and RC ordering
    /// places it before that SEND arrives, so the driver needs no completion.
    RdmaWrite {
        stag: u32,
        remote_addr: u64,
        data: OutData,
    },
    /// iSER: RDMA-READ `len` bytes of the initiator's buffer into `dest`, then
    /// report [`Input::RdmaReadDone`] with `tag`.
    RdmaRead {
        tag: u32,
        stag: u32,
        remote_addr: u64,
        len: u32,
        dest: ReadDest,
    },
    /// Close the connection once everything before this action is sent.
    Close,
}

/// What a driver learns once, out of the engine ([`Connection::poll_event`](super::Connection::poll_event)),
/// instead of asking the connection after every input.
#[derive(Clone)]
pub enum Event {
    /// A normal session (one that moves data) reached full feature phase.
    /// Its final login response is queued behind this event, so a driver
    /// that handles events before it drains actions is ready (over iSER:
    /// its full receive ring posted) before the host's first command.
    NormalSession {
        /// Whose limits the login settled on (iSER only).
        iser_peer: Option<IserPeer>,
        /// The session's transfers into volume memory: what an abort waits
        /// for, so the driver raises it around each RDMA READ it posts.
        transfers: Arc<Transfers>,
    },
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::NormalSession { iser_peer, .. } => f
                .debug_struct("NormalSession")
                .field("iser_peer", iser_peer)
                .finish_non_exhaustive(),
        }
    }
}

/// Where an RDMA READ puts the initiator's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadDest {
    /// Straight into a volume's memory (SCSI checked the range).
    Store { volume: VolumeId, offset: u64 },
    /// Into the driver's own buffer; its bytes come back with the completion
    /// (parameter lists and other data the SCSI device must see first).
    Buffer,
}

/// The transport a connection runs on: it decides how data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// R2T / Data-Out / Data-In PDUs.
    Tcp,
    /// RDMA READ / WRITE of tagged initiator buffers; only control PDUs are sent.
    Iser,
}

/// The tagged buffers an iSER header named for a SCSI command: the
/// initiator's write data to RDMA-read and its read buffer to RDMA-write.
/// None on TCP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteBuffers {
    pub write: Option<RemoteBuffer>,
    pub read: Option<RemoteBuffer>,
}

/// Everything a transport delivers to the engine, through [`Connection::handle`](super::Connection::handle).
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// A PDU: its header, AHS and data segment (no padding or digests), with
    /// the buffers its iSER header named.
    Pdu {
        bhs: &'a Bhs,
        ahs: &'a [u8],
        data: &'a [u8],
        buffers: RemoteBuffers,
    },
    /// A PDU whose data digest did not match; its header was sound.
    DataDigestError(&'a Bhs),
    /// A PDU announcing a data segment longer than
    /// [`Connection::max_rx_data_segment`](super::Connection::max_rx_data_segment): a protocol error.
    Oversized(&'a Bhs),
    /// The RDMA READ of [`Action::RdmaRead`] `tag` finished (iSER). For
    /// [`ReadDest::Buffer`] `data` holds the bytes read; for the store it is
    /// empty.
    RdmaReadDone { tag: u32, data: &'a [u8] },
    /// A deadline [`Connection::poll_timeout`](super::Connection::poll_timeout) named has passed.
    Timeout,
    /// The response that carried `served` ([`OutPdu::served`]) was written
    /// or posted at `at_raw` (`metrics::clock().raw()`, read fresh: the
    /// `now` beside it may be a round old): its command's service time.
    Served { served: Served, at_raw: u64 },
    /// The connection's control was terminated. For a planned restart (the
    /// control carries its notice) the initiator of a normal session is
    /// told when to come back (an Async Message, AsyncEvent 3, after the
    /// transport's Time2Wait), then the connection closes: over iSER once
    /// the host confirmed the notice (within the restart drain), since its
    /// disconnect can overtake the notice. Any other termination ends the
    /// connection at once: nothing more is sent ([`Connection::has_ended`](super::Connection::has_ended)).
    /// Once is enough; more are harmless.
    Terminated,
    /// The transport is gone (the peer closed, an error, termination):
    /// release the session. The driver sends it once, last; more are
    /// harmless.
    Closed,
}

impl<'a> Input<'a> {
    /// A PDU that came without tagged buffers (every PDU on TCP).
    #[inline]
    pub fn pdu(bhs: &'a Bhs, ahs: &'a [u8], data: &'a [u8]) -> Input<'a> {
        Input::Pdu {
            bhs,
            ahs,
            data,
            buffers: RemoteBuffers::default(),
        }
    }

    /// The response that carried `served` went out just now.
    #[inline]
    pub fn served_now(served: Served) -> Input<'a> {
        Input::Served {
            served,
            at_raw: crate::metrics::clock().raw(),
        }
    }

    /// A PDU that came in an iSER message, with the buffers its header tagged.
    #[inline]
    pub fn iser(pdu: &'a ControlPdu<'a>) -> Input<'a> {
        Input::Pdu {
            bhs: &pdu.bhs,
            ahs: pdu.ahs,
            data: pdu.data,
            buffers: RemoteBuffers {
                write: pdu.write,
                read: pdu.read,
            },
        }
    }
}
