//! `ratewall check [--path … --method … --host … --header … --peer …]`: what it prints
//! once the file is loaded (a file that does not load never gets here).

use std::net::IpAddr;

use crate::config::{Config, Source};

/// `check`'s sample request, as its flags give it.
pub struct Sample {
    /// The path (and query); none: no sample, the configuration only.
    pub path: Option<String>,
    pub method: String,
    /// Each `"name: value"`.
    pub headers: Vec<String>,
    /// The Host header, where given.
    pub host: Option<String>,
    pub peer: IpAddr,
}

/// Print that `config` (loaded from `source`) is valid and what it says, then, with a
/// sample's path, the way the request path would take that request. Err: a sample that is
/// no request (its message, without the `ratewall: ` before it).
pub fn check(config: &Config, source: &Source, sample: Sample) -> Result<(), String> {
    println!("{}: valid", source.path.display());
    if !source.overrides.is_empty() {
        println!("{}", source.overrides);
    }
    print!("{}", super::describe(config));
    for warning in config.server.tls.iter().flat_map(|t| t.warnings()) {
        eprintln!("ratewall: warning: {warning}");
    }
    let mut headers = sample.headers;
    if let Some(host) = sample.host {
        headers.push(format!("host: {host}"));
    }
    let Some(path) = sample.path else {
        return Ok(());
    };
    let (method, headers) = sample_request(&sample.method, &headers)?;
    let keyed = crate::server::key_check_tags(config, &source.path);
    println!();
    print!(
        "{}",
        super::explain(config, &method, &path, &headers, sample.peer)
    );
    if !keyed {
        println!("(identity tags read --------: they are keyed by the deployment's tag secret, which is kept in the shared store or made at the gateway's first start; /admin/state gives an identity's tag)");
    }
    Ok(())
}

/// The method and headers of `ratewall check`'s sample request.
fn sample_request(
    method: &str,
    headers: &[String],
) -> Result<(http::Method, http::HeaderMap), String> {
    let method = http::Method::from_bytes(method.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("--method {method:?} is not a method"))?;
    let mut map = http::HeaderMap::new();
    for h in headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("--header {h:?}: expected \"name: value\""))?;
        let name = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| format!("--header {h:?}: bad header name"))?;
        let value = http::HeaderValue::from_str(value.trim())
            .map_err(|_| format!("--header {h:?}: bad header value"))?;
        map.append(name, value);
    }
    Ok((method, map))
}
