//! The frame: a small typed header, then the tensor payload as raw bytes,
//! so a large tensor is never pushed through a serializer.
//!
//! Layout inside one length-delimited frame:
//! `[u32 LE header length][postcard header][payload bytes]`.

use anyhow::{bail, ensure, Context, Result};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use super::protocol::{Beat, DeadProcess, Membership, Roster, Settings};

/// Messages of the control plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ControlMessage {
    /// A trainer announces itself at rendezvous, with the endpoint its ring
    /// listener is bound to.
    Join {
        /// The rank the launcher gave it.
        rank: usize,
        /// The world size it was configured with, checked against the
        /// coordinator's.
        world_size: usize,
        /// `ip:port` of its data-plane listener.
        data_endpoint: String,
        /// `ip:port` of its checkpoint mirror, if it serves one.
        mirror: Option<String>,
        /// The settings it was started with, by dotted key (no secret among them).
        settings: Settings,
    },
    /// A join was refused: the rank was started for another job (the reason names the
    /// difference), so no restart of it can help.
    Mismatched {
        /// What differs.
        reason: String,
    },
    /// Rendezvous complete: every rank's data endpoint, the generation, the step to resume at.
    Roster(Box<Roster>),
    /// A request was refused or failed; the reason names what went wrong.
    Refused {
        /// Human-readable cause.
        reason: String,
    },
    /// A rank waits at the barrier `name`.
    Barrier {
        /// Who is waiting.
        rank: usize,
        /// Which barrier.
        name: String,
    },
    /// Everyone reached barrier `name`.
    Released {
        /// Which barrier.
        name: String,
    },
    /// A rank hands rank 0 its part of gather `name`: the frame's payload.
    Gather {
        /// Who hands it.
        rank: usize,
        /// Which gather.
        name: String,
    },
    /// Everyone reached gather `name`; to rank 0 the payload is every rank's part, by rank,
    /// back to back (to the others it is empty).
    Gathered {
        /// Which gather.
        name: String,
        /// Bytes of each rank's part, by rank (to every rank: how a gather in pieces knows
        /// when every rank has sent its last).
        lengths: Vec<u64>,
    },
    /// A rank wrote its files of step `step`'s checkpoint (the payload: their records, JSON)
    /// and waits for the commit.
    Acknowledge {
        /// Who acknowledges.
        rank: usize,
        /// The checkpoint's step.
        step: usize,
    },
    /// Every rank acknowledged step `step`'s checkpoint and the coordinator committed it (the
    /// payload: its record of which node holds which file, JSON).
    Committed {
        /// The checkpoint's step.
        step: usize,
    },
    /// A rank is alive; sent every `fault_tolerance.heartbeat_interval_ms` on a connection of
    /// its own. Answered by [`ControlMessage::Alive`], or refused once the job is aborted.
    Heartbeat {
        /// Who is alive.
        rank: usize,
        /// Its process id on its node.
        pid: u32,
        /// The generation it last joined, and its members (none before its first roster).
        member_of: Option<Membership>,
    },
    /// A launcher asks which processes the coordinator declared dead.
    ListDead,
    /// The processes declared dead, newest last.
    Dead {
        /// Rank and process id of each.
        processes: Vec<DeadProcess>,
    },
    /// The coordinator heard the heartbeat (or the farewell): go on, or roll back.
    Alive(Beat),
    /// A rank has finished and stops heartbeating: its silence is no longer a death.
    Leave {
        /// Who leaves.
        rank: usize,
    },
    /// What time is it at the coordinator? Asked a few times at start by roles that record a
    /// timeline, to put every process's spans on the coordinator's clock.
    ClockProbe,
    /// The coordinator's wall clock when it answered a [`ControlMessage::ClockProbe`].
    Clock {
        /// Microseconds since the Unix epoch.
        unix_us: f64,
    },
}

impl ControlMessage {
    /// The rank a role's request speaks for; `None` for the coordinator's answers and probes.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Self::Join { rank, .. }
            | Self::Barrier { rank, .. }
            | Self::Gather { rank, .. }
            | Self::Acknowledge { rank, .. }
            | Self::Heartbeat { rank, .. }
            | Self::Leave { rank } => Some(*rank),
            Self::Roster(_)
            | Self::Refused { .. }
            | Self::Released { .. }
            | Self::Gathered { .. }
            | Self::Committed { .. }
            | Self::Mismatched { .. }
            | Self::ListDead
            | Self::Dead { .. }
            | Self::Alive(_)
            | Self::ClockProbe
            | Self::Clock { .. } => None,
        }
    }
}

