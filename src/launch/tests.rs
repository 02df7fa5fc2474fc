//! Tests of `launch`.

use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    launch: LaunchArgs,
}

fn args(line: &str) -> LaunchArgs {
    Cli::try_parse_from(std::iter::once("launch").chain(line.split_whitespace()))
        .expect("the launch line parses")
        .launch
}

#[test]
fn port_0_negative_counts_and_empty_node_ips_are_refused_naming_the_flag() {
    let refusal = |line: &str| {
        let parsed = Cli::try_parse_from(std::iter::once("launch").chain(line.split_whitespace()));
        parsed.err().expect("refused").to_string()
    };
    let port = refusal("--started_port 0 -- train");
    assert!(
        port.contains("--started_port") && port.contains("not in 1..=65535"),
        "{port}"
    );
    let count = refusal("--nproc_per_node -1 -- train");
    assert!(count.contains("'-1'") && count.contains("--nproc_per_node"), "{count}");
    let restarts = refusal("--max_restarts -3 -- train");
    assert!(
        restarts.contains("'-3'") && restarts.contains("--max_restarts"),
        "{restarts}"
    );
    let ips = refusal("--nnodes 3 --cluster_node_ips 127.0.0.1,,127.0.0.2 -- train");
    assert!(ips.contains("--cluster_node_ips"), "{ips}");
}

#[test]
fn nnodes_min_max_is_elastic_and_tells_the_ranks_its_minimum() -> anyhow::Result<()> {
    let launch = args("--nnodes 2:3 --node-rank 2 --master 10.0.0.1:1 -- train");
    assert_eq!(launch.nnodes, NodeRange { min: 2, max: 3 });
    let plan = launch.plan("flotilla".into())?;
    let env = |k: &str| plan[0].env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(env("PADDLE_NNODES").as_deref(), Some("3"));
    assert_eq!(env("FLOTILLA_MIN_NNODES").as_deref(), Some("2"));
    let fixed = args("--nnodes 2 --node-rank 1 --master 10.0.0.1:1 -- train").plan("flotilla".into())?;
    let min = fixed[0].env.iter().find(|(n, _)| n == "FLOTILLA_MIN_NNODES");
    assert_eq!(min.map(|(_, v)| v.as_str()), Some(""), "blank: not elastic");
    let parse = |text: &str| text.parse::<NodeRange>().unwrap_err().to_string();
    assert_eq!(parse("3:2"), "--nnodes 3:2: MIN is more than MAX");
    assert_eq!(parse("0:2"), "--nnodes 0:2: a job needs at least one node");
    assert!(parse("two").contains("\"two\" is not a number of nodes (N or MIN:MAX)"));
    Ok(())
}

#[test]
fn second_node_gets_global_ranks_and_paddle_env() -> anyhow::Result<()> {
    let plan = args("--nnodes 2 --nproc_per_node 2 --node_ip 10.0.0.2 --cluster_node_ips 10.0.0.1,10.0.0.2 -- train --config c.toml")
        .plan("flotilla".into())
        ?;
    assert_eq!(plan.iter().map(|c| c.rank).collect::<Vec<_>>(), vec![2, 3]);
    assert_eq!(plan[0].args, vec!["run", "--role", "trainer", "--config", "c.toml"]);
    let env = |k: &str| {
        plan[1]
            .env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(env("PADDLE_TRAINERS_NUM"), "4");
    assert_eq!(
        env("PADDLE_TRAINER_ENDPOINTS"),
        "10.0.0.1:6171,10.0.0.1:6172,10.0.0.2:6171,10.0.0.2:6172"
    );
    assert_eq!(env("PADDLE_CURRENT_ENDPOINT"), "10.0.0.2:6172");
    assert_eq!(env("PADDLE_MASTER"), "10.0.0.1:6170");
    assert_eq!(env("FLAGS_selected_gpus"), "1");
    // torchrun's names for the same.
    let torchrun = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ]
    .map(env);
    assert_eq!(torchrun, ["3", "1", "4", "2", "10.0.0.1", "6170"]);
    Ok(())
}

