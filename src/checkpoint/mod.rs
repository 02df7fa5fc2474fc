//! Coordinated checkpoints on disk. `DIR/step-00000120/` holds the files the roles wrote for
//! step 120 and a `manifest.json`, written last, once every role has acknowledged, that lists
//! each file with its size and CRC-32C (the checksum TensorFlow's checkpoints carry: computed
//! by the CPU's own instruction at many GB/s, so checksumming costs the disk nothing, and it
//! catches torn and flipped bytes, which is its job; it is not a defence against tampering). Every file is written to a temporary name, synced and
//! renamed, so a crash never leaves half a file under a real name; a checkpoint without a
//! manifest (a role died before the commit), whose manifest lists no file (every writer lists
//! the file it wrote, so none is no checkpoint), whose files do not match it (truncated, a
//! flipped byte), whose safetensors files are malformed or hold a value that is not finite (a
//! NaN trains on silently: a ReLU hides it from the loss), or whose manifest names anything
//! but a plain file of its own directory is skipped, with a warning naming the file, for the
//! one before it. A manifest is data like any other: a name in it is checked
//! ([`check_file_name`]) before it is joined to the directory, only regular files are opened,
//! and no more bytes are read than it records.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

pub mod inspect;

/// The file every committed checkpoint directory ends with.
pub const MANIFEST: &str = "manifest.json";
/// The manifest's `format` value.
const FORMAT: &str = "flotilla-checkpoint";
const STEP_PREFIX: &str = "step-";

/// The metadata key of a training state file naming the sharding stage whose optimizer shards
/// were gathered into it.
pub const SHARDING_STAGE: &str = "sharding_stage";

/// The metadata key of a training state file naming how many ranks split the layers (tensor
/// parallelism) whose parts were gathered into it.
pub const LAYER_PARTS: &str = "mp_degree";
/// Checkpoint files with this suffix are safetensors, whose header is checked on reading.
const SAFETENSORS: &str = ".safetensors";
/// The safetensors format's largest header.
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;
/// The piece a checkpoint file is read in.
const PIECE: usize = 8 << 20;

/// Refuses `name` unless it can name a checkpoint file: a plain name inside its step directory
/// (no separator, no `..`, not absolute, not hidden like the temporary files), of ASCII letters,
/// digits, `-`, `_` and `.`, and not the manifest's. Every name that comes from a manifest, a
/// coordinator's record or a peer passes here before it is joined to a directory.
pub fn check_file_name(name: &str) -> Result<()> {
    let plain = !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != MANIFEST;
    ensure!(
        plain,
        "{name:?} is not a plain checkpoint file name inside a step directory"
    );
    Ok(())
}

/// One file of a checkpoint as its writer saw it: what the manifest records and the reader
/// checks. Small enough to travel to the committing rank in a gather.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// The file's name inside the step directory.
    pub name: String,
    /// Its length.
    pub bytes: u64,
    /// CRC-32C of its contents.
    pub crc32c: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    step: usize,
    world_size: usize,
    files: Vec<FileRecord>,
}

/// The coordinator's record of the newest checkpoint it committed, in a job whose nodes each
/// keep their own copy of its files (no shared filesystem): which node holds which file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitRecord {
    /// The step it was taken after.
    pub step: usize,
    /// The job's processes.
    pub world_size: usize,
    /// Every file, with the nodes holding a copy.
    pub files: Vec<HeldFile>,
}

/// A checkpoint file and the nodes that hold a copy of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "HeldFileFields", into = "HeldFileFields")]
pub struct HeldFile {
    /// The file as its writers wrote it.
    pub record: FileRecord,
    /// The hosts holding it. In a role's acknowledgement: the other hosts it stored a copy on
    /// (its buddy node), its own being the coordinator's to know.
    pub nodes: Vec<String>,
}

/// A [`HeldFile`] as it is written: its record's fields and its nodes side by side (in JSON one
/// flat object), in a form every serde format takes — the coordinator's protocol (postcard)
/// cannot encode a flattened field.
#[derive(Serialize, Deserialize)]
struct HeldFileFields {
    name: String,
    bytes: u64,
    crc32c: u32,
    nodes: Vec<String>,
}

