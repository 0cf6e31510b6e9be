//! Forward-auth: `GET|POST /v1/forward-auth`, the decision asked by a proxy that stays in
//! front (Traefik's `ForwardAuth`, Caddy's `forward_auth`, nginx's `auth_request`) about
//! the request it holds. The call describes that original request in headers:
//!
//! | proxy | method | target | host | client |
//! | --- | --- | --- | --- | --- |
//! | Traefik, Caddy | `X-Forwarded-Method` | `X-Forwarded-Uri` | `X-Forwarded-Host` | `X-Forwarded-For` |
//! | nginx (docs/forward-auth.md's snippet) | `X-Original-Method` | `X-Original-URI` | `X-Forwarded-Host` or `Host` | `X-Forwarded-For` |
//!
//! and carries the original request's other fields as they came (its `x-api-key`, its
//! `Authorization`: which is why forward-auth takes no token of its own). Those
//! descriptions are believed only from a peer inside `[client_ip] trusted_proxies` (as
//! the proxy believes a forwarding header only from there) or one whose TLS handshake
//! verified a client certificate (where the service hands it on); any other caller is judged as the call it made (its
//! method, `/v1/forward-auth`, its own address). A description that does not add up (a
//! field twice, two that disagree, a target that is not a path, a host that is not a
//! host) is a 400: never a guess, never a request let through unjudged.
//!
//! The original request is then decided by the proxy's own core ([`decide::decide`]: the
//! same rules, identities, plans, JWT verification, shadow and rollout, the same store
//! keys), its counts handed to [`Metrics::decided`] and its end to [`Metrics::ended`].
//! The answer: 200 with the `RateLimit` fields, for the calling proxy to copy (Traefik's
//! `authResponseHeaders`, Caddy's `copy_headers` or `request_header`); a denial's 429
//! with `Retry-After` and problem+json, or the status `[decide] forward_auth = {
//! deny_status = 403 }` names (nginx's `auth_request` takes only 2xx, 401 and 403 from
//! its auth server); any other refusal as the proxy writes it (401, 503, …).
//!
//! What forward-auth cannot do, since it never sees the answer: settle. A rule that
//! charges by the answer (`charge`, `cost_header`, `cost_from`) stands as charged at the
//! decision. Concurrency leases are given back at once: the slot is held only while the
//! decision is made (docs/forward-auth.md).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use http::header::HOST;
use http::request::Parts;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::config::Config;
use crate::decide::{self, head, Decided, Subject};
use crate::headers::{self, Problem};
use crate::identity::ClientCert;
use crate::runtime::requests::FrontEndKind;
use crate::runtime::{Ended, Live, Metrics};
use crate::telemetry::Disposition;

/// The fields a calling proxy describes the original request with; dropped from the
/// headers the decision reads, so that no rule keys on them.
const X_FORWARDED_METHOD: HeaderName = HeaderName::from_static("x-forwarded-method");
const X_FORWARDED_URI: HeaderName = HeaderName::from_static("x-forwarded-uri");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_ORIGINAL_METHOD: HeaderName = HeaderName::from_static("x-original-method");
const X_ORIGINAL_URI: HeaderName = HeaderName::from_static("x-original-uri");

/// The status a denial is answered with: `[decide] forward_auth = { deny_status }`, 429
/// unless it says otherwise.
fn deny_status(live: &Live) -> StatusCode {
    live.config
        .decide
        .as_ref()
        .map_or(StatusCode::TOO_MANY_REQUESTS, |d| d.forward_auth_deny)
}

/// Answer one forward-auth call from `peer` (the calling proxy). The body, if any, is
/// never read.
pub async fn call(
    ctx: &super::Ctx,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let live = ctx.live();
    let (parts, _body) = req.into_parts();
    answer(&live, ctx.metrics(), peer.ip(), &parts).await
}

