//! `ratewall`: arguments, logging, load the config, run (or `check` it: [`ratewall::cli`]).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use ratewall::config::{Given, Overrides, Source};

/// mimalloc: per-thread free lists suit the workers' many small per-request allocations
/// (docs/performance.md has what it was measured to give).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    version,
    about = "A reverse-proxy gateway that enforces request rate limits",
    after_help = "Environment:\n  \
        RATEWALL_ADMIN_TOKEN   the admin API's bearer token (wins over [admin] token; at least 16 characters)\n  \
        RATEWALL_LISTEN, RATEWALL_ADMIN_LISTEN, RATEWALL_TLS_LISTEN, RATEWALL_UPSTREAM\n                         as --listen, --admin-listen, --tls-listen, --upstream\n  \
        RUST_LOG               what is logged, e.g. info (the default), debug, ratewall::access=off\n\n\
        Every key of the file: docs/configuration.md"
)]
struct Cli {
    /// The limits file.
    #[arg(long, global = true, default_value = "config/limits.toml")]
    config: PathBuf,
    /// Log line format (RUST_LOG selects what is logged).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Overrides [server] listen, e.g. 0.0.0.0:8080 (also on every reload).
    #[arg(long, global = true, env = "RATEWALL_LISTEN", value_name = "ADDR")]
    listen: Option<String>,
    /// Overrides [server] admin_listen, e.g. 127.0.0.1:9090 (also on every reload).
    #[arg(
        long,
        global = true,
        env = "RATEWALL_ADMIN_LISTEN",
        value_name = "ADDR"
    )]
    admin_listen: Option<String>,
    /// Overrides [server.tls] listen, e.g. 0.0.0.0:8443 (also on every reload).
    #[arg(long, global = true, env = "RATEWALL_TLS_LISTEN", value_name = "ADDR")]
    tls_listen: Option<String>,
    /// Overrides [upstream] url, e.g. http://backend:3000 (also on every reload).
    #[arg(long, global = true, env = "RATEWALL_UPSTREAM", value_name = "URL")]
    upstream: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate the config file and print the effective rules; exit 0 if valid, 1 if not.
    /// With --path (and --method, --host, --header, --peer), also show the route and pool
    /// that request would go to, which rules would apply to it and how each would count it.
    Check {
        /// A sample request's path (and query), e.g. /api/orders.
        #[arg(long)]
        path: Option<String>,
        /// The sample request's method.
        #[arg(long, default_value = "GET")]
        method: String,
        /// A sample request header, "name: value"; repeat for more.
        #[arg(long = "header", value_name = "NAME: VALUE")]
        headers: Vec<String>,
        /// The sample request's host (its Host header), e.g. billing.example.com: routes
        /// and rules that match on the host see it.
        #[arg(long)]
        host: Option<String>,
        /// The sample request's TCP peer address.
        #[arg(long, default_value = "127.0.0.1")]
        peer: std::net::IpAddr,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_logging(cli.log_format);

    let given = |id: &str, value: Option<String>| given(&matches, id, value);
    let overrides = match Overrides::new(
        given("listen", cli.listen),
        given("admin_listen", cli.admin_listen),
        given("tls_listen", cli.tls_listen),
        given("upstream", cli.upstream),
    ) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ratewall: invalid override: {e}");
            return ExitCode::FAILURE;
        }
    };
    let source = Source::new(cli.config, overrides);
    let config = match source.load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ratewall: invalid configuration: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(Command::Check {
        path,
        method,
        headers,
        host,
        peer,
    }) = cli.command
    {
        let sample = ratewall::cli::Sample {
            path,
            method,
            headers,
            host,
            peer,
        };
        return match ratewall::cli::check(&config, &source, sample) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ratewall: {e}");
                ExitCode::FAILURE
            }
        };
    }

    // The control runtime: signals, reloads, the admin listener, upkeep and the store's
    // connections. Clients are served by the workers' own event loops (server::run). The
    // decision service's calls run here too: with `[decide]`, it has as many threads as
    // the proxy has workers, so that it is not held to one core.
    let threads = match config.decide {
        Some(_) => config.server.workers.max(1),
        None => 1,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("ratewall-control")
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ratewall: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(ratewall::server::run(config, Some(source))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ratewall: {e}");
            ExitCode::FAILURE
        }
    }
}

/// An override's value and where it came from: the flag, or its environment variable (an
/// empty variable counts as unset).
fn given(matches: &ArgMatches, id: &str, value: Option<String>) -> Option<Given> {
    let arg = Cli::command()
        .get_arguments()
        .find(|a| a.get_id() == id)
        .cloned()?;
    let origin = match matches.value_source(id) {
        Some(ValueSource::EnvVariable) => arg.get_env()?.to_string_lossy().into_owned(),
        _ => format!("--{}", arg.get_long()?),
    };
    value
        .filter(|v| !v.is_empty() || origin.starts_with("--"))
        .map(|value| Given { value, origin })
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
