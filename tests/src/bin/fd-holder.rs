//! `fd-holder DIR`: hold what a daemon pushes into systemd's fd store, as
//! systemd does for a unit with `FileDescriptorStoreMax=` set, for a
//! benchmark run outside systemd (tests/bench/restart.sh with HOLDER=on).
//! Prints the notification socket's path once it listens, then holds until
//! killed; give the daemon `NOTIFY_SOCKET=<that path>` and `FDSTORE=512`.

use std::path::PathBuf;

use ramslog_tests::fdstore::FdStoreSupervisor;

fn main() {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: fd-holder DIR");
        std::process::exit(2);
    };
    let holder = FdStoreSupervisor::new(&dir);
    println!("{}", holder.socket_path().display());
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
