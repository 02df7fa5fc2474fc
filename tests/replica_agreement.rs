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
    let job = JobConfig::default();
    let transports = memory::ring(2, Duration::from_secs(10));
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, transport)| {
                let (job, f) = (&job, &f);
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
