//! serde's type errors in the config's own words. `timeout = 30` is "invalid type:
//! integer `30`, expected a string" to serde; to whoever wrote it, it is a duration
//! without its unit. The key's name says which kind of value it takes, and the message
//! shows the line as it should have been written.

/// Keys whose value is a duration (`"30s"`), as docs/configuration.md types them
/// (a test checks the two lists agree).
const DURATIONS: &[&str] = &[
    "body_timeout",
    "breaker_cooldown",
    "connect_timeout",
    "fail_timeout",
    "fail_window",
    "header_timeout",
    "idle_timeout",
    "interval",
    "jwks_refresh",
    "lease_ttl",
    "leeway",
    "max_delay",
    "max_wait",
    "probe_interval",
    "resolve_every",
    "resync",
    "retry_jitter",
    "settle_within",
    "shutdown_grace",
    "time",
    "timeout",
    "tunnel_idle_timeout",
    "upgrade_idle_timeout",
];

/// Keys whose value is a rate (`"10/s"`).
const RATES: &[&str] = &["rate", "attempts_rate"];

/// Keys whose value is a size (`"1MiB"`).
const SIZES: &[&str] = &["max_header_bytes", "max_bytes", "bytes"];

/// `message` (serde's, for the key path `key`) said as the config would: `Some` when it is
/// a type or value error this knows, `None` to keep serde's own.
pub(super) fn in_own_words(key: &str, message: &str) -> Option<String> {
    let leaf = key.rsplit('.').next().unwrap_or(key);
    let leaf = leaf.split('[').next().unwrap_or(leaf);
    let rest = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))?;
    let (found, expected) = rest.rsplit_once(", expected ")?;
    let written = written(found)?;
    let line = format!("`{leaf} = {written}`");
    let bare = written.trim_matches('"');
    let say = match expected {
        "a string" if DURATIONS.contains(&leaf) => {
            let n = number_or(bare, "30");
            format!("{line}: a duration is written in quotes with its unit (ms, s, m, h), e.g. `{leaf} = \"{n}s\"`")
        }
        "a string" if RATES.contains(&leaf) => {
            let n = number_or(bare, "10");
            format!("{line}: a rate is written in quotes as a count per period, e.g. `{leaf} = \"{n}/s\"` or \"{n}/m\"")
        }
        "a string" if SIZES.contains(&leaf) => {
            let n = number_or(bare, "1");
            format!(
                "{line}: a size is written in quotes with its unit (B, KiB, MiB, GiB), e.g. `{leaf} = \"{n}KiB\"`"
            )
        }
        "a string" => format!(
            "{line}: this key takes text, in quotes (`{leaf} = \"…\"`); docs/configuration.md says what it may be"
        ),
        e if e.starts_with("a nonzero ") => {
            let n = positive_or(bare, "10");
            format!("{line}: a whole number of at least 1 is needed here, without quotes, e.g. `{leaf} = {n}`")
        }
        "u8" | "u16" | "u32" | "u64" | "usize" => {
            let n = positive_or(bare, "0");
            format!("{line}: a whole number (0 or more) is needed here, without quotes, e.g. `{leaf} = {n}`")
        }
        "a boolean" => format!("{line}: true or false, without quotes, e.g. `{leaf} = true`"),
        _ => return None,
    };
    Some(say)
}

/// The value as the file wrote it, from serde's description of it: `30` for "integer
/// `30`", `"5"` for "string \"5\"".
fn written(found: &str) -> Option<String> {
    for kind in ["integer ", "floating point ", "boolean "] {
        if let Some(v) = found.strip_prefix(kind) {
            return Some(v.trim_matches('`').to_string());
        }
    }
    let s = found.strip_prefix("string ")?;
    Some(s.to_string())
}

/// `s` if it is a number (so that the example keeps the number the file wrote), else
/// `or`.
fn number_or<'a>(s: &'a str, or: &'a str) -> &'a str {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 => s,
        _ => or,
    }
}

/// `s` if it is a whole number of at least 1, else `or`.
fn positive_or<'a>(s: &'a str, or: &'a str) -> &'a str {
    match s.parse::<u64>() {
        Ok(v) if v > 0 => s,
        _ => or,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_without_its_unit_is_shown_with_it() {
        assert_eq!(
            in_own_words("upstream.timeout", "invalid type: integer `30`, expected a string").as_deref(),
            Some("`timeout = 30`: a duration is written in quotes with its unit (ms, s, m, h), e.g. `timeout = \"30s\"`")
        );
    }

    #[test]
    fn zero_or_a_quoted_number_where_a_count_goes_says_so() {
        assert_eq!(
            in_own_words("rules[0].burst", "invalid value: integer `0`, expected a nonzero u64")
                .as_deref(),
            Some("`burst = 0`: a whole number of at least 1 is needed here, without quotes, e.g. `burst = 10`")
        );
        assert_eq!(
            in_own_words("rules[0].burst", "invalid type: string \"5\", expected a nonzero u64")
                .as_deref(),
            Some("`burst = \"5\"`: a whole number of at least 1 is needed here, without quotes, e.g. `burst = 5`")
        );
    }

    #[test]
    fn rates_sizes_text_and_switches_get_their_own_example() {
        let said = |k, m| in_own_words(k, m).unwrap_or_default();
        assert!(said(
            "rules[2].rate",
            "invalid type: integer `5`, expected a string"
        )
        .ends_with("e.g. `rate = \"5/s\"` or \"5/m\""));
        assert!(said(
            "server.max_header_bytes",
            "invalid type: integer `8`, expected a string"
        )
        .ends_with("e.g. `max_header_bytes = \"8KiB\"`"));
        assert!(said(
            "upstream.url",
            "invalid type: integer `3000`, expected a string"
        )
        .starts_with("`url = 3000`: this key takes text, in quotes (`url = \"…\"`)"));
        assert!(said(
            "server.redirect_https",
            "invalid type: string \"yes\", expected a boolean"
        )
        .starts_with("`redirect_https = \"yes\"`: true or false"));
        // What it does not know stays serde's.
        assert_eq!(in_own_words("x", "unknown field `burts`"), None);
    }

    /// Every key docs/configuration.md types `duration` is known as one here.
    #[test]
    fn the_durations_are_the_documents() {
        let doc = include_str!("../../docs/configuration.md");
        for line in doc.lines() {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            if cells.len() > 3 && cells[3].starts_with("duration") {
                let key = cells[1].trim_matches('`');
                assert!(DURATIONS.contains(&key), "{key} is a duration in the docs");
            }
        }
    }
}
