//! Strangers at every listening port of a launched job while it starts: connections that stay
//! silent and connections that begin a handshake and stop, to the coordinator, to the ranks'
//! data endpoints (their rings and stage rings) and to the parameter-server shards. No stranger
//! may cost a real peer its connection: each job ends with the result of an undisturbed run.
//! And a process of another job that holds the same token cannot speak for a job's rank.

mod common;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{
    children_of, config, end_leftovers, flotilla, free_port_range, start_flotilla, train_in_process, trainer_ranks,
    wait_for_training, PIPELINE_2X2,
};
use flotilla::config::JobConfig;
use flotilla::job::ps::ParameterServerJob;
use flotilla::job::RunOptions;
use flotilla::net::auth::{ClusterToken, Credentials};
use flotilla::net::ControlBus;

/// Connections a crowd keeps open at each port.
const PER_PORT: usize = 3;
/// The longest a crowd stays (the jobs below start well within it).
const CROWD_FOR: Duration = Duration::from_secs(60);

/// Strangers opening [`PER_PORT`] connections at each of `ports` on loopback as soon as it
/// listens, and holding them open until they leave (a stranger that closes its connection would
/// free the endpoint it holds); every third begins the handshake (`FLOTAUTH`) and stops.
/// Leaves when dropped.
struct Crowd {
    leave: Arc<AtomicBool>,
    thread: Option<JoinHandle<usize>>,
}

impl Crowd {
    fn at(ports: std::ops::Range<u16>) -> Self {
        let leave = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let leave = leave.clone();
            move || {
                let deadline = Instant::now() + CROWD_FOR;
                let mut open: Vec<Vec<TcpStream>> = ports.clone().map(|_| Vec::new()).collect();
                let mut arrivals = 0;
                while !leave.load(Ordering::Relaxed) && Instant::now() < deadline {
                    for (port, held) in ports.clone().zip(&mut open) {
                        if held.len() < PER_PORT {
                            if let Ok(mut stream) = stranger_to(port) {
                                arrivals += 1;
                                if arrivals % 3 == 0 {
                                    let _ = stream.write_all(b"FLOTAUTH");
                                }
                                held.push(stream);
                            }
                        }
                    }
                    // Ports still closed are tried every millisecond: a stranger must be able
                    // to arrive between a rank's bind and its neighbour's connection.
                    let waiting = open.iter().any(|held| held.len() < PER_PORT);
                    std::thread::sleep(Duration::from_millis(if waiting { 1 } else { 20 }));
                }
                arrivals
            }
        });
        Self {
            leave,
            thread: Some(thread),
        }
    }

    /// Sends the crowd away; how many connections it made.
    fn leave(mut self) -> usize {
        self.leave.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().expect("the crowd's thread"))
    }
}

/// A connection to `port` on 127.0.0.1 from 127.0.0.2: a stranger's own port then never takes
/// one of the job's (the job binds 127.0.0.1 only).
fn stranger_to(port: u16) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    socket.bind(&SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 0)).into())?;
    socket.connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)).into(),
        Duration::from_millis(50),
    )?;
    Ok(socket.into())
}

impl Drop for Crowd {
    fn drop(&mut self) {
        self.leave.store(true, Ordering::Relaxed);
    }
}

/// Launches `launcher` (its arguments before `--started_port`) on `ports` ports, `listening` of
/// which its processes listen on, with a crowd at all of them, training `config_file` with
/// `settings`; the summary of the run.
fn launch_among_strangers(
    launcher: &[&str],
    (ports, listening): (u16, usize),
    config_file: &str,
    settings: &[&str],
) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let first = free_port_range(ports);
    let crowd = Crowd::at(first..first + ports);
    let port = first.to_string();
    let mut args = launcher.to_vec();
    #[rustfmt::skip]
    args.extend(["--started_port", &port, "--", "train", "--config", config_file, "--run-dir", run_dir.to_str().unwrap()]);
    for set in settings {
        args.extend(["--set", set]);
    }
    let finished = flotilla(&args, &[], 180);
    let arrivals = crowd.leave();
    finished.assert_success(&format!("the job did not survive {arrivals} strangers"));
    assert!(
        arrivals >= PER_PORT * listening,
        "only {arrivals} strangers arrived at {listening} listening ports"
    );
    common::read_summary(&run_dir)
}

