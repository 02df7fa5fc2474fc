//! `[train]`: model, data set, run length, batch size and optimizer of the job.

use serde::{Deserialize, Serialize};

use super::{ClickLogSchema, FieldError};
use crate::refusal::Refusal;

/// Epochs run when neither `train.steps` nor `train.epochs` is given.
const DEFAULT_EPOCHS: usize = 20;

/// Model architecture.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// Multi-layer perceptron with `train.hidden_sizes` hidden layers (collective strategy).
    #[default]
    Mlp,
    /// Wide&deep CTR model over the 26 sparse slots and 13 dense features of Criteo
    /// (parameter-server strategy): a shared embedding table of width `train.embedding_dim`
    /// feeding the `train.hidden_sizes` deep layers, plus a width-1 table and a linear layer on
    /// the dense features for the wide part.
    WideDeep,
    /// DeepFM over the same click logs (parameter-server strategy): factor vectors of width
    /// `train.embedding_dim` for the 26 sparse slots (an `embedding` table) and the 13 dense
    /// features, their pairwise interactions (the FM term), a width-1 `first_order` table, and
    /// the `train.hidden_sizes` deep layers on the factors.
    #[serde(rename = "deepfm")]
    DeepFm,
    /// A parameter-server model of the program that runs the job: its tables and dense part
    /// come from the `SparseModelDef` it passes to `ParameterServerJob::new`.
    Custom,
    /// A decoder-only transformer (GPT shaped, `[train.gpt]`) trained as a character-level
    /// language model on `dataset = "text"` (collective or pipeline strategy).
    Gpt,
}

impl ModelKind {
    /// Whether the model trains on parameter servers, its tables keyed by click logs' ids.
    pub fn is_sparse(self) -> bool {
        matches!(self, Self::WideDeep | Self::DeepFm | Self::Custom)
    }

    /// The name `train.model` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mlp => "mlp",
            Self::WideDeep => "wide_deep",
            Self::DeepFm => "deepfm",
            Self::Custom => "custom",
            Self::Gpt => "gpt",
        }
    }

    /// Hidden layers when `train.hidden_sizes` is not given: PaddleRec's sizes for wide&deep.
    fn default_hidden_sizes(self) -> Vec<usize> {
        match self {
            Self::Mlp => vec![128],
            Self::WideDeep => vec![256, 128, 64],
            // The DeepFM paper's Criteo setting.
            Self::DeepFm => vec![400, 400, 400],
            Self::Gpt | Self::Custom => Vec::new(),
        }
    }
}

/// Training data set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    /// The bundled 8×8 handwritten digits set.
    #[default]
    Digits,
    /// Generated classification data shaped by the `train.synthetic_*` keys.
    Synthetic,
    /// Generated click logs in Criteo's shape (Zipf-distributed ids, a planted click model):
    /// `train.synthetic_samples` samples, `train.test_fraction` of them held out.
    CriteoSynthetic,
    /// Criteo display-advertising TSV files: `train.train_files` and `train.test_files`.
    Criteo,
    /// Click logs of the user's own, in the columns `[train.click_log]` describes (TSV, CSV or
    /// Parquet): `train.train_files` and `train.test_files`.
    ClickLog,
    /// The shipped text, Jules Verne's *Around the World in 80 Days*, as characters: windows
    /// of `train.gpt.block_size` characters every half window, the last `train.test_fraction`
    /// of the text held out.
    Text,
    /// CSV files of the user's own, with a header row: `train.train_files`, and
    /// `train.test_files` held out (else `train.test_fraction` of the training rows); the
    /// model reads the `train.feature_columns` and predicts the `train.label_column` — a class
    /// id, or a value to regress with `train.loss = "mse"` or `"mae"`.
    Csv,
    /// Parquet files of the user's own, read as `csv` reads its tables: top-level columns of
    /// integers or floating-point numbers.
    Parquet,
    /// Named arrays of the user's own — safetensors files, NumPy's `.npz`, or directories of
    /// `.npy` files (each array named by its file's stem) — as tables whose columns are arrays: `train.label_column` names the label array (one value a row), the
    /// `train.feature_columns` the feature arrays (`(n)` or `(n, k)`; every other array, in
    /// name order, when not given).
    Arrays,
}

