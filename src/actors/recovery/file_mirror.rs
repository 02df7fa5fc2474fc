//! A role's checkpoint mirror: the TCP endpoint through which a role on another node stores a
//! copy of a checkpoint file that no other node holds (a buddy copy), and through which a role
//! whose node came back with an empty disk fetches it again. Every connection proves the cluster
//! token first; files travel in pieces no larger than the frame cap allows; a file name is a
//! plain name inside the step's directory, never a path.

use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::checkpoint::{check_file_name, CheckpointStore, FileRecord};
use crate::net::auth::{self, Credentials};
use crate::net::frame::{codec, encode_with, Frame};
use crate::net::listen::accept_authenticated;

/// The largest piece of a file in one frame.
const PIECE: usize = 16 << 20;
/// Room for a piece's header within the frame cap.
const HEADER_ROOM: usize = 4096;

/// What travels to and from a mirror.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum MirrorMessage {
    /// A piece (the payload) of step `step`'s file `name`, `total` bytes long, at `offset`.
    Store {
        step: usize,
        name: String,
        offset: u64,
        total: u64,
    },
    /// The whole file was written into the mirror's checkpoint directory.
    Stored(FileRecord),
    /// Send step `step`'s file `name` from the mirror's committed checkpoint.
    Fetch { step: usize, name: String },
    /// A piece of the fetched file, `total` bytes long, at `offset`.
    Piece { offset: u64, total: u64 },
    /// The request failed, and why.
    Refused { reason: String },
}

/// Serves `store`'s checkpoint directory to the job's other roles until the actor system stops.
pub async fn serve_mirror(listener: TcpListener, store: CheckpointStore, credentials: Credentials, max_frame: usize) {
    accept_authenticated(listener, credentials, "checkpoint-mirror", move |stream| {
        let store = store.clone();
        async move {
            serve_connection(stream, store, max_frame)
                .await
                .map_err(|e| format!("{e:#}"))
        }
    })
    .await
}

async fn serve_connection(stream: TcpStream, store: CheckpointStore, max_frame: usize) -> Result<()> {
    stream.set_nodelay(true)?;
    let mut framed = Framed::new(stream, codec(max_frame));
    let mut incoming: Vec<u8> = Vec::new();
    while let Some(body) = framed.next().await {
        let frame = Frame::<MirrorMessage>::decode(body?.freeze())?;
        match frame.header {
            MirrorMessage::Store {
                step,
                name,
                offset,
                total,
            } => {
                check_file_name(&name)?;
                let whole = append_piece(&mut incoming, offset, total, &frame.payload)
                    .with_context(|| format!("a copy of {name}"))?;
                if whole {
                    let (bytes, store) = (std::mem::take(&mut incoming), store.clone());
                    let written = tokio::task::spawn_blocking(move || store.write(step, &name, &bytes)).await?;
                    let answer = match written {
                        Ok(record) => MirrorMessage::Stored(record),
                        Err(e) => MirrorMessage::Refused {
                            reason: format!("{e:#}"),
                        },
                    };
                    framed.send(Frame::control(answer).encode()?).await?;
                }
            }
            MirrorMessage::Fetch { step, name } => {
                check_file_name(&name)?;
                let store = store.clone();
                let read = tokio::task::spawn_blocking(move || store.verify(step)?.read(&name)).await?;
                match read {
                    Ok(bytes) => {
                        send_pieces(&mut framed, &bytes, max_frame, |offset, total| MirrorMessage::Piece {
                            offset,
                            total,
                        })
                        .await?
                    }
                    Err(e) => {
                        let refused = MirrorMessage::Refused {
                            reason: format!("{e:#}"),
                        };
                        framed.send(Frame::control(refused).encode()?).await?;
                    }
                }
            }
            other => bail!("a mirror does not answer {other:?}"),
        }
    }
    Ok(())
}

/// Sends `bytes` in pieces, each headed by `header(offset, total)`.
async fn send_pieces(
    framed: &mut Framed<TcpStream, LengthDelimitedCodec>,
    bytes: &[u8],
    max_frame: usize,
    header: impl Fn(u64, u64) -> MirrorMessage,
) -> Result<()> {
    let piece = PIECE.min(max_frame.saturating_sub(HEADER_ROOM)).max(1);
    let total = bytes.len() as u64;
    let mut offset = 0;
    // An empty file is one empty piece.
    loop {
        let end = (offset + piece).min(bytes.len());
        // Copied once, straight into the frame that is sent.
        let frame = encode_with(&header(offset as u64, total), end - offset, |out| {
            out.extend_from_slice(&bytes[offset..end])
        })?;
        framed.send(frame).await?;
        offset = end;
        if offset == bytes.len() {
            return Ok(());
        }
    }
}

/// Appends a piece at `offset` of a file of `total` bytes to the `received` part; answers
/// whether the file is whole. Pieces come in order and never past the end.
fn append_piece(received: &mut Vec<u8>, offset: u64, total: u64, piece: &[u8]) -> Result<bool> {
    ensure!(
        offset == received.len() as u64 && offset + piece.len() as u64 <= total,
        "a piece at byte {offset} of {total}, after {} bytes",
        received.len()
    );
    received.extend_from_slice(piece);
    Ok(received.len() as u64 == total)
}

