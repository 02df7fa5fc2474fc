//! Runs that must not be lost: run directories are never shared, final outputs are whole or
//! absent, a run resumes with its own configuration, and a diverged run fails. Every test runs
//! the real binary in a directory of its own.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

use common::{flotilla, start_flotilla_in, Finished};

/// Seconds any one `train` of these tests may take.
const TIMEOUT_S: u64 = 120;

/// `flotilla ARGS` run in `cwd` to its end.
fn flotilla_in(cwd: &Path, args: &[&str]) -> Finished {
    start_flotilla_in(cwd, args, &[]).finish(TIMEOUT_S)
}

fn run_dirs(cwd: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(cwd.join("runs"))
        .expect("runs/ was made")
        .map(|entry| entry.expect("entry").path())
        .collect();
    dirs.sort();
    dirs
}

/// The exit code of a refusal (`EX_CONFIG`).
const REFUSED: Option<i32> = Some(flotilla::job::REFUSAL_EXIT_CODE as i32);

/// Every file and directory under `dir`, with its modification time and contents, by path.
fn snapshot(dir: &Path) -> Vec<(PathBuf, SystemTime, Vec<u8>)> {
    let mut entries = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable") {
            let path = entry.expect("entry").path();
            let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
            let contents = if path.is_dir() {
                dirs.push(path.clone());
                Vec::new()
            } else {
                std::fs::read(&path).expect("readable")
            };
            entries.push((path, modified, contents));
        }
    }
    entries.sort();
    entries
}

/// The steps of `run_dir/metrics.jsonl`, in file order.
fn metric_steps(run_dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|line| {
            let metrics: serde_json::Value = serde_json::from_str(line).expect("a whole line");
            metrics["step"].as_u64().expect("step")
        })
        .collect()
}

#[test]
fn two_runs_started_together_get_their_own_directories() {
    let cwd = tempfile::tempdir().unwrap();
    let args = ["train", "--set", "train.steps=30"];
    let runs = [
        start_flotilla_in(cwd.path(), &args, &[]),
        start_flotilla_in(cwd.path(), &args, &[]),
    ];
    for run in runs {
        let finished = run.finish(TIMEOUT_S);
        assert!(finished.success, "{}", finished.stderr);
    }
    let dirs = run_dirs(cwd.path());
    assert_eq!(dirs.len(), 2, "{dirs:?}");
    for dir in &dirs {
        assert_eq!(metric_steps(dir), (1..=30).collect::<Vec<_>>(), "{}", dir.display());
        assert_eq!(common::read_summary(dir)["steps"], 30);
    }
}

/// A run refused once its data is read (after its default directory was made) leaves no empty
/// run behind.
#[test]
fn a_run_refused_before_its_first_output_leaves_no_directory() {
    let cwd = tempfile::tempdir().unwrap();
    let refused = flotilla_in(cwd.path(), &["train", "--set", "train.batch_size=100000"]);
    assert_eq!(refused.code, REFUSED, "{}", refused.stderr);
    assert!(
        refused.stderr.contains("larger than the training split"),
        "{}",
        refused.stderr
    );
    assert_eq!(run_dirs(cwd.path()), Vec::<PathBuf>::new());
}

/// The copy of its config a run keeps names the files it read by where they are, so `eval` (or
/// `--resume`) finds them from any working directory.
#[test]
fn a_runs_config_names_its_files_so_eval_finds_them_from_anywhere() {
    let cwd = tempfile::tempdir().unwrap();
    let mut table = "a,b,label\n".to_string();
    for row in 0..64 {
        table += &format!("{},{},{}\n", row % 7, row % 5, row % 2);
    }
    std::fs::write(cwd.path().join("rows.csv"), table).unwrap();
    #[rustfmt::skip]
    let trained = flotilla_in(cwd.path(), &[
        "train", "--set", "train.dataset=\"csv\"", "--set", "train.train_files=[\"rows.csv\"]",
        "--set", "train.steps=5", "--set", "train.batch_size=16", "--run-dir", "run",
    ]);
    assert!(trained.success, "{}", trained.stderr);
    let run = cwd.path().join("run");
    let elsewhere = tempfile::tempdir().unwrap();
    let (config, params) = (run.join("config.toml"), run.join("params.safetensors"));
    #[rustfmt::skip]
    let evaluated = flotilla_in(elsewhere.path(), &[
        "eval", "--config", config.to_str().unwrap(), "--params", params.to_str().unwrap(),
    ]);
    assert!(evaluated.success, "{}", evaluated.stderr);
    assert!(evaluated.stdout.contains("accuracy"), "{}", evaluated.stdout);
}

