//! A trained CTR model out of a parameter-server run and back: `flotilla ps export` (a base, and
//! a delta of the rows changed since it) and `flotilla predict`, run as the command a user runs,
//! against the runs' own files and evaluations.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{ctr_config, run, saved_shard};
use flotilla::config::JobConfig;
use flotilla::data::ctr::{write_synthetic, CriteoSynth, Split};
use flotilla::job::ps::serving as ps_serving;
use flotilla::job::ps::ParameterServerJob;
use flotilla::job::RunOptions;

/// Runs `flotilla args…`: its JSON answer on success, its stderr on failure.
fn flotilla(args: &[&str]) -> Result<serde_json::Value, String> {
    let output = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(args)
        .output()
        .expect("flotilla runs");
    match output.status.success() {
        true => Ok(serde_json::from_slice(&output.stdout).expect("a JSON answer")),
        false => Err(String::from_utf8_lossy(&output.stderr).into_owned()),
    }
}

/// Every row of table `table` that the run in `dir` saved, by id.
fn table_rows(config: &JobConfig, dir: &Path, table: usize) -> BTreeMap<u64, Vec<f32>> {
    (0..config.cluster.server_num)
        .flat_map(|index| saved_shard(config, dir, index).2.swap_remove(table))
        .map(|(id, value, _)| (id, value))
        .collect()
}

#[test]
fn an_export_scores_the_jobs_auc_and_a_delta_holds_exactly_the_rows_changed_since_its_base() {
    let files = tempfile::tempdir().unwrap();
    let path = |name: &str| files.path().join(name).display().to_string();
    let synth = CriteoSynth::new(42, 300);
    write_synthetic(Path::new(&path("train.tsv")), &synth, Split::Train, 0..20_000).unwrap();
    write_synthetic(Path::new(&path("test.tsv.gz")), &synth, Split::Test, 0..1_000).unwrap();
    let job = |steps: &str| {
        ctr_config(&[
            "train.dataset=criteo",
            &format!("train.train_files=[{:?}]", path("train.tsv")),
            &format!("train.test_files=[{:?}]", path("test.tsv.gz")),
            steps,
        ])
    };
    // The same job stopped after 10 steps and after 20: the first 10 steps agree.
    let (early, late) = (job("train.steps=10"), job("train.steps=20"));
    let (early_dir, late_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let early_summary = run(early.clone(), early_dir.path());
    let late_summary = run(late.clone(), late_dir.path());

    let predict = |model: &str, out: &str| {
        flotilla(&[
            "predict",
            "--model",
            model,
            "--data",
            &path("test.tsv.gz"),
            "--out",
            out,
        ])
    };
    let base = path("base");
    let tables = flotilla(&["ps", "export", &early_dir.path().display().to_string(), "--out", &base]).unwrap();
    assert_eq!(tables[0]["rows"], table_rows(&early, early_dir.path(), 0).len());
    let scored = predict(&base, &path("a.tsv")).unwrap();
    assert_eq!(scored["samples"], 1_000);
    assert_eq!(
        scored["auc"].as_f64(),
        Some(early_summary.auc),
        "the job's own evaluation"
    );
    let lines = std::fs::read_to_string(path("a.tsv")).unwrap();
    assert_eq!(lines.lines().count(), 1_000);

    let delta = path("delta");
    let late_run = late_dir.path().display().to_string();
    let tables = flotilla(&["ps", "export", &late_run, "--out", &delta, "--since", &base]).unwrap();
    for table in 0..2 {
        let (before, after) = (
            table_rows(&early, early_dir.path(), table),
            table_rows(&late, late_dir.path(), table),
        );
        let changed = after.iter().filter(|(id, row)| before.get(id) != Some(row)).count();
        let gone = before.keys().filter(|id| !after.contains_key(id)).count();
        assert!(
            changed > 0 && changed < after.len(),
            "table {table}: the test needs rows on both sides"
        );
        assert_eq!(
            (tables[table]["rows"].as_u64(), tables[table]["deleted"].as_u64()),
            (Some(changed as u64), Some(gone as u64))
        );
    }
    let scored = predict(&delta, &path("b.tsv")).unwrap();
    assert_eq!(
        scored["auc"].as_f64(),
        Some(late_summary.auc),
        "base then delta is the late model"
    );

    // Damage is named: a changed byte, an export that is not one, a second export into one.
    let rows = files.path().join("base/sparse/embedding.rows");
    let mut bytes = std::fs::read(&rows).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&rows, bytes).unwrap();
    let error = predict(&base, &path("c.tsv")).unwrap_err();
    assert!(error.contains(&format!("{} is corrupt", rows.display())), "{error}");
    let error = predict(&path("nowhere"), &path("c.tsv")).unwrap_err();
    assert!(error.contains("nowhere: no such file or directory"), "{error}");
    let error = flotilla(&["ps", "export", &late_run, "--out", &base]).unwrap_err();
    assert!(error.contains("already holds an export"), "{error}");
}

/// DeepFM exported by the binary, and a program's own model exported and scored through the
/// library with its `SparseModelDef`, both reproduce their job's AUC; the binary, which does not
/// know a program's model, says so.
#[test]
fn deepfm_and_a_programs_own_model_export_and_score_as_their_jobs_evaluated() {
    let files = tempfile::tempdir().unwrap();
    let path = |name: &str| files.path().join(name).display().to_string();
    let synth = CriteoSynth::new(42, 300);
    write_synthetic(Path::new(&path("train.tsv")), &synth, Split::Train, 0..20_000).unwrap();
    write_synthetic(Path::new(&path("test.tsv")), &synth, Split::Test, 0..1_000).unwrap();
    let job = |model: &str| {
        ctr_config(&[
            model,
            "train.dataset=criteo",
            &format!("train.train_files=[{:?}]", path("train.tsv")),
            &format!("train.test_files=[{:?}]", path("test.tsv")),
        ])
    };
    let predict =
        |model: &str, out: &str| flotilla(&["predict", "--model", model, "--data", &path("test.tsv"), "--out", out]);

    let deepfm_dir = tempfile::tempdir().unwrap();
    let deepfm = run(job("train.model=deepfm"), deepfm_dir.path());
    let run_dir = deepfm_dir.path().display().to_string();
    let tables = flotilla(&["ps", "export", &run_dir, "--out", &path("deepfm")]).unwrap();
    assert_eq!(
        (tables[0]["name"].as_str(), tables[1]["name"].as_str()),
        (Some("embedding"), Some("first_order"))
    );
    let scored = predict(&path("deepfm"), &path("deepfm.tsv")).unwrap();
    assert_eq!(scored["auc"].as_f64(), Some(deepfm.auc));

    let model = common::three_table_model();
    let own_dir = tempfile::tempdir().unwrap();
    let own = ParameterServerJob::new(job("train.model=custom"), model.clone())
        .unwrap()
        .run_simulated(&RunOptions::new(own_dir.path()))
        .unwrap();
    let export = files.path().join("own");
    let manifest = ps_serving::export(own_dir.path(), &export, None, Some(&model)).unwrap();
    let names: Vec<&str> = manifest.tables.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["user", "item", "context"]);
    let test = [files.path().join("test.tsv")];
    let scored = ps_serving::predict(&export, &test, &files.path().join("own.tsv"), Some(&model)).unwrap();
    assert_eq!(scored.auc, Some(own.auc));
    let run_dir = own_dir.path().display().to_string();
    let refused = flotilla(&["ps", "export", &run_dir, "--out", &path("again")]).unwrap_err();
    assert!(
        refused.contains("train.model = \"custom\" is the model of the program"),
        "{refused}"
    );
}
