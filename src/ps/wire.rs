//! The parameter servers' protocol: what trainers ask of a shard and what it answers.
//!
//! In a simulated cluster these values travel as actor messages; between processes each is one
//! [`Frame`]: a small postcard header carrying the counts, then the ids (u64 LE) and the values
//! (f32 LE) as raw bytes, so a pull of a hundred thousand rows never goes through a serializer.
//! Decoding checks the payload against the counts, so a torn or malicious frame is an error,
//! never misread floats.

use anyhow::{bail, ensure, Result};
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::checkpoint::FileRecord;
use crate::net::frame::encode_with;
use crate::net::Frame;

/// Rows of the sparse tables and the dense slice a trainer needs from one shard.
#[derive(Debug, Clone, PartialEq)]
pub struct PullRequest {
    /// The asking trainer.
    pub trainer: usize,
    /// Sync mode: the number of applied steps the answer must include (the trainer's step);
    /// the shard holds the answer until it has applied that many. Ignored in async and geo.
    pub version: u64,
    /// Wait until every trainer has ended training (for the final evaluation).
    pub after_training: bool,
    /// For a training step (rows not held read as their initial values, unless an entry rule
    /// keeps them out) or for evaluation (they read as zeros). Nothing is created either way.
    pub training: bool,
    /// Ids to pull, per table (table index = position).
    pub ids: Vec<Vec<u64>>,
    /// Whether to send this shard's dense slice.
    pub dense: bool,
}

/// A shard's answer to a [`PullRequest`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PulledRows {
    /// Per table, the rows of the requested ids in request order (`ids × width` values).
    pub rows: Vec<Vec<f32>>,
    /// The dense slice, empty unless requested.
    pub dense: Vec<f32>,
}

/// What a push carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateKind {
    /// Gradients of one step (sync and async): the shard's optimizer applies them.
    Gradients,
    /// Parameter deltas of `k_steps` local steps (geo): the shard adds their mean.
    Deltas,
}

/// One trainer's update for one shard.
#[derive(Debug, Clone, PartialEq)]
pub struct PushRequest {
    /// The pushing trainer.
    pub trainer: usize,
    /// The trainer's step; with `trainer` it makes a retried push idempotent.
    pub step: u64,
    /// Gradients or deltas.
    pub kind: UpdateKind,
    /// Ids per table.
    pub ids: Vec<Vec<u64>>,
    /// Per table, `ids × width` values.
    pub values: Vec<Vec<f32>>,
    /// Per table, each id's shows and clicks in the pushed samples (`2 × ids`), for tables
    /// with a row policy; empty for the others.
    pub counts: Vec<Vec<f32>>,
    /// Values for the whole dense slice of the shard.
    pub dense: Vec<f32>,
}

/// A request to a shard.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Read rows and the dense slice.
    Pull(PullRequest),
    /// Apply an update.
    Push(PushRequest),
    /// The trainer has pushed its last update.
    EndTraining {
        /// Which trainer.
        trainer: usize,
    },
    /// The trainer will send nothing more; the shard exits once every trainer has left.
    Leave {
        /// Which trainer.
        trainer: usize,
    },
    /// Write the shard's tables and dense slice to `path` (safetensors).
    Save {
        /// File to write, on the shard's machine.
        path: String,
    },
    /// Report the tables' sizes.
    Stats,
    /// Trainer `trainer` has pushed its steps before `step` and waits for the checkpoint after
    /// them: once every trainer has asked, the shard writes its part into the checkpoint
    /// directory `dir` and answers them all — the quiesce point of every mode.
    Checkpoint {
        /// The job's checkpoint directory, on the shard's machine.
        dir: String,
        /// The step the checkpoint is taken after.
        step: u64,
        /// The asking trainer.
        trainer: usize,
        /// The trainer's own files of this checkpoint (geo's local optimizer state).
        files: Vec<FileRecord>,
    },
    /// Trainer `trainer`'s scores of its share of the held-out data, sent to shard 0 once it
    /// ended training; once every trainer has sent its share, shard 0 answers them all with the
    /// AUC over the whole held-out set.
    Evaluated {
        /// The sending trainer.
        trainer: usize,
        /// Its predicted click probabilities.
        scores: Vec<f32>,
        /// The samples' labels, 0.0 or 1.0.
        labels: Vec<f32>,
    },
}

