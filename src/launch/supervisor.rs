//! Runs the planned processes: prefixes their output with the rank,
//! forwards Ctrl-C (and SIGTERM; a second signal or a grace period kills them), and if one fails
//! stops the others and restarts them all (a process that refused to start is not restarted),
//! or reports the failed rank's last words. Each process leads its own process group, so stopping
//! it stops what it started too, and dies with the launcher.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use indicatif::ProgressBar;

use super::{ChildSpec, DeathWatch};
use crate::collective::preemption::{ProcessesPreempted, PREEMPTED_EXIT_CODE};
use crate::job::{REFUSAL_EXIT_CODE, RESUME_VAR};
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
/// How long children get to stop after a forwarded Ctrl-C (or SIGTERM when the launcher stops
/// them itself) before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// The seconds processes get by default after a SIGTERM the launcher forwards (preemption):
/// within the 30 s Kubernetes and Slurm wait before their SIGKILL.
pub const PREEMPTION_GRACE_S: u64 = 25;
/// How long the output of stopped processes is still read: a process that left its process
/// group may hold their pipes open for ever.
const OUTPUT_GRACE: Duration = Duration::from_secs(1);

/// The SIGINTs and SIGTERMs the launcher received: the first is forwarded to the processes, a
/// second kills them.
#[derive(Clone)]
struct Interrupts {
    count: Arc<AtomicUsize>,
    /// The first signal received (0 before any).
    first: Arc<AtomicI32>,
    /// How long children get after a SIGTERM the launcher got and forwards (preemption: a
    /// trainer stops at a checkpoint).
    preemption_grace: Duration,
}

impl Interrupts {
    fn install(preemption_grace: Duration) -> Result<Self> {
        let (count, first) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicI32::new(0)));
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let (count, first) = (count.clone(), first.clone());
            // SAFETY: the handler only updates atomics, which is async-signal-safe.
            unsafe {
                signal_hook::low_level::register(signal, move || {
                    let _ = first.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
                    count.fetch_add(1, Ordering::SeqCst);
                })
            }
            .context("installing the signal handler")?;
        }
        Ok(Self {
            count,
            first,
            preemption_grace,
        })
    }

    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// The signal to forward, and how long the processes then get: a SIGTERM (preemption) as
    /// itself, with time for a checkpoint; a Ctrl-C as itself.
    fn forwarded(&self) -> (libc::c_int, Duration) {
        match self.first.load(Ordering::SeqCst) {
            libc::SIGTERM => (libc::SIGTERM, self.preemption_grace),
            _ => (libc::SIGINT, STOP_GRACE),
        }
    }
}

struct Running {
    name: String,
    child: Child,
    /// Killed because the coordinator declared it dead, or (the coordinator) because it stopped
    /// answering (once is enough).
    killed_as_dead: bool,
    /// When it was started: a coordinator's silence counts from here at the earliest.
    started: Instant,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<thread::JoinHandle<()>>,
}

/// How one start of the processes ended, when not in success.
enum Ended {
    /// A process failed: the others were stopped, and a restart may follow.
    Failed(anyhow::Error),
    /// The launcher was interrupted, could not start a process, or a process refused to start:
    /// no restart.
    Stopped(anyhow::Error),
}

/// Starts `children` and waits for all of them. When one fails, the others are stopped and,
/// up to `max_restarts` times, all are started again with [`RESUME_VAR`] set, so that a job with
/// checkpoints continues from the last committed one. One that exits with [`REFUSAL_EXIT_CODE`]
/// is not restarted. The final error names the rank that failed last and quotes the end of its
/// stderr.
///
/// The children die with the thread that calls this (their parent-death signal): call it from
/// the main thread.
///
/// With a `death_watch`, a process the coordinator declared dead that still runs (stopped, or
/// hung) is killed, and so replaced. After a SIGTERM the launcher forwards, the processes get
/// `preemption_grace` before they are killed.
pub fn supervise(
    children: Vec<ChildSpec>,
    mode: OutputMode,
    max_restarts: usize,
    death_watch: Option<DeathWatch>,
    preemption_grace: Duration,
) -> Result<()> {
    let interrupts = Interrupts::install(preemption_grace)?;
    let bar = LauncherBar::for_terminal();
    let ended = restart_until_done(children, mode, max_restarts, &interrupts, &bar, death_watch.as_ref());
    bar.finish();
    ended
}

