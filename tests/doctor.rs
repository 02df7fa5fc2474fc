//! `flotilla doctor` on temporary configs: a port in use, peers that never answer, stand-ins of
//! the CUDA driver, a healthy job and an unknown key. Network only on loopback.

mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use common::{flotilla, free_port_range, Finished};
use socket2::{Domain, Socket, Type};

/// A config file of a 2-rank job with these addresses, in a directory removed on drop.
struct JobFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn job_file(master: &str, endpoints: [&str; 2]) -> JobFile {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("job.toml");
    let text = format!(
        "[cluster]\nnproc_per_node = 2\nmaster = \"{master}\"\nendpoints = [\"{}\", \"{}\"]\n",
        endpoints[0], endpoints[1]
    );
    std::fs::write(&path, text).expect("write the config");
    JobFile { _dir: dir, path }
}

/// A job whose coordinator and two ranks take three free loopback ports from `base`.
fn loopback_job(base: u16) -> JobFile {
    job_file(
        &format!("127.0.0.1:{base}"),
        [&format!("127.0.0.1:{}", base + 1), &format!("127.0.0.1:{}", base + 2)],
    )
}

fn doctor(job: &JobFile, extra: &[&str]) -> Finished {
    let config = job.path.to_str().expect("utf-8 temp path");
    let args: Vec<&str> = ["doctor", "--config", config].iter().chain(extra).copied().collect();
    flotilla(&args, &[], 30)
}

/// The report's check lines (all but the count line at the end).
fn check_lines(run: &Finished) -> Vec<&str> {
    run.stdout.lines().filter(|l| l.starts_with('[')).collect()
}

fn failures(run: &Finished) -> Vec<&str> {
    run.stdout.lines().filter(|l| l.starts_with("[FAIL]")).collect()
}

#[test]
fn a_default_port_in_use_only_warns_as_a_whole_job_launcher_picks_free_ones() {
    // The coordinator's default port for a one-node launch: held here (or by someone else).
    let _held = TcpListener::bind("127.0.0.1:6170");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("job.toml");
    std::fs::write(&path, "[cluster]\nnproc_per_node = 2\n").expect("write the config");
    let job = JobFile { _dir: dir, path };
    let run = doctor(&job, &[]);
    let warning = check_lines(&run)
        .into_iter()
        .find(|line| line.starts_with("[WARN] port 127.0.0.1:6170 (cluster.master"));
    let warning = warning.unwrap_or_else(|| panic!("{}", run.stdout));
    assert!(
        warning.ends_with("a launcher that starts the whole job picks free ports instead; only with --started_port 6170 would it collide"),
        "{warning}"
    );
    assert!(
        failures(&run).iter().all(|line| !line.contains("6170")),
        "{}",
        run.stdout
    );
}

#[test]
fn a_port_in_use_fails_naming_the_key_and_the_process() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = taken.local_addr().expect("addr");
    let free = free_port_range(2);
    let job = job_file(
        &format!("127.0.0.1:{free}"),
        [&taken.to_string(), &format!("127.0.0.1:{}", free + 1)],
    );
    let run = doctor(&job, &[]);
    assert!(!run.success, "{}", run.stdout);
    let failed = failures(&run);
    assert_eq!(failed.len(), 1, "{}", run.stdout);
    // The test process holds the port; same user, so the doctor may read its descriptors.
    assert!(
        failed[0].starts_with(&format!(
            "[FAIL] port {taken} (cluster.endpoints[0]) is in use (pid {}, ",
            std::process::id()
        )),
        "{}",
        run.stdout
    );
    assert!(
        failed[0].ends_with("stop that process or choose another port (--set cluster.endpoints=[...])"),
        "{}",
        failed[0]
    );
    assert!(run.stderr.contains("1 of 9 checks failed"), "{}", run.stderr);
}

/// A loopback listener that never answers a connect, as a host behind a firewall that drops
/// packets: its backlog is 0, so its accept queue holds one connection (Linux admits one more
/// than the backlog); the test fills it, after which the kernel drops SYNs to it and a connect
/// times out.
struct SilentListener {
    addr: SocketAddr,
    _socket: Socket,
    _queued: Vec<TcpStream>,
}

