//! The front-ends on listeners of their own ([`crate::FRONT_ENDS`], the admin one among
//! them), started alike: each configured one's socket bound at start, its accept loop run
//! on the calling runtime with a connection registry of its own, stopped once the
//! workers have drained.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use super::StartError;
use crate::config::Config;
use crate::connection::Registry;
use crate::front_end::{FrontEnd, Listener, Shared};
use crate::runtime::Metrics;

/// A configured front-end's socket, bound at start (before the gateway says it listens).
pub(super) struct Bound {
    front_end: &'static dyn FrontEnd,
    addr: SocketAddr,
    socket: TcpListener,
}

/// Bind the socket of every front-end `config` configures, in the order they are listed.
pub(super) fn bind(config: &Config, backlog: u32) -> Result<Vec<Bound>, StartError> {
    let mut bound = Vec::new();
    for &front_end in crate::FRONT_ENDS {
        if let Some(addr) = front_end.listen(config) {
            let socket = super::bind(addr, backlog)?;
            bound.push(Bound {
                front_end,
                addr,
                socket,
            });
        }
    }
    Ok(bound)
}

/// The start line's list of them: `admin: 127.0.0.1:9090`, or `-`.
pub(super) fn listed(bound: &[Bound]) -> String {
    if bound.is_empty() {
        return "-".to_string();
    }
    let each: Vec<String> = bound
        .iter()
        .map(|b| format!("{}: {}", b.front_end.name(), b.addr))
        .collect();
    each.join(", ")
}

/// A front-end's listener, run on the calling runtime until it is stopped.
pub(super) struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Serve `bound`'s connections with its handler, under a bound of its own on their
    /// number, counted under its name.
    pub(super) fn start(
        bound: Bound,
        config: &Config,
        shared: &Shared,
        metrics: &Metrics,
    ) -> Running {
        let Bound {
            front_end, socket, ..
        } = bound;
        let name = front_end.name();
        let registry = Registry::new(
            name,
            front_end.max_connections(config),
            metrics.connection.listener(name),
        );
        let handler = front_end.handler(shared);
        let listener = Listener::new(socket, registry, handler, front_end.grace(config));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(listener.run(async move {
            let _ = stopped.await;
        }));
        Running { stop, task }
    }
}

/// Stop accepting on each of `running`, and drain their connections (each for up to its
/// grace; together, so the longest grace bounds the wait).
pub(super) async fn stop(running: Vec<Running>) {
    let tasks: Vec<_> = running
        .into_iter()
        .map(|r| {
            let _ = r.stop.send(());
            r.task
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every front-end's name is its own: two alike would share their metrics' series.
    #[test]
    fn front_ends_have_names_of_their_own() {
        let mut names: Vec<&str> = crate::FRONT_ENDS.iter().map(|f| f.name()).collect();
        let listed = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), listed, "{names:?}");
        assert!(
            !names.contains(&"gateway"),
            "the proxy's listener is `gateway`"
        );
    }

    fn config(admin_listen: Option<SocketAddr>) -> Config {
        let admin = admin_listen.map_or_else(String::new, |a| format!("admin_listen = \"{a}\"\n"));
        Config::parse(
            &format!("[server]\nlisten = \"127.0.0.1:1\"\n{admin}[upstream]\nurl = \"http://127.0.0.1:2\"\n"),
            std::path::Path::new("t.toml"),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A front-end is bound where it is configured, listed in the start line by name and
    /// address; one the config leaves out is neither; a taken address stops the start,
    /// naming it.
    #[tokio::test]
    async fn configured_front_ends_are_bound_listed_and_a_taken_address_is_named() {
        assert_eq!(
            listed(&bind(&config(None), 16).expect("nothing to bind")),
            "-"
        );

        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let addr = taken.local_addr().expect("an address");
        match bind(&config(Some(addr)), 16) {
            Err(StartError::Bind { addr: named, .. }) => assert_eq!(named, addr),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("{addr} was taken"),
        }
        drop(taken);

        let bound = bind(&config(Some(addr)), 16).expect("bound");
        assert_eq!(listed(&bound), format!("admin: {addr}"));
    }
}
