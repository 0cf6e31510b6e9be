//! The dashboards of issue 27 end to end: the real binary on the memory store, a real
//! upstream, a real HTTP client. Known traffic from a good client, an abusive one and one on
//! a plan only some rules define gives exact counts of `ratewall_denials_total` (by rule and
//! plan), `ratewall_denial_retry_seconds` (its count, and its sum beside the Retry-After
//! values the 429s gave), `ratewall_near_limit_total` and `ratewall_plan_requests_total`;
//! `/status.json` and the status page in headless Chromium show each rule's p95 time to
//! reset and its SLO, and "—" where a rule has none. A token's plan claim that no rule
//! defines is counted as `default`, never as a label of its own.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::jwt::{unix_now, SigningKey};
use common::{dump_dom, Gateway, HttpClient, Scrape, Upstream};
use http::StatusCode;

const GOOD: &str = "sk_dash_good_client_0001";
const ABUSIVE: &str = "sk_dash_abusive_client_02";
const GOLD: &str = "sk_dash_gold_client_00003";

/// The gateway on `body`, once its admin listener accepts too.
fn start(body: &str) -> Gateway {
    let gw = Gateway::start(body);
    assert!(
        common::wait_for_port(gw.admin_port, Duration::from_secs(10)),
        "the admin listener did not come up:\n{}",
        gw.logs()
    );
    gw
}

/// Per rule, the sum of the Retry-After values its 429s gave, and how many.
#[derive(Default, Debug)]
struct Waits(BTreeMap<&'static str, (u64, u64)>);

impl Waits {
    /// One request; a 429 is put down under `denier` with its Retry-After.
    async fn get(
        &mut self,
        client: &HttpClient,
        gw: &Gateway,
        key: &str,
        path: &str,
        denier: &'static str,
    ) -> u16 {
        let r = client.get(&gw.url(path), &[("x-api-key", key)]).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            let secs: u64 = r
                .header("retry-after")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("a 429 without a Retry-After: {r:?}"));
            let e = self.0.entry(denier).or_default();
            e.0 += secs;
            e.1 += 1;
        }
        r.status.as_u16()
    }
}

fn get(m: &Scrape, metric: &str, labels: &[(&str, &str)]) -> u64 {
    let v = m
        .find(metric, labels)
        .unwrap_or_else(|| panic!("no {metric}{labels:?} in:\n{}", m.text));
    v as u64
}