impl DatasetKind {
    /// Whether the set is tables of the user's own (`csv`, `parquet`).
    pub fn is_table(self) -> bool {
        matches!(self, Self::Csv | Self::Parquet | Self::Arrays)
    }

    /// Whether the set is click logs (for the CTR model) rather than dense classification data.
    pub fn is_click_log(self) -> bool {
        matches!(self, Self::CriteoSynthetic | Self::Criteo | Self::ClickLog)
    }
}

/// How the learning rate is scaled with the world size (the global batch grows with it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    /// Use `train.lr` as given.
    #[default]
    None,
    /// Multiply `train.lr` by the world size.
    Linear,
    /// Multiply `train.lr` by the square root of the world size.
    Sqrt,
}

/// How the learning rate decays after warm-up, over the run's optimizer steps (PyTorch's
/// `LinearLR`, `CosineAnnealingLR`, `StepLR`; Paddle's `PolynomialDecay`, `CosineAnnealingDecay`,
/// `StepDecay`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// The peak rate to the end.
    #[default]
    Constant,
    /// Straight down from the peak to `train.lr_min` at the last step.
    Linear,
    /// Half a cosine from the peak to `train.lr_min` at the last step.
    Cosine,
    /// The rate times `train.lr_gamma` every `train.lr_step_size` steps.
    Step,
}

/// Optimizer algorithm.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with `train.momentum`.
    #[default]
    Sgd,
    /// AdamW with decoupled `train.weight_decay` (collective strategy).
    Adamw,
    /// Adagrad, applied per row by the parameter servers.
    Adagrad,
    /// Adam with per-row moments, applied by the parameter servers.
    Adam,
}

/// The training loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Cross-entropy of the logits against class ids (classification, language models).
    CrossEntropy,
    /// Mean squared error against values (regression).
    Mse,
    /// Mean absolute error against values (regression less swayed by outliers).
    Mae,
}

impl LossKind {
    /// Whether the loss regresses values rather than classifies.
    pub fn is_regression(self) -> bool {
        matches!(self, Self::Mse | Self::Mae)
    }

    /// The name `train.loss` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::CrossEntropy => "cross_entropy",
            Self::Mse => "mse",
            Self::Mae => "mae",
        }
    }
}

/// `[train.gpt]`: the shape of the GPT model (its vocabulary is the text's characters).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GptShape {
    /// Transformer layers (blocks `h0` … of the model, what pipelines cut).
    pub n_layer: usize,
    /// Attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Characters per window: the sequence length.
    pub block_size: usize,
}

impl Default for GptShape {
    fn default() -> Self {
        Self {
            n_layer: 4,
            n_head: 4,
            n_embd: 64,
            block_size: 64,
        }
    }
}

