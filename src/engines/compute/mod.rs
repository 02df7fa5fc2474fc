//! The compute device tensors live on. CPU today; CUDA arrives behind the
//! `cuda` feature, selected here so that models and optimizers never name a
//! backend themselves.

pub mod segments;

use anyhow::{bail, Result};
use candle_core::Device;

use crate::config::DeviceKind;

/// The candle device for a configured device kind.
pub fn device_for(kind: DeviceKind) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Gpu => {
            bail!("cluster.device = \"gpu\" is not supported yet: this build runs on CPU")
        }
    }
}
