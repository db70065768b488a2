//! The state directory: each LUN's identity and generation across restarts
//! (the identity rule, docs/persistence.md). A LUN whose content did not
//! survive comes back under its old identity but NOT READY until the admin
//! accepts the empty device. The daemon holds an exclusive lock on the
//! directory for its lifetime.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::identity::{naa_hex, Identity};
use crate::private_dir::{self, PrivateDirError};

const FILE: &str = "luns.toml";

#[derive(Debug, Error)]
pub enum StateError {
    #[error(transparent)]
    Private(#[from] PrivateDirError),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is damaged ({source}); move it aside to start over (every LUN then gets a new identity)")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("{path} has an invalid NAA designator for {target} LUN {lun}; move the file aside to start over")]
    BadNaa {
        path: PathBuf,
        target: String,
        lun: u64,
    },
    #[error("{path} holds a generation beyond the supported range for {target} LUN {lun}; move the file aside to start over")]
    BadGeneration {
        path: PathBuf,
        target: String,
        lun: u64,
    },
    #[error("state directory {path} is in use by another ramslog-target (it holds the lock); stop it first, or give this one its own --state-dir")]
    Locked { path: PathBuf },
    #[error("cannot lock state directory {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no record for {target} LUN {lun} in {path}")]
    Unknown {
        path: PathBuf,
        target: String,
        lun: u64,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LunRecord {
    pub target: String,
    pub lun: u64,
    /// NAA designator, 16 hex digits.
    pub naa: String,
    pub serial: String,
    /// The current generation: bumped durably before the first write of a
    /// run is acknowledged and at every new identity; never reset, never
    /// reused, at most i64::MAX.
    #[serde(default)]
    pub generation: u64,
    /// The generation whose image is complete, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clean: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct StateFile {
    #[serde(default)]
    lun: Vec<LunRecord>,
    /// The last stop, if its dump failed; gone after a clean stop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failed_stop: Option<FailedStop>,
}

/// A stop whose dump failed: the LUNs it did not save come back NOT READY,
/// and the next start and `status` say why until a stop succeeds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedStop {
    /// Seconds since the epoch.
    pub at_unix: u64,
    pub reason: String,
}

/// What the state directory says about one LUN at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recall {
    /// Never seen: a fresh identity, the LUN is ready.
    New(Identity),
    /// Seen before: its identity and generation; the content is back only
    /// if a clean image of exactly this generation verifies.
    Known {
        identity: Identity,
        generation: u64,
        /// Whether the state marks `generation` cleanly dumped.
        clean: bool,
    },
}

/// Highest generation the state accepts (stays within i64 for any reader).
pub const MAX_GENERATION: u64 = i64::MAX as u64;

pub struct StateDir {
    path: PathBuf,
    file: StateFile,
    /// Holds the exclusive lock for as long as the daemon runs.
    lock: std::fs::File,
}

fn parse_naa(s: &str) -> Option<[u8; 8]> {
    if s.len() != 16 {
        return None;
    }
    let mut out = [0u8; 8];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

impl StateDir {
    pub fn open(path: &Path) -> Result<StateDir, StateError> {
        Self::open_with(path, None)
    }

    /// Open the state directory at `path`, locked through `inherited` when
    /// the process that held the lock handed it over across exec (a second
    /// open of the directory could not lock it: the lock belongs to that
    /// open file). A descriptor of another directory is refused.
    pub fn open_with(path: &Path, inherited: Option<OwnedFd>) -> Result<StateDir, StateError> {
        private_dir::prepare(path, "state directory")?;
        let lock = match inherited {
            Some(fd) => {
                let lock = std::fs::File::from(fd);
                let same = |a: &std::fs::Metadata, b: &std::fs::Metadata| {
                    a.dev() == b.dev() && a.ino() == b.ino()
                };
                match (lock.metadata(), std::fs::metadata(path)) {
                    (Ok(held), Ok(dir)) if same(&held, &dir) => lock,
                    _ => {
                        return Err(StateError::Lock {
                            path: path.into(),
                            source: std::io::Error::other(
                                "the lock handed over is not this directory's",
                            ),
                        })
                    }
                }
            }
            None => std::fs::File::open(path).map_err(|source| StateError::Lock {
                path: path.into(),
                source,
            })?,
        };
        // Taking a lock this open file holds already succeeds.
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StateError::Locked { path: path.into() })
            }
            Err(std::fs::TryLockError::Error(source)) => {
                return Err(StateError::Lock {
                    path: path.into(),
                    source,
                })
            }
        }
        let f = path.join(FILE);
        let text = private_dir::open_regular(&f, 0).and_then(|mut h| {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut h, &mut s).map(|_| s)
        });
        let file = match text {
            Ok(s) => toml::from_str(&s).map_err(|source| StateError::Parse {
                path: f.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StateFile::default(),
            Err(source) => return Err(StateError::Read { path: f, source }),
        };
        let file: StateFile = file;
        if let Some(r) = file
            .lun
            .iter()
            .find(|r| r.generation > MAX_GENERATION || r.clean.is_some_and(|c| c > r.generation))
        {
            return Err(StateError::BadGeneration {
                path: f,
                target: r.target.clone(),
                lun: r.lun,
            });
        }
        Ok(StateDir {
            path: path.into(),
            file,
            lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open directory that holds the lock, to hand on across exec.
    pub fn lock(&self) -> BorrowedFd<'_> {
        self.lock.as_fd()
    }

    fn record(&self, target: &str, lun: u64) -> Option<&LunRecord> {
        self.file
            .lun
            .iter()
            .find(|r| r.target == target && r.lun == lun)
    }

    /// Look up (and if new, record) a LUN's identity.
    pub fn recall(&mut self, target: &str, lun: u64) -> Result<Recall, StateError> {
        if let Some(r) = self.record(target, lun) {
            let naa = parse_naa(&r.naa).ok_or_else(|| StateError::BadNaa {
                path: self.path.join(FILE),
                target: target.into(),
                lun,
            })?;
            return Ok(Recall::Known {
                identity: Identity {
                    naa,
                    serial: r.serial.clone(),
                },
                generation: r.generation,
                clean: r.clean == Some(r.generation),
            });
        }
        let id = Identity::generate();
        self.set(target, lun, &id)?;
        Ok(Recall::New(id))
    }

    /// Record a new identity for a LUN (first start or accept-empty), under
    /// a new generation with no image. Returns that generation.
    pub fn set(&mut self, target: &str, lun: u64, id: &Identity) -> Result<u64, StateError> {
        let generation = match self.record(target, lun) {
            Some(r) => self.next_generation(r)?,
            None => 1,
        };
        let rec = LunRecord {
            target: target.into(),
            lun,
            naa: naa_hex(&id.naa),
            serial: id.serial.clone(),
            generation,
            clean: None,
        };
        self.change(target, lun, |r| *r = rec.clone(), Some(rec.clone()))?;
        Ok(generation)
    }

    fn next_generation(&self, r: &LunRecord) -> Result<u64, StateError> {
        r.generation
            .checked_add(1)
            .filter(|g| *g <= MAX_GENERATION)
            .ok_or_else(|| StateError::BadGeneration {
                path: self.path.join(FILE),
                target: r.target.clone(),
                lun: r.lun,
            })
    }

    /// Start a new generation for a LUN, durably (file and directory
    /// fsynced) before this returns. Returns it.
    pub fn bump_generation(&mut self, target: &str, lun: u64) -> Result<u64, StateError> {
        let r = self
            .record(target, lun)
            .ok_or_else(|| StateError::Unknown {
                path: self.path.join(FILE),
                target: target.into(),
                lun,
            })?;
        let g = self.next_generation(r)?;
        self.change(target, lun, |r| r.generation = g, None)?;
        Ok(g)
    }

    /// Record that `generation` of a LUN has a complete image.
    pub fn mark_clean(
        &mut self,
        target: &str,
        lun: u64,
        generation: u64,
    ) -> Result<(), StateError> {
        match self.record(target, lun) {
            Some(r) if r.generation == generation => {}
            _ => {
                return Err(StateError::Unknown {
                    path: self.path.join(FILE),
                    target: target.into(),
                    lun,
                })
            }
        }
        self.change(target, lun, |r| r.clean = Some(generation), None)
    }

    /// The last stop's failure, if its dump failed.
    pub fn failed_stop(&self) -> Option<&FailedStop> {
        self.file.failed_stop.as_ref()
    }

    /// Record how a stop ended: `Some` when its dump failed, `None` once a
    /// stop succeeded. Written (durably) only when it changes.
    pub fn record_stop(&mut self, failed: Option<FailedStop>) -> Result<(), StateError> {
        if self.file.failed_stop == failed {
            return Ok(());
        }
        let mut next = self.file.clone();
        next.failed_stop = failed;
        self.save(&next)?;
        self.file = next;
        Ok(())
    }

    /// The current generation of a LUN.
    /// The NAA (16 hex digits) of a LUN the state knows.
    pub fn naa(&self, target: &str, lun: u64) -> Option<String> {
        self.record(target, lun).map(|r| r.naa.clone())
    }

    pub fn generation(&self, target: &str, lun: u64) -> Option<u64> {
        self.record(target, lun).map(|r| r.generation)
    }

    /// Whether the state marks `generation` of a LUN as cleanly dumped and
    /// it is the current one.
    pub fn is_clean(&self, target: &str, lun: u64, generation: u64) -> bool {
        self.record(target, lun)
            .is_some_and(|r| r.generation == generation && r.clean == Some(generation))
    }

    /// Change a copy and save it: a record that cannot be saved must not
    /// linger in memory and fail every later save.
    fn change(
        &mut self,
        target: &str,
        lun: u64,
        edit: impl FnOnce(&mut LunRecord),
        insert: Option<LunRecord>,
    ) -> Result<(), StateError> {
        let mut next = self.file.clone();
        match next
            .lun
            .iter_mut()
            .find(|r| r.target == target && r.lun == lun)
        {
            Some(r) => edit(r),
            None => next.lun.extend(insert),
        }
        self.save(&next)?;
        self.file = next;
        Ok(())
    }

    fn save(&self, file: &StateFile) -> Result<(), StateError> {
        let f = self.path.join(FILE);
        let tmp = self.path.join(format!("{FILE}.tmp"));
        // A failed serialisation must not replace the file with nothing.
        let text = toml::to_string(file).map_err(|e| StateError::Write {
            path: f.clone(),
            source: std::io::Error::other(e),
        })?;
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            // A temporary file a crash left behind is ours to replace; the
            // new one is created, never opened through what is there.
            match std::fs::remove_file(&tmp) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            let mut h = private_dir::create_private(&tmp, 0)?;
            h.write_all(text.as_bytes())?;
            h.sync_all()?;
            std::fs::rename(&tmp, &f)?;
            std::fs::File::open(&self.path)?.sync_all()
        };
        write().map_err(|source| StateError::Write {
            path: f.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ramslog-state-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn known(id: &Identity, generation: u64, clean: bool) -> Recall {
        Recall::Known {
            identity: id.clone(),
            generation,
            clean,
        }
    }

    #[test]
    fn identities_and_generations_survive_reopening() {
        let dir = fresh_dir("gen");
        let mut s = StateDir::open(&dir).unwrap();
        let Recall::New(id) = s.recall("iqn.x", 0).unwrap() else {
            panic!("expected new")
        };
        assert_eq!(s.generation("iqn.x", 0), Some(1));
        drop(s);
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), known(&id, 1, false));
        s.mark_clean("iqn.x", 0, 1).unwrap();
        assert!(s.is_clean("iqn.x", 0, 1));
        assert!(
            s.mark_clean("iqn.x", 0, 2).is_err(),
            "only the current generation"
        );
        drop(s);
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), known(&id, 1, true));
        // The first write of a run: the clean image is no longer current.
        assert_eq!(s.bump_generation("iqn.x", 0).unwrap(), 2);
        drop(s);
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), known(&id, 2, false));
        // accept-empty: new identity, the generation goes on.
        let fresh = Identity::generate();
        assert_eq!(s.set("iqn.x", 0, &fresh).unwrap(), 3);
        drop(s);
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), known(&fresh, 3, false));
        drop(s);
        std::fs::write(dir.join(FILE), "lun = 5").unwrap();
        assert!(matches!(
            StateDir::open(&dir),
            Err(StateError::Parse { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_stop_is_remembered_until_a_stop_succeeds() {
        let dir = fresh_dir("failed-stop");
        let mut s = StateDir::open(&dir).unwrap();
        let Recall::New(id) = s.recall("iqn.x", 0).unwrap() else {
            panic!("expected new")
        };
        assert_eq!(s.failed_stop(), None);
        let failed = FailedStop {
            at_unix: 1_796_000_000,
            reason: "iqn.x LUN 0: image write: No space left on device".into(),
        };
        s.record_stop(Some(failed.clone())).unwrap();
        drop(s);
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.failed_stop(), Some(&failed));
        assert_eq!(
            s.recall("iqn.x", 0).unwrap(),
            known(&id, 1, false),
            "the LUNs are untouched"
        );
        s.record_stop(None).unwrap();
        drop(s);
        let s = StateDir::open(&dir).unwrap();
        assert_eq!(s.failed_stop(), None);
        let text = std::fs::read_to_string(dir.join(FILE)).unwrap();
        assert!(!text.contains("failed_stop"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_opener_is_refused() {
        let dir = fresh_dir("lock");
        let s = StateDir::open(&dir).unwrap();
        assert!(matches!(
            StateDir::open(&dir),
            Err(StateError::Locked { .. })
        ));
        drop(s);
        StateDir::open(&dir).expect("free again once the holder is gone");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn generations_stay_within_i64() {
        let dir = fresh_dir("max");
        std::fs::create_dir_all(&dir).unwrap();
        let rec = |g: u64| {
            format!(
                "[[lun]]\ntarget = \"iqn.x\"\nlun = 0\nnaa = \"3000000000000001\"\nserial = \"s\"\ngeneration = {g}\n"
            )
        };
        std::fs::write(dir.join(FILE), rec(MAX_GENERATION)).unwrap();
        let mut s = StateDir::open(&dir).unwrap();
        assert!(matches!(
            s.bump_generation("iqn.x", 0),
            Err(StateError::BadGeneration { .. })
        ));
        drop(s);
        // A clean mark ahead of the generation is damage, not trust.
        std::fs::write(dir.join(FILE), rec(4) + "clean = 5\n").unwrap();
        assert!(matches!(
            StateDir::open(&dir),
            Err(StateError::BadGeneration { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A record TOML cannot hold (integers beyond i64) fails the change and
    /// leaves the file as it was; it never replaces it with nothing.
    #[test]
    fn a_record_that_cannot_be_written_keeps_the_file() {
        let dir = fresh_dir("ser");
        let mut s = StateDir::open(&dir).unwrap();
        let Recall::New(id) = s.recall("iqn.x", 0).unwrap() else {
            panic!("expected new")
        };
        let before = std::fs::read_to_string(dir.join(FILE)).unwrap();
        assert!(matches!(
            s.set("iqn.x", u64::MAX, &Identity::generate()),
            Err(StateError::Write { .. })
        ));
        assert_eq!(std::fs::read_to_string(dir.join(FILE)).unwrap(), before);
        s.set("iqn.x", 1, &Identity::generate())
            .expect("the failed record is not kept");
        drop(s);
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), known(&id, 1, false));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The state file shows the NAA and serial an image forger needs: 0600.
    /// A temporary file someone left as a link is never written through.
    #[test]
    fn the_state_file_is_private_and_never_written_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = fresh_dir("link");
        let mut s = StateDir::open(&dir).unwrap();
        s.recall("iqn.x", 0).unwrap();
        let mode = std::fs::metadata(dir.join(FILE))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        let victim =
            std::env::temp_dir().join(format!("ramslog-state-victim-{}", std::process::id()));
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(format!("{FILE}.tmp"))).unwrap();
        let bumped = s.bump_generation("iqn.x", 0);
        let kept = std::fs::read_to_string(&victim).unwrap();
        let _ = std::fs::remove_file(&victim);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(kept, "precious", "followed a planted link");
        assert_eq!(bumped.unwrap(), 2, "a stale temporary file is replaced");
        assert_eq!(mode, 0o600, "luns.toml is private");
    }
}
