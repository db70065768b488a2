//! Configuration: command-line flags and an optional TOML file, validated into
//! one `Config`. Flags override the file's global settings; targets come from
//! the file, or from `--target-name`/`--size` when the file has none.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ramslog_common::lun::Lun;
use thiserror::Error;

use crate::core::CoreLimits;
use crate::iscsi::portal::{AclEntry, ChapSecret, Limits};
use crate::store::HugePages;

mod args;
mod file;
pub use args::RunArgs;
pub use file::{check_file, Problem};
use file::{FileChap, FileConfig};

pub const DEFAULT_IQN_PREFIX: &str = "iqn.2026-11.org.ramslog";
pub const DEFAULT_CONFIG: &str = "/etc/ramslog/ramslog.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/ramslog";

/// The control socket of a daemon without a state directory (`--ephemeral`):
/// `/run/ramslog/control.sock` for root, else under `$XDG_RUNTIME_DIR` (the
/// user's own directory, made by systemd-logind), so `status` finds it
/// without flags. None for a non-root user without one: any directory
/// another user could create first (`/tmp/ramslog-<uid>`) would let that
/// user answer in the daemon's place.
pub fn runtime_control_socket() -> Option<PathBuf> {
    let dir = if rustix::process::geteuid().is_root() {
        PathBuf::from("/run/ramslog")
    } else {
        PathBuf::from(std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty())?)
            .join("ramslog")
    };
    Some(dir.join("control.sock"))
}

/// Where `status`, `stop` and `accept-empty` look when given no path: a
/// daemon with the default state directory, and one started `--ephemeral`
/// where this user has a runtime directory.
pub fn default_control_sockets() -> Vec<PathBuf> {
    std::iter::once(Path::new(DEFAULT_STATE_DIR).join("control.sock"))
        .chain(runtime_control_socket())
        .collect()
}

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The first TOML error, or every semantic one, each with its position.
    #[error("{}", Problem::list(path, problems))]
    File {
        path: PathBuf,
        problems: Vec<Problem>,
    },
    #[error("{0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
}

/// Parse a size such as `4G`, `256M`, `512K` or a byte count (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (s, 1u64),
        Some((i, _)) => {
            let unit = s[i..].trim_end_matches(['B', 'b', 'i']);
            let m = match unit.to_ascii_uppercase().as_str() {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => {
                    return Err(format!(
                        "'{s}' is not a size: use a number with K, M, G or T, e.g. 4G"
                    ))
                }
            };
            (&s[..i], m)
        }
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size: use e.g. 4G or 268435456"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// `on` or `off`.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: use on or off")),
    }
}

/// `--metrics-allow`: a network or one address.
pub fn parse_metrics_network(s: &str) -> Result<ipnet::IpNet, String> {
    crate::admission::parse_network(s).ok_or_else(|| {
        format!("{s:?} is not a network (e.g. 192.0.2.0/24, 2001:db8::/64 or 192.0.2.7)")
    })
}

/// `--metrics`: `PORT` (loopback) or `ADDR:PORT`.
pub fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse::<SocketAddr>().map_err(|_| {
        format!("{s:?} is neither a port nor ADDR:PORT (e.g. 9105 or 127.0.0.1:9105, [::1]:9105)")
    })
}

#[derive(Debug, Clone)]
pub struct LunConfig {
    pub lun: u64,
    pub size: u64,
    pub block_size: u32,
}

#[derive(Debug, Clone)]
pub struct TargetConfig {
    pub name: String,
    pub alias: Option<String>,
    /// Empty with `open_access`: anyone may log in.
    pub allow: Vec<AclEntry>,
    pub open_access: bool,
    pub chap: Option<ChapSecret>,
    pub mutual_chap: Option<ChapSecret>,
    pub luns: Vec<LunConfig>,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Vec<SocketAddr>,
    pub state_dir: Option<PathBuf>,
    pub control_socket: PathBuf,
    /// Set exactly when `state_dir` is.
    pub image_dir: Option<PathBuf>,
    pub hugepages: HugePages,
    pub allow_any: bool,
    /// iSCSI's negotiation values, window and timers.
    pub limits: Limits,
    /// What every front end obeys: staging, stall, drain, connection caps.
    pub core_limits: CoreLimits,
    pub discovery_chap: Option<ChapSecret>,
    pub targets: Vec<TargetConfig>,
    /// Serve iSER on the portal addresses that belong to an RDMA device.
    pub iser: bool,
    pub iser_spin: u32,
    /// Hold LUN memory in systemd's fd store (`--kept-memory`).
    pub kept_memory: bool,
    /// Keep page checksums of LUN memory (`--verify-kept-memory`).
    pub verify_kept_memory: bool,
    /// Where the Prometheus endpoint listens; off when `None`.
    pub metrics: Option<SocketAddr>,
    /// The networks the endpoint answers; every source when empty.
    pub metrics_allow: Vec<ipnet::IpNet>,
}

