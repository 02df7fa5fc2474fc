//! The user's own data from the command line: CSV tables trained under `flotilla launch`,
//! checked against one process training the same global batches.

mod common;

use std::fmt::Write as _;
use std::path::Path;

use common::parquet::{write_parquet, Column};
use common::{flotilla, free_port_range, max_abs_diff, read_params, read_summary};
use flotilla::config::JobConfig;
use flotilla::job::{RunOptions, TrainingJob};

/// `rows` rows (a, b, c, y) of three features and a planted linear target with a little
/// deterministic noise: `y = 2·a − b + 0.5·c + 1`.
fn regression_rows(rows: usize, offset: usize) -> Vec<[f32; 4]> {
    (offset..offset + rows)
        .map(|i| {
            let a = ((i * 37) % 101) as f32 / 50.0 - 1.0;
            let b = ((i * 53) % 97) as f32 / 48.0 - 1.0;
            let c = ((i * 71) % 89) as f32 / 44.0 - 1.0;
            let noise = ((i * 13) % 7) as f32 / 100.0 - 0.03;
            [a, b, c, 2.0 * a - b + 0.5 * c + 1.0 + noise]
        })
        .collect()
}

fn regression_csv(rows: usize, offset: usize) -> String {
    let mut text = String::from("a,b,c,y\n");
    for [a, b, c, y] in regression_rows(rows, offset) {
        writeln!(text, "{a},{b},{c},{y}").unwrap();
    }
    text
}

/// The same rows as a Parquet file at `path`, the label first (columns are found by name), in
/// row groups of 100.
fn write_regression_parquet(path: &Path, rows: usize, offset: usize) {
    let rows = regression_rows(rows, offset);
    let doubles = |i: usize| Column::Doubles(rows.iter().map(|r| f64::from(r[i])).collect());
    let columns = [
        ("y", doubles(3)),
        ("a", doubles(0)),
        ("b", doubles(1)),
        ("c", doubles(2)),
    ];
    write_parquet(path, &columns, 100);
}

/// A job config training an MLP regression on the `format` ("csv" or "parquet") files in
/// `dir`, on `ranks` ranks.
fn config_text(dir: &Path, format: &str, ranks: usize) -> String {
    let file = |name: &str| dir.join(format!("{name}.{format}")).to_string_lossy().into_owned();
    format!(
        "[cluster]\nnproc_per_node = {ranks}\n\n[train]\nmodel = \"mlp\"\nhidden_sizes = [16]\n\
         dataset = \"{format}\"\ntrain_files = [{:?}]\ntest_files = [{:?}]\nlabel_column = \"y\"\n\
         loss = \"mse\"\nsteps = 120\nbatch_size = 32\nlr = 0.05\nseed = 7\n",
        file("train"),
        file("test")
    )
}

fn write_tables(dir: &Path) {
    std::fs::write(dir.join("train.csv"), regression_csv(256, 0)).unwrap();
    std::fs::write(dir.join("test.csv"), regression_csv(64, 1000)).unwrap();
    write_regression_parquet(&dir.join("train.parquet"), 256, 0);
    write_regression_parquet(&dir.join("test.parquet"), 64, 1000);
}

#[test]
fn a_csv_regression_launched_on_two_processes_equals_one_process() {
    launched_regression_equals_one_process("csv", "");
}

#[test]
fn a_parquet_regression_launched_on_two_processes_equals_one_process() {
    launched_regression_equals_one_process("parquet", "");
}

/// Streamed in two parts of one file each rank reads alone — the CSV cut by bytes (the header
/// in the first part only), the Parquet by rows (the second part starting inside a row group of
/// 100) — and shuffled in windows.
const STREAMED: &str = "data_parts = 2\nshuffle_buffer = 48\n";

#[test]
fn a_csv_streamed_in_parts_launched_on_two_processes_equals_one_process() {
    launched_regression_equals_one_process("csv", STREAMED);
}

#[test]
fn a_parquet_streamed_in_parts_launched_on_two_processes_equals_one_process() {
    launched_regression_equals_one_process("parquet", STREAMED);
}

