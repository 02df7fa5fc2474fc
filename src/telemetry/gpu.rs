//! Utilisation and memory of the GPUs this process trains on, read from NVML (libnvidia-ml,
//! loaded at run time, so a machine without it only loses these figures). Each rank's device
//! registers its GPU when it opens it; the reporting rank's monitor samples them every step.

/// What the process's GPUs were doing at one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuFigures {
    /// Device memory in use on them, every process's, in bytes (summed over the GPUs).
    pub memory_bytes: u64,
    /// Share of the last sample period in which a kernel ran, in percent (mean over the GPUs).
    pub utilization_percent: f64,
}

#[cfg(feature = "cuda")]
pub use nvml::{register, sample};

/// A build without CUDA trains on no GPU.
#[cfg(not(feature = "cuda"))]
pub fn sample() -> Option<GpuFigures> {
    None
}

#[cfg(feature = "cuda")]
mod nvml {
    use std::sync::{Mutex, OnceLock};

    use nvml_wrapper::Nvml;

    use super::GpuFigures;

    /// UUIDs of the GPUs this process's ranks opened.
    static GPUS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    /// NVML, loaded on the first sample; `None` (said once) when it does not load.
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();

    /// Adds a GPU (NVML's `GPU-…` UUID) to those sampled.
    pub fn register(uuid: String) {
        let mut gpus = GPUS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !gpus.contains(&uuid) {
            gpus.push(uuid);
        }
    }

    /// The registered GPUs' figures, or `None` without NVML or GPUs.
    pub fn sample() -> Option<GpuFigures> {
        let nvml = NVML
            .get_or_init(|| match Nvml::init() {
                Ok(nvml) => Some(nvml),
                Err(why) => {
                    tracing::warn!(
                        "libnvidia-ml.so.1 does not load ({why}): no GPU utilisation or memory in the metrics"
                    );
                    None
                }
            })
            .as_ref()?;
        let gpus = GPUS.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let mut figures = Vec::with_capacity(gpus.len());
        for uuid in &gpus {
            let read = nvml.device_by_uuid(uuid.as_str()).and_then(|device| {
                Ok(GpuFigures {
                    memory_bytes: device.memory_info()?.used,
                    utilization_percent: f64::from(device.utilization_rates()?.gpu),
                })
            });
            match read {
                Ok(one) => figures.push(one),
                Err(why) => tracing::debug!("NVML cannot read {uuid}: {why}"),
            }
        }
        if figures.is_empty() {
            return None;
        }
        Some(GpuFigures {
            memory_bytes: figures.iter().map(|f| f.memory_bytes).sum(),
            utilization_percent: figures.iter().map(|f| f.utilization_percent).sum::<f64>() / figures.len() as f64,
        })
    }
}
