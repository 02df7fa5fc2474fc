//! Pipeline schedules: the order in which each stage runs the forward and backward passes of
//! the micro-batches, for GPipe (`FThenB`), `1F1B` and interleaved 1F1B (Narayanan et al. 2021,
//! "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM").
//!
//! With `v` virtual stages (model chunks) per stage, the model is cut into `p·v` chunks and
//! chunk `c` of stage `s` is virtual stage `c·p + s`: a micro-batch visits stages
//! 0, 1, …, p−1, 0, 1, … in its forward pass and the reverse in its backward pass.

use anyhow::{bail, ensure, Result};

/// How micro-batches are interleaved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// GPipe: every forward, then every backward; activations of all `m` micro-batches live
    /// at once.
    FThenB,
    /// One forward, one backward in the steady state; at most `p − s` micro-batches in flight
    /// on stage `s`.
    OneFOneB,
    /// 1F1B over `v` model chunks per stage; the bubble shrinks by `v` at the cost of `v`
    /// times the transfers.
    Interleaved {
        /// Model chunks per stage (`virtual_pipeline_stages`), at least 2.
        virtual_stages: usize,
    },
}

impl ScheduleKind {
    /// Model chunks per stage.
    pub fn virtual_stages(self) -> usize {
        match self {
            Self::Interleaved { virtual_stages } => virtual_stages,
            Self::FThenB | Self::OneFOneB => 1,
        }
    }

    /// The bubble in Megatron's terms, idle time over ideal compute time, for equal stages:
    /// `(p − 1) / (v·m)`.
    pub fn theoretical_bubble(self, stages: usize, micro_batches: usize) -> f64 {
        (stages.saturating_sub(1)) as f64 / (self.virtual_stages() * micro_batches.max(1)) as f64
    }
}

/// One step of a stage's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Forward pass of micro-batch `micro` through the stage's model chunk `chunk`.
    Forward {
        /// Micro-batch index.
        micro: usize,
        /// Model chunk of this stage.
        chunk: usize,
    },
    /// Backward pass of micro-batch `micro` through the stage's model chunk `chunk`.
    Backward {
        /// Micro-batch index.
        micro: usize,
        /// Model chunk of this stage.
        chunk: usize,
    },
}

/// The ops of `stage` (of `stages`) for `micro_batches` micro-batches under `kind`, in order.
pub fn stage_ops(kind: ScheduleKind, stages: usize, micro_batches: usize, stage: usize) -> Result<Vec<Op>> {
    let (p, m) = (stages, micro_batches);
    ensure!(
        p >= 1 && m >= 1,
        "a pipeline needs at least one stage and one micro-batch"
    );
    ensure!(stage < p, "stage {stage} is outside the {p} stages");
    match kind {
        ScheduleKind::FThenB => {
            let forwards = (0..m).map(|micro| Op::Forward { micro, chunk: 0 });
            let backwards = (0..m).map(|micro| Op::Backward { micro, chunk: 0 });
            Ok(forwards.chain(backwards).collect())
        }
        ScheduleKind::OneFOneB => Ok(one_f_one_b(p, m, stage)),
        ScheduleKind::Interleaved { virtual_stages } => interleaved(p, m, virtual_stages, stage),
    }
}

/// 1F1B: `p − s − 1` warm-up forwards, then alternate, then the remaining backwards.
fn one_f_one_b(p: usize, m: usize, s: usize) -> Vec<Op> {
    let warmup = (p - s - 1).min(m);
    let mut ops = Vec::with_capacity(2 * m);
    ops.extend((0..warmup).map(|micro| Op::Forward { micro, chunk: 0 }));
    for i in 0..m - warmup {
        ops.push(Op::Forward {
            micro: warmup + i,
            chunk: 0,
        });
        ops.push(Op::Backward { micro: i, chunk: 0 });
    }
    ops.extend((m - warmup..m).map(|micro| Op::Backward { micro, chunk: 0 }));
    ops
}

