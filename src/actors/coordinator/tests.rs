//! The coordinator's state machines, driven through its messages.

use std::future::Future;
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use tokio::sync::oneshot;

use super::membership::JoinRefused;
use super::*;
use crate::checkpoint::{CheckpointStore, CommitRecord, HeldFile};
use crate::net::protocol::{
    Answer, Beat, Call, ConnectionLost, DeadProcess, Heartbeat, Join, Membership, ReachRank, Reply, Request,
    RollbackOrder, Roster, Settings,
};

/// `request`, handing over `part`, on line `line`: sent at once, answered when awaited.
fn call(c: &Addr<Coordinator>, request: Request, part: Bytes, line: u64) -> impl Future<Output = Reply> {
    let sent = c.send(Call { request, part, line });
    async move { sent.await.expect("coordinator alive") }
}

/// What a reply answers: `Ok` with the answer, `Err` with a refusal's reason.
fn answered(reply: Reply) -> Result<Answer, String> {
    match reply.answer {
        Answer::Refused { reason } => Err(reason),
        answer => Ok(answer),
    }
}

async fn join(c: &Addr<Coordinator>, rank: usize, world_size: usize) -> Result<Roster, String> {
    join_with(c, rank, world_size, Settings::new())
        .await
        .map_err(|refused| match refused {
            JoinRefused::Mismatch(reason) | JoinRefused::Failed(reason) => reason,
        })
}

fn join_with(
    c: &Addr<Coordinator>,
    rank: usize,
    world_size: usize,
    settings: Settings,
) -> impl Future<Output = Result<Roster, JoinRefused>> {
    let data_endpoint = format!("endpoint-{rank}");
    join_at(c, rank, world_size, data_endpoint, settings)
}

fn join_at(
    c: &Addr<Coordinator>,
    rank: usize,
    world_size: usize,
    data_endpoint: String,
    settings: Settings,
) -> impl Future<Output = Result<Roster, JoinRefused>> {
    let join = Join {
        rank,
        world_size,
        data_endpoint,
        mirror: None,
        settings,
    };
    let sent = call(c, Request::Join(join), Bytes::new(), 0);
    async move {
        match sent.await.answer {
            Answer::Roster(roster) => Ok(*roster),
            Answer::Mismatched { reason } => Err(JoinRefused::Mismatch(reason)),
            Answer::Refused { reason } => Err(JoinRefused::Failed(reason)),
            other => panic!("a join answered {other:?}"),
        }
    }
}

fn barrier(c: &Addr<Coordinator>, rank: usize, name: &str) -> impl Future<Output = Result<(), String>> {
    let sent = call(
        c,
        Request::Barrier {
            rank,
            name: name.into(),
        },
        Bytes::new(),
        0,
    );
    async move { answered(sent.await).map(|_| ()) }
}

/// Every rank's part length, and the parts handed back.
fn gather(
    c: &Addr<Coordinator>,
    rank: usize,
    name: &str,
    part: Bytes,
) -> impl Future<Output = Result<(Vec<u64>, Vec<Bytes>), String>> {
    let sent = call(
        c,
        Request::Gather {
            rank,
            name: name.into(),
        },
        part,
        0,
    );
    async move {
        let reply = sent.await;
        let parts = reply.parts.clone();
        match answered(reply)? {
            Answer::Gathered { lengths, .. } => Ok((lengths, parts)),
            other => panic!("a gather answered {other:?}"),
        }
    }
}

fn acknowledge_files(
    c: &Addr<Coordinator>,
    rank: usize,
    step: usize,
    files: Vec<HeldFile>,
) -> impl Future<Output = Result<CommitRecord, String>> {
    let sent = call(c, Request::Acknowledge { rank, step, files }, Bytes::new(), 0);
    async move {
        match answered(sent.await)? {
            Answer::Committed(record) => Ok(record),
            other => panic!("an acknowledgement answered {other:?}"),
        }
    }
}

async fn acknowledge(c: &Addr<Coordinator>, rank: usize, step: usize) -> Result<CommitRecord, String> {
    acknowledge_files(c, rank, step, Vec::new()).await
}

