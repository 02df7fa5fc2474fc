//! The frame: a small typed header, then the tensor payload as raw bytes,
//! so a large tensor is never pushed through a serializer.
//!
//! Layout inside one length-delimited frame:
//! `[u32 LE header length][postcard header][payload bytes]`.

use anyhow::{bail, ensure, Context, Result};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_util::codec::LengthDelimitedCodec;

/// One frame: a header and its payload. The coordinator's protocol has its
/// [`Request`](super::protocol::Request)s and [`Answer`](super::protocol::Answer)s as headers;
/// other protocols bring their own header type.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame<H> {
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
    use crate::net::protocol::{Join, Request};
    use bytes::Buf;
    use tokio_util::codec::{Decoder, Encoder};

    #[test]
    fn round_trip_with_payload() -> anyhow::Result<()> {
        let frame = Frame {
            header: Request::Join(Join {
                rank: 3,
                world_size: 4,
                data_endpoint: "127.0.0.1:9".into(),
                mirror: Some("127.0.0.1:10".into()),
                settings: [("train.lr".to_string(), "0.05".to_string())].into(),
            }),
            payload: Bytes::from_static(&[1, 2, 3, 4]),
        };
        assert_eq!(Frame::decode(frame.encode()?)?, frame);
        Ok(())
    }

    #[test]
    fn malformed_frames_are_errors_not_panics() {
        assert!(Frame::<Request>::decode(Bytes::from_static(&[1])).is_err());
        assert!(Frame::<Request>::decode(Bytes::from_static(&[255, 255, 255, 255, 0])).is_err());
        assert!(Frame::<Request>::decode(Bytes::from_static(&[2, 0, 0, 0, 200, 200])).is_err());
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
