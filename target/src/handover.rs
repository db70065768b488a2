//! A planned restart (`ramslog-target restart`, `systemctl reload`): the
//! daemon executes its binary again (the file on disk, so an upgrade takes
//! effect) in the same process, and hands the new program what a stop and a
//! start would lose or redo: each LUN's memory with its kept-memory record
//! (memfds), the TCP listening sockets (the kernel queues hosts' reconnects
//! in the meantime instead of refusing them) and the state directory's lock.
//! They cross `execve` as descriptors without close-on-exec, named in one
//! environment variable; everything else (the RDMA devices' descriptors
//! above all) is close-on-exec and gone before the new program runs.
//! docs/restarts.md says what survives what.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::core::Advertised;

use crate::store;
use crate::volume::kept::{self, Current};

/// The variable that names what was handed over.
pub const ENV_VAR: &str = "RAMSLOG_HANDOVER";
/// The variable's layout this binary writes and reads.
const VERSION: &str = "1";

/// What a restart hands over, by descriptor number.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Handed {
    /// Names this handover in every volume's record.
    pub token: u64,
    /// Each LUN's memory and its record's.
    pub volumes: Vec<(RawFd, RawFd)>,
    pub listeners: Vec<RawFd>,
    pub state_lock: Option<RawFd>,
}

impl Handed {
    /// `1 token=HEX volumes=D:R,D:R listeners=F,F state-lock=F`.
    pub fn encode(&self) -> String {
        let list = |fds: &mut dyn Iterator<Item = String>| fds.collect::<Vec<_>>().join(",");
        let mut out = format!(
            "{VERSION} token={:016x} volumes={} listeners={}",
            self.token,
            list(&mut self.volumes.iter().map(|(d, r)| format!("{d}:{r}"))),
            list(&mut self.listeners.iter().map(|f| f.to_string())),
        );
        if let Some(lock) = self.state_lock {
            out += &format!(" state-lock={lock}");
        }
        out
    }

    /// The inverse of [`Handed::encode`]; anything else is an error.
    pub fn decode(text: &str) -> Result<Handed, String> {
        let mut words = text.split(' ');
        if words.next() != Some(VERSION) {
            return Err(format!("not a version {VERSION} handover: {text:?}"));
        }
        let fd = |s: &str| {
            s.parse::<RawFd>()
                .map_err(|_| format!("bad descriptor {s:?}"))
        };
        let fds = |s: &str| -> Result<Vec<RawFd>, String> {
            s.split(',').filter(|f| !f.is_empty()).map(fd).collect()
        };
        let mut handed = Handed::default();
        let mut token = None;
        for word in words {
            let (key, value) = word
                .split_once('=')
                .ok_or_else(|| format!("bad handover field {word:?}"))?;
            match key {
                "token" => {
                    token = Some(
                        u64::from_str_radix(value, 16)
                            .map_err(|_| format!("bad token {value:?}"))?,
                    )
                }
                "volumes" => {
                    for pair in value.split(',').filter(|p| !p.is_empty()) {
                        let (d, r) = pair
                            .split_once(':')
                            .ok_or_else(|| format!("bad volume {pair:?}"))?;
                        handed.volumes.push((fd(d)?, fd(r)?));
                    }
                }
                "listeners" => handed.listeners = fds(value)?,
                "state-lock" => handed.state_lock = Some(fd(value)?),
                _ => return Err(format!("unknown handover field {key:?}")),
            }
        }
        handed.token = token.ok_or("the handover names no token")?;
        Ok(handed)
    }

    /// Every descriptor it names.
    fn descriptors(&self) -> Vec<RawFd> {
        let mut all: Vec<RawFd> = self.volumes.iter().flat_map(|&(d, r)| [d, r]).collect();
        all.extend(&self.listeners);
        all.extend(self.state_lock);
        all
    }
}

/// One LUN's memory as handed over, and what its record says (read before
/// the record's memfd was closed), or why there is no record to go by.
#[derive(Debug)]
pub struct KeptVolume {
    pub memory: OwnedFd,
    pub record: Result<Current, String>,
    /// The record's own memfd, which the successor writes on.
    pub record_memory: Option<OwnedFd>,
    /// The NAA its name in systemd's fd store gives (`lun-<naa>`), if it
    /// came from there.
    pub stored_as: Option<String>,
}

/// What this process was handed by the program it replaced.
#[derive(Debug)]
pub struct Inherited {
    pub token: u64,
    pub volumes: Vec<KeptVolume>,
    pub listeners: Vec<OwnedFd>,
    pub state_lock: Option<OwnedFd>,
    /// Set when this process holds an RDMA device's descriptor: then the
    /// predecessor's queue pairs may be alive and no kept memory is served.
    pub rdma_descriptors: Vec<String>,
}

