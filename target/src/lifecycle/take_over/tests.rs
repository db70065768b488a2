//! Every branch of the take-over rules, one row each: a change to facts
//! under which the memory is served, and what the reader must then decide.

use super::*;
use crate::volume::kept::{KeptReservations, Written, FORMAT};

const BOOT: &str = "c0ffee00-1111-2222-3333-444455556666";
const OTHER_BOOT: &str = "deadbeef-1111-2222-3333-444455556666";
const WRITER: Owner = Owner {
    pid: 4242,
    start_time: 123_456,
    incarnation: 0x5eed,
};
const ME: Owner = Owner {
    pid: 5151,
    start_time: 200_000,
    incarnation: 0xbeef,
};
const INODE: u64 = 1042;
const TOKEN: u64 = 0x7007;

/// A record its writer left valid, of generation 7, in this boot.
fn record() -> KeptRecord {
    KeptRecord {
        format: FORMAT,
        naa: "3a1b2c3d4e5f6071".into(),
        serial: "0b5e3c8e".into(),
        target: "iqn.2026-11.org.ramslog:slog-a".into(),
        lun: 0,
        lun_bytes: 16 << 30,
        memfd_bytes: 16 << 30,
        memfd_inode: INODE,
        block_size: 512,
        generation: 7,
        pending_generation: None,
        state: KeptState::Valid,
        boot_id: BOOT.into(),
        owner: WRITER,
        written: Written::All,
        reservations: KeptReservations::default(),
        inquiry: None,
        page_crcs: true,
    }
}

/// What the state directory says: this identity at generation 7, its image
/// written by a clean stop.
fn known() -> Known {
    Known {
        identity: Identity {
            naa: [0x3a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71],
            serial: "0b5e3c8e".into(),
        },
        generation: 7,
        clean: true,
    }
}

/// Facts under which a holder's memory is served.
struct Case {
    record: KeptRecord,
    restart: Option<u64>,
    writer: Result<(), String>,
    fault: Option<ExitCause>,
    boot_id: &'static str,
    me: Owner,
    owner_running: bool,
    state: Option<Known>,
    shape: (u64, u32),
    verify: bool,
    memory_inode: u64,
}

impl Case {
    fn holder() -> Case {
        Case {
            record: record(),
            restart: None,
            writer: Ok(()),
            fault: None,
            boot_id: BOOT,
            me: ME,
            owner_running: false,
            state: Some(known()),
            shape: (16 << 30, 512),
            verify: true,
            memory_inode: INODE,
        }
    }

    /// A planned restart of this process (the record's writer is it).
    fn restart() -> Case {
        let mut c = Case::holder();
        c.restart = Some(TOKEN);
        c.record.owner = ME;
        c.record.state = KeptState::HandedOver {
            token: TOKEN,
            ready: true,
        };
        c
    }

    fn decide(&self) -> Result<Allowed, Unkept> {
        decide(&Facts {
            came: match self.restart {
                Some(token) => Came::Restart { token },
                None => Came::Holder {
                    writer: &self.writer,
                },
            },
            record: &self.record,
            fault: self.fault,
            boot_id: self.boot_id,
            me: self.me,
            owner_running: self.owner_running,
            state: self.state.clone(),
            shape: self.shape,
            verify: self.verify,
            memory_inode: self.memory_inode,
        })
    }
}

