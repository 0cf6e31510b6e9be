//! The load of bench/overload: two classes of requests (a free and a pro API key), on an
//! open-loop schedule of phases, every request recorded.
//!
//!     bench-overload-load ADDR OUT.csv PHASES [CONNECTIONS] [GRACE_S]
//!
//! PHASES is `SECS:RATE,…` (`5:400,10:8000,5:400`): RATE requests/s over both classes for
//! SECS seconds each, half of them with `x-api-key: bench-free-key`, half with
//! `x-api-key: bench-pro-key`, each class evenly spaced (the pro requests midway between
//! the free ones). Each class has CONNECTIONS kept-alive HTTP/1.1 connections (default
//! 512), each sending one request at a time: the next one due, at its time, or at once
//! where it is late. A request's latency is counted from the time it was *due*, not from
//! when a connection was free to send it (so that a backlog of the client's own is not
//! hidden: wrk2's correction of coordinated omission). GRACE_S (default 5) after the last
//! request was due, whatever has not been answered is recorded as status 0.
//!
//! OUT.csv has one line per scheduled request, `class,due_ms,sent_ms,done_ms,status,shed`,
//! ms since the start (`sent_ms` and `done_ms` empty where it was never sent or answered;
//! status 0 for those, and for a connection error); `shed`, for a 503, why, from its
//! `detail`: `full` (the queue was full of its priority or higher), `evicted` (a higher
//! priority took its place), `waited` (max_wait), or `other`. Prints a one-line summary.
//! One thread: the gateway and the backend have the other cores.

use std::cell::Cell;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

type Error = Box<dyn std::error::Error + Send + Sync>;

const CLASSES: [(&str, &str); 2] = [("free", "bench-free-key"), ("pro", "bench-pro-key")];

/// One phase: `secs` seconds at `rate` requests/s (both classes together).
#[derive(Clone, Copy)]
struct Phase {
    secs: f64,
    rate: f64,
}

/// When each request of one class is due: evenly spaced at half the rate in each phase,
/// `offset` (0 or 0.5) of a spacing into it.
struct Schedule {
    due: Vec<Duration>,
}

impl Schedule {
    fn new(phases: &[Phase], offset: f64) -> Schedule {
        let mut due = Vec::new();
        let mut start = 0.0;
        for p in phases {
            let spacing = 2.0 / p.rate;
            let n = (p.secs * p.rate / 2.0).round() as usize;
            due.extend(
                (0..n).map(|i| Duration::from_secs_f64(start + (i as f64 + offset) * spacing)),
            );
            start += p.secs;
        }
        Schedule { due }
    }
}

/// One request's record.
#[derive(Clone, Copy)]
struct Record {
    due: Duration,
    sent: Option<Duration>,
    done: Option<Duration>,
    status: u16,
    shed: Shed,
}

/// Why a 503 was shed, read from its problem+json `detail` (the gateway's three).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shed {
    No,
    Full,
    Evicted,
    Waited,
    Other,
}

impl Shed {
    fn of(status: u16, body: &[u8]) -> Shed {
        if status != 503 {
            return Shed::No;
        }
        let has = |s: &str| body.windows(s.len()).any(|w| w == s.as_bytes());
        if has("the queue is full") {
            Shed::Full
        } else if has("higher priority took") {
            Shed::Evicted
        } else if has("waited max_wait") {
            Shed::Waited
        } else {
            Shed::Other
        }
    }

    fn name(self) -> &'static str {
        match self {
            Shed::No => "",
            Shed::Full => "full",
            Shed::Evicted => "evicted",
            Shed::Waited => "waited",
            Shed::Other => "other",
        }
    }
}

/// One class: its schedule, the next request to take, and the records.
struct Class {
    name: &'static str,
    key: &'static str,
    schedule: Schedule,
    next: Cell<usize>,
    records: std::cell::RefCell<Vec<Record>>,
}

fn parse_phases(s: &str) -> Result<Vec<Phase>, Error> {
    s.split(',')
        .map(|p| {
            let (secs, rate) = p.split_once(':').ok_or("a phase is SECS:RATE")?;
            let phase = Phase {
                secs: secs.parse()?,
                rate: rate.parse()?,
            };
            if phase.secs <= 0.0 || phase.rate <= 0.0 {
                return Err("a phase's SECS and RATE are positive".into());
            }
            Ok(phase)
        })
        .collect()
}

fn main() -> Result<(), Error> {
    let usage = "usage: bench-overload-load ADDR OUT.csv PHASES [CONNECTIONS] [GRACE_S]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !(3..=5).contains(&args.len()) {
        return Err(usage.into());
    }
    let addr: SocketAddr = args[0].parse()?;
    let phases = parse_phases(&args[2])?;
    let connections: usize = args.get(3).map_or(Ok(512), |s| s.parse())?;
    let grace: f64 = args.get(4).map_or(Ok(5.0), |s| s.parse())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let classes =
        tokio::task::LocalSet::new().block_on(&rt, run(addr, &phases, connections, grace));
    write_csv(&args[1], &classes)?;
    summary(&classes);
    Ok(())
}