/// What the variable names, owned from now on; the variable is removed
/// (a child must never take it for its own), so call this before any
/// other thread runs. `Ok(None)` on an ordinary start.
pub fn inherited() -> Result<Option<Inherited>, String> {
    let Some(text) = std::env::var_os(ENV_VAR) else {
        return Ok(None);
    };
    std::env::remove_var(ENV_VAR);
    let handed = Handed::decode(&text.to_string_lossy())?;
    let mut fds = store::inherited_fds(&handed.descriptors())?.into_iter();
    let mut volumes = Vec::new();
    for _ in &handed.volumes {
        let (Some(memory), Some(record_fd)) = (fds.next(), fds.next()) else {
            return Err("the handover names fewer descriptors than it holds".into());
        };
        let record = kept::read_handed(record_fd.as_fd()).map_err(|e| e.to_string());
        volumes.push(KeptVolume {
            memory,
            record,
            record_memory: Some(record_fd),
            stored_as: None,
        });
    }
    let listeners = fds.by_ref().take(handed.listeners.len()).collect();
    let state_lock = fds.next();
    Ok(Some(Inherited {
        token: handed.token,
        volumes,
        listeners,
        state_lock,
        rdma_descriptors: rdma_descriptors(),
    }))
}

/// Open descriptors of RDMA devices (`/dev/infiniband/...`) in this process.
pub fn rdma_descriptors() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return vec!["/proc/self/fd unreadable".into()];
    };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|l| l.display().to_string())
        .filter(|l| l.starts_with("/dev/infiniband/"))
        .collect()
}

/// Let `fd` survive the coming `execve`.
pub fn keep_across_exec(fd: BorrowedFd<'_>) -> std::io::Result<RawFd> {
    rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?;
    Ok(fd.as_raw_fd())
}

/// What `--handover-check` prints: what the new binary would serve, for the
/// running one to compare before it fences anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The kept-memory record format the new binary reads.
    pub format: u32,
    pub state_dir: Option<PathBuf>,
    pub luns: Vec<LunShape>,
}

/// A LUN as a restart must keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LunShape {
    pub target: String,
    pub lun: u64,
    pub size: u64,
    pub block_size: u32,
    /// What each front end advertises of it, by [`Advertised::key`]
    /// (`block_limits`: SCSI's Block Limits VPD page; absent from a binary
    /// older than this check).
    #[serde(flatten)]
    pub advertised: BTreeMap<String, serde_json::Value>,
}

impl Report {
    /// What a configuration serves, with what `fronts` advertise of each
    /// LUN.
    pub fn of(cfg: &Config, fronts: &[&dyn Advertised]) -> Report {
        Report {
            format: kept::FORMAT,
            state_dir: cfg.state_dir.clone(),
            luns: cfg
                .targets
                .iter()
                .flat_map(|t| {
                    t.luns.iter().map(|l| LunShape {
                        target: t.name.clone(),
                        lun: l.lun,
                        size: l.size,
                        block_size: l.block_size,
                        advertised: fronts
                            .iter()
                            .map(|f| (f.key().to_string(), f.of(l.block_size)))
                            .collect(),
                    })
                })
                .collect(),
        }
    }

    /// Why the program that printed `new` may not take over from the one
    /// serving `self`: another record format or state directory, or a LUN
    /// served now that it would drop, serve with another size or block
    /// size, or advertise less of it in a front end of `fronts` (hosts keep
    /// what they read at their scan). A LUN it adds is fine: it starts as on
    /// a first start.
    pub fn refusal(&self, new: &Report, fronts: &[&dyn Advertised]) -> Option<String> {
        if new.format != self.format {
            return Some(format!(
                "the new binary reads kept-memory format {}, this one writes {}",
                new.format, self.format
            ));
        }
        if new.state_dir != self.state_dir {
            return Some(format!(
                "the new configuration's state directory is {:?}, this one's {:?}",
                new.state_dir, self.state_dir
            ));
        }
        for lun in &self.luns {
            let found = new
                .luns
                .iter()
                .find(|n| n.target == lun.target && n.lun == lun.lun);
            match found {
                None => {
                    return Some(format!(
                        "the new configuration drops {} LUN {}",
                        lun.target, lun.lun
                    ))
                }
                Some(n) if (n.size, n.block_size) != (lun.size, lun.block_size) => {
                    return Some(format!(
                        "the new configuration gives {} LUN {} {} bytes of {}-byte blocks, not {} of {}",
                        lun.target, lun.lun, n.size, n.block_size, lun.size, lun.block_size
                    ))
                }
                Some(n) => {
                    for f in fronts {
                        let lowered = match (lun.advertised.get(f.key()), n.advertised.get(f.key()))
                        {
                            (Some(now), Some(then)) => f.lowered(now, then),
                            (Some(_), None) => Some("it does not say what it advertises".into()),
                            (None, _) => None,
                        };
                        if let Some(what) = lowered {
                            return Some(format!(
                                "the new binary would lower {} LUN {}'s {}, which hosts cache ({what}): \
                                 stop and start instead, so that hosts scan the LUN again",
                                lun.target,
                                lun.lun,
                                f.name()
                            ));
                        }
                    }
                }
            }
        }
        None
    }
}

