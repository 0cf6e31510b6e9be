//! A request's client address: peer address + trusted proxies + forwarding header.
//!
//! A client IP is believed from a forwarding header only when the TCP peer is a trusted
//! proxy. The header is then walked from the right — the entry the nearest proxy wrote —
//! skipping trusted addresses; the first untrusted address is the client. Entries to its
//! left were written by the client itself and are never believed (the leftmost entry of
//! X-Forwarded-For is whatever the client wants it to be).

use std::net::{IpAddr, Ipv6Addr};

use http::header::HeaderMap;
use ipnet::IpNet;
use serde::Deserialize;

/// Which header a trusted proxy names the client in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardingHeader {
    #[default]
    XForwardedFor,
    Forwarded,
    XRealIp,
}

/// `[client_ip]`: whose forwarding headers are believed, and which one.
#[derive(Debug, Clone, Default)]
pub struct ClientIp {
    pub trusted_proxies: Vec<IpNet>,
    pub header: ForwardingHeader,
}

/// Hops examined at most in one forwarding header; past them the last trusted hop stands.
const MAX_HOPS: usize = 64;

/// The client address of a request, by the rules above.
///
/// A malformed or `unknown` entry ends the walk at the trusted hop that passed it on (the
/// entry to its right, or the peer): a client cannot escape its limit by writing garbage,
/// because garbage never becomes an identity of its own.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, cfg: &ClientIp) -> IpAddr {
    let peer = peer.to_canonical();
    if !is_trusted(peer, &cfg.trusted_proxies) {
        return peer;
    }
    let mut client = peer;
    for entry in hops(headers, cfg.header).take(MAX_HOPS) {
        match entry {
            Some(ip) if is_trusted(ip, &cfg.trusted_proxies) => client = ip,
            Some(ip) => return ip,
            None => return client,
        }
    }
    client
}

/// Whether `ip` is inside one of the trusted proxies' networks.
pub fn is_trusted(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|n| n.contains(&ip))
}

/// The forwarding header's entries, rightmost first; `None` for one that is not an address.
fn hops(
    headers: &HeaderMap,
    kind: ForwardingHeader,
) -> Box<dyn Iterator<Item = Option<IpAddr>> + '_> {
    match kind {
        ForwardingHeader::XForwardedFor => {
            let lines: Vec<_> = headers.get_all("x-forwarded-for").iter().collect();
            Box::new(lines.into_iter().rev().flat_map(|v| {
                let entries: Vec<Option<IpAddr>> = match v.to_str() {
                    Ok(s) => s.split(',').rev().map(parse_node).collect(),
                    Err(_) => vec![None],
                };
                entries
            }))
        }
        ForwardingHeader::Forwarded => {
            let lines: Vec<_> = headers.get_all(http::header::FORWARDED).iter().collect();
            Box::new(lines.into_iter().rev().flat_map(|v| {
                let entries: Vec<Option<IpAddr>> = match v.to_str() {
                    Ok(s) => split_elements(s)
                        .into_iter()
                        .rev()
                        .map(forwarded_for)
                        .collect(),
                    Err(_) => vec![None],
                };
                entries
            }))
        }
        ForwardingHeader::XRealIp => {
            let mut values = headers.get_all("x-real-ip").iter();
            let entry = match (values.next(), values.next()) {
                (None, _) => return Box::new(std::iter::empty()),
                // Two X-Real-IP lines: someone added one. Believe neither.
                (Some(_), Some(_)) => None,
                (Some(v), None) => v.to_str().ok().and_then(parse_node),
            };
            Box::new(std::iter::once(entry))
        }
    }
}

