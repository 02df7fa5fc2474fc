//! What the reporting rank of a job shows and keeps per step: a progress bar (its own on a
//! terminal, or the launcher's, fed by progress lines), log lines every `train.log_every`
//! steps otherwise, a line of `metrics.jsonl`, and the Prometheus gauges.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::exporter::{Exporter, MetricLabels};
use super::gpu;
use super::metrics::{MetricsLog, SparseTableMetrics, StepMetrics};
use super::tensorboard::EventWriter;
use crate::models::HeldOut;

/// Set by `flotilla launch` on a terminal: the reporting rank writes progress lines for the
/// launcher to draw, as its stderr is a pipe.
pub const PROGRESS_VAR: &str = "FLOTILLA_PROGRESS";
/// The value of [`PROGRESS_VAR`] that asks for progress lines.
pub const PROGRESS_FOR_LAUNCHER: &str = "launcher";
/// How a progress line starts on the reporting rank's stderr.
pub const PROGRESS_LINE_PREFIX: &str = "flotilla-progress ";

/// Where progress goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressView {
    /// A bar on this process's terminal.
    Terminal,
    /// Progress lines on stderr, drawn as a bar by the launcher.
    Launcher,
    /// A log line every `train.log_every` steps.
    Log,
}

impl ProgressView {
    /// A bar when stderr is a terminal, progress lines when a launcher on one asked for them,
    /// log lines otherwise.
    pub fn from_environment() -> Self {
        if std::io::stderr().is_terminal() {
            Self::Terminal
        } else if std::env::var(PROGRESS_VAR).is_ok_and(|v| v == PROGRESS_FOR_LAUNCHER) {
            Self::Launcher
        } else {
            Self::Log
        }
    }
}

/// One progress line: what the launcher's bar shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressLine {
    /// Steps done.
    pub step: usize,
    /// Steps of the run.
    pub steps: usize,
    /// Loss of the last step.
    pub loss: f32,
    /// Samples per second of the last step.
    pub samples_per_sec: f64,
}

impl ProgressLine {
    /// The line's text after [`PROGRESS_LINE_PREFIX`], if `line` is a progress line.
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line.strip_prefix(PROGRESS_LINE_PREFIX)?).ok()
    }
}

/// A bar over `steps` steps, showing the ETA and the message (loss, samples/s).
pub fn progress_bar(steps: usize) -> ProgressBar {
    let bar = ProgressBar::new(steps as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} steps  {msg}  ({eta} left)")
    {
        bar.set_style(style);
    }
    bar
}

fn progress_message(loss: f32, samples_per_sec: f64) -> String {
    format!("loss {loss:.4}  {samples_per_sec:.0} samples/s")
}

/// How the reporting rank reports.
#[derive(Debug, Clone)]
pub struct MonitorSettings {
    /// Where progress goes.
    pub view: ProgressView,
    /// Where `metrics.jsonl` is written.
    pub run_dir: PathBuf,
    /// Serve the figures for Prometheus at this address.
    pub metrics_address: Option<SocketAddr>,
    /// Who the figures are of.
    pub labels: MetricLabels,
}

/// What the reporting rank measured in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSample {
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Largest minus smallest rank loss, where the ranks exchange them.
    pub loss_spread: Option<f32>,
    /// Learning rate of the step.
    pub lr: f64,
    /// Wall time of the step.
    pub step_time: Duration,
    /// Time in communication.
    pub comm_time: Duration,
    /// Time compute was blocked on communication.
    pub exposed_comm_time: Duration,
    /// Pipeline jobs: the bubble's share of the schedule.
    pub bubble_fraction: Option<f64>,
    /// Largest peak resident set of the processes that reported.
    pub peak_rss_bytes: u64,
    /// Parameter-server jobs with row policies: the policed tables' figures, when asked for.
    pub sparse_tables: Option<Vec<SparseTableMetrics>>,
    /// The held-out split's figures, at the steps that scored it.
    pub eval: Option<HeldOut>,
}

