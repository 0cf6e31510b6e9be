//! The egress gateway (issue 45): an HTTP forward proxy on a listener of its own
//! (`[egress] listen`, loopback by default) for the calls a company's services make to
//! APIs it does not own, kept under those APIs' limits by the rules with `match = {
//! egress = true }` (keyed by `target`, `credential`, `caller`: docs/egress.md).
//!
//! It is never open. A call names its target in one of two ways, and a target that is
//! not listed in `[[egress.targets]]` is refused with 403 problem+json, as is a listed
//! name that resolves to a private, loopback or link-local address (unless the target
//! says `allow_private = true`): no way into the network through DNS. The address
//! checked is the one connected to.
//!
//! - **Absolute-form** (`GET http://api.example.com/v1/x`, what `http_proxy` makes a
//!   client send): the call is seen whole and limited per call, and goes to the target
//!   over TLS where the target says `tls = true` (verified against the system's roots or
//!   its `ca`).
//! - **`CONNECT host:port`** (what a client that keeps its own TLS sends): limited per new
//!   tunnel, and by concurrent tunnels (a `max_in_flight` rule holds its slot for the
//!   tunnel's life); the calls inside are not seen.

mod forward;
pub mod learn;

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;

use crate::config::egress::{Egress, Target};
use crate::config::Config;
use crate::connection::{self, InFlight, Track, Tracked};
use crate::decide::{self, Decided};
use crate::front_end::{Accepted, FrontEnd, Handler, Serves, Shared};
use crate::headers::{self, Problem};
use crate::runtime::requests::FrontEndKind;
use crate::runtime::Metrics;

/// An egress answer's body: the target's, streamed, or the gateway's own.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Reply = Response<Body>;

/// The egress gateway, as the server starts it (`[egress] listen`).
pub const FRONT_END: EgressFrontEnd = EgressFrontEnd;

/// Open connections the egress listener keeps at most: a fleet's services keep pools of
/// a few each.
pub const MAX_CONNECTIONS: usize = 4096;

/// How long calls still under way get once the workers are done.
pub const GRACE: Duration = Duration::from_secs(5);

pub struct EgressFrontEnd;

impl FrontEnd for EgressFrontEnd {
    fn name(&self) -> &'static str {
        "egress"
    }

    fn listen(&self, config: &Config) -> Option<SocketAddr> {
        config.egress.as_ref().map(|e| e.listen)
    }

    fn max_connections(&self, _: &Config) -> usize {
        MAX_CONNECTIONS
    }

    fn grace(&self, _: &Config) -> Duration {
        GRACE
    }

    fn handler(&self, shared: &Shared) -> Box<dyn Serves> {
        Box::new(Ctx { shared: shared.clone() })
    }
}

/// What every call through the egress gateway runs on: the configuration and metrics
/// the proxy shares. Cloned for each connection.
#[derive(Clone)]
pub struct Ctx {
    shared: Shared,
}

impl Handler for Ctx {
    fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static> {
        let settings = self.shared.live().config.server.connections();
        let ctx = self.clone();
        let (stream, peer, registry, permit) =
            (conn.stream, conn.peer, conn.registry.clone(), conn.permit);
        Some(async move {
            connection::serve(stream, &registry, permit, settings, |track| {
                ctx.service(peer, track)
            })
            .await
        })
    }
}

impl Ctx {
    fn metrics(&self) -> &Arc<Metrics> {
        self.shared.metrics()
    }

    fn service(self, peer: SocketAddr, track: Arc<Track>) -> impl connection::Service<Tracked<Body>> {
        service_fn(move |req: Request<Incoming>| {
            let request = InFlight::new(&track);
            let http2 = req.version() == http::Version::HTTP_2;
            let ctx = self.clone();
            let track = track.clone();
            async move {
                let answer = ctx.handle(peer, req, &track).await;
                Ok::<_, Infallible>(answer.map(|body| Tracked::new(body, request, http2)))
            }
        })
    }