/// What one shard holds and has applied.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShardStats {
    /// Each table's size.
    pub tables: Vec<TableStats>,
    /// Updates applied in the run's lineage: sync steps, or pushes (async and geo) — each
    /// trainer's push of each step once, however often the job rolled back.
    pub updates_applied: u64,
}

/// One table's size on one shard, and what its row policy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TableStats {
    /// Rows held.
    pub rows: u64,
    /// Bytes allocated for them and their index.
    pub bytes: u64,
    /// Rows stored under the policy's entry rule.
    pub admitted: u64,
    /// Rows evicted to stay under the memory cap.
    pub evicted: u64,
    /// Rows deleted at the end of a pass.
    pub deleted: u64,
}

impl TableStats {
    /// Table `table`'s figures summed over the shards' `stats`.
    pub fn total(stats: &[ShardStats], table: usize) -> Self {
        stats
            .iter()
            .filter_map(|shard| shard.tables.get(table))
            .fold(Self::default(), |sum, t| Self {
                rows: sum.rows + t.rows,
                bytes: sum.bytes + t.bytes,
                admitted: sum.admitted + t.admitted,
                evicted: sum.evicted + t.evicted,
                deleted: sum.deleted + t.deleted,
            })
    }
}

/// A request from a trainer to a shard in its process (or from the shard's TCP endpoint, for a
/// trainer elsewhere); every request gets an answer, a refusal carrying the reason.
#[derive(actix::Message, Debug, Clone, PartialEq)]
#[rtype(result = "Result<Reply>")]
pub struct ShardCall {
    /// The generation of the job the trainer is in (0 until a rollback): a shard refuses the
    /// requests of a generation it rolled back from, so nothing sent before a rollback is
    /// applied after it.
    pub generation: u64,
    /// What the trainer asks.
    pub request: Request,
}

impl ShardCall {
    /// `request`, sent in the job's first generation.
    pub fn first(request: Request) -> Self {
        Self { generation: 0, request }
    }
}

/// A request frame's header: the generation of the sending trainer, then the request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stamped {
    generation: u64,
    header: Header,
}

/// A shard's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Answer to a pull.
    Rows(PulledRows),
    /// Answer to [`Request::Stats`].
    Stats(ShardStats),
    /// Answer to [`Request::Checkpoint`]: the file the shard wrote, then every trainer's.
    Checkpointed(Vec<FileRecord>),
    /// Answer to [`Request::Evaluated`]: the held-out set's AUC over every trainer's share.
    Evaluation {
        /// `None` when it is undefined (one class only, or no samples).
        auc: Option<f64>,
        /// Samples scored by all trainers together.
        samples: u64,
    },
    /// Any other request was carried out.
    Done,
}

/// The typed header of a parameter-server frame; counts describe the raw payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Header {
    Pull {
        trainer: u32,
        version: u64,
        after_training: bool,
        training: bool,
        ids: Vec<u32>,
        dense: bool,
    },
    Push {
        trainer: u32,
        step: u64,
        kind: UpdateKind,
        ids: Vec<u32>,
        values: Vec<u32>,
        counts: Vec<u32>,
        dense: u32,
    },
    EndTraining {
        trainer: u32,
    },
    Leave {
        trainer: u32,
    },
    Save {
        path: String,
    },
    Stats,
    Checkpoint {
        dir: String,
        step: u64,
        trainer: u32,
        files: Vec<FileRecord>,
    },
    Evaluated {
        trainer: u32,
        samples: u32,
    },
    Checkpointed(Vec<FileRecord>),
    Evaluation {
        auc: Option<f64>,
        samples: u64,
    },
    TableStats {
        tables: Vec<TableStats>,
        applied: u64,
    },
    Rows {
        rows: Vec<u32>,
        dense: u32,
    },
    Done,
    Failed {
        reason: String,
    },
}

