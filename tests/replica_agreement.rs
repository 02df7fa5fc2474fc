//! Replicas start from rank 0's parameters and a divergence between them is
//! caught by the checksum comparison, naming the rank.

use std::time::Duration;

use candle_core::Device;
use flotilla::collective::{RankReplica, Replica};
use flotilla::config::JobConfig;
use flotilla::engines::comm::{memory, CommWorker, Communicator};
use flotilla::models::{mlp, ParamInit};

/// Two replicas over an in-memory ring; rank `r` initialised from seed `r`,
/// so only the broadcast can make them equal. Each replica lives on its own
/// thread, as on the device actors.
fn with_replicas<T: Send>(f: impl Fn(&mut Replica) -> T + Sync) -> Vec<T> {
    with_replicas_of(&JobConfig::default(), f)
}

/// [`with_replicas`] of `job`.
fn with_replicas_of<T: Send>(job: &JobConfig, f: impl Fn(&mut Replica) -> T + Sync) -> Vec<T> {
    let transports = memory::ring(2, Duration::from_secs(10));
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, transport)| {
                let f = &f;
                s.spawn(move || {
                    let model = mlp(4, &[6], 3, &ParamInit::new(rank as u64, Device::Cpu)).expect("model");
                    let comm = CommWorker::spawn(Communicator::new(Box::new(transport))).expect("comm thread");
                    let mut replica = Replica::new(model, job, (comm, None), Device::Cpu, 100).expect("replica");
                    f(&mut replica)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("replica thread")).collect()
    })
}

#[test]
fn broadcast_makes_every_replica_start_from_rank_0() {
    let sums = with_replicas(|r| {
        let before = r.checksum().expect("checksum");
        r.broadcast_parameters().expect("broadcast");
        (
            before,
            r.check_replicas_agree().expect("replicas agree after the broadcast"),
        )
    });
    assert_ne!(
        sums[0].0, sums[1].0,
        "different seeds give different initial parameters"
    );
    assert_eq!(sums[0].1, sums[1].1);
    assert_eq!(sums[0].0, sums[0].1, "rank 0 keeps its own parameters");
}

#[test]
fn a_diverged_replica_is_named() {
    let errors = with_replicas(|r| {
        r.broadcast_parameters().expect("broadcast");
        if r.rank() == 1 {
            let p = r.held().params[0].param.var().expect("held");
            p.set(&(p.as_tensor() + 1e-3).expect("perturb")).expect("set");
        }
        r.check_replicas_agree()
            .expect_err("divergence is detected")
            .to_string()
    });
    for err in errors {
        assert!(err.contains("diverged") && err.contains("rank 1 has"), "{err}");
    }
}

/// With sharded parameters nothing is gathered whole to be checked: each rank checks its own
/// shards, so a value that is not finite in rank 1's shard of a layer is named with the piece
/// of the parameter it lies in.
#[test]
fn a_sharded_parameter_that_is_not_finite_is_named_with_its_piece_and_rank() {
    let mut job = JobConfig::default();
    job.strategy.sharding = true;
    job.strategy.sharding_configs.stage = 3;
    let results = with_replicas_of(&job, |r| {
        r.broadcast_parameters().expect("broadcast");
        if r.rank() == 1 {
            // fc0's bucket is its bias (6 values) then its weight (24); rank 1 holds the part its
            // reduce-scatter finishes, the first 15: the bias and the weight's first 9.
            let weight = r
                .held()
                .params
                .iter()
                .find(|p| p.name == "fc0.weight")
                .expect("fc0")
                .param
                .clone();
            weight
                .set(&(weight.var().expect("held").as_tensor() * f64::NAN).expect("poison"))
                .expect("set");
        }
        r.check_replicas_agree().map_err(|e| e.to_string())
    });
    assert!(results[0].is_ok(), "{:?}", results[0]);
    let err = results[1].as_ref().expect_err("rank 1's shard holds NaN");
    assert!(
        err.contains("parameter fc0.weight[0..9] holds NaN (element 0) (rank 1)"),
        "{err}"
    );
}
