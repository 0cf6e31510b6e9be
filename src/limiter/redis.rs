//! The shared store: one Redis, one multiplexed connection for every request, and the Lua
//! twins of the step functions (`lua/`), run atomically with EVALSHA (reloaded on NOSCRIPT
//! by `redis::Script`): one call decides every rule of a request. Time is Redis' own
//! `TIME`, so every gateway shares one clock.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{Algorithm, Check, Decision, StoreError};

/// The script Redis runs: the prelude, each algorithm's file, and the dispatcher, compiled
/// into the binary so it always matches the Rust twins.
pub const SCRIPT: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/decide.lua"),
);

pub struct RedisStore {
    conn: ConnectionManager,
    script: redis::Script,
    prefix: String,
    timeout: Duration,
}

impl RedisStore {
    /// Set up the connection without waiting for it: a gateway starts while Redis is down
    /// and answers by `on_error` until Redis is reachable.
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(250))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(RedisStore {
            conn,
            script: redis::Script::new(SCRIPT),
            prefix: prefix.to_string(),
            timeout,
        })
    }

    /// The Redis key of one identity under one rule: `<prefix>:{<identity-hash>}:<rule>`.
    pub fn key(&self, check: &Check<'_>) -> String {
        format!(
            "{}:{{{}}}:{}",
            self.prefix,
            check.identity.hex(),
            check.rule
        )
    }

    /// Decide all `checks` in one script call. `now_us`: `None` reads Redis `TIME` (always,
    /// in production); tests pass a time to replay a timeline exactly.
    pub async fn decide(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        self.run(checks, now_us, false).await
    }

    /// What `checks` would be told now, without charging or writing anything.
    pub async fn peek(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Decision>, StoreError> {
        self.run(checks, now_us, true).await
    }

    /// Forget one identity's state under one rule.
    pub async fn reset(&self, check: &Check<'_>) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let _: i64 = tokio::time::timeout(
            self.timeout,
            redis::cmd("DEL")
                .arg(self.key(check))
                .query_async(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))??;
        Ok(())
    }

    async fn run(
        &self,
        checks: &[Check<'_>],
        now_us: Option<u64>,
        peek: bool,
    ) -> Result<Vec<Decision>, StoreError> {
        let mut inv = self.script.prepare_invoke();
        match now_us {
            Some(t) => inv.arg(t),
            None => inv.arg(""),
        };
        inv.arg(if peek { "peek" } else { "" });
        for c in checks {
            let q = c.quota;
            inv.key(self.key(c)).arg(q.algorithm.code());
            match q.algorithm {
                Algorithm::TokenBucket | Algorithm::Gcra => inv
                    .arg(q.unit)
                    .arg(q.per_us)
                    .arg(q.capacity())
                    .arg(q.need()),
                Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                    inv.arg(q.period_us()).arg(q.rate.count).arg(q.cost).arg(0)
                }
            };
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))??;
        if reply.len() != checks.len() * 4 {
            return Err(StoreError::Protocol(format!(
                "the script returned {} numbers for {} keys",
                reply.len(),
                checks.len()
            )));
        }
        let num = |v: i64| {
            u64::try_from(v).map_err(|_| StoreError::Protocol(format!("negative value {v}")))
        };
        reply
            .chunks_exact(4)
            .map(|c| {
                Ok(Decision {
                    allowed: c[0] == 1,
                    remaining: num(c[1])?,
                    retry_after_us: num(c[2])?,
                    reset_us: num(c[3])?,
                })
            })
            .collect()
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let pong: String =
            tokio::time::timeout(self.timeout, redis::cmd("PING").query_async(&mut conn))
                .await
                .map_err(|_| StoreError::Timeout(self.timeout))??;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::Protocol(format!("PING answered {pong:?}")))
        }
    }
}