/// Rank `rank`'s heartbeat as process `pid`, on line `line`.
async fn heartbeat(
    c: &Addr<Coordinator>,
    rank: usize,
    pid: u32,
    member_of: Option<Membership>,
    line: u64,
) -> Result<Beat, String> {
    let beat = Heartbeat { rank, pid, member_of };
    match answered(call(c, Request::Heartbeat(beat), Bytes::new(), line).await)? {
        Answer::Alive(beat) => Ok(beat),
        other => panic!("a heartbeat answered {other:?}"),
    }
}

/// Rank `rank`'s heartbeat as process `100 + rank`, on line `line`.
async fn beat(c: &Addr<Coordinator>, rank: usize, line: u64) -> Result<Beat, String> {
    heartbeat(c, rank, 100 + rank as u32, None, line).await
}

async fn leave(c: &Addr<Coordinator>, rank: usize, line: u64) -> Result<(), String> {
    answered(call(c, Request::Leave { rank }, Bytes::new(), line).await).map(|_| ())
}

async fn list_dead(c: &Addr<Coordinator>) -> Vec<DeadProcess> {
    match call(c, Request::ListDead, Bytes::new(), 0).await.answer {
        Answer::Dead { processes } => processes,
        other => panic!("a question for the dead answered {other:?}"),
    }
}

#[actix::test]
async fn roster_is_handed_out_by_rank() {
    let c = Coordinator::new(2, Duration::from_secs(5)).start();
    let (late, early) = futures::join!(join(&c, 1, 2), join(&c, 0, 2));
    let late = late.expect("both joined");
    assert_eq!(late.endpoints, vec!["endpoint-0".to_string(), "endpoint-1".to_string()]);
    assert_eq!((late.generation, late.resume_step), (0, None));
    assert_eq!(early, Ok(late));
}

#[actix::test]
async fn a_rank_that_never_arrives_is_named() {
    let c = Coordinator::new(3, Duration::from_millis(200)).start();
    let err = join(&c, 0, 3).await.expect_err("ranks 1 and 2 are missing");
    assert!(err.contains("ranks 1, 2 never joined"), "{err}");
    let err = barrier(&c, 2, "end")
        .await
        .expect_err("ranks 0 and 1 never reach the barrier");
    assert!(err.contains("ranks 0, 1 never arrived"), "{err}");
}

#[actix::test]
async fn a_gather_answers_rank_0_with_every_part_by_rank_and_every_rank_with_their_lengths() {
    let c = Coordinator::new(3, Duration::from_secs(5)).start();
    let gather = |rank: usize, part: &'static [u8]| gather(&c, rank, "outcomes", Bytes::from_static(part));
    let (two, zero, one) = futures::join!(gather(2, b"c"), gather(0, b"a"), gather(1, b""));
    let lengths = vec![1, 0, 1];
    let parts = vec![Bytes::from_static(b"a"), Bytes::new(), Bytes::from_static(b"c")];
    assert_eq!(zero, Ok((lengths.clone(), parts)));
    // Every rank learns the lengths; the parts go to rank 0 alone.
    assert_eq!(one, Ok((lengths.clone(), Vec::new())));
    assert_eq!(two, Ok((lengths, Vec::new())));
}

#[actix::test]
async fn a_coordinator_that_did_not_run_for_longer_than_the_deadline_gives_the_ranks_a_new_one() {
    let c = Coordinator::new(2, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_millis(200))
        .start();
    for rank in 0..2 {
        assert_eq!(beat(&c, rank, 0).await, Ok(Beat::Alive));
    }
    // The test's thread is the coordinator's: blocking it stops the coordinator as a SIGSTOP
    // (or a starved CPU) would, while the ranks' heartbeats would wait unread.
    std::thread::sleep(Duration::from_millis(700));
    // Its overdue heartbeat checks run first.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for rank in 0..2 {
        assert_eq!(
            beat(&c, rank, 0).await,
            Ok(Beat::Alive),
            "rank {rank} was taken for dead for the coordinator's own silence"
        );
    }
}