/// What a row must decide: served (generation, every page checked), or
/// which refusal, with words its reason must hold.
#[derive(Debug)]
enum Want {
    Serve(u64, bool),
    Image(&'static str),
    NotReady(&'static str),
    Lost(&'static str),
}

fn row(name: &str, case: Case, want: Want) {
    let got = case.decide();
    let ok = match (&want, &got) {
        (Want::Serve(g, check), Ok(a)) => a.generation == *g && a.check_every_page == *check,
        (Want::Image(w), Err(Unkept::Image(r)))
        | (Want::NotReady(w), Err(Unkept::NotReady(r)))
        | (Want::Lost(w), Err(Unkept::Lost(r))) => r.contains(w),
        _ => false,
    };
    assert!(ok, "{name}: wanted {want:?}, the rules decided {got:?}");
}

fn with(mut case: Case, change: impl FnOnce(&mut Case)) -> Case {
    change(&mut case);
    case
}

#[test]
fn every_take_over_rule_decides_as_the_table_says() {
    use Want::*;
    let fault = Some(ExitCause::Signal(11));
    let rows: Vec<(&str, Case, Want)> = vec![
        // Where it came from, and what the record says it is.
        ("a holder's valid memory", Case::holder(), Serve(7, false)),
        (
            "a holder's memory handed over while ready",
            with(Case::holder(), |c| {
                c.record.state = KeptState::HandedOver {
                    token: 1,
                    ready: true,
                }
            }),
            Serve(7, false),
        ),
        (
            "a holder's memory handed over while NOT READY",
            with(Case::holder(), |c| {
                c.record.state = KeptState::HandedOver {
                    token: 1,
                    ready: false,
                }
            }),
            Image("not this LUN's content"),
        ),
        (
            "a record left INITIALISING (accept-empty cut short)",
            with(Case::holder(), |c| c.record.state = KeptState::Initialising),
            Image("Initialising"),
        ),
        (
            "a record left RESTORING (a restore cut short)",
            with(Case::holder(), |c| c.record.state = KeptState::Restoring),
            Image("Restoring"),
        ),
        (
            "discarded memory",
            with(Case::holder(), |c| {
                c.record.state = KeptState::Discarded {
                    reason: "a failed dump".into(),
                }
            }),
            Lost("a failed dump"),
        ),
        ("this restart's handover", Case::restart(), Serve(7, false)),
        (
            "another restart's token",
            with(Case::restart(), |c| c.restart = Some(TOKEN + 1)),
            Image("not handed over by this restart"),
        ),
        (
            "a valid record on a planned restart",
            with(Case::restart(), |c| c.record.state = KeptState::Valid),
            Image("not handed over by this restart"),
        ),
        // The boot.
        (
            "another boot_id",
            with(Case::holder(), |c| c.boot_id = OTHER_BOOT),
            Image("before this boot"),
        ),
        // The single writer.
        (
            "a restart's memory written by another process",
            with(Case::restart(), |c| c.record.owner = WRITER),
            Image("not this one"),
        ),
        (
            "a stored writer pidfd still open, or a process left in the cgroup",
            with(Case::holder(), |c| {
                c.writer = Err("the unit's cgroup still holds process(es) 77".into())
            }),
            NotReady("still holds process(es) 77"),
        ),
        (
            "the record's writer still running",
            with(Case::holder(), |c| c.owner_running = true),
            NotReady("process 4242, is still running"),
        ),
        (
            "a restart ignores a running owner (it is this process)",
            with(Case::restart(), |c| c.owner_running = true),
            Serve(7, false),
        ),
        // The state directory.
        (
            "a state directory that does not know the LUN",
            with(Case::holder(), |c| c.state = None),
            NotReady("is it the right state directory?"),
        ),
        (
            "memory of another identity (accept-empty since)",
            with(Case::holder(), |c| c.record.naa = "3a1b2c3d4e5f6072".into()),
            Image("naa.3a1b2c3d4e5f6072"),
        ),
        (
            "another serial",
            with(Case::holder(), |c| c.record.serial = "other".into()),
            Image("the state directory names"),
        ),
        // The shape.
        (
            "another size",
            with(Case::holder(), |c| c.shape.0 = 8 << 30),
            NotReady("put the configuration back"),
        ),
        (
            "another block size",
            with(Case::holder(), |c| c.shape.1 = 4096),
            NotReady("of 512-byte blocks"),
        ),
        // The generation.
        (
            "a bump the state made durable before the record said it ended",
            with(Case::holder(), |c| {
                c.record.pending_generation = Some(8);
                if let Some(k) = c.state.as_mut() {
                    k.generation = 8;
                }
            }),
            Serve(8, false),
        ),
        (
            // Bytes of the bump's first write may be placed, none was
            // acknowledged: generation 7's image is the content.
            "a bump the state never made durable",
            with(Case::holder(), |c| c.record.pending_generation = Some(8)),
            Image("(pending Some(8)), the state directory's is 7"),
        ),
        (
            "memory behind the state (an image is newer)",
            with(Case::holder(), |c| c.record.generation = 6),
            Image("the state directory's is 7"),
        ),
        (
            "memory ahead of the state (a state directory put back from a backup)",
            with(Case::holder(), |c| c.record.generation = 8),
            NotReady("the state directory went back"),
        ),
        (
            "a pending bump two ahead of the state",
            with(Case::holder(), |c| {
                c.record.generation = 7;
                c.record.pending_generation = Some(9);
            }),
            NotReady("the state directory went back"),
        ),
        // The exit cause.
        (
            "a faulted writer whose pages can be checked",
            with(Case::holder(), |c| c.fault = fault),
            Serve(7, true),
        ),
        (
            "a faulted writer, --verify-kept-memory off, a clean image of the generation",
            with(Case::holder(), |c| {
                c.fault = fault;
                c.verify = false;
            }),
            Image("--verify-kept-memory is off"),
        ),
        (
            "a faulted writer that kept no checksums, no image of the generation",
            with(Case::holder(), |c| {
                c.fault = fault;
                c.record.page_crcs = false;
                if let Some(k) = c.state.as_mut() {
                    k.clean = false;
                }
            }),
            Lost("no image holds generation 7"),
        ),
        // The binding of record and memory.
        (
            "a holder passing memory of another inode (a forged or replaced memfd)",
            with(Case::holder(), |c| c.memory_inode = INODE + 1),
            NotReady("the memory passed is inode 1043"),
        ),
        (
            "a record from a binary that named no inode",
            with(Case::holder(), |c| c.record.memfd_inode = 0),
            NotReady("memfd inode 0"),
        ),
        (
            "a restart passes its own memory: no inode check",
            with(Case::restart(), |c| c.memory_inode = INODE + 1),
            Serve(7, false),
        ),
    ];
    for (name, case, want) in rows {
        row(name, case, want);
    }
}

/// The first rule that fails decides: a record of another boot is the
/// image's even when its writer still runs (a pid of another boot says
/// nothing of this one).
#[test]
fn the_first_failing_rule_gives_the_reason() {
    let case = with(Case::holder(), |c| {
        c.boot_id = OTHER_BOOT;
        c.owner_running = true;
        c.record.generation = 9;
    });
    row(
        "another boot, a running pid",
        case,
        Want::Image("before this boot"),
    );
}
