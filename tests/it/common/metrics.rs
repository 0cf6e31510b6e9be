//! `/metrics` (OpenMetrics text), parsed with `prometheus-parse`.

use std::collections::BTreeMap;

use http::StatusCode;

use super::client::HttpClient;
use super::gateway::Gateway;

/// One scrape of `/metrics`.
pub struct Scrape {
    pub text: String,
    samples: Vec<prometheus_parse::Sample>,
}

impl Scrape {
    /// Scrape the gateway's admin listener: the answer must be OpenMetrics text.
    pub async fn take(client: &HttpClient, gw: &Gateway) -> Scrape {
        let r = client.get(&gw.admin_url("/metrics"), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "GET /metrics");
        let ct = r.header("content-type").unwrap_or_default().to_string();
        assert!(
            ct.starts_with("application/openmetrics-text"),
            "content-type of /metrics: {ct:?}"
        );
        let text = String::from_utf8(r.body.to_vec()).expect("metrics are UTF-8");
        assert_eq!(
            text.lines().last(),
            Some("# EOF"),
            "OpenMetrics text ends with # EOF"
        );
        let lines: Vec<std::io::Result<String>> = text
            .lines()
            .filter(|l| *l != "# EOF")
            .map(|l| Ok(l.to_string()))
            .collect();
        let parsed = prometheus_parse::Scrape::parse(lines.into_iter()).expect("parse /metrics");
        assert!(!parsed.samples.is_empty(), "no samples in:\n{text}");
        Scrape {
            text,
            samples: parsed.samples,
        }
    }

    fn number(v: &prometheus_parse::Value) -> Option<f64> {
        match v {
            prometheus_parse::Value::Counter(x)
            | prometheus_parse::Value::Gauge(x)
            | prometheus_parse::Value::Untyped(x) => Some(*x),
            _ => None,
        }
    }

    /// Every sample of `metric`, keyed by its labels (sorted `k=v` pairs).
    pub fn family(&self, metric: &str) -> BTreeMap<Vec<(String, String)>, f64> {
        self.samples
            .iter()
            .filter(|s| s.metric == metric)
            .filter_map(|s| {
                let mut labels: Vec<(String, String)> = s
                    .labels
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                labels.sort();
                Scrape::number(&s.value).map(|v| (labels, v))
            })
            .collect()
    }

    /// The value of `metric` with exactly `labels`; 0 when the series does not exist yet
    /// (a labelled counter appears on its first increment).
    pub fn get(&self, metric: &str, labels: &[(&str, &str)]) -> f64 {
        let mut want: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.sort();
        self.family(metric).get(&want).copied().unwrap_or(0.0)
    }

    /// The sum of the samples of `metric` whose labels include `labels` (0 when none).
    pub fn sum(&self, metric: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.metric == metric)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .filter_map(|s| Scrape::number(&s.value))
            .sum()
    }

    /// A metric without labels, which must exist.
    pub fn scalar(&self, metric: &str) -> f64 {
        *self
            .family(metric)
            .get(&Vec::new())
            .unwrap_or_else(|| panic!("no {metric} in:\n{}", self.text))
    }

    /// The non-zero series of a two-label family, as `(a, b) -> value`.
    pub fn nonzero2(&self, metric: &str, a: &str, b: &str) -> BTreeMap<(String, String), u64> {
        self.samples
            .iter()
            .filter(|s| s.metric == metric)
            .filter_map(|s| {
                let v = Scrape::number(&s.value)?;
                (v != 0.0).then(|| {
                    (
                        (
                            s.labels.get(a).unwrap_or("?").to_string(),
                            s.labels.get(b).unwrap_or("?").to_string(),
                        ),
                        v as u64,
                    )
                })
            })
            .collect()
    }

    /// The non-zero series of a one-label family, as `label -> value`.
    pub fn nonzero1(&self, metric: &str, a: &str) -> BTreeMap<String, u64> {
        self.samples
            .iter()
            .filter(|s| s.metric == metric)
            .filter_map(|s| {
                let v = Scrape::number(&s.value)?;
                (v != 0.0).then(|| (s.labels.get(a).unwrap_or("?").to_string(), v as u64))
            })
            .collect()
    }

    /// Every label value of every sample.
    pub fn label_values(&self) -> Vec<String> {
        self.samples
            .iter()
            .flat_map(|s| s.labels.values().cloned())
            .collect()
    }
}

/// One value from the gateway's `/metrics`: the sum of the samples of `metric` whose
/// labels include `labels` (0 when no such series exists yet).
pub async fn metric(gw: &Gateway, metric: &str, labels: &[(&str, &str)]) -> f64 {
    Scrape::take(&HttpClient::new(), gw)
        .await
        .sum(metric, labels)
}

impl Scrape {
    /// The value of the series of `metric` with exactly `labels`, if it exists.
    pub fn find(&self, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut want: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.sort();
        self.family(metric).get(&want).copied()
    }
}

/// The value of the gateway's series of `metric` with exactly `labels`, if it exists.
pub async fn series(gw: &Gateway, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    Scrape::take(&HttpClient::new(), gw)
        .await
        .find(metric, labels)
}

/// Scrape the gateway's `/metrics` every 20 ms until `holds` is true of a scrape, at most
/// [`super::WAIT`]: the scrape it held of, or panic with `what` and the last scrape's
/// text.
pub async fn until_scrape(gw: &Gateway, what: &str, holds: impl Fn(&Scrape) -> bool) -> Scrape {
    let client = HttpClient::new();
    let end = std::time::Instant::now() + super::WAIT;
    loop {
        let scrape = Scrape::take(&client, gw).await;
        if holds(&scrape) {
            return scrape;
        }
        assert!(
            std::time::Instant::now() < end,
            "not within {:?}: {what}\n{}",
            super::WAIT,
            scrape.text
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Wait until the gateway has at most `open` client connections on its listener and no
/// request in flight: every client that left has been seen to go (its requests dropped),
/// and nothing more will be forwarded for one.
pub async fn until_quiet(gw: &Gateway, open: f64) {
    until_scrape(
        gw,
        &format!("at most {open} connections open and no request in flight"),
        |s| {
            s.get("ratewall_connections", &[("listener", "gateway")]) <= open
                && s.scalar("ratewall_in_flight_requests") == 0.0
        },
    )
    .await;
}