#[test]
fn a_named_run_directory_is_not_written_over_unless_asked() {
    let cwd = tempfile::tempdir().unwrap();
    let run_dir = cwd.path().join("mine");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--set",
            "train.steps=5",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ];
        args.extend(extra);
        flotilla_in(cwd.path(), &args)
    };
    let first = run(&[]);
    assert!(first.success, "{}", first.stderr);
    let second = run(&[]);
    assert_eq!(
        second.code, REFUSED,
        "a second run into the same directory: {}",
        second.stderr
    );
    assert!(
        second.stderr.contains(&run_dir.display().to_string()) && second.stderr.contains("--overwrite"),
        "{}",
        second.stderr
    );
    let overwritten = run(&["--overwrite"]);
    assert!(overwritten.success, "{}", overwritten.stderr);
    assert_eq!(metric_steps(&run_dir), (1..=5).collect::<Vec<_>>());
}

/// Two runs started at once into one directory: one trains, the other is refused as it starts,
/// and every output is the one run's (they are told apart by their lengths).
#[test]
fn of_two_runs_started_together_into_one_directory_one_runs_and_one_is_refused() {
    let cwd = tempfile::tempdir().unwrap();
    let run_dir = cwd.path().join("shared");
    let dir = run_dir.to_str().unwrap();
    let lengths = [30, 31];
    let runs = lengths.map(|steps| {
        let steps = format!("train.steps={steps}");
        start_flotilla_in(cwd.path(), &["train", "--set", &steps, "--run-dir", dir], &[])
    });
    let [first, second] = runs.map(|run| run.finish(TIMEOUT_S));
    let (steps, refused) = match (first.success, second.success) {
        (true, false) => (lengths[0], second),
        (false, true) => (lengths[1], first),
        (both, _) => panic!(
            "both runs {}:\n{}\n{}",
            if both { "ran" } else { "failed" },
            first.stderr,
            second.stderr
        ),
    };
    assert_eq!(refused.code, REFUSED, "{}", refused.stderr);
    assert!(refused.stderr.contains(dir), "{}", refused.stderr);
    assert_eq!(common::read_summary(&run_dir)["steps"], steps);
    assert_eq!(metric_steps(&run_dir), (1..=steps).collect::<Vec<_>>());
    let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(config.contains(&format!("steps = {steps}\n")), "{config}");
}

/// `FLOTILLA_RUN_DIR`, which Kubernetes manifests and Slurm scripts set to one path for every
/// job, names a finished run's directory to the next job too: it is refused as a `--run-dir`
/// would be, by a launcher as by `train`, unless `--overwrite`. A launched job's processes share
/// the directory their launcher claimed.
#[test]
fn a_new_job_in_flotilla_run_dir_is_refused_a_finished_runs_directory() {
    let cwd = tempfile::tempdir().unwrap();
    let run_dir = cwd.path().join("fixed");
    let env = [("FLOTILLA_RUN_DIR", run_dir.display().to_string())];
    #[rustfmt::skip]
    let launch = ["launch", "--nproc_per_node", "2", "--", "train", "--set", "train.steps=20"];
    let first = start_flotilla_in(cwd.path(), &launch, &env).finish(TIMEOUT_S);
    assert!(first.success, "{}", first.stderr);
    assert_eq!(common::read_summary(&run_dir)["cluster"], "multi-process");
    let before = snapshot(&run_dir);
    for again in [&launch[..], &["train", "--set", "train.steps=5"]] {
        let refused = start_flotilla_in(cwd.path(), again, &env).finish(TIMEOUT_S);
        assert_eq!(refused.code, REFUSED, "{again:?} was not refused:\n{}", refused.stderr);
        assert!(
            refused.stderr.contains(&run_dir.display().to_string()) && refused.stderr.contains("--overwrite"),
            "{}",
            refused.stderr
        );
        assert!(
            snapshot(&run_dir) == before,
            "{again:?} changed the finished run's files"
        );
    }
    let overwritten =
        start_flotilla_in(cwd.path(), &["train", "--overwrite", "--set", "train.steps=5"], &env).finish(TIMEOUT_S);
    assert!(overwritten.success, "{}", overwritten.stderr);
    assert_eq!(common::read_summary(&run_dir)["steps"], 5);
}

