//! The parameter servers' protocol: what trainers ask of a shard and what it answers.
//!
//! In a simulated cluster these values travel as actor messages; between processes each is one
//! frame ([`crate::net::frame_stream`]): a small postcard header carrying the counts, then the
//! ids (u64 LE) and the values (f32 LE) as raw bytes, written from and read into their vectors,
//! so a pull of a hundred thousand rows never goes through a serializer or a frame buffer.
//! Reading checks the payload against the counts, so a torn or malicious frame is an error,
//! never misread floats.

use std::io;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::checkpoint::FileRecord;
use crate::net::frame_stream::{malformed, read_frame, write_frame, PayloadReader};

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
    /// Sync mode: whether a trainer, or the shard, was asked to stop (preemption) in the step
    /// the rows were last updated by: every trainer hears it in the same step, and all stop
    /// after it.
    pub stop: bool,
}

/// What a push carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateKind {
    /// Gradients of one step (sync and async): the shard's optimizer applies them.
    Gradients,
    /// Parameter deltas of `k_steps` local steps (geo): the shard adds their mean.
    Deltas,
}

/// Which piece of a trainer's update for one step a push carries: a large update travels as
/// several pushes of disjoint rows, pipelined on the connection; the shard applies the step's
/// update once it holds every piece (sync) or each piece as it comes (async, geo).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    /// Position among the pieces, from 0.
    pub index: u32,
    /// Pieces of the update, at least 1.
    pub of: u32,
}

impl Part {
    /// The whole update in one push.
    pub const WHOLE: Self = Self { index: 0, of: 1 };
    /// The most parts an update may travel in (a shard keeps a flag per part).
    pub const MOST: u32 = 1 << 12;
}

/// One trainer's update (or a [`Part`] of it) for one shard.
#[derive(Debug, Clone, PartialEq)]
pub struct PushRequest {
    /// The pushing trainer.
    pub trainer: usize,
    /// The trainer's step; with `trainer` and `part` it makes a retried push idempotent.
    pub step: u64,
    /// Which piece of the trainer's update for this step this is.
    pub part: Part,
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
    /// Sync mode: whether the trainer was asked to stop (preemption); the shard tells every
    /// trainer, in its answers to the next step's pulls, that one was.
    pub stop: bool,
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
    /// Write the shard's tables and dense slice as `ps-shard-<index>.safetensors` in the run
    /// directory the shard was started with: a request never names a path the shard writes.
    Save,
    /// Report the tables' sizes.
    Stats,
    /// Trainer `trainer` has pushed its steps before `step` and waits for the checkpoint after
    /// them: once every trainer has asked, the shard writes its part into the checkpoint
    /// directory it was started with and answers them all — the quiesce point of every mode.
    Checkpoint {
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
        part: Part,
        kind: UpdateKind,
        ids: Vec<u32>,
        values: Vec<u32>,
        counts: Vec<u32>,
        dense: u32,
        stop: bool,
    },
    EndTraining {
        trainer: u32,
    },
    Leave {
        trainer: u32,
    },
    Save,
    Stats,
    Checkpoint {
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
        stop: bool,
    },
    Done,
    Failed {
        reason: String,
    },
}

/// Writes `call` as one frame, its ids and values straight from their vectors.
pub async fn write_request<W: AsyncWrite + Unpin>(
    out: &mut W,
    call: &ShardCall,
    max_frame_bytes: usize,
) -> io::Result<()> {
    let (header, sections) = request_frame(&call.request)?;
    let stamped = Stamped {
        generation: call.generation,
        header,
    };
    write_frame(out, &stamped, &sections, max_frame_bytes).await
}

