//! The parameter-server strategy in a simulated cluster: sync mode against an independent
//! single-process reference, the asynchronous modes against sync, and bad input.

mod common;

use common::{ctr_config, run};

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var};
use flotilla::config::JobConfig;
use flotilla::config::OptimizerKind;
use flotilla::data::ctr::SPARSE_SLOTS;
use flotilla::data::ctr::{CtrLoader, DataLayout};
use flotilla::job::ps::{build_shard, ParameterServerJob};
use flotilla::job::{Resume, RunOptions};
use flotilla::models::{sigmoid_cross_entropy, Lookup, ParamInit, SparseModelDef};
use flotilla::ps::table::{init_row, RowInit};
use flotilla::ps::wire::{Part, PullRequest, PushRequest, UpdateKind};

/// The tensors of one shard snapshot, as f32 values or u64 ids.
struct ShardFile {
    tensors: HashMap<String, (Vec<u8>, usize)>,
}

impl ShardFile {
    fn read(path: &Path) -> Self {
        let bytes = std::fs::read(path).expect("shard snapshot");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        let tensors = file
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, (view.data().to_vec(), view.dtype().bitsize() / 8)))
            .collect();
        Self { tensors }
    }

    fn floats(&self, name: &str) -> Vec<f32> {
        let (data, size) = self.tensors.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(*size, 4);
        data.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn ids(&self, name: &str) -> Vec<u64> {
        let (data, size) = self.tensors.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(*size, 8);
        data.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

/// Plain single-process SGD on the global batches, written independently of the shards and of
/// the trainers' planning: whole tables in hash maps, each table's ids gathered from its own
/// slots, candle's autograd through the model's logits, updates by hand at each table's step size.
fn reference(config: &JobConfig, def: &SparseModelDef) -> (Vec<f32>, Vec<HashMap<u64, Vec<f32>>>) {
    let train = &config.train;
    let job = ParameterServerJob::new(config.clone(), def.clone()).unwrap();
    let model = def.build(&ParamInit::new(train.seed, Device::Cpu)).unwrap();
    let params: Vec<Var> = model
        .parameters()
        .into_iter()
        .map(|(_, p)| p.var().expect("held"))
        .collect();
    let specs = def.tables();
    assert!(
        specs
            .iter()
            .all(|t| t.optimizer.is_none_or(|o| o == OptimizerKind::Sgd))
            && train.momentum == 0.0,
        "the reference trains with plain SGD"
    );
    let mut tables: Vec<HashMap<u64, Vec<f32>>> = vec![HashMap::new(); specs.len()];
    let layout = DataLayout::of(train, config.world_size());
    let mut loader = CtrLoader::new(job.train_data.clone(), layout, train.batch_size, 0, 1).unwrap();
    let lr = train.lr as f32;
    for _ in 0..train.steps.unwrap() {
        let batch = loader.next_batch().unwrap();
        let mut looked_up = Vec::new();
        for (spec, table) in specs.iter().zip(&mut tables) {
            let mut unique: Vec<u64> = Vec::new();
            let mut position = HashMap::new();
            let mut index: Vec<u32> = Vec::new();
            for sample in batch.ids.chunks_exact(SPARSE_SLOTS) {
                for &slot in &spec.slots {
                    let id = sample[slot];
                    index.push(*position.entry(id).or_insert_with(|| {
                        unique.push(id);
                        unique.len() as u32 - 1
                    }));
                }
            }
            let mut values = Vec::new();
            for id in &unique {
                let row = table.entry(*id).or_insert_with(|| {
                    let mut row = vec![0.0; spec.width];
                    let init = RowInit {
                        seed: train.seed,
                        bound: spec.init_bound,
                    };
                    init_row(&init, &spec.name, *id, &mut row);
                    row
                });
                values.extend_from_slice(row);
            }
            let rows =
                Var::from_tensor(&Tensor::from_vec(values, (unique.len(), spec.width), &Device::Cpu).unwrap()).unwrap();
            let index = Tensor::from_vec(index, batch.len * spec.slots.len(), &Device::Cpu).unwrap();
            looked_up.push((unique, rows, index));
        }
        let lookups: Vec<Lookup> = specs
            .iter()
            .zip(&looked_up)
            .map(|(spec, (_, rows, index))| Lookup {
                rows: rows.as_tensor(),
                index,
                segments: None,
                slots: spec.slots.len(),
            })
            .collect();
        let dense = Tensor::from_slice(&batch.dense, (batch.len, 13), &Device::Cpu).unwrap();
        let logits = model.logits(&dense, &lookups).unwrap();
        let labels = Tensor::from_slice(&batch.labels, batch.len, &Device::Cpu).unwrap();
        let grads = sigmoid_cross_entropy(&logits, &labels).unwrap().backward().unwrap();
        for p in &params {
            let g = grads.get(p.as_tensor()).unwrap();
            p.set(&(p.as_tensor() - (g * f64::from(lr)).unwrap()).unwrap()).unwrap();
        }
        for ((spec, table), (unique, rows, _)) in specs.iter().zip(&mut tables).zip(&looked_up) {
            let g = grads
                .get(rows.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let lr = spec.lr.map_or(lr, |lr| lr as f32);
            for (u, id) in unique.iter().enumerate() {
                let row = table.get_mut(id).unwrap();
                for (v, g) in row.iter_mut().zip(&g[u * spec.width..(u + 1) * spec.width]) {
                    *v -= lr * g;
                }
            }
        }
    }
    let dense = params
        .iter()
        .flat_map(|p| p.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect();
    (dense, tables)
}

/// Tolerance of sync mode against the reference: the shards sum the trainers' gradients
/// (each a mean over a third of the batch) where the reference takes one mean, so every step
/// differs by f32 rounding (~1e-7 relative); over 20 steps of lr 0.1 on values of order 1 that
/// stays far below 1e-5, while a real error (a lost or doubled gradient, a row on the wrong
/// shard) moves values by about lr × gradient ≈ 1e-3 or more.
const SYNC_TOLERANCE: f32 = 1e-5;

/// Trains `model` under `config` (3 trainers, 2 shards, sync) and checks the shards' final dense
/// values and every row against [`reference`], and that only trained rows were stored.
fn sync_training_equals_the_reference(config: JobConfig, model: SparseModelDef) {
    let dir = tempfile::tempdir().unwrap();
    let job = ParameterServerJob::new(config.clone(), model.clone()).unwrap();
    let summary = job.run_simulated(&RunOptions::new(dir.path())).unwrap();
    assert_eq!(
        (summary.mode.as_str(), summary.trainers, summary.servers),
        ("sync", 3, 2)
    );
    let (dense, tables) = reference(&config, &model);

    let shards: Vec<ShardFile> = (0..2)
        .map(|i| ShardFile::read(&dir.path().join(format!("ps-shard-{i}.safetensors"))))
        .collect();
    let served: Vec<f32> = shards.iter().flat_map(|s| s.floats("dense.values")).collect();
    assert_eq!(served.len(), dense.len());
    let dense_diff = served
        .iter()
        .zip(&dense)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(dense_diff <= SYNC_TOLERANCE, "dense: max |Δ| = {dense_diff:e}");

    for (spec, table) in model.tables().iter().zip(&tables) {
        let mut seen = 0;
        let mut worst = 0.0f32;
        for shard in &shards {
            let ids = shard.ids(&format!("sparse.{}.ids", spec.name));
            let values = shard.floats(&format!("sparse.{}.values", spec.name));
            for (id, row) in ids.iter().zip(values.chunks_exact(spec.width)) {
                // Only training creates rows: the final evaluation's pulls leave none behind.
                let expected = table
                    .get(id)
                    .unwrap_or_else(|| panic!("{}: row {id} was stored but never trained", spec.name));
                seen += 1;
                for (a, b) in row.iter().zip(expected) {
                    worst = worst.max((a - b).abs());
                }
            }
        }
        assert_eq!(
            seen,
            table.len(),
            "{}: every trained row is on exactly one shard",
            spec.name
        );
        assert!(worst <= SYNC_TOLERANCE, "{}: max |Δrow| = {worst:e}", spec.name);
    }
}

#[test]
fn sync_mode_equals_single_process_training_of_the_global_batch() {
    let config = ctr_config(&[]);
    let model = SparseModelDef::builtin(&config.train).unwrap();
    sync_training_equals_the_reference(config, model);
}

#[test]
fn deepfm_trains_under_sync_as_it_trains_in_one_process() {
    let config = ctr_config(&["train.model=deepfm"]);
    let model = SparseModelDef::builtin(&config.train).unwrap();
    assert_eq!(model.table_names(), ["embedding", "first_order"]);
    sync_training_equals_the_reference(config, model);
}

#[test]
fn a_users_three_table_model_trains_under_sync_as_it_trains_in_one_process() {
    let model = common::three_table_model();
    assert_eq!(model.table_names(), ["user", "item", "context"]);
    // The policy sections name the user's tables; the built-in model's are unknown to this job.
    let config = ctr_config(&[
        "train.model=custom",
        "strategy.sparse_table_configs.item.delete_after_unseen_days=5",
    ]);
    sync_training_equals_the_reference(config.clone(), model.clone());
    let wrong = ctr_config(&[
        "train.model=custom",
        "strategy.sparse_table_configs.wide.count_filter=2",
    ]);
    let err = ParameterServerJob::new(wrong, model.clone())
        .err()
        .expect("no table `wide`");
    assert!(
        err.to_string()
            .ends_with("strategy.sparse_table_configs.wide: the model has no sparse table `wide`; its tables are user, item, context"),
        "{err}"
    );
    // The asynchronous modes run it too: every table trained, the held-out clicks ranked.
    for mode in [
        vec!["strategy.a_sync=true"],
        vec!["strategy.a_sync=true", "strategy.a_sync_configs.k_steps=4"],
    ] {
        let sets: Vec<&str> = ["train.model=custom", "train.steps=60"]
            .into_iter()
            .chain(mode)
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let job = ParameterServerJob::new(ctr_config(&sets), model.clone()).unwrap();
        let summary = job.run_simulated(&RunOptions::new(dir.path())).unwrap();
        let rows: Vec<(&str, bool)> = summary.tables.iter().map(|t| (t.name.as_str(), t.rows > 0)).collect();
        assert_eq!(
            rows,
            [("user", true), ("item", true), ("context", true)],
            "{}",
            summary.mode
        );
        assert!(summary.auc > 0.55, "{}: AUC {}", summary.mode, summary.auc);
    }
    let err = ParameterServerJob::builtin(config).err().expect("no built-in model");
    assert!(
        err.to_string()
            .starts_with("train.model = \"custom\" is the model of the program"),
        "{err}"
    );
}

#[test]
fn async_and_geo_reach_the_auc_of_sync() {
    let common = [
        "cluster.nproc_per_node=2",
        "train.steps=300",
        "train.batch_size=256",
        "train.synthetic_vocab=5000",
        "train.synthetic_samples=100000",
        "train.test_fraction=0.1",
        "train.embedding_dim=8",
        "train.hidden_sizes=[32, 16]",
        "train.optimizer=adagrad",
        "train.lr=0.05",
    ];
    let auc = |mode: &[&str]| {
        let overrides: Vec<&str> = common.iter().chain(mode).copied().collect();
        let dir = tempfile::tempdir().unwrap();
        run(ctr_config(&overrides), dir.path())
    };
    let sync = auc(&[]);
    let ceiling = sync.planted_auc.unwrap();
    assert!(
        sync.auc > 0.5 + 0.5 * (ceiling - 0.5),
        "sync AUC {} against the planted model's {ceiling}",
        sync.auc
    );
    for (name, mode) in [
        ("async", vec!["strategy.a_sync=true"]),
        ("geo", vec!["strategy.a_sync=true", "strategy.a_sync_configs.k_steps=4"]),
    ] {
        let summary = auc(&mode);
        assert_eq!(summary.mode, name);
        assert!(
            (summary.auc - sync.auc).abs() <= 0.01,
            "{name} AUC {} against sync {}",
            summary.auc,
            sync.auc
        );
    }
}

#[test]
fn a_push_to_an_unknown_table_or_with_a_row_of_the_wrong_width_is_refused() {
    let config = ctr_config(&[]);
    let mut shard = common::fresh_shard(&config, 0);
    let dense = vec![0.0; shard.dense().len()];
    let push = |ids: Vec<Vec<u64>>, values: Vec<Vec<f32>>| PushRequest {
        trainer: 1,
        step: 0,
        part: Part::WHOLE,
        kind: UpdateKind::Gradients,
        ids,
        values,
        counts: Vec::new(),
        dense: dense.clone(),
        stop: false,
    };
    let err = shard
        .push(push(vec![vec![], vec![], vec![7]], vec![vec![], vec![], vec![1.0]]))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "push names table 2 but the job has 2 tables (embedding, wide)"
    );
    let err = shard
        .push(push(vec![vec![7], vec![]], vec![vec![1.0, 2.0, 3.0], vec![]]))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "push from trainer 1 to table \"embedding\": 3 values for 1 rows of width 4 (expected 4)"
    );
    let err = shard.push(push(vec![vec![], vec![]], vec![vec![], vec![]]));
    assert!(err.is_ok(), "a well-formed push is taken: {err:?}");
}

#[test]
fn shards_start_from_the_tables_a_run_saved() {
    let dir = tempfile::tempdir().unwrap();
    run(ctr_config(&[]), dir.path());
    let from = format!("train.init_tables_from={:?}", dir.path().display().to_string());
    let config = ctr_config(&[&from]);
    for index in 0..2 {
        let shard = common::fresh_shard(&config, index);
        let file = ShardFile::read(&dir.path().join(format!("ps-shard-{index}.safetensors")));
        assert_eq!(shard.dense().values(), file.floats("dense.values").as_slice());
        for table in shard.tables() {
            let ids = file.ids(&format!("sparse.{}.ids", table.name()));
            let values = file.floats(&format!("sparse.{}.values", table.name()));
            let saved: HashMap<u64, &[f32]> = ids.iter().copied().zip(values.chunks_exact(table.width())).collect();
            assert_eq!(table.len(), saved.len(), "{}", table.name());
            for (id, value, _) in table.rows() {
                assert_eq!(Some(&value), saved.get(&id), "{} row {id}", table.name());
            }
        }
    }
    let three = ctr_config(&[&from, "cluster.server_num=3"]);
    let err = format!(
        "{:#}",
        build_shard(&three, &SparseModelDef::builtin(&three.train).unwrap(), 0)
            .err()
            .expect("a snapshot of 2 shards does not fit 3")
    );
    assert!(err.starts_with("parameter server 0: train.init_tables_from: "), "{err}");
    assert!(err.contains("server"), "{err}");
}

/// Three trainers read three files — each its own, plain or gzipped, in shuffled windows — and
/// train bit-identically to the generator the files were written from, cut into the same parts.
#[test]
fn criteo_tsv_files_plain_or_gzipped_train_exactly_like_the_generator_they_were_written_from() {
    use flotilla::data::ctr::{write_synthetic, CriteoSynth, Split};
    let synthetic = ctr_config(&["train.shuffle_buffer=40"]);
    let train = &synthetic.train;
    let test_samples = (train.synthetic_samples as f64 * train.test_fraction).round() as u64;
    let train_samples = train.synthetic_samples as u64 - test_samples;
    let parts = train.data_parts(synthetic.world_size()) as u64;
    assert_eq!(parts, 3, "one part per trainer by default");
    let synth = CriteoSynth::new(train.seed, train.synthetic_vocab);
    let files = tempfile::tempdir().unwrap();
    let generated_dir = tempfile::tempdir().unwrap();
    let generated = run(synthetic.clone(), generated_dir.path());
    let dense = |dir: &Path| ShardFile::read(&dir.join("ps-shard-0.safetensors")).floats("dense.values");
    let quoted = |paths: &[String]| paths.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ");
    for suffix in ["", ".gz"] {
        let bound = |part: u64| train_samples * part / parts;
        let train_files: Vec<String> = (0..parts)
            .map(|part| {
                let path = files.path().join(format!("train-{part}.tsv{suffix}"));
                write_synthetic(&path, &synth, Split::Train, bound(part)..bound(part + 1)).unwrap();
                path.display().to_string()
            })
            .collect();
        let test_file = files.path().join(format!("test.tsv{suffix}"));
        write_synthetic(&test_file, &synth, Split::Test, 0..test_samples).unwrap();
        let from_files = ctr_config(&[
            "train.shuffle_buffer=40",
            "train.dataset=criteo",
            &format!("train.train_files=[{}]", quoted(&train_files)),
            &format!("train.test_files=[{:?}]", test_file.display().to_string()),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let read = run(from_files, dir.path());
        assert_eq!(read.test_samples, generated.test_samples, "{suffix}");
        assert_eq!(
            (read.auc, read.final_loss),
            (generated.auc, generated.final_loss),
            "{suffix}"
        );
        assert_eq!(
            dense(generated_dir.path()),
            dense(dir.path()),
            "{suffix}: the same records give the same parameters"
        );
    }
}

#[test]
fn a_pull_held_for_a_trainer_that_never_pushes_names_it_after_the_timeout() {
    use actix::prelude::*;
    use flotilla::actors::pserver::PServer;
    use flotilla::ps::wire::{Request, ShardCall};

    let config = ctr_config(&["cluster.nproc_per_node=2", "fault_tolerance.timeout_s=1"]);
    let shard = common::fresh_shard(&config, 0);
    let push = empty_push(&config, 0, 0, UpdateKind::Gradients);
    let started = std::time::Instant::now();
    let err = System::new().block_on(async move {
        let (all_left, _) = futures::channel::oneshot::channel();
        let server = PServer::new(shard, all_left, config.fault_tolerance.timeout()).start();
        server
            .send(ShardCall::first(Request::Push(push)))
            .await
            .unwrap()
            .unwrap();
        server
            .send(ShardCall::first(Request::Pull(pull_of_step_1())))
            .await
            .unwrap()
            .unwrap_err()
    });
    assert_eq!(
        err.to_string(),
        "parameter server 0: no answer to trainer 0's pull within 1s: step 0 still waits for the pushes of trainers [1]"
    );
    let waited = started.elapsed().as_secs_f64();
    assert!((0.9..5.0).contains(&waited), "answered after {waited:.1}s");
}

#[test]
fn an_evaluation_waiting_for_a_trainers_scores_names_it_after_the_timeout() {
    use actix::prelude::*;
    use flotilla::actors::pserver::PServer;
    use flotilla::ps::wire::{Request, ShardCall};

    let config = ctr_config(&["cluster.nproc_per_node=3", "fault_tolerance.timeout_s=1"]);
    let shard = common::fresh_shard(&config, 0);
    let started = std::time::Instant::now();
    let errors = System::new().block_on(async move {
        let (all_left, _) = futures::channel::oneshot::channel();
        let server = PServer::new(shard, all_left, config.fault_tolerance.timeout()).start();
        let share = |trainer| {
            server.send(ShardCall::first(Request::Evaluated {
                trainer,
                scores: vec![0.5],
                labels: vec![1.0],
            }))
        };
        let (first, second) = futures::join!(share(0), share(2));
        [first.unwrap().unwrap_err(), second.unwrap().unwrap_err()]
    });
    for err in errors {
        assert_eq!(
            err.to_string(),
            "parameter server 0: the evaluation waited 1s for the scores of trainers [1]"
        );
    }
    let waited = started.elapsed().as_secs_f64();
    assert!((0.9..5.0).contains(&waited), "answered after {waited:.1}s");
}

#[test]
fn a_shard_writes_its_tables_and_checkpoints_only_in_the_directories_it_was_started_with() {
    use actix::prelude::*;
    use flotilla::actors::pserver::PServer;
    use flotilla::ps::wire::{Reply, Request, ShardCall};

    let config = ctr_config(&["cluster.nproc_per_node=1"]);
    let shard = common::fresh_shard(&config, 1);
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, checkpoints) = (dir.path().join("run"), dir.path().join("checkpoints"));
    let (save, checkpointed) = System::new().block_on({
        let (run_dir, checkpoints) = (run_dir.clone(), checkpoints.clone());
        async move {
            let (all_left, _) = futures::channel::oneshot::channel();
            let server = PServer::new(shard, all_left, config.fault_tolerance.timeout())
                .writing_in(&run_dir, Some(&checkpoints))
                .start();
            // A request names no path: what the shard writes, and where, is its own to know.
            let save = server.send(ShardCall::first(Request::Save)).await.unwrap().unwrap();
            let checkpoint = Request::Checkpoint {
                step: 0,
                trainer: 0,
                files: Vec::new(),
            };
            let checkpointed = server.send(ShardCall::first(checkpoint)).await.unwrap().unwrap();
            (save, checkpointed)
        }
    });
    assert_eq!(save, Reply::Done);
    assert!(run_dir.join("ps-shard-1.safetensors").is_file());
    let Reply::Checkpointed(files) = checkpointed else {
        panic!("a checkpoint answered with {checkpointed:?}");
    };
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].name, "ps-shard-1.safetensors");
    assert!(checkpoints.join("step-00000000/ps-shard-1.safetensors").is_file());
}

#[test]
fn a_shard_started_without_a_checkpoint_directory_refuses_a_checkpoint() {
    use actix::prelude::*;
    use flotilla::actors::pserver::PServer;
    use flotilla::ps::wire::{Request, ShardCall};

    let config = ctr_config(&["cluster.nproc_per_node=1"]);
    let shard = common::fresh_shard(&config, 0);
    let dir = tempfile::tempdir().unwrap();
    let refused = System::new().block_on({
        let run_dir = dir.path().to_path_buf();
        async move {
            let (all_left, _) = futures::channel::oneshot::channel();
            let server = PServer::new(shard, all_left, config.fault_tolerance.timeout())
                .writing_in(&run_dir, None)
                .start();
            let checkpoint = Request::Checkpoint {
                step: 0,
                trainer: 0,
                files: Vec::new(),
            };
            server.send(ShardCall::first(checkpoint)).await.unwrap().unwrap_err()
        }
    });
    assert_eq!(
        refused.to_string(),
        "parameter server 0 was asked for the checkpoint of step 0, but the job takes none"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
}

/// Trainer 0's pull of step 1 (nothing but the dense slice), held until every trainer pushed
/// step 0.
fn pull_of_step_1() -> PullRequest {
    PullRequest {
        trainer: 0,
        version: 1,
        after_training: false,
        training: true,
        ids: vec![vec![], vec![]],
        dense: true,
    }
}

/// An empty push of `step` from `trainer` to shard 0 of `config`.
fn empty_push(config: &JobConfig, trainer: usize, step: u64, kind: UpdateKind) -> PushRequest {
    let dense = common::fresh_shard(config, 0).dense().len();
    PushRequest {
        trainer,
        step,
        part: Part::WHOLE,
        kind,
        ids: vec![vec![], vec![]],
        values: vec![vec![], vec![]],
        counts: Vec::new(),
        dense: vec![0.0; dense],
        stop: false,
    }
}

#[test]
fn a_shard_serves_one_generation_of_its_trainers_refusing_older_requests_and_holding_newer_ones_until_restored() {
    use actix::prelude::*;
    use flotilla::actors::pserver::{PServer, RestoreState, RollBack};
    use flotilla::ps::wire::{Reply, Request, ShardCall};

    let config = ctr_config(&["cluster.nproc_per_node=2"]);
    let shard = common::fresh_shard(&config, 0);
    let push = empty_push(&config, 0, 0, UpdateKind::Gradients);
    System::new().block_on(async move {
        let (all_left, _) = futures::channel::oneshot::channel();
        let (acknowledge, _acks) = tokio::sync::mpsc::unbounded_channel();
        let server = PServer::new(shard, all_left, config.fault_tolerance.timeout())
            .recovering_in_place(0, acknowledge)
            .unwrap()
            .start();
        let call = |generation, request| ShardCall { generation, request };
        // Not ready before its state is restored: the request waits.
        let stats = server.send(call(0, Request::Stats));
        let restore = |generation, trainers| RestoreState {
            generation,
            step: 0,
            bytes: None,
            trainers,
        };
        server.send(restore(0, 2)).await.unwrap().unwrap();
        assert!(matches!(stats.await.unwrap().unwrap(), Reply::Stats(_)));

        // Trainer 0 waits for step 1 while trainer 1 has not pushed step 0: the rollback
        // refuses the held pull with its reason.
        server.send(call(0, Request::Push(push))).await.unwrap().unwrap();
        let held = server.send(call(0, Request::Pull(pull_of_step_1())));
        let reason = "trainer 1 declared dead".to_string();
        server.do_send(RollBack { generation: 1, reason });
        assert_eq!(held.await.unwrap().unwrap_err().to_string(), "trainer 1 declared dead");
        let stale = server.send(call(0, Request::Stats)).await.unwrap().unwrap_err();
        assert_eq!(
            stale.to_string(),
            "parameter server 0: a request of generation 0 after the job rolled back to generation 1"
        );
        let early = server.send(call(1, Request::Stats));
        server.send(restore(1, 2)).await.unwrap().unwrap();
        let Reply::Stats(stats) = early.await.unwrap().unwrap() else {
            panic!("statistics expected");
        };
        assert_eq!(
            stats.updates_applied, 0,
            "rolled back to step 0: trainer 0's push is undone"
        );

        // Elastic membership went on without trainer 1: generation 2 has one trainer, whose
        // push alone completes the step.
        server.do_send(RollBack {
            generation: 2,
            reason: "node 1 dropped".to_string(),
        });
        server.send(restore(2, 1)).await.unwrap().unwrap();
        let push = empty_push(&config, 0, 0, UpdateKind::Gradients);
        server.send(call(2, Request::Push(push))).await.unwrap().unwrap();
        let pulled = server.send(call(2, Request::Pull(pull_of_step_1()))).await.unwrap();
        assert!(
            matches!(pulled.unwrap(), Reply::Rows(_)),
            "step 0 complete with one trainer"
        );
    });
}

#[test]
fn an_async_checkpoint_waits_for_every_trainers_pushes_before_it_and_resumes_their_bookkeeping() {
    let config = ctr_config(&["cluster.nproc_per_node=2", "strategy.a_sync=true"]);
    let mut shard = common::fresh_shard(&config, 0);
    let push = |trainer, step| empty_push(&config, trainer, step, UpdateKind::Gradients);
    for step in 0..2 {
        assert!(shard.push(push(0, step)).unwrap());
    }
    assert!(!shard.checkpoint_ready(2).unwrap(), "trainer 1 has not pushed yet");
    for step in 0..2 {
        assert!(shard.push(push(1, step)).unwrap());
    }
    assert!(shard.checkpoint_ready(2).unwrap());
    let bytes = shard.snapshot_bytes().unwrap();
    assert!(shard.push(push(0, 2)).unwrap());
    let past = shard.checkpoint_ready(2).unwrap_err().to_string();
    assert_eq!(
        past,
        "parameter server 0: trainer 0 pushed step Some(2) before the checkpoint of step 2"
    );
    shard.resume(&bytes, 2).unwrap();
    assert_eq!(shard.stats().updates_applied, 4, "two steps of two trainers");
    assert!(
        !shard.push(push(0, 1)).unwrap(),
        "a push of the checkpoint is not applied again"
    );
    assert!(
        shard.push(push(0, 2)).unwrap(),
        "the rolled-back push is applied once more"
    );
    assert_eq!(shard.stats().updates_applied, 5);
}

/// When trainer 0 of a traced 20-step job `mode` (`--set`s) began pulling each step's rows and
/// when it finished training each step, in µs on the trace's clock.
fn pulls_and_trainings(mode: &[&str]) -> Vec<(f64, f64)> {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, trace_dir) = (dir.path().join("run"), dir.path().join("trace"));
    #[rustfmt::skip]
    let mut args = vec![
        "train", "--config", "examples/ctr_ps.toml", "--run-dir", run_dir.to_str().unwrap(),
        "--trace", trace_dir.to_str().unwrap(), "--set", "train.steps=20", "--set", "train.synthetic_samples=20000",
    ];
    for set in mode {
        args.extend(["--set", set]);
    }
    let out = common::flotilla(&args, &[], 120);
    assert!(out.success, "{}", out.stderr);
    let text = std::fs::read_to_string(trace_dir.join("trace.json")).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Tracks: the two servers, then the trainers.
    let span = |name: String| {
        let found = common::trace_spans(&trace, 2, |n| n == name);
        assert_eq!(found.len(), 1, "trainer 0's span {name:?}");
        found[0]
    };
    (0..20)
        .map(|step| (span(format!("pull {step}")).0, span(format!("train {step}")).1))
        .collect()
}

/// Async mode pulls step t+1's rows while step t computes: each pull begins before the training
/// of the step before has ended. Sync mode cannot (step t+1's rows wait for every trainer's
/// push of step t), which shows the timeline can tell.
#[test]
fn async_pulls_the_next_steps_rows_while_a_step_computes_and_sync_cannot() {
    let overlapped = |steps: &[(f64, f64)]| steps.windows(2).filter(|pair| pair[1].0 < pair[0].1).count();
    let asynchronous = pulls_and_trainings(&["strategy.a_sync=true"]);
    assert_eq!(overlapped(&asynchronous), 19, "{asynchronous:?}");
    let sync = pulls_and_trainings(&[]);
    assert_eq!(overlapped(&sync), 0, "{sync:?}");
}

/// A resumed run starts reading its files at the positions its checkpoint saved: after the
/// checkpoint the lines before those positions are garbled byte for byte, newlines included (a
/// reader that counted its way back through lines would land elsewhere, or fail to parse), and
/// the resumed run still ends exactly as the uninterrupted one.
#[test]
fn a_resumed_run_reads_its_files_from_the_saved_position_not_from_their_start() {
    use flotilla::data::ctr::{write_synthetic, CriteoSynth, Split};
    let files = tempfile::tempdir().unwrap();
    let synth = CriteoSynth::new(42, 300);
    let train_files: Vec<std::path::PathBuf> = (0..3u64)
        .map(|part| {
            let path = files.path().join(format!("train-{part}.tsv"));
            write_synthetic(&path, &synth, Split::Train, part * 2000..(part + 1) * 2000).unwrap();
            path
        })
        .collect();
    let test_file = files.path().join("test.tsv");
    write_synthetic(&test_file, &synth, Split::Test, 0..500).unwrap();
    let quoted: Vec<String> = train_files
        .iter()
        .map(|p| format!("{:?}", p.display().to_string()))
        .collect();
    let config = |steps: usize| {
        ctr_config(&[
            "train.dataset=criteo",
            &format!("train.train_files=[{}]", quoted.join(", ")),
            &format!("train.test_files=[{:?}]", test_file.display().to_string()),
            "fault_tolerance.checkpoint_every=10",
            &format!("train.steps={steps}"),
        ])
    };
    let uninterrupted = tempfile::tempdir().unwrap();
    let whole = run(config(20), uninterrupted.path());
    // Stopped after step 15; its checkpoint is of step 10.
    let interrupted = tempfile::tempdir().unwrap();
    run(config(15), interrupted.path());

    // 3 trainers, one file each, 96 / 3 records of each file per step: 10 steps read 320 lines.
    for path in &train_files {
        let mut bytes = std::fs::read(path).unwrap();
        let read = bytes
            .iter()
            .enumerate()
            .filter(|(_, &b)| b == b'\n')
            .nth(319)
            .unwrap()
            .0
            + 1;
        bytes[..read]
            .iter_mut()
            .filter(|b| **b == b'\n')
            .for_each(|b| *b = b'#');
        std::fs::write(path, bytes).unwrap();
    }
    let resumed_dir = tempfile::tempdir().unwrap();
    let options = RunOptions {
        resume: Resume::From(interrupted.path().join("checkpoints")),
        ..RunOptions::new(resumed_dir.path())
    };
    let resumed = ParameterServerJob::builtin(config(20))
        .unwrap()
        .run_simulated(&options)
        .unwrap();
    assert_eq!((resumed.final_loss, resumed.auc), (whole.final_loss, whole.auc));
    for shard in 0..2 {
        let dense =
            |dir: &Path| ShardFile::read(&dir.join(format!("ps-shard-{shard}.safetensors"))).floats("dense.values");
        assert_eq!(dense(resumed_dir.path()), dense(uninterrupted.path()), "shard {shard}");
    }
}

#[test]
fn an_update_in_parts_out_of_order_and_retried_applies_exactly_as_the_whole_update() {
    use flotilla::ps::parts::{split, Joined};
    use flotilla::ps::wire::{Reply, Request};
    for mode in [
        &["cluster.nproc_per_node=2"][..],
        &["cluster.nproc_per_node=2", "strategy.a_sync=true"],
    ] {
        let config = ctr_config(mode);
        let (mut whole, mut in_parts) = (common::fresh_shard(&config, 0), common::fresh_shard(&config, 0));
        let widths: Vec<usize> = whole.tables().iter().map(|t| t.width()).collect();
        let dense = whole.dense().len();
        let mut rng = flotilla::rng::SplitMix64::new(7);
        for step in 0..3 {
            for trainer in 0..2 {
                // Trainers share some ids, so the step's sums mix their parts.
                let ids: Vec<Vec<u64>> = widths
                    .iter()
                    .map(|_| (0..40).map(|i| i * 3 + trainer as u64 + step).collect())
                    .collect();
                let mut floats = |n: usize| (0..n).map(|_| rng.next_f32() - 0.5).collect::<Vec<f32>>();
                let push = PushRequest {
                    trainer,
                    step,
                    part: Part::WHOLE,
                    kind: UpdateKind::Gradients,
                    values: ids.iter().zip(&widths).map(|(ids, w)| floats(ids.len() * w)).collect(),
                    ids,
                    counts: Vec::new(),
                    dense: floats(dense),
                    stop: false,
                };
                whole.push(push.clone()).unwrap();
                let mut parts = split(Request::Push(push), 7);
                assert!(parts.len() > 10, "{} parts", parts.len());
                parts.reverse();
                let again = parts[3].clone();
                parts.push(again);
                let mut applied = 0;
                for part in parts {
                    let Request::Push(part) = part else { panic!("a push") };
                    applied += usize::from(in_parts.push(part).unwrap());
                }
                let expected = if mode.len() == 1 { trainer } else { 12 };
                assert_eq!(
                    applied, expected,
                    "{mode:?}: sync applies at the last trainer's last part; async each new part"
                );
            }
        }
        assert_eq!(
            whole.stats().updates_applied,
            in_parts.stats().updates_applied,
            "{mode:?}"
        );
        let saved = |shard: &flotilla::ps::Shard, dir: &Path| {
            shard.save(&dir.join("ps-shard-0.safetensors")).unwrap();
            common::saved_shard(&config, dir, 0)
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        assert_eq!(
            saved(&whole, a.path()),
            saved(&in_parts, b.path()),
            "{mode:?}: bitwise, with optimizer state"
        );
        // A pull in parts joins to the whole pull's rows.
        let pull = PullRequest {
            trainer: 0,
            version: 3,
            after_training: false,
            training: true,
            ids: vec![(0..50).collect(), (20..90).collect()],
            dense: true,
        };
        let parts = split(Request::Pull(pull.clone()), 9);
        let mut joined = Joined::new(&parts);
        for part in &parts {
            let Request::Pull(part) = part else { panic!("a pull") };
            let mut rows = in_parts.pull(part).unwrap();
            if let Some(mut so_far) = joined.rows_so_far() {
                for (all, part) in so_far.rows.iter_mut().zip(rows.rows) {
                    all.extend(part);
                }
                so_far.dense.extend(rows.dense);
                rows = so_far;
            }
            joined.add(Ok(Reply::Rows(rows)));
        }
        let Reply::Rows(rows) = joined.finish().unwrap() else {
            panic!("rows")
        };
        assert_eq!(rows, whole.pull(&pull).unwrap());
    }
}

/// Sync mode: a trainer asked to stop says so in its push of step 0; every pull of step 1 —
/// both trainers' — answers that one was, and the pulls of step 2 that none was since.
#[test]
fn a_stop_pushed_in_a_step_is_answered_to_every_pull_of_the_next() {
    let config = ctr_config(&["cluster.nproc_per_node=2"]);
    let mut shard = common::fresh_shard(&config, 0);
    let pull = |trainer: usize, version: u64| PullRequest {
        trainer,
        version,
        ..pull_of_step_1()
    };
    for (step, stops) in [(0, [false, true]), (1, [false, false])] {
        for (trainer, stop) in stops.into_iter().enumerate() {
            let push = PushRequest {
                stop,
                ..empty_push(&config, trainer, step, UpdateKind::Gradients)
            };
            shard.push(push).unwrap();
        }
        let asked = stops.contains(&true);
        for trainer in 0..2 {
            let next = pull(trainer, step + 1);
            assert!(shard.can_answer(&next));
            assert_eq!(shard.pull(&next).unwrap().stop, asked, "step {step}, trainer {trainer}");
        }
    }
    // The shard's own process asked to stop counts as a trainer would.
    shard.ask_to_stop();
    for trainer in 0..2 {
        shard
            .push(empty_push(&config, trainer, 2, UpdateKind::Gradients))
            .unwrap();
    }
    assert!(shard.pull(&pull(0, 3)).unwrap().stop);
}
