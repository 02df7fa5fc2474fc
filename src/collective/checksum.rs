//! A hash of every parameter's bytes, in name order, so that two runs (or
//! two replicas) can be compared exactly; and, over the same copy of the
//! values, the check that each of them is finite.

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
        Ok(Self::of_values(&values_of(params)?))
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

/// Every parameter of `params` by name, its values copied off the device.
pub(crate) fn values_of(params: &[NamedParam]) -> candle_core::Result<Vec<(String, Vec<f32>)>> {
    params
        .iter()
        .map(|p| Ok((p.name.clone(), p.param.var()?.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

/// Fails naming the rank, the step (counted from 1) and the parameter when one of `params` (by
/// name and values) holds a value that is not finite. A NaN parameter leaves the loss finite
/// where a ReLU hides it, so the loss check alone would train on to a model of NaNs.
pub(crate) fn check_finite(rank: usize, step: usize, params: &[(String, Vec<f32>)]) -> anyhow::Result<()> {
    for (name, values) in params {
        if let Some((element, value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            anyhow::bail!(
                "step {step}: parameter {name} holds {value} (element {element}) (rank {rank}): training diverged; \
                 a smaller train.lr may help"
            );
        }
    }
    Ok(())
}

impl fmt::Display for ParamChecksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_that_is_not_finite_is_named_with_its_parameter_rank_and_step() {
        let params = |poison: f32| {
            vec![
                ("a".to_string(), vec![1.0, 2.0]),
                ("b".to_string(), vec![0.0, 0.5, poison]),
            ]
        };
        assert!(check_finite(0, 10, &params(3.0)).is_ok());
        let nan = check_finite(2, 10, &params(f32::NAN)).unwrap_err().to_string();
        assert!(
            nan.starts_with("step 10: parameter b holds NaN (element 2) (rank 2)"),
            "{nan}"
        );
        let inf = check_finite(1, 4, &params(f32::NEG_INFINITY)).unwrap_err().to_string();
        assert!(
            inf.starts_with("step 4: parameter b holds -inf (element 2) (rank 1)"),
            "{inf}"
        );
    }
}