/// The text of the status page's rules-table cell for `rule` and `k`.
fn cell<'d>(dom: &'d str, rule: &str, k: &str) -> &'d str {
    let needle = format!("data-rule=\"{rule}\" data-k=\"{k}\"");
    let at = dom
        .find(&needle)
        .unwrap_or_else(|| panic!("no cell {k} of {rule} in:\n{dom}"));
    let open = at + dom[at..].find('>').expect("the cell's tag ends") + 1;
    &dom[open..open + dom[open..].find('<').expect("the cell's text ends")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denials_retry_waits_near_limit_and_the_slo_count_exactly_and_the_page_shows_them() {
    let _watch = common::watchdog();
    let upstream = Upstream::start().await;
    // Slow refills (an hour's rates): no token comes back while the test runs.
    //  api: default 5 at once; plan pro 10, plan gold 3.
    //  exports (/api/export, also under api; an hour's fixed window): default 1; plan pro 2;
    //  gold is not its plan.
    //  calm: everyone together, 1,000: never denies. idle: never applies.
    let body = format!(
        "[upstream]\nurl = \"{}\"\n[store]\nbackend = \"memory\"\n\
         [keys.plans]\n\"{GOOD}\" = \"pro\"\n\"{GOLD}\" = \"gold\"\n\
         [[rules]]\nname = \"api\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"api_key\"\n\
         rate = \"5/h\"\nburst = 5\n\
         [rules.plans.pro]\nrate = \"10/h\"\nburst = 10\n\
         [rules.plans.gold]\nrate = \"3/h\"\nburst = 3\n\
         [[rules]]\nname = \"exports\"\nmatch = {{ path = \"/api/export\" }}\nkey = \"api_key\"\n\
         algorithm = \"fixed_window\"\nrate = \"1/h\"\n\
         [rules.plans.pro]\nrate = \"2/h\"\n\
         [[rules]]\nname = \"calm\"\nmatch = {{ path_prefix = \"/api/\" }}\nkey = \"global\"\n\
         rate = \"1000/h\"\nburst = 1000\n\
         [[rules]]\nname = \"idle\"\nmatch = {{ path_prefix = \"/idle/\" }}\nkey = \"global\"\n\
         rate = \"1/h\"\n",
        upstream.url()
    );
    let gw = start(&body);
    let client = HttpClient::new();

    // Before any traffic every series exists at zero, and the page has no numbers.
    let m = Scrape::take(&client, &gw).await;
    for (rule, plan) in [
        ("api", "default"),
        ("api", "pro"),
        ("api", "gold"),
        ("exports", "default"),
        ("exports", "pro"),
        ("calm", "default"),
    ] {
        let labels = [("rule", rule), ("plan", plan)];
        assert_eq!(
            get(&m, "ratewall_denials_total", &labels),
            0,
            "{rule} {plan}"
        );
    }
    assert_eq!(
        m.find(
            "ratewall_denials_total",
            &[("rule", "exports"), ("plan", "gold")]
        ),
        None,
        "gold is not a plan of exports"
    );
    let before = client.get(&gw.admin_url("/status.json"), &[]).await.json();
    for rule in before["rules"].as_array().expect("rules") {
        assert_eq!(
            rule["time_to_reset"]["p95_s"],
            serde_json::Value::Null,
            "{rule}"
        );
        assert_eq!(
            rule["slo"]["served_share"],
            serde_json::Value::Null,
            "{rule}"
        );
    }

    let mut waits = Waits::default();
    // GOOD (pro): 6 orders, then 3 exports; exports' plan gives it 2, the third is denied
    // by exports — while under api it has asked 9 of its 10: within its plan there.
    for i in 0..6 {
        let s = waits.get(&client, &gw, GOOD, "/api/orders", "-").await;
        assert_eq!(s, 200, "GOOD order {i}");
    }
    for (i, want) in [200, 200, 429].into_iter().enumerate() {
        let s = waits
            .get(&client, &gw, GOOD, "/api/export", "exports")
            .await;
        assert_eq!(s, want, "GOOD export {i}");
    }
    // ABUSIVE (no plan): 12 orders, 5 pass; the 7 denied are over its plan (6..12 > 5).
    for i in 0..12 {
        let s = waits.get(&client, &gw, ABUSIVE, "/api/orders", "api").await;
        assert_eq!(s, if i < 5 { 200 } else { 429 }, "ABUSIVE order {i}");
    }
    // GOLD: 2 exports; exports does not define gold, so its own limit of 1 applies: the
    // second is denied, counted under plan `default`; under api (gold: 3) it is within.
    for (i, want) in [200, 429].into_iter().enumerate() {
        let s = waits
            .get(&client, &gw, GOLD, "/api/export", "exports")
            .await;
        assert_eq!(s, want, "GOLD export {i}");
    }

    let m = Scrape::take(&client, &gw).await;
    let denials = |rule, plan| {
        get(
            &m,
            "ratewall_denials_total",
            &[("rule", rule), ("plan", plan)],
        )
    };
    assert_eq!(
        [
            denials("api", "default"),
            denials("api", "pro"),
            denials("api", "gold"),
            denials("exports", "pro"),
            denials("exports", "default"),
            denials("calm", "default"),
            denials("idle", "default"),
        ],
        [7, 0, 0, 1, 1, 0, 0],
        "{}",
        m.text
    );
    // The retry histogram: one observation per 429 under the rule that denied it; its sum
    // (ms, in seconds) is what Retry-After rounded up: each within [sum, sum + count).
    for (rule, count) in [("api", 7u64), ("exports", 2), ("calm", 0), ("idle", 0)] {
        let labels = [("rule", rule)];
        let n = get(&m, "ratewall_denial_retry_seconds_count", &labels);
        assert_eq!(n, count, "{rule}: {}", m.text);
        let sum = m
            .find("ratewall_denial_retry_seconds_sum", &labels)
            .unwrap_or_else(|| panic!("no sum for {rule}"));
        let (told, denied) = waits.0.get(rule).copied().unwrap_or_default();
        assert_eq!(denied, count, "{rule}");
        let within_rounding = match count {
            0 => sum == 0.0 && told == 0,
            n => sum <= told as f64 && (told as f64) < sum + n as f64,
        };
        assert!(
            within_rounding,
            "{rule}: the histogram's sum {sum} s, the Retry-After values {told} s over {count}"
        );
    }
    // Near the limit (at most 20% left): GOOD's second export under api (2 of 10 left)
    // and exports (0 of 2); ABUSIVE's 4th and 5th orders (1 and 0 of 5); GOLD's first
    // export under exports (0 of 1).
    for (rule, n) in [("api", 3), ("exports", 2), ("calm", 0), ("idle", 0)] {
        assert_eq!(
            get(&m, "ratewall_near_limit_total", &[("rule", rule)]),
            n,
            "{rule}"
        );
    }
    // The SLO, within-plan requests by outcome: under api GOOD's 8 passed and 1 denied by
    // exports, ABUSIVE's first 5, GOLD's 1 passed and 1 denied by exports; under exports
    // GOOD's first 2 and GOLD's first (their denied ones were over those plans); under calm
    // every request: 14 passed, 9 denied.
    for (rule, served, limited) in [
        ("api", 8 + 5 + 1, 1 + 1),
        ("exports", 2 + 1, 0),
        ("calm", 14, 9),
        ("idle", 0, 0),
    ] {
        let outcome = |o| {
            get(
                &m,
                "ratewall_plan_requests_total",
                &[("rule", rule), ("outcome", o)],
            )
        };
        assert_eq!(
            (outcome("served"), outcome("limited")),
            (served, limited),
            "{rule}"
        );
    }
    assert!(
        !m.text.contains(GOOD) && !m.text.contains(ABUSIVE) && !m.text.contains(GOLD),
        "an API key in /metrics"
    );

    // /status.json: the same counts, the p95 from the histogram's buckets (api's 7 waits of
    // about 720 s fall in 524.288..1048.576 s; exports' two, to its hour's end, in
    // 2097.152..4194.304 s) and the SLO as a share.
    let stats = client.get(&gw.admin_url("/status.json"), &[]).await.json();
    let rule = |name: &str| {
        stats["rules"]
            .as_array()
            .expect("rules")
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("no rule {name} in {stats}"))
            .clone()
    };
    let (api, exports, calm, idle) = (rule("api"), rule("exports"), rule("calm"), rule("idle"));
    let p95 = |r: &serde_json::Value| r["time_to_reset"]["p95_s"].as_f64();
    let api_p95 = p95(&api).unwrap_or_else(|| panic!("no p95 for api: {api}"));
    assert!((524.288..=1048.576).contains(&api_p95), "{api}");
    let exports_p95 = p95(&exports).unwrap_or_else(|| panic!("no p95: {exports}"));
    assert!((2097.152..=4194.304).contains(&exports_p95), "{exports}");
    assert_eq!(api["time_to_reset"]["denials"], 7, "{api}");
    assert_eq!(p95(&calm), None, "{calm}");
    assert_eq!(api["near_limit"], 3, "{api}");
    assert_eq!(
        (&api["slo"]["served"], &api["slo"]["limited"]),
        (&serde_json::json!(14), &serde_json::json!(2)),
        "{api}"
    );
    assert_eq!(
        api["slo"]["served_share"].as_f64(),
        Some(14.0 / 16.0),
        "{api}"
    );
    assert_eq!(
        exports["slo"]["served_share"].as_f64(),
        Some(1.0),
        "{exports}"
    );
    assert_eq!(
        calm["slo"]["served_share"].as_f64(),
        Some(14.0 / 23.0),
        "{calm}"
    );
    assert_eq!(
        idle["slo"]["served_share"],
        serde_json::Value::Null,
        "{idle}"
    );

    // The page, rendered: the numbers, and "—" where a rule has none.
    let dom = dump_dom(&gw.admin_url("/")).await;
    assert!(
        dom.contains("data-loaded=\"yes\""),
        "the page did not render:\n{dom}"
    );
    assert_eq!(cell(&dom, "api", "slo"), "87.50 %");
    assert_eq!(cell(&dom, "exports", "slo"), "100 %");
    assert_eq!(cell(&dom, "idle", "slo"), "\u{2014}");
    assert_eq!(cell(&dom, "calm", "p95_reset"), "\u{2014}");
    assert_eq!(cell(&dom, "idle", "p95_reset"), "\u{2014}");
    assert_eq!(cell(&dom, "api", "near_limit"), "3");
    let shown = cell(&dom, "api", "p95_reset");
    assert!(
        shown.ends_with('s') && shown.contains('m'),
        "api's p95 of {api_p95} s shown as {shown:?}"
    );
}

