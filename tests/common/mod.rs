//! Shared by the integration tests: building jobs and comparing parameters.

#![allow(dead_code)]

pub mod hosts;
pub mod parquet;
pub mod slurm;

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use flotilla::config::JobConfig;
use flotilla::job::ps::{ParameterServerJob, PsSummary};
use flotilla::job::{RunOptions, RunOutcome, TrainingJob};
use flotilla::models::{Activation, Block, Linear, Lookup, ParamInit, SparseModel, SparseModelDef, SparseTableSpec};

/// A job from the built-in config text plus `overrides`, no environment.
pub fn config(overrides: &[&str]) -> JobConfig {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    JobConfig::from_toml_str(include_str!("../../config.toml"), "config.toml", &|_| None, &overrides)
        .expect("valid test config")
}

/// Trains `config` as a simulated cluster, outputs in a temporary directory.
pub fn train_in_process(config: JobConfig) -> RunOutcome {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = RunOptions::new(dir.path());
    TrainingJob::builtin(config)
        .expect("job")
        .run_simulated(&options)
        .expect("training succeeds")
}

/// The error (with its causes) that training `config` as a simulated cluster ends with.
pub fn run_error(config: JobConfig) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = RunOptions::new(dir.path());
    let job = TrainingJob::builtin(config).expect("job");
    format!("{:#}", job.run_simulated(&options).expect_err("the run fails"))
}

/// Largest absolute difference between two parameter sets, by name.
pub fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    let b: HashMap<&str, &Vec<f32>> = b.iter().map(|(n, v)| (n.as_str(), v)).collect();
    assert_eq!(a.len(), b.len(), "parameter sets differ in size");
    a.iter()
        .map(|(name, va)| {
            let vb = b.get(name.as_str()).unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(va.len(), vb.len(), "{name} differs in shape");
            va.iter().zip(vb.iter()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
        })
        .fold(0.0, f32::max)
}

/// A table row: id, values, optimizer state.
pub type Row = (u64, Vec<f32>, Vec<f32>);

