//! Matrix products in bfloat16 with f32 sums, on AVX-512 BF16 (`vdpbf16ps`): both operands are
//! rounded to bfloat16 (round to nearest even) as they are packed, each pair of products is
//! exact in f32 and added to f32 accumulators, and the output is f32. This is the compute of
//! `strategy.amp` with `amp_configs.use_bf16`: the weights stay f32 (the optimizer's masters),
//! only the products see bfloat16.
//!
//! The kernel packs `B` once into panels of 32 columns, each pair of rows interleaved as
//! `vdpbf16ps` reads them, and each block of 8 rows of `A` as pairs of bfloat16 per row; an
//! 8 × 32 tile of the output is 16 accumulators in registers over the whole inner dimension.
//! Runs of blocks of rows run on as many threads as candle has.

use crate::cpu_features::bf16_dot_products as supported;

/// Rows of the output one kernel call computes.
const ROWS: usize = 8;
/// Columns of the output one kernel call computes: two registers of 16 f32.
const COLS: usize = 32;

/// `x` rounded to the nearest bfloat16 (ties to even), as its 16 bits; NaN stays NaN.
pub(super) fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

/// Two values as one dword of two bfloat16, the first in the low half: how `vdpbf16ps` pairs
/// the products it adds.
fn pair(first: f32, second: f32) -> u32 {
    u32::from(bf16_bits(first)) | (u32::from(bf16_bits(second)) << 16)
}

/// `a` (m×k) by `b` (k×n), each read by `(row, column)`, into row-major `out` (m×n) in bfloat16
/// with f32 sums, added to what
/// `out` holds when `accumulate`, on `threads` threads; refused where the CPU cannot
/// (`strategy.amp` is refused there first).
pub(super) fn matmul(
    (m, k, n): (usize, usize, usize),
    a: impl Fn(usize, usize) -> f32 + Sync,
    b: impl Fn(usize, usize) -> f32,
    out: &mut [f32],
    accumulate: bool,
    threads: usize,
) -> candle_core::Result<()> {
    if !supported() {
        candle_core::bail!("bfloat16 products need AVX-512 BF16, which this CPU lacks");
    }
    if out.len() != m * n {
        candle_core::bail!("a {m}×{k} by {k}×{n} bfloat16 product into {} values", out.len());
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // An empty sum.
        if !accumulate {
            out.fill(0.0);
        }
        return Ok(());
    }
    let pairs = k.div_ceil(2);
    let panels = pack_b(&b, k, n, pairs);
    let block = |(index, rows): (usize, &mut [f32])| {
        let first = index * ROWS;
        let packed = pack_a(&a, first, rows.len() / n, k, pairs);
        // SAFETY: `supported` held above; the packed buffers hold `pairs` pairs of `ROWS` rows
        // and of `COLS` columns per panel, as the kernel reads them.
        unsafe { rows_by_panels(&packed, &panels, pairs, rows, n, accumulate) };
    };
    // Each thread takes a run of whole blocks of rows.
    let blocks = m.div_ceil(ROWS);
    let per_thread = blocks.div_ceil(threads.clamp(1, blocks)) * ROWS * n;
    std::thread::scope(|scope| {
        let mut runs = out.chunks_mut(per_thread).enumerate();
        let first = runs.next();
        for (run, rows) in runs {
            let first_block = run * per_thread / (ROWS * n);
            scope.spawn(move || {
                rows.chunks_mut(ROWS * n)
                    .enumerate()
                    .for_each(|(i, r)| block((first_block + i, r)))
            });
        }
        // The calling thread takes the first run.
        if let Some((_, rows)) = first {
            rows.chunks_mut(ROWS * n).enumerate().for_each(block);
        }
    });
    Ok(())
}

/// `b` (k×n) as panels of [`COLS`] columns, each `pairs` rows of pairs, the pair of rows
/// `2p, 2p + 1` of column `c` one dword; zeros beyond the matrix.
fn pack_b(b: &impl Fn(usize, usize) -> f32, k: usize, n: usize, pairs: usize) -> Vec<u32> {
    let panels = n.div_ceil(COLS);
    let mut packed = vec![0u32; panels * pairs * COLS];
    for (panel, out) in packed.chunks_exact_mut(pairs * COLS).enumerate() {
        let cols = (n - panel * COLS).min(COLS);
        for p in 0..pairs {
            let row = &mut out[p * COLS..p * COLS + cols];
            for (c, dword) in row.iter_mut().enumerate() {
                let col = panel * COLS + c;
                let second = if 2 * p + 1 < k { b(2 * p + 1, col) } else { 0.0 };
                *dword = pair(b(2 * p, col), second);
            }
        }
    }
    packed
}

/// Rows `first .. first + rows` of `a` (m×k) as `pairs` steps of [`ROWS`] dwords, the pair of
/// columns `2p, 2p + 1` of each row one dword; zeros beyond the matrix.
fn pack_a(a: &impl Fn(usize, usize) -> f32, first: usize, rows: usize, k: usize, pairs: usize) -> Vec<u32> {
    let mut packed = vec![0u32; pairs * ROWS];
    for p in 0..pairs {
        for r in 0..rows {
            let second = if 2 * p + 1 < k { a(first + r, 2 * p + 1) } else { 0.0 };
            packed[p * ROWS + r] = pair(a(first + r, 2 * p), second);
        }
    }
    packed
}

