//! `[strategy]` keys of pipeline parallelism (Paddle's names): `pipeline`,
//! `pipeline_configs` and `hybrid_configs`.

use serde::{Deserialize, Serialize};

use super::FieldError;

/// Order of forwards and backwards over the micro-batches (`pipeline_configs.schedule_mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ScheduleMode {
    /// GPipe: all forwards, then all backwards.
    FThenB,
    /// One forward, one backward in the steady state (interleaved when
    /// `virtual_pipeline_stages > 1`).
    #[default]
    #[serde(rename = "1F1B")]
    OneFOneB,
}

/// `[strategy.pipeline_configs]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfigs {
    /// The schedule.
    pub schedule_mode: ScheduleMode,
    /// Micro-batches per step (`m`).
    pub accumulate_steps: usize,
    /// Samples per micro-batch; optional, and when given it must equal the global batch over
    /// `dp_degree × accumulate_steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<usize>,
    /// Model chunks per stage (`v`); more than 1 interleaves 1F1B.
    pub virtual_pipeline_stages: usize,
    /// First block of stages 1, 2, … (of virtual stages when interleaving); empty balances the
    /// stages by parameter count.
    pub stage_boundaries: Vec<usize>,
    /// With data-parallel replicas: all-reduce a stage's gradients once, in the optimizer step,
    /// instead of block by block as each block's last backward finishes (overlapped with the
    /// backward still to run).
    pub pp_allreduce_in_optimize: bool,
}

impl Default for PipelineConfigs {
    fn default() -> Self {
        Self {
            schedule_mode: ScheduleMode::OneFOneB,
            accumulate_steps: 1,
            micro_batch_size: None,
            virtual_pipeline_stages: 1,
            stage_boundaries: Vec::new(),
            pp_allreduce_in_optimize: false,
        }
    }
}

/// `[strategy.hybrid_configs]`: how the world is split into pipeline stages and data-parallel
/// replicas of the pipeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HybridConfigs {
    /// Replicas of the whole pipeline (`d`); each stage all-reduces within its replicas. With
    /// sharding inside the nodes, the replicas of the shards (the number of nodes); with
    /// `mp_degree`, the replicas of the split model.
    pub dp_degree: usize,
    /// Pipeline stages (`p`).
    pub pp_degree: usize,
    /// Ranks that split each layer's weights between them (tensor parallelism, Megatron's
    /// layout): a GPT's attention by heads and its MLP by hidden width, its embedding and logits
    /// by vocabulary; an MLP's layers in column-then-row pairs. The innermost axis of the rank
    /// grid: a replica's (a stage's, in a pipeline) ranks are consecutive, so on one node.
    /// `dp_degree × pp_degree × mp_degree` is the world size.
    pub mp_degree: usize,
    /// Ranks that split the optimizer's states (and gradients) between them, with
    /// `strategy.sharding`: 1 (unset) or the world size, every rank; or `cluster.nproc_per_node`
    /// of several nodes, each node's ranks, the nodes holding replicas (`dp_degree` = nodes). With
    /// `mp_degree`, every data-parallel rank of each layer part: 1, or the world size / `mp_degree`
    /// (then `dp_degree` 1).
    pub sharding_degree: usize,
}

/// A rank's place in the `dp_degree` × `pp_degree` × `mp_degree` grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridPlace {
    /// The replica of the pipeline.
    pub replica: usize,
    /// The pipeline stage.
    pub stage: usize,
    /// The part of the stage's split layers (0 where they are whole).
    pub part: usize,
}

/// Where each rank sits in the `dp_degree` × `pp_degree` × `mp_degree` grid, defined once:
/// ranks are numbered replica-major, then by stage, the layer group innermost (Megatron's
/// order: a stage's parts consecutive, so on one node), rank `(r·p + s)·mp + k` holding part
/// `k` of stage `s` of replica `r`.
impl HybridConfigs {
    /// The layer group's size (1: layers whole).
    fn parts(&self) -> usize {
        self.mp_degree.max(1)
    }

    /// Replicas of the pipeline (of the model, without one): `dp_degree`, times
    /// `sharding_degree` where the states are sharded over replicas Paddle counts apart.
    pub fn replicas(&self) -> usize {
        self.dp_degree * self.sharding_degree.max(1)
    }

    /// Rank `rank`'s place.
    pub fn place_of(&self, rank: usize) -> GridPlace {
        let (group, part) = (rank / self.parts(), rank % self.parts());
        GridPlace {
            replica: group / self.pp_degree,
            stage: group % self.pp_degree,
            part,
        }
    }

    /// The rank at `place`.
    pub fn rank_of(&self, place: GridPlace) -> usize {
        (place.replica * self.pp_degree + place.stage) * self.parts() + place.part
    }

    /// The ranks holding part `part` of `stage`, by replica: their data-parallel ring.
    pub fn replicas_of(&self, stage: usize, part: usize) -> Vec<usize> {
        (0..self.replicas())
            .map(|replica| self.rank_of(GridPlace { replica, stage, part }))
            .collect()
    }

    /// The ranks holding part `part` of `replica`'s stages, by stage: their stage rings.
    pub fn stages_of(&self, replica: usize, part: usize) -> Vec<usize> {
        (0..self.pp_degree)
            .map(|stage| self.rank_of(GridPlace { replica, stage, part }))
            .collect()
    }