impl From<HeldFileFields> for HeldFile {
    fn from(
        HeldFileFields {
            name,
            bytes,
            crc32c,
            nodes,
        }: HeldFileFields,
    ) -> Self {
        Self {
            record: FileRecord { name, bytes, crc32c },
            nodes,
        }
    }
}

impl From<HeldFile> for HeldFileFields {
    fn from(HeldFile { record, nodes }: HeldFile) -> Self {
        let FileRecord { name, bytes, crc32c } = record;
        Self {
            name,
            bytes,
            crc32c,
            nodes,
        }
    }
}

impl HeldFile {
    /// `record`, held where it was written only.
    pub fn here(record: FileRecord) -> Self {
        Self {
            record,
            nodes: Vec::new(),
        }
    }
}

/// The coordinator's [`CommitRecord`] in the checkpoint directory.
const COMMIT_RECORD: &str = "committed.json";

/// The checkpoint directory of a job: where roles write their files and the coordinator's rank
/// commits them.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    root: PathBuf,
    keep: usize,
}

/// A committed checkpoint whose files all matched its manifest when it was found.
#[derive(Debug)]
pub struct Checkpoint {
    /// The step it was taken after: training resumes with this step's successor.
    pub step: usize,
    /// Its directory.
    pub dir: PathBuf,
    world_size: usize,
    files: Vec<FileRecord>,
}

