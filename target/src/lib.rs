//! ramslog-target: a pinned-RAM block device served over iSCSI and iSER.
//!
//! The house, top to bottom (docs/design.md draws it): `daemon` (the
//! phases) builds everything; the faces (`control`, `exposition`) and the
//! `lifecycle` work on the `core`; the iSCSI front end (`iscsi`: engine,
//! portal, its TCP framing) stands on `scsi` (one SBC device) and the core;
//! the transports (`tcp`, `rdma`) carry it; the `core` (volumes, exports,
//! the admission gate, staging, counters) stands on `volume` (a LUN's
//! memory, identity, readiness, the fence and persistence) and `store` (the
//! memory itself). `volume` and `store` name nothing above them, the core
//! and the faces name no front end (`tests/layers.rs` checks it), so
//! another front end can stand beside iSCSI.

pub mod admission;
pub mod clock;
pub mod config;
pub mod control;
pub mod core;
pub mod daemon;
pub mod exposition;
pub mod handover;
pub mod iscsi;
pub mod lifecycle;
pub mod metrics;
pub mod private_dir;
pub mod rdma;
pub mod scsi;
pub mod signals;
pub mod store;
pub mod systemd;
pub mod tcp;
pub mod test_pause;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod volume;
