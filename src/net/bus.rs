//! How a role talks to the coordinator: directly by actor message when both
//! live in one process, or by frames over TCP. Callers see one interface.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use super::auth::{self, Credentials};
use super::frame::{codec, Frame};
use super::protocol::{
    Answer, Beat, Call, CoordinatorLine, DeadProcess, Heartbeat, Join, Membership, Mismatch, Reply, Request, Roster,
    Settings,
};
use crate::checkpoint::{CommitRecord, HeldFile};
use crate::telemetry::clock::{self, ClockSample};

/// Room for a gather answer's header beside its name and lengths.
const GATHER_HEADER_BYTES: usize = 256;

/// The longest a broken line to the coordinator is retried: a restarted coordinator is back in
/// moments, and a role's heartbeats give up on a dead one sooner.
const RECONNECT_MAX: Duration = Duration::from_secs(30);

/// Round trips of a clock measurement: the shortest one bounds the error best.
const CLOCK_PROBES: usize = 8;

/// A role's line to the coordinator.
pub enum ControlBus {
    /// Same process: actor messages.
    InMemory(CoordinatorLine),
    /// Another process: frames over TCP.
    Tcp {
        /// The framed connection.
        connection: Box<Framed<TcpStream, LengthDelimitedCodec>>,
        /// The coordinator's `ip:port`, for errors.
        master: String,
        /// How long one request may take, beyond the coordinator's own
        /// deadline, before the coordinator is presumed dead.
        timeout: Duration,
        /// What a new connection proves, when the line breaks.
        credentials: Credentials,
        /// Answers the coordinator still owes: requests whose wait was given up (a rollback
        /// order cancels a rank's wait for a commit). They are read and dropped before the next
        /// request, whose answer would otherwise be one of them.
        owed: usize,
    },
}

/// How one exchange of a request and its answer failed.
enum Exchange {
    /// The connection broke: the coordinator's process may have been restarted.
    Broken(anyhow::Error),
    /// Anything else (no answer in time, a malformed one).
    Failed(anyhow::Error),
}

impl ControlBus {
    /// Connects to the coordinator at `master`, retrying while it starts, for at most
    /// `timeout`. A connection reset during the handshake is tried again too: one made while
    /// a killed coordinator's endpoint was closing lands in its dying backlog and is reset,
    /// while its replacement is moments away. A peer that proves another token is refused at
    /// once.
    pub async fn connect(
        master: &str,
        timeout: Duration,
        max_frame_bytes: usize,
        credentials: &Credentials,
    ) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let failure = match TcpStream::connect(master).await {
                Ok(mut stream) => match auth::connect(&mut stream, credentials).await {
                    Ok(()) => break stream,
                    Err(e) if e.root_cause().downcast_ref::<std::io::Error>().is_none() => {
                        return Err(e).with_context(|| format!("handshake with the coordinator at {master}"))
                    }
                    Err(e) => anyhow!(e).context(format!("handshake with the coordinator at {master}")),
                },
                Err(e) => anyhow!(e).context(format!("connecting to the coordinator at {master}")),
            };
            if Instant::now() >= deadline {
                return Err(failure.context(format!(
                    "could not reach the coordinator at {master} within {:.1}s",
                    timeout.as_secs_f64()
                )));
            }
            tracing::debug!("coordinator at {master} not reachable yet: {failure:#}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        stream.set_nodelay(true)?;
        Ok(Self::Tcp {
            connection: Box::new(Framed::new(stream, codec(max_frame_bytes))),
            master: master.to_string(),
            timeout,
            credentials: credentials.clone(),
            owed: 0,
        })
    }

    /// Joins the rendezvous (at the start, or after a rollback) with the `settings` the rank was
    /// started with; returns every rank's data endpoint, by rank, with the generation and the
    /// step training continues after. A rank started for another job gets an error whose source
    /// is a [`Mismatch`].
    pub async fn join(
        &mut self,
        rank: usize,
        world_size: usize,
        data_endpoint: String,
        mirror: Option<String>,
        settings: Settings,
    ) -> Result<Roster> {
        let join = Join {
            rank,
            world_size,
            data_endpoint,
            mirror,
            settings,
        };
        match self.ask(Request::Join(join), None).await? {
            Answer::Roster(roster) => Ok(*roster),
            Answer::Mismatched { reason } => Err(anyhow!(Mismatch(reason)).context(format!("rank {rank}"))),
            other => Err(unexpected(rank, other)),
        }
    }