/// `request`'s header and its payload's sections, borrowed from the request's vectors.
fn request_frame(request: &Request) -> io::Result<(Header, Vec<&[u8]>)> {
    Ok(match request {
        Request::Pull(pull) => pull_frame(pull)?,
        Request::Push(push) => push_frame(push)?,
        Request::EndTraining { trainer } => (
            Header::EndTraining {
                trainer: *trainer as u32,
            },
            Vec::new(),
        ),
        Request::Leave { trainer } => (
            Header::Leave {
                trainer: *trainer as u32,
            },
            Vec::new(),
        ),
        Request::Save => (Header::Save, Vec::new()),
        Request::Stats => (Header::Stats, Vec::new()),
        Request::Checkpoint { step, trainer, files } => (
            Header::Checkpoint {
                step: *step,
                trainer: *trainer as u32,
                files: files.clone(),
            },
            Vec::new(),
        ),
        Request::Evaluated {
            trainer,
            scores,
            labels,
        } => evaluated_frame(*trainer, scores, labels)?,
    })
}

/// A pull's header and its ids, table by table.
fn pull_frame(pull: &PullRequest) -> io::Result<(Header, Vec<&[u8]>)> {
    let header = Header::Pull {
        trainer: pull.trainer as u32,
        version: pull.version,
        after_training: pull.after_training,
        training: pull.training,
        ids: counts(pull.ids.iter().map(Vec::len))?,
        dense: pull.dense,
    };
    Ok((header, pull.ids.iter().map(|ids| bytes_of(ids)).collect()))
}

/// A push's header and its sections: the ids, values and counts table by table, then the
/// dense values.
fn push_frame(push: &PushRequest) -> io::Result<(Header, Vec<&[u8]>)> {
    let header = Header::Push {
        trainer: push.trainer as u32,
        step: push.step,
        part: push.part,
        kind: push.kind,
        ids: counts(push.ids.iter().map(Vec::len))?,
        values: counts(push.values.iter().map(Vec::len))?,
        counts: counts(push.counts.iter().map(Vec::len))?,
        dense: count(push.dense.len())?,
        stop: push.stop,
    };
    let sections = push
        .ids
        .iter()
        .map(|ids| bytes_of(ids))
        .chain(push.values.iter().chain(&push.counts).map(|v| bytes_of(v)))
        .chain(std::iter::once(bytes_of(&push.dense)))
        .collect();
    Ok((header, sections))
}

/// A trainer's held-out scores and labels, one of each per sample.
fn evaluated_frame<'a>(trainer: usize, scores: &'a [f32], labels: &'a [f32]) -> io::Result<(Header, Vec<&'a [u8]>)> {
    if scores.len() != labels.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} scores for {} labels", scores.len(), labels.len()),
        ));
    }
    let header = Header::Evaluated {
        trainer: trainer as u32,
        samples: count(scores.len())?,
    };
    Ok((header, vec![bytes_of(scores), bytes_of(labels)]))
}

/// Reads the next request, its ids and values straight into their vectors; `None` when the
/// trainer closed the connection between requests.
pub async fn read_request<R: AsyncRead + Unpin>(
    input: &mut R,
    max_frame_bytes: usize,
) -> io::Result<Option<ShardCall>> {
    let Some((stamped, mut payload)) = read_frame::<_, Stamped>(input, max_frame_bytes).await? else {
        return Ok(None);
    };
    let request = match stamped.header {
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
            ids: sections(&mut payload, &ids).await?,
            dense,
        }),
        Header::Push {
            trainer,
            step,
            part,
            kind,
            ids,
            values,
            counts,
            dense,
            stop,
        } => Request::Push(PushRequest {
            trainer: trainer as usize,
            step,
            part,
            kind,
            ids: sections(&mut payload, &ids).await?,
            values: sections(&mut payload, &values).await?,
            counts: sections(&mut payload, &counts).await?,
            dense: payload.values(dense as usize).await?,
            stop,
        }),
        Header::EndTraining { trainer } => Request::EndTraining {
            trainer: trainer as usize,
        },
        Header::Leave { trainer } => Request::Leave {
            trainer: trainer as usize,
        },
        Header::Save => Request::Save,
        Header::Stats => Request::Stats,
        Header::Checkpoint { step, trainer, files } => Request::Checkpoint {
            step,
            trainer: trainer as usize,
            files,
        },
        Header::Evaluated { trainer, samples } => Request::Evaluated {
            trainer: trainer as usize,
            scores: payload.values(samples as usize).await?,
            labels: payload.values(samples as usize).await?,
        },
        other => {
            return Err(malformed(format!(
                "a {} frame is an answer, not a request",
                header_name(&other)
            )))
        }
    };
    payload.finish()?;
    Ok(Some(ShardCall {
        generation: stamped.generation,
        request,
    }))
}

