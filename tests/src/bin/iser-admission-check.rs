//! iser-admission-check: what no host may do to another over iSER.
//!
//!   iser-admission-check preempt --target ADDR:PORT --iqn IQN --a NAME --b NAME
//!   iser-admission-check flood --target ADDR:PORT --iqn IQN --name NAME
//!       --from IP[,IP...] [--per-source N] [--seconds N] [--chap USER:SECRET]
//!
//! `preempt`: host A (the illumos profile: 4 RDMA READ credits, so the
//! target holds READs beyond them) registers and reserves, then has 32
//! writes of 0xAA in flight over a 2 MiB region; host B (the Linux profile)
//! preempts and aborts A, writes 0xBB over the region, waits, and reads it
//! back: every byte must be 0xBB (an aborted write of A's that landed after
//! the PREEMPT AND ABORT was answered would show as 0xAA).
//!
//! `flood`: from each `--from` address, `--per-source` iSER discovery
//! sessions that answer pings and reconnect at once whenever the target
//! ends them; meanwhile `--name` logs in (a normal session, CHAP when
//! given) every second, or as soon as the last login ended when one takes
//! longer, for `--seconds`, and must succeed each time.
//!
//! `cap`: against a target started with `--max-iser-connections N`, `--name`
//! logs in N normal sessions (ISIDs of their own); the next login must be
//! refused with Out of Resources (status class 3, detail 2) while they
//! last, and succeed once one of them has logged out.
//!
//! Prints `ISER PREEMPT CHECK PASSED` / `ISER FLOOD CHECK PASSED` /
//! `ISER CAP CHECK PASSED` and exits
//! 0, or says what failed and exits 1.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramslog_common::scsi_wire::sense_key;
use ramslog_initiator::iser::{IserOptions, IserProfile, IserSession};
use ramslog_initiator::{cdb, ChapParams, Credentials, LoginParams};

const USAGE: &str =
    "usage: iser-admission-check preempt --target ADDR:PORT --iqn IQN --a NAME --b NAME\n       \
iser-admission-check flood --target ADDR:PORT --iqn IQN --name NAME --from IP[,IP...] \
[--per-source N] [--seconds N] [--chap USER:SECRET]\n       \
iser-admission-check cap --target ADDR:PORT --iqn IQN --name NAME --count N";

struct Args {
    mode: String,
    target: SocketAddr,
    iqn: String,
    a: String,
    b: String,
    name: String,
    from: Vec<IpAddr>,
    per_source: usize,
    seconds: u64,
    chap: Option<(String, String)>,
    count: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mode = it.next().ok_or(USAGE)?;
    let mut a = Args {
        mode,
        target: SocketAddr::from(([0, 0, 0, 0], 0)),
        iqn: String::new(),
        a: String::new(),
        b: String::new(),
        name: String::new(),
        from: Vec::new(),
        per_source: 16,
        seconds: 60,
        chap: None,
        count: 0,
    };
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--target" => a.target = value.parse().map_err(|e| bad(&e))?,
            "--iqn" => a.iqn = value,
            "--a" => a.a = value,
            "--b" => a.b = value,
            "--name" => a.name = value,
            "--from" => {
                a.from = value
                    .split(',')
                    .map(|s| s.trim().parse::<IpAddr>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| bad(&e))?
            }
            "--per-source" => a.per_source = value.parse().map_err(|e| bad(&e))?,
            "--seconds" => a.seconds = value.parse().map_err(|e| bad(&e))?,
            "--count" => a.count = value.parse().map_err(|e| bad(&e))?,
            "--chap" => {
                let (u, s) = value
                    .split_once(':')
                    .ok_or_else(|| bad(&"write USER:SECRET"))?;
                a.chap = Some((u.into(), s.into()));
            }
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if a.iqn.is_empty() || a.target.port() == 0 {
        return Err(USAGE.into());
    }
    Ok(a)
}

fn options(profile: IserProfile, queue_depth: usize) -> IserOptions {
    let mut o = IserOptions::new(profile);
    // A read must show the target's bytes, never what the slot held.
    o.poison_reads = true;
    o.queue_depth = queue_depth;
    o.timeout = Duration::from_secs(20);
    o
}

/// Log in and take the power-on unit attention, as initiators do.
fn open(
    target: SocketAddr,
    params: &LoginParams,
    opts: &IserOptions,
) -> Result<IserSession, String> {
    let mut s = IserSession::connect(target, params, opts)
        .map_err(|e| format!("{} login: {e}", params.initiator_name))?;
    for _ in 0..8 {
        let st = s
            .test_unit_ready(0)
            .map_err(|e| format!("TEST UNIT READY: {e}"))?;
        if st.sense.is_none_or(|x| x.key != sense_key::UNIT_ATTENTION) {
            return Ok(s);
        }
    }
    Err("unit attentions never cleared".into())
}

