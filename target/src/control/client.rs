//! The control socket's client side: what `ramslog-target status`,
//! `stop`, `restart`, `accept-empty` and `discard-kept` send to a running
//! daemon, one request and its reply per connection.

use std::path::Path;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use super::{Reply, Request};

/// Client side: send one request to a running daemon.
pub async fn request(path: &Path, req: &Request) -> Result<Reply, String> {
    request_on(connect(path).await?, req).await
}

/// [`request`], and a pidfd of the daemon that answered it, taken from the
/// connection (SO_PEERCRED) before the request is sent: it says when that
/// process ends, whatever programs it executes meanwhile (a planned
/// restart keeps the pid).
pub async fn request_with_pidfd(
    path: &Path,
    req: &Request,
) -> Result<(Reply, std::os::fd::OwnedFd), String> {
    let stream = connect(path).await?;
    let pid = rustix::net::sockopt::socket_peercred(&stream)
        .map_err(|e| {
            format!(
                "cannot tell which process answers at {}: {e}",
                path.display()
            )
        })?
        .pid;
    let pidfd =
        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).map_err(|e| {
            format!(
                "cannot watch the daemon's process {}: {e}",
                pid.as_raw_nonzero()
            )
        })?;
    Ok((request_on(stream, req).await?, pidfd))
}

async fn connect(path: &Path) -> Result<UnixStream, String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        match crate::private_dir::check_socket_dir(dir) {
            // A missing directory is a daemon that is not running: the
            // connect below says so.
            Err(crate::private_dir::PrivateDirError::Inspect { .. }) | Ok(()) => {}
            Err(e) => return Err(format!("refusing to use {}: {e}", path.display())),
        }
    }
    UnixStream::connect(path).await.map_err(|e| {
        format!(
            "cannot reach ramslog-target at {} ({e}); is it running? Point at it with --state-dir or --control-socket",
            path.display()
        )
    })
}

async fn request_on(stream: UnixStream, req: &Request) -> Result<Reply, String> {
    let (rd, mut wr) = stream.into_split();
    let mut line = serde_json::to_string(req).map_err(|e| e.to_string())?;
    line.push('\n');
    // A daemon that refuses the client answers and closes without reading:
    // its reply explains a failed write.
    let sent = wr.write_all(line.as_bytes()).await;
    let mut lines = BufReader::new(rd).lines();
    let reply = match (lines.next_line().await, sent) {
        (Ok(Some(reply)), _) => reply,
        (_, Err(e)) => return Err(format!("cannot send the request to the daemon: {e}")),
        (Err(e), Ok(())) => return Err(e.to_string()),
        (Ok(None), Ok(())) => return Err("daemon closed the control socket".into()),
    };
    serde_json::from_str(&reply).map_err(|e| format!("bad reply from daemon: {e}"))
}

/// Subcommand output goes to scripts (`status | grep -q ready`): a reader
/// that stops early is not an error, and nothing may panic on it.
pub fn print_stdout(text: &str) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("cannot write to standard output: {e}"))
        }
        _ => Ok(()),
    }
}