fn silent_listener() -> SilentListener {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("bind");
    socket.listen(0).expect("listen");
    let addr = socket.local_addr().expect("addr").as_socket().expect("an IP address");
    let mut queued = Vec::new();
    for _ in 0..16 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(stream) => queued.push(stream),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return SilentListener {
                    addr,
                    _socket: socket,
                    _queued: queued,
                }
            }
            Err(e) => panic!("filling the accept queue of {addr}: {e}"),
        }
    }
    panic!("the accept queue of {addr} (backlog 0) still took connections after 16");
}

#[test]
fn peers_that_never_answer_fail_as_unreachable() {
    // 127.0.0.0/8 is all loopback on Linux: with --node-ip 127.0.0.2, 127.0.0.1 is another node.
    TcpListener::bind("127.0.0.2:0").expect("127.0.0.2 is a loopback address here");
    let silent: Vec<SilentListener> = (0..3).map(|_| silent_listener()).collect();
    let job = job_file(
        &silent[0].addr.to_string(),
        [&silent[1].addr.to_string(), &silent[2].addr.to_string()],
    );
    let run = doctor(&job, &["--node-ip", "127.0.0.2", "--connect-timeout-ms", "1000"]);
    assert!(!run.success, "{}", run.stdout);
    let failed = failures(&run);
    let keys = ["cluster.master", "cluster.endpoints[0]", "cluster.endpoints[1]"];
    assert_eq!(failed.len(), keys.len(), "{}", run.stdout);
    for ((line, key), listener) in failed.iter().zip(keys).zip(&silent) {
        assert_eq!(
            *line,
            format!(
                "[FAIL] peer {} ({key}) unreachable: no answer in 1.0s — check the address, routing and firewall",
                listener.addr
            )
        );
    }
}

#[test]
fn a_healthy_job_passes() {
    let base = free_port_range(3);
    let job = loopback_job(base);
    let run = doctor(&job, &[]);
    assert!(run.success, "{}\n{}", run.stdout, run.stderr);
    let lines = check_lines(&run);
    assert_eq!(lines.len(), 9, "{}", run.stdout);
    // The clock may warn in a container; nothing else should.
    for line in &lines {
        assert!(
            line.starts_with("[ OK ]") || line.starts_with("[WARN] clock: "),
            "{}",
            run.stdout
        );
    }
    let config = job.path.display();
    assert_eq!(
        lines[0],
        format!("[ OK ] config: {config} is valid (collective, 2 ranks on 1 node)")
    );
    assert_eq!(lines[1], format!("[ OK ] resolve cluster.master = 127.0.0.1:{base}"));
    assert_eq!(
        lines[5],
        format!("[ OK ] port 127.0.0.1:{} (cluster.endpoints[0]) is free", base + 1)
    );
    assert_eq!(lines[8], "[ OK ] device: cpu — no GPU libraries needed");
}

#[test]
fn an_unknown_key_fails_naming_it_and_stops() {
    let job = loopback_job(free_port_range(3));
    let run = doctor(&job, &["--set", "cluster.nproc_per_nod=2"]);
    assert!(!run.success);
    let lines = check_lines(&run);
    assert_eq!(lines.len(), 1, "{}", run.stdout);
    assert!(
        lines[0].starts_with("[FAIL] config: --set: cluster: unknown field `nproc_per_nod`"),
        "{}",
        lines[0]
    );

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("job.toml");
    std::fs::write(&path, "[train]\nstepz = 3\n").expect("write the config");
    let run = flotilla(&["doctor", "--config", path.to_str().expect("utf-8")], &[], 30);
    assert!(!run.success);
    assert_eq!(
        check_lines(&run)[0].split(", expected").next(),
        Some(format!("[FAIL] config: {}: train: unknown field `stepz`", path.display()).as_str()),
        "{}",
        run.stdout
    );
}

