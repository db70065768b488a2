//! Source networks: what ACL entries and `--metrics-allow` are written in.

use std::net::IpAddr;

use ipnet::IpNet;

/// `NETWORK/PREFIX` or a bare address (that one host), host bits cleared.
pub fn parse_network(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
        .ok()
        .map(|n| n.trunc())
}

/// Whether `ip` is in one of `networks` (an IPv4 client of an IPv6 socket,
/// `::ffff:a.b.c.d`, counts as `a.b.c.d`).
pub fn in_networks(networks: &[IpNet], ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    networks.iter().any(|n| n.contains(&ip))
}