    /// [`Self::join`]s the next generation in which `rank` trains: with elastic membership, a
    /// rank the coordinator keeps waiting to be admitted (it answers with a roster that does not
    /// hold it) asks again until a checkpoint admits it or the job ends.
    pub async fn join_admitted(
        &mut self,
        rank: usize,
        world_size: usize,
        data_endpoint: String,
        mirror: Option<String>,
        settings: Settings,
    ) -> Result<Roster> {
        loop {
            let roster = self
                .join(
                    rank,
                    world_size,
                    data_endpoint.clone(),
                    mirror.clone(),
                    settings.clone(),
                )
                .await?;
            if roster.place_of(rank).is_some() {
                return Ok(roster);
            }
            tracing::info!(
                rank,
                generation = roster.generation,
                training = roster.world_size(),
                "not admitted yet: waiting for the next checkpoint"
            );
        }
    }

    /// Waits until every rank has reached barrier `name`.
    pub async fn barrier(&mut self, rank: usize, name: &str) -> Result<()> {
        let name = name.to_string();
        match self.ask(Request::Barrier { rank, name }, None).await? {
            Answer::Released { .. } => Ok(()),
            other => Err(unexpected(rank, other)),
        }
    }

    /// Hands `part` to rank 0 at gather `name` and waits until every rank has handed its own
    /// (so it is a barrier too). Rank 0 gets every rank's part, by rank; the others get none.
    /// Over TCP the parts travel in pieces, so no part and no answer is bounded by
    /// `cluster.max_frame_mb` (a pipeline stage's final parameters can be larger).
    pub async fn gather(&mut self, rank: usize, name: &str, part: Bytes) -> Result<Vec<Bytes>> {
        match self {
            Self::InMemory(_) => Ok(self.gather_round(rank, name, part).await?.1),
            Self::Tcp { .. } => self.gather_in_pieces(rank, name, part).await,
        }
    }

    /// A gather as rounds: a first empty one tells every rank the world size; then each round
    /// every rank hands the next piece of its part, sized so that rank 0's answer (a piece of
    /// every rank) fits in a frame, until a round where every rank's piece was its last.
    async fn gather_in_pieces(&mut self, rank: usize, name: &str, mut part: Bytes) -> Result<Vec<Bytes>> {
        let Self::Tcp { connection, .. } = self else {
            bail!("in-memory bus has no frames");
        };
        let cap = connection.codec().max_frame_length();
        let (lengths, _) = self
            .gather_round(rank, &format!("{name} (start)"), Bytes::new())
            .await?;
        let world_size = lengths.len().max(1);
        // The answer's header: the name and a length per rank, with room to spare.
        let header = GATHER_HEADER_BYTES + name.len() + 10 * world_size;
        let piece = cap.saturating_sub(header) / world_size;
        ensure!(
            piece > 0,
            "rank {rank}: cluster.max_frame_mb ({cap} bytes) leaves no room for gather {name:?} of {world_size} ranks"
        );
        let mut gathered = vec![Vec::new(); world_size];
        for round in 1.. {
            let mine = part.split_to(part.len().min(piece));
            let (lengths, parts) = self
                .gather_round(rank, &format!("{name} (piece {round})"), mine)
                .await?;
            for (whole, piece) in gathered.iter_mut().zip(parts) {
                whole.extend_from_slice(&piece);
            }
            if lengths.iter().all(|&n| n < piece as u64) {
                break;
            }
        }
        Ok(if rank == 0 {
            gathered.into_iter().map(Bytes::from).collect()
        } else {
            Vec::new()
        })
    }

    /// One round of a gather: every rank's part length, and (to rank 0) the parts.
    async fn gather_round(&mut self, rank: usize, name: &str, part: Bytes) -> Result<(Vec<u64>, Vec<Bytes>)> {
        let gather = Request::Gather {
            rank,
            name: name.to_string(),
        };
        let reply = self.call(gather, part, None).await?;
        match reply.answer {
            Answer::Gathered { lengths, .. } => Ok((lengths, reply.parts)),
            other => Err(unexpected(rank, other)),
        }
    }