fn restart_until_done(
    mut children: Vec<ChildSpec>,
    mode: OutputMode,
    max_restarts: usize,
    interrupts: &Interrupts,
    bar: &LauncherBar,
    death_watch: Option<&DeathWatch>,
) -> Result<()> {
    let mut restarts = 0;
    loop {
        let alone = Restarts {
            done: &mut restarts,
            max: max_restarts,
        };
        match run_once(&children, mode, interrupts, bar, alone, death_watch) {
            Ok(()) => return Ok(()),
            Err(Ended::Failed(e)) if restarts < max_restarts => {
                restarts += 1;
                // Only the processes know whether the job checkpoints; each says where it resumes.
                tracing::warn!(
                    "{e:#}\nrestarting all {} processes (restart {restarts} of {max_restarts}): a job with \
                     checkpoints resumes from the last committed one, a job without starts again at step 0",
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

/// The restarts a launcher allows, all processes' together, and how many it has made.
struct Restarts<'a> {
    done: &'a mut usize,
    max: usize,
}

/// Starts every child once and waits for all of them, or for the first failure. A failed child
/// that may be restarted alone ([`ChildSpec::restart_alone`]) is, while `alone` allows, and the
/// others go on.
fn run_once(
    children: &[ChildSpec],
    mode: OutputMode,
    interrupts: &Interrupts,
    bar: &LauncherBar,
    alone: Restarts,
    death_watch: Option<&DeathWatch>,
) -> Result<(), Ended> {
    let mut round = Round {
        children,
        mode,
        interrupts,
        bar,
        alone,
        running: Vec::with_capacity(children.len()),
        interrupted_at: None,
    };
    for spec in children {
        let child = round.start_or_stop_all(spec)?;
        round.running.push(child);
    }
    loop {
        round.handle_interrupts()?;
        if let Some(watch) = death_watch {
            kill_declared_dead(&mut round.running, children, watch);
        }
        let statuses = round.poll_for_cause()?;
        if let Some((index, status)) = first_cause(&statuses) {
            round.handle_failure(index, status)?;
            continue;
        }
        if statuses.iter().all(Option::is_some) {
            return round.finish(&statuses);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// One start of every child, while it runs: its processes (in the children's order) and when
/// the launcher was interrupted.
struct Round<'a> {
    children: &'a [ChildSpec],
    mode: OutputMode,
    interrupts: &'a Interrupts,
    bar: &'a LauncherBar,
    alone: Restarts<'a>,
    running: Vec<Running>,
    interrupted_at: Option<Instant>,
}

impl Round<'_> {
    /// Starts `spec`; a process that cannot start ends the round, the others stopped.
    fn start_or_stop_all(&mut self, spec: &ChildSpec) -> Result<Running, Ended> {
        start(spec, self.mode, self.bar).map_err(|e| {
            stop_all(&mut self.running, libc::SIGTERM, self.interrupts);
            Ended::Stopped(e)
        })
    }

    /// Forwards the launcher's first signal to the processes; a second signal, or their
    /// outlasting the grace it gives, kills them and ends the round.
    fn handle_interrupts(&mut self) -> Result<(), Ended> {
        let signals = self.interrupts.count();
        let (forwarded, grace) = self.interrupts.forwarded();
        if signals > 0 && self.interrupted_at.is_none() {
            tracing::warn!(
                "interrupted: forwarding {} to {} process(es); a second signal kills them",
                if forwarded == libc::SIGTERM {
                    "SIGTERM"
                } else {
                    "SIGINT"
                },
                self.running.len()
            );
            signal_groups(&self.running, forwarded);
            // A stopped (SIGSTOP) process acts on the signal only once continued.
            signal_groups(&self.running, libc::SIGCONT);
            self.interrupted_at = Some(Instant::now());
        }
        let Some(at) = self.interrupted_at else {
            return Ok(());
        };
        let why = if signals > 1 {
            Some("a second signal".to_string())
        } else {
            (at.elapsed() >= grace).then(|| format!("they did not stop within {grace:?}"))
        };
        if let Some(why) = why {
            tracing::warn!("killing the processes still running: {why}");
            kill_all(&mut self.running);
            return Err(Ended::Stopped(anyhow!(
                "interrupted; the processes still running were killed ({why})"
            )));
        }
        Ok(())
    }

    /// Every process's exit status (`None` while running), polled a moment later again when
    /// one that takes its peers down has failed.
    fn poll_for_cause(&mut self) -> Result<Vec<Option<ExitStatus>>, Ended> {
        let statuses = poll(&mut self.running)?;
        let failed_here = |(status, spec): (&Option<ExitStatus>, &ChildSpec)| {
            status.is_some_and(|s| failed_exit(&s)) && !spec.restart_alone
        };
        if statuses.iter().zip(self.children).any(failed_here) {
            // The peers of a killed process fail within moments of it, and may be reaped first:
            // a moment more lets the cause show itself. (A process restarted alone has no peers
            // that fail with it: it is replaced at once.)
            thread::sleep(CAUSE_GRACE);
            return poll(&mut self.running);
        }
        Ok(statuses)
    }

    /// Replaces the failed process at `index` alone when it may be and `alone` allows; else
    /// stops the others and ends the round with the failure.
    fn handle_failure(&mut self, index: usize, status: ExitStatus) -> Result<(), Ended> {
        let mut failed = self.running.remove(index);
        // What the failed process left running in its group would otherwise live on.
        kill_all(std::slice::from_mut(&mut failed));
        let interrupted = self.interrupted_at.is_some();
        if self.children[index].restart_alone && !interrupted && !refused(&status) && *self.alone.done < self.alone.max
        {
            return self.restart_alone(index, &failed, status);
        }
        stop_all(&mut self.running, libc::SIGTERM, self.interrupts);
        let error = failure(&failed, status, interrupted, "the other processes were stopped");
        Err(if interrupted || refused(&status) {
            Ended::Stopped(error)
        } else {
            Ended::Failed(error)
        })
    }

    /// Starts a replacement of the failed process at `index`, resuming from the last committed
    /// checkpoint, in its place among the running ones.
    fn restart_alone(&mut self, index: usize, failed: &Running, status: ExitStatus) -> Result<(), Ended> {
        *self.alone.done += 1;
        tracing::warn!(
            "{:#}\nrestarting {} alone (restart {} of {}): the other processes roll back in place \
             to the last committed checkpoint and wait for it",
            failure(failed, status, false, "the other processes go on"),
            failed.name,
            self.alone.done,
            self.alone.max
        );
        let mut spec = self.children[index].clone();
        spec.env.push((RESUME_VAR.to_string(), "1".to_string()));
        let replacement = self.start_or_stop_all(&spec)?;
        self.running.insert(index, replacement);
        Ok(())
    }

    /// Ends the round once every process has exited without failing: in success, or stopped
    /// when they were preempted or interrupted.
    fn finish(&mut self, statuses: &[Option<ExitStatus>]) -> Result<(), Ended> {
        // Whatever the processes left running in their groups ends with the job.
        kill_all(&mut self.running);
        if statuses.iter().flatten().any(stopped_for_preemption) {
            return Err(Ended::Stopped(ProcessesPreempted.into()));
        }
        if self.interrupted_at.is_some() {
            return Err(Ended::Stopped(anyhow!("interrupted")));
        }
        Ok(())
    }
}

/// A failed exit: a process that stopped for preemption (a SIGTERM the launcher forwarded, or
/// one the engine sent it directly) did as asked, and the others stop after the same step.
fn failed_exit(status: &ExitStatus) -> bool {
    !(status.success() || stopped_for_preemption(status))
}

/// The failed process that caused the others' failure, by index: one that refused to start (no
/// restart changes it); else one killed by a signal; the ones that then lost it as a peer
/// failed because of it.
fn first_cause(statuses: &[Option<ExitStatus>]) -> Option<(usize, ExitStatus)> {
    statuses
        .iter()
        .enumerate()
        .filter_map(|(index, status)| status.filter(failed_exit).map(|s| (index, s)))
        .min_by_key(|(_, status)| (!refused(status), status.signal().is_none()))
}

/// Kills the processes that may be restarted alone and that the coordinator declared dead while
/// they still run (stopped, or hung), and the coordinator when it has not answered for longer
/// than the watch allows: their exit is then handled as any death.
fn kill_declared_dead(running: &mut [Running], children: &[ChildSpec], watch: &DeathWatch) {
    for (r, spec) in running.iter_mut().zip(children) {
        if !spec.restart_alone || r.killed_as_dead {
            continue;
        }
        let why = if spec.is_coordinator() {
            watch.hung_for(r.started).map(|silent| {
                format!(
                    "has not answered for {:.1}s (hung, or stopped): killing it so it is replaced",
                    silent.as_secs_f64()
                )
            })
        } else {
            watch.declared_dead(spec.rank, r.child.id()).then(|| {
                "was declared dead by the coordinator but still runs: killing it so it is replaced".to_string()
            })
        };
        if let Some(why) = why {
            r.killed_as_dead = true;
            tracing::warn!("{} (pid {}) {why}", r.name, r.child.id());
            signal_groups(std::slice::from_ref(r), libc::SIGKILL);
        }
    }
}

/// Whether a process exited having stopped for preemption.
fn stopped_for_preemption(status: &ExitStatus) -> bool {
    status.code() == Some(i32::from(PREEMPTED_EXIT_CODE))
}

/// Whether a process exited refusing to start, for a reason no restart changes.
fn refused(status: &ExitStatus) -> bool {
    status.code() == Some(i32::from(REFUSAL_EXIT_CODE))
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
    die_with_launcher(&mut command);
    let mut child = command
        // A group of its own: stopping the child stops what it started too.
        .process_group(0)
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("{}: cannot start {}", spec.name, spec.program.display()))?;
    tracing::info!(process = %spec.name, pid = child.id(), "started {}", spec.program.display());
    let stderr_tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    let log = spec.log.as_deref().map(open_log).transpose()?;
    let mut pumps = Vec::new();
    if let Some(out) = child.stdout.take() {
        let plain = mode == OutputMode::Rank0Plain && spec.rank == 0;
        let output = Output {
            name: spec.name.clone(),
            plain,
            tail: None,
            to_stderr: false,
            log: log.clone(),
        };
        pumps.push(pump(out, output, bar.clone()));
    }
    if let Some(err) = child.stderr.take() {
        let output = Output {
            name: spec.name.clone(),
            plain: false,
            tail: Some(stderr_tail.clone()),
            to_stderr: true,
            log,
        };
        pumps.push(pump(err, output, bar.clone()));
    }
    Ok(Running {
        name: spec.name.clone(),
        child,
        killed_as_dead: false,
        started: Instant::now(),
        stderr_tail,
        pumps,
    })
}

/// Has the child killed when the launcher dies, even by SIGKILL, rather than outlive it holding
/// its ports. The kernel sends the signal when the thread that started the child exits, hence
/// [`supervise`] on the main thread.
#[cfg(target_os = "linux")]
fn die_with_launcher(command: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec, and makes only async-signal-safe calls
    // and no allocation.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died before that took effect: nothing would send the signal.
            if libc::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_command: &mut Command) {}

/// A child's log file (`--log_dir`), opened for appending, its directory made.
fn open_log(path: &Path) -> Result<Arc<Mutex<File>>> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the log directory {}", dir.display()))?;
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening the log {}", path.display()))?;
    Ok(Arc::new(Mutex::new(file)))
}

/// Where one of a child's output streams goes.
struct Output {
    /// The child's name, prefixed to its lines.
    name: String,
    /// Lines as they are, unprefixed.
    plain: bool,
    /// The last lines, kept to quote when the child fails.
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
    to_stderr: bool,
    /// The child's log file, which gets the lines unprefixed.
    log: Option<Arc<Mutex<File>>>,
}

fn pump(stream: impl Read + Send + 'static, output: Output, bar: LauncherBar) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let Output {
            name,
            plain,
            tail,
            to_stderr,
            log,
        } = output;
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if let Some(log) = &log {
                // A log that cannot be written loses its lines, never the child's output.
                if let Ok(mut file) = log.lock() {
                    let _ = writeln!(file, "{line}");
                }
            }
            if bar.update(&line) {
                continue;
            }
            let text = if plain {
                format!("{line}\n")
            } else {
                labelled(&name, &line)
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

/// `line` labelled with the process it came from: a JSON object (a `--log-format json` log line)
/// gains a `"process"` field, so that it stays one JSON object a line; any other line gets a
/// `[name]` prefix.
fn labelled(name: &str, line: &str) -> String {
    if line.starts_with('{') {
        if let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_str(line) {
            fields.insert("process".to_string(), name.into());
            if let Ok(json) = serde_json::to_string(&fields) {
                return format!("{json}\n");
            }
        }
    }
    format!("[{name}] {line}\n")
}

/// Sends `signal` to every child's process group: the child and whatever it started.
fn signal_groups(running: &[Running], signal: libc::c_int) {
    for r in running {
        // SAFETY: each child leads a process group of its own, whose id is its pid; a child not
        // yet reaped keeps it, and a reaped one's group ends with its last member.
        unsafe {
            libc::kill(-(r.child.id() as libc::pid_t), signal);
        }
    }
}

/// Signals every child's process group (continuing stopped processes), then, after a grace
/// period or at a second interrupt, kills the groups and reaps the children.
fn stop_all(running: &mut [Running], signal: libc::c_int, interrupts: &Interrupts) {
    signal_groups(running, signal);
    // A stopped (SIGSTOP) process acts on the signal only once continued.
    signal_groups(running, libc::SIGCONT);
    let deadline = Instant::now() + STOP_GRACE;
    for r in running.iter_mut() {
        while Instant::now() < deadline && interrupts.count() < 2 && matches!(r.child.try_wait(), Ok(None)) {
            thread::sleep(Duration::from_millis(20));
        }
        if matches!(r.child.try_wait(), Ok(None)) {
            tracing::warn!(process = %r.name, "did not stop within {STOP_GRACE:?}; killing it");
        }
    }
    kill_all(running);
}

/// Kills every child's process group, reaps the children and takes the rest of their output.
fn kill_all(running: &mut [Running]) {
    signal_groups(running, libc::SIGKILL);
    for r in running.iter_mut() {
        let _ = r.child.wait();
        let deadline = Instant::now() + OUTPUT_GRACE;
        while r.pumps.iter().any(|pump| !pump.is_finished()) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        // A pump still reading after that is left to end with the pipe's last holder.
        for pump in r.pumps.drain(..).filter(|pump| pump.is_finished()) {
            let _ = pump.join();
        }
    }
}

/// Why `failed` ended, with the end of its stderr; `others` says what became of the rest.
fn failure(failed: &Running, status: ExitStatus, interrupted: bool, others: &str) -> anyhow::Error {
    let tail: Vec<String> = failed
        .stderr_tail
        .lock()
        .map(|t| t.iter().cloned().collect())
        .unwrap_or_default();
    let (cause, consequence) = if interrupted {
        ("was interrupted", "")
    } else if refused(&status) {
        ("refused to start", "no restart can help, so ")
    } else {
        ("failed", "")
    };
    let last_words = if tail.is_empty() {
        "It wrote nothing to stderr.".to_string()
    } else {
        format!("Its last output:\n{}", tail.join("\n"))
    };
    anyhow!(
        "{} {cause} ({status}); {consequence}{others}. {last_words}",
        failed.name
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_stay_json_and_name_their_process() {
        let line = labelled("rank 1", r#"{"level":"INFO","fields":{"message":"step 3"}}"#);
        let event: serde_json::Value = serde_json::from_str(&line).expect("one JSON object");
        assert_eq!(event["process"], "rank 1");
        assert_eq!(event["fields"]["message"], "step 3");
        assert_eq!(labelled("rank 1", "step 3"), "[rank 1] step 3\n");
        assert_eq!(labelled("rank 1", "{not json"), "[rank 1] {not json\n");
    }
}
