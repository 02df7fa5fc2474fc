//! Every decoder of bytes from the network, as property tests on the stable toolchain, in every
//! test run (`PROPTEST_CASES` raises the count for a longer search): control frames, parameter-server requests
//! and replies, pipeline stage outcomes and both sides of the handshake. Arbitrary bytes, and
//! valid encodings cut short, with a byte changed or with a length overwritten by a huge one,
//! give an error or a value — never a panic, and never an allocation sized by a claimed length
//! (that would abort the test process). Valid encodings decode to what was encoded.

use std::io::{Read, Write};
use std::time::Duration;

use bytes::Bytes;
use flotilla::actors::stage::StageOutcome;
use flotilla::checkpoint::FileRecord;
use flotilla::net::auth::{accept_on, connect_on, ClusterToken, Credentials};
use flotilla::net::protocol::{
    Answer, Beat, DeadProcess, Heartbeat, Join, Membership, Request as ControlRequest, Roster,
};
use flotilla::net::Frame;
use flotilla::ps::wire::{
    read_reply, read_request, write_reply, write_request, Part, PullRequest, PulledRows, PushRequest, Reply, Request,
    ShardCall, UpdateKind,
};
use proptest::prelude::*;

/// The frame cap the parameter-server readers are given.
const CAP: usize = 1 << 20;

fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
    futures::executor::block_on(future)
}

fn encode_request(call: &ShardCall) -> std::io::Result<Bytes> {
    let mut wire = Vec::new();
    block_on(write_request(&mut wire, call, CAP))?;
    Ok(wire.into())
}

fn encode_reply(reply: &anyhow::Result<Reply>) -> std::io::Result<Bytes> {
    let mut wire = Vec::new();
    block_on(write_reply(&mut wire, reply, CAP))?;
    Ok(wire.into())
}

fn decode_request(wire: &[u8]) -> std::io::Result<Option<ShardCall>> {
    block_on(read_request(&mut &wire[..], CAP))
}

fn decode_reply(wire: &[u8]) -> std::io::Result<anyhow::Result<Reply>> {
    block_on(read_reply(&mut &wire[..], CAP, None))
}

/// Runs every decoder on `body`; only a panic fails.
fn decode_with_every_decoder(body: &[u8]) {
    let _ = decode_request(body);
    let _ = decode_reply(body);
    let body = Bytes::copy_from_slice(body);
    let _ = Frame::<ControlRequest>::decode(body.clone());
    let _ = Frame::<Answer>::decode(body.clone());
    let _ = StageOutcome::from_bytes(body);
}

fn control_requests() -> Vec<Frame<ControlRequest>> {
    vec![
        Frame::control(ControlRequest::Join(Join {
            rank: 3,
            world_size: 4,
            data_endpoint: "127.0.0.1:6174".into(),
            mirror: Some("127.0.0.1:41000".into()),
            settings: [("train.lr".to_string(), "0.05".to_string())].into(),
        })),
        Frame {
            header: ControlRequest::Gather {
                rank: 1,
                name: "checkpoint of step 40".into(),
            },
            payload: Bytes::from_static(b"a part of some bytes"),
        },
        Frame::control(ControlRequest::Heartbeat(Heartbeat {
            rank: 2,
            pid: 4321,
            member_of: Some(Membership {
                generation: 3,
                members: vec![0, 2],
            }),
        })),
        Frame::control(ControlRequest::Acknowledge {
            rank: 2,
            step: 40,
            files: vec![held_file()],
        }),
    ]
}

fn held_file() -> flotilla::checkpoint::HeldFile {
    flotilla::checkpoint::HeldFile {
        record: FileRecord {
            name: "rank-0.safetensors".into(),
            bytes: 1024,
            crc32c: 0x1234_5678,
        },
        nodes: vec!["10.0.0.1".into(), "10.0.0.2".into()],
    }
}

