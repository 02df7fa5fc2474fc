//! A large pull or push cut into parts of disjoint rows, and the parts' answers put back
//! together. The parts travel pipelined on one connection, so the shard gathers (or applies)
//! one part while the line carries the next and the trainer reads the one before: one shard
//! serves a 25 MB pull with its two halves working at once instead of in turn.

use anyhow::{bail, Result};

use super::wire::{Part, PullRequest, PulledRows, PushRequest, Reply, Request};

/// Ids per part: 16 384 rows of 64 floats are 4 MiB, large enough that a part's fixed costs
/// (a frame, a mailbox hop) vanish, small enough that 100 000 rows make six parts.
pub const PART_IDS: usize = 1 << 14;

/// `request` as parts of at most about `part_ids` ids over all its tables (one part when it is
/// small, or not a pull or a whole push). Each table's ids are cut into the same number of
/// contiguous runs; the dense slice travels with part 0.
pub fn split(request: Request, part_ids: usize) -> Vec<Request> {
    let parts = parts_of(&request, part_ids);
    match request {
        Request::Pull(pull) if parts > 1 => (0..parts)
            .map(|k| {
                Request::Pull(PullRequest {
                    ids: pull.ids.iter().map(|ids| run(ids, k, parts, 1).to_vec()).collect(),
                    dense: pull.dense && k == 0,
                    ..pull.clone()
                })
            })
            .collect(),
        Request::Push(push) if parts > 1 => (0..parts)
            .map(|k| {
                let cut = |rows: &[Vec<f32>]| -> Vec<Vec<f32>> {
                    push.ids
                        .iter()
                        .zip(rows)
                        .map(|(ids, values)| run(values, k, parts, values.len() / ids.len().max(1)).to_vec())
                        .collect()
                };
                Request::Push(PushRequest {
                    trainer: push.trainer,
                    step: push.step,
                    part: Part {
                        index: k as u32,
                        of: parts as u32,
                    },
                    kind: push.kind,
                    ids: push.ids.iter().map(|ids| run(ids, k, parts, 1).to_vec()).collect(),
                    values: cut(&push.values),
                    counts: cut(&push.counts),
                    dense: if k == 0 { push.dense.clone() } else { Vec::new() },
                    stop: push.stop,
                })
            })
            .collect(),
        whole => vec![whole],
    }
}

/// How many parts `request` travels in: one unless it is a pull or a whole, well-formed push
/// of more than `part_ids` ids (a malformed push goes whole, for the shard to name its fault).
fn parts_of(request: &Request, part_ids: usize) -> usize {
    let ids = match request {
        Request::Pull(pull) => pull.ids.iter().map(Vec::len).sum(),
        Request::Push(push) if push.part == Part::WHOLE => {
            let rows_of = |per_table: &[Vec<f32>]| {
                per_table.len() == push.ids.len()
                    && push
                        .ids
                        .iter()
                        .zip(per_table)
                        .all(|(ids, values)| values.len() == ids.len() * (values.len() / ids.len().max(1)))
            };
            let well_formed = rows_of(&push.values) && (push.counts.is_empty() || rows_of(&push.counts));
            if !well_formed {
                return 1;
            }
            push.ids.iter().map(Vec::len).sum()
        }
        _ => 0,
    };
    ids.div_ceil(part_ids.max(1)).clamp(1, Part::MOST as usize)
}

/// The `k`-th of `parts` contiguous runs of a table whose rows are `per_row` values each (none
/// when it holds no values): part `k` of every section of a table covers the same rows.
fn run<T>(values: &[T], k: usize, parts: usize, per_row: usize) -> &[T] {
    if per_row == 0 {
        return &[];
    }
    let rows = values.len() / per_row;
    let size = rows.div_ceil(parts);
    let start = (k * size).min(rows);
    let end = ((k + 1) * size).min(rows);
    &values[start * per_row..end * per_row]
}

/// The answers to the parts of one request, joined as they arrive: a pull's rows appended in
/// part order to the first part's (reserved for the whole pull once the first part shows the
/// tables' widths, so nothing is copied twice), pushes' `Done`s to one `Done`. The first
/// refusal stands for the whole.
pub struct Joined {
    /// Ids per table of the whole pull, and of its first part (empty for a push).
    whole_ids: Vec<usize>,
    first_ids: Vec<usize>,
    state: Option<Result<Reply>>,
}

