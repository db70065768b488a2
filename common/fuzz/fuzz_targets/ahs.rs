#![no_main]
//! AHS walk: never panics, never reads past the buffer, terminates.
use libfuzzer_sys::fuzz_target;
use ramslog_common::iscsi::parse_ahs;

fuzz_target!(|data: &[u8]| {
    let mut n = 0;
    for entry in parse_ahs(data) {
        if let Ok(a) = entry {
            assert!(a.data.len() <= data.len());
        }
        n += 1;
        assert!(n <= data.len() + 1);
    }
});
