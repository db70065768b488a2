//! `--softroce NETDEV`: a one-command demo for hosts without InfiniBand.
//! Creates an rxe (SoftRoCE) device on NETDEV, starts a ramslog-target on the
//! netdev's IPv4 address, hands the iser:// URL to the measurement, and tears
//! both down again, whatever happened in between.

use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

const IQN: &str = "iqn.2026-11.org.ramslog:softroce-demo";

/// Run a command, turning a failure into an error that shows its output.
fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program} (is it installed?)"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The first IPv4 address of `netdev`, from `ip -4 -o addr show dev NETDEV`.
fn ipv4_of(netdev: &str) -> Result<Ipv4Addr> {
    let out = sh("ip", &["-4", "-o", "addr", "show", "dev", netdev])?;
    parse_ip_addr_line(&out).ok_or_else(|| {
        anyhow!("{netdev} has no IPv4 address: rdma_cm over SoftRoCE needs one (ip addr add …)")
    })
}

fn parse_ip_addr_line(out: &str) -> Option<Ipv4Addr> {
    out.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .and_then(|a| a.parse().ok())
}

/// ramslog-target next to this binary, else on PATH.
fn target_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .map(|p| p.with_file_name("ramslog-target"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("ramslog-target"))
}

/// This command line without `--softroce NETDEV`, with `url` as the
/// target: what the measuring child process runs.
fn child_args(url: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--softroce" {
            args.next();
        } else if !a.starts_with("--softroce=") {
            out.push(a);
        }
    }
    if let Some(i) = out.iter().position(|a| a == "lat") {
        out.insert(i + 1, url.to_string());
    }
    out
}

/// Everything the demo set up; dropping it tears it down.
struct Demo {
    rxe: Option<String>,
    target: Option<Child>,
    /// Removed on drop: a killed target leaves its socket behind.
    control_socket: Option<std::path::PathBuf>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Some(mut t) = self.target.take() {
            let _ = t.kill();
            let _ = t.wait();
        }
        if let Some(socket) = self.control_socket.take() {
            let _ = std::fs::remove_file(socket);
        }
        if let Some(dev) = self.rxe.take() {
            if let Err(e) = sh("rdma", &["link", "delete", &dev]) {
                eprintln!("rdma-bench: could not remove {dev}: {e}");
            }
        }
    }
}

/// The measurement runs in a child process: librdmacm keeps every device
/// it opened open until its process exits, and the rxe device can only be
/// deleted once nobody holds it.
pub fn demo(netdev: &str, initiator_name: &str) -> Result<()> {
    sh("modprobe", &["rdma_rxe"]).context(
        "this kernel cannot load rdma_rxe (SoftRoCE); --softroce needs it and root \
         (on machines without it, use tests/softroce/run)",
    )?;
    let ip = ipv4_of(netdev)?;
    let mut demo = Demo {
        rxe: None,
        target: None,
        control_socket: None,
    };
    let dev = format!("rsb-{netdev}");
    sh(
        "rdma",
        &["link", "add", &dev, "type", "rxe", "netdev", netdev],
    )
    .with_context(|| format!("creating the rxe device {dev} on {netdev}"))?;
    demo.rxe = Some(dev.clone());
    eprintln!("rdma-bench: rxe device {dev} on {netdev} ({ip})");

    let bin = target_binary();
    let listen = format!("{ip}:3260");
    // Its own control socket: the default one may belong to another
    // ephemeral target on this machine (a quick start, a lab script).
    // In root's runtime directory: the daemon refuses a socket directory
    // others can write to, such as /tmp.
    let control_socket = PathBuf::from(format!(
        "/run/ramslog/rdma-bench-softroce-{}.sock",
        std::process::id()
    ));
    let mut child = Command::new(&bin)
        .args(["--size", "256M", "--ephemeral", "--iser-spin", "0"])
        .arg("--control-socket")
        .arg(&control_socket)
        .args([
            "--listen",
            &listen,
            "--target-name",
            IQN,
            "--allow",
            initiator_name,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let stderr = child.stderr.take();
    demo.target = Some(child);
    demo.control_socket = Some(control_socket);
    let (tx, rx) = mpsc::channel();
    if let Some(stderr) = stderr {
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let ready = format!("iSER listening on {listen}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(&ready) => break,
            Ok(line) => seen.push(line),
            Err(_) => bail!(
                "ramslog-target did not start serving iSER on {listen}:\n{}",
                seen.join("\n")
            ),
        }
    }
    // Keep draining its log so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in rx {});
    eprintln!("rdma-bench: ramslog-target serving {IQN} on {listen} over iSER");
    let me = std::env::current_exe().context("cannot find this program to run the measurement")?;
    let status = Command::new(me)
        .args(child_args(&format!("iser://{listen}/{IQN}/0")))
        .status()
        .context("cannot start the measurement")?;
    if !status.success() {
        bail!("the measurement failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_ip_addr_output() {
        let out = "3: rsl-a    inet 10.99.0.1/24 scope global rsl-a\\       valid_lft forever preferred_lft forever\n";
        assert_eq!(
            super::parse_ip_addr_line(out),
            Some("10.99.0.1".parse().unwrap())
        );
        assert_eq!(super::parse_ip_addr_line(""), None);
    }
}
