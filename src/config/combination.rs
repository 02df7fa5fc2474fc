//! Rules across sections: which models, data sets and optimizers each strategy trains, so a
//! mismatch is a config error naming the key rather than a failure deep inside a run.

use super::amp::check_amp;
use super::sharding::check_sharding;
use super::sparse_tables::check_sparse_tables;
use super::tensor_parallel::check_tensor_parallel;
use super::{
    DatasetKind, FieldError, HybridConfigs, JobConfig, LrSchedule, ModelKind, OptimizerKind, PipelineConfigs, PsMode,
    RecoveryMode,
};

/// Checks that strategy, model, data set and optimizer fit together.
pub(super) fn check(config: &JobConfig) -> Result<(), FieldError> {
    let train = &config.train;
    check_tensor_parallel(config)?;
    check_pipeline(config)?;
    check_sharding(config)?;
    check_amp(config)?;
    check_checkpoints(config)?;
    check_hierarchical_allreduce(config)?;
    check_elastic(config)?;
    check_data_layout(config)?;
    if config.cluster.is_parameter_server() {
        check_parameter_server(config)?;
    } else {
        check_collective(config)?;
    }
    let dataset = dataset_name(train.dataset);
    match (train.model, train.dataset) {
        (m, d) if m.is_sparse() && !d.is_click_log() => Err(FieldError::new(
            "train.dataset",
            format!(
                "{dataset} is not click logs: the {} model reads \"criteo_synthetic\", \"criteo\" or \"click_log\"",
                m.name()
            ),
        )),
        (ModelKind::Mlp, d) if d.is_click_log() => Err(FieldError::new(
            "train.dataset",
            format!(
                "{dataset} is click logs, which the mlp model cannot read: use model = \"wide_deep\" or \"deepfm\""
            ),
        )),
        (ModelKind::Gpt, d) if d != DatasetKind::Text => Err(FieldError::new(
            "train.dataset",
            format!("{dataset} is not text: the gpt model reads dataset = \"text\""),
        )),
        (ModelKind::Mlp | ModelKind::WideDeep | ModelKind::DeepFm | ModelKind::Custom, DatasetKind::Text) => {
            Err(FieldError::new("train.dataset", "\"text\" is read by model = \"gpt\""))
        }
        _ => {
            train.gpt.check()?;
            check_click_log(train)?;
            check_files(config)
        }
    }
}

/// A hierarchical all-reduce asked for needs a data-parallel ring over several nodes of several
/// ranks.
fn check_hierarchical_allreduce(config: &JobConfig) -> Result<(), FieldError> {
    if config.strategy.use_hierarchical_allreduce != Some(true) {
        return Ok(());
    }
    let key = "strategy.use_hierarchical_allreduce";
    let (nodes, per_node) = (config.cluster.nnodes, config.cluster.nproc_per_node);
    if config.cluster.is_parameter_server() {
        Err(FieldError::new(
            key,
            "parameter servers do not all-reduce: it applies to collective jobs",
        ))
    } else if config.strategy.pipeline {
        Err(FieldError::new(
            key,
            "a pipeline's data-parallel rings are flat: it applies to data-parallel jobs",
        ))
    } else if nodes < 2 || per_node < 2 {
        Err(FieldError::new(
            key,
            format!("needs several nodes of several ranks, but cluster.nnodes = {nodes} and cluster.nproc_per_node = {per_node}"),
        ))
    } else {
        Ok(())
    }
}

