//! The daemon's flags (`ramslog-target [OPTIONS]`), as clap parses them.
//! `Config::load` merges them with the configuration file's keys.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

use crate::store::HugePages;

use super::{parse_metrics_addr, parse_metrics_network, parse_on_off, parse_size};

/// Flags of the daemon (`ramslog-target [OPTIONS]`).
#[derive(Debug, Args, Default, Clone)]
pub struct RunArgs {
    /// TOML file describing targets and LUNs (default: /etc/ramslog/ramslog.toml if it exists).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// LUN size for the command-line target, e.g. 4G or 256M.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Logical block size of the command-line target's LUN.
    #[arg(long, value_parser = ["512", "4096"])]
    pub block_size: Option<String>,
    /// IQN of the command-line target (default: `iqn.2026-11.org.ramslog:<hostname>`).
    #[arg(long)]
    pub target_name: Option<String>,
    /// Back LUN memory with 2 MiB huge pages: auto, require, off.
    #[arg(long)]
    pub hugepages: Option<HugePages>,
    /// Portal address (repeatable). Default 127.0.0.1:3260.
    #[arg(long = "listen", value_name = "ADDR:PORT")]
    pub listen: Vec<SocketAddr>,
    /// Initiator IQN allowed to log in to the command-line target
    /// (repeatable); `IQN@192.0.2.0/24` also binds it to a source network.
    #[arg(long = "allow", value_name = "IQN[@NETWORK]")]
    pub allow: Vec<String>,
    /// Let any initiator log in even on non-loopback addresses (unsafe for a SLOG).
    #[arg(long)]
    pub allow_any: bool,
    /// CHAP user name the initiator must present (one-way CHAP).
    #[arg(long, requires = "chap_secret_file")]
    pub chap_user: Option<String>,
    /// File holding the CHAP secret (kept off the command line and out of `ps`).
    #[arg(long, requires = "chap_user")]
    pub chap_secret_file: Option<PathBuf>,
    /// CHAP user name the target answers with (mutual CHAP).
    #[arg(long, requires = "mutual_chap_secret_file")]
    pub mutual_chap_user: Option<String>,
    /// File holding the mutual CHAP secret.
    #[arg(long, requires = "mutual_chap_user")]
    pub mutual_chap_secret_file: Option<PathBuf>,
    /// Directory that remembers LUN identities across restarts.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Run without a state directory: every start is a first start (unsafe as a ZFS log).
    #[arg(long, conflicts_with = "state_dir")]
    pub ephemeral: bool,
    /// Control socket for `status`, `stop`, `restart` and `accept-empty` (default:
    /// `<state-dir>/control.sock`; with --ephemeral /run/ramslog/control.sock for root).
    #[arg(long)]
    pub control_socket: Option<PathBuf>,
    /// Load the configuration these flags give, print what a restart must
    /// compare (as JSON) and exit: `restart` runs the new binary so before
    /// it fences anything.
    #[arg(long, hide = true)]
    pub handover_check: bool,
    /// Where LUN images go at a clean stop (default: `<state-dir>/images`; mode 0700).
    #[arg(long, conflicts_with = "ephemeral")]
    pub image_dir: Option<PathBuf>,
    /// Commands an initiator may have outstanding per session.
    #[arg(long)]
    pub cmd_window: Option<u32>,
    /// Seconds of idleness before the target pings the initiator (NOP-In).
    #[arg(long)]
    pub nop_interval: Option<u64>,
    /// Seconds a NOP-In ping may go unanswered before the connection is dropped.
    #[arg(long, value_name = "SECS")]
    pub nop_timeout: Option<u64>,
    /// Seconds a login may take before the connection is closed.
    #[arg(long, value_name = "SECS")]
    pub login_timeout: Option<u64>,
    /// Seconds a TCP connection's output may make no progress (the initiator
    /// reads nothing) before the connection is dropped (default 30).
    #[arg(long, value_name = "SECS")]
    pub output_stall_timeout: Option<u64>,
    /// Seconds a new connection may take to send its first PDU (default 5).
    #[arg(long, value_name = "SECS")]
    pub first_pdu_timeout: Option<u64>,
    /// Milliseconds a planned restart waits for connections to send the
    /// hosts' notice and close before the exec (default 100); those left
    /// are closed by the exec, without the notice.
    #[arg(long, value_name = "MS")]
    pub restart_drain_ms: Option<u64>,
    /// Seconds after its last SendTargets a discovery session is asked to
    /// log out, and then closed (default 30).
    #[arg(long, value_name = "SECS")]
    pub discovery_lifetime: Option<u64>,
    /// Logged-in connections (past ACL and CHAP) in total, both transports
    /// (default 256). Connections still logging in and discovery sessions
    /// have pools of their own and never count against it.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<u32>,
    /// Logged-in connections from one source host (default 16).
    #[arg(long, value_name = "N")]
    pub max_connections_per_host: Option<u32>,
    /// Connections from one source host still logging in (default 4).
    #[arg(long, value_name = "N")]
    pub max_logins_per_host: Option<u32>,
    /// TCP connections still logging in, in total (default 64); beyond it
    /// the oldest is closed to make room.
    #[arg(long, value_name = "N")]
    pub max_pending_logins: Option<u32>,
    /// RDMA (iSER) connections still logging in, in total (default 8);
    /// beyond it the oldest is closed to make room. Also accepted as
    /// `--max-pending-iser-logins`.
    #[arg(long, value_name = "N", visible_alias = "max-pending-iser-logins")]
    pub max_pending_rdma_logins: Option<u32>,
    /// Discovery sessions in total (default 16); beyond it the oldest is closed.
    #[arg(long, value_name = "N")]
    pub max_discovery_sessions: Option<u32>,
    /// Discovery sessions from one source host (default 2).
    #[arg(long, value_name = "N")]
    pub max_discovery_sessions_per_host: Option<u32>,
    /// Logged-in RDMA (iSER) connections, each pinning registered buffers
    /// (default 32). Also accepted as `--max-iser-connections`.
    #[arg(long, value_name = "N", visible_alias = "max-iser-connections")]
    pub max_rdma_connections: Option<u32>,
    /// Logged-in iSCSI connections, iSCSI/TCP and iSER together (default
    /// 256); a cap of its own beside `--max-connections` so that a second
    /// front end can keep places for itself.
    #[arg(long, value_name = "N")]
    pub max_iscsi_connections: Option<u32>,
    /// Memory for parameter data all sessions may hold at once (default 128M).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub staging_budget: Option<u64>,
    /// Serve iSCSI/TCP only: no iSER listener even where an RDMA device exists.
    #[arg(long)]
    pub no_iser: bool,
    /// iSER: empty completion-queue polls before a connection's thread sleeps
    /// on the completion channel (0 = sleep at once; use 0 on SoftRoCE or
    /// shared CPUs, where spinning starves the peer).
    #[arg(long, value_name = "POLLS")]
    pub iser_spin: Option<u32>,
    /// Keep each LUN's memory in systemd's fd store, so that a crash or a
    /// restart under systemd keeps the content (on, the default). Off: a
    /// crash loses what no image has, a restart dumps first, and memory the
    /// store kept from an earlier run is released at start.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub kept_memory: Option<bool>,
    /// Keep a checksum of every 4 KiB page of LUN memory, updated by each
    /// write before its status (off, the default). After the daemon died
    /// of a fault (panic, SIGSEGV), kept memory is served only if every
    /// page still matches; without it such memory is never served. Costs a
    /// CRC32C of each written page per command and 8 bytes per page.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub verify_kept_memory: Option<bool>,
    /// Serve Prometheus metrics over HTTP at /metrics. A bare port binds
    /// 127.0.0.1; give an address to expose them beyond this host.
    #[arg(long, value_name = "[ADDR:]PORT", value_parser = parse_metrics_addr)]
    pub metrics: Option<SocketAddr>,
    /// Answer metrics requests only from this network (`192.0.2.0/24`,
    /// `2001:db8::/64` or one address); repeatable. Others are closed at once.
    #[arg(long, value_name = "NETWORK", value_parser = parse_metrics_network)]
    pub metrics_allow: Vec<ipnet::IpNet>,
}
