//! What a front-end is: a module that takes requests on a listener of its own (the admin
//! API; next, the decision API and an egress proxy) and answers them on what the rest of
//! the process shares with it ([`Shared`]: the current configuration, swapped whole on
//! reload, and the metrics).
//!
//! A front-end says what the server needs to start it ([`FrontEnd`]): its name, where it
//! listens under the config (or that it is not configured), the bound on its connections,
//! its grace at shutdown, and the [`Handler`] that serves its connections. It is listed
//! once, in `src/lib.rs`' `front_ends!`, which declares its module and puts it in
//! [`crate::FRONT_ENDS`]; the server binds each configured one's socket at start, runs its
//! accept loop ([`Listener`], `listener.rs`, the one every listener runs) with a
//! connection registry of its own, and stops it once the proxy's workers have drained.
//!
//! The proxy's own listeners are not front-ends of this kind: a listening socket shared
//! by the worker threads, each accepting in its own event loop, cleartext and TLS with
//! `redirect_https` between them (`server/mod.rs`).

mod listener;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::runtime::{Current, Live, Metrics};

pub use listener::{Accepted, Handler, Listener};

/// What every front-end's requests run on, shared with the proxy: the configuration kept
/// current across reloads (the proxy's `Gateway` holds the same [`Current`]) and the
/// metrics registry root. Cloned by each front-end that keeps it.
#[derive(Clone)]
pub struct Shared {
    current: Arc<Current>,
    metrics: Arc<Metrics>,
}

impl Shared {
    pub fn new(current: Arc<Current>, metrics: Arc<Metrics>) -> Shared {
        Shared { current, metrics }
    }

    /// The configuration requests start on now.
    pub fn live(&self) -> Arc<Live> {
        self.current.live()
    }

    /// Where a reload is asked for ([`Current::reload`]).
    pub fn current(&self) -> &Arc<Current> {
        &self.current
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// A front-end on a listener of its own, as the server starts it: one value of a type
/// that implements this (a unit struct, its module's `FRONT_END`), listed in `src/lib.rs`'
/// `front_ends!`.
pub trait FrontEnd: Sync {
    /// Its name: its connection registry's, the `listener` label of its connection
    /// metrics, and its name in the start line.
    fn name(&self) -> &'static str;

    /// Where it listens under `config`; `None`: it is not configured, and not started.
    /// Read once, at start (a reload that moves it takes effect on restart).
    fn listen(&self, config: &Config) -> Option<SocketAddr>;

    /// The most connections it keeps open at once: a bound of its own, so that a flood on
    /// another listener never locks its clients out.
    fn max_connections(&self, config: &Config) -> usize;

    /// How long its calls still under way get once it stops (after the proxy's workers
    /// have drained).
    fn grace(&self, config: &Config) -> Duration;

    /// What serves its connections, made once at start (on the runtime that runs its
    /// listener, so it may spawn its own upkeep there). The handler reads its connection
    /// settings from the configuration live when each connection is accepted.
    fn handler(&self, shared: &Shared) -> Box<dyn Serves>;
}

/// A [`Handler`] as the server holds a front-end's, whatever its type: each connection's
/// task boxed (one allocation per connection, beside the task the listener spawns for it).
pub trait Serves: Send + Sync {
    fn serve_boxed(&self, conn: Accepted<'_>) -> Option<Task>;
}

/// A connection's task, boxed.
pub type Task = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

impl<H: Handler + Send + Sync> Serves for H {
    fn serve_boxed(&self, conn: Accepted<'_>) -> Option<Task> {
        self.serve(conn).map(|task| Box::pin(task) as Task)
    }
}

impl Handler for Box<dyn Serves> {
    fn serve(&self, conn: Accepted<'_>) -> Option<impl Future<Output = ()> + Send + 'static> {
        // The boxed handler's own: the box is a `Serves` too (through this impl), and
        // `self.serve_boxed` would call back here.
        (**self).serve_boxed(conn)
    }
}

/// Declares the front-ends on listeners of their own, in the order the server starts
/// them: each a module (declared here, so a new front-end is its folder and one line in
/// this list) whose `FRONT_END` implements [`FrontEnd`]; they are
/// [`crate::FRONT_ENDS`]. `tests/it/layering.rs` reads the list to place them in the
/// front-ends tier.
macro_rules! front_ends {
    ($($(#[$attr:meta])* $module:ident),* $(,)?) => {
        $($(#[$attr])* pub mod $module;)*

        /// The front-ends on listeners of their own, in the order they are started (see
        /// [`front_end`]).
        pub const FRONT_ENDS: &[&dyn $crate::front_end::FrontEnd] = &[$(&$module::FRONT_END),*];
    };
}
pub(crate) use front_ends;

/// The token of an `Authorization: Bearer <token>` value: the scheme matched in any case
/// (RFC 9110 §11.1: `bearer`, `BEARER`), one or more spaces after it.
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    let at = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(at);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii_start();
    (!token.is_empty()).then_some(token)
}

/// Whether two tokens are equal, in a time that tells neither where they differ nor how
/// long the right one is: their SHA-256 digests are compared, every byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    same_digest(&Sha256::digest(a).into(), &Sha256::digest(b).into())
}

/// Whether two digests are equal, every byte compared.
pub fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}
