//! systemd's readiness protocol (sd_notify): with `Type=notify` the unit is
//! started once every LUN is restored and the portal listens, and `systemctl
//! status` shows what the daemon is doing. Without `$NOTIFY_SOCKET` (not
//! under systemd) every call does nothing.

use std::os::unix::net::UnixDatagram;

/// Send one notification, e.g. `READY=1`; failures are logged, never fatal.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let result = (|| -> std::io::Result<()> {
        let socket = UnixDatagram::unbound()?;
        let bytes = path.as_encoded_bytes();
        match bytes.strip_prefix(b"@") {
            // An abstract socket: '@' stands for the leading NUL byte.
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                socket.send_to_addr(state.as_bytes(), &addr)?;
            }
            None => {
                socket.send_to(state.as_bytes(), &path)?;
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        tracing::warn!("cannot notify systemd ({state}): {e}");
    }
}
