//! The library face: what a Paddle user writes with `fleet.init(strategy)`,
//! a flotilla user writes as a [`TrainingJob`] — a config (with its
//! `DistributedStrategy`), a model built from blocks, and a dataset — and
//! hands to [`TrainingJob::run`], which trains it in-process or as one rank
//! of a launched cluster. The built-in jobs take the same path.

mod control;
mod coordinator;
mod data_parallel;
mod distributed_model;
pub mod generation;
mod launched_rank;
mod outputs;
mod pipeline;
mod process_group;
pub mod ps;
mod resumed;
pub mod run_dir;
pub mod serving;
mod simulated;
pub mod torchrun;

pub(crate) use crate::actors::recovery::Recovery;
pub use crate::actors::recovery::{Resume, RESUME_VAR};
pub use crate::refusal::{Refusal, REFUSAL_EXIT_CODE};
pub use control::connect_control;
pub use coordinator::run_coordinator;
pub use distributed_model::{DistributedModel, Output};
pub use launched_rank::{coordinator_is_own_process, COORDINATOR_PROCESS_VAR};
pub use outputs::{write_params, RunOutcome, Summary, CONFIG_FILE};
pub use process_group::ProcessGroup;
pub use resumed::{resumed_config, SAFE_TO_CHANGE};
pub use simulated::{FaultPlan, FaultReport};

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};

use crate::actors::device::ModelFactory;
use crate::actors::rank_parts::RankParts;
use crate::actors::ring_link::RingLink;
use crate::actors::{DeviceActor, Trainer};
use crate::config::{DatasetKind, JobConfig, LossKind, ModelKind, Strategy, TrainConfig};
use crate::data::ctr::DataLayout;
use crate::data::table::{streamed_splits, table_splits, Columns, TableFormat};
use crate::data::text::TextCorpus;
use crate::data::{Dataset, RowSource};
use crate::models::export::ModelInfo;
use crate::models::{GptConfig, Model, ModelSpec, ParamInit};
use crate::net::ControlBus;
use crate::telemetry::clock::TraceOrigin;
use crate::telemetry::exporter::MetricLabels;
use crate::telemetry::monitor::{MonitorSettings, ProgressView};
use crate::telemetry::timeline::{self, TraceTarget};

/// (train, test) windows of the shipped text: the test part is the end of the text, so no
/// test window overlaps a training one; windows start every half window. Also the vocabulary:
/// token `i` is its `i`-th character.
fn text_windows(train: &crate::config::TrainConfig) -> Result<(Dataset, Dataset, String)> {
    let corpus = TextCorpus::around_the_world()?;
    let (train_tokens, test_tokens) = corpus.split(train.test_fraction).context("train.test_fraction")?;
    let block = train.gpt.block_size;
    let windows = |tokens: &[u32]| {
        Dataset::token_windows(tokens, block, block.div_ceil(2), corpus.vocab.len())
            .with_context(|| format!("train.gpt.block_size = {block}"))
    };
    Ok((
        windows(&train_tokens)?,
        windows(&test_tokens)?,
        corpus.vocab.iter().collect(),
    ))
}

/// Splits of rows held in memory.
fn in_memory((train, test): (Dataset, Dataset)) -> (RowSource, RowSource, usize) {
    // The held-out split's classes count those of both.
    let outputs = test.outputs;
    (train.into(), test.into(), outputs)
}

/// What a data set's targets are, in words.
fn kind_of(regression: bool) -> &'static str {
    if regression {
        "value"
    } else {
        "class"
    }
}

/// A [`Refusal`] saying `why` unless `holds`.
fn refuse_unless(holds: bool, why: impl FnOnce() -> String) -> Result<()> {
    match holds {
        true => Ok(()),
        false => Err(Refusal::wrap(anyhow::anyhow!(why()))),
    }
}

/// Where and how a run reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Directory for `summary.json`, `params.safetensors` and the resolved
    /// `config.toml` (written by rank 0), and the default checkpoint directory's parent.
    pub run_dir: PathBuf,
    /// Where the reporting rank's progress goes.
    pub progress: ProgressView,
    /// Serve the reporting rank's per-step figures for Prometheus at this address.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// Write each rank's chrome-trace timeline into this directory as `rank-N.json` (an
    /// in-process job also merges them into `trace.json`; `flotilla trace merge` merges a
    /// launched job's).
    pub trace: Option<PathBuf>,
    /// Where training starts: from step 0, or from a checkpoint.
    pub resume: Resume,
}

