#![no_main]
//! Text key decode: never panics; decoded pairs re-encode and decode identically.
use libfuzzer_sys::fuzz_target;
use ramslog_common::iscsi::text;

fuzz_target!(|data: &[u8]| {
    if let Ok(pairs) = text::decode(data) {
        let mut buf = Vec::new();
        for p in &pairs {
            text::encode_pair(&mut buf, p.key, p.value);
        }
        assert_eq!(text::decode(&buf).as_deref(), Ok(&pairs[..]));
    }
});
