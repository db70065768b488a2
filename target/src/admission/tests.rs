use super::*;

fn limits() -> ConnectionLimits {
    ConnectionLimits {
        total: 5,
        per_source: 3,
        rdma: 1,
        iscsi: 5,
        pending: 4,
        pending_rdma: 2,
        pending_per_source: 2,
        discovery: 3,
        discovery_per_source: 2,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// A permit with a control watching it, as a driver holds them.
fn connect(gate: &Arc<ConnectionGate>, from: &str, link: Link) -> (Permit, Arc<SessionControl>) {
    let permit = gate.admit(ip(from), Door::iscsi(link)).expect("admitted");
    let control = SessionControl::new();
    permit.watch(control.clone());
    (permit, control)
}

#[test]
fn pending_connections_are_capped_per_source_and_age_out_in_total() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (_a1, a1) = connect(&gate, "192.0.2.1", Link::Tcp);
    let (_a2, a2) = connect(&gate, "192.0.2.1", Link::Tcp);
    assert_eq!(
        gate.admit(ip("192.0.2.1"), Door::iscsi(Link::Tcp)).err(),
        Some(Refusal::PendingPerSource(2))
    );
    // An IPv4-mapped IPv6 source is the same host.
    assert_eq!(
        gate.admit(ip("::ffff:192.0.2.1"), Door::iscsi(Link::Tcp))
            .err(),
        Some(Refusal::PendingPerSource(2))
    );
    let (_b1, b1) = connect(&gate, "192.0.2.2", Link::Tcp);
    let (_c1, c1) = connect(&gate, "192.0.2.3", Link::Tcp);
    // The pending pool (4) is full: the newcomer gets in, and the oldest
    // connection of the source holding the most (192.0.2.1, two) is ended.
    let (_d1, d1) = connect(&gate, "192.0.2.4", Link::Tcp);
    assert!(
        a1.is_terminated(),
        "the oldest of the busiest source is evicted"
    );
    assert!(!a2.is_terminated() && !b1.is_terminated() && !c1.is_terminated());
    assert!(!d1.is_terminated());
    assert_eq!(gate.counters().limit_hits(LimitHit::PendingLogins), 1);
    // The evicted connection no longer counts, even before it ends.
    let (_e1, _) = connect(&gate, "192.0.2.5", Link::Tcp);
    assert!(a2.is_terminated(), "192.0.2.1 still holds the most");
}

#[test]
fn rdma_connections_have_their_own_pending_cap() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (_t, tcp) = connect(&gate, "192.0.2.9", Link::Tcp);
    let (_r1, r1) = connect(&gate, "192.0.2.1", Link::Rdma);
    let (_r2, _) = connect(&gate, "192.0.2.2", Link::Rdma);
    let (_r3, _) = connect(&gate, "192.0.2.3", Link::Rdma);
    assert!(
        r1.is_terminated(),
        "the RDMA pending cap (2) evicts an RDMA connection"
    );
    assert!(!tcp.is_terminated(), "never a TCP one");
}

#[test]
fn logged_in_connections_leave_the_pending_pool_and_meet_their_own_caps() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let mut admitted = Vec::new();
    for n in 1..=4 {
        let (p, c) = connect(&gate, "192.0.2.2", Link::Tcp);
        match gate.logged_in(&c, LoggedIn::Admitted) {
            Ok(()) => admitted.push((p, c)),
            Err(why) => {
                assert_eq!(why, Refusal::PerSource(3), "connection {n}");
                assert_eq!(n, 4);
            }
        }
    }
    assert_eq!(
        admitted.len(),
        3,
        "192.0.2.2 has three, its fourth is refused"
    );
    let (p, c) = connect(&gate, "192.0.2.1", Link::Tcp);
    gate.logged_in(&c, LoggedIn::Admitted)
        .expect("another host");
    admitted.push((p, c));
    // The pending pool is empty again: four more can wait to log in.
    let pending: Vec<_> = (1..=4)
        .map(|n| connect(&gate, &format!("198.51.100.{n}"), Link::Tcp))
        .collect();
    assert!(pending.iter().all(|(_, c)| !c.is_terminated()));
    assert!(
        admitted.iter().all(|(_, c)| !c.is_terminated()),
        "never evicted"
    );
    let (_p, c) = connect(&gate, "203.0.113.1", Link::Tcp);
    gate.logged_in(&c, LoggedIn::Admitted)
        .expect("fifth admitted");
    let (_p, c) = connect(&gate, "203.0.113.2", Link::Tcp);
    assert_eq!(
        gate.logged_in(&c, LoggedIn::Admitted),
        Err(Refusal::Total(5))
    );
    assert_eq!(gate.counters().limit_hits(LimitHit::Connections), 1);
    let (_p, c) = connect(&gate, "203.0.113.3", Link::Rdma);
    assert_eq!(
        gate.logged_in(&c, LoggedIn::Admitted),
        Err(Refusal::Total(5))
    );
}