impl RunOptions {
    /// A fresh run writing to `run_dir`, reporting progress in log lines, without timeline.
    pub fn new(run_dir: impl Into<PathBuf>) -> Self {
        Self {
            run_dir: run_dir.into(),
            progress: ProgressView::Log,
            metrics_address: None,
            trace: None,
            resume: Resume::Fresh,
        }
    }

    /// How the reporting rank of `config`, `rank` in role `role`, reports.
    pub(crate) fn monitor(&self, config: &JobConfig, rank: usize, role: &'static str) -> MonitorSettings {
        let job = config.cluster.job_id.clone().unwrap_or_else(|| {
            let name = self.run_dir.file_name().unwrap_or_default();
            name.to_string_lossy().into_owned()
        });
        MonitorSettings {
            view: self.progress,
            run_dir: self.run_dir.clone(),
            metrics_address: self.metrics_address,
            labels: MetricLabels { job, rank, role },
        }
    }

    /// An in-process job's ranks share one clock: their timelines are merged at once into
    /// `DIR/trace.json`.
    pub(crate) fn merge_in_process_trace(&self) -> Result<()> {
        match &self.trace {
            Some(dir) => timeline::write_merged(dir, &dir.join("trace.json")),
            None => Ok(()),
        }
    }

    /// Where this process's ranks write their timelines, measured from now.
    pub(crate) fn trace_target(&self) -> Option<TraceTarget> {
        self.trace.as_ref().map(|dir| TraceTarget {
            dir: dir.clone(),
            origin: TraceOrigin::now(),
        })
    }
}

/// A model, its data and the config that says how to train it.
#[derive(Clone)]
pub struct TrainingJob {
    /// The validated job config.
    pub config: Arc<JobConfig>,
    /// Builds the model on each rank's device thread.
    pub model: ModelFactory,
    /// Training split.
    pub train_data: RowSource,
    /// Held-out split.
    pub test_data: RowSource,
    /// What the model file says besides the parameters: the built-in model's architecture
    /// (so the file alone rebuilds it), the loss, the feature columns of a CSV data set.
    pub export: ModelInfo,
}

impl TrainingJob {
    /// A job over a user's model and data. `train.loss`, when not given, is the data's:
    /// cross-entropy for classes, mean squared error for values; a loss of the other kind,
    /// splits of two kinds, or a global batch larger than the rows in memory are refused (a
    /// [`Refusal`]: no restart changes them).
    pub fn new(
        mut config: JobConfig,
        model: impl Fn(&ParamInit) -> Result<Model> + Send + Sync + 'static,
        train_data: impl Into<RowSource>,
        test_data: impl Into<RowSource>,
    ) -> Result<Self> {
        let (train_data, test_data): (RowSource, RowSource) = (train_data.into(), test_data.into());
        let regression = train_data.is_regression();
        refuse_unless(
            test_data.is_regression() == regression && test_data.dim() == train_data.dim(),
            || {
                format!(
                    "the held-out split is not shaped as the training split ({} and {} inputs per row, {} and {} targets)",
                    train_data.dim(),
                    test_data.dim(),
                    kind_of(regression),
                    kind_of(test_data.is_regression())
                )
            },
        )?;
        let loss = *config.train.loss.get_or_insert(if regression {
            LossKind::Mse
        } else {
            LossKind::CrossEntropy
        });
        refuse_unless(loss.is_regression() == regression, || {
            format!(
                "train.loss = \"{}\" does not fit a data set of {} targets",
                loss.name(),
                kind_of(regression)
            )
        })?;
        // Streamed parts are checked as they are cut; rows in memory can be counted now.
        let batch = config.train.batch_size;
        if let RowSource::InMemory(rows) = &train_data {
            refuse_unless(batch <= rows.len(), || {
                format!(
                    "train.batch_size = {batch}: the global batch is larger than the training split ({} rows)",
                    rows.len()
                )
            })?;
        }
        let export = ModelInfo {
            loss: Some(loss.name().to_string()),
            ..ModelInfo::default()
        };
        Ok(Self {
            config: Arc::new(config),
            model: Arc::new(model),
            train_data,
            test_data,
            export,
        })
    }