/// Writes a shard's answer, or its refusal with the reason, as one frame; pulled rows go
/// straight from their vectors.
pub async fn write_reply<W: AsyncWrite + Unpin>(
    out: &mut W,
    reply: &Result<Reply>,
    max_frame_bytes: usize,
) -> io::Result<()> {
    let header = match reply {
        Ok(Reply::Rows(rows)) => {
            let header = Header::Rows {
                rows: counts(rows.rows.iter().map(Vec::len))?,
                dense: count(rows.dense.len())?,
                stop: rows.stop,
            };
            let sections: Vec<&[u8]> = rows
                .rows
                .iter()
                .chain(std::iter::once(&rows.dense))
                .map(|v| bytes_of(v))
                .collect();
            return write_frame(out, &header, &sections, max_frame_bytes).await;
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
    write_frame(out, &header, &[], max_frame_bytes).await
}

/// Reads a shard's answer, pulled rows straight into their vectors: appended to `joined`, the
/// rows of the earlier parts of the same pull, if any. The outer error is the line's or the
/// frame's; the inner one is the shard's refusal, carrying its reason.
pub async fn read_reply<R: AsyncRead + Unpin>(
    input: &mut R,
    max_frame_bytes: usize,
    joined: Option<PulledRows>,
) -> io::Result<Result<Reply>> {
    let Some((header, mut payload)) = read_frame::<_, Header>(input, max_frame_bytes).await? else {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "the shard closed the connection",
        ));
    };
    let reply = match header {
        Header::Rows { rows, dense, stop } => {
            let mut joined = joined.unwrap_or_else(|| PulledRows {
                rows: vec![Vec::new(); rows.len()],
                ..PulledRows::default()
            });
            joined.stop |= stop;
            if joined.rows.len() != rows.len() {
                return Err(malformed(format!(
                    "rows of {} tables answer a part of a pull of {}",
                    rows.len(),
                    joined.rows.len()
                )));
            }
            for (values, &n) in joined.rows.iter_mut().zip(&rows) {
                payload.values_into(n as usize, values).await?;
            }
            payload.values_into(dense as usize, &mut joined.dense).await?;
            Ok(Reply::Rows(joined))
        }
        Header::TableStats { tables, applied } => Ok(Reply::Stats(ShardStats {
            tables,
            updates_applied: applied,
        })),
        Header::Checkpointed(records) => Ok(Reply::Checkpointed(records)),
        Header::Evaluation { auc, samples } => Ok(Reply::Evaluation { auc, samples }),
        Header::Done => Ok(Reply::Done),
        Header::Failed { reason } => Err(anyhow::anyhow!("{reason}")),
        other => {
            return Err(malformed(format!(
                "a {} frame is a request, not an answer",
                header_name(&other)
            )))
        }
    };
    payload.finish()?;
    Ok(reply)
}

/// One vector per announced count, in order.
async fn sections<R: AsyncRead + Unpin, T: bytemuck::Pod>(
    payload: &mut PayloadReader<'_, R>,
    counts: &[u32],
) -> io::Result<Vec<Vec<T>>> {
    let mut out = Vec::with_capacity(counts.len());
    for &n in counts {
        out.push(payload.values(n as usize).await?);
    }
    Ok(out)
}

fn header_name(header: &Header) -> &'static str {
    match header {
        Header::Pull { .. } => "pull",
        Header::Push { .. } => "push",
        Header::EndTraining { .. } => "end-of-training",
        Header::Leave { .. } => "leave",
        Header::Save => "save",
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

fn count(n: usize) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{n} values do not fit in one frame"),
        )
    })
}