/// The answer to the call `parts` from `peer`, on `live`, counted in `metrics`.
async fn answer(
    live: &Live,
    metrics: &Metrics,
    peer: IpAddr,
    parts: &Parts,
) -> Response<Full<Bytes>> {
    let started = Instant::now();
    let cfg = &*live.config;
    let mut decided = Decided::default();
    let described;
    let subject = if believed(cfg, peer, parts) {
        described = match Original::of(parts, cfg.server.underscores_in_headers) {
            Ok(o) => o,
            Err(p) => {
                tracing::debug!(%peer, detail = p.detail.as_deref(), "forward-auth: the original request is not described soundly");
                decided.disposed(Disposition::Malformed {
                    not_implemented: false,
                });
                let resp = written(*p, &[], &[], live, None);
                let seen = (&parts.method, parts.uri.path(), None);
                return finish(metrics, &decided, started, resp, seen);
            }
        };
        described.subject(peer)
    } else {
        // Not a proxy it trusts: whatever it says of another request is its own word.
        Subject {
            method: &parts.method,
            uri: &parts.uri,
            headers: &parts.headers,
            peer,
            client_cert: None,
        }
    };
    let requester = subject.requester(cfg);
    let result = decide::decide(live, &subject, &requester, None, &mut decided).await;
    let named = |index| decide::named(cfg, &requester, index);
    let kind = FrontEndKind::ForwardAuth;
    metrics.decided(live, kind, decided.disposition, &decided.counts, named);
    // Nothing here follows the answer: a settlement would never come, and a lease would
    // be held for a request this process never sees end.
    if let Some(settling) = decided.settling.take() {
        // The charges stand as taken: marked as sent on, so that dropping them gives
        // nothing back.
        settling.reached().store(true, Ordering::Relaxed);
    }
    drop(decided.leases.take());
    let resp = match result {
        Ok(()) => {
            if !decided.waited.is_zero() {
                // `max_delay`: the proxy's answer waits, as a proxied request would.
                tokio::time::sleep(decided.waited).await;
            }
            decided.slots.clear();
            // Its answer is known now: the passes are counted, as the proxy counts them
            // once the upstream answered.
            decided.count_passed(live);
            let mut resp = Response::new(Full::new(Bytes::new()));
            let h = resp.headers_mut();
            headers::add_ratelimit(h, cfg.response, &decided.applied);
            headers::add_shadow(h, cfg.response, &decided.shadow);
            // A verified token's claims (`[jwt] forward_claims`), for the proxy to copy
            // to the backend as it copies the RateLimit fields.
            for (name, value) in std::mem::take(&mut decided.claims) {
                h.append(name, value);
            }
            resp
        }
        Err(r) => {
            let shown: (&[_], &[_]) = match r.shows_limits {
                true => (&decided.applied, &decided.shadow),
                false => (&[], &[]),
            };
            let deny =
                (r.problem.status == StatusCode::TOO_MANY_REQUESTS).then(|| deny_status(live));
            written(r.problem, shown.0, shown.1, live, deny)
        }
    };
    let seen = (
        subject.method,
        subject.uri.path(),
        Some(requester.client_ip()),
    );
    finish(metrics, &decided, started, resp, seen)
}

