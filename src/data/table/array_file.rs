//! Named arrays read by rows from their files, for tables streamed in parts: a safetensors file
//! (its header gives each tensor's dtype, shape and byte range) or a directory of `.npy` files
//! (each header gives its dtype, shape and order). Both hold an array row-major, so a run of
//! rows is one read per array, and a table of arrays larger than memory is read a run at a time.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use super::row_file::RowFile;
use super::{label_value, npy_files, Columns, Layout};

/// Rows decoded at a time.
const BLOCK_ROWS: u64 = 4096;

/// How an array's elements are stored, little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Element {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    Bool,
}

impl Element {
    fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 | Self::U64 => 8,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::I8 | Self::U8 | Self::Bool => 1,
        }
    }

    /// The element of a safetensors dtype; `None` for one that is not a plain number.
    fn of_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        use safetensors::Dtype as D;
        Some(match dtype {
            D::F64 => Self::F64,
            D::F32 => Self::F32,
            D::F16 => Self::F16,
            D::BF16 => Self::BF16,
            D::I64 => Self::I64,
            D::I32 => Self::I32,
            D::I16 => Self::I16,
            D::I8 => Self::I8,
            D::U64 => Self::U64,
            D::U32 => Self::U32,
            D::U16 => Self::U16,
            D::U8 => Self::U8,
            D::BOOL => Self::Bool,
            _ => return None,
        })
    }

    /// The element of a NumPy type string; `None` for one that is not a little-endian number.
    fn of_numpy(dtype: &npyz::DType) -> Option<Self> {
        use npyz::{Endianness, TypeChar};
        let npyz::DType::Plain(plain) = dtype else {
            return None;
        };
        if plain.endianness() == Endianness::Big && plain.size_field() > 1 {
            return None;
        }
        Some(match (plain.type_char(), plain.size_field()) {
            (TypeChar::Float, 8) => Self::F64,
            (TypeChar::Float, 4) => Self::F32,
            (TypeChar::Float, 2) => Self::F16,
            (TypeChar::Int, 8) => Self::I64,
            (TypeChar::Int, 4) => Self::I32,
            (TypeChar::Int, 2) => Self::I16,
            (TypeChar::Int, 1) => Self::I8,
            (TypeChar::Uint, 8) => Self::U64,
            (TypeChar::Uint, 4) => Self::U32,
            (TypeChar::Uint, 2) => Self::U16,
            (TypeChar::Uint, 1) => Self::U8,
            (TypeChar::Bool, 1) => Self::Bool,
            _ => return None,
        })
    }

    /// The elements of `bytes` as f32, appended to `out`.
    fn decode(self, bytes: &[u8], out: &mut Vec<f32>) {
        let chunks = bytes.chunks_exact(self.size());
        match self {
            Self::F64 => out.extend(chunks.map(|b| f64::from_le_bytes(b.try_into().unwrap_or_default()) as f32)),
            Self::F32 => out.extend(chunks.map(|b| f32::from_le_bytes(b.try_into().unwrap_or_default()))),
            Self::F16 => out.extend(chunks.map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())),
            Self::BF16 => out.extend(chunks.map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())),
            Self::I64 => out.extend(chunks.map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()) as f32)),
            Self::I32 => out.extend(chunks.map(|b| i32::from_le_bytes(b.try_into().unwrap_or_default()) as f32)),
            Self::I16 => out.extend(chunks.map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])))),
            Self::I8 => out.extend(chunks.map(|b| f32::from(b[0] as i8))),
            Self::U64 => out.extend(chunks.map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()) as f32)),
            Self::U32 => out.extend(chunks.map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()) as f32)),
            Self::U16 => out.extend(chunks.map(|b| f32::from(u16::from_le_bytes([b[0], b[1]])))),
            Self::U8 | Self::Bool => out.extend(chunks.map(|b| f32::from(b[0]))),
        }
    }
}

