//! `flotilla train --resume RUN_DIR`: a run continues with its own configuration, the
//! `config.toml` it wrote into its directory as it started. `--set` may change how long and how
//! it runs (its length, checkpoints, logging, deadlines, endpoints), not what it trains: another
//! model, optimizer, learning rate, batch or strategy would make the resumed run a different
//! one under the old one's name. A finished run resumes only to train longer: resumed as it was,
//! it would train nothing and write its outputs over again.

use std::io::ErrorKind;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use toml::Value;

use super::outputs::{SEALED_CONFIG_FILE, SUMMARY_FILE};
use super::CONFIG_FILE;
use crate::config::{JobConfig, Strategy, TrainLength};

/// The keys a resumed run may change; every other one is refused.
pub const SAFE_TO_CHANGE: &[&str] = &[
    "train.steps",
    "train.epochs",
    "train.log_every",
    "strategy.check_every",
    "fault_tolerance.timeout_s",
    "fault_tolerance.retry",
    "fault_tolerance.checkpoint_every",
    "fault_tolerance.keep_checkpoints",
    "fault_tolerance.max_restarts",
    "fault_tolerance.heartbeat_interval_ms",
    "fault_tolerance.heartbeat_misses",
    "fault_tolerance.elastic_timeout_s",
    "cluster.master",
    "cluster.endpoints",
    "cluster.pservers",
    "cluster.max_frame_mb",
    "cluster.shared_memory",
];

/// The keys of a collective job's layout: its checkpoint holds one copy of the replica (sharded
/// optimizer states and split layers gathered whole), or of each pipeline stage, every parameter and optimizer slot
/// under its model name, and each rank reads its share of
/// the same global batches — so it resumes on any number of ranks that divides the global batch,
/// cut into any number of stages (the sums of a step are then associated differently).
const COLLECTIVE_LAYOUT: &[&str] = &[
    "cluster.nnodes",
    "cluster.min_nnodes",
    "cluster.nproc_per_node",
    "cluster.world_size",
    "strategy.use_hierarchical_allreduce",
    "strategy.pipeline",
    "strategy.hybrid_configs.pp_degree",
    "strategy.hybrid_configs.dp_degree",
    "strategy.hybrid_configs.mp_degree",
    "strategy.pipeline_configs.stage_boundaries",
    "strategy.pipeline_configs.virtual_pipeline_stages",
    "strategy.sharding",
    "strategy.sharding_configs.stage",
    "strategy.hybrid_configs.sharding_degree",
];

/// The keys of a parameter-server job's layout: its checkpoint holds every row by (table, id)
/// and the dense parameters in order — re-hashed onto any number of servers — and every trainer
/// reads its share of the same global batches, so it resumes on any number of trainers that
/// divides the global batch.
const PS_LAYOUT: &[&str] = &[
    "cluster.server_num",
    "cluster.nnodes",
    "cluster.min_nnodes",
    "cluster.nproc_per_node",
    "cluster.world_size",
];

/// The config of the run in `run_dir`, read with the environment `env` and the command line's
/// `overrides`, which may only change [`SAFE_TO_CHANGE`] keys — and the layout of the job
/// (`COLLECTIVE_LAYOUT`, `PS_LAYOUT`) — and must make a finished run longer.
pub fn resumed_config(run_dir: &Path, env: &dyn Fn(&str) -> Option<String>, overrides: &[String]) -> Result<JobConfig> {
    let path = run_dir.join(CONFIG_FILE);
    ensure!(
        path.is_file(),
        "--resume {}: no {CONFIG_FILE} there. --resume takes the directory of the run to continue \
         (train's --run-dir), where every run writes its config as it starts",
        run_dir.display()
    );
    // What the run trained as it started: its sealed copy (a run written before it had one: its
    // config.toml), so that an edit of config.toml is held to the same rule as --set.
    let sealed = run_dir.join(SEALED_CONFIG_FILE);
    let saved = JobConfig::from_file(if sealed.is_file() { &sealed } else { &path }, env, &[])?;
    let edited = JobConfig::from_file(&path, env, &[])?.leaves()?;
    let resumed = JobConfig::from_file(&path, env, overrides)?;
    let (before, after) = (saved.leaves()?, resumed.leaves()?);
    let unset = Value::String("unset".to_string());
    let parameter_servers = [&saved, &resumed].map(|config| config.resolved_strategy() == Strategy::ParameterServer);
    let reshards = parameter_servers == [false, false];
    let rehashes = parameter_servers == [true, true];
    let may_change = |key: &str| {
        SAFE_TO_CHANGE.contains(&key)
            || (reshards && COLLECTIVE_LAYOUT.contains(&key))
            || (rehashes && PS_LAYOUT.contains(&key))
    };
    let refused: Vec<String> = before
        .keys()
        .chain(after.keys())
        .filter(|key| !may_change(key.as_str()) && before.get(*key) != after.get(*key))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|key| {
            let (was, now) = (before.get(key).unwrap_or(&unset), after.get(key).unwrap_or(&unset));
            match edited.get(key) == after.get(key) && before.get(key) != edited.get(key) {
                true => format!("{key} was {was}, and {CONFIG_FILE} was edited to make it {now}"),
                false => format!("{key} was {was}, --set makes it {now}"),
            }
        })
        .collect();
    if !refused.is_empty() {
        bail!(
            "--resume {}: a resumed run trains what it trained, and here {}. Start a new run for that; a \
             resumed one may change only {}",
            run_dir.display(),
            refused.join("; "),
            SAFE_TO_CHANGE.join(", ")
                + if reshards {
                    ", and its layout (cluster.nnodes, cluster.nproc_per_node, the pipeline's degrees and stages, sharding)"
                } else if rehashes {
                    ", and its numbers of servers and trainers (cluster.server_num, cluster.nnodes, cluster.nproc_per_node)"
                } else {
                    ""
                }
        );
    }
    if let Some(finished) = finished_run(run_dir)? {
        let longer = match (saved.train.length(), resumed.train.length()) {
            (_, TrainLength::Steps(steps)) => steps > finished.steps,
            (TrainLength::Epochs(before), TrainLength::Epochs(after)) => after > before,
            // How many steps the epochs make depends on the data: the checkpoint it resumes
            // from is refused where it is past their end.
            (TrainLength::Steps(_), TrainLength::Epochs(_)) => true,
        };
        ensure!(
            longer,
            "--resume {}: that run finished at step {steps} ({SUMMARY_FILE} is there), so it has nothing \
             left to train; nothing was changed. Raise train.steps with --set train.steps=N (N > {steps}) \
             to train it on",
            run_dir.display(),
            steps = finished.steps
        );
    }
    Ok(resumed)
}

