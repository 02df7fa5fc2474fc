//! Ring links between processes of one host through shared memory.
//!
//! Over loopback TCP every byte is copied twice by the kernel, and with
//! several ranks on few cores those copies are what limits an all-reduce.
//! Here each link is a file in `/dev/shm` mapped by both neighbours: the
//! sender copies a chunk into one of `SLOTS` slots and rings a doorbell
//! (a 32-byte record) over the TCP connection; the receiver reduces straight
//! out of the slot and returns a one-byte credit. Only doorbells and
//! credits cross the kernel, and every wait is a blocking socket read, so
//! nothing spins, timeouts work as over TCP, and a dead neighbour shows as a
//! closed socket.

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::send_queue::{MessageSink, SendQueue};
use super::tcp::{ConnectedLinks, Incoming, ProcessTransport, ReceiveLeft};
use super::transport::MessageHeader;

/// Bytes per slot: one piece of the streamed all-reduce.
const SLOT_BYTES: usize = 1 << 18;
/// Slots per link: chunks in flight before the sender waits for a credit
/// (4 MiB per link).
const SLOTS: usize = 16;
const REGION_BYTES: usize = SLOT_BYTES * SLOTS;
const SHM_PREFIX: &str = "/dev/shm/flotilla-";
const DOORBELL_MAGIC: u64 = u64::from_le_bytes(*b"FLOTSHM1");

/// A shared mapping of one link's slots.
struct Region {
    ptr: *mut u8,
}

// SAFETY: the mapping is plain memory; which side may touch which slot when
// is governed by the doorbell/credit protocol, not by thread identity.
unsafe impl Send for Region {}

impl Region {
    /// Creates the link's file (which must not exist yet) and maps it. Only this user may open
    /// it: every gradient on the link passes through it.
    fn create(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(REGION_BYTES as u64)?;
        Self::map(&file)
    }

    /// Maps the file the left neighbour created.
    fn open(path: &Path) -> io::Result<Self> {
        Self::map(&OpenOptions::new().read(true).write(true).open(path)?)
    }

    fn map(file: &std::fs::File) -> io::Result<Self> {
        // SAFETY: a fresh shared mapping of a file of REGION_BYTES bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGION_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { ptr: ptr.cast() })
    }

    fn slot(&self, index: usize) -> *mut u8 {
        // SAFETY: index < SLOTS keeps the pointer inside the mapping.
        unsafe { self.ptr.add((index % SLOTS) * SLOT_BYTES) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.ptr.cast(), REGION_BYTES) };
    }
}

/// "Slot `slot` holds `chunk_len` bytes of message `seq` (`msg_len` bytes
/// in all)."
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Doorbell {
    seq: u64,
    msg_len: u64,
    chunk_len: u32,
    slot: u32,
}

impl Doorbell {
    const SIZE: usize = 32;

    fn encode(&self) -> [u8; Self::SIZE] {
        let mut out = [0u8; Self::SIZE];
        out[..8].copy_from_slice(&DOORBELL_MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.msg_len.to_le_bytes());
        out[24..28].copy_from_slice(&self.chunk_len.to_le_bytes());
        out[28..].copy_from_slice(&self.slot.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8; Self::SIZE]) -> Option<Self> {
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap_or_default());
        (u64_at(0) == DOORBELL_MAGIC).then(|| Self {
            seq: u64_at(8),
            msg_len: u64_at(16),
            chunk_len: u32_at(24),
            slot: u32_at(28),
        })
    }
}

/// The sending half of a link, run by the send-queue thread.
struct ShmSink {
    doorbells: TcpStream,
    region: Region,
    next_slot: usize,
    in_flight: usize,
}

impl MessageSink for ShmSink {
    fn write_message(&mut self, header: MessageHeader, bytes: &[u8]) -> io::Result<()> {
        // An empty message still rings once, so the receiver sees it.
        let chunks: Box<dyn Iterator<Item = &[u8]>> = if bytes.is_empty() {
            Box::new(std::iter::once(bytes))
        } else {
            Box::new(bytes.chunks(SLOT_BYTES))
        };
        for chunk in chunks {
            if self.in_flight == SLOTS {
                let mut credit = [0u8; 1];
                self.doorbells.read_exact(&mut credit)?;
                self.in_flight -= 1;
            }
            let slot = self.region.slot(self.next_slot);
            // SAFETY: this slot is free (credited back) and chunk fits in it.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), slot, chunk.len()) };
            let bell = Doorbell {
                seq: header.seq,
                msg_len: header.len,
                chunk_len: chunk.len() as u32,
                slot: (self.next_slot % SLOTS) as u32,
            };
            self.doorbells.write_all(&bell.encode())?;
            self.next_slot = (self.next_slot + 1) % SLOTS;
            self.in_flight += 1;
        }
        Ok(())
    }
}

impl Drop for ShmSink {
    /// Takes back every outstanding credit before the socket closes: closing
    /// with unread credits would reset the connection and destroy doorbells
    /// the right neighbour has not read yet. Bounded by the read timeout;
    /// stops at once if the neighbour is gone.
    fn drop(&mut self) {
        let mut credit = [0u8; 1];
        while self.in_flight > 0 && self.doorbells.read_exact(&mut credit).is_ok() {
            self.in_flight -= 1;
        }
    }
}

/// One rank's two shared-memory links.
pub type ShmTransport = ProcessTransport<ShmLeft>;

