//! What a run tells about itself: logs (to stderr through `tracing`,
//! filtered by `RUST_LOG`, default `info`; text, coloured on a terminal unless
//! `NO_COLOR` is set, or one JSON object a line), per-step metrics, the report
//! drawn from them, and timelines.

pub mod clock;
pub mod exporter;
pub mod gpu;
pub mod metrics;
pub mod monitor;
pub mod report;
pub mod summary_table;
pub mod tensorboard;
pub mod timeline;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line (`timestamp`, `level`, `fields`, `spans`), for log collectors.
    Json,
}

/// The variable that carries the log format to the processes a launcher starts.
pub const LOG_FORMAT_VAR: &str = "FLOTILLA_LOG_FORMAT";

/// Whether text logs may be coloured: on a terminal, unless `NO_COLOR` is set to anything
/// (<https://no-color.org>).
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber once, in the format [`LOG_FORMAT_VAR`] names (`text` when
/// unset, so a program of one's own started by `flotilla launch --log-format json` logs as the
/// launcher asked); later calls are no-ops.
pub fn init_logging() {
    let format = match std::env::var(LOG_FORMAT_VAR).as_deref() {
        Ok("json") => LogFormat::Json,
        _ => LogFormat::Text,
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let lines = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        // Its fallback for a failed write is `eprintln!`, which panics on a closed stderr.
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => lines.with_ansi(colour()).try_init(),
        LogFormat::Json => lines.json().with_ansi(false).try_init(),
    };
}