async fn run(addr: SocketAddr, phases: &[Phase], connections: usize, grace: f64) -> Vec<Rc<Class>> {
    let classes: Vec<Rc<Class>> = CLASSES
        .iter()
        .zip([0.0, 0.5])
        .map(|(&(name, key), offset)| {
            Rc::new(Class {
                name,
                key,
                schedule: Schedule::new(phases, offset),
                next: Cell::new(0),
                records: Default::default(),
            })
        })
        .collect();
    let total: f64 = phases.iter().map(|p| p.secs).sum();
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(total + grace);
    let mut workers = Vec::new();
    for class in &classes {
        for _ in 0..connections {
            let class = class.clone();
            workers.push(tokio::task::spawn_local(worker(
                addr, class, start, deadline,
            )));
        }
    }
    for w in workers {
        let _ = w.await;
    }
    // What no connection took before the deadline: never sent.
    for class in &classes {
        let mut records = class.records.borrow_mut();
        for &due in &class.schedule.due[class.next.get().min(class.schedule.due.len())..] {
            records.push(Record {
                due,
                sent: None,
                done: None,
                status: 0,
                shed: Shed::No,
            });
        }
    }
    classes
}

/// One connection of `class`: takes the next request due, sends it at its time (at once
/// if late), until the schedule is done or the deadline passed.
async fn worker(addr: SocketAddr, class: Rc<Class>, start: Instant, deadline: Instant) {
    let mut sender: Option<SendRequest<Empty<Bytes>>> = None;
    loop {
        let i = class.next.get();
        let Some(&due) = class.schedule.due.get(i) else {
            return;
        };
        if Instant::now() >= deadline {
            return;
        }
        class.next.set(i + 1);
        tokio::time::sleep_until(start + due).await;
        let sent = start.elapsed();
        let answer =
            match tokio::time::timeout_at(deadline, send(addr, &mut sender, class.key)).await {
                Ok(Ok(answer)) => Some(answer),
                Ok(Err(_)) => {
                    sender = None;
                    Some((0, Shed::No))
                }
                Err(_) => None,
            };
        class.records.borrow_mut().push(Record {
            due,
            sent: Some(sent),
            done: answer.map(|_| start.elapsed()),
            status: answer.map_or(0, |a| a.0),
            shed: answer.map_or(Shed::No, |a| a.1),
        });
        if answer.is_none() {
            return;
        }
    }
}

/// One request on the kept connection (opened first where there is none); its status and,
/// for a 503, why it was shed.
async fn send(
    addr: SocketAddr,
    sender: &mut Option<SendRequest<Empty<Bytes>>>,
    key: &str,
) -> Result<(u16, Shed), Error> {
    if let Some(s) = sender.as_mut() {
        if s.ready().await.is_err() {
            *sender = None;
        }
    }
    let s = match sender {
        Some(s) => s,
        None => {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let (s, conn) = http1::handshake(TokioIo::new(stream)).await?;
            tokio::task::spawn_local(async move {
                let _ = conn.await;
            });
            sender.insert(s)
        }
    };
    let req = Request::get("/api/work")
        .header("host", "127.0.0.1")
        .header("x-api-key", key)
        .body(Empty::new())?;
    let resp = s.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, Shed::of(status, &body)))
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(String::new, |d| format!("{:.3}", d.as_secs_f64() * 1e3))
}

fn write_csv(path: &str, classes: &[Rc<Class>]) -> std::io::Result<()> {
    let mut out = String::from("class,due_ms,sent_ms,done_ms,status,shed\n");
    for class in classes {
        let mut records = class.records.borrow().clone();
        records.sort_by_key(|r| r.due);
        for r in records {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{}",
                class.name,
                ms(Some(r.due)),
                ms(r.sent),
                ms(r.done),
                r.status,
                r.shed.name()
            );
        }
    }
    std::fs::write(path, out)
}

fn summary(classes: &[Rc<Class>]) {
    let mut line = String::new();
    for class in classes {
        let records = class.records.borrow();
        let count = |f: &dyn Fn(&Record) -> bool| records.iter().filter(|r| f(r)).count();
        let _ = write!(
            line,
            "{} scheduled {} ok {} shed {} other {} unanswered {} ",
            class.name,
            records.len(),
            count(&|r| r.status == 200),
            count(&|r| r.status == 503),
            count(&|r| r.status != 200 && r.status != 503 && r.status != 0),
            count(&|r| r.status == 0),
        );
    }
    println!("{}", line.trim_end());
}
