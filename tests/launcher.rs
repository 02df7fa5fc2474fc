//! The launchers and the processes they start: a closed launcher output, a killed launcher, Ctrl-C
//! with a stopped rank, and a failed rank that leaves a background process behind. Every process a
//! test's launcher starts carries a mark in its environment, which finds it (and its own children)
//! wherever it was reparented; a guard kills whatever carries it when the test ends.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{children_of, free_port_range, start_flotilla, trainer_ranks, wait_for_training, wait_or_kill};

const MARK_VAR: &str = "FLOTILLA_TEST_MARK";

/// The mark of one test's processes; kills (by pid) every process still carrying it when dropped.
struct Marked(String);

impl Marked {
    fn new(test: &str) -> Self {
        Self(format!("{}-{test}", std::process::id()))
    }

    fn env(&self) -> (&'static str, String) {
        (MARK_VAR, self.0.clone())
    }

    /// The live processes carrying the mark, except `launcher`.
    fn processes(&self, launcher: u32) -> Vec<i32> {
        let wanted = format!("{MARK_VAR}={}", self.0);
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != launcher as i32)
            .filter(|pid| {
                // A zombie's environment reads empty: it counts as gone.
                let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                environ.split(|&b| b == 0).any(|var| var == wanted.as_bytes())
            })
            .collect()
    }

    /// The marked processes besides `launcher` still alive after `timeout`, or none as soon as
    /// all are gone.
    fn survivors(&self, launcher: u32, timeout: Duration) -> Vec<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = self.processes(launcher);
            if left.is_empty() || Instant::now() > deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits (at most 30 s) until `launcher` has started `count` processes; returns their pids.
fn wait_for_children(launcher: u32, count: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let children = children_of(launcher);
        if children.len() >= count {
            return children;
        }
        assert!(
            Instant::now() < deadline,
            "only {children:?} of {count} processes started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Marked {
    fn drop(&mut self) {
        for pid in self.processes(0) {
            // SAFETY: a process this test started, found by its mark.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: a process this test started and has not reaped.
    unsafe {
        libc::kill(pid as i32, signal);
    }
}

/// Two ranks that ignore SIGINT and SIGTERM, one of them stopped (SIGSTOP): the launcher (with
/// `flags`) gets `signals` and must end them by force. Returns its stderr.
fn interrupt_with_a_stopped_rank(test: &str, flags: &[&str], signals: &[i32]) -> String {
    let mark = Marked::new(test);
    let port = free_port_range(3).to_string();
    let mut args = vec!["launch", "--nproc_per_node", "2", "--started_port", &port];
    args.extend(flags);
    args.extend(["--", "bash", "-c", "trap '' INT TERM; sleep 60"]);
    let launcher = start_flotilla(&args, &[mark.env()]);
    let pid = launcher.child.id();
    let ranks = wait_for_children(pid, 2);
    signal(ranks[0] as u32, libc::SIGSTOP);
    for &s in signals {
        signal(pid, s);
    }
    let finished = launcher.finish(30);
    let left = mark.survivors(pid, Duration::from_secs(5));
    assert!(left.is_empty(), "still running after the launcher: {left:?}");
    assert!(!finished.success, "an interrupted job does not succeed");
    finished.stderr
}

#[test]
fn ctrl_c_ends_ranks_that_ignore_it_after_the_grace_period() {
    let stderr = interrupt_with_a_stopped_rank("grace", &[], &[libc::SIGINT]);
    assert!(stderr.contains("did not stop within 5s"), "{stderr}");
}

#[test]
fn a_forwarded_sigterm_gives_the_ranks_the_stop_grace_asked() {
    let stderr = interrupt_with_a_stopped_rank("stop-grace", &["--stop_grace_s", "1"], &[libc::SIGTERM]);
    assert!(
        stderr.contains("forwarding SIGTERM") && stderr.contains("did not stop within 1s"),
        "{stderr}"
    );
}

#[test]
fn a_second_signal_kills_the_ranks_at_once() {
    // Two different signals: a second SIGINT sent at once may merge with the first.
    let stderr = interrupt_with_a_stopped_rank("second", &[], &[libc::SIGINT, libc::SIGTERM]);
    assert!(stderr.contains("a second signal"), "{stderr}");
}

#[test]
fn killing_a_launcher_ends_its_processes() {
    let launchers: [&[&str]; 2] = [
        &["launch", "--nproc_per_node", "2"],
        &["launch-ps", "--server_num", "2", "--worker_num", "1"],
    ];
    for launcher in launchers {
        let mark = Marked::new(launcher[0]);
        let port = free_port_range(4).to_string();
        let mut args = launcher.to_vec();
        args.extend(["--started_port", &port, "--", "sleep", "60"]);
        let mut started = start_flotilla(&args, &[mark.env()]);
        let pid = started.child.id();
        wait_for_children(pid, if launcher[0] == "launch" { 2 } else { 3 });
        started.child.kill().expect("SIGKILL the launcher");
        let _ = started.child.wait();
        let left = mark.survivors(pid, Duration::from_secs(5));
        assert!(
            left.is_empty(),
            "{}: processes outlived their launcher: {left:?}",
            launcher[0]
        );
    }
}

#[test]
fn a_failed_rank_is_reported_at_once_and_its_background_process_ends() {
    let mark = Marked::new("background");
    let port = free_port_range(2).to_string();
    let launcher = start_flotilla(
        &[
            "launch",
            "--started_port",
            &port,
            "--",
            "bash",
            "-c",
            "(sleep 25)& exit 3",
        ],
        &[mark.env()],
    );
    let pid = launcher.child.id();
    // Well under the 25 s of the background sleep.
    let finished = launcher.finish(10);
    assert!(!finished.success);
    assert!(
        finished.stderr.contains("rank 0 failed (exit status: 3)"),
        "{}",
        finished.stderr
    );
    let left = mark.survivors(pid, Duration::from_secs(5));
    assert!(
        left.is_empty(),
        "the failed rank's background process lives on: {left:?}"
    );
}

#[test]
fn a_closed_output_does_not_stop_the_launcher_restarting_a_killed_rank() {
    let mark = Marked::new("closed");
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(3).to_string();
    // `flotilla launch … 2>&1 | head -2`.
    let (reader, writer) = std::io::pipe().expect("pipe");
    #[rustfmt::skip]
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["launch", "--nproc_per_node", "2", "--started_port", &port, "--", "train",
               "--run-dir", run_dir.to_str().unwrap(), "--set", "train.steps=3000",
               "--set", "fault_tolerance.max_restarts=1"])
        .env_remove("FLOTILLA_TOKEN")
        .env(MARK_VAR, &mark.0)
        .stdin(Stdio::null())
        .stdout(writer.try_clone().expect("pipe"))
        .stderr(writer)
        .spawn()
        .expect("flotilla starts");
    let (lines, head) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(reader);
        for _ in 0..2 {
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = lines.send(line);
        }
        // The reader, dropped here, was the pipe's last: the launcher's output is closed.
    });
    for _ in 0..2 {
        let line = head
            .recv_timeout(Duration::from_secs(60))
            .expect("a line of the launcher");
        eprintln!("head: {line}");
    }
    wait_for_training(&run_dir);
    let ranks = trainer_ranks(launcher.id());
    assert_eq!(ranks.len(), 2, "the ranks: {ranks:?}");
    signal(ranks[&1] as u32, libc::SIGKILL);
    let status = wait_or_kill(&mut launcher, 180);
    assert!(status.success(), "the launcher ended with {status}");
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["steps"], 3000);
}
