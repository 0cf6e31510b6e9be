//! One EVALSHA, and what to do when it is refused: a server that lost the script
//! (NOSCRIPT, after a restart or `SCRIPT FLUSH`) is given it again; a cluster slot being
//! migrated (ASK) is followed with `ASKING` written together with the call.
//!
//! redis-rs' cluster client follows ASK by itself, but sends `ASKING` and the call as two
//! requests on a connection other calls share: a call that lands between them consumes
//! the one-time `ASKING`, the target answers MOVED back to the source, which answers ASK
//! again, until the redirections run out and the call fails. Under load that turned a
//! slot migration into store errors (tests/it/scale.rs,
//! `a_slot_moved_to_another_master_mid_run_keeps_its_state`).
//!
//! With `[store] replication = { wait }` a write call is followed by `WAIT` in the same
//! pipeline ([`eval_waited`]): one round trip, on the connection (so to the node) that ran
//! the script, since `WAIT` counts the replicas that have that connection's writes. A
//! cluster routes the pipeline by the script's keys, to the master of their slot (`WAIT`
//! has no key and does not move it).

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisResult, RetryMethod, Value,
};
use std::future::Future;

/// A Lua script and its SHA1, as EVALSHA names it.
pub(super) struct Lua {
    code: &'static str,
    hash: String,
}

impl Lua {
    pub(super) fn new(code: &'static str) -> Lua {
        let hash = redis::Script::new(code).get_hash().to_owned();
        Lua { code, hash }
    }

    /// A call of this script, keys and arguments to be added.
    pub(super) fn invocation(&self) -> Invocation<'_> {
        Invocation {
            lua: self,
            keys: Args::default(),
            args: Args::default(),
        }
    }

    /// `SCRIPT LOAD` (a cluster client sends it to every master).
    pub(super) fn load(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(self.code);
        cmd
    }
}

/// One call of a [`Lua`] script: its keys and its arguments.
pub(super) struct Invocation<'l> {
    lua: &'l Lua,
    keys: Args,
    args: Args,
}

impl Invocation<'_> {
    pub(super) fn key<T: redis::ToRedisArgs>(&mut self, key: T) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    pub(super) fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    fn evalsha(&self) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.lua.hash).arg(self.keys.ends.len());
        for a in self.keys.iter().chain(self.args.iter()) {
            cmd.arg(a);
        }
        cmd
    }
}

/// Arguments one after another in one buffer: none allocated alone (a batch has hundreds).
#[derive(Default)]
struct Args {
    bytes: Vec<u8>,
    /// Where each ends in `bytes`.
    ends: Vec<usize>,
}

impl Args {
    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(a, &b)| &self.bytes[a..b])
    }
}

impl redis::RedisWrite for Args {
    fn write_arg(&mut self, arg: &[u8]) {
        self.bytes.extend_from_slice(arg);
        self.ends.push(self.bytes.len());
    }

    fn writer_for_next_arg(&mut self) -> impl std::io::Write + '_ {
        NextArg(self)
    }
}

/// An argument being written; it ends when dropped.
struct NextArg<'a>(&'a mut Args);

impl std::io::Write for NextArg<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for NextArg<'_> {
    fn drop(&mut self) {
        self.0.ends.push(self.0.bytes.len());
    }
}

/// A connection scripts are called on: one server's, or a cluster's (which may redirect).
pub(super) trait Evaluates: ConnectionLike + Send {
    /// The cluster connection, for following an ASK; `None` for one server.
    fn cluster(&mut self) -> Option<&mut ClusterConnection> {
        None
    }
}

impl Evaluates for ConnectionManager {}

impl Evaluates for ClusterConnection {
    fn cluster(&mut self) -> Option<&mut ClusterConnection> {
        Some(self)
    }
}

/// `WAIT <replicas> <timeout>`, as `[store] replication = { wait, timeout }` asks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Wait {
    pub(super) replicas: u32,
    /// Never 0: `WAIT` with a timeout of 0 blocks until enough replicas answer, forever.
    timeout_ms: u64,
}

