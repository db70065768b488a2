//! The initiator against a real target: `RAMSLOG_LIVE_URL=iscsi://host:port/IQN/LUN` (another
//! target, e.g. LIO or tgt; the LUN's content is overwritten), else a fresh `ramslog-target`
//! started here, so that every run exercises them.

use std::sync::Arc;

use ramslog_initiator::{discover, Connection, LoginParams, Session, TargetUrl};
use ramslog_tests::{secret_file, TargetOptions, TargetProcess};
use rand::Rng;

const INITIATOR: &str = "iqn.2026-11.org.ramslog:live-test";

/// `RAMSLOG_LIVE_URL`'s target, or a `ramslog-target` started with `extra_args` (stopped when
/// the returned process drops).
fn live_target(extra_args: Vec<String>) -> (TargetUrl, Option<TargetProcess>) {
    if let Ok(u) = std::env::var("RAMSLOG_LIVE_URL") {
        return (TargetUrl::parse(&u).expect("RAMSLOG_LIVE_URL"), None);
    }
    let t = TargetProcess::start_with(TargetOptions {
        extra_args,
        ..Default::default()
    });
    let url = TargetUrl::parse(&t.url(0)).expect("the started target's URL");
    (url, Some(t))
}

#[tokio::test]
async fn live_login_discovery_io() {
    let (url, _target) = live_target(Vec::new());
    let addr = url.socket_addr().await.unwrap();

    let targets = discover(addr, INITIATOR, None).await.unwrap();
    eprintln!("discovered {targets:?}");
    assert!(targets.iter().any(|(n, _)| *n == url.target_name));

    // Low-level login with digests on, then a NOP round trip by hand.
    let mut c = Connection::connect(addr).await.unwrap();
    let mut p = LoginParams::normal(INITIATOR, url.target_name.clone());
    p.header_digest = ramslog_initiator::Digest::PreferCrc32c;
    p.data_digest = ramslog_initiator::Digest::PreferCrc32c;
    let out = c.login(&p).await.unwrap();
    eprintln!("negotiated (CRC32C,None offered) {:?}", out.negotiated);
    let s = Session::from_connection(c).unwrap();
    s.nop().await.unwrap();
    let _ = s.test_unit_ready(url.lun).await.unwrap(); // eats the power-on unit attention
    let (_, bs0) = s.read_capacity16(url.lun).await.unwrap();
    let data: Vec<u8> = (0..64 * bs0).map(|i| (i % 251) as u8).collect();
    s.write(url.lun, 8, &data, true).await.unwrap();
    assert!(s.read(url.lun, 8, 64, bs0).await.unwrap() == data);
    s.logout().await.unwrap();

    let s = Arc::new(
        Session::login(
            addr,
            LoginParams::normal(INITIATOR, url.target_name.clone()),
        )
        .await
        .unwrap(),
    );
    eprintln!("negotiated {:?}", s.negotiated());
    let lun = url.lun;
    let tur = s.test_unit_ready(lun).await.unwrap();
    eprintln!("TUR status {:#x} sense {:?}", tur.status, tur.sense);
    let inq = s.inquiry(lun, false, 0, 96).await.unwrap();
    eprintln!(
        "INQUIRY: {:?} {:?}",
        String::from_utf8_lossy(&inq[8..16]),
        String::from_utf8_lossy(&inq[16..32])
    );
    let vpd = s.inquiry(lun, true, 0x80, 255).await.unwrap();
    eprintln!("VPD 0x80: {:?}", String::from_utf8_lossy(&vpd[4..]));
    let (last, bs) = s.read_capacity16(lun).await.unwrap();
    eprintln!("capacity: last LBA {last}, block {bs}");
    let luns = s.report_luns().await.unwrap();
    eprintln!("REPORT LUNS: {luns:?}");
    assert!(luns.contains(&lun));
    s.sync_cache(lun).await.unwrap();

    // QD 1: sizes from one block to past MaxBurstLength (R2T sequences).
    let mut rng = rand::thread_rng();
    for blocks in [1u32, 8, 33, 256, 600] {
        let mut data = vec![0u8; (blocks * bs) as usize];
        rng.fill(&mut data[..]);
        let lba = rng.gen_range(0..=last + 1 - u64::from(blocks));
        s.write(lun, lba, &data, blocks % 2 == 0).await.unwrap();
        let back = s.read(lun, lba, blocks, bs).await.unwrap();
        assert!(
            back == data,
            "mismatch at QD1, {blocks} blocks at LBA {lba}"
        );
    }

    // QD 16: disjoint regions written concurrently, then read back concurrently.
    let mut jobs = Vec::new();
    for i in 0..16u64 {
        let s = s.clone();
        jobs.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(i);
            for round in 0..20u64 {
                let blocks = rng.gen_range(1..=64u32);
                let lba = i * 4096 + (round % 4) * 1024;
                let mut data = vec![0u8; (blocks * bs) as usize];
                rng.fill(&mut data[..]);
                s.write(lun, lba, &data, false).await.unwrap();
                let back = s.read(lun, lba, blocks, bs).await.unwrap();
                assert!(back == data, "mismatch at QD16 task {i} round {round}");
            }
        }));
    }
    for j in jobs {
        j.await.unwrap();
    }

    // A CHECK CONDITION is a result, not a session error: read past the end.
    let r = s
        .command(lun, &ramslog_initiator::cdb::read16(last + 1, 1), None, bs)
        .await
        .unwrap();
    eprintln!("read past end: status {:#x} sense {:?}", r.status, r.sense);
    assert_eq!(r.status, 0x02);
    s.nop().await.unwrap();

    let s = Arc::try_unwrap(s).ok().unwrap();
    s.logout().await.unwrap();
}

