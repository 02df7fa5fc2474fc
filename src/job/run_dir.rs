//! Choosing a run's directory and claiming it for one job. Two runs must never share one: they
//! would interleave their metrics and overwrite each other's outputs. A default directory is
//! made new (`create_dir` fails on one that exists, so two processes starting together cannot
//! both get it). Any directory, however it was chosen (`--run-dir`, `FLOTILLA_RUN_DIR`, a
//! default), is claimed for the job before anything is written there: a lock file decides the
//! claims one at a time and records the job's id (`cluster.job_id`); every process of the job
//! holds a second lock file shared while it runs. A process of the same job joins (a launcher's
//! ranks and its restarts of them, the nodes of one job); another job is refused while the job
//! runs, and afterwards while the directory holds its outputs, unless it means to write over them
//! (`--overwrite`, `--resume`). Processes without a job id (ranks an engine started) cannot be
//! told apart: they join a directory claimed without one.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::Refusal;

/// Names tried for a default run directory before giving up.
const ATTEMPTS: usize = 1000;

/// Records the job a run directory is claimed for; locked exclusively while a process claims.
pub const CLAIM_FILE: &str = ".flotilla-claim";

/// Locked shared by every process of the claiming job while it runs.
const RUNNING_FILE: &str = ".flotilla-running";

/// The default run directory this process made, which [`discard_unused`] removes again when the
/// process ends without writing anything there.
static MADE_HERE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Removes the run directory this process made ([`create_unique`]) when it holds nothing but its
/// claim (the run was refused, or failed, before its first output): a failed start leaves no
/// empty run behind. Call it as the process ends.
pub fn discard_unused() {
    let Some(dir) = MADE_HERE.get() else {
        return;
    };
    if matches!(holds_outputs(dir), Ok(false)) {
        for name in [CLAIM_FILE, RUNNING_FILE] {
            let _ = std::fs::remove_file(dir.join(name));
        }
        if let Err(e) = std::fs::remove_dir(dir) {
            tracing::debug!("{}: not removed: {e}", dir.display());
        }
    }
}

/// Creates and returns a new directory `parent/<UTC date>-<time>-<pid>` (with `-N` appended
/// when that one is taken).
pub fn create_unique(parent: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let stem = format!("{}-{}", utc_stamp(SystemTime::now()), std::process::id());
    for attempt in 0..ATTEMPTS {
        let dir = match attempt {
            0 => parent.join(&stem),
            n => parent.join(format!("{stem}-{n}")),
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                let _ = MADE_HERE.set(dir.clone());
                return Ok(dir);
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating run directory {}", dir.display())),
        }
    }
    bail!(
        "{}: {ATTEMPTS} run directories named {stem}-N exist already",
        parent.display()
    )
}

/// What a new job does with a run directory that holds the outputs of another job, which no
/// longer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOutputs {
    /// Refuses the directory.
    Refuse,
    /// Writes over them or on from them (`--overwrite`, `--resume`).
    WriteOver,
}

/// A process's hold on a run directory for its job: while a process of the job holds one, no
/// other job can claim the directory. Dropped, or at the process's end, it lets go.
#[derive(Debug)]
pub struct Claim {
    _running: File,
}

impl Claim {
    /// Keeps the claim until this process ends: the lock lives as long as its open file, which
    /// the process's end closes.
    pub fn hold_until_exit(self) {
        std::mem::forget(self);
    }
}

/// The job a run directory is claimed for, as [`CLAIM_FILE`] records it.
#[derive(Debug, Serialize, Deserialize)]
struct Holder {
    /// Its `cluster.job_id`; none for a launched job without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    job_id: Option<String>,
    /// The process that claimed the directory for it.
    pid: u32,
}

impl Holder {
    /// Whether a process of the job `job` belongs to the job holding the directory: the same
    /// id, or neither has one. Processes without an id cannot be told apart: the ranks an engine
    /// started for a job without one join the first of them, and so do the ones it starts again
    /// after all of them ended (torchrun's `--max-restarts`, Slurm's requeue). `train` and
    /// flotilla's launchers always give their jobs an id.
    fn admits(&self, job: Option<&str>) -> bool {
        match (self.job_id.as_deref(), job) {
            (Some(held), Some(job)) => held == job,
            (None, None) => true,
            _ => false,
        }
    }

    /// `job X (pid P)`, as refusals name the holder.
    fn describe(&self) -> String {
        match &self.job_id {
            Some(id) => format!("job {id} (pid {})", self.pid),
            None => format!("a job without an id (pid {})", self.pid),
        }
    }
}

