#![no_main]
//! BHS decode: never panics, and what decodes re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use ramslog_common::iscsi::{Bhs, PduLayout};

fuzz_target!(|data: &[u8]| {
    if let Ok(bhs) = Bhs::decode(data) {
        let mut out = [0u8; 48];
        assert_eq!(bhs.encode_into(&mut out), Ok(48));
        assert_eq!(&out[..], data);
        let layout = PduLayout::of(&bhs, true, true);
        let _ = (layout.header_rest(), layout.data_wire_len(), bhs.cdb(), bhs.lun(), bhs.isid());
    }
});
