//! `rdma-bench floor` against `rdma-bench floor-server --no-rdma` over
//! 127.0.0.1, both the real binary: the TCP floor's JSON, a server that
//! outlives clients leaving mid-run, and the errors a user sees.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStderr, Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

mod common;
use common::{json_of, rdma_bench, rdma_bench_line, stdout_of};

const BIN: &str = env!("CARGO_BIN_EXE_rdma-bench");

/// A floor-server on a port the kernel picks; killed on drop.
struct Server {
    child: Child,
    addr: SocketAddr,
    _stderr: std::thread::JoinHandle<()>,
}

impl Server {
    fn start() -> Server {
        let mut child = Command::new(BIN)
            .args(["floor-server", "--listen", "127.0.0.1:0", "--no-rdma"])
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start rdma-bench floor-server");
        let stderr: ChildStderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("floor-server exited before listening")
                .expect("read floor-server stderr");
            if let Some(rest) = line.strip_prefix("floor-server: listening on ") {
                let a = rest.split_whitespace().next().expect("address");
                break a.parse().expect("listen address");
            }
        };
        // Keep draining stderr so the server never blocks on it.
        let drain = std::thread::spawn(move || for _ in lines.by_ref() {});
        Server {
            child,
            addr,
            _stderr: drain,
        }
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn floor(args: &[&str]) -> Output {
    rdma_bench(&[&["floor"], args].concat())
}

#[test]
fn tcp_floor_json() {
    let s = Server::start();
    let addr = s.addr.to_string();
    let out = floor(&[&addr, "--transport", "tcp", "--count", "2000", "--json"]);
    let v = json_of(&out);
    assert_eq!(v["transport"], "tcp");
    assert_eq!(v["bs"], 4096);
    assert_eq!(v["addr"], addr);
    let samples = v["samples"].as_array().expect("samples");
    assert_eq!(samples.len(), 1);
    let t = &samples[0];
    assert_eq!(t["shape"], "tcp 48+bs/48");
    assert_eq!(t["half_rtt"], false);
    assert_eq!(t["ios"], 2000);
    let lat = &t["lat_us"];
    let p50 = lat["p50"].as_f64().expect("p50");
    assert!(p50 > 0.0, "{lat}");
    assert!(lat["min"].as_f64().unwrap() <= p50);
    assert!(lat["p99"].as_f64().unwrap() >= p50);
    assert!(lat["max"].as_f64().unwrap() >= lat["p99"].as_f64().unwrap());
    assert!(t["iops"].as_f64().unwrap() > 0.0);
}

#[test]
fn tcp_floor_table_and_time() {
    let s = Server::start();
    let out = rdma_bench_line(&format!(
        "floor {} --bs 512 --time 0.3 --warmup 0.1",
        s.addr
    ));
    let text = stdout_of(&out);
    assert!(text.contains("bs=512"), "{text}");
    assert!(text.contains("p50 µs"), "{text}");
    assert!(text.contains("tcp 48+bs/48"), "{text}");
}

#[test]
fn server_survives_clients_that_leave_mid_run() {
    let mut s = Server::start();
    // Mid-message: a header announcing 4 KiB, 100 bytes of it, gone.
    let mut hdr = [0u8; 48];
    hdr[..4].copy_from_slice(b"RSLF");
    hdr[4] = 1;
    hdr[5] = 1;
    hdr[12..16].copy_from_slice(&4096u32.to_be_bytes());
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(&hdr).unwrap();
    c.write_all(&[7u8; 100]).unwrap();
    drop(c);
    // Garbage.
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(b"GET / HTTP/1.0\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")
        .unwrap();
    drop(c);
    // A real client killed while measuring.
    let mut victim = Command::new(BIN)
        .args([
            "floor",
            &s.addr.to_string(),
            "--time",
            "30",
            "--warmup",
            "0",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    victim.kill().unwrap();
    victim.wait().unwrap();
    assert!(s.alive(), "floor-server died");
    let v = json_of(&rdma_bench_line(&format!(
        "floor {} --count 200 --warmup 0 --json",
        s.addr
    )));
    assert_eq!(v["samples"][0]["ios"], 200);
    assert!(s.alive());
}

#[test]
fn clear_errors() {
    // No server.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = floor(&[&format!("127.0.0.1:{port}"), "--count", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot connect to a floor-server"), "{err}");
    // Bad arguments.
    let out = floor(&["127.0.0.1:1", "--bs", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bs"));
    // RDMA where there is none: a clear message, never a hang.
    if ramslog_has_no_rdma() {
        let out = floor(&["127.0.0.1:1", "--transport", "rdma", "--count", "1"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no RDMA device"), "{err}");
        let out = Command::new(BIN)
            .args(["floor-server", "--listen", "127.0.0.1:0"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--no-rdma"), "{err}");
    }
}

/// No RDMA device visible (this project's build machines).
fn ramslog_has_no_rdma() -> bool {
    !std::path::Path::new("/dev/infiniband/rdma_cm").exists()
}

#[test]
fn lat_and_compare_report_what_the_target_adds() {
    let s = Server::start();
    let floor = s.addr.to_string();
    let t = ramslog_tests::TargetProcess::start();
    let u = ramslog_tests::TargetProcess::start();

    let v = json_of(&rdma_bench_line(&format!(
        "lat {} --pattern fua --count 300 --warmup 0 --floor {} --json",
        t.url(0),
        floor
    )));
    let f = &v["floors"][0];
    assert_eq!(f["shape"], "tcp 48+bs/48");
    assert!(f["summary"]["ios"].as_u64().unwrap() > 0);
    let p50 = |x: &Value| x["summary"]["lat_us"]["p50"].as_f64().unwrap();
    let adds = v["results"][0]["target_adds_us"].as_f64().unwrap();
    assert!((adds - (p50(&v["results"][0]) - p50(f))).abs() < 1e-6);

    let v = json_of(&rdma_bench_line(&format!(
        "compare {} {} --time 1 --rounds 2 --warmup 0 --floor {} --json",
        t.url(0),
        u.url(0),
        floor
    )));
    assert_eq!(
        v["floors"].as_array().unwrap().len(),
        1,
        "one floor per transport"
    );
    for r in v["results"].as_array().unwrap() {
        assert!(r["target_adds_us"].is_f64());
    }

    let out = rdma_bench_line(&format!(
        "lat {} --count 100 --warmup 0 --floor {}",
        t.url(0),
        floor
    ));
    let text = stdout_of(&out);
    assert!(
        text.contains("adds µs") && text.contains("floor: tcp 48+bs/48"),
        "{text}"
    );

    // Reads have no floor shape: said, not invented.
    let out = rdma_bench_line(&format!(
        "lat {} --pattern read --count 100 --warmup 0 --floor {} --json",
        t.url(0),
        floor
    ));
    let v = json_of(&out);
    assert!(v["floors"].as_array().unwrap().is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no floor for Read"));
}