/// The reporting rank's per-step outputs.
pub struct Monitor {
    steps: usize,
    first: usize,
    global_batch: usize,
    log_every: usize,
    started: Instant,
    view: ProgressView,
    bar: ProgressBar,
    metrics: MetricsLog,
    /// The same figures as TensorBoard events.
    events: EventWriter,
    exporter: Option<Exporter>,
}

impl Monitor {
    /// Starts reporting a run of `steps` steps resumed after `first` (0 when fresh), whose
    /// steps take `global_batch` samples. Must be called inside a tokio runtime when serving
    /// metrics.
    pub fn start(
        settings: &MonitorSettings,
        steps: usize,
        first: usize,
        global_batch: usize,
        log_every: usize,
    ) -> Result<Self> {
        let metrics = MetricsLog::open(&settings.run_dir, first)?;
        let events = EventWriter::create(&settings.run_dir)?;
        // The endpoint is for watching: a port it cannot have is said, and training goes on.
        let exporter = settings
            .metrics_address
            .and_then(|address| match Exporter::serve(address, &settings.labels) {
                Ok(exporter) => Some(exporter),
                Err(e) => {
                    tracing::warn!("{e:#}: training goes on without the Prometheus endpoint");
                    None
                }
            });
        let bar = if settings.view == ProgressView::Terminal {
            progress_bar(steps)
        } else {
            ProgressBar::hidden()
        };
        bar.set_position(first as u64);
        Ok(Self {
            steps,
            first,
            global_batch,
            log_every: log_every.max(1),
            started: Instant::now(),
            view: settings.view,
            bar,
            metrics,
            events,
            exporter,
        })
    }

    /// Whether step `step` (1-based) is one the progress log reports.
    pub fn is_log_step(&self, step: usize) -> bool {
        step.is_multiple_of(self.log_every) || step == self.steps
    }

    /// Reports step `step` (1-based: steps done) and returns its metrics.
    pub fn record(&mut self, step: usize, sample: StepSample) -> Result<StepMetrics> {
        let step_s = sample.step_time.as_secs_f64().max(1e-9);
        let gpu = gpu::sample();
        let metrics = StepMetrics {
            step,
            elapsed_s: self.started.elapsed().as_secs_f64(),
            step_time_s: sample.step_time.as_secs_f64(),
            samples_per_sec: self.global_batch as f64 / step_s,
            comm_time_ratio: sample.comm_time.as_secs_f64() / step_s,
            exposed_comm_ratio: sample.exposed_comm_time.as_secs_f64() / step_s,
            bubble_fraction: sample.bubble_fraction,
            peak_rss_bytes: sample.peak_rss_bytes,
            gpu_memory_bytes: gpu.map(|g| g.memory_bytes),
            gpu_utilization: gpu.map(|g| g.utilization_percent),
            lr: sample.lr,
            loss: sample.loss,
            loss_spread: sample.loss_spread,
            sparse_tables: sample.sparse_tables,
            eval: sample.eval,
        };
        if let Some(eval) = &metrics.eval {
            tracing::info!("step {step}/{}: held-out {}", self.steps, held_out_line(eval));
        }
        self.metrics.append(&metrics)?;
        self.events.append(&metrics)?;
        if let Some(exporter) = &self.exporter {
            exporter.publish(&metrics);
        }
        let rate = ((step - self.first) * self.global_batch) as f64 / metrics.elapsed_s.max(1e-9);
        let due = self.is_log_step(step);
        match self.view {
            ProgressView::Terminal => {
                self.bar.set_position(step as u64);
                self.bar.set_message(progress_message(sample.loss, rate));
            }
            ProgressView::Launcher => {
                let line = ProgressLine {
                    step,
                    steps: self.steps,
                    loss: sample.loss,
                    samples_per_sec: rate,
                };
                // A closed stderr must not stop training.
                let _ = writeln!(
                    std::io::stderr(),
                    "{PROGRESS_LINE_PREFIX}{}",
                    serde_json::to_string(&line)?
                );
            }
            ProgressView::Log if due => {
                let spread = sample
                    .loss_spread
                    .map(|s| format!(" (spread {s:.2e})"))
                    .unwrap_or_default();
                tracing::info!(
                    "step {step}/{} loss {:.4}{spread} lr {:.4} {rate:.0} samples/s, comm {:.1}% of step",
                    self.steps,
                    sample.loss,
                    sample.lr,
                    100.0 * metrics.comm_time_ratio
                );
            }
            ProgressView::Log => {}
        }
        Ok(metrics)
    }