fn counts(lens: impl Iterator<Item = usize>) -> io::Result<Vec<u32>> {
    lens.map(count).collect()
}

// The wire is little-endian; on such hosts values are copied as they lie in memory.
#[cfg(not(target_endian = "little"))]
compile_error!("the parameter-server wire format copies little-endian memory as is");

fn bytes_of<T: bytemuck::Pod>(values: &[T]) -> &[u8] {
    bytemuck::cast_slice(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: usize = 1 << 20;

    fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
        futures::executor::block_on(future)
    }

    fn request_bytes(call: &ShardCall) -> io::Result<Vec<u8>> {
        let mut wire = Vec::new();
        block_on(write_request(&mut wire, call, CAP))?;
        Ok(wire)
    }

    fn request_from(mut wire: &[u8]) -> io::Result<Option<ShardCall>> {
        block_on(read_request(&mut wire, CAP))
    }

    fn reply_round_trip(reply: &Result<Reply>) -> io::Result<Result<Reply>> {
        let mut wire = Vec::new();
        block_on(write_reply(&mut wire, reply, CAP))?;
        block_on(read_reply(&mut &wire[..], CAP, None))
    }

    fn push() -> Request {
        Request::Push(PushRequest {
            trainer: 2,
            step: 17,
            part: Part { index: 1, of: 3 },
            kind: UpdateKind::Gradients,
            ids: vec![vec![1, u64::MAX], vec![]],
            values: vec![vec![0.5, -1.0, 2.0, 3.0], vec![]],
            counts: vec![vec![3.0, 1.0, 1.0, 0.0], vec![]],
            dense: vec![1.0, 2.0, 3.0],
            stop: true,
        })
    }

    #[test]
    fn requests_and_replies_round_trip() -> anyhow::Result<()> {
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
            Request::Save,
            Request::Stats,
            Request::Evaluated {
                trainer: 1,
                scores: vec![0.5, 0.25],
                labels: vec![1.0, 0.0],
            },
        ] {
            let call = ShardCall { generation: 3, request };
            assert_eq!(request_from(&request_bytes(&call)?)?, Some(call));
        }
        let rows = Reply::Rows(PulledRows {
            rows: vec![vec![1.0, 2.0], vec![]],
            dense: vec![4.0],
            stop: true,
        });
        assert_eq!(reply_round_trip(&Ok(rows.clone()))??, rows);
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
        assert_eq!(reply_round_trip(&Ok(stats.clone()))??, stats);
        let evaluation = Reply::Evaluation { auc: None, samples: 7 };
        assert_eq!(reply_round_trip(&Ok(evaluation.clone()))??, evaluation);
        let failed = reply_round_trip(&Err(anyhow::anyhow!("unknown table 3")))?.unwrap_err();
        assert_eq!(failed.to_string(), "unknown table 3");
        Ok(())
    }

    #[test]
    fn payload_that_disagrees_with_the_header_is_an_error() -> io::Result<()> {
        let wire = request_bytes(&ShardCall::first(push()))?;
        // The frame's length cut by 4 along with its last 4 bytes.
        let mut short = wire[..wire.len() - 4].to_vec();
        short[..4].copy_from_slice(&(wire.len() as u32 - 8).to_be_bytes());
        let msg = request_from(&short).unwrap_err().to_string();
        assert!(
            msg.starts_with("malformed frame: the header announces 12 more payload bytes"),
            "{msg}"
        );
        let mut long = wire.clone();
        long.push(0);
        long[..4].copy_from_slice(&(wire.len() as u32 - 3).to_be_bytes());
        assert_eq!(request_from(&long).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let mut answer = Vec::new();
        block_on(write_reply(&mut answer, &Ok(Reply::Done), CAP))?;
        assert!(request_from(&answer).is_err(), "an answer is no request");
        Ok(())
    }
}