/// What a finished run's `summary.json` says of its length.
#[derive(Deserialize)]
struct Finished {
    /// The optimizer steps it trained.
    steps: usize,
}

/// The run in `run_dir`, where it finished: its summary is written last.
fn finished_run(run_dir: &Path) -> Result<Option<Finished>> {
    let path = run_dir.join(SUMMARY_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let finished = serde_json::from_str(&text).with_context(|| format!("{}: not a run's summary", path.display()))?;
    Ok(Some(finished))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir_with(config: &str) -> Result<tempfile::TempDir> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join(CONFIG_FILE), config)?;
        Ok(dir)
    }

    #[test]
    fn a_resumed_run_keeps_its_config_and_may_run_longer() -> Result<()> {
        let dir = run_dir_with("[train]\nlr = 0.5\nepochs = 2\n")?;
        let same = resumed_config(dir.path(), &|_| None, &[])?;
        assert_eq!((same.train.lr, same.train.epochs), (0.5, Some(2)));
        let longer = resumed_config(dir.path(), &|_| None, &["train.steps=40".to_string()])?;
        assert_eq!((longer.train.lr, longer.train.steps), (0.5, Some(40)));
        Ok(())
    }

    #[test]
    fn a_changed_learning_rate_or_model_is_named() -> Result<()> {
        let dir = run_dir_with("[train]\nlr = 0.5\n")?;
        let set = ["train.lr=0.1".to_string(), "train.hidden_sizes=[8]".to_string()];
        let refused = resumed_config(dir.path(), &|_| None, &set).unwrap_err().to_string();
        assert!(refused.contains("train.lr was 0.5, --set makes it 0.1"), "{refused}");
        assert!(
            refused.contains("train.hidden_sizes was [128], --set makes it [8]"),
            "{refused}"
        );
        Ok(())
    }

    #[test]
    fn an_edit_of_the_runs_config_is_held_to_the_rule_of_set() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let config = JobConfig::from_toml_str("[train]\nlr = 0.5\nsteps = 20\n", "test", &|_| None, &[])?;
        super::super::outputs::write_config(dir.path(), &config)?;
        let path = dir.path().join(CONFIG_FILE);
        let text = std::fs::read_to_string(&path)?;
        std::fs::write(
            &path,
            text.replace("lr = 0.5", "lr = 0.1").replace("steps = 20", "steps = 30"),
        )?;
        let refused = resumed_config(dir.path(), &|_| None, &[]).unwrap_err().to_string();
        assert!(
            refused.contains("train.lr was 0.5, and config.toml was edited to make it 0.1"),
            "{refused}"
        );
        assert!(
            !refused.contains("train.steps was"),
            "a longer run may be asked for there: {refused}"
        );
        std::fs::write(&path, text.replace("steps = 20", "steps = 30"))?;
        assert_eq!(resumed_config(dir.path(), &|_| None, &[])?.train.steps, Some(30));
        Ok(())
    }

    #[test]
    fn a_finished_run_resumes_only_to_train_longer() -> Result<()> {
        for (length, finished_at, same, longer) in [
            ("steps = 20", 20, "train.steps=20", "train.steps=21"),
            ("epochs = 2", 16, "train.epochs=2", "train.epochs=3"),
        ] {
            let dir = run_dir_with(&format!("[train]\n{length}\n"))?;
            resumed_config(dir.path(), &|_| None, &[])?;
            std::fs::write(
                dir.path().join(SUMMARY_FILE),
                format!("{{\"steps\": {finished_at}, \"cluster\": \"multi-process\"}}"),
            )?;
            for set in [vec![], vec![same.to_string()]] {
                let refused = resumed_config(dir.path(), &|_| None, &set).unwrap_err().to_string();
                assert!(
                    refused.contains(&format!("finished at step {finished_at}"))
                        && refused.contains("--set train.steps"),
                    "{refused}"
                );
            }
            resumed_config(dir.path(), &|_| None, &[longer.to_string()])?;
            resumed_config(dir.path(), &|_| None, &[format!("train.steps={}", finished_at + 1)])?;
        }
        Ok(())
    }

    #[test]
    fn a_directory_without_config_is_not_a_run() {
        let dir = tempfile::tempdir().unwrap();
        let refused = resumed_config(dir.path(), &|_| None, &[]).unwrap_err().to_string();
        assert!(refused.contains("no config.toml there"), "{refused}");
    }
}
