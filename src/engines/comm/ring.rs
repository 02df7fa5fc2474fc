//! Ring collectives over any [`RingTransport`].
//!
//! All-reduce streams: segments are cut into pieces, and a piece moves on
//! to the right neighbour as soon as it has been reduced, so the steps
//! below overlap like a pipeline (as NCCL's ring does).
//!
//! The buffer is cut into `n` segments (segment `i` is
//! `i*len/n..(i+1)*len/n`, so any length works, including 0 and lengths not
//! divisible by `n`). Reduce-scatter: in step `k` every rank sends segment
//! `rank-k` and adds the received segment `rank-k-1` into its own copy;
//! after `n-1` steps rank `r` holds the full sum of segment `r+1`.
//! All-gather: `n-1` more steps pass the finished segments around. Each
//! segment is summed on exactly one rank and then copied, so every rank ends
//! with bit-identical values, and the order of additions depends only on
//! `n` — the same in threads and in processes.

use std::borrow::Cow;
use std::ops::Range;

use anyhow::{ensure, Result};

use super::memory;
use super::transport::RingTransport;
use super::wire::{self, Wire};

/// Collectives for one rank: the ring's, on host buffers, and on GPU jobs NCCL's, on device
/// tensors.
pub struct Communicator {
    transport: Box<dyn RingTransport>,
    /// The node and rail rings a hierarchical all-reduce runs over, beside the flat ring.
    levels: Option<Box<Levels>>,
    /// The bfloat16 copy of the buffer a [`Wire::Bf16`] all-reduce sends from and receives into,
    /// kept between calls.
    staging: Vec<u16>,
    #[cfg(feature = "cuda")]
    nccl: Option<super::nccl::NcclComm>,
}

/// Views received bytes as values, copying only if they are misaligned.
fn as_values<T: bytemuck::Pod>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(floats) => Cow::Borrowed(floats),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// Floats per piece of the streamed all-reduce (256 KiB): small enough that
/// a piece is reduced and forwarded while still in cache and the ring fills
/// fast, large enough that the per-message cost stays small. Measured best
/// of 64 KiB – 2 MiB over both TCP and shared memory (BENCHMARKS.md).
const PIECE_FLOATS: usize = 64 * 1024;

/// `range` cut into consecutive pieces of at most [`PIECE_FLOATS`].
fn pieces(range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range
        .step_by(PIECE_FLOATS)
        .map(move |start| start..(start + PIECE_FLOATS).min(end))
}

fn segment(len: usize, n: usize, i: usize) -> Range<usize> {
    (i * len / n)..((i + 1) * len / n)
}

/// The segment of a buffer of `len` values rank `rank` of a ring of `n` finishes first in the
/// ring all-reduce: the reduce-scatter's last step hands it the sums of the segment after its
/// own.
fn ring_shard(len: usize, n: usize, rank: usize) -> Range<usize> {
    segment(len, n, (rank + 1) % n.max(1))
}