    /// Acknowledges the checkpoint of step `step` with the `files` this rank wrote for it, and
    /// waits until the coordinator has committed it (every rank acknowledged); answers its
    /// record of the checkpoint's files and the nodes holding them.
    pub async fn acknowledge(&mut self, rank: usize, step: usize, files: Vec<HeldFile>) -> Result<CommitRecord> {
        match self.ask(Request::Acknowledge { rank, step, files }, None).await? {
            Answer::Committed(record) if record.step == step => Ok(record),
            other => Err(unexpected(rank, other)),
        }
    }

    /// Tells the coordinator `rank` is alive, waiting at most `limit` for its answer: `Err` when
    /// the line failed, `Ok(Err(reason))` when the coordinator has stopped the job, else what
    /// the coordinator orders.
    /// `member_of` is the generation the rank last joined, so that a restarted coordinator
    /// learns who is training.
    pub async fn heartbeat(
        &mut self,
        rank: usize,
        member_of: Option<Membership>,
        limit: Duration,
    ) -> Result<Result<Beat, String>> {
        let beat = Heartbeat {
            rank,
            pid: self.process(),
            member_of,
        };
        match self.ask(Request::Heartbeat(beat), Some(limit)).await? {
            Answer::Alive(beat) => Ok(Ok(beat)),
            Answer::Refused { reason } => Ok(Err(reason)),
            other => Err(unexpected(rank, other)),
        }
    }

    /// The processes the coordinator declared dead, newest last (a launcher's question).
    pub async fn list_dead(&mut self, limit: Duration) -> Result<Vec<DeadProcess>> {
        match self.ask(Request::ListDead, Some(limit)).await? {
            Answer::Dead { processes } => Ok(processes),
            other => Err(unexpected(0, other)),
        }
    }

    /// Tells the coordinator `rank` has finished, so its silence is not a death.
    pub async fn leave(&mut self, rank: usize, limit: Duration) -> Result<()> {
        match self.ask(Request::Leave { rank }, Some(limit)).await? {
            Answer::Alive(_) => Ok(()),
            other => Err(unexpected(rank, other)),
        }
    }

    /// How far the coordinator's wall clock is ahead of this process's, in microseconds:
    /// NTP's estimate from the probe with the shortest round trip of a few (zero in memory,
    /// where both are one clock).
    pub async fn clock_offset_us(&mut self) -> Result<f64> {
        if let Self::InMemory(_) = self {
            return Ok(0.0);
        }
        let mut samples = Vec::with_capacity(CLOCK_PROBES);
        for _ in 0..CLOCK_PROBES {
            let sent = clock::unix_now_us();
            let answer = self.ask(Request::ClockProbe, None).await?;
            let received = clock::unix_now_us();
            match answer {
                Answer::Clock { unix_us } => samples.push(ClockSample {
                    sent,
                    remote: unix_us,
                    received,
                }),
                other => return Err(unexpected(0, other)),
            }
        }
        Ok(clock::offset_us(&samples))
    }

    /// The process this bus speaks for: this one, or the incarnation of a simulated role.
    fn process(&self) -> u32 {
        match self {
            Self::InMemory(coordinator) => coordinator.process,
            Self::Tcp { .. } => std::process::id(),
        }
    }

    /// The coordinator's answer to `request`, which hands nothing over.
    async fn ask(&mut self, request: Request, limit: Option<Duration>) -> Result<Answer> {
        Ok(self.call(request, Bytes::new(), limit).await?.answer)
    }