#[test]
fn a_second_run_does_not_meet_the_first_runs_checkpoints() {
    let cwd = tempfile::tempdir().unwrap();
    let args = [
        "train",
        "--set",
        "train.steps=10",
        "--set",
        "fault_tolerance.checkpoint_every=5",
    ];
    for _ in 0..2 {
        let run = flotilla_in(cwd.path(), &args);
        assert!(run.success, "{}", run.stderr);
    }
    for dir in run_dirs(cwd.path()) {
        let manifest = dir.join("checkpoints/step-00000005/manifest.json");
        assert!(manifest.is_file(), "{} is missing", manifest.display());
    }
}

#[test]
fn report_skips_a_torn_last_line() {
    let cwd = tempfile::tempdir().unwrap();
    let run_dir = cwd.path().join("run");
    let run = flotilla_in(
        cwd.path(),
        &[
            "train",
            "--set",
            "train.steps=6",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ],
    );
    assert!(run.success, "{}", run.stderr);
    // The run killed while it wrote its last line: the line is cut, without its newline.
    let metrics = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap();
    std::fs::write(&metrics, &text[..text.len() - 20]).unwrap();
    let report = flotilla(&["report", run_dir.to_str().unwrap()], &[], TIMEOUT_S);
    assert!(report.success, "{}", report.stderr);
    assert!(run_dir.join("report.png").is_file());
}

/// A tmpfs mounted for a test, unmounted when it is dropped (also when the test fails).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, size: &str) -> Self {
        std::fs::create_dir_all(&at).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at)
            .output()
            .expect("mount runs");
        assert!(
            mounted.status.success(),
            "this test needs to mount a tmpfs (as root): {}",
            String::from_utf8_lossy(&mounted.stderr)
        );
        Self(at)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_leaves_no_summary_and_no_partial_files() {
    let cwd = tempfile::tempdir().unwrap();
    let disk = Tmpfs::mount(cwd.path().join("disk"), "256k");
    let run_dir = disk.0.join("run");
    // About 1.2 MB of parameters, which cannot fit.
    let run = flotilla_in(
        cwd.path(),
        &[
            "train",
            "--set",
            "train.steps=2",
            "--set",
            "train.hidden_sizes=[4096]",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ],
    );
    assert!(!run.success, "the run claimed success on a full disk");
    assert!(
        run.stderr.contains("params.safetensors") && run.stderr.contains("No space left on device"),
        "{}",
        run.stderr
    );
    let mut left: Vec<String> = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            ".config.sealed.toml",
            ".flotilla-claim",
            ".flotilla-running",
            "config.toml",
            "metrics.jsonl",
            "tensorboard"
        ],
        "no summary, no partial file"
    );
}

#[test]
fn a_diverged_run_fails_naming_the_step() {
    let cwd = tempfile::tempdir().unwrap();
    let run = flotilla_in(
        cwd.path(),
        &["train", "--set", "train.steps=20", "--set", "train.lr=1e30"],
    );
    assert!(!run.success, "a diverged run exited 0");
    assert!(
        run.stderr.contains("step ") && (run.stderr.contains("loss is NaN") || run.stderr.contains("loss is infinite")),
        "{}",
        run.stderr
    );
    assert!(
        !run_dirs(cwd.path())[0].join("summary.json").exists(),
        "a diverged run wrote a summary"
    );
}

