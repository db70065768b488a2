//! iSCSI (RFC 7143) wire format: basic header segment, text keys, digests.

mod bhs;
pub mod chap;
pub mod digest;
pub mod frame;
pub mod keys;
pub mod text;

pub use bhs::*;

/// Round `len` up to the 4-byte boundary that iSCSI pads data segments to.
pub const fn padded(len: usize) -> usize {
    (len + 3) & !3
}