impl CheckpointStore {
    /// A store at `root` that keeps the newest `keep` checkpoints.
    pub fn new(root: impl Into<PathBuf>, keep: usize) -> Self {
        Self {
            root: root.into(),
            keep: keep.max(1),
        }
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn step_dir(&self, step: usize) -> PathBuf {
        self.root.join(format!("{STEP_PREFIX}{step:08}"))
    }

    /// Writes `bytes` as file `name` of step `step`'s checkpoint, atomically, and returns its
    /// record for the manifest.
    pub fn write(&self, step: usize, name: &str, bytes: &[u8]) -> Result<FileRecord> {
        self.write_with(step, name, |out| Ok(out.write_all(bytes)?))
    }

    /// Writes what `contents` writes as file `name` of step `step`'s checkpoint, atomically,
    /// streaming it to disk and through the checksum; returns its record for the manifest.
    pub fn write_with(
        &self,
        step: usize,
        name: &str,
        contents: impl FnOnce(&mut dyn Write) -> Result<()>,
    ) -> Result<FileRecord> {
        check_file_name(name)?;
        let dir = self.step_dir(step);
        fs::create_dir_all(&dir).with_context(|| format!("creating checkpoint directory {}", dir.display()))?;
        let mut record = None;
        write_atomically(&dir, name, |file| {
            let mut out = ChecksummingWriter {
                inner: std::io::BufWriter::with_capacity(PIECE, file),
                crc: 0,
                bytes: 0,
            };
            contents(&mut out)?;
            out.inner.flush()?;
            record = Some(FileRecord {
                name: name.to_string(),
                bytes: out.bytes,
                crc32c: out.crc,
            });
            Ok(())
        })?;
        record.context("the file was written")
    }

    /// Commits step `step`'s checkpoint once every role has written its `files`: the manifest
    /// goes last, so the checkpoint exists only when all its files do. Then checkpoints older
    /// than the newest `keep` are deleted. No files is refused: such a manifest is no checkpoint
    /// ([`Self::verify`] skips it).
    pub fn commit(&self, step: usize, world_size: usize, files: Vec<FileRecord>) -> Result<()> {
        let dir = self.step_dir(step);
        ensure!(
            !files.is_empty(),
            "committing {}: it holds no checkpoint file, and a manifest listing none is no checkpoint",
            dir.display()
        );
        let mut names = HashSet::new();
        for file in &files {
            check_file_name(&file.name).with_context(|| format!("committing {}", dir.display()))?;
            ensure!(
                names.insert(&file.name),
                "checkpoint of step {step}: two roles wrote {}",
                file.name
            );
            let path = dir.join(&file.name);
            let on_disk = fs::metadata(&path).with_context(|| format!("committing {}", path.display()))?;
            ensure!(
                on_disk.len() == file.bytes,
                "committing {}: {} bytes on disk, its writer wrote {}",
                path.display(),
                on_disk.len(),
                file.bytes
            );
        }
        let manifest = Manifest {
            format: FORMAT.to_string(),
            step,
            world_size,
            files,
        };
        let text = serde_json::to_vec_pretty(&manifest)?;
        write_atomically(&dir, MANIFEST, |file| Ok(file.write_all(&text)?))?;
        tracing::info!(step, dir = %dir.display(), "checkpoint committed");
        self.prune(step)
    }

    /// Commits this node's copy of the checkpoint the coordinator recorded as `record`: the
    /// manifest lists the record's files this directory holds in full (a node's own copies, or
    /// every file on a shared filesystem). A node that holds none of them (its disk came back
    /// empty) commits nothing: it is refused, and the state comes from another node.
    pub fn commit_held(&self, record: &CommitRecord) -> Result<()> {
        let dir = self.step_dir(record.step);
        for held in &record.files {
            check_file_name(&held.record.name)
                .with_context(|| format!("the coordinator's record of {}", dir.display()))?;
        }
        let here = record
            .files
            .iter()
            .filter(|held| fs::metadata(dir.join(&held.record.name)).is_ok_and(|m| m.len() == held.record.bytes))
            .map(|held| held.record.clone())
            .collect();
        self.commit(record.step, record.world_size, here)
    }

    /// Records `record` as the newest checkpoint committed, for a coordinator started again
    /// to resume from: the files themselves are on the nodes it names.
    pub fn record(&self, record: &CommitRecord) -> Result<()> {
        fs::create_dir_all(&self.root).with_context(|| format!("creating {}", self.root.display()))?;
        let text = serde_json::to_vec_pretty(record)?;
        write_atomically(&self.root, COMMIT_RECORD, |file| Ok(file.write_all(&text)?))?;
        tracing::info!(step = record.step, dir = %self.root.display(), "checkpoint committed");
        Ok(())
    }

    /// The newest checkpoint [`Self::record`] recorded here, if any.
    pub fn recorded(&self) -> Result<Option<CommitRecord>> {
        let path = self.root.join(COMMIT_RECORD);
        match fs::read(&path) {
            Ok(text) => Ok(Some(
                serde_json::from_slice(&text).with_context(|| format!("{} is malformed", path.display()))?,
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// Deletes every step directory older than the newest `keep` committed ones up to `newest`,
    /// torn ones included. Ranks sharing the directory (one file system over several nodes)
    /// prune it at the same time, so a directory another rank deleted first is not an error.
    fn prune(&self, newest: usize) -> Result<()> {
        let steps = self.steps()?;
        let committed: Vec<usize> = steps
            .iter()
            .copied()
            .filter(|&s| s <= newest && self.step_dir(s).join(MANIFEST).exists())
            .collect();
        let Some(&oldest_kept) = committed.iter().rev().nth(self.keep - 1) else {
            return Ok(());
        };
        for step in steps.into_iter().filter(|&s| s < oldest_kept) {
            let dir = self.step_dir(step);
            match fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("deleting old checkpoint {}", dir.display()));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Steps that have a directory, oldest first.
    pub fn steps(&self) -> Result<Vec<usize>> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", self.root.display())),
        };
        let mut steps = Vec::new();
        for entry in entries {
            let name = entry?.file_name();
            if let Some(step) = name
                .to_str()
                .and_then(|n| n.strip_prefix(STEP_PREFIX))
                .and_then(|n| n.parse().ok())
            {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    /// The newest checkpoint whose manifest is present and lists files, every one of which
    /// matches it; the ones skipped on the way are logged with the reason. `None` when there is
    /// none.
    pub fn latest(&self) -> Result<Option<Checkpoint>> {
        for step in self.steps()?.into_iter().rev() {
            match self.verify(step) {
                Ok(checkpoint) => return Ok(Some(checkpoint)),
                Err(e) => tracing::warn!(step, "skipping checkpoint: {e:#}"),
            }
        }
        Ok(None)
    }

    /// Step `step`'s checkpoint, if its manifest is there, lists files, and every file matches it.
    pub fn verify(&self, step: usize) -> Result<Checkpoint> {
        let dir = self.step_dir(step);
        let manifest_path = dir.join(MANIFEST);
        let text = match fs::read(&manifest_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("{} has no manifest: it was never committed", dir.display())
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", manifest_path.display())),
        };
        let manifest: Manifest =
            serde_json::from_slice(&text).with_context(|| format!("{} is malformed", manifest_path.display()))?;
        ensure!(
            manifest.format == FORMAT && manifest.step == step,
            "{} is not the manifest of step {step}",
            manifest_path.display()
        );
        // Every commit lists the file its committer wrote: an empty list was not written by one.
        ensure!(
            !manifest.files.is_empty(),
            "{} lists no files: it is no checkpoint",
            manifest_path.display()
        );
        // Every name first: a manifest naming a path outside its directory opens nothing.
        for file in &manifest.files {
            check_file_name(&file.name).with_context(|| format!("{} is refused", manifest_path.display()))?;
        }
        for file in &manifest.files {
            check_file(&dir, step, file)?;
        }
        Ok(Checkpoint {
            step,
            dir,
            world_size: manifest.world_size,
            files: manifest.files,
        })
    }
}

impl Checkpoint {
    /// The processes of the job that took it.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Its files, as its manifest lists them (each checked against it when it was found).
    pub fn files(&self) -> &[FileRecord] {
        &self.files
    }

    /// The files named `name(0)`, `name(1)`, … it holds, up to the first missing: a pipeline's
    /// stage files, a parameter-server job's shard files.
    pub fn numbered_files(&self, name: impl Fn(usize) -> String) -> Vec<String> {
        (0..)
            .map(name)
            .take_while(|name| self.files.iter().any(|file| file.name == *name))
            .collect()
    }

    /// Refuses a checkpoint taken by a job of another size: its files are cut for that size.
    pub fn check_world_size(&self, world_size: usize) -> Result<()> {
        ensure!(
            self.world_size == world_size,
            "checkpoint {} was taken by a job of {} processes; this one has {world_size}",
            self.dir.display(),
            self.world_size
        );
        Ok(())
    }

    /// The contents of file `name`.
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        let record = self
            .files
            .iter()
            .find(|f| f.name == name)
            .with_context(|| format!("checkpoint {} has no file {name}", self.dir.display()))?;
        let path = self.dir.join(name);
        // Opened first: the length to allocate is then the file's, not just the manifest's word.
        let mut file = open_recorded(&self.dir, record)?;
        let mut bytes = Vec::with_capacity(usize::try_from(record.bytes)?);
        file.read_to_end(&mut bytes)
            .with_context(|| format!("reading {}", path.display()))?;
        ensure!(
            bytes.len() as u64 == record.bytes,
            "{} changed since it was checked",
            path.display()
        );
        Ok(bytes)
    }
}

/// Writes `dir/name` (its contents by `contents`) through a temporary file that is synced,
/// renamed over the name, and made durable by syncing the directory. A failed write (a full
/// disk) removes the temporary file, so it leaves nothing behind.
pub(crate) fn write_atomically(dir: &Path, name: &str, contents: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    // A name of its own: processes of two nodes that share the directory may write the same
    // file (each node's copy of one replicated state) at once, and may have the same pid
    // (containers number their processes from 1), so a random tag tells them apart.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static PROCESS_TAG: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        getrandom::u64().unwrap_or(clock)
    });
    let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let temporary = dir.join(format!(
        ".{name}.{}-{:016x}-{write}.tmp",
        std::process::id(),
        *PROCESS_TAG
    ));
    let path = dir.join(name);
    let mut file = File::create(&temporary).with_context(|| format!("creating {}", temporary.display()))?;
    // Named by the file being written: the temporary one is gone when the error is read.
    let written = contents(&mut file)
        .and_then(|()| Ok(file.sync_all()?))
        .with_context(|| format!("writing {}", path.display()));
    if let Err(e) = written {
        drop(file);
        // Best effort: the write's own error is the one to report.
        let _ = fs::remove_file(&temporary);
        return Err(e);
    }
    fs::rename(&temporary, &path).with_context(|| format!("renaming {} to {}", temporary.display(), path.display()))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

/// Opens file `record` of the step directory `dir` to read no more than the length recorded:
/// a plain name ([`check_file_name`]) of a regular file of that length. A device (`/dev/zero`
/// never ends), a FIFO (whose open would wait for a writer) or a symbolic link (which may lead
/// out of the directory) is refused.
fn open_recorded(dir: &Path, record: &FileRecord) -> Result<std::io::Take<File>> {
    check_file_name(&record.name)?;
    let path = dir.join(&record.name);
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
    {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            bail!("{} is a symbolic link, not a checkpoint file", path.display())
        }
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    let on_disk = file.metadata().with_context(|| format!("reading {}", path.display()))?;
    ensure!(on_disk.is_file(), "{} is not a regular file", path.display());
    ensure!(
        on_disk.len() == record.bytes,
        "{} has {} bytes, the manifest says {} (truncated?)",
        path.display(),
        on_disk.len(),
        record.bytes
    );
    Ok(file.take(record.bytes))
}

/// Checks file `record` of step `step`'s directory `dir` against the manifest in one read: its
/// length and CRC-32C and, for a safetensors file, that its header places its tensors exactly
/// in the rest of the file and that every f32 value is finite. A checksum only proves the file
/// is what its writer wrote: a faulty writer's file, or one whose parameters went NaN, would
/// otherwise fail only when a role restores it (or never), too late to fall back to an earlier
/// checkpoint.
fn check_file(dir: &Path, step: usize, record: &FileRecord) -> Result<()> {
    let path = dir.join(&record.name);
    let mut file = ChecksummingReader {
        inner: open_recorded(dir, record)?,
        crc: 0,
        bytes: 0,
    };
    let contents = match record.name.ends_with(SAFETENSORS) {
        true => check_tensors(&mut file, record.bytes, step, &path),
        false => Ok(()),
    };
    // The rest of the file, so that the checksum covers it whatever its contents turned out.
    std::io::copy(
        &mut std::io::BufReader::with_capacity(PIECE, &mut file),
        &mut std::io::sink(),
    )
    .with_context(|| format!("reading {}", path.display()))?;
    ensure!(
        file.bytes == record.bytes,
        "{} has {} bytes, the manifest says {} (truncated?)",
        path.display(),
        file.bytes,
        record.bytes
    );
    ensure!(
        file.crc == record.crc32c,
        "{} does not match its checksum (corrupted)",
        path.display()
    );
    contents
}

/// Reads the safetensors file `path` of step `step`, `len` bytes long, from its start through
/// its last tensor: its header must place the tensors exactly in the rest of the file, and every
/// value of an f32 tensor (parameters, optimizer state, a shard's rows: every float a
/// checkpoint holds) must be finite.
fn check_tensors(file: &mut impl Read, len: u64, step: usize, path: &Path) -> Result<()> {
    let metadata = read_safetensors_header(file, len).with_context(|| format!("{} is malformed", path.display()))?;
    let mut piece = vec![0u8; PIECE];
    for name in metadata.offset_keys() {
        let info = metadata.info(&name).context("a tensor the header lists")?;
        let (start, end) = info.data_offsets;
        let mut left = end - start;
        while left > 0 {
            // Whole values: a tensor's length is a multiple of its value's.
            let n = left.min(piece.len());
            file.read_exact(&mut piece[..n])
                .with_context(|| format!("reading {}", path.display()))?;
            if info.dtype == safetensors::Dtype::F32 {
                let values = piece[..n]
                    .chunks_exact(4)
                    .map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
                if let Some((at, value)) = values.enumerate().find(|(_, v)| !v.is_finite()) {
                    let element = (end - start - left) / 4 + at;
                    bail!(
                        "step {step}: tensor {name} of {} holds {value} (element {element}): a checkpoint whose \
                         values are not finite is refused",
                        path.display()
                    );
                }
            }
            left -= n;
        }
    }
    Ok(())
}

/// The header of a safetensors file `len` bytes long, read from its start; it must place its
/// tensors exactly in the rest of the file.
fn read_safetensors_header(file: &mut impl Read, len: u64) -> Result<safetensors::tensor::Metadata> {
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)
        .context("shorter than a safetensors header")?;
    let header_len = u64::from_le_bytes(prefix);
    ensure!(
        header_len <= MAX_SAFETENSORS_HEADER && header_len <= len - 8,
        "its safetensors header claims {header_len} bytes, the file has {len}"
    );
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)?;
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).context("its safetensors header does not parse")?;
    let data = len - 8 - header_len;
    ensure!(
        metadata.data_len() as u64 == data,
        "its safetensors header places {} bytes of tensors, the file holds {data}",
        metadata.data_len()
    );
    Ok(metadata)
}

/// A reader that checksums and counts what passes through it.
struct ChecksummingReader<R> {
    inner: R,
    crc: u32,
    bytes: u64,
}

impl<R: Read> Read for ChecksummingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let read = self.inner.read(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..read]);
        self.bytes += read as u64;
        Ok(read)
    }
}

