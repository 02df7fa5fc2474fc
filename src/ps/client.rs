//! The trainer's side of the parameter servers: one link per shard, in memory (a shard actor
//! of this process, in a simulated cluster) or a TCP connection, and requests sent to all shards
//! in parallel.
//!
//! Network failures (refused, reset, closed; in memory, a request or answer a simulated link
//! lost) of a request are retried `retry` times with exponential backoff and jitter on a fresh
//! connection; pushes are idempotent on the shard, so a retry after a lost answer is safe. A
//! shard that answers nothing within the timeout, or stays unreachable, is an error naming it and
//! its endpoint.

use std::sync::Arc;
use std::time::Duration;

use actix::Recipient;
use anyhow::{anyhow, bail, Context as _, Result};
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::io::{BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::parts::{self, Joined, PART_IDS};
use super::wire::{read_reply, write_request, Reply, Request, ShardCall};
use crate::net::auth::{self, Credentials};

/// `backoff` scaled by a random factor in [0.5, 1): trainers that failed together (a shard
/// restarting) do not all come back at the same instant.
fn jittered(backoff: Duration) -> Duration {
    let mut bytes = [0u8; 4];
    // Without randomness the retry still happens, only without the spread.
    let unit = match getrandom::fill(&mut bytes) {
        Ok(()) => f64::from(u32::from_le_bytes(bytes)) / (f64::from(u32::MAX) + 1.0),
        Err(_) => 0.5,
    };
    backoff.mul_f64(0.5 + 0.5 * unit)
}

/// First backoff between retries; doubled each time.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// Pause between connection attempts while a shard is starting up.
const STARTUP_POLL: Duration = Duration::from_millis(100);
/// A shard refuses a pull it held for the timeout with the names of the trainers it waits for;
/// the trainer waits this much longer, so that answer rather than its own timeout is reported.
const SHARD_ANSWER_GRACE: Duration = Duration::from_secs(2);

/// A request, or its answer, that an in-memory link lost.
pub struct Lost {
    /// What happened, for the log and the error.
    pub reason: String,
    /// The request, to be sent again as over a fresh connection; `None` when the shard is gone
    /// (its actor stopped), which no retry can reach.
    pub call: Option<Box<ShardCall>>,
}

/// A shard actor of this process, as one trainer's link reaches it.
pub trait InProcessShard: Send + Sync {
    /// Hands `call` to the shard and answers its reply.
    fn call(&self, call: ShardCall) -> BoxFuture<'static, std::result::Result<Result<Reply>, Lost>>;
}

impl InProcessShard for Recipient<ShardCall> {
    fn call(&self, call: ShardCall) -> BoxFuture<'static, std::result::Result<Result<Reply>, Lost>> {
        self.send(call)
            .map(|answer| {
                answer.map_err(|e| Lost {
                    reason: format!("gone: {e}"),
                    call: None,
                })
            })
            .boxed()
    }
}

/// How a trainer reaches one shard.
pub enum ShardLink {
    /// A shard actor of this process.
    Local(Arc<dyn InProcessShard>),
    /// A shard process.
    Remote(Box<RemoteShard>),
}

impl ShardLink {
    /// The link to the shard actor `shard` of this process.
    pub fn local(shard: Recipient<ShardCall>) -> Self {
        Self::Local(Arc::new(shard))
    }

    /// The link to the shard process at `endpoint`.
    pub fn remote(endpoint: String, max_frame_bytes: usize, credentials: Credentials) -> Self {
        Self::Remote(Box::new(RemoteShard::new(endpoint, max_frame_bytes, credentials)))
    }
}

/// A TCP connection to a shard, re-established when it breaks.
pub struct RemoteShard {
    endpoint: String,
    connection: Option<Connection>,
    max_frame_bytes: usize,
    credentials: Credentials,
}

/// The two halves of a connection, so requests go out while answers come in.
struct Connection {
    input: BufReader<OwnedReadHalf>,
    output: BufWriter<OwnedWriteHalf>,
}

impl RemoteShard {
    /// A link to the shard at `endpoint`; connects (and proves the cluster token) on first use.
    pub fn new(endpoint: String, max_frame_bytes: usize, credentials: Credentials) -> Self {
        Self {
            endpoint,
            connection: None,
            max_frame_bytes,
            credentials,
        }
    }