/// The `rows` (at most [`ROWS`]) of the output in `out` (rows × n) from one packed block of `A`
/// and every panel of `B`.
///
/// # Safety
/// The CPU has AVX-512 F and BF16; `a` holds `pairs · ROWS` dwords and `panels` `pairs · COLS`
/// per panel of `n`'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn rows_by_panels(a: &[u32], panels: &[u32], pairs: usize, out: &mut [f32], n: usize, accumulate: bool) {
    let rows = out.len() / n;
    for (panel, b) in panels.chunks_exact(pairs * COLS).enumerate() {
        let mut tile = [[0f32; COLS]; ROWS];
        // SAFETY: as the caller promises.
        unsafe { tile_kernel(a, b, pairs, &mut tile) };
        let (first, cols) = (panel * COLS, (n - panel * COLS).min(COLS));
        for (r, sums) in tile.iter().enumerate().take(rows) {
            let dst = &mut out[r * n + first..r * n + first + cols];
            if accumulate {
                dst.iter_mut().zip(sums).for_each(|(o, s)| *o += s);
            } else {
                dst.copy_from_slice(&sums[..cols]);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows_by_panels(_: &[u32], _: &[u32], _: usize, _: &mut [f32], _: usize, _: bool) {
    unreachable!("bfloat16 products are refused where AVX-512 BF16 is not supported")
}

/// One [`ROWS`] × [`COLS`] tile: 16 registers of sums over every pair of the inner dimension,
/// each step a broadcast pair of each row of `A` against the two registers of `B`'s pair rows.
///
/// # Safety
/// The CPU has AVX-512 F and BF16; `a` holds `pairs · ROWS` dwords and `b` `pairs · COLS`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_kernel(a: &[u32], b: &[u32], pairs: usize, tile: &mut [[f32; COLS]; ROWS]) {
    use std::arch::x86_64::*;
    assert!(a.len() >= pairs * ROWS && b.len() >= pairs * COLS);
    let mut sums = [[_mm512_setzero_ps(); 2]; ROWS];
    for p in 0..pairs {
        // SAFETY: within `b` (checked above); unaligned loads.
        let (left, right): (__m512bh, __m512bh) = unsafe {
            let at = b.as_ptr().add(p * COLS) as *const __m512i;
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.add(1))),
            )
        };
        for (r, row) in sums.iter_mut().enumerate() {
            // SAFETY: a dword broadcast is a register of 32 bfloat16.
            let pairs_of_a =
                unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(a[p * ROWS + r] as i32)) };
            row[0] = _mm512_dpbf16_ps(row[0], pairs_of_a, left);
            row[1] = _mm512_dpbf16_ps(row[1], pairs_of_a, right);
        }
    }
    for (row, out) in sums.iter().zip(tile.iter_mut()) {
        // SAFETY: each output row holds 32 f32, two registers' worth.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr(), row[0]);
            _mm512_storeu_ps(out.as_mut_ptr().add(16), row[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x` rounded to bfloat16 and back.
    fn rounded(x: f32) -> f32 {
        f32::from_bits(u32::from(bf16_bits(x)) << 16)
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(rounded(1.0), 1.0);
        // 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷: ties go to the even 1.
        assert_eq!(rounded(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(rounded(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(rounded(-2.5), -2.5);
        assert!(rounded(f32::NAN).is_nan());
        assert_eq!(rounded(f32::INFINITY), f32::INFINITY);
    }

    /// The product of the operands rounded to bfloat16, summed in f64: what the kernel computes
    /// up to the order of its f32 sums.
    fn reference(
        (m, k, n): (usize, usize, usize),
        a: impl Fn(usize, usize) -> f32,
        b: impl Fn(usize, usize) -> f32,
    ) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                let sum: f64 = (0..k)
                    .map(|i| f64::from(rounded(a(r, i))) * f64::from(rounded(b(i, c))))
                    .sum();
                out[r * n + c] = sum as f32;
            }
        }
        out
    }

    #[test]
    fn products_of_odd_shapes_and_transposed_operands_match_bfloat16_arithmetic() {
        if !supported() {
            // The kernel refuses, and the config refuses bfloat16 before it is asked.
            let out = &mut [0f32; 1];
            assert!(matmul((1, 1, 1), |_, _| 1.0, |_, _| 1.0, out, false, 1).is_err());
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (2, 0, 3),
            (3, 5, 7),
            (8, 32, 32),
            (17, 33, 65),
            (70, 129, 40),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 201) as f32 / 100.0 - 1.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 197) as f32 / 50.0 - 2.0).collect();
            // A as it lies (row-major m×k); B read transposed from an n×k row-major buffer.
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let a = |r: usize, c: usize| a[r * k + c];
            let b = |r: usize, c: usize| bt[c * k + r];
            let expected = reference((m, k, n), a, b);
            for threads in [1, 2] {
                let mut out = vec![0.5f32; m * n];
                matmul((m, k, n), a, b, &mut out, true, threads).expect("supported");
                for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
                    // f32 sums of up to 129 exact products, in another order than f64's.
                    let want = want + 0.5;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * k as f32,
                        "{m}×{k}×{n} [{i}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
