//! The flotilla binary: `flotilla <command>`; `flotilla run --role …` runs
//! one role of a launched job.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use flotilla::bench::allreduce::{self, AllReduceArgs};
use flotilla::config::{process_env, JobConfig};
use flotilla::job::{RunOptions, TrainingJob};
use flotilla::launch::{supervise, LaunchArgs, OutputMode};

/// The default job, compiled in so `flotilla train` works from any directory.
const EMBEDDED_CONFIG: &str = include_str!("../config.toml");
const DEFAULT_CONFIG: &str = "config.toml";

#[derive(Parser)]
#[command(
    name = "flotilla",
    version,
    about = "Distributed deep-learning training: parameter server, collective, pipeline"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// Benchmarks that print figures.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Clone, Copy, ValueEnum)]
enum Role {
    /// A data-parallel trainer.
    Trainer,
    /// A parameter-server shard.
    Pserver,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// The job's TOML file (default: ./config.toml, else the built-in one).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key: `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Where rank 0 writes summary.json (default: runs/<unix time>).
    #[arg(long)]
    run_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Ring all-reduce between processes on loopback.
    Allreduce {
        /// Processes.
        #[arg(long, default_value_t = 2)]
        nproc: usize,
        #[command(flatten)]
        args: AllReduceArgs,
    },
    /// One rank of `bench allreduce` (started by it).
    #[command(hide = true)]
    AllreduceRank(AllReduceArgs),
}

fn main() -> ExitCode {
    flotilla::telemetry::init_logging();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => train(&args),
        Command::Run {
            role: Role::Trainer,
            train: args,
        } => {
            if std::env::var_os("PADDLE_TRAINER_ID").is_none() {
                bail!("`run --role trainer` needs PADDLE_TRAINER_ID (and the rest of the launcher's environment); use `flotilla launch`, or `flotilla train` for an in-process job");
            }
            train(&args)
        }
        Command::Run {
            role: Role::Pserver, ..
        } => bail!("--role pserver: the parameter-server strategy is not supported yet"),
        Command::Launch(args) => {
            let exe = std::env::current_exe().context("locating the flotilla binary")?;
            supervise(args.plan(exe)?, OutputMode::Prefixed)
        }
        Command::Bench(BenchCommand::Allreduce { nproc, args }) => allreduce::run(nproc, &args),
        Command::Bench(BenchCommand::AllreduceRank(args)) => allreduce::run_rank(&args),
    }
}

fn load_config(args: &TrainArgs) -> Result<JobConfig> {
    let config = match &args.config {
        Some(path) => JobConfig::from_file(path, &process_env, &args.overrides)?,
        None if std::path::Path::new(DEFAULT_CONFIG).exists() => {
            JobConfig::from_file(DEFAULT_CONFIG.as_ref(), &process_env, &args.overrides)?
        }
        None => JobConfig::from_toml_str(EMBEDDED_CONFIG, "<built-in config.toml>", &process_env, &args.overrides)?,
    };
    Ok(config)
}

fn train(args: &TrainArgs) -> Result<()> {
    let config = load_config(args)?;
    let run_dir = args.run_dir.clone().unwrap_or_else(default_run_dir);
    let options = RunOptions {
        run_dir: run_dir.clone(),
        show_progress: std::io::stderr().is_terminal(),
    };
    let job = TrainingJob::builtin(config)?;
    if let Some(outcome) = job.run(&options)? {
        let s = &outcome.summary;
        println!(
            "{} {} × {}: {} steps, final loss {:.4}, test accuracy {:.4}, {:.0} samples/s, comm {:.1}% of step time",
            s.strategy,
            s.cluster,
            s.world_size,
            s.steps,
            s.final_loss,
            s.test_accuracy,
            s.samples_per_sec,
            100.0 * s.comm_time_ratio
        );
        println!("summary: {}", run_dir.join("summary.json").display());
    }
    Ok(())
}

fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PathBuf::from("runs").join(secs.to_string())
}
