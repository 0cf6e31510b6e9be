//! What a request carries up besides its own fields: the forwarding fields of this hop
//! (`X-Forwarded-*`, `Forwarded`, `X-Real-IP`), written from what the gateway saw of the
//! client ([`Downstream`], [`ClientPeer`]); and what it must not carry, the hop-by-hop fields
//! (RFC 9110 §7.6.1), left out both ways.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, HOST};

use super::head::field_line;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Hop-by-hop fields, RFC 9110 §7.6.1: meaningful for one connection only, never
/// forwarded. `Proxy-Connection` and `Keep-Alive` are the legacy ones the section names;
/// `Proxy-Authenticate`/`-Authorization` are hop-by-hop per RFC 9110 §11.7.
pub(super) static HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
];

/// Whether `name` is one of [`HOP_BY_HOP`]: one match on the lowercase name, where a
/// search of the list compares it with each.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "proxy-connection"
            | "keep-alive"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "proxy-authenticate"
            | "proxy-authorization"
    )
}

/// Whether `headers` has a field `name`. A request's usual handful of names is looked at
/// one by one, cheaper than hashing `name` for a lookup; a larger map is looked up.
pub(super) fn carries(headers: &HeaderMap, name: &HeaderName) -> bool {
    match headers.keys_len() <= 8 {
        true => headers.keys().any(|k| k == name),
        false => headers.contains_key(name),
    }
}

/// Remove the hop-by-hop fields, and every field the `Connection` header names. Returns
/// whether there was any (`false`: `headers` is as it was).
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) -> bool {
    // Most messages have none: one pass over the names instead of a lookup for each.
    if !headers.keys().any(is_hop_by_hop) {
        return false;
    }
    if headers.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in &named {
            headers.remove(name);
        }
    }
    for name in HOP_BY_HOP.iter() {
        headers.remove(name);
    }
    true
}

/// Ready a request's fields to go up: its hop-by-hop fields dropped, one `Content-Length`
/// line where it came with several (equal: the screen refused differing ones; HTTP/2 lets
/// them through, and an nginx backend answers 400 to two), and a `Host` where it has none
/// (the authority of an absolute target, else the upstream's `default`). Returns the host
/// the client asked for, which `X-Forwarded-Host` carries, and whether the request came
/// with a `Host` field.
pub(super) fn prepare(
    parts: &mut http::request::Parts,
    default: &HeaderValue,
) -> (Option<HeaderValue>, bool) {
    if carries(&parts.headers, &http::header::CONTENT_LENGTH) {
        let mut lengths = parts.headers.get_all(http::header::CONTENT_LENGTH).iter();
        if let (Some(first), Some(_)) = (lengths.next(), lengths.next()) {
            let first = first.clone();
            parts.headers.insert(http::header::CONTENT_LENGTH, first);
        }
    }
    let given = parts.headers.get(HOST).cloned();
    let host_given = given.is_some();
    let asked = given.or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    // `Connection: host` may have named it away.
    let stripped = strip_hop_by_hop(&mut parts.headers);
    if !host_given || (stripped && !parts.headers.contains_key(HOST)) {
        let host = asked.clone().unwrap_or_else(|| default.clone());
        parts.headers.insert(HOST, host);
    }
    (asked, host_given)
}

/// What the upstream hop needs to know of the client side of a request.
pub struct Downstream<'a> {
    pub peer: &'a ClientPeer,
    /// Whether the peer is a trusted proxy: its forwarding headers are kept and appended
    /// to, where an untrusted peer's are replaced.
    pub trusted: bool,
    /// The longest the client may pause between two reads of its request body.
    pub body_timeout: Duration,
}

/// A client connection's peer, with its address as the forwarding headers show it:
/// rendered once per connection, not once per request.
#[derive(Clone)]
pub struct ClientPeer {
    pub addr: SocketAddr,
    /// `10.0.0.1` or `::1`, as `X-Forwarded-For` and `X-Real-IP` carry it.
    forwarded: HeaderValue,
    /// `10.0.0.1` or `"[::1]"`, as a `Forwarded` node (RFC 7239 §6: an IPv6 address is
    /// bracketed and quoted).
    node: Bytes,
    /// `for=<node>;proto=http` (or `https`): the `Forwarded` element of this hop, what an
    /// untrusted peer's request carries.
    element: HeaderValue,
    /// The lines of an HTTP/1.1 head that replace an untrusted peer's forwarding fields
    /// (`X-Forwarded-For`, `X-Real-IP`, `X-Forwarded-Proto`, `Forwarded`): one copy per
    /// request instead of four fields written.
    replacing: Bytes,
    /// What the TLS handshake agreed, where the client came over the TLS listener.
    pub tls: Option<crate::tls::Session>,
}