/// A token's `plan` claim is the client's to write: a plan the rule does not define
/// gets the rule's own quota and its denials count as `default`; the claimed name never
/// becomes a label. A plan the rule defines counts as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_plan_the_rule_does_not_define_counts_as_default() {
    let _watch = common::watchdog();
    const CLAIMED: &str = "platinum-claimed-by-the-client";
    let upstream = Upstream::start().await;
    let gw = Gateway::start_with(
        &format!(
            "[upstream]\nurl = \"{}\"\n[jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"DASH_JWT_SECRET\"\n\
             plan_claim = \"plan\"\n\
             [[rules]]\nname = \"per-user\"\nkey = \"jwt:sub\"\nrate = \"1/h\"\nburst = 2\n\
             [rules.plans.pro]\nburst = 4\n",
            upstream.url()
        ),
        &[],
        &[("DASH_JWT_SECRET", "dashboards-secret")],
    );
    assert!(common::wait_for_port(
        gw.admin_port,
        Duration::from_secs(10)
    ));
    let key = SigningKey::secret(b"dashboards-secret");
    let token = |sub: &str, plan: &str| {
        let t = key.sign(
            &serde_json::json!({"sub": sub, "plan": plan, "exp": unix_now() + 600}),
            None,
        );
        format!("Bearer {t}")
    };
    let client = HttpClient::new();
    for (auth, passes) in [(token("odd", CLAIMED), 2), (token("paying", "pro"), 4)] {
        for i in 0..6 {
            let s = client
                .get(&gw.url("/x"), &[("authorization", &auth)])
                .await
                .status;
            let want = if i < passes { 200 } else { 429 };
            assert_eq!(s.as_u16(), want, "request {i}, {passes} passing");
        }
    }
    let m = Scrape::take(&client, &gw).await;
    let denials = |plan| {
        get(
            &m,
            "ratewall_denials_total",
            &[("rule", "per-user"), ("plan", plan)],
        )
    };
    assert_eq!((denials("default"), denials("pro")), (4, 2), "{}", m.text);
    assert!(
        !m.text.contains(CLAIMED),
        "a claimed plan became a label:\n{}",
        m.text
    );
}
