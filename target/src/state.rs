//! The state directory: each LUN's identity across restarts (the identity rule
//! of DESIGN.md). A LUN whose content did not survive comes back under its old
//! identity but NOT READY until the admin accepts the empty device.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::scsi::Identity;

const FILE: &str = "luns.toml";

#[derive(Debug, Error)]
pub enum StateError {
    #[error("cannot create state directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
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
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct StateFile {
    #[serde(default)]
    lun: Vec<LunRecord>,
}

/// What the state directory says about one LUN at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recall {
    /// Never seen: a fresh identity, the LUN is ready.
    New(Identity),
    /// Seen before and its content is gone: same identity, not ready.
    ContentLost(Identity),
}

pub struct StateDir {
    path: PathBuf,
    file: StateFile,
}

pub fn naa_hex(naa: &[u8; 8]) -> String {
    naa.iter().map(|b| format!("{b:02x}")).collect()
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
        std::fs::create_dir_all(path).map_err(|source| StateError::CreateDir {
            path: path.into(),
            source,
        })?;
        let f = path.join(FILE);
        let file = match std::fs::read_to_string(&f) {
            Ok(s) => toml::from_str(&s).map_err(|source| StateError::Parse {
                path: f.clone(),
                source,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StateFile::default(),
            Err(source) => return Err(StateError::Read { path: f, source }),
        };
        Ok(StateDir {
            path: path.into(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Look up (and if new, record) a LUN's identity.
    pub fn recall(&mut self, target: &str, lun: u64) -> Result<Recall, StateError> {
        if let Some(r) = self
            .file
            .lun
            .iter()
            .find(|r| r.target == target && r.lun == lun)
        {
            let naa = parse_naa(&r.naa).ok_or_else(|| StateError::BadNaa {
                path: self.path.join(FILE),
                target: target.into(),
                lun,
            })?;
            return Ok(Recall::ContentLost(Identity {
                naa,
                serial: r.serial.clone(),
            }));
        }
        let id = Identity::generate();
        self.set(target, lun, &id)?;
        Ok(Recall::New(id))
    }

    /// Record a new identity for a LUN (first start or accept-empty).
    pub fn set(&mut self, target: &str, lun: u64, id: &Identity) -> Result<(), StateError> {
        let rec = LunRecord {
            target: target.into(),
            lun,
            naa: naa_hex(&id.naa),
            serial: id.serial.clone(),
        };
        // Change a copy: a record that cannot be saved must not linger in
        // memory and fail every later save.
        let mut next = self.file.clone();
        match next
            .lun
            .iter_mut()
            .find(|r| r.target == target && r.lun == lun)
        {
            Some(r) => *r = rec,
            None => next.lun.push(rec),
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
            let mut h = std::fs::File::create(&tmp)?;
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

    #[test]
    fn first_start_new_then_content_lost() {
        let dir = std::env::temp_dir().join(format!("ramslog-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = StateDir::open(&dir).unwrap();
        let Recall::New(id) = s.recall("iqn.x", 0).unwrap() else {
            panic!("expected new")
        };
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(
            s.recall("iqn.x", 0).unwrap(),
            Recall::ContentLost(id.clone())
        );
        let fresh = Identity::generate();
        s.set("iqn.x", 0, &fresh).unwrap();
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), Recall::ContentLost(fresh));
        std::fs::write(dir.join(FILE), "lun = 5").unwrap();
        assert!(matches!(
            StateDir::open(&dir),
            Err(StateError::Parse { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A record TOML cannot hold (integers beyond i64) fails the change and
    /// leaves the file as it was; it never replaces it with nothing.
    #[test]
    fn a_record_that_cannot_be_written_keeps_the_file() {
        let dir = std::env::temp_dir().join(format!("ramslog-state-ser-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
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
        let mut s = StateDir::open(&dir).unwrap();
        assert_eq!(s.recall("iqn.x", 0).unwrap(), Recall::ContentLost(id));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