#[test]
fn a_streamed_table_trains_a_pipeline_of_two_replicas_as_one_process_and_scores_every_held_out_row() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let run = |name: &str, sets: &[&str]| {
        let text = config_text(dir.path(), "csv", 1) + STREAMED;
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let config = JobConfig::from_toml_str(&text, "regression.toml", &|_| None, &sets).unwrap();
        TrainingJob::builtin(config)
            .unwrap()
            .run_simulated(&RunOptions::new(dir.path().join(name)))
            .unwrap()
    };
    // Both stages of a replica read its part of every batch; the last scores its held-out share.
    let (pipeline, one) = (run("pipeline", &common::PIPELINE_2X2), run("one", &[]));
    assert_eq!((pipeline.summary.test_samples, one.summary.test_samples), (64, 64));
    // Within 1e-5 per parameter: the replicas sum their gradients in another order.
    let diff = max_abs_diff(&one.parameters, &pipeline.parameters);
    assert!(diff <= 1e-5, "max |Δparam| = {diff:e}");
}

/// `format` trained under `flotilla launch` on two processes, with the `[train]` keys `extra`,
/// against one process on the same global batches.
fn launched_regression_equals_one_process(format: &str, extra: &str) {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let config_path = dir.path().join("regression.toml");
    std::fs::write(&config_path, config_text(dir.path(), format, 2) + extra).unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(3).to_string();
    #[rustfmt::skip]
    let args = [
        "launch", "--nproc_per_node", "2", "--started_port", &port, "--",
        "train", "--config", config_path.to_str().unwrap(), "--run-dir", run_dir.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 120);
    finished.assert_success("launch failed");
    let summary = read_summary(&run_dir);
    assert_eq!(summary["world_size"], 2);
    assert!(
        summary.get("test_accuracy").is_none(),
        "a regression has no accuracy: {summary}"
    );
    assert_eq!(summary["test_samples"], 64);

    // One process on the same global batches: within 1e-5 per parameter, the tolerance of
    // data_parallel_equivalence.rs (two ranks sum their halves of each gradient in another
    // order than one process sums the whole).
    let text = config_text(dir.path(), format, 1) + extra;
    let reference = TrainingJob::builtin(JobConfig::from_toml_str(&text, "regression.toml", &|_| None, &[]).unwrap())
        .unwrap()
        .run_simulated(&RunOptions::new(dir.path().join("reference")))
        .unwrap();
    let diff = max_abs_diff(&reference.parameters, &read_params(&run_dir.join("params.safetensors")));
    assert!(diff <= 1e-5, "max |Δparam| = {diff:e}");
    let (mse, want) = (
        summary["test_mse"].as_f64().unwrap(),
        reference.summary.test_mse.unwrap(),
    );
    assert!((mse - want).abs() <= 1e-4 * want, "test mse {mse} against {want}");
    // It learned: the planted target's variance is about 1.9, its noise's 4e-4.
    assert!(mse < 0.05, "test mse {mse}");
}

/// Trains `config_path` into `run_dir`, which must fail with an error that names `file` and says
/// `needle`, and write nothing.
fn refused(config_path: &Path, run_dir: &Path, file: &str, needle: &str) {
    let args = [
        "train",
        "--config",
        config_path.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 60);
    // A refusal: data no restart can change.
    assert_eq!(finished.code, Some(78), "{needle}: {}", finished.stderr);
    assert!(
        finished.stderr.contains(file) && finished.stderr.contains(needle),
        "{needle}: {}",
        finished.stderr
    );
    assert!(!run_dir.join("summary.json").exists() && !run_dir.join("params.safetensors").exists());
}

#[test]
fn bad_tables_are_refused_with_the_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let mut broken = regression_csv(20, 0);
    broken.push_str("0.1,0.2,x7,1.0\n");
    std::fs::write(dir.path().join("train.csv"), broken).unwrap();
    let config_path = dir.path().join("regression.toml");
    std::fs::write(&config_path, config_text(dir.path(), "csv", 1)).unwrap();
    let run_dir = dir.path().join("run");
    refused(
        &config_path,
        &run_dir,
        "train.csv",
        "line 22, column \"c\": \"x7\" is not a number",
    );
    std::fs::write(dir.path().join("train.csv"), "a,b,c\n1,2,3\n").unwrap();
    let missing = "no column \"y\" (train.label_column); its columns are a, b, c";
    refused(&config_path, &run_dir, "train.csv", missing);
}

