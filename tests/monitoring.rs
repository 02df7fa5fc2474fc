//! What a person watching a run sees: metrics.jsonl for every step, the ranks' timelines merged
//! onto one clock, the Prometheus endpoint, progress lines for a launcher, the summary table.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{
    flotilla, free_port_range, local_launch, read_summary, start_flotilla, trace_spans, trace_tracks, wait_or_kill,
};
use serde_json::Value;

const STEPS: usize = 40;

/// Every field of a metrics.jsonl line, in order.
const FIELDS: [&str; 13] = [
    "step",
    "elapsed_s",
    "step_time_s",
    "samples_per_sec",
    "comm_time_ratio",
    "exposed_comm_ratio",
    "bubble_fraction",
    "peak_rss_bytes",
    "gpu_memory_bytes",
    "gpu_utilization",
    "lr",
    "loss",
    "loss_spread",
];

fn json(path: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn a_launched_two_rank_job_leaves_every_steps_metrics_and_timelines_on_one_clock() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, trace_dir) = (dir.path().join("run"), dir.path().join("trace"));
    let port = free_port_range(3).to_string();
    let steps = format!("train.steps={STEPS}");
    let launched = flotilla(
        &local_launch(
            "2",
            &port,
            &[
                "--run-dir",
                run_dir.to_str().unwrap(),
                "--trace",
                trace_dir.to_str().unwrap(),
                "--set",
                &steps,
            ],
        ),
        &[],
        120,
    );
    assert!(launched.success, "{}\n{}", launched.stdout, launched.stderr);

    // The summary table holds the figures of summary.json.
    let summary = json(&run_dir.join("summary.json"));
    for (key, value) in summary.as_object().unwrap() {
        let row = launched
            .stdout
            .lines()
            .find(|l| l.contains(&format!("| {key} ")))
            .unwrap_or_else(|| panic!("no row {key} in\n{}", launched.stdout));
        if let Some(text) = value.as_str() {
            assert!(row.contains(text), "{row} vs {value}");
        }
    }

    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), STEPS);
    for (index, line) in lines.iter().enumerate() {
        let keys: Vec<&str> = line.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, FIELDS, "line {}", index + 1);
        assert_eq!(line["step"], index + 1);
        let number = |key: &str| line[key].as_f64().unwrap_or_else(|| panic!("{key} in {line}"));
        assert!(number("loss").is_finite() && number("loss") > 0.0, "{line}");
        assert!(number("loss_spread") >= 0.0, "{line}");
        assert!(number("samples_per_sec") > 0.0 && number("step_time_s") > 0.0, "{line}");
        assert!((0.0..=1.5).contains(&number("comm_time_ratio")), "{line}");
        assert!((0.0..=1.0).contains(&number("exposed_comm_ratio")), "{line}");
        assert!(number("peak_rss_bytes") > 1e6, "{line}");
        assert!(number("lr") > 0.0, "{line}");
        assert!(
            line["bubble_fraction"].is_null()
                && line["gpu_memory_bytes"].is_null()
                && line["gpu_utilization"].is_null(),
            "{line}"
        );
    }
    assert_eq!(
        lines.last().unwrap()["loss"].as_f64().unwrap() as f32,
        summary["final_loss"].as_f64().unwrap() as f32
    );

    // The report of the run: a PNG of the declared size (IHDR's width and height).
    let report = flotilla(&["report", run_dir.to_str().unwrap()], &[], 60);
    assert!(report.success, "{}", report.stderr);
    let png = std::fs::read(run_dir.join("report.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let dimension = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    assert_eq!((dimension(16), dimension(20)), flotilla::telemetry::report::IMAGE_SIZE);

    let merged_path = dir.path().join("merged.json");
    let merged = flotilla(
        &[
            "trace",
            "merge",
            trace_dir.to_str().unwrap(),
            "-o",
            merged_path.to_str().unwrap(),
        ],
        &[],
        30,
    );
    assert!(merged.success, "{}", merged.stderr);
    let trace = json(&merged_path);
    let ranks = trace_tracks(&trace);
    assert_eq!(
        ranks,
        [(0, "rank 0: trainer".to_string()), (1, "rank 1: trainer".to_string())]
    );
    for pid in 0..2 {
        for kind in ["data", "forward", "backward", "optimizer"] {
            let found = trace_spans(&trace, pid, |n| n.starts_with(&format!("{kind} ")));
            assert_eq!(found.len(), STEPS, "rank {pid} {kind}");
        }
    }
    // A ring all-reduce cannot end on one rank before the other has started it: on one clock,
    // each step's first bucket overlaps across the ranks.
    let first_bucket = |pid| trace_spans(&trace, pid, |n| n.starts_with("all-reduce bucket 0 "));
    let (rank0, rank1) = (first_bucket(0), first_bucket(1));
    assert_eq!((rank0.len(), rank1.len()), (STEPS, STEPS));
    for (step, (a, b)) in rank0.iter().zip(&rank1).enumerate() {
        assert!(
            a.1 >= b.0 && b.1 >= a.0,
            "step {step}: rank 0's bucket 0 ran {a:?} µs, rank 1's {b:?} µs"
        );
    }
}

#[test]
fn prometheus_scrapes_the_running_job() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port_range(1);
    let run_dir = dir.path().join("run");
    // Long enough to be scraped while it runs; stopped by the test once scraped.
    let mut job = start_flotilla(
        &[
            "train",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--metrics-port",
            &port.to_string(),
            "--set",
            "train.epochs=2000",
        ],
        &[],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let scraped = loop {
        assert!(Instant::now() < deadline, "no metrics with steps within 60 s");
        if let Some(status) = job.child.try_wait().unwrap() {
            panic!("the job ended ({status}) before it was scraped");
        }
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .unwrap();
            let mut response = String::new();
            let _ = stream.read_to_string(&mut response);
            let steps = response
                .lines()
                .find_map(|l| l.strip_prefix("flotilla_steps_total{"))
                .and_then(|l| l.rsplit_once("} "))
                .and_then(|(_, v)| v.parse::<u64>().ok());
            if steps.is_some_and(|s| s > 0) {
                break response;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = job.child.kill();
    let _ = job.child.wait();
    assert!(scraped.starts_with("HTTP/1.1 200"), "{scraped}");
    // Every sample says whose it is; a figure the job lacks (a pipeline's bubble) has none.
    let run_name = run_dir.file_name().unwrap().to_str().unwrap();
    let ours = format!("{{job=\"{run_name}\",rank=\"0\",role=\"trainer\"}} ");
    for gauge in [
        "flotilla_loss",
        "flotilla_loss_spread",
        "flotilla_samples_per_second",
        "flotilla_comm_time_ratio",
    ] {
        assert!(
            scraped.lines().any(|l| l.starts_with(&format!("{gauge}{ours}"))),
            "no {gauge}{ours} in\n{scraped}"
        );
    }
    assert!(
        !scraped.contains("NaN") && !scraped.contains("flotilla_bubble_fraction{"),
        "{scraped}"
    );
}

#[test]
fn a_rank_under_a_launcher_on_a_terminal_writes_a_progress_line_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let steps = format!("train.steps={STEPS}");
    let finished = flotilla(
        &["train", "--run-dir", run_dir.to_str().unwrap(), "--set", &steps],
        &[("FLOTILLA_PROGRESS", "launcher".to_string())],
        60,
    );
    assert!(finished.success, "{}", finished.stderr);
    let progress: Vec<Value> = finished
        .stderr
        .lines()
        .filter_map(|l| l.strip_prefix("flotilla-progress "))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(progress.len(), STEPS);
    assert_eq!(progress[STEPS - 1]["step"], STEPS);
    assert_eq!(progress[0]["steps"], STEPS);
}

#[test]
fn a_launcher_on_a_terminal_draws_the_reporting_ranks_progress_as_its_bar() {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::process::{Command, Stdio};

    // A pseudo-terminal for the launcher's stderr, 120 columns wide.
    let (mut controller, mut terminal) = (-1, -1);
    let size = libc::winsize {
        ws_row: 40,
        ws_col: 120,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two descriptors into the integers it is given; the name and
    // termios pointers may be null.
    let opened = unsafe {
        libc::openpty(
            &mut controller,
            &mut terminal,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(opened, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned by nothing else.
    let (controller, terminal) = unsafe { (OwnedFd::from_raw_fd(controller), OwnedFd::from_raw_fd(terminal)) };

    let dir = tempfile::tempdir().unwrap();
    let port = free_port_range(3).to_string();
    let run_dir = dir.path().join("run");
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args([
            "launch",
            "--nproc_per_node",
            "2",
            "--started_port",
            &port,
            "--",
            "train",
        ])
        .args(["--run-dir", run_dir.to_str().unwrap(), "--set", "train.steps=3000"])
        .env_remove("PADDLE_TRAINER_ID")
        .env_remove("FLOTILLA_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(terminal))
        .spawn()
        .unwrap();
    // The terminal's output, until the launcher (its last writer) has exited.
    let reader = std::thread::spawn(move || {
        let mut drawn = Vec::new();
        let _ = std::fs::File::from(controller).read_to_end(&mut drawn);
        String::from_utf8_lossy(&drawn).into_owned()
    });
    let status = wait_or_kill(&mut launcher, 120);
    let drawn = reader.join().unwrap();
    assert!(status.success(), "{drawn}");
    assert!(drawn.contains("/3000 steps"), "no bar in:\n{drawn}");
    assert!(drawn.contains("samples/s"), "no throughput in the bar:\n{drawn}");
    assert!(
        !drawn.contains("flotilla-progress"),
        "progress lines printed as text:\n{drawn}"
    );
    assert!(
        drawn.contains("[coordinator]"),
        "the processes' logs still show:\n{drawn}"
    );
}

#[test]
fn a_launched_pipelines_outputs_and_metrics_share_the_launchers_run_directory() {
    // Rank 0 writes summary.json, rank 1 (the last stage) metrics.jsonl: without --run-dir both
    // take the directory the launcher hands its processes.
    let dir = tempfile::tempdir().unwrap();
    let port = free_port_range(3).to_string();
    let launched = flotilla(
        &local_launch(
            "2",
            &port,
            &[
                "--set",
                "strategy.pipeline=true",
                "--set",
                "strategy.hybrid_configs.pp_degree=2",
                "--set",
                "train.steps=10",
            ],
        ),
        &[("FLOTILLA_RUN_DIR", dir.path().display().to_string())],
        120,
    );
    assert!(launched.success, "{}", launched.stderr);
    assert!(dir.path().join("summary.json").exists());
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 10);
    assert!(
        metrics.lines().all(|l| l.contains("\"bubble_fraction\":0.")),
        "{metrics}"
    );
}

/// `comm_time_ratio` and `exposed_comm_ratio` have one definition: the exposed share is the
/// part of communication time compute waited through, so it never exceeds it — in any line,
/// under any strategy. With `train.eval_every`, the lines of every 25th step and of the last
/// hold the held-out figures, the last ones the summary's.
#[test]
fn the_exposed_share_never_exceeds_the_communication_share() {
    let dir = tempfile::tempdir().unwrap();
    #[rustfmt::skip]
    let jobs: [(&str, &[&str]); 3] = [
        ("collective", &["--set", "train.steps=150", "--set", "train.eval_every=25"]),
        ("pipeline", &[
            "--set", "train.steps=60", "--set", "train.eval_every=25",
            "--set", "strategy.pipeline=true", "--set", "cluster.nproc_per_node=4",
            "--set", "strategy.hybrid_configs.dp_degree=2", "--set", "strategy.hybrid_configs.pp_degree=2",
            "--set", "strategy.pipeline_configs.accumulate_steps=4",
        ]),
        ("parameter_server", &["--config", "examples/ctr_ps.toml", "--set", "train.steps=60"]),
    ];
    for (name, settings) in jobs {
        let run_dir = dir.path().join(name);
        let args = [&["train", "--run-dir", run_dir.to_str().unwrap()], settings].concat();
        let finished = flotilla(&args, &[], 120);
        assert!(finished.success, "{name}: {}", finished.stderr);
        let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
        let mut lines = 0;
        let mut evaluated = Vec::new();
        for line in text.lines() {
            let m: Value = serde_json::from_str(line).unwrap();
            let (total, exposed) = (m["comm_time_ratio"].as_f64(), m["exposed_comm_ratio"].as_f64());
            let (total, exposed) = (total.unwrap(), exposed.unwrap());
            assert!((0.0..=total).contains(&exposed), "{name}: {line}");
            lines += 1;
            if let Some(eval) = m.get("eval") {
                evaluated.push((m["step"].as_u64().unwrap(), eval.clone()));
            }
        }
        assert!(lines >= 60, "{name}: {lines} lines");
        if name == "parameter_server" {
            assert!(evaluated.is_empty());
            continue;
        }
        let steps: Vec<u64> = evaluated.iter().map(|(step, _)| *step).collect();
        let want: Vec<u64> = if name == "collective" {
            vec![25, 50, 75, 100, 125, 150]
        } else {
            vec![25, 50, 60]
        };
        assert_eq!(steps, want, "{name}");
        let summary = read_summary(&run_dir);
        let last = &evaluated.last().unwrap().1;
        assert_eq!(last["accuracy"], summary["test_accuracy"], "{name}");
        assert_eq!(last["loss"], summary["test_loss"], "{name}");
        assert_eq!(last["samples"], summary["test_samples"], "{name}");
        let first = evaluated[0].1["loss"].as_f64().unwrap();
        assert!(
            last["loss"].as_f64().unwrap() < first,
            "{name}: the held-out loss falls"
        );
    }
}

/// A run's TensorBoard event files are read by TensorBoard itself (Python's `tensorboard`
/// package, as `tensorboard --logdir` reads them): a scalar per step for the loss, the same
/// values as `metrics.jsonl`.
#[test]
fn tensorboard_reads_the_runs_scalars() {
    if !common::python_imports(&["tensorboard"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let finished = flotilla(
        &[
            "train",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--set",
            "train.steps=30",
            "--set",
            "train.eval_every=10",
        ],
        &[],
        60,
    );
    assert!(finished.success, "{}", finished.stderr);
    let script = "import json, sys\n\
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
        events = EventAccumulator(sys.argv[1]); events.Reload()\n\
        print(json.dumps([[[s.step, s.value] for s in events.Scalars(tag)] for tag in ('loss', 'eval/accuracy')]))\n";
    let logdir = run_dir.join("tensorboard");
    let read = common::start_program("python3", &["-c", script, logdir.to_str().unwrap()], &[]).finish(60);
    assert!(read.success, "{}", read.stderr);
    let [losses, accuracies]: [Vec<(u64, f32)>; 2] = serde_json::from_str(read.stdout.trim()).unwrap();
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = metrics
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let scalars = |value: &dyn Fn(&Value) -> Option<f64>| -> Vec<(u64, f32)> {
        lines
            .iter()
            .filter_map(|m| Some((m["step"].as_u64().unwrap(), value(m)? as f32)))
            .collect()
    };
    assert_eq!(losses, scalars(&|m| m["loss"].as_f64()));
    let held_out = scalars(&|m| m.get("eval")?["accuracy"].as_f64());
    assert_eq!(held_out.iter().map(|(step, _)| *step).collect::<Vec<_>>(), [10, 20, 30]);
    assert_eq!(accuracies, held_out);
}
