//! The files a job reads: a launch that fails on a missing file costs every node's start, so
//! each one `train.train_files` and `train.test_files` name must be there.

use std::path::Path;

use super::report::Line;
use crate::config::JobConfig;

/// One line for the job's data files: all there, or the ones missing by key; none for a job that
/// reads no files (built-in or generated data).
pub(super) fn check_data_files(config: &JobConfig) -> Option<Line> {
    let train = &config.train;
    let listed = [
        ("train.train_files", &train.train_files),
        ("train.test_files", &train.test_files),
    ];
    let count: usize = listed.iter().map(|(_, files)| files.len()).sum();
    if count == 0 {
        return None;
    }
    let missing: Vec<String> = listed
        .iter()
        .flat_map(|(key, files)| {
            files
                .iter()
                .filter(|file| !Path::new(file).exists())
                .map(move |file| format!("{key}: {file}"))
        })
        .collect();
    Some(match missing.is_empty() {
        true => Line::ok(format!("data: the {count} file(s) the job reads are there")),
        false => Line::fail(format!("data: no such file or directory: {}", missing.join(", "))),
    })
}
