//! The `peerwall` binary: parse arguments, set up logging, run, map errors to exit codes.

use clap::Parser;
use peerwall::cli::{self, Cli, LogFormat};
use tracing_subscriber::EnvFilter;

fn main() {
    // Copied into the container runtime's CNI directory, the binary is `peerwall-boot`, the
    // chained plugin that puts a gateway's boot policy in force at its sandbox's creation.
    if peerwall::cni::plugin::invoked_as_plugin() {
        std::process::exit(peerwall::cni::plugin::main());
    }
    let args = Cli::parse();
    let filter = EnvFilter::try_from_env("PEERWALL_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only for a terminal: logs written to files and pipes carry no escape codes.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    if let Err(e) = cli::run(args) {
        // The reader went away (`| head`): what it wanted it has; nothing to report.
        let closed_pipe = e.error().chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        });
        if closed_pipe {
            std::process::exit(0);
        }
        eprintln!("error: {}", cli::error_text(e.error()));
        std::process::exit(e.exit_code());
    }
}
