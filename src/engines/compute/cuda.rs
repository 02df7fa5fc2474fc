//! A rank's GPU (feature `cuda`): opened on the device thread with its own stream, with errors
//! that say what to change, and registered for the GPU figures of the run's metrics.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{CudaDevice, Device};
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, DriverError};

use crate::telemetry::gpu;

/// Opens visible GPU `ordinal` with a stream of its own (candle's default, the per-thread
/// stream, would tie the device to whichever thread touches it first).
pub fn open(ordinal: usize) -> Result<Device> {
    let visible = CudaContext::device_count()
        .map_err(|why| anyhow!("the CUDA driver cannot list the GPUs: {why}; check that nvidia-smi sees them"))?;
    let visible = usize::try_from(visible).unwrap_or(0);
    if ordinal >= visible {
        bail!(
            "this rank wants GPU {ordinal} but {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES={}); \
             run one process per GPU (flotilla launch sets {}) or fewer ranks",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into()),
            super::SELECTED_GPUS_VAR,
        );
    }
    let device = Device::new_cuda_with_stream(ordinal).with_context(|| format!("opening GPU {ordinal}"))?;
    let cuda = device.as_cuda_device()?;
    let uuid = uuid(cuda)?;
    tracing::info!(
        ordinal,
        name = cuda.cuda_stream().context().name().unwrap_or_default(),
        %uuid,
        "training on GPU {ordinal}"
    );
    gpu::register(uuid);
    Ok(device)
}

/// The GPU's UUID, as NVML and `nvidia-smi -L` write it.
pub fn uuid(device: &CudaDevice) -> Result<String> {
    let context = device.cuda_stream().context().clone();
    let uuid = context
        .uuid()
        .map_err(|why| anyhow!("GPU {}: reading its UUID: {}", context.ordinal(), explain(&why)))?;
    Ok(nvml_uuid(&uuid.bytes))
}

/// A driver error by its name, with what to do about the common ones.
pub fn explain(error: &DriverError) -> String {
    let what = match error.0 {
        CUresult::CUDA_ERROR_NO_DEVICE => "no GPU is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES",
        CUresult::CUDA_ERROR_STUB_LIBRARY => {
            "the libcuda.so.1 loaded is a link-time stub, not the NVIDIA driver: take its folder off LD_LIBRARY_PATH"
        }
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "the NVIDIA driver is older than the CUDA 13.0 this binary's kernels were built with: update it (580 or later)"
        }
        _ => "check that nvidia-smi works",
    };
    format!("{:?}: {what}", error.0)
}

/// A device UUID as NVML spells it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
fn nvml_uuid(bytes: &[std::ffi::c_char; 16]) -> String {
    let hex = hex::encode(bytes.iter().map(|&b| b as u8).collect::<Vec<u8>>());
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_read_as_nvml_writes_them() {
        let bytes: [std::ffi::c_char; 16] = std::array::from_fn(|i| (i as u8 * 17) as std::ffi::c_char);
        assert_eq!(nvml_uuid(&bytes), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
