//! Hold what a daemon pushes into systemd's fd store, as systemd does for a
//! unit with `FileDescriptorStoreMax=` set, where systemd is not PID 1 (the
//! lab's guest, a benchmark run by hand).
//!
//! - `fd-holder DIR`: print the notification socket's path once it
//!   listens, then hold until killed; give the daemon
//!   `NOTIFY_SOCKET=<that path>` and `FDSTORE=512` (tests/bench/restart.sh
//!   HOLDER=on).
//! - `fd-holder DIR -- PROGRAM ARGS...`: run PROGRAM as the shipped unit
//!   does: started again 100 ms after it ends in failure
//!   (Restart=on-failure, RestartSec=100ms, no start limit) with what the
//!   store holds passed in (LISTEN_FDS); its pid in DIR/pid at each start.
//!   Ends with PROGRAM when it exits 0 or 74 (RestartPreventExitStatus=74),
//!   emptying the store as systemd 252 does at a stop.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use ramslog_tests::fdstore::FdStoreSupervisor;

fn main() {
    let mut args = std::env::args_os().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: fd-holder DIR [-- PROGRAM ARGS...]");
        std::process::exit(2);
    };
    let holder = FdStoreSupervisor::new(&dir);
    let program: Vec<_> = match args.next() {
        None => Vec::new(),
        Some(sep) if sep == "--" => args.collect(),
        Some(other) => {
            eprintln!("fd-holder: expected -- before the program, got {other:?}");
            std::process::exit(2);
        }
    };
    if program.is_empty() {
        println!("{}", holder.socket_path().display());
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    loop {
        let start = holder.start();
        let mut child = match Command::new(&start.wrapper[0])
            .args(&start.wrapper[1..])
            .args(&program)
            .envs(start.env.iter().map(|(k, v)| (k, v)))
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("fd-holder: cannot start {:?}: {e}", program[0]);
                std::process::exit(1);
            }
        };
        drop(start.inherited);
        let _ = std::fs::write(dir.join("pid"), format!("{}\n", child.id()));
        let status = match child.wait() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("fd-holder: waiting for the program: {e}");
                std::process::exit(1);
            }
        };
        match status.code() {
            Some(code @ (0 | 74)) => {
                holder.clear();
                std::process::exit(code);
            }
            _ => {
                eprintln!("fd-holder: the program ended ({status}): starting it again in 100 ms");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}
