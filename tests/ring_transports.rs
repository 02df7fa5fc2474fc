//! The ring collectives over the transports between processes — TCP
//! sockets on 127.0.0.1 and shared memory — one thread per rank: sums (all-reduce, and
//! reduce-scatter then all-gather of the shards) against a plain sum, for sizes that cut segments into many pieces, into
//! uneven ones, and into empty ones.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use flotilla::engines::comm::tcp::TcpTransport;
use flotilla::engines::comm::{connect_ring_transport, Abandoned, Communicator, RingPlace, RingTransport, Wire};
use flotilla::net::auth::{ClusterToken, Credentials};

const TOKEN: &str = "the ring transports test's token";

#[derive(Clone, Copy, Debug)]
enum Kind {
    Tcp,
    Shm,
}

fn on_ring<T: Send>(kind: Kind, n: usize, f: impl Fn(&mut Communicator) -> T + Sync) -> Vec<T> {
    on_listeners(kind, &bind_endpoints(n), f)
}

/// `n` ring endpoints on loopback, bound before any rank connects (as a launched rank's are).
fn bind_endpoints(n: usize) -> Vec<TcpListener> {
    (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect()
}

fn on_listeners<T: Send>(kind: Kind, listeners: &[TcpListener], f: impl Fn(&mut Communicator) -> T + Sync) -> Vec<T> {
    let ranks: Vec<usize> = (0..listeners.len()).collect();
    on_sub_ring(kind, &ranks, listeners, Duration::from_secs(20), f)
}

/// One thread per member of a ring over the global `ranks` (in ring order), each serving its
/// endpoint on `listeners[position]`.
fn on_sub_ring<T: Send>(
    kind: Kind,
    ranks: &[usize],
    listeners: &[TcpListener],
    timeout: Duration,
    f: impl Fn(&mut Communicator) -> T + Sync,
) -> Vec<T> {
    let endpoints: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().expect("addr")).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(position, listener)| {
                let (endpoints, f) = (&endpoints, &f);
                s.spawn(move || {
                    let transport = connect(kind, ranks, position, endpoints, listener, timeout).expect("connects");
                    f(&mut Communicator::new(transport))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// The member at `position` of a ring over the global `ranks` joins it.
fn connect(
    kind: Kind,
    ranks: &[usize],
    position: usize,
    endpoints: &[SocketAddr],
    listener: &TcpListener,
    timeout: Duration,
) -> anyhow::Result<Box<dyn RingTransport>> {
    let place = RingPlace::new(position, ranks.to_vec())?;
    let credentials = Credentials::new(ClusterToken::new(TOKEN).expect("token"), timeout);
    // Every endpoint is on loopback, so shared memory is used exactly when asked for.
    let shared_memory = matches!(kind, Kind::Shm);
    connect_ring_transport(
        place,
        endpoints,
        listener,
        timeout,
        shared_memory,
        &credentials,
        &Abandoned::never(),
    )
}

fn rank_buffer(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7919 + i * 31) % 1000) as f32 / 8.0).collect()
}

#[test]
fn all_reduce_over_tcp_matches_plain_sum() {
    all_reduce_matches_plain_sum(Kind::Tcp);
}

#[test]
fn all_reduce_over_shared_memory_matches_plain_sum() {
    all_reduce_matches_plain_sum(Kind::Shm);
}

fn all_reduce_matches_plain_sum(kind: Kind) {
    for n in 2..=4usize {
        // 0, fewer values than ranks, uneven, and 2.3 M floats (several
        // 256 Ki pieces per segment).
        let sizes = [0, n - 1, 1031, 2_300_017];
        let results = on_ring(kind, n, |c| {
            sizes
                .iter()
                .map(|&len| {
                    let mut data = rank_buffer(c.rank(), len);
                    c.all_reduce_sum("test all-reduce", &mut data)?;
                    // The same sum as a sharded optimizer takes it: reduce-scatter, then the
                    // shards alone (the rest overwritten) gathered.
                    let mut sharded = rank_buffer(c.rank(), len);
                    let shard = c.reduce_scatter_sum_as("test reduce-scatter", &mut sharded, Wire::F32)?;
                    let mut gathered = vec![f32::NAN; len];
                    gathered[shard.clone()].copy_from_slice(&sharded[shard]);
                    c.all_gather_shards_as("test all-gather", &mut gathered, Wire::F32)?;
                    anyhow::Ok((data, gathered))
                })
                .collect::<Vec<_>>()
        });
        for (i, &len) in sizes.iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| rank_buffer(r, len)).collect();
            let expected: Vec<f32> = (0..len).map(|j| inputs.iter().map(|b| b[j]).sum()).collect();
            for (rank, per_size) in results.iter().enumerate() {
                let (all_reduced, gathered) = per_size[i].as_ref().expect("the collectives succeed");
                // Multiples of 1/8 below 1000: every partial sum is exact.
                assert!(all_reduced == &expected, "{kind:?} n={n} len={len} rank={rank}");
                assert!(gathered == &expected, "{kind:?} n={n} len={len} rank={rank}: sharded");
            }
        }
    }
}

