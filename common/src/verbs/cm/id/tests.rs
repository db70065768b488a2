use super::*;

#[test]
fn sockaddr_round_trip() {
    for s in ["10.99.0.1:7471", "[fe80::1%3]:3260", "[::1]:1", "0.0.0.0:0"] {
        let addr: SocketAddr = s.parse().unwrap();
        let raw = RawSockAddr::new(addr);
        // SAFETY: reading back the variant `new` wrote for this family.
        let back = unsafe {
            match addr {
                SocketAddr::V4(_) => from_v4(&raw.v4),
                SocketAddr::V6(_) => from_v6(&raw.v6),
            }
        };
        assert_eq!(back, addr, "{s}");
    }
}

#[test]
fn conn_param_limits() {
    let long = [0u8; 256];
    let p = ConnParam {
        private_data: &long,
        ..ConnParam::default()
    };
    assert!(matches!(p.to_raw("x"), Err(e) if e.errno() == Some(libc::EINVAL)));
    let p = ConnParam {
        private_data: &long[..56],
        ..ConnParam::default()
    };
    let raw = p.to_raw("x").unwrap();
    assert_eq!(raw.private_data_len, 56);
    assert_eq!(raw.flow_control, 1);
    let raw = ConnParam::default().to_raw("x").unwrap();
    assert!(raw.private_data.is_null());
}

#[test]
fn event_kinds() {
    use ffi::rdma_cm_event_type as t;
    assert_eq!(
        CmEventKind::from_raw(t::RDMA_CM_EVENT_CONNECT_REQUEST),
        CmEventKind::ConnectRequest
    );
    assert_eq!(
        CmEventKind::from_raw(t::RDMA_CM_EVENT_TIMEWAIT_EXIT),
        CmEventKind::TimewaitExit
    );
    assert_eq!(CmEventKind::from_raw(99), CmEventKind::Other(99));
}

#[test]
fn posting_refuses_ids_only_a_slot_buffer_may_use() {
    let ordinary = [ib::WrId::new(1, 0), ib::WrId::new((1 << 31) - 1, u32::MAX)];
    assert!(refuse_reserved_ids("post", ordinary.into_iter()).is_ok());
    for reserved in [ib::WrId::new(1 << 31, 0), ib::WrId::lent(1, 7, 3)] {
        let e = refuse_reserved_ids("post", [ib::WrId::new(1, 0), reserved].into_iter())
            .expect_err("a reserved id is refused");
        assert_eq!(e.posted, 0);
        assert_eq!(e.error.source.raw_os_error(), Some(libc::EINVAL));
    }
}
