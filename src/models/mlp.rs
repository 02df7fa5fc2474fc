//! The multi-layer perceptron classifier.

use anyhow::Result;

use super::{Activation, Block, Linear, Model, ParamInit};

/// An MLP `inputs → hidden[0] → … → classes`, ReLU between layers, one
/// [`Linear`] block per layer named `fc0`, `fc1`, ….
pub fn mlp(inputs: usize, hidden: &[usize], classes: usize, init: &ParamInit) -> Result<Model> {
    let widths: Vec<usize> = std::iter::once(inputs)
        .chain(hidden.iter().copied())
        .chain(std::iter::once(classes))
        .collect();
    let layers = widths.len() - 1;
    let blocks = (0..layers)
        .map(|i| {
            let activation = if i + 1 == layers {
                Activation::Identity
            } else {
                Activation::Relu
            };
            Ok(Box::new(Linear::new(
                &format!("fc{i}"),
                widths[i],
                widths[i + 1],
                activation,
                init,
            )?) as Box<dyn Block>)
        })
        .collect::<Result<Vec<_>>>()?;
    Model::new(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn shapes_names_and_determinism() -> anyhow::Result<()> {
        let init = ParamInit::new(1, Device::Cpu);
        let model = mlp(4, &[8, 6], 3, &init)?;
        let names: Vec<String> = model.parameters().into_iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "fc0.bias",
                "fc0.weight",
                "fc1.bias",
                "fc1.weight",
                "fc2.bias",
                "fc2.weight"
            ]
        );
        assert_eq!(model.parameter_count(), 4 * 8 + 8 + 8 * 6 + 6 + 6 * 3 + 3);
        let x = Tensor::ones((5, 4), candle_core::DType::F32, &Device::Cpu)?;
        assert_eq!(model.forward(&x)?.dims(), &[5, 3]);
        let again = mlp(4, &[8, 6], 3, &init)?;
        let a = model.parameters()[1].param.var()?.flatten_all()?.to_vec1::<f32>()?;
        let b = again.parameters()[1].param.var()?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(a, b);
        Ok(())
    }
}
