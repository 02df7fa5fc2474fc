//! The CPU kernel of [`super::Linear`]: `y = act(x W + b)` as one GEMM whose output starts as the
//! bias, with the ReLU applied in place; its backward masks the upstream gradient once and
//! takes `dX = g Wᵀ` and `dW = xᵀ g` each as one GEMM and `db` as one pass over `g`. Composed
//! from candle's ops the same layer costs a bias broadcast, a ReLU pass and, backward, a
//! four-pass ReLU gradient and a generic reduction for the bias.
//!
//! The GEMMs are the `gemm` crate's (the kernel candle's matmul uses), run with candle's thread
//! count; the crate picks its AVX-512, AVX2/FMA or portable kernel at run time. Under
//! `strategy.amp` they take bfloat16 operands with f32 sums instead ([`super::bf16_matmul`]).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use gemm::Parallelism;

use crate::cpu_values::{cpu_values, with_cpu_values};

use super::{bf16_matmul, Activation};
use crate::config::JobConfig;

/// The f32 matrix kernel gemm runs on this CPU, chosen as gemm chooses it: `avx512f`,
/// `avx2+fma`, `neon` or its `portable` one — recorded with every throughput figure.
pub fn cpu_matrix_kernel() -> &'static str {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512f";
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return "avx2+fma";
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return "neon";
        }
    }
    "portable"
}

/// What an affine map's products are computed in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 operands and sums.
    #[default]
    F32,
    /// bfloat16 operands, f32 sums (`strategy.amp`).
    Bf16,
}

impl Precision {
    /// The products `job` asks for.
    pub fn of(job: &JobConfig) -> Self {
        match job.bf16_products() {
            true => Self::Bf16,
            false => Self::F32,
        }
    }

    /// The kernel the dense layers' products run on in this process, as summaries record it:
    /// [`cpu_matrix_kernel`]'s, or `avx512_bf16` for bfloat16 products.
    pub fn matrix_kernel(self) -> &'static str {
        match self {
            Self::F32 => cpu_matrix_kernel(),
            Self::Bf16 => "avx512_bf16",
        }
    }
}

/// `act(x W + b)` for `x` (…, in), `W` (in, out), `b` (out): the fused kernel on the CPU in f32
/// (its products in `products`), candle's composed ops elsewhere (a GPU).
pub(super) fn affine(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    (activation, products): (Activation, Precision),
) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        return x.contiguous()?.apply_op3(weight, bias, Affine { activation, products });
    }
    let y = x.broadcast_matmul(weight)?.broadcast_add(bias)?;
    match activation {
        Activation::Identity => Ok(y),
        Activation::Relu => y.relu(),
    }
}

struct Affine {
    activation: Activation,
    products: Precision,
}

/// The shape (inputs, outputs) of the weight, checked against the input and the bias.
fn dims(x: &Layout, weight: &Layout, bias: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let (inputs, outputs) = weight.shape().dims2()?;
    let x_inputs = x.dims().last().copied().unwrap_or(0);
    if x_inputs != inputs || bias.shape().elem_count() != outputs {
        candle_core::bail!(
            "linear: input {:?}, weight {:?} and bias {:?} do not fit",
            x.dims(),
            weight.dims(),
            bias.dims()
        );
    }
    Ok((x.shape().elem_count() / inputs.max(1), inputs, outputs))
}

fn parallelism() -> Parallelism {
    match candle_core::utils::get_num_threads() {
        threads if threads > 1 => Parallelism::Rayon(threads),
        _ => Parallelism::None,
    }
}

/// A matrix as it lies in memory: its values and the strides of a step down a column (to the
/// next row) and along a row (to the next column).
struct Matrix<T> {
    values: T,
    row_stride: isize,
    col_stride: isize,
}

impl Matrix<&[f32]> {
    /// Element `(row, col)`.
    fn at(&self, row: usize, col: usize) -> f32 {
        self.values[row * self.row_stride as usize + col * self.col_stride as usize]
    }
}

/// `a` (m×k) by `b` (k×n) into row-major `out` (m×n), added to what `out` holds when `accumulate`,
/// its products in `products`.
fn matmul(
    (m, k, n): (usize, usize, usize),
    a: Matrix<&[f32]>,
    b: Matrix<&[f32]>,
    out: &mut [f32],
    (accumulate, products): (bool, Precision),
) -> candle_core::Result<()> {
    if out.len() != m * n || a.values.len() != m * k || b.values.len() != k * n {
        candle_core::bail!("linear: a {m}×{k} by {k}×{n} product over buffers that do not fit");
    }
    if products == Precision::Bf16 {
        let threads = candle_core::utils::get_num_threads();
        return bf16_matmul::matmul(
            (m, k, n),
            |r, c| a.at(r, c),
            |r, c| b.at(r, c),
            out,
            accumulate,
            threads,
        );
    }
    // SAFETY: the three buffers hold exactly the m×k, k×n and m×n values the strides address
    // (checked above); `out` is borrowed mutably and so overlaps neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.values.as_ptr(),
            a.col_stride,
            a.row_stride,
            b.values.as_ptr(),
            b.col_stride,
            b.row_stride,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        );
    }
    Ok(())
}