#[actix::test]
async fn a_silent_rank_is_declared_dead_and_everyone_is_told() {
    let c = Coordinator::new(2, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_millis(200))
        .start();
    for rank in 0..2 {
        heartbeat(&c, rank, 0, None, 0)
            .await
            .expect("the heartbeat is answered");
    }
    let barrier = barrier(&c, 0, "step");
    // Rank 0 keeps heartbeating; rank 1 falls silent.
    let beating = async {
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = heartbeat(&c, 0, 0, None, 0).await;
        }
    };
    let (waited, ()) = futures::join!(barrier, beating);
    let err = waited.expect_err("the barrier cannot complete");
    assert!(err.contains("rank 1 declared dead: no heartbeat for"), "{err}");
    let refused = heartbeat(&c, 0, 0, None, 0).await.unwrap_err();
    assert_eq!(refused, err, "every later heartbeat hears why the job stopped");
}

/// The coordinator of a process of its own for `world` ranks, which replaces lost ranks in
/// place, and what tells that it is over.
fn coordinator_of_its_own(world: usize) -> (Addr<Coordinator>, oneshot::Receiver<()>) {
    let (done, finished) = oneshot::channel();
    let c = Coordinator::new(world, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_secs(30))
        .recovering_in_place()
        .with_finish(done)
        .start();
    (c, finished)
}

#[actix::test]
async fn once_the_job_was_asked_to_stop_a_lost_rank_is_not_awaited_and_the_coordinator_ends() {
    let (c, mut finished) = coordinator_of_its_own(2);
    for rank in [0, 1] {
        beat(&c, rank, rank as u64).await.expect("the heartbeat is answered");
    }
    c.send(JobAskedToStop).await.expect("the coordinator answers");
    c.send(ConnectionLost { rank: 0, line: 0 })
        .await
        .expect("the coordinator answers");
    assert!(finished.try_recv().is_err(), "rank 1 still runs");
    let err = beat(&c, 1, 1).await.unwrap_err();
    assert!(
        err.contains("rank 0 declared dead after the job was asked to stop"),
        "{err}"
    );
    c.send(ConnectionLost { rank: 1, line: 1 })
        .await
        .expect("the coordinator answers");
    assert!(finished.try_recv().is_ok(), "no rank runs on");
}

#[actix::test]
async fn a_rank_awaited_when_the_job_is_asked_to_stop_is_not_waited_for() {
    let (c, mut finished) = coordinator_of_its_own(2);
    beat(&c, 0, 0).await.expect("the heartbeat is answered");
    // Rank 1 ended with the signal before it reached the coordinator.
    let (joined, ()) = futures::join!(join(&c, 0, 2), async {
        c.send(JobAskedToStop).await.expect("the coordinator answers");
    });
    let err = joined.expect_err("nobody completes the rendezvous");
    assert!(
        err.contains("the job was asked to stop while rank 1 was awaited"),
        "{err}"
    );
    assert!(finished.try_recv().is_err(), "rank 0 still runs");
    c.send(ConnectionLost { rank: 0, line: 0 })
        .await
        .expect("the coordinator answers");
    assert!(finished.try_recv().is_ok(), "no rank runs on");
}

#[actix::test]
async fn a_rank_lost_while_the_job_runs_is_awaited() {
    let (c, mut finished) = coordinator_of_its_own(1);
    beat(&c, 0, 0).await.expect("the heartbeat is answered");
    c.send(ConnectionLost { rank: 0, line: 0 })
        .await
        .expect("the coordinator answers");
    assert!(finished.try_recv().is_err(), "its replacement is awaited");
}

#[actix::test]
async fn a_lost_connection_is_a_death_unless_the_rank_left() {
    let c = Coordinator::new(2, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_secs(30))
        .start();
    heartbeat(&c, 1, 0, None, 1).await.expect("the heartbeat is answered");
    let spoofed = leave(&c, 1, 9).await;
    assert!(
        spoofed.is_err_and(|e| e.contains("only on the connection that carries its heartbeats")),
        "a leave from another line must not end rank 1's failure detection"
    );
    leave(&c, 1, 1).await.expect("the rank leaves");
    c.send(ConnectionLost { rank: 1, line: 1 })
        .await
        .expect("the coordinator answers");
    heartbeat(&c, 0, 0, None, 2)
        .await
        .expect("a rank that left is not dead");
    c.send(ConnectionLost { rank: 0, line: 2 })
        .await
        .expect("the coordinator answers");
    let err = heartbeat(&c, 1, 0, None, 3).await.unwrap_err();
    assert!(
        err.contains("rank 0 declared dead: its heartbeat connection broke"),
        "{err}"
    );
}

