//! SendTargets discovery.

use std::net::SocketAddr;

use crate::conn::Connection;
use crate::login::{ChapParams, LoginParams};
use crate::Error;

/// Log in a Discovery session, ask `SendTargets=All`, log out. Returns each
/// TargetName with the TargetAddress values that followed it.
pub async fn discover(
    addr: SocketAddr,
    initiator_name: &str,
    chap: Option<ChapParams>,
) -> Result<Vec<(String, Vec<String>)>, Error> {
    let mut c = Connection::connect(addr).await?;
    let mut p = LoginParams::discovery(initiator_name);
    p.chap = chap;
    c.login(&p).await?;
    let keys = c
        .text_request(&[("SendTargets".to_string(), "All".to_string())])
        .await?;
    let targets = parse_send_targets(&keys)?;
    if let Err(e) = c.logout().await {
        tracing::debug!(error = %e, "discovery logout");
    }
    Ok(targets)
}

pub(crate) fn parse_send_targets(
    keys: &[(String, String)],
) -> Result<Vec<(String, Vec<String>)>, Error> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for (k, v) in keys {
        match k.as_str() {
            "TargetName" => out.push((v.clone(), Vec::new())),
            "TargetAddress" => match out.last_mut() {
                Some((_, addrs)) => addrs.push(v.clone()),
                None => return Err(Error::proto("TargetAddress before any TargetName")),
            },
            _ => tracing::debug!(key = %k, "ignored in SendTargets response"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_addresses() {
        let k = |a: &str, b: &str| (a.to_string(), b.to_string());
        let r = parse_send_targets(&[
            k("TargetName", "iqn.a"),
            k("TargetAddress", "10.0.0.1:3260,1"),
            k("TargetAddress", "[fe80::1]:3260,1"),
            k("TargetName", "iqn.b"),
        ])
        .unwrap();
        assert_eq!(
            r,
            vec![
                (
                    "iqn.a".to_string(),
                    vec![
                        "10.0.0.1:3260,1".to_string(),
                        "[fe80::1]:3260,1".to_string()
                    ]
                ),
                ("iqn.b".to_string(), vec![])
            ]
        );
        assert!(parse_send_targets(&[k("TargetAddress", "x")]).is_err());
    }
}