impl GptShape {
    pub(crate) fn check(&self) -> Result<(), FieldError> {
        for (key, value) in [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
        ] {
            if value == 0 {
                return Err(FieldError::new(format!("train.gpt.{key}"), "must be at least 1, got 0"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(FieldError::new(
                "train.gpt.n_head",
                format!("{} heads do not split n_embd = {} evenly", self.n_head, self.n_embd),
            ));
        }
        Ok(())
    }
}

/// How long to train: exactly one of `train.steps` / `train.epochs` after loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainLength {
    /// A fixed number of optimizer steps.
    Steps(usize),
    /// A number of passes over the training split.
    Epochs(usize),
}

impl TrainLength {
    /// The run's optimizer steps, with `batches_per_epoch` batches in a pass over the data; more
    /// than can be counted is a [`Refusal`] (found only once the data is read).
    pub fn steps(self, batches_per_epoch: usize) -> anyhow::Result<usize> {
        match self {
            Self::Steps(steps) => Ok(steps),
            Self::Epochs(epochs) => epochs.checked_mul(batches_per_epoch).ok_or_else(|| {
                Refusal::wrap(anyhow::anyhow!(
                    "train.epochs = {epochs}: with {batches_per_epoch} batches an epoch that is more steps than can be counted"
                ))
            }),
        }
    }
}

/// `[train]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default = "TrainConfig::unresolved", deny_unknown_fields)]
pub struct TrainConfig {
    /// Model architecture.
    pub model: ModelKind,
    /// Widths of the hidden layers, input side first; empty gives a linear model. Defaults
    /// depend on the model (see [`TrainConfig::hidden_sizes`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hidden_sizes: Option<Vec<usize>>,
    /// Width of the shared embedding table of the wide&deep model.
    pub embedding_dim: usize,
    /// Shape of the GPT model.
    pub gpt: GptShape,
    /// Dataset `click_log`: the columns of the logs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub click_log: Option<ClickLogSchema>,
    /// Training data set.
    pub dataset: DatasetKind,
    /// Number of generated samples (synthetic data set only).
    pub synthetic_samples: usize,
    /// Number of features per generated sample (synthetic data set only).
    pub synthetic_features: usize,
    /// Number of classes of the generated data (synthetic data set only).
    pub synthetic_classes: usize,
    /// Largest vocabulary of one sparse slot of generated click logs.
    pub synthetic_vocab: usize,
    /// Files to train on, read in order: Criteo TSV files (dataset `criteo`) or click logs in
    /// `[train.click_log]`'s columns (dataset `click_log`), both streamed; CSV tables (dataset
    /// `csv`), Parquet files (dataset `parquet`) or named arrays (dataset `arrays`).
    pub train_files: Vec<String>,
    /// Files held out for evaluation: click logs (datasets `criteo` and `click_log`), or tables
    /// (datasets `csv`, `parquet` and `arrays`, where none holds out `test_fraction` of the
    /// training rows).
    pub test_files: Vec<String>,
    /// Datasets `csv` and `parquet`: the column the model predicts.
    pub label_column: String,
    /// Datasets `csv` and `parquet`: the columns the model reads, in this order; every column but
    /// the label when not given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub feature_columns: Option<Vec<String>>,
    /// Parameter server only: a directory of `ps-shard-<i>.safetensors` files (what a run
    /// leaves in its run directory) that the shards start from instead of fresh parameters, as
    /// Paddle's `fleet.init_server(dirname)`. The shard count must be the same.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_tables_from: Option<String>,
    /// Click logs, and tables to stream (CSV, Parquet, safetensors or `.npy` arrays): the parts
    /// the training data is cut into — runs of files, or byte (Parquet and arrays: row) ranges
    /// of fewer files — each read by one trainer (or data-parallel pipeline replica); a global
    /// batch takes an equal share of each, so the batch must divide among the parts. Click logs
    /// default to the number of trainers, kept when a run resumes on another number. A table
    /// is read into memory unless this is given; with it, each rank streams only its parts from
    /// the files, a shuffle window at a time (files larger than memory), and `test_files` are
    /// held out and streamed too.
    pub data_parts: Option<usize>,
    /// Data read in parts (`data_parts`): records of a part shuffled together, in consecutive
    /// windows, by a generator seeded with `seed`, the part, the pass and the window; 0 reads
    /// in file order.
    pub shuffle_buffer: usize,
    /// Fraction of the data held out for evaluation, strictly between 0 and 1.
    pub test_fraction: f64,
    /// Run length in optimizer steps; exclusive with `epochs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Run length in epochs; exclusive with `steps`, and 20 when neither is given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epochs: Option<usize>,
    /// GLOBAL batch size, split evenly across the world, so it must be divisible by the world
    /// size; keeping it global makes results comparable across world sizes.
    pub batch_size: usize,
    /// Rows per forward pass of an evaluation on each rank: the held-out set is scored
    /// piece by piece, so evaluation's memory does not grow with the set. Unset: a data-parallel
    /// replica's share of the training batch (which a pipeline cuts into the same micro-batches
    /// as a step's), so that evaluation holds no more activations than a training step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_batch_size: Option<usize>,
    /// Score the held-out split every this many steps too (0: only at the end), into the
    /// step's metrics line (`eval`), TensorBoard and the progress log.
    pub eval_every: usize,
    /// Base learning rate (before `lr_scaling`).
    pub lr: f64,
    /// Learning-rate scaling with the world size.
    pub lr_scaling: LrScaling,
    /// Steps of linear learning-rate warm-up from 0; 0 disables warm-up.
    pub warmup_steps: usize,
    /// How the rate decays after warm-up.
    pub lr_schedule: LrSchedule,
    /// The rate `linear` and `cosine` schedules end at (not scaled with the world size).
    pub lr_min: f64,
    /// `step` schedule: optimizer steps between decays.
    pub lr_step_size: usize,
    /// `step` schedule: the factor of each decay, in (0, 1].
    pub lr_gamma: f64,
    /// Clip the averaged gradients to this global L2 norm before each optimizer step (PyTorch's
    /// `clip_grad_norm_`, Paddle's `ClipGradByGlobalNorm`); 0 leaves them.
    pub grad_clip_norm: f64,
    /// The training loss of a dense model: `cross_entropy` for classes (the default), `mse` or
    /// `mae` for values (a CSV table's label is then read as a value to regress). A program's
    /// own `TrainingJob` of values defaults to `mse`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<LossKind>,
    /// Optimizer algorithm.
    pub optimizer: OptimizerKind,
    /// SGD momentum, in `[0, 1)`.
    pub momentum: f64,
    /// Weight decay, `>= 0`.
    pub weight_decay: f64,
    /// Seed of parameter initialisation, data generation and shuffling; the same on every
    /// replica so they start identical.
    pub seed: u64,
    /// Steps between progress log lines (at least 1).
    pub log_every: usize,
}

impl Default for TrainConfig {
    /// The resolved defaults: every key at its default and `epochs = Some(20)`.
    fn default() -> Self {
        let mut config = Self::unresolved();
        config.resolve_defaults();
        config
    }
}

impl TrainConfig {
    /// Defaults for keys missing from a present `[train]` table. `steps` and `epochs` are both
    /// `None` here so giving only `steps` does not collide with the default epoch count;
    /// [`TrainConfig::resolve_defaults`] fills that in afterwards.
    fn unresolved() -> Self {
        Self {
            model: ModelKind::Mlp,
            hidden_sizes: None,
            embedding_dim: 9,
            gpt: GptShape::default(),
            click_log: None,
            dataset: DatasetKind::Digits,
            synthetic_samples: 16384,
            synthetic_features: 64,
            synthetic_classes: 10,
            synthetic_vocab: 100_000,
            train_files: Vec::new(),
            test_files: Vec::new(),
            label_column: "label".to_string(),
            feature_columns: None,
            init_tables_from: None,
            data_parts: None,
            shuffle_buffer: 0,
            test_fraction: 0.2,
            steps: None,
            epochs: None,
            batch_size: 64,
            eval_batch_size: None,
            eval_every: 0,
            lr: 0.05,
            lr_scaling: LrScaling::None,
            warmup_steps: 0,
            lr_schedule: LrSchedule::Constant,
            lr_min: 0.0,
            lr_step_size: 1000,
            lr_gamma: 0.1,
            grad_clip_norm: 0.0,
            loss: None,
            optimizer: OptimizerKind::Sgd,
            momentum: 0.9,
            weight_decay: 0.0,
            seed: 42,
            log_every: 10,
        }
    }

    /// Applies defaults that depend on other keys: 20 epochs when no run length is given, the
    /// model's hidden layers when none are, cross-entropy when no loss is (dense data sets).
    pub(crate) fn resolve_defaults(&mut self) {
        if self.steps.is_none() && self.epochs.is_none() {
            self.epochs = Some(DEFAULT_EPOCHS);
        }
        if self.hidden_sizes.is_none() {
            self.hidden_sizes = Some(self.model.default_hidden_sizes());
        }
        // The built-in dense data sets hold classes (a CSV table's label too, unless a
        // regression loss is asked for); click logs train with their models' own loss.
        if self.loss.is_none() && !self.dataset.is_click_log() {
            self.loss = Some(LossKind::CrossEntropy);
        }
    }

    /// The training loss, once a job has resolved it from its data ([`LossKind`]).
    pub fn resolved_loss(&self) -> anyhow::Result<LossKind> {
        self.loss
            .ok_or_else(|| anyhow::anyhow!("train.loss is not resolved: a job sets it from its data set"))
    }

    /// Parts of the click-log data (`data_parts`; the number of trainers if not given).
    pub fn data_parts(&self, trainers: usize) -> usize {
        self.data_parts.unwrap_or(trainers)
    }

    /// Keeps the number of parts of click logs in the resolved config, so a run resumed on
    /// another number of trainers reads the data cut as before.
    pub(crate) fn resolve_data_parts(&mut self, trainers: usize) {
        if self.dataset.is_click_log() && self.data_parts.is_none() {
            self.data_parts = Some(trainers);
        }
    }

    /// The columns of the click logs the job reads: Criteo's for `criteo` and the Criteo-shaped
    /// `criteo_synthetic`, `[train.click_log]` for `click_log`; `None` for other data.
    pub fn click_log_schema(&self) -> Option<ClickLogSchema> {
        match self.dataset {
            DatasetKind::Criteo | DatasetKind::CriteoSynthetic => Some(ClickLogSchema::criteo()),
            DatasetKind::ClickLog => self.click_log.clone(),
            _ => None,
        }
    }

    /// Widths of the hidden layers (the model's defaults if the config gave none).
    pub fn hidden_sizes(&self) -> Vec<usize> {
        self.hidden_sizes
            .clone()
            .unwrap_or_else(|| self.model.default_hidden_sizes())
    }

    /// The run length; steps win if (unvalidated) both are set, 20 epochs if neither is.
    pub fn length(&self) -> TrainLength {
        match (self.steps, self.epochs) {
            (Some(steps), _) => TrainLength::Steps(steps),
            (None, Some(epochs)) => TrainLength::Epochs(epochs),
            (None, None) => TrainLength::Epochs(DEFAULT_EPOCHS),
        }
    }

    /// Per-process batch size: the global batch split over `world_size` replicas.
    pub fn local_batch_size(&self, world_size: usize) -> usize {
        self.batch_size / world_size.max(1)
    }

    /// The table columns the model reads: each named once, the label not among them.
    fn check_columns(&self) -> Result<(), FieldError> {
        let Some(features) = &self.feature_columns else {
            return Ok(());
        };
        for (i, name) in features.iter().enumerate() {
            if let Some(first) = features[..i].iter().position(|earlier| earlier == name) {
                return Err(FieldError::new(
                    format!("train.feature_columns[{i}]"),
                    format!("{name:?} is named twice (also at [{first}]): a feature is read once"),
                ));
            }
            if *name == self.label_column {
                return Err(FieldError::new(
                    format!("train.feature_columns[{i}]"),
                    format!("{name:?} is train.label_column: a model must not read the column it predicts"),
                ));
            }
        }
        Ok(())
    }

    /// Range checks of the section; the batch is split among `replicas` (the world size, or its
    /// layer groups where layers are split).
    pub(crate) fn check(&self, replicas: usize) -> Result<(), FieldError> {
        self.check_hidden_sizes()?;
        self.check_columns()?;
        at_least("train.synthetic_samples", self.synthetic_samples, 1)?;
        at_least("train.synthetic_features", self.synthetic_features, 1)?;
        at_least("train.synthetic_classes", self.synthetic_classes, 2)?;
        at_least("train.synthetic_vocab", self.synthetic_vocab, 1)?;
        at_least("train.embedding_dim", self.embedding_dim, 1)?;
        self.check_test_fraction()?;
        self.check_length()?;
        self.check_batch(replicas)?;
        self.check_optimizer()?;
        self.check_seed()?;
        at_least("train.log_every", self.log_every, 1)
    }

    /// Every hidden layer has a unit.
    fn check_hidden_sizes(&self) -> Result<(), FieldError> {
        for (i, &width) in self.hidden_sizes().iter().enumerate() {
            if width == 0 {
                return Err(FieldError::new(
                    format!("train.hidden_sizes[{i}]"),
                    "a hidden layer must have at least 1 unit, got 0",
                ));
            }
        }
        Ok(())
    }

    /// Both the training and the held-out part of the data get samples.
    fn check_test_fraction(&self) -> Result<(), FieldError> {
        let f = self.test_fraction;
        if !(f > 0.0 && f < 1.0) {
            return Err(FieldError::new(
                "train.test_fraction",
                format!("must be strictly between 0 and 1, got {f}"),
            ));
        }
        Ok(())
    }

    /// The run's length: steps or epochs, not both, at least one of either.
    fn check_length(&self) -> Result<(), FieldError> {
        match (self.steps, self.epochs) {
            (Some(steps), Some(epochs)) => Err(FieldError::new(
                "train.steps",
                format!(
                    "train.steps = {steps} contradicts train.epochs = {epochs}: \
                     give only one of them"
                ),
            )),
            (Some(steps), None) => at_least("train.steps", steps, 1),
            (None, Some(epochs)) => at_least("train.epochs", epochs, 1),
            (None, None) => Ok(()),
        }
    }

    /// The batches are not empty, and the global one splits evenly over the replicas.
    fn check_batch(&self, replicas: usize) -> Result<(), FieldError> {
        at_least("train.batch_size", self.batch_size, 1)?;
        if let Some(rows) = self.eval_batch_size {
            at_least("train.eval_batch_size", rows, 1)?;
        }
        if !self.batch_size.is_multiple_of(replicas) {
            return Err(FieldError::new(
                "train.batch_size",
                format!(
                    "the global batch size {} is not divisible by the {replicas} data-parallel replicas (the world \
                     size, or its layer groups)",
                    self.batch_size
                ),
            ));
        }
        Ok(())
    }

    /// The learning rate's schedule and the optimizer's settings.
    fn check_optimizer(&self) -> Result<(), FieldError> {
        positive_finite("train.lr", self.lr)?;
        let lr_min = self.lr_min;
        if !(lr_min.is_finite() && (0.0..=self.lr).contains(&lr_min)) {
            return Err(FieldError::new(
                "train.lr_min",
                format!("must be from 0 to train.lr = {}, got {lr_min}", self.lr),
            ));
        }
        at_least("train.lr_step_size", self.lr_step_size, 1)?;
        let gamma = self.lr_gamma;
        if !(gamma > 0.0 && gamma <= 1.0) {
            return Err(FieldError::new(
                "train.lr_gamma",
                format!("must be in (0, 1], got {gamma}"),
            ));
        }
        let clip = self.grad_clip_norm;
        if !(clip.is_finite() && clip >= 0.0) {
            return Err(FieldError::new(
                "train.grad_clip_norm",
                format!("must be a finite number >= 0 (0 = off), got {clip}"),
            ));
        }
        let m = self.momentum;
        if !((0.0..1.0).contains(&m)) {
            return Err(FieldError::new("train.momentum", format!("must be in [0, 1), got {m}")));
        }
        let wd = self.weight_decay;
        if !(wd.is_finite() && wd >= 0.0) {
            return Err(FieldError::new(
                "train.weight_decay",
                format!("must be a finite number >= 0, got {wd}"),
            ));
        }
        Ok(())
    }

    /// The seed survives a round trip through the resolved config's TOML.
    fn check_seed(&self) -> Result<(), FieldError> {
        if i64::try_from(self.seed).is_err() {
            return Err(FieldError::new(
                "train.seed",
                format!(
                    "must be at most {} (TOML integers are signed 64-bit), got {}",
                    i64::MAX,
                    self.seed
                ),
            ));
        }
        Ok(())
    }
}

/// `value >= min`, or an error naming `key`.
fn at_least(key: &str, value: usize, min: usize) -> Result<(), FieldError> {
    if value < min {
        return Err(FieldError::new(key, format!("must be at least {min}, got {value}")));
    }
    Ok(())
}

/// `value` is finite and `> 0`, or an error naming `key`.
fn positive_finite(key: &str, value: f64) -> Result<(), FieldError> {
    if !(value.is_finite() && value > 0.0) {
        return Err(FieldError::new(
            key,
            format!("must be a finite number > 0, got {value}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{err_text, load_str};

    #[test]
    fn a_feature_named_twice_or_the_label_among_the_features_is_refused() {
        let twice = err_text(load_str("[train]\nfeature_columns = [\"a\", \"b\", \"a\"]\n"));
        assert_eq!(
            twice,
            "config.toml: train.feature_columns[2]: \"a\" is named twice (also at [0]): a feature is read once"
        );
        let label = err_text(load_str(
            "[train]\nlabel_column = \"y\"\nfeature_columns = [\"a\", \"y\"]\n",
        ));
        assert!(
            label.ends_with(
                "train.feature_columns[1]: \"y\" is train.label_column: a model must not read the column it predicts"
            ),
            "{label}"
        );
    }

    #[test]
    fn batch_size_must_split_evenly() {
        let msg = err_text(load_str("[cluster]\nnnodes = 2\n[train]\nbatch_size = 6\n"));
        assert_eq!(
            msg,
            "config.toml: train.batch_size: the global batch size 6 is not divisible by the 4 \
             data-parallel replicas (the world size, or its layer groups)"
        );
        let config = load_str("[train]\nbatch_size = 6\n").unwrap();
        assert_eq!(config.train.local_batch_size(config.world_size()), 3);
        // Split over 2 ranks each, 4 ranks are 2 replicas: 6 rows of 3 each.
        let split =
            "[cluster]\nnnodes = 2\n[train]\nbatch_size = 6\n[strategy.hybrid_configs]\ndp_degree = 2\nmp_degree = 2\n";
        let config = load_str(split).unwrap();
        assert_eq!(config.train.local_batch_size(config.data_parallel_replicas()), 3);
    }

    #[test]
    fn steps_and_epochs_contradict() {
        let msg = err_text(load_str("[train]\nsteps = 100\nepochs = 5\n"));
        assert_eq!(
            msg,
            "config.toml: train.steps: train.steps = 100 contradicts train.epochs = 5: \
             give only one of them"
        );
    }

    #[test]
    fn run_length_defaults_and_zero() {
        let config = load_str("[train]\nsteps = 100\n").unwrap();
        assert_eq!((config.train.steps, config.train.epochs), (Some(100), None));
        assert_eq!(config.train.length(), TrainLength::Steps(100));
        let config = load_str("[train]\nlr = 0.1\n").unwrap();
        assert_eq!(config.train.epochs, Some(20));
        let config = load_str("[train]\nepochs = 3\n").unwrap();
        assert_eq!(config.train.length(), TrainLength::Epochs(3));
        let msg = err_text(load_str("[train]\nsteps = 0\n"));
        assert!(msg.starts_with("config.toml: train.steps: must be at least 1"), "{msg}");
        let msg = err_text(load_str("[train]\nepochs = 0\n"));
        assert!(
            msg.starts_with("config.toml: train.epochs: must be at least 1"),
            "{msg}"
        );
    }

    #[test]
    fn enums_parse_lowercase() {
        let config =
            load_str("[train]\noptimizer = \"adamw\"\nlr_scaling = \"linear\"\ndataset = \"synthetic\"\n").unwrap();
        assert_eq!(config.train.optimizer, OptimizerKind::Adamw);
        assert_eq!(config.train.lr_scaling, LrScaling::Linear);
        assert_eq!(config.train.dataset, DatasetKind::Synthetic);
        let msg = err_text(load_str("[train]\noptimizer = \"adamax\"\n"));
        assert!(
            msg.starts_with("config.toml: train.optimizer: unknown variant `adamax`, expected"),
            "{msg}"
        );
    }

    #[test]
    fn ranges_are_checked() {
        for (text, key) in [
            ("test_fraction = 1.0", "train.test_fraction"),
            ("test_fraction = 0", "train.test_fraction"),
            ("lr = 0", "train.lr"),
            ("momentum = 1.0", "train.momentum"),
            ("momentum = -0.1", "train.momentum"),
            ("weight_decay = -1e-4", "train.weight_decay"),
            ("batch_size = 0", "train.batch_size"),
            ("log_every = 0", "train.log_every"),
            ("eval_batch_size = 0", "train.eval_batch_size"),
            ("synthetic_classes = 1", "train.synthetic_classes"),
            ("hidden_sizes = [32, 0]", "train.hidden_sizes[1]"),
        ] {
            let msg = err_text(load_str(&format!("[train]\n{text}\n")));
            assert!(msg.starts_with(&format!("config.toml: {key}: ")), "{text}: {msg}");
        }
    }
}
