//! NCCL collectives on GPU tensors (feature `cuda`), beside the ring: the ring keeps the small
//! host-side collectives (losses, checksums, counts) and carries NCCL's bootstrap; NCCL moves
//! the gradient buckets and the initial parameters without leaving the GPUs.
//!
//! NCCL runs on a stream of its own. A bucket enters it only after the compute stream's last
//! write to it (cudarc records an event per write and makes the reading stream wait on it), so
//! the compute stream goes on with backward while earlier buckets are reduced; the result is
//! read back by the compute stream the same way.

use std::ffi::{c_char, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DriverError};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::Communicator;
use crate::engines::compute::cuda;

/// One rank's NCCL communicator and the stream its collectives run on.
pub struct NcclComm {
    comm: Comm,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    /// Longest a collective may take: NCCL itself waits forever for a peer that died.
    timeout: Duration,
}

// SAFETY: an NCCL communicator may be used from any thread, one thread at a time; `NcclComm`
// is owned by one communication thread and only moved, never shared.
unsafe impl Send for NcclComm {}

/// NCCL for the ranks of `ring`, each on its GPU `device`, when the job has use for it: not
/// on the CPU, nor in a world of one, nor when ranks share a GPU (NCCL refuses two ranks on one
/// device; their gradients then travel through the host ring, slower but correct).
pub fn connect(ring: &mut Communicator, device: &Device, timeout: Duration) -> Result<Option<NcclComm>> {
    let Device::Cuda(device) = device else {
        return Ok(None);
    };
    if ring.world_size() == 1 {
        return Ok(None);
    }
    let uuids = ring.all_gather("all-gather of the ranks' GPU ids", cuda::uuid(device)?.as_bytes())?;
    // Every rank sees the same list, so all of them decide alike.
    if let Some((a, b)) = first_shared(&uuids) {
        tracing::warn!(
            "ranks {a} and {b} share GPU {}: NCCL cannot put two ranks on one device, so gradients \
             go through the host ring",
            String::from_utf8_lossy(&uuids[a])
        );
        return Ok(None);
    }
    join(ring, device, timeout).map(Some)
}

/// The first two ranks (in rank order) whose GPU ids are the same.
fn first_shared(uuids: &[Vec<u8>]) -> Option<(usize, usize)> {
    (0..uuids.len()).find_map(|b| (0..b).find(|&a| uuids[a] == uuids[b]).map(|a| (a, b)))
}

/// The NCCL communicator of the ring's ranks, whatever their devices: rank 0 makes the unique
/// id and the ring carries it to the others. A collective that takes longer than `timeout` is
/// an error.
pub fn join(ring: &mut Communicator, device: &CudaDevice, timeout: Duration) -> Result<NcclComm> {
    let rank = ring.rank();
    let mut id = [0u8; 128];
    if rank == 0 {
        let made = Id::new().map_err(|e| nccl_failure(rank, "creating the NCCL unique id", e))?;
        for (byte, c) in id.iter_mut().zip(made.internal()) {
            *byte = *c as u8;
        }
    }
    ring.broadcast("broadcast of the NCCL unique id", &mut id, 0)?;
    let stream = device
        .cuda_stream()
        .context()
        .new_stream()
        .map_err(|why| anyhow!("rank {rank}: creating NCCL's stream: {}", cuda::explain(&why)))?;
    let comm = Comm::from_rank(
        stream.clone(),
        rank,
        ring.world_size(),
        Id::uninit(id.map(|b| b as c_char)),
    )
    .map_err(|e| nccl_failure(rank, "joining the NCCL communicator", e))?;
    tracing::debug!(rank, "NCCL communicator ready");
    Ok(NcclComm {
        comm,
        device: device.clone(),
        stream,
        timeout,
    })
}

impl NcclComm {
    /// The mean of `tensor` (f32, contiguous) over all ranks, as a new flat tensor.
    pub fn all_reduce_mean(&self, op: &str, tensor: &Tensor) -> Result<Tensor> {
        let mut out = self.alloc(op, tensor.elem_count())?;
        self.on_view(op, tensor, |input| {
            self.comm.all_reduce(&input, &mut out, &ReduceOp::Avg).map(drop)
        })?;
        self.finish(op, out)
    }