impl ClientPeer {
    /// A client of the cleartext listener.
    pub fn new(addr: SocketAddr) -> ClientPeer {
        ClientPeer::with_tls(addr, None)
    }

    /// A client, over TLS where `tls` says what its handshake agreed.
    pub fn with_tls(addr: SocketAddr, tls: Option<crate::tls::Session>) -> ClientPeer {
        let ip = addr.ip().to_canonical();
        let text = ip.to_string();
        let node = match ip {
            IpAddr::V4(_) => text.clone(),
            IpAddr::V6(_) => format!("\"[{text}]\""),
        };
        // An address's text is always a valid header value.
        let value = |s: String| {
            HeaderValue::from_maybe_shared(Bytes::from(s))
                .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
        };
        let mut peer = ClientPeer {
            addr,
            forwarded: value(text),
            element: value(format!(
                "for={node};proto={}",
                if tls.is_some() { "https" } else { "http" }
            )),
            node: Bytes::from(node),
            replacing: Bytes::new(),
            tls,
        };
        let mut lines = Vec::new();
        replacing_fields(&mut lines, &peer);
        peer.replacing = Bytes::from(lines);
        peer
    }

    pub fn ip(&self) -> IpAddr {
        self.addr.ip()
    }

    /// The scheme the client used: `https` over the TLS listener.
    pub fn proto(&self) -> &'static [u8] {
        match self.tls {
            Some(_) => b"https",
            None => b"http",
        }
    }
}

/// The forwarding fields a request came with, as [`fields`] treats them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Forwarding {
    For,
    Forwarded,
    Proto,
    Host,
    /// `X-Real-IP` and every other `X-Forwarded-*`.
    Other,
}

impl Forwarding {
    fn of(name: &HeaderName) -> Option<Forwarding> {
        let n = name.as_str();
        Some(match n {
            "x-forwarded-for" => Forwarding::For,
            "forwarded" => Forwarding::Forwarded,
            "x-forwarded-proto" => Forwarding::Proto,
            "x-forwarded-host" => Forwarding::Host,
            "x-real-ip" => Forwarding::Other,
            _ if n.starts_with("x-forwarded-") => Forwarding::Other,
            _ => return None,
        })
    }
}

/// A request's trailers as they go up (after [`super::body::clean_trailers`]): never a
/// forwarding field (`X-Forwarded-*`, `Forwarded`, `X-Real-IP`), which the gateway sets
/// in the head alone, nor any of `screened` (a rule's cost header: a client's own copy
/// must not reach a backend that could echo it back as a cost).
pub(super) fn screen_request_trailers(map: &mut HeaderMap, screened: Option<&[HeaderName]>) {
    let forwarding: Vec<HeaderName> = map
        .keys()
        .filter(|n| Forwarding::of(n).is_some())
        .cloned()
        .collect();
    for name in forwarding.iter().chain(screened.unwrap_or_default()) {
        map.remove(name);
    }
}

/// Which forwarding fields a trusted proxy set itself.
#[derive(Default)]
struct Kept {
    proto: bool,
    host: bool,
}

static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Where a request's fields are written on their way up: the bytes of an HTTP/1.1 head
/// (`Vec<u8>`), or the header map of an HTTP/2 request ([`MapFields`]). One writer of the
/// forwarding rules ([`fields`]) for both.
pub(super) trait FieldSink {
    /// A field of the client's request, as it came.
    fn keep(&mut self, name: &HeaderName, value: &HeaderValue);
    /// A field of this hop, its value the concatenation of `parts`.
    fn add(&mut self, name: &HeaderName, parts: &[&[u8]]) {
        self.begin(name);
        for p in parts {
            self.push(p);
        }
        self.end();
    }
    /// The forwarding fields of this hop that replace an untrusted peer's.
    fn replacing(&mut self, peer: &ClientPeer) {
        replacing_fields(self, peer);
    }
    /// A field of this hop written piece by piece: its name, its value's pieces, its end.
    fn begin(&mut self, name: &HeaderName);
    fn push(&mut self, bytes: &[u8]);
    fn end(&mut self);
}

/// [`FieldSink::replacing`], a field at a time.
fn replacing_fields(out: &mut (impl FieldSink + ?Sized), peer: &ClientPeer) {
    out.add(&X_FORWARDED_FOR, &[peer.forwarded.as_bytes()]);
    out.add(&X_REAL_IP, &[peer.forwarded.as_bytes()]);
    out.add(&X_FORWARDED_PROTO, &[peer.proto()]);
    out.add(&http::header::FORWARDED, &[peer.element.as_bytes()]);
}

/// The HTTP/1.1 head: each field a line, written straight into it.
impl FieldSink for Vec<u8> {
    fn keep(&mut self, name: &HeaderName, value: &HeaderValue) {
        field_line(self, name.as_str(), &[value.as_bytes()]);
    }

