//! The compute device tensors live on, selected here so that models and optimizers never name
//! a backend themselves: the CPU, or with the `cuda` feature one GPU per rank.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod segments;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use crate::config::DeviceKind;

/// The launcher's choice of GPU for a process (Paddle's variable): an index among the devices
/// `CUDA_VISIBLE_DEVICES` leaves visible.
pub const SELECTED_GPUS_VAR: &str = "FLAGS_selected_gpus";

/// The candle device of `rank` for a configured device kind. A GPU rank takes the device
/// [`gpu_ordinal`] picks.
pub fn device_for(kind: DeviceKind, rank: usize) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Gpu => open_gpu(gpu_ordinal(std::env::var(SELECTED_GPUS_VAR).ok().as_deref(), rank)?),
    }
}

#[cfg(feature = "cuda")]
fn open_gpu(ordinal: usize) -> Result<Device> {
    cuda::open(ordinal)
}

#[cfg(not(feature = "cuda"))]
fn open_gpu(_ordinal: usize) -> Result<Device> {
    bail!("cluster.device = \"gpu\": built without CUDA support; rebuild with --features cuda")
}

/// Which visible GPU `rank` uses: `FLAGS_selected_gpus` when the launcher set it (one process
/// per GPU; a list names one GPU per rank of the process), else the rank itself (ranks that
/// are threads of one process, one GPU each).
pub fn gpu_ordinal(selected_gpus: Option<&str>, rank: usize) -> Result<usize> {
    let Some(selected) = selected_gpus.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(rank);
    };
    let ordinals = selected
        .split(',')
        .map(|id| id.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{SELECTED_GPUS_VAR}={selected:?} is not a comma-separated list of GPU indices"))?;
    match ordinals.as_slice() {
        [one] => Ok(*one),
        many if rank < many.len() => Ok(many[rank]),
        many => bail!(
            "{SELECTED_GPUS_VAR}={selected:?} names {} GPUs, none for rank {rank}",
            many.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launchers_choice_wins_over_the_rank() {
        assert_eq!(gpu_ordinal(None, 3).unwrap(), 3);
        assert_eq!(gpu_ordinal(Some(""), 2).unwrap(), 2);
        assert_eq!(gpu_ordinal(Some("5"), 0).unwrap(), 5);
        assert_eq!(gpu_ordinal(Some("5"), 1).unwrap(), 5);
        assert_eq!(gpu_ordinal(Some("4, 6"), 1).unwrap(), 6);
    }

    #[test]
    fn a_bad_selection_names_the_variable() {
        let err = gpu_ordinal(Some("0,x"), 0).unwrap_err();
        assert!(
            format!("{err:#}").starts_with("FLAGS_selected_gpus=\"0,x\" is not"),
            "{err:#}"
        );
        let err = gpu_ordinal(Some("0,1"), 2).unwrap_err();
        assert_eq!(
            err.to_string(),
            "FLAGS_selected_gpus=\"0,1\" names 2 GPUs, none for rank 2"
        );
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn a_gpu_needs_a_cuda_build() {
        let err = device_for(DeviceKind::Gpu, 0).unwrap_err();
        assert!(err.to_string().contains("rebuild with --features cuda"), "{err}");
    }
}
