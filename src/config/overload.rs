//! A pool's `overload = { … }` (in `[[upstreams]]`, or in `[upstream]` for every pool to
//! inherit: a pool's own table replaces the inherited one whole), validated into
//! [`crate::overload::Settings`]. Two shapes:
//!
//! ```toml
//! overload = { adaptive = true, min_limit = 4, max_limit = 1000, probe_interval = "30s", max_queue = 1000, max_wait = "2s" }
//! overload = { max_concurrency = 64, max_queue = 100, max_wait = "1s", reserve_for_higher = "25%" }
//! ```

use serde::Deserialize;
use toml::Spanned;

use super::values::HumanDuration;
use super::Invalid;
use crate::overload::{
    Adaptive, Limiting, Settings, MAX_LIMIT, MAX_QUEUE, MAX_WAIT, MIN_LIMIT, PROBE_INTERVAL,
    RESERVE_FOR_HIGHER,
};

/// `reserve_for_higher = "25%"`: a share of the limit, 0% to 90%.
struct Reserve(u8);

impl<'de> Deserialize<'de> for Reserve {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "reserve_for_higher is a share of the limit, \"0%\" to \"90%\" (default \"25%\")",
            )
        })?;
        let n = s
            .trim()
            .strip_suffix('%')
            .and_then(|n| n.trim().parse::<u8>().ok())
            .filter(|&n| n <= 90);
        n.map(Reserve).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "reserve_for_higher = {s:?}: a share of the limit, \"0%\" to \"90%\" (default \"25%\")"
            ))
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOverload {
    adaptive: Option<Spanned<bool>>,
    min_limit: Option<Spanned<u32>>,
    max_limit: Option<Spanned<u32>>,
    probe_interval: Option<Spanned<HumanDuration>>,
    max_concurrency: Option<Spanned<u32>>,
    max_queue: Option<Spanned<u32>>,
    max_wait: Option<Spanned<HumanDuration>>,
    reserve_for_higher: Option<Reserve>,
}

/// `table.overload`, validated (`table`: `upstream` or `upstreams[i]`).
pub(super) fn validate(table: &str, o: &Spanned<RawOverload>) -> Result<Settings, Invalid> {
    let raw = o.get_ref();
    let key = |k: &str| format!("{table}.overload.{k}");
    let at_least_one = |k: &str, v: &Option<Spanned<u32>>| match v {
        Some(n) if *n.get_ref() == 0 => Err(Invalid::new(
            Some(n.span()),
            key(k),
            format!("{k} must be at least 1"),
        )),
        _ => Ok(()),
    };
    at_least_one("min_limit", &raw.min_limit)?;
    at_least_one("max_limit", &raw.max_limit)?;
    at_least_one("max_concurrency", &raw.max_concurrency)?;
    let adaptive = raw.adaptive.as_ref().is_some_and(|a| *a.get_ref());
    let limiting = match (adaptive, &raw.max_concurrency) {
        (true, Some(m)) => {
            return Err(Invalid::new(
                Some(m.span()),
                key("max_concurrency"),
                "adaptive = true adapts the limit, max_concurrency fixes it: give one of them",
            ))
        }
        (false, None) => {
            return Err(Invalid::new(
                Some(o.span()),
                format!("{table}.overload"),
                "overload needs a limit: adaptive = true (adapted to the backend's latency) or max_concurrency = N (fixed)",
            ))
        }
        (false, Some(m)) => {
            let adaptive_only = [
                ("min_limit", raw.min_limit.as_ref().map(Spanned::span)),
                ("max_limit", raw.max_limit.as_ref().map(Spanned::span)),
                (
                    "probe_interval",
                    raw.probe_interval.as_ref().map(Spanned::span),
                ),
            ];
            if let Some((k, span)) = adaptive_only.into_iter().find(|(_, s)| s.is_some()) {
                return Err(Invalid::new(
                    span,
                    key(k),
                    format!("{k} applies to adaptive = true only: a fixed max_concurrency does not move"),
                ));
            }
            Limiting::Fixed(*m.get_ref())
        }
        (true, None) => {
            let min_limit = raw.min_limit.as_ref().map_or(MIN_LIMIT, |n| *n.get_ref());
            let max_limit = raw.max_limit.as_ref().map_or(MAX_LIMIT, |n| *n.get_ref());
            if min_limit > max_limit {
                let (k, span) = match (&raw.min_limit, &raw.max_limit) {
                    (Some(n), _) => ("min_limit", n.span()),
                    (None, Some(n)) => ("max_limit", n.span()),
                    (None, None) => ("min_limit", o.span()),
                };
                return Err(Invalid::new(
                    Some(span),
                    key(k),
                    format!("min_limit {min_limit} is above max_limit {max_limit}"),
                ));
            }
            Limiting::Adaptive(Adaptive {
                min_limit,
                max_limit,
                probe_interval: raw
                    .probe_interval
                    .as_ref()
                    .map_or(PROBE_INTERVAL, |d| d.get_ref().0),
            })
        }
    };
    Ok(Settings {
        limiting,
        max_queue: raw.max_queue.as_ref().map_or(MAX_QUEUE, |n| *n.get_ref()),
        max_wait: raw.max_wait.as_ref().map_or(MAX_WAIT, |d| d.get_ref().0),
        reserve_for_higher: raw
            .reserve_for_higher
            .as_ref()
            .map_or(RESERVE_FOR_HIGHER, |r| r.0),
    })
}
