//! Wire formats shared by the ramslog target, initiator and bench.
//!
//! Pure codecs: nothing here does I/O. Decoders borrow their input and return
//! typed errors; encoders write into caller-owned buffers.
#![deny(unsafe_code)]

pub mod iscsi;
pub mod iser;
pub mod scsi_wire;
pub mod serial;
