//! The shared stores: one Redis ([`RedisStore`]), a Redis Cluster
//! ([`RedisClusterStore`]), or a primary found through Redis Sentinel
//! ([`RedisSentinelStore`], a [`RedisStore`] on whichever node is the primary now). All run the Lua twins of the step functions (`lua/`),
//! composed into one script and called with EVALSHA (loaded again on NOSCRIPT, on every
//! node of a cluster; see `eval`). Time is Redis' own `TIME`, so every
//! gateway shares one clock.
//!
//! One Redis decides every rule of a request in one atomic call. In a cluster a script
//! may only touch one slot: keys are hash-tagged on the identity
//! (`<prefix>:{<identity-hash>}:<rule>`), so all rules on one identity are still one
//! atomic call; rules on different identities (say, per key and per IP) are decided one
//! identity at a time, and a denial refunds what the identities before it took.
//!
//! With `[store] replication = { wait = N, timeout }` every write call (a decision or a
//! batch of them, a settlement, a cluster's call per slot and its refunds; not a peek, nor
//! a lease's renewal or release) is followed by `WAIT N timeout` in the same round trip
//! (`eval::eval_waited`); fewer than N replicas make the call a store error
//! ([`StoreError::Unreplicated`]), which `on_error` answers: an admission a replica never
//! got could be granted again by a replica promoted after a failover (docs/scaling.md,
//! "What a failover costs").

mod cluster;
pub mod directory;
mod eval;
mod heartbeat;
mod sentinel;
mod single;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;

use eval::{eval, eval_waited, Evaluates, Invocation, Lua, Wait};

use super::settle::Adjust;
use super::store::{Call, Kind, Receipt, Replication, Settlement, Store};
use super::{unix_now_us, Algorithm, Check, Decision, Quota, StoreError};

/// The script's algorithm code for a calendar window (`lua/fixed_window.lua`): a fixed
/// window whose edges the gateway sends. Its rules are `fixed_window` ones (code 3).
const CALENDAR_CODE: u8 = 6;

pub use cluster::RedisClusterStore;
pub use heartbeat::HEARTBEAT_SCRIPT;
pub use sentinel::{PrimaryAuth, RedisSentinelStore, Sentinels};
pub use single::RedisStore;

/// The script Redis runs: the prelude, each algorithm's file, and the dispatcher, compiled
/// into the binary so it always matches the Rust twins.
pub const SCRIPT: &str = concat!(
    include_str!("../../../lua/prelude.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/gcra.lua"),
    include_str!("../../../lua/fixed_window.lua"),
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/decide.lua"),
);

/// Renews one concurrency lease while its request is in flight.
pub const LEASE_SCRIPT: &str = include_str!("../../../lua/lease.lua");

/// What the script does with the keys it is given.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Decide,
    Peek,
}

/// The script, the key prefix and the per-call timeout: what both stores share.
struct Scripted {
    script: Lua,
    lease_script: Lua,
    prefix: String,
    timeout: Duration,
    /// Tells this process's leases from other gateways' in a shared lease set.
    instance: u64,
    /// What a write call waits for after it ran: `None`, or the replicas `WAIT` asks for.
    wait: Option<Wait>,
}

/// One check as the script's arguments (see `lua/prelude.lua`).
struct Encoded {
    key: String,
    /// `<algorithm code>:<parameters>`: the same string for every request on one rule's
    /// quota, which the script parses once per call.
    quota: Arc<str>,
    shadow: bool,
}

impl Encoded {
    /// Add this key and its 2 arguments; `starts` marks the first key of a batch's
    /// second and later requests (flag 2).
    fn push(&self, inv: &mut Invocation<'_>, starts: bool) {
        inv.key(&self.key)
            .arg(&*self.quota)
            .arg(["0", "1", "2", "3"][usize::from(self.shadow) | if starts { 2 } else { 0 }]);
    }
}