#[actix::test]
async fn wrong_world_size_and_duplicates_are_refused() {
    let c = Coordinator::new(2, Duration::from_millis(300)).start();
    let err = join(&c, 0, 3).await.expect_err("world size differs");
    assert!(err.contains("world size 3"), "{err}");
    let (first, twice) = futures::join!(join(&c, 1, 2), join(&c, 1, 2));
    assert!(twice.expect_err("same rank twice").contains("rank 1 joined twice"));
    assert!(first.expect_err("rank 0 never came").contains("rank 0 never joined"));
}

/// Every rank of `c`'s three acknowledges step 10's checkpoint; ranks 0 and 2 wrote a copy each
/// on their nodes, rank 2 one more on a buddy node: committed in `store_dir`, recording every
/// holder (the files are theirs to commit). A coordinator restarted from the record answers
/// rank 1's acknowledgement again with it.
async fn step_10_is_committed_and_answered_again(c: &Addr<Coordinator>, store_dir: &std::path::Path) {
    // are theirs to commit).
    let written = crate::checkpoint::FileRecord {
        name: "replica".into(),
        bytes: 5,
        crc32c: crc32c::crc32c(b"state"),
    };
    let ack = |rank| {
        let held = HeldFile {
            record: written.clone(),
            nodes: if rank == 2 { vec!["node-9".into()] } else { Vec::new() },
        };
        acknowledge_files(c, rank, 10, if rank == 1 { Vec::new() } else { vec![held] })
    };
    let (x, y, z) = futures::join!(ack(0), ack(1), ack(2));
    for answer in [x, y, z] {
        answer.expect("committed");
    }
    let record = CheckpointStore::new(store_dir, 3)
        .recorded()
        .expect("the record reads")
        .expect("a commit is recorded");
    assert_eq!(record.step, 10);
    assert_eq!(
        record.files,
        vec![HeldFile {
            record: written,
            nodes: vec!["endpoint-0".into(), "endpoint-2".into(), "node-9".into()]
        }]
    );
    // Its answer lost with a coordinator that died committing, rank 1 acknowledges again —
    // to a coordinator restarted from the record: answered at once with it.
    let restarted = Coordinator::new(3, Duration::from_secs(5))
        .with_record(record.clone())
        .start();
    assert_eq!(acknowledge(&restarted, 1, 10).await, Ok(record));
}

#[actix::test]
async fn in_place_a_lost_rank_rolls_the_survivors_back_and_its_replacement_rejoins() {
    let store_dir = tempfile::tempdir().expect("a temporary directory");
    let store = CheckpointStore::new(store_dir.path(), 3);
    let c = Coordinator::new(3, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_secs(30))
        .with_checkpoints(Some(store), None)
        .recovering_in_place()
        .start();
    let (a, b, d) = futures::join!(join(&c, 0, 3), join(&c, 1, 3), join(&c, 2, 3));
    assert!(a.is_ok() && b.is_ok() && d.is_ok());
    for rank in 0..3 {
        assert_eq!(beat(&c, rank, rank as u64).await, Ok(Beat::Alive));
    }
    step_10_is_committed_and_answered_again(&c, store_dir.path()).await;

    // Rank 1's line breaks: rank 0, waiting at a barrier, is told at once; rank 2 at its beat.
    let waiting = barrier(&c, 0, "end");
    c.send(ConnectionLost { rank: 1, line: 1 })
        .await
        .expect("the coordinator answers");
    let told = waiting.await.unwrap_err();
    assert!(
        told.contains("rank 1 declared dead") && told.contains("generation 1 resumes from the checkpoint of step 10"),
        "{told}"
    );
    match beat(&c, 2, 2).await {
        Ok(Beat::RollBack { generation: 1, reason }) => assert_eq!(reason, told),
        other => panic!("rank 2 should roll back: {other:?}"),
    }
    assert_eq!(list_dead(&c).await, vec![DeadProcess { rank: 1, pid: 101 }]);
    // A request of the old generation is refused; the replacement beats as a newcomer.
    let stale = barrier(&c, 2, "x");
    assert!(stale.await.is_err());
    assert_eq!(beat(&c, 1, 7).await, Ok(Beat::Alive));
    // The old line's loss after the replacement beat on a new one is no new death.
    c.send(ConnectionLost { rank: 1, line: 1 })
        .await
        .expect("the coordinator answers");
    let (a, b, d) = futures::join!(join(&c, 2, 3), join(&c, 0, 3), join(&c, 1, 3));
    let roster = a.expect("generation 1 formed");
    assert_eq!((roster.generation, roster.resume_step), (1, Some(10)));
    assert_eq!(b, Ok(roster.clone()));
    assert_eq!(d, Ok(roster));
    assert_eq!(beat(&c, 2, 2).await, Ok(Beat::Alive), "rank 2 is in the new generation");
}