fn control_answers() -> Vec<Frame<Answer>> {
    let record = flotilla::checkpoint::CommitRecord {
        step: 40,
        world_size: 2,
        files: vec![held_file()],
    };
    vec![
        Frame::control(Answer::Mismatched {
            reason: "train.lr = 0.1, the job has 0.05".into(),
        }),
        Frame {
            header: Answer::Gathered {
                name: "stage outcomes".into(),
                lengths: vec![3, 0, 5],
            },
            payload: Bytes::from_static(b"abcdefgh"),
        },
        Frame::control(Answer::Alive(Beat::RollBack {
            generation: 3,
            reason: "rank 1 declared dead".into(),
        })),
        Frame::control(Answer::Roster(Box::new(Roster {
            members: vec![0, 1],
            endpoints: vec!["127.0.0.1:6171".into(), "127.0.0.1:6172".into()],
            mirrors: vec![None, Some("127.0.0.1:41001".into())],
            generation: 3,
            resume_step: Some(40),
            record: Some(record.clone()),
        }))),
        Frame::control(Answer::Committed(record)),
        Frame::control(Answer::Dead {
            processes: vec![DeadProcess { rank: 1, pid: 77 }],
        }),
    ]
}

fn requests() -> Vec<Request> {
    vec![
        Request::Pull(PullRequest {
            trainer: 1,
            version: 7,
            after_training: false,
            training: true,
            ids: vec![vec![1, 5, 9], vec![], vec![u64::MAX]],
            dense: true,
        }),
        Request::Push(PushRequest {
            trainer: 0,
            step: 12,
            part: Part { index: 2, of: 5 },
            kind: UpdateKind::Gradients,
            ids: vec![vec![4, 2], vec![8]],
            values: vec![vec![0.5; 8], vec![-1.0; 4]],
            counts: vec![vec![2.0, 1.0, 1.0, 0.0], vec![]],
            dense: vec![0.25; 6],
            stop: true,
        }),
        Request::Checkpoint {
            step: 60,
            trainer: 1,
            files: vec![FileRecord {
                name: "ps-trainer-1.safetensors".into(),
                bytes: 4096,
                crc32c: 0xdead_beef,
            }],
        },
        Request::Leave { trainer: 3 },
        Request::Save,
        Request::Evaluated {
            trainer: 2,
            scores: vec![0.25, 0.75, 0.5],
            labels: vec![0.0, 1.0, 1.0],
        },
    ]
}

fn replies() -> Vec<Reply> {
    vec![
        Reply::Evaluation {
            auc: Some(0.75),
            samples: 1000,
        },
        Reply::Rows(PulledRows {
            rows: vec![vec![1.0, 2.0], vec![], vec![3.5; 5]],
            dense: vec![0.125; 3],
            stop: true,
        }),
        Reply::Checkpointed(vec![FileRecord {
            name: "ps-shard-0.safetensors".into(),
            bytes: 1 << 20,
            crc32c: 7,
        }]),
        Reply::Done,
    ]
}

fn stage_outcome() -> StageOutcome {
    StageOutcome {
        rank: 1,
        steps: 20,
        losses: vec![2.5, 1.25],
        evaluated: Some(flotilla::models::Score {
            total: 90.0,
            loss_total: 31.5,
            count: 100,
        }),
        samples_per_sec: 1000.0,
        allreduce_ratio: 0.1,
        exposed_allreduce_ratio: 0.05,
        peak_activations: 4,
        peak_activation_bytes: 4096,
        bubble_fraction: 0.2,
        state_bytes: flotilla::collective::StateBytes {
            parameters: 48,
            gradients: 48,
            optimizer: 96,
        },
        parameters: vec![("block1.weight".into(), vec![0.5; 12]), ("block1.bias".into(), vec![])],
    }
}

/// Every valid encoding the decoders are tested from.
fn valid_encodings() -> Vec<Bytes> {
    let mut all: Vec<Bytes> = control_requests()
        .iter()
        .map(|f| f.encode().expect("encodes"))
        .collect();
    all.extend(control_answers().iter().map(|f| f.encode().expect("encodes")));
    all.extend(
        requests()
            .into_iter()
            .map(|r| encode_request(&ShardCall::first(r)).expect("encodes")),
    );
    all.extend(replies().into_iter().map(|r| encode_reply(&Ok(r)).expect("encodes")));
    all.push(encode_reply(&Err(anyhow::anyhow!("a shard's failure"))).expect("encodes"));
    all.push(stage_outcome().to_bytes().expect("encodes"));
    all
}