    async fn handle(&self, peer: SocketAddr, mut req: Request<Incoming>, track: &Arc<Track>) -> Reply {
        let live = self.shared.live();
        let Some(egress) = &live.config.egress else {
            return problem(&Problem::new(StatusCode::FORBIDDEN, "[egress] is not configured"));
        };
        // What is not sent on is not looked at either: a credential named in
        // `Connection` is dropped before any rule counts by it.
        strip_hop_by_hop(req.headers_mut());
        let client = peer.ip().to_canonical();
        let call = match Call::of(egress, &req) {
            Ok(call) => call,
            Err(p) => return refused_call(req.method(), None, client, &p),
        };
        let addr = match call.resolve(egress).await {
            Ok(addr) => addr,
            Err(p) => return refused_call(req.method(), Some(&call), client, &p),
        };
        // The rules of the calls going out, decided as the proxy decides a request, on
        // the headers the target is sent (the Host the call named).
        if let Ok(v) = HeaderValue::from_str(&call.authority) {
            req.headers_mut().insert(header::HOST, v);
        }
        let cfg = &*live.config;
        let tunnel = req.method() == Method::CONNECT;
        let path = cfg.index.path_of(req.uri().path());
        let fitting = cfg.index.egress_matching(req.method(), &path, &call.host, tunnel);
        // Who calls is the connection's peer: no forwarding header is believed here
        // (`caller`, `client_ip`), whatever `[client_ip] trusted_proxies` says for the
        // proxy.
        let requester = crate::identity::Requester::new(req.headers(), client, &cfg.keys, &NO_PROXIES);
        let mut d = Decided::default();
        let result = decide::decide_rules(&live, fitting, &requester, None, &mut d).await;
        let named = |i| decide::named(cfg, &requester, i);
        (self.metrics()).decided(&live, FrontEndKind::Egress, d.disposition, &d.counts, named);
        let style = cfg.response;
        if let Err(rejected) = result {
            let mut r = problem(&rejected.problem);
            headers::add_ratelimit(r.headers_mut(), style, &d.applied);
            access_line(req.method(), Some(&call), client, &d, r.status().as_u16());
            return r;
        }
        d.count_passed(&live);
        // `max_delay`: the call waits for the tokens it took ahead, then goes.
        if !d.waited.is_zero() {
            tokio::time::sleep(d.waited).await;
        }
        let leases = d.leases.take();
        let method = req.method().clone();
        let mut answer = if tunnel {
            // The tunnel holds its connection: no clock of HTTP's runs over its bytes.
            let hold = track.hold();
            forward::tunnel(req, addr, egress.tunnel_idle, egress.timeout, (leases, hold)).await
        } else {
            forward::call(req, &call, addr, egress.timeout, leases).await
        };
        headers::add_ratelimit(answer.headers_mut(), style, &d.applied);
        access_line(&method, Some(&call), client, &d, answer.status().as_u16());
        answer
    }
}

/// No trusted proxies: the egress gateway's callers are who connect to it.
static NO_PROXIES: std::sync::LazyLock<crate::identity::ClientIp> =
    std::sync::LazyLock::new(crate::identity::ClientIp::default);

/// A call refused before any rule (not a listed target, a private address, a malformed
/// request): answered, and its access line written (`decision` refused).
fn refused_call(method: &Method, call: Option<&Call<'_>>, client: IpAddr, p: &Problem) -> Reply {
    use crate::telemetry::disposition::Disposition;
    // A malformed call's, or one no target takes (the proxy's no route).
    let disposition = match p.status {
        StatusCode::BAD_REQUEST => Disposition::Malformed { not_implemented: false },
        _ => Disposition::NoRoute,
    };
    let d = Decided {
        disposition,
        ..Decided::default()
    };
    access_line(method, call, client, &d, p.status.as_u16());
    problem(p)
}

/// Where a call goes: its target, host and port, as the request names them.
pub(crate) struct Call<'e> {
    pub target: &'e Target,
    /// Lower-cased, without a trailing dot or brackets.
    pub host: String,
    pub port: u16,
    /// `host:port` as the request named it (the `Host` the target is sent).
    pub authority: String,
    /// Over TLS to the target (an absolute-form call to a `tls = true` target).
    pub tls: bool,
}

