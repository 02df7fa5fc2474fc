//! A fusion bucket's gradients on their way through the all-reduce: host floats for the ring
//! (CPU jobs), or one flat tensor that stays on the GPU for NCCL.

use anyhow::{Context, Result};
use candle_core::{Device, Shape, Tensor};

use crate::engines::comm::{Communicator, Wire};
use crate::optim::MergeBuffer;

/// A bucket's values.
pub(super) enum BucketValues {
    /// On the host, for the ring.
    Host(Vec<f32>),
    /// One flat f32 tensor on the compute device.
    Device(Tensor),
}

/// Gathers a bucket's gradients, in fill order, where its all-reduce wants them.
pub(super) struct BucketFill {
    host: Option<Vec<f32>>,
    device: Vec<Tensor>,
}

impl BucketFill {
    /// An empty bucket for gradients on `device`: GPU gradients stay on the GPU.
    pub(super) fn new(device: &Device) -> Self {
        Self {
            host: (!device.is_cuda()).then(Vec::new),
            device: Vec::new(),
        }
    }

    /// Appends a gradient, flattened.
    pub(super) fn push(&mut self, grad: &Tensor, bucket_len: usize) -> Result<()> {
        match &mut self.host {
            Some(host) => {
                if host.is_empty() {
                    host.reserve(bucket_len);
                }
                host.extend(grad.flatten_all()?.to_vec1::<f32>()?);
            }
            None => self.device.push(grad.flatten_all()?),
        }
        Ok(())
    }

    /// The gradients pushed since the last take, as one bucket.
    pub(super) fn take(&mut self) -> Result<BucketValues> {
        Ok(match &mut self.host {
            Some(host) => BucketValues::Host(std::mem::take(host)),
            None => BucketValues::Device(Tensor::cat(&std::mem::take(&mut self.device), 0)?),
        })
    }
}

impl BucketValues {
    /// The mean of the bucket over all ranks of `comm`, carried as `wire` says: by NCCL when
    /// the ranks have it, else by the ring (a device bucket through host memory).
    pub(super) fn all_reduce_mean(self, comm: &mut Communicator, op: &str, wire: Wire) -> Result<Self> {
        Ok(match self {
            Self::Host(mut values) => {
                comm.all_reduce_mean(op, &mut values, wire)?;
                Self::Host(values)
            }
            Self::Device(tensor) => Self::Device(comm.all_reduce_mean_tensor(op, tensor, wire)?),
        })
    }

    /// This rank's shard of the bucket's mean over all ranks of `comm` (the reduce-scatter's,
    /// [`Communicator::shard_of`]), carried as `wire` says; a device bucket goes through host
    /// memory to the ring.
    pub(super) fn reduce_scatter_mean(self, comm: &mut Communicator, op: &str, wire: Wire) -> Result<Vec<f32>> {
        let mut values = match self {
            Self::Host(values) => values,
            Self::Device(tensor) => tensor.to_vec1::<f32>()?,
        };
        let shard = comm.reduce_scatter_sum_as(op, &mut values, wire)?;
        let world = comm.world_size() as f32;
        Ok(values[shard].iter().map(|v| v / world).collect())
    }

    /// The bucket as one flat tensor on `device`: host values are moved in, not copied, where the
    /// job computes on the CPU, so every parameter's gradient is a view of it ([`gradient_of`])
    /// and the averaged gradients take no memory beyond the bucket's.
    pub(super) fn into_flat(self, device: &Device) -> Result<Tensor> {
        Ok(match self {
            Self::Host(values) => {
                let len = values.len();
                Tensor::from_vec(values, len, device)?
            }
            Self::Device(tensor) => tensor,
        })
    }
}

/// The gradient of `shape` at `offset` of `flat`, a bucket's values ([`BucketValues::into_flat`]):
/// a view of them.
pub(super) fn gradient_of(flat: &Tensor, offset: usize, shape: &Shape) -> Result<Tensor> {
    flat.narrow(0, offset, shape.elem_count())?
        .reshape(shape)
        .with_context(|| format!("a gradient of shape {shape:?} at offset {offset}"))
}

impl MergeBuffer for BucketValues {
    fn plus(self, other: Self) -> Result<Self> {
        Ok(match (self, other) {
            (Self::Host(sum), Self::Host(values)) => Self::Host(sum.plus(values)?),
            (Self::Device(sum), Self::Device(values)) => Self::Device((sum + values)?),
            _ => anyhow::bail!("a host and a device bucket cannot merge"),
        })
    }

    fn divided_by(self, k: f32) -> Result<Self> {
        Ok(match self {
            Self::Host(values) => Self::Host(values.divided_by(k)?),
            Self::Device(tensor) => Self::Device((tensor / f64::from(k))?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::comm::memory;

    /// The device path, run on CPU tensors: a 3-rank ring averages it as it averages host floats.
    #[test]
    fn device_and_host_buckets_reduce_to_the_same_mean() -> Result<()> {
        let rings = memory::ring(3, std::time::Duration::from_secs(5));
        let means = std::thread::scope(|scope| {
            let handles: Vec<_> = rings
                .into_iter()
                .map(|transport| {
                    scope.spawn(move || -> Result<(Vec<f32>, Vec<f32>)> {
                        let mut comm = Communicator::new(Box::new(transport));
                        let mine: Vec<f32> = (0..7).map(|i| (comm.rank() * 10 + i) as f32).collect();
                        let tensor = Tensor::from_vec(mine.clone(), 7, &Device::Cpu)?;
                        let BucketValues::Device(device) =
                            BucketValues::Device(tensor).all_reduce_mean(&mut comm, "test", Wire::F32)?
                        else {
                            anyhow::bail!("a device bucket came back from the host")
                        };
                        let BucketValues::Host(host) =
                            BucketValues::Host(mine).all_reduce_mean(&mut comm, "test", Wire::F32)?
                        else {
                            anyhow::bail!("a host bucket came back from the device")
                        };
                        Ok((device.to_vec1()?, host))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect::<Result<Vec<_>>>()
        })?;
        let expected: Vec<f32> = (0..7).map(|i| (10 + i) as f32).collect();
        for (device, host) in means {
            assert_eq!(device, expected);
            assert_eq!(host, expected);
        }
        Ok(())
    }

    #[test]
    fn buckets_merge_and_give_back_shaped_gradients() -> Result<()> {
        let tensor = |v: &[f32]| Tensor::from_slice(v, v.len(), &Device::Cpu);
        let device = BucketValues::Device(tensor(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?)
            .plus(BucketValues::Device(tensor(&[1.0; 6])?))?
            .divided_by(2.0)?;
        let host = BucketValues::Host(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .plus(BucketValues::Host(vec![1.0; 6]))?
            .divided_by(2.0)?;
        let shape = Shape::from((2, 2));
        for bucket in [device, host] {
            let grad = gradient_of(&bucket.into_flat(&Device::Cpu)?, 2, &shape)?;
            assert_eq!(grad.to_vec2::<f32>()?, [[2.0, 2.5], [3.0, 3.5]]);
        }
        assert!(BucketValues::Host(vec![1.0])
            .plus(BucketValues::Device(tensor(&[1.0])?))
            .is_err());
        Ok(())
    }
}
