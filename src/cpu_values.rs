//! The f32 values of a tensor's CPU storage, for the fused kernels and in-place updates that
//! read and write them directly; anything else (another dtype, a strided view) is an error
//! naming the operation.

use candle_core::{CpuStorage, Layout, Storage, Tensor};

/// The values of a contiguous f32 tensor.
pub fn cpu_values<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) => Ok(&v[start..end]),
        _ => candle_core::bail!("{op}: expects a contiguous f32 tensor"),
    }
}

/// The values of a contiguous f32 tensor of `len` values (its partner's), to write in place.
pub fn cpu_values_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
    len: usize,
    op: &str,
) -> candle_core::Result<&'a mut [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((start, end))) if end - start == len => Ok(&mut v[start..end]),
        _ => candle_core::bail!("{op}: expects a contiguous f32 tensor of {len} values"),
    }
}

/// A tensor's values, read under its storage lock, to `f`; `op` names the kernel in errors.
pub fn with_cpu_values<T>(tensor: &Tensor, op: &str, f: impl FnOnce(&[f32]) -> T) -> candle_core::Result<T> {
    let (storage, layout) = tensor.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => Ok(f(cpu_values(cpu, layout, op)?)),
        _ => candle_core::bail!("{op}: the fused kernel runs on the CPU"),
    }
}
