//! Click logs of the user's own: `[train.click_log]` names the label, the dense columns and the
//! sparse slots of TSV, CSV or Parquet files, and a parameter-server job trains on them as they
//! are. Ground truth: Criteo's records written in other columns and formats train bit for bit as
//! the Criteo files do; `flotilla data click-log` writes a schema's files and `flotilla predict`
//! scores them as the job evaluated them.

mod common;

use std::path::Path;
use std::process::Command;

use common::{ctr_config, ctr_config_with, run};
use flotilla::config::{ClickLogSchema, JobConfig};
use flotilla::data::ctr::{write_click_log, write_synthetic, CriteoSynth, Split};
use flotilla::job::ps::ParameterServerJob;
use flotilla::job::RunOptions;

/// Criteo's columns, named (`click`, `i1`…`i13`, `c1`…`c26`), in `format`, with a header.
fn named_criteo(format: &str) -> String {
    let dense: Vec<String> = (1..=13).map(|i| format!("\"i{i}\"")).collect();
    let mut text = format!(
        "[train.click_log]\nformat = \"{format}\"\nheader = true\nlabel = \"click\"\ndense = [{}]\n",
        dense.join(", ")
    );
    for c in 1..=26 {
        text.push_str(&format!(
            "[[train.click_log.slots]]\ncolumn = \"c{c}\"\nids = \"hex\"\n"
        ));
    }
    text
}

/// The job's records written to `dir` in `schema`'s columns (Criteo TSV when `None`): the
/// training split as one file per trainer (so every format is cut into the same parts), the
/// held-out split as one; and the overrides that read them.
fn write_logs(config: &JobConfig, schema: Option<&ClickLogSchema>, dir: &Path, ext: &str) -> Vec<String> {
    let train = &config.train;
    let test_samples = (train.synthetic_samples as f64 * train.test_fraction).round() as u64;
    let train_samples = train.synthetic_samples as u64 - test_samples;
    let parts = train.data_parts(config.world_size()) as u64;
    let synth = CriteoSynth::new(train.seed, train.synthetic_vocab);
    let write = |name: String, split: Split, records: std::ops::Range<u64>| -> String {
        let path = dir.join(name);
        match schema {
            Some(schema) => write_click_log(&path, schema, &synth, split, records).expect("a log written"),
            None => write_synthetic(&path, &synth, split, records).expect("a Criteo file written"),
        }
        format!("{:?}", path.display().to_string())
    };
    let bound = |part: u64| train_samples * part / parts;
    let train_files: Vec<String> = (0..parts)
        .map(|part| {
            write(
                format!("train-{part}.{ext}"),
                Split::Train,
                bound(part)..bound(part + 1),
            )
        })
        .collect();
    vec![
        format!("train.train_files=[{}]", train_files.join(", ")),
        format!(
            "train.test_files=[{}]",
            write(format!("test.{ext}"), Split::Test, 0..test_samples)
        ),
    ]
}

/// Shard 0's dense parameters at the end of the run in `dir`.
fn dense_values(dir: &Path) -> Vec<u8> {
    let bytes = std::fs::read(dir.join("ps-shard-0.safetensors")).expect("shard 0's tables");
    let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    tensors.tensor("dense.values").expect("dense values").data().to_vec()
}

/// Criteo's records as Criteo TSV, as a CSV with a header naming the columns, and as Parquet:
/// the same records train to the same bits (2 shards × 3 trainers, sync, shuffled parts).
#[test]
fn criteo_records_in_named_csv_or_parquet_columns_train_exactly_as_the_criteo_files() {
    let files = tempfile::tempdir().unwrap();
    let shuffled = "train.shuffle_buffer=40".to_string();
    let base = ctr_config(&[&shuffled]);
    let mut criteo = write_logs(&base, None, files.path(), "tsv");
    criteo.extend([shuffled.clone(), "train.dataset=criteo".to_string()]);
    let criteo_dir = tempfile::tempdir().unwrap();
    let expected = run(ctr_config(&as_refs(&criteo)), criteo_dir.path());
    assert!(expected.auc > 0.5, "the job learns: AUC {}", expected.auc);

    for format in ["csv", "parquet"] {
        let tables = named_criteo(format);
        let probe = ctr_config_with(
            &tables,
            &[
                "train.dataset=click_log",
                "train.train_files=[\"-\"]",
                "train.test_files=[\"-\"]",
            ],
        );
        let schema = probe.train.click_log.clone().expect("the schema");
        let sub = files.path().join(format);
        std::fs::create_dir(&sub).unwrap();
        let mut logs = write_logs(&base, Some(&schema), &sub, format);
        logs.extend([shuffled.clone(), "train.dataset=click_log".to_string()]);
        let dir = tempfile::tempdir().unwrap();
        let read = run(ctr_config_with(&tables, &as_refs(&logs)), dir.path());
        assert_eq!(
            (read.test_samples, read.auc, read.final_loss),
            (expected.test_samples, expected.auc, expected.final_loss),
            "{format}"
        );
        assert!(
            dense_values(dir.path()) == dense_values(criteo_dir.path()),
            "{format}: the same parameters"
        );
    }
}

fn as_refs(strings: &[String]) -> Vec<&str> {
    strings.iter().map(String::as_str).collect()
}

