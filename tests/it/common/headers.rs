//! The rate-limit headers of a reply, parsed as Structured Field lists (RFC 9651).

use super::client::Reply;

/// A Structured Field list header of string items: each item's name and parameters, in
/// order. Panics (failing the test) on anything else.
pub fn sf_list(value: &str) -> Vec<(String, sfv::Parameters)> {
    let list = sfv::Parser::parse_list(value.as_bytes())
        .unwrap_or_else(|e| panic!("{value:?} is not a Structured Field list: {e}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_str()
                    .unwrap_or_else(|| panic!("item of {value:?} is not a string"))
                    .to_string();
                (name, item.params)
            }
            sfv::ListEntry::InnerList(_) => panic!("{value:?} has an inner list"),
        })
        .collect()
}

/// An integer parameter of an item.
pub fn int(params: &sfv::Parameters, key: &str) -> i64 {
    params
        .get(key)
        .and_then(|v| v.as_int())
        .unwrap_or_else(|| panic!("no integer {key} in {params:?}"))
}

/// The rule names in a Structured Field list header, in order; empty when it is absent.
pub fn names(r: &Reply, header: &str) -> Vec<String> {
    r.header(header)
        .map(|v| sf_list(v).into_iter().map(|(n, _)| n).collect())
        .unwrap_or_default()
}

/// The rule names in `RateLimit-Policy`.
pub fn policies(r: &Reply) -> Vec<String> {
    names(r, "ratelimit-policy")
}

/// The parameters of `rule`'s item in a Structured Field list header, if there is one.
pub fn try_item(r: &Reply, header: &str, rule: &str) -> Option<sfv::Parameters> {
    sf_list(r.header(header)?)
        .into_iter()
        .find(|(n, _)| n == rule)
        .map(|(_, p)| p)
}

/// The parameters of `rule`'s item in a Structured Field list header, which must be there.
pub fn item(r: &Reply, header: &str, rule: &str) -> sfv::Parameters {
    try_item(r, header, rule).unwrap_or_else(|| {
        panic!(
            "no {rule:?} item in {header} {:?} on a {} reply: {:?}",
            r.header(header),
            r.status,
            r.headers
        )
    })
}

/// `r` (requests still allowed) of `rule` in the `RateLimit` header, if it has an item.
pub fn try_remaining(r: &Reply, rule: &str) -> Option<i64> {
    try_item(r, "ratelimit", rule).map(|p| int(&p, "r"))
}

/// `r` (requests still allowed) of `rule` in the `RateLimit` header, which must be there.
pub fn remaining(r: &Reply, rule: &str) -> i64 {
    int(&item(r, "ratelimit", rule), "r")
}

/// Whether an item carries the boolean parameter `denied` (`;denied` is true).
pub fn is_denied(params: &sfv::Parameters) -> bool {
    match params.get("denied") {
        None => false,
        Some(v) => v
            .as_bool()
            .unwrap_or_else(|| panic!("denied is not a boolean: {params:?}")),
    }
}