/// Elastic membership changes the number of data-parallel replicas (a parameter-server job's
/// trainers; its servers are replaced, never dropped): recovering in place (a pipeline's nodes
/// must hold whole replicas), with a global batch every possible number of replicas divides (it
/// is re-split, never changed, so the learning rate stays that of the global batch).
fn check_elastic(config: &JobConfig) -> Result<(), FieldError> {
    let Some(min) = config.cluster.min_nnodes else {
        return Ok(());
    };
    let key = "cluster.min_nnodes";
    if config.fault_tolerance.recovery == Some(RecoveryMode::Restart) {
        return Err(FieldError::new(
            key,
            "elastic membership goes on with the surviving processes: it needs fault_tolerance.recovery = \"in_place\"",
        ));
    }
    let strategy = &config.strategy;
    let (batch, per_node) = (config.train.batch_size, config.cluster.nproc_per_node);
    let (stages, micro_batches) = match strategy.pipeline {
        true => (
            strategy.hybrid_configs.pp_degree,
            strategy.pipeline_configs.accumulate_steps,
        ),
        false => (1, 1),
    };
    if !per_node.is_multiple_of(stages) {
        return Err(FieldError::new(
            key,
            format!(
                "a node comes and goes whole, so it must hold whole pipeline replicas: cluster.nproc_per_node = \
                 {per_node} is not a multiple of strategy.hybrid_configs.pp_degree = {stages}"
            ),
        ));
    }
    for nodes in min..=config.cluster.nnodes {
        let replicas = nodes * per_node / stages;
        if !batch.is_multiple_of(replicas) || !(batch / replicas).is_multiple_of(micro_batches) {
            return Err(FieldError::new(
                key,
                format!(
                    "the job may train on {nodes} node(s) of {per_node} rank(s), but train.batch_size = {batch} does not \
                     divide by {replicas} replica(s) × {micro_batches} micro-batch(es): the global batch is re-split \
                     over the replicas, never changed"
                ),
            ));
        }
    }
    Ok(())
}

/// A checkpoint holds optimizer state, not half-merged gradients, so it is taken where a merge
/// has just completed — and in geo mode where the trainers have just pushed their local steps.
fn check_checkpoints(config: &JobConfig) -> Result<(), FieldError> {
    let (every, k) = (config.fault_tolerance.checkpoint_every, config.strategy.merge_steps());
    if let (true, true, PsMode::Geo { k_steps }) = (
        every > 0,
        config.cluster.is_parameter_server(),
        config.strategy.ps_mode(),
    ) {
        if !every.is_multiple_of(k_steps) {
            return Err(FieldError::new(
                "fault_tolerance.checkpoint_every",
                format!("{every} is not a multiple of strategy.a_sync_configs.k_steps = {k_steps}: a geo checkpoint must fall where the trainers push"),
            ));
        }
    }
    if every > 0 && !every.is_multiple_of(k) {
        return Err(FieldError::new(
            "fault_tolerance.checkpoint_every",
            format!("{every} is not a multiple of strategy.gradient_merge_configs.k_steps = {k}: a checkpoint must fall where a merge completes"),
        ));
    }
    Ok(())
}

fn check_parameter_server(config: &JobConfig) -> Result<(), FieldError> {
    let train = &config.train;
    let servers = config.cluster.server_num;
    if !train.model.is_sparse() {
        return Err(FieldError::new(
            "train.model",
            format!(
                "the parameter-server strategy (cluster.server_num = {servers}) trains \"wide_deep\" or \
                 \"deepfm\"; dense models train with the collective strategy (cluster.server_num = 0)"
            ),
        ));
    }
    if train.optimizer == OptimizerKind::Adamw {
        return Err(FieldError::new(
            "train.optimizer",
            "\"adamw\" is not a parameter-server optimizer: use \"sgd\", \"adagrad\" or \"adam\"",
        ));
    }
    if train.warmup_steps > 0 {
        return Err(FieldError::new(
            "train.warmup_steps",
            format!(
                "{}: the parameter servers apply a constant learning rate; set 0",
                train.warmup_steps
            ),
        ));
    }
    if train.lr_schedule != LrSchedule::Constant {
        return Err(FieldError::new(
            "train.lr_schedule",
            "the parameter servers apply a constant learning rate: leave it \"constant\"",
        ));
    }
    if train.grad_clip_norm > 0.0 {
        return Err(FieldError::new(
            "train.grad_clip_norm",
            "the parameter servers apply each push as it comes: gradient clipping is for the collective strategy",
        ));
    }
    if train.eval_every > 0 {
        return Err(FieldError::new(
            "train.eval_every",
            "a parameter-server job scores its held-out logs at the end (AUC); periodic evaluation is for the collective and pipeline strategies",
        ));
    }
    for (set, key) in [
        (config.strategy.recompute, "strategy.recompute"),
        (config.strategy.gradient_merge, "strategy.gradient_merge"),
    ] {
        if set {
            return Err(FieldError::new(
                key,
                "applies to dense models trained collectively or in a pipeline, not to the parameter-server strategy",
            ));
        }
    }
    if train.weight_decay > 0.0 {
        return Err(FieldError::new(
            "train.weight_decay",
            format!(
                "{}: the parameter servers' optimizers have no weight decay; set 0",
                train.weight_decay
            ),
        ));
    }
    check_sparse_tables(&config.strategy.sparse_table_configs)
}

