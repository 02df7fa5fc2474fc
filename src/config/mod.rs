//! Job configuration: one TOML file with the sections `[cluster]`, `[strategy]`, `[train]` and
//! `[fault_tolerance]`, overridable by environment variables (Paddle launcher compatibility) and
//! by `--set section.key=value` command-line overrides.
//!
//! Precedence is file < environment < `--set`, and all three go through one path so that they
//! cannot disagree about parsing or validation:
//!
//! 1. the file is parsed into a [`toml::Table`];
//! 2. environment overrides are written into that table (see `env.rs`);
//! 3. `--set` overrides are written into that table (see `overrides.rs`);
//! 4. keys of strategies / fault-tolerance features that are not built yet are rejected with a
//!    "not supported yet" error instead of a generic "unknown field";
//! 5. the table is deserialized into [`JobConfig`] with `deny_unknown_fields` everywhere, through
//!    `serde_path_to_error` so that errors carry the dotted key path;
//! 6. the typed config is validated (ranges, cross-field contradictions, whether the model and
//!    data fit in this host's memory, and whether the roles fit its limits on threads, open
//!    files and memory maps).
//!
//! Every error is a [`ConfigError`] naming where the offending value came from (the file, the
//! environment variable, or `--set`) and the dotted key, e.g.
//! `config.toml: strategy.fuse_grad_size_in_MB: invalid type: string "x", expected f64`.

mod amp;
mod click_log;
mod cluster;
mod combination;
mod document;
mod env;
mod fault_tolerance;
mod footprint;
mod host_limits;
mod memory;
mod overrides;
mod pipeline;
pub mod placement;
mod provenance;
pub mod reference;
mod sharding;
mod sparse_tables;
mod strategy;
mod tensor_parallel;
mod train;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub(crate) use document::set_path;
use document::{display_path, load, parse_document, read_config_file};
use provenance::Provenance;

pub use click_log::{
    ClickLogFormat, ClickLogSchema, ColumnRef, ColumnRole, DenseTransform, SlotIds, SlotSpec, CRITEO_DENSE,
    CRITEO_SLOTS, SLOT_CODES,
};
pub(crate) use cluster::GPU_NOT_BUILT;
pub use cluster::{host_port, ClusterConfig, DeviceKind};
pub use fault_tolerance::{FaultToleranceConfig, RecoveryMode};
pub use memory::{BlockRef, GradientMergeConfigs, RecomputeConfigs};
pub use pipeline::{GridPlace, HybridConfigs, PipelineConfigs, ScheduleMode};
pub use sharding::{ShardingConfigs, ShardingStage};
pub use sparse_tables::SparseTableConfig;
pub use strategy::{AsyncConfigs, DistributedStrategy, PsMode, Strategy};
pub use train::{
    DatasetKind, GptShape, LossKind, LrScaling, LrSchedule, ModelKind, OptimizerKind, TrainConfig, TrainLength,
};

/// Source name to pass to [`JobConfig::from_toml_str`] when the text is not a file on disk (and
/// the source name of [`JobConfig::default`]), so errors still say where a value came from.
pub const DEFAULT_SOURCE_NAME: &str = "<built-in default>";

/// Source name of errors in `--set` overrides, and of values written by them.
const SET_SOURCE: &str = "--set";

/// Key shown for errors about the document root, which has no dotted name of its own.
const ROOT_KEY: &str = "(top level)";

/// The largest config file read: a job's settings take a few KiB, and a path to something
/// endless (`/dev/zero`, a pipe that never closes) must not be read into memory without bound.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Why a job configuration could not be loaded.
///
/// Kept to two variants so callers can print it as is: the message always names the source
/// (file, environment variable or `--set`) and the dotted key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value is malformed, of the wrong type, unknown, unsupported or contradicts another.
    #[error("{source_name}: {key}: {message}")]
    Invalid {
        /// Where the offending value came from: the config file name, `<built-in default>`,
        /// `environment`, `environment (VAR)` or `--set`.
        source_name: String,
        /// Dotted key (`strategy.fuse_grad_size_in_MB`, `cluster.endpoints[1]`), the environment
        /// variable, the `--set` text, or the line and column of a TOML syntax error.
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// The config file could not be read.
    #[error("{}: cannot read config file: {error}", path.display())]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error (shown in the message, so not chained as a `source`).
        error: std::io::Error,
    },
}