    /// The job `config.train` describes with the built-in models and data; what keeps it from
    /// being built (its data, its model's shape) is refused: no restart changes it.
    pub fn builtin(config: JobConfig) -> Result<Self> {
        Self::of_builtin_parts(config).map_err(Refusal::wrap)
    }

    fn of_builtin_parts(config: JobConfig) -> Result<Self> {
        let train = &config.train;
        // What a user of the model file needs besides the weights: the columns a table model
        // reads, the characters a language model's tokens stand for.
        let mut extra = std::collections::HashMap::new();
        // The rows, and the width of the model's output (classes, or values regressed).
        let (train_data, test_data, outputs) = match train.dataset {
            DatasetKind::Digits => in_memory(
                Dataset::digits()?
                    .split(train.test_fraction, train.seed)
                    .context("train.test_fraction")?,
            ),
            DatasetKind::Synthetic => in_memory(
                Dataset::synthetic(
                    train.synthetic_samples,
                    train.synthetic_features,
                    train.synthetic_classes,
                    train.seed,
                )?
                .split(train.test_fraction, train.seed)
                .context("train.test_fraction")?,
            ),
            DatasetKind::Text => {
                let (train_windows, test_windows, vocab) = text_windows(train)?;
                extra.insert("vocab".to_string(), serde_json::to_string(&vocab)?);
                in_memory((train_windows, test_windows))
            }
            DatasetKind::Csv | DatasetKind::Parquet | DatasetKind::Arrays => {
                let (splits, feature_columns) = table_data(train)?;
                extra.insert("feature_columns".to_string(), serde_json::to_string(&feature_columns)?);
                splits
            }
            DatasetKind::CriteoSynthetic | DatasetKind::Criteo | DatasetKind::ClickLog => {
                anyhow::bail!("click logs train on parameter servers: see `ParameterServerJob`")
            }
        };
        let spec = model_spec(train, train_data.dim(), outputs)?;
        let builder = spec.clone();
        let mut job = Self::new(
            config,
            move |init: &ParamInit| builder.build(init),
            train_data,
            test_data,
        )?;
        job.export.spec = Some(spec);
        job.export.extra = extra;
        Ok(job)
    }

    /// What rank `rank` trains with: the job's model and data, a device actor of its own,
    /// `monitor` and `trace` where it reports, `recovery`.
    pub(crate) fn rank_parts(
        &self,
        rank: usize,
        recovery: Recovery,
        monitor: Option<MonitorSettings>,
        trace: Option<TraceTarget>,
    ) -> RankParts {
        RankParts {
            rank,
            job: self.config.clone(),
            model: self.model.clone(),
            export: self.export.clone(),
            train_data: self.train_data.clone(),
            test_data: self.test_data.clone(),
            device: actix::SyncArbiter::start(1, DeviceActor::default),
            monitor,
            trace,
            recovery,
            faults: None,
        }
    }

    /// The trainer actor of `rank`, with its own device actor; rank 0 reports.
    fn trainer(
        &self,
        rank: usize,
        bus: ControlBus,
        link: RingLink,
        data_endpoint: String,
        options: &RunOptions,
        recovery: Recovery,
    ) -> Trainer {
        let monitor = (rank == 0).then(|| options.monitor(&self.config, rank, "trainer"));
        Trainer {
            parts: self.rank_parts(rank, recovery, monitor, options.trace_target()),
            bus: Some(bus),
            link: Some(link),
            data_endpoint,
            in_place: None,
            inbox: None,
        }
    }

    /// Runs the job the way its environment asks: as one rank of a launched
    /// cluster when `PADDLE_TRAINER_ID` or torchrun's `RANK` is set (by `flotilla launch`,
    /// Paddle's launcher or torchrun), else as a simulated cluster of `cluster.world_size`
    /// ranks in this process. Returns rank 0's outcome (other ranks of a launched job get
    /// `None`).
    pub fn run(&self, options: &RunOptions) -> Result<Option<RunOutcome>> {
        match crate::config::placement::rank(&crate::config::process_env)? {
            Some(rank) => self.run_rank(rank, options),
            None => self.run_simulated(options).map(Some),
        }
    }

    /// All ranks as actors of this process, ring links in memory.
    pub fn run_simulated(&self, options: &RunOptions) -> Result<RunOutcome> {
        self.simulated_with(options, |job, options| {
            if job.config.resolved_strategy() == Strategy::Pipeline {
                pipeline::run(job, options)
            } else {
                simulated::run(job, options)
            }
        })
    }

