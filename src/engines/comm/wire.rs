//! The number format an all-reduce puts on its links.
//!
//! With [`Wire::Bf16`] every partial sum a rank sends is rounded to bfloat16 (round to nearest,
//! ties to even), halving the bytes on the wire; the receiver widens it and adds in f32, and
//! the finished sums are rounded once more before they go round, the owner of a segment keeping
//! the rounded value too, so every rank still ends with the same bits. bfloat16 keeps f32's
//! exponent range, so gradients need no loss scaling to fit (fp16 would overflow above 65 504).
//!
//! Error bound: each rounding errs by at most `u = 2⁻⁸` of the value rounded, and every value
//! rounded is a partial sum of the ranks' values, so at most `Σᵢ|xᵢ|` in size; an element is
//! rounded at most `n` times on its way round a ring of `n` ranks (`n − 1` partial sums and the
//! finished sum; a hierarchical all-reduce rounds fewer times). So the summed element is within
//! `n · 2⁻⁸ · Σᵢ|xᵢ|` of the exact sum (plus f32's own rounding), and the mean within
//! `2⁻⁸ · Σᵢ|xᵢ|`: below 0.4 % of the sum of magnitudes whatever the world size.

/// How an all-reduce's values travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Wire {
    /// As they are: the sums are exactly those of f32 additions in the ring's order.
    #[default]
    F32,
    /// Rounded to bfloat16 on every link, summed in f32 (see the module's error bound).
    Bf16,
}

impl Wire {
    /// Bytes of one value on the wire.
    pub fn width(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// The relative error bound of one bfloat16 rounding (half a unit in the last of its 8 bits).
pub const BF16_ROUNDING: f32 = 1.0 / 256.0;

/// `x` rounded to the nearest bfloat16, ties to even; NaN stays NaN.
#[inline]
pub fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Keep the sign and make sure a mantissa bit survives the truncation.
        ((bits >> 16) | 0x40) as u16
    } else {
        // Adding just under half of the dropped part, plus the kept part's lowest bit, rounds
        // to nearest with ties to even; a carry into the exponent is the correct rounding up
        // (to infinity beyond the largest bfloat16).
        ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
    }
}

/// The f32 of bfloat16 `h` (exact).
#[inline]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Rounds `values` into `out` (equal lengths).
pub fn round_into(values: &[f32], out: &mut [u16]) {
    out.iter_mut().zip(values).for_each(|(o, &x)| *o = to_bf16(x));
}

/// Widens `values` into `out` (equal lengths).
pub fn widen_into(values: &[u16], out: &mut [f32]) {
    out.iter_mut().zip(values).for_each(|(o, &h)| *o = from_bf16(h));
}

/// Adds the widened `values` to `acc`, element by element.
pub fn add_widened(acc: &mut [f32], values: &[u16]) {
    acc.iter_mut().zip(values).for_each(|(a, &h)| *a += from_bf16(h));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Agrees with the `half` crate's conversion (the reference implementation) on every class of
    /// value: normal, subnormal, ties both ways, overflow to infinity, infinities, NaN.
    #[test]
    fn rounding_agrees_with_the_half_crate() {
        let mut values = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            f32::MIN_POSITIVE,
            f32::MIN_POSITIVE / 3.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x3F80_8000), // a tie, rounds down to even
            f32::from_bits(0x3F81_8000), // a tie, rounds up to even
            f32::from_bits(0x3F80_8001),
            f32::from_bits(0x7F7F_FFFF),
        ];
        let mut state = 0x9E37_79B9u32;
        for _ in 0..100_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            values.push(f32::from_bits(state));
        }
        for x in values {
            let expected = half::bf16::from_f32(x);
            if x.is_nan() {
                assert!(from_bf16(to_bf16(x)).is_nan(), "{x:e}");
                continue;
            }
            assert_eq!(to_bf16(x), expected.to_bits(), "{x:e} ({:#010x})", x.to_bits());
            assert_eq!(from_bf16(to_bf16(x)), expected.to_f32(), "{x:e}");
            let rounded = from_bf16(to_bf16(x));
            if x.is_finite() && rounded.is_finite() && x.abs() >= f32::MIN_POSITIVE {
                assert!((rounded - x).abs() <= BF16_ROUNDING * x.abs(), "{x:e} → {rounded:e}");
            }
        }
    }

    #[test]
    fn slices_round_widen_and_accumulate() {
        let values = [1.0f32, 1.2345, -2.5e-3, 65_504.0];
        let mut rounded = [0u16; 4];
        round_into(&values, &mut rounded);
        let mut widened = [0f32; 4];
        widen_into(&rounded, &mut widened);
        let mut acc = [1.0f32; 4];
        add_widened(&mut acc, &rounded);
        for ((x, w), a) in values.iter().zip(widened).zip(acc) {
            assert!((w - x).abs() <= BF16_ROUNDING * x.abs());
            assert_eq!(a, 1.0 + w);
        }
    }
}
