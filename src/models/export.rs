//! The model file: a trained model's parameters as safetensors, each under its model name
//! (`fc0.weight`, `h1.attn.q.weight`) in its real shape and PyTorch's layout — an affine
//! weight (out, in) as `nn.Linear` holds it — so that Python's `safetensors` loads it into the
//! equivalent PyTorch module by name. The metadata says what the file is:
//!
//! | key | value |
//! | --- | --- |
//! | `format` | `flotilla-model` |
//! | `format_version` | `1` |
//! | `model` | the architecture as JSON ([`ModelSpec`]), for the built-in models |
//! | `loss` | the loss it was trained with (`cross_entropy`, `mse`, `mae`) |
//! | extra keys | what the job adds, as JSON: `feature_columns` of a table data set, `vocab` of a language model (its characters in token order, one string) |
//!
//! A checkpoint's file is a model file too (of its stage's parameters, in a pipeline), with
//! the training state besides: each optimizer slot as `optimizer.<parameter>.<slot>` in its
//! parameter's layout, and the optimizer's kind, its update counter, the batches trained and
//! the losses so far in the metadata ([`crate::collective::training_state`]). PyTorch loads its
//! parameters by name once the `optimizer.` entries are set aside.
//!
//! Loading checks every tensor against the model before it changes anything: a file of
//! another model is refused with the tensor that does not fit.

use std::collections::HashMap;
use std::io::Write;

use anyhow::{bail, ensure, Context, Result};
use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};
use safetensors::SafeTensors;

use super::{Model, ModelSpec, NamedParam, ParamInit};
use crate::checkpoint::{write_header, write_tensors};

/// The `format` of a model file.
pub const FORMAT: &str = "flotilla-model";
const FORMAT_VERSION: &str = "1";
/// The names of a checkpoint's optimizer slots start with this; a model's parameters never do.
pub const OPTIMIZER_PREFIX: &str = "optimizer.";

/// What a model file says besides its tensors.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelInfo {
    /// The architecture, for a built-in model.
    pub spec: Option<ModelSpec>,
    /// The loss trained (`train.loss`).
    pub loss: Option<String>,
    /// Further entries, such as the feature columns a model reads.
    pub extra: HashMap<String, String>,
}

impl ModelInfo {
    /// The safetensors metadata.
    pub(crate) fn metadata(&self) -> Result<HashMap<String, String>> {
        let mut metadata = self.extra.clone();
        metadata.insert("format".to_string(), FORMAT.to_string());
        metadata.insert("format_version".to_string(), FORMAT_VERSION.to_string());
        if let Some(spec) = &self.spec {
            metadata.insert("model".to_string(), serde_json::to_string(spec)?);
        }
        if let Some(loss) = &self.loss {
            metadata.insert("loss".to_string(), loss.clone());
        }
        Ok(metadata)
    }

    /// The info of a model file's metadata, which must say it is one.
    fn of(metadata: HashMap<String, String>) -> Result<Self> {
        let mut extra = metadata;
        match extra.remove("format").as_deref() {
            Some(FORMAT) => {}
            other => bail!(
                "not a flotilla model file: its metadata's format is {other:?}, not {FORMAT:?} \
                 (a checkpoint's files are read with --checkpoint)"
            ),
        }
        let version = extra.remove("format_version").unwrap_or_default();
        ensure!(
            version == FORMAT_VERSION,
            "model file format version {version:?}: this flotilla reads version {FORMAT_VERSION}"
        );
        let spec = extra
            .remove("model")
            .map(|json| serde_json::from_str(&json).context("its `model` metadata"))
            .transpose()?;
        Ok(Self {
            spec,
            loss: extra.remove("loss"),
            extra,
        })
    }
}

/// Writes `model`'s parameters in PyTorch's layout, with `info`, as a safetensors file.
pub fn write_model(out: &mut dyn Write, model: &Model, info: &ModelInfo) -> Result<()> {
    let tensors = model
        .parameters()
        .iter()
        .map(|p| Ok((p.name.clone(), in_torch_layout(p, p.param.var()?.as_tensor())?)))
        .collect::<Result<Vec<_>>>()?;
    write_tensors(out, &tensors, info.metadata()?)
}