/// Encodes a call as a frame body.
pub fn encode_request(call: &ShardCall) -> Result<Bytes> {
    let stamped = |header| Stamped {
        generation: call.generation,
        header,
    };
    let header = match &call.request {
        Request::Pull(pull) => {
            let len = pull.ids.iter().map(|ids| ids.len() * 8).sum();
            let header = Header::Pull {
                trainer: pull.trainer as u32,
                version: pull.version,
                after_training: pull.after_training,
                training: pull.training,
                ids: counts(pull.ids.iter().map(Vec::len))?,
                dense: pull.dense,
            };
            return encode_with(&stamped(header), len, |out| put_ids(out, &pull.ids));
        }
        Request::Push(push) => {
            let len = push.ids.iter().map(|ids| ids.len() * 8).sum::<usize>()
                + push
                    .values
                    .iter()
                    .chain(&push.counts)
                    .chain(std::iter::once(&push.dense))
                    .map(|v| v.len() * 4)
                    .sum::<usize>();
            let header = Header::Push {
                trainer: push.trainer as u32,
                step: push.step,
                kind: push.kind,
                ids: counts(push.ids.iter().map(Vec::len))?,
                values: counts(push.values.iter().map(Vec::len))?,
                counts: counts(push.counts.iter().map(Vec::len))?,
                dense: count(push.dense.len())?,
            };
            return encode_with(&stamped(header), len, |out| {
                put_ids(out, &push.ids);
                for values in push.values.iter().chain(&push.counts) {
                    put_floats(out, values);
                }
                put_floats(out, &push.dense);
            });
        }
        Request::EndTraining { trainer } => Header::EndTraining {
            trainer: *trainer as u32,
        },
        Request::Leave { trainer } => Header::Leave {
            trainer: *trainer as u32,
        },
        Request::Save { path } => Header::Save { path: path.clone() },
        Request::Stats => Header::Stats,
        Request::Checkpoint {
            dir,
            step,
            trainer,
            files,
        } => Header::Checkpoint {
            dir: dir.clone(),
            step: *step,
            trainer: *trainer as u32,
            files: files.clone(),
        },
        Request::Evaluated {
            trainer,
            scores,
            labels,
        } => {
            anyhow::ensure!(
                scores.len() == labels.len(),
                "{} scores for {} labels",
                scores.len(),
                labels.len()
            );
            let header = Header::Evaluated {
                trainer: *trainer as u32,
                samples: count(scores.len())?,
            };
            return encode_with(&stamped(header), scores.len() * 8, |out| {
                put_floats(out, scores);
                put_floats(out, labels);
            });
        }
    };
    encode_with(&stamped(header), 0, |_| {})
}

/// Decodes a request frame body.
pub fn decode_request(body: Bytes) -> Result<ShardCall> {
    let frame = Frame::<Stamped>::decode(body)?;
    let mut payload = Payload::new(frame.payload);
    let request = match frame.header.header {
        Header::Pull {
            trainer,
            version,
            after_training,
            training,
            ids,
            dense,
        } => Request::Pull(PullRequest {
            trainer: trainer as usize,
            version,
            after_training,
            training,
            ids: ids.iter().map(|&n| payload.ids(n)).collect::<Result<_>>()?,
            dense,
        }),
        Header::Push {
            trainer,
            step,
            kind,
            ids,
            values,
            counts,
            dense,
        } => Request::Push(PushRequest {
            trainer: trainer as usize,
            step,
            kind,
            ids: ids.iter().map(|&n| payload.ids(n)).collect::<Result<_>>()?,
            values: values.iter().map(|&n| payload.floats(n)).collect::<Result<_>>()?,
            counts: counts.iter().map(|&n| payload.floats(n)).collect::<Result<_>>()?,
            dense: payload.floats(dense)?,
        }),
        Header::EndTraining { trainer } => Request::EndTraining {
            trainer: trainer as usize,
        },
        Header::Leave { trainer } => Request::Leave {
            trainer: trainer as usize,
        },
        Header::Save { path } => Request::Save { path },
        Header::Stats => Request::Stats,
        Header::Checkpoint {
            dir,
            step,
            trainer,
            files,
        } => Request::Checkpoint {
            dir,
            step,
            trainer: trainer as usize,
            files,
        },
        Header::Evaluated { trainer, samples } => Request::Evaluated {
            trainer: trainer as usize,
            scores: payload.floats(samples)?,
            labels: payload.floats(samples)?,
        },
        other => bail!("malformed request: a {} frame is an answer", header_name(&other)),
    };
    payload.finish()?;
    Ok(ShardCall {
        generation: frame.header.generation,
        request,
    })
}