/// Interleaved 1F1B as in Megatron-LM: micro-batches go through the chunks in groups of `p`;
/// a stage warms up with `2(p − s − 1) + (v − 1)p` forwards, then alternates.
fn interleaved(p: usize, m: usize, v: usize, s: usize) -> Result<Vec<Op>> {
    if v < 2 {
        bail!("interleaving needs at least 2 virtual stages per stage, got {v}");
    }
    if !m.is_multiple_of(p) {
        bail!("interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of the stage count ({p})");
    }
    let total = m * v;
    // The k-th forward (or backward) of this stage: which micro-batch and which chunk.
    let nth = |k: usize, forward: bool| {
        let in_group = k % (p * v);
        let chunk = in_group / p;
        let chunk = if forward { chunk } else { v - 1 - chunk };
        let micro = (k / (p * v)) * p + k % p;
        (micro, chunk)
    };
    let warmup = if m == p {
        total
    } else {
        ((p - s - 1) * 2 + (v - 1) * p).min(total)
    };
    let mut ops = Vec::with_capacity(2 * total);
    let forward = |k: usize| {
        let (micro, chunk) = nth(k, true);
        Op::Forward { micro, chunk }
    };
    let backward = |k: usize| {
        let (micro, chunk) = nth(k, false);
        Op::Backward { micro, chunk }
    };
    ops.extend((0..warmup).map(forward));
    for i in 0..total - warmup {
        ops.push(forward(warmup + i));
        ops.push(backward(i));
    }
    ops.extend((total - warmup..total).map(backward));
    Ok(ops)
}

/// The outcome of running every stage's schedule with fixed op costs: a check that the
/// schedules fit together, and the figures they imply.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Time at which the last op ends.
    pub makespan: f64,
    /// Per stage, time not spent computing over the makespan.
    pub idle_fraction: Vec<f64>,
    /// Per stage, the most micro-batch chunks whose forward has run and backward not yet.
    pub peak_in_flight: Vec<usize>,
}

impl Simulation {
    /// Idle time over ideal compute time, averaged over stages (Megatron's bubble).
    pub fn bubble(&self) -> f64 {
        let busy = 1.0 - self.idle_fraction.iter().sum::<f64>() / self.idle_fraction.len().max(1) as f64;
        (1.0 - busy) / busy.max(f64::MIN_POSITIVE)
    }
}

/// Runs the schedules of all `stages` with forward cost `forward` and backward cost `backward`
/// per chunk (transfers free), each op starting once its stage is free and its input exists:
/// the forward of virtual stage `k` after the forward of `k − 1`, the backward of `k` after the
/// backward of `k + 1` (the last virtual stage's after its own forward). Fails if the schedules
/// deadlock or an op is missing or repeated.
pub fn simulate(
    kind: ScheduleKind,
    stages: usize,
    micro_batches: usize,
    forward: f64,
    backward: f64,
) -> Result<Simulation> {
    let (p, m) = (stages, micro_batches);
    let schedules = (0..p).map(|s| stage_ops(kind, p, m, s)).collect::<Result<Vec<_>>>()?;
    check_every_op_once(&schedules, m * kind.virtual_stages())?;
    let mut clock = Clock::new(p, m, kind.virtual_stages(), forward, backward);
    let mut next = vec![0usize; p];
    let mut remaining: usize = schedules.iter().map(Vec::len).sum();
    while remaining > 0 {
        let mut progressed = false;
        for s in 0..p {
            let Some(op) = schedules[s].get(next[s]).copied() else {
                continue;
            };
            let Some(ready) = clock.ready(op, s) else {
                continue;
            };
            clock.run(op, s, ready)?;
            next[s] += 1;
            remaining -= 1;
            progressed = true;
        }
        ensure!(
            progressed,
            "the {kind:?} schedules of {p} stages and {m} micro-batches deadlock"
        );
    }
    Ok(clock.simulation())
}

/// Every stage runs each of its `2 · chunk_passes` ops (a forward and a backward of each
/// micro-batch through each of its chunks) exactly once.
fn check_every_op_once(schedules: &[Vec<Op>], chunk_passes: usize) -> Result<()> {
    for (s, ops) in schedules.iter().enumerate() {
        let mut seen = std::collections::HashSet::new();
        for op in ops {
            ensure!(seen.insert(*op), "stage {s} runs {op:?} twice");
        }
        ensure!(
            ops.len() == 2 * chunk_passes,
            "stage {s} runs {} ops, expected {}",
            ops.len(),
            2 * chunk_passes
        );
    }
    Ok(())
}

/// The simulated time of every stage: when each pass ended, and what the stages did so far.
struct Clock {
    stages: usize,
    /// Virtual stages in all.
    chunks: usize,
    forward: f64,
    backward: f64,
    /// `done_f[micro][virtual stage]`: when that forward ended; `done_b` likewise.
    done_f: Vec<Vec<Option<f64>>>,
    done_b: Vec<Vec<Option<f64>>>,
    /// Per stage: when it is next free, its time computing, its forwards awaiting their
    /// backward now and at most.
    free_at: Vec<f64>,
    busy: Vec<f64>,
    in_flight: Vec<usize>,
    peak: Vec<usize>,
}

impl Clock {
    fn new(p: usize, m: usize, v: usize, forward: f64, backward: f64) -> Self {
        let chunks = p * v;
        Self {
            stages: p,
            chunks,
            forward,
            backward,
            done_f: vec![vec![None; chunks]; m],
            done_b: vec![vec![None; chunks]; m],
            free_at: vec![0.0; p],
            busy: vec![0.0; p],
            in_flight: vec![0; p],
            peak: vec![0; p],
        }
    }