/// A rank actor of a test: what the coordinator's orders to it were.
#[derive(Default)]
struct OrderTaker(Vec<RollbackOrder>);

impl Actor for OrderTaker {
    type Context = Context<Self>;
}

impl Handler<RollbackOrder> for OrderTaker {
    type Result = ();

    fn handle(&mut self, order: RollbackOrder, _: &mut Context<Self>) {
        self.0.push(order);
    }
}

#[derive(Message)]
#[rtype(result = "Vec<RollbackOrder>")]
struct TakenOrders;

impl Handler<TakenOrders> for OrderTaker {
    type Result = Vec<RollbackOrder>;

    fn handle(&mut self, _: TakenOrders, _: &mut Context<Self>) -> Vec<RollbackOrder> {
        std::mem::take(&mut self.0)
    }
}

#[actix::test]
async fn in_place_a_reached_rank_gets_its_order_as_a_message_not_on_a_heartbeat() {
    let c = Coordinator::new(2, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_secs(30))
        .recovering_in_place()
        .start();
    let (a, b) = futures::join!(join(&c, 0, 2), join(&c, 1, 2));
    assert!(a.is_ok() && b.is_ok());
    let rank_0 = OrderTaker::default().start();
    c.send(ReachRank {
        rank: 0,
        line: 0,
        actor: rank_0.clone().recipient(),
    })
    .await
    .expect("the coordinator answers");
    for rank in 0..2 {
        assert_eq!(beat(&c, rank, rank as u64).await, Ok(Beat::Alive));
    }
    c.send(ConnectionLost { rank: 1, line: 1 })
        .await
        .expect("the coordinator answers");
    // Sent at once, before any heartbeat; the heartbeat that follows carries nothing.
    let orders = rank_0.send(TakenOrders).await.expect("the order taker answers");
    assert_eq!(orders.len(), 1, "{orders:?}");
    assert_eq!(orders[0].generation, 1);
    assert!(
        orders[0].reason.contains("rank 1 declared dead"),
        "{}",
        orders[0].reason
    );
    assert_eq!(beat(&c, 0, 0).await, Ok(Beat::Alive));
    // A rank reached only after the order was given gets it when it is reached.
    let late = OrderTaker::default().start();
    c.send(ReachRank {
        rank: 0,
        line: 0,
        actor: late.clone().recipient(),
    })
    .await
    .expect("the coordinator answers");
    assert_eq!(late.send(TakenOrders).await.expect("the order taker answers"), orders);
}

