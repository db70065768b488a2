//! What the daemon counts for `--metrics` and `status`.
//!
//! The I/O path only ever touches counters that belong to one session and
//! are written by that session's connection thread alone: a plain load and
//! store, no lock prefix, no allocation, no shared cache line. A logical unit
//! keeps the list of its sessions' counters and the totals of the sessions
//! that ended; a scrape sums both under the LU's lock, so every counter only
//! ever grows.
//!
//! Service time runs from the engine taking a SCSI command off the PDU the
//! driver handed it to the driver having posted (iSER) or written (TCP) the
//! response that carries the status. Both ends read [`clock`]: the TSC
//! through `quanta` where the CPU has an invariant TSC, else
//! `CLOCK_MONOTONIC`. The drivers' own `Instant`s are not used for this,
//! because the iSER driver reads its clock only every few polling rounds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};

use ramslog_common::scsi_wire::{sense_key, status, Sense};

/// The clock of service times (see the module docs).
pub fn clock() -> &'static quanta::Clock {
    static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}

/// A set of counter labels as an enum: variants numbered from 0 in order
/// (they index counter arrays), `COUNT`, `ALL` in that order, and
/// `label()`, the label value each one is exported as. Each variant and its
/// label are written once.
macro_rules! labels {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident => $label:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            pub const COUNT: usize = [$($label),+].len();
            pub const ALL: [$name; $name::COUNT] = [$($name::$variant),+];

            pub fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }
        }
    };
}

labels! {
    /// What a SCSI command does, for counting.
    pub enum CommandKind {
        Read => "read",
        /// WRITE, WRITE AND VERIFY, WRITE SAME, COMPARE AND WRITE.
        Write => "write",
        /// SYNCHRONIZE CACHE: what a ZFS log's flushes are.
        Flush => "flush",
        Other => "other",
    }
}

labels! {
    /// The status a failed command ended with.
    pub enum FailedStatus {
        CheckCondition => "check_condition",
        ReservationConflict => "reservation_conflict",
        Busy => "busy",
        TaskSetFull => "task_set_full",
        Other => "other",
    }
}

impl FailedStatus {
    fn of(st: u8) -> FailedStatus {
        match st {
            status::CHECK_CONDITION => FailedStatus::CheckCondition,
            status::RESERVATION_CONFLICT => FailedStatus::ReservationConflict,
            status::BUSY => FailedStatus::Busy,
            status::TASK_SET_FULL => FailedStatus::TaskSetFull,
            _ => FailedStatus::Other,
        }
    }
}

/// SPC-4's sense key names, as label values; "none" for a status without
/// sense data.
pub fn sense_key_label(key: u8) -> &'static str {
    match key {
        sense_key::NO_SENSE => "none",
        sense_key::RECOVERED_ERROR => "recovered_error",
        sense_key::NOT_READY => "not_ready",
        sense_key::MEDIUM_ERROR => "medium_error",
        sense_key::HARDWARE_ERROR => "hardware_error",
        sense_key::ILLEGAL_REQUEST => "illegal_request",
        sense_key::UNIT_ATTENTION => "unit_attention",
        sense_key::DATA_PROTECT => "data_protect",
        0x8 => "blank_check",
        0x9 => "vendor_specific",
        0xa => "copy_aborted",
        sense_key::ABORTED_COMMAND => "aborted_command",
        0xd => "volume_overflow",
        sense_key::MISCOMPARE => "miscompare",
        _ => "reserved",
    }
}

/// Upper bounds of the service-time buckets: 1 µs, 2 µs, 4 µs … 2^20 µs
/// (about 1 s), then +Inf. Powers of two make the bucket a leading-zero count.
pub const FINITE_BUCKETS: usize = 21;
const BUCKETS: usize = FINITE_BUCKETS + 1;

/// The upper bound of bucket `i`, in seconds.
pub fn bucket_bound_seconds(i: usize) -> f64 {
    (1u64 << i) as f64 * 1e-6
}

fn bucket_of(nanos: u64) -> usize {
    let micros = nanos.div_ceil(1000).max(1);
    ((u64::BITS - (micros - 1).leading_zeros()) as usize).min(FINITE_BUCKETS)
}

/// A counter with one writer (see the module docs); readers may see it lag.
#[derive(Debug, Default)]
struct Tally(AtomicU64);

