//! The command line of a training program: `flotilla train`'s flags (`--config`, `--set`,
//! `--run-dir`, `--overwrite`, `--trace`, `--metrics-port`, `--resume`, `--log-format`), which
//! a program of one's own gets from one call, [`standard_command_line`].

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;

use crate::config::{placement, process_env, JobConfig};
use crate::job::run_dir::{self, Claim, LeftOutputs};
use crate::job::torchrun::agent_may_restart;
use crate::job::{resumed_config, Refusal, Resume, RunOptions, RESUME_VAR};
use crate::launch::{thread_env, RUN_DIR_VAR};
use crate::net::auth::generate_job_id;
use crate::telemetry::monitor::ProgressView;
use crate::telemetry::{init_logging, LogFormat, LOG_FORMAT_VAR};

/// Where default run directories are made.
pub const RUNS: &str = "runs";

/// The config a program falls back on without `--config`.
#[derive(Debug, Clone, Copy)]
pub struct DefaultConfig<'a> {
    /// A file in the working directory that, where it exists, is the default instead of `toml`.
    pub local_file: Option<&'a str>,
    /// Its TOML text.
    pub toml: &'a str,
    /// What errors call it.
    pub name: &'a str,
}

/// Where a job's config comes from.
#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// The job's TOML file (default: the program's own config; `flotilla` reads ./config.toml,
    /// else its built-in job).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a key: `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl ConfigArgs {
    /// The job's config: `--config`'s file, else `default`, with the environment `env` and the
    /// `--set` overrides applied.
    pub fn load(&self, env: &dyn Fn(&str) -> Option<String>, default: &DefaultConfig) -> Result<JobConfig> {
        let local = default
            .local_file
            .map(std::path::Path::new)
            .filter(|file| file.exists());
        match self.config.as_deref().or(local) {
            Some(path) => JobConfig::from_file(path, env, &self.overrides),
            None => JobConfig::from_toml_str(default.toml, default.name, env, &self.overrides),
        }
        .map_err(Into::into)
    }
}

/// The flags of a process that trains.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub job: ConfigArgs,
    /// The run's directory: its config.toml, metrics.jsonl, params.safetensors, summary.json
    /// and, by default, its checkpoints (default: $FLOTILLA_RUN_DIR, which a launcher sets for
    /// all its processes, else a new `runs/<UTC date>-<time>-<pid>`). Claimed for the job
    /// (`cluster.job_id`) as it starts: one another job runs in is refused, and one that holds
    /// another job's files unless --overwrite.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Write into a run directory (--run-dir, $FLOTILLA_RUN_DIR) that already holds another
    /// run's files; never into one another run is writing.
    #[arg(long)]
    pub overwrite: bool,
    /// Write every rank's timeline (data, forward, backward, all-reduce buckets, waits,
    /// pipeline sends and receives, pulls and pushes) into this directory as `rank-N.json`
    /// chrome traces; an in-process job also merges them into `trace.json`, a launched one
    /// with `flotilla trace merge DIR`. Open them in Perfetto or chrome://tracing.
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Serve the reporting rank's per-step figures for Prometheus at
    /// `http://ADDRESS:PORT/metrics`: a bare PORT listens on 127.0.0.1 only (the endpoint has
    /// no authentication); `0.0.0.0:PORT` lets another machine scrape it.
    #[arg(long = "metrics-port", value_name = "[ADDRESS:]PORT", value_parser = crate::telemetry::exporter::parse_listen_address)]
    pub metrics_address: Option<std::net::SocketAddr>,
    /// Continue the stopped run in this run directory, with the config.toml it wrote (`--set`
    /// may change only how long and how it runs), from the newest intact checkpoint of its
    /// `fault_tolerance.checkpoint_dir`; its outputs go on being written there.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["run_dir", "config"])]
    pub resume: Option<PathBuf>,
}

impl TrainArgs {
    /// The config of a process that trains: the resumed run's own, else as
    /// [`ConfigArgs::load`]. An error is a refusal: no restart can change it.
    pub fn load_config(&self, env: &dyn Fn(&str) -> Option<String>, default: &DefaultConfig) -> Result<JobConfig> {
        match &self.resume {
            Some(dir) => resumed_config(dir, env, &self.job.overrides),
            None => self.job.load(env, default),
        }
        .map_err(Refusal::wrap)
    }

