//! The two collectives of a split layer as autograd ops: [`enter`] (identity forward, sum of the
//! gradient backward; Megatron's `f`) and [`leave`] (sum forward, identity backward; `g`).

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use super::{collective, Group};
use crate::cpu_values::cpu_values;

/// The op of [`enter`].
struct Enter(Group);

/// The op of [`leave`].
struct Leave(Group);

impl CustomOp1 for Enter {
    fn name(&self) -> &'static str {
        "enter-layer-group"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let values = cpu_values(storage, layout, "a split layer's input")?;
        Ok((CpuStorage::F32(values.to_vec()), layout.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let values = grad.flatten_all()?.to_vec1::<f32>()?;
        let summed = collective(self.0.sum(values, "all-reduce of a split layer's input gradient"))?;
        Tensor::from_vec(summed, grad.shape(), grad.device()).map(Some)
    }
}

impl CustomOp1 for Leave {
    fn name(&self) -> &'static str {
        "leave-layer-group"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let values = cpu_values(storage, layout, "a row-split layer's partial output")?.to_vec();
        let summed = collective(self.0.sum(values, "all-reduce of a row-split layer's partial outputs"))?;
        Ok((CpuStorage::F32(summed), layout.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// `x`, where a group's split layers begin: the same values, whose gradient is summed over the
/// group (each rank's part of the layers contributes its share of it).
pub fn enter(x: &Tensor, group: &Group) -> candle_core::Result<Tensor> {
    x.apply_op1(Enter(group.clone()))
}

/// The sum over the group of the ranks' partial outputs `x`, where a group's split layers end;
/// the gradient passes back to every rank as it is.
pub fn leave(x: &Tensor, group: &Group) -> candle_core::Result<Tensor> {
    x.apply_op1(Leave(group.clone()))
}