    /// Every rank of `replica`, all of whose ranks must train for it to.
    pub fn ranks_of_replica(&self, replica: usize) -> std::ops::Range<usize> {
        let ranks = self.pp_degree * self.parts();
        replica * ranks..(replica + 1) * ranks
    }

    /// How errors and logs name rank `rank`: `rank 3 (stage 1 of replica 1)`, and with split
    /// layers `rank 3 (part 1 of stage 1 of replica 0)`.
    pub fn name_of(&self, rank: usize) -> String {
        let GridPlace { replica, stage, part } = self.place_of(rank);
        match self.parts() {
            1 => format!("rank {rank} (stage {stage} of replica {replica})"),
            _ => format!("rank {rank} (part {part} of stage {stage} of replica {replica})"),
        }
    }
}

impl Default for HybridConfigs {
    fn default() -> Self {
        Self {
            dp_degree: 1,
            pp_degree: 1,
            mp_degree: 1,
            sharding_degree: 1,
        }
    }
}

/// The degrees are at least 1 and their product is the world size.
fn check_degrees(hybrid: &HybridConfigs, world_size: usize) -> Result<(), FieldError> {
    let (dp, p) = (hybrid.dp_degree, hybrid.pp_degree);
    if dp == 0 || p == 0 {
        let key = if dp == 0 { "dp_degree" } else { "pp_degree" };
        return Err(FieldError::new(
            format!("strategy.hybrid_configs.{key}"),
            "must be at least 1, got 0",
        ));
    }
    // The pipeline's replicas: `dp_degree`, or `sharding_degree` where the shards' are counted
    // apart (the sharding keys check which).
    let (sharding, mp) = (hybrid.sharding_degree.max(1), hybrid.parts());
    if hybrid.replicas().checked_mul(p).and_then(|n| n.checked_mul(mp)) == Some(world_size) {
        return Ok(());
    }
    let degrees = [("dp", dp), ("sharding", sharding), ("pp", p), ("mp", mp)];
    let set: Vec<_> = degrees
        .iter()
        .filter(|&&(key, n)| n > 1 || key == "dp" || key == "pp")
        .collect();
    let names: Vec<String> = set.iter().map(|(key, _)| format!("{key}_degree")).collect();
    let values: Vec<String> = set.iter().map(|(_, n)| n.to_string()).collect();
    Err(FieldError::new(
        "strategy.hybrid_configs",
        format!(
            "{} = {} must equal the world size {world_size}",
            names.join(" × "),
            values.join(" × ")
        ),
    ))
}

impl PipelineConfigs {
    /// Range and consistency checks, given the hybrid layout, the world size and the global
    /// batch.
    pub(crate) fn check(&self, hybrid: &HybridConfigs, world_size: usize, batch_size: usize) -> Result<(), FieldError> {
        let (d, p) = (hybrid.replicas(), hybrid.pp_degree);
        check_degrees(hybrid, world_size)?;
        let m = self.accumulate_steps;
        if m == 0 {
            return Err(FieldError::new(
                "strategy.pipeline_configs.accumulate_steps",
                "must be at least 1, got 0",
            ));
        }
        let v = self.virtual_pipeline_stages;
        if v == 0 {
            return Err(FieldError::new(
                "strategy.pipeline_configs.virtual_pipeline_stages",
                "must be at least 1, got 0",
            ));
        }
        if v > 1 && self.schedule_mode == ScheduleMode::FThenB {
            return Err(FieldError::new(
                "strategy.pipeline_configs.virtual_pipeline_stages",
                format!("{v} virtual stages interleave 1F1B; schedule_mode = \"FThenB\" cannot interleave"),
            ));
        }
        if v > 1 && !m.is_multiple_of(p) {
            return Err(FieldError::new(
                "strategy.pipeline_configs.accumulate_steps",
                format!("interleaving needs the micro-batch count ({m}) to be a multiple of pp_degree ({p})"),
            ));
        }
        let replica_batch = batch_size / d;
        if !batch_size.is_multiple_of(d) || !replica_batch.is_multiple_of(m) {
            return Err(FieldError::new(
                "strategy.pipeline_configs.accumulate_steps",
                format!(
                    "the global batch {batch_size} does not split into dp_degree {d} × {m} micro-batches of equal size"
                ),
            ));
        }
        if let Some(size) = self.micro_batch_size {
            if size != replica_batch / m {
                return Err(FieldError::new(
                    "strategy.pipeline_configs.micro_batch_size",
                    format!(
                        "{size} contradicts train.batch_size / (dp_degree × accumulate_steps) = {batch_size} / ({d} × {m}) = {}",
                        replica_batch / m
                    ),
                ));
            }
        }
        if !self.stage_boundaries.is_empty() && self.stage_boundaries.len() + 1 != p * v {
            return Err(FieldError::new(
                "strategy.pipeline_configs.stage_boundaries",
                format!(
                    "{} boundaries give {} stages, the pipeline has pp_degree × virtual_pipeline_stages = {}",
                    self.stage_boundaries.len(),
                    self.stage_boundaries.len() + 1,
                    p * v
                ),
            ));
        }
        Ok(())
    }
}
