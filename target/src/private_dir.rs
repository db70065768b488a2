//! Directories only the daemon's user may touch: the state directory (each
//! LUN's NAA, serial and generation, all an image forger needs), the image
//! directory (the LUN content) and the control socket's directory. Whoever
//! else can place, replace or link a file there can forge an image, point a
//! write at another file or spoof the daemon, so the daemon refuses to start
//! on such a directory instead of trusting what is in it.
//!
//! Inside a checked directory nobody else can create anything, so the
//! daemon's own opens only have to refuse what the directory check would
//! have refused (links, FIFOs), which `open_regular` and `create_private` do.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum PrivateDirError {
    #[error("cannot create the {what} {path}: {source}")]
    Create {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot inspect the {what} {path}: {source}")]
    Inspect {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the {what} {path} is not a directory; move it away or choose another path")]
    NotADirectory { what: &'static str, path: PathBuf },
    #[error("{path} (in the {what}) is owned by uid {owner}, not by uid {daemon} that runs ramslog-target; another user could have placed it: check it, then `chown {daemon} {path}` or remove it")]
    Owner {
        what: &'static str,
        path: PathBuf,
        owner: u32,
        daemon: u32,
    },
    #[error("{path} (in the {what}) is writable by group or others (mode {mode:o}), so another user could have replaced what is in it: check it, then `chmod go-w {path}`")]
    Writable {
        what: &'static str,
        path: PathBuf,
        mode: u32,
    },
    #[error(
        "{path} (in the {what}) is a {kind}; the daemon only keeps regular files there: remove it"
    )]
    Foreign {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
    },
    #[error("{ancestor} (above the {what} {path}) is {why}: another user could rename the {what} away and put one of their own in its place after the daemon checked it. Put the {what} under directories only root and uid {daemon} can write, or `chmod go-w {ancestor}` (or `chmod +t` for a shared directory such as /tmp)")]
    Ancestor {
        what: &'static str,
        path: PathBuf,
        ancestor: PathBuf,
        why: String,
        daemon: u32,
    },
    #[error("cannot write to the {what} {path}: {source}")]
    NotWritable {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set the mode of {path} (in the {what}): {source}")]
    Tighten {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The user every private directory and file must belong to.
pub fn daemon_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Create `dir` (0700) if needed, then check it and everything directly in
/// it: owned by the daemon's user (or root, who could do anything anyway
/// and owns what systemd creates), not writable by group or others, no
/// symbolic links, FIFOs or devices. Modes looser than 0700 (directories)
/// and 0600 (files) are tightened with a warning: they expose the NAA and
/// serial or the content, but nobody could have changed anything through
/// them.
pub fn prepare(dir: &Path, what: &'static str) -> Result<(), PrivateDirError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| PrivateDirError::Create {
            what,
            path: dir.into(),
            source,
        })?;
    let inspect = |path: &Path, source| PrivateDirError::Inspect {
        what,
        path: path.into(),
        source,
    };
    // The directory itself may be reached through a link the admin made
    // (/var/lib/ramslog -> /srv/ramslog); what it resolves to is checked.
    let meta = std::fs::metadata(dir).map_err(|e| inspect(dir, e))?;
    if !meta.is_dir() {
        return Err(PrivateDirError::NotADirectory {
            what,
            path: dir.into(),
        });
    }
    check_entry(dir, &meta, what)?;
    check_ancestors(dir, what)?;
    tighten(dir, &meta, 0o700, what)?;
    // Found now rather than at the first dump, hours later (a read-only
    // mount, say).
    rustix::fs::access(
        dir,
        rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
    )
    .map_err(|e| PrivateDirError::NotWritable {
        what,
        path: dir.into(),
        source: e.into(),
    })?;
    let entries = std::fs::read_dir(dir).map_err(|e| inspect(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| inspect(dir, e))?;
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path).map_err(|e| inspect(&path, e))?;
        let kind = meta.file_type();
        let foreign = |kind| PrivateDirError::Foreign {
            what,
            path: path.clone(),
            kind,
        };
        use std::os::unix::fs::FileTypeExt;
        if kind.is_symlink() {
            return Err(foreign("symbolic link"));
        }
        if kind.is_fifo() {
            return Err(foreign("FIFO"));
        }
        if kind.is_block_device() || kind.is_char_device() {
            return Err(foreign("device node"));
        }
        check_entry(&path, &meta, what)?;
        if kind.is_file() {
            tighten(&path, &meta, 0o600, what)?;
        }
    }
    Ok(())
}

