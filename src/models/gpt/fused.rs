//! Fused CPU kernels, with their backward, for the GPT ops whose backward is otherwise a chain
//! of element-wise passes over memory: the causal softmax of attention scores, the
//! normalisation of LayerNorm and the (erf) GELU. candle-nn's fused softmax and LayerNorm
//! register no backward, and the composed versions (kept for other devices) cost a pass per
//! op; these cost one pass forward and one backward.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use crate::cpu_values::{cpu_values, with_cpu_values};

/// The length of the last dimension.
fn row_len(layout: &Layout) -> candle_core::Result<usize> {
    match layout.dims().last() {
        Some(&n) if n > 0 => Ok(n),
        _ => candle_core::bail!("expects a non-empty last dimension, got {:?}", layout.dims()),
    }
}

/// A kernel computed row by row. Implementations mark `row` `#[inline(always)]`, so that it is
/// compiled into [`EveryRow`]'s loop for the CPU's vector unit.
trait RowKernel {
    /// The name candle knows the kernel's op by, for errors.
    const NAME: &'static str;
    /// Output row `out` from row `r` of the input, `x`, and for a backward kernel the row of
    /// the upstream gradient, `g` (empty otherwise).
    fn row(&self, r: usize, x: &[f32], g: &[f32], out: &mut [f32]);
}

/// `kernel` over every row of `row` values, as pulp dispatches it (AVX-512, AVX2/FMA or plain).
struct EveryRow<'a, K> {
    kernel: &'a K,
    row: usize,
    x: &'a [f32],
    g: Option<&'a [f32]>,
    out: &'a mut [f32],
}

impl<K: RowKernel> pulp::WithSimd for EveryRow<'_, K> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let n = self.row;
        for (r, (x, out)) in self.x.chunks_exact(n).zip(self.out.chunks_exact_mut(n)).enumerate() {
            let g = self.g.map_or(&[][..], |g| &g[r * n..(r + 1) * n]);
            self.kernel.row(r, x, g, out);
        }
    }
}

/// A new tensor of `layout`'s shape whose rows of `row` values are `kernel`'s of the input's
/// rows (and of `g`'s, for a backward kernel: a gradient of the same shape).
fn map_rows<K: RowKernel>(
    (storage, layout): (&CpuStorage, &Layout),
    g: Option<(&CpuStorage, &Layout)>,
    row: usize,
    kernel: &K,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let op = K::NAME;
    let x = cpu_values(storage, layout, op)?;
    let g = g.map(|(g, g_layout)| cpu_values(g, g_layout, op)).transpose()?;
    if let Some(g) = &g {
        if g.len() != x.len() {
            candle_core::bail!("{op}: the gradient has {} values for {:?}", g.len(), layout.dims());
        }
    }
    let mut out = vec![0f32; x.len()];
    pulp::Arch::new().dispatch(EveryRow {
        kernel,
        row,
        x,
        g,
        out: &mut out,
    });
    Ok((CpuStorage::F32(out), layout.shape().clone()))
}

/// Lanes of the partial sums of a reduction: a multiple of every vector width in use.
const LANES: usize = 16;

/// `Σ f(i)` over `0..len`, in [`LANES`] partial sums (so the loop vectorises), then those summed.
#[inline(always)]
fn lane_sum(len: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut partial = [0f32; LANES];
    let whole = len / LANES * LANES;
    for start in (0..whole).step_by(LANES) {
        for (lane, p) in partial.iter_mut().enumerate() {
            *p += f(start + lane);
        }
    }
    partial.iter().sum::<f32>() + (whole..len).map(f).sum::<f32>()
}

/// The largest of `values` (−∞ for none), in [`LANES`] partial maxima.
#[inline(always)]
fn lane_max(values: &[f32]) -> f32 {
    let mut partial = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (p, &v) in partial.iter_mut().zip(chunk) {
            *p = if v > *p { v } else { *p };
        }
    }
    partial.iter().chain(rest).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// eˣ for `x ≤ 0` (arguments below −87.3 give e⁻⁸⁷·³ ≈ 1.2e−38 instead of smaller): Cephes'
