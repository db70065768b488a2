#![no_main]
//! iSER header, message and CM private data: decode and parse never panic;
//! what decodes re-encodes to the same value.
use libfuzzer_sys::fuzz_target;
use ramslog_common::iser::{CmRequest, Header, Message, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        let mut b = [0u8; HEADER_LEN];
        assert_eq!(h.encode_into(&mut b), Ok(HEADER_LEN));
        assert_eq!(Header::decode(&b), Ok(h));
    }
    let _ = CmRequest::parse(data);
    let _ = Message::parse(data, 8192);
});
