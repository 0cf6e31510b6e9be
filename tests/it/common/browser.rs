//! Headless Chromium: a page as a real browser renders it (its scripts run), for the
//! status page.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

/// The `chromium` on `PATH` (or `/usr/bin/chromium`); panics, saying how to install it,
/// when there is none.
pub fn chromium() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("chromium"))
            .find(|p| p.is_file())
    });
    let path = found.unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        path.is_file(),
        "chromium is not installed: the status page tests need it (./scripts/test installs \
         it, or: apt-get install chromium)"
    );
    path
}

/// The DOM of `url` once headless Chromium has run its scripts (5 s of virtual time); at
/// most 90 s.
pub async fn dump_dom(url: &str) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=5000",
        "--dump-dom",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .arg(url)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let child = cmd.spawn().expect("spawn chromium");
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
        .await
        .expect("chromium did not finish within 90 s")
        .expect("chromium output");
    assert!(
        out.status.success(),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("the DOM is UTF-8")
}
