//! A parameter as blocks read it: a variable held whole, or — with sharded parameters
//! (`sharding_configs.stage = 3`) — released between the moments a block uses it, while the
//! optimizer keeps this rank's shard of its values elsewhere.
//!
//! candle cannot shrink a variable's storage in place (as PyTorch's FSDP resizes its to zero),
//! so a released parameter drops its variable, and the next gather holds a fresh one. Every
//! block and the replica's parameter list share one slot per parameter, so all of them see the
//! same variable; no other copy of it may be kept, or its memory would outlive the release.

use std::ops::Range;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use candle_core::{DType, Device, Shape, Tensor, Var};

use super::init::Recipe;

/// A shared slot holding one parameter's variable, or nothing while it is released.
#[derive(Clone)]
pub struct Param(Arc<Slot>);

struct Slot {
    shape: Shape,
    dtype: DType,
    device: Device,
    held: RwLock<Option<Var>>,
    /// How its first values are made, where it was made released ([`Param::deferred`]).
    recipe: Option<Recipe>,
}

impl Param {
    /// A parameter holding `var`.
    pub fn new(var: Var) -> Self {
        Self(Arc::new(Slot {
            shape: var.shape().clone(),
            dtype: var.dtype(),
            device: var.device().clone(),
            held: RwLock::new(Some(var)),
            recipe: None,
        }))
    }

    /// A released parameter of `shape` whose first values `recipe` makes where they are asked
    /// for ([`values`](Self::values)).
    pub fn deferred(shape: &[usize], dtype: DType, device: &Device, recipe: Recipe) -> Self {
        Self(Arc::new(Slot {
            shape: Shape::from_dims(shape),
            dtype,
            device: device.clone(),
            held: RwLock::new(None),
            recipe: Some(recipe),
        }))
    }

    /// The flat (row-major) values at `range`: the held variable's, or a released parameter's
    /// first values from its recipe.
    pub fn values(&self, range: Range<usize>) -> candle_core::Result<Tensor> {
        if let Some(var) = &*self.read() {
            return var.flatten_all()?.narrow(0, range.start, range.len());
        }
        match &self.0.recipe {
            Some(recipe) => Tensor::from_vec(recipe.values(range.clone()), range.len(), &self.0.device),
            None => candle_core::bail!(
                "a released parameter of shape {:?} has no values to give (gather it first)",
                self.0.shape
            ),
        }
    }

    /// The variable; an error while the parameter is released.
    pub fn var(&self) -> candle_core::Result<Var> {
        match &*self.read() {
            Some(var) => Ok(var.clone()),
            None => candle_core::bail!(
                "a parameter of shape {:?} was read while released (sharded parameters are gathered before a \
                 block runs)",
                self.0.shape
            ),
        }
    }

    /// The variable's shape, held or not.
    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }

    /// The dimensions of [`shape`](Self::shape).
    pub fn dims(&self) -> &[usize] {
        self.0.shape.dims()
    }

    /// Number of values.
    pub fn elem_count(&self) -> usize {
        self.0.shape.elem_count()
    }

    /// The values' type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// The device the values live on.
    pub fn device(&self) -> &Device {
        &self.0.device
    }

    /// Copies `values` into the held variable.
    pub fn set(&self, values: &Tensor) -> candle_core::Result<()> {
        self.var()?.set(values)
    }

    /// Holds `values`, the parameter's flat (row-major) values: copied into the variable held,
    /// or (released) into a fresh one, in one copy.
    pub fn hold(&self, values: &[f32]) -> candle_core::Result<()> {
        let Slot {
            shape, dtype, device, ..
        } = &*self.0;
        if values.len() != shape.elem_count() {
            candle_core::bail!("a parameter of shape {shape:?} given {} values", values.len());
        }
        let mut held = self.write();
        match &*held {
            Some(var) => var.set(&Tensor::from_slice(values, shape, device)?),
            None if *dtype == DType::F32 => {
                *held = Some(Var::from_slice(values, shape, device)?);
                Ok(())
            }
            None => {
                *held = Some(Var::from_tensor(
                    &Tensor::from_slice(values, shape, device)?.to_dtype(*dtype)?,
                )?);
                Ok(())
            }
        }
    }

    /// Drops the variable (its memory goes once no graph holds it any more).
    pub fn release(&self) {
        *self.write() = None;
    }

    /// Whether a variable is held.
    pub fn is_held(&self) -> bool {
        self.read().is_some()
    }

    /// A lock poisoned by a panic elsewhere still guards a whole value (each write replaces it).
    fn read(&self) -> RwLockReadGuard<'_, Option<Var>> {
        self.0.held.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Option<Var>> {
        self.0.held.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Param")
            .field("shape", &self.0.shape)
            .field("held", &self.is_held())
            .finish()
    }
}

impl From<Var> for Param {
    fn from(var: Var) -> Self {
        Self::new(var)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_parameter_keeps_its_shape_and_refuses_reads_until_held_again() -> anyhow::Result<()> {
        let param = Param::new(Var::ones((2, 3), DType::F32, &Device::Cpu)?);
        let shared = param.clone();
        param.release();
        assert!(!shared.is_held());
        assert_eq!(shared.dims(), &[2, 3]);
        assert!(shared.var().is_err());
        assert!(param.hold(&[0.0; 3]).is_err());
        param.hold(&[2.0; 6])?;
        assert_eq!(shared.var()?.as_tensor().to_vec2::<f32>()?, vec![vec![2f32; 3]; 2]);
        Ok(())
    }
}
