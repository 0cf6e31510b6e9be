//! `ratewall`: arguments, logging, load the config, run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use ratewall::config::Config;

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
    Check,
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
    if let Some(Command::Check) = cli.command {
        println!("{}: valid", cli.config.display());
        print!("{}", config.describe());
        return ExitCode::SUCCESS;
    }

    let runtime = match tokio::runtime::Builder::new_multi_thread()
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
