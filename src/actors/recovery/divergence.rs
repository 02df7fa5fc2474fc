//! A diverged run stops at the step it diverged: a NaN or infinite loss poisons every
//! parameter after it, so training on would only end in a summary of garbage.

use anyhow::{bail, Result};

/// Fails with the step (counted from 1) and the rank when `loss` is not finite.
pub(crate) fn check_loss(rank: usize, step: usize, loss: f32) -> Result<()> {
    if !loss.is_finite() {
        let value = if loss.is_nan() { "NaN" } else { "infinite" };
        bail!("step {step}: loss is {value} (rank {rank}): training diverged; a smaller train.lr may help");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_finite_losses_pass() {
        assert!(check_loss(0, 1, 2.5).is_ok());
        let nan = check_loss(1, 7, f32::NAN).unwrap_err().to_string();
        assert!(nan.starts_with("step 7: loss is NaN (rank 1)"), "{nan}");
        let inf = check_loss(0, 3, f32::NEG_INFINITY).unwrap_err().to_string();
        assert!(inf.starts_with("step 3: loss is infinite"), "{inf}");
    }
}