impl Scripted {
    fn new(prefix: &str, timeout: Duration, replication: Replication) -> Scripted {
        use std::hash::{BuildHasher, Hasher};
        // 64 random bits (std's per-process SipHash keys) mixed with the pid and the time.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        Scripted {
            script: Lua::new(SCRIPT),
            lease_script: Lua::new(LEASE_SCRIPT),
            prefix: prefix.to_string(),
            timeout,
            instance: h.finish(),
            wait: match replication {
                Replication::Async => None,
                Replication::Wait { replicas, timeout } => Some(Wait::new(replicas, timeout)),
            },
        }
    }

    /// A concurrency lease's member in the rule's lease set: unique across gateways.
    fn member(&self, check: &Check<'_>) -> String {
        format!("{:016x}-{:x}", self.instance, check.lease)
    }

    async fn timed<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, ::redis::RedisError>>,
    {
        Ok(tokio::time::timeout(self.timeout, f)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??)
    }

    /// Connect and load both scripts, so the first request does not pay for it (a script
    /// load can take longer than a store timeout).
    async fn warm<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), StoreError> {
        let t = self.timeout.max(Duration::from_secs(1));
        for script in [&self.script, &self.lease_script] {
            tokio::time::timeout(t, script.load().exec_async(conn))
                .await
                .map_err(|_| StoreError::Timeout(t))??;
        }
        Ok(())
    }

    /// Remove a lease: its request ended.
    async fn release<C: ConnectionLike>(
        &self,
        conn: &mut C,
        check: &Check<'_>,
    ) -> Result<(), StoreError> {
        let cmd = redis::cmd("ZREM")
            .arg(self.key(check))
            .arg(self.member(check))
            .to_owned();
        let _: i64 = self.timed(cmd.query_async(conn)).await?;
        Ok(())
    }

    /// Extend a lease by its TTL from now. `false`: it had already expired or was reset.
    async fn renew<C: Evaluates>(
        &self,
        conn: &mut C,
        check: &Check<'_>,
    ) -> Result<bool, StoreError> {
        let mut inv = self.lease_script.invocation();
        inv.key(self.key(check))
            .arg(self.member(check))
            .arg(check.quota.lease_us);
        let live: i64 = self.timed(eval(conn, &inv)).await?;
        Ok(live == 1)
    }

    /// `<prefix>:{<identity-hash>}:<rule>`.
    fn key(&self, check: &Check<'_>) -> String {
        let mut key = String::with_capacity(self.prefix.len() + check.rule.len() + 36);
        key.push_str(&self.prefix);
        key.push_str(":{");
        check.identity.push_hex(&mut key);
        key.push_str("}:");
        key.push_str(check.rule);
        key
    }

    /// One check as the script takes it: its key and its arguments. `now_us`: the call's
    /// time where a test gives one, else this machine's clock; only a calendar window
    /// reads it, for its edges (the script still decides at Redis' time, and picks the
    /// window containing it: `lua/fixed_window.lua`).
    fn encode(&self, c: &Check<'_>, now_us: Option<u64>) -> Encoded {
        let q = c.quota;
        // A rate quota's string is the same for every request on it: made once a thread
        // (for the last few quotas), then shared. A calendar's moves with the time, a
        // concurrency limit's carries the request's lease.
        let fixed = q.calendar.is_none() && q.algorithm != Algorithm::Concurrency;
        let quota = if fixed {
            ENCODED.with(|recent| recent.borrow_mut().get(q, || self.quota(c, now_us)))
        } else {
            Arc::from(self.quota(c, now_us))
        };
        Encoded {
            key: self.key(c),
            quota,
            shadow: c.shadow,
        }
    }

    /// `<algorithm code>:<parameters>`: see [`Encoded::quota`].
    fn quota(&self, c: &Check<'_>, now_us: Option<u64>) -> String {
        let q = c.quota;
        let mut n = itoa::Buffer::new();
        let mut quota = String::with_capacity(64);
        let code = match q.calendar {
            Some(_) => CALENDAR_CODE,
            None => q.algorithm.code(),
        };
        quota.push(char::from(b'0' + code));
        let mut param = |p: &str| {
            quota.push(':');
            quota.push_str(p);
        };
        if let Some(cal) = q.calendar {
            // The period open now, and the next one's end: enough for a Redis clock a
            // period either side of this one's (docs/algorithms.md, "Calendar windows").
            let (e0, e1) = cal.window(now_us.unwrap_or_else(unix_now_us));
            let (_, e2) = cal.window(e1);
            for p in [q.rate.count, q.cost, q.max_debt, e0, e1, e2] {
                param(n.format(p));
            }
            return quota;
        }
        match q.algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                for p in [
                    q.unit,
                    q.per_us,
                    q.capacity(),
                    q.need(),
                    q.slack(),
                    q.borrow(),
                ] {
                    param(n.format(p));
                }
            }
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                for p in [q.period_us(), q.rate.count, q.cost, q.max_debt] {
                    param(n.format(p));
                }
            }
            // The lease id in place of the third parameter.
            Algorithm::Concurrency => {
                param(n.format(q.burst));
                param(n.format(q.lease_us));
                param(&self.member(c));
            }
        }
        quota
    }

    /// One script call for `checks` (all on one slot, in a cluster).
    async fn call<C: Evaluates>(
        &self,
        conn: &mut C,
        checks: &[&Check<'_>],
        now_us: Option<u64>,
        mode: Mode,
    ) -> Result<Vec<Decision>, StoreError> {
        let encoded: Vec<Encoded> = checks.iter().map(|c| self.encode(c, now_us)).collect();
        self.call_encoded(conn, &encoded, now_us, mode).await
    }

    /// One script call settling `items` (all on one slot, in a cluster): each key's
    /// settlement stands on its own. One [`Receipt`] per item.
    async fn settle<C: Evaluates>(
        &self,
        conn: &mut C,
        items: &[(&Check<'_>, Adjust)],
        now_us: Option<u64>,
    ) -> Result<Vec<Receipt>, StoreError> {
        let mut inv = self.script.invocation();
        match now_us {
            Some(t) => inv.arg(t),
            None => inv.arg(""),
        };
        inv.arg("settle");
        let mut n = itoa::Buffer::new();
        for (check, adj) in items {
            let e = self.encode(check, now_us);
            let mut arg = String::with_capacity(40);
            arg.push_str(n.format(adj.delta));
            arg.push(':');
            arg.push_str(n.format(adj.window));
            inv.key(&e.key).arg(&*e.quota).arg(arg);
        }
        let reply = self.run(conn, &inv, true, items.len()).await?;
        Ok(answers(&reply.numbers)
            .into_iter()
            .map(|(now, forgiven)| Receipt::new(now, forgiven))
            .collect())
    }

    /// Run `inv`, within the store timeout: the script's reply. A write (`write`) with
    /// `replication = { wait }` is followed by `WAIT` on the same connection, in the same
    /// round trip; fewer replicas than asked make the call [`StoreError::Unreplicated`],
    /// whatever it decided (its writes stand on the primary: stricter, never looser).
    async fn run<C: Evaluates>(
        &self,
        conn: &mut C,
        inv: &Invocation<'_>,
        write: bool,
        keys: usize,
    ) -> Result<Reply, StoreError> {
        let Some(wait) = self.wait.filter(|_| write) else {
            return Reply::read(self.timed(eval(conn, inv)).await?, keys);
        };
        let (reply, acked): (redis::Value, u64) = self.timed(eval_waited(conn, inv, wait)).await?;
        if acked < u64::from(wait.replicas) {
            return Err(StoreError::Unreplicated {
                acked,
                wanted: wait.replicas,
            });
        }
        Reply::read(reply, keys)
    }

    /// Run `inv` on `keys` keys: their decisions. `write`: the call may write (a
    /// decision), so replication applies.
    async fn decisions<C: Evaluates>(
        &self,
        conn: &mut C,
        inv: &Invocation<'_>,
        keys: usize,
        write: bool,
    ) -> Result<Vec<Decision>, StoreError> {
        let reply = self.run(conn, inv, write, keys).await?;
        Ok(decisions(&reply.numbers))
    }

    async fn call_encoded<C: Evaluates>(
        &self,
        conn: &mut C,
        checks: &[Encoded],
        now_us: Option<u64>,
        mode: Mode,
    ) -> Result<Vec<Decision>, StoreError> {
        let mut inv = self.script.invocation();
        match now_us {
            Some(t) => inv.arg(t),
            None => inv.arg(""),
        };
        inv.arg(match mode {
            Mode::Decide => "",
            Mode::Peek => "peek",
        });
        for c in checks {
            c.push(&mut inv, false);
        }
        self.decisions(conn, &inv, checks.len(), mode == Mode::Decide)
            .await
    }

    /// One script call deciding several requests, one after another, each all or nothing
    /// (at Redis' time). Each request's answers, or its own key error; an `Err` fails all.
    async fn call_batch<C: Evaluates>(
        &self,
        conn: &mut C,
        requests: &[&[Encoded]],
    ) -> Result<Vec<Result<Vec<Decision>, StoreError>>, StoreError> {
        let mut inv = self.script.invocation();
        inv.arg("").arg("");
        for (r, checks) in requests.iter().enumerate() {
            for (k, c) in checks.iter().enumerate() {
                c.push(&mut inv, r > 0 && k == 0);
            }
        }
        let keys: usize = requests.iter().map(|r| r.len()).sum();
        let mut reply = self.run(conn, &inv, true, keys).await?;
        let mut rest = &reply.numbers[..];
        let mut out = Vec::with_capacity(requests.len());
        for (r, checks) in requests.iter().enumerate() {
            let (mine, after) = rest.split_at(checks.len() * PER_KEY);
            rest = after;
            let failed = reply.failed.iter_mut().find(|(at, _)| *at == r);
            out.push(match failed {
                Some((_, why)) => Err(StoreError::Data(std::mem::take(why))),
                None => Ok(decisions(mine)),
            });
        }
        Ok(out)
    }

    async fn ping<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), StoreError> {
        let pong: String = tokio::time::timeout(self.timeout, redis::cmd("PING").query_async(conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::Protocol(format!("PING answered {pong:?}")))
        }
    }

    async fn delete<C: ConnectionLike>(
        &self,
        conn: &mut C,
        check: &Check<'_>,
    ) -> Result<(), StoreError> {
        let _: i64 = tokio::time::timeout(
            self.timeout,
            redis::cmd("DEL").arg(self.key(check)).query_async(conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))??;
        Ok(())
    }
}

/// A shared store's decisions at a time of the caller's choosing: `None` is Redis' own
/// `TIME` (always, in production); tests pass their own times to replay timelines.
pub trait DecideAt {
    /// Decide `checks` at `now_us`, all or nothing.
    fn decide_at<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        now_us: Option<u64>,
    ) -> impl Future<Output = Result<Vec<Decision>, StoreError>> + Send + 'a;

    /// What `checks` would be told at `now_us`, charging nothing.
    fn peek_at<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        now_us: Option<u64>,
    ) -> impl Future<Output = Result<Vec<Decision>, StoreError>> + Send + 'a;

    /// Settle `items` at `now_us`: one atomic call per identity (one call in all on one
    /// Redis); each settlement stands on its own.
    fn settle_at<'a>(
        &'a self,
        items: &'a [Settlement<'a>],
        now_us: Option<u64>,
    ) -> impl Future<Output = Result<Vec<Receipt>, StoreError>> + Send + 'a;
}

