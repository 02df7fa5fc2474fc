//! TensorBoard event files beside `metrics.jsonl`: `RUN_DIR/tensorboard/events.out.tfevents.
//! <seconds>.<host>.<pid>`, so `tensorboard --logdir RUN_DIR` shows a run's scalars. Written
//! from the format's specification: a TFRecord stream (each record a little-endian u64
//! length, its masked CRC-32C, the bytes, their masked CRC-32C) of `tensorflow.Event` protocol
//! buffers — the first holding `file_version`, each later one a step's `Summary` of scalars
//! (`simple_value`). A resumed run starts a file of its own; TensorBoard reads a directory's
//! files together.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};

use super::metrics::StepMetrics;

/// The directory of a run's event files.
pub const TENSORBOARD_DIR: &str = "tensorboard";
const FILE_VERSION: &str = "brain.Event:2";

/// Appends events to one event file.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// A new event file in `run_dir/tensorboard`.
    pub fn create(run_dir: &Path) -> Result<Self> {
        let dir = run_dir.join(TENSORBOARD_DIR);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{}.{}",
            now.as_secs(),
            host.trim(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut writer = Self {
            path,
            out: BufWriter::new(file),
        };
        let mut event = Vec::new();
        wall_time_and_step(&mut event, 0);
        field_bytes(&mut event, 3, FILE_VERSION.as_bytes());
        writer.record(&event)?;
        Ok(writer)
    }

    /// Writes a step's figures as scalars, flushed so a running TensorBoard sees them.
    pub fn append(&mut self, m: &StepMetrics) -> Result<()> {
        let mut summary = Vec::new();
        let mut scalar = |tag: &str, value: Option<f64>| {
            if let Some(value) = value.filter(|v| v.is_finite()) {
                let mut entry = Vec::new();
                field_bytes(&mut entry, 1, tag.as_bytes());
                // simple_value: field 2, fixed 32-bit.
                entry.push(2 << 3 | 5);
                entry.extend_from_slice(&(value as f32).to_le_bytes());
                field_bytes(&mut summary, 1, &entry);
            }
        };
        scalar("loss", Some(f64::from(m.loss)));
        scalar("loss_spread", m.loss_spread.map(f64::from));
        scalar("learning_rate", Some(m.lr));
        scalar("samples_per_sec", Some(m.samples_per_sec));
        scalar("step_time_s", Some(m.step_time_s));
        scalar("comm_time_ratio", Some(m.comm_time_ratio));
        scalar("exposed_comm_ratio", Some(m.exposed_comm_ratio));
        scalar("bubble_fraction", m.bubble_fraction);
        scalar("peak_rss_bytes", Some(m.peak_rss_bytes as f64));
        scalar("gpu_memory_bytes", m.gpu_memory_bytes.map(|b| b as f64));
        scalar("gpu_utilization_percent", m.gpu_utilization);
        if let Some(eval) = &m.eval {
            scalar("eval/loss", Some(eval.loss));
            scalar("eval/accuracy", eval.accuracy);
            scalar("eval/perplexity", eval.perplexity);
            scalar("eval/mse", eval.mse);
        }
        let mut event = Vec::new();
        wall_time_and_step(&mut event, m.step as u64);
        field_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// One TFRecord holding `data`.
    fn record(&mut self, data: &[u8]) -> Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&length);
        record.extend_from_slice(&masked_crc(&length).to_le_bytes());
        record.extend_from_slice(data);
        record.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out
            .write_all(&record)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// TFRecord's checksum: CRC-32C, rotated and offset so that a CRC of data holding CRCs is not
/// trivially zero.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// `Event.wall_time` (field 1, double: now) and `Event.step` (field 2, varint).
fn wall_time_and_step(event: &mut Vec<u8>, step: u64) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    event.push(1 << 3 | 1);
    event.extend_from_slice(&now.as_secs_f64().to_le_bytes());
    event.push(2 << 3);
    varint(event, step);
}