    /// All ranks as actors of this process, struck by `faults`, recovering in place as a
    /// launched job does (see [`FaultPlan`]); also answers the replacements each rank needed.
    pub fn run_simulated_with_faults(
        &self,
        options: &RunOptions,
        faults: &FaultPlan,
    ) -> Result<(RunOutcome, FaultReport)> {
        let mut report = None;
        let outcome = self.simulated_with(options, |job, options| {
            let (outcome, replaced) = if job.config.resolved_strategy() == Strategy::Pipeline {
                pipeline::run_with_faults(job, options, faults)?
            } else {
                simulated::run_with_faults(job, options, faults)?
            };
            report = Some(replaced);
            Ok(outcome)
        })?;
        Ok((outcome, report.context("the simulated run reported no faults")?))
    }

    /// Writes the config, runs `run`, and writes the trace and the outcome.
    fn simulated_with(
        &self,
        options: &RunOptions,
        run: impl FnOnce(&Self, &RunOptions) -> Result<RunOutcome>,
    ) -> Result<RunOutcome> {
        outputs::write_config(&options.run_dir, &self.config)?;
        let outcome = run(self, options)?;
        options.merge_in_process_trace()?;
        outcome.write(&options.run_dir, self)?;
        Ok(outcome)
    }

    /// One rank of a multi-process job over TCP or shared memory; rank 0
    /// writes the outputs, and hosts the coordinator at `cluster.master` unless
    /// it runs as a process of its own.
    pub fn run_rank(&self, rank: usize, options: &RunOptions) -> Result<Option<RunOutcome>> {
        if rank == 0 {
            outputs::write_config(&options.run_dir, &self.config)?;
        }
        // Rank 0 writes the outputs before it leaves the job.
        if self.config.resolved_strategy() == Strategy::Pipeline {
            pipeline::run_rank(self, rank, options)
        } else {
            data_parallel::run(self, rank, options)
        }
    }
}

/// The splits of a table dataset (CSV, Parquet, arrays) and its feature columns: streamed from
/// the files, each rank reading its own parts, when cut into parts (`train.data_parts`); else in
/// memory.
fn table_data(train: &TrainConfig) -> Result<((RowSource, RowSource, usize), Vec<String>)> {
    let format = match train.dataset {
        DatasetKind::Parquet => TableFormat::Parquet,
        DatasetKind::Arrays => TableFormat::Arrays,
        _ => TableFormat::Csv,
    };
    let columns = Columns {
        label: Some(&train.label_column),
        features: train.feature_columns.as_deref(),
        regression: train.loss.is_some_and(LossKind::is_regression),
    };
    Ok(match train.data_parts {
        // Cut into parts: streamed from the files, each rank reading its own.
        Some(parts) => {
            let layout = DataLayout::of(train, parts);
            let (streamed, test, outputs) =
                streamed_splits(format, &train.train_files, &train.test_files, columns, layout)?;
            let feature_columns = streamed.feature_columns.clone();
            ((streamed.into(), test.into(), outputs), feature_columns)
        }
        None => {
            let splits = table_splits(
                format,
                &train.train_files,
                &train.test_files,
                columns,
                train.test_fraction,
                train.seed,
            )?;
            (in_memory((splits.train, splits.test)), splits.feature_columns)
        }
    })
}

/// The model `train` asks for, over `inputs` features and `outputs` outputs.
fn model_spec(train: &TrainConfig, inputs: usize, outputs: usize) -> Result<ModelSpec> {
    Ok(match train.model {
        ModelKind::Mlp => ModelSpec::Mlp {
            inputs,
            hidden: train.hidden_sizes(),
            outputs,
        },
        ModelKind::Gpt => ModelSpec::Gpt(GptConfig {
            vocab: outputs,
            block_size: train.gpt.block_size,
            n_layer: train.gpt.n_layer,
            n_head: train.gpt.n_head,
            n_embd: train.gpt.n_embd,
            // The head's own weight: a tied one needs the embedding and the head in one
            // backward pass, which neither per-block data parallelism nor stages at both
            // ends of a pipeline give.
            tie_head: false,
        }),
        ModelKind::WideDeep | ModelKind::DeepFm | ModelKind::Custom => {
            anyhow::bail!(
                "{} trains on parameter servers: see `ParameterServerJob`",
                train.model.name()
            )
        }
    })
}