/// Variables a child or the next program must not take for its own: the
/// handover's, and systemd's socket-activation ones (this process owns
/// whatever they named).
pub const SCRUBBED: [&str; 4] = [ENV_VAR, "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"];

/// The new program of a restart, opened once: `--handover-check` runs this
/// file and the exec runs this file, whatever is renamed over its path in
/// between (a second upgrade, a half-written file). A script (`#!`) can
/// only be run through a descriptor its interpreter can open after the
/// exec, so its descriptor stays open across it; a binary's closes.
#[derive(Debug)]
pub struct NewProgram {
    path: PathBuf,
    file: OwnedFd,
}

impl NewProgram {
    pub fn open(path: &Path) -> Result<NewProgram, String> {
        use rustix::fs::{Mode, OFlags};
        let file = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let mut magic = [0u8; 2];
        let script =
            rustix::io::pread(&file, &mut magic, 0).is_ok_and(|n| n == 2) && magic == *b"#!";
        if script {
            rustix::io::fcntl_setfd(&file, rustix::io::FdFlags::empty()).map_err(|e| {
                format!(
                    "cannot keep {} open for its interpreter: {e}",
                    path.display()
                )
            })?;
        }
        Ok(NewProgram {
            path: path.to_path_buf(),
            file,
        })
    }

    /// The path it was opened from (for messages, and its argv\[0\]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The opened file, as a path that names it and nothing else.
    fn by_descriptor(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }
}

/// Run `program ARGS --handover-check` (without systemd's notify socket:
/// the check is not the service) and compare what it would serve with
/// `running`. Bounded: a binary that hangs is killed after `limit`.
pub fn check(
    program: &NewProgram,
    args: &[OsString],
    running: &Report,
    fronts: &[&dyn Advertised],
    limit: Duration,
) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let exe = program.path();
    let mut cmd = Command::new(program.by_descriptor());
    cmd.arg0(exe);
    cmd.args(args)
        .arg("--handover-check")
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in SCRUBBED {
        cmd.env_remove(v);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < limit => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{} --handover-check did not answer within {limit:?}",
                    exe.display()
                ));
            }
            Err(e) => return Err(format!("waiting for {}: {e}", exe.display())),
        }
    };
    let read = |pipe: Option<&mut dyn Read>| {
        let mut text = String::new();
        if let Some(p) = pipe {
            let _ = p.take(1 << 20).read_to_string(&mut text);
        }
        text
    };
    let out = read(child.stdout.as_mut().map(|p| p as &mut dyn Read));
    let err = read(child.stderr.as_mut().map(|p| p as &mut dyn Read));
    if !status.success() {
        let why = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        return Err(format!(
            "{} --handover-check failed ({status}): {why}",
            exe.display()
        ));
    }
    let new: Report = serde_json::from_str(out.trim())
        .map_err(|e| format!("{} --handover-check answered {out:?}: {e}", exe.display()))?;
    running.refusal(&new, fronts).map_or(Ok(()), Err)
}

/// Replace this program with `program ARGS` (the very file that was
/// checked), handing over `handed`; the stop signals stay blocked, and any
/// sent meanwhile pending, across the exec (std's `Command::exec` would
/// empty the mask). Returns only if that failed.
pub fn exec(program: &NewProgram, args: &[OsString], handed: &Handed) -> std::io::Error {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c =
        |s: &[u8]| CString::new(s).map_err(|_| std::io::Error::other("a NUL byte in an argument"));
    let prepared = (|| {
        let path = c(program.path().as_os_str().as_bytes())?;
        let mut argv = vec![path];
        for a in args {
            argv.push(c(a.as_bytes())?);
        }
        let mut env = Vec::new();
        for (k, v) in std::env::vars_os() {
            if !SCRUBBED.iter().any(|s| k == *s) {
                env.push(c(&[k.as_bytes(), b"=", v.as_bytes()].concat())?);
            }
        }
        env.push(c(format!("{ENV_VAR}={}", handed.encode()).as_bytes())?);
        Ok::<_, std::io::Error>((argv, env))
    })();
    match prepared {
        Ok((argv, env)) => {
            // execveat(fd, "", AT_EMPTY_PATH): the opened file, not the path.
            let Err(e) = nix::unistd::fexecve(program.file.as_fd(), &argv, &env);
            e.into()
        }
        Err(e) => e,
    }
}

