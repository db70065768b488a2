use super::*;
use ramslog_common::iscsi::{login_status, text, LoginResponse};

fn response(req: &Bhs, flags: u8, tsih: u16, keys: &[(&str, &str)]) -> (Bhs, Vec<u8>) {
    let mut b = Bhs::login_response(LoginResponse {
        flags,
        isid: req.isid(),
        tsih,
        itt: req.itt(),
        status: login_status::SUCCESS,
    });
    b.set_statsn(7)
        .set_exp_cmdsn(req.cmdsn())
        .set_max_cmdsn(req.cmdsn() + 31);
    let mut d = Vec::new();
    for (k, v) in keys {
        text::encode_pair(&mut d, k, v);
    }
    (b, d)
}

fn sent_keys(data: &[u8]) -> Vec<(String, String)> {
    decode_keys(data).unwrap()
}

#[test]
fn login_without_chap_two_exchanges() {
    let p = LoginParams::normal("iqn.i", "iqn.t");
    let mut seq = SeqState::default();
    let (mut m, req, data) = LoginMachine::start(&p, 9, &mut seq).unwrap();
    assert_eq!(req.flags(), login::TRANSIT | login::STAGE_OPERATIONAL);
    assert_eq!(req.exp_statsn(), 0);
    assert_eq!(get(&sent_keys(&data), "AuthMethod"), Some("None"));
    let (r, d) = response(&req, login::TRANSIT | login::STAGE_OPERATIONAL, 0, &[]);
    let LoginStep::Send(req, data) = m.handle(&r, &d, &mut seq).unwrap() else {
        panic!("expected the operational request");
    };
    assert_eq!(
        req.flags(),
        login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE
    );
    assert_eq!(req.exp_statsn(), 8);
    assert_eq!(get(&sent_keys(&data), "MaxBurstLength"), Some("1048576"));
    let (r, d) = response(
        &req,
        login::TRANSIT | (login::STAGE_OPERATIONAL << 2) | login::STAGE_FULL_FEATURE,
        0x42,
        &[
            ("ImmediateData", "No"),
            ("MaxRecvDataSegmentLength", "8192"),
            ("ErrorRecoveryLevel", "0"),
        ],
    );
    let LoginStep::Done(o) = m.handle(&r, &d, &mut seq).unwrap() else {
        panic!("expected the end of login");
    };
    assert_eq!(o.tsih, 0x42);
    assert!(!o.negotiated.immediate_data);
    assert!(m.handle(&r, &d, &mut seq).is_err());
}

#[test]
fn login_answers_target_offers_and_rejects_bad_responses() {
    let p = LoginParams::discovery("iqn.i");
    let mut seq = SeqState::default();
    let (mut m, req, _) = LoginMachine::start(&p, 1, &mut seq).unwrap();
    // Another ITT is a protocol error; a failure status is LoginFailed.
    let (mut r, d) = response(&req, login::TRANSIT | 1, 0, &[]);
    r.set_itt(2);
    assert!(matches!(
        m.handle(&r, &d, &mut seq),
        Err(Error::Protocol(_))
    ));
    let (mut r, d) = response(&req, 0, 0, &[]);
    r.fail_login(login_status::AUTH_FAILED);
    assert!(matches!(
        m.handle(&r, &d, &mut seq),
        Err(Error::LoginFailed {
            class: 2,
            detail: 1
        })
    ));
    let (r, d) = response(&req, login::TRANSIT | 1, 0, &[]);
    let LoginStep::Send(req, _) = m.handle(&r, &d, &mut seq).unwrap() else {
        panic!()
    };
    // The target offers a key of its own and does not transit yet.
    let (r, d) = response(&req, 1 << 2, 0, &[("X-vendor", "1")]);
    let LoginStep::Send(req, data) = m.handle(&r, &d, &mut seq).unwrap() else {
        panic!()
    };
    assert_eq!(
        sent_keys(&data),
        [("X-vendor".into(), "NotUnderstood".into())]
    );
    let (r, d) = response(&req, login::TRANSIT | (1 << 2) | 3, 5, &[]);
    assert!(matches!(
        m.handle(&r, &d, &mut seq).unwrap(),
        LoginStep::Done(LoginOutcome { tsih: 5, .. })
    ));
}

#[test]
fn long_text_goes_in_continued_requests() {
    let mut p = LoginParams::normal("iqn.i", "iqn.t");
    p.extra_keys = vec![("X-long".into(), "v".repeat(10_000))];
    let mut seq = SeqState::default();
    let (mut m, req, _) = LoginMachine::start(&p, 3, &mut seq).unwrap();
    let (r, d) = response(&req, login::TRANSIT | 1, 0, &[]);
    let LoginStep::Send(req, data) = m.handle(&r, &d, &mut seq).unwrap() else {
        panic!()
    };
    assert_eq!(req.flags() & login::CONTINUE, login::CONTINUE);
    assert_eq!(req.flags() & login::TRANSIT, 0);
    assert_eq!(data.len(), LOGIN_MAX_DATA as usize);
    let (r, d) = response(&req, 1 << 2, 0, &[]);
    let LoginStep::Send(req, data) = m.handle(&r, &d, &mut seq).unwrap() else {
        panic!()
    };
    assert_eq!(req.flags() & login::CONTINUE, 0);
    assert_eq!(req.flags() & login::TRANSIT, login::TRANSIT);
    assert!(!data.is_empty());
    // The target continues its answer over two responses.
    let (r, d) = response(&req, login::CONTINUE | (1 << 2), 0, &[("X-long", "Not")]);
    let LoginStep::Send(_, data) = m.handle(&r, &d[..d.len() - 1], &mut seq).unwrap() else {
        panic!()
    };
    assert!(data.is_empty());
    let mut tail = b"Understood".to_vec();
    tail.push(0);
    let (r, _) = response(&req, login::TRANSIT | (1 << 2) | 3, 9, &[]);
    let LoginStep::Done(o) = m.handle(&r, &tail, &mut seq).unwrap() else {
        panic!()
    };
    assert_eq!(
        get(&o.negotiated.target_keys, "X-long"),
        Some("NotUnderstood")
    );
}

#[test]
fn text_exchange_follows_continuation() {
    let mut x = TextExchange::new(4, &[("SendTargets".into(), "All".into())]);
    let (b, d) = x.request().unwrap();
    assert_eq!((b.itt(), b.ttt()), (4, RESERVED_TAG));
    assert_eq!(d, b"SendTargets=All\0");
    let mut r = Bhs::new(Opcode::TextResponse);
    r.set_flags(0x40).set_itt(4).set_ttt(77);
    assert_eq!(x.response(&r, b"TargetName=iqn").unwrap(), None);
    let (b, d) = x.request().unwrap();
    assert_eq!(b.ttt(), 77);
    assert!(d.is_empty());
    r.set_flags(0x80);
    let keys = x.response(&r, b".x\0").unwrap().unwrap();
    assert_eq!(keys, [("TargetName".into(), "iqn.x".into())]);
    r.set_flags(0xc0);
    assert!(x.response(&r, b"").is_err());
}