/// A length-delimited field (wire type 2).
fn field_bytes(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push(field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scalar of an event file: step, tag, value.
    type Scalar = (u64, String, f32);

    /// The file version and the scalars of an event file, read by the format's specification,
    /// every record's checksums verified.
    fn read_scalars(path: &Path) -> Result<(String, Vec<Scalar>)> {
        let bytes = std::fs::read(path)?;
        let mut at = 0;
        let (mut version, mut scalars) = (String::new(), Vec::new());
        while at < bytes.len() {
            let length = &bytes[at..at + 8];
            anyhow::ensure!(
                u32::from_le_bytes(bytes[at + 8..at + 12].try_into()?) == masked_crc(length),
                "length checksum"
            );
            let n = u64::from_le_bytes(length.try_into()?) as usize;
            let data = &bytes[at + 12..at + 12 + n];
            anyhow::ensure!(
                u32::from_le_bytes(bytes[at + 12 + n..at + 16 + n].try_into()?) == masked_crc(data),
                "data checksum"
            );
            at += 16 + n;
            let mut step = 0;
            for (field, value) in fields(data)? {
                match (field, value) {
                    (2, Field::Varint(s)) => step = s,
                    (3, Field::Bytes(v)) => version = String::from_utf8(v.to_vec())?,
                    (5, Field::Bytes(summary)) => {
                        for (_, entry) in fields(summary)? {
                            let Field::Bytes(entry) = entry else {
                                anyhow::bail!("a summary value")
                            };
                            let (mut tag, mut value) = (String::new(), f32::NAN);
                            for (field, part) in fields(entry)? {
                                match (field, part) {
                                    (1, Field::Bytes(t)) => tag = String::from_utf8(t.to_vec())?,
                                    (2, Field::Fixed32(v)) => value = f32::from_le_bytes(v),
                                    _ => anyhow::bail!("unexpected field {field} of a summary value"),
                                }
                            }
                            scalars.push((step, tag, value));
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok((version, scalars))
    }

    enum Field<'a> {
        Varint(u64),
        Fixed64,
        Fixed32([u8; 4]),
        Bytes(&'a [u8]),
    }

    fn fields(mut data: &[u8]) -> Result<Vec<(u64, Field<'_>)>> {
        fn varint(data: &mut &[u8]) -> Result<u64> {
            let (mut value, mut shift) = (0u64, 0);
            loop {
                let (&byte, rest) = data.split_first().context("a varint cut short")?;
                *data = rest;
                value |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return Ok(value);
                }
                shift += 7;
            }
        }
        let mut out = Vec::new();
        while !data.is_empty() {
            let key = varint(&mut data)?;
            let field = match key & 7 {
                0 => Field::Varint(varint(&mut data)?),
                1 => {
                    data = &data[8..];
                    Field::Fixed64
                }
                2 => {
                    let n = varint(&mut data)? as usize;
                    let (bytes, rest) = data.split_at(n);
                    data = rest;
                    Field::Bytes(bytes)
                }
                5 => {
                    let (bytes, rest) = data.split_at(4);
                    data = rest;
                    Field::Fixed32(bytes.try_into()?)
                }
                wire => anyhow::bail!("wire type {wire}"),
            };
            out.push((key >> 3, field));
        }
        Ok(out)
    }

    #[test]
    fn the_masked_crc_is_tensorflows() {
        // TFRecord's mask of CRC-32C("") = 0, and of a known value.
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn steps_become_scalar_events_that_read_back() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut writer = EventWriter::create(dir.path())?;
        for step in 1..=3 {
            writer.append(&StepMetrics {
                step,
                elapsed_s: 1.0,
                step_time_s: 0.5,
                samples_per_sec: 128.0,
                comm_time_ratio: 0.25,
                exposed_comm_ratio: 0.125,
                bubble_fraction: None,
                peak_rss_bytes: 1024,
                gpu_memory_bytes: None,
                gpu_utilization: None,
                lr: 0.05,
                loss: 2.0 / step as f32,
                loss_spread: Some(0.5),
                sparse_tables: None,
                eval: None,
            })?;
        }
        let file = std::fs::read_dir(dir.path().join(TENSORBOARD_DIR))?
            .next()
            .context("an event file")??
            .path();
        assert!(file
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("events.out.tfevents."));
        let (version, scalars) = read_scalars(&file)?;
        assert_eq!(version, FILE_VERSION);
        let losses: Vec<(u64, f32)> = scalars
            .iter()
            .filter(|(_, tag, _)| tag == "loss")
            .map(|(step, _, v)| (*step, *v))
            .collect();
        assert_eq!(losses, [(1, 2.0), (2, 1.0), (3, 2.0 / 3.0)]);
        assert!(
            scalars.iter().all(|(_, tag, _)| tag != "bubble_fraction"),
            "absent figures are left out"
        );
        assert!(scalars
            .iter()
            .any(|(s, tag, v)| *s == 2 && tag == "learning_rate" && *v == 0.05));
        Ok(())
    }
}