/// The shards' saved tables and dense slices, and the AUC and loss of the summary, equal those
/// of the same job run uninterrupted in one process.
pub fn ps_matches_uninterrupted(settings: &[&str], summary: &serde_json::Value, run_dir: &Path) {
    let load = |path: &Path| {
        flotilla::config::JobConfig::from_file(
            path,
            &|_| None,
            &settings.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    };
    let config = load(Path::new("examples/ctr_ps.toml")).unwrap();
    let reference_dir = tempfile::tempdir().unwrap();
    let uninterrupted = flotilla::job::ps::ParameterServerJob::builtin(config.clone())
        .unwrap()
        .run_simulated(&RunOptions::new(reference_dir.path()))
        .unwrap();
    assert_eq!(summary["auc"].as_f64().unwrap(), uninterrupted.auc);
    assert_eq!(summary["final_loss"].as_f64().unwrap() as f32, uninterrupted.final_loss);
    for index in 0..config.cluster.server_num {
        assert!(
            saved_shard(&config, run_dir, index) == saved_shard(&config, reference_dir.path(), index),
            "shard {index} differs"
        );
    }
}

/// Shard `index` of `config`'s job with its built-in model, fresh.
pub fn fresh_shard(config: &JobConfig, index: usize) -> flotilla::ps::Shard {
    let model = flotilla::models::SparseModelDef::builtin(&config.train).unwrap();
    flotilla::job::ps::build_shard(config, &model, index).unwrap()
}

/// What shard `index` of `config`'s job saved in `dir`: its dense values and their optimizer
/// state, and each table's rows by id with their state.
pub fn saved_shard(config: &JobConfig, dir: &Path, index: usize) -> (Vec<f32>, Vec<f32>, Vec<Vec<Row>>) {
    let mut shard = fresh_shard(config, index);
    shard.load(&dir.join(format!("ps-shard-{index}.safetensors"))).unwrap();
    let mut tables: Vec<Vec<Row>> = shard
        .tables()
        .iter()
        .map(|t| t.rows().map(|(id, v, s)| (id, v.to_vec(), s.to_vec())).collect())
        .collect();
    tables
        .iter_mut()
        .for_each(|rows| rows.sort_unstable_by_key(|row| row.0));
    (shard.dense().values().to_vec(), shard.dense().state().to_vec(), tables)
}

/// The `summary.json` a run wrote into `run_dir`.
pub fn read_summary(run_dir: &Path) -> serde_json::Value {
    let path = run_dir.join("summary.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Reads a `params.safetensors` written by a run of a built-in model: its parameters by name,
/// flat in the model's own layout (as a run's outcome holds them).
pub fn read_params(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = flotilla::models::export::ModelFile::parse(&bytes).expect("a model file");
    let model = file.model(&candle_core::Device::Cpu).expect("a built-in model");
    model
        .parameters()
        .into_iter()
        .map(|p| {
            (
                p.name,
                p.param.var().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect()
}

/// A base port with `count` free consecutive loopback ports after it.
pub fn free_port_range(count: u16) -> u16 {
    for _ in 0..50 {
        let base = TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        if base > u16::MAX - count {
            continue;
        }
        let all_free = (base..base + count).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no free loopback port range of {count}");
}

/// The pids of `launcher`'s children.
pub fn children_of(launcher: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{launcher}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        pids.extend(children.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
    }
    pids
}

/// The pid of each of `launcher`'s roles, by the name the launcher gives it — `rank 1`,
/// `server 0`, `trainer 1` — read from their environments.
pub fn role_pids(launcher: u32) -> HashMap<String, i32> {
    children_of(launcher)
        .into_iter()
        .filter_map(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let var = |name: &str| {
                environ.split(|&b| b == 0).find_map(|var| {
                    let value = var.strip_prefix(format!("{name}=").as_bytes())?;
                    Some(String::from_utf8_lossy(value).into_owned())
                })
            };
            let name = match (var("TRAINING_ROLE")?.as_str(), var("PADDLE_PSERVERS_IP_PORT_LIST")) {
                ("PSERVER", Some(servers)) => {
                    let me = format!("{}:{}", var("POD_IP")?, var("PADDLE_PORT")?);
                    format!("server {}", servers.split(',').position(|s| s == me)?)
                }
                ("TRAINER", Some(_)) => format!("trainer {}", var("PADDLE_TRAINER_ID")?),
                _ => format!("rank {}", var("PADDLE_TRAINER_ID")?),
            };
            Some((name, pid))
        })
        .collect()
}

/// The pid of each of `launcher`'s trainers, by rank (read from their environments).
pub fn trainer_ranks(launcher: u32) -> HashMap<usize, i32> {
    children_of(launcher)
        .into_iter()
        .filter_map(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let rank = environ
                .split(|&b| b == 0)
                .find_map(|var| var.strip_prefix(b"PADDLE_TRAINER_ID="))?;
            Some((std::str::from_utf8(rank).ok()?.parse().ok()?, pid))
        })
        .collect()
}

/// Waits (at most 60 s) until `run_dir`'s metrics.jsonl has a line: training is under way.
pub fn wait_for_training(run_dir: &Path) {
    let metrics = run_dir.join("metrics.jsonl");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(&metrics).map_or(true, |m| !m.contains('\n')) {
        assert!(Instant::now() < deadline, "{} never got a line", metrics.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most 60 s) until step `step`'s checkpoint is committed in `dir`.
pub fn wait_for_commit(dir: &Path, step: usize) {
    let manifest = dir.join(format!("step-{step:08}")).join("manifest.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !manifest.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", manifest.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A number that differs from run to run, printed so a failure can be replayed by hand.
pub fn pick(choices: usize) -> usize {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    nanos as usize % choices
}

/// Loses the node `launcher` runs: kills the launcher and every process it started, by pid, so
/// that nothing there restarts, and waits for its end.
pub fn lose_node(launcher: Started) {
    let started = children_of(launcher.child.id());
    // SAFETY: the pids of the test's own launcher and of the processes it started.
    unsafe {
        libc::kill(launcher.child.id() as i32, libc::SIGKILL);
        for &pid in &started {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    assert!(!launcher.finish(10).success);
}

/// Kills what is left of `pids`, the processes a test's launcher started: reaped already unless
/// the launcher failed to end them, in which case the test must not leave them behind.
pub fn end_leftovers(pids: impl IntoIterator<Item = i32>) {
    for pid in pids {
        // SAFETY: a pid of a process the test's own launcher started; SIGKILL of one already
        // reaped by it is a no-op.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// What a finished flotilla process printed.
pub struct Finished {
    pub success: bool,
    /// Its exit status; `None` when a signal ended it.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    /// Panics unless the process succeeded, with `what` went wrong and all it printed.
    pub fn assert_success(&self, what: &str) {
        assert!(self.success, "{what}:\n{}\n{}", self.stdout, self.stderr);
    }
}

/// The arguments of `flotilla launch` starting `nproc` ranks on this host, their ports from
/// `port` on, each running `train` with `args`.
pub fn local_launch<'a>(nproc: &'a str, port: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut launch = vec![
        "launch",
        "--nproc_per_node",
        nproc,
        "--started_port",
        port,
        "--",
        "train",
    ];
    launch.extend_from_slice(args);
    launch
}

/// Starts `launcher` (the launch command and its process counts) on ports from `port`, each of
/// its processes training `config` into `run_dir` with every one of `settings` as a `--set`.
pub fn start_launched_training(
    launcher: &[&str],
    port: u16,
    config: &str,
    run_dir: &Path,
    settings: &[impl AsRef<str>],
) -> Started {
    let port = port.to_string();
    let run_dir = run_dir.to_str().expect("a UTF-8 run directory");
    let mut args = launcher.to_vec();
    #[rustfmt::skip]
    args.extend(["--started_port", &port, "--", "train", "--config", config, "--run-dir", run_dir]);
    for setting in settings {
        args.extend(["--set", setting.as_ref()]);
    }
    start_flotilla(&args, &[])
}

/// Panics unless `text` (a process's output) holds `needle`, saying `what` was expected and
/// showing `text`.
pub fn assert_says(text: &str, needle: &str, what: &str) {
    assert!(text.contains(needle), "{what}:\n{text}");
}

/// A flotilla process started by a test, its output being collected.
pub struct Started {
    pub child: std::process::Child,
    stdout: std::thread::JoinHandle<String>,
    stderr: std::thread::JoinHandle<String>,
}

fn collect(mut stream: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stream.read_to_string(&mut s);
        s
    })
}

/// The cluster token the tests hand the roles they start by hand (a launcher makes its own).
pub const TEST_TOKEN: &str = "the integration tests' cluster token";

/// Starts the flotilla binary with `args` and extra `env`; the launcher's
/// variables come only from `env`, never from the tests' environment. A role
/// started by hand (`run --role …`) gets [`TEST_TOKEN`] unless `env` names a
/// token.
pub fn start_flotilla(args: &[&str], env: &[(&str, String)]) -> Started {
    start_flotilla_in(Path::new("."), args, env)
}

/// Starts the flotilla binary as [`start_flotilla`] does, in the working directory `cwd`.
pub fn start_flotilla_in(cwd: &Path, args: &[&str], env: &[(&str, String)]) -> Started {
    let mut env = env.to_vec();
    if args.first() == Some(&"run") && !env.iter().any(|(k, _)| *k == "FLOTILLA_TOKEN") {
        env.push(("FLOTILLA_TOKEN", TEST_TOKEN.to_string()));
    }
    start_program_in(cwd, env!("CARGO_BIN_EXE_flotilla"), args, &env)
}

/// Starts `program` with `args` and extra `env`, as [`start_flotilla`].
pub fn start_program(program: &str, args: &[&str], env: &[(&str, String)]) -> Started {
    start_program_in(Path::new("."), program, args, env)
}

/// Starts `program` as [`start_program`] does, in the working directory `cwd`.
pub fn start_program_in(cwd: &Path, program: &str, args: &[&str], env: &[(&str, String)]) -> Started {
    use std::process::{Command, Stdio};
    let mut command = Command::new(program);
    command.current_dir(cwd).args(args);
    // A test names the launch contract it tests: none leaks in from where the tests run.
    let contracts = [
        "PADDLE_TRAINER_ID",
        "FLOTILLA_TOKEN",
        "FLOTILLA_JOB_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ];
    for var in contracts {
        command.env_remove(var);
    }
    let mut child = command
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("flotilla starts");
    let stdout = collect(child.stdout.take().expect("stdout"));
    let stderr = collect(child.stderr.take().expect("stderr"));
    Started { child, stdout, stderr }
}

impl Started {
    /// Waits for the process, killing it (by pid) if it outlives `timeout_s`.
    pub fn finish(mut self, timeout_s: u64) -> Finished {
        let status = wait_or_kill(&mut self.child, timeout_s);
        Finished {
            success: status.success(),
            code: status.code(),
            stdout: self.stdout.join().unwrap_or_default(),
            stderr: self.stderr.join().unwrap_or_default(),
        }
    }
}

/// Waits for `child`, killing it (by pid) and failing the test if it outlives `timeout_s`.
pub fn wait_or_kill(child: &mut std::process::Child, timeout_s: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(timeout_s);
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("flotilla did not finish within {timeout_s}s; killed pid {}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the flotilla binary with `args` and extra `env` to its end (at most
/// `timeout_s`).
pub fn flotilla(args: &[&str], env: &[(&str, String)], timeout_s: u64) -> Finished {
    start_flotilla(args, env).finish(timeout_s)
}

/// A hybrid job of 2 pipeline replicas × 2 stages (1F1B, 4 micro-batches) on 4 ranks.
pub const PIPELINE_2X2: [&str; 6] = [
    "strategy.pipeline=true",
    "cluster.nproc_per_node=4",
    "strategy.hybrid_configs.dp_degree=2",
    "strategy.hybrid_configs.pp_degree=2",
    "strategy.pipeline_configs.schedule_mode=\"1F1B\"",
    "strategy.pipeline_configs.accumulate_steps=4",
];

/// A character GPT small enough to train a few steps in a test: 2 layers of 2 heads, width 16,
/// 16-token windows, a global batch of 16.
pub const TINY_GPT: [&str; 7] = [
    "train.model=\"gpt\"",
    "train.dataset=\"text\"",
    "train.gpt.n_layer=2",
    "train.gpt.n_head=2",
    "train.gpt.n_embd=16",
    "train.gpt.block_size=16",
    "train.batch_size=16",
];

/// A chrome trace's process tracks, `(pid, name)` sorted by pid.
pub fn trace_tracks(trace: &serde_json::Value) -> Vec<(u64, String)> {
    let mut tracks: Vec<(u64, String)> = trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| {
            let pid = e["pid"].as_u64().expect("pid");
            (pid, e["args"]["name"].as_str().expect("track name").to_string())
        })
        .collect();
    tracks.sort();
    tracks
}

/// `(start, end)` in µs of the spans on track `pid` whose name `name` accepts, in time order.
pub fn trace_spans(trace: &serde_json::Value, pid: u64, name: impl Fn(&str) -> bool) -> Vec<(f64, f64)> {
    let mut found: Vec<(f64, f64)> = trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["name"].as_str().is_some_and(&name))
        .map(|e| {
            let start = e["ts"].as_f64().expect("ts");
            (start, start + e["dur"].as_f64().expect("dur"))
        })
        .collect();
    found.sort_by(|a, b| a.0.total_cmp(&b.0));
    found
}

/// Whether `program` (from Debian's `package`) is on the `PATH` here (or in `/usr/sbin`, where
/// Debian puts daemons). CI installs it, so there its absence fails the test; elsewhere the test
/// is skipped, saying why.
pub fn installed(program: &str, package: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([std::path::PathBuf::from("/usr/sbin")])
        .any(|dir| dir.join(program).is_file());
    let found = if found {
        Ok(())
    } else {
        Err("not on the PATH".to_string())
    };
    required(&format!("{program} ({package})"), found).is_some()
}

/// A small CTR job: narrow model, small vocabularies (so rows are shared between trainers and
/// steps), 2 shards × 3 trainers.
pub fn ctr_config(overrides: &[&str]) -> JobConfig {
    ctr_config_with("", overrides)
}

/// [`ctr_config`] with `tables` (TOML tables, e.g. `[train.click_log]`) added.
pub fn ctr_config_with(tables: &str, overrides: &[&str]) -> JobConfig {
    let base = r#"
        [cluster]
        server_num = 2
        nproc_per_node = 3
        [train]
        model = "wide_deep"
        embedding_dim = 4
        hidden_sizes = [16, 8]
        dataset = "criteo_synthetic"
        synthetic_samples = 21000
        synthetic_vocab = 300
        test_fraction = 0.05
        batch_size = 96
        steps = 20
        optimizer = "sgd"
        momentum = 0.0
        lr = 0.1
        [fault_tolerance]
        timeout_s = 30
    "#;
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    JobConfig::from_toml_str(&format!("{base}\n{tables}"), "ctr.toml", &|_| None, &overrides)
        .expect("valid test config")
}

/// `config`'s parameter-server job run in a simulated cluster, its summary.
pub fn run(config: JobConfig, run_dir: &Path) -> PsSummary {
    let options = RunOptions::new(run_dir);
    ParameterServerJob::builtin(config)
        .expect("job")
        .run_simulated(&options)
        .expect("training succeeds")
}

/// A library user's model: three tables read by disjoint slots (users, items, context), the
/// context's rows at a step size of their own, and a dense part of two blocks.
pub struct ThreeTables {
    hidden: Linear,
    out: Linear,
}

/// `(table, width, slots)` of [`ThreeTables`].
pub const THREE_TABLES: [(&str, usize, std::ops::Range<usize>); 3] =
    [("user", 4, 0..8), ("item", 6, 8..20), ("context", 2, 20..26)];

impl ThreeTables {
    fn new(init: &ParamInit) -> candle_core::Result<Self> {
        let inputs: usize = THREE_TABLES.iter().map(|(_, w, slots)| w * slots.len()).sum::<usize>() + 13;
        Ok(Self {
            hidden: Linear::new("hidden", inputs, 8, Activation::Relu, init)?,
            out: Linear::new("out", 8, 1, Activation::Identity, init)?,
        })
    }
}

impl SparseModel for ThreeTables {
    fn tables(&self) -> Vec<SparseTableSpec> {
        THREE_TABLES
            .iter()
            .map(|(name, width, slots)| SparseTableSpec {
                lr: (*name == "context").then_some(0.03),
                ..SparseTableSpec::new(name, *width, 0.3, slots.clone())
            })
            .collect()
    }

    fn blocks(&self) -> Vec<&dyn Block> {
        vec![&self.hidden, &self.out]
    }

    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor> {
        let batch = dense.dim(0)?;
        let mut inputs = lookups
            .iter()
            .map(|l| l.embedded(batch)?.flatten_from(1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        inputs.push(dense.clone());
        self.out
            .forward(&self.hidden.forward(&Tensor::cat(&inputs, 1)?)?)?
            .squeeze(1)
    }
}

/// [`ThreeTables`] as a job's model.
pub fn three_table_model() -> SparseModelDef {
    SparseModelDef::new(std::sync::Arc::new(|init: &ParamInit| {
        Ok(Box::new(ThreeTables::new(init)?) as Box<dyn SparseModel>)
    }))
    .unwrap()
}

/// Whether this machine's `python3` imports `modules`: CI's must (`.ci/run` installs them);
/// elsewhere the test says it was skipped.
pub fn python_imports(modules: &[&str]) -> bool {
    let probe = format!("import {}", modules.join(", "));
    let found = std::process::Command::new("python3")
        .args(["-c", &probe])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let found = if found { Ok(()) } else { Err(format!("`{probe}` fails")) };
    required(&format!("python3 with the modules {modules:?}"), found).is_some()
}

/// A part of this machine a test needs (`what`: a program, root, network namespaces), or why it
/// is missing. CI provides every such part (`.ci/run` installs them and runs as root), so under
/// `CI` a missing one fails the test, naming it, rather than letting it pass without running;
/// elsewhere the test is skipped, saying why (`None`).
pub fn required<T>(what: &str, found: Result<T, String>) -> Option<T> {
    match found {
        Ok(part) => Some(part),
        Err(why) if in_ci() => panic!("CI must provide {what} (.ci/run sets it up), but: {why}"),
        Err(why) => {
            eprintln!("skipped: this test needs {what}: {why}");
            None
        }
    }
}

/// Whether this is CI: `CI` set to anything but empty, `0` or `false` (`.ci/run` sets `true`).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|ci| !matches!(ci.as_str(), "" | "0" | "false"))
}

/// Runs the flotilla binary with `args` to its end (at most `timeout_s`, then it is killed by
/// pid): whether it succeeded, its stderr, and the peak resident set of its process in bytes
/// (the kernel's count, from `wait4` in a small parent).
pub fn flotilla_peak_rss(args: &[&str], timeout_s: u64) -> (bool, String, u64) {
    // The kernel's count keeps, across `exec`, the peak of the process the child was spawned
    // from, whose memory was the child's until then: spawned from this test process (large,
    // and holding other tests' data), the count would be this process's. A small parent —
    // Python, which forks, execs the binary and reports the child's count — bounds that by its
    // own few megabytes.
    const MEASURE: &str = "import ctypes, os, sys\n\
        pid = os.fork()\n\
        if pid == 0:\n    ctypes.CDLL(None).prctl(1, 9)\n    os.execv(sys.argv[1], sys.argv[1:])\n\
        _, status, usage = os.wait4(pid, 0)\n\
        print(f'peak_rss_kib {usage.ru_maxrss}', file=sys.stderr)\n\
        sys.exit(os.waitstatus_to_exitcode(status))\n";
    let measured = [&["-c", MEASURE, env!("CARGO_BIN_EXE_flotilla")][..], args].concat();
    let finished = start_program("python3", &measured, &[]).finish(timeout_s);
    let (stderr, report) = finished
        .stderr
        .trim_end()
        .rsplit_once('\n')
        .unwrap_or(("", finished.stderr.trim_end()));
    let kib: u64 = report
        .strip_prefix("peak_rss_kib ")
        .and_then(|kib| kib.parse().ok())
        .unwrap_or_else(|| panic!("no peak from the measuring parent:\n{}", finished.stderr));
    (finished.success, stderr.to_string(), kib * 1024)
}
