//! How a role talks to the coordinator: directly by actor message when both
//! live in one process, or by frames over TCP. Callers see one interface.

use std::time::{Duration, Instant};

use actix::Addr;
use anyhow::{anyhow, bail, Context, Result};
use futures::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use super::frame::{codec, ControlMessage, Frame};
use crate::actors::coordinator::{Barrier, Coordinator, Join};

/// A role's line to the coordinator.
pub enum ControlBus {
    /// Same process: actor messages.
    InMemory(Addr<Coordinator>),
    /// Another process: frames over TCP.
    Tcp {
        /// The framed connection.
        connection: Framed<TcpStream, LengthDelimitedCodec>,
        /// The coordinator's `ip:port`, for errors.
        master: String,
        /// How long one request may take, beyond the coordinator's own
        /// deadline, before the coordinator is presumed dead.
        timeout: Duration,
    },
}

impl ControlBus {
    /// Connects to the coordinator at `master`, retrying while it starts,
    /// for at most `timeout`.
    pub async fn connect(master: &str, timeout: Duration, max_frame_bytes: usize) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match TcpStream::connect(master).await {
                Ok(stream) => break stream,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("coordinator at {master} not reachable yet: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => bail!(
                    "could not reach the coordinator at {master} within {:.1}s: {e}",
                    timeout.as_secs_f64()
                ),
            }
        };
        stream.set_nodelay(true)?;
        Ok(Self::Tcp {
            connection: Framed::new(stream, codec(max_frame_bytes)),
            master: master.to_string(),
            timeout,
        })
    }

    /// Joins the rendezvous; returns every rank's data endpoint, by rank.
    pub async fn join(&mut self, rank: usize, world_size: usize, data_endpoint: String) -> Result<Vec<String>> {
        match self {
            Self::InMemory(coordinator) => coordinator
                .send(Join {
                    rank,
                    world_size,
                    data_endpoint,
                })
                .await
                .context("the coordinator stopped")?
                .map_err(|reason| anyhow!("rank {rank}: {reason}")),
            Self::Tcp { .. } => match self
                .request(ControlMessage::Join {
                    rank,
                    world_size,
                    data_endpoint,
                })
                .await?
            {
                ControlMessage::Roster { endpoints } => Ok(endpoints),
                other => Err(self.unexpected(rank, other)),
            },
        }
    }

    /// Waits until every rank has reached barrier `name`.
    pub async fn barrier(&mut self, rank: usize, name: &str) -> Result<()> {
        match self {
            Self::InMemory(coordinator) => coordinator
                .send(Barrier {
                    rank,
                    name: name.to_string(),
                })
                .await
                .context("the coordinator stopped")?
                .map_err(|reason| anyhow!("rank {rank}: {reason}")),
            Self::Tcp { .. } => match self
                .request(ControlMessage::Barrier {
                    rank,
                    name: name.to_string(),
                })
                .await?
            {
                ControlMessage::Released { .. } => Ok(()),
                other => Err(self.unexpected(rank, other)),
            },
        }
    }

    fn unexpected(&self, rank: usize, answer: ControlMessage) -> anyhow::Error {
        match answer {
            ControlMessage::Refused { reason } => anyhow!("rank {rank}: {reason}"),
            other => anyhow!("rank {rank}: unexpected answer from the coordinator: {other:?}"),
        }
    }

    async fn request(&mut self, message: ControlMessage) -> Result<ControlMessage> {
        let Self::Tcp {
            connection,
            master,
            timeout,
        } = self
        else {
            bail!("in-memory bus has no frames");
        };
        connection
            .send(Frame::control(message).encode()?)
            .await
            .with_context(|| format!("sending to the coordinator at {master}"))?;
        // The coordinator answers within its own deadline; past that plus a
        // grace period it is presumed dead.
        let answer = tokio::time::timeout(*timeout + Duration::from_secs(5), connection.next())
            .await
            .map_err(|_| {
                anyhow!(
                    "the coordinator at {master} did not answer within {:.1}s",
                    timeout.as_secs_f64()
                )
            })?
            .ok_or_else(|| anyhow!("the coordinator at {master} closed the connection"))?
            .with_context(|| format!("reading from the coordinator at {master}"))?;
        Ok(Frame::decode(answer.freeze())?.header)
    }
}