/// What tells the two shared stores apart: how a call gets a connection, and how a
/// request's rules are decided (one atomic call, or one per cluster slot). Everything
/// else they do is written once, in their [`Store`] implementation below.
trait Shared: DecideAt + Send + Sync {
    type Conn: Evaluates;
    const KIND: Kind;

    fn scripted(&self) -> &Scripted;

    /// A connection to run one call on (a multiplexed handle: cheap to clone).
    fn connection(&self) -> impl Future<Output = Result<Self::Conn, StoreError>> + Send;

    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn warm(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// See [`Store::primary`].
    fn primary(&self) -> Option<String> {
        None
    }

    /// See [`Store::describe`].
    fn describe(&self) -> String {
        Self::KIND.name().to_string()
    }
}

impl<S: Shared> Store for S {
    fn kind(&self) -> Kind {
        S::KIND
    }

    fn decide<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>> {
        Call::pending(self.decide_at(checks, None))
    }

    fn peek<'a>(&'a self, checks: &'a [Check<'a>]) -> Call<'a, Vec<Decision>> {
        Call::pending(self.peek_at(checks, None))
    }

    fn settle<'a>(&'a self, items: &'a [Settlement<'a>]) -> Call<'a, Vec<Receipt>> {
        Call::pending(self.settle_at(items, None))
    }

    fn reset<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, ()> {
        Call::pending(async move {
            self.scripted()
                .delete(&mut self.connection().await?, check)
                .await
        })
    }

    fn release<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, ()> {
        Call::pending(async move {
            self.scripted()
                .release(&mut self.connection().await?, check)
                .await
        })
    }

    fn renew<'a>(&'a self, check: &'a Check<'a>) -> Call<'a, bool> {
        Call::pending(async move {
            self.scripted()
                .renew(&mut self.connection().await?, check)
                .await
        })
    }

    fn ping(&self) -> Call<'_, ()> {
        Call::pending(Shared::ping(self))
    }

    fn heartbeat(&self, window: Duration) -> Call<'_, u32> {
        Call::pending(async move {
            self.scripted()
                .heartbeat(&mut self.connection().await?, window)
                .await
        })
    }

    fn tag_secret<'a>(&'a self, fresh: &'a str) -> Call<'a, Option<String>> {
        Call::pending(async move {
            self.scripted()
                .tag_secret(&mut self.connection().await?, fresh)
                .await
                .map(Some)
        })
    }

    fn warm(&self) -> Call<'_, ()> {
        Call::pending(Shared::warm(self))
    }

    fn primary(&self) -> Option<String> {
        Shared::primary(self)
    }

    fn describe(&self) -> String {
        Shared::describe(self)
    }
}