#[test]
fn a_run_resumes_with_its_own_config_and_refuses_another_learning_rate() {
    let cwd = tempfile::tempdir().unwrap();
    let run_dir = cwd.path().join("run");
    let dir = run_dir.to_str().unwrap();
    let first = flotilla_in(
        cwd.path(),
        &[
            "train",
            "--set",
            "train.steps=20",
            "--set",
            "train.lr=0.1",
            "--set",
            "fault_tolerance.checkpoint_every=10",
            "--run-dir",
            dir,
        ],
    );
    assert!(first.success, "{}", first.stderr);

    let changed = flotilla_in(cwd.path(), &["train", "--resume", dir, "--set", "train.lr=0.5"]);
    assert!(!changed.success, "a resume with another learning rate was accepted");
    assert!(
        changed.stderr.contains("train.lr was 0.1, --set makes it 0.5"),
        "{}",
        changed.stderr
    );

    // Extended by 10 steps, from the checkpoint of step 10, with the run's own learning rate.
    let longer = flotilla_in(cwd.path(), &["train", "--resume", dir, "--set", "train.steps=30"]);
    assert!(longer.success, "{}", longer.stderr);
    assert_eq!(common::read_summary(&run_dir)["steps"], 30);
    assert_eq!(metric_steps(&run_dir), (1..=30).collect::<Vec<_>>());
    let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(config.contains("lr = 0.1"), "{config}");
}

/// A finished run resumed without more steps to train is refused, saying so, and nothing in its
/// directory changes (its summary is not written over with a run of no steps).
#[test]
fn a_finished_run_resumed_without_more_steps_changes_nothing() {
    let cwd = tempfile::tempdir().unwrap();
    let run_dir = cwd.path().join("run");
    let dir = run_dir.to_str().unwrap();
    #[rustfmt::skip]
    let first = flotilla_in(cwd.path(), &["train", "--set", "train.steps=20", "--set", "fault_tolerance.checkpoint_every=10",
        "--run-dir", dir]);
    assert!(first.success, "{}", first.stderr);
    let before = snapshot(&run_dir);
    for extra in [&[][..], &["--set", "train.steps=20"]] {
        let resumed = flotilla_in(cwd.path(), &[&["train", "--resume", dir][..], extra].concat());
        assert_eq!(resumed.code, REFUSED, "{extra:?}: {}", resumed.stderr);
        assert!(
            resumed.stderr.contains("finished at step 20") && resumed.stderr.contains("--set train.steps"),
            "{}",
            resumed.stderr
        );
        assert!(
            snapshot(&run_dir) == before,
            "{extra:?}: the finished run's files changed"
        );
    }
}

#[test]
fn checkpoint_inspect_shows_what_a_runs_checkpoints_hold() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (replicas, shards) = (dir.path().join("replicas"), dir.path().join("shards"));
    #[rustfmt::skip]
    let runs = [
        // Checkpoints after steps 10, 20 and the last, 30.
        (&replicas, vec!["--set", "train.steps=30"]),
        (&shards, vec!["--config", "examples/ctr_ps.toml", "--set", "train.steps=20"]),
    ];
    for (run_dir, settings) in &runs {
        let mut args = vec!["train", "--set", "fault_tolerance.checkpoint_every=10", "--run-dir"];
        args.push(run_dir.to_str().expect("utf-8"));
        args.extend(settings);
        let trained = flotilla(&args, &[], TIMEOUT_S);
        assert!(trained.success, "{}", trained.stderr);
    }
    let inspect = |path: &Path| -> serde_json::Value {
        let out = flotilla(
            &["checkpoint", "inspect", "--json", path.to_str().expect("utf-8")],
            &[],
            30,
        );
        assert!(out.success, "{}", out.stderr);
        serde_json::from_str(&out.stdout).expect("JSON")
    };
    let replica = inspect(&replicas.join("checkpoints"));
    assert_eq!(replica["step"], 30);
    assert_eq!(replica["layout"], "data parallel: 2 rank(s), one copy of the replica");
    let file = &replica["files"][0];
    assert_eq!(file["name"], "replica.safetensors");
    // The model file's names and layout: nn.Linear's (out, in).
    assert_eq!(file["tensors"]["fc0.weight"], serde_json::json!([128, 64]));
    assert_eq!(
        file["tensors"]["optimizer.fc0.weight.momentum"],
        serde_json::json!([128, 64])
    );
    assert_eq!(file["metadata"]["format"], "flotilla-model");
    assert_eq!(file["metadata"]["optimizer"], "sgd");
    assert_eq!(file["metadata"]["optimizer_steps"], "30", "SGD counts its updates too");
    let shards = inspect(&shards.join("checkpoints/step-00000010"));
    assert_eq!(shards["layout"], "parameter servers: 2 shard(s), 2 trainer(s)");
    let rows = &shards["files"][0]["rows"];
    assert!(rows["embedding"].as_u64().unwrap_or(0) > 0, "{shards}");
    // A flipped byte: the checkpoint is skipped, naming the file, for the one before it.
    let newest = replicas.join("checkpoints/step-00000030/replica.safetensors");
    let mut bytes = std::fs::read(&newest).expect("read");
    bytes[100] ^= 1;
    std::fs::write(&newest, bytes).expect("write");
    let older = inspect(&replicas.join("checkpoints"));
    assert_eq!(older["step"], 20);
    let skipped = older["skipped"][0][1].as_str().unwrap_or_default();
    assert!(
        skipped.contains("replica.safetensors does not match its checksum"),
        "{older}"
    );
}