    /// When `op`'s input exists on stage `s`, `None` while it does not.
    fn ready(&self, op: Op, s: usize) -> Option<f64> {
        match op {
            Op::Forward { micro, chunk } => {
                let k = chunk * self.stages + s;
                if k == 0 {
                    Some(0.0)
                } else {
                    self.done_f[micro][k - 1]
                }
            }
            Op::Backward { micro, chunk } => {
                let k = chunk * self.stages + s;
                if k + 1 == self.chunks {
                    self.done_f[micro][k]
                } else {
                    self.done_b[micro][k + 1]
                }
            }
        }
    }

    /// Runs `op` on stage `s` from when both the stage is free and its input is `ready`.
    fn run(&mut self, op: Op, s: usize, ready: f64) -> Result<()> {
        let start = ready.max(self.free_at[s]);
        let cost = match op {
            Op::Forward { .. } => self.forward,
            Op::Backward { .. } => self.backward,
        };
        let end = start + cost;
        match op {
            Op::Forward { micro, chunk } => {
                self.done_f[micro][chunk * self.stages + s] = Some(end);
                self.in_flight[s] += 1;
                self.peak[s] = self.peak[s].max(self.in_flight[s]);
            }
            Op::Backward { micro, chunk } => {
                ensure!(
                    self.done_f[micro][chunk * self.stages + s].is_some(),
                    "stage {s} runs {op:?} before its forward"
                );
                self.done_b[micro][chunk * self.stages + s] = Some(end);
                self.in_flight[s] -= 1;
            }
        }
        self.free_at[s] = end;
        self.busy[s] += cost;
        Ok(())
    }

    /// The figures of the schedules once every op ran.
    fn simulation(self) -> Simulation {
        let makespan = self.free_at.iter().copied().fold(0.0, f64::max);
        Simulation {
            makespan,
            idle_fraction: self.busy.iter().map(|b| 1.0 - b / makespan).collect(),
            peak_in_flight: self.peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ScheduleKind; 4] = [
        ScheduleKind::FThenB,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved { virtual_stages: 2 },
        ScheduleKind::Interleaved { virtual_stages: 3 },
    ];

    #[test]
    fn every_schedule_runs_without_deadlock_and_each_op_once() {
        for kind in KINDS {
            for p in 1..=5 {
                for m in 1..=12usize {
                    let interleaved = matches!(kind, ScheduleKind::Interleaved { .. });
                    if interleaved && !m.is_multiple_of(p) {
                        assert!(stage_ops(kind, p, m, 0).is_err(), "{kind:?} p={p} m={m}");
                        continue;
                    }
                    simulate(kind, p, m, 1.0, 2.0).unwrap_or_else(|e| panic!("{kind:?} p={p} m={m}: {e}"));
                }
            }
        }
    }

    #[test]
    fn bubbles_match_the_theory_for_equal_stages() {
        for (kind, p, m) in [
            (ScheduleKind::FThenB, 4, 8),
            (ScheduleKind::OneFOneB, 4, 8),
            (ScheduleKind::OneFOneB, 2, 8),
            (ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 8),
            (ScheduleKind::Interleaved { virtual_stages: 2 }, 2, 8),
        ] {
            let sim = simulate(kind, p, m, 1.0, 2.0).unwrap();
            let theory = kind.theoretical_bubble(p, m);
            assert!(
                (sim.bubble() - theory).abs() <= 1e-9 * theory.max(1.0),
                "{kind:?} p={p} m={m}: simulated {} theory {theory}",
                sim.bubble()
            );
        }
    }

    #[test]
    fn one_f_one_b_bounds_activations_where_gpipe_keeps_them_all() {
        let gpipe = simulate(ScheduleKind::FThenB, 4, 8, 1.0, 2.0).unwrap();
        assert_eq!(gpipe.peak_in_flight, vec![8, 8, 8, 8]);
        let one_f_one_b = simulate(ScheduleKind::OneFOneB, 4, 8, 1.0, 2.0).unwrap();
        assert_eq!(one_f_one_b.peak_in_flight, vec![4, 3, 2, 1]);
    }

    #[test]
    fn one_f_one_b_order_on_the_first_stage() {
        let ops = stage_ops(ScheduleKind::OneFOneB, 3, 4, 0).unwrap();
        let f = |micro| Op::Forward { micro, chunk: 0 };
        let b = |micro| Op::Backward { micro, chunk: 0 };
        assert_eq!(ops, vec![f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]);
    }
}