/// A log of the user's own layout: a CSV whose columns are named, a hashed user id in 1000
/// buckets, a multi-valued tag slot, an integer country id, a log-scaled price; written by
/// `flotilla data click-log`, trained by DeepFM, exported, and scored by `flotilla predict`
/// exactly as the job evaluated it.
#[test]
fn a_users_own_log_with_a_multi_valued_slot_trains_and_predict_scores_it_as_the_job_did() {
    let files = tempfile::tempdir().unwrap();
    let path = |name: &str| files.path().join(name).display().to_string();
    let job = format!(
        r#"
        [cluster]
        server_num = 2
        nproc_per_node = 2
        [train]
        model = "deepfm"
        embedding_dim = 4
        hidden_sizes = [8]
        dataset = "click_log"
        train_files = [{train:?}]
        test_files = [{test:?}]
        synthetic_vocab = 300
        batch_size = 128
        steps = 300
        optimizer = "adagrad"
        lr = 0.1
        [train.click_log]
        format = "csv"
        header = true
        label = "clicked"
        dense = ["price", "age", "d3", "d4", "d5", "d6", "d7", "d8", "d9", "d10", "d11", "d12", "d13"]
        [[train.click_log.slots]]
        column = "user"
        hash_buckets = 1000
        [[train.click_log.slots]]
        column = "tags"
        separator = "|"
        [[train.click_log.slots]]
        column = "country"
        ids = "integer"
        id_range = 50
        [[train.click_log.slots]]
        column = "ad"
        {more_slots}
        [fault_tolerance]
        timeout_s = 30
        "#,
        train = path("train.csv"),
        test = path("test.csv"),
        more_slots = (5..=26)
            .map(|s| format!("[[train.click_log.slots]]\ncolumn = \"s{s}\"\n"))
            .collect::<String>(),
    );
    let config_file = files.path().join("job.toml");
    std::fs::write(&config_file, &job).unwrap();
    for (out, samples, split) in [("train.csv", "40000", &[][..]), ("test.csv", "1000", &["--test"][..])] {
        let (config, out) = (config_file.display().to_string(), path(out));
        let args = [
            &[
                "data",
                "click-log",
                "--config",
                &config,
                "--samples",
                samples,
                "--out",
                &out,
            ][..],
            split,
        ]
        .concat();
        let output = Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(&args)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    }
    let text = std::fs::read_to_string(path("train.csv")).unwrap();
    let header = text.lines().next().unwrap();
    assert!(header.starts_with("clicked,price,age,d3,"), "{header}");
    assert!(header.ends_with(",d13,user,tags,country,ad,s5,s6,s7,s8,s9,s10,s11,s12,s13,s14,s15,s16,s17,s18,s19,s20,s21,s22,s23,s24,s25,s26"), "{header}");
    assert!(
        text.lines().skip(1).any(|line| line.contains('|')),
        "some records hold several tags"
    );

    let config = JobConfig::from_file(&config_file, &|_| None, &[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let summary = run(config, dir.path());
    assert_eq!(summary.test_samples, 1000);
    assert!(
        summary.auc > 0.6,
        "the job learns from the log's slots: AUC {}",
        summary.auc
    );

    let export = path("export");
    let cli = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&output.stdout).expect("a JSON answer")
    };
    cli(&["ps", "export", &dir.path().display().to_string(), "--out", &export]);
    let scored = cli(&[
        "predict",
        "--model",
        &export,
        "--data",
        &path("test.csv"),
        "--out",
        &path("scores.tsv"),
    ]);
    assert_eq!(scored["samples"], 1000);
    assert_eq!(scored["auc"].as_f64(), Some(summary.auc), "the job's own evaluation");
}

/// A bad cell stops the job naming the file, its line and the column; a header without a named
/// column is refused before training starts; a log whose schema is missing is a config error.
#[test]
fn bad_logs_and_schemas_are_named() {
    let files = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = files.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let mut rows = String::from("click,price,user\n");
    for i in 0..200 {
        let click = if i == 57 { "yes" } else { ["0", "1"][i % 2] };
        rows.push_str(&format!("{click},{i},u{}\n", i % 7));
    }
    let train = write("train.csv", &rows);
    let test = write("test.csv", "click,price,user\n1,2,u1\n");
    let schema = "[train.click_log]\nheader = true\nlabel = \"click\"\ndense = [\"price\"]\n\
                  [[train.click_log.slots]]\ncolumn = \"user\"\n";
    let job = |train: &str| {
        ctr_config_with(
            schema,
            &[
                "train.dataset=click_log",
                &format!("train.train_files=[{train:?}]"),
                &format!("train.test_files=[{test:?}]"),
                "train.batch_size=60",
                "train.steps=5",
            ],
        )
    };
    // How the job over `train` fails, with every context.
    let failure = |train: &str| {
        let dir = tempfile::tempdir().unwrap();
        let error = ParameterServerJob::builtin(job(train))
            .and_then(|j| j.run_simulated(&RunOptions::new(dir.path())))
            .map(|_| ())
            .unwrap_err();
        format!("{error:#}")
    };
    let error = failure(&train);
    assert!(
        error.contains(&format!(
            "{train}:59: column 0 \"click\" (label): \"yes\" is not a click label"
        )),
        "the file's own line 59 (the header is line 1): {error}"
    );

    let renamed = write("renamed.csv", &rows.replacen("user", "member", 1));
    let error = failure(&renamed);
    assert!(
        error.contains(&format!(
            "{renamed}: the slot 0 column \"user\" is not among the file's columns"
        )),
        "{error}"
    );

    let error = JobConfig::from_toml_str(
        "[cluster]\nserver_num = 1\n[train]\nmodel = \"wide_deep\"\ndataset = \"click_log\"\ntrain_files = [\"a\"]\ntest_files = [\"b\"]\n",
        "job.toml",
        &|_| None,
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("train.click_log: dataset \"click_log\" needs the logs' columns"),
        "{error}"
    );
}
