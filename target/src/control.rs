//! The root-only control socket: `ramslog-target status` and
//! `ramslog-target accept-empty`. One JSON request per line, one JSON reply.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::portal::Portal;
use crate::scsi::{Identity, Readiness};
use crate::state::{naa_hex, StateDir};

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    Status,
    AcceptEmpty { target: String, lun: u64 },
}

#[derive(Debug, Serialize, Deserialize)]
pub struct LunStatus {
    pub lun: u64,
    pub size: u64,
    pub block_size: u32,
    pub naa: String,
    pub serial: String,
    pub ready: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TargetStatus {
    pub name: String,
    pub luns: Vec<LunStatus>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SessionStatus {
    pub initiator: String,
    pub isid: String,
    pub target: String,
    pub tsih: u16,
    pub peer: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Status {
    pub state_dir: Option<String>,
    pub targets: Vec<TargetStatus>,
    pub sessions: Vec<SessionStatus>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reply {
    Status(Status),
    Accepted {
        target: String,
        lun: u64,
        naa: String,
        serial: String,
    },
    Error(String),
}

pub struct Control {
    pub portal: Arc<Portal>,
    pub state: Option<Mutex<StateDir>>,
}

impl Control {
    pub fn handle(&self, req: Request) -> Reply {
        match req {
            Request::Status => Reply::Status(self.status()),
            Request::AcceptEmpty { target, lun } => self.accept_empty(&target, lun),
        }
    }

    fn status(&self) -> Status {
        let targets = self
            .portal
            .targets
            .iter()
            .map(|t| TargetStatus {
                name: t.name.clone(),
                luns: t
                    .scsi
                    .luns()
                    .filter_map(|lu| {
                        let lun = lu.lun();
                        let (id, readiness) = t.scsi.identity(lun)?;
                        Some(LunStatus {
                            lun,
                            size: lu.store().len(),
                            block_size: t.scsi.block_size(lun),
                            naa: naa_hex(&id.naa),
                            serial: id.serial,
                            ready: readiness == Readiness::Ready,
                        })
                    })
                    .collect(),
            })
            .collect();
        let sessions = self
            .portal
            .sessions_info()
            .into_iter()
            .map(|s| SessionStatus {
                initiator: s.key.initiator,
                isid: s.key.isid.iter().map(|b| format!("{b:02x}")).collect(),
                target: s.key.target,
                tsih: s.tsih,
                peer: s.peer.to_string(),
            })
            .collect();
        let state_dir = self.state.as_ref().map(|s| {
            s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .path()
                .display()
                .to_string()
        });
        Status {
            state_dir,
            targets,
            sessions,
        }
    }

    fn accept_empty(&self, target: &str, lun: u64) -> Reply {
        let Some(t) = self.portal.target(target) else {
            return Reply::Error(format!(
                "no target named {target}; `ramslog-target status` lists them"
            ));
        };
        if t.scsi.lu(lun).is_none() {
            return Reply::Error(format!("target {target} has no LUN {lun}"));
        }
        let id = Identity::generate();
        if let Some(state) = &self.state {
            let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = s.set(&t.name, lun, &id) {
                return Reply::Error(format!("identity not changed: {e}"));
            }
        }
        t.scsi.accept_empty(lun, id.clone());
        tracing::warn!(
            target = %t.name, lun, naa = %naa_hex(&id.naa), serial = %id.serial,
            "accept-empty: LUN accepted as an empty device under a new identity; it is ready"
        );
        Reply::Accepted {
            target: t.name.clone(),
            lun,
            naa: naa_hex(&id.naa),
            serial: id.serial,
        }
    }
}

/// Bind the control socket (mode 0600: root only) and serve it forever.
pub async fn serve(path: PathBuf, control: Arc<Control>) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(&path).await.is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!(
                    "{} is in use: another ramslog-target runs with this state directory",
                    path.display()
                ),
            ));
        }
        std::fs::remove_file(&path)?;
    }
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let control = control.clone();
            tokio::spawn(async move {
                let (rd, mut wr) = stream.into_split();
                let mut lines = BufReader::new(rd).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let reply = match serde_json::from_str::<Request>(&line) {
                        Ok(req) => control.handle(req),
                        Err(e) => Reply::Error(format!("bad request: {e}")),
                    };
                    let mut out = serde_json::to_string(&reply).unwrap_or_default();
                    out.push('\n');
                    if wr.write_all(out.as_bytes()).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(())
}

/// Client side: send one request to a running daemon.
pub async fn request(path: &Path, req: &Request) -> Result<Reply, String> {
    let stream = UnixStream::connect(path).await.map_err(|e| {
        format!(
            "cannot reach ramslog-target at {} ({e}); is it running? Point at it with --state-dir or --control-socket",
            path.display()
        )
    })?;
    let (rd, mut wr) = stream.into_split();
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    wr.write_all(line.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut lines = BufReader::new(rd).lines();
    let reply = lines
        .next_line()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("daemon closed the control socket")?;
    serde_json::from_str(&reply).map_err(|e| format!("bad reply from daemon: {e}"))
}
