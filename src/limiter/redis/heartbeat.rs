//! The gateways' heartbeats (`local_share = "auto"`): each gateway writes its instance id
//! into one sorted set, `<prefix>:gateways`, scored by Redis' own clock, and is told how
//! many gateways wrote theirs within the window (`lua/heartbeat.lua`: one atomic call
//! that adds, drops the members older than the window, sets the TTL and counts).
//!
//! One key, so one slot in a cluster: no hash tag is needed. It cannot meet a rule's key,
//! which is always `<prefix>:{<identity-hash>}:<rule>` (a `{` after the prefix), nor the
//! key directory's `<prefix>:keys`.

use std::sync::LazyLock;
use std::time::Duration;

use super::eval::{eval, Evaluates, Lua};
use super::Scripted;
use crate::limiter::StoreError;

pub const HEARTBEAT_SCRIPT: &str = include_str!("../../../lua/heartbeat.lua");

static HEARTBEAT: LazyLock<Lua> = LazyLock::new(|| Lua::new(HEARTBEAT_SCRIPT));

impl Scripted {
    /// `<prefix>:gateways`.
    pub(super) fn gateways_key(&self) -> String {
        format!("{}:gateways", self.prefix)
    }

    /// This gateway's member in the set: its instance id, as its lease members begin.
    pub(super) fn gateway_member(&self) -> String {
        format!("{:016x}", self.instance)
    }

    /// `<prefix>:tag-secret`: the deployment's identity tag secret (one key, one slot; no
    /// TTL: tags stay the same as long as it lives).
    pub(super) fn tag_secret_key(&self) -> String {
        format!("{}:tag-secret", self.prefix)
    }

    /// The secret at [`Self::tag_secret_key`], `fresh` written first where there is none
    /// (`SET NX`, then `GET`: of gateways starting at once, one writes and all read it).
    /// Anything there but 64 hex digits is an error, never a weaker key.
    pub(super) async fn tag_secret<C: redis::aio::ConnectionLike>(
        &self,
        conn: &mut C,
        fresh: &str,
    ) -> Result<String, StoreError> {
        let key = self.tag_secret_key();
        let _: redis::Value = self
            .timed(
                redis::cmd("SET")
                    .arg(&key)
                    .arg(fresh)
                    .arg("NX")
                    .query_async(conn),
            )
            .await?;
        let kept: Option<String> = self
            .timed(redis::cmd("GET").arg(&key).query_async(conn))
            .await?;
        match kept {
            Some(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(s),
            _ => Err(StoreError::Protocol(format!(
                "{key} is not 64 hex digits: delete it to have a new tag secret made"
            ))),
        }
    }

    /// Write this gateway's heartbeat; the gateways heard from within `window`.
    pub(super) async fn heartbeat<C: Evaluates>(
        &self,
        conn: &mut C,
        window: Duration,
    ) -> Result<u32, StoreError> {
        let mut inv = HEARTBEAT.invocation();
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        inv.key(self.gateways_key())
            .arg(self.gateway_member())
            .arg(window_ms);
        let seen: i64 = self.timed(eval(conn, &inv)).await?;
        u32::try_from(seen)
            .map_err(|_| StoreError::Protocol(format!("the heartbeat counted {seen} gateways")))
    }
}
