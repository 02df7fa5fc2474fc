//! Models of the parameter-server strategy: sparse tables that live on the servers, looked up by
//! the ids of a click log's slots, and a dense part of [`Block`]s that every trainer computes.
//!
//! A model declares its tables ([`SparseTableSpec`]) and computes logits from a batch's dense
//! features and, per table, the rows its ids looked up ([`Lookup`]). The runtime does the rest
//! — which ids a batch needs from which shard, each id pulled once, gradients of the rows and
//! of the dense parameters pushed back — for any model, built-in (wide&deep, DeepFM) or a
//! library user's own, passed to the job as a [`SparseModelBuilder`].

use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::Tensor;

use super::{Block, DeepFm, Param, ParamInit, WideDeep};
use crate::config::{ModelKind, OptimizerKind, TrainConfig};
use crate::data::ctr::CtrShape;

/// One sparse table of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseTableSpec {
    /// Name: in `[strategy.sparse_table_configs.<name>]`, snapshots, exports and errors.
    pub name: String,
    /// Floats per row.
    pub width: usize,
    /// New rows start uniform in `[-init_bound, init_bound)`, drawn from the job's seed, the
    /// table's name and the id.
    pub init_bound: f32,
    /// The click log's sparse slots (`0..26` of Criteo's, or of a schema's) whose ids look rows
    /// up in this table, in the order the model reads them.
    pub slots: Vec<usize>,
    /// The optimizer of this table's rows; `None`: the job's (`train.optimizer`).
    pub optimizer: Option<OptimizerKind>,
    /// The step size of this table's rows (scaled like `train.lr` by `train.lr_scaling`);
    /// `None`: `train.lr`.
    pub lr: Option<f64>,
}

impl SparseTableSpec {
    /// A table `name` of rows of `width` read by `slots`, optimised as the job says.
    pub fn new(name: &str, width: usize, init_bound: f32, slots: impl IntoIterator<Item = usize>) -> Self {
        Self {
            name: name.to_string(),
            width,
            init_bound,
            slots: slots.into_iter().collect(),
            optimizer: None,
            lr: None,
        }
    }
}

/// One table's rows for a batch.
pub struct Lookup<'a> {
    /// `(distinct ids, width)`: the rows of the distinct ids the table's slots hold in the batch.
    pub rows: &'a Tensor,
    /// u32: per sample and slot of the table (sample-major), the positions of its ids' rows in
    /// `rows` — one per (sample, slot), `batch × slots`, unless `segments` says otherwise.
    pub index: &'a Tensor,
    /// With multi-valued slots, u32 per entry of `index`: the (sample, slot) it belongs to,
    /// `sample × slots + slot`, ascending; `None` when each (sample, slot) has one entry.
    pub segments: Option<&'a Tensor>,
    /// The table's slot count.
    pub slots: usize,
}

impl Lookup<'_> {
    /// The rows each sample looked up, `(batch, slots, width)`: a multi-valued slot's rows summed
    /// (sum pooling, as Paddle's and TorchRec's default).
    pub fn embedded(&self, batch: usize) -> candle_core::Result<Tensor> {
        let width = self.rows.dim(1)?;
        let rows = self.rows.index_select(self.index, 0)?;
        let pooled = match self.segments {
            None => rows,
            Some(segments) => Tensor::zeros((batch * self.slots, width), rows.dtype(), rows.device())?
                .index_add(segments, &rows, 0)?,
        };
        pooled.reshape((batch, self.slots, width))
    }
}

/// A model trained under the parameter-server strategy.
pub trait SparseModel: Send {
    /// The sparse tables, in table order.
    fn tables(&self) -> Vec<SparseTableSpec>;

    /// The dense part: the blocks whose parameters the servers hold and the trainers compute.
    fn blocks(&self) -> Vec<&dyn Block>;