/// A writer that checksums and counts what passes through it.
struct ChecksummingWriter<W> {
    inner: W,
    crc: u32,
    bytes: u64,
}

impl<W: Write> Write for ChecksummingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..written]);
        self.bytes += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `tensors` (f32) and `metadata` to `out` as a safetensors file, one tensor at a time,
/// so that a checkpoint never holds a second copy of the whole state in memory.
pub fn write_tensors(
    out: &mut dyn Write,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        ensure!(tensor.dtype() == DType::F32, "{name} is {:?}, not f32", tensor.dtype());
        entries.push((name.clone(), tensor.dims().to_vec()));
    }
    write_header(out, &entries, metadata)?;
    for (_, tensor) in tensors {
        let values = tensor.flatten_all()?.to_vec1::<f32>()?;
        out.write_all(bytemuck::cast_slice(&values))?;
    }
    Ok(())
}

/// Writes the header of a safetensors file of f32 tensors named and shaped as `entries` (in the
/// order their values follow) with `metadata`: the values are then written one tensor after
/// another, as they come.
pub fn write_header(
    out: &mut dyn Write,
    entries: &[(String, Vec<usize>)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    // In key order: replicas of one state write the same bytes, whatever each process's hash
    // order (their copies are compared by checksum).
    let metadata: std::collections::BTreeMap<String, String> = metadata.into_iter().collect();
    header.insert("__metadata__".to_string(), serde_json::to_value(metadata)?);
    let mut offset = 0usize;
    for (name, dims) in entries {
        let end = offset + dims.iter().product::<usize>() * 4;
        let entry = serde_json::json!({"dtype": "F32", "shape": dims, "data_offsets": [offset, end]});
        ensure!(
            header.insert(name.clone(), entry).is_none(),
            "two tensors are named {name}"
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header)?;
    // The format pads the header with spaces to a multiple of 8 bytes.
    header.resize(header.len().next_multiple_of(8), b' ');
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(&header)?;
    Ok(())
}

/// The tensors (on `device`) and metadata of a safetensors file's bytes.
pub fn decode_tensors(bytes: &[u8], device: &Device) -> Result<(HashMap<String, Tensor>, HashMap<String, String>)> {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    Ok((candle_core::safetensors::load_buffer(bytes, device)?, metadata))
}

#[cfg(test)]
mod tests;