/// A validation failure before the source of the value is known; the loader turns it into a
/// [`ConfigError`] naming the file, variable or `--set` that supplied `key`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FieldError {
    key: String,
    message: String,
    /// Other keys whose values the error is as much about (a memory estimate sized by several):
    /// the one the user set last is named.
    also: Vec<String>,
}

impl FieldError {
    /// Error about the dotted `key`.
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
            also: Vec::new(),
        }
    }

    /// Error about the value `keys` make together: named, where the config was loaded, by the
    /// key among them the user set last (a `--set` value over the file's), else the first.
    pub(crate) fn among(keys: &[&str], message: impl Into<String>) -> Self {
        let (first, rest) = keys.split_first().map_or(("train", &[][..]), |(f, r)| (*f, r));
        Self {
            key: first.to_string(),
            message: message.into(),
            also: rest.iter().map(|key| key.to_string()).collect(),
        }
    }
}

/// Reads an environment variable of this process; pass `&process_env` to the loaders.
///
/// The loaders take the environment as a function so tests (and embedders) can supply a fake
/// one without mutating the real process environment. Variables that are not valid Unicode are
/// treated as unset.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The resolved configuration of one training job.
///
/// Built only through [`JobConfig::from_file`] / [`JobConfig::from_toml_str`] (or
/// [`JobConfig::default`]), so a value of this type has been validated. Serializes back to TOML
/// with [`JobConfig::to_toml_string`] so a launcher can hand the exact resolved config to its
/// child processes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    /// Topology: nodes, processes per node, endpoints.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// Distributed strategy knobs (gradient fusion, consistency checks).
    #[serde(default)]
    pub strategy: DistributedStrategy,
    /// Model, data and optimizer.
    #[serde(default)]
    pub train: TrainConfig,
    /// Timeouts of collectives and rendezvous.
    #[serde(default)]
    pub fault_tolerance: FaultToleranceConfig,
    /// Where this config was loaded from (file name or `<built-in default>`), for messages.
    #[serde(skip)]
    pub source_name: String,
}

impl Default for JobConfig {
    /// The built-in defaults, identical to loading an empty file.
    fn default() -> Self {
        Self {
            cluster: ClusterConfig::default(),
            strategy: DistributedStrategy::default(),
            train: TrainConfig::default(),
            fault_tolerance: FaultToleranceConfig::default(),
            source_name: DEFAULT_SOURCE_NAME.to_string(),
        }
    }
}

impl JobConfig {
    /// The job's strategy: parameter servers where the cluster has shards, else a pipeline where
    /// `strategy.pipeline` asks, else data parallelism.
    pub fn resolved_strategy(&self) -> Strategy {
        if self.cluster.is_parameter_server() {
            Strategy::ParameterServer
        } else if self.strategy.pipeline {
            Strategy::Pipeline
        } else {
            Strategy::DataParallel
        }
    }

