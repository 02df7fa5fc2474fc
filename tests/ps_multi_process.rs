//! Parameter-server jobs as real processes on loopback, started by `flotilla launch-ps`, and
//! the errors a trainer gives when its servers are missing or misbehave.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{flotilla, free_port_range};
use flotilla::net::auth::{ClusterToken, Credentials};
use flotilla::ps::client::{PsClient, ShardLink};
use flotilla::ps::wire::Request;

#[test]
fn launch_ps_trains_the_ctr_job_to_the_expected_auc_and_servers_exit() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, trace) = (dir.path().join("run"), dir.path().join("trace"));
    let port = free_port_range(5).to_string();
    #[rustfmt::skip]
    let args = [
        "launch-ps", "--server_num", "2", "--worker_num", "2", "--started_port", &port, "--",
        "train", "--config", "examples/ctr_ps.toml", "--set", "train.steps=150",
        "--run-dir", run_dir.to_str().unwrap(), "--trace", trace.to_str().unwrap(),
    ];
    let finished = flotilla(&args, &[], 240);
    finished.assert_success("launch-ps failed");
    common::assert_says(&finished.stderr, "[server 1]", "servers ran");
    common::assert_says(
        &finished.stderr,
        "every trainer has left; shutting down",
        "servers shut down cleanly",
    );
    let summary: serde_json::Value = common::read_summary(&run_dir);
    assert_eq!(summary["mode"], "sync");
    assert_eq!(summary["cluster"], "multi-process");
    assert_eq!(
        (summary["trainers"].as_u64(), summary["servers"].as_u64()),
        (Some(2), Some(2))
    );
    let auc = summary["auc"].as_f64().unwrap();
    let ceiling = summary["planted_auc"].as_f64().unwrap();
    assert!(
        auc > 0.5 + 0.5 * (ceiling - 0.5),
        "AUC {auc} against the planted model's {ceiling}"
    );
    for shard in 0..2 {
        assert!(run_dir.join(format!("ps-shard-{shard}.safetensors")).exists());
    }
    // Trainer 0 reports every step; its trainers exchange no losses, so there is no spread.
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(Some(lines.len() as u64), summary["steps"].as_u64());
    for (index, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], index + 1);
        assert!(line["loss"].as_f64().is_some_and(f64::is_finite), "{line}");
        assert!(
            line["loss_spread"].is_null() && line["samples_per_sec"].as_f64() > Some(0.0),
            "{line}"
        );
    }
    servers_serve_each_push_while_its_trainer_waits_for_it(&trace);
}

/// On the merged clock, a server's handling of a push lies inside the trainer's push span: the
/// trainer sent it before and had its answer after.
fn servers_serve_each_push_while_its_trainer_waits_for_it(trace: &std::path::Path) {
    let merged = flotilla(&["trace", "merge", trace.to_str().unwrap()], &[], 60);
    assert!(merged.success, "{}", merged.stderr);
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(trace.join("trace.json")).unwrap()).unwrap();
    let tracks = common::trace_tracks(&trace);
    let tracks: Vec<(u64, &str)> = tracks.iter().map(|(pid, name)| (*pid, name.as_str())).collect();
    let names = [
        (0, "rank 0: server 0"),
        (1, "rank 1: server 1"),
        (2, "rank 2: trainer 0"),
        (3, "rank 3: trainer 1"),
    ];
    assert_eq!(tracks, names);
    let span = |pid: u64, name: &str| -> (f64, f64) {
        let found = common::trace_spans(&trace, pid, |n| n == name);
        *found
            .first()
            .unwrap_or_else(|| panic!("no span {name:?} on track {pid}"))
    };
    for step in [0, 75, 149] {
        for trainer in 0..2 {
            let (sent, answered) = span(2 + trainer, &format!("push {step}"));
            for server in 0..2 {
                let (start, end) = span(server, &format!("push of trainer {trainer} (step {step})"));
                assert!(
                    sent <= start && end <= answered,
                    "step {step}: server {server} handled trainer {trainer}'s push over {start}..{end} µs, \
                     outside the trainer's {sent}..{answered} µs"
                );
            }
        }
    }
}

#[test]
fn a_server_list_that_disagrees_with_server_num_is_a_config_error() {
    let finished = flotilla(
        &[
            "train",
            "--config",
            "examples/ctr_ps.toml",
            "--set",
            "cluster.pservers=[\"127.0.0.1:7001\"]",
        ],
        &[],
        30,
    );
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains("--set: cluster.pservers: lists 1 parameter servers but cluster.server_num = 2"),
        "{}",
        finished.stderr
    );
}

#[test]
fn an_unreachable_server_is_named_after_the_timeout() {
    let port = free_port_range(2);
    let servers = format!("[\"127.0.0.1:{port}\", \"127.0.0.1:{}\"]", port + 1);
    let set_servers = format!("cluster.pservers={servers}");
    let run_dir = tempfile::tempdir().unwrap();
    let finished = flotilla(
        &[
            "run",
            "--role",
            "trainer",
            "--config",
            "examples/ctr_ps.toml",
            "--set",
            &set_servers,
            "--set",
            "fault_tolerance.timeout_s=1",
        ],
        &[
            ("PADDLE_TRAINER_ID", "0".to_string()),
            ("FLOTILLA_RUN_DIR", run_dir.path().display().to_string()),
        ],
        30,
    );
    assert!(!finished.success);
    assert!(
        finished.stderr.contains(&format!(
            "parameter server 0 at 127.0.0.1:{port} did not accept a connection within 1"
        )),
        "{}",
        finished.stderr
    );
}

#[test]
fn a_server_that_drops_every_request_fails_the_call_after_the_retries() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    // Accepts and closes at once, so every attempt fails at the network level; for 10 s at most.
    listener.set_nonblocking(true).unwrap();
    let acceptor = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut accepted = 0;
        while accepted < 4 && std::time::Instant::now() < deadline {
            match listener.accept() {
                Ok((stream, _)) => {
                    drop(stream);
                    accepted += 1;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        accepted
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = runtime.block_on(async {
        let credentials = Credentials::new(ClusterToken::new(common::TEST_TOKEN).unwrap(), Duration::from_secs(5));
        let link = ShardLink::remote(endpoint.clone(), 1 << 20, credentials);
        let mut client = PsClient::new(vec![link], 3, Duration::from_secs(10));
        client
            .call_all(vec![Request::Leave { trainer: 0 }], "leave")
            .await
            .unwrap_err()
    });
    assert!(
        err.to_string().starts_with(&format!(
            "parameter server 0 at {endpoint} is unreachable: the leave failed after 3 retries"
        )),
        "{err}"
    );
    assert_eq!(acceptor.join().unwrap(), 4, "one attempt and three retries");
}

#[test]
fn pulls_and_pushes_in_pipelined_parts_reach_shard_processes_whole() {
    // 40 000 ids make three parts; the benchmark checks the parted pull against a whole one.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args([
            "bench", "ps", "--ids", "40000", "--widths", "8", "--shards", "1,2", "--iters", "1", "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().filter(|l| l.contains("\"op\"")).count(), 4, "{stdout}");
}