    fn replacing(&mut self, peer: &ClientPeer) {
        // Rendered with the peer, once per connection.
        self.extend_from_slice(&peer.replacing);
    }

    fn begin(&mut self, name: &HeaderName) {
        self.extend_from_slice(name.as_str().as_bytes());
        self.extend_from_slice(b": ");
    }

    fn push(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn end(&mut self) {
        self.extend_from_slice(b"\r\n");
    }
}

/// An HTTP/2 request's header map, built from the client's fields. `Host` is left out:
/// HTTP/2 carries it as `:authority` (RFC 9113 §8.3.1).
pub(super) struct MapFields {
    pub(super) map: HeaderMap,
    /// The field being written: its name and value so far.
    pending: Option<(HeaderName, Vec<u8>)>,
}

impl MapFields {
    pub(super) fn with_capacity(n: usize) -> MapFields {
        MapFields {
            map: HeaderMap::with_capacity(n),
            pending: None,
        }
    }
}

impl FieldSink for MapFields {
    fn keep(&mut self, name: &HeaderName, value: &HeaderValue) {
        if name != HOST {
            self.map.append(name.clone(), value.clone());
        }
    }

    fn begin(&mut self, name: &HeaderName) {
        self.pending = Some((name.clone(), Vec::with_capacity(64)));
    }

    fn push(&mut self, bytes: &[u8]) {
        if let Some((_, value)) = self.pending.as_mut() {
            value.extend_from_slice(bytes);
        }
    }

    fn end(&mut self) {
        if let Some((name, value)) = self.pending.take() {
            // Made of fields that were valid values, and addresses: always valid.
            if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
                self.map.append(name, value);
            }
        }
    }
}

/// The fields of a request going up: its own fields, then the forwarding fields of
/// this hop. From a trusted proxy the forwarding fields tell a story that began before
/// it: `X-Forwarded-Proto` and `X-Forwarded-Host` are kept as that proxy set them (and
/// written here only where it did not), `X-Real-IP` as it came, and the peer is appended
/// to `X-Forwarded-For` and, where the proxy sent one, to `Forwarded` (RFC 7239 §7.1) — so
/// the two chains agree, and a `Forwarded: proto=https` is never contradicted by an
/// `X-Forwarded-Proto` written here. From any other peer nothing it says about itself is
/// believed: every `X-Forwarded-*`, `Forwarded` and `X-Real-IP` field it sent is left
/// out, and each is written anew from what the gateway itself saw (the peer, `http`, the
/// `Host`). For HTTP/1.1 written straight into the head, not put in the header map first:
/// no insertion, no growth of the map per request.
pub(super) fn fields(
    out: &mut impl FieldSink,
    headers: &HeaderMap,
    down: &Downstream<'_>,
    host: Option<&HeaderValue>,
) {
    let mut kept = Kept::default();
    for (name, value) in headers {
        if let Some(field) = Forwarding::of(name) {
            if !down.trusted {
                continue;
            }
            match field {
                // Re-written below, the peer appended.
                Forwarding::For | Forwarding::Forwarded => continue,
                Forwarding::Proto => kept.proto = true,
                Forwarding::Host => kept.host = true,
                Forwarding::Other => {}
            }
        }
        out.keep(name, value);
    }
    if down.trusted {
        appended(out, headers, down.peer, host, kept);
    } else {
        replaced(out, down.peer, host);
    }
}

/// A trusted proxy's chains with the peer appended, and what it left unsaid.
fn appended(
    out: &mut impl FieldSink,
    headers: &HeaderMap,
    peer: &ClientPeer,
    host: Option<&HeaderValue>,
    kept: Kept,
) {
    appended_line(out, headers, &X_FORWARDED_FOR, &[peer.forwarded.as_bytes()]);
    if headers.contains_key(http::header::FORWARDED) {
        appended_line(
            out,
            headers,
            &http::header::FORWARDED,
            &[b"for=", &peer.node],
        );
    }
    if !kept.proto {
        out.add(&X_FORWARDED_PROTO, &[peer.proto()]);
    }
    if let Some(host) = host.filter(|_| !kept.host) {
        out.add(&X_FORWARDED_HOST, &[host.as_bytes()]);
    }
}

/// What the gateway itself saw, in place of all an untrusted peer said.
fn replaced(out: &mut impl FieldSink, peer: &ClientPeer, host: Option<&HeaderValue>) {
    out.replacing(peer);
    if let Some(host) = host {
        out.add(&X_FORWARDED_HOST, &[host.as_bytes()]);
    }
}