/// `--log-format json`: every line a run logs is one JSON object with a level and a message
/// (what log collectors read); the default is text.
#[test]
fn logs_can_be_json_lines() {
    let cwd = tempfile::tempdir().unwrap();
    let finished = flotilla_in(cwd.path(), &["--log-format", "json", "train", "--set", "train.steps=3"]);
    assert!(finished.success, "{}", finished.stderr);
    let lines: Vec<&str> = finished.stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "nothing logged");
    for line in lines {
        let event: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(
            event["level"].is_string() && event["fields"]["message"].is_string(),
            "{line}"
        );
    }
    let text = flotilla_in(cwd.path(), &["train", "--set", "train.steps=3"]);
    assert!(text.success, "{}", text.stderr);
    assert!(text.stderr.lines().any(|l| l.contains(" INFO ")), "{}", text.stderr);
}

/// `flotilla config --defaults` prints every key at its default under its documentation, a file
/// that loads back to the built-in defaults; `--reference` prints docs/config.md as it is checked
/// in; `flotilla config` prints a job's resolved keys; completions come for the common shells.
#[test]
fn config_prints_the_defaults_and_the_resolved_job_and_completions_are_generated() {
    let defaults = flotilla(&["config", "--defaults"], &[], 30);
    assert!(defaults.success, "{}", defaults.stderr);
    let loaded = flotilla::config::JobConfig::from_toml_str(&defaults.stdout, "defaults.toml", &|_| None, &[])
        .expect("the defaults load");
    let expected = flotilla::config::JobConfig {
        source_name: "defaults.toml".to_string(),
        ..Default::default()
    };
    assert_eq!(loaded, expected);
    for key in [
        "[cluster]",
        "[strategy]",
        "[train]",
        "[fault_tolerance]",
        "# eval_batch_size = (integer, unset)",
        "lr_schedule",
        "# Paddle: fuse_grad_size_in_MB, FLAGS_fuse_parameter_groups_size\nfuse_grad_size_in_MB = 32.0",
        "# master = (string, unset)",
    ] {
        assert!(defaults.stdout.contains(key), "no {key} in\n{}", defaults.stdout);
    }
    let reference = flotilla(&["config", "--reference"], &[], 30);
    assert!(reference.success, "{}", reference.stderr);
    let checked_in = std::fs::read_to_string("docs/config.md").unwrap();
    assert!(
        reference.stdout == checked_in,
        "docs/config.md is not current: `cargo run --release -- config --reference > docs/config.md`"
    );
    let resolved = flotilla(&["config", "--set", "train.steps=7"], &[], 30);
    assert!(
        resolved.success && resolved.stdout.contains("steps = 7"),
        "{}",
        resolved.stdout
    );
    for shell in ["bash", "zsh", "fish"] {
        let script = flotilla(&["completions", shell], &[], 30);
        assert!(
            script.success && script.stdout.contains("eval"),
            "{shell}: {}",
            script.stdout
        );
    }
}