/// A header naming a column twice (found only when the file is read), and a label among the
/// features, are refused (78, which a launcher does not restart), naming the file and the column.
#[test]
fn a_column_named_twice_and_a_label_among_the_features_are_refusals() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let config_path = dir.path().join("regression.toml");
    let config = config_text(dir.path(), "csv", 1);
    let run_dir = dir.path().join("run");
    std::fs::write(&config_path, &config).unwrap();
    let twice = regression_csv(256, 0).replacen("a,b,c,y", "a,b,a,y", 1);
    std::fs::write(dir.path().join("train.csv"), twice).unwrap();
    refused(
        &config_path,
        &run_dir,
        "train.csv",
        "columns 1 and 3 (counted from 1) are both named \"a\"",
    );
    write_tables(dir.path());
    // The label among the features is the config's own contradiction: refused as it loads.
    std::fs::write(&config_path, format!("{config}feature_columns = [\"a\", \"y\"]\n")).unwrap();
    let label_among_features = "train.feature_columns[1]: \"y\" is train.label_column";
    refused(&config_path, &run_dir, "regression.toml", label_among_features);
}

#[test]
fn a_parquet_file_of_another_schema_is_refused_naming_the_column() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let train = dir.path().join("train.parquet");
    let texts = Column::Texts((0..10).map(|i| format!("x{i}")).collect());
    let longs = || Column::Longs((0..10).collect());
    write_parquet(
        &train,
        &[("a", longs()), ("b", longs()), ("c", texts), ("y", longs())],
        4,
    );
    let config_path = dir.path().join("regression.toml");
    std::fs::write(&config_path, config_text(dir.path(), "parquet", 1)).unwrap();
    let run_dir = dir.path().join("run");
    let file = "train.parquet";
    // Integers are numbers; text is not.
    let text = "column \"c\" is not numbers: its schema is `REQUIRED BYTE_ARRAY c (UTF8);`";
    refused(&config_path, &run_dir, file, text);
    write_parquet(&train, &[("a", longs()), ("b", longs()), ("c", longs())], 4);
    let missing = "no column \"y\" (train.label_column); its columns are a, b, c";
    refused(&config_path, &run_dir, file, missing);
    std::fs::write(&train, regression_csv(10, 0)).unwrap();
    refused(&config_path, &run_dir, file, "not a readable Parquet file");
}

/// Trains `config_path` for its steps as one process into `run_dir`, with a checkpoint every
/// 50 steps (and so at the last).
fn train(config_path: &Path, run_dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "train",
        "--config",
        config_path.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--set",
        "fault_tolerance.checkpoint_every=50",
    ];
    for setting in extra {
        args.extend(["--set", setting]);
    }
    let finished = flotilla(&args, &[], 120);
    assert!(finished.success, "training failed:\n{}", finished.stderr);
    read_summary(run_dir)
}

/// `flotilla eval`'s JSON for `config_path` with `weights` (`--params FILE` or `--checkpoint DIR`).
fn eval(config_path: &Path, weights: [&str; 2]) -> serde_json::Value {
    let args = [
        "eval",
        "--config",
        config_path.to_str().unwrap(),
        weights[0],
        weights[1],
    ];
    let finished = flotilla(&args, &[], 60);
    assert!(finished.success, "eval failed:\n{}", finished.stderr);
    serde_json::from_str(&finished.stdout).unwrap()
}