/// A refusal as problem+json, with the rules' fields it shows; `status`: another status
/// than the problem's (a denial's `deny_status`).
fn written(
    p: Problem,
    applied: &[headers::Applied<'_>],
    shadow: &[headers::Applied<'_>],
    live: &Live,
    status: Option<StatusCode>,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(p.body.clone()));
    *resp.status_mut() = status.unwrap_or(p.status);
    let h = resp.headers_mut();
    p.headers(h);
    headers::add_ratelimit(h, live.config.response, applied);
    headers::add_shadow(h, live.config.response, shadow);
    resp
}

/// Count the call as over ([`Metrics::ended`]) and write its access line, under the
/// status it stands for (a denial's 429, whatever `deny_status` sent). `seen`: the
/// method, path and client of the request decided (the described one, or the call).
fn finish(
    metrics: &Metrics,
    decided: &Decided<'_>,
    started: Instant,
    resp: Response<Full<Bytes>>,
    seen: (&Method, &str, Option<IpAddr>),
) -> Response<Full<Bytes>> {
    let status = match decided.disposition {
        Disposition::Denied => StatusCode::TOO_MANY_REQUESTS.as_u16(),
        _ => resp.status().as_u16(),
    };
    let (method, path, client) = seen;
    super::access_line(
        "forward_auth",
        method.as_str(),
        &path,
        client,
        decided,
        status,
    );
    metrics.ended(&Ended {
        disposition: decided.disposition,
        upstream: false,
        status,
        took: started.elapsed(),
    });
    resp
}

/// The original request, as a trusted proxy described it.
struct Original {
    method: Method,
    uri: Uri,
    /// The call's fields, less the description's, with `Host` the original host.
    headers: HeaderMap,
}

impl Original {
    /// Read the description off the call's head `parts`; a 400 where it does not add up.
    /// `underscores`: whether fields with `_` in their name are kept (`[server]
    /// underscores_in_headers`), as the proxy keeps them.
    fn of(parts: &Parts, underscores: bool) -> Result<Original, Bad> {
        let h = &parts.headers;
        let method = agreed(h, &X_FORWARDED_METHOD, &X_ORIGINAL_METHOD)?
            .ok_or_else(|| bad("no X-Forwarded-Method or X-Original-Method: the original request's method is not known"))?;
        let method = method_of(method)?;
        let target = agreed(h, &X_FORWARDED_URI, &X_ORIGINAL_URI)?.ok_or_else(|| {
            bad("no X-Forwarded-Uri or X-Original-URI: the original request's target is not known")
        })?;
        let host = match one(h, &X_FORWARDED_HOST)? {
            Some(host) => host,
            None => one(h, &HOST)?.ok_or_else(|| {
                bad("no X-Forwarded-Host or Host: the original request's host is not known")
            })?,
        };
        // Traefik says `ws` and `wss` of a WebSocket's upgrade request.
        let scheme = match one(h, &X_FORWARDED_PROTO)?.map(str::to_ascii_lowercase) {
            None => Scheme::HTTP,
            Some(p) if p == "http" || p == "ws" => Scheme::HTTP,
            Some(p) if p == "https" || p == "wss" => Scheme::HTTPS,
            Some(_) => return Err(bad("X-Forwarded-Proto is not http, https, ws or wss")),
        };
        let uri = uri_of(scheme, host, target)?;
        // The call's fields, less the description's and (unless kept, as the proxy keeps
        // them) those with `_` in their name, which CGI, WSGI and Rack read as `-`.
        let description = [
            &X_FORWARDED_METHOD,
            &X_FORWARDED_URI,
            &X_FORWARDED_HOST,
            &X_FORWARDED_PROTO,
            &X_ORIGINAL_METHOD,
            &X_ORIGINAL_URI,
        ];
        let mut headers = HeaderMap::with_capacity(h.len());
        for (name, value) in h {
            let dropped =
                description.contains(&name) || !underscores && name.as_str().contains('_');
            if !dropped {
                headers.append(name.clone(), value.clone());
            }
        }
        // A host `uri_of` took: visible ASCII.
        let host = HeaderValue::from_str(host).map_err(|_| bad("the original host is not text"))?;
        headers.insert(HOST, host);
        Ok(Original {
            method,
            uri,
            headers,
        })
    }

    /// The subject the decision judges: this request, from a proxy at `peer` (the client
    /// is read off `X-Forwarded-For` past the trusted proxies, as the proxy reads it).
    fn subject(&self, peer: IpAddr) -> Subject<'_> {
        Subject {
            method: &self.method,
            uri: &self.uri,
            headers: &self.headers,
            peer,
            // The client's certificate, if any, ended at the calling proxy's TLS.
            client_cert: None,
        }
    }
}

/// Whether the caller's description of another request is believed: it calls from
/// `[client_ip] trusted_proxies`, or its TLS handshake verified a client certificate,
/// where the service puts it in the call's extensions (a [`ClientCert`]). Forward-auth takes no token: the calling
/// proxy passes its client's own `Authorization` on.
fn believed(cfg: &Config, peer: IpAddr, parts: &Parts) -> bool {
    crate::identity::is_trusted(peer.to_canonical(), &cfg.client_ip.trusted_proxies)
        || parts.extensions.get::<ClientCert>().is_some()
}

/// A description that does not add up: its 400, boxed (rare, and large beside what the
/// functions return otherwise).
type Bad = Box<Problem>;

/// A 400 naming what is wrong with the description.
fn bad(detail: impl Into<std::borrow::Cow<'static, str>>) -> Bad {
    Box::new(Problem::new(StatusCode::BAD_REQUEST, detail))
}

/// The value of `name`, where it is sent once; a 400 where it is sent twice (which one a
/// backend would read is anyone's guess) or is not visible ASCII text.
fn one<'h>(h: &'h HeaderMap, name: &HeaderName) -> Result<Option<&'h str>, Bad> {
    let mut values = h.get_all(name).iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return match h.contains_key(name) {
            true => Err(bad(format!("{name} is sent more than once"))),
            false => Ok(None),
        };
    };
    v.to_str()
        .map(|s| Some(s.trim()))
        .map_err(|_| bad(format!("{name} is not ASCII text")))
}

/// The value Traefik's and Caddy's field `a` and nginx's `b` give: either, or both where
/// they agree. Two that disagree are a 400: a client can add either on its way through
/// a proxy that sets the other, and neither is chosen for it.
fn agreed<'h>(h: &'h HeaderMap, a: &HeaderName, b: &HeaderName) -> Result<Option<&'h str>, Bad> {
    match (one(h, a)?, one(h, b)?) {
        (Some(x), Some(y)) if x != y => Err(bad(format!("{a} and {b} name different values"))),
        (x, y) => Ok(x.or(y)),
    }
}