    /// The coordinator's reply to `request` handing over `part`: an actor message in one process,
    /// a frame over TCP (waiting at most `limit`, or the coordinator's own deadline and a grace
    /// period, past which it is presumed dead). In memory the line is the incarnation's.
    async fn call(&mut self, request: Request, part: Bytes, limit: Option<Duration>) -> Result<Reply> {
        let limit = match self {
            Self::InMemory(coordinator) => {
                let line = u64::from(coordinator.process);
                let call = Call { request, part, line };
                return coordinator.call.send(call).await.context("the coordinator stopped");
            }
            Self::Tcp { timeout, .. } => limit.unwrap_or(*timeout + Duration::from_secs(5)),
        };
        let receives_parts = request.receives_parts();
        let answer = self
            .request_within(
                Frame {
                    header: request,
                    payload: part,
                },
                limit,
            )
            .await?;
        let parts = match &answer.header {
            Answer::Gathered { lengths, .. } if receives_parts => split_parts(answer.payload, lengths)?,
            _ => Vec::new(),
        };
        Ok(Reply {
            answer: answer.header,
            parts,
        })
    }

    /// Sends `message` and waits at most `limit` for the answer. A line that broke (the
    /// coordinator's process was restarted) is connected again, within `limit`, and the message
    /// sent once more: every request is one the coordinator may hear twice.
    async fn request_within(&mut self, message: Frame<Request>, limit: Duration) -> Result<Frame<Answer>> {
        let Self::Tcp {
            connection,
            master,
            credentials,
            owed,
            ..
        } = self
        else {
            bail!("in-memory bus has no frames");
        };
        let encoded = message.encode()?;
        let late = drop_late_answers(connection, owed, limit).await;
        let cap = connection.codec().max_frame_length();
        ensure!(
            encoded.len() <= cap,
            "a message of {} bytes to the coordinator at {master} exceeds cluster.max_frame_mb ({cap} bytes)",
            encoded.len()
        );
        let first = match late {
            Ok(()) => exchange(connection, owed, encoded.clone(), limit, master).await,
            Err(e) => Err(e),
        };
        match first {
            Ok(answer) => Ok(answer),
            Err(Exchange::Failed(e)) => Err(e),
            Err(Exchange::Broken(e)) => {
                tracing::warn!("the line to the coordinator at {master} broke ({e:#}): connecting again");
                let credentials = credentials.clone();
                let master = master.clone();
                *self = Self::connect(&master, limit.min(RECONNECT_MAX), cap, &credentials).await?;
                let Self::Tcp { connection, owed, .. } = self else {
                    bail!("in-memory bus has no frames");
                };
                exchange(connection, owed, encoded, limit, &master)
                    .await
                    .map_err(|(Exchange::Broken(e) | Exchange::Failed(e))| e)
            }
        }
    }
}

/// Reads and drops the `owed` answers of requests whose wait was given up, waiting at most
/// `limit` for them; a line that does not deliver them is out of step, so it counts as broken
/// (and is connected again).
async fn drop_late_answers(
    connection: &mut Framed<TcpStream, LengthDelimitedCodec>,
    owed: &mut usize,
    limit: Duration,
) -> Result<(), Exchange> {
    while *owed > 0 {
        match tokio::time::timeout(limit, connection.next()).await {
            Ok(Some(Ok(_))) => {
                *owed -= 1;
                tracing::debug!("dropped the coordinator's answer to a request no longer waited for");
            }
            _ => {
                *owed = 0;
                return Err(Exchange::Broken(anyhow!(
                    "the answer to a request given up did not arrive within {:.1}s",
                    limit.as_secs_f64()
                )));
            }
        }
    }
    Ok(())
}

/// Sends `encoded` on `connection` and reads the answer, waiting at most `limit` for it; until
/// it is read, `owed` counts it.
async fn exchange(
    connection: &mut Framed<TcpStream, LengthDelimitedCodec>,
    owed: &mut usize,
    encoded: Bytes,
    limit: Duration,
    master: &str,
) -> Result<Frame<Answer>, Exchange> {
    connection
        .send(encoded)
        .await
        .map_err(|e| Exchange::Broken(anyhow!(e).context(format!("sending to the coordinator at {master}"))))?;
    *owed += 1;
    let answer = tokio::time::timeout(limit, connection.next())
        .await
        .map_err(|_| {
            Exchange::Failed(anyhow!(
                "the coordinator at {master} did not answer within {:.1}s",
                limit.as_secs_f64()
            ))
        })?
        .ok_or_else(|| Exchange::Broken(anyhow!("the coordinator at {master} closed the connection")))?
        .map_err(|e| Exchange::Broken(anyhow!(e).context(format!("reading from the coordinator at {master}"))))?;
    *owed -= 1;
    Frame::decode(answer.freeze()).map_err(Exchange::Failed)
}