/// Encodes a shard's answer, or its refusal with the reason, as a frame body.
pub fn encode_reply(reply: &Result<Reply>) -> Result<Bytes> {
    let header = match reply {
        Ok(Reply::Rows(rows)) => {
            let len = rows
                .rows
                .iter()
                .chain(std::iter::once(&rows.dense))
                .map(|v| v.len() * 4)
                .sum();
            let header = Header::Rows {
                rows: counts(rows.rows.iter().map(Vec::len))?,
                dense: count(rows.dense.len())?,
            };
            return encode_with(&header, len, |out| {
                for values in &rows.rows {
                    put_floats(out, values);
                }
                put_floats(out, &rows.dense);
            });
        }
        Ok(Reply::Stats(stats)) => Header::TableStats {
            tables: stats.tables.clone(),
            applied: stats.updates_applied,
        },
        Ok(Reply::Checkpointed(records)) => Header::Checkpointed(records.clone()),
        Ok(Reply::Evaluation { auc, samples }) => Header::Evaluation {
            auc: *auc,
            samples: *samples,
        },
        Ok(Reply::Done) => Header::Done,
        Err(e) => Header::Failed {
            reason: format!("{e:#}"),
        },
    };
    encode_with(&header, 0, |_| {})
}

/// Decodes a shard's answer; a refusal becomes an error carrying the shard's reason.
pub fn decode_reply(body: Bytes) -> Result<Reply> {
    let frame = Frame::<Header>::decode(body)?;
    let mut payload = Payload::new(frame.payload);
    let reply = match frame.header {
        Header::Rows { rows, dense } => Reply::Rows(PulledRows {
            rows: rows.iter().map(|&n| payload.floats(n)).collect::<Result<_>>()?,
            dense: payload.floats(dense)?,
        }),
        Header::TableStats { tables, applied } => Reply::Stats(ShardStats {
            tables,
            updates_applied: applied,
        }),
        Header::Checkpointed(records) => Reply::Checkpointed(records),
        Header::Evaluation { auc, samples } => Reply::Evaluation { auc, samples },
        Header::Done => Reply::Done,
        Header::Failed { reason } => bail!("{reason}"),
        other => bail!("malformed answer: a {} frame is a request", header_name(&other)),
    };
    payload.finish()?;
    Ok(reply)
}

fn header_name(header: &Header) -> &'static str {
    match header {
        Header::Pull { .. } => "pull",
        Header::Push { .. } => "push",
        Header::EndTraining { .. } => "end-of-training",
        Header::Leave { .. } => "leave",
        Header::Save { .. } => "save",
        Header::Stats => "stats",
        Header::Checkpoint { .. } => "checkpoint",
        Header::Checkpointed(_) => "checkpointed",
        Header::Evaluated { .. } => "evaluated",
        Header::Evaluation { .. } => "evaluation",
        Header::TableStats { .. } => "table-stats",
        Header::Rows { .. } => "rows",
        Header::Done => "done",
        Header::Failed { .. } => "failed",
    }
}

fn count(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| anyhow::anyhow!("{n} values do not fit in one frame"))
}

fn counts(lens: impl Iterator<Item = usize>) -> Result<Vec<u32>> {
    lens.map(count).collect()
}

// The wire is little-endian; on such hosts values are copied as they lie in memory.
#[cfg(not(target_endian = "little"))]
compile_error!("the parameter-server wire format copies little-endian memory as is");

fn put_ids(out: &mut BytesMut, tables: &[Vec<u64>]) {
    for ids in tables {
        out.extend_from_slice(bytemuck::cast_slice(ids));
    }
}

fn put_floats(out: &mut BytesMut, values: &[f32]) {
    out.extend_from_slice(bytemuck::cast_slice(values));
}