#[test]
fn nodes_named_by_index_get_the_coordinator_from_torchruns_or_paddles_flags() -> anyhow::Result<()> {
    let torchrun = "--nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 -- train";
    let plan = args(torchrun).plan("flotilla".into())?;
    assert_eq!(plan.iter().map(|c| c.rank).collect::<Vec<_>>(), vec![2, 3]);
    let env = |k: &str| plan[1].env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(env("PADDLE_MASTER").as_deref(), Some("10.0.0.1:29500"));
    assert_eq!(env("RANK").as_deref(), Some("3"));
    // Announced at the rendezvous instead; blank, so an inherited list does not count.
    assert_eq!(env("PADDLE_TRAINER_ENDPOINTS").as_deref(), Some(""));
    let paddle = args("--nnodes 2 --rank 0 --master 10.0.0.1:29500 --rdzv-endpoint 10.0.0.1:29500 -- train");
    assert_eq!(paddle.addresses()?.master, "10.0.0.1:29500");
    Ok(())
}

#[test]
fn flags_that_name_different_coordinators_or_an_unknown_one_are_refused() {
    let error = |line: &str| format!("{:#}", args(line).plan("f".into()).unwrap_err());
    assert_eq!(
        error("--nnodes 2 --node-rank 0 --master 10.0.0.1:1 --master-addr 10.0.0.2 --master-port 1 -- train"),
        "--master-addr:--master-port 10.0.0.2:1 contradicts --master 10.0.0.1:1"
    );
    assert!(error("--nnodes 2 --node-rank 1 -- train").contains("the coordinator's address must be given"));
    assert_eq!(
        error("--nnodes 2 --node-rank 2 --rdzv-endpoint 10.0.0.1:1 -- train"),
        "--node-rank 2 is outside --nnodes 2"
    );
    assert_eq!(
        error("--nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- train"),
        "--master-addr needs --master-port"
    );
    let standalone = args("--standalone --nnodes 2 -- train")
        .with_ports_chosen()
        .unwrap_err();
    assert_eq!(standalone.to_string(), "--standalone runs one node, but --nnodes is 2");
}

#[test]
fn torchruns_rendezvous_flags_name_the_coordinator_and_the_job() -> anyhow::Result<()> {
    let line = "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 -- train";
    let plan = args(line).plan("flotilla".into())?;
    let env = |k: &str| plan[0].env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(env("PADDLE_MASTER").as_deref(), Some("10.0.0.1:29400"));
    assert_eq!(env(JOB_ID_VAR).as_deref(), Some("job7"));
    let unnumbered = "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 -- train";
    let error = format!("{:#}", args(unnumbered).plan("f".into()).unwrap_err());
    assert!(error.contains("start the ranks with torchrun itself"), "{error}");
    let etcd = Cli::try_parse_from(["launch", "--rdzv-backend", "etcd", "--", "train"])
        .map(|_| ())
        .unwrap_err();
    assert!(
        etcd.to_string().contains("invalid value 'etcd' for '--rdzv_backend"),
        "{etcd}"
    );
    Ok(())
}

#[test]
fn paddles_log_dir_job_id_and_max_restart_flags() -> anyhow::Result<()> {
    let launch = args("--nproc_per_node 2 --log_dir logs --job_id nightly --max_restart 2 -- train");
    assert_eq!(launch.processes.max_restarts, Some(2));
    let mut plan = launch.plan("flotilla".into())?;
    let logs: Vec<_> = plan.iter().map(|c| c.log.clone()).collect();
    assert_eq!(logs, [Some("logs/workerlog.0".into()), Some("logs/workerlog.1".into())]);
    let job = |child: &ChildSpec| child.env.iter().find(|(k, _)| k == JOB_ID_VAR).map(|(_, v)| v.clone());
    assert_eq!(job(&plan[1]).as_deref(), Some("nightly"));
    recover_in_place(&mut plan, Some(2));
    assert_eq!(plan[0].name, "coordinator");
    assert_eq!(plan[0].log, Some("logs/coordinatorlog".into()));
    Ok(())
}

#[test]
fn paddles_devices_are_gpus_one_a_local_rank_and_count_the_ranks() -> anyhow::Result<()> {
    let err = args("--devices 0,1 --nproc_per_node 3 -- train")
        .plan("f".into())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "--devices 0,1 names 2 device(s), but --nproc_per_node is 3"
    );
    let planned = args("--gpus 2,3 -- train").plan("flotilla".into());
    if !cfg!(feature = "cuda") {
        let err = planned.unwrap_err();
        assert!(err.is::<Refusal>(), "{err:?}");
        assert_eq!(
            err.to_string(),
            "--devices 2,3 sets cluster.device = \"gpu\": built without CUDA support; rebuild with --features cuda"
        );
        return Ok(());
    }
    let env = |child: &ChildSpec, var: &str| {
        let value = child.env.iter().find(|(k, _)| k == var).map(|(_, v)| v.clone());
        value.unwrap_or_default()
    };
    let plan = planned?;
    let gpus: Vec<_> = plan.iter().map(|c| env(c, "FLAGS_selected_gpus")).collect();
    assert_eq!(gpus, ["2", "3"]);
    assert!(plan.iter().all(|c| env(c, DEVICE_VAR) == "gpu"));
    Ok(())
}

