//! Userspace iSCSI initiator on ramslog-common's codecs.
//!
//! Three entry points:
//! - [`Connection`]: one TCP connection, login, and raw PDU send/receive with
//!   digests and sequence-number bookkeeping. For tests that send hostile input.
//! - [`Session`]: a logged-in, pipelined session usable from many tasks at once
//!   (`&self`), with SCSI command helpers. For the bench and data-integrity tests.
//! - [`iser::IserSession`]: the same over iSER (RDMA), blocking and
//!   single-threaded, behaving like the Linux or the illumos initiator.

pub use ramslog_common::cdb;
pub mod chap;
mod conn;
pub mod datain;
mod discovery;
mod error;
mod exchange;
pub mod iser;
mod login;
#[cfg(test)]
mod pair_tests;
pub mod pdu;
pub mod seq;
mod session;
pub mod url;

use ramslog_common::lun::Lun;

pub use conn::{Connection, DEFAULT_PORT};
pub use datain::{Residual, ScsiResult};
pub use discovery::discover;
pub use error::Error;
pub use login::{
    ChapParams, Credentials, Digest, LoginDialect, LoginOutcome, LoginParams, Negotiated,
    SessionType, DEFAULT_INITIATOR_NAME,
};
pub use pdu::{Digests, Pdu};
pub use session::Session;
pub use url::{TargetUrl, Transport};

/// Encode a LUN number as the 8-byte LUN field (see [`Lun`]).
pub fn encode_lun(lun: u64) -> Result<u64, Error> {
    Lun::new(lun).map(Lun::to_wire).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "LUN {lun} is above {} and needs an addressing method this initiator does not encode",
            Lun::MAX
        ))
    })
}

/// Decode an 8-byte LUN field to a LUN number; a field in any other form
/// than [`Lun`]'s is returned as the raw 64-bit value, for display.
pub fn decode_lun(raw: u64) -> u64 {
    Lun::from_wire(raw).map_or(raw, Lun::number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lun_encoding() {
        assert_eq!(encode_lun(1).unwrap(), 0x0001_0000_0000_0000);
        assert_eq!(encode_lun(300).unwrap(), 0x412c_0000_0000_0000);
        assert!(encode_lun(0x4000).is_err());
        for l in [0u64, 1, 255, 256, 0x3fff] {
            assert_eq!(decode_lun(encode_lun(l).unwrap()), l);
        }
        assert_eq!(decode_lun(0x0001_0000_0000_0001), 0x0001_0000_0000_0001);
    }
}
