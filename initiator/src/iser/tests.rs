use super::engine::classify;
use super::*;
use ramslog_common::iscsi::RejectReason;

#[test]
fn profiles_set_their_keys() {
    let mut p = LoginParams::normal("iqn.i", "iqn.t");
    p.immediate_data = false;
    IserProfile::Linux.apply(&mut p);
    assert_eq!(p.dialect, LoginDialect::IserRdmaExtensions);
    let k = p.operational_keys();
    assert_eq!(get(&k, "RDMAExtensions"), Some("Yes"));
    assert_eq!(get(&k, "InitiatorRecvDataSegmentLength"), Some("8192"));
    assert_eq!(get(&k, "ImmediateData"), Some("Yes"));

    let mut p = LoginParams::normal("iqn.i", "iqn.t");
    IserProfile::Illumos.apply(&mut p);
    assert_eq!(p.dialect, LoginDialect::Illumos);
    let k = p.operational_keys();
    for (key, v) in [
        ("MaxRecvDataSegmentLength", "8192"),
        ("DefaultTime2Retain", "20"),
        ("InitialR2T", "Yes"),
        ("ImmediateData", "Yes"),
        ("MaxBurstLength", "262144"),
        ("FirstBurstLength", "65536"),
        ("MaxOutstandingR2T", "1"),
    ] {
        assert_eq!(get(&k, key), Some(v), "{key}");
    }
}

#[test]
fn private_data_per_profile() {
    assert_eq!(IserProfile::Linux.private_data(), LINUX_CM_PRIVATE_DATA);
    let i = IserProfile::Illumos.private_data();
    assert_eq!(i.len(), 56);
    assert_eq!(&i[..4], &[0, 0, 0, 0xC0]);
    assert!(i[4..].iter().all(|b| *b != 0));
    let parsed = ramslog_common::iser::CmRequest::parse(&i);
    assert_eq!(parsed.peer, ramslog_common::iser::CmPeer::Illumos);
    assert_eq!(
        ramslog_common::iser::CmRequest::parse(&IserProfile::Linux.private_data()).peer,
        ramslog_common::iser::CmPeer::Linux
    );
}

#[test]
fn tags() {
    let t = Tag(5 << 16 | 3);
    assert_eq!((t.slot(), t.generation()), (3, 5));
}

#[test]
fn classify_rejects_data_pdus_and_sorts_the_rest() {
    let b = Bhs::new(Opcode::DataIn);
    assert!(matches!(classify(&b, &[]), Err(Error::Protocol(_))));
    let mut ping = Bhs::new(Opcode::NopIn);
    ping.set_itt(RESERVED_TAG).set_ttt(9);
    assert!(matches!(classify(&ping, b"x"), Ok(Rx::TargetPing { .. })));
    ping.set_ttt(RESERVED_TAG);
    assert!(matches!(classify(&ping, &[]), Ok(Rx::Ignore)));
    let rej = Bhs::reject(RejectReason::ProtocolError);
    let mut rejected = Bhs::new(Opcode::ScsiCommand);
    rejected.set_itt(0x10002);
    match classify(&rej, rejected.as_bytes()) {
        Ok(Rx::Reject { itt, reason, .. }) => assert_eq!((itt, reason), (0x10002, 4)),
        _ => panic!("expected a Reject"),
    }
    let mut rsp = Bhs::new(Opcode::ScsiResponse);
    rsp.set_itt(0x10001);
    assert!(matches!(
        classify(&rsp, &[]),
        Ok(Rx::Response {
            itt: 0x10001,
            status: Ok(_)
        })
    ));
    assert!(matches!(
        classify(&Bhs::new(Opcode::ScsiCommand), &[]),
        Err(Error::Protocol(_))
    ));
}
