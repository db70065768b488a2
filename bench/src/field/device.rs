//! The kernel initiator's block device: checks that it is an unused
//! RAMSLOG disk, and the fio run on it.

use super::*;

/// The device must be an unused ramslog LUN: fio overwrites it. Returns
/// its canonical path.
pub(super) fn check_device(dev: &Path) -> Result<PathBuf> {
    let real = std::fs::canonicalize(dev).with_context(|| format!("--device {}", dev.display()))?;
    let name = real
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let sys = Path::new("/sys/class/block").join(&name);
    if !sys.exists() {
        bail!("--device {}: not a block device", dev.display());
    }
    let vendor = sysfs(&sys.join("device/vendor")).unwrap_or_default();
    if vendor != "RAMSLOG" {
        bail!(
            "--device {}: its vendor is {vendor:?}, not RAMSLOG: the fio run overwrites the \
             device, so it only runs on a ramslog LUN",
            dev.display()
        );
    }
    let holders = std::fs::read_dir(sys.join("holders"))
        .map(|d| d.count())
        .unwrap_or(0);
    let partitions = std::fs::read_dir(&sys)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(&name))
                .count()
        })
        .unwrap_or(0);
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mounted = mounts
        .lines()
        .any(|l| l.split_whitespace().next() == Some(&real.to_string_lossy()));
    // Low-level probe of the whole device: filesystems, ZFS labels and
    // partition tables (PTTYPE); exit status 2 alone means "nothing found".
    let probe = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(&real)
        .output()
        .context(
            "cannot run blkid (apt-get install util-linux) to see whether the device holds data",
        )?;
    let signature = match probe.status.code() {
        Some(2) => String::new(),
        Some(0) => String::from_utf8_lossy(&probe.stdout)
            .lines()
            .filter(|l| l.starts_with("TYPE=") || l.starts_with("PTTYPE="))
            .collect::<Vec<_>>()
            .join(" "),
        _ => format!(
            "an unreadable probe (blkid: {})",
            String::from_utf8_lossy(&probe.stderr).trim()
        ),
    };
    if holders > 0 || partitions > 0 || mounted || !signature.is_empty() {
        bail!(
            "--device {}: in use or holding data ({}): the fio run would overwrite it. Measure \
             a LUN before `zpool add`, or one removed from the pool (`zpool remove`) and cleared \
             (`zpool labelclear`)",
            dev.display(),
            [
                (holders > 0).then(|| "held by another device".to_string()),
                (partitions > 0).then(|| "partitioned".to_string()),
                mounted.then(|| "mounted".to_string()),
                (!signature.is_empty()).then(|| signature.clone()),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
        );
    }
    Ok(real)
}

/// How much of each end of a LUN is checked for data: ZFS keeps two labels
/// of 256 KiB at each end, GPT its headers at both ends.
pub(super) const CHECKED_END: u64 = 512 * 1024;

/// Refuse to measure (write to) a LUN whose ends hold anything but zeros.
pub(super) fn refuse_if_holding_data(url: &TargetUrl, o: &runner::ConnectOptions) -> Result<()> {
    let w = Workload {
        pattern: Pattern::Read,
        bs: 4096,
        qd: 1,
    };
    let mut r = runner::connect(url, w, o)?;
    let info = r.info().clone();
    let block = u64::from(info.block_size.max(1));
    // The blocks the workload addresses: whole 4 KiB I/Os, so up to 3.5 KiB
    // short of the end on a 512-byte LUN whose size is no multiple of 4 KiB.
    let total = info.blocks * block;
    let span = CHECKED_END.min(total / 2) / block * block;
    let mut buf = vec![0u8; span as usize];
    let mut dirty = false;
    for start in [0, total - span] {
        r.read_at(start / block, &mut buf)
            .with_context(|| format!("reading {url} to see whether it holds data"))?;
        dirty |= buf.iter().any(|&b| b != 0);
    }
    r.close();
    if dirty {
        bail!(
            "{url} holds data in its first or last {} KiB (a ZFS label, a partition table, or an \
             earlier benchmark): the report writes over it. If it is in a pool, stop: measure a \
             LUN that is not. If the data does not matter, add --overwrite",
            CHECKED_END / 1024
        );
    }
    Ok(())
}

/// The sync-write job every device in the lab is measured with: 4 KiB random
/// writes, O_DIRECT + O_SYNC, QD1.
pub(super) fn fio_sync_qd1(dev: &Path, secs: Duration) -> Result<FioRun> {
    let out = Command::new("fio")
        .arg("--name=ramslog-sync-qd1")
        // fio splits --filename at ':'.
        .arg(format!(
            "--filename={}",
            dev.display().to_string().replace(':', "\\:")
        ))
        .args([
            "--rw=randwrite",
            "--bs=4k",
            "--direct=1",
            "--sync=1",
            "--ioengine=psync",
            "--iodepth=1",
            "--time_based",
            "--percentile_list=50:99:99.9",
            "--output-format=json",
        ])
        .arg(format!("--runtime={}", secs.as_secs().max(1)))
        .output()
        .context("cannot run fio (apt-get install fio)")?;
    if !out.status.success() {
        bail!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio's JSON output")?;
    let w = &j["jobs"][0]["write"];
    let pct = |p: &str| w["clat_ns"]["percentile"][p].as_f64().unwrap_or(f64::NAN) / 1e3;
    Ok(FioRun {
        device: dev.display().to_string(),
        workload: "4 KiB randwrite, QD1, O_DIRECT|O_SYNC (psync)",
        iops: w["iops"].as_f64().unwrap_or(0.0),
        ios: w["total_ios"].as_u64().unwrap_or(0),
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        p99_9_us: pct("99.900000"),
        mean_us: w["clat_ns"]["mean"].as_f64().unwrap_or(f64::NAN) / 1e3,
        max_us: w["clat_ns"]["max"].as_f64().unwrap_or(f64::NAN) / 1e3,
    })
}