use rand::SeedableRng;

/// CHAP, one way and mutual, then a wrong mutual secret caught. With `RAMSLOG_LIVE_URL`,
/// `RAMSLOG_LIVE_CHAP=user:secret[:target_user:target_secret]` gives that target's credentials
/// (mutual with the last two); without it, a started target gets its own.
#[tokio::test]
async fn live_chap() {
    let (url, spec, _target) = if std::env::var("RAMSLOG_LIVE_URL").is_ok() {
        let spec = std::env::var("RAMSLOG_LIVE_CHAP")
            .expect("RAMSLOG_LIVE_URL is set: RAMSLOG_LIVE_CHAP=user:secret[:target_user:target_secret] must name its CHAP credentials");
        let (url, t) = live_target(Vec::new());
        (url, spec, t)
    } else {
        let initiator_secret = secret_file("chap", "live-initiator-secret");
        let target_secret = secret_file("mutual-chap", "live-target-secret-1");
        let (url, t) = live_target(vec![
            "--chap-user".into(),
            "live-user".into(),
            "--chap-secret-file".into(),
            initiator_secret.display().to_string(),
            "--mutual-chap-user".into(),
            "live-target".into(),
            "--mutual-chap-secret-file".into(),
            target_secret.display().to_string(),
        ]);
        let spec = "live-user:live-initiator-secret:live-target:live-target-secret-1".to_string();
        (url, spec, t)
    };
    let f: Vec<&str> = spec.split(':').collect();
    let creds = |n: &str, s: &str| ramslog_initiator::Credentials {
        name: n.into(),
        secret: s.as_bytes().to_vec(),
    };
    let mut chap = ramslog_initiator::ChapParams {
        initiator: creds(f[0], f[1]),
        mutual: (f.len() == 4).then(|| creds(f[2], f[3])),
    };
    let addr = url.socket_addr().await.unwrap();
    let mut p = LoginParams::normal(INITIATOR, url.target_name.clone());
    p.chap = Some(chap.clone());
    let s = Session::login(addr, p.clone()).await.unwrap();
    s.nop().await.unwrap();
    s.logout().await.unwrap();
    if let Some(m) = &mut chap.mutual {
        m.secret = b"not-the-target-secret".to_vec();
        p.chap = Some(chap);
        let e = Session::login(addr, p).await.err().unwrap();
        eprintln!("wrong mutual secret: {e}");
        assert!(matches!(e, ramslog_initiator::Error::Auth(_)));
    }
}