/// A restart that did not happen: the descriptors [`keep_across_exec`]
/// opened to the exec are closed on exec again.
pub fn close_on_exec_again(fd: BorrowedFd<'_>) -> std::io::Result<()> {
    rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_round_trips_and_nothing_else_decodes() {
        let handed = Handed {
            token: 0xfeed_beef_0000_0001,
            volumes: vec![(5, 6), (7, 8)],
            listeners: vec![9],
            state_lock: Some(10),
        };
        assert_eq!(
            handed.encode(),
            "1 token=feedbeef00000001 volumes=5:6,7:8 listeners=9 state-lock=10"
        );
        assert_eq!(Handed::decode(&handed.encode()), Ok(handed.clone()));
        assert_eq!(handed.descriptors(), vec![5, 6, 7, 8, 9, 10]);
        let bare = Handed {
            token: 1,
            ..Handed::default()
        };
        assert_eq!(Handed::decode(&bare.encode()), Ok(bare));
        for bad in [
            "",
            "2 token=1",
            "1 volumes=5:6",
            "1 token=xyz",
            "1 token=1 volumes=5",
            "1 token=1 listeners=a",
            "1 token=1 colour=blue",
            "1 token=1 listeners",
        ] {
            assert!(Handed::decode(bad).is_err(), "{bad:?} decoded");
        }
    }

    #[test]
    fn a_restart_keeps_every_lun_or_is_refused() {
        let scsi = crate::scsi::BlockLimitsAdvertised;
        let fronts: &[&dyn Advertised] = &[&scsi];
        let lun = |target: &str, lun, size| LunShape {
            target: target.into(),
            lun,
            size,
            block_size: 512,
            advertised: [("block_limits".to_string(), scsi.of(512))].into(),
        };
        let running = Report {
            format: kept::FORMAT,
            state_dir: Some("/var/lib/ramslog".into()),
            luns: vec![lun("iqn.a", 0, 1 << 30), lun("iqn.a", 1, 1 << 30)],
        };
        let mut new = running.clone();
        new.luns.push(lun("iqn.b", 0, 1 << 20));
        assert_eq!(running.refusal(&new, fronts), None, "a LUN added is fine");
        let refused = |change: &dyn Fn(&mut Report)| {
            let mut new = running.clone();
            change(&mut new);
            running.refusal(&new, fronts).expect("refused")
        };
        // The SCSI LU's Block Limits as the report carries them.
        let limits = |r: &mut Report, lun: usize, field: &str, change: &dyn Fn(u64) -> u64| {
            let v = &mut r.luns[lun]
                .advertised
                .get_mut("block_limits")
                .expect("limits")[field];
            *v = change(v.as_u64().expect("a number")).into();
        };
        assert!(refused(&|r| r.format += 1).contains("format"));
        assert!(refused(&|r| r.state_dir = None).contains("state directory"));
        assert!(refused(&|r| {
            r.luns.remove(1);
        })
        .contains("drops iqn.a LUN 1"));
        assert!(refused(&|r| r.luns[0].size *= 2).contains("iqn.a LUN 0 2147483648 bytes"));
        assert!(refused(&|r| r.luns[1].block_size = 4096).contains("4096-byte blocks"));
        let lower = |r: &mut Report| limits(r, 1, "max_transfer", &|n| n - 1);
        assert!(refused(&lower).contains("iqn.a LUN 1's Block Limits"));
        assert!(refused(&lower).contains("MAXIMUM TRANSFER LENGTH 32768 -> 32767 blocks"));
        assert!(refused(&|r| {
            r.luns[0].advertised.clear();
        })
        .contains("does not say"));
        let mut raised = running.clone();
        limits(&mut raised, 0, "max_write_same", &|n| n * 2);
        assert_eq!(
            running.refusal(&raised, fronts),
            None,
            "a raised limit is fine"
        );
        // The report reads as before the front ends were asked: a binary on
        // either side of this change compares the same `block_limits`.
        let json = serde_json::to_value(&running.luns[0]).expect("json");
        assert_eq!(json["block_limits"]["max_transfer"], 32768);
        let old: LunShape = serde_json::from_str(
            r#"{"target":"iqn.a","lun":0,"size":1073741824,"block_size":512,
                "block_limits":{"max_compare_and_write":1,"max_transfer":32768,"max_write_same":32768}}"#,
        )
        .expect("an older binary's report");
        assert!(old.advertised.contains_key("block_limits"));
    }
}
