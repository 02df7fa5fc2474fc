//! Runs the planned processes: prefixes their output with the rank,
//! forwards Ctrl-C (and SIGTERM), and if one fails stops the others and
//! reports the failed rank's last words.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::ChildSpec;

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
/// How long children get to stop after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

struct Running {
    name: String,
    child: Child,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<thread::JoinHandle<()>>,
}

/// Starts `children` and waits for all of them; an error names the first
/// rank that failed and quotes the end of its stderr.
pub fn supervise(children: Vec<ChildSpec>, mode: OutputMode) -> Result<()> {
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, interrupted.clone()).context("installing the signal handler")?;
    }
    let mut running = Vec::with_capacity(children.len());
    for spec in children {
        match start(&spec, mode) {
            Ok(child) => running.push(child),
            Err(e) => {
                stop_all(&mut running, libc::SIGTERM);
                return Err(e);
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
        let mut all_done = true;
        for index in 0..running.len() {
            match running[index].child.try_wait()? {
                Some(status) if !status.success() => {
                    let failed = running.remove(index);
                    stop_all(&mut running, libc::SIGTERM);
                    return Err(failure(failed, status, interrupt_sent));
                }
                Some(_) => {}
                None => all_done = false,
            }
        }
        if all_done {
            for r in &mut running {
                for pump in r.pumps.drain(..) {
                    let _ = pump.join();
                }
            }
            if interrupt_sent {
                bail!("interrupted");
            }
            return Ok(());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn start(spec: &ChildSpec, mode: OutputMode) -> Result<Running> {
    let mut child = Command::new(&spec.program)
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
        pumps.push(pump(out, spec.name.clone(), plain, None, false));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(pump(err, spec.name.clone(), false, Some(stderr_tail.clone()), true));
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
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            let text = if plain {
                format!("{line}\n")
            } else {
                format!("[{name}] {line}\n")
            };
            // A closed launcher output (e.g. a closed pipe) must not stop
            // the child, so write errors are ignored.
            let _ = if to_stderr {
                std::io::stderr().write_all(text.as_bytes())
            } else {
                std::io::stdout().write_all(text.as_bytes())
            };
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

/// Signals every child, then kills whichever has not exited after a grace
/// period, and reaps them all.
fn stop_all(running: &mut [Running], signal: libc::c_int) {
    signal_all(running, signal);
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
    anyhow::anyhow!(
        "{} {cause} ({status}); the other processes were stopped. Its last output:\n{}",
        failed.name,
        tail.join("\n")
    )
}