#[test]
fn broadcast_gather_and_barrier() {
    for kind in [Kind::Tcp, Kind::Shm] {
        broadcast_gather_and_barrier_over(kind);
    }
}

fn broadcast_gather_and_barrier_over(kind: Kind) {
    let results = on_ring(kind, 3, |c| {
        let mut data = vec![c.rank() as u8; 3 << 20];
        c.broadcast("test broadcast", &mut data, 1)?;
        let gathered = c.all_gather("test gather", &[c.rank() as u8; 5])?;
        c.barrier("test barrier")?;
        Ok::<_, anyhow::Error>((data.iter().all(|&b| b == 1), gathered))
    });
    for r in results {
        let (all_from_root, gathered) = r.expect("collectives succeed");
        assert!(all_from_root);
        assert_eq!(gathered, vec![vec![0u8; 5], vec![1u8; 5], vec![2u8; 5]]);
    }
}

#[test]
fn a_dead_neighbour_is_an_error_naming_it() {
    for kind in [Kind::Tcp, Kind::Shm] {
        a_dead_neighbour_over(kind);
    }
}

fn a_dead_neighbour_over(kind: Kind) {
    let results = on_ring(kind, 2, |c| {
        if c.rank() == 1 {
            return Ok(());
        }
        // Rank 1 returned and dropped its links: rank 0 gets an error, not a hang.
        std::thread::sleep(Duration::from_millis(200));
        c.all_reduce_sum("all-reduce of bucket 0", &mut [1.0; 1000])
    });
    let err = results[0].as_ref().expect_err("rank 1 is gone").to_string();
    assert!(err.contains("rank 1") && err.contains("bucket 0"), "{kind:?}: {err}");
}

#[test]
fn a_member_that_left_a_ring_over_some_ranks_is_named_by_its_rank() {
    for kind in [Kind::Tcp, Kind::Shm] {
        for leaving in [0, 1] {
            // A stage ring over ranks 2 and 5: positions 0 and 1 are not the ranks.
            let ranks = [2, 5];
            let results = on_sub_ring(kind, &ranks, &bind_endpoints(2), Duration::from_secs(20), |c| {
                if c.rank() == leaving {
                    return Ok(());
                }
                c.all_reduce_sum("all-reduce of bucket 0", &mut [1.0; 1000])
            });
            let staying = 1 - leaving;
            let err = format!("{:#}", results[staying].as_ref().expect_err("the neighbour is gone"));
            assert!(
                err.contains(&format!("rank {}", ranks[leaving])) && err.contains("bucket 0"),
                "{kind:?}, rank {} left: {err}",
                ranks[leaving]
            );
            assert!(!err.contains("rank 0") && !err.contains("rank 1"), "{kind:?}: {err}");
        }
    }
}

#[test]
fn a_member_silent_in_a_ring_over_some_ranks_times_out_naming_both_ranks() {
    let silent_until_timed_out = std::sync::Barrier::new(2);
    let results = on_sub_ring(Kind::Tcp, &[2, 5], &bind_endpoints(2), Duration::from_secs(2), |c| {
        let outcome = match c.rank() {
            0 => c.all_reduce_sum("all-reduce of bucket 0", &mut [1.0; 10]),
            _ => Ok(()),
        };
        silent_until_timed_out.wait();
        outcome
    });
    let err = format!("{:#}", results[0].as_ref().expect_err("rank 5 never sends"));
    assert!(
        err.contains("waiting for rank 5 (rank 2 at position 0 of the ring over ranks [2, 5])"),
        "{err}"
    );
}

