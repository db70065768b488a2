//! The fault mark: a fatal signal or a panic writes into each living
//! store's mark before the process dies, so a successor that finds the
//! kept memory learns its writer died of a fault.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use super::{Store, StoreError, WORD};

impl Store {
    /// Have a panic or a fault signal of this process (see
    /// [`install_fault_handlers`]) write its mark into the 16 bytes at
    /// `offset`, for as long as this store lives: [`FAULT_MARK`] in the
    /// first word, the cause ([`PANIC_CAUSE`] or the signal number) in the
    /// second. A kept-memory record reserves those bytes, so a successor
    /// learns that its writer died of a fault.
    pub fn mark_faults_at(&self, offset: u64) -> Result<(), StoreError> {
        let off = self.check(offset, 2 * WORD)?;
        if !off.is_multiple_of(WORD) {
            return Err(StoreError::OutOfRange {
                offset,
                len: 2 * WORD,
                size: self.len as u64,
            });
        }
        let words = self.words(off / WORD, 2).as_ptr().cast_mut();
        self.unmark_faults();
        for (i, slot) in FAULT_MARKS.iter().enumerate() {
            if slot
                .compare_exchange(
                    std::ptr::null_mut(),
                    words,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                self.fault_mark.store(i + 1, Ordering::Release);
                return Ok(());
            }
        }
        Err(StoreError::NotKept(format!(
            "more than {} fault marks in one process",
            FAULT_MARKS.len()
        )))
    }

    /// Clear this store's fault mark (the living process vouches for the
    /// memory again: it hands it over).
    pub fn clear_fault_mark(&self) {
        let i = self.fault_mark.load(Ordering::Acquire);
        if let Some(p) = i.checked_sub(1).and_then(|i| FAULT_MARKS.get(i)) {
            let words = p.load(Ordering::Acquire);
            if !words.is_null() {
                // SAFETY: a registered mark points at two words of this
                // store's mapping, alive while `self` is.
                let words = unsafe { std::slice::from_raw_parts(words.cast_const(), 2) };
                words[0].store(0, Ordering::Release);
                words[1].store(0, Ordering::Release);
            }
        }
    }

    pub(super) fn unmark_faults(&self) {
        let i = self.fault_mark.swap(0, Ordering::AcqRel);
        if let Some(slot) = i.checked_sub(1).and_then(|i| FAULT_MARKS.get(i)) {
            slot.store(std::ptr::null_mut(), Ordering::Release);
        }
    }
}

/// The first word of a fault mark: "RSLFAULT".
pub const FAULT_MARK: u64 = u64::from_le_bytes(*b"RSLFAULT");

/// The cause a panic writes into a fault mark (a signal writes its number).
pub const PANIC_CAUSE: u64 = 1 << 32;

/// The fault marks of the living stores: each points at a mark's two words.
/// A fixed array of atomics, because a signal handler may neither lock nor
/// allocate.
static FAULT_MARKS: [AtomicPtr<AtomicU64>; 4096] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; 4096];

/// Write `cause` into every living store's fault mark: the cause first,
/// then the magic word, so a mark whose magic is seen names its cause.
/// Async-signal-safe: atomic loads and stores only.
pub fn mark_faults(cause: u64) {
    for slot in &FAULT_MARKS {
        let words = slot.load(Ordering::Acquire);
        if words.is_null() {
            continue;
        }
        // SAFETY: a registered mark points at two aligned words inside a
        // living store's mapping; a store unregisters before it unmaps. A
        // store dropped on another thread between this load and the stores
        // is unmapped under us: the fault this raises meets the default
        // action (the handler resets itself on entry), and the process was
        // dying anyway.
        unsafe {
            (*words.add(1)).store(cause, Ordering::Release);
            (*words).store(FAULT_MARK, Ordering::Release);
        }
    }
}

/// The fault signals that mark the kept memory before the process dies:
/// after one of them, memory this process wrote may have been written
/// anywhere. SIGABRT is glibc's heap-corruption checks and Rust's
/// allocation failure (abort(3)); SIGFPE an arithmetic trap; SIGSYS a
/// system call a seccomp filter trapped.
pub const FAULT_SIGNALS: [libc::c_int; 6] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGILL,
    libc::SIGABRT,
    libc::SIGFPE,
    libc::SIGSYS,
];

/// Install handlers that mark every living store's fault mark on each of
/// [`FAULT_SIGNALS`], then let the signal kill the process as before (a
/// core dump never holds the LUN memory: it is `MADV_DONTDUMP`). Call once,
/// after the Rust runtime set up each thread's alternate signal stack: the
/// handler runs on it, so a stack overflow is marked too.
pub fn install_fault_handlers() -> std::io::Result<()> {
    for signal in FAULT_SIGNALS {
        // SAFETY: a zeroed sigaction is a valid value to fill in; the
        // handler is async-signal-safe (atomic stores, write(2), raise(3)).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fault_signal as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESETHAND;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

extern "C" fn on_fault_signal(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    mark_faults(signal as u64);
    const SAID: &[u8] = b"ramslog-target: fatal signal; the kept LUN memory is marked as written by a faulted process\n";
    // SAFETY: write(2) is async-signal-safe; the buffer is static. `info`
    // is the kernel's siginfo for this delivery (SA_SIGINFO), valid here.
    unsafe {
        let _ = libc::write(2, SAID.as_ptr().cast(), SAID.len());
        // The handler reset itself to the default action on entry. A fault
        // returns to the faulting instruction and meets it; a signal sent
        // with kill(2) or raise(3) (si_code <= 0, abort(3) among them) does
        // not come back, nor does a seccomp trap (the trapped call returns),
        // so send it again: it is delivered, fatally, once this handler
        // returns.
        if info.is_null() || (*info).si_code <= 0 || signal == libc::SIGSYS {
            libc::raise(signal);
        }
    }
}
