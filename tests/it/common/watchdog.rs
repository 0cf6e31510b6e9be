//! A bounded time for every test: a hung test ends the run with its name, instead of
//! holding CI until its own timeout.
//!
//! Every test of this binary begins with `let _watch = common::watchdog();`
//! ([`every_test_is_watched`] checks that none forgets). The call notes the test's name
//! (libtest runs each test on a thread named after it) and the time; the guard it returns
//! takes the test off the list when the test ends, however it ends. One thread, started by
//! the first call, looks at the list every second: a test running past its budget
//! ([`BUDGET`], or `RATEWALL_TEST_BUDGET` seconds) is named on stderr with every test still
//! running, the processes the tests started (gateways, redis-server, nginx, Python
//! backends, Chromium) are killed, and the binary exits with 101, as a failed run does.
//! (libtest cannot stop one test thread; `cargo test` has no per-test timeout on stable.)
//!
//! Time spent waiting for [`super::serial`]'s lock is not counted: a test's clock starts
//! again once it holds the lock, so that the one that hangs, not the ones queued behind
//! it, is named.

use std::io::Write;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How long one test may run, unless `RATEWALL_TEST_BUDGET` (seconds) says otherwise. The
/// longest tests take about a minute on a loaded 2-core machine.
pub const BUDGET: Duration = Duration::from_secs(300);

/// A running test: its name, and since when its clock runs (`None` while it waits for
/// the serial lock).
struct Running {
    thread: ThreadId,
    name: String,
    since: Option<Instant>,
}

static RUNNING: Mutex<Vec<Running>> = Mutex::new(Vec::new());
/// The budget, once the watchdog thread is started.
static STARTED: OnceLock<Duration> = OnceLock::new();

fn running() -> std::sync::MutexGuard<'static, Vec<Running>> {
    RUNNING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The budget of this run: `RATEWALL_TEST_BUDGET` (whole seconds), else [`BUDGET`].
fn budget() -> Duration {
    match std::env::var("RATEWALL_TEST_BUDGET") {
        Ok(s) => {
            Duration::from_secs(s.trim().parse().unwrap_or_else(|_| {
                panic!("RATEWALL_TEST_BUDGET={s:?} is not a number of seconds")
            }))
        }
        Err(_) => BUDGET,
    }
}

/// The test on this thread is watched until the guard drops (the test's first line:
/// `let _watch = common::watchdog();`).
#[must_use = "the test is watched while the guard lives: `let _watch = common::watchdog();`"]
pub fn watchdog() -> Watched {
    STARTED.get_or_init(|| {
        let budget = budget();
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || watch(budget))
            .expect("start the watchdog thread");
        budget
    });
    let me = std::thread::current();
    let name = me
        .name()
        .unwrap_or("(a test on an unnamed thread)")
        .to_string();
    running().push(Running {
        thread: me.id(),
        name,
        since: Some(Instant::now()),
    });
    Watched { thread: me.id() }
}

/// The guard of [`watchdog`]: the test is watched while it lives.
pub struct Watched {
    thread: ThreadId,
}

impl Drop for Watched {
    fn drop(&mut self) {
        let mut list = running();
        let ended = list.iter().position(|r| r.thread == self.thread);
        if let Some(r) = ended.map(|at| list.remove(at)) {
            // A test past half its budget is said on the terminal (past libtest's
            // capture): the budget is to be raised, or the test made shorter, before it
            // is reached.
            let took = r.since.map(|s| s.elapsed()).unwrap_or_default();
            let budget = *STARTED.get().expect("started with the first test");
            if took > budget / 2 {
                let _ = writeln!(
                    std::io::stderr(),
                    "watchdog: test `{}` took {took:.0?}, more than half its budget of {budget:?}",
                    r.name
                );
            }
        }
    }
}

/// The test on this thread waits (for the serial lock) until the guard drops: its clock
/// stops, then starts again from zero.
pub(super) fn waiting() -> Waiting {
    let me = std::thread::current().id();
    set_since(me, None);
    Waiting(me)
}

