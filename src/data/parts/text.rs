//! Text data files, read as their lines whether gzip-compressed or not.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use anyhow::{Context, Result};
use flate2::read::MultiGzDecoder;

/// Whether `path` names a gzip-compressed file.
pub(crate) fn is_gzip(path: &Path) -> bool {
    path.extension().is_some_and(|extension| extension == "gz")
}

/// `path`'s lines, decompressed when the name ends in `.gz`.
pub(crate) fn open_buffered(path: &Path) -> Result<BufReader<Box<dyn Read + Send>>> {
    let file = File::open(path).with_context(|| format!("cannot open data file {}", path.display()))?;
    Ok(buffered(path, file))
}

/// `file`'s lines, decompressed when `path` ends in `.gz`.
pub(crate) fn buffered(path: &Path, file: File) -> BufReader<Box<dyn Read + Send>> {
    let stream: Box<dyn Read + Send> = match is_gzip(path) {
        true => Box::new(MultiGzDecoder::new(file)),
        false => Box::new(file),
    };
    BufReader::with_capacity(1 << 16, stream)
}

/// Records in `path` (its non-empty lines), counted by scanning bytes
/// without parsing, so sizing an epoch costs one fast pass over the file.
pub(crate) fn count_records(path: &Path) -> Result<u64> {
    let mut file = open_buffered(path)?;
    let mut buffer = vec![0u8; 1 << 16];
    let (mut records, mut line_has_content) = (0u64, false);
    loop {
        let read = file
            .read(&mut buffer)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if read == 0 {
            return Ok(records + u64::from(line_has_content));
        }
        for &byte in &buffer[..read] {
            match byte {
                b'\n' => {
                    records += u64::from(line_has_content);
                    line_has_content = false;
                }
                b'\r' => {}
                _ => line_has_content = true,
            }
        }
    }
}