    /// Clears the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `eval` as the progress log says it: `loss 0.3120, accuracy 0.9433, perplexity 1.37`.
fn held_out_line(eval: &HeldOut) -> String {
    let mut line = format!("loss {:.4}", eval.loss);
    for (name, value) in [
        ("accuracy", eval.accuracy),
        ("perplexity", eval.perplexity),
        ("mse", eval.mse),
    ] {
        if let Some(value) = value {
            line += &format!(", {name} {value:.4}");
        }
    }
    line + &format!(" over {} predictions", eval.samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::{read_metrics, METRICS_FILE};

    fn labels() -> MetricLabels {
        MetricLabels {
            job: "test".into(),
            rank: 0,
            role: "trainer",
        }
    }

    #[test]
    fn a_busy_metrics_port_is_a_warning_not_a_failed_run() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
        let settings = MonitorSettings {
            view: ProgressView::Log,
            run_dir: dir.path().to_path_buf(),
            metrics_address: Some(taken.local_addr()?),
            labels: labels(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let monitor = runtime.block_on(async { Monitor::start(&settings, 3, 0, 64, 1) })?;
        assert!(monitor.exporter.is_none());
        Ok(())
    }

    #[test]
    fn every_step_becomes_a_line_of_metrics() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let settings = MonitorSettings {
            view: ProgressView::Log,
            run_dir: dir.path().to_path_buf(),
            metrics_address: None,
            labels: labels(),
        };
        let mut monitor = Monitor::start(&settings, 3, 0, 64, 1)?;
        for step in 1..=3 {
            monitor.record(
                step,
                StepSample {
                    loss: 1.0 / step as f32,
                    loss_spread: Some(0.125),
                    lr: 0.1,
                    step_time: Duration::from_millis(50),
                    comm_time: Duration::from_millis(10),
                    exposed_comm_time: Duration::from_millis(5),
                    bubble_fraction: None,
                    peak_rss_bytes: 3 << 20,
                    sparse_tables: None,
                    eval: None,
                },
            )?;
        }
        monitor.finish();
        let steps = read_metrics(&dir.path().join(METRICS_FILE))?;
        assert_eq!(steps.len(), 3);
        let last = &steps[2];
        assert_eq!((last.step, last.loss, last.loss_spread), (3, 1.0 / 3.0, Some(0.125)));
        assert!((last.samples_per_sec - 1280.0).abs() < 1e-6, "{last:?}");
        assert!((last.comm_time_ratio - 0.2).abs() < 1e-9 && (last.exposed_comm_ratio - 0.1).abs() < 1e-9);
        Ok(())
    }

    #[test]
    fn progress_lines_round_trip() -> Result<()> {
        let line = ProgressLine {
            step: 4,
            steps: 10,
            loss: 0.5,
            samples_per_sec: 100.0,
        };
        let text = format!("{PROGRESS_LINE_PREFIX}{}", serde_json::to_string(&line)?);
        assert_eq!(ProgressLine::parse(&text), Some(line));
        assert_eq!(ProgressLine::parse("step 4/10 loss 0.5"), None);
        Ok(())
    }
}