pub(super) struct Waiting(ThreadId);

impl Drop for Waiting {
    fn drop(&mut self) {
        set_since(self.0, Some(Instant::now()));
    }
}

fn set_since(thread: ThreadId, since: Option<Instant>) {
    if let Some(r) = running().iter_mut().find(|r| r.thread == thread) {
        r.since = since;
    }
}

/// The watchdog thread: once a second, is any test past `budget`?
fn watch(budget: Duration) {
    loop {
        // Real time passing on purpose: the watchdog's own tick.
        std::thread::sleep(Duration::from_secs(1));
        let list = running();
        let Some(hung) = list
            .iter()
            .find(|r| r.since.is_some_and(|s| s.elapsed() > budget))
        else {
            continue;
        };
        let mut message = format!(
            "\nwatchdog: test `{}` has run for more than {budget:?} (RATEWALL_TEST_BUDGET); \
             the run is stopped so that it does not hang CI.\n\
             Run it alone with its output: cargo test --test it -- --exact {} --nocapture\n\
             Tests still running:\n",
            hung.name, hung.name
        );
        for r in list.iter() {
            let state = match r.since {
                Some(s) => format!("{:.0?}", s.elapsed()),
                None => "waiting for the serial lock".to_string(),
            };
            message.push_str(&format!("  {} ({state})\n", r.name));
        }
        // Straight to the file descriptor: libtest captures `eprintln!` of the thread that
        // started this one, and that capture is lost when the process exits.
        let _ = std::io::stderr().write_all(message.as_bytes());
        kill_descendants();
        std::process::exit(101);
    }
}

/// SIGKILL every process this one started, and theirs: exiting runs no destructor, so no
/// `Drop` would kill them.
fn kill_descendants() {
    let me = std::process::id();
    let mut parents = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid ...`: the name may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parents.push((pid, ppid));
            }
        }
    }
    let mut doomed = vec![me];
    let mut i = 0;
    while i < doomed.len() {
        let parent = doomed[i];
        doomed.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    let children: Vec<String> = doomed[1..].iter().map(u32::to_string).collect();
    if !children.is_empty() {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .args(&children)
            .status();
    }
}

/// Every test function under `tests/it/` starts with `let _watch = common::watchdog();`:
/// one without it could hang the run unnamed.
#[test]
fn every_test_is_watched() {
    let _watch = watchdog();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it");
    let mut files = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).expect("read tests/it").flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut unwatched = Vec::new();
    let mut tests = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a test file");
        let lines: Vec<&str> = text.lines().collect();
        for (at, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            if !(t.starts_with("#[test]") || t.starts_with("#[tokio::test")) {
                continue;
            }
            tests += 1;
            // The signature, then its body's first statement.
            let Some(sig) = (at..lines.len()).find(|&i| lines[i].contains("fn ")) else {
                unwatched.push(format!(
                    "{}:{}: no fn after the attribute",
                    file.display(),
                    at + 1
                ));
                continue;
            };
            let open = (sig..lines.len()).find(|&i| lines[i].trim_end().ends_with('{'));
            let first = open.and_then(|o| {
                lines[o + 1..]
                    .iter()
                    .map(|l| l.trim())
                    .find(|l| !l.is_empty() && !l.starts_with("//"))
            });
            if !first.is_some_and(|l| l.starts_with("let _watch =") && l.contains("watchdog()")) {
                let name = lines[sig].trim();
                let rel = file.strip_prefix(&root).unwrap_or(file);
                unwatched.push(format!("{}:{}: {name}", rel.display(), sig + 1));
            }
        }
    }
    assert!(
        tests > 300,
        "only {tests} tests found under {}",
        root.display()
    );
    assert!(
        unwatched.is_empty(),
        "tests that do not begin with `let _watch = common::watchdog();`:\n{}",
        unwatched.join("\n")
    );
}