/// One array: where its row-major data starts in its file, and its shape.
#[derive(Debug)]
struct ArrayData {
    name: String,
    path: PathBuf,
    offset: u64,
    element: Element,
    rows: u64,
    /// Values per row: 1 for `(n)`, `k` for `(n, k)`.
    width: usize,
}

impl ArrayData {
    /// `name`'s data at byte `offset` of `path`, of `shape` in `element`s (`None`: not a
    /// number type, which `dtype` names).
    fn new(
        name: String,
        path: &Path,
        offset: u64,
        element: Option<Element>,
        shape: &[u64],
        dtype: &str,
    ) -> Result<Self> {
        let element = element.with_context(|| format!("array {name:?} holds {dtype}, not numbers"))?;
        let (rows, width) = match *shape {
            [rows] => (rows, 1),
            [rows, width] => (rows, width as usize),
            _ => bail!("array {name:?} has shape {shape:?}: one value per row (n) or k of them (n, k)"),
        };
        Ok(Self {
            name,
            path: path.to_path_buf(),
            offset,
            element,
            rows,
            width,
        })
    }

    /// The values of rows `rows`, row-major.
    fn read(&self, rows: std::ops::Range<u64>) -> Result<Vec<f32>> {
        let row_bytes = (self.width * self.element.size()) as u64;
        let mut bytes = vec![0u8; ((rows.end - rows.start) * row_bytes) as usize];
        let mut file = File::open(&self.path).with_context(|| format!("cannot open {}", self.path.display()))?;
        file.seek(SeekFrom::Start(self.offset + rows.start * row_bytes))
            .and_then(|_| file.read_exact(&mut bytes))
            .with_context(|| format!("array {:?}: cannot read rows {rows:?}: the file is short", self.name))?;
        let mut values = Vec::with_capacity(bytes.len() / self.element.size());
        self.element.decode(&bytes, &mut values);
        Ok(values)
    }
}

/// A table of named arrays read by rows: the arrays a model reads, found by name.
#[derive(Debug)]
pub(crate) struct ArrayTable {
    /// Every array, in name order.
    arrays: Vec<ArrayData>,
    layout: Layout,
    rows: u64,
}

impl ArrayTable {
    /// The names of the feature arrays, and the values a row holds of them.
    pub(crate) fn features(&self) -> (Vec<String>, usize) {
        let names = self
            .layout
            .features
            .iter()
            .map(|&i| self.arrays[i].name.clone())
            .collect();
        let dim = self.layout.features.iter().map(|&i| self.arrays[i].width).sum();
        (names, dim)
    }
}

/// The arrays of the safetensors file at `path`, from its header.
fn safetensors_arrays(path: &Path) -> Result<Vec<ArrayData>> {
    let mut file = File::open(path).context("cannot open it")?;
    let mut size = [0u8; 8];
    file.read_exact(&mut size).context("not a safetensors file")?;
    let header_size = u64::from_le_bytes(size);
    ensure!(
        header_size < 100 << 20,
        "not a safetensors file: a header of {header_size} bytes"
    );
    let mut header = vec![0u8; header_size as usize];
    file.read_exact(&mut header).context("not a safetensors file")?;
    // The header alone: the data is read a run of rows at a time.
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).context("not a safetensors file: its header")?;
    metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
            let offset = 8 + header_size + info.data_offsets.0 as u64;
            let dtype = format!("{:?}", info.dtype);
            let array = ArrayData::new(name, path, offset, Element::of_safetensors(info.dtype), &shape, &dtype)?;
            let bytes = array.rows * (array.width * array.element.size()) as u64;
            ensure!(
                (info.data_offsets.1 - info.data_offsets.0) as u64 == bytes,
                "array {:?}: its byte range {:?} does not hold its shape {shape:?}",
                array.name,
                info.data_offsets
            );
            Ok(array)
        })
        .collect()
}

