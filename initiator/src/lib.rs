//! Userspace iSCSI initiator on ramslog-common's codecs.
#![deny(unsafe_code)]
