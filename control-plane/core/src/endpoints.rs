//! Which worker endpoints a model accepts from relays (`allowed_endpoints`):
//! without a list, any relay that can publish on NATS registers a worker
//! with whatever endpoint it claims (NATS credentials are then the only
//! guard); with one, a heartbeat claiming another endpoint is refused and
//! counted, and its worker never enters routing.
//!
//! An entry is `ip:port` (that endpoint), `ip` (any port) or `ip/len` (a
//! CIDR block, any port), IPv4 or IPv6.

use std::net::{IpAddr, SocketAddr};

/// One entry of `allowed_endpoints`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointRule {
    /// Exactly this endpoint.
    Exact(SocketAddr),
    /// Any port of addresses in this block.
    Block(IpAddr, u8),
}

impl EndpointRule {
    /// Parses one entry; the error says what is expected.
    pub fn parse(s: &str) -> Result<Self, &'static str> {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(Self::Exact(a));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Self::Block(ip, if ip.is_ipv4() { 32 } else { 128 }));
        }
        let (ip, len) = s.split_once('/').ok_or("expected ip:port, ip or ip/prefix")?;
        let ip: IpAddr = ip.parse().map_err(|_| "not an IP address before /")?;
        let len: u8 = len.parse().map_err(|_| "prefix length is not a number")?;
        if len > if ip.is_ipv4() { 32 } else { 128 } {
            return Err("prefix length too long for the address");
        }
        Ok(Self::Block(ip, len))
    }

    /// Whether `endpoint` (`ip:port`) is allowed by this entry.
    pub fn allows(&self, endpoint: &SocketAddr) -> bool {
        match *self {
            Self::Exact(a) => a == *endpoint,
            Self::Block(net, len) => same_prefix(net, endpoint.ip(), len),
        }
    }
}

fn same_prefix(a: IpAddr, b: IpAddr, len: u8) -> bool {
    let (a, b, bits) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)) << 96, u128::from(u32::from(b)) << 96, 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let len = u32::from(len).min(bits);
    if len == 0 {
        return true;
    }
    let mask = u128::MAX << (128 - len);
    a & mask == b & mask
}

/// Whether `endpoint` is allowed by `rules` (an empty list allows all).
pub fn allowed(rules: &[EndpointRule], endpoint: &str) -> bool {
    if rules.is_empty() {
        return true;
    }
    match endpoint.parse::<SocketAddr>() {
        Ok(a) => rules.iter().any(|r| r.allows(&a)),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        let rules: Vec<EndpointRule> = ["10.0.0.5:8000", "10.1.0.0/16", "fd00::/8", "192.168.1.9"]
            .iter()
            .map(|r| EndpointRule::parse(r).unwrap())
            .collect();
        for (e, ok) in [
            ("10.0.0.5:8000", true),
            ("10.0.0.5:8001", false),
            ("10.1.200.3:8000", true),
            ("10.2.0.1:8000", false),
            ("[fd12::1]:8000", true),
            ("[fe80::1]:8000", false),
            ("192.168.1.9:1", true),
            ("not-an-endpoint", false),
        ] {
            assert_eq!(allowed(&rules, e), ok, "{e}");
        }
        assert!(allowed(&[], "anything"));
        for bad in ["10.0.0.0/33", "x/8", "10.0.0.0/y", "host:80"] {
            assert!(EndpointRule::parse(bad).is_err(), "{bad}");
        }
        assert!(allowed(&[EndpointRule::parse("0.0.0.0/0").unwrap()], "1.2.3.4:5"));
    }
}