#[test]
fn eval_of_the_model_file_and_of_the_last_checkpoint_equals_the_runs_own_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let config_path = dir.path().join("regression.toml");
    std::fs::write(&config_path, config_text(dir.path(), "csv", 2)).unwrap();
    for (name, extra) in [
        ("regression", &[][..]),
        (
            "pipeline",
            &["strategy.pipeline=true", "strategy.hybrid_configs.pp_degree=2"][..],
        ),
    ] {
        let run_dir = dir.path().join(name);
        let summary = train(&config_path, &run_dir, extra);
        let params = run_dir.join("params.safetensors");
        let checkpoints = run_dir.join("checkpoints");
        let want = summary["test_mse"].as_f64().unwrap();
        // A replica's checkpoint file is a model file too.
        let replica = checkpoints.join("step-00000120/replica.safetensors");
        let mut all_weights = vec![
            ["--params", params.to_str().unwrap()],
            ["--checkpoint", checkpoints.to_str().unwrap()],
        ];
        if name == "regression" {
            all_weights.push(["--params", replica.to_str().unwrap()]);
        }
        for weights in all_weights {
            let got = eval(&config_path, weights);
            assert_eq!(got["test_samples"], summary["test_samples"], "{name} {weights:?}");
            // The run sums each rank's squared errors in f32 across ranks; eval sums them all
            // in f64.
            let mse = got["test_mse"].as_f64().unwrap();
            assert!(
                (mse - want).abs() <= 1e-6 * want,
                "{name} {weights:?}: {mse} against {want}"
            );
        }
        assert_eq!(
            eval(&config_path, ["--checkpoint", checkpoints.to_str().unwrap()])["step"],
            120
        );
    }

    // Classification: the digits job's accuracy, exactly.
    let run_dir = dir.path().join("digits");
    let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
    let summary = train(&digits, &run_dir, &["train.steps=30"]);
    let params = run_dir.join("params.safetensors");
    let got = eval(&digits, ["--params", params.to_str().unwrap()]);
    assert_eq!(got["test_accuracy"], summary["test_accuracy"]);
    assert_eq!(got["test_samples"], 359);

    // Rows of another width than the model reads are refused before anything is written.
    let predictions = dir.path().join("refused.csv");
    let test_rows = dir.path().join("test.csv");
    #[rustfmt::skip]
    let args = [
        "predict", "--model", params.to_str().unwrap(), "--data", test_rows.to_str().unwrap(),
        "--out", predictions.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 60);
    assert!(!finished.success && !predictions.exists());
    assert!(
        finished
            .stderr
            .contains("the model reads 64 features a row, the data has 4 columns"),
        "{}",
        finished.stderr
    );

    // Another model's file is refused by the tensor that does not fit.
    let args = [
        "eval",
        "--config",
        config_path.to_str().unwrap(),
        "--params",
        params.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 60);
    assert!(!finished.success);
    assert!(
        finished.stderr.contains("params.safetensors") && finished.stderr.contains("tensor fc0.bias"),
        "{}",
        finished.stderr
    );
}

#[test]
fn pytorch_loads_the_model_file_by_name_and_predicts_as_flotilla_does() {
    if !common::python_imports(&["torch", "safetensors"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/load_into_torch.py");
    let regression = dir.path().join("regression.toml");
    // The features in an order of their own, not the file's.
    let text = config_text(dir.path(), "csv", 2) + "feature_columns = [\"c\", \"a\", \"b\"]\n";
    std::fs::write(&regression, text).unwrap();
    let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
    let digit_rows = dir.path().join("digits.csv");
    let mut table = (0..64).map(|i| format!("p{i}")).collect::<Vec<_>>().join(",") + "\n";
    for row in 0..40 {
        let pixels: Vec<String> = (0..64)
            .map(|i| (((row * 31 + i * 7) % 17) as f32 / 16.0).to_string())
            .collect();
        table += &(pixels.join(",") + "\n");
    }
    std::fs::write(&digit_rows, table).unwrap();

    for (name, config_path, data) in [
        ("regression", regression.as_path(), dir.path().join("test.csv")),
        ("digits", digits.as_path(), digit_rows),
    ] {
        let run_dir = dir.path().join(name);
        train(config_path, &run_dir, &["train.steps=30"]);
        let params = run_dir.join("params.safetensors");
        let predictions = dir.path().join(format!("{name}-predictions.csv"));
        #[rustfmt::skip]
        let args = [
            "predict", "--model", params.to_str().unwrap(), "--data", data.to_str().unwrap(),
            "--out", predictions.to_str().unwrap(),
        ];
        let finished = flotilla(&args, &[], 60);
        assert!(finished.success, "predict failed:\n{}", finished.stderr);
        // The checkpoint after the last step holds the same parameters, in the same layout.
        let checkpoint = run_dir.join("checkpoints/step-00000030/replica.safetensors");
        for file in [&params, &checkpoint] {
            #[rustfmt::skip]
            let args = [
                script.to_str().unwrap(), "--params", file.to_str().unwrap(), "--data", data.to_str().unwrap(),
                "--predictions", predictions.to_str().unwrap(),
            ];
            let checked = common::start_program("python3", &args, &[]).finish(120);
            assert!(
                checked.success,
                "{name}, {}: PyTorch disagrees:\n{}\n{}",
                file.display(),
                checked.stdout,
                checked.stderr
            );
            let figures: serde_json::Value = serde_json::from_str(&checked.stdout).unwrap();
            assert!(figures["max_abs_diff"].as_f64().unwrap() <= 1e-5, "{name}: {figures}");
        }
    }
}

/// The peak resident set of `flotilla args`, which must succeed.
fn peak_rss(args: &[&str]) -> u64 {
    let (succeeded, stderr, peak) = common::flotilla_peak_rss(args, 120);
    assert!(succeeded, "{stderr}");
    peak
}

/// Evaluation scores the held-out set `eval_batch_size` rows at a time, so its memory does not
/// grow with the set: `flotilla eval` of a wide MLP on 40 000 held-out rows peaks within 64 MB of
/// the same on 2 000, where one forward pass of the whole set would hold 311 MB more of the
/// hidden layer's activations alone.
#[test]
fn evaluation_memory_stays_bounded_as_the_held_out_set_grows() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let held_out = |name: &str, rows: usize| {
        let path = dir.path().join(format!("{name}.csv"));
        std::fs::write(&path, regression_csv(rows, 5000)).unwrap();
        let config = config_text(dir.path(), "csv", 1)
            .replace("hidden_sizes = [16]", "hidden_sizes = [2048]")
            .replace("steps = 120", "steps = 4")
            .replace(&*dir.path().join("test.csv").to_string_lossy(), &path.to_string_lossy());
        let config_path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&config_path, config).unwrap();
        config_path
    };
    let (small, large) = (held_out("small", 2_000), held_out("large", 40_000));
    let run_dir = dir.path().join("run");
    let summary = train(&small, &run_dir, &[]);
    assert_eq!(summary["test_samples"], 2_000);
    let params = run_dir.join("params.safetensors");
    let peak = |config: &Path| {
        peak_rss(&[
            "eval",
            "--config",
            config.to_str().unwrap(),
            "--params",
            params.to_str().unwrap(),
        ])
    };
    let (small_peak, large_peak) = (peak(&small), peak(&large));
    assert!(
        large_peak < small_peak + (64 << 20),
        "peak resident set {small_peak} B on 2 000 rows, {large_peak} B on 40 000"
    );
}

