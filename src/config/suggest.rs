//! "Did you mean …?" for a key or value the file misspelt: serde names what it expected,
//! and the nearest of those, by edit distance, is most often what was meant.

/// `message` with a suggestion appended when it is serde's `unknown field` or `unknown
/// variant` error and one expected name is close to what was written: at most a third of
/// its letters changed (at least one), as `burts` for `burst` or `bakend` for `backend`.
pub(super) fn with_suggestion(message: &str) -> String {
    let Some(near) = nearest(message) else {
        return message.to_string();
    };
    format!("{message} (did you mean `{near}`?)")
}

fn nearest(message: &str) -> Option<&str> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("unknown variant `"))?;
    let (written, rest) = rest.split_once('`')?;
    let expected = rest.split_once("expected one of ")?.1;
    closest(written, expected.split(", ").map(|n| n.trim_matches('`')))
}

/// The one of `names` closest to `written`, if it is close: at most a third of its
/// letters changed (at least one), case aside.
pub(super) fn closest<'a>(
    written: &str,
    names: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let mut best: Option<(usize, &str)> = None;
    for name in names {
        let d = distance(&written.to_ascii_lowercase(), &name.to_ascii_lowercase());
        if d <= (name.chars().count() / 3).max(1) && best.is_none_or(|(b, _)| d < b) {
            best = Some((d, name));
        }
    }
    best.map(|(_, name)| name)
}

/// Levenshtein distance, with a swap of two neighbours counted as one edit.
fn distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let w = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * w];
    for (j, cell) in d.iter_mut().enumerate().take(w) {
        *cell = j;
    }
    for i in 1..=a.len() {
        d[i * w] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[(i - 1) * w + j] + 1)
                .min(d[i * w + j - 1] + 1)
                .min(d[(i - 1) * w + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[(i - 2) * w + j - 2] + 1);
            }
            d[i * w + j] = v;
        }
    }
    d[a.len() * w + b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_expected_name_is_suggested() {
        let m = "unknown field `bakend`, expected one of `backend`, `url`, `nodes`";
        assert_eq!(with_suggestion(m), format!("{m} (did you mean `backend`?)"));
        let m = "unknown field `burts`, expected one of `rate`, `burst`, `cost`";
        assert!(with_suggestion(m).ends_with("(did you mean `burst`?)"));
        let m = "unknown variant `Token_Bucket`, expected one of `token_bucket`, `gcra`";
        assert!(with_suggestion(m).ends_with("(did you mean `token_bucket`?)"));
        // Nothing close: no guess.
        let m = "unknown variant `leaky_bucket`, expected one of `token_bucket`, `gcra`";
        assert_eq!(with_suggestion(m), m);
        let m = "unknown field `limits`, expected one of `server`, `rules`";
        assert_eq!(with_suggestion(m), m);
        // Other messages pass unchanged.
        assert_eq!(with_suggestion("invalid type"), "invalid type");
        assert_eq!(distance("ab", "ba"), 1);
        assert_eq!(distance("", "abc"), 3);
    }
}