    async fn connect(&mut self) -> std::io::Result<&mut Connection> {
        if self.connection.is_none() {
            let mut stream = TcpStream::connect(&self.endpoint).await?;
            auth::connect(&mut stream, &self.credentials)
                .await
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("{e:#}")))?;
            stream.set_nodelay(true)?;
            let (input, output) = stream.into_split();
            self.connection = Some(Connection {
                input: BufReader::new(input),
                output: BufWriter::new(output),
            });
        }
        self.connection
            .as_mut()
            .ok_or_else(|| std::io::Error::other("no connection"))
    }

    /// One attempt: sends the parts of a request back to back while reading their answers, in
    /// order. The outer error is the line's (or a malformed answer's); an inner one is a part's
    /// refusal by the shard.
    async fn exchange(&mut self, parts: &[ShardCall]) -> std::io::Result<Result<Reply>> {
        let max_frame_bytes = self.max_frame_bytes;
        let Connection { input, output } = self.connect().await?;
        let send = async {
            for part in parts {
                write_request(output, part, max_frame_bytes).await?;
            }
            Ok::<_, std::io::Error>(())
        };
        let receive = async {
            let mut joined = Joined::new(parts.iter().map(|part| &part.request));
            for _ in parts {
                let so_far = joined.rows_so_far();
                joined.add(read_reply(input, max_frame_bytes, so_far).await?);
            }
            Ok(joined.finish())
        };
        let ((), answer) = futures::future::try_join(send, receive).await?;
        Ok(answer)
    }
}

/// The links to every shard of the job, with the retry and timeout policy.
pub struct PsClient {
    shards: Vec<ShardLink>,
    retry: usize,
    timeout: Duration,
    /// The generation of the job this trainer is in, stamped on every request.
    generation: u64,
    /// Requests to a shard process with more ids travel as pipelined parts.
    part_ids: usize,
}

impl PsClient {
    /// A client over `shards` (indexed by shard).
    pub fn new(shards: Vec<ShardLink>, retry: usize, timeout: Duration) -> Self {
        Self {
            shards,
            retry,
            timeout,
            generation: 0,
            part_ids: PART_IDS,
        }
    }

    /// Cuts requests to shard processes into parts of at most about `ids` ids (default
    /// [`PART_IDS`]).
    pub fn with_part_ids(mut self, ids: usize) -> Self {
        self.part_ids = ids;
        self
    }

    /// The trainer joined `generation` after a rollback: its requests carry it from now on, over
    /// fresh connections (a request cut off by the rollback may have left its answer unread).
    pub fn enter(&mut self, generation: u64) {
        self.generation = generation;
        for link in &mut self.shards {
            if let ShardLink::Remote(remote) = link {
                remote.connection = None;
            }
        }
    }

    /// A client of its own over new links to the same shards, in the same generation: async
    /// mode's pushes travel on it, so a pull never waits behind one.
    pub fn another_lane(&self) -> Self {
        let shards = self
            .shards
            .iter()
            .map(|link| match link {
                ShardLink::Local(shard) => ShardLink::Local(shard.clone()),
                ShardLink::Remote(remote) => ShardLink::remote(
                    remote.endpoint.clone(),
                    remote.max_frame_bytes,
                    remote.credentials.clone(),
                ),
            })
            .collect();
        Self {
            shards,
            retry: self.retry,
            timeout: self.timeout,
            generation: self.generation,
            part_ids: self.part_ids,
        }
    }

    /// Shards in the job.
    pub fn server_num(&self) -> usize {
        self.shards.len()
    }

    /// Waits until every remote shard accepts a connection (they may still be starting), for
    /// at most the timeout.
    pub async fn wait_for_servers(&mut self) -> Result<()> {
        let timeout = self.timeout;
        for (index, link) in self.shards.iter_mut().enumerate() {
            let ShardLink::Remote(remote) = link else {
                continue;
            };
            let started = tokio::time::Instant::now();
            loop {
                match remote.connect().await {
                    Ok(_) => break,
                    Err(e) if started.elapsed() < timeout => {
                        tracing::debug!("parameter server {index} at {} not up yet: {e}", remote.endpoint);
                        tokio::time::sleep(STARTUP_POLL).await;
                    }
                    Err(e) => bail!(
                        "parameter server {index} at {} did not accept a connection within {:.0?}: {e}",
                        remote.endpoint,
                        timeout
                    ),
                }
            }
        }
        Ok(())
    }