/// Collective data parallelism trains dense models with replica-side optimizers.
fn check_collective(config: &JobConfig) -> Result<(), FieldError> {
    let train = &config.train;
    if let Some(table) = config.strategy.sparse_table_configs.keys().next() {
        return Err(FieldError::new(
            format!("strategy.sparse_table_configs.{table}"),
            "sparse tables live on parameter servers: set cluster.server_num",
        ));
    }
    if config.strategy.sparse_pass_steps > 0 {
        return Err(FieldError::new(
            "strategy.sparse_pass_steps",
            "passes shrink the parameter servers' sparse tables: set cluster.server_num",
        ));
    }
    if train.model.is_sparse() {
        return Err(FieldError::new(
            "train.model",
            format!(
                "\"{}\" trains on parameter servers: set cluster.server_num (or start the job with \
                 `flotilla launch-ps`)",
                train.model.name()
            ),
        ));
    }
    if train.init_tables_from.is_some() {
        return Err(FieldError::new(
            "train.init_tables_from",
            "parameter-server tables to start from, but this is a collective job (cluster.server_num = 0)",
        ));
    }
    if matches!(train.optimizer, OptimizerKind::Adagrad | OptimizerKind::Adam) {
        return Err(FieldError::new(
            "train.optimizer",
            "adagrad and adam run on parameter servers; the collective strategy has \"sgd\" and \"adamw\"",
        ));
    }
    if config.strategy.a_sync {
        return Err(FieldError::new(
            "strategy.a_sync",
            "applies to the parameter-server strategy: set cluster.server_num",
        ));
    }
    Ok(())
}

/// Pipeline keys take effect only with `strategy.pipeline = true`, and then must fit the world
/// and the batch.
fn check_pipeline(config: &JobConfig) -> Result<(), FieldError> {
    let strategy = &config.strategy;
    if !strategy.pipeline {
        let hybrid = &strategy.hybrid_configs;
        // Sharding's and tensor parallelism's degrees are checked with their keys; plain data
        // parallelism's replicas are every rank (`dp_degree` left 1 or the world size).
        let split = strategy.sharding || hybrid.mp_degree > 1;
        let replicas = split || hybrid.dp_degree == config.world_size();
        let sharded_only = HybridConfigs {
            sharding_degree: hybrid.sharding_degree,
            mp_degree: hybrid.mp_degree,
            dp_degree: if replicas { hybrid.dp_degree } else { 1 },
            ..HybridConfigs::default()
        };
        if *hybrid != sharded_only || strategy.pipeline_configs != PipelineConfigs::default() {
            return Err(FieldError::new(
                "strategy.pipeline",
                "pipeline_configs / hybrid_configs are set but strategy.pipeline is false: set it to true",
            ));
        }
        return Ok(());
    }
    if config.train.grad_clip_norm > 0.0 {
        return Err(FieldError::new(
            "train.grad_clip_norm",
            "not supported with strategy.pipeline yet: the global norm spans every stage's gradients, and stages \
             share no collective",
        ));
    }
    if config.cluster.is_parameter_server() {
        return Err(FieldError::new(
            "strategy.pipeline",
            "pipelines run collectively; a parameter-server job (cluster.server_num > 0) cannot pipeline",
        ));
    }
    strategy
        .pipeline_configs
        .check(&strategy.hybrid_configs, config.world_size(), config.train.batch_size)
}

