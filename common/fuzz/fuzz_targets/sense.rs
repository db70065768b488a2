#![no_main]
//! Sense decode: never panics; fixed-format sense we encode decodes back.
use libfuzzer_sys::fuzz_target;
use ramslog_common::scsi_wire::Sense;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = Sense::decode(data) {
        if data.first().is_some_and(|b| b & 0x7f == 0x70) && data.len() >= 18 {
            assert_eq!(Sense::decode(&s.encode_fixed()).map(|d| (d.key, d.asc, d.ascq)), Ok((s.key, s.asc, s.ascq)));
        }
    }
});