/// The receiving half of a shared-memory link: doorbells read from the
/// socket, the chunks they announce out of the left neighbour's region.
pub struct ShmLeft {
    from_left: TcpStream,
    /// The left neighbour's link file, mapped.
    region: Region,
    next_slot: usize,
}

/// Removes the link file once both sides have it mapped (or on failure).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl ReceiveLeft for ShmLeft {
    /// Swaps the data path of both links to shared memory. Every endpoint
    /// must be on this host.
    fn open(links: ConnectedLinks) -> Result<ShmTransport> {
        let ConnectedLinks {
            place,
            mut to_right,
            mut from_left,
            timeout,
            sockets,
        } = links;
        let (rank, left) = (place.rank(), place.rank_at(place.left()));
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = PathBuf::from(format!("{SHM_PREFIX}{}-{rank}-{unique}", std::process::id()));
        let outgoing = Region::create(&path).with_context(|| format!("rank {rank}: creating {}", path.display()))?;
        let _remove = RemoveOnDrop(path.clone());
        let name = path.to_string_lossy().into_owned();
        to_right.write_all(&(name.len() as u16).to_le_bytes())?;
        to_right.write_all(name.as_bytes())?;

        let mut len = [0u8; 2];
        from_left
            .read_exact(&mut len)
            .with_context(|| format!("rank {rank}: shared-memory handshake with rank {left}"))?;
        let mut left_name = vec![0u8; usize::from(u16::from_le_bytes(len))];
        from_left.read_exact(&mut left_name)?;
        let left_name = String::from_utf8_lossy(&left_name).into_owned();
        let left_path = PathBuf::from(&left_name);
        // Only a link file of this runtime is mapped, never an arbitrary path.
        if !left_name.starts_with(SHM_PREFIX) || left_name.contains("..") {
            bail!(
                "rank {rank}: rank {left} offered {} as its shared-memory link",
                left_path.display()
            );
        }
        let incoming = Region::open(&left_path).with_context(|| {
            format!(
                "rank {rank}: mapping rank {left}'s link {} (not on this host? set cluster.shared_memory = false)",
                left_path.display()
            )
        })?;
        from_left.write_all(&[1])?;
        let mut ack = [0u8; 1];
        to_right
            .read_exact(&mut ack)
            .with_context(|| format!("rank {rank}: shared-memory handshake, waiting for the right neighbour"))?;
        let sink = ShmSink {
            doorbells: to_right,
            region: outgoing,
            next_slot: 0,
            in_flight: 0,
        };
        let to_right = SendQueue::new(sink, format!("ring-shm-send-rank{rank}"))?;
        let from_left = ShmLeft {
            from_left,
            region: incoming,
            next_slot: 0,
        };
        Ok(ProcessTransport::new(place, to_right, from_left, timeout, sockets))
    }

    fn recv(&mut self, incoming: &Incoming, on_recv: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
        let (op, seq, len) = (incoming.op, incoming.header.seq, incoming.header.len as usize);
        let mut offset = 0;
        loop {
            let bell = self.read_doorbell(incoming)?;
            let chunk = bell.chunk_len as usize;
            let expected_slot = (self.next_slot % SLOTS) as u32;
            if bell.seq != seq
                || bell.msg_len != len as u64
                || bell.slot != expected_slot
                || chunk > SLOT_BYTES
                || offset + chunk > len
            {
                bail!(
                    "{op}: rank {} rang for message #{} of {} bytes ({} bytes in slot {}), expected #{seq} of {len} bytes in slot {expected_slot} (ranks out of step)",
                    incoming.left_rank(),
                    bell.seq,
                    bell.msg_len,
                    chunk,
                    bell.slot
                );
            }
            // SAFETY: the doorbell hands this slot to us until we credit it.
            let piece = unsafe { std::slice::from_raw_parts(self.region.slot(self.next_slot), chunk) };
            on_recv(offset, piece);
            self.next_slot = (self.next_slot + 1) % SLOTS;
            (&self.from_left).write_all(&[1]).map_err(|e| incoming.error(e))?;
            offset += chunk;
            if offset == len {
                return Ok(());
            }
        }
    }
}

impl ShmLeft {
    fn read_doorbell(&self, incoming: &Incoming) -> Result<Doorbell> {
        let mut bytes = [0u8; Doorbell::SIZE];
        (&self.from_left)
            .read_exact(&mut bytes)
            .map_err(|e| incoming.error(e))?;
        Doorbell::decode(&bytes).ok_or_else(|| {
            anyhow::anyhow!(
                "{}: corrupt doorbell from rank {} (bad magic)",
                incoming.op,
                incoming.left_rank()
            )
        })
    }
}

/// Whether the ring can use shared memory: every endpoint on one host, and
/// that host has `/dev/shm` (the same answer on every rank of the host).
pub fn usable_for(endpoints: &[SocketAddr]) -> bool {
    endpoints.windows(2).all(|w| w[0].ip() == w[1].ip()) && Path::new("/dev/shm").is_dir()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn link_files_are_private_to_their_user() {
        let path = PathBuf::from(format!("{SHM_PREFIX}mode-test-{}", std::process::id()));
        let _remove = RemoveOnDrop(path.clone());
        let _region = Region::create(&path).expect("creates the link file");
        let mode = std::fs::metadata(&path).expect("the link file").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{} has mode {mode:o}", path.display());
    }
}