/// One frame: a header and its payload. The control plane's headers are [`ControlMessage`]s;
/// other protocols (the parameter servers') bring their own header type.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame<H = ControlMessage> {
    /// The typed message.
    pub header: H,
    /// Raw little-endian tensor bytes (empty for pure control messages).
    pub payload: Bytes,
}

const HEADER_LEN_BYTES: usize = 4;
/// Headers are small; a larger claimed length is a malformed frame.
const MAX_HEADER_BYTES: usize = 1 << 20;

impl<H: Serialize + DeserializeOwned> Frame<H> {
    /// A frame without payload.
    pub fn control(header: H) -> Self {
        Self {
            header,
            payload: Bytes::new(),
        }
    }

    /// Encodes the frame body (the codec adds the outer length).
    pub fn encode(&self) -> Result<Bytes> {
        encode_with(&self.header, self.payload.len(), |out| {
            out.extend_from_slice(&self.payload)
        })
    }

    /// Decodes a frame body, rejecting truncated or malformed ones without
    /// trusting any length it claims.
    pub fn decode(mut body: Bytes) -> Result<Self> {
        ensure!(
            body.len() >= HEADER_LEN_BYTES,
            "malformed frame: {} bytes, shorter than its header length",
            body.len()
        );
        let header_len = u32::from_le_bytes(body[..HEADER_LEN_BYTES].try_into()?) as usize;
        if header_len > MAX_HEADER_BYTES || header_len > body.len() - HEADER_LEN_BYTES {
            bail!(
                "malformed frame: header claims {header_len} bytes, frame has {}",
                body.len() - HEADER_LEN_BYTES
            );
        }
        let rest = body.split_off(HEADER_LEN_BYTES);
        let mut rest = rest;
        let payload = rest.split_off(header_len);
        let header = postcard::from_bytes(&rest).context("malformed frame header")?;
        Ok(Self { header, payload })
    }
}

/// Encodes a frame body whose `payload_len` payload bytes `write_payload` appends, straight into
/// the one buffer that is sent, so a large payload is copied once.
pub fn encode_with<H: Serialize>(
    header: &H,
    payload_len: usize,
    write_payload: impl FnOnce(&mut BytesMut),
) -> Result<Bytes> {
    let header = postcard::to_stdvec(header).context("encoding a frame header")?;
    let mut out = BytesMut::with_capacity(HEADER_LEN_BYTES + header.len() + payload_len);
    out.put_u32_le(header.len() as u32);
    out.extend_from_slice(&header);
    write_payload(&mut out);
    Ok(out.freeze())
}

/// The length-delimited codec with a deliberate cap (the default is 8 MiB).
pub fn codec(max_frame_bytes: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(max_frame_bytes)
        .length_field_type::<u32>()
        .new_codec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Buf;
    use tokio_util::codec::{Decoder, Encoder};

    #[test]
    fn round_trip_with_payload() -> anyhow::Result<()> {
        let frame = Frame {
            header: ControlMessage::Join {
                rank: 3,
                world_size: 4,
                data_endpoint: "127.0.0.1:9".into(),
                mirror: Some("127.0.0.1:10".into()),
                settings: [("train.lr".to_string(), "0.05".to_string())].into(),
            },
            payload: Bytes::from_static(&[1, 2, 3, 4]),
        };
        assert_eq!(Frame::decode(frame.encode()?)?, frame);
        Ok(())
    }

    #[test]
    fn malformed_frames_are_errors_not_panics() {
        assert!(Frame::<ControlMessage>::decode(Bytes::from_static(&[1])).is_err());
        assert!(Frame::<ControlMessage>::decode(Bytes::from_static(&[255, 255, 255, 255, 0])).is_err());
        assert!(Frame::<ControlMessage>::decode(Bytes::from_static(&[2, 0, 0, 0, 200, 200])).is_err());
    }

    #[test]
    fn frames_above_the_cap_are_refused() -> anyhow::Result<()> {
        let mut codec = codec(16);
        let mut wire = BytesMut::new();
        codec.encode(Bytes::from(vec![0u8; 8]), &mut wire)?;
        assert_eq!(codec.decode(&mut wire)?.map(|b| b.remaining()), Some(8));
        assert!(codec.encode(Bytes::from(vec![0u8; 17]), &mut BytesMut::new()).is_err());
        let mut claimed = BytesMut::from(&(1u32 << 30).to_be_bytes()[..]);
        assert!(
            codec.decode(&mut claimed).is_err(),
            "a huge claimed length is refused before allocating"
        );
        Ok(())
    }
}