/// Claims `dir` (made if missing) for the job `job` — its `cluster.job_id`; none for a launched
/// process of a job without one. Refused (a [`Refusal`]) when another job runs there, or when
/// another job's outputs are there and `left` says to refuse them.
pub fn claim(dir: &Path, job: Option<&str>, left: LeftOutputs) -> Result<Claim> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating run directory {}", dir.display()))?;
    let mut record = open_lock_file(&dir.join(CLAIM_FILE))?;
    // Claims are decided one at a time, so two jobs starting together cannot both find the
    // directory free; the lock goes when `record` is closed, once this claim is decided.
    record
        .lock()
        .with_context(|| format!("locking {}", dir.join(CLAIM_FILE).display()))?;
    let running = open_lock_file(&dir.join(RUNNING_FILE))?;
    // Only a claimant, holding the claim lock, ever locks this file exclusively: it is free
    // exactly when no process of the holding job runs.
    let runs = match running.try_lock() {
        Ok(()) => false,
        Err(TryLockError::WouldBlock) => true,
        Err(TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", dir.join(RUNNING_FILE).display()));
        }
    };
    let holder = read_holder(&mut record, dir)?;
    let joins = holder.as_ref().is_some_and(|h| h.admits(job));
    if runs {
        if !joins {
            let holder = holder.map_or_else(|| "another job".to_string(), |h| h.describe());
            return Err(Refusal::wrap(anyhow!(
                "run directory {} is in use: {holder} is running there, and another run would mix its outputs \
                 with that one's. Choose another --run-dir, or wait for that run to end",
                dir.display()
            )));
        }
    } else {
        if !joins && left == LeftOutputs::Refuse && holds_outputs(dir)? {
            let of = holder.map_or_else(|| "another run".to_string(), |h| h.describe());
            return Err(Refusal::wrap(anyhow!(
                "run directory {} already exists and is not empty: the outputs of {of} are there. Choose \
                 another --run-dir, continue that run with --resume {}, or pass --overwrite to write over it",
                dir.display(),
                dir.display()
            )));
        }
        let holder = Holder {
            job_id: job.map(str::to_string),
            pid: std::process::id(),
        };
        write_holder(&mut record, &holder, dir)?;
        // The job's other processes must join: its exclusive lock becomes a shared one. No
        // claimant comes between the two, as each holds the claim lock first.
        running
            .unlock()
            .with_context(|| format!("unlocking {}", dir.join(RUNNING_FILE).display()))?;
    }
    // Never waits: the file is locked exclusively only by a claimant, and this one holds the
    // claim lock.
    running.try_lock_shared().map_err(|e| {
        anyhow!(
            "{}: cannot share the lock of the running job: {e}",
            dir.join(RUNNING_FILE).display()
        )
    })?;
    Ok(Claim { _running: running })
}

/// `path`, opened for reading and writing (a lock needs both on network file systems) and made
/// if missing.
fn open_lock_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

/// The holder `record` (the claim file of `dir`) names; none in a new directory, or where the
/// record cannot be read (a claimant stopped while writing it): the directory's outputs then
/// decide.
fn read_holder(record: &mut File, dir: &Path) -> Result<Option<Holder>> {
    let mut text = String::new();
    record
        .read_to_string(&mut text)
        .with_context(|| format!("reading {}", dir.join(CLAIM_FILE).display()))?;
    if text.trim().is_empty() {
        return Ok(None);
    }
    match toml::from_str(&text) {
        Ok(holder) => Ok(Some(holder)),
        Err(e) => {
            tracing::warn!("{}: not a claim record, ignored: {e}", dir.join(CLAIM_FILE).display());
            Ok(None)
        }
    }
}