#[test]
fn admitted_connections_meet_the_rdma_cap_and_their_front_ends_cap() {
    let gate = Arc::new(ConnectionGate::new(ConnectionLimits {
        iscsi: 3,
        ..limits()
    }));
    let (_r1, r1) = connect(&gate, "192.0.2.1", Link::Rdma);
    gate.logged_in(&r1, LoggedIn::Admitted).expect("first RDMA");
    let (_r2, r2) = connect(&gate, "192.0.2.2", Link::Rdma);
    assert_eq!(
        gate.logged_in(&r2, LoggedIn::Admitted),
        Err(Refusal::Rdma(1)),
        "the RDMA cap counts RDMA connections only"
    );
    assert_eq!(gate.counters().limit_hits(LimitHit::RdmaConnections), 1);
    let mut tcp = Vec::new();
    for n in 1..=2 {
        let (p, c) = connect(&gate, &format!("198.51.100.{n}"), Link::Tcp);
        gate.logged_in(&c, LoggedIn::Admitted)
            .expect("TCP beside the RDMA one");
        tcp.push((p, c));
    }
    // Three iSCSI connections, one over RDMA: the fourth meets the front
    // end's cap (3) before the total (5).
    let (_t, t) = connect(&gate, "198.51.100.9", Link::Tcp);
    assert_eq!(
        gate.logged_in(&t, LoggedIn::Admitted),
        Err(Refusal::FrontEnd(FrontEnd::Iscsi, 3))
    );
    assert_eq!(gate.counters().limit_hits(LimitHit::IscsiConnections), 1);
    assert_eq!(
        Refusal::FrontEnd(FrontEnd::Iscsi, 3).to_string(),
        "3 logged-in iSCSI connections (the limit)"
    );
    let open = gate.counts_now();
    assert_eq!((open.total, open.rdma, open.tcp()), (5, 2, 3));
    assert_eq!(
        open.of(FrontEnd::Iscsi),
        5,
        "every open connection, any pool"
    );
    // A place given back is a place for the next one.
    drop(tcp.pop());
    let (_t2, t2) = connect(&gate, "198.51.100.10", Link::Tcp);
    gate.logged_in(&t2, LoggedIn::Admitted)
        .expect("the place came back");
}

#[test]
fn discovery_sessions_have_their_own_pool() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let mut held = Vec::new();
    for from in ["192.0.2.1", "192.0.2.1", "192.0.2.2"] {
        let (p, c) = connect(&gate, from, Link::Tcp);
        gate.logged_in(&c, LoggedIn::Discovery).expect("discovery");
        held.push((p, c));
    }
    let (_p, c) = connect(&gate, "192.0.2.1", Link::Tcp);
    assert_eq!(
        gate.logged_in(&c, LoggedIn::Discovery),
        Err(Refusal::DiscoveryPerSource(2))
    );
    // The pool (3) is full: the oldest of the busiest source goes.
    let (_p, newcomer) = connect(&gate, "192.0.2.3", Link::Tcp);
    gate.logged_in(&newcomer, LoggedIn::Discovery)
        .expect("room made");
    assert!(held[0].1.is_terminated());
    assert!(!held[1].1.is_terminated() && !held[2].1.is_terminated());
    assert_eq!(gate.counters().limit_hits(LimitHit::DiscoverySessions), 1);
    // None of them counts against the admitted pool: five normal sessions fit.
    let admitted: Vec<_> = (1..=5)
        .map(|n| {
            let (p, c) = connect(&gate, &format!("198.51.100.{n}"), Link::Tcp);
            gate.logged_in(&c, LoggedIn::Admitted).expect("admitted");
            (p, c)
        })
        .collect();
    assert_eq!(admitted.len(), 5);
}

#[test]
fn an_evicted_connection_cannot_log_in_and_a_dropped_permit_releases() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let conns: Vec<_> = (1..=5)
        .map(|n| connect(&gate, &format!("192.0.2.{n}"), Link::Tcp))
        .collect();
    let first = &conns[0].1;
    assert!(first.is_terminated());
    assert_eq!(
        gate.logged_in(first, LoggedIn::Admitted),
        Err(Refusal::Evicted)
    );
    assert!(!first.is_released());
    assert_eq!(
        (gate.counts_now().total, gate.counts_now().rdma),
        (5, 0),
        "the evicted one is still open"
    );
    let first = first.clone();
    drop(conns);
    assert!(first.is_released(), "its permit is gone");
    assert_eq!(gate.counts_now(), OpenConnections::default());
}