impl Wait {
    /// `timeout` in whole milliseconds, rounded up, at least 1.
    pub(super) fn new(replicas: u32, timeout: std::time::Duration) -> Wait {
        let ms = timeout.as_micros().div_ceil(1000).max(1);
        Wait {
            replicas,
            timeout_ms: u64::try_from(ms).unwrap_or(u64::MAX),
        }
    }

    fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(self.replicas).arg(self.timeout_ms);
        cmd
    }
}

/// EVALSHA `inv`; on NOSCRIPT, load the script and call it once more; on an ASK that
/// redis-rs gave up on, call it on the node the ASK names.
pub(super) async fn eval<C: Evaluates, T: FromRedisValue>(
    conn: &mut C,
    inv: &Invocation<'_>,
) -> RedisResult<T> {
    let answer = loaded(conn, inv, &inv.evalsha()).await;
    match (answer, conn.cluster()) {
        (Err(e), Some(cluster)) if matches!(e.retry_method(), RetryMethod::AskRedirect) => {
            let answer = only(asking(cluster, inv, e, None).await?)?;
            Ok(T::from_redis_value(answer)?)
        }
        (answer, _) => answer,
    }
}

/// EVALSHA `inv` and `wait` in one pipeline on one connection: the script's answer, and
/// how many replicas had its write by `WAIT`'s end. NOSCRIPT and ASK are followed as
/// [`eval`] follows them, `WAIT` still right after the call.
pub(super) async fn eval_waited<C: Evaluates, T: FromRedisValue>(
    conn: &mut C,
    inv: &Invocation<'_>,
    wait: Wait,
) -> RedisResult<(T, u64)> {
    let mut call = redis::pipe();
    call.add_command(inv.evalsha()).add_command(wait.cmd());
    let answer = loaded(conn, inv, &call).await;
    match (answer, conn.cluster()) {
        (Err(e), Some(cluster)) if matches!(e.retry_method(), RetryMethod::AskRedirect) => {
            let mut answers = asking(cluster, inv, e, Some(wait)).await?;
            let (Some(acked), Some(answer), true) =
                (answers.pop(), answers.pop(), answers.is_empty())
            else {
                return Err(RedisError::from((
                    ErrorKind::Parse,
                    "a redirected script call got other than two answers",
                )));
            };
            Ok((T::from_redis_value(answer)?, u64::from_redis_value(acked)?))
        }
        (answer, _) => answer,
    }
}