    /// Sends `requests[s]` to shard `s`, all shards at once, and returns the answers by shard;
    /// `what` names the operation in errors ("pull of step 17").
    pub async fn call_all(&mut self, requests: Vec<Request>, what: &str) -> Result<Vec<Reply>> {
        let (retry, timeout, generation, part_ids) = (self.retry, self.timeout, self.generation, self.part_ids);
        let calls = self
            .shards
            .iter_mut()
            .zip(requests)
            .enumerate()
            .map(|(index, (link, request))| {
                let call_of = ShardCall { generation, request };
                call(index, link, call_of, retry, timeout, part_ids, what)
            });
        futures::future::try_join_all(calls).await
    }
}

/// The retries of one request: at most `retry`, each after twice the pause of the one before.
struct Retries {
    retry: usize,
    attempt: usize,
    backoff: Duration,
}

impl Retries {
    fn new(retry: usize) -> Self {
        Self {
            retry,
            attempt: 0,
            backoff: FIRST_BACKOFF,
        }
    }

    /// After a failed attempt (`failure`) of the `what` at `shard`: pauses and answers `true`
    /// when a retry is left.
    async fn another(&mut self, what: &str, shard: &str, failure: &dyn std::fmt::Display) -> bool {
        if self.attempt >= self.retry {
            return false;
        }
        self.attempt += 1;
        let pause = jittered(self.backoff);
        tracing::warn!(
            "{what} at {shard} failed: {failure}; retry {} of {} in {pause:.0?}",
            self.attempt,
            self.retry
        );
        tokio::time::sleep(pause).await;
        self.backoff *= 2;
        true
    }
}

/// One request to shard `index`, with retries.
async fn call(
    index: usize,
    link: &mut ShardLink,
    request: ShardCall,
    retry: usize,
    timeout: Duration,
    part_ids: usize,
    what: &str,
) -> Result<Reply> {
    let mut retries = Retries::new(retry);
    let deadline = timeout + SHARD_ANSWER_GRACE;
    let remote = match link {
        ShardLink::Local(shard) => {
            let shard_name = format!("parameter server {index}");
            let mut request = request;
            loop {
                let answer = tokio::time::timeout(deadline, shard.call(request))
                    .await
                    .map_err(|_| anyhow!("{shard_name} did not answer the {what} within {timeout:.0?}"))?;
                match answer {
                    Ok(reply) => return reply,
                    Err(Lost {
                        reason,
                        call: Some(again),
                    }) if retries.another(what, &shard_name, &reason).await => request = *again,
                    Err(Lost { reason, .. }) => bail!("{shard_name}: the {what} failed: {reason}"),
                }
            }
        }
        ShardLink::Remote(remote) => remote,
    };
    let generation = request.generation;
    let parts: Vec<ShardCall> = parts::split(request.request, part_ids)
        .into_iter()
        .map(|request| ShardCall { generation, request })
        .collect();
    let shard_name = format!("parameter server {index} at {}", remote.endpoint);
    loop {
        match tokio::time::timeout(deadline, remote.exchange(&parts)).await {
            Err(_) => bail!("{shard_name} did not answer the {what} within {timeout:.0?}"),
            Ok(Ok(answer)) => return answer.with_context(|| format!("{what} at {shard_name}")),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                remote.connection = None;
                return Err(anyhow!(e).context(format!("{what} at {shard_name}: the answer")));
            }
            Ok(Err(e)) => {
                remote.connection = None;
                if !retries.another(what, &shard_name, &e).await {
                    bail!("{shard_name} is unreachable: the {what} failed after {retry} retries: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_spreads_a_backoff_over_its_upper_half() {
        let backoff = Duration::from_millis(200);
        let pauses: Vec<Duration> = (0..64).map(|_| jittered(backoff)).collect();
        assert!(pauses.iter().all(|p| *p >= backoff / 2 && *p < backoff), "{pauses:?}");
        assert!(pauses.iter().any(|p| p != &pauses[0]), "the pauses differ");
    }
}
