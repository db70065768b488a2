//! `iscsi://[user[%password]@]host[:port]/IQN/LUN` and `iser://...` (libiscsi's form).

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use crate::conn::DEFAULT_PORT;
use crate::login::{ChapParams, Credentials, LoginParams};
use crate::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Iser,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetUrl {
    pub transport: Transport,
    /// Host name or address, without IPv6 brackets.
    pub host: String,
    pub port: u16,
    pub target_name: String,
    pub lun: u64,
    /// CHAP user and secret from `user%secret@`.
    pub chap: Option<(String, String)>,
}

impl TargetUrl {
    pub fn parse(s: &str) -> Result<TargetUrl, Error> {
        let bad = |why: &str| Error::InvalidArgument(format!("URL {s:?}: {why}"));
        let (transport, rest) = if let Some(r) = s.strip_prefix("iscsi://") {
            (Transport::Tcp, r)
        } else if let Some(r) = s.strip_prefix("iser://") {
            (Transport::Iser, r)
        } else {
            return Err(bad("scheme must be iscsi:// or iser://"));
        };
        let (authority, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("missing /IQN/LUN"))?;
        let (chap, hostport) = match authority.rsplit_once('@') {
            Some((cred, hp)) => {
                let (user, secret) = cred
                    .split_once('%')
                    .ok_or_else(|| bad("credentials must be user%secret"))?;
                if user.is_empty() {
                    return Err(bad("empty CHAP user"));
                }
                (Some((user.to_string(), secret.to_string())), hp)
            }
            None => (None, authority),
        };
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(|| bad("unclosed '['"))?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| bad("junk after ']'"))?),
            };
            (h, port)
        } else {
            match hostport.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            }
        };
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(p) => p.parse::<u16>().map_err(|_| bad("bad port"))?,
        };
        let (iqn, lun) = path.split_once('/').ok_or_else(|| bad("missing /LUN"))?;
        if iqn.is_empty() {
            return Err(bad("empty target name"));
        }
        let lun = lun
            .strip_suffix('/')
            .unwrap_or(lun)
            .parse::<u64>()
            .map_err(|_| bad("LUN must be a decimal number"))?;
        Ok(TargetUrl {
            transport,
            host: host.to_string(),
            port,
            target_name: iqn.to_string(),
            lun,
            chap,
        })
    }

    /// Resolve host and port.
    pub async fn socket_addr(&self) -> Result<SocketAddr, Error> {
        let mut addrs = tokio::net::lookup_host((self.host.as_str(), self.port)).await?;
        addrs
            .next()
            .ok_or_else(|| Error::InvalidArgument(format!("{} does not resolve", self.host)))
    }

    /// Resolve host and port without an async runtime (for the blocking
    /// [`crate::iser::IserSession`]).
    pub fn resolve(&self) -> Result<SocketAddr, Error> {
        (self.host.as_str(), self.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| Error::InvalidArgument(format!("{} does not resolve", self.host)))
    }

    /// Login parameters for a Normal session to this URL's target, with the
    /// URL's CHAP credentials.
    pub fn login_params(&self, initiator_name: &str) -> LoginParams {
        let mut p = LoginParams::normal(initiator_name, self.target_name.clone());
        p.chap = self.chap.as_ref().map(|(user, secret)| ChapParams {
            initiator: Credentials {
                name: user.clone(),
                secret: secret.as_bytes().to_vec(),
            },
            mutual: None,
        });
        p
    }

    /// Err(Unsupported) for iser://: [`crate::Session`] and
    /// [`crate::Connection`] speak iSCSI/TCP; open iser:// URLs with
    /// [`crate::iser::IserSession::connect`] (see [`TargetUrl::resolve`] and
    /// [`TargetUrl::login_params`]).
    pub fn require_tcp(&self) -> Result<(), Error> {
        match self.transport {
            Transport::Tcp => Ok(()),
            Transport::Iser => Err(Error::Unsupported(
                "iser:// needs the iSER session (ramslog_initiator::iser::IserSession), \
                 not the TCP one"
                    .into(),
            )),
        }
    }
}

impl FromStr for TargetUrl {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        TargetUrl::parse(s)
    }
}

impl fmt::Display for TargetUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.transport {
            Transport::Tcp => "iscsi",
            Transport::Iser => "iser",
        };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(
            f,
            "{scheme}://{host}:{}/{}/{}",
            self.port, self.target_name, self.lun
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        let u = TargetUrl::parse("iscsi://127.0.0.1:3261/iqn.2024-01.lab.peers:ramdisk/1").unwrap();
        assert_eq!(u.transport, Transport::Tcp);
        assert_eq!(u.host, "127.0.0.1");
        assert_eq!(u.port, 3261);
        assert_eq!(u.target_name, "iqn.2024-01.lab.peers:ramdisk");
        assert_eq!(u.lun, 1);
        assert_eq!(u.chap, None);
        assert!(u.require_tcp().is_ok());

        let u = TargetUrl::parse("iser://box-a/iqn.2026-11.org.ramslog:slog0/0").unwrap();
        assert_eq!(u.transport, Transport::Iser);
        assert_eq!(u.port, 3260);
        assert!(matches!(u.require_tcp(), Err(Error::Unsupported(_))));

        let u = TargetUrl::parse("iser://bob%pw@127.0.0.1:3262/iqn.x:y/0").unwrap();
        assert_eq!(u.resolve().unwrap(), "127.0.0.1:3262".parse().unwrap());
        let p = u.login_params("iqn.i");
        assert_eq!(p.target_name.as_deref(), Some("iqn.x:y"));
        let chap = p.chap.unwrap();
        assert_eq!(chap.initiator.name, "bob");
        assert_eq!(chap.initiator.secret, b"pw");

        let u = TargetUrl::parse("iscsi://bob%s3cret@[::1]:3262/iqn.x:y/7").unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.port, 3262);
        assert_eq!(u.chap, Some(("bob".into(), "s3cret".into())));
        assert_eq!(u.to_string(), "iscsi://[::1]:3262/iqn.x:y/7");

        let u = TargetUrl::parse("iscsi://[fe80::1]/iqn.x:y/0").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("fe80::1", 3260));
    }

    #[test]
    fn rejects_bad() {
        for s in [
            "http://h/iqn/1",
            "iscsi://h/iqn",
            "iscsi://h:99999/iqn/1",
            "iscsi://h/iqn/x",
            "iscsi:///iqn/1",
            "iscsi://h//1",
            "iscsi://bob@h/iqn/1",
            "iscsi://[::1/iqn/1",
        ] {
            assert!(TargetUrl::parse(s).is_err(), "{s}");
        }
    }
}
