//! The flotilla binary: `flotilla <command>`; `flotilla run --role …` runs
//! one role of a launched job.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

use flotilla::bench::allreduce::{self, AllReduceArgs};
use flotilla::bench::checkpoint::{self as checkpoint_bench, CheckpointBenchArgs};
use flotilla::bench::pipeline::{self as pipeline_bench, PipelineBenchArgs};
use flotilla::bench::ps::{self as ps_bench, PsBenchArgs, PsBenchShardArgs};
use flotilla::cli::{ConfigArgs, DefaultConfig, TrainArgs};
use flotilla::collective::preemption::{is_preemption, PREEMPTED_EXIT_CODE};
use flotilla::config::{process_env, JobConfig, Strategy};
use flotilla::data::ctr::{write_click_log, write_synthetic, CriteoSynth, Split};
use flotilla::job::ps::serving as ps_serving;
use flotilla::job::ps::{ParameterServerJob, PsSummary};
use flotilla::job::serving::Weights;
use flotilla::job::{Refusal, RunOptions, RunOutcome, TrainingJob, REFUSAL_EXIT_CODE};
use flotilla::launch::{
    recover_in_place, supervise, ChildSpec, DeathWatch, LaunchArgs, LaunchPsArgs, OutputMode, ProcessFlags, RUN_DIR_VAR,
};
use flotilla::net::auth::Credentials;
use flotilla::telemetry::metrics::METRICS_FILE;
use flotilla::telemetry::summary_table;
use flotilla::telemetry::{LogFormat, LOG_FORMAT_VAR};

/// The default job, compiled in so `flotilla train` works from any directory.
const BUILT_IN: DefaultConfig = DefaultConfig {
    local_file: Some("config.toml"),
    toml: include_str!("../config.toml"),
    name: "<built-in config.toml>",
};

