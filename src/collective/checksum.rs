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
        let mut sorted: Vec<&NamedParam> = params.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        let mut hasher = Sha256::new();
        for p in sorted {
            hasher.update(p.name.as_bytes());
            let values = p.var.flatten_all()?.to_vec1::<f32>()?;
            // Native bytes are little-endian on every target flotilla builds for.
            hasher.update(bytemuck::cast_slice::<f32, u8>(&values));
        }
        Ok(Self(hasher.finalize().into()))
    }
}

impl fmt::Display for ParamChecksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}