    /// Where a launched process of the job `config` writes and starts, its run directory
    /// claimed for the job `cluster.job_id` until the process ends (as [`TrainArgs::claim`]).
    pub fn options(&self, config: &JobConfig) -> Result<RunOptions> {
        self.options_of_job(config, config.cluster.job_id.as_deref())
    }

    /// The run directory of these flags, claimed for the job `job` (its `cluster.job_id`; none
    /// for a launched job without one): a resumed run's own directory; else `--run-dir`, the
    /// launcher's directory or a new one. Another job's outputs there are refused unless
    /// `--overwrite` or `--resume`.
    pub fn claim(&self, job: Option<&str>) -> Result<(PathBuf, Claim)> {
        let dir = match (&self.resume, &self.run_dir, std::env::var_os(RUN_DIR_VAR)) {
            (Some(dir), _, _) | (None, Some(dir), _) => dir.clone(),
            (None, None, Some(dir)) => PathBuf::from(dir),
            (None, None, None) => run_dir::create_unique(RUNS.as_ref())?,
        };
        let left = match self.overwrite || self.resume.is_some() {
            true => LeftOutputs::WriteOver,
            false => LeftOutputs::Refuse,
        };
        let claim = run_dir::claim(&dir, job, left)?;
        Ok((dir, claim))
    }

    /// Where a process of the job `job` writes and starts: a resumed run in its own directory
    /// from its checkpoints; else in the directory [`TrainArgs::claim`] claims.
    fn options_of_job(&self, config: &JobConfig, job: Option<&str>) -> Result<RunOptions> {
        let (run_dir, claim) = self.claim(job)?;
        claim.hold_until_exit();
        let resume = match &self.resume {
            Some(_) => Resume::From(config.fault_tolerance.checkpoint_dir_of(&run_dir)),
            // A launcher restarting the job after a failure, or torchrun's agent, which may.
            None if std::env::var_os(RESUME_VAR).is_some() || agent_may_restart(&process_env) => Resume::IfAny,
            None => Resume::Fresh,
        };
        Ok(RunOptions {
            run_dir,
            progress: ProgressView::from_environment(),
            metrics_address: self.metrics_address,
            trace: self.trace.clone(),
            resume,
        })
    }

    /// Gets this process ready to train the job `config`: claims its run directory (a process
    /// no launcher started is a job of its own, with an id of its own unless `cluster.job_id`
    /// names one; a launched one joins the job its launcher claimed the directory for) and
    /// sizes the compute threads of the roles it will host. Call it before any other thread
    /// exists.
    pub fn prepare(&self, config: &JobConfig) -> Result<RunOptions> {
        let launched = placement::rank(&process_env)?.is_some() || std::env::var_os("TRAINING_ROLE").is_some();
        let job = match (&config.cluster.job_id, launched) {
            (None, false) => Some(generate_job_id()?),
            (id, _) => id.clone(),
        };
        let options = self.options_of_job(config, job.as_deref())?;
        if !launched {
            // Every role of the job shares this process's cores (a launcher sets this itself).
            let roles = config.world_size() + config.cluster.server_num;
            for (var, threads) in thread_env(roles) {
                // Before any thread exists and before the first tensor op sizes candle's pool.
                std::env::set_var(var, threads);
            }
        }
        Ok(options)
    }
}

/// A program's command line: `flotilla train`'s flags.
#[derive(Parser)]
struct ProgramCommandLine {
    #[command(flatten)]
    train: TrainArgs,
    /// How log lines are written: text, or one JSON object a line.
    #[arg(long, value_enum, env = LOG_FORMAT_VAR, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// The standard command line for a program of one's own, from one call at the top of `main`
/// (before any other thread exists): parses `flotilla train`'s flags, starts logging, and
/// gives the job's config — `--config`'s file or `default`, with the launcher's environment
/// and `--set` applied, or a resumed run's own — and where the run writes and starts, that run
/// directory claimed for the job until the process ends ([`TrainArgs::prepare`]). Prints the
/// usage and exits on `--help` or a flag it does not know, as any command line does.
pub fn standard_command_line(default: &DefaultConfig) -> Result<(JobConfig, RunOptions)> {
    let command_line = ProgramCommandLine::parse();
    std::env::set_var(LOG_FORMAT_VAR, format!("{:?}", command_line.log_format).to_lowercase());
    init_logging();
    let config = command_line.train.load_config(&process_env, default)?;
    let options = command_line.train.prepare(&config)?;
    Ok((config, options))
}
