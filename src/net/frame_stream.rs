//! Frames written straight from typed vectors to a stream and read straight from it into typed
//! vectors: the same bytes as [`super::frame`] inside the length-delimited codec
//! (`[u32 BE frame length][u32 LE header length][postcard header][payload]`), without
//! assembling the frame in a buffer first. A pull's 25 MB of rows go from the shard's vector to
//! the socket and from the socket into the trainer's vector: the kernel's copies are the only
//! ones.
//!
//! Errors: a transport failure keeps its [`std::io::ErrorKind`]; a frame that breaks the format
//! (above the cap, a header that does not parse, a payload that disagrees with its header) is an
//! [`std::io::ErrorKind::InvalidData`] error naming what is wrong, so callers can tell a broken
//! line (worth a retry) from a broken peer (not).

use std::io::{Error, ErrorKind, Result};

use bytemuck::Pod;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const HEADER_LEN_BYTES: usize = 4;
/// Headers are small; a larger claimed length is a malformed frame.
const MAX_HEADER_BYTES: usize = 1 << 20;
/// Payload is read in pieces of this size: the memory reserved for a section (bounded by the
/// frame cap) is written, and so committed, only as its bytes arrive.
const READ_PIECE_BYTES: usize = 1 << 20;

/// A format error, as the I/O error callers see.
pub fn malformed(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidData, format!("malformed frame: {what}"))
}

/// Writes one frame: `header`, then `sections` in order as they lie in memory. Flushes, so the
/// frame is on its way when this returns.
pub async fn write_frame<W, H>(out: &mut W, header: &H, sections: &[&[u8]], max_frame_bytes: usize) -> Result<()>
where
    W: AsyncWrite + Unpin,
    H: Serialize,
{
    let header = postcard::to_stdvec(header).map_err(|e| Error::other(format!("encoding a frame header: {e}")))?;
    let body = HEADER_LEN_BYTES + header.len() + sections.iter().map(|s| s.len()).sum::<usize>();
    if body > max_frame_bytes {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("a frame of {body} bytes exceeds the cap of {max_frame_bytes} bytes (cluster.max_frame_mb)"),
        ));
    }
    let body = u32::try_from(body).map_err(|_| Error::new(ErrorKind::InvalidInput, "a frame above 4 GiB"))?;
    let mut head = Vec::with_capacity(2 * HEADER_LEN_BYTES + header.len());
    head.extend_from_slice(&body.to_be_bytes());
    head.extend_from_slice(&(header.len() as u32).to_le_bytes());
    head.extend_from_slice(&header);
    out.write_all(&head).await?;
    for section in sections {
        out.write_all(section).await?;
    }
    out.flush().await
}

