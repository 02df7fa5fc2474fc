//! Runs the planned processes: prefixes their output with the rank,
//! forwards Ctrl-C (and SIGTERM), and if one fails stops the others and
//! restarts them all from the last checkpoint, or reports the failed rank's last words.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use indicatif::ProgressBar;

use super::ChildSpec;
use crate::job::RESUME_VAR;
use crate::telemetry::monitor::{progress_bar, ProgressLine, PROGRESS_FOR_LAUNCHER, PROGRESS_VAR};

/// The launcher's progress bar, drawn from the reporting rank's progress lines when the
/// launcher's stderr is a terminal (the children's is a pipe); made at the first line, which
/// says how many steps there are.
#[derive(Clone, Default)]
struct LauncherBar(Option<Arc<Mutex<Option<ProgressBar>>>>);

impl LauncherBar {
    fn for_terminal() -> Self {
        Self(std::io::stderr().is_terminal().then(Arc::default))
    }

    /// Moves the bar if `line` is a progress line; `false` for any other line.
    fn update(&self, line: &str) -> bool {
        let (Some(shared), Some(progress)) = (&self.0, ProgressLine::parse(line)) else {
            return false;
        };
        if let Ok(mut bar) = shared.lock() {
            let bar = bar.get_or_insert_with(|| progress_bar(progress.steps));
            bar.set_position(progress.step as u64);
            bar.set_message(format!(
                "loss {:.4}  {:.0} samples/s",
                progress.loss, progress.samples_per_sec
            ));
        }
        true
    }

    /// Writes `text` above the bar.
    fn write(&self, text: &str, to_stderr: bool) {
        let emit = || {
            // A closed launcher output (e.g. a closed pipe) must not stop the child, so write
            // errors are ignored.
            let _ = if to_stderr {
                std::io::stderr().write_all(text.as_bytes())
            } else {
                std::io::stdout().write_all(text.as_bytes())
            };
        };
        match self.0.as_ref().and_then(|shared| shared.lock().ok()) {
            Some(bar) => match bar.as_ref() {
                Some(bar) => bar.suspend(emit),
                None => emit(),
            },
            None => emit(),
        }
    }

    fn finish(&self) {
        if let Some(Ok(mut bar)) = self.0.as_ref().map(|shared| shared.lock()) {
            if let Some(bar) = bar.take() {
                bar.finish_and_clear();
            }
        }
    }
}

/// How children's output reaches the launcher's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputMode {
    /// Every line prefixed with `[rank N]`.
    Prefixed,
    /// Rank 0's stdout unchanged, everything else prefixed (for tools whose
    /// rank 0 prints results).
    Rank0Plain,
}

/// Lines of a failed rank's stderr quoted in the launcher's error.
const TAIL_LINES: usize = 20;
/// How long, after a first failure, the other processes' exits are awaited to find the cause.
const CAUSE_GRACE: Duration = Duration::from_millis(100);
/// How long children get to stop after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

struct Running {
    name: String,
    child: Child,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<thread::JoinHandle<()>>,
}

/// How one start of the processes ended, when not in success.
enum Ended {
    /// A process failed: the others were stopped, and a restart may follow.
    Failed(anyhow::Error),
    /// The launcher was interrupted, or could not start a process: no restart.
    Stopped(anyhow::Error),
}

/// Starts `children` and waits for all of them. When one fails, the others are stopped and,
/// up to `max_restarts` times, all are started again with [`RESUME_VAR`] set, so they continue
/// from the last committed checkpoint. The final error names the rank that failed last and
/// quotes the end of its stderr.
pub fn supervise(children: Vec<ChildSpec>, mode: OutputMode, max_restarts: usize) -> Result<()> {
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, interrupted.clone()).context("installing the signal handler")?;
    }
    let bar = LauncherBar::for_terminal();
    let ended = restart_until_done(children, mode, max_restarts, &interrupted, &bar);
    bar.finish();
    ended
}

fn restart_until_done(
    mut children: Vec<ChildSpec>,
    mode: OutputMode,
    max_restarts: usize,
    interrupted: &AtomicBool,
    bar: &LauncherBar,
) -> Result<()> {
    let mut restarts = 0;
    loop {
        match run_once(&children, mode, interrupted, bar) {
            Ok(()) => return Ok(()),
            Err(Ended::Failed(e)) if restarts < max_restarts => {
                restarts += 1;
                tracing::warn!(
                    "{e:#}\nrestarting all {} processes from the last checkpoint (restart {restarts} of {max_restarts})",
                    children.len()
                );
                if restarts == 1 {
                    for child in &mut children {
                        child.env.push((RESUME_VAR.to_string(), "1".to_string()));
                    }
                }
            }
            Err(Ended::Failed(e)) if max_restarts > 0 => {
                return Err(e.context(format!("gave up after {max_restarts} restart(s)")))
            }
            Err(Ended::Failed(e) | Ended::Stopped(e)) => return Err(e),
        }
    }
}

