//! ramslog-target: a pinned-RAM SCSI disk served over iSCSI and iSER.
//!
//! Layers, top to bottom (each only calls the ones below it):
//! `tcp`, `rdma` (transport drivers) → `engine` (sans-IO iSCSI) → `scsi` (one SBC
//! device) → `volume` (a LUN's memory, identity, readiness, the fence and
//! persistence: generations, the state directory, images) → `store` (the
//! memory itself). `volume` and `store` name nothing above them
//! (`tests/layers.rs` checks it), so another front end can stand on them.
//! `config`, `admission` (which connections are kept), `portal` and
//! `control` form the control plane and stay off the I/O path.

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