#[test]
fn a_closed_gate_admits_nothing_and_ends_everyone() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (_p, c) = connect(&gate, "192.0.2.1", Link::Tcp);
    assert_eq!(gate.close(false), 1);
    assert!(c.is_terminated());
    assert_eq!(
        gate.admit(ip("192.0.2.2"), Door::iscsi(Link::Tcp)).err(),
        Some(Refusal::ShuttingDown)
    );
}

#[test]
fn sources_are_hosts_ipv4_slash_32_and_ipv6_slash_64() {
    assert_eq!(source_key(ip("::ffff:192.0.2.7")), ip("192.0.2.7"));
    assert_eq!(
        source_key(ip("2001:db8:1:2:aaaa:bbbb:cccc:dddd")),
        ip("2001:db8:1:2::")
    );
    let gate = Arc::new(ConnectionGate::new(limits()));
    let _a = connect(&gate, "2001:db8::1", Link::Tcp);
    let _b = connect(&gate, "2001:db8::2", Link::Tcp);
    assert_eq!(
        gate.admit(ip("2001:db8::3"), Door::iscsi(Link::Tcp)).err(),
        Some(Refusal::PendingPerSource(2)),
        "one /64 is one host"
    );
    assert!(gate
        .admit(ip("2001:db8:0:1::1"), Door::iscsi(Link::Tcp))
        .is_ok());
}

#[test]
fn refusals_are_logged_at_most_once_a_second_per_reason() {
    let log = LogLimiter {
        slots: Mutex::new(HashMap::new()),
    };
    assert_eq!(log.allow("a"), Some(0));
    assert_eq!(log.allow("a"), None);
    assert_eq!(log.allow("a"), None);
    assert_eq!(log.allow("b"), Some(0), "each reason has its own second");
}

#[test]
fn a_login_under_way_is_evicted_after_the_silent_connections() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (_l, login) = connect(&gate, "192.0.2.1", Link::Tcp);
    gate.heard_from(&login);
    let silent: Vec<_> = ["192.0.2.2", "192.0.2.3", "192.0.2.4"]
        .into_iter()
        .map(|from| connect(&gate, from, Link::Tcp))
        .collect();
    // Silence counts once a connection had its grace to speak.
    std::thread::sleep(SILENCE_GRACE);
    let _newcomers: Vec<_> = ["198.51.100.1", "198.51.100.2", "198.51.100.3"]
        .into_iter()
        .map(|from| connect(&gate, from, Link::Tcp))
        .collect();
    assert!(
        silent.iter().all(|(_, c)| c.is_terminated()),
        "the silent ones went"
    );
    assert!(
        !login.is_terminated(),
        "the oldest, but its login is under way"
    );
}

#[test]
fn the_source_that_reconnects_the_most_is_evicted_first() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (_host, host) = connect(&gate, "192.0.2.1", Link::Tcp);
    // A flooder: connects, is closed, connects again, many times a second.
    for _ in 0..20 {
        drop(connect(&gate, "198.51.100.1", Link::Tcp));
    }
    let (_f1, f1) = connect(&gate, "198.51.100.1", Link::Tcp);
    let (_o1, o1) = connect(&gate, "203.0.113.1", Link::Tcp);
    let (_o2, _) = connect(&gate, "203.0.113.2", Link::Tcp);
    // The pool (4) is full: the flooder's connection goes, though the
    // host's is the oldest and holds as many.
    let (_n, _) = connect(&gate, "203.0.113.3", Link::Tcp);
    assert!(f1.is_terminated());
    assert!(!host.is_terminated() && !o1.is_terminated());
}

#[test]
fn an_rdma_discovery_session_stays_within_the_rdma_pending_cap() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (_d, discovery) = connect(&gate, "192.0.2.1", Link::Rdma);
    gate.logged_in(&discovery, LoggedIn::Discovery)
        .expect("discovery over iSER");
    let (_p, _) = connect(&gate, "192.0.2.2", Link::Rdma);
    // Two RDMA connections pin slots; the third makes one of them go.
    let (_n, _) = connect(&gate, "192.0.2.3", Link::Rdma);
    assert!(discovery.is_terminated(), "it counted as pending");
}