/// Named arrays — safetensors, NumPy's `.npz` and a directory of `.npy` files — holding the rows
/// of the CSV tables train the very same model: a feature array of shape (n, 3) and a label
/// array (n).
#[test]
fn named_arrays_train_the_model_the_same_rows_as_a_table_train() {
    use candle_core::{Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    let arrays = |rows: usize, offset: usize| {
        let rows = regression_rows(rows, offset);
        let x: Vec<f32> = rows.iter().flat_map(|r| r[..3].to_vec()).collect();
        let y: Vec<f32> = rows.iter().map(|r| r[3]).collect();
        let n = rows.len();
        (
            Tensor::from_vec(x, (n, 3), &Device::Cpu).unwrap(),
            Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
        )
    };
    for (split, rows, offset) in [("train", 256, 0), ("test", 64, 1000)] {
        let (x, y) = arrays(rows, offset);
        let named = std::collections::HashMap::from([("x".to_string(), x.clone()), ("y".to_string(), y.clone())]);
        candle_core::safetensors::save(&named, dir.path().join(format!("{split}.safetensors"))).unwrap();
        Tensor::write_npz(&[("x", &x), ("y", &y)], dir.path().join(format!("{split}.npz"))).unwrap();
        let npy = dir.path().join(format!("{split}_npy"));
        std::fs::create_dir(&npy).unwrap();
        x.write_npy(npy.join("x.npy")).unwrap();
        y.write_npy(npy.join("y.npy")).unwrap();
    }
    let job = |format: &str, extension: &str, extra: &str| {
        let text = config_text(dir.path(), format, 1).replace(".arrays", extension)
            + if format == "arrays" {
                "feature_columns = [\"x\"]\n"
            } else {
                ""
            }
            + extra;
        TrainingJob::builtin(JobConfig::from_toml_str(&text, "arrays.toml", &|_| None, &[]).unwrap())
    };
    let run = |format: &str, extension: &str, extra: &str| {
        let run_dir = dir.path().join(format!("run{extension}-{}", extra.len()));
        let outcome = job(format, extension, extra)
            .unwrap()
            .run_simulated(&RunOptions::new(run_dir))
            .unwrap();
        assert_eq!(outcome.summary.test_samples, 64);
        outcome.parameters
    };
    let table = run("csv", ".csv", "");
    for extension in [".safetensors", ".npz", "_npy"] {
        assert_eq!(max_abs_diff(&table, &run("arrays", extension, "")), 0.0, "{extension}");
    }
    // Streamed as one part in file order, shuffled in the same windows: the same batches from
    // every format, read a block of rows at a time (arrays at their byte offsets).
    let streamed = "data_parts = 1\nshuffle_buffer = 48\n";
    let table = run("csv", ".csv", streamed);
    for (format, extension) in [("parquet", ".parquet"), ("arrays", ".safetensors"), ("arrays", "_npy")] {
        let what = format!("streamed {format} {extension}");
        assert_eq!(max_abs_diff(&table, &run(format, extension, streamed)), 0.0, "{what}");
    }
    let error = job("arrays", ".npz", streamed)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(error.contains("a .npz archive is read whole"), "{error}");
    // A lone .npy file is one array: the error says how to pair it.
    let text = config_text(dir.path(), "arrays", 1).replace("train.arrays", "train_npy/x.npy");
    let config = JobConfig::from_toml_str(&text, "arrays.toml", &|_| None, &[]).unwrap();
    let error = match TrainingJob::builtin(config) {
        Ok(_) => panic!("a lone .npy file trained"),
        Err(e) => format!("{e:#}"),
    };
    assert!(error.contains("x.npy: a .npy file holds one array"), "{error}");
    // A missing label array is named with the arrays there are.
    let text = config_text(dir.path(), "arrays", 1)
        .replace(".arrays", ".npz")
        .replace("\"y\"", "\"z\"");
    let config = JobConfig::from_toml_str(&text, "arrays.toml", &|_| None, &[]).unwrap();
    let error = match TrainingJob::builtin(config) {
        Ok(_) => panic!("a missing label array trained"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        error.contains("no array \"z\" (train.label_column); its arrays are x, y"),
        "{error}"
    );
}

#[test]
fn training_and_prediction_memory_stay_bounded_as_a_streamed_table_grows() {
    let dir = tempfile::tempdir().unwrap();
    write_tables(dir.path());
    // 1.2 million rows (about 48 MB of CSV) against 2 000: as rows in memory they would take
    // over 19 MB more, streamed they take a shuffle window.
    // Written 10 000 rows at a time: a child's peak resident set counts its parent's at the
    // fork, so this process keeps little.
    let table = |name: &str, rows: usize| {
        let path = dir.path().join(format!("{name}.csv"));
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        for start in (0..rows).step_by(10_000) {
            let text = regression_csv(10_000.min(rows - start), start);
            let body = if start == 0 {
                &text[..]
            } else {
                &text["a,b,c,y\n".len()..]
            };
            std::io::Write::write_all(&mut out, body.as_bytes()).unwrap();
        }
        std::io::Write::flush(&mut out).unwrap();
        path.to_string_lossy().into_owned()
    };
    let (small, large) = (table("small", 2_000), table("large", 1_200_000));
    let peak = |file: &str, extra: &str| {
        let config = config_text(dir.path(), "csv", 1)
            .replace("steps = 120", "steps = 4")
            .replace(&*dir.path().join("train.csv").to_string_lossy(), file)
            + extra;
        let config_path = dir.path().join("memory.toml");
        std::fs::write(&config_path, config).unwrap();
        let run_dir = dir.path().join("run");
        peak_rss(&[
            "train",
            "--config",
            config_path.to_str().unwrap(),
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--overwrite",
        ])
    };
    let streamed = "data_parts = 1\nshuffle_buffer = 256\n";
    let (small_peak, large_peak) = (peak(&small, streamed), peak(&large, streamed));
    assert!(
        large_peak < small_peak + (6 << 20),
        "streamed: peak resident set {small_peak} B on 2 000 rows, {large_peak} B on 1 200 000"
    );
    // The measure sees rows held in memory: the same table read whole grows it.
    let whole = peak(&large, "");
    assert!(
        whole > small_peak + (16 << 20),
        "read whole: peak resident set {whole} B on 1 200 000 rows against {small_peak} B streamed on 2 000"
    );
    // `predict` streams the tables it reads, and writes as it goes.
    let params = dir.path().join("run/params.safetensors");
    let out = dir.path().join("predictions.csv");
    let predict = |file: &str| {
        #[rustfmt::skip]
        let args = ["predict", "--model", params.to_str().unwrap(), "--data", file, "--out", out.to_str().unwrap()];
        peak_rss(&args)
    };
    let (small_peak, large_peak) = (predict(&small), predict(&large));
    assert!(
        large_peak < small_peak + (6 << 20),
        "predict: peak resident set {small_peak} B on 2 000 rows, {large_peak} B on 1 200 000"
    );
    let lines = std::io::BufRead::lines(std::io::BufReader::new(std::fs::File::open(&out).unwrap())).count();
    assert_eq!(lines, 1_200_001, "a header and a prediction a row");
}