/// The original method: a token, and a standard one in upper case only (methods are
/// case-sensitive, RFC 9110 §9.1, yet some backends route `get` as `GET`: the proxy
/// refuses the ambiguity, and so does this).
fn method_of(text: &str) -> Result<Method, Bad> {
    let method = Method::from_bytes(text.as_bytes())
        .map_err(|_| bad("the original method is not a method"))?;
    let upper = Method::from_bytes(text.to_ascii_uppercase().as_bytes()).ok();
    let standard = upper.as_ref().is_some_and(|m| {
        [
            Method::GET,
            Method::HEAD,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::CONNECT,
            Method::OPTIONS,
            Method::TRACE,
            Method::PATCH,
        ]
        .contains(m)
    });
    if standard && upper.as_ref() != Some(&method) {
        return Err(bad(
            "the original method is a standard one not in upper case: methods are case-sensitive",
        ));
    }
    Ok(method)
}

/// The original URI: `scheme://host` and the target, which must be a path (origin form,
/// as the proxies send it), with no byte the proxy would refuse in its path.
fn uri_of(scheme: Scheme, host: &str, target: &str) -> Result<Uri, Bad> {
    if !target.starts_with('/') {
        return Err(bad("the original target is not a path starting with /"));
    }
    let path_and_query = PathAndQuery::try_from(target)
        .map_err(|_| bad("the original target is not a valid path and query"))?;
    let path = path_and_query.path();
    if let Some(p) = head::path_problem(path).or_else(|| head::parameter_problem(path)) {
        return Err(Box::new(p));
    }
    let authority = Authority::try_from(host)
        .ok()
        .filter(|_| head::is_host_and_port(host.as_bytes()))
        .ok_or_else(|| {
            bad("the original host is not a host and optional port (RFC 9110 §7.2): no userinfo, path or other characters")
        })?;
    Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(path_and_query)
        .build()
        .map_err(|_| bad("the original URI is not valid"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(fields: &[(&str, &[u8])]) -> Parts {
        let mut b = Request::builder().method("GET").uri("/v1/forward-auth");
        for (name, value) in fields {
            b = b.header(
                *name,
                HeaderValue::from_bytes(value).expect("a field value"),
            );
        }
        b.body(()).expect("a request").into_parts().0
    }

    fn described(fields: &[(&str, &[u8])]) -> Result<Original, String> {
        Original::of(&parts(fields), false).map_err(|p| p.detail.unwrap_or_default().into_owned())
    }

    const TRAEFIK: &[(&str, &[u8])] = &[
        ("host", b"ratewall:8081"),
        ("x-forwarded-method", b"POST"),
        ("x-forwarded-proto", b"https"),
        ("x-forwarded-host", b"api.example.com"),
        ("x-forwarded-uri", b"/v1/x?a=1"),
        ("x-forwarded-for", b"203.0.113.7"),
        ("x-api-key", b"k"),
    ];

    #[test]
    fn traefik_and_caddy_describe_with_x_forwarded() {
        let o = described(TRAEFIK).expect("sound");
        assert_eq!(o.method, Method::POST);
        assert_eq!(o.uri.to_string(), "https://api.example.com/v1/x?a=1");
        assert_eq!(o.headers["host"], "api.example.com");
        assert_eq!(o.headers["x-api-key"], "k", "the client's own fields pass");
        assert_eq!(o.headers["x-forwarded-for"], "203.0.113.7");
        assert!(!o.headers.contains_key("x-forwarded-uri"));
    }

    #[test]
    fn nginx_describes_with_x_original_and_host() {
        let o = described(&[
            ("host", b"shop.example.com"),
            ("x-original-method", b"DELETE"),
            ("x-original-uri", b"/cart/1"),
        ])
        .expect("sound");
        assert_eq!(o.method, Method::DELETE);
        assert_eq!(o.uri.to_string(), "http://shop.example.com/cart/1");
    }

    #[test]
    fn what_does_not_add_up_is_a_400_naming_it() {
        let with = |extra: &[(&str, &[u8])]| {
            let mut f: Vec<(&str, &[u8])> = TRAEFIK
                .iter()
                .filter(|(n, _)| !extra.iter().any(|(e, _)| e == n))
                .copied()
                .collect();
            f.extend(extra.iter().filter(|(_, v)| !v.is_empty()));
            described(&f).err().unwrap_or_default()
        };
        let twice = {
            let mut f = TRAEFIK.to_vec();
            f.push(("x-forwarded-uri", b"/free"));
            described(&f).err().unwrap_or_default()
        };
        assert!(
            twice.contains("x-forwarded-uri is sent more than once"),
            "{twice}"
        );
        for (extra, says) in [
            (vec![("x-original-uri", &b"/free"[..])], "different values"),
            (vec![("x-forwarded-uri", &b""[..])], "target is not known"),
            (
                vec![("x-forwarded-method", &b""[..])],
                "method is not known",
            ),
            (
                vec![("x-forwarded-uri", &b"http://evil/x"[..])],
                "not a path",
            ),
            (vec![("x-forwarded-uri", &b"/a b"[..])], "not a valid path"),
            (vec![("x-forwarded-uri", &b"/x%00.png"[..])], "control byte"),
            (
                vec![("x-forwarded-uri", &b"/api;x%2F..%2F/o"[..])],
                "parameter",
            ),
            (vec![("x-forwarded-uri", &b"/\xff"[..])], "not ASCII"),
            (vec![("x-forwarded-method", &b"get"[..])], "upper case"),
            (vec![("x-forwarded-method", &b"G T"[..])], "not a method"),
            (vec![("x-forwarded-host", &b"a@b.example"[..])], "host"),
            (vec![("x-forwarded-host", &b"a.example/x"[..])], "host"),
            (
                vec![("x-forwarded-host", &b"a.example,b.example"[..])],
                "host",
            ),
            (vec![("x-forwarded-host", &b"a.example:99999"[..])], "host"),
            (vec![("x-forwarded-host", &b"[::zz]"[..])], "host"),
            (vec![("x-forwarded-uri", &b"/a;b\\..\\c"[..])], "parameter"),
            (
                vec![("x-forwarded-proto", &b"gopher"[..])],
                "not http, https",
            ),
        ] {
            let got = with(&extra);
            assert!(got.contains(says), "{extra:?}: {got:?}");
        }
        let no_host = described(&[("x-forwarded-method", b"GET"), ("x-forwarded-uri", b"/")]);
        assert!(no_host
            .err()
            .unwrap_or_default()
            .contains("host is not known"));
    }

    #[test]
    fn agreeing_descriptions_and_dot_segments_are_read_as_sent() {
        let mut f = TRAEFIK.to_vec();
        f.push(("x-original-uri", b"/v1/x?a=1"));
        assert!(described(&f).is_ok(), "both families, agreeing");
        let mut f = TRAEFIK.to_vec();
        f.retain(|(n, _)| *n != "x-forwarded-uri");
        f.push(("x-forwarded-uri", b"/public/../api/x"));
        // The rules read paths normalised, as a backend routes them.
        let o = described(&f).expect("sound");
        assert_eq!(o.uri.path(), "/public/../api/x");
    }

    #[test]
    fn a_websockets_upgrade_is_described_with_ws_or_wss() {
        for (proto, scheme) in [("wss", "https"), ("ws", "http"), ("HTTPS", "https")] {
            let mut f = TRAEFIK.to_vec();
            f.retain(|(n, _)| *n != "x-forwarded-proto");
            f.push(("x-forwarded-proto", proto.as_bytes()));
            let o = described(&f).unwrap_or_else(|e| panic!("{proto}: {e}"));
            assert_eq!(o.uri.scheme_str(), Some(scheme));
        }
    }

    #[test]
    fn hosts_with_a_port_and_v6_literals_are_hosts() {
        for host in [
            "api.example.com:8443",
            "[::1]:8080",
            "10.0.0.1",
            "a-b.example.",
        ] {
            let mut f = TRAEFIK.to_vec();
            f.retain(|(n, _)| *n != "x-forwarded-host");
            f.push(("x-forwarded-host", host.as_bytes()));
            let o = described(&f).unwrap_or_else(|e| panic!("{host}: {e}"));
            assert_eq!(o.headers["host"], host);
        }
    }

    #[test]
    fn underscored_fields_go_unless_kept() {
        let mut f = TRAEFIK.to_vec();
        f.push(("x_api_key", b"other"));
        assert!(!described(&f)
            .expect("sound")
            .headers
            .contains_key("x_api_key"));
        let kept = Original::of(&parts(&f), true).ok().expect("sound");
        assert!(kept.headers.contains_key("x_api_key"));
    }
}