/// polynomial after a Cody–Waite reduction, within 2 ulps of libm's (the test bounds it), and
/// branch-free and call-free so that loops over it vectorise.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding and subtracting it rounds to the nearest integer, ties to even.
    const ROUND: f32 = 12_582_912.0;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    let x = x.clamp(-87.3, 0.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = P[1..].iter().fold(P[0], |p, &c| p * r + c);
    let e_r = p * r * r + r + 1.0;
    e_r * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// A fused forward kernel, with the backward kernel that turns the tensor it saves and the
/// upstream gradient into the input's gradient.
trait ForwardKernel: RowKernel + Send + Sync + 'static {
    /// The forward tensor the backward kernel reads beside the gradient.
    const SAVES: Saved;
    type Backward: RowKernel;
    /// The backward kernel, with this kernel's settings.
    fn backward(&self) -> Self::Backward;
}

/// Which tensor of the forward op its backward kernel reads.
enum Saved {
    Input,
    Output,
}

/// A [`ForwardKernel`] as candle's op, with its backward registered.
struct Forward<K>(K);

impl<K: ForwardKernel> CustomOp1 for Forward<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        map_rows((storage, layout), None, row_len(layout)?, &self.0)
    }

    fn bwd(&self, input: &Tensor, output: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let saved = match K::SAVES {
            Saved::Input => input,
            Saved::Output => output,
        };
        Ok(Some(
            saved.apply_op2_no_bwd(&grad.contiguous()?, &Backward(self.0.backward()))?,
        ))
    }
}

/// A backward kernel as candle's op over the saved tensor and the gradient (it has no
/// gradient of its own).
struct Backward<K>(K);

impl<K: RowKernel> CustomOp2 for Backward<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        saved: &CpuStorage,
        saved_layout: &Layout,
        grad: &CpuStorage,
        grad_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = row_len(saved_layout)?;
        map_rows((saved, saved_layout), Some((grad, grad_layout)), n, &self.0)
    }
}

/// Softmax over the last dimension of `(…, T, T)` attention scores, row `q` over keys `0..=q`
/// only (the later keys get probability 0): the causal mask and the softmax in one pass.
pub(super) fn causal_softmax(scores: &Tensor) -> candle_core::Result<Tensor> {
    scores.contiguous()?.apply_op1(Forward(CausalSoftmax))
}

struct CausalSoftmax;

impl RowKernel for CausalSoftmax {
    const NAME: &'static str = "causal-softmax";

    #[inline(always)]
    fn row(&self, r: usize, x: &[f32], _: &[f32], out: &mut [f32]) {
        // Rows are `(…, query, key)`: query `r mod T` sees keys `0..=query`.
        let visible = r % x.len() + 1;
        let (x, out) = (&x[..visible], &mut out[..visible]);
        let max = lane_max(x);
        for (o, &v) in out.iter_mut().zip(x) {
            *o = exp(v - max);
        }
        let inv_sum = 1.0 / lane_sum(visible, |i| out[i]);
        out.iter_mut().for_each(|o| *o *= inv_sum);
    }
}

impl ForwardKernel for CausalSoftmax {
    const SAVES: Saved = Saved::Output;
    type Backward = SoftmaxBackward;

    fn backward(&self) -> SoftmaxBackward {
        SoftmaxBackward
    }
}

/// `dx = y ⊙ (g − Σ g ⊙ y)` row by row, from the probabilities `y` and their gradient `g`.
struct SoftmaxBackward;

impl RowKernel for SoftmaxBackward {
    const NAME: &'static str = "softmax-backward";

    #[inline(always)]
    fn row(&self, _: usize, y: &[f32], g: &[f32], dx: &mut [f32]) {
        let dot = lane_sum(y.len(), |i| y[i] * g[i]);
        for ((d, &y), &g) in dx.iter_mut().zip(y).zip(g) {
            *d = y * (g - dot);
        }
    }
}

/// `(x − mean) / sqrt(var + eps)` over the last dimension.
pub(super) fn normalize(x: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Forward(Normalize { eps }))
}

struct Normalize {
    eps: f32,
}

