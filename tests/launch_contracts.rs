//! Ranks started without our launcher, by the contracts other launchers use: each process reads
//! its rank, the job's size and the coordinator from torchrun's variables, and the job trains as
//! the in-process cluster does.

mod common;

use common::{config, free_port_range, start_flotilla, train_in_process};

const STEPS: &str = "train.steps=20";

#[test]
fn ranks_started_with_torchruns_variables_train_as_the_in_process_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port_range(1).to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let env = [
                ("RANK", rank.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("WORLD_SIZE", "2".to_string()),
                ("LOCAL_WORLD_SIZE", "2".to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.clone()),
                ("FLOTILLA_RUN_DIR", dir.path().display().to_string()),
            ];
            let args = ["run", "--role", "trainer", "--config", "config.toml", "--set", STEPS];
            start_flotilla(&args, &env)
        })
        .collect();
    for (rank, finished) in ranks.into_iter().map(|started| started.finish(120)).enumerate() {
        assert!(
            finished.success,
            "rank {rank}:\n{}\n{}",
            finished.stdout, finished.stderr
        );
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["world_size"], 2);
    assert_eq!(summary["cluster"], "multi-process");
    let simulated = train_in_process(config(&[STEPS]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

#[test]
fn paddles_and_torchruns_variables_that_disagree_are_refused_naming_both() {
    let args = ["run", "--role", "trainer", "--config", "config.toml", "--set", STEPS];
    let env = [
        ("RANK", "0".to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("PADDLE_TRAINERS_NUM", "4".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", "6170".to_string()),
    ];
    let finished = start_flotilla(&args, &env).finish(60);
    assert!(!finished.success);
    assert!(
        finished
            .stderr
            .contains("WORLD_SIZE: 2 contradicts PADDLE_TRAINERS_NUM = 4"),
        "{}",
        finished.stderr
    );
    let env = [("RANK", "1".to_string()), ("PADDLE_TRAINER_ID", "0".to_string())];
    let finished = start_flotilla(&args, &env).finish(60);
    assert!(!finished.success);
    assert!(
        finished.stderr.contains("RANK = 1 contradicts PADDLE_TRAINER_ID = 0"),
        "{}",
        finished.stderr
    );
}