/// Reads the next frame's header; its payload is left in the stream for the returned
/// [`PayloadReader`]. `None` when the stream ends between frames.
pub async fn read_frame<'a, R, H>(input: &'a mut R, max_frame_bytes: usize) -> Result<Option<(H, PayloadReader<'a, R>)>>
where
    R: AsyncRead + Unpin,
    H: DeserializeOwned,
{
    let mut length = [0u8; 4];
    match input.read_exact(&mut length).await {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let body = u32::from_be_bytes(length) as usize;
    if body > max_frame_bytes {
        return Err(malformed(format!(
            "{body} bytes, above the cap of {max_frame_bytes} bytes"
        )));
    }
    if body < HEADER_LEN_BYTES {
        return Err(malformed(format!("{body} bytes, shorter than its header length")));
    }
    let mut header_len = [0u8; HEADER_LEN_BYTES];
    input.read_exact(&mut header_len).await?;
    let header_len = u32::from_le_bytes(header_len) as usize;
    let left = body - HEADER_LEN_BYTES;
    if header_len > MAX_HEADER_BYTES || header_len > left {
        return Err(malformed(format!("header claims {header_len} bytes, frame has {left}")));
    }
    let mut header = vec![0u8; header_len];
    input.read_exact(&mut header).await?;
    let header = postcard::from_bytes(&header).map_err(|e| malformed(format!("header: {e}")))?;
    Ok(Some((
        header,
        PayloadReader {
            input,
            left: left - header_len,
        },
    )))
}

/// The payload of a frame being read, taken in order against its header's counts straight into
/// typed vectors.
pub struct PayloadReader<'a, R> {
    input: &'a mut R,
    left: usize,
}

impl<R: AsyncRead + Unpin> PayloadReader<'_, R> {
    /// The next `n` values. Never reads past the frame.
    pub async fn values<T: Pod>(&mut self, n: usize) -> Result<Vec<T>> {
        let mut values = Vec::new();
        self.values_into(n, &mut values).await?;
        Ok(values)
    }

    /// The next `n` values, appended to `out`.
    pub async fn values_into<T: Pod>(&mut self, n: usize, out: &mut Vec<T>) -> Result<()> {
        let size = std::mem::size_of::<T>();
        let bytes = n.checked_mul(size).filter(|&bytes| bytes <= self.left);
        let Some(bytes) = bytes else {
            return Err(malformed(format!(
                "the header announces {} more payload bytes, {} are left",
                n.saturating_mul(size),
                self.left
            )));
        };
        out.reserve(n);
        let end = out.len() + n;
        let piece = (READ_PIECE_BYTES / size).max(1);
        while out.len() < end {
            let start = out.len();
            out.resize((start + piece).min(end), T::zeroed());
            self.input
                .read_exact(bytemuck::cast_slice_mut(&mut out[start..]))
                .await?;
        }
        self.left -= bytes;
        Ok(())
    }

    /// The whole payload has been taken; bytes beyond what the header announced are an error.
    pub fn finish(self) -> Result<()> {
        match self.left {
            0 => Ok(()),
            left => Err(malformed(format!(
                "{left} payload bytes beyond what the header announces"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
        futures::executor::block_on(future)
    }

    #[test]
    fn sections_round_trip_into_typed_vectors() -> Result<()> {
        let ids = [1u64, u64::MAX];
        let floats = [0.5f32, -2.0, 3.25];
        let mut wire = Vec::new();
        let sections = [bytemuck::cast_slice(&ids[..]), bytemuck::cast_slice(&floats[..])];
        block_on(write_frame(&mut wire, &("rows", 7u32), &sections, 1 << 10))?;
        let mut input = &wire[..];
        let (header, mut payload) = block_on(read_frame::<_, (String, u32)>(&mut input, 1 << 10))?.expect("a frame");
        assert_eq!(header, ("rows".to_string(), 7));
        assert_eq!(block_on(payload.values::<u64>(2))?, ids);
        assert_eq!(block_on(payload.values::<f32>(3))?, floats);
        payload.finish()?;
        assert!(
            block_on(read_frame::<_, (String, u32)>(&mut input, 1 << 10))?.is_none(),
            "the end"
        );
        Ok(())
    }

    #[test]
    fn the_same_bytes_as_the_codec_frame() -> anyhow::Result<()> {
        use tokio_util::codec::Encoder;
        let payload = [9u8, 8, 7];
        let mut wire = Vec::new();
        block_on(write_frame(&mut wire, &42u16, &[&payload[..]], 1 << 10))?;
        let body = super::super::frame::encode_with(&42u16, 3, |out| out.extend_from_slice(&payload))?;
        let mut framed = bytes::BytesMut::new();
        super::super::frame::codec(1 << 10).encode(body, &mut framed)?;
        assert_eq!(wire, framed.to_vec());
        Ok(())
    }

    #[test]
    fn broken_frames_are_invalid_data() -> Result<()> {
        let mut wire = Vec::new();
        block_on(write_frame(&mut wire, &1u8, &[&[0u8; 8][..]], 1 << 10))?;
        // A payload shorter than the header says.
        let mut input = &wire[..];
        let (_, mut payload) = block_on(read_frame::<_, u8>(&mut input, 1 << 10))?.expect("a frame");
        let err = block_on(payload.values::<u64>(2)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
        assert!(
            err.to_string().contains("announces 16 more payload bytes, 8 are left"),
            "{err}"
        );
        // Bytes beyond it.
        let mut input = &wire[..];
        let (_, payload) = block_on(read_frame::<_, u8>(&mut input, 1 << 10))?.expect("a frame");
        assert_eq!(payload.finish().unwrap_err().kind(), ErrorKind::InvalidData);
        // A frame above the cap is refused from its length alone; so is a torn one.
        let err = block_on(read_frame::<_, u8>(&mut &wire[..], 8))
            .err()
            .expect("above the cap");
        assert!(err.to_string().contains("above the cap of 8 bytes"), "{err}");
        let claimed = (u32::MAX).to_be_bytes();
        assert!(block_on(read_frame::<_, u8>(&mut &claimed[..], usize::MAX)).is_err());
        // Written frames obey the cap too.
        let err = block_on(write_frame(&mut Vec::new(), &1u8, &[&[0u8; 64][..]], 16)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        Ok(())
    }
}