/// A row's mean and `1 / sqrt(var + eps)`.
#[inline(always)]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = lane_sum(row.len(), |i| row[i]) / n;
    let var = lane_sum(row.len(), |i| (row[i] - mean) * (row[i] - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl RowKernel for Normalize {
    const NAME: &'static str = "normalize";

    #[inline(always)]
    fn row(&self, _: usize, x: &[f32], _: &[f32], out: &mut [f32]) {
        let (mean, inv_std) = moments(x, self.eps);
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v - mean) * inv_std;
        }
    }
}

impl ForwardKernel for Normalize {
    const SAVES: Saved = Saved::Input;
    type Backward = NormalizeBackward;

    fn backward(&self) -> NormalizeBackward {
        NormalizeBackward { eps: self.eps }
    }
}

/// `dx = (g − mean(g) − x̂ · mean(g ⊙ x̂)) / sqrt(var + eps)` row by row, from the input `x`
/// (whose moments it recomputes) and the gradient `g` of the normalised output `x̂`.
struct NormalizeBackward {
    eps: f32,
}

impl RowKernel for NormalizeBackward {
    const NAME: &'static str = "normalize-backward";

    #[inline(always)]
    fn row(&self, _: usize, x: &[f32], g: &[f32], dx: &mut [f32]) {
        let n = x.len();
        let (mean, inv_std) = moments(x, self.eps);
        let g_mean = lane_sum(n, |i| g[i]) / n as f32;
        let gx_mean = lane_sum(n, |i| g[i] * (x[i] - mean) * inv_std) / n as f32;
        for ((d, &x), &g) in dx.iter_mut().zip(x).zip(g) {
            *d = (g - g_mean - (x - mean) * inv_std * gx_mean) * inv_std;
        }
    }
}

/// `x · Φ(x)`, the exact (erf) GELU.
pub(super) fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Forward(Gelu))
}

struct Gelu;

/// Φ(x), the standard normal CDF.
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// erf(x) in f32 as a rational function of x on [−4, 4] (±1 beyond, where erf rounds to ±1 in
/// f32): the approximation Eigen and XLA use, within a few ulps of the exact value (the test
/// bounds it against libm). Branch-free and call-free, so loops over it vectorise; libm's erf
/// made the GELU a sixth of a GPT step.
#[inline(always)]
fn erf(x: f32) -> f32 {
    const ALPHA: [f32; 7] = [
        -2.726_142_3e-10,
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_600_5e-3,
        -1.609_603_3e-2,
    ];
    const BETA: [f32; 5] = [
        -1.456_607_2e-5,
        -2.133_740_6e-4,
        -1.682_827e-3,
        -7.373_329_2e-3,
        -1.426_474e-2,
    ];
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let p = ALPHA[1..].iter().fold(ALPHA[0], |p, &a| p * x2 + a) * x;
    let q = BETA[1..].iter().fold(BETA[0], |q, &b| q * x2 + b);
    p / q
}

impl RowKernel for Gelu {
    const NAME: &'static str = "gelu";

    #[inline(always)]
    fn row(&self, _: usize, x: &[f32], _: &[f32], y: &mut [f32]) {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = x * normal_cdf(x);
        }
    }
}

impl ForwardKernel for Gelu {
    const SAVES: Saved = Saved::Input;
    type Backward = GeluBackward;

    fn backward(&self) -> GeluBackward {
        GeluBackward
    }
}

/// `dx = g · (Φ(x) + x · φ(x))`.
struct GeluBackward;

impl RowKernel for GeluBackward {
    const NAME: &'static str = "gelu-backward";

    #[inline(always)]
    fn row(&self, _: usize, x: &[f32], g: &[f32], dx: &mut [f32]) {
        // 1 / sqrt(2π)
        const INV_SQRT_TAU: f32 = 0.398_942_3;
        for ((d, &x), &g) in dx.iter_mut().zip(x).zip(g) {
            *d = g * (normal_cdf(x) + x * INV_SQRT_TAU * exp(-0.5 * x * x));
        }
    }
}