/// Writes the model file of a model of `model`'s shapes holding `values` (flat, by name, as
/// ranks report them) to `out`, `info` describing it, one parameter at a time: `model` need hold
/// no values of its own (made [`ParamInit::deferring`]). A name missing, unknown or of another
/// size is refused before anything is written.
pub fn write_values(out: &mut dyn Write, model: &Model, values: &[(String, Vec<f32>)], info: &ModelInfo) -> Result<()> {
    let params = model.parameters();
    let by_name: HashMap<&str, &[f32]> = values.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    ensure!(
        by_name.len() == params.len(),
        "{} parameters given for a model of {}",
        by_name.len(),
        params.len()
    );
    let mut entries = Vec::with_capacity(params.len());
    for p in &params {
        let flat = by_name
            .get(p.name.as_str())
            .with_context(|| format!("no values for parameter {}", p.name))?;
        ensure!(
            flat.len() == p.param.elem_count(),
            "parameter {}: {} values for a shape of {:?}",
            p.name,
            flat.len(),
            p.param.dims()
        );
        entries.push((p.name.clone(), torch_dims(p)));
    }
    write_header(out, &entries, info.metadata()?)?;
    for p in &params {
        write_in_torch_layout(out, p, by_name[p.name.as_str()])?;
    }
    Ok(())
}

/// `tensor`, a value of `p`'s shape (the parameter, an optimizer slot), as PyTorch lays it out:
/// a view, copied only as it is written.
pub(crate) fn in_torch_layout(p: &NamedParam, tensor: &Tensor) -> Result<Tensor> {
    Ok(if p.transposed { tensor.t()? } else { tensor.clone() })
}

/// Writes `values` — the flat values of `p`, or of a value of its shape, in its own layout — to
/// `out` in PyTorch's.
pub(crate) fn write_in_torch_layout(out: &mut dyn Write, p: &NamedParam, values: &[f32]) -> Result<()> {
    if p.transposed {
        let value = Tensor::from_slice(values, p.param.shape(), &Device::Cpu)?;
        let laid_out = value.t()?.flatten_all()?.to_vec1::<f32>()?;
        out.write_all(bytemuck::cast_slice(&laid_out))?;
    } else {
        out.write_all(bytemuck::cast_slice(values))?;
    }
    Ok(())
}

/// The shape of `p` in PyTorch's layout.
pub(crate) fn torch_dims(p: &NamedParam) -> Vec<usize> {
    let dims = p.param.dims();
    if p.transposed {
        dims.iter().rev().copied().collect()
    } else {
        dims.to_vec()
    }
}

/// The value of `p`'s shape that `view` holds in PyTorch's layout, on `p`'s device in its own;
/// a view of another shape or type is refused, named `what`.
pub(crate) fn from_torch_layout(
    p: &NamedParam,
    view: &safetensors::tensor::TensorView<'_>,
    what: &str,
) -> Result<Tensor> {
    let expected = torch_dims(p);
    ensure!(
        view.shape() == expected.as_slice() && view.dtype() == safetensors::Dtype::F32,
        "{what}: the file's is {:?} {:?}, the model's F32 {expected:?}",
        view.dtype(),
        view.shape()
    );
    let tensor: Tensor = view.load(p.param.device())?;
    Ok(if p.transposed {
        tensor.t()?.contiguous()?
    } else {
        tensor
    })
}

/// What a model file holds: its info and a view of its tensors.
pub struct ModelFile<'a> {
    /// The metadata.
    pub info: ModelInfo,
    tensors: SafeTensors<'a>,
}

impl<'a> ModelFile<'a> {
    /// The model file in `bytes`.
    pub fn parse(bytes: &'a [u8]) -> Result<Self> {
        let tensors = SafeTensors::deserialize(bytes).context("not a safetensors file")?;
        let (_, header) = SafeTensors::read_metadata(bytes)?;
        let info = ModelInfo::of(header.metadata().clone().unwrap_or_default())?;
        Ok(Self { info, tensors })
    }

    /// The built-in model the file describes, with its parameters.
    pub fn model(&self, device: &Device) -> Result<Model> {
        let spec = self.info.spec.as_ref().context(
            "the file names no built-in model (it holds a custom model: build it, then load the file into it)",
        )?;
        let model = spec.build(&ParamInit::new(0, device.clone()))?;
        self.load_into(&model)?;
        Ok(model)
    }