/// Every directory above `dir`, up to /: the daemon reaches its files by
/// path, so whoever can rename `dir` (or a link to it) could swap it for
/// their own after the check. Each must belong to root or the daemon's
/// user and not be writable by group or others, unless it has the sticky
/// bit (as /tmp does: there only an entry's owner can rename it). Both the
/// directory the path resolves to and the one holding the path's last
/// component (a link the admin made) are checked upward.
fn check_ancestors(dir: &Path, what: &'static str) -> Result<(), PrivateDirError> {
    let inspect = |path: &Path, source| PrivateDirError::Inspect {
        what,
        path: path.into(),
        source,
    };
    let daemon = daemon_uid();
    let absolute = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| inspect(dir, e))?
            .join(dir)
    };
    // Every directory the path passes through, as the kernel resolves it:
    // the one each component of the literal path sits in (a link anywhere
    // in the path could be repointed by whoever can write there), and those
    // above the directory it resolves to.
    let mut chains = vec![std::fs::canonicalize(dir).map_err(|e| inspect(dir, e))?];
    for component in absolute.ancestors() {
        let meta = std::fs::symlink_metadata(component).map_err(|e| inspect(component, e))?;
        if meta.file_type().is_symlink() && meta.uid() != 0 && meta.uid() != daemon {
            return Err(PrivateDirError::Ancestor {
                what,
                path: dir.into(),
                ancestor: component.into(),
                why: format!("a symbolic link owned by uid {}", meta.uid()),
                daemon,
            });
        }
        if let Some(parent) = component.parent() {
            chains.push(std::fs::canonicalize(parent).map_err(|e| inspect(parent, e))?);
        }
    }
    let resolved = chains[0].clone();
    let ancestors = chains
        .iter()
        .flat_map(|c| c.ancestors())
        .filter(|a| *a != resolved.as_path());
    for ancestor in ancestors {
        let meta = std::fs::metadata(ancestor).map_err(|e| inspect(ancestor, e))?;
        let mode = meta.permissions().mode();
        let why = if meta.uid() != 0 && meta.uid() != daemon {
            format!("owned by uid {}", meta.uid())
        } else if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            format!("writable by group or others (mode {:o})", mode & 0o7777)
        } else {
            continue;
        };
        return Err(PrivateDirError::Ancestor {
            what,
            path: dir.into(),
            ancestor: ancestor.into(),
            why,
            daemon,
        });
    }
    Ok(())
}

/// The directory of a control socket, on both sides of it: whoever else can
/// write there could bind a socket of their own at its path first and
/// answer `status` or swallow `stop` in the daemon's place. It must belong
/// to this process's user or root (root may use any user's) and not be
/// writable by group or others.
pub fn check_socket_dir(dir: &Path) -> Result<(), PrivateDirError> {
    let what = "control socket's directory";
    let meta = std::fs::metadata(dir).map_err(|source| PrivateDirError::Inspect {
        what,
        path: dir.into(),
        source,
    })?;
    if daemon_uid() == 0 && meta.uid() != 0 {
        // Root reaching a non-root daemon: only the write bits matter.
        let mode = meta.mode() & 0o7777;
        if mode & 0o022 != 0 {
            return Err(PrivateDirError::Writable {
                what,
                path: dir.into(),
                mode,
            });
        }
        return Ok(());
    }
    check_entry(dir, &meta, what)
}

/// Owner and write bits of one path.
fn check_entry(
    path: &Path,
    meta: &std::fs::Metadata,
    what: &'static str,
) -> Result<(), PrivateDirError> {
    let daemon = daemon_uid();
    if meta.uid() != daemon && meta.uid() != 0 {
        return Err(PrivateDirError::Owner {
            what,
            path: path.into(),
            owner: meta.uid(),
            daemon,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(PrivateDirError::Writable {
            what,
            path: path.into(),
            mode,
        });
    }
    Ok(())
}

fn tighten(
    path: &Path,
    meta: &std::fs::Metadata,
    to: u32,
    what: &'static str,
) -> Result<(), PrivateDirError> {
    let mode = meta.mode() & 0o777;
    if mode & !to == 0 {
        return Ok(());
    }
    tracing::warn!(path = %path.display(), "{what}: mode {mode:o} lets others read it; setting {to:o}");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(to)).map_err(|source| {
        PrivateDirError::Tighten {
            what,
            path: path.into(),
            source,
        }
    })
}

/// Open an existing file for reading: never through a symbolic link, never
/// blocking on a FIFO, and only if it is a regular file. `extra` adds open
/// flags (O_DIRECT).
pub fn open_regular(path: &Path, extra: i32) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | extra)
        .open(path)
        .map_err(|e| explain_link(path, e))?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(file)
}

/// Create a new file, mode 0600, for writing: never an existing one and
/// never through a symbolic link. `extra` adds open flags (O_DIRECT).
pub fn create_private(path: &Path, extra: i32) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | extra)
        .open(path)
        .map_err(|e| explain_link(path, e))
}

/// ELOOP from O_NOFOLLOW says little; name the cause.
fn explain_link(path: &Path, e: std::io::Error) -> std::io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        std::io::Error::new(
            e.kind(),
            format!(
                "{} is a symbolic link; refusing to follow it",
                path.display()
            ),
        )
    } else {
        e
    }
}

#[cfg(test)]
mod tests;