#[actix::test]
async fn in_place_a_rank_joining_again_from_a_new_process_replaces_the_old_one() {
    let c = Coordinator::new(2, Duration::from_secs(30))
        .recovering_in_place()
        .start();
    let (a, b) = futures::join!(join(&c, 0, 2), join(&c, 1, 2));
    assert_eq!(a.expect("joined").generation, 0);
    assert_eq!(b.expect("joined").generation, 0);
    // Rank 1 restarted before its old line was seen to break.
    let (rejoined, survivor) = futures::join!(join(&c, 1, 2), join(&c, 0, 2));
    assert_eq!(rejoined.expect("joined").generation, 1);
    assert_eq!(survivor.expect("joined").generation, 1);
    // A replacement of another job's shape is refused as a mismatch, and changes nothing.
    let err = join_with(&c, 1, 3, Settings::new()).await.unwrap_err();
    assert_eq!(
        err,
        JoinRefused::Mismatch("rank 1 was started for world size 3, the job has 2".to_string())
    );
}

fn elastic(min_nodes: usize, max_nodes: usize, timeout_ms: u64) -> Elastic {
    Elastic {
        fixed: 0,
        min_nodes,
        max_nodes,
        per_node: 1,
        timeout: Duration::from_millis(timeout_ms),
    }
}

/// A coordinator of `world` ranks with `elastic` membership, recovering in place, whose every
/// rank joined generation 0 and was heard from.
async fn elastic_job(world: usize, elastic: Elastic) -> Addr<Coordinator> {
    let c = Coordinator::new(world, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_secs(30))
        .with_elastic(Some(elastic))
        .recovering_in_place()
        .start();
    let joined = futures::future::join_all((0..world).map(|rank| join(&c, rank, world))).await;
    for (rank, roster) in joined.into_iter().enumerate() {
        assert_eq!(
            roster.expect("generation 0 formed").members,
            (0..world).collect::<Vec<_>>()
        );
        assert_eq!(beat(&c, rank, rank as u64).await, Ok(Beat::Alive));
    }
    c
}

#[actix::test]
async fn elastic_a_node_not_replaced_in_time_is_dropped_and_a_late_one_is_admitted_at_the_next_checkpoint() {
    let c = elastic_job(3, elastic(2, 3, 200)).await;
    // Rank 2's node is gone for good: once the elastic timeout passes, ranks 0 and 1 go on.
    c.send(ConnectionLost { rank: 2, line: 2 })
        .await
        .expect("the coordinator answers");
    let started = Instant::now();
    let (a, b) = futures::join!(join(&c, 0, 3), join(&c, 1, 3));
    let shrunk = a.expect("generation 1 formed without rank 2");
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "it waited for a replacement first"
    );
    assert_eq!((shrunk.members.clone(), shrunk.generation), (vec![0, 1], 1));
    assert_eq!((shrunk.place_of(1), shrunk.place_of(2)), (Some(1), None));
    assert_eq!(b, Ok(shrunk));
    // A barrier now waits for the two alone.
    let (x, y) = futures::join!(barrier(&c, 0, "b"), barrier(&c, 1, "b"));
    assert_eq!((x, y), (Ok(()), Ok(())));
    // A node comes back: it waits for the next checkpoint, which the two commit as theirs.
    let late = join_at(&c, 2, 3, "endpoint-2b".into(), Settings::new());
    let (x, y) = futures::join!(acknowledge(&c, 0, 10), acknowledge(&c, 1, 10));
    assert_eq!(x.expect("committed").world_size, 2);
    assert!(y.is_ok());
    // Then every rank rolls over to a generation of three, from that checkpoint.
    match beat(&c, 0, 0).await {
        Ok(Beat::RollBack { generation: 2, reason }) => {
            assert!(
                reason.contains("admitting rank 2 at the checkpoint of step 10"),
                "{reason}"
            )
        }
        other => panic!("rank 0 should roll over to admit rank 2: {other:?}"),
    }
    let (a, b, late) = futures::join!(join(&c, 0, 3), join(&c, 1, 3), late);
    let grown = a.expect("generation 2 formed");
    assert_eq!(
        (grown.members.clone(), grown.generation, grown.resume_step),
        (vec![0, 1, 2], 2, Some(10))
    );
    assert_eq!(grown.endpoints[2], "endpoint-2b");
    assert_eq!(b, Ok(grown.clone()));
    assert_eq!(late, Ok(grown));
}

