//! The iSCSI front end: the sans-IO connection engine (login, sessions,
//! commands, over TCP and iSER) and the portal, iSCSI's own view (targets,
//! IQNs, ACLs, CHAP, sessions) beside the [`Core`](crate::core::Core) it
//! holds. The SCSI device model it serves, `scsi/`, and the transports it
//! runs over, `tcp` and `rdma`, stand apart.

pub mod engine;
pub mod portal;
pub mod tcp;
