//! Choosing a run's directory. Two runs must never share one: they would interleave their
//! metrics and overwrite each other's outputs. A default directory is made new (`create_dir`
//! fails on one that exists, so two processes starting together cannot both get it); a named
//! one is refused when it already holds something, unless the user asks to overwrite it.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};

/// Names tried for a default run directory before giving up.
const ATTEMPTS: usize = 1000;

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
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating run directory {}", dir.display())),
        }
    }
    bail!(
        "{}: {ATTEMPTS} run directories named {stem}-N exist already",
        parent.display()
    )
}

/// Refuses `dir`, named by the user, when it exists and is not empty, unless `overwrite`.
pub fn check_named(dir: &Path, overwrite: bool) -> Result<()> {
    let mut entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading run directory {}", dir.display())),
    };
    if entries.next().is_some() && !overwrite {
        bail!(
            "run directory {} already exists and is not empty: another run's outputs are there. Choose \
             another --run-dir, continue that run with --resume {}, or pass --overwrite to write over it",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
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

    #[test]
    fn a_named_directory_holding_something_needs_overwrite() -> Result<()> {
        let parent = tempfile::tempdir()?;
        let dir = parent.path().join("run");
        check_named(&dir, false)?;
        std::fs::create_dir(&dir)?;
        check_named(&dir, false)?;
        std::fs::write(dir.join("summary.json"), "{}")?;
        let refused = check_named(&dir, false).unwrap_err().to_string();
        assert!(
            refused.contains(&dir.display().to_string()) && refused.contains("--overwrite"),
            "{refused}"
        );
        check_named(&dir, true)
    }
}