#[actix::test]
async fn elastic_a_node_whose_ranks_are_found_dead_one_by_one_is_dropped_once() {
    let per_node_2 = Elastic {
        per_node: 2,
        ..elastic(1, 2, 150)
    };
    let c = elastic_job(4, per_node_2).await;
    // Rank 2 is found dead and rank 0 rejoins at once; then rank 3, and rank 1 rejoins: the
    // generation that replaced the first still forms, with the first node alone.
    c.send(ConnectionLost { rank: 2, line: 2 })
        .await
        .expect("the coordinator answers");
    let first = join(&c, 0, 4);
    let second = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.send(ConnectionLost { rank: 3, line: 3 })
            .await
            .expect("the coordinator answers");
        join(&c, 1, 4).await
    };
    let (a, b) = futures::join!(first, second);
    let roster = b.expect("formed without the second node");
    assert_eq!((roster.members.clone(), roster.generation), (vec![0, 1], 2));
    assert_eq!(a, Ok(roster));
}

#[actix::test]
async fn elastic_a_rank_waiting_to_be_admitted_hears_the_running_roster_and_asks_again() {
    let c = Coordinator::new(2, Duration::from_millis(400))
        .with_elastic(Some(elastic(1, 2, 100)))
        .recovering_in_place()
        .start();
    // Rank 1 never comes: rank 0 trains alone once the elastic timeout passes.
    let alone = join(&c, 0, 2).await.expect("formed with one node");
    assert_eq!(alone.members, vec![0]);
    // Rank 1 comes late, while no checkpoint is due: within half the timeout it hears the
    // roster it is not in.
    let waited = join(&c, 1, 2).await.expect("answered with the running roster");
    assert_eq!((waited.place_of(1), waited.generation), (None, 0));
}

#[actix::test]
async fn elastic_a_restarted_coordinator_counts_the_members_its_ranks_announce() {
    let restarted = Coordinator::new(3, Duration::from_secs(30))
        .with_heartbeat_deadline(Duration::from_secs(30))
        .with_elastic(Some(elastic(2, 3, 30_000)))
        .recovering_in_place()
        .start();
    // Generation 1 went on without rank 2; its ranks heartbeat to the new coordinator.
    for rank in [0, 1] {
        let member_of = Some(Membership {
            generation: 1,
            members: vec![0, 1],
        });
        let beat = heartbeat(&restarted, rank, 100 + rank as u32, member_of, rank as u64);
        assert_eq!(beat.await, Ok(Beat::Alive));
    }
    let record = futures::join!(acknowledge(&restarted, 0, 10), acknowledge(&restarted, 1, 10));
    for answer in [record.0, record.1] {
        assert_eq!(answer.expect("committed by the two members").world_size, 2);
    }
}

#[actix::test]
async fn elastic_fewer_nodes_than_the_minimum_stop_the_job_saying_so() {
    let c = elastic_job(3, elastic(2, 3, 100)).await;
    c.send(ConnectionLost { rank: 1, line: 1 })
        .await
        .expect("the coordinator answers");
    c.send(ConnectionLost { rank: 2, line: 2 })
        .await
        .expect("the coordinator answers");
    let err = join(&c, 0, 3).await.unwrap_err();
    assert!(
        err.contains("1 whole node(s) joined generation")
            && err.contains("ranks 1, 2 never joined")
            && err.contains("fewer than the minimum of 2 (--nnodes 2:3); the job stops"),
        "{err}"
    );
    assert_eq!(beat(&c, 0, 0).await, Err(err), "every later request hears it");
}

#[actix::test]
async fn a_rank_started_with_other_settings_is_refused_naming_every_key_that_differs() {
    let settings = |lr: &str| -> Settings {
        [
            ("train.lr".to_string(), lr.to_string()),
            ("train.seed".to_string(), "42".to_string()),
        ]
        .into()
    };
    let c = Coordinator::new(1, Duration::from_secs(30))
        .with_settings(settings("0.05"))
        .start();
    let err = join_with(&c, 0, 1, settings("0.1")).await.unwrap_err();
    assert_eq!(
        err,
        JoinRefused::Mismatch("rank 0 was started for another job: train.lr = 0.1, the job has 0.05".to_string())
    );
    assert!(join_with(&c, 0, 1, settings("0.05")).await.is_ok());
}