#[test]
fn paddles_run_mode_ps_is_a_parameter_server_launch() -> anyhow::Result<()> {
    let collective = args("--nproc_per_node 2 -- train");
    assert!(collective.parameter_servers()?.is_none());
    let ps = args("--run_mode ps --server_num 2 --trainer_num 3 --started_port 7000 -- train")
        .parameter_servers()?
        .expect("a parameter-server launch");
    let plan = ps.plan("flotilla".into())?;
    let names: Vec<_> = plan.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["server 0", "server 1", "trainer 0", "trainer 1", "trainer 2"]);
    // The servers' and trainers' flags say so without --run_mode.
    let listed = args("--servers 127.0.0.1:7000 --trainers 127.0.0.1:7001 -- train").parameter_servers()?;
    assert_eq!(
        listed.expect("a parameter-server launch").addresses()?.servers,
        ["127.0.0.1:7000"]
    );
    let error = |line: &str| args(line).parameter_servers().unwrap_err().to_string();
    assert_eq!(
        error("--run_mode collective --server_num 2 -- train"),
        "--server_num starts parameter servers, but --run_mode is collective"
    );
    assert!(error("--run_mode ps --nproc_per_node 2 --server_num 1 -- train")
        .starts_with("--nproc_per_node places collective ranks"),);
    Ok(())
}

#[test]
fn a_launcher_started_by_srun_on_each_node_takes_its_place_from_slurm() -> anyhow::Result<()> {
    let slurm = |procid: &'static str, tasks: &'static str| {
        move |var: &str| {
            let value = match var {
                "SLURM_PROCID" => procid,
                "SLURM_NTASKS" => tasks,
                "SLURM_STEP_NODELIST" => "node[1-2]",
                "SLURM_JOB_ID" => "42",
                "SLURM_STEP_ID" => "0",
                _ => return None,
            };
            Some(value.to_string())
        }
    };
    let launch = args("--nproc_per_node 2 -- train").placed_by_engine(&slurm("1", "2"))?;
    assert_eq!((launch.nnodes.max, launch.node_rank), (2, Some(1)));
    assert_eq!(launch.master_addr.as_deref(), Some("node1"));
    let plan = launch.plan("flotilla".into())?;
    assert_eq!(plan.iter().map(|c| c.rank).collect::<Vec<_>>(), [2, 3]);
    // Flags that place the node win; two launchers on one node are refused.
    let flagged = args("--node-rank 0 --master-addr a --master-port 1 -- train").placed_by_engine(&slurm("1", "2"))?;
    assert_eq!(flagged.node_rank, Some(0));
    let error = args("-- train")
        .placed_by_engine(&slurm("1", "4"))
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("the cluster engine started 2 launchers on this node"),
        "{error}"
    );
    let error = args("--nnodes 3 -- train")
        .placed_by_engine(&slurm("1", "2"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        error,
        "--nnodes 3 contradicts the cluster engine's 2 tasks (one launcher per node)"
    );
    Ok(())
}

#[test]
fn inconsistent_node_lists_are_rejected() {
    let err = args("--nnodes 2 --node_ip 127.0.0.1 --cluster_node_ips 127.0.0.1 -- train")
        .plan("f".into())
        .unwrap_err();
    assert!(err.to_string().contains("--nnodes is 2"), "{err}");
    let err = args("--node_ip 10.9.9.9 -- train").plan("f".into()).unwrap_err();
    assert!(err.to_string().contains("10.9.9.9"), "{err}");
}

#[test]
fn other_programs_run_as_given() -> anyhow::Result<()> {
    let plan = args("--nproc_per_node 1 -- ./my_job --flag").plan("flotilla".into())?;
    assert_eq!(plan[0].program, PathBuf::from("./my_job"));
    assert_eq!(plan[0].args, vec!["--flag"]);
    Ok(())
}