/// A row-major (rows × cols) matrix as it lies.
fn plain(values: &[f32], cols: usize) -> Matrix<&[f32]> {
    Matrix {
        values,
        row_stride: cols as isize,
        col_stride: 1,
    }
}

/// The transpose of a row-major (rows × cols) matrix, read in place.
fn transposed(values: &[f32], cols: usize) -> Matrix<&[f32]> {
    Matrix {
        values,
        row_stride: 1,
        col_stride: cols as isize,
    }
}

impl CustomOp3 for Affine {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, inputs, outputs) = dims(x_layout, weight_layout, bias_layout)?;
        let (x, weight) = (
            cpu_values(x, x_layout, "linear input")?,
            cpu_values(weight, weight_layout, "linear weight")?,
        );
        let bias = cpu_values(bias, bias_layout, "linear bias")?;
        let mut y: Vec<f32> = Vec::with_capacity(rows * outputs);
        for _ in 0..rows {
            y.extend_from_slice(bias);
        }
        matmul(
            (rows, inputs, outputs),
            plain(x, inputs),
            plain(weight, outputs),
            &mut y,
            (true, self.products),
        )?;
        if self.activation == Activation::Relu {
            for v in &mut y {
                *v = v.max(0.0);
            }
        }
        let mut dims = x_layout.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = outputs;
        }
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = dims(x.layout(), weight.layout(), bias.layout())?;
        let products = self.products;
        with_cpu_values(&grad.contiguous()?, "linear gradient", |grad| match self.activation {
            Activation::Identity => gradients((dims, products), x, weight, bias, grad),
            Activation::Relu => {
                // The upstream gradient where the ReLU let the value through (y > 0).
                let masked: Vec<f32> = with_cpu_values(y, "linear output", |y| {
                    grad.iter()
                        .zip(y)
                        .map(|(&g, &y)| if y > 0.0 { g } else { 0.0 })
                        .collect()
                })?;
                gradients((dims, products), x, weight, bias, &masked)
            }
        })?
    }
}

