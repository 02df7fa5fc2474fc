//! What this CPU can compute, asked once by the config's checks and by the kernels that use it.

/// Whether this CPU multiplies bfloat16 pairs into f32 sums (`vdpbf16ps`: AVX-512 F and BF16).
pub fn bf16_dot_products() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