impl Joined {
    /// Ready for the answers to the parts of `whole`.
    pub fn new<'a>(parts: impl IntoIterator<Item = &'a Request>) -> Self {
        let mut per_part = parts.into_iter().map(|part| match part {
            Request::Pull(pull) => pull.ids.iter().map(Vec::len).collect(),
            _ => Vec::new(),
        });
        let first_ids: Vec<usize> = per_part.next().unwrap_or_default();
        let mut whole_ids = first_ids.clone();
        for ids in per_part {
            for (sum, ids) in whole_ids.iter_mut().zip(ids) {
                *sum += ids;
            }
        }
        Self {
            whole_ids,
            first_ids,
            state: None,
        }
    }

    /// The rows the next part's answer is to be appended to: those of the parts so far.
    pub fn rows_so_far(&mut self) -> Option<PulledRows> {
        match &mut self.state {
            Some(Ok(Reply::Rows(rows))) => Some(std::mem::take(rows)),
            _ => None,
        }
    }

    /// Takes the next part's answer (rows appended to [`Joined::rows_so_far`]).
    pub fn add(&mut self, answer: Result<Reply>) {
        let first = self.state.is_none();
        self.state = Some(match (self.state.take(), answer) {
            (Some(Err(e)), _) | (_, Err(e)) => Err(e),
            (None, Ok(Reply::Rows(mut rows))) => {
                // The first part's rows show the tables' widths, which size the whole.
                for ((values, &whole), &first) in rows.rows.iter_mut().zip(&self.whole_ids).zip(&self.first_ids) {
                    let width = values.len().checked_div(first).unwrap_or(0);
                    values.reserve(whole.saturating_mul(width).saturating_sub(values.len()));
                }
                Ok(Reply::Rows(rows))
            }
            (Some(Ok(Reply::Rows(_))), Ok(Reply::Rows(rows))) => Ok(Reply::Rows(rows)),
            (None | Some(Ok(Reply::Done)), Ok(Reply::Done)) => Ok(Reply::Done),
            (_, Ok(other)) if first => Ok(other),
            (_, Ok(_)) => Err(anyhow::anyhow!(
                "the parts of one request were answered differently (rows for some, none for others)"
            )),
        });
    }

    /// The answer to the whole request.
    pub fn finish(self) -> Result<Reply> {
        self.state.unwrap_or_else(|| bail!("a request of no parts"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::wire::UpdateKind;

    fn push() -> PushRequest {
        PushRequest {
            trainer: 1,
            step: 4,
            part: Part::WHOLE,
            kind: UpdateKind::Gradients,
            ids: vec![(0..10).collect(), vec![100, 101, 102]],
            values: vec![(0..20).map(|v| v as f32).collect(), vec![1.0, 2.0, 3.0]],
            counts: vec![(0..20).map(|v| v as f32).collect(), Vec::new()],
            dense: vec![7.0, 8.0],
            stop: true,
        }
    }

    #[test]
    fn a_push_splits_into_disjoint_runs_that_join_to_the_whole() {
        let whole = push();
        let parts = split(Request::Push(whole.clone()), 4);
        assert_eq!(parts.len(), 4, "13 ids in parts of at most 4");
        let mut joined = PushRequest {
            part: Part::WHOLE,
            ids: vec![Vec::new(); 2],
            values: vec![Vec::new(); 2],
            counts: vec![Vec::new(); 2],
            dense: Vec::new(),
            ..whole.clone()
        };
        for (k, part) in parts.into_iter().enumerate() {
            let Request::Push(part) = part else { panic!("a push") };
            assert_eq!(part.part, Part { index: k as u32, of: 4 });
            assert_eq!(part.dense.is_empty(), k > 0, "dense with part 0 only");
            joined.dense.extend(part.dense);
            for t in 0..2 {
                assert_eq!(part.values[t].len(), part.ids[t].len() * [2, 1][t]);
                joined.ids[t].extend(&part.ids[t]);
                joined.values[t].extend(&part.values[t]);
                joined.counts[t].extend(&part.counts[t]);
            }
        }
        assert_eq!(joined, whole);
    }

    #[test]
    fn pull_answers_join_in_part_order() -> Result<()> {
        let pull = Request::Pull(PullRequest {
            trainer: 0,
            version: 3,
            after_training: false,
            training: true,
            ids: vec![(0..5).collect()],
            dense: true,
        });
        let parts = split(pull, 2);
        assert_eq!(parts.len(), 3);
        let mut joined = Joined::new(&parts);
        for part in &parts {
            let Request::Pull(part) = part else { panic!("a pull") };
            // As the wire's reader does: the part's rows appended to those so far.
            let mut rows = joined.rows_so_far().unwrap_or_else(|| PulledRows {
                rows: vec![Vec::new()],
                ..PulledRows::default()
            });
            rows.rows[0].extend(part.ids[0].iter().flat_map(|&id| [id as f32, -(id as f32)]));
            if part.dense {
                rows.dense.push(9.0);
            }
            joined.add(Ok(Reply::Rows(rows)));
        }
        let Reply::Rows(rows) = joined.finish()? else {
            panic!("rows")
        };
        let expected: Vec<f32> = (0..5).flat_map(|id| [id as f32, -(id as f32)]).collect();
        assert_eq!(rows.rows, vec![expected]);
        assert!(rows.rows[0].capacity() == 10, "reserved once for the whole");
        assert_eq!(rows.dense, vec![9.0]);
        let mut done = Joined::new(&[Request::Stats, Request::Stats]);
        done.add(Ok(Reply::Done));
        done.add(Ok(Reply::Done));
        assert!(matches!(done.finish()?, Reply::Done));
        let mut mixed = Joined::new(&[Request::Stats, Request::Stats]);
        mixed.add(Ok(Reply::Done));
        mixed.add(Ok(Reply::Stats(Default::default())));
        assert!(mixed.finish().is_err());
        let mut refused = Joined::new(&[Request::Stats, Request::Stats]);
        refused.add(Err(anyhow::anyhow!("no such table")));
        refused.add(Ok(Reply::Done));
        assert_eq!(refused.finish().unwrap_err().to_string(), "no such table");
        Ok(())
    }

    #[test]
    fn small_requests_and_parts_stay_whole() {
        let mut part = push();
        part.part = Part { index: 0, of: 2 };
        assert_eq!(split(Request::Push(part), 1).len(), 1, "a part is not cut again");
        assert_eq!(split(Request::Push(push()), 13).len(), 1);
        assert_eq!(split(Request::Stats, 1).len(), 1);
    }
}