impl Tally {
    #[inline]
    fn add(&self, n: u64) {
        let v = self.0.load(Ordering::Relaxed);
        self.0.store(v.wrapping_add(n), Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Default)]
struct ServiceTimes {
    buckets: [Tally; BUCKETS],
    sum_nanos: Tally,
}

/// One session's counters of one LU.
#[derive(Debug, Default)]
pub struct LunCounters {
    commands: [Tally; CommandKind::COUNT],
    bytes: [Tally; CommandKind::COUNT],
    /// By failed status, then sense key (0 when the status has no sense).
    errors: [[Tally; 16]; FailedStatus::COUNT],
    service: [ServiceTimes; CommandKind::COUNT],
}

impl LunCounters {
    /// A command ended with `st` (and `sense`); `bytes` moved if it succeeded.
    #[inline]
    pub fn completed(&self, kind: CommandKind, st: u8, sense: Option<&Sense>, bytes: u32) {
        self.commands[kind as usize].add(1);
        if st == status::GOOD {
            self.bytes[kind as usize].add(u64::from(bytes));
        } else {
            let key = sense.map_or(0, |s| s.key & 0x0f);
            self.errors[FailedStatus::of(st) as usize][key as usize].add(1);
        }
    }

    #[inline]
    pub fn served(&self, kind: CommandKind, nanos: u64) {
        let s = &self.service[kind as usize];
        s.buckets[bucket_of(nanos)].add(1);
        s.sum_nanos.add(nanos);
    }

    fn add_to(&self, t: &mut LunTotals) {
        for k in 0..4 {
            t.commands[k] += self.commands[k].get();
            t.bytes[k] += self.bytes[k].get();
            for b in 0..BUCKETS {
                t.service[k].buckets[b] += self.service[k].buckets[b].get();
            }
            t.service[k].sum_nanos += self.service[k].sum_nanos.get();
        }
        for (row, counts) in t.errors.iter_mut().zip(&self.errors) {
            for (total, c) in row.iter_mut().zip(counts) {
                *total += c.get();
            }
        }
    }
}

/// Service times of one command kind, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ServiceTotals {
    /// Per bucket, not cumulative; the last is +Inf.
    pub buckets: [u64; BUCKETS],
    pub sum_nanos: u64,
}

impl ServiceTotals {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The upper bound (in µs) of the bucket holding quantile `q`; `None`
    /// without samples, `f64::INFINITY` past the last finite bucket.
    pub fn quantile_bound_micros(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(if i < FINITE_BUCKETS {
                    bucket_bound_seconds(i) * 1e6
                } else {
                    f64::INFINITY
                });
            }
        }
        Some(f64::INFINITY)
    }
}

/// Everything counted for one LU, over all sessions past and present.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LunTotals {
    pub commands: [u64; CommandKind::COUNT],
    pub bytes: [u64; CommandKind::COUNT],
    pub errors: [[u64; 16]; FailedStatus::COUNT],
    pub service: [ServiceTotals; CommandKind::COUNT],
}

impl LunTotals {
    /// Non-zero error counts as (status, sense key, count).
    pub fn errors(&self) -> impl Iterator<Item = (FailedStatus, u8, u64)> + '_ {
        FailedStatus::ALL.into_iter().flat_map(move |st| {
            (0u8..16).filter_map(move |key| {
                let n = self.errors[st as usize][key as usize];
                (n > 0).then_some((st, key, n))
            })
        })
    }

    /// The facts `status --json` prints.
    pub fn report(&self) -> LunIo {
        let kinds = CommandKind::ALL
            .into_iter()
            .map(|k| {
                let s = &self.service[k as usize];
                KindIo {
                    kind: k.label().to_string(),
                    commands: self.commands[k as usize],
                    bytes: self.bytes[k as usize],
                    service_time_sum_seconds: s.sum_nanos as f64 * 1e-9,
                    service_time_p50_micros_at_most: s
                        .quantile_bound_micros(0.5)
                        .filter(|v| v.is_finite()),
                    service_time_p99_micros_at_most: s
                        .quantile_bound_micros(0.99)
                        .filter(|v| v.is_finite()),
                }
            })
            .collect();
        let errors = self
            .errors()
            .map(|(st, key, count)| ErrorCount {
                status: st.label().to_string(),
                sense_key: sense_key_label(key).to_string(),
                count,
            })
            .collect();
        LunIo { kinds, errors }
    }
}