    /// Loads `path`, applies environment overrides read through `env` and then the `--set`
    /// `overrides` (each `section.key=value`), and validates the result.
    pub fn from_file(
        path: &Path,
        env: &dyn Fn(&str) -> Option<String>,
        overrides: &[String],
    ) -> Result<JobConfig, ConfigError> {
        let text = read_config_file(path).map_err(|error| ConfigError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Self::from_toml_str(&text, &path.display().to_string(), env, overrides)
    }

    /// Like [`JobConfig::from_file`] for TOML text already in memory; `source_name` is what
    /// errors about values from the text are attributed to (use [`DEFAULT_SOURCE_NAME`] when
    /// there is no file).
    pub fn from_toml_str(
        text: &str,
        source_name: &str,
        env: &dyn Fn(&str) -> Option<String>,
        overrides: &[String],
    ) -> Result<JobConfig, ConfigError> {
        let table = parse_document(text, source_name)?;
        load(table, source_name, env, overrides)
    }

    /// This config with its relative file paths (the data files, the tables to start from, the
    /// checkpoint directory) made absolute against `cwd`, where they were meant: the copy a run
    /// keeps in its directory then means the same files wherever `eval`, `predict` or `--resume`
    /// are run from.
    pub fn with_paths_from(&self, cwd: &Path) -> JobConfig {
        let absolute = |path: &str| match Path::new(path).is_absolute() {
            true => path.to_string(),
            false => cwd.join(path).display().to_string(),
        };
        let mut config = self.clone();
        let train = &mut config.train;
        for files in [&mut train.train_files, &mut train.test_files] {
            for file in files.iter_mut() {
                *file = absolute(file);
            }
        }
        train.init_tables_from = train.init_tables_from.as_deref().map(absolute);
        let checkpoints = &mut config.fault_tolerance.checkpoint_dir;
        *checkpoints = checkpoints.as_ref().map(|dir| cwd.join(dir));
        config
    }

    /// Whether a launched run of this job recovers from a lost process in place
    /// (`fault_tolerance.recovery`, by default).
    pub fn recovers_in_place(&self) -> bool {
        self.fault_tolerance.recovery.unwrap_or(RecoveryMode::InPlace) == RecoveryMode::InPlace
    }

    /// The processes of the job the coordinator counts: the parameter servers, then the
    /// trainers (or ranks, or pipeline stages).
    pub fn roles(&self) -> usize {
        self.cluster.server_num + self.world_size()
    }

    /// What the coordinator calls role `role`: `server i` and `trainer t` in a
    /// parameter-server job (servers first), `rank r` otherwise.
    pub fn role_name(&self, role: usize) -> String {
        let servers = self.cluster.server_num;
        match (self.cluster.is_parameter_server(), role.checked_sub(servers)) {
            (false, _) => format!("rank {role}"),
            (true, None) => format!("server {role}"),
            (true, Some(trainer)) => format!("trainer {trainer}"),
        }
    }

    /// Every setting that is not a table, by dotted key (`train.lr`).
    pub fn leaves(&self) -> Result<std::collections::BTreeMap<String, toml::Value>, toml::ser::Error> {
        fn walk(prefix: &str, value: toml::Value, out: &mut std::collections::BTreeMap<String, toml::Value>) {
            match value {
                toml::Value::Table(table) => {
                    for (key, value) in table {
                        let key = if prefix.is_empty() {
                            key
                        } else {
                            format!("{prefix}.{key}")
                        };
                        walk(&key, value, out);
                    }
                }
                leaf => {
                    out.insert(prefix.to_string(), leaf);
                }
            }
        }
        let mut out = std::collections::BTreeMap::new();
        walk("", toml::Value::try_from(self)?, &mut out);
        Ok(out)
    }

    /// The settings every process of the job must share, as text by dotted key, for the
    /// coordinator to compare a joining process's against its own: all but the secret
    /// (`cluster.token`), which never travels.
    pub fn shared_settings(&self) -> std::collections::BTreeMap<String, String> {
        const OWN: &[&str] = &["cluster.token"];
        self.leaves()
            .unwrap_or_default()
            .into_iter()
            .filter(|(key, _)| !OWN.contains(&key.as_str()))
            .map(|(key, value)| (key, value.to_string()))
            .collect()
    }

    /// Whether the job is collective data parallelism alone (no pipeline, no parameter
    /// servers): every rank holds the whole replica.
    pub fn is_data_parallel(&self) -> bool {
        !self.cluster.is_parameter_server() && !self.strategy.pipeline
    }

    /// The memory the job takes on one node, estimated from the config: a lower bound of what
    /// it will use (no allocator or framework overhead).
    pub fn estimated_node_bytes(&self) -> u128 {
        footprint::node_bytes(self)
    }

    /// Held-out rows a rank (or a pipeline replica) scores in one pass: `train.eval_batch_size`,
    /// else a data-parallel replica's share of the training batch, so that evaluation holds no
    /// more activations than a training step (scoring hundreds of GPT windows at once held 15×).
    pub fn eval_batch_rows(&self) -> usize {
        let replicas = match self.strategy.pipeline {
            true => self.strategy.hybrid_configs.replicas(),
            false => self.data_parallel_replicas(),
        };
        let rows = self
            .train
            .eval_batch_size
            .unwrap_or_else(|| self.train.local_batch_size(replicas));
        rows.max(1)
    }

    /// The replicas a collective job's global batch is cut among before the strategy's checks:
    /// the ranks, or where `mp_degree` divides them, the layer groups.
    fn batch_replicas(&self) -> usize {
        match self.world_size().is_multiple_of(self.mp_degree()) {
            true => self.data_parallel_replicas(),
            false => self.world_size(),
        }
    }

    /// Number of trainer processes in the job (`cluster.nnodes × cluster.nproc_per_node`).
    pub fn world_size(&self) -> usize {
        self.cluster.world_size()
    }

    /// Serializes the resolved config back to TOML, e.g. to pass it to child processes, which
    /// load it with [`JobConfig::from_toml_str`]. The result loads to an equal `JobConfig`
    /// (given the same source name and no further overrides).
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        let mut out = String::new();
        serde_path_to_error::serialize(self, toml::Serializer::new(&mut out)).map_err(|err| ConfigError::Invalid {
            source_name: self.source_name.clone(),
            key: display_path(&err.path().to_string()),
            message: format!("cannot serialize to TOML: {}", err.inner()),
        })?;
        Ok(out)
    }