/// Click logs are cut into at least one part, and the batch into equal shares of them; CSV and
/// Parquet tables may be (then they are streamed, and hold out files); other data sets are not
/// read in parts.
fn check_data_layout(config: &JobConfig) -> Result<(), FieldError> {
    let train = &config.train;
    let streamed_table = train.dataset.is_table() && train.data_parts.is_some();
    if !train.dataset.is_click_log() && !streamed_table {
        let only = |key: &str| {
            FieldError::new(
                key,
                format!(
                    "only click logs (\"criteo\", \"criteo_synthetic\") and tables streamed in parts (\"csv\", \"parquet\", \
                     \"arrays\" with train.data_parts) are read in parts and windows; {} is not",
                    dataset_name(train.dataset)
                ),
            )
        };
        return match (train.data_parts, train.shuffle_buffer) {
            (Some(_), _) => Err(only("train.data_parts")),
            (None, 0) => Ok(()),
            (None, _) => Err(only("train.shuffle_buffer")),
        };
    }
    if streamed_table && train.test_files.is_empty() {
        return Err(FieldError::new(
            "train.test_files",
            "a table streamed in parts (train.data_parts) holds out files, not a fraction of its rows",
        ));
    }
    let parts = train.data_parts(config.world_size());
    if parts == 0 {
        return Err(FieldError::new(
            "train.data_parts",
            "0 parts: the data needs at least 1",
        ));
    }
    if !train.batch_size.is_multiple_of(parts) {
        return Err(FieldError::new(
            "train.data_parts",
            format!(
                "the global batch of {} records does not divide into {parts} equal shares, one per part",
                train.batch_size
            ),
        ));
    }
    Ok(())
}

/// Dataset `click_log` needs its columns, which no other dataset reads.
fn check_click_log(train: &super::TrainConfig) -> Result<(), FieldError> {
    match (&train.click_log, train.dataset) {
        (Some(schema), DatasetKind::ClickLog) => schema.check(),
        (None, DatasetKind::ClickLog) => Err(FieldError::new(
            "train.click_log",
            "dataset \"click_log\" needs the logs' columns: [train.click_log] with a label, dense columns and [[train.click_log.slots]]",
        )),
        (Some(_), other) => Err(FieldError::new(
            "train.click_log",
            format!("describes the columns of dataset \"click_log\", not of {}", dataset_name(other)),
        )),
        (None, _) => Ok(()),
    }
}

/// Data sets `criteo`, `click_log`, `csv` and `parquet` need their files.
fn check_files(config: &JobConfig) -> Result<(), FieldError> {
    let train = &config.train;
    if train.dataset.is_table() {
        if train.train_files.is_empty() {
            return Err(FieldError::new(
                "train.train_files",
                format!("dataset {} needs at least one file here", dataset_name(train.dataset)),
            ));
        }
        return Ok(());
    }
    if !matches!(train.dataset, DatasetKind::Criteo | DatasetKind::ClickLog) {
        return Ok(());
    }
    for (key, files) in [
        ("train.train_files", &train.train_files),
        ("train.test_files", &train.test_files),
    ] {
        if files.is_empty() {
            return Err(FieldError::new(
                key,
                format!("dataset {} needs at least one file here", dataset_name(train.dataset)),
            ));
        }
    }
    Ok(())
}

