//! The coordinator's TCP endpoint refuses strangers and bad frames without
//! falling over: a client without the cluster token or with a wrong one, an
//! oversized length, a malformed header, an unexpected message each close
//! that one connection, and the next client is served. Gathers hand rank 0
//! every part, in pieces where the parts are larger than a frame.

use std::time::Duration;

use actix::Actor;
use flotilla::actors::Coordinator;
use flotilla::net::auth::{self, ClusterToken, Credentials};
use flotilla::net::protocol::{Answer, Beat, Join, Request};
use flotilla::net::{server, ControlBus, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CAP: usize = 4096;
const TOKEN: &str = "the control plane test's token";

/// Handshakes within 2 s: a client that sends half a hello is dropped well before the test's
/// 5 s wait for the close.
fn credentials(token: &str) -> Credentials {
    Credentials::new(ClusterToken::new(token).expect("token"), Duration::from_secs(2))
}

async fn start_coordinator(world_size: usize) -> String {
    serve_coordinator(Coordinator::new(world_size, Duration::from_secs(5))).await
}

async fn serve_coordinator(coordinator: Coordinator) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let coordinator = coordinator.start();
    actix::spawn(server::serve(listener, coordinator.into(), CAP, credentials(TOKEN)));
    addr
}

/// Sends raw bytes (after the handshake, with `token`) and expects the server to close the
/// connection.
async fn closes_after(addr: &str, token: Option<&str>, bytes: &[u8]) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    if let Some(token) = token {
        auth::connect(&mut stream, &credentials(token))
            .await
            .expect("handshake");
    }
    stream.write_all(bytes).await.expect("write");
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .expect("closed in time");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "connection should be closed, got {read:?}"
    );
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

