//! CmdSN at its edges (RFC 7143 4.2.2): the serial-number wrap, a gap, an
//! immediate command outside the window, the window's last slot.

use ramslog_common::serial;

use super::*;

fn tur_status(r: &[Rsp]) -> Option<u8> {
    r.iter()
        .find(|p| p.bhs.opcode() == Some(Opcode::ScsiResponse))
        .map(|p| p.bhs.scsi_status())
}

fn immediate_tur(h: &mut Harness, cmdsn: u32) -> Vec<Rsp> {
    let mut b = Bhs::new(Opcode::ScsiCommand);
    b.set_immediate(true)
        .set_flags(0x81)
        .set_itt(h.next_itt())
        .set_cmdsn(cmdsn);
    b.set_cdb(&[0u8; 6]);
    h.send(&b, &[])
}

/// A session that starts three short of 2^32 keeps working across the wrap:
/// every command is answered, ExpCmdSN and MaxCmdSN wrap with it, and data
/// written before the wrap reads back after it.
#[test]
fn a_session_runs_across_the_cmdsn_wrap() {
    let mut h = Harness::new(RamPortal::new(IQN).build());
    h.cmdsn = u32::MAX - 2;
    h.login(&[("ImmediateData", "Yes"), ("InitialR2T", "No")]);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 5 + 1) as u8).collect();
    let (_, r) = h.command(&write10(16, 8), 0xa1, 4096, &data);
    assert_eq!(tur_status(&r), Some(status::GOOD));
    for _ in 0..8 {
        let sent = h.cmdsn;
        let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
        assert_eq!(tur_status(&r), Some(status::GOOD), "CmdSN {sent:#x}");
        let b = &r[0].bhs;
        assert_eq!(
            b.exp_cmdsn(),
            sent.wrapping_add(1),
            "ExpCmdSN after {sent:#x}"
        );
        assert!(
            serial::gt(b.max_cmdsn(), sent),
            "MaxCmdSN {:#x} must lie ahead of {sent:#x}",
            b.max_cmdsn()
        );
    }
    assert!(
        h.cmdsn < 16,
        "the session crossed the wrap: now {:#x}",
        h.cmdsn
    );
    let (_, r) = h.command(&read10(16, 8), 0xc1, 4096, &[]);
    let got: Vec<u8> = r
        .iter()
        .filter(|p| p.bhs.opcode() == Some(Opcode::DataIn))
        .flat_map(|p| p.data.clone())
        .collect();
    assert_eq!(got, data);
}

/// A CmdSN one ahead of ExpCmdSN (a gap inside the window) is dropped
/// without an answer; the session goes on with ExpCmdSN, and the dropped
/// number is taken by the next command.
#[test]
fn a_gap_inside_the_window_is_dropped_and_the_session_goes_on() {
    let mut h = logged_in();
    let exp = h.cmdsn;
    h.cmdsn = exp.wrapping_add(1);
    let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
    assert!(r.is_empty(), "a command after a gap was answered");
    h.cmdsn = exp;
    let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
    assert_eq!(tur_status(&r), Some(status::GOOD));
    assert_eq!(r[0].bhs.exp_cmdsn(), exp.wrapping_add(1));
    let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
    assert_eq!(tur_status(&r), Some(status::GOOD), "the once-dropped CmdSN");
    assert!(!h.closed);
}

/// An immediate command carries ExpCmdSN and does not advance it; one
/// whose CmdSN lies outside the window is dropped.
#[test]
fn immediate_commands_inside_the_window_only() {
    let mut h = logged_in();
    let exp = h.cmdsn;
    let r = immediate_tur(&mut h, exp);
    assert_eq!(tur_status(&r), Some(status::GOOD));
    assert_eq!(
        r[0].bhs.exp_cmdsn(),
        exp,
        "an immediate command takes no CmdSN"
    );
    for outside in [exp.wrapping_add(10_000), exp.wrapping_sub(1)] {
        let r = immediate_tur(&mut h, outside);
        assert!(
            r.is_empty(),
            "an immediate command at {outside:#x} was answered"
        );
    }
    let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
    assert_eq!(tur_status(&r), Some(status::GOOD));
    assert!(!h.closed);
}

/// The window's last slot: with a window of four, the fourth command waiting
/// for data has CmdSN = the MaxCmdSN advertised before the first; it is
/// taken. The fifth, one beyond, is dropped.
#[test]
fn the_last_cmdsn_of_the_advertised_window_is_taken() {
    let mut h = Harness::new(
        RamPortal::new(IQN)
            .limits(Limits {
                cmd_window: 4,
                ..Limits::default()
            })
            .build(),
    );
    h.login(&[("InitialR2T", "Yes"), ("ImmediateData", "No")]);
    let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
    let advertised = r[0].bhs.max_cmdsn();
    assert_eq!(advertised, h.cmdsn.wrapping_add(3));
    for i in 0..4u32 {
        let sent = h.cmdsn;
        let (_, r) = h.command(&write10(i * 8, 8), 0xa1, 4096, &[]);
        assert_eq!(
            r.first().and_then(|p| p.bhs.opcode()),
            Some(Opcode::ReadyToTransfer),
            "CmdSN {sent:#x} (advertised MaxCmdSN {advertised:#x})"
        );
    }
    assert_eq!(h.cmdsn, advertised.wrapping_add(1));
    let (_, r) = h.command(&[0u8; 6], 0x81, 0, &[]);
    assert!(r.is_empty(), "a command beyond the window was answered");
}