/// How a valid encoding is damaged.
#[derive(Debug, Clone)]
enum Damage {
    CutAt(usize),
    Xor(usize, u8),
    HugeLengthAt(usize),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<usize>().prop_map(Damage::CutAt),
        (any::<usize>(), 1..=255u8).prop_map(|(at, x)| Damage::Xor(at, x)),
        any::<usize>().prop_map(Damage::HugeLengthAt),
    ]
}

fn damaged(valid: &[u8], damage: &Damage) -> Vec<u8> {
    let mut bytes = valid.to_vec();
    if bytes.is_empty() {
        return bytes;
    }
    match *damage {
        Damage::CutAt(at) => bytes.truncate(at % bytes.len()),
        Damage::Xor(at, x) => {
            let at = at % bytes.len();
            bytes[at] ^= x;
        }
        Damage::HugeLengthAt(at) => {
            // A big-endian u32 length prefix, and postcard's varint of a length near 2^35.
            let at = at % bytes.len();
            for (i, b) in [0xff, 0xff, 0xff, 0xff, 0x7f].into_iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + i) {
                    *slot = b;
                }
            }
        }
    }
    bytes
}

/// A peer that answers with scripted bytes and swallows what it is sent.
struct Scripted<'a>(&'a [u8]);

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The cases of each property: `PROPTEST_CASES`, else 2,000.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000)
}

proptest! {
    // 2,000 cases a run; `PROPTEST_CASES` asks for more (an explicit count overrides proptest's
    // own reading of it).
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_refused_or_decoded_without_a_panic(body in proptest::collection::vec(any::<u8>(), 0..600)) {
        decode_with_every_decoder(&body);
    }

    #[test]
    fn damaged_encodings_are_refused_or_decoded_without_a_panic(which in any::<usize>(), damage in damage()) {
        let encodings = valid_encodings();
        let valid = &encodings[which % encodings.len()];
        decode_with_every_decoder(&damaged(valid, &damage));
    }

    #[test]
    fn a_handshake_against_arbitrary_bytes_fails_cleanly(script in proptest::collection::vec(any::<u8>(), 0..160)) {
        let token = ClusterToken::new("the property tests' cluster token").expect("token");
        let credentials = Credentials::new(token, Duration::from_secs(1));
        // Guessing a valid MAC is impossible: arbitrary bytes never pass.
        prop_assert!(accept_on(&mut Scripted(&script), &credentials).is_err());
        prop_assert!(connect_on(&mut Scripted(&script), &credentials).is_err());
    }
}

#[test]
fn valid_encodings_decode_to_what_was_encoded() {
    for frame in control_requests() {
        let decoded = Frame::<ControlRequest>::decode(frame.encode().expect("encodes")).expect("decodes");
        assert_eq!(decoded, frame);
    }
    for frame in control_answers() {
        let decoded = Frame::<Answer>::decode(frame.encode().expect("encodes")).expect("decodes");
        assert_eq!(decoded, frame);
    }
    for (generation, request) in requests().into_iter().enumerate() {
        let call = ShardCall {
            generation: generation as u64,
            request,
        };
        assert_eq!(
            decode_request(&encode_request(&call).expect("encodes")).expect("decodes"),
            Some(call)
        );
    }
    for reply in replies() {
        assert_eq!(
            decode_reply(&encode_reply(&Ok(reply.clone())).expect("encodes"))
                .expect("decodes")
                .expect("no refusal"),
            reply
        );
    }
    let failure =
        decode_reply(&encode_reply(&Err(anyhow::anyhow!("a shard's failure"))).expect("encodes")).expect("decodes");
    assert!(format!("{:#}", failure.expect_err("a failure")).contains("a shard's failure"));
    let encoded = stage_outcome().to_bytes().expect("encodes");
    let decoded = StageOutcome::from_bytes(encoded.clone()).expect("decodes");
    assert_eq!(decoded.to_bytes().expect("encodes"), encoded);
    assert_eq!(decoded.parameters, stage_outcome().parameters);
}