/// A LU's I/O as `status` reports it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LunIo {
    pub kinds: Vec<KindIo>,
    pub errors: Vec<ErrorCount>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KindIo {
    pub kind: String,
    pub commands: u64,
    pub bytes: u64,
    pub service_time_sum_seconds: f64,
    /// The upper bound of the histogram bucket holding the median.
    pub service_time_p50_micros_at_most: Option<f64>,
    pub service_time_p99_micros_at_most: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorCount {
    pub status: String,
    pub sense_key: String,
    pub count: u64,
}

#[derive(Debug, Default)]
struct LunRegistry {
    live: Vec<Arc<LunCounters>>,
    ended: LunTotals,
}

/// A LU's view of its sessions' counters.
#[derive(Debug, Default)]
pub struct LunMetrics {
    registry: Mutex<LunRegistry>,
}

impl LunMetrics {
    fn lock(&self) -> MutexGuard<'_, LunRegistry> {
        self.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counters for a new session (at login, off the I/O path).
    pub fn join(&self) -> Arc<LunCounters> {
        let c = Arc::new(LunCounters::default());
        self.lock().live.push(c.clone());
        c
    }

    /// A session ended: its counts move to the totals.
    pub fn leave(&self, c: &Arc<LunCounters>) {
        let mut reg = self.lock();
        if let Some(i) = reg.live.iter().position(|l| Arc::ptr_eq(l, c)) {
            let gone = reg.live.swap_remove(i);
            gone.add_to(&mut reg.ended);
        }
    }

    pub fn totals(&self) -> LunTotals {
        let reg = self.lock();
        let mut t = reg.ended.clone();
        for c in &reg.live {
            c.add_to(&mut t);
        }
        t
    }
}

labels! {
    /// Why a login was refused, by its login status (RFC 7143 11.13.5).
    pub enum LoginRefusal {
        AuthenticationFailed => "authentication_failed",
        Forbidden => "forbidden",
        TargetNotFound => "target_not_found",
        InitiatorError => "initiator_error",
        MissingParameter => "missing_parameter",
        Unsupported => "unsupported",
        OutOfResources => "out_of_resources",
        Other => "other",
    }
}

impl LoginRefusal {
    pub fn of_status(login_status: u16) -> LoginRefusal {
        match login_status {
            0x0201 => LoginRefusal::AuthenticationFailed,
            0x0202 => LoginRefusal::Forbidden,
            0x0203 | 0x0204 => LoginRefusal::TargetNotFound,
            0x0207 => LoginRefusal::MissingParameter,
            0x0205 | 0x0208 | 0x0209 => LoginRefusal::Unsupported,
            0x0300..=0x03ff => LoginRefusal::OutOfResources,
            0x0200..=0x02ff => LoginRefusal::InitiatorError,
            _ => LoginRefusal::Other,
        }
    }
}

labels! {
    /// A configured limit that stopped something.
    pub enum LimitHit {
        /// `max_connections`: a connection was refused.
        Connections => "connections",
        /// Connections from one address.
        ConnectionsPerSource => "connections_per_source",
        /// Connections from one address still logging in.
        PendingLoginsPerSource => "pending_logins_per_source",
        /// Logged-in RDMA connections (each pins its queue pair's memory).
        /// The label predates a second RDMA front end and stays, so that
        /// dashboards and alert rules keep working.
        RdmaConnections => "iser_connections",
        /// Logged-in iSCSI connections (`max_iscsi_connections`).
        IscsiConnections => "iscsi_connections",
        /// The daemon-wide staging budget: a command got TASK SET FULL.
        StagingBudget => "staging_budget",
        /// A session's command window: a command got TASK SET FULL.
        CommandWindow => "command_window",
        /// A peer read nothing for the output stall limit: it was dropped.
        OutputStall => "output_stall",
        /// Connections still logging in, in total: the oldest was evicted.
        PendingLogins => "pending_logins",
        /// Discovery sessions in total: the oldest was evicted.
        DiscoverySessions => "discovery_sessions",
        /// Discovery sessions from one address: a login was refused.
        DiscoverySessionsPerSource => "discovery_sessions_per_source",
        /// A connection sent no PDU in time, or a discovery session outlived
        /// its lifetime: it was closed.
        IdleLogins => "idle_logins",
        /// RDMA connections still logging in, or closing, held every login
        /// slot for too long: a new one was refused (the label predates a
        /// second RDMA front end and stays).
        RdmaLoginSlots => "iser_login_slots",
    }
}

/// Portal-wide events; rare, so shared atomics.
#[derive(Debug, Default)]
pub struct PortalCounters {
    logins_refused: [AtomicU64; LoginRefusal::COUNT],
    limit_hits: [AtomicU64; LimitHit::COUNT],
}

impl PortalCounters {
    pub fn login_refused(&self, why: LoginRefusal) {
        self.logins_refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn limit_hit(&self, which: LimitHit) {
        self.limit_hits[which as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn logins_refused(&self, why: LoginRefusal) -> u64 {
        self.logins_refused[why as usize].load(Ordering::Relaxed)
    }

    pub fn limit_hits(&self, which: LimitHit) -> u64 {
        self.limit_hits[which as usize].load(Ordering::Relaxed)
    }
}

/// The process's memory as the kernel counts it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct ProcessMemory {
    /// mlock'ed (VmLck): the LUN memory.
    pub locked_bytes: u64,
    /// Pinned by RDMA registrations (VmPin): each LUN once per RDMA device
    /// and every iSER connection's buffers. The LUN's pages count in both.
    #[serde(default)]
    pub pinned_bytes: u64,
    pub resident_bytes: u64,
}

impl ProcessMemory {
    /// From `/proc/self/status` (VmLck, VmPin, VmRSS); zeros where unreadable.
    pub fn now() -> ProcessMemory {
        let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kib = |field: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
                .map_or(0, |n| n * 1024)
        };
        ProcessMemory {
            locked_bytes: kib("VmLck:"),
            pinned_bytes: kib("VmPin:"),
            resident_bytes: kib("VmRSS:"),
        }
    }
}

/// One session's counters, one entry per LU of its target; gives them back
/// to their LUs when the session ends.
#[derive(Debug, Default)]
pub struct SessionMetrics {
    luns: Vec<(Arc<LunMetrics>, Arc<LunCounters>)>,
}

impl SessionMetrics {
    /// Join the counters of each LU, in the target's order: slot `i` is
    /// the `i`th LU's.
    pub fn join(lus: impl Iterator<Item = Arc<LunMetrics>>) -> SessionMetrics {
        let luns = lus
            .map(|metrics| {
                let c = metrics.join();
                (metrics, c)
            })
            .collect();
        SessionMetrics { luns }
    }

    #[inline]
    pub fn slot(&self, slot: u16) -> Option<&LunCounters> {
        self.luns.get(slot as usize).map(|(_, c)| &**c)
    }
}

impl Drop for SessionMetrics {
    fn drop(&mut self) {
        for (lu, c) in &self.luns {
            lu.leave(c);
        }
    }
}

/// A response that ends a SCSI command: the driver reports when it went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub slot: u16,
    pub kind: CommandKind,
    /// [`clock`]'s raw reading when the command arrived.
    pub arrived: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_microseconds() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1000), 0);
        assert_eq!(bucket_of(1001), 1);
        assert_eq!(bucket_of(2000), 1);
        assert_eq!(bucket_of(2001), 2);
        assert_eq!(bucket_of(4000), 2);
        assert_eq!(bucket_of(1_048_576_000), 20);
        assert_eq!(bucket_of(1_048_576_001), FINITE_BUCKETS);
        assert_eq!(bucket_of(u64::MAX), FINITE_BUCKETS);
        assert_eq!(bucket_bound_seconds(0), 1e-6);
        assert_eq!(bucket_bound_seconds(3), 8e-6);
    }

    #[test]
    fn ended_sessions_keep_their_counts() {
        let lu = LunMetrics::default();
        let a = lu.join();
        let b = lu.join();
        a.completed(CommandKind::Write, status::GOOD, None, 4096);
        a.served(CommandKind::Write, 3_000);
        b.completed(CommandKind::Flush, status::GOOD, None, 0);
        let not_ready = Sense::new(sense_key::NOT_READY, 0x04, 0x03);
        b.completed(
            CommandKind::Write,
            status::CHECK_CONDITION,
            Some(&not_ready),
            4096,
        );
        lu.leave(&a);
        let t = lu.totals();
        assert_eq!(t.commands, [0, 2, 1, 0]);
        assert_eq!(t.bytes[CommandKind::Write as usize], 4096);
        assert_eq!(t.service[CommandKind::Write as usize].count(), 1);
        assert_eq!(t.service[CommandKind::Write as usize].buckets[2], 1);
        let errors: Vec<_> = t.errors().collect();
        assert_eq!(errors, vec![(FailedStatus::CheckCondition, 2, 1)]);
        lu.leave(&b);
        lu.leave(&b);
        assert_eq!(lu.totals(), t);
    }

    #[test]
    fn quantiles_name_the_bucket_bound() {
        let mut s = ServiceTotals::default();
        assert_eq!(s.quantile_bound_micros(0.5), None);
        s.buckets[2] = 98;
        s.buckets[10] = 2;
        assert_eq!(s.quantile_bound_micros(0.5), Some(4.0));
        assert_eq!(s.quantile_bound_micros(0.99), Some(1024.0));
        s.buckets[FINITE_BUCKETS] = 100;
        assert_eq!(s.quantile_bound_micros(0.99), Some(f64::INFINITY));
    }

    #[test]
    fn login_statuses_map_to_bounded_reasons() {
        for (status, reason) in [
            (0x0201, LoginRefusal::AuthenticationFailed),
            (0x0203, LoginRefusal::TargetNotFound),
            (0x0209, LoginRefusal::Unsupported),
            (0x0206, LoginRefusal::InitiatorError),
            (0x020b, LoginRefusal::InitiatorError),
            (0x0301, LoginRefusal::OutOfResources),
            (0x0101, LoginRefusal::Other),
        ] {
            assert_eq!(LoginRefusal::of_status(status), reason, "{status:#06x}");
        }
    }
}
