//! Jobs run by a real Slurm: the test starts Debian's `munged`, `slurmctld` and `slurmd` on
//! this machine (one node, its own ports, key and state directory; ended by pid afterwards), and
//! `srun` starts the job: one task per rank, each `flotilla run` reading its place from Slurm's
//! variables; and one task running our parameter-server launcher. Needs root and Debian's
//! `slurmctld`, `slurmd`, `slurm-client` and `munge` (CI installs them and runs as root: there,
//! without them, the test fails); skipped, saying why, elsewhere.

mod common;

use std::path::PathBuf;

use common::slurm::Slurm;
use common::{config, free_port_range, ps_matches_uninterrupted, train_in_process};

const STEPS: &str = "train.steps=20";

/// `srun -n 4`: one task per rank of a data-parallel job, each a `flotilla run` that reads its
/// rank, the job's size and the coordinator (the step's first node, a port of the job's) from
/// Slurm; the same job under `srun --ntasks-per-node=1 flotilla launch` (the launcher's node
/// rank and coordinator from Slurm); then `srun -n 1` of our parameter-server launcher. Each
/// ends as the in-process run.
#[test]
fn srun_runs_a_data_parallel_job_rank_by_rank_and_under_launchers_and_a_parameter_server_job() {
    let Some(slurm) = Slurm::start() else {
        return;
    };
    let run_dir: PathBuf = slurm.dir.path().join("collective");
    let flotilla = env!("CARGO_BIN_EXE_flotilla");
    #[rustfmt::skip]
    let ranks = [
        "-N", "1", "-n", "4", "--overcommit",
        flotilla, "run", "--role", "trainer", "--config", "config.toml", "--set", STEPS,
    ];
    slurm.srun(&ranks, &[("FLOTILLA_RUN_DIR", run_dir.display().to_string())]);
    let collective = common::read_summary(&run_dir);
    assert_eq!(collective["world_size"], 4);
    let simulated = train_in_process(config(&[STEPS, "cluster.nproc_per_node=4"]));
    assert_eq!(collective["param_checksum"], simulated.summary.param_checksum.as_str());

    // One launcher per node, its place and the coordinator from Slurm.
    let run_dir: PathBuf = slurm.dir.path().join("launched");
    #[rustfmt::skip]
    let launcher = [
        "-N", "1", "--ntasks-per-node", "1", "--overcommit",
        flotilla, "launch", "--nproc_per_node", "4", "--", "train", "--config", "config.toml", "--set", STEPS,
        "--run-dir", run_dir.to_str().unwrap(),
    ];
    slurm.srun(&launcher, &[]);
    let launched = common::read_summary(&run_dir);
    assert_eq!(launched["param_checksum"], simulated.summary.param_checksum.as_str());

    let run_dir = slurm.dir.path().join("parameter-server");
    let port = free_port_range(6).to_string();
    let ps_steps = "train.steps=40";
    #[rustfmt::skip]
    let launcher = [
        "-N", "1", "-n", "1", "--overcommit",
        flotilla, "launch-ps", "--server_num", "2", "--worker_num", "2", "--started_port", &port, "--",
        "train", "--config", "examples/ctr_ps.toml", "--set", ps_steps, "--run-dir", run_dir.to_str().unwrap(),
    ];
    slurm.srun(&launcher, &[]);
    ps_matches_uninterrupted(&[ps_steps], &common::read_summary(&run_dir), &run_dir);
}