#[test]
fn a_new_login_survives_a_reconnecting_rdma_discovery_flood() {
    let gate = Arc::new(ConnectionGate::new(ConnectionLimits::default()));
    let sources = ["10.99.0.11", "10.99.0.12", "10.99.0.13"];
    let mut held = Vec::new();
    // The flood: discovery sessions that are evicted and come back at once.
    let flood = |held: &mut Vec<(Permit, Arc<SessionControl>)>| {
        for round in 0..40 {
            let from = sources[round % 3];
            if let Ok(permit) = gate.admit(ip(from), Door::iscsi(Link::Rdma)) {
                let control = SessionControl::new();
                permit.watch(control.clone());
                gate.heard_from(&control);
                let _ = gate.logged_in(&control, LoggedIn::Discovery);
                held.push((permit, control));
            }
            held.retain(|(_, c)| !c.is_terminated());
        }
    };
    flood(&mut held);
    let (_legit, legit) = connect(&gate, "10.99.0.1", Link::Rdma);
    flood(&mut held);
    assert!(
        !legit.is_terminated(),
        "the new login was evicted by the flood"
    );
}

/// Until a connection waits in `reserve_login_slots` (it counts itself
/// under the gate's lock and waits on the condition variable, which lets
/// the lock go: whatever changes the slots from here on wakes it).
fn until_a_slot_waiter(gate: &ConnectionGate) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while gate.slot_waiters() == 0 {
        assert!(
            Instant::now() < deadline,
            "no connection waits for login slots"
        );
        std::thread::yield_now();
    }
}

#[test]
fn evicted_rdma_connections_hold_their_login_slots_until_they_are_gone() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let patience = Duration::from_millis(50);
    let (a, a_control) = connect(&gate, "192.0.2.1", Link::Rdma);
    a.reserve_login_slots(patience).expect("room for the first");
    let (b, _b_control) = connect(&gate, "192.0.2.2", Link::Rdma);
    b.reserve_login_slots(patience)
        .expect("room for the second");
    // The RDMA pending pool (2) is full: the newcomer evicts the oldest,
    // but that one's slots stay pinned until its permit drops.
    let (c, _c_control) = connect(&gate, "192.0.2.3", Link::Rdma);
    assert!(a_control.is_terminated(), "the oldest is evicted");
    assert_eq!(
        c.reserve_login_slots(patience),
        Err(Refusal::RdmaLoginSlots(2)),
        "an evicted connection still tearing down counts against the cap"
    );
    assert_eq!(gate.counters().limit_hits(LimitHit::RdmaLoginSlots), 1);
    // d evicts b. Once a is torn down, the waiting d gets its slots.
    let (d, d_control) = connect(&gate, "192.0.2.4", Link::Rdma);
    let waiter = std::thread::spawn(move || {
        let got = d.reserve_login_slots(Duration::from_secs(10));
        (got, d)
    });
    until_a_slot_waiter(&gate);
    drop(a);
    let (got, _d) = waiter.join().expect("waiter");
    assert_eq!(got, Ok(()));
    // Held: b (evicted, tearing down) and d. Once d is admitted its slots
    // no longer count as a pending connection's.
    drop(c);
    gate.logged_in(&d_control, LoggedIn::Admitted)
        .expect("admitted");
    let (e, _e_control) = connect(&gate, "192.0.2.5", Link::Rdma);
    e.reserve_login_slots(patience)
        .expect("room once d is admitted");
    drop(b);
}

#[test]
fn a_connection_waiting_for_login_slots_ends_when_evicted() {
    let gate = Arc::new(ConnectionGate::new(limits()));
    let (a, _ac) = connect(&gate, "192.0.2.1", Link::Rdma);
    a.reserve_login_slots(Duration::ZERO).expect("room");
    let (b, _bc) = connect(&gate, "192.0.2.2", Link::Rdma);
    b.reserve_login_slots(Duration::ZERO).expect("room");
    // c evicts a (whose slots stay until it is gone); c waits.
    let (c, _cc) = connect(&gate, "192.0.2.3", Link::Rdma);
    let started = Instant::now();
    let waiter = std::thread::spawn(move || c.reserve_login_slots(Duration::from_secs(10)));
    until_a_slot_waiter(&gate);
    // d evicts b, the oldest in the pool; e evicts the waiting c, which
    // gives up at once rather than at the end of its patience.
    let (_d, _dc) = connect(&gate, "192.0.2.4", Link::Rdma);
    let (_e, _ec) = connect(&gate, "192.0.2.5", Link::Rdma);
    assert_eq!(waiter.join().expect("waiter"), Err(Refusal::Evicted));
    assert!(started.elapsed() < Duration::from_secs(5));
    // A TCP connection pins nothing: it never waits.
    let (t, _tc) = connect(&gate, "192.0.2.9", Link::Tcp);
    assert_eq!(t.reserve_login_slots(Duration::ZERO), Ok(()));
    drop((a, b));
}
