//! Errors, grouped by who is to blame.

use std::io;
use std::sync::Arc;

use ramslog_common::scsi_wire::Sense;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    // --- transport ---
    #[error("I/O error: {0}")]
    Io(Arc<io::Error>),
    /// The target closed the connection (clean EOF between PDUs).
    #[error("connection closed by the target")]
    Closed,
    #[error("timed out waiting for {0}")]
    Timeout(String),
    /// A verbs or rdma_cm call failed, or a work request completed in error.
    #[error("RDMA: {0}")]
    Rdma(String),

    // --- the target misbehaved ---
    #[error("protocol violation by the target: {0}")]
    Protocol(String),
    #[error("{} digest mismatch on a PDU from the target", if *.header { "header" } else { "data" })]
    Digest { header: bool },

    // --- login and authentication ---
    #[error("login failed: status class {class:#04x}, detail {detail:#04x}")]
    LoginFailed { class: u8, detail: u8 },
    #[error("authentication failed: {0}")]
    Auth(String),

    // --- the target answered this command (not a connection error) ---
    #[error("the target rejected the PDU, reason {reason:#04x}")]
    Rejected { reason: u8 },
    #[error("iSCSI response {0:#04x} (target failure)")]
    TargetFailure(u8),
    #[error("SCSI status {status:#04x}, sense {sense:?}")]
    Scsi { status: u8, sense: Option<Sense> },

    // --- API misuse / not implemented ---
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Closed
        } else {
            Error::Io(Arc::new(e))
        }
    }
}

impl From<ramslog_common::verbs::Error> for Error {
    fn from(e: ramslog_common::verbs::Error) -> Self {
        Error::Rdma(e.to_string())
    }
}

impl Error {
    pub(crate) fn proto(msg: impl Into<String>) -> Self {
        Error::Protocol(msg.into())
    }
}

impl From<ramslog_common::verbs::CmWaitError> for Error {
    fn from(e: ramslog_common::verbs::CmWaitError) -> Self {
        use ramslog_common::verbs::CmWaitError;
        match e {
            CmWaitError::Timeout { want } => Error::Timeout(format!("the rdma_cm event {want:?}")),
            CmWaitError::Verbs(e) => e.into(),
            other => Error::Rdma(other.to_string()),
        }
    }
}