/// The gradients of the input, the weight and the bias.
type Gradients = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// The gradients of the input (when it needs one), the weight and the bias, from `g`, the
/// gradient of the affine map's output (rows × outputs), the products in `products`.
fn gradients(
    ((rows, inputs, outputs), products): ((usize, usize, usize), Precision),
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    g: &[f32],
) -> candle_core::Result<Gradients> {
    let mut bias_grad = vec![0f32; outputs];
    for row in g.chunks_exact(outputs) {
        for (sum, &v) in bias_grad.iter_mut().zip(row) {
            *sum += v;
        }
    }
    let mut weight_grad = vec![0f32; inputs * outputs];
    with_cpu_values(x, "linear input", |x| {
        matmul(
            (inputs, rows, outputs),
            transposed(x, inputs),
            plain(g, outputs),
            &mut weight_grad,
            (false, products),
        )
    })??;
    let input_grad = match x.track_op() {
        true => {
            let mut input_grad = vec![0f32; rows * inputs];
            with_cpu_values(weight, "linear weight", |w| {
                matmul(
                    (rows, outputs, inputs),
                    plain(g, outputs),
                    transposed(w, outputs),
                    &mut input_grad,
                    (false, products),
                )
            })??;
            Some(Tensor::from_vec(input_grad, x.shape(), x.device())?)
        }
        false => None,
    };
    Ok((
        input_grad,
        Some(Tensor::from_vec(weight_grad, weight.shape(), weight.device())?),
        Some(Tensor::from_vec(bias_grad, bias.shape(), bias.device())?),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// `act(x W + b)` composed from candle's own ops, for the gradients of its autograd.
    fn composed(x: &Tensor, w: &Tensor, b: &Tensor, activation: Activation) -> candle_core::Result<Tensor> {
        let y = x.broadcast_matmul(w)?.broadcast_add(b)?;
        match activation {
            Activation::Identity => Ok(y),
            Activation::Relu => y.relu(),
        }
    }

    fn close(what: &str, fused: &Tensor, reference: &Tensor) -> candle_core::Result<()> {
        assert_eq!(fused.dims(), reference.dims(), "{what}");
        let (a, b) = (
            fused.flatten_all()?.to_vec1::<f32>()?,
            reference.flatten_all()?.to_vec1::<f32>()?,
        );
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            // Sums of up to 33 products of values below 1 in another order: a few ulps.
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{what}[{i}]: {a} vs {b}");
        }
        Ok(())
    }

    #[test]
    fn forward_and_backward_equal_candles_autograd_on_odd_shapes() -> candle_core::Result<()> {
        let device = Device::Cpu;
        for (x_dims, outputs) in [(vec![1, 3], 5), (vec![7, 13], 1), (vec![33, 17], 9), (vec![2, 5, 6], 4)] {
            for activation in [Activation::Identity, Activation::Relu] {
                let inputs = *x_dims.last().unwrap_or(&1);
                let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, x_dims.as_slice(), &device)?)?;
                let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (inputs, outputs), &device)?)?;
                let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, outputs, &device)?)?;
                let upstream = Tensor::randn(0f32, 1.0, composed(&x, &w, &b, activation)?.shape(), &device)?;
                let run = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> candle_core::Result<_> {
                    let y = f()?;
                    let grads = (&y * &upstream)?.sum_all()?.backward()?;
                    let grad = |v: &Var| grads.get(v.as_tensor()).cloned().expect("a gradient");
                    Ok((y, grad(&x), grad(&w), grad(&b)))
                };
                let fused = run(&|| affine(&x, &w, &b, (activation, Precision::F32)))?;
                let reference = run(&|| composed(&x, &w, &b, activation))?;
                let case = format!("{x_dims:?} → {outputs}, {activation:?}");
                close(&format!("{case}: y"), &fused.0, &reference.0)?;
                close(&format!("{case}: dX"), &fused.1, &reference.1)?;
                close(&format!("{case}: dW"), &fused.2, &reference.2)?;
                close(&format!("{case}: db"), &fused.3, &reference.3)?;
            }
        }
        Ok(())
    }

    /// `t` with every value rounded to bfloat16, as f32.
    fn rounded(t: &Tensor) -> candle_core::Result<Tensor> {
        let values: Vec<f32> = t
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .map(|v| f32::from_bits(u32::from(bf16_matmul::bf16_bits(v)) << 16))
            .collect();
        Tensor::from_vec(values, t.shape(), t.device())
    }

    /// With bfloat16 products the map and its gradients are f32 arithmetic on operands rounded
    /// to bfloat16: forward `x̃ W̃ + b`, backward `g̃ W̃ᵀ`, `x̃ᵀ g̃` (the upstream gradient
    /// rounded too) and the bias's f32 sum; up to the order of the f32 sums.
    #[test]
    fn bfloat16_products_are_f32_arithmetic_on_rounded_operands() -> candle_core::Result<()> {
        let device = Device::Cpu;
        let bf16 = (Activation::Relu, Precision::Bf16);
        let x = Var::from_tensor(&Tensor::randn(0f32, 0.5, (37, 19), &device)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (19, 11), &device)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.5, 11, &device)?)?;
        let forward = affine(&x, &w, &b, bf16);
        if !crate::cpu_features::bf16_dot_products() {
            // Refused where the CPU cannot (the config refuses `strategy.amp` there first).
            assert!(forward.is_err());
            return Ok(());
        }
        let y = forward?;
        let upstream = Tensor::randn(0f32, 0.5, (37, 11), &device)?;
        let grads = (&y * &upstream)?.sum_all()?.backward()?;
        let (xr, wr) = (rounded(&x)?, rounded(&w)?);
        let expected = xr.matmul(&wr)?.broadcast_add(&b)?.relu()?;
        close("y", &y, &expected)?;
        let g = (&upstream * y.gt(0f32)?.to_dtype(DType::F32)?)?;
        let gr = rounded(&g)?;
        close("dX", grads.get(&x).expect("dX"), &gr.matmul(&wr.t()?)?)?;
        close("dW", grads.get(&w).expect("dW"), &xr.t()?.matmul(&gr)?)?;
        close("db", grads.get(&b).expect("db"), &g.sum(0)?)?;
        Ok(())
    }

    #[test]
    fn an_input_that_needs_no_gradient_gets_none() -> candle_core::Result<()> {
        let device = Device::Cpu;
        let x = Tensor::ones((4, 3), candle_core::DType::F32, &device)?;
        let w = Var::ones((3, 2), candle_core::DType::F32, &device)?;
        let b = Var::zeros(2, candle_core::DType::F32, &device)?;
        let grads = affine(&x, &w, &b, (Activation::Relu, Precision::F32))?
            .sum_all()?
            .backward()?;
        assert!(grads.get(&x).is_none());
        assert_eq!(grads.get(&w).expect("dW").to_vec2::<f32>()?, vec![vec![4.0; 2]; 3]);
        assert_eq!(grads.get(&b).expect("db").to_vec1::<f32>()?, vec![4.0; 2]);
        Ok(())
    }
}