impl Config {
    /// What the admin should hear at every start: settings that work but
    /// expose the LUNs more than they may think.
    pub fn warnings(&self) -> Vec<String> {
        let exposed = !self.listen.iter().all(|a| a.ip().is_loopback());
        let mut out = Vec::new();
        for t in &self.targets {
            if !exposed || t.chap.is_some() {
                continue;
            }
            if t.open_access {
                out.push(format!(
                    "target {}: --allow-any: any initiator that reaches this portal may write to the LUN",
                    t.name
                ));
            } else {
                out.push(format!(
                    "target {}: its ACL admits initiators by the name they claim, and without CHAP any host that reaches this portal can claim an allowed name; set chap_user and chap_secret_file (--chap-user, --chap-secret-file)",
                    t.name
                ));
            }
        }
        out
    }
}

/// Default empty polls before an iSER connection thread sleeps: about 20 µs
/// of spinning on a current CPU, enough to catch the next command of a
/// synchronous writer without a wake-up.
pub const DEFAULT_ISER_SPIN: u32 = 2000;

fn parse_acl(entries: &[String]) -> Result<Vec<AclEntry>, ConfigError> {
    entries
        .iter()
        .map(|e| e.parse::<AclEntry>().map_err(invalid))
        .collect()
}

/// RFC 7143 9.2.1: a CHAP secret has at least 96 bits.
const MIN_CHAP_SECRET_BYTES: usize = 12;

fn read_secret(path: &PathBuf) -> Result<String, ConfigError> {
    use std::os::unix::fs::PermissionsExt;
    let read_error = |source| ConfigError::Read {
        path: path.clone(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_error)?;
    let mode = file.metadata().map_err(read_error)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(invalid(format!(
            "CHAP secret file {} is readable or writable by group or others (mode {mode:o}); \
             make it the daemon's user's alone: chmod 600 {}",
            path.display(),
            path.display()
        )));
    }
    let mut s = String::new();
    std::io::Read::read_to_string(&mut file, &mut s).map_err(read_error)?;
    let s = s.trim_end_matches(['\n', '\r']).to_string();
    if s.len() < MIN_CHAP_SECRET_BYTES {
        return Err(invalid(format!(
            "CHAP secret in {} is {} bytes; RFC 7143 requires at least 96 bits ({MIN_CHAP_SECRET_BYTES} bytes): \
             write a longer random secret there (e.g. head -c 16 /dev/urandom | base64)",
            path.display(),
            s.len()
        )));
    }
    Ok(s)
}

fn chap(c: Option<FileChap>) -> Result<Option<ChapSecret>, ConfigError> {
    let Some(c) = c else { return Ok(None) };
    let secret = match (c.secret, c.secret_file) {
        (Some(s), None) => s,
        (None, Some(f)) => read_secret(&f)?,
        _ => {
            return Err(invalid(format!(
                "CHAP for user {}: give exactly one of secret or secret_file",
                c.user
            )))
        }
    };
    if secret.len() < MIN_CHAP_SECRET_BYTES {
        return Err(invalid(format!(
            "CHAP secret for user {} is {} bytes; RFC 7143 requires at least 96 bits ({MIN_CHAP_SECRET_BYTES} bytes)",
            c.user.escape_debug(),
            secret.len()
        )));
    }
    Ok(Some(ChapSecret {
        user: c.user,
        secret,
    }))
}

fn default_target_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_ascii_lowercase())
        .unwrap_or_default();
    let host: String = host
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
        .collect();
    format!(
        "{DEFAULT_IQN_PREFIX}:{}",
        if host.is_empty() { "ramslog" } else { &host }
    )
}

fn valid_iqn(name: &str) -> bool {
    (name.starts_with("iqn.") || name.starts_with("eui.") || name.starts_with("naa."))
        && name.len() <= 223
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':'))
}

