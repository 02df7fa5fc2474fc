//! A hash of every parameter's bytes, in name order, so that two runs (or
//! two replicas) can be compared exactly.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::models::NamedParam;

/// SHA-256 over each parameter's name and little-endian `f32` bytes, in
/// name order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamChecksum(pub [u8; 32]);

impl ParamChecksum {
    /// The checksum of `params`.
    pub fn of(params: &[NamedParam]) -> candle_core::Result<Self> {
        let values = params
            .iter()
            .map(|p| Ok((p.name.clone(), p.var.flatten_all()?.to_vec1::<f32>()?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self::of_values(&values))
    }

    /// The checksum of parameters given by name and values (e.g. gathered from pipeline
    /// stages).
    pub fn of_values(params: &[(String, Vec<f32>)]) -> Self {
        let mut sorted: Vec<&(String, Vec<f32>)> = params.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut hasher = Sha256::new();
        for (name, values) in sorted {
            hasher.update(name.as_bytes());
            // Native bytes are little-endian on every target flotilla builds for.
            hasher.update(bytemuck::cast_slice::<f32, u8>(values));
        }
        Self(hasher.finalize().into())
    }
}

impl fmt::Display for ParamChecksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}
