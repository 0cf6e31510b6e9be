//! The upstream side: one pooled hyper-util client, hop-by-hop stripping and
//! `X-Forwarded-*`. Bodies are never buffered: the client's request body streams to the
//! upstream and the upstream's response body streams back.

use std::net::IpAddr;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, HOST};
use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::Upstream;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Hop-by-hop fields, RFC 9110 §7.6.1: meaningful for one connection only, never
/// forwarded. `Proxy-Connection` and `Keep-Alive` are the legacy ones the section names;
/// `Proxy-Authenticate`/`-Authorization` are hop-by-hop per RFC 9110 §11.7.
static HOP_BY_HOP: [HeaderName; 9] = [
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

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("upstream refused or unreachable: {0}")]
    Unreachable(String),
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
    #[error("upstream failed: {0}")]
    Failed(String),
}

pub struct Proxy {
    client: Client<HttpConnector, Incoming>,
    authority: http::uri::Authority,
    base_path: String,
    timeout: Duration,
}

impl Proxy {
    pub fn new(cfg: &Upstream) -> Proxy {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(256)
            .build(connector);
        let authority = cfg
            .url
            .authority()
            .cloned()
            .unwrap_or_else(|| http::uri::Authority::from_static("127.0.0.1"));
        Proxy {
            client,
            authority,
            base_path: cfg.base_path.clone(),
            timeout: cfg.timeout,
        }
    }

    /// Send `req` from `peer` upstream; the answer's head must arrive within `timeout`.
    pub async fn forward(
        &self,
        mut req: Request<Incoming>,
        peer: IpAddr,
    ) -> Result<Response<Incoming>, ProxyError> {
        let original_host = req.headers().get(HOST).cloned().or_else(|| {
            req.uri()
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });

        *req.uri_mut() = self.upstream_uri(req.uri())?;
        *req.version_mut() = Version::HTTP_11;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        if let Some(host) = original_host {
            headers.insert(HOST, host.clone());
            headers.insert(X_FORWARDED_HOST.clone(), host);
        }
        append_forwarded_for(headers, peer);
        headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));

        let mut resp = match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => return Err(ProxyError::Timeout(self.timeout)),
            Ok(Err(e)) if e.is_connect() => return Err(ProxyError::Unreachable(error_chain(&e))),
            Ok(Err(e)) => return Err(ProxyError::Failed(error_chain(&e))),
            Ok(Ok(resp)) => resp,
        };
        strip_hop_by_hop(resp.headers_mut());
        Ok(resp)
    }

    fn upstream_uri(&self, uri: &Uri) -> Result<Uri, ProxyError> {
        let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let pq: PathAndQuery = if self.base_path.is_empty() {
            uri.path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"))
        } else {
            format!("{}{}", self.base_path, pq)
                .parse()
                .map_err(|e| ProxyError::Failed(format!("bad upstream path: {e}")))?
        };
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
            .map_err(|e| ProxyError::Failed(format!("bad upstream uri: {e}")))
    }
}

/// Remove the hop-by-hop fields, and every field the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// `X-Forwarded-For: <what came in>, <peer>`, folding repeated lines into one.
fn append_forwarded_for(headers: &mut HeaderMap, peer: IpAddr) {
    let peer = peer.to_canonical().to_string();
    let mut value = Vec::new();
    for v in headers.get_all(&X_FORWARDED_FOR) {
        if !value.is_empty() {
            value.extend_from_slice(b", ");
        }
        value.extend_from_slice(v.as_bytes());
    }
    if !value.is_empty() {
        value.extend_from_slice(b", ");
    }
    value.extend_from_slice(peer.as_bytes());
    match HeaderValue::from_bytes(&value) {
        Ok(v) => {
            headers.insert(X_FORWARDED_FOR.clone(), v);
        }
        Err(_) => {
            // Cannot happen (the parts were header values), but never drop the peer.
            if let Ok(v) = HeaderValue::from_str(&peer) {
                headers.insert(X_FORWARDED_FOR.clone(), v);
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn forwarded_for_appends_the_peer() {
        let mut h = HeaderMap::new();
        append_forwarded_for(&mut h, "10.0.0.1".parse().unwrap());
        assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.1");
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("2.2.2.2"));
        append_forwarded_for(&mut h, "::ffff:10.0.0.1".parse().unwrap());
        assert_eq!(h.get_all(&X_FORWARDED_FOR).iter().count(), 1);
        assert_eq!(h[&X_FORWARDED_FOR], "1.1.1.1, 2.2.2.2, 10.0.0.1");
    }
}