/// Builds a stand-in CUDA driver, `libcuda.so.1` from `source`, into a temporary directory.
fn fake_driver(source: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let c = dir.path().join("libcuda.c");
    std::fs::write(&c, source).expect("write the driver's source");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.path().join("libcuda.so.1"))
        .arg(&c)
        .status()
        .expect("cc runs (gcc is part of the toolchain this project builds with)");
    assert!(built.success(), "cc failed to build the stand-in driver");
    dir
}

/// The GPU check loads the driver it finds, counts its devices and reads its CUDA version:
/// against two stand-ins of `libcuda.so.1` (one with 2 devices and CUDA 12.4, one a link-time
/// stub) put first on the library path.
#[test]
fn the_gpu_check_asks_the_driver_it_finds() {
    let job = loopback_job(free_port_range(3));
    let config = job.path.to_str().expect("utf-8 temp path");
    let gpu_lines = |driver: &tempfile::TempDir| {
        let library_path = driver.path().to_str().expect("utf-8 temp path").to_string();
        let run = flotilla(
            &["doctor", "--config", config, "--set", "cluster.device=\"gpu\""],
            &[("LD_LIBRARY_PATH", library_path)],
            30,
        );
        check_lines(&run)
            .into_iter()
            .filter(|l| l.contains("libcuda") || l.contains("driver runs"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };

    let working = fake_driver(
        "int cuInit(unsigned flags) { return 0; }\n\
         int cuDeviceGetCount(int *count) { *count = 2; return 0; }\n\
         int cuDriverGetVersion(int *version) { *version = 12040; return 0; }\n",
    );
    let lines = gpu_lines(&working);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], "[ OK ] device: libcuda.so.1 loads; 2 CUDA device(s)");
    assert!(
        lines[1].starts_with("[WARN] device: the driver runs CUDA up to 12.4, older than the 13.0"),
        "{}",
        lines[1]
    );

    let stub = fake_driver(
        "int cuInit(unsigned flags) { return 34; }\n\
         int cuDeviceGetCount(int *count) { return 34; }\n\
         int cuDriverGetVersion(int *version) { return 34; }\n",
    );
    let lines = gpu_lines(&stub);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("[FAIL] device: the libcuda.so.1 found is a link-time stub"),
        "{}",
        lines[0]
    );
}

#[test]
fn data_files_that_are_not_there_fail_naming_the_key_and_the_file() {
    let job = loopback_job(free_port_range(3));
    let run = doctor(
        &job,
        &[
            "--set",
            "train.dataset=\"csv\"",
            "--set",
            "train.train_files=[\"data/digits/digits.csv\", \"nosuch.csv\"]",
        ],
    );
    assert!(!run.success, "{}", run.stdout);
    assert_eq!(
        failures(&run),
        ["[FAIL] data: no such file or directory: train.train_files: nosuch.csv"],
        "{}",
        run.stdout
    );
}

#[test]
fn a_click_log_without_a_column_its_schema_names_fails_naming_the_file_and_the_column() {
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("log.csv");
    std::fs::write(&log, "click,member\n1,a\n0,b\n").expect("the log");
    let path = dir.path().join("job.toml");
    let text = format!(
        "[cluster]\nserver_num = 1\nnproc_per_node = 1\n[train]\nmodel = \"wide_deep\"\ndataset = \"click_log\"\n\
         train_files = [{log:?}]\ntest_files = [{log:?}]\n[train.click_log]\nheader = true\nlabel = \"click\"\n\
         [[train.click_log.slots]]\ncolumn = \"user\"\n",
        log = log.display().to_string()
    );
    std::fs::write(&path, text).expect("write the config");
    let run = doctor(&JobFile { _dir: dir, path }, &[]);
    assert!(!run.success, "{}", run.stdout);
    let expected = format!(
        "[FAIL] data: {}: the slot 0 column \"user\" is not among the file's columns [\"click\", \"member\"]",
        log.display()
    );
    assert!(failures(&run).contains(&expected.as_str()), "{}", run.stdout);
}
