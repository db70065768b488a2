//! A monotonic clock for timers measured in seconds (NOP-In pings, the
//! output stall, the close grace) on a loop that may turn millions of times
//! a second: the kernel's coarse clock, which the vDSO answers without a
//! system call even where the precise clock cannot (an HPET clocksource, as
//! in the TCG lab, makes every precise read a syscall). Its resolution is a
//! scheduler tick (a few milliseconds).

use std::time::{Duration, Instant};

use rustix::time::{clock_gettime, ClockId};

pub struct CoarseClock {
    start: Instant,
    start_coarse: Duration,
}

impl CoarseClock {
    pub fn new() -> CoarseClock {
        CoarseClock {
            start: Instant::now(),
            start_coarse: coarse(),
        }
    }

    /// Never earlier than a previous reading; within a tick of
    /// `Instant::now()`, on either side.
    pub fn now(&self) -> Instant {
        self.start + coarse().saturating_sub(self.start_coarse)
    }
}

impl Default for CoarseClock {
    fn default() -> Self {
        Self::new()
    }
}

fn coarse() -> Duration {
    let t = clock_gettime(ClockId::MonotonicCoarse);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_precise_clock_within_a_tick() {
        let clock = CoarseClock::new();
        let a = clock.now();
        std::thread::sleep(Duration::from_millis(30));
        let b = clock.now();
        assert!(b >= a);
        let lag = Instant::now().saturating_duration_since(b);
        assert!(lag < Duration::from_millis(25), "lag {lag:?}");
        assert!(b.duration_since(a) >= Duration::from_millis(15));
    }
}