/// The arrays of the `.npy` files in `dir`, each named by its file's stem, from their headers.
fn npy_arrays(dir: &Path) -> Result<Vec<ArrayData>> {
    let mut arrays = Vec::new();
    for (name, path) in npy_files(dir)? {
        let mut file = File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let header = npyz::NpyHeader::from_reader(&mut file)
            .with_context(|| format!("{}: not a readable .npy file", path.display()))?;
        let npy = npyz::NpyFile::with_header(header, &mut file);
        ensure!(
            npy.order() == npyz::Order::C || npy.shape().len() < 2,
            "array {name:?} is in Fortran order: save it in C order (numpy.ascontiguousarray)"
        );
        let (dtype, shape) = (npy.dtype(), npy.shape().to_vec());
        let offset = file.stream_position().context("reading the header")?;
        let described = format!("{dtype:?}");
        arrays.push(ArrayData::new(
            name,
            &path,
            offset,
            Element::of_numpy(&dtype),
            &shape,
            &described,
        )?);
    }
    Ok(arrays)
}

impl RowFile for ArrayTable {
    /// The arrays of a safetensors file, or of a directory of `.npy` files, at `path`.
    fn open(path: &Path, columns: Columns) -> Result<Self> {
        let mut arrays = match path.extension().and_then(|e| e.to_str()) {
            _ if path.is_dir() => npy_arrays(path)?,
            Some("safetensors") => safetensors_arrays(path)?,
            _ => bail!(
                "a table of arrays streamed in parts is a safetensors file or a directory of .npy files \
                 (a .npz archive is read whole: leave train.data_parts out)"
            ),
        };
        // In name order: the order of a feature list nobody gave.
        arrays.sort_by(|a, b| a.name.cmp(&b.name));
        let names: Vec<String> = arrays.iter().map(|a| a.name.clone()).collect();
        let layout = Layout::find(&names, columns, "array")?;
        let first = &arrays[layout.features[0]];
        for i in layout.read() {
            let array = &arrays[i];
            ensure!(
                array.rows == first.rows,
                "array {:?} has {} rows, {:?} {}",
                array.name,
                array.rows,
                first.name,
                first.rows
            );
        }
        if let Some(label) = layout.label {
            ensure!(
                arrays[label].width == 1,
                "the label array {:?} holds more than one value a row",
                arrays[label].name
            );
        }
        let rows = first.rows;
        Ok(Self { arrays, layout, rows })
    }

    fn rows(&self) -> u64 {
        self.rows
    }

    /// The run of up to `BLOCK_ROWS` rows from `row`.
    fn block_of(&self, row: u64, regression: bool) -> Result<(u64, Vec<Vec<f32>>)> {
        let rows = row..(row + BLOCK_ROWS).min(self.rows);
        let count = (rows.end - rows.start) as usize;
        let columns: Vec<(&ArrayData, Vec<f32>)> = self
            .layout
            .read()
            .map(|i| Ok((&self.arrays[i], self.arrays[i].read(rows.clone())?)))
            .collect::<Result<_>>()?;
        let features = self.layout.features.len();
        let mut block = Vec::with_capacity(count);
        for r in 0..count {
            let mut values = Vec::new();
            for (array, data) in &columns[..features] {
                values.extend_from_slice(&data[r * array.width..(r + 1) * array.width]);
            }
            let number = rows.start + r as u64 + 1;
            for (array, data) in &columns {
                if data[r * array.width..(r + 1) * array.width]
                    .iter()
                    .any(|v| !v.is_finite())
                {
                    bail!(
                        "array {:?}, row {number}: a value that is not a finite number",
                        array.name
                    );
                }
            }
            if let Some((array, data)) = columns.get(features) {
                let at = || format!("array {:?}, row {number}", array.name);
                values.push(label_value(data[r], regression, &at)?);
            }
            block.push(values);
        }
        Ok((rows.start, block))
    }
}