#[actix::test]
async fn bad_frames_close_only_their_connection() {
    let addr = start_coordinator(1).await;
    let join = Frame::control(Request::Join(Join {
        rank: 0,
        world_size: 1,
        data_endpoint: "127.0.0.1:9".into(),
        mirror: None,
        settings: Default::default(),
    }))
    .encode()
    .expect("encode");
    // A well-formed frame from a client that skipped the handshake: dropped unread.
    closes_after(&addr, None, &framed(&join)).await;
    // A huge length prefix without the handshake.
    closes_after(&addr, None, &(1u32 << 30).to_be_bytes()).await;
    // A client with another token learns the server does not share it, and is dropped.
    let mut stranger = TcpStream::connect(&addr).await.expect("connect");
    let err = auth::connect(&mut stranger, &credentials("a token of somebody else"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not know the cluster token"), "{err}");
    // Past the handshake: a length far above the cap, refused before anything is allocated.
    closes_after(&addr, Some(TOKEN), &(1u32 << 30).to_be_bytes()).await;
    // A header length larger than the frame.
    closes_after(&addr, Some(TOKEN), &framed(&[200, 0, 0, 0, 1, 2])).await;
    // A well-formed frame carrying an answer, which no request decodes as.
    let answer = Frame::control(Answer::Clock { unix_us: 1.0 }).encode().expect("encode");
    closes_after(&addr, Some(TOKEN), &framed(&answer)).await;

    let mut bus = ControlBus::connect(&addr, Duration::from_secs(5), CAP, &credentials(TOKEN))
        .await
        .expect("connect");
    let roster = bus
        .join(0, 1, "127.0.0.1:9".to_string(), None, Default::default())
        .await
        .expect("served after the bad clients");
    assert_eq!(roster.endpoints, vec!["127.0.0.1:9".to_string()]);
    bus.barrier(0, "done").await.expect("barrier of one");
}

#[actix::test]
async fn an_unreachable_coordinator_is_named() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    drop(listener);
    let err = ControlBus::connect(&addr, Duration::from_millis(300), CAP, &credentials(TOKEN))
        .await
        .err()
        .expect("nobody listens");
    assert!(err.to_string().contains(&addr), "{err}");
}

/// Every bus hands its part of gather `name` at once; the answers by rank.
async fn gather_all(
    buses: &mut [ControlBus],
    name: &str,
    parts: [Vec<u8>; 3],
) -> Vec<anyhow::Result<Vec<bytes::Bytes>>> {
    let gathers = buses
        .iter_mut()
        .zip(parts)
        .enumerate()
        .map(|(rank, (bus, part))| bus.gather(rank, name, part.into()));
    futures::future::join_all(gathers).await
}

#[actix::test]
async fn gathers_hand_rank_0_every_part_even_parts_larger_than_a_frame() {
    let addr = start_coordinator(3).await;
    let mut buses = Vec::new();
    for _ in 0..3 {
        buses.push(
            ControlBus::connect(&addr, Duration::from_secs(5), CAP, &credentials(TOKEN))
                .await
                .expect("connect"),
        );
    }
    let answers = gather_all(&mut buses, "small", [b"zero".to_vec(), Vec::new(), b"two".to_vec()]).await;
    let answers: Vec<_> = answers.into_iter().map(|a| a.expect("gathered")).collect();
    assert_eq!(answers[0], [&b"zero"[..], b"", b"two"]);
    assert!(
        answers[1].is_empty() && answers[2].is_empty(),
        "only rank 0 gets the parts"
    );

    // Each part fits under the cap, the three together do not; and one part alone is larger
    // than the cap: both arrive whole, in pieces.
    let large = [vec![1; 1500], vec![2; 1500], vec![3; 3 * CAP + 7]];
    let answers = gather_all(&mut buses, "large", large.clone()).await;
    let answers: Vec<_> = answers.into_iter().map(|a| a.expect("gathered in pieces")).collect();
    assert_eq!(answers[0], large.map(bytes::Bytes::from));
    assert!(answers[1].is_empty() && answers[2].is_empty());
}

#[actix::test]
async fn a_connection_speaks_for_one_rank_only() {
    let addr = start_coordinator(2).await;
    let mut bus = ControlBus::connect(&addr, Duration::from_secs(5), CAP, &credentials(TOKEN))
        .await
        .expect("connect");
    let limit = Duration::from_secs(5);
    assert_eq!(bus.heartbeat(0, None, limit).await.expect("answered"), Ok(Beat::Alive));
    // The same line now claims rank 1's heartbeat (as a process of another job, or a confused
    // one, could to keep a stalled rank 1 looking alive): refused, and the connection closed.
    match bus.heartbeat(1, None, limit).await {
        Ok(Err(reason)) => assert!(
            reason.contains("a connection of rank 0 sent a message for rank 1"),
            "{reason}"
        ),
        other => panic!("a heartbeat for another rank was not refused: {other:?}"),
    }
    let mut bus = ControlBus::connect(&addr, Duration::from_secs(5), CAP, &credentials(TOKEN))
        .await
        .expect("connect");
    assert!(bus.leave(1, limit).await.is_ok());
    assert!(
        bus.leave(0, limit).await.is_err(),
        "a leave for another rank was accepted"
    );
}

#[actix::test]
async fn a_leave_counts_only_on_the_connection_that_carries_the_ranks_heartbeats() {
    let deadline = Duration::from_millis(300);
    let addr = serve_coordinator(Coordinator::new(2, Duration::from_secs(5)).with_heartbeat_deadline(deadline)).await;
    let proof = credentials(TOKEN);
    let connect = || ControlBus::connect(&addr, Duration::from_secs(5), CAP, &proof);
    let limit = Duration::from_secs(5);
    let mut heartbeats = connect().await.expect("connect");
    assert_eq!(
        heartbeats.heartbeat(0, None, limit).await.expect("answered"),
        Ok(Beat::Alive)
    );
    // A second process with the job's token (a stale one, or the same command started twice)
    // says rank 0 has finished, while rank 0's own line stays open and falls silent.
    let mut stranger = connect().await.expect("connect");
    let refused = stranger.leave(0, limit).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:#}").contains("only on the connection")),
        "a leave from another connection was accepted: {refused:?}"
    );
    tokio::time::sleep(deadline * 3).await;
    let mut observer = connect().await.expect("connect");
    match observer.heartbeat(1, None, limit).await {
        Ok(Err(reason)) => assert!(reason.contains("rank 0 declared dead: no heartbeat"), "{reason}"),
        other => panic!("rank 0's silence went unnoticed: {other:?}"),
    }
    drop(heartbeats);
}

#[actix::test]
async fn a_process_of_another_job_with_the_same_token_is_refused() {
    let addr = start_coordinator(1).await;
    let other_job = Credentials::new(
        ClusterToken::new(TOKEN).expect("token").for_job("another job"),
        Duration::from_secs(2),
    );
    let err = ControlBus::connect(&addr, Duration::from_secs(5), CAP, &other_job)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("belongs to another job"), "{err:#}");
}