/// `x · gain + bias` over the last dimension (LayerNorm's affine part): one pass forward; the
/// backward takes the input's gradient and both column sums in one pass over the rows, where
/// candle's broadcast ops reduce each parameter's gradient with a generic strided sum.
pub(super) fn scale_shift(x: &Tensor, gain: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op3(gain, bias, ScaleShift)
}

struct ScaleShift;

/// [`ScaleShift`]'s forward over rows, with the gain and bias it applies.
struct ScaleShiftRows<'a> {
    gain: &'a [f32],
    bias: &'a [f32],
}

impl RowKernel for ScaleShiftRows<'_> {
    const NAME: &'static str = "scale-shift";

    #[inline(always)]
    fn row(&self, _: usize, x: &[f32], _: &[f32], y: &mut [f32]) {
        for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(self.gain).zip(self.bias) {
            *y = x * g + b;
        }
    }
}

impl CustomOp3 for ScaleShift {
    fn name(&self) -> &'static str {
        ScaleShiftRows::NAME
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        gain: &CpuStorage,
        gain_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = row_len(x_layout)?;
        let (gain, bias) = (
            cpu_values(gain, gain_layout, self.name())?,
            cpu_values(bias, bias_layout, self.name())?,
        );
        if gain.len() != n || bias.len() != n {
            candle_core::bail!(
                "scale-shift: rows of {n}, gain of {}, bias of {}",
                gain.len(),
                bias.len()
            );
        }
        let rows = ScaleShiftRows { gain, bias };
        map_rows((x, x_layout), None, n, &rows)
    }

    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = row_len(x.layout())?;
        let (mut gain_grad, mut bias_grad) = (vec![0f32; n], vec![0f32; n]);
        let mut input_grad = x.track_op().then(|| vec![0f32; x.elem_count()]);
        with_cpu_values(&grad.contiguous()?, self.name(), |gs| {
            with_cpu_values(x, self.name(), |xs| {
                with_cpu_values(gain, self.name(), |gain| {
                    for (r, (x, g)) in xs.chunks_exact(n).zip(gs.chunks_exact(n)).enumerate() {
                        for (((dg, db), &x), &g) in gain_grad.iter_mut().zip(&mut bias_grad).zip(x).zip(g) {
                            *dg += g * x;
                            *db += g;
                        }
                        if let Some(dx) = &mut input_grad {
                            for ((dx, &g), &w) in dx[r * n..(r + 1) * n].iter_mut().zip(g).zip(gain) {
                                *dx = g * w;
                            }
                        }
                    }
                })
            })
        })???;
        let input_grad = input_grad
            .map(|dx| Tensor::from_vec(dx, x.shape(), x.device()))
            .transpose()?;
        Ok((
            input_grad,
            Some(Tensor::from_vec(gain_grad, gain.shape(), gain.device())?),
            Some(Tensor::from_vec(bias_grad, bias.shape(), bias.device())?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn input(shape: (usize, usize, usize), seed: u64) -> candle_core::Result<Var> {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let n = shape.0 * shape.1 * shape.2;
        let v: Vec<f32> = (0..n).map(|_| 3.0 * rng.normal()).collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// Largest difference of values and of the gradients of `Σ w ⊙ f(x)` (fixed weights `w`).
    fn compare(
        fused: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        composed: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
        x: &Var,
    ) -> candle_core::Result<(f32, f32)> {
        let w = input(x.dims3()?, 99)?;
        let run = |f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>| -> candle_core::Result<(Tensor, Tensor)> {
            let y = f(x.as_tensor())?;
            let grads = (&y * w.as_tensor())?.sum_all()?.backward()?;
            Ok((y, grads.get(x.as_tensor()).expect("gradient").clone()))
        };
        let ((y1, g1), (y2, g2)) = (run(&fused)?, run(&composed)?);
        let diff = |a: &Tensor, b: &Tensor| -> candle_core::Result<f32> {
            (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
        };
        Ok((diff(&y1, &y2)?, diff(&g1, &g2)?))
    }

    #[test]
    fn causal_softmax_equals_mask_then_softmax() -> candle_core::Result<()> {
        let x = input((3, 5, 5), 1)?;
        let mask: Vec<f32> = (0..5)
            .flat_map(|q| (0..5).map(move |k| if k <= q { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (5, 5), &Device::Cpu)?;
        let composed = |s: &Tensor| -> candle_core::Result<Tensor> {
            let s = s.broadcast_add(&mask)?;
            let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        };
        let (values, grads) = compare(causal_softmax, composed, &x)?;
        assert!(values < 1e-6 && grads < 1e-5, "values {values:e}, gradients {grads:e}");
        Ok(())
    }

    #[test]
    fn exp_is_within_two_ulps_of_libm_below_zero() {
        let mut worst = 0f32;
        for i in 0..=1_000_000 {
            let x = -87.0 * i as f32 / 1e6;
            let (ours, libm) = (exp(x), x.exp());
            let ulp = f32::from_bits(libm.to_bits() + 1) - libm;
            worst = worst.max((ours - libm).abs() / ulp);
        }
        assert!(worst <= 2.0, "largest error {worst} ulps on [-87, 0]");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 2e-38 && exp(f32::NEG_INFINITY) >= 0.0);
    }

    #[test]
    fn lane_reductions_cover_every_value() {
        for len in [0, 1, 15, 16, 17, 100] {
            let values: Vec<f32> = (0..len).map(|i| (i as f32 - 40.0) * 0.5).collect();
            assert_eq!(lane_sum(len, |i| values[i]), values.iter().sum::<f32>(), "{len}");
            let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lane_max(&values), max, "{len}");
        }
    }

    #[test]
    fn erf_is_within_a_few_ulps_of_libm() {
        let mut worst = 0f64;
        for i in -60_000..=60_000 {
            let x = i as f32 * 1e-4;
            let exact = candle_core::cpu::erf::erf_f64(f64::from(x));
            worst = worst.max((f64::from(erf(x)) - exact).abs());
        }
        assert!(worst < 1e-6, "largest error {worst:e} on [-6, 6]");
    }

    #[test]
    fn scale_shift_and_its_gradients_equal_the_broadcast_ops() -> candle_core::Result<()> {
        let x = input((2, 3, 7), 5)?;
        let gain = Var::from_tensor(&input((1, 1, 7), 6)?.flatten_all()?)?;
        let bias = Var::from_tensor(&input((1, 1, 7), 7)?.flatten_all()?)?;
        let w = input((2, 3, 7), 8)?;
        let run = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> candle_core::Result<Vec<Tensor>> {
            let y = f()?;
            let grads = (&y * w.as_tensor())?.sum_all()?.backward()?;
            let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient").clone();
            Ok(vec![y, grad(&x), grad(&gain), grad(&bias)])
        };
        let fused = run(&|| scale_shift(&x, &gain, &bias))?;
        let composed = run(&|| x.broadcast_mul(&gain)?.broadcast_add(&bias))?;
        for (what, (a, b)) in ["y", "dx", "dgain", "dbias"].iter().zip(fused.iter().zip(&composed)) {
            let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            // Sums of six products of values up to ~10 in another order.
            assert!(diff < 1e-4, "{what}: {diff:e}");
        }
        Ok(())
    }

    #[test]
    fn gelu_equals_candles() -> candle_core::Result<()> {
        let x = input((2, 3, 7), 3)?;
        let (values, grads) = compare(gelu, |x| x.gelu_erf(), &x)?;
        assert!(values < 1e-5 && grads < 1e-5, "values {values:e}, gradients {grads:e}");
        Ok(())
    }

    #[test]
    fn normalize_equals_its_composition() -> candle_core::Result<()> {
        let x = input((2, 4, 16), 2)?;
        let composed = |x: &Tensor| -> candle_core::Result<Tensor> {
            let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
            let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
            centred.broadcast_mul(&(var + 1e-5)?.sqrt()?.recip()?)
        };
        let (values, grads) = compare(|x| normalize(x, 1e-5), composed, &x)?;
        assert!(values < 1e-5 && grads < 1e-4, "values {values:e}, gradients {grads:e}");
        Ok(())
    }
}
