//! Credentials in a NATS URL.
//!
//! Operators give kvgate one NATS URL (from a Kubernetes Secret, say):
//! `nats://user:password@host:4222`, or `nats://token@host:4222`. The NATS
//! client library connects to the address but does not read credentials
//! from it, so both the control plane and the relay split the URL here and
//! pass the credentials as connect options. Percent-encoded bytes in the
//! user info are decoded (`%40` is `@`), so any password can be written.
//! Several servers separated by commas share one set of credentials, which
//! may be written on any of them.
//!
//! Cost: O(len(url)); a few allocations per connect.

use alloc::string::String;
use alloc::vec::Vec;

/// What a NATS URL authenticates with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NatsAuth {
    /// No user info in the URL.
    None,
    /// `user:password@`.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// `token@`.
    Token(String),
}

#[cfg(feature = "nats")]
impl NatsAuth {
    /// These credentials as async-nats connect options, added to `opts`.
    pub fn connect_options(self, opts: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
        match self {
            Self::None => opts,
            Self::UserPassword { user, password } => opts.user_and_password(user, password),
            Self::Token(token) => opts.token(token),
        }
    }
}

/// A NATS URL split into its credentials and the addresses without them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsUrl {
    /// The credentials.
    pub auth: NatsAuth,
    /// The server addresses with the user info removed, comma-separated as given.
    pub servers: String,
}

/// Splits the credentials out of `url` (see the module docs). A URL
/// without user info is returned as it is.
pub fn split_nats_url(url: &str) -> NatsUrl {
    let mut auth = NatsAuth::None;
    let mut servers: Vec<String> = Vec::new();
    for server in url.split(',') {
        let server = server.trim();
        let (scheme, rest) = match server.split_once("://") {
            Some((s, r)) => (Some(s), r),
            None => (None, server),
        };
        let (authority, path) = match rest.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (rest, None),
        };
        // The last '@' ends the user info (an unencoded '@' in a password).
        let Some((info, host)) = authority.rsplit_once('@') else {
            servers.push(String::from(server));
            continue;
        };
        if auth == NatsAuth::None {
            auth = match info.split_once(':') {
                Some((u, p)) => NatsAuth::UserPassword { user: percent_decode(u), password: percent_decode(p) },
                None => NatsAuth::Token(percent_decode(info)),
            };
        }
        let mut s = String::with_capacity(server.len());
        if let Some(scheme) = scheme {
            s.push_str(scheme);
            s.push_str("://");
        }
        s.push_str(host);
        if let Some(path) = path {
            s.push('/');
            s.push_str(path);
        }
        servers.push(s);
    }
    NatsUrl { auth, servers: servers.join(",") }
}

fn percent_decode(s: &str) -> String {
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes().peekable();
    while let Some(c) = bytes.next() {
        if c == b'%' {
            let mut ahead = bytes.clone();
            if let (Some(h), Some(l)) = (ahead.next().and_then(hex), ahead.next().and_then(hex)) {
                out.push((h * 16 + l) as u8);
                bytes = ahead;
                continue;
            }
        }
        out.push(c);
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(u: &str, p: &str) -> NatsAuth {
        NatsAuth::UserPassword { user: u.into(), password: p.into() }
    }

    #[test]
    fn user_password_token_and_none() {
        let u = split_nats_url("nats://kvgate:s3cret@kvgate-nats:4222");
        assert_eq!(u.auth, up("kvgate", "s3cret"));
        assert_eq!(u.servers, "nats://kvgate-nats:4222");
        let t = split_nats_url("nats://abc123@10.0.0.1:4222");
        assert_eq!(t.auth, NatsAuth::Token("abc123".into()));
        assert_eq!(t.servers, "nats://10.0.0.1:4222");
        let n = split_nats_url("nats://127.0.0.1:4222");
        assert_eq!(n, NatsUrl { auth: NatsAuth::None, servers: "nats://127.0.0.1:4222".into() });
        assert_eq!(split_nats_url("127.0.0.1:4222").servers, "127.0.0.1:4222");
    }

    #[test]
    fn percent_encoded_and_several_servers() {
        let u = split_nats_url("nats://a%40b:p%3Aw%2F%@n1:4222, nats://n2:4222");
        assert_eq!(u.auth, up("a@b", "p:w/%"));
        assert_eq!(u.servers, "nats://n1:4222,nats://n2:4222");
        // An '@' in the password, unencoded: the last '@' ends the user info.
        let v = split_nats_url("tls://u:p@ss@host:4222/x");
        assert_eq!(v.auth, up("u", "p@ss"));
        assert_eq!(v.servers, "tls://host:4222/x");
    }
}
