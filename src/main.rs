//! `ratewall`: arguments, logging, load the config, run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use ratewall::config::Config;

/// mimalloc: per-thread free lists suit the workers' many small per-request allocations
/// (docs/performance.md has what it was measured to give).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    version,
    about = "A reverse-proxy gateway that enforces request rate limits"
)]
struct Cli {
    /// The limits file.
    #[arg(long, global = true, default_value = "config/limits.toml")]
    config: PathBuf,
    /// Log line format (RUST_LOG selects what is logged).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate the config file and print the effective rules; exit 0 if valid, 1 if not.
    /// With --path (and --method, --header, --peer), also show which rules would apply to
    /// that request and how each would count it.
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
    let cli = Cli::parse();
    init_logging(cli.log_format);

    let config = match Config::load(&cli.config) {
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
        peer,
    }) = cli.command
    {
        println!("{}: valid", cli.config.display());
        print!("{}", config.describe());
        if let Some(path) = path {
            match sample_request(&method, &headers) {
                Ok((method, headers)) => {
                    println!();
                    print!(
                        "{}",
                        ratewall::gateway::explain(&config, &method, &path, &headers, peer)
                    );
                }
                Err(e) => {
                    eprintln!("ratewall: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        return ExitCode::SUCCESS;
    }

    // The control runtime: signals, reloads, the admin listener, upkeep and the store's
    // connections. Clients are served by the workers' own event loops (server::run).
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
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
    match runtime.block_on(ratewall::server::run(config, Some(cli.config))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ratewall: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The method and headers of `ratewall check`'s sample request.
fn sample_request(
    method: &str,
    headers: &[String],
) -> Result<(http::Method, http::HeaderMap), String> {
    let method = http::Method::from_bytes(method.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("--method {method:?} is not a method"))?;
    let mut map = http::HeaderMap::new();
    for h in headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("--header {h:?}: expected \"name: value\""))?;
        let name = http::HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| format!("--header {h:?}: bad header name"))?;
        let value = http::HeaderValue::from_str(value.trim())
            .map_err(|_| format!("--header {h:?}: bad header value"))?;
        map.append(name, value);
    }
    Ok((method, map))
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