/// The raw part of a frame, consumed in order against the header's counts.
struct Payload {
    bytes: Bytes,
    offset: usize,
}

impl Payload {
    fn new(bytes: Bytes) -> Self {
        Self { bytes, offset: 0 }
    }

    fn take(&mut self, len: usize) -> Result<&[u8]> {
        let end = self.offset.checked_add(len).filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            bail!(
                "malformed frame: the header announces {len} more payload bytes, {} are left",
                self.bytes.len() - self.offset
            );
        };
        let slice = &self.bytes[self.offset..end];
        self.offset = end;
        Ok(slice)
    }

    // Received bytes need not be aligned for u64/f32: `pod_collect_to_vec` copies into an
    // aligned vector either way.
    fn ids(&mut self, n: u32) -> Result<Vec<u64>> {
        Ok(bytemuck::pod_collect_to_vec(self.take(n as usize * 8)?))
    }

    fn floats(&mut self, n: u32) -> Result<Vec<f32>> {
        Ok(bytemuck::pod_collect_to_vec(self.take(n as usize * 4)?))
    }

    fn finish(self) -> Result<()> {
        ensure!(
            self.offset == self.bytes.len(),
            "malformed frame: {} payload bytes beyond what the header announces",
            self.bytes.len() - self.offset
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    fn push() -> Request {
        Request::Push(PushRequest {
            trainer: 2,
            step: 17,
            kind: UpdateKind::Gradients,
            ids: vec![vec![1, u64::MAX], vec![]],
            values: vec![vec![0.5, -1.0, 2.0, 3.0], vec![]],
            counts: vec![vec![3.0, 1.0, 1.0, 0.0], vec![]],
            dense: vec![1.0, 2.0, 3.0],
        })
    }

    #[test]
    fn requests_and_replies_round_trip() -> Result<()> {
        let pull = Request::Pull(PullRequest {
            trainer: 1,
            version: 9,
            after_training: true,
            training: false,
            ids: vec![vec![5, 6, 7], vec![8]],
            dense: true,
        });
        for request in [
            pull,
            push(),
            Request::Leave { trainer: 3 },
            Request::Save { path: "x".into() },
            Request::Stats,
            Request::Evaluated {
                trainer: 1,
                scores: vec![0.5, 0.25],
                labels: vec![1.0, 0.0],
            },
        ] {
            let call = ShardCall { generation: 3, request };
            assert_eq!(decode_request(encode_request(&call)?)?, call);
        }
        let rows = Reply::Rows(PulledRows {
            rows: vec![vec![1.0, 2.0], vec![]],
            dense: vec![4.0],
        });
        assert_eq!(decode_reply(encode_reply(&Ok(rows.clone()))?)?, rows);
        let stats = Reply::Stats(ShardStats {
            tables: vec![
                TableStats {
                    rows: 3,
                    bytes: 300,
                    admitted: 4,
                    evicted: 1,
                    deleted: 0,
                },
                TableStats::default(),
            ],
            updates_applied: 12,
        });
        assert_eq!(decode_reply(encode_reply(&Ok(stats.clone()))?)?, stats);
        let evaluation = Reply::Evaluation { auc: None, samples: 7 };
        assert_eq!(decode_reply(encode_reply(&Ok(evaluation.clone()))?)?, evaluation);
        let failed = decode_reply(encode_reply(&Err(anyhow::anyhow!("unknown table 3")))?).unwrap_err();
        assert_eq!(failed.to_string(), "unknown table 3");
        Ok(())
    }

    #[test]
    fn payload_that_disagrees_with_the_header_is_an_error() -> Result<()> {
        let body = encode_request(&ShardCall::first(push()))?;
        let short = body.slice(..body.len() - 4);
        let msg = decode_request(short).unwrap_err().to_string();
        assert!(
            msg.starts_with("malformed frame: the header announces 12 more payload bytes"),
            "{msg}"
        );
        let mut long = BytesMut::from(&body[..]);
        long.put_u8(0);
        assert!(decode_request(long.freeze()).is_err());
        let answer = encode_reply(&Ok(Reply::Done))?;
        assert!(decode_request(answer).is_err(), "an answer is no request");
        Ok(())
    }
}