/// How a role reaches other roles' mirrors: what a connection proves, the frame cap, and how
/// long an answer may take.
#[derive(Debug, Clone)]
pub struct MirrorLine {
    /// What every connection proves.
    pub credentials: Credentials,
    /// The job's frame cap (`cluster.max_frame_mb`).
    pub max_frame: usize,
    /// The longest wait for a connection or a piece (`fault_tolerance.timeout_s`).
    pub timeout: Duration,
}

impl MirrorLine {
    /// A connection to the mirror at `endpoint`.
    async fn connect(&self, endpoint: &str) -> Result<Framed<TcpStream, LengthDelimitedCodec>> {
        let mut stream = tokio::time::timeout(self.timeout, TcpStream::connect(endpoint))
            .await
            .with_context(|| format!("the checkpoint mirror at {endpoint} did not accept a connection in time"))?
            .with_context(|| format!("connecting to the checkpoint mirror at {endpoint}"))?;
        auth::connect(&mut stream, &self.credentials)
            .await
            .with_context(|| format!("handshake with the checkpoint mirror at {endpoint}"))?;
        stream.set_nodelay(true)?;
        Ok(Framed::new(stream, codec(self.max_frame)))
    }

    /// The next frame from the mirror at `endpoint`, within the deadline.
    async fn answer(
        &self,
        framed: &mut Framed<TcpStream, LengthDelimitedCodec>,
        endpoint: &str,
    ) -> Result<Frame<MirrorMessage>> {
        let body = tokio::time::timeout(self.timeout, framed.next())
            .await
            .with_context(|| {
                format!(
                    "the checkpoint mirror at {endpoint} did not answer within {:.0?}",
                    self.timeout
                )
            })?
            .with_context(|| format!("the checkpoint mirror at {endpoint} closed the connection"))??;
        let frame = Frame::<MirrorMessage>::decode(body.freeze())?;
        if let MirrorMessage::Refused { reason } = &frame.header {
            bail!("the checkpoint mirror at {endpoint}: {reason}");
        }
        Ok(frame)
    }

    /// Stores `bytes` as step `step`'s file `name` at the mirror at `endpoint`; answers what it
    /// wrote.
    pub async fn store(&self, endpoint: &str, step: usize, name: &str, bytes: &[u8]) -> Result<FileRecord> {
        let mut framed = self.connect(endpoint).await?;
        send_pieces(&mut framed, bytes, self.max_frame, |offset, total| {
            MirrorMessage::Store {
                step,
                name: name.to_string(),
                offset,
                total,
            }
        })
        .await?;
        match self.answer(&mut framed, endpoint).await?.header {
            MirrorMessage::Stored(record) => Ok(record),
            other => bail!("the checkpoint mirror at {endpoint} answered a copy with {other:?}"),
        }
    }

    /// Step `step`'s file `name` from the committed checkpoint of the mirror at `endpoint`.
    pub async fn fetch(&self, endpoint: &str, step: usize, name: &str) -> Result<Vec<u8>> {
        let mut framed = self.connect(endpoint).await?;
        let fetch = MirrorMessage::Fetch {
            step,
            name: name.to_string(),
        };
        framed.send(Frame::control(fetch).encode()?).await?;
        let mut bytes = Vec::new();
        loop {
            let frame = self.answer(&mut framed, endpoint).await?;
            let MirrorMessage::Piece { offset, total } = frame.header else {
                bail!(
                    "the checkpoint mirror at {endpoint} answered a fetch with {:?}",
                    frame.header
                );
            };
            let whole = append_piece(&mut bytes, offset, total, &frame.payload)
                .with_context(|| format!("the checkpoint mirror at {endpoint}"))?;
            if whole {
                return Ok(bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::auth::ClusterToken;

    #[actix::test]
    async fn a_copy_stored_at_a_mirror_is_fetched_back_once_committed_and_paths_are_refused() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path(), 2);
        let token = ClusterToken::new(&ClusterToken::generate()?)?.for_job("a job");
        let timeout = Duration::from_secs(5);
        let credentials = Credentials::new(token, timeout);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = listener.local_addr()?.to_string();
        // Pieces of 1 MiB − header room: three of them.
        let max_frame = (1 << 20) + HEADER_ROOM;
        actix::spawn(serve_mirror(listener, store.clone(), credentials.clone(), max_frame));
        let line = MirrorLine {
            credentials,
            max_frame,
            timeout,
        };
        let bytes: Vec<u8> = (0..(5u32 << 19)).map(|i| i as u8).collect();
        let record = line.store(&endpoint, 10, "stage-1.bin", &bytes).await?;
        assert_eq!(record.bytes, bytes.len() as u64);
        let uncommitted = line.fetch(&endpoint, 10, "stage-1.bin").await;
        assert!(uncommitted.is_err(), "only a committed checkpoint is served");
        store.commit(10, 2, vec![record])?;
        assert_eq!(line.fetch(&endpoint, 10, "stage-1.bin").await?, bytes);
        let escape = line.store(&endpoint, 10, "../outside", b"x").await;
        assert!(escape.is_err());
        assert!(!dir.path().join("outside").exists());
        Ok(())
    }
}
