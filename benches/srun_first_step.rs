//! Time from `srun` to the first training step: flotilla's launcher (one per node, its place
//! and coordinator from Slurm) against torchrun under the same `srun`, each starting 2 ranks of
//! a small data-parallel MLP, on a one-node Slurm this program starts (root; Debian's
//! `munged`, `slurmctld`, `slurmd`, `slurm-client`). The first step is the first line of
//! flotilla's `metrics.jsonl`, or the time torchrun's rank 0 writes after its first step
//! (`benches/torch_first_step.py`). Prints each run and the medians.
//!
//!     PEERS_PY=$HOME/.cache/flotilla-peers/bin/python cargo bench --bench srun_first_step
//!     (RUNS=5 by default)

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::slurm::Slurm;

/// Waits (at most 120 s) until `ready` gives a time, polling every 2 ms.
fn wait_for(what: &str, ready: impl Fn() -> Option<f64>) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(at) = ready() {
            return at;
        }
        assert!(Instant::now() < deadline, "waited 120 s for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Seconds from `srun ARGS` to the first step, which `first_step` reports as an epoch time.
fn first_step(slurm: &Slurm, args: &[&str], first_step: impl Fn() -> Option<f64>) -> f64 {
    let started = now();
    let srun = slurm.start_srun(args, &[]);
    let at = wait_for("the first step", first_step);
    let finished = srun.finish(300);
    assert!(
        finished.success,
        "srun {args:?}:\n{}\n{}",
        finished.stdout, finished.stderr
    );
    at - started
}

/// When a file appeared and got its first line: its modification time then.
fn first_line(path: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.contains('\n').then(|| {
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok()?;
        Some(modified.duration_since(UNIX_EPOCH).ok()?.as_secs_f64())
    })?
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let Some(slurm) = Slurm::start() else {
        eprintln!("Slurm cannot run here (see above)");
        std::process::exit(1);
    };
    let runs: usize = std::env::var("RUNS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let peer = std::env::var("PEERS_PY").ok();
    let flotilla = env!("CARGO_BIN_EXE_flotilla");
    let srun = ["-N", "1", "--ntasks-per-node", "1", "--overcommit"];
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        #[rustfmt::skip]
        let launch = [
            flotilla, "launch", "--nproc_per_node", "2", "--", "train", "--config", "config.toml",
            "--set", "train.steps=200", "--run-dir", run_dir.to_str().unwrap(),
        ];
        let metrics = run_dir.join("metrics.jsonl");
        let seconds = first_step(&slurm, &[&srun[..], &launch].concat(), || first_line(&metrics));
        println!("run {run}: flotilla launch {seconds:.3} s");
        ours.push(seconds);
        if let Some(python) = &peer {
            let marker = dir.path().join("torch-first-step");
            #[rustfmt::skip]
            let torchrun = [
                python.as_str(), "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "benches/torch_first_step.py", "--marker", marker.to_str().unwrap(),
            ];
            let read = || std::fs::read_to_string(&marker).ok()?.trim().parse().ok();
            let seconds = first_step(&slurm, &[&srun[..], &torchrun].concat(), read);
            println!("run {run}: torchrun        {seconds:.3} s");
            theirs.push(seconds);
        }
    }
    let ours = median(ours);
    println!("median srun → first step: flotilla launch {ours:.3} s");
    if !theirs.is_empty() {
        let theirs = median(theirs);
        println!(
            "median srun → first step: torchrun        {theirs:.3} s ({:.1}× flotilla's)",
            theirs / ours
        );
    }
}