#[test]
fn a_data_parallel_job_among_strangers_ends_as_an_undisturbed_one() {
    for transport in ["cluster.shared_memory=true", "cluster.shared_memory=false"] {
        let settings = ["train.steps=30", transport];
        let summary = launch_among_strangers(&["launch", "--nproc_per_node", "2"], (3, 3), "config.toml", &settings);
        let undisturbed = train_in_process(config(&settings));
        assert_eq!(
            summary["param_checksum"],
            undisturbed.summary.param_checksum.as_str(),
            "{transport}"
        );
    }
}

#[test]
fn a_pipeline_job_among_strangers_ends_as_an_undisturbed_one() {
    let mut settings = PIPELINE_2X2.to_vec();
    settings.push("train.steps=10");
    let summary = launch_among_strangers(&["launch", "--nproc_per_node", "4"], (5, 5), "config.toml", &settings);
    let undisturbed = train_in_process(config(&settings));
    assert_eq!(summary["param_checksum"], undisturbed.summary.param_checksum.as_str());
}

#[test]
fn a_parameter_server_job_among_strangers_ends_as_an_undisturbed_one() {
    let settings = ["train.steps=60"];
    let launcher = ["launch-ps", "--server_num", "2", "--worker_num", "2"];
    // Two shards and the coordinator listen; the trainers' endpoints are only named.
    let summary = launch_among_strangers(&launcher, (5, 3), "examples/ctr_ps.toml", &settings);
    let config = JobConfig::from_file("examples/ctr_ps.toml".as_ref(), &|_| None, &settings.map(String::from)).unwrap();
    let reference_dir = tempfile::tempdir().unwrap();
    let undisturbed = ParameterServerJob::builtin(config)
        .unwrap()
        .run_simulated(&RunOptions::new(reference_dir.path()))
        .unwrap();
    // Sync mode: the same pushes in the same order on every shard, so the same figures exactly.
    assert_eq!(summary["auc"].as_f64().unwrap(), undisturbed.auc);
    assert_eq!(summary["final_loss"].as_f64().unwrap() as f32, undisturbed.final_loss);
}

/// Heartbeats for `rank` to the coordinator at `master` every 100 ms, as a process of another
/// job that shares the token would send them, until `stop` (at most 60 s); how many were
/// answered as alive.
fn heartbeat_as_another_job(master: String, token: &str, rank: usize, stop: Arc<AtomicBool>) -> JoinHandle<usize> {
    let credentials = Credentials::new(ClusterToken::new(token).expect("token"), Duration::from_secs(2));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let (deadline, mut answered) = (Instant::now() + CROWD_FOR, 0);
            let mut line = None;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                if line.is_none() {
                    line = ControlBus::connect(&master, Duration::from_secs(1), 1 << 20, &credentials)
                        .await
                        .ok();
                }
                if let Some(bus) = line.as_mut() {
                    match bus.heartbeat(rank, None, Duration::from_secs(1)).await {
                        Ok(Ok(_)) => answered += 1,
                        _ => line = None,
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            answered
        })
    })
}

#[test]
fn a_process_of_another_job_with_the_same_token_cannot_keep_a_stalled_rank_alive() {
    const TOKEN: &str = "one token that two jobs on this host share";
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let port = free_port_range(3);
    let started_port = port.to_string();
    #[rustfmt::skip]
    let mut args = vec!["launch", "--nproc_per_node", "2", "--started_port", &started_port, "--", "train", "--run-dir", run_dir.to_str().unwrap()];
    for set in [
        "train.steps=1000000",
        "fault_tolerance.heartbeat_interval_ms=200",
        "fault_tolerance.heartbeat_misses=5",
        "fault_tolerance.timeout_s=60",
        "fault_tolerance.max_restarts=0",
    ] {
        args.extend(["--set", set]);
    }
    let job = start_flotilla(&args, &[("FLOTILLA_TOKEN", TOKEN.to_string())]);
    let launcher = job.child.id();
    wait_for_training(&run_dir);
    let stop = Arc::new(AtomicBool::new(false));
    let intruder = heartbeat_as_another_job(format!("127.0.0.1:{port}"), TOKEN, 1, stop.clone());
    let processes = children_of(launcher);
    // SAFETY: rank 1's pid, a child of the launcher this test started.
    unsafe {
        libc::kill(trainer_ranks(launcher)[&1], libc::SIGSTOP);
    }
    let finished = job.finish(120);
    stop.store(true, Ordering::Relaxed);
    let answered = intruder.join().expect("the intruder's thread");
    end_leftovers(processes);
    assert!(!finished.success, "the job went on with a stalled rank");
    assert_eq!(answered, 0, "another job's heartbeats for rank 1 were taken");
    common::assert_says(
        &finished.stderr,
        "rank 1 declared dead: no heartbeat for",
        "the stalled rank was not found by its heartbeats",
    );
}