    /// `root`'s `tensor` (f32, contiguous) on every rank, as a new flat tensor.
    pub fn broadcast(&self, op: &str, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let mut out = self.alloc(op, tensor.elem_count())?;
        let root = i32::try_from(root).context("NCCL numbers ranks with i32")?;
        self.on_view(op, tensor, |input| {
            self.comm.broadcast(Some(&input), &mut out, root).map(drop)
        })?;
        self.finish(op, out)
    }

    /// Enqueues `collective` on a view of `tensor`'s f32 values.
    fn on_view(
        &self,
        op: &str,
        tensor: &Tensor,
        collective: impl FnOnce(CudaView<'_, f32>) -> std::result::Result<(), NcclError>,
    ) -> Result<()> {
        let (storage, layout) = tensor.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            bail!("{op}: NCCL was handed a tensor that is not on a GPU");
        };
        let slice = storage
            .as_cuda_slice::<f32>()
            .with_context(|| format!("{op}: NCCL moves f32 tensors"))?;
        let (start, end) = layout
            .contiguous_offsets()
            .with_context(|| format!("{op}: NCCL was handed a non-contiguous tensor"))?;
        collective(slice.slice(start..end)).map_err(|e| nccl_failure(self.comm.rank(), op, e))
    }

    fn alloc(&self, op: &str, len: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every element is written by the collective before anything reads it.
        unsafe { self.stream.alloc::<f32>(len) }
            .map_err(|why| anyhow!("{op}: allocating {len} floats: {}", cuda::explain(&why)))
    }

    /// Waits for the collective (so its time is measured and its input may be freed), at most
    /// the timeout, and wraps the result as a tensor of the compute device.
    fn finish(&self, op: &str, out: CudaSlice<f32>) -> Result<Tensor> {
        let rank = self.comm.rank();
        let failed = |why: DriverError| anyhow!("rank {rank}: {op}: the NCCL stream failed: {}", cuda::explain(&why));
        let done = self.stream.record_event(None).map_err(failed)?;
        let started = Instant::now();
        while !done.try_is_complete().map_err(failed)? {
            if started.elapsed() > self.timeout {
                bail!(
                    "rank {rank}: {op} did not finish within {:.0?}: a peer may have died or stopped \
                     calling the collective (fault_tolerance.timeout_s; NCCL_DEBUG=WARN shows NCCL's view)",
                    self.timeout
                );
            }
            // A bucket's all-reduce takes from microseconds to milliseconds: spin briefly, then
            // sleep in short steps.
            if started.elapsed() < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(POLL);
            }
        }
        let len = out.len();
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, self.device.clone()));
        Ok(Tensor::from_storage(storage, len, BackpropOp::none(), false))
    }
}

/// How long a wait for a collective spins before it sleeps between polls.
const SPIN: Duration = Duration::from_millis(1);
/// The step of a sleeping wait.
const POLL: Duration = Duration::from_micros(50);

/// An NCCL failure as a person can act on it: the rank, the operation, NCCL's name and text for
/// the error, and how to make NCCL say more.
fn nccl_failure(rank: usize, op: &str, error: NcclError) -> anyhow::Error {
    // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any result code.
    let text = unsafe { CStr::from_ptr(cudarc::nccl::sys::ncclGetErrorString(error.0)) }.to_string_lossy();
    let hint = if std::env::var_os("NCCL_DEBUG").is_some() {
        "NCCL's own log above says more"
    } else {
        "set NCCL_DEBUG=WARN (or INFO) for NCCL's own account"
    };
    anyhow!("rank {rank}: {op} failed in NCCL: {:?} ({text}); {hint}", error.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_sharing_a_gpu_are_found_alike_on_every_rank() {
        let ids = |names: &[&str]| names.iter().map(|n| n.as_bytes().to_vec()).collect::<Vec<_>>();
        assert_eq!(first_shared(&ids(&["GPU-a", "GPU-b", "GPU-c"])), None);
        assert_eq!(first_shared(&ids(&["GPU-a", "GPU-b", "GPU-c", "GPU-b"])), Some((1, 3)));
        assert_eq!(first_shared(&ids(&["GPU-a", "GPU-a", "GPU-c", "GPU-c"])), Some((0, 1)));
    }
}