/// Starts every child once and waits for all of them, or for the first failure.
fn run_once(
    children: &[ChildSpec],
    mode: OutputMode,
    interrupted: &AtomicBool,
    bar: &LauncherBar,
) -> Result<(), Ended> {
    let mut running = Vec::with_capacity(children.len());
    for spec in children {
        match start(spec, mode, bar) {
            Ok(child) => running.push(child),
            Err(e) => {
                stop_all(&mut running, libc::SIGTERM);
                return Err(Ended::Stopped(e));
            }
        }
    }
    let mut interrupt_sent = false;
    loop {
        if interrupted.load(Ordering::Relaxed) && !interrupt_sent {
            tracing::warn!("interrupted: forwarding to {} trainer process(es)", running.len());
            signal_all(&running, libc::SIGINT);
            interrupt_sent = true;
        }
        let mut statuses = poll(&mut running)?;
        if statuses.iter().flatten().any(|s| !s.success()) {
            // The peers of a killed process fail within moments of it, and may be reaped first:
            // a moment more lets the cause show itself.
            thread::sleep(CAUSE_GRACE);
            statuses = poll(&mut running)?;
        }
        // A process killed by a signal is the cause; the ones that then lost it as a peer
        // failed because of it.
        let failed = statuses
            .iter()
            .enumerate()
            .filter_map(|(index, status)| status.filter(|s| !s.success()).map(|s| (index, s)))
            .min_by_key(|(_, status)| status.signal().is_none());
        if let Some((index, status)) = failed {
            let failed = running.remove(index);
            stop_all(&mut running, libc::SIGTERM);
            let error = failure(failed, status, interrupt_sent);
            return Err(if interrupt_sent {
                Ended::Stopped(error)
            } else {
                Ended::Failed(error)
            });
        }
        let all_done = statuses.iter().all(Option::is_some);
        if all_done {
            for r in &mut running {
                for pump in r.pumps.drain(..) {
                    let _ = pump.join();
                }
            }
            if interrupt_sent {
                return Err(Ended::Stopped(anyhow!("interrupted")));
            }
            return Ok(());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Every child's exit status, `None` for those still running.
fn poll(running: &mut [Running]) -> Result<Vec<Option<ExitStatus>>, Ended> {
    running
        .iter_mut()
        .map(|r| {
            r.child
                .try_wait()
                .context("waiting for a child process")
                .map_err(Ended::Stopped)
        })
        .collect()
}

fn start(spec: &ChildSpec, mode: OutputMode, bar: &LauncherBar) -> Result<Running> {
    let mut command = Command::new(&spec.program);
    if bar.0.is_some() {
        command.env(PROGRESS_VAR, PROGRESS_FOR_LAUNCHER);
    }
    let mut child = command
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("{}: cannot start {}", spec.name, spec.program.display()))?;
    tracing::info!(process = %spec.name, pid = child.id(), "started {}", spec.program.display());
    let stderr_tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        let plain = mode == OutputMode::Rank0Plain && spec.rank == 0;
        pumps.push(pump(out, spec.name.clone(), plain, None, false, bar.clone()));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(pump(
            err,
            spec.name.clone(),
            false,
            Some(stderr_tail.clone()),
            true,
            bar.clone(),
        ));
    }
    Ok(Running {
        name: spec.name.clone(),
        child,
        stderr_tail,
        pumps,
    })
}

fn pump(
    stream: impl Read + Send + 'static,
    name: String,
    plain: bool,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
    to_stderr: bool,
    bar: LauncherBar,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if bar.update(&line) {
                continue;
            }
            let text = if plain {
                format!("{line}\n")
            } else {
                format!("[{name}] {line}\n")
            };
            bar.write(&text, to_stderr);
            if let Some(tail) = &tail {
                if let Ok(mut tail) = tail.lock() {
                    if tail.len() == TAIL_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        }
    })
}

fn signal_all(running: &[Running], signal: libc::c_int) {
    for r in running {
        // The pid belongs to a child we started and have not reaped.
        unsafe {
            libc::kill(r.child.id() as libc::pid_t, signal);
        }
    }
}

/// Signals every child (continuing stopped ones), then kills whichever has not exited after a
/// grace period, and reaps them all.
fn stop_all(running: &mut [Running], signal: libc::c_int) {
    signal_all(running, signal);
    // A stopped (SIGSTOP) process acts on the signal only once continued.
    signal_all(running, libc::SIGCONT);
    let deadline = Instant::now() + STOP_GRACE;
    for r in running.iter_mut() {
        while Instant::now() < deadline && matches!(r.child.try_wait(), Ok(None)) {
            thread::sleep(Duration::from_millis(20));
        }
        if matches!(r.child.try_wait(), Ok(None)) {
            tracing::warn!(process = %r.name, "did not stop within {STOP_GRACE:?}; killing it");
            let _ = r.child.kill();
        }
        let _ = r.child.wait();
    }
}

fn failure(mut failed: Running, status: ExitStatus, interrupted: bool) -> anyhow::Error {
    for pump in failed.pumps.drain(..) {
        let _ = pump.join();
    }
    let tail: Vec<String> = failed
        .stderr_tail
        .lock()
        .map(|t| t.iter().cloned().collect())
        .unwrap_or_default();
    let cause = if interrupted { "was interrupted" } else { "failed" };
    let last_words = if tail.is_empty() {
        "It wrote nothing to stderr.".to_string()
    } else {
        format!("Its last output:\n{}", tail.join("\n"))
    };
    anyhow!(
        "{} {cause} ({status}); the other processes were stopped. {last_words}",
        failed.name
    )
}