impl<'e> Call<'e> {
    /// The target `req` names, or why it may not go: an absolute-form `http://` request
    /// or a `CONNECT host:port`, to a listed host, on one of its ports.
    fn of(egress: &'e Egress, req: &Request<Incoming>) -> Result<Call<'e>, Box<Problem>> {
        let uri = req.uri();
        let connect = req.method() == Method::CONNECT;
        let Some(authority) = uri.authority() else {
            return Err(refused(
                StatusCode::BAD_REQUEST,
                "the egress gateway takes absolute-form calls (http://host/path, as http_proxy sends them) or CONNECT host:port",
            ));
        };
        if !connect && uri.scheme_str() != Some("http") {
            return Err(refused(
                StatusCode::BAD_REQUEST,
                "an absolute-form call is http://: for https, CONNECT (the client's TLS), or http:// to a target with tls = true",
            ));
        }
        if authority.as_str().contains('@') {
            // Userinfo is no part of where a call goes (RFC 9110 §4.2.4 deprecates it): a
            // name before `@` would be another key, and a credential sent in the Host.
            return Err(refused(
                StatusCode::BAD_REQUEST,
                "a call's authority has no userinfo (user@host): send credentials in headers",
            ));
        }
        let raw_host = authority.host();
        let host = raw_host.trim_start_matches('[').trim_end_matches(']');
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        let Some((_, target)) = egress.target(&host) else {
            return Err(refused(
                StatusCode::FORBIDDEN,
                format!("{host} is not a listed target ([[egress.targets]])"),
            ));
        };
        if connect && !target.connect {
            return Err(refused(
                StatusCode::FORBIDDEN,
                format!("CONNECT to {host} is not allowed: its target does not say connect = true"),
            ));
        }
        let tls = !connect && target.tls;
        let port = match (authority.port_u16(), connect, tls) {
            (Some(p), _, _) => p,
            (None, true, _) => {
                return Err(refused(StatusCode::BAD_REQUEST, "CONNECT names host:port"))
            }
            (None, false, true) => 443,
            (None, false, false) => 80,
        };
        if !target.ports.contains(&port) {
            return Err(refused(
                StatusCode::FORBIDDEN,
                format!("port {port} of {host} is not one of its target's ports"),
            ));
        }
        // The Host the target is sent, and the rules read: the host and the port the
        // call named, nothing else.
        let authority = match authority.port_u16() {
            Some(p) => format!("{host}:{p}"),
            None => host.clone(),
        };
        Ok(Call {
            target,
            authority,
            host,
            port,
            tls,
        })
    }

    /// The address to connect to: the first the name resolves to, every one of them
    /// public unless the target allows private ones (a name that resolves to one private
    /// address among public ones is refused whole: which one a client library would pick
    /// is not ours to guess).
    async fn resolve(&self, egress: &Egress) -> Result<SocketAddr, Box<Problem>> {
        let found = tokio::time::timeout(
            egress.timeout,
            tokio::net::lookup_host((self.host.as_str(), self.port)),
        )
        .await;
        let addrs: Vec<SocketAddr> = match found {
            Ok(Ok(addrs)) => addrs.collect(),
            Ok(Err(e)) => {
                return Err(refused(
                    StatusCode::BAD_GATEWAY,
                    format!("{} does not resolve: {e}", self.host),
                ))
            }
            Err(_) => {
                return Err(refused(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("{} did not resolve in time", self.host),
                ))
            }
        };
        if !self.target.allow_private {
            if let Some(private) = addrs.iter().find(|a| !is_public(a.ip())) {
                // The address is the operator's to see, not the caller's.
                tracing::info!(host = %self.host, address = %private.ip(), "egress call refused: its target resolves to a private address");
                return Err(refused(
                    StatusCode::FORBIDDEN,
                    format!(
                        "{} resolves to a private, loopback or link-local address: its target does not say allow_private = true",
                        self.host
                    ),
                ));
            }
        }
        addrs.first().copied().ok_or_else(|| {
            refused(StatusCode::BAD_GATEWAY, format!("{} resolves to no address", self.host))
        })
    }
}

/// Whether `ip` is an address of the public internet: not loopback, private (RFC 1918,
/// RFC 4193), link-local, shared (RFC 6598), unspecified, multicast, broadcast or
/// documentation; an IPv4-mapped IPv6 address as its IPv4.
pub fn is_public(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            let [s0, s1, ..] = v6.segments();
            // Global unicast (2000::/3) only, without the ranges that carry or stand for
            // another address (documentation 2001:db8::/32, Teredo 2001::/32, 6to4
            // 2002::/16); NAT64, IPv4-compatible, site-local and the rest lie outside it.
            (s0 & 0xe000) == 0x2000 && !(s0 == 0x2001 && (s1 == 0x0db8 || s1 == 0)) && s0 != 0x2002
        }
    }
}

/// Why a call does not go, boxed (a [`Problem`] is large).
pub(crate) fn refused(status: StatusCode, detail: impl Into<std::borrow::Cow<'static, str>>) -> Box<Problem> {
    Box::new(Problem::new(status, detail))
}

/// The gateway's own answer.
pub fn problem(p: &Problem) -> Reply {
    let mut r = Response::new(full(p.body.clone()));
    *r.status_mut() = p.status;
    p.headers(r.headers_mut());
    r
}

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// The access line of an egress call (target `ratewall::access`): the target and port
/// it went to (never its path's query, which may carry a credential), and how long it
/// waited for its tokens.
fn access_line(method: &Method, call: Option<&Call<'_>>, client: IpAddr, d: &Decided<'_>, status: u16) {
    match call {
        Some(call) => {
            let target = format_args!("{}:{}", call.host, call.port);
            crate::service::access_line("egress", method.as_str(), &target, Some(client), d, status);
        }
        None => crate::service::access_line("egress", method.as_str(), &"-", Some(client), d, status),
    }
}

/// What a response takes off its way: the hop-by-hop fields of RFC 9110 §7.6.1, and the
/// proxy's own.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<header::HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| header::HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(n);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_public() {
        for private in [
            "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0",
            "100.64.0.1", "224.0.0.1", "255.255.255.255", "192.0.2.1", "::1", "::", "fc00::1",
            "fe80::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2001:db8::1", "ff02::1", "240.0.0.1", "198.18.0.1",
            "64:ff9b::a9fe:a9fe", "::a9fe:a9fe", "2002:a9fe:a9fe::1", "2001:0:4136:e378::1", "fec0::1", "100::1",
        ] {
            assert!(!is_public(private.parse().expect("an address")), "{private}");
        }
        for public in ["1.1.1.1", "8.8.8.8", "140.82.112.3", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(public.parse().expect("an address")), "{public}");
        }
    }
}
