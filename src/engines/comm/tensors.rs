//! Collectives on tensors of the compute device: through NCCL when the ranks have it (GPU
//! jobs), else through the ring and host memory.

use anyhow::Result;
use candle_core::Tensor;

use super::{Communicator, Wire};

impl Communicator {
    /// The mean of `values` over all ranks, in place, the values travelling as `wire` says.
    pub fn all_reduce_mean(&mut self, op: &str, values: &mut [f32], wire: Wire) -> Result<()> {
        self.all_reduce_sum_as(op, values, wire)?;
        let world = self.world_size() as f32;
        values.iter_mut().for_each(|v| *v /= world);
        Ok(())
    }

    /// The mean of the flat f32 `tensor` over all ranks, the values travelling as `wire` says.
    pub fn all_reduce_mean_tensor(&mut self, op: &str, tensor: Tensor, wire: Wire) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl() {
            anyhow::ensure!(
                wire == Wire::F32,
                "{op}: a bfloat16 all-reduce runs on the ring of CPU jobs; NCCL carries f32 only \
                 (set strategy.fp16_allreduce = false on GPUs)"
            );
            return nccl.all_reduce_mean(op, &tensor);
        }
        if self.world_size() == 1 {
            return Ok(tensor);
        }
        let mut values = tensor.to_vec1::<f32>()?;
        self.all_reduce_mean(op, &mut values, wire)?;
        let len = values.len();
        Ok(Tensor::from_vec(values, len, tensor.device())?)
    }

    /// Rank `root`'s flat f32 `tensor` on every rank.
    pub fn broadcast_tensor(&mut self, op: &str, tensor: Tensor, root: usize) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = self.nccl() {
            return nccl.broadcast(op, &tensor, root);
        }
        if self.world_size() == 1 {
            return Ok(tensor);
        }
        let mut values = tensor.to_vec1::<f32>()?;
        self.broadcast(op, bytemuck::cast_slice_mut(&mut values), root)?;
        let len = values.len();
        Ok(Tensor::from_vec(values, len, tensor.device())?)
    }
}