#[test]
fn a_member_nobody_serves_is_named_by_its_rank() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let unserved = SocketAddr::from(([127, 0, 0, 1], common::free_port_range(1)));
    let endpoints = [listener.local_addr().expect("addr"), unserved];
    let err = connect(Kind::Tcp, &[2, 5], 0, &endpoints, &listener, Duration::from_millis(500))
        .err()
        .expect("rank 5 never answers");
    let err = format!("{err:#}");
    assert!(
        err.contains(&format!("rank 2: could not connect to rank 5 at {unserved}")),
        "{err}"
    );
    assert!(!err.contains("rank 0") && !err.contains("rank 1"), "{err}");
}

#[test]
fn a_stranger_at_a_ring_endpoint_is_dropped_and_the_ring_still_forms() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let peer = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoints = [listener.local_addr().unwrap(), peer.local_addr().unwrap()];
    // Before the ring connects, someone without the token knocks and sends garbage.
    let mut stranger = std::net::TcpStream::connect(endpoints[0]).expect("connect");
    std::io::Write::write_all(&mut stranger, &[0xAB; 64]).expect("write");
    let timeout = Duration::from_secs(20);
    let credentials = Credentials::new(ClusterToken::new(TOKEN).expect("token"), timeout);
    let sums = std::thread::scope(|s| {
        let ranks: Vec<_> = [&listener, &peer]
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (endpoints, credentials) = (&endpoints, &credentials);
                s.spawn(move || {
                    let place = RingPlace::identity(rank, endpoints.len());
                    let transport =
                        TcpTransport::connect(place, endpoints, l, timeout, credentials, &Abandoned::never())
                            .expect("connects");
                    let mut values = vec![rank as f32 + 1.0; 3];
                    Communicator::new(Box::new(transport))
                        .all_reduce_sum("sum", &mut values)
                        .expect("all-reduce");
                    values
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().expect("rank")).collect::<Vec<_>>()
    });
    assert_eq!(sums, vec![vec![3.0; 3]; 2]);
}

#[test]
fn silent_and_slow_strangers_at_every_ring_endpoint_cost_the_ring_nothing() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let listeners = bind_endpoints(3);
        // Before the ranks connect, each endpoint holds three silent connections and one that
        // starts a handshake and stops: each would hold a one-at-a-time accept loop for the
        // handshake's 10 s, longer together than the ring's 20 s timeout.
        let strangers: Vec<std::net::TcpStream> = listeners
            .iter()
            .flat_map(|l| {
                let addr = l.local_addr().expect("addr");
                (0..4).map(move |i| {
                    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
                    if i == 3 {
                        std::io::Write::write_all(&mut stream, b"FLOTAUTH").expect("write");
                    }
                    stream
                })
            })
            .collect();
        let sums = on_listeners(kind, &listeners, |c| {
            let mut values = vec![c.rank() as f32 + 1.0; 5];
            c.all_reduce_sum("sum", &mut values).map(|()| values)
        });
        for sum in sums {
            assert_eq!(sum.expect("the ring forms and sums"), vec![6.0; 5], "{kind:?}");
        }
        drop(strangers);
    }
}

/// `flotilla bench allreduce --collective` times each collective between real processes and
/// reports it as nccl-tests does: the bus bandwidth of an all-reduce is algbw × 2(n−1)/n, of a
/// reduce-scatter or an all-gather algbw × (n−1)/n.
#[test]
fn the_benchmark_times_each_collective_between_processes() {
    for (collective, factor) in [("allreduce", 1.0), ("reducescatter", 0.5), ("allgather", 0.5)] {
        let args = [
            "bench",
            "allreduce",
            "--nproc",
            "2",
            "--size-mb",
            "1",
            "--iters",
            "2",
            "--json",
            "--collective",
            collective,
        ];
        let bench = common::flotilla(&args, &[], 120);
        bench.assert_success(&format!("bench allreduce --collective {collective}"));
        let figures: serde_json::Value = bench
            .stdout
            .lines()
            .find(|line| line.starts_with('{'))
            .and_then(|line| serde_json::from_str(line).ok())
            .unwrap_or_else(|| panic!("no figures from {collective}:\n{}", bench.stdout));
        assert_eq!(figures["op"], collective, "{figures}");
        let (algbw, busbw) = (figures["algbw_gbps"].as_f64(), figures["busbw_gbps"].as_f64());
        let (Some(algbw), Some(busbw)) = (algbw, busbw) else {
            panic!("{collective}: no bandwidths in {figures}")
        };
        assert!(algbw > 0.0, "{figures}");
        assert!((busbw - factor * algbw).abs() <= 1e-9 * algbw, "{figures}");
    }
}