/// How many quotas' strings a thread keeps ([`Scripted::encode`]).
const ENCODED_KEPT: usize = 8;

/// The last quotas a thread encoded, and their strings; the oldest gives way.
#[derive(Default)]
struct Encodings {
    kept: Vec<(Quota, Arc<str>)>,
    next: usize,
}

impl Encodings {
    fn get(&mut self, q: &Quota, make: impl FnOnce() -> String) -> Arc<str> {
        if let Some((_, s)) = self.kept.iter().find(|(k, _)| k == q) {
            return s.clone();
        }
        let s: Arc<str> = Arc::from(make());
        if self.kept.len() < ENCODED_KEPT {
            self.kept.push((*q, s.clone()));
        } else {
            self.kept[self.next] = (*q, s.clone());
            self.next = (self.next + 1) % ENCODED_KEPT;
        }
        s
    }
}

thread_local! {
    static ENCODED: std::cell::RefCell<Encodings> = std::cell::RefCell::new(Encodings::default());
}

/// The numbers the script answers per key (`lua/decide.lua`).
const PER_KEY: usize = 5;

/// The script's reply (`lua/decide.lua`): [`PER_KEY`] numbers a key, in key order, and in
/// a batch the requests that failed on a key's state (their place, from 0, and why).
#[derive(Debug, PartialEq)]
struct Reply {
    numbers: Vec<u64>,
    failed: Vec<(usize, String)>,
}

