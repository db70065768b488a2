//! The metrics endpoint (`--metrics`): filled by real I/O, read by Debian's
//! own `prometheus`, the same facts in `status --json`, and the shipped
//! alert rules checked and unit-tested by `promtool`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ramslog_tests::{artefact_dir, build_dir, free_port, TargetOptions, TargetProcess};

use super::*;

/// A peer-supplied name that must never become a label.
const PROBE_INITIATOR: &str = "iqn.2026-11.org.ramslog:label-probe-5f3a";

/// Debian's prometheus and promtool: `$RAMSLOG_PROMETHEUS_BIN`, else where
/// `tests/lib/prometheus.sh` (called by tests/run-all.sh) unpacks them.
fn prometheus_bin(tool: &str) -> PathBuf {
    let dir = std::env::var_os("RAMSLOG_PROMETHEUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| build_dir().join("tools/prometheus/usr/bin"));
    let p = dir.join(tool);
    assert!(
        p.is_file(),
        "{} is missing: run tests/run-all.sh, or `. tests/lib/prometheus.sh && prometheus_tools` \
         from the repository root (it unpacks Debian's prometheus package into build/tools)",
        p.display()
    );
    p
}

/// One HTTP GET on loopback; (status line, body).
pub(super) fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    try_http_get(addr, path).expect("HTTP GET")
}

