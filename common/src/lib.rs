//! Wire formats shared by the ramslog target, initiator and bench.
//!
//! Pure codecs: nothing here does I/O. Decoders borrow their input and return
//! typed errors; encoders write into caller-owned buffers. The one exception
//! is `verbs` (feature `rdma`): the safe RDMA verbs / rdma_cm wrapper that the
//! target and the initiator share, and the only place with unsafe code here.

pub mod cdb;
pub mod iscsi;
pub mod iser;
pub mod lun;
pub mod scsi_wire;
pub mod serial;
#[cfg(feature = "rdma")]
pub mod verbs;