impl Reply {
    /// `value` read as the reply for `keys` keys: its first item is every number as one
    /// string (one value to take off the connection, not one a number), space-separated;
    /// the failed requests' places (from 1) and errors follow.
    fn read(value: redis::Value, keys: usize) -> Result<Reply, StoreError> {
        let bad = |what: String| Err(StoreError::Protocol(format!("the script answered {what}")));
        let redis::Value::Array(items) = value else {
            return bad(format!("{value:?}, not a list"));
        };
        let mut items = items.into_iter();
        let numbers = match items.next() {
            Some(redis::Value::BulkString(b)) => numbers(&b)?,
            other => return bad(format!("{other:?} in the place of its numbers")),
        };
        if numbers.len() != keys * PER_KEY {
            return bad(format!("{} numbers for {keys} keys", numbers.len()));
        }
        let mut failed = Vec::new();
        while let Some(place) = items.next() {
            let text = |v: Option<redis::Value>| match v {
                Some(redis::Value::BulkString(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
                _ => None,
            };
            let (Some(place), Some(why)) = (text(Some(place)), text(items.next())) else {
                return bad("a failed request without its place and error".to_string());
            };
            match place.parse::<usize>() {
                Ok(p) if p >= 1 => failed.push((p - 1, why)),
                _ => return bad(format!("{place:?} as a failed request's place")),
            }
        }
        Ok(Reply { numbers, failed })
    }
}

/// Whole numbers separated by single spaces.
fn numbers(text: &[u8]) -> Result<Vec<u64>, StoreError> {
    text.split(|b| *b == b' ')
        .map(|n| {
            // Up to 19 digits: never past u64::MAX.
            let digits = !n.is_empty() && n.len() <= 19 && n.iter().all(u8::is_ascii_digit);
            digits
                .then(|| n.iter().fold(0u64, |v, d| v * 10 + u64::from(d - b'0')))
                .ok_or_else(|| {
                    StoreError::Protocol(format!(
                        "not a whole number: {:?}",
                        String::from_utf8_lossy(n)
                    ))
                })
        })
        .collect()
}

/// The script's answers, [`PER_KEY`] numbers a key: the decision, and the fifth (in
/// decide and peek mode the window, in settle mode the cost forgiven) apart.
fn answers(numbers: &[u64]) -> Vec<(Decision, u64)> {
    numbers
        .chunks_exact(PER_KEY)
        .map(|c| {
            let d = Decision {
                allowed: c[0] == 1,
                remaining: c[1],
                retry_after_us: c[2],
                reset_us: c[3],
                window: c[4],
            };
            (d, c[4])
        })
        .collect()
}

/// The script's decisions (decide and peek mode: the fifth number is the window each was
/// decided in).
fn decisions(numbers: &[u64]) -> Vec<Decision> {
    answers(numbers).into_iter().map(|(d, _)| d).collect()
}

/// Whether a call failed because its connection had dropped (worth one more try on the
/// connection being re-established), not because Redis refused or timed out.
fn dropped(e: &StoreError) -> bool {
    match e {
        StoreError::Redis(r) => {
            r.is_connection_dropped()
                || (r.is_io_error() && !r.is_connection_refusal() && !r.is_timeout())
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn the_scripts_reply_is_read_whole_or_refused() {
        let one = Value::Array(vec![bulk("1 9 0 3600000000 1700000000000000")]);
        let read = Reply::read(one, 1).expect("one request's reply");
        assert_eq!(
            read.numbers,
            [1, 9, 0, 3_600_000_000, 1_700_000_000_000_000]
        );
        assert!(read.failed.is_empty());
        let batch = Value::Array(vec![
            bulk("0 0 0 0 0 1 2 3 4 5"),
            bulk("1"),
            bulk("RATEWALL k: WRONGTYPE"),
        ]);
        let read = Reply::read(batch, 2).expect("a batch reply");
        assert_eq!(read.failed, vec![(0, "RATEWALL k: WRONGTYPE".to_string())]);
        assert_eq!(read.numbers[5..], [1, 2, 3, 4, 5]);
        for bad in [
            Value::Array(vec![bulk("1 2 3 4")]),
            Value::Array(vec![bulk("1 2 3 4 -5")]),
            Value::Array(vec![bulk("1 2  3 4 5")]),
            Value::Array(vec![bulk("1 2 3 4 99999999999999999999")]),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![bulk("1 2 3 4 5"), bulk("0"), bulk("why")]),
            Value::Array(vec![bulk("1 2 3 4 5"), bulk("1")]),
            Value::Int(1),
        ] {
            assert!(Reply::read(bad.clone(), 1).is_err(), "{bad:?}");
        }
    }
}