/// `name: <its values, joined>, <element>` as one field.
fn appended_line(
    out: &mut impl FieldSink,
    headers: &HeaderMap,
    name: &HeaderName,
    element: &[&[u8]],
) {
    out.begin(name);
    for v in headers.get_all(name) {
        out.push(v.as_bytes());
        out.push(b", ");
    }
    for p in element {
        out.push(p);
    }
    out.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `carries` answers as `contains_key` does, in a small map and a large one.
    #[test]
    fn carries_is_contains_key() {
        let mut map = HeaderMap::new();
        let names: Vec<HeaderName> = (0..12)
            .map(|i| HeaderName::from_bytes(format!("x-n{i}").as_bytes()).expect("a name"))
            .collect();
        for (i, name) in names.iter().enumerate() {
            map.append(name.clone(), HeaderValue::from_static("v"));
            map.append(name.clone(), HeaderValue::from_static("w"));
            for probe in names.iter().chain([&HOST, &http::header::TE]) {
                assert_eq!(carries(&map, probe), map.contains_key(probe), "{i} {probe}");
            }
        }
    }

    /// The lines rendered with a peer are the fields written one at a time, over TCP and
    /// TLS, IPv4 and IPv6.
    #[test]
    fn replacing_lines_are_the_fields_written_one_by_one() {
        for addr in ["10.0.0.1:1", "[2001:db8::1]:1", "[::ffff:10.0.0.2]:1"] {
            let peer = ClientPeer::new(addr.parse().expect("an address"));
            let mut one_by_one = Vec::new();
            replacing_fields(&mut one_by_one, &peer);
            let mut lines = Vec::new();
            lines.replacing(&peer);
            assert_eq!(lines, one_by_one, "{addr}");
            let text = String::from_utf8(lines).expect("text");
            assert!(text.starts_with("x-forwarded-for: "), "{text}");
            assert!(text.ends_with(";proto=http\r\n"), "{text}");
        }
    }
    use http::Request;

    #[test]
    fn strips_hop_by_hop_and_connection_named_fields() {
        let mut h = HeaderMap::new();
        h.insert(
            CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop , close"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-end-to-end"], "kept");
    }

    #[test]
    fn the_hop_by_hop_match_is_the_list() {
        for name in &HOP_BY_HOP {
            assert!(is_hop_by_hop(name), "{name}");
        }
        for name in ["host", "content-length", "x-connection", "tee", "upgrades"] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
        }
    }

    /// The head written for `request` from `peer`, trusted or not.
    fn forwarded_head(request: Request<()>, peer: &str, trusted: bool) -> String {
        let (parts, ()) = request.into_parts();
        let peer = ClientPeer::new(peer.parse().unwrap());
        let down = Downstream {
            peer: &peer,
            trusted,
            body_timeout: Duration::from_secs(1),
        };
        let host = parts.headers.get(HOST).cloned();
        let head =
            super::super::head::request(&parts, "", false, &down, host.as_ref(), None).unwrap();
        String::from_utf8(head).unwrap()
    }

    #[test]
    fn forwarding_fields_are_appended_from_trusted_peers_and_replaced_from_others() {
        let request = || {
            Request::get("/x")
                .header("host", "app.test")
                .header("x-forwarded-for", "1.1.1.1")
                .header("x-forwarded-for", "2.2.2.2")
                .header("x-forwarded-proto", "https")
                .header("forwarded", "for=1.1.1.1;proto=https")
                .header("x-forwarded-port", "443")
                .header("x-real-ip", "1.1.1.1")
                .header("x-other", "kept")
                .body(())
                .unwrap()
        };
        assert_eq!(
            forwarded_head(request(), "[::ffff:10.0.0.1]:4000", true),
            "GET /x HTTP/1.1\r\nhost: app.test\r\nx-forwarded-proto: https\r\n\
             x-forwarded-port: 443\r\nx-real-ip: 1.1.1.1\r\nx-other: kept\r\n\
             x-forwarded-for: 1.1.1.1, 2.2.2.2, 10.0.0.1\r\n\
             forwarded: for=1.1.1.1;proto=https, for=10.0.0.1\r\n\
             x-forwarded-host: app.test\r\n\r\n"
        );
        assert_eq!(
            forwarded_head(request(), "[2001:db8::7]:4000", false),
            "GET /x HTTP/1.1\r\nhost: app.test\r\nx-other: kept\r\n\
             x-forwarded-for: 2001:db8::7\r\nx-real-ip: 2001:db8::7\r\n\
             x-forwarded-proto: http\r\nforwarded: for=\"[2001:db8::7]\";proto=http\r\n\
             x-forwarded-host: app.test\r\n\r\n"
        );
        // A trusted proxy that sent no Forwarded gets none: its chain is X-Forwarded-For.
        let plain = Request::get("/").header("host", "a").body(()).unwrap();
        let head = forwarded_head(plain, "127.0.0.1:1", true);
        assert!(!head.contains("forwarded:"), "{head}");
        assert!(head.contains("x-forwarded-for: 127.0.0.1\r\n"), "{head}");
    }
}
