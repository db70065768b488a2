//! Helpers shared by the end-to-end tests.
#![deny(unsafe_code)]