/// What carries a script call: the EVALSHA alone, or a pipeline of it and its `WAIT`.
trait Carrier: Sync {
    fn send<T: FromRedisValue>(
        &self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> impl Future<Output = RedisResult<T>> + Send;
}

impl Carrier for Cmd {
    fn send<T: FromRedisValue>(
        &self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> impl Future<Output = RedisResult<T>> + Send {
        self.query_async(conn)
    }
}

impl Carrier for Pipeline {
    fn send<T: FromRedisValue>(
        &self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> impl Future<Output = RedisResult<T>> + Send {
        self.query_async(conn)
    }
}

/// Send `call`; where the server lacks `inv`'s script (NOSCRIPT), load it and send `call`
/// once more.
async fn loaded<C: Evaluates, T: FromRedisValue>(
    conn: &mut C,
    inv: &Invocation<'_>,
    call: &impl Carrier,
) -> RedisResult<T> {
    match call.send(conn).await {
        Err(e) if no_script(&e) => {
            inv.lua.load().exec_async(conn).await?;
            call.send(conn).await
        }
        answer => answer,
    }
}

fn no_script(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// Call `inv` on the node `ask` names, `ASKING` and the call (and `wait`, if any) written
/// as one pipeline so that nothing comes between them; the script first when that node
/// lacks it. The call's answer, then `WAIT`'s.
async fn asking(
    conn: &mut ClusterConnection,
    inv: &Invocation<'_>,
    ask: RedisError,
    wait: Option<Wait>,
) -> RedisResult<Vec<Value>> {
    let Some(route) = ask
        .redirect_node()
        .and_then(|(node, _slot)| by_address(node))
    else {
        return Err(ask);
    };
    let count = 1 + usize::from(wait.is_some());
    let pipeline = |load: bool| {
        let mut pipe = redis::pipe();
        if load {
            pipe.add_command(inv.lua.load());
        }
        pipe.cmd("ASKING").add_command(inv.evalsha());
        if let Some(w) = wait {
            pipe.add_command(w.cmd());
        }
        pipe
    };
    let mut answers = conn
        .route_pipeline(pipeline(false), 1, count, route.clone())
        .await?;
    if let Some(Value::ServerError(e)) = answers.first() {
        if no_script(&RedisError::from(e.clone())) {
            answers = conn.route_pipeline(pipeline(true), 2, count, route).await?;
        }
    }
    answers.into_iter().map(Value::extract_error).collect()
}

/// `host:port` (the host may be an IPv6 address) as a route to that node.
fn by_address(node: &str) -> Option<SingleNodeRoutingInfo> {
    let (host, port) = node.rsplit_once(':')?;
    Some(SingleNodeRoutingInfo::ByAddress {
        host: host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
        port: port.parse().ok()?,
    })
}

fn only(mut answers: Vec<Value>) -> RedisResult<Value> {
    match (answers.pop(), answers.is_empty()) {
        (Some(answer), true) => Ok(answer),
        _ => Err(RedisError::from((
            ErrorKind::Parse,
            "a redirected script call got other than one answer",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_node_address_is_a_route() {
        let route = |host: &str, port: u16| SingleNodeRoutingInfo::ByAddress {
            host: host.into(),
            port,
        };
        assert_eq!(by_address("127.0.0.1:7001"), Some(route("127.0.0.1", 7001)));
        assert_eq!(by_address("::1:7001"), Some(route("::1", 7001)));
        assert_eq!(by_address("[::1]:7001"), Some(route("::1", 7001)));
        assert_eq!(by_address("node-a:70001"), None);
        assert_eq!(by_address("no-port"), None);
    }

    #[test]
    fn a_wait_never_blocks_forever() {
        let ms = |d: Duration| Wait::new(1, d).timeout_ms;
        assert_eq!(ms(Duration::from_millis(5)), 5);
        assert_eq!(ms(Duration::from_micros(5_001)), 6, "rounded up");
        assert_eq!(
            ms(Duration::from_micros(1)),
            1,
            "WAIT 0 would block forever"
        );
        let packed = String::from_utf8_lossy(
            &Wait::new(2, Duration::from_millis(50))
                .cmd()
                .get_packed_command(),
        )
        .into_owned();
        assert_eq!(packed, "*3\r\n$4\r\nWAIT\r\n$1\r\n2\r\n$2\r\n50\r\n");
    }

    #[test]
    fn evalsha_names_the_keys_then_the_arguments() {
        let lua = Lua::new("return 1");
        let mut inv = lua.invocation();
        inv.key("k1").arg("a1").key("k2").arg(7u64);
        let packed = String::from_utf8_lossy(&inv.evalsha().get_packed_command()).into_owned();
        let words: Vec<&str> = packed
            .split("\r\n")
            .filter(|w| !w.starts_with(['*', '$']))
            .collect();
        assert_eq!(
            words,
            ["EVALSHA", lua.hash.as_str(), "2", "k1", "k2", "a1", "7", ""],
            "{packed:?}"
        );
        assert_eq!(
            lua.hash, "e0e1f9fabfc9d4800c877a703b823ac0578ff8db",
            "SHA1 of the code"
        );
    }

    #[test]
    fn an_invocation_sends_its_keys_then_its_arguments_each_whole() {
        let lua = Lua::new("return 1");
        let mut inv = lua.invocation();
        inv.key("k:1")
            .arg(42u64)
            .arg("")
            .key(String::from("k:2"))
            .arg("1:2:3")
            .arg(7i64);
        let cmd = inv.evalsha();
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => b.to_vec(),
                other => panic!("not a plain argument: {other:?}"),
            })
            .collect();
        let want: Vec<&[u8]> = vec![
            b"EVALSHA",
            lua.hash.as_bytes(),
            b"2",
            b"k:1",
            b"k:2",
            b"42",
            b"",
            b"1:2:3",
            b"7",
        ];
        assert_eq!(args, want);
    }
}