#[derive(Parser)]
#[command(
    name = "flotilla",
    version,
    about = "Distributed deep-learning training: parameter server, collective, pipeline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written: text, or one JSON object a line. Processes this one starts
    /// write theirs alike.
    #[arg(long, global = true, value_enum, env = LOG_FORMAT_VAR, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Train a job: a simulated cluster in this process, or one rank when
    /// started by `flotilla launch`.
    Train(TrainArgs),
    /// Run one role of a launched job (what `flotilla launch` starts).
    Run {
        /// The role of this process.
        #[arg(long, value_enum)]
        role: Role,
        #[command(flatten)]
        train: TrainArgs,
    },
    /// Start this node's trainer processes (`paddle.distributed.launch`).
    Launch(LaunchArgs),
    /// Start the parameter servers and trainers of a parameter-server job (`launch_ps`).
    #[command(name = "launch-ps", alias = "launch_ps")]
    LaunchPs(LaunchPsArgs),
    /// Write data sets to files.
    #[command(subcommand)]
    Data(DataCommand),
    /// Benchmarks that print figures.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Plot a run's loss, throughput and communication ratio against step into RUN_DIR/report.png.
    Report {
        /// The run's directory (train's --run-dir), holding metrics.jsonl.
        run_dir: PathBuf,
        /// Where to write the PNG (default: RUN_DIR/report.png).
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Another run's directory, whose loss is drawn over this run's (the same job in
        /// another precision or layout, say).
        #[arg(long)]
        compare: Option<PathBuf>,
    },
    /// Print the Kubernetes manifests of a job (JSON, a `List` for `kubectl apply -f`): a
    /// headless Service, its config as a ConfigMap, checkpoint volumes and its pods, as
    /// Indexed Jobs or a training operator's PyTorchJob / PaddleJob. The cluster token comes
    /// from the Secret NAME-token (key `token`), which you create. Failed pods are retried up
    /// to the job's `fault_tolerance.max_restarts` (default 0: a lost pod fails the job): the
    /// Indexed Job's and the PyTorchJob's backoffLimit; a PaddleJob's pods restart in place
    /// (restartPolicy OnFailure) when it is above 0. The pods meet Pod Security's `restricted`
    /// profile (uid 10001, read-only root file system). A GPU job prints in any build.
    K8s {
        #[command(flatten)]
        job: ConfigArgs,
        #[command(flatten)]
        options: flotilla::k8s::K8sOptions,
    },
    /// Check a job's config, endpoints, ports, peers, clock and GPU libraries before launching it.
    Doctor(DoctorArgs),
    /// Work with checkpoints.
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Work with the models of parameter-server runs.
    #[command(subcommand)]
    Ps(PsCommand),
    /// Predict with a trained model. A model file (a run's `params.safetensors`) predicts the
    /// rows of CSV or Parquet tables: writes a CSV of each row's class and logits
    /// (`class,logit_0,…`) or values (`prediction`), and prints the counts as JSON. An exported CTR model (`flotilla ps
    /// export`, a directory) scores Criteo-layout click logs: writes `label<TAB>click
    /// probability` per record and prints the count and AUC as JSON.
    Predict {
        /// A model file, or a CTR export (a base, or a delta whose base is where it was made
        /// from).
        #[arg(long)]
        model: PathBuf,
        /// CSV tables with a header row, Parquet files (`.parquet`, `.pq`), or named arrays
        /// (`.safetensors`, `.npz`, directories of `.npy`) for a model file; click logs in the
        /// columns the job trained on (Criteo TSV, or its `[train.click_log]`: TSV, CSV or
        /// Parquet; text plain or `.gz`) for a CTR export; read in this order.
        #[arg(long, required = true, num_args = 1..)]
        data: Vec<PathBuf>,
        /// Where to write the scores.
        #[arg(long)]
        out: PathBuf,
    },
    /// Continue a prompt with a trained character-level GPT and write the text to stdout: the
    /// prompt, then --tokens characters, each the most likely one (greedy, --temperature 0,
    /// the default) or drawn at --temperature among the --top-k most likely, --seed making a
    /// draw reproducible.
    Generate(flotilla::job::generation::GenerateArgs),
    /// Work with the timelines of `train --trace DIR`.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Print a job's resolved config as TOML (its file, the environment and `--set` applied),
    /// or with `--defaults` every key at its default.
    Config {
        #[command(flatten)]
        job: ConfigArgs,
        /// Every key at its default value, whatever the files and the environment say, each under
        /// its documentation and the PaddlePaddle name it matches.
        #[arg(long)]
        defaults: bool,
        /// The reference of every key (type, default, Paddle name, what it does) as Markdown:
        /// the text of docs/config.md.
        #[arg(long, conflicts_with = "defaults")]
        reference: bool,
    },
    /// Print the shell completion script of `flotilla` for SHELL (e.g. `flotilla completions
    /// bash > /etc/bash_completion.d/flotilla`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Score a job's held-out split with trained parameters, as the job's final evaluation
    /// does, and print the figures as JSON.
    Eval {
        /// The job (its run directory's config.toml describes the model and data it trained).
        #[command(flatten)]
        job: ConfigArgs,
        /// A model file (a run's `params.safetensors`).
        #[arg(long, required_unless_present = "checkpoint", conflicts_with = "checkpoint")]
        params: Option<PathBuf>,
        /// A checkpoint of any layout: a step directory, or a checkpoint directory (its newest
        /// complete checkpoint).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum PsCommand {
    /// Write the model a parameter-server run ended with — dense parameters as safetensors,
    /// each sparse table as a rows file, a manifest with checksums — for serving; with
    /// `--since`, only the rows changed since that earlier export (a delta).
    Export {
        /// The run's directory (holding config.toml and ps-shard-<i>.safetensors).
        run_dir: PathBuf,
        /// The export's directory.
        #[arg(long)]
        out: PathBuf,
        /// An earlier export of the same model: write a delta against it.
        #[arg(long)]
        since: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// What a checkpoint holds: its step, the layout that wrote it, every file's tensors and
    /// a shard's rows per table, each file checked against the manifest's size and checksum.
    Inspect {
        /// A step directory (`step-NNNNNNNN`), or a checkpoint directory: its newest intact
        /// checkpoint.
        dir: PathBuf,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Merge the ranks' `rank-N.json` timelines onto the coordinator's clock, one track per
    /// rank (for Perfetto or chrome://tracing).
    Merge {
        /// The directory given to `--trace`.
        dir: PathBuf,
        /// The merged trace (default: DIR/trace.json).
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Role {
    /// A trainer: a data-parallel rank, a pipeline stage, or a parameter-server job's trainer.
    Trainer,
    /// A parameter-server shard.
    Pserver,
    /// The coordinator of a job of any strategy, as a process of its own.
    Coordinator,
}

#[derive(clap::Args)]
struct DoctorArgs {
    #[command(flatten)]
    job: ConfigArgs,
    #[command(flatten)]
    checks: flotilla::doctor::DoctorOptions,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Generate Criteo-shaped click logs (the `criteo_synthetic` data set) as Criteo TSV.
    CriteoSynthetic {
        /// Samples to write.
        #[arg(long)]
        samples: u64,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Write the held-out split instead of the training split.
        #[arg(long)]
        test: bool,
        /// The generator's seed (`train.seed`).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Largest slot vocabulary (`train.synthetic_vocab`).
        #[arg(long, default_value_t = 100_000)]
        vocab: usize,
    },
    /// Generate click logs in the columns and format of a job's `[train.click_log]` (or
    /// Criteo's): the generator's records with its planted click model, seeded by `train.seed`,
    /// vocabularies bounded by `train.synthetic_vocab`.
    ClickLog {
        /// The job whose click-log columns to write.
        #[command(flatten)]
        job: ConfigArgs,
        /// Samples to write.
        #[arg(long)]
        samples: u64,
        /// Output file (`.parquet`, `.csv`, else TSV; `.gz` compresses text).
        #[arg(long)]
        out: PathBuf,
        /// Write the held-out split instead of the training split.
        #[arg(long)]
        test: bool,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Ring all-reduce between processes: on loopback, or this node's part of several nodes.
    Allreduce {
        /// Processes (on this node).
        #[arg(long, default_value_t = 2)]
        nproc: usize,
        #[command(flatten)]
        nodes: allreduce::NodeFlags,
        #[command(flatten)]
        args: AllReduceArgs,
    },
    /// One rank of `bench allreduce` (started by it).
    #[command(hide = true)]
    AllreduceRank(AllReduceArgs),
    /// Checkpoint save and restore throughput against the disk's sequential write speed (dd).
    Checkpoint(CheckpointBenchArgs),
    /// Pull and push throughput against parameter-server shard processes on loopback.
    Ps(PsBenchArgs),
    /// The measured bubble of a pipeline schedule against the theory, with equal stages.
    Pipeline(PipelineBenchArgs),
    /// One shard of `bench ps` (started by it).
    #[command(hide = true)]
    PsShard(PsBenchShardArgs),
}

fn main() -> ExitCode {
    keep_freed_buffers();
    let cli = Cli::parse();
    // Logging reads it, and the processes a launcher starts inherit it. No other thread exists
    // yet.
    std::env::set_var(LOG_FORMAT_VAR, format!("{:?}", cli.log_format).to_lowercase());
    flotilla::telemetry::init_logging();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed stderr must not turn the error into a panic.
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            flotilla::job::run_dir::discard_unused();
            if e.chain().any(|cause| cause.is::<Refusal>()) {
                ExitCode::from(REFUSAL_EXIT_CODE)
            } else if is_preemption(&e) {
                ExitCode::from(PREEMPTED_EXIT_CODE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => train(&args),
        Command::Run { role, train: args } => run_role(role, &args),
        Command::Launch(args) => launch_command(args),
        Command::LaunchPs(args) => launch_ps(args),
        Command::Data(data) => data_command(data),
        Command::Bench(bench) => bench_command(bench),
        Command::Report { run_dir, out, compare } => {
            let out = out.unwrap_or_else(|| run_dir.join("report.png"));
            flotilla::telemetry::report::render(&run_dir, &out, compare.as_deref())?;
            print_out(&format!("wrote {}\n", out.display()));
            Ok(())
        }
        Command::Ps(PsCommand::Export { run_dir, out, since }) => {
            let manifest = ps_serving::export(&run_dir, &out, since.as_deref(), None)
                .with_context(|| format!("exporting {} to {}", run_dir.display(), out.display()))?;
            print_out(&(serde_json::to_string(&manifest.tables)? + "\n"));
            Ok(())
        }
        Command::Predict { model, data, out } => predict_command(&model, &data, &out),
        Command::Generate(args) => flotilla::job::generation::generate(&args, &mut std::io::stdout().lock()),
        Command::Config {
            job,
            defaults,
            reference,
        } => config_command(&job, defaults, reference),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "flotilla", &mut script);
            print_out(&String::from_utf8_lossy(&script));
            Ok(())
        }
        Command::Eval {
            job,
            params,
            checkpoint,
        } => eval_command(&job, params, checkpoint),
        Command::Checkpoint(CheckpointCommand::Inspect { dir, json }) => {
            let inspection = flotilla::checkpoint::inspect::inspect(&dir)?;
            let text = match json {
                true => serde_json::to_string_pretty(&inspection)? + "\n",
                false => flotilla::checkpoint::inspect::render(&inspection),
            };
            print_out(&text);
            Ok(())
        }
        Command::Trace(TraceCommand::Merge { dir, out }) => {
            let out = out.unwrap_or_else(|| dir.join("trace.json"));
            flotilla::telemetry::timeline::write_merged(&dir, &out)?;
            print_out(&format!("merged trace: {}\n", out.display()));
            Ok(())
        }
        Command::K8s { job, options } => {
            let config = flotilla::k8s::job_config(&job, &process_env, &BUILT_IN)?;
            let manifests = flotilla::k8s::manifests(&config, &options)?;
            print_out(&format!("{}\n", serde_json::to_string_pretty(&manifests)?));
            Ok(())
        }
        Command::Doctor(args) => flotilla::doctor::run(&args.checks, load_config(&args.job)),
    }
}

/// `flotilla launch`: this node's ranks (or a parameter-server job's roles), supervised.
fn launch_command(args: LaunchArgs) -> Result<()> {
    if let Some(ps) = args.parameter_servers()? {
        return launch_ps(ps);
    }
    let train = launched_train(&args.command)?;
    let args = args
        .placed_by_engine(&process_env)?
        .with_nproc_of(|| train.as_ref().map(|t| t.load_config(&process_env, &BUILT_IN)))
        .with_ports_chosen()?;
    let exe = std::env::current_exe().context("locating the flotilla binary")?;
    let mut children = args.plan(exe)?;
    let config = launched_config(train.as_ref(), &children)?;
    if config.as_ref().is_some_and(JobConfig::recovers_in_place) {
        args.recover_in_place(&mut children)?;
    }
    launch(children, train, config, &args.processes)
}

/// `flotilla data …`: generated click logs written to a file.
fn data_command(command: DataCommand) -> Result<()> {
    match command {
        DataCommand::CriteoSynthetic {
            samples,
            out,
            test,
            seed,
            vocab,
        } => {
            let split = if test { Split::Test } else { Split::Train };
            write_synthetic(&out, &CriteoSynth::new(seed, vocab), split, 0..samples)?;
            print_out(&format!("wrote {samples} samples to {}\n", out.display()));
            Ok(())
        }
        DataCommand::ClickLog {
            job,
            samples,
            out,
            test,
        } => {
            let config = job.load(&process_env, &BUILT_IN)?;
            let train = &config.train;
            let schema = train.click_log_schema().with_context(|| {
                format!(
                    "the job reads no click logs (train.dataset = {:?}): give it [train.click_log] and dataset = \"click_log\"",
                    train.dataset
                )
            })?;
            let split = if test { Split::Test } else { Split::Train };
            let synth = CriteoSynth::new(train.seed, train.synthetic_vocab);
            write_click_log(&out, &schema, &synth, split, 0..samples)?;
            print_out(&format!("wrote {samples} samples to {}\n", out.display()));
            Ok(())
        }
    }
}

/// `flotilla bench …`: the benchmarks that print figures.
fn bench_command(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Allreduce { nproc, nodes, args } => allreduce::run(nproc, &nodes, &args),
        BenchCommand::AllreduceRank(args) => allreduce::run_rank(&args),
        BenchCommand::Checkpoint(args) => checkpoint_bench::run(&args),
        BenchCommand::Ps(args) => ps_bench::run(&args),
        BenchCommand::Pipeline(args) => pipeline_bench::run(&args),
        BenchCommand::PsShard(args) => {
            one_allocator_arena();
            ps_bench::run_shard(&args)
        }
    }
}

/// `flotilla predict`: a model file's predictions of tables, or a CTR export's click
/// probabilities of click logs.
fn predict_command(model: &Path, data: &[PathBuf], out: &Path) -> Result<()> {
    if !model.exists() {
        bail!("--model {}: no such file or directory", model.display())
    }
    if model.is_file() {
        let data: Vec<String> = data.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        let predictions = flotilla::job::serving::predict(model, &data, out)
            .with_context(|| format!("predicting with {}", model.display()))?;
        print_out(&(serde_json::to_string(&predictions)? + "\n"));
        return Ok(());
    }
    let prediction = ps_serving::predict(model, data, out, None)
        .with_context(|| format!("scoring with the model in {}", model.display()))?;
    print_out(&(serde_json::to_string(&prediction)? + "\n"));
    Ok(())
}

/// `flotilla config`: the job's resolved config, the commented defaults, or the reference.
fn config_command(job: &ConfigArgs, defaults: bool, reference: bool) -> Result<()> {
    let text = match (defaults, reference) {
        (_, true) => flotilla::config::reference::markdown(),
        (true, false) => flotilla::config::reference::commented_defaults(),
        (false, false) => load_config(job)?.to_toml_string()?,
    };
    print_out(&text);
    Ok(())
}

/// `flotilla eval`: the held-out score of a model file's or a checkpoint's parameters.
fn eval_command(job: &ConfigArgs, params: Option<PathBuf>, checkpoint: Option<PathBuf>) -> Result<()> {
    let weights = match (params, checkpoint) {
        (Some(file), _) => Weights::ModelFile(file),
        (None, Some(dir)) => Weights::Checkpoint(dir),
        (None, None) => anyhow::bail!("give --params FILE or --checkpoint DIR"),
    };
    let evaluation = flotilla::job::serving::evaluate(load_config(job)?, &weights)?;
    print_out(&(serde_json::to_string(&evaluation)? + "\n"));
    Ok(())
}

fn load_config(args: &ConfigArgs) -> Result<JobConfig> {
    args.load(&process_env, &BUILT_IN)
}

/// `train [ARGS]` after a launcher's `--`, parsed as the processes will parse it.
#[derive(Parser)]
struct LaunchedTrain {
    #[command(flatten)]
    args: TrainArgs,
}

/// Runs a launcher's processes. Unless told otherwise, they all write into one default run
/// directory, chosen here once: the ranks that write a job's outputs (rank 0's summary, the
/// reporting rank's metrics) and every restart of the job then agree on it. The run directory
/// is claimed here for the job, as `train` claims it, and held until the launcher ends: the
/// processes (and their restarts), of the same job, join the claim.
fn launch(
    mut children: Vec<ChildSpec>,
    train: Option<TrainArgs>,
    config: Option<JobConfig>,
    flags: &ProcessFlags,
) -> Result<()> {
    // `--max_restarts`, else the job's `fault_tolerance.max_restarts`; none for a program of
    // the user's own.
    let restarts = flags
        .max_restarts
        .or(config.as_ref().map(|c| c.fault_tolerance.max_restarts))
        .unwrap_or(0);
    let death_watch = match &config {
        Some(config) if children.iter().any(|c| c.restart_alone) => Some(death_watch(config)?),
        _ => None,
    };
    // flotilla's own trainer only: a program of the user's own keeps its outputs itself.
    // Held until the launcher ends, past every restart of its processes.
    let _claim = match (&train, &config) {
        (Some(args), Some(config)) => {
            let (run_dir, claim) = args.claim(config.cluster.job_id.as_deref())?;
            if args.resume.is_none() && args.run_dir.is_none() {
                for child in &mut children {
                    child.env.push((RUN_DIR_VAR.to_string(), run_dir.display().to_string()));
                }
            }
            Some(claim)
        }
        _ => None,
    };
    let grace = std::time::Duration::from_secs(flags.stop_grace_s);
    supervise(children, OutputMode::Prefixed, restarts, death_watch, grace)
}

/// `flotilla launch-ps`, or `flotilla launch --run_mode ps`: this node's servers and trainers.
fn launch_ps(args: LaunchPsArgs) -> Result<()> {
    let args = args.with_ports_chosen()?;
    let exe = std::env::current_exe().context("locating the flotilla binary")?;
    let train = launched_train(&args.command)?;
    let mut children = args.plan(exe)?;
    let config = launched_config(train.as_ref(), &children)?;
    if let Some(config) = config.as_ref().filter(|c| c.recovers_in_place()) {
        let coordinator = args.hosts_coordinator()?.then_some(config.roles());
        recover_in_place(&mut children, coordinator);
    }
    launch(children, train, config, &args.processes)
}

/// Watches the coordinator of `config`'s job for processes it declares dead.
fn death_watch(config: &JobConfig) -> Result<DeathWatch> {
    let ft = &config.fault_tolerance;
    let master = config
        .cluster
        .master
        .clone()
        .context("cluster.master: the launcher's processes have no coordinator address")?;
    let credentials = Credentials::of_cluster(&config.cluster, ft.timeout())?;
    DeathWatch::start(
        master,
        credentials,
        ft.heartbeat_interval(),
        ft.heartbeat_deadline(),
        ft.coordinator_hang_limit(),
        config.cluster.max_frame_bytes(),
    )
}

/// The arguments of a launcher's `train` command, when it runs flotilla's trainer.
fn launched_train(command: &[String]) -> Result<Option<TrainArgs>> {
    match command.split_first() {
        Some((train, rest)) if train == "train" => {
            let args = LaunchedTrain::try_parse_from(command.iter().map(String::as_str))
                .with_context(|| format!("the command after `--`: train {}", rest.join(" ")))?
                .args;
            Ok(Some(args))
        }
        _ => Ok(None),
    }
}

/// The job a launcher's processes run, when they run flotilla's trainer: its config read as a
/// trainer process will read it, so a bad one fails here, before anything starts.
fn launched_config(train: Option<&TrainArgs>, children: &[ChildSpec]) -> Result<Option<JobConfig>> {
    let (Some(args), Some(trainer)) = (train, children.last()) else {
        return Ok(None);
    };
    let env = |key: &str| {
        trainer
            .env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .or_else(|| process_env(key))
    };
    args.load_config(&env, &BUILT_IN).map(Some)
}

/// One role of a launched job; the environment says which rank or shard: a launcher's (ours,
/// Paddle's, torchrun's), or a cluster engine's that started every rank itself (`srun`,
/// `mpirun`), read as torchrun's.
fn run_role(role: Role, args: &TrainArgs) -> Result<()> {
    let env = flotilla::config::placement::launched_env()?;
    let config = args.load_config(&env, &BUILT_IN)?;
    let options = args.options(&config)?;
    match (role, config.resolved_strategy()) {
        (Role::Coordinator, _) => flotilla::job::run_coordinator(&config, &options),
        (Role::Pserver, Strategy::ParameterServer) => {
            one_allocator_arena();
            let job = ParameterServerJob::builtin(config)?;
            job.run_server(flotilla::job::ps::shard_index_from_env(&job.config)?, &options)
        }
        (Role::Pserver, _) => bail!(
            "--role pserver: {} is not a parameter-server job (cluster.server_num = 0); start it with `flotilla launch-ps`",
            config.source_name
        ),
        (Role::Trainer, strategy) => {
            let rank = flotilla::config::placement::rank(&env)?.ok_or_else(|| {
                anyhow::anyhow!("`run --role trainer` needs its rank: PADDLE_TRAINER_ID or RANK (and the rest of a launcher's environment), or an engine's (srun, mpirun); use `flotilla launch` or `launch-ps`, or `flotilla train` for an in-process job")
            })?;
            if strategy == Strategy::ParameterServer {
                flotilla::job::torchrun::refuse_parameter_servers(&config, &env).map_err(Refusal::wrap)?;
                let summary = ParameterServerJob::builtin(config)?.run_trainer(rank, &options)?;
                print_ps_summary(summary.as_ref(), &options)?;
            } else {
                let mut config = config;
                flotilla::job::torchrun::meet_coordinator(&mut config, rank, &env)?;
                let outcome = TrainingJob::builtin(config)?.run_rank(rank, &options)?;
                print_collective_summary(outcome.as_ref(), &options)?;
            }
            Ok(())
        }
    }
}

fn print_ps_summary(summary: Option<&PsSummary>, options: &RunOptions) -> Result<()> {
    if let Some(s) = summary {
        let title = format!(
            "parameter-server ({}) {} × {} servers, {} trainers",
            s.mode, s.cluster, s.servers, s.trainers
        );
        print_summary(&title, s, options)?;
    }
    Ok(())
}

fn print_collective_summary(outcome: Option<&RunOutcome>, options: &RunOptions) -> Result<()> {
    if let Some(outcome) = outcome {
        let s = &outcome.summary;
        print_summary(&format!("{} {} × {}", s.strategy, s.cluster, s.world_size), s, options)?;
    }
    Ok(())
}

/// The summary's table, then where its files are.
fn print_summary(title: &str, summary: &impl serde::Serialize, options: &RunOptions) -> Result<()> {
    print_out(&format!(
        "{}summary: {}\nmetrics: {} (plot them: flotilla report {})\n",
        summary_table::render(title, summary)?,
        options.run_dir.join("summary.json").display(),
        options.run_dir.join(METRICS_FILE).display(),
        options.run_dir.display()
    ));
    Ok(())
}

/// Writes `text` to stdout; a closed stdout (`| head`) must not fail or kill the process.
fn print_out(text: &str) {
    let _ = std::io::stdout().write_all(text.as_bytes());
}

/// `flotilla train`: the whole job in this process, or the role a launcher's environment names.
fn train(args: &TrainArgs) -> Result<()> {
    let config = args.load_config(&process_env, &BUILT_IN)?;
    let options = args.prepare(&config)?;
    if config.resolved_strategy() == Strategy::ParameterServer {
        let summary = ParameterServerJob::builtin(config)?.run(&options)?;
        print_ps_summary(summary.as_ref(), &options)?;
    } else {
        let outcome = TrainingJob::builtin(config)?.run(&options)?;
        print_collective_summary(outcome.as_ref(), &options)?;
    }
    Ok(())
}

/// Every training step allocates and frees the same large buffers (frames of pulled rows,
/// gradients). glibc returns such buffers to the kernel on free and faults them in again on the
/// next allocation, which measured as a third of a 25 MB pull; keeping freed memory for reuse
/// (as PyTorch's caching allocator does) made pulls and pushes 2.2× faster (`bench ps`). Set
/// `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` to choose otherwise.
fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() && std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_none() {
        // SAFETY: mallopt only adjusts allocator parameters; called before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

/// A parameter server's actor thread allocates every answer and its I/O thread frees it. glibc
/// gives such a thread an arena of its own, whose emptied heaps go back to the kernel whatever
/// the trim threshold, so every answer faulted its pages in again; in the one main arena freed
/// memory is kept (above): one-shard pulls of 100 000 × 64 rows went from 1.0 to 1.6 GB/s
/// (`bench ps`). A server has no compute threads to contend for the arena's lock. Set
/// `MALLOC_ARENA_MAX` to choose otherwise.
fn one_allocator_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only adjusts allocator parameters; called before the server's threads
        // start, and arenas already made are left as they are.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}
