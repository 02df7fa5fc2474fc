//! The files a job reads: a launch that fails on a missing file costs every node's start, so
//! each one `train.train_files` and `train.test_files` name must be there, and click logs must
//! have the columns their schema names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::report::Line;
use crate::config::JobConfig;
use crate::data::ctr::{ClickLogParser, CtrSource};

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
    if !missing.is_empty() {
        return Some(Line::fail(format!(
            "data: no such file or directory: {}",
            missing.join(", ")
        )));
    }
    if let Some(schema) = train.click_log_schema() {
        let parser = Arc::new(ClickLogParser::new(schema));
        for (_, files) in listed {
            let files: Vec<PathBuf> = files.iter().map(PathBuf::from).collect();
            let source = CtrSource::Files {
                files,
                parser: parser.clone(),
            };
            if let Err(e) = source.check_columns() {
                return Some(Line::fail(format!("data: {e:#}")));
            }
        }
    }
    Some(Line::ok(format!("data: the {count} file(s) the job reads are there")))
}