    /// Click logits, shape `(batch,)`, for `dense` features `(batch, dense)` and, per table in
    /// table order, the rows the batch looked up.
    fn logits(&self, dense: &Tensor, lookups: &[Lookup<'_>]) -> candle_core::Result<Tensor>;

    /// The dense parameters as `"{block}.{param}"`, sorted by name: the order in which they are
    /// flattened and split over the servers.
    fn parameters(&self) -> Vec<(String, Param)> {
        let mut params: Vec<(String, Param)> = (self.blocks().into_iter().enumerate())
            .flat_map(|(index, block)| block.named_parameters(index))
            .map(|p| (p.name, p.param))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        params
    }
}

/// Builds a job's model with its dense parameters drawn from an initialiser: every trainer and
/// every server builds the same one from the job's seed.
pub type SparseModelBuilder = Arc<dyn Fn(&ParamInit) -> Result<Box<dyn SparseModel>> + Send + Sync>;

/// The built-in model `train.model` names, shaped by the click log's columns,
/// `train.embedding_dim` and `train.hidden_sizes`.
fn builtin_sparse_model(train: &TrainConfig) -> Result<SparseModelBuilder> {
    let (kind, width, hidden) = (train.model, train.embedding_dim, train.hidden_sizes());
    let shape = CtrShape::of_train(train);
    Ok(match kind {
        ModelKind::WideDeep => Arc::new(move |init| Ok(Box::new(WideDeep::new(shape, width, &hidden, init)?))),
        ModelKind::DeepFm => Arc::new(move |init| Ok(Box::new(DeepFm::new(shape, width, &hidden, init)?))),
        ModelKind::Custom => anyhow::bail!(
            "train.model = \"custom\" is the model of the program that runs the job (a SparseModelDef \
             passed to ParameterServerJob::new); the built-in ones are \"wide_deep\" and \"deepfm\""
        ),
        ModelKind::Mlp | ModelKind::Gpt => {
            anyhow::bail!(
                "train.model = {:?} is a dense model: it has no sparse tables",
                kind.name()
            )
        }
    })
}

/// Checks a model's tables: names distinct and non-empty, widths and slot lists non-empty.
fn check_tables(tables: &[SparseTableSpec]) -> Result<()> {
    ensure!(!tables.is_empty(), "a sparse model needs at least one sparse table");
    for (i, table) in tables.iter().enumerate() {
        ensure!(!table.name.is_empty(), "sparse table {i} has no name");
        ensure!(
            tables[..i].iter().all(|t| t.name != table.name),
            "two sparse tables are named {:?}",
            table.name
        );
        ensure!(table.width > 0, "sparse table {}: width 0", table.name);
        ensure!(!table.slots.is_empty(), "sparse table {}: no slots read it", table.name);
        ensure!(
            table.lr.is_none_or(|lr| lr.is_finite() && lr > 0.0),
            "sparse table {}: lr {:?} is not a positive number",
            table.name,
            table.lr
        );
        ensure!(
            table.optimizer != Some(OptimizerKind::Adamw),
            "sparse table {}: \"adamw\" is not a parameter-server optimizer",
            table.name
        );
    }
    Ok(())
}

/// A job's sparse model: how every role builds it, and the tables it declares.
#[derive(Clone)]
pub struct SparseModelDef {
    build: SparseModelBuilder,
    tables: Arc<[SparseTableSpec]>,
}

impl SparseModelDef {
    /// The model `build` makes, its tables checked.
    pub fn new(build: SparseModelBuilder) -> Result<Self> {
        let probe = build(&ParamInit::new(0, candle_core::Device::Cpu))?;
        let tables = probe.tables();
        check_tables(&tables)?;
        Ok(Self {
            build,
            tables: tables.into(),
        })
    }

    /// The built-in model `train.model` names.
    pub fn builtin(train: &TrainConfig) -> Result<Self> {
        Self::new(builtin_sparse_model(train)?)
    }

    /// The model with its dense parameters drawn from `init`.
    pub fn build(&self, init: &ParamInit) -> Result<Box<dyn SparseModel>> {
        let model = (self.build)(init)?;
        ensure!(
            model.tables() == *self.tables,
            "the sparse model builder made a model with other tables than it declared first"
        );
        Ok(model)
    }

    /// Checks that every table's slots are among the `shape`d log's.
    pub fn check_slots(&self, shape: CtrShape) -> Result<()> {
        for table in self.tables.iter() {
            if let Some(slot) = table.slots.iter().find(|&&s| s >= shape.slots) {
                anyhow::bail!(
                    "sparse table {}: slot {slot} is not one of the click log's {} (slots 0..{})",
                    table.name,
                    shape.slots,
                    shape.slots
                );
            }
        }
        Ok(())
    }

    /// The tables, in table order.
    pub fn tables(&self) -> &[SparseTableSpec] {
        &self.tables
    }

    /// The tables' names, in table order.
    pub fn table_names(&self) -> Vec<&str> {
        self.tables.iter().map(|t| t.name.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_tables_are_named() {
        let good = || SparseTableSpec::new("user", 4, 0.1, 0..3);
        let cases = [
            (vec![], "a sparse model needs at least one sparse table".to_string()),
            (vec![good(), good()], "two sparse tables are named \"user\"".to_string()),
            (
                vec![SparseTableSpec::new("user", 4, 0.1, [])],
                "sparse table user: no slots read it".to_string(),
            ),
            (
                vec![SparseTableSpec::new("user", 0, 0.1, [1])],
                "sparse table user: width 0".to_string(),
            ),
            (
                vec![SparseTableSpec {
                    lr: Some(-1.0),
                    ..good()
                }],
                "sparse table user: lr Some(-1.0) is not a positive number".to_string(),
            ),
        ];
        for (tables, expected) in cases {
            assert_eq!(check_tables(&tables).unwrap_err().to_string(), expected);
        }
        assert!(check_tables(&[good()]).is_ok());
        let def = SparseModelDef::new(Arc::new(|init| {
            Ok(Box::new(WideDeep::new(CtrShape::CRITEO, 2, &[], init)?))
        }))
        .expect("a model");
        assert!(def.check_slots(CtrShape::CRITEO).is_ok());
        let err = def
            .check_slots(CtrShape { dense: 1, slots: 20 })
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "sparse table embedding: slot 20 is not one of the click log's 20 (slots 0..20)"
        );
    }

    /// Sum pooling of multi-valued slots: the pooled rows are the sums of each (sample, slot)'s
    /// rows, and the gradient a row gets matches a central finite difference of the loss.
    #[test]
    fn multi_valued_slots_pool_by_sum_and_their_gradient_matches_finite_differences() -> Result<()> {
        use candle_core::{DType, Device};
        let device = Device::Cpu;
        let init = ParamInit::new(11, device.clone());
        let rows = init.uniform("rows", &[5, 3], 1.0)?.var()?;
        let weights = init.uniform("weights", &[2, 2, 3], 1.0)?.var()?;
        // Sample 0: slot 0 holds rows 0 and 1, slot 1 row 2; sample 1: slot 0 row 3, slot 1
        // rows 1, 4 and 1 again (a value repeated in a cell counts twice).
        let index = Tensor::new(&[0u32, 1, 2, 3, 1, 4, 1], &device)?;
        let segments = Tensor::new(&[0u32, 0, 1, 2, 3, 3, 3], &device)?;
        let loss_of = |rows: &Tensor| -> candle_core::Result<Tensor> {
            let lookup = Lookup {
                rows,
                index: &index,
                segments: Some(&segments),
                slots: 2,
            };
            (lookup.embedded(2)?.tanh()? * weights.as_tensor())?.sum_all()
        };
        let pooled = Lookup {
            rows: rows.as_tensor(),
            index: &index,
            segments: Some(&segments),
            slots: 2,
        }
        .embedded(2)?;
        let r: Vec<Vec<f32>> = rows.as_tensor().to_vec2()?;
        let p: Vec<Vec<Vec<f32>>> = pooled.to_vec3()?;
        for k in 0..3 {
            assert_eq!(p[0][0][k], r[0][k] + r[1][k]);
            assert_eq!(p[1][1][k], r[1][k] + r[4][k] + r[1][k]);
        }
        let grad = loss_of(rows.as_tensor())?.backward()?;
        let grad: Vec<Vec<f32>> = grad.get(rows.as_tensor()).expect("a gradient").to_vec2()?;
        let h = 1e-2f32;
        for (row, col) in [(0, 0), (1, 2), (2, 1), (4, 0), (1, 0)] {
            let nudged = |delta: f32| -> candle_core::Result<f64> {
                let mut values = r.clone();
                values[row][col] += delta;
                let flat: Vec<f64> = values.concat().into_iter().map(f64::from).collect();
                let rows = Tensor::from_vec(flat, (5, 3), &device)?;
                let weights = weights.as_tensor().to_dtype(DType::F64)?;
                let lookup = Lookup {
                    rows: &rows,
                    index: &index,
                    segments: Some(&segments),
                    slots: 2,
                };
                (lookup.embedded(2)?.tanh()? * weights)?.sum_all()?.to_scalar::<f64>()
            };
            let numeric = (nudged(h)? - nudged(-h)?) / (2.0 * f64::from(h));
            let analytic = f64::from(grad[row][col]);
            assert!(
                (numeric - analytic).abs() < 1e-4 * (1.0 + analytic.abs()),
                "row {row} col {col}: finite difference {numeric}, gradient {analytic}"
            );
        }
        let untouched: f32 = grad[3].iter().map(|g| g.abs()).sum::<f32>();
        assert!(untouched > 0.0, "row 3 is read by sample 1's slot 0");
        Ok(())
    }

    #[test]
    fn the_builtin_models_are_the_ones_train_model_names() {
        let mut train = TrainConfig {
            model: ModelKind::DeepFm,
            embedding_dim: 3,
            ..TrainConfig::default()
        };
        let def = SparseModelDef::builtin(&train).unwrap();
        assert_eq!(def.table_names(), ["embedding", "first_order"]);
        assert_eq!(def.tables()[0].width, 3);
        train.model = ModelKind::Custom;
        let err = SparseModelDef::builtin(&train).err().unwrap().to_string();
        assert!(err.contains("ParameterServerJob::new"), "{err}");
    }
}