/// Replaces what `record` (the claim file of `dir`) says with `holder`.
fn write_holder(record: &mut File, holder: &Holder, dir: &Path) -> Result<()> {
    let text = toml::to_string(holder).context("a claim record as TOML")?;
    record
        .set_len(0)
        .and_then(|()| record.rewind())
        .and_then(|()| record.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", dir.join(CLAIM_FILE).display()))
}

/// Whether `dir` holds anything besides its claim's own files.
fn holds_outputs(dir: &Path) -> Result<bool> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading run directory {}", dir.display()))?;
    for entry in entries {
        let name = entry
            .with_context(|| format!("reading run directory {}", dir.display()))?
            .file_name();
        if name != CLAIM_FILE && name != RUNNING_FILE {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `YYYYMMDD-HHMMSS` of `time` in UTC.
fn utc_stamp(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (year, month, day) = civil_from_days(secs / 86_400);
    let seconds = secs % 86_400;
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        seconds / 3600,
        seconds % 3600 / 60,
        seconds % 60
    )
}

/// The (year, month, day) of the day `days` after 1970-01-01, in the proleptic Gregorian
/// calendar (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Counted from 0000-03-01, so that the leap day ends each 400-year era's year.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn stamps_are_utc_calendar_dates() {
        let at = |secs| utc_stamp(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "19700101-000000");
        assert_eq!(at(951_782_400), "20000229-000000");
        assert_eq!(at(1_700_000_000), "20231114-221320");
        assert_eq!(at(4_107_542_399), "21000228-235959");
    }

    #[test]
    fn default_directories_are_never_shared() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let dirs: Vec<PathBuf> = (0..3).map(|_| create_unique(parent.path())).collect::<Result<_>>()?;
        assert!(
            dirs[0] != dirs[1] && dirs[1] != dirs[2] && dirs[0] != dirs[2],
            "{dirs:?}"
        );
        assert!(dirs.iter().all(|d| d.is_dir()));
        Ok(())
    }

    /// A claim of `dir` for `job`, or the refusal's text.
    fn try_claim(dir: &Path, job: Option<&str>, left: LeftOutputs) -> std::result::Result<Claim, String> {
        claim(dir, job, left).map_err(|e| {
            assert!(e.is::<Refusal>(), "not a refusal: {e:#}");
            e.to_string()
        })
    }

    #[test]
    fn a_running_job_shares_its_directory_with_its_own_processes_only() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let dir = parent.path().join("run");
        let launcher = try_claim(&dir, Some("a"), LeftOutputs::Refuse).map_err(|e| anyhow!(e))?;
        let rank = try_claim(&dir, Some("a"), LeftOutputs::Refuse).map_err(|e| anyhow!(e))?;
        for left in [LeftOutputs::Refuse, LeftOutputs::WriteOver] {
            let refused = try_claim(&dir, Some("b"), left).unwrap_err();
            assert!(
                refused.contains(&dir.display().to_string())
                    && refused.contains(&format!("job a (pid {})", std::process::id())),
                "{refused}"
            );
        }
        drop(launcher);
        // Still running while one of its processes is.
        try_claim(&dir, Some("b"), LeftOutputs::WriteOver).unwrap_err();
        drop(rank);
        try_claim(&dir, Some("b"), LeftOutputs::WriteOver).map_err(|e| anyhow!(e))?;
        Ok(())
    }

    #[test]
    fn another_job_meets_a_finished_runs_outputs_only_to_write_over_them() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let dir = parent.path().join("run");
        drop(try_claim(&dir, Some("a"), LeftOutputs::Refuse).map_err(|e| anyhow!(e))?);
        // Claimed, nothing written yet: nothing to lose.
        drop(try_claim(&dir, Some("b"), LeftOutputs::Refuse).map_err(|e| anyhow!(e))?);
        std::fs::write(dir.join("summary.json"), "{}")?;
        let refused = try_claim(&dir, Some("c"), LeftOutputs::Refuse).unwrap_err();
        assert!(
            refused.contains("the outputs of job b") && refused.contains("--overwrite") && refused.contains("--resume"),
            "{refused}"
        );
        // The same job again: its launcher restarted.
        drop(try_claim(&dir, Some("b"), LeftOutputs::Refuse).map_err(|e| anyhow!(e))?);
        drop(try_claim(&dir, Some("c"), LeftOutputs::WriteOver).map_err(|e| anyhow!(e))?);
        try_claim(&dir, Some("b"), LeftOutputs::Refuse).unwrap_err();
        Ok(())
    }

    #[test]
    fn processes_without_a_job_id_join_a_job_without_one_running_or_started_again() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let dir = parent.path().join("run");
        let first = try_claim(&dir, None, LeftOutputs::Refuse).map_err(|e| anyhow!(e))?;
        std::fs::write(dir.join("metrics.jsonl"), "")?;
        let second = try_claim(&dir, None, LeftOutputs::Refuse).map_err(|e| anyhow!(e))?;
        try_claim(&dir, Some("a"), LeftOutputs::WriteOver).unwrap_err();
        drop((first, second));
        // Every rank ended; the engine starts them again.
        drop(try_claim(&dir, None, LeftOutputs::Refuse).map_err(|e| anyhow!(e))?);
        let refused = try_claim(&dir, Some("a"), LeftOutputs::Refuse).unwrap_err();
        assert!(refused.contains("a job without an id"), "{refused}");
        Ok(())
    }

    #[test]
    fn a_directory_holding_files_of_no_claim_needs_overwrite() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let dir = parent.path().join("run");
        std::fs::create_dir(&dir)?;
        std::fs::write(dir.join("notes.txt"), "mine")?;
        let refused = try_claim(&dir, Some("a"), LeftOutputs::Refuse).unwrap_err();
        assert!(refused.contains("the outputs of another run"), "{refused}");
        try_claim(&dir, Some("a"), LeftOutputs::WriteOver).map_err(|e| anyhow!(e))?;
        Ok(())
    }
}