fn try_http_get(addr: SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

/// The value of the sample whose name and labels start as `prefix`.
fn sample(page: &str, prefix: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in:\n{page}"))
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Prometheus {
    fn start(scrape: SocketAddr) -> Prometheus {
        let dir = artefact_dir(&format!("prometheus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files: ['{}']\n\
                 scrape_configs:\n  - job_name: ramslog\n    static_configs:\n      - targets: ['{scrape}']\n",
                alert_rules().display()
            ),
        )
        .unwrap();
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let log = dir.join("prometheus.log");
        let child = Command::new(prometheus_bin("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start prometheus");
        Prometheus { child, addr, log }
    }

    /// Poll an instant query until `accept` takes its first value.
    fn wait_for(&self, query: &str, accept: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Ok(mut s) = TcpStream::connect(self.addr) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let path = format!("/api/v1/query?query={}", url_encode(query));
                let _ = write!(
                    s,
                    "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                    self.addr
                );
                let mut raw = String::new();
                let _ = s.read_to_string(&mut raw);
                last = raw
                    .split_once("\r\n\r\n")
                    .map(|(_, b)| b.to_string())
                    .unwrap_or(raw);
                let v: Option<f64> = serde_json::from_str::<serde_json::Value>(&last)
                    .ok()
                    .and_then(|j| {
                        j["data"]["result"][0]["value"][1]
                            .as_str()
                            .and_then(|x| x.parse().ok())
                    });
                if let Some(v) = v.filter(|v| accept(*v)) {
                    return v;
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!(
            "prometheus never answered {query} as expected; last answer: {last}\nits log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for_no_connections(metrics: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(
        &http_get(metrics, "/metrics").1,
        "ramslog_connections{transport=\"tcp\"}",
    ) != 0.0
    {
        assert!(
            Instant::now() < deadline,
            "a closed connection stays counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alert_rules() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/prometheus/ramslog-alerts.yml")
}

/// A target serving metrics on a free port of 127.0.0.1 (given as a bare
/// port when `bare_port`, which must bind loopback), with `flags`: the
/// endpoint's address and the target.
fn metrics_target(bare_port: bool, flags: &[&str]) -> (SocketAddr, TargetProcess) {
    let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let at = if bare_port {
        metrics.port().to_string()
    } else {
        metrics.to_string()
    };
    let mut extra_args = vec!["--metrics".to_string(), at];
    extra_args.extend(flags.iter().map(|f| f.to_string()));
    let t = TargetProcess::start_with(TargetOptions {
        extra_args,
        ..Default::default()
    });
    (metrics, t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_io_fills_the_endpoint_and_prometheus_scrapes_it() {
    let (metrics, t) = metrics_target(false, &[]);
    let s = open(&t, PROBE_INITIATOR).await;
    let data = random_bytes(4096);
    for i in 0..200u64 {
        s.write(0, i * 8, &data, false).await.expect("WRITE");
    }
    for _ in 0..50 {
        s.sync_cache(0).await.expect("SYNCHRONIZE CACHE");
    }
    for i in 0..100u64 {
        s.read(0, i * 8, 8, 512).await.expect("READ");
    }
    // One READ past the end of the 256 MiB LUN: CHECK CONDITION, ILLEGAL REQUEST.
    let r = s
        .command(0, &read10(u32::MAX - 1, 1), None, 512)
        .await
        .expect("READ past the end answers");
    assert_eq!(sense(&r).0, sense_key::ILLEGAL_REQUEST);

    let (status, page) = http_get(metrics, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "{page}");
    let lun = format!("{{target=\"{}\",lun=\"0\"", t.target_name());
    let at = |name: &str, rest: &str| sample(&page, &format!("{name}{lun}{rest}"));
    assert_eq!(at("ramslog_lun_commands_total", ",kind=\"write\"}"), 200.0);
    assert_eq!(at("ramslog_lun_commands_total", ",kind=\"flush\"}"), 50.0);
    assert_eq!(at("ramslog_lun_commands_total", ",kind=\"read\"}"), 101.0);
    assert_eq!(
        at("ramslog_lun_data_bytes_total", ",kind=\"write\"}"),
        200.0 * 4096.0
    );
    assert_eq!(
        at("ramslog_lun_data_bytes_total", ",kind=\"read\"}"),
        100.0 * 4096.0
    );
    assert_eq!(
        at(
            "ramslog_lun_errors_total",
            ",status=\"check_condition\",sense_key=\"illegal_request\"}"
        ),
        1.0
    );
    assert_eq!(
        at("ramslog_lun_service_time_seconds_count", ",kind=\"write\"}"),
        200.0
    );
    assert_eq!(
        sample(
            &page,
            &format!("ramslog_lun_service_time_seconds_bucket{{le=\"+Inf\",target=\"{}\",lun=\"0\",kind=\"write\"}}", t.target_name())
        ),
        200.0
    );
    assert!(at("ramslog_lun_service_time_seconds_sum", ",kind=\"write\"}") > 0.0);
    assert_eq!(at("ramslog_lun_ready", "}"), 1.0);
    assert_eq!(
        sample(
            &page,
            &format!("ramslog_sessions{{target=\"{}\"}}", t.target_name())
        ),
        1.0
    );
    assert_eq!(sample(&page, "ramslog_connections{transport=\"tcp\"}"), 1.0);
    assert_eq!(
        sample(&page, "ramslog_front_end_connections{front_end=\"iscsi\"}"),
        1.0
    );
    assert!(sample(&page, "ramslog_process_locked_memory_bytes") >= 256.0 * 1024.0 * 1024.0);
    assert!(
        !page.contains("label-probe-5f3a") && !page.contains("127.0.0.1:"),
        "a peer's name or address became a label:\n{page}"
    );

    // `status --json` reports the same counts.
    let out = Command::new(ramslog_tests::target_binary())
        .args(["status", "--json", "--control-socket"])
        .arg(t.control_socket().expect("ephemeral target's socket"))
        .output()
        .expect("status --json");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
    let kinds = &st["targets"][0]["luns"][0]["io"]["kinds"];
    let kind = |k: &str| {
        kinds
            .as_array()
            .and_then(|a| a.iter().find(|x| x["kind"] == k))
            .cloned()
            .unwrap_or_else(|| panic!("no kind {k} in {st}"))
    };
    assert_eq!(kind("write")["commands"], 200);
    assert_eq!(kind("write")["bytes"], 200 * 4096);
    assert_eq!(kind("flush")["commands"], 50);
    assert!(kind("write")["service_time_p99_micros_at_most"]
        .as_f64()
        .is_some());
    assert_eq!(st["portal"]["tcp_connections"], 1);
    assert_eq!(st["portal"]["iser_connections"], 0);
    assert_eq!(st["portal"]["front_end_connections"]["iscsi"], 1);
    assert_eq!(
        st["targets"][0]["luns"][0]["io"]["errors"][0]["sense_key"],
        "illegal_request"
    );

    // A real Prometheus scrapes it and sees the histogram the writes filled.
    let prom = Prometheus::start(metrics);
    prom.wait_for("up{job=\"ramslog\"}", |v| v == 1.0);
    let writes = prom.wait_for(
        "sum(ramslog_lun_service_time_seconds_count{job=\"ramslog\",kind=\"write\"})",
        |v| v > 0.0,
    );
    assert_eq!(writes, 200.0);
    let p50 = prom.wait_for(
        "histogram_quantile(0.5, sum by (le) (ramslog_lun_service_time_seconds_bucket{kind=\"write\"}))",
        |v| v.is_finite(),
    );
    assert!(p50 > 0.0 && p50 <= 1.048576, "p50 {p50} s");
    prom.wait_for("count(ramslog_lun_ready == 1)", |v| v == 1.0);
    s.logout().await.expect("logout");
}

fn read10(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x28;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

#[tokio::test]
async fn refused_logins_and_limits_are_counted_without_peer_names() {
    let (metrics, t) = metrics_target(false, &["--max-connections", "1"]);
    // The harness's readiness probe holds the one connection until the
    // daemon sees it closed.
    wait_for_no_connections(metrics);
    let wrong = ramslog_initiator::Session::login(
        t.addr(),
        ramslog_initiator::LoginParams::normal(PROBE_INITIATOR, "iqn.2026-11.org.ramslog:no-such"),
    )
    .await;
    assert!(
        wrong.is_err(),
        "a login to a target that does not exist succeeded"
    );
    // The refused connection gives its place back after the client saw the reject.
    wait_for_no_connections(metrics);
    let s = open(&t, PROBE_INITIATOR).await;
    // The one connection allowed is taken: the next is refused at accept.
    let second = ramslog_initiator::Session::login(
        t.addr(),
        ramslog_initiator::LoginParams::normal(PROBE_INITIATOR, t.target_name()),
    )
    .await;
    assert!(
        second.is_err(),
        "a connection over --max-connections logged in"
    );
    let (_, page) = http_get(metrics, "/metrics");
    assert_eq!(
        sample(
            &page,
            "ramslog_logins_refused_total{reason=\"target_not_found\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(&page, "ramslog_limit_hits_total{limit=\"connections\"}"),
        1.0
    );
    assert!(
        !page.contains("label-probe-5f3a") && !page.contains("no-such"),
        "{page}"
    );
    s.logout().await.expect("logout");
}

#[test]
fn the_endpoint_answers_only_metrics() {
    let (metrics, _t) = metrics_target(true, &[]);
    assert_eq!(http_get(metrics, "/").0, "HTTP/1.1 404 Not Found");
    let mut s = TcpStream::connect(metrics).unwrap();
    s.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.1 405"), "{raw}");
    // A header that never ends is cut off, not buffered.
    let mut s = TcpStream::connect(metrics).unwrap();
    let junk = vec![b'a'; 64 * 1024];
    let _ = s.write_all(&junk);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert!(String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 431"));
}

#[test]
fn a_bad_metrics_address_names_the_flag() {
    let out = Command::new(ramslog_tests::target_binary())
        .args(["--ephemeral", "--size", "16M", "--metrics", "localhost:x"])
        .output()
        .expect("run ramslog-target");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--metrics") && err.contains("ADDR:PORT"),
        "{err}"
    );
}

#[test]
fn promtool_accepts_the_alert_rules_and_their_tests() {
    let promtool = prometheus_bin("promtool");
    for args in [
        vec!["check", "rules", "ramslog-alerts.yml"],
        vec!["test", "rules", "ramslog-alerts.test.yml"],
    ] {
        let out = Command::new(&promtool)
            .args(&args)
            .current_dir(alert_rules().parent().unwrap())
            .output()
            .expect("run promtool");
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A host that sends READs and then reads nothing is dropped once its
/// output made no progress for `--output-stall-timeout` (4 s here, far from
/// the 30 s default and from every other timer), with the reason logged and
/// counted as `output_stall`.
#[tokio::test]
async fn a_host_that_stops_reading_is_dropped_after_the_output_stall_timeout() {
    use ramslog_common::iscsi::{Bhs, Opcode};
    const STALL: Duration = Duration::from_secs(4);
    // No ping may end the connection first.
    let stall = STALL.as_secs().to_string();
    let flags = ["--output-stall-timeout", &stall, "--nop-interval", "3600"];
    let (metrics, t) = metrics_target(false, &flags);
    let mut c = ramslog_initiator::Connection::connect(t.addr())
        .await
        .expect("connect");
    c.login(&LoginParams::normal(INITIATOR, t.target_name()))
        .await
        .expect("login");
    // 32 READs of 16 MiB: far more than the socket buffers hold.
    for i in 0..32u32 {
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_flags(0xc1)
            .set_itt(c.next_itt())
            .set_expected_data_len(16 << 20);
        b.set_cdb(&read10((i % 16) * 32768, 32768));
        c.fill_sn(&mut b, false);
        c.send_pdu(&b, &[], &[]).await.expect("send READ");
    }
    let sent = Instant::now();
    let reason = "no output progress for 4s";
    while !t.output().contains(reason) {
        assert!(
            sent.elapsed() < STALL + Duration::from_secs(20),
            "not dropped {:?} after the READs: {}",
            sent.elapsed(),
            t.output_tail(10)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dropped_after = sent.elapsed();
    assert!(
        dropped_after >= STALL,
        "dropped after {dropped_after:?}, before the {STALL:?} stall timeout"
    );
    let (_, page) = http_get(metrics, "/metrics");
    assert_eq!(
        sample(&page, "ramslog_limit_hits_total{limit=\"output_stall\"}"),
        1.0
    );
    // The client then finds the connection closed once it reads what the
    // socket buffers still hold.
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if c.recv_pdu().await.is_err() {
                return;
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection is still open");
}

/// TASK SET FULL on the wire: with a window of four and four writes
/// waiting for their data, a fifth (immediate, so CmdSN does not hold it
/// back) gets TASK SET FULL; the initiator retries it once a write
/// completes, as Linux does, and it goes through. Both ends are counted:
/// the limit hit and the LUN's error by status.
#[tokio::test]
async fn task_set_full_on_the_wire_is_retried_and_counted() {
    use ramslog_common::iscsi::{Bhs, Opcode, RESERVED_TAG};
    use ramslog_common::scsi_wire::status;
    let (metrics, t) = metrics_target(false, &["--cmd-window", "4"]);
    let mut c = ramslog_initiator::Connection::connect(t.addr())
        .await
        .expect("connect");
    let mut p = LoginParams::normal(INITIATOR, t.target_name());
    p.initial_r2t = true;
    p.immediate_data = false;
    c.login(&p).await.expect("login");
    // The power-on unit attention first.
    for _ in 0..2 {
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_flags(0x81).set_itt(c.next_itt());
        b.set_cdb(&[0u8; 6]);
        c.fill_sn(&mut b, false);
        c.send_pdu(&b, &[], &[]).await.expect("TUR");
        next_pdu(&mut c).await;
    }
    let write = |c: &mut ramslog_initiator::Connection, lba: u32| {
        let mut b = Bhs::new(Opcode::ScsiCommand);
        b.set_flags(0xa1)
            .set_itt(c.next_itt())
            .set_expected_data_len(4096);
        let mut cdb = [0u8; 10];
        cdb[0] = 0x2a;
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[8] = 8;
        b.set_cdb(&cdb);
        c.fill_sn(&mut b, true);
        b
    };
    let mut waiting = Vec::new();
    for i in 0..4u32 {
        let b = write(&mut c, i * 8);
        c.send_pdu(&b, &[], &[]).await.expect("write");
        let r2t = next_pdu(&mut c).await;
        assert_eq!(r2t.opcode(), Some(Opcode::ReadyToTransfer));
        waiting.push((b.itt(), r2t.bhs.ttt()));
    }
    let fifth = write(&mut c, 64);
    c.send_pdu(&fifth, &[], &[]).await.expect("fifth write");
    let full = next_pdu(&mut c).await;
    assert_eq!(
        (full.opcode(), full.bhs.itt(), full.bhs.scsi_status()),
        (
            Some(Opcode::ScsiResponse),
            fifth.itt(),
            status::TASK_SET_FULL
        )
    );
    // One write completes, and the initiator retries.
    let (itt, ttt) = waiting[0];
    let mut d = Bhs::new(Opcode::DataOut);
    d.set_final(true).set_itt(itt).set_ttt(ttt).set_datasn(0);
    c.send_pdu(&d, &[], &[0x5c; 4096]).await.expect("data");
    let done = next_pdu(&mut c).await;
    assert_eq!(done.bhs.scsi_status(), status::GOOD);
    let retry = write(&mut c, 64);
    c.send_pdu(&retry, &[], &[]).await.expect("retry");
    let r2t = next_pdu(&mut c).await;
    assert_eq!(
        (r2t.opcode(), r2t.bhs.itt()),
        (Some(Opcode::ReadyToTransfer), retry.itt()),
        "the retry is taken"
    );
    assert_ne!(r2t.bhs.ttt(), RESERVED_TAG);
    let (_, page) = http_get(metrics, "/metrics");
    assert_eq!(
        sample(&page, "ramslog_limit_hits_total{limit=\"command_window\"}"),
        1.0
    );
    let errors = page
        .lines()
        .find(|l| l.starts_with("ramslog_lun_errors_total{") && l.contains("task_set_full"))
        .unwrap_or_else(|| panic!("no task_set_full error in:\n{page}"));
    assert!(errors.ends_with(" 1"), "{errors}");
}

async fn next_pdu(c: &mut ramslog_initiator::Connection) -> ramslog_initiator::Pdu {
    c.recv_pdu_timeout(Duration::from_secs(5))
        .await
        .expect("recv")
        .expect("a PDU")
}

/// Connect to `to` from the loopback address `from` (all of 127/8 is
/// loopback on Linux), and send `head` without finishing it.
fn idle_client(from: std::net::Ipv4Addr, to: SocketAddr, head: &[u8]) -> std::net::TcpStream {
    let socket = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .expect("socket");
    rustix::net::bind(&socket, &std::net::SocketAddrV4::new(from, 0))
        .expect("bind a loopback source");
    rustix::net::connect(&socket, &to).expect("connect");
    let mut s = std::net::TcpStream::from(socket);
    s.write_all(head).expect("send a partial head");
    s
}

/// A few slow or idle clients must never keep Prometheus out (a full block
/// fires RamslogDown, an intermittent one resets every alert's `for:`): an
/// idle connection is dropped within half a second, each source holds one
/// connection, and when every slot is taken a scrape evicts the oldest
/// connection that has not sent a whole request.
#[test]
fn slow_clients_never_keep_a_scrape_out() {
    let (metrics, _t) = metrics_target(true, &[]);
    assert_eq!(http_get(metrics, "/metrics").0, "HTTP/1.1 200 OK");
    // Many sources, each idling in the middle of its request head.
    let idle: Vec<_> = (2..40u8)
        .map(|i| idle_client(std::net::Ipv4Addr::new(127, 0, 0, i), metrics, b"GET /metr"))
        .collect();
    // And many connections from the scraper's own address.
    let same: Vec<_> = (0..8)
        .map(|_| idle_client(std::net::Ipv4Addr::new(127, 0, 0, 1), metrics, b"GET /"))
        .collect();
    // Let the daemon accept them all (well inside the 500 ms head timeout):
    // a connection it accepts after the scrape's would evict the scrape, as
    // the oldest that has not sent a whole head.
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let got = try_http_get(metrics, "/metrics");
    assert!(
        got.as_ref()
            .is_ok_and(|(status, body)| status == "HTTP/1.1 200 OK" && body.contains("ramslog_")),
        "the scrape was kept out: {got:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the scrape was kept out for {:?}",
        started.elapsed()
    );
    // An idle connection is closed within the head timeout (500 ms).
    let mut quiet = idle_client(std::net::Ipv4Addr::new(127, 0, 0, 77), metrics, b"");
    quiet
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let started = std::time::Instant::now();
    let mut buf = [0u8; 64];
    let _ = quiet.read(&mut buf);
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "an idle connection was kept {:?}",
        started.elapsed()
    );
    drop((idle, same));
}

/// `--metrics-allow`: sources outside the networks are closed at once, the
/// others answered; the flag without `--metrics` names the fix.
#[test]
fn metrics_allow_answers_only_its_networks() {
    let (metrics, _t) = metrics_target(
        true,
        &[
            "--metrics-allow",
            "127.0.0.2",
            "--metrics-allow",
            "127.0.1.0/24",
        ],
    );
    let scrape_from = |from: std::net::Ipv4Addr| -> String {
        let mut s = idle_client(
            from,
            metrics,
            b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
        );
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        raw
    };
    for allowed in [[127, 0, 0, 2], [127, 0, 1, 9]] {
        let raw = scrape_from(allowed.into());
        assert!(
            raw.starts_with("HTTP/1.1 200 OK") && raw.contains("ramslog_"),
            "{allowed:?}: {raw}"
        );
    }
    for refused in [[127, 0, 0, 1], [127, 0, 0, 3], [127, 0, 2, 9]] {
        let raw = scrape_from(refused.into());
        assert!(raw.is_empty(), "{refused:?} was answered: {raw}");
    }

    let flags = "--ephemeral --size 16M --metrics-allow 10.0.0.0/8";
    refused(
        &run_target(&flags.split(' ').collect::<Vec<_>>()),
        &["--metrics-allow", "--metrics [ADDR:]PORT"],
    );
    let flags = "--ephemeral --size 16M --metrics 0 --metrics-allow 10.0.0.300";
    refused_with(
        2,
        &run_target(&flags.split(' ').collect::<Vec<_>>()),
        &["--metrics-allow", "not a network"],
    );
}