/// The data set's name as written in the config.
fn dataset_name(dataset: DatasetKind) -> &'static str {
    match dataset {
        DatasetKind::Digits => "\"digits\"",
        DatasetKind::Synthetic => "\"synthetic\"",
        DatasetKind::CriteoSynthetic => "\"criteo_synthetic\"",
        DatasetKind::Criteo => "\"criteo\"",
        DatasetKind::ClickLog => "\"click_log\"",
        DatasetKind::Text => "\"text\"",
        DatasetKind::Csv => "\"csv\"",
        DatasetKind::Parquet => "\"parquet\"",
        DatasetKind::Arrays => "\"arrays\"",
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_str};
    use crate::config::PsMode;

    const CTR: &str = "[cluster]\nserver_num = 2\n[train]\nmodel = \"wide_deep\"\ndataset = \"criteo_synthetic\"\n\
                       optimizer = \"adam\"\nlr = 0.001\n";

    #[test]
    fn the_ctr_job_loads_with_wide_deep_defaults() {
        let config = load_str(CTR).unwrap();
        assert!(config.cluster.is_parameter_server());
        assert_eq!(config.train.hidden_sizes(), vec![256, 128, 64]);
        assert_eq!(config.train.embedding_dim, 9);
    }

    #[test]
    fn click_logs_are_cut_into_parts_that_divide_the_batch() {
        let with = |train: &str| {
            load_str(&format!(
                "[cluster]\nserver_num = 2\nnproc_per_node = 2\n[train]\nmodel = \"wide_deep\"\n\
                 dataset = \"criteo_synthetic\"\nbatch_size = 96\n{train}"
            ))
        };
        let ctr = with("").unwrap();
        assert_eq!(ctr.train.data_parts, Some(2), "kept in the resolved config");
        let resumed = crate::config::JobConfig::from_toml_str(
            &ctr.to_toml_string().unwrap(),
            "run",
            &|_| None,
            &["cluster.nproc_per_node=1".into()],
        );
        assert_eq!(
            resumed.unwrap().train.data_parts,
            Some(2),
            "a run resumed on one trainer keeps the cut"
        );
        let err = |train: &str| err_text(with(train));
        assert!(err("data_parts = 64").contains("train.data_parts: the global batch of 96 records does not divide"));
        assert!(err("data_parts = 0").contains("train.data_parts: 0 parts"));
        assert_eq!(
            with("data_parts = 3").unwrap().train.data_parts,
            Some(3),
            "trainers may share parts"
        );
        assert!(err("shuffle_buffer = -1").contains("train.shuffle_buffer"));
        let digits = err_text(load_str("[train]\ndata_parts = 2\n"));
        assert!(digits.contains("train.data_parts: only click logs"), "{digits}");
        let digits = err_text(load_str("[train]\nshuffle_buffer = 8\n"));
        assert!(digits.contains("train.shuffle_buffer: only click logs"), "{digits}");
    }

    #[test]
    fn tables_given_parts_are_streamed_and_hold_out_files() {
        let table = |dataset: &str, rest: &str| {
            load_str(&format!(
                "[train]\ndataset = \"{dataset}\"\ntrain_files = [\"t\"]\nbatch_size = 64\n{rest}"
            ))
        };
        let streamed = table("csv", "data_parts = 4\nshuffle_buffer = 100\ntest_files = [\"h\"]\n").unwrap();
        assert_eq!(
            (streamed.train.data_parts, streamed.train.shuffle_buffer),
            (Some(4), 100)
        );
        assert_eq!(
            table("parquet", "").unwrap().train.data_parts,
            None,
            "read whole by default"
        );
        let no_held_out = err_text(table("csv", "data_parts = 4\n"));
        assert!(
            no_held_out.contains("train.test_files: a table streamed in parts"),
            "{no_held_out}"
        );
        let uneven = err_text(table("parquet", "data_parts = 3\ntest_files = [\"h\"]\n"));
        assert!(uneven.contains("train.data_parts: the global batch of 64"), "{uneven}");
        let arrays = table("arrays", "data_parts = 2\ntest_files = [\"h\"]\n").unwrap();
        assert_eq!(arrays.train.data_parts, Some(2), "arrays stream too");
        let digits = err_text(load_str("[train]\ndataset = \"digits\"\nshuffle_buffer = 8\n"));
        assert!(digits.contains("train.shuffle_buffer: only click logs"), "{digits}");
    }

    #[test]
    fn elastic_membership_needs_min_at_most_max_a_data_parallel_job_and_a_batch_every_size_divides() {
        let elastic = |cluster: &str, rest: &str| err_text(load_str(&format!("[cluster]\n{cluster}\n{rest}")));
        assert_eq!(
            elastic("nnodes = 2\nmin_nnodes = 3", ""),
            "config.toml: cluster.min_nnodes: 3 is more than cluster.nnodes = 2 (--nnodes MIN:MAX needs MIN <= MAX)"
        );
        assert_eq!(
            elastic(
                "nnodes = 3\nmin_nnodes = 1\nnproc_per_node = 2",
                "[train]\nbatch_size = 18\n"
            ),
            "config.toml: cluster.min_nnodes: the job may train on 2 node(s) of 2 rank(s), but train.batch_size = 18 \
             does not divide by 4 replica(s) × 1 micro-batch(es): the global batch is re-split over the replicas, \
             never changed"
        );
        let msg = elastic(
            "nnodes = 2\nmin_nnodes = 1",
            "[fault_tolerance]\nrecovery = \"restart\"\n",
        );
        assert!(
            msg.contains("it needs fault_tolerance.recovery = \"in_place\""),
            "{msg}"
        );
        // A parameter-server job's trainers are elastic too.
        let ps = load_str(&CTR.replace("server_num = 2\n", "server_num = 2\nmin_nnodes = 1\n")).unwrap();
        assert_eq!(ps.cluster.min_nnodes, Some(1));
        let pipeline = "[train]\nbatch_size = 48\n[strategy]\npipeline = true\n[strategy.hybrid_configs]\npp_degree = 2\ndp_degree = 3\n";
        let msg = elastic("nnodes = 2\nmin_nnodes = 1\nnproc_per_node = 3", pipeline);
        assert!(
            msg.contains("cluster.nproc_per_node = 3 is not a multiple of strategy.hybrid_configs.pp_degree = 2"),
            "{msg}"
        );
        let config =
            load_str("[cluster]\nnnodes = 3\nmin_nnodes = 2\nnproc_per_node = 1\n[train]\nbatch_size = 48\n").unwrap();
        assert_eq!(config.cluster.min_nnodes, Some(2));
    }

    #[test]
    fn a_hierarchical_all_reduce_needs_several_nodes_of_several_ranks() {
        let asked = "[strategy]\nuse_hierarchical_allreduce = true\n";
        let msg = err_text(load_str(&format!("[cluster]\nnnodes = 1\nnproc_per_node = 4\n{asked}")));
        assert_eq!(
            msg,
            "config.toml: strategy.use_hierarchical_allreduce: needs several nodes of several ranks, but cluster.nnodes = 1 and cluster.nproc_per_node = 4"
        );
        let msg = err_text(load_str(&format!("{CTR}{asked}")));
        assert!(msg.contains("parameter servers do not all-reduce"), "{msg}");
        let config = load_str(&format!("[cluster]\nnnodes = 2\nnproc_per_node = 2\n{asked}")).unwrap();
        assert_eq!(config.strategy.use_hierarchical_allreduce, Some(true));
    }

    #[test]
    fn strategy_and_model_must_fit() {
        let msg = err_text(load_str("[cluster]\nserver_num = 2\n"));
        assert!(
            msg.starts_with("config.toml: train.model: the parameter-server strategy"),
            "{msg}"
        );
        let msg = err_text(load_str(
            "[train]\nmodel = \"wide_deep\"\ndataset = \"criteo_synthetic\"\n",
        ));
        assert!(
            msg.starts_with("config.toml: train.model: \"wide_deep\" trains on parameter servers"),
            "{msg}"
        );
        let msg = err_text(load_str(
            &format!("{CTR}optimizer = \"adamw\"\n").replace("optimizer = \"adam\"\n", ""),
        ));
        assert!(
            msg.starts_with("config.toml: train.optimizer: \"adamw\" is not"),
            "{msg}"
        );
        let msg = err_text(load_str("[train]\noptimizer = \"adagrad\"\n"));
        assert!(
            msg.starts_with("config.toml: train.optimizer: adagrad and adam run on"),
            "{msg}"
        );
        let msg = err_text(load_str("[strategy]\na_sync = true\n"));
        assert!(
            msg.starts_with("config.toml: strategy.a_sync: applies to the parameter-server"),
            "{msg}"
        );
    }

    #[test]
    fn data_must_fit_the_model() {
        let msg = err_text(load_str(&CTR.replace("criteo_synthetic", "digits")));
        assert!(
            msg.starts_with("config.toml: train.dataset: \"digits\" is not click logs"),
            "{msg}"
        );
        let msg = err_text(load_str("[train]\ndataset = \"criteo_synthetic\"\n"));
        assert!(
            msg.starts_with("config.toml: train.dataset: \"criteo_synthetic\" is click logs"),
            "{msg}"
        );
        let msg = err_text(load_str("[train]\nmodel = \"gpt\"\n"));
        assert!(
            msg.starts_with("config.toml: train.dataset: \"digits\" is not text"),
            "{msg}"
        );
        let msg = err_text(load_str("[train]\ndataset = \"text\"\n"));
        assert!(
            msg.starts_with("config.toml: train.dataset: \"text\" is read by"),
            "{msg}"
        );
        let gpt = "[train]\nmodel = \"gpt\"\ndataset = \"text\"\n[train.gpt]\nn_head = 3\n";
        let msg = err_text(load_str(gpt));
        assert!(msg.starts_with("config.toml: train.gpt.n_head: 3 heads"), "{msg}");
        let msg = err_text(load_str(&CTR.replace("criteo_synthetic", "criteo")));
        assert_eq!(
            msg,
            "config.toml: train.train_files: dataset \"criteo\" needs at least one file here"
        );
    }

    #[test]
    fn pipeline_layouts_must_fit_the_world_and_the_batch() {
        let pp = "[cluster]\nnproc_per_node = 4\n[train]\nbatch_size = 32\nhidden_sizes = [8, 8, 8]\n\
                  [strategy]\npipeline = true\n";
        let ok = format!("{pp}[strategy.hybrid_configs]\ndp_degree = 2\npp_degree = 2\n[strategy.pipeline_configs]\naccumulate_steps = 4\n");
        load_str(&ok).unwrap();
        for (extra, key, says) in [
            ("[strategy.hybrid_configs]\ndp_degree = 1\npp_degree = 2\n", "strategy.hybrid_configs", "must equal the world size 4"),
            ("[strategy.hybrid_configs]\npp_degree = 4\n[strategy.pipeline_configs]\naccumulate_steps = 3\n", "strategy.pipeline_configs.accumulate_steps", "does not split"),
            ("[strategy.hybrid_configs]\npp_degree = 4\n[strategy.pipeline_configs]\nschedule_mode = \"FThenB\"\nvirtual_pipeline_stages = 2\n", "strategy.pipeline_configs.virtual_pipeline_stages", "cannot interleave"),
            ("[strategy.hybrid_configs]\npp_degree = 4\n[strategy.pipeline_configs]\naccumulate_steps = 2\nvirtual_pipeline_stages = 2\n", "strategy.pipeline_configs.accumulate_steps", "multiple of pp_degree"),
            ("[strategy.hybrid_configs]\npp_degree = 4\n[strategy.pipeline_configs]\naccumulate_steps = 2\nmicro_batch_size = 4\n", "strategy.pipeline_configs.micro_batch_size", "contradicts"),
        ] {
            let msg = err_text(load_str(&format!("{pp}{extra}")));
            assert!(msg.starts_with(&format!("config.toml: {key}: ")) && msg.contains(says), "{msg}");
        }
        let msg = err_text(load_str("[strategy.hybrid_configs]\npp_degree = 2\n"));
        assert!(
            msg.starts_with("config.toml: strategy.pipeline: pipeline_configs / hybrid_configs are set"),
            "{msg}"
        );
    }

    #[test]
    fn geo_needs_a_sync_and_modes_follow_the_keys() {
        let msg = err_text(load_str(&format!("{CTR}[strategy.a_sync_configs]\nk_steps = 4\n")));
        assert!(
            msg.starts_with("config.toml: strategy.a_sync_configs.k_steps: k_steps = 4 selects geo"),
            "{msg}"
        );
        let config = load_str(&format!("{CTR}[strategy]\na_sync = true\n")).unwrap();
        assert_eq!(config.strategy.ps_mode(), PsMode::Async);
        let geo = format!("{CTR}[strategy]\na_sync = true\na_sync_configs = {{ k_steps = 4 }}\n");
        let config = load_str(&geo).unwrap();
        assert_eq!(config.strategy.ps_mode(), PsMode::Geo { k_steps: 4 });
        assert_eq!(load_str(CTR).unwrap().strategy.ps_mode(), PsMode::Sync);
    }

    #[test]
    fn every_mode_checkpoints_and_geo_where_the_trainers_push() {
        let checkpoints = |every: usize| format!("[fault_tolerance]\ncheckpoint_every = {every}\n");
        let async_job = format!("{CTR}[strategy]\na_sync = true\n{}", checkpoints(10));
        assert!(load_str(&async_job).is_ok());
        let geo = |every| {
            format!(
                "{CTR}[strategy]\na_sync = true\na_sync_configs = {{ k_steps = 4 }}\n{}",
                checkpoints(every)
            )
        };
        assert!(load_str(&geo(8)).is_ok());
        let msg = err_text(load_str(&geo(10)));
        assert!(
            msg.starts_with("config.toml: fault_tolerance.checkpoint_every: 10 is not a multiple of strategy.a_sync_configs.k_steps = 4"),
            "{msg}"
        );
    }
}
