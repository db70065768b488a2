//! What the report records about the machine: RDMA devices and ports
//! (`ibv_devinfo -v`, sysfs).

use super::*;

/// One port of an RDMA device, as `ibv_devinfo -v` and sysfs show it.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RdmaPort {
    pub port: u32,
    pub state: String,
    pub link_layer: String,
    pub active_mtu: String,
    pub active_width: String,
    pub active_speed: String,
    /// sysfs `rate`, e.g. "100 Gb/sec (4X EDR)".
    pub rate: String,
    /// The Ethernet/IPoIB interface of the port and its MTU.
    pub netdev: Option<String>,
    pub netdev_mtu: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct RdmaDevice {
    pub name: String,
    pub transport: String,
    pub fw_ver: String,
    pub vendor_id: String,
    pub vendor_part_id: String,
    pub hw_ver: String,
    pub board_id: String,
    /// rdma_rxe or siw: RDMA done by the CPU.
    pub software: bool,
    pub ports: Vec<RdmaPort>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MachineFacts {
    #[serde(flatten)]
    pub base: Machine,
    /// The CPU runs under a hypervisor (the `hypervisor` cpuinfo flag).
    pub virtualised: bool,
    pub rdma_devices: Vec<RdmaDevice>,
    /// Why absolute numbers from this machine mean little; empty on real
    /// hardware.
    pub emulated: Vec<String>,
}

pub(super) fn sysfs(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Parse `ibv_devinfo -v`: one entry per hca_id, ports in order. GUIDs and
/// GIDs are left out: they identify the hardware and measure nothing.
pub(super) fn parse_devinfo(text: &str) -> Vec<RdmaDevice> {
    let mut devs: Vec<RdmaDevice> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim().to_string();
        if key == "hca_id" {
            devs.push(RdmaDevice {
                name: value,
                ..Default::default()
            });
            continue;
        }
        let Some(dev) = devs.last_mut() else {
            continue;
        };
        if key == "port" {
            dev.ports.push(RdmaPort {
                port: value.parse().unwrap_or(0),
                ..Default::default()
            });
            continue;
        }
        let port = dev.ports.last_mut();
        match (key, port) {
            ("transport", None) => dev.transport = value,
            ("fw_ver", None) => dev.fw_ver = value,
            ("vendor_id", None) => dev.vendor_id = value,
            ("vendor_part_id", None) => dev.vendor_part_id = value,
            ("hw_ver", None) => dev.hw_ver = value,
            ("board_id", None) => dev.board_id = value,
            ("state", Some(p)) => p.state = value,
            ("link_layer", Some(p)) => p.link_layer = value,
            ("active_mtu", Some(p)) => p.active_mtu = value,
            ("active_width", Some(p)) => p.active_width = value,
            ("active_speed", Some(p)) => p.active_speed = value,
            _ => {}
        }
    }
    devs
}

impl MachineFacts {
    pub fn here() -> MachineFacts {
        let base = Machine::here();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let virtualised = cpuinfo
            .lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor"));
        let mut rdma_devices = match Command::new("ibv_devinfo").arg("-v").output() {
            Ok(o) if o.status.success() => parse_devinfo(&String::from_utf8_lossy(&o.stdout)),
            _ => Vec::new(),
        };
        for d in &mut rdma_devices {
            let dir = Path::new("/sys/class/infiniband").join(&d.name);
            // A software device has no PCI device behind it.
            d.software = d.name.starts_with("rxe")
                || d.name.starts_with("siw")
                || !dir.join("device").exists();
            for p in &mut d.ports {
                let pdir = dir.join("ports").join(p.port.to_string());
                p.rate = sysfs(&pdir.join("rate")).unwrap_or_default();
                p.netdev = sysfs(&pdir.join("gid_attrs/ndevs/0"));
                p.netdev_mtu = p
                    .netdev
                    .as_ref()
                    .and_then(|n| sysfs(&Path::new("/sys/class/net").join(n).join("mtu")))
                    .and_then(|m| m.parse().ok());
            }
        }
        let mut emulated = Vec::new();
        for d in rdma_devices.iter().filter(|d| d.software) {
            emulated.push(format!(
                "{} is software RDMA (rdma_rxe/siw): the CPU does the HCA's work",
                d.name
            ));
        }
        let cpu = base.cpu.to_ascii_lowercase();
        if cpu.contains("tcg") || (virtualised && cpu.contains("qemu")) {
            emulated.push(format!(
                "the CPU is emulated ({}): every instruction is translated",
                base.cpu
            ));
        }
        MachineFacts {
            base,
            virtualised,
            rdma_devices,
            emulated,
        }
    }
}
