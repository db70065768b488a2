//! Test builds: the daemon stops itself (SIGSTOP) at step `step` (a
//! start-up step, or a moment of accept-empty or of a generation bump) when
//! the file `$RAMSLOG_TEST_PAUSE_FILE` names that step, once (the file is
//! removed first). The tests signal or kill it there, at a moment they
//! chose, instead of after a delay that may fall anywhere. Release builds
//! have no such pause.

/// Pause here if the pause file names `step` (test builds only).
#[cfg(debug_assertions)]
pub fn here(step: &str) {
    let Some(path) = std::env::var_os("RAMSLOG_TEST_PAUSE_FILE") else {
        return;
    };
    if std::fs::read_to_string(&path).is_ok_and(|s| s.trim() == step)
        && std::fs::remove_file(&path).is_ok()
    {
        tracing::info!(step, "test build: pausing here (SIGSTOP)");
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP);
        // A stop sent to the process may be taken by another thread, and
        // this one runs on until the group stop reaches it: it must reach
        // it here, not a step later (seen: the write after a bump pause
        // acknowledged). A sleep enters the kernel, which stops the thread
        // before anything after the pause runs.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// See the test builds' version.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn here(_step: &str) {}