    /// Sets `model`'s parameters from the file. Every tensor is checked first (present, of the
    /// model's shape, f32, none left over), so a file of another model changes nothing.
    pub fn load_into(&self, model: &Model) -> Result<()> {
        let params = model.parameters();
        let mut values = Vec::with_capacity(params.len());
        for p in &params {
            let view = self
                .tensors
                .tensor(&p.name)
                .ok()
                .with_context(|| format!("the file has no tensor {}: it holds another model", p.name))?;
            values.push(from_torch_layout(p, &view, &format!("tensor {}", p.name))?);
        }
        // A checkpoint's optimizer slots are no parameters.
        if let Some(extra) = self
            .tensors
            .names()
            .into_iter()
            .find(|n| !n.starts_with(OPTIMIZER_PREFIX) && !params.iter().any(|p| p.name == **n))
        {
            bail!("the file has a tensor {extra} the model lacks: it holds another model");
        }
        for (p, value) in params.iter().zip(values) {
            p.param.set(&value)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::mlp;

    fn file_of(model: &Model, info: &ModelInfo) -> Vec<u8> {
        let mut bytes = Vec::new();
        write_model(&mut bytes, model, info).unwrap();
        bytes
    }

    #[test]
    fn weights_are_written_out_by_in_and_read_back_exactly() -> Result<()> {
        let spec = ModelSpec::Mlp {
            inputs: 3,
            hidden: vec![4],
            outputs: 2,
        };
        let trained = spec.build(&ParamInit::new(5, Device::Cpu))?;
        let info = ModelInfo {
            spec: Some(spec.clone()),
            loss: Some("mse".to_string()),
            extra: HashMap::from([("feature_columns".to_string(), "[\"a\"]".to_string())]),
        };
        let bytes = file_of(&trained, &info);
        let raw = SafeTensors::deserialize(&bytes)?;
        assert_eq!(raw.tensor("fc0.weight")?.shape(), [4, 3]);
        assert_eq!(raw.tensor("fc1.bias")?.shape(), [2]);
        // (out, in): row o of the file is column o of the stored (in, out) weight.
        let stored = trained.parameters()[1].param.var()?.as_tensor().to_vec2::<f32>()?;
        let written: Tensor = raw.tensor("fc0.weight")?.load(&Device::Cpu)?;
        assert_eq!(written.to_vec2::<f32>()?[2][1], stored[1][2]);

        let file = ModelFile::parse(&bytes)?;
        assert_eq!(file.info, info);
        let loaded = file.model(&Device::Cpu)?;
        let x = Tensor::new(&[[0.5f32, -1.0, 2.0]], &Device::Cpu)?;
        assert_eq!(
            loaded.forward(&x)?.to_vec2::<f32>()?,
            trained.forward(&x)?.to_vec2::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn a_file_of_another_model_is_refused_by_tensor_and_changes_nothing() -> Result<()> {
        let device = Device::Cpu;
        let small = mlp(3, &[4], 2, &ParamInit::new(1, device.clone()))?;
        let deeper = mlp(3, &[4, 4], 2, &ParamInit::new(1, device.clone()))?;
        let wider = mlp(3, &[5], 2, &ParamInit::new(1, device.clone()))?;
        let before = small.parameters()[0].param.var()?.as_tensor().to_vec1::<f32>()?;
        let info = ModelInfo::default();
        let err = |bytes: Vec<u8>| format!("{:#}", ModelFile::parse(&bytes).unwrap().load_into(&small).unwrap_err());
        let text = err(file_of(&wider, &info));
        assert!(text.contains("tensor fc0.bias") && text.contains("[5]"), "{text}");
        assert_eq!(small.parameters()[0].param.var()?.as_tensor().to_vec1::<f32>()?, before);
        let text = err(file_of(&deeper, &info));
        assert!(text.contains("tensor fc1.bias: the file's is F32 [4]"), "{text}");
        // The tensors of `small`'s file, then one of them dropped or one added.
        let tensors = |bytes: &[u8]| -> Result<Vec<(String, Tensor)>> {
            let file = SafeTensors::deserialize(bytes)?;
            let names: Vec<String> = file.names().into_iter().map(str::to_string).collect();
            names
                .into_iter()
                .map(|n| Ok((n.clone(), file.tensor(&n)?.load(&device)?)))
                .collect()
        };
        let written = file_of(&small, &info);
        let with = |tensors: Vec<(String, Tensor)>| -> Result<Vec<u8>> {
            let mut bytes = Vec::new();
            write_tensors(&mut bytes, &tensors, info.metadata()?)?;
            Ok(bytes)
        };
        let mut missing = tensors(&written)?;
        missing.retain(|(n, _)| n != "fc0.bias");
        assert!(err(with(missing)?).contains("no tensor fc0.bias"));
        let mut extra = tensors(&written)?;
        extra.push((
            "fc9.bias".to_string(),
            Tensor::zeros(2, candle_core::DType::F32, &device)?,
        ));
        let text = err(with(extra)?);
        assert!(text.contains("tensor fc9.bias the model lacks"), "{text}");
        let text = format!(
            "{:#}",
            ModelFile::parse(&file_of(&small, &info))?.model(&device).err().unwrap()
        );
        assert!(text.contains("no built-in model"), "{text}");
        let mut plain = Vec::new();
        let tensors = [("w".to_string(), small.parameters()[0].param.var()?.as_tensor().clone())];
        write_tensors(&mut plain, &tensors, HashMap::new())?;
        let text = format!("{:#}", ModelFile::parse(&plain).err().unwrap());
        assert!(text.contains("not a flotilla model file"), "{text}");
        Ok(())
    }
}