/// A shared view of segment `a` and a mutable one of segment `b` of the same
/// buffer; the two must not overlap.
fn split_segments<T>(data: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    if a.end <= b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = data.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

impl Communicator {
    /// A communicator over `transport`.
    pub fn new(transport: Box<dyn RingTransport>) -> Self {
        Self {
            transport,
            levels: None,
            staging: Vec::new(),
            #[cfg(feature = "cuda")]
            nccl: None,
        }
    }

    /// This communicator with a hierarchical all-reduce: a reduce-scatter over `node` (the
    /// ranks of this rank's node), an all-reduce of this rank's share over `rail` (the ranks of
    /// its local index on every node), and an all-gather over `node` (see
    /// [`super::hierarchy`]). The other collectives keep to the flat ring.
    pub fn into_levels(mut self, node: Box<dyn RingTransport>, rail: Box<dyn RingTransport>) -> Self {
        self.levels = Some(Box::new(Levels {
            node: Self::new(node),
            rail: Self::new(rail),
            shards_in_node: false,
        }));
        self
    }

    /// This hierarchical communicator with shards that split a buffer over the ranks of a node
    /// alone, every node holding the same shards (sharding inside the nodes, replicas across
    /// them): [`Communicator::reduce_scatter_sum_as`] then sums this rank's node share over the
    /// node and all-reduces it across the nodes, and [`Communicator::all_gather_shards_as`]
    /// gathers within the node. The sums are the hierarchical all-reduce's. A flat ring has no
    /// nodes to shard in: an error.
    pub fn sharding_within_nodes(mut self) -> Result<Self> {
        let Some(levels) = self.levels.as_mut() else {
            anyhow::bail!(
                "sharding inside the nodes needs the hierarchical rings (several nodes of several ranks), \
                 and this rank's ring of {} is flat",
                self.transport.world_size()
            )
        };
        levels.shards_in_node = true;
        Ok(self)
    }

    /// Whether the all-reduce is hierarchical.
    pub fn is_hierarchical(&self) -> bool {
        self.levels.is_some()
    }

    /// Joins the ranks' NCCL communicator when they train on distinct GPUs (see
    /// [`super::nccl::connect`]); device tensors then go through NCCL, each collective within
    /// `timeout`.
    #[cfg(feature = "cuda")]
    pub fn connect_nccl(&mut self, device: &candle_core::Device, timeout: std::time::Duration) -> Result<()> {
        self.nccl = super::nccl::connect(self, device, timeout)?;
        Ok(())
    }

    /// Joins the ranks' NCCL communicator on GPU `device`, whatever the world (see
    /// [`super::nccl::join`]).
    #[cfg(feature = "cuda")]
    pub fn join_nccl(&mut self, device: &candle_core::Device, timeout: std::time::Duration) -> Result<()> {
        self.nccl = Some(super::nccl::join(self, device.as_cuda_device()?, timeout)?);
        Ok(())
    }

    /// The NCCL communicator, on GPU jobs whose ranks have one.
    #[cfg(feature = "cuda")]
    pub fn nccl(&self) -> Option<&super::nccl::NcclComm> {
        self.nccl.as_ref()
    }

    /// The communicator of a world of one: every collective is a no-op.
    pub fn single() -> Self {
        let transport = memory::ring(1, std::time::Duration::from_secs(1))
            .pop()
            .expect("a ring of one has one end");
        Self::new(Box::new(transport))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Ranks in the ring.
    pub fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    /// What breaks the ring (and a hierarchy's node and rail rings) from another thread.
    pub fn link_breaks(&self) -> Vec<super::LinkBreak> {
        let levels = self
            .levels
            .iter()
            .flat_map(|l| l.node.link_breaks().into_iter().chain(l.rail.link_breaks()));
        self.transport.link_break().into_iter().chain(levels).collect()
    }

    /// Sums `data` over all ranks, in place.
    pub fn all_reduce_sum(&mut self, op: &str, data: &mut [f32]) -> Result<()> {
        self.all_reduce_sum_as(op, data, Wire::F32)
    }

    /// Sums `data` over all ranks, in place, its values travelling as `wire` says.
    pub fn all_reduce_sum_as(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<()> {
        if let Some(levels) = self.levels.as_mut() {
            return levels.all_reduce_sum(op, data, wire);
        }
        let n = self.world_size();
        self.ring_steps(op, data, 0..2 * n.saturating_sub(1), wire)
    }

    /// The part of a buffer of `len` values whose finished sums this rank holds after
    /// [`Communicator::reduce_scatter_sum_as`], and hands every rank in
    /// [`Communicator::all_gather_shards_as`]: the ranks' shards are disjoint and cover the
    /// buffer (a rank's may be empty when `len` is below the world size).
    pub fn shard_of(&self, len: usize) -> Range<usize> {
        match &self.levels {
            Some(levels) => levels.shard_of(len),
            None => ring_shard(len, self.world_size(), self.rank()),
        }
    }

    /// Sums `data` over all ranks, leaving this rank the finished sums of its shard
    /// ([`Communicator::shard_of`], returned) and partial sums elsewhere, its values travelling
    /// as `wire` says: a sharded optimizer's reduction of gradients, half an all-reduce's
    /// traffic. On a bfloat16 wire the partial sums are rounded as they travel; the finished
    /// ones stay `f32`.
    pub fn reduce_scatter_sum_as(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<Range<usize>> {
        if let Some(levels) = self.levels.as_mut() {
            return levels.reduce_scatter_sum(op, data, wire);
        }
        self.reduce_scatter_sum(op, data, wire)
    }

    /// Hands every rank's shard of `data` ([`Communicator::shard_of`]) to every rank: after a
    /// sharded optimizer's step, the parameters each rank updated reach all. On a bfloat16 wire
    /// every rank, the owner too, ends with the rounded values, so all hold the same bits.
    pub fn all_gather_shards_as(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<()> {
        if let Some(levels) = self.levels.as_mut() {
            return levels.all_gather_shards(op, data, wire);
        }
        self.all_gather_reduced(op, data, wire)
    }

    /// The reduce-scatter half of the ring all-reduce: afterwards this rank holds the sum over
    /// the ring of the returned segment of `data` (the rest is partly reduced).
    fn reduce_scatter_sum(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<Range<usize>> {
        let (n, rank) = (self.world_size(), self.rank());
        self.ring_steps(op, data, 0..n.saturating_sub(1), wire)?;
        Ok(ring_shard(data.len(), n, rank))
    }

    /// The all-gather half of the ring all-reduce: each rank's segment of
    /// [`Communicator::reduce_scatter_sum`] reaches every rank.
    fn all_gather_reduced(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<()> {
        let n = self.world_size();
        self.ring_steps(op, data, n.saturating_sub(1)..2 * n.saturating_sub(1), wire)
    }

    /// Steps `steps` of the ring all-reduce (`0..n-1` reduce, `n-1..2(n-1)` gather), then
    /// waits until everything queued has been sent.
    fn ring_steps(&mut self, op: &str, data: &mut [f32], steps: Range<usize>, wire: Wire) -> Result<()> {
        if self.world_size() == 1 || steps.is_empty() {
            return Ok(());
        }
        let mut staging = std::mem::take(&mut self.staging);
        if wire == Wire::Bf16 && staging.len() < data.len() {
            staging.resize(data.len(), 0);
        }
        let buffers = RingBuffers {
            data: data.as_mut_ptr(),
            staging: staging.as_mut_ptr(),
            wire,
            finished_in: self.world_size() - 1,
        };
        let streamed = self.stream_steps(op, &buffers, data.len(), steps);
        // Queued pieces point into `data` and `staging`: they must be sent before the buffers
        // are handed back, whatever happened.
        let flushed = self.transport.flush(op);
        self.staging = staging;
        streamed.and(flushed)
    }

    /// Ring all-reduce as a pipeline: every piece is forwarded to the right
    /// as soon as it has been received and reduced, instead of waiting for
    /// the whole step, so the steps overlap.
    fn stream_steps(&mut self, op: &str, buffers: &RingBuffers, len: usize, steps: Range<usize>) -> Result<()> {
        let (n, rank) = (self.world_size(), self.rank());
        // The segment received in step `t`, which is also the one sent in
        // step `t + 1`; step 0 sends the rank's own segment.
        let received_in = |t: usize| {
            if t < n - 1 {
                (rank + 2 * n - t - 1) % n
            } else {
                (rank + 2 * n - 1 - t) % n
            }
        };
        // SAFETY (every use of `buffers` below): pieces are disjoint ranges inside the buffers,
        // which stay borrowed until the caller's flush. A piece is queued for sending only after
        // its last write (its reduction or copy), and it is written again only in a later step,
        // with data that the right neighbour can only produce after it has read the whole queued
        // piece, i.e. after the send thread is done with it.
        //
        // The first step sends what the step before it received (step 0: the rank's own
        // segment).
        let first_sent = steps.start.checked_sub(1).map_or(rank, received_in);
        for piece in pieces(segment(len, n, first_sent)) {
            unsafe { self.transport.send_queued(op, buffers.outgoing(&piece, steps.start))? };
        }
        let width = buffers.wire.width();
        for t in steps.clone() {
            let reduce = t < n - 1;
            for piece in pieces(segment(len, n, received_in(t))) {
                if reduce {
                    self.transport
                        .recv(op, piece.len() * width, &mut |offset, bytes| unsafe {
                            buffers.reduce(&piece, offset / width, bytes)
                        })?;
                } else {
                    self.transport.recv_into(op, unsafe { buffers.incoming(&piece) })?;
                    unsafe { buffers.received(&piece) };
                }
                if t + 1 < steps.end {
                    unsafe { self.transport.send_queued(op, buffers.outgoing(&piece, t + 1))? };
                }
            }
        }
        Ok(())
    }

    /// Passes finished segments around the ring: before, rank `r` owns
    /// segment `r + shift`; after, every rank has every segment.
    fn ring_all_gather<T: bytemuck::Pod>(&mut self, op: &str, data: &mut [T], shift: usize) -> Result<()> {
        let n = self.world_size();
        let rank = self.rank();
        let len = data.len();
        let width = std::mem::size_of::<T>();
        for k in 0..n - 1 {
            let send = segment(len, n, (rank + shift + n - k) % n);
            let recv = segment(len, n, (rank + shift + 2 * n - k - 1) % n);
            let recv_len = recv.len();
            let (outgoing, target) = split_segments(data, send, recv);
            let target_bytes: &mut [u8] = bytemuck::cast_slice_mut(target);
            self.transport.exchange(
                op,
                bytemuck::cast_slice(outgoing),
                recv_len * width,
                &mut |offset, piece| {
                    target_bytes[offset..offset + piece.len()].copy_from_slice(piece);
                },
            )?;
        }
        Ok(())
    }

    /// Gathers every rank's `mine` (all ranks pass the same length); element
    /// `r` of the result is rank `r`'s.
    pub fn all_gather(&mut self, op: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size();
        let width = mine.len();
        let mut all = vec![0u8; width * n];
        let rank = self.rank();
        all[rank * width..(rank + 1) * width].copy_from_slice(mine);
        if n > 1 {
            // Blocks of equal width are exactly the ring's segments.
            self.ring_all_gather(op, &mut all, 0)?;
        }
        Ok(all.chunks(width.max(1)).take(n).map(<[u8]>::to_vec).collect())
    }

    /// Gathers every rank's `mine`, of any length: the lengths first, then every part padded to
    /// the longest. Element `r` of the result is rank `r`'s.
    pub fn all_gather_sized(&mut self, op: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let lengths = self.all_gather(&format!("{op} (lengths)"), &(mine.len() as u64).to_le_bytes())?;
        let lengths = lengths
            .iter()
            .map(|bytes| Ok(usize::try_from(u64::from_le_bytes(bytes.as_slice().try_into()?))?))
            .collect::<Result<Vec<usize>>>()?;
        let width = lengths.iter().copied().max().unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(width, 0);
        let mut all = self.all_gather(op, &padded)?;
        for (part, length) in all.iter_mut().zip(lengths) {
            part.truncate(length);
        }
        Ok(all)
    }

    /// Copies `root`'s `data` to every rank, along the ring.
    pub fn broadcast(&mut self, op: &str, data: &mut [u8], root: usize) -> Result<()> {
        let n = self.world_size();
        ensure!(root < n, "{op}: broadcast root {root} is outside world size {n}");
        if self.position_after(root) == 0 {
            self.relay_from_root(op, data, n - 1)
        } else {
            self.relay(op, data, root, n - 1)
        }
    }

    /// How many places along the ring this rank comes after `root`.
    pub(super) fn position_after(&self, root: usize) -> usize {
        let n = self.world_size();
        (self.rank() + n - root) % n
    }

    /// The root's part of a broadcast to the `reach` ranks after it: `data` is only read, so
    /// the root needs no mutable copy of it.
    pub(super) fn relay_from_root(&mut self, op: &str, data: &[u8], reach: usize) -> Result<()> {
        if reach > 0 {
            self.transport.send(op, data)?;
        }
        Ok(())
    }

    /// Another rank's part of a broadcast from `root` to the `reach` ranks after it: one
    /// within reach receives `data`, and passes it on while the next rank is within reach too.
    pub(super) fn relay(&mut self, op: &str, data: &mut [u8], root: usize, reach: usize) -> Result<()> {
        let position = self.position_after(root);
        if position == 0 || position > reach {
            return Ok(());
        }
        let len = data.len();
        self.transport.recv(op, len, &mut |offset, piece| {
            data[offset..offset + piece.len()].copy_from_slice(piece)
        })?;
        if position < reach {
            self.transport.send(op, data)?;
        }
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self, op: &str) -> Result<()> {
        let mut token = [1.0f32];
        self.all_reduce_sum(op, &mut token)
    }
}

/// The rings under a hierarchical all-reduce.
struct Levels {
    /// The ranks of this rank's node.
    node: Communicator,
    /// The ranks of this rank's local index, one per node.
    rail: Communicator,
    /// Shards split a node's ranks alone, replicated across the nodes
    /// ([`Communicator::sharding_within_nodes`]).
    shards_in_node: bool,
}

impl Levels {
    /// Reduce-scatter in the node, all-reduce of this rank's share across the nodes, all-gather
    /// in the node: each share is summed over its node in the node ring's order, then over the
    /// nodes in the rail ring's, on one rank, and copied — so every rank ends with the same
    /// bits, and only a `1/per_node` share of the buffer crosses between nodes.
    fn all_reduce_sum(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<()> {
        let share = self.node.reduce_scatter_sum(op, data, wire)?;
        self.rail.all_reduce_sum_as(op, &mut data[share], wire)?;
        self.node.all_gather_reduced(op, data, wire)
    }

    /// A rank's shard: its rail's shard of its node's share (the share itself when shards
    /// stay in the node).
    fn shard_of(&self, len: usize) -> Range<usize> {
        let share = self.node.shard_of(len);
        if self.shards_in_node {
            return share;
        }
        let within = self.rail.shard_of(share.len());
        share.start + within.start..share.start + within.end
    }

    /// Reduce-scatter in the node, then of this rank's share across the nodes: only a
    /// `1/per_node` share of the buffer crosses between nodes, as in the all-reduce.
    fn reduce_scatter_sum(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<Range<usize>> {
        let share = self.node.reduce_scatter_sum(op, data, wire)?;
        if self.shards_in_node {
            self.rail.all_reduce_sum_as(op, &mut data[share.clone()], wire)?;
            return Ok(share);
        }
        let within = self.rail.reduce_scatter_sum(op, &mut data[share.clone()], wire)?;
        Ok(share.start + within.start..share.start + within.end)
    }

    /// All-gather of this rank's node share across the nodes, then in the node.
    fn all_gather_shards(&mut self, op: &str, data: &mut [f32], wire: Wire) -> Result<()> {
        if self.shards_in_node {
            return self.node.all_gather_reduced(op, data, wire);
        }
        let share = self.node.shard_of(data.len());
        self.rail.all_gather_reduced(op, &mut data[share], wire)?;
        self.node.all_gather_reduced(op, data, wire)
    }
}

/// Raw views of the buffer an all-reduce streams and of its bfloat16 staging copy: pieces of
/// both are queued for sending while other pieces are written, which borrows cannot express
/// (see the safety argument in [`Communicator::stream_steps`]).
struct RingBuffers {
    data: *mut f32,
    /// As long as `data` for [`Wire::Bf16`]; unused for [`Wire::F32`].
    staging: *mut u16,
    wire: Wire,
    /// The step that sends the finished sums first (`n - 1`).
    finished_in: usize,
}

impl RingBuffers {
    unsafe fn values<'a>(&self, piece: &Range<usize>) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.data.add(piece.start), piece.len())
    }

    unsafe fn rounded<'a>(&self, piece: &Range<usize>) -> &'a mut [u16] {
        std::slice::from_raw_parts_mut(self.staging.add(piece.start), piece.len())
    }

    /// The bytes of `piece` to send in step `step`. On a bfloat16 wire a partial sum is rounded
    /// first; a finished sum too, and the sender keeps the rounded value as every other rank
    /// will; a finished sum received from the left goes on as it came.
    unsafe fn outgoing<'a>(&self, piece: &Range<usize>, step: usize) -> &'a [u8] {
        match self.wire {
            Wire::F32 => bytemuck::cast_slice(self.values(piece)),
            Wire::Bf16 => {
                if step <= self.finished_in {
                    wire::round_into(self.values(piece), self.rounded(piece));
                    if step == self.finished_in {
                        wire::widen_into(self.rounded(piece), self.values(piece));
                    }
                }
                bytemuck::cast_slice(self.rounded(piece))
            }
        }
    }

    /// Adds received `bytes`, the values from `offset` on of `piece`, into `piece`.
    unsafe fn reduce(&self, piece: &Range<usize>, offset: usize, bytes: &[u8]) {
        let target = &mut self.values(piece)[offset..];
        match self.wire {
            Wire::F32 => target
                .iter_mut()
                .zip(as_values::<f32>(bytes).iter())
                .for_each(|(acc, x)| *acc += x),
            Wire::Bf16 => wire::add_widened(target, &as_values::<u16>(bytes)),
        }
    }

    /// Where the finished sums of `piece` are received.
    unsafe fn incoming<'a>(&self, piece: &Range<usize>) -> &'a mut [u8] {
        match self.wire {
            Wire::F32 => bytemuck::cast_slice_mut(self.values(piece)),
            Wire::Bf16 => bytemuck::cast_slice_mut(self.rounded(piece)),
        }
    }

    /// Takes in the finished sums of `piece` received into [`RingBuffers::incoming`].
    unsafe fn received(&self, piece: &Range<usize>) {
        if self.wire == Wire::Bf16 {
            wire::widen_into(self.rounded(piece), self.values(piece));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn run_ring<T: Send>(n: usize, f: impl Fn(&mut Communicator) -> T + Sync) -> Vec<T> {
        let transports = memory::ring(n, Duration::from_secs(10));
        std::thread::scope(|s| {
            let handles: Vec<_> = transports
                .into_iter()
                .map(|t| {
                    let f = &f;
                    s.spawn(move || f(&mut Communicator::new(Box::new(t))))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    fn rank_buffer(rank: usize, len: usize) -> Vec<f32> {
        (0..len).map(|i| ((rank * 7919 + i * 31) % 1000) as f32 / 8.0).collect()
    }

    #[test]
    fn all_reduce_matches_plain_sum_for_all_sizes() -> anyhow::Result<()> {
        for n in 1..=5usize {
            for len in [0, 1, n.saturating_sub(1), n + 1, 1031, 100_003, 1_000_003] {
                let results = run_ring(n, |c| {
                    let mut data = rank_buffer(c.rank(), len);
                    c.all_reduce_sum("test", &mut data).map(|()| data)
                });
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| rank_buffer(r, len)).collect();
                let expected: Vec<f32> = (0..len).map(|i| inputs.iter().map(|b| b[i]).sum()).collect();
                for (rank, r) in results.into_iter().enumerate() {
                    // Values are multiples of 1/8 below 1000: every sum is exact.
                    assert_eq!(r?, expected, "n={n} len={len} rank={rank}");
                }
            }
        }
        Ok(())
    }

    /// Values of both signs spread over six orders of magnitude, as gradients are.
    fn gradient_like(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let k = (rank * 7919 + i * 104_729) % 10_007;
                let sign = if k.is_multiple_of(3) { -1.0 } else { 1.0 };
                sign * (k as f32 / 10_007.0 + 0.01) * 10f32.powi((k % 7) as i32 - 4)
            })
            .collect()
    }

    /// A bfloat16 wire: every rank ends with the same bits, each sum within the module's bound
    /// `n · 2⁻⁸ · Σ|xᵢ|` of the exact sum (computed in f64) — and the bound is not loose by
    /// orders of magnitude, so rounding really happened.
    #[test]
    fn a_bf16_all_reduce_agrees_everywhere_and_stays_within_its_bound() -> anyhow::Result<()> {
        for n in 1..=5usize {
            for len in [0, 1, n + 1, 1031, 300_007] {
                let results = run_ring(n, |c| {
                    let mut data = gradient_like(c.rank(), len);
                    c.all_reduce_sum_as("test", &mut data, Wire::Bf16).map(|()| data)
                });
                let results = results.into_iter().collect::<Result<Vec<_>>>()?;
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| gradient_like(r, len)).collect();
                let mut worst = 0f64;
                for i in 0..len {
                    let exact: f64 = inputs.iter().map(|b| f64::from(b[i])).sum();
                    let magnitude: f64 = inputs.iter().map(|b| f64::from(b[i]).abs()).sum();
                    let bound = n as f64 * f64::from(wire::BF16_ROUNDING) * magnitude + 1e-6 * magnitude;
                    let error = (f64::from(results[0][i]) - exact).abs();
                    assert!(error <= bound, "n={n} len={len} i={i}: {} vs {exact}", results[0][i]);
                    worst = worst.max(error / magnitude);
                }
                if n > 1 && len > 1000 {
                    assert!(worst > 1e-4, "n={n} len={len}: no rounding seen ({worst:e})");
                }
                for (rank, r) in results.iter().enumerate() {
                    let same = r.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "n={n} len={len}: rank {rank} differs from rank 0");
                }
            }
        }
        Ok(())
    }

    /// A reduce-scatter leaves each rank the exact sums of its shard, the shards cover the
    /// buffer once, and an all-gather of the shards alone (the rest overwritten with NaN) hands
    /// every rank the whole sum.
    #[test]
    fn a_reduce_scatter_then_an_all_gather_of_the_shards_is_an_all_reduce() -> anyhow::Result<()> {
        for n in 1..=5usize {
            for len in [0, 1, n + 1, 1031, 100_003] {
                let results = run_ring(n, |c| {
                    let mut data = rank_buffer(c.rank(), len);
                    let shard = c.reduce_scatter_sum_as("scatter", &mut data, Wire::F32)?;
                    anyhow::ensure!(shard == c.shard_of(len), "the shard returned is shard_of's");
                    let summed = data[shard.clone()].to_vec();
                    let mut gathered = vec![f32::NAN; len];
                    gathered[shard.clone()].copy_from_slice(&summed);
                    c.all_gather_shards_as("gather", &mut gathered, Wire::F32)?;
                    Ok((shard, summed, gathered))
                });
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| rank_buffer(r, len)).collect();
                let expected: Vec<f32> = (0..len).map(|i| inputs.iter().map(|b| b[i]).sum()).collect();
                let mut covered = vec![0usize; len];
                for (rank, result) in results.into_iter().enumerate() {
                    let (shard, summed, gathered) = result?;
                    // Multiples of 1/8 below 1000: every sum is exact in any order.
                    assert_eq!(summed, expected[shard.clone()], "n={n} len={len} rank={rank}");
                    assert_eq!(gathered, expected, "n={n} len={len} rank={rank}");
                    shard.for_each(|i| covered[i] += 1);
                }
                assert!(
                    covered.iter().all(|&c| c == 1),
                    "n={n} len={len}: shards overlap or miss"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn broadcast_and_all_gather() -> anyhow::Result<()> {
        for n in 1..=4 {
            let results = run_ring(n, |c| {
                let mut data = vec![c.rank() as u8; 5];
                c.broadcast("bcast", &mut data, n - 1)?;
                let gathered = c.all_gather("gather", &[c.rank() as u8, 9])?;
                c.barrier("barrier")?;
                Ok::<_, anyhow::Error>((data, gathered))
            });
            for r in results {
                let (data, gathered) = r?;
                assert_eq!(data, vec![(n - 1) as u8; 5]);
                assert_eq!(gathered, (0..n).map(|i| vec![i as u8, 9]).collect::<Vec<_>>());
            }
        }
        Ok(())
    }

    #[test]
    fn a_missing_rank_times_out_naming_it() {
        let mut transports = memory::ring(3, Duration::from_millis(200));
        let _silent = transports.pop();
        let mut first = Communicator::new(Box::new(transports.remove(0)));
        let err = first
            .all_reduce_sum("all-reduce of bucket 0", &mut [1.0; 9])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("timed out") && err.contains("rank 2") && err.contains("bucket 0"),
            "{err}"
        );
    }
}