/// Split a Forwarded value (RFC 7239) into its comma-separated elements, honouring quotes.
fn split_elements(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// The address in a Forwarded element's `for=` parameter.
fn forwarded_for(element: &str) -> Option<IpAddr> {
    let mut found = None;
    for pair in element.split(';') {
        let (k, v) = pair.split_once('=')?;
        if k.trim().eq_ignore_ascii_case("for") {
            if found.is_some() {
                return None; // two `for=` in one element: ambiguous
            }
            found = Some(v.trim());
        }
    }
    parse_node(found?)
}

/// One node: `1.2.3.4`, `1.2.3.4:80`, `::1`, `[::1]`, `[::1]:80`, optionally quoted.
/// `unknown`, obfuscated identifiers (`_x`) and anything else are `None`.
fn parse_node(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    let s = match s.strip_prefix('"') {
        Some(rest) => rest.strip_suffix('"')?,
        None => s,
    };
    if s.len() > 64 {
        return None;
    }
    let ip = if let Some(rest) = s.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        if !(after.is_empty() || is_port(after.strip_prefix(':')?)) {
            return None;
        }
        IpAddr::V6(inside.parse::<Ipv6Addr>().ok()?)
    } else if let Ok(ip) = s.parse::<IpAddr>() {
        ip
    } else {
        let (host, port) = s.rsplit_once(':')?;
        if !is_port(port) {
            return None;
        }
        IpAddr::V4(host.parse().ok()?)
    };
    Some(ip.to_canonical())
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::tests::headers;

    fn cfg(header: ForwardingHeader) -> ClientIp {
        ClientIp {
            trusted_proxies: vec![
                "127.0.0.1/32".parse().unwrap(),
                "10.0.0.0/8".parse().unwrap(),
                "::1/128".parse().unwrap(),
            ],
            header,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn xff(peer: &str, values: &[&[u8]]) -> IpAddr {
        client_ip(
            ip(peer),
            &headers("x-forwarded-for", values),
            &cfg(ForwardingHeader::XForwardedFor),
        )
    }

    #[test]
    fn untrusted_peer_header_is_ignored() {
        assert_eq!(xff("203.0.113.9", &[b"1.1.1.1"]), ip("203.0.113.9"));
    }

    #[test]
    fn rightmost_untrusted_hop_wins() {
        assert_eq!(
            xff("127.0.0.1", &[b"6.6.6.6, 198.51.100.7, 10.1.2.3"]),
            ip("198.51.100.7")
        );
        // Across repeated header lines, in order.
        assert_eq!(
            xff("127.0.0.1", &[b"6.6.6.6", b"198.51.100.7", b"10.1.2.3"]),
            ip("198.51.100.7")
        );
    }

    #[test]
    fn all_trusted_hops_give_the_leftmost() {
        assert_eq!(xff("127.0.0.1", &[b"10.0.0.5, 10.0.0.6"]), ip("10.0.0.5"));
        assert_eq!(xff("127.0.0.1", &[]), ip("127.0.0.1"));
    }

    #[test]
    fn malformed_entries_stop_at_the_trusted_hop_that_passed_them() {
        assert_eq!(xff("127.0.0.1", &[b"1.2.3.4, garbage"]), ip("127.0.0.1"));
        assert_eq!(
            xff("127.0.0.1", &[b"1.2.3.4, unknown, 10.0.0.9"]),
            ip("10.0.0.9")
        );
        assert_eq!(xff("127.0.0.1", &[b"1.2.3.4,,"]), ip("127.0.0.1"));
        assert_eq!(xff("127.0.0.1", &[b"\xff\xfe"]), ip("127.0.0.1"));
        assert_eq!(xff("127.0.0.1", &[b"999.1.1.1"]), ip("127.0.0.1"));
    }

    #[test]
    fn ports_brackets_and_mapped_addresses() {
        assert_eq!(
            xff("127.0.0.1", &[b"198.51.100.7:4711"]),
            ip("198.51.100.7")
        );
        assert_eq!(xff("127.0.0.1", &[b"[2001:db8::1]:80"]), ip("2001:db8::1"));
        assert_eq!(xff("127.0.0.1", &[b"2001:db8::1"]), ip("2001:db8::1"));
        assert_eq!(
            xff("127.0.0.1", &[b"::ffff:198.51.100.7"]),
            ip("198.51.100.7")
        );
        assert_eq!(
            xff("::ffff:127.0.0.1", &[b"198.51.100.7"]),
            ip("198.51.100.7")
        );
        assert_eq!(xff("127.0.0.1", &[b"[2001:db8::1]:x"]), ip("127.0.0.1"));
    }

    #[test]
    fn forwarded_header() {
        let c = cfg(ForwardingHeader::Forwarded);
        let f = |v: &[u8]| client_ip(ip("127.0.0.1"), &headers("forwarded", &[v]), &c);
        assert_eq!(
            f(b"for=192.0.2.60;proto=http;by=203.0.113.43"),
            ip("192.0.2.60")
        );
        assert_eq!(
            f(b"for=\"[2001:db8:cafe::17]:4711\""),
            ip("2001:db8:cafe::17")
        );
        assert_eq!(
            f(b"for=6.6.6.6, For=198.51.100.1, for=10.0.0.1"),
            ip("198.51.100.1")
        );
        assert_eq!(f(b"for=6.6.6.6, for=unknown"), ip("127.0.0.1"));
        assert_eq!(f(b"for=6.6.6.6, for=_hidden"), ip("127.0.0.1"));
        assert_eq!(f(b"for=6.6.6.6, proto=http"), ip("127.0.0.1"));
        assert_eq!(f(b"for=\"6.6.6.6, for=7.7.7.7\""), ip("127.0.0.1"));
    }

    #[test]
    fn x_real_ip_header() {
        let c = cfg(ForwardingHeader::XRealIp);
        let f = |vs: &[&[u8]]| client_ip(ip("127.0.0.1"), &headers("x-real-ip", vs), &c);
        assert_eq!(f(&[b"198.51.100.2"]), ip("198.51.100.2"));
        assert_eq!(f(&[b"198.51.100.2", b"6.6.6.6"]), ip("127.0.0.1"));
        assert_eq!(f(&[b"1.1.1.1, 2.2.2.2"]), ip("127.0.0.1"));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// Bytes a header value may hold: visible ASCII, space, tab, obs-text.
        fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
            prop::collection::vec(
                prop_oneof![
                    0x20u8..0x7f,
                    Just(b'\t'),
                    0x80u8..=0xff,
                    Just(b','),
                    Just(b':'),
                    Just(b'['),
                    Just(b']'),
                    Just(b';'),
                    Just(b'=')
                ],
                0..80,
            )
        }

        /// One forwarding entry: a client address, a trusted proxy, or something else.
        fn entry() -> impl Strategy<Value = String> {
            prop_oneof![
                (1u8..=223, any::<u8>(), any::<u8>(), 1u8..=254)
                    .prop_map(|(a, b, c, d)| format!("{a}.{b}.{c}.{d}")),
                any::<u8>().prop_map(|d| format!("10.0.0.{d}")),
                (any::<u16>(), 1u16..9999).prop_map(|(x, p)| format!("[2001:db8::{x:x}]:{p}")),
                Just("unknown".to_string()),
                "[a-z_ :.\\[\\]0-9]{0,12}",
            ]
        }

        fn value(h: &HeaderMap, name: &str) -> Vec<IpAddr> {
            h.get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split([',', ';', '"', '=']))
                .filter_map(parse_node)
                .collect()
        }

        crate::proptest_seeds! {
            #![cases(2_000)]

            /// Whatever bytes arrive, the answer is the peer or an address written in the
            /// header; from an untrusted peer it is always the peer.
            #[test]
            fn any_forwarding_header_yields_the_peer_or_a_listed_address(
                lines in prop::collection::vec(header_bytes(), 0..4),
                kind in prop_oneof![Just(ForwardingHeader::XForwardedFor), Just(ForwardingHeader::Forwarded), Just(ForwardingHeader::XRealIp)],
                trusted_peer in any::<bool>(),
            ) {
                let name = match kind {
                    ForwardingHeader::XForwardedFor => "x-forwarded-for",
                    ForwardingHeader::Forwarded => "forwarded",
                    ForwardingHeader::XRealIp => "x-real-ip",
                };
                let lines: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
                let h = headers(name, &lines);
                let peer = if trusted_peer { ip("127.0.0.1") } else { ip("203.0.113.5") };
                let got = client_ip(peer, &h, &cfg(kind));
                if !trusted_peer {
                    prop_assert_eq!(got, peer);
                } else {
                    prop_assert!(got == peer || value(&h, name).contains(&got), "{} is neither the peer nor listed", got);
                }
            }

            /// What a client writes to the left of the first untrusted (or unreadable) hop
            /// never changes its identity: no spoofing by prepending.
            #[test]
            fn prepended_entries_never_change_the_client(
                prefix in prop::collection::vec(entry(), 1..5),
                tail in prop::collection::vec(entry(), 1..6),
            ) {
                let untrusted_or_bad = tail.iter().any(|e| match parse_node(e) {
                    Some(a) => !is_trusted(a, &cfg(ForwardingHeader::XForwardedFor).trusted_proxies),
                    None => true,
                });
                prop_assume!(untrusted_or_bad);
                let c = cfg(ForwardingHeader::XForwardedFor);
                let alone = tail.join(", ");
                let spoofed = format!("{}, {}", prefix.join(", "), alone);
                let a = client_ip(ip("127.0.0.1"), &headers("x-forwarded-for", &[alone.as_bytes()]), &c);
                let b = client_ip(ip("127.0.0.1"), &headers("x-forwarded-for", &[spoofed.as_bytes()]), &c);
                prop_assert_eq!(a, b, "{:?} vs {:?}", alone, spoofed);
            }

        }
    }
}