/// PERSISTENT RESERVE OUT, LU scope, WRITE EXCLUSIVE; its GOOD or an error.
fn pr_out(s: &mut IserSession, sa: u8, key: u64, sa_key: u64) -> Result<(), String> {
    let cdb = [0x5f, sa, 0x01, 0, 0, 0, 0, 0, 24, 0];
    let mut params = [0u8; 24];
    params[0..8].copy_from_slice(&key.to_be_bytes());
    params[8..16].copy_from_slice(&sa_key.to_be_bytes());
    let st = s
        .command(0, &cdb, &params, &mut [])
        .map_err(|e| format!("PERSISTENT RESERVE OUT {sa}: {e}"))?;
    if st.is_good() {
        Ok(())
    } else {
        Err(format!("PERSISTENT RESERVE OUT {sa}: {st:?}"))
    }
}

const REGION_BYTES: usize = 2 << 20;
const A_WRITES: usize = 32;

fn preempt(a: &Args) -> Result<(), String> {
    let mut host_a = open(
        a.target,
        &LoginParams::normal(&a.a, &a.iqn),
        &options(IserProfile::Illumos, A_WRITES),
    )?;
    let mut host_b = open(
        a.target,
        &LoginParams::normal(&a.b, &a.iqn),
        &options(IserProfile::Linux, 8),
    )?;
    pr_out(&mut host_a, 0, 0, 0xa)?;
    pr_out(&mut host_a, 1, 0xa, 0)?;
    pr_out(&mut host_b, 0, 0, 0xb)?;
    let chunk = REGION_BYTES / A_WRITES;
    let blocks = (chunk / 512) as u32;
    let aa = vec![0xaa; chunk];
    for i in 0..A_WRITES {
        let lba = (i * chunk / 512) as u64;
        host_a
            .submit(0, &cdb::write16(lba, blocks, false), &aa, 0)
            .map_err(|e| format!("A's write {i}: {e}"))?;
    }
    // At once, while A's RDMA READs are in flight or held.
    let t = Instant::now();
    pr_out(&mut host_b, 5, 0xb, 0xa)?;
    let answered = t.elapsed();
    // The race is shown to happen: a write of A's that completed GOOD was
    // placed before the preempt was answered (an aborted one gets no GOOD
    // after it), so at least one must not have, or none was in flight.
    let mut good = 0usize;
    let settle = Instant::now() + Duration::from_secs(2);
    while Instant::now() < settle && host_a.outstanding() > 0 {
        match host_a.poll() {
            Ok(Some(c)) => {
                if c.result.as_ref().is_ok_and(|st| st.is_good()) {
                    good += 1;
                }
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            // The target may end the preempted host's connection.
            Err(_) => break,
        }
    }
    println!(
        "PREEMPT AND ABORT answered after {answered:?}; {good} of A's {A_WRITES} writes completed GOOD, \
         {} were in flight when it came",
        A_WRITES - good
    );
    if good == A_WRITES {
        return Err(format!(
            "all {A_WRITES} of A's writes completed GOOD: none was in flight when B preempted, so \
             the check shows nothing"
        ));
    }
    let bb = vec![0xbb; 256 * 1024];
    for off in (0..REGION_BYTES).step_by(bb.len()) {
        host_b
            .write16(0, (off / 512) as u64, &bb, false)
            .map_err(|e| format!("B's write at {off}: {e}"))?;
    }
    // Anything of A's still to land has had time to.
    std::thread::sleep(Duration::from_secs(2));
    let mut back = vec![0u8; 256 * 1024];
    let (mut stale, mut unplaced, mut other) = (0usize, 0usize, 0usize);
    for off in (0..REGION_BYTES).step_by(back.len()) {
        host_b
            .read16(0, (off / 512) as u64, &mut back)
            .map_err(|e| format!("B's read at {off}: {e}"))?;
        for b in &back {
            match *b {
                0xbb => {}
                0xaa => stale += 1,
                ramslog_initiator::iser::POISON => unplaced += 1,
                _ => other += 1,
            }
        }
    }
    drop(host_a);
    let _ = host_b.logout();
    if unplaced > 0 {
        return Err(format!(
            "{unplaced} bytes of B's reads were never placed by the target (the poison they were read into is still there)"
        ));
    }
    if stale + other > 0 {
        return Err(format!(
            "{stale} bytes of the region are A's 0xAA and {other} are neither A's nor B's: an aborted write of the preempted host landed after the preempt"
        ));
    }
    println!("ISER PREEMPT CHECK PASSED");
    Ok(())
}

fn flood(a: &Args) -> Result<(), String> {
    if a.from.is_empty() || a.name.is_empty() {
        return Err(USAGE.into());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let sessions = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for (i, source) in a.from.iter().copied().enumerate() {
        for n in 0..a.per_source {
            let (stop, sessions, target) = (stop.clone(), sessions.clone(), a.target);
            flooders.push(std::thread::spawn(move || {
                let mut opts = options(IserProfile::Linux, 1);
                opts.source = Some(source);
                let p = LoginParams::discovery(format!("iqn.2026-11.org.ramslog:flood-{i}-{n}"));
                let mut said = false;
                while !stop.load(Ordering::Relaxed) {
                    match IserSession::connect(target, &p, &opts) {
                        Ok(mut s) => {
                            sessions.fetch_add(1, Ordering::Relaxed);
                            // Answer pings until the target ends it.
                            let ended = loop {
                                if stop.load(Ordering::Relaxed) {
                                    break None;
                                }
                                if let Err(e) = s.idle(Duration::from_millis(500)) {
                                    break Some(e);
                                }
                            };
                            if let (Some(e), false) = (ended, said) {
                                said = true;
                                println!("flooder {i}-{n}: its session ended: {e}");
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            }));
        }
    }
    std::thread::sleep(Duration::from_secs(3));
    let mut params = LoginParams::normal(&a.name, &a.iqn);
    if let Some((user, secret)) = &a.chap {
        params.chap = Some(ChapParams {
            initiator: Credentials {
                name: user.clone(),
                secret: secret.as_bytes().to_vec(),
            },
            mutual: None,
        });
    }
    let opts = options(IserProfile::Linux, 4);
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    let mut attempts = 0u64;
    // A login every second (or as soon as the last one ended, when one
    // takes longer: under emulation an RDMA connection's setup does) for
    // the whole flood; every one must succeed.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(a.seconds) {
        let tick = Instant::now();
        attempts += 1;
        match IserSession::connect(a.target, &params, &opts) {
            Ok(s) => {
                slowest = slowest.max(tick.elapsed());
                let _ = s.logout();
            }
            Err(e) => failures.push(format!("at {:?}: {e}", start.elapsed())),
        }
        std::thread::sleep(Duration::from_secs(1).saturating_sub(tick.elapsed()));
    }
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        let _ = f.join();
    }
    let sessions = sessions.load(Ordering::Relaxed);
    println!(
        "{} s of iSER floods from {} addresses x {}: {sessions} discovery sessions; {} of {attempts} allowed logins failed; slowest login {slowest:?}",
        a.seconds,
        a.from.len(),
        a.per_source,
        failures.len(),
    );
    if sessions == 0 {
        return Err("the flood never got a session: it did not run".into());
    }
    if !failures.is_empty() {
        return Err(format!(
            "the allowed initiator was kept out: {}",
            failures.join("; ")
        ));
    }
    println!("ISER FLOOD CHECK PASSED");
    Ok(())
}

fn cap(a: &Args) -> Result<(), String> {
    if a.name.is_empty() || a.count == 0 {
        return Err(USAGE.into());
    }
    let opts = options(IserProfile::Linux, 4);
    let params = |n: usize| {
        let mut p = LoginParams::normal(&a.name, &a.iqn);
        p.isid = Some([0x80, 0, 0, 0xca, (n >> 8) as u8, n as u8]);
        p
    };
    let mut held = Vec::new();
    for n in 0..a.count {
        held.push(open(a.target, &params(n), &opts)?);
    }
    match IserSession::connect(a.target, &params(a.count), &opts) {
        Ok(_) => {
            return Err(format!(
                "login {} of a cap of {} succeeded",
                a.count + 1,
                a.count
            ))
        }
        Err(ramslog_initiator::Error::LoginFailed {
            class: 3,
            detail: 2,
        }) => {
            println!("login {} refused with Out of Resources", a.count + 1)
        }
        Err(e) => {
            return Err(format!(
                "login {} failed, but not with Out of Resources: {e}",
                a.count + 1
            ))
        }
    }
    held.pop()
        .expect("at least one")
        .logout()
        .map_err(|e| format!("logout: {e}"))?;
    // The target frees the place once it has seen the connection end.
    let start = Instant::now();
    loop {
        match IserSession::connect(a.target, &params(a.count), &opts) {
            Ok(s) => {
                let _ = s.logout();
                break;
            }
            Err(e) if start.elapsed() > Duration::from_secs(30) => {
                return Err(format!("the freed place never came back: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    for s in held {
        let _ = s.logout();
    }
    println!("ISER CAP CHECK PASSED");
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let result = match args.mode.as_str() {
        "preempt" => preempt(&args),
        "flood" => flood(&args),
        "cap" => cap(&args),
        _ => Err(USAGE.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("iser-admission-check {}: {e}", args.mode);
            ExitCode::FAILURE
        }
    }
}