impl Config {
    pub fn load(args: &RunArgs) -> Result<Config, ConfigError> {
        let file_path = args.config.clone().or_else(|| {
            std::path::Path::new(DEFAULT_CONFIG)
                .exists()
                .then(|| DEFAULT_CONFIG.into())
        });
        let file: FileConfig = match &file_path {
            Some(p) => {
                let (text, file) = file::parse(p)?;
                let listen = if args.listen.is_empty() {
                    &file.listen
                } else {
                    &args.listen
                };
                let exposure = file::Exposure::of(listen, args.allow_any || file.allow_any);
                file::checked(p, &text, &file, exposure)?;
                file
            }
            None => FileConfig::default(),
        };

        let listen = if !args.listen.is_empty() {
            args.listen.clone()
        } else if !file.listen.is_empty() {
            file.listen
        } else {
            vec![SocketAddr::from(([127, 0, 0, 1], 3260))]
        };
        let hugepages = match (&args.hugepages, &file.hugepages) {
            (Some(h), _) => *h,
            (None, Some(s)) => s
                .get_ref()
                .parse()
                .map_err(|e| invalid(format!("hugepages: {e}")))?,
            (None, None) => HugePages::Auto,
        };
        let state_dir = if args.ephemeral {
            None
        } else {
            Some(
                args.state_dir
                    .clone()
                    .or(file.state_dir)
                    .unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            )
        };
        let control_socket = args
            .control_socket
            .clone()
            .or(file.control_socket)
            .map_or_else(
                || match &state_dir {
                    Some(d) => Ok(d.join("control.sock")),
                    None => runtime_control_socket().ok_or_else(|| {
                        invalid(
                            "without a state directory a non-root daemon keeps its control socket under \
                             $XDG_RUNTIME_DIR, which is not set here: give --control-socket PATH in a \
                             directory only you can write (or log in through a session that sets \
                             XDG_RUNTIME_DIR)",
                        )
                    }),
                },
                Ok,
            )?;
        let image_dir = state_dir.as_ref().map(|d| {
            args.image_dir
                .clone()
                .or(file.image_dir)
                .unwrap_or_else(|| d.join("images"))
        });
        let mut limits = Limits::default();
        let mut core_limits = CoreLimits::default();
        // The file's values passed `file::checked`; the same rules apply to flags.
        let setting =
            |key: &str, flag: Option<u64>, file: Option<u64>| -> Result<Option<u64>, ConfigError> {
                match flag.or(file) {
                    None => Ok(None),
                    Some(v) => check_setting(key, v).map(|()| Some(v)).map_err(invalid),
                }
            };
        // A numeric setting: the flag, else the file's key of the same name,
        // checked against its bounds.
        macro_rules! number {
            ($key:ident) => {
                setting(
                    stringify!($key),
                    args.$key.map(u64::from),
                    file.$key.as_ref().map(|v| u64::from(*v.get_ref())),
                )?
            };
        }
        if let Some(w) = number!(cmd_window) {
            // check_setting bounds it to 4096.
            limits.cmd_window = w as u32;
        }
        let seconds = [
            (number!(nop_interval), &mut limits.nop_interval),
            (number!(nop_timeout), &mut limits.nop_timeout),
            (number!(login_timeout), &mut limits.login_timeout),
            (
                number!(output_stall_timeout),
                &mut core_limits.output_stall_timeout,
            ),
            (number!(first_pdu_timeout), &mut limits.first_pdu_timeout),
            (number!(discovery_lifetime), &mut limits.discovery_lifetime),
        ];
        for (value, limit) in seconds {
            if let Some(n) = value {
                *limit = Duration::from_secs(n);
            }
        }
        if let Some(ms) = number!(restart_drain_ms) {
            core_limits.restart_drain = Duration::from_millis(ms);
        }
        let c = &mut core_limits.connections;
        let counts = [
            (number!(max_connections), &mut c.total),
            (number!(max_connections_per_host), &mut c.per_source),
            (number!(max_logins_per_host), &mut c.pending_per_source),
            (number!(max_pending_logins), &mut c.pending),
            (number!(max_pending_rdma_logins), &mut c.pending_rdma),
            (number!(max_discovery_sessions), &mut c.discovery),
            (
                number!(max_discovery_sessions_per_host),
                &mut c.discovery_per_source,
            ),
            (number!(max_rdma_connections), &mut c.rdma),
            (number!(max_iscsi_connections), &mut c.iscsi),
        ];
        for (value, limit) in counts {
            if let Some(n) = value {
                // check_setting bounds every count to u32.
                *limit = n as u32;
            }
        }
        let staging = match (args.staging_budget, &file.staging_budget) {
            (Some(b), _) => Some(b),
            (None, Some(text)) => Some(parse_size(text.get_ref()).map_err(invalid)?),
            (None, None) => None,
        };
        if let Some(b) = setting("staging_budget", staging, None)? {
            core_limits.staging_budget = b;
        }

        let iser = !args.no_iser && file.iser.unwrap_or(true);
        let kept_memory = args.kept_memory.or(file.kept_memory).unwrap_or(true);
        let verify_kept_memory = args
            .verify_kept_memory
            .or(file.verify_kept_memory)
            .unwrap_or(false);
        let iser_spin = args
            .iser_spin
            .or(file.iser_spin)
            .unwrap_or(DEFAULT_ISER_SPIN);

        let metrics = match (args.metrics, &file.metrics) {
            (Some(a), _) => Some(a),
            (None, Some(m)) => Some(parse_metrics_addr(m.get_ref()).map_err(invalid)?),
            (None, None) => None,
        };
        let metrics_allow = if !args.metrics_allow.is_empty() {
            args.metrics_allow.clone()
        } else {
            file.metrics_allow
                .iter()
                .flat_map(|l| l.get_ref().iter())
                .map(|n| {
                    parse_metrics_network(n).map_err(|e| invalid(format!("metrics_allow: {e}")))
                })
                .collect::<Result<_, _>>()?
        };
        if metrics.is_none() && !metrics_allow.is_empty() {
            return Err(invalid(
                "--metrics-allow (metrics_allow) limits the metrics endpoint, which is off: add --metrics [ADDR:]PORT".to_string(),
            ));
        }

        let cli_target_flags =
            args.size.is_some() || args.target_name.is_some() || args.block_size.is_some();
        let mut targets = Vec::new();
        if !file.target.is_empty() {
            if cli_target_flags {
                return Err(invalid(
                    "the config file defines targets; --size, --target-name and --block-size only apply without them",
                ));
            }
            for t in file.target {
                let t = t.into_inner();
                let luns = t
                    .lun
                    .into_iter()
                    .map(|l| {
                        let l = l.into_inner();
                        let size = parse_size(l.size.get_ref()).map_err(invalid)?;
                        Ok(LunConfig {
                            lun: l.number(),
                            size,
                            block_size: l.block_size(),
                        })
                    })
                    .collect::<Result<Vec<_>, ConfigError>>()?;
                let allow: Vec<String> = t.allow.into_iter().map(|a| a.into_inner()).collect();
                targets.push(TargetConfig {
                    name: t.name.into_inner(),
                    alias: t.alias,
                    open_access: false,
                    allow: parse_acl(&allow)?,
                    chap: chap(t.chap.map(|c| c.into_inner()))?,
                    mutual_chap: chap(t.mutual_chap.map(|c| c.into_inner()))?,
                    luns,
                });
            }
        } else {
            let size = args.size.ok_or_else(|| {
                invalid("no LUN configured: give --size (e.g. --size 4G) or a config file with [[target]] entries")
            })?;
            let block_size = args
                .block_size
                .as_deref()
                .unwrap_or("512")
                .parse()
                .unwrap_or(512);
            let chap = match (&args.chap_user, &args.chap_secret_file) {
                (Some(u), Some(f)) => Some(ChapSecret {
                    user: u.clone(),
                    secret: read_secret(f)?,
                }),
                _ => None,
            };
            let mutual_chap = match (&args.mutual_chap_user, &args.mutual_chap_secret_file) {
                (Some(u), Some(f)) => Some(ChapSecret {
                    user: u.clone(),
                    secret: read_secret(f)?,
                }),
                _ => None,
            };
            targets.push(TargetConfig {
                name: args.target_name.clone().unwrap_or_else(default_target_name),
                alias: None,
                allow: parse_acl(&args.allow)?,
                open_access: false,
                chap,
                mutual_chap,
                luns: vec![LunConfig {
                    lun: 0,
                    size,
                    block_size,
                }],
            });
        }
        let mut cfg = Config {
            listen,
            state_dir,
            control_socket,
            image_dir,
            hugepages,
            allow_any: args.allow_any || file.allow_any,
            limits,
            core_limits,
            discovery_chap: chap(file.discovery_chap.map(|c| c.into_inner()))?,
            targets,
            iser,
            iser_spin,
            kept_memory,
            verify_kept_memory,
            metrics,
            metrics_allow,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        let all_loopback = self.listen.iter().all(|a| a.ip().is_loopback());
        let mut names = std::collections::HashSet::new();
        for t in &mut self.targets {
            check_target_name(&t.name).map_err(invalid)?;
            if !names.insert(t.name.to_ascii_lowercase()) {
                return Err(invalid(format!("target {} is defined twice", t.name)));
            }
            if t.luns.is_empty() {
                return Err(invalid(format!("target {} has no LUN", t.name)));
            }
            let mut luns = std::collections::HashSet::new();
            for l in &t.luns {
                let lun = |e: String| invalid(format!("target {} LUN {}: {e}", t.name, l.lun));
                check_lun_number(l.lun).map_err(lun)?;
                if !luns.insert(l.lun) {
                    return Err(lun("defined twice".into()));
                }
                check_block_size(l.block_size).map_err(lun)?;
                check_lun_size(l.size).map_err(lun)?;
            }
            t.open_access = open_access(
                &t.name,
                t.allow.is_empty(),
                all_loopback,
                self.allow_any,
                t.chap.is_some(),
            )
            .map_err(invalid)?;
        }
        Ok(())
    }
}

/// The allowed values of each numeric setting, for the flag and the file key alike.
fn check_setting(key: &str, value: u64) -> Result<(), String> {
    let (min, max, unit) = match key {
        "cmd_window" => (1, 4096, ""),
        "nop_interval" => (1, 86_400, " seconds"),
        "nop_timeout" | "login_timeout" | "first_pdu_timeout" | "output_stall_timeout" => {
            (1, 3600, " seconds")
        }
        "discovery_lifetime" => (1, 86_400, " seconds"),
        "restart_drain_ms" => (1, 10_000, " milliseconds"),
        "staging_budget" => (1 << 20, u64::MAX, " bytes (1M)"),
        _ => (1, u64::from(u32::MAX), ""),
    };
    if (min..=max).contains(&value) {
        Ok(())
    } else if max == u64::MAX || max == u64::from(u32::MAX) {
        Err(format!("{key} must be at least {min}{unit}"))
    } else {
        Err(format!("{key} must be between {min} and {max}{unit}"))
    }
}

fn check_target_name(name: &str) -> Result<(), String> {
    if valid_iqn(name) {
        Ok(())
    } else {
        Err(format!(
            "target name '{}' is not a valid iSCSI name (e.g. {DEFAULT_IQN_PREFIX}:slog1)",
            name.escape_debug()
        ))
    }
}

/// LUNs are addressed flat (SAM-5 single-level); 14 bits.
fn check_lun_number(lun: u64) -> Result<(), String> {
    match Lun::new(lun) {
        Some(_) => Ok(()),
        None => Err(format!("LUN {lun} is above {}", Lun::MAX)),
    }
}

fn check_block_size(block_size: u32) -> Result<(), String> {
    if block_size == 512 || block_size == 4096 {
        Ok(())
    } else {
        Err(format!("block size {block_size}: it must be 512 or 4096"))
    }
}

fn check_lun_size(size: u64) -> Result<(), String> {
    if size != 0 && size.is_multiple_of(4096) {
        Ok(())
    } else {
        Err(format!(
            "size {size}: it must be a non-zero multiple of 4 KiB"
        ))
    }
}

/// Whether a target without an ACL may be served to any initiator, or the
/// error that explains why not: a second host writing to a SLOG destroys the pool.
fn open_access(
    name: &str,
    no_acl: bool,
    all_loopback: bool,
    allow_any: bool,
    has_chap: bool,
) -> Result<bool, String> {
    if !no_acl {
        return Ok(false);
    }
    if all_loopback || allow_any || has_chap {
        return Ok(true);
    }
    Err(format!(
        "target {name} listens on a non-loopback address with no initiator ACL and no CHAP: \
         a second host writing to a SLOG destroys the pool. Add --allow IQN (or allow = [..] \
         in the config), configure CHAP, or pass --allow-any to accept any initiator"
    ))
}

#[cfg(test)]
mod tests;
