//! Gradient clipping by global norm: when the L2 norm of all gradients together exceeds
//! `max_norm`, every gradient is scaled by `max_norm / (norm + 1e-6)` (PyTorch's
//! `clip_grad_norm_`, Paddle's `ClipGradByGlobalNorm`).

use candle_core::backprop::GradStore;
use candle_core::{DType, Var};

/// Scales the gradients of `vars` in `grads` to a global norm of at most `max_norm`; answers
/// the norm they had.
pub fn clip_by_global_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> candle_core::Result<f64> {
    let norm = sum_of_squares(grads, vars)?.sqrt();
    scale_to_norm(grads, vars, norm, max_norm)?;
    Ok(norm)
}

/// The sum of the squares of the gradients of `vars` in `grads`, in f64.
pub fn sum_of_squares(grads: &GradStore, vars: &[Var]) -> candle_core::Result<f64> {
    let mut squares = 0f64;
    for var in vars {
        if let Some(grad) = grads.get(var.as_tensor()) {
            squares += grad.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
    }
    Ok(squares)
}

/// Scales the gradients of `vars`, whose global norm is `norm`, to at most `max_norm`.
pub fn scale_to_norm(grads: &mut GradStore, vars: &[Var], norm: f64, max_norm: f64) -> candle_core::Result<()> {
    let scale = max_norm / (norm + 1e-6);
    if scale < 1.0 {
        for var in vars {
            if let Some(grad) = grads.remove(var.as_tensor()) {
                grads.insert(var.as_tensor(), grad.affine(scale, 0.0)?);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn only_a_norm_above_the_limit_is_scaled_down_to_it() -> candle_core::Result<()> {
        let a = Var::new(&[1f32, 1.0], &Device::Cpu)?;
        let b = Var::new(&[0f32], &Device::Cpu)?;
        let grads_of = |ga: &[f32], gb: &[f32]| -> candle_core::Result<GradStore> {
            let loss = (a.as_tensor().mul(&Tensor::new(ga, &Device::Cpu)?)?.sum_all()?
                + b.as_tensor().mul(&Tensor::new(gb, &Device::Cpu)?)?.sum_all()?)?;
            loss.backward()
        };
        // Gradients (3, 0) and (4): norm 5, clipped to 1.
        let mut grads = grads_of(&[3.0, 0.0], &[4.0])?;
        let norm = clip_by_global_norm(&mut grads, &[a.clone(), b.clone()], 1.0)?;
        assert!((norm - 5.0).abs() < 1e-9);
        let ga = grads.get(a.as_tensor()).unwrap().to_vec1::<f32>()?;
        let gb = grads.get(b.as_tensor()).unwrap().to_vec1::<f32>()?;
        assert!((ga[0] - 0.6).abs() < 1e-6 && ga[1] == 0.0 && (gb[0] - 0.8).abs() < 1e-6);
        // Under the limit: untouched.
        let mut grads = grads_of(&[0.3, 0.0], &[0.4])?;
        clip_by_global_norm(&mut grads, &[a.clone(), b.clone()], 1.0)?;
        assert_eq!(grads.get(a.as_tensor()).unwrap().to_vec1::<f32>()?, [0.3, 0.0]);
        Ok(())
    }
}