    /// Checks ranges and cross-field consistency; errors are attributed to `source_name`.
    ///
    /// The loaders already call this (with finer attribution to environment variables and
    /// `--set`); it is public for configs built or modified in code.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(|e| ConfigError::Invalid {
            source_name: self.source_name.clone(),
            key: e.key,
            message: e.message,
        })
    }

    /// Validation of every section; the first failure wins.
    fn check(&self) -> Result<(), FieldError> {
        self.cluster.check()?;
        host_limits::check(self, &host_limits::HostLimits::of_this_host())?;
        self.strategy.check()?;
        // The batch is cut among the data-parallel replicas (the layer groups, where layers are split).
        self.train.check(self.batch_replicas())?;
        self.fault_tolerance.check()?;
        combination::check(self)?;
        footprint::check(self, footprint::available_memory())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// An environment with no variables set.
    pub(crate) fn no_env(_: &str) -> Option<String> {
        None
    }

    /// Loads `text` as `config.toml` with no environment and no overrides.
    pub(crate) fn load_str(text: &str) -> Result<JobConfig, ConfigError> {
        JobConfig::from_toml_str(text, "config.toml", &no_env, &[])
    }

    /// Loads `text` as `config.toml` with a fake environment and `--set` overrides.
    pub(crate) fn load_with(text: &str, vars: &[(&str, &str)], sets: &[&str]) -> Result<JobConfig, ConfigError> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let env = move |name: &str| vars.get(name).cloned();
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        JobConfig::from_toml_str(text, "config.toml", &env, &sets)
    }

    /// The Display text of a failed load; panics if it succeeded.
    pub(crate) fn err_text(result: Result<JobConfig, ConfigError>) -> String {
        match result {
            Ok(config) => panic!("expected an error, got {config:?}"),
            Err(err) => err.to_string(),
        }
    }

    #[test]
    fn a_memory_refusal_names_the_key_the_user_set_among_those_that_size_it() {
        // Layers and the window size every activation: the file's batch is not to blame.
        let gpt = "[train]\nmodel = \"gpt\"\ndataset = \"text\"\nbatch_size = 32\n";
        for set in ["train.gpt.n_layer=100000000", "train.gpt.block_size=100000000"] {
            let err = JobConfig::from_toml_str(gpt, "job.toml", &no_env, &[set.to_string()]).unwrap_err();
            let key = set.split('=').next().unwrap_or_default();
            assert!(
                err.to_string()
                    .starts_with(&format!("--set: {key}: the job needs at least")),
                "{err}"
            );
        }
        let err = JobConfig::from_toml_str(
            "[train]\nhidden_sizes = [4000000000]\n",
            "job.toml",
            &no_env,
            &["train.batch_size=2".to_string()],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("job.toml: train.hidden_sizes: the job needs at least"),
            "a --set key that does not size the largest part is not named: {err}"
        );
    }

    #[test]
    fn empty_string_gives_the_defaults() {
        let config = JobConfig::from_toml_str("", DEFAULT_SOURCE_NAME, &no_env, &[]).unwrap();
        assert_eq!(config, JobConfig::default());
        assert_eq!(config.source_name, "<built-in default>");
        assert_eq!(config.cluster.nnodes, 1);
        assert_eq!(config.cluster.nproc_per_node, 2);
        assert_eq!(config.cluster.world_size, None);
        assert_eq!(config.cluster.device, DeviceKind::Cpu);
        assert_eq!(config.cluster.max_frame_mb, 1024);
        assert!(config.cluster.endpoints.is_empty());
        assert_eq!(config.world_size(), 2);
        assert_eq!(config.strategy.fuse_grad_size_in_mb, 32.0);
        assert_eq!(config.strategy.check_every, 10);
        assert_eq!(config.train.model, ModelKind::Mlp);
        assert_eq!(config.train.hidden_sizes(), vec![128]);
        assert_eq!(config.train.dataset, DatasetKind::Digits);
        assert_eq!(config.train.epochs, Some(20));
        assert_eq!(config.train.steps, None);
        assert_eq!(config.train.length(), TrainLength::Epochs(20));
        assert_eq!(config.train.batch_size, 64);
        assert_eq!(config.train.lr, 0.05);
        assert_eq!(config.train.lr_scaling, LrScaling::None);
        assert_eq!(config.train.optimizer, OptimizerKind::Sgd);
        assert_eq!(config.train.seed, 42);
        assert_eq!(config.fault_tolerance.timeout_s, 1800.0);
        config.validate().unwrap();
    }

    #[test]
    fn unknown_key_in_each_section_is_rejected_by_name() {
        for section in ["cluster", "strategy", "train", "fault_tolerance"] {
            let text = format!("[{section}]\nbogus_key = 1\n");
            let msg = err_text(load_str(&text));
            assert!(
                msg.starts_with(&format!("config.toml: {section}: unknown field `bogus_key`")),
                "{msg}"
            );
            assert!(msg.contains("expected"), "{msg}");
        }
        let msg = err_text(load_str("[bogus_section]\nx = 1\n"));
        assert!(
            msg.contains("unknown field `bogus_section`, expected one of `cluster`"),
            "{msg}"
        );
    }

    #[test]
    fn misspelled_strategy_key_lists_the_valid_ones() {
        let msg = err_text(load_str("[strategy]\nfuse_grad_size = 64\n"));
        assert!(
            msg.starts_with("config.toml: strategy: unknown field `fuse_grad_size`, expected"),
            "{msg}"
        );
        assert!(msg.contains("fuse_grad_size_in_MB"), "{msg}");
    }

    #[test]
    fn type_error_names_the_key() {
        let msg = err_text(load_str("[strategy]\nfuse_grad_size_in_MB = \"x\"\n"));
        assert_eq!(
            msg,
            "config.toml: strategy.fuse_grad_size_in_MB: invalid type: string \"x\", expected f64"
        );
        let msg = err_text(load_str("[train]\nhidden_sizes = [64, \"x\"]\n"));
        assert!(msg.starts_with("config.toml: train.hidden_sizes[1]: "), "{msg}");
        let msg = err_text(load_str("[cluster]\nnnodes = -1\n"));
        assert!(msg.starts_with("config.toml: cluster.nnodes: "), "{msg}");
    }

    #[test]
    fn syntax_error_names_file_and_position() {
        let msg = err_text(load_str("[train]\nlr = = 3\n"));
        assert!(msg.starts_with("config.toml: line 2, column "), "{msg}");
        assert!(msg.contains("invalid TOML"), "{msg}");
    }

    #[test]
    fn section_that_is_not_a_table_is_rejected() {
        let msg = err_text(load_str("train = 3\n"));
        assert!(msg.starts_with("config.toml: train: invalid type"), "{msg}");
    }

    #[test]
    fn round_trip_through_toml_gives_an_equal_config() {
        let text = r#"
            [cluster]
            nnodes = 2
            nproc_per_node = 2
            world_size = 4
            master = "127.0.0.1:6170"
            endpoints = ["127.0.0.1:6171", "127.0.0.1:6172", "127.0.0.1:6173", "127.0.0.1:6174"]
            [strategy]
            fuse_grad_size_in_MB = 0.5
            check_every = 0
            [train]
            hidden_sizes = [64, 32]
            dataset = "synthetic"
            steps = 100
            batch_size = 128
            lr_scaling = "sqrt"
            optimizer = "adamw"
            weight_decay = 0.01
            [fault_tolerance]
            timeout_s = 30.5
        "#;
        let config = load_str(text).unwrap();
        let serialized = config.to_toml_string().unwrap();
        let reloaded = load_str(&serialized).unwrap();
        assert_eq!(config, reloaded, "{serialized}");
        assert!(serialized.contains("fuse_grad_size_in_MB = 0.5"), "{serialized}");

        let default = JobConfig::default();
        let reloaded =
            JobConfig::from_toml_str(&default.to_toml_string().unwrap(), DEFAULT_SOURCE_NAME, &no_env, &[]).unwrap();
        assert_eq!(default, reloaded);
    }

    #[test]
    fn from_file_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.toml");
        std::fs::write(&path, "[train]\nlr = \"fast\"\n").unwrap();
        let msg = err_text(JobConfig::from_file(&path, &no_env, &[]));
        assert!(msg.starts_with(&format!("{}: train.lr: ", path.display())), "{msg}");

        std::fs::write(&path, "[train]\nlr = 0.1\n").unwrap();
        let config = JobConfig::from_file(&path, &no_env, &[]).unwrap();
        assert_eq!(config.train.lr, 0.1);
        assert_eq!(config.source_name, path.display().to_string());

        let missing = dir.path().join("missing.toml");
        let err = JobConfig::from_file(&missing, &no_env, &[]).unwrap_err();
        assert!(matches!(err, ConfigError::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("missing.toml"), "{err}");
    }

    #[test]
    fn a_config_file_is_read_up_to_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.toml");
        let comment = "#".repeat(MAX_CONFIG_BYTES as usize - 1);
        std::fs::write(&path, format!("{comment}\n")).unwrap();
        JobConfig::from_file(&path, &no_env, &[]).unwrap();
        std::fs::write(&path, format!("{comment}#\n")).unwrap();
        let msg = err_text(JobConfig::from_file(&path, &no_env, &[]));
        assert_eq!(
            msg,
            format!(
                "{}: cannot read config file: more than 1 MiB; a config file is at most that",
                path.display()
            )
        );
        let msg = err_text(JobConfig::from_file(Path::new("/dev/zero"), &no_env, &[]));
        assert!(
            msg.starts_with("/dev/zero: cannot read config file: more than 1 MiB"),
            "{msg}"
        );
    }

    #[test]
    fn a_trainer_count_from_the_launcher_outranks_the_files_layout() {
        let file = "[cluster]\nnproc_per_node = 2\n";
        let config = load_with(file, &[("PADDLE_TRAINERS_NUM", "4")], &[]).unwrap();
        assert_eq!((config.cluster.nnodes, config.cluster.nproc_per_node), (1, 4));
        let config = load_with(
            "[cluster]\nnnodes = 2\nnproc_per_node = 1\n",
            &[],
            &["cluster.world_size=4"],
        )
        .unwrap();
        assert_eq!((config.cluster.nnodes, config.cluster.nproc_per_node), (2, 2));
        let msg = err_text(load_with(
            file,
            &[("PADDLE_TRAINERS_NUM", "3"), ("PADDLE_LOCAL_SIZE", "2")],
            &[],
        ));
        assert!(msg.contains("cluster.world_size: 3 contradicts"), "{msg}");
        let msg = err_text(load_str("[cluster]\nnproc_per_node = 2\nworld_size = 3\n"));
        assert!(msg.contains("cluster.world_size: 3 contradicts"), "{msg}");
    }

    #[test]
    fn provenance_prefers_the_latest_write_at_or_above_a_key() {
        let mut p = Provenance::new("f.toml");
        p.record("cluster.world_size".into(), "env".into());
        p.record("cluster.endpoints".into(), "--set".into());
        assert_eq!(p.source_of("cluster.world_size"), "env");
        assert_eq!(p.source_of("cluster.endpoints[2]"), "--set");
        assert_eq!(p.source_of("cluster.nnodes"), "f.toml");
        assert_eq!(p.source_of("cluster.world_sizes"), "f.toml");
        assert_eq!(p.source_of("cluster"), "--set");
        p.record("cluster".into(), "late".into());
        assert_eq!(p.source_of("cluster.world_size"), "late");
    }
}
