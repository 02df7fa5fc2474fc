//! What a run tells about itself: logs (to stderr through `tracing`,
//! filtered by `RUST_LOG`, default `info`), per-step metrics, the report
//! drawn from them, and timelines.

pub mod clock;
pub mod exporter;
pub mod gpu;
pub mod metrics;
pub mod monitor;
pub mod report;
pub mod summary_table;
pub mod timeline;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls are no-ops.
pub fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        // Its fallback for a failed write is `eprintln!`, which panics on a closed stderr.
        .log_internal_errors(false)
        .try_init();
}
