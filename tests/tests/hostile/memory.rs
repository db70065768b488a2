//! Peak resident memory of the target process, sampled every 100 ms.

use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use ramslog_tests::artefact_dir;

const INTERVAL: Duration = Duration::from_millis(100);

fn vm_rss_bytes(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<Mutex<u64>>,
    thread: Option<JoinHandle<()>>,
}

impl RssSampler {
    pub fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(Mutex::new(vm_rss_bytes(pid).unwrap_or(0)));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(rss) = vm_rss_bytes(pid) {
                    let mut peak = p.lock().unwrap_or_else(|e| e.into_inner());
                    *peak = (*peak).max(rss);
                }
                thread::sleep(INTERVAL);
            }
        });
        RssSampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    /// Peak VmRSS seen so far, in bytes.
    pub fn peak(&self) -> u64 {
        *self.peak.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stop sampling; peak VmRSS in bytes.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak()
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Record one case's figure (peak VmRSS minus the LUN bytes) in
/// `build/hostile/memory.json`, one JSON object per line. The LUN, locked
/// in RAM at start, must be in the sample: a peak below it means the
/// memory was not counted (huge pages are not in VmRSS), and any bound
/// checked on the figure would pass whatever the daemon spent.
pub fn record(case: &str, connections: u32, peak_rss: u64, lun_bytes: u64) -> u64 {
    assert!(
        peak_rss >= lun_bytes,
        "{case}: peak VmRSS {peak_rss} is below the {lun_bytes}-byte LUN: the LUN memory is not \
         counted (huge pages?), so the bound would check nothing"
    );
    let above = peak_rss - lun_bytes;
    let line = format!(
        "{{\"case\":\"{case}\",\"connections\":{connections},\"peak_rss_mib\":{:.1},\"above_lun_mib\":{:.1}}}\n",
        peak_rss as f64 / 1048576.0,
        above as f64 / 1048576.0
    );
    println!("memory: {}", line.trim_end());
    let path = artefact_dir("hostile").join("memory.json");
    let mut old = fs::read_to_string(&path).unwrap_or_default();
    old.push_str(&line);
    let _ = fs::write(&path, old);
    above
}