/// The error for an answer that is not the one asked for: the coordinator's refusal, or a
/// message out of place.
fn unexpected(rank: usize, answer: Answer) -> anyhow::Error {
    match answer {
        Answer::Refused { reason } => anyhow!("rank {rank}: {reason}"),
        other => anyhow!("rank {rank}: unexpected answer from the coordinator: {other:?}"),
    }
}

/// A gather's answer payload cut into the parts its header lists.
fn split_parts(mut payload: Bytes, lengths: &[u64]) -> Result<Vec<Bytes>> {
    let total = lengths.iter().try_fold(0u64, |sum, &n| sum.checked_add(n));
    ensure!(
        total == Some(payload.len() as u64),
        "the coordinator's gather lists parts that do not fill its {} bytes",
        payload.len()
    );
    Ok(lengths.iter().map(|&n| payload.split_to(n as usize)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::auth::ClusterToken;
    use tokio::net::TcpListener;

    fn credentials(text: &str) -> Credentials {
        Credentials::new(ClusterToken::new(text).unwrap(), Duration::from_secs(2))
    }

    /// A listener on a free loopback port, and its address.
    async fn listen() -> (TcpListener, String) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let master = listener.local_addr().unwrap().to_string();
        (listener, master)
    }

    /// A bus to `master` presenting `token`, trying for at most `seconds`.
    async fn connect(master: &str, token: &str, seconds: u64) -> Result<ControlBus> {
        ControlBus::connect(master, Duration::from_secs(seconds), 1 << 20, &credentials(token)).await
    }

    #[actix::test]
    async fn a_connection_reset_during_the_handshake_is_tried_again() {
        let (listener, master) = listen().await;
        let server_side = credentials("a cluster token of enough length");
        let serving = tokio::spawn(async move {
            // The first connection is closed with its hello unread, as a dying endpoint does.
            drop(listener.accept().await.unwrap());
            let (mut stream, _) = listener.accept().await.unwrap();
            auth::accept(&mut stream, &server_side).await.map(|()| stream)
        });
        let bus = connect(&master, "a cluster token of enough length", 10).await;
        assert!(bus.is_ok(), "{:#}", bus.err().unwrap());
        assert!(serving.await.unwrap().is_ok());
    }

    #[actix::test]
    async fn a_coordinator_with_another_token_is_refused_without_retrying() {
        // Accepted once: a retry would wait for a handshake that never comes and end in a
        // timeout, not in the mismatch.
        let (listener, master) = listen().await;
        let server_side = credentials("the coordinators token, long enough");
        let serving = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            auth::accept(&mut stream, &server_side).await
        });
        let refused = connect(&master, "another token, also long enough", 60).await;
        let message = format!("{:#}", refused.err().unwrap());
        assert!(message.contains("does not know the cluster token"), "{message}");
        assert!(serving.await.unwrap().is_err());
    }

    #[actix::test]
    async fn the_late_answer_to_a_request_given_up_is_dropped_not_taken_for_the_next() {
        let (listener, master) = listen().await;
        let server_side = credentials("a cluster token of enough length");
        let serving = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await?;
            auth::accept(&mut stream, &server_side).await?;
            let mut framed = Framed::new(stream, codec(1 << 20));
            framed.next().await.context("the first request")??;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let late = Answer::Refused {
                reason: "the late answer".into(),
            };
            framed.send(Frame::control(late).encode()?).await?;
            framed.next().await.context("the second request")??;
            framed
                .send(Frame::control(Answer::Dead { processes: Vec::new() }).encode()?)
                .await?;
            anyhow::Ok(())
        });
        let mut bus = connect(&master, "a cluster token of enough length", 10).await.unwrap();
        let given_up = tokio::time::timeout(Duration::from_millis(50), bus.list_dead(Duration::from_secs(10))).await;
        assert!(given_up.is_err(), "the first answer comes after 200 ms");
        let answer = bus.list_dead(Duration::from_secs(10)).await;
        assert!(matches!(answer.as_deref(), Ok([])), "{answer:?}");
        serving.await.unwrap().unwrap();
    }
}
