//! How a stage exchanges activations (forward, to the next stage) and their gradients
//! (backward, to the previous one). Stages form a ring, so with interleaving the last stage's
//! chunk feeds the first stage's next chunk. Stages of one process use channels
//! ([`MemoryStageLink`]); stages in separate processes use two ring transports
//! ([`TransportStageLink`]).
//!
//! Every message carries one bit besides its tensor, a *signal* per direction ([`Signals`]): a
//! stage sets what its messages say ([`StageLink::signal`]), and a message passes on what the
//! sender heard from upstream in the same direction, so by the end of a step's schedule a
//! stage has heard every stage before it (forward) or after it (backward) in the chain of
//! chunks. Preemption rides on it: stages agree to stop without a message of their own.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use candle_core::{DType, Device, Tensor};

use crate::engines::comm::RingTransport;

/// The signals a stage's messages carry and those it heard, per direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Signals {
    /// Set on forward messages.
    pub forward: bool,
    /// Set on backward messages.
    pub backward: bool,
}

impl Signals {
    /// Either direction's.
    fn or(self, other: Signals) -> Signals {
        Signals {
            forward: self.forward || other.forward,
            backward: self.backward || other.backward,
        }
    }
}

/// What a link keeps of the signals: its own and what it heard since they were set.
#[derive(Debug, Default)]
struct SignalState {
    own: Signals,
    heard: Signals,
}

impl SignalState {
    /// Sending `own`, having heard nothing yet.
    fn sending(own: Signals) -> Self {
        Self {
            own,
            heard: Signals::default(),
        }
    }

    /// What the next message sent says: this stage's signal, and what it heard from upstream.
    fn outgoing(&self) -> Signals {
        self.own.or(self.heard)
    }
}

/// A stage's connections to its neighbours. `what` names the transfer in errors.
pub trait StageLink: Send {
    /// Every message sent from now on carries `signals` (and what this stage hears from
    /// upstream in the same direction); forgets what was heard before.
    fn signal(&mut self, signals: Signals);
    /// The signals the messages received since [`signal`](Self::signal) carried; forgets them
    /// and this stage's own, so that messages outside a step (evaluation's) carry none.
    fn heard(&mut self) -> Signals;
    /// Sends an activation to the next stage.
    fn send_forward(&mut self, what: &str, activation: Tensor) -> Result<()>;
    /// Receives an activation from the previous stage.
    fn recv_forward(&mut self, what: &str) -> Result<Tensor>;
    /// Sends an activation's gradient to the previous stage.
    fn send_backward(&mut self, what: &str, gradient: Tensor) -> Result<()>;
    /// Receives the gradient of this stage's output from the next stage.
    fn recv_backward(&mut self, what: &str) -> Result<Tensor>;
}

/// Stages of one process: channels between threads.
pub struct MemoryStageLink {
    stage: usize,
    stages: usize,
    timeout: Duration,
    to_next: Sender<(Tensor, bool)>,
    from_previous: Receiver<(Tensor, bool)>,
    to_previous: Sender<(Tensor, bool)>,
    from_next: Receiver<(Tensor, bool)>,
    signals: SignalState,
}

/// The links of `stages` stages in one process, indexed by stage; a receive waits at most
/// `timeout`.
pub fn memory_links(stages: usize, timeout: Duration) -> Vec<MemoryStageLink> {
    // forward[s] carries activations into stage s, backward[s] gradients into stage s.
    let (forward_tx, forward_rx): (Vec<_>, Vec<_>) = (0..stages).map(|_| channel()).unzip();
    let (backward_tx, backward_rx): (Vec<_>, Vec<_>) = (0..stages).map(|_| channel()).unzip();
    forward_rx
        .into_iter()
        .zip(backward_rx)
        .enumerate()
        .map(|(stage, (from_previous, from_next))| MemoryStageLink {
            stage,
            stages,
            timeout,
            to_next: forward_tx[(stage + 1) % stages].clone(),
            from_previous,
            to_previous: backward_tx[(stage + stages - 1) % stages].clone(),
            from_next,
            signals: SignalState::default(),
        })
        .collect()
}

impl MemoryStageLink {
    fn receive(&self, from: &Receiver<(Tensor, bool)>, peer: usize, what: &str) -> Result<(Tensor, bool)> {
        from.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => anyhow!(
                "stage {}: {what}: nothing from stage {peer} within {:.0?}",
                self.stage,
                self.timeout
            ),
            RecvTimeoutError::Disconnected => anyhow!("stage {}: {what}: stage {peer} is gone", self.stage),
        })
    }

    fn next(&self) -> usize {
        (self.stage + 1) % self.stages
    }

    fn previous(&self) -> usize {
        (self.stage + self.stages - 1) % self.stages
    }
}

impl StageLink for MemoryStageLink {
    fn signal(&mut self, signals: Signals) {
        self.signals = SignalState::sending(signals);
    }

    fn heard(&mut self) -> Signals {
        std::mem::take(&mut self.signals).heard
    }

    fn send_forward(&mut self, what: &str, activation: Tensor) -> Result<()> {
        self.to_next
            .send((activation, self.signals.outgoing().forward))
            .map_err(|_| anyhow!("stage {}: {what}: stage {} is gone", self.stage, self.next()))
    }

    fn recv_forward(&mut self, what: &str) -> Result<Tensor> {
        let (activation, signal) = self.receive(&self.from_previous, self.previous(), what)?;
        self.signals.heard.forward |= signal;
        Ok(activation)
    }

    fn send_backward(&mut self, what: &str, gradient: Tensor) -> Result<()> {
        self.to_previous
            .send((gradient, self.signals.outgoing().backward))
            .map_err(|_| anyhow!("stage {}: {what}: stage {} is gone", self.stage, self.previous()))
    }

    fn recv_backward(&mut self, what: &str) -> Result<Tensor> {
        let (gradient, signal) = self.receive(&self.from_next, self.next(), what)?;
        self.signals.heard.backward |= signal;
        Ok(gradient)
    }
}

/// Most dimensions a tensor between stages may have: the header has room for this many.
const MAX_DIMS: usize = 8;
/// Bytes of a tensor's header: its dtype, its rank, the signal (0 or 1), then [`MAX_DIMS`]
/// dimensions, each a u64 LE.
const HEADER_BYTES: usize = 8 * (3 + MAX_DIMS);
/// The header's word of the first dimension.
const FIRST_DIM: usize = 3;
/// The header's dtype word for f32, the only dtype that travels between stages (the
/// receiver builds the tensor from raw f32 bytes).
const F32_TAG: u64 = u64::from_le_bytes(*b"f32\0\0\0\0\0");

/// Stages in separate processes: a *forward* ring over the replica's stages in order (stage
/// `s` is ring rank `s`, so it sends to `s + 1` and receives from `s − 1`; the ring wraps,
/// which interleaved schedules use) and a *backward* ring over them in reverse (stage `s` is
/// ring rank `p − 1 − s`, so it sends to `s − 1`). A tensor travels as a fixed-size header
/// message, then its f32 values as bytes.
pub struct TransportStageLink {
    stage: usize,
    forward: StageRing,
    backward: StageRing,
    /// Where received tensors are built: the stage's compute device.
    device: Device,
    signals: SignalState,
}

/// One direction of a stage's traffic: the ring it sends on to one neighbour stage and
/// receives on from the other.
struct StageRing {
    /// Dropped before `in_flight`, so its send queue is done with those bytes first.
    transport: Box<dyn RingTransport>,
    /// The stage this ring sends to.
    to: usize,
    /// The stage this ring receives from.
    from: usize,
    /// Names the ring in the transport's errors (which name the peers' ranks).
    op: &'static str,
    /// The last tensor sent, kept alive until the next send on this ring has waited for it:
    /// one message of slack, so two neighbours that send to each other at once (1F1B's steady
    /// state) both go on to receive, however large the tensors and however small the socket
    /// buffers.
    in_flight: Option<InFlight>,
}

/// A queued tensor's bytes and what it was, for errors.
struct InFlight {
    what: String,
    header: Vec<u8>,
    values: Vec<f32>,
}

impl TransportStageLink {
    /// Stage `stage`'s link over its two rings; `forward` must be ring rank `stage` and
    /// `backward` ring rank `p − 1 − stage` of rings of the same `p` stages. Received tensors
    /// are built on `device`.
    pub fn new(
        stage: usize,
        forward: Box<dyn RingTransport>,
        backward: Box<dyn RingTransport>,
        device: Device,
    ) -> Result<Self> {
        let p = forward.world_size();
        ensure!(
            stage < p && forward.rank() == stage && backward.world_size() == p && backward.rank() == p - 1 - stage,
            "stage {stage}: the forward ring must be ring rank {stage} of the stages and the backward ring rank \
             p − 1 − {stage}; got forward rank {} of {p}, backward rank {} of {}",
            forward.rank(),
            backward.rank(),
            backward.world_size()
        );
        let (next, previous) = ((stage + 1) % p, (stage + p - 1) % p);
        Ok(Self {
            stage,
            forward: StageRing {
                transport: forward,
                to: next,
                from: previous,
                op: "forward stage ring",
                in_flight: None,
            },
            backward: StageRing {
                transport: backward,
                to: previous,
                from: next,
                op: "backward stage ring",
                in_flight: None,
            },
            device,
            signals: SignalState::default(),
        })
    }
}

impl StageRing {
    /// Waits until the previous send on this ring is out, then frees its bytes.
    fn settle(&mut self, stage: usize) -> Result<()> {
        let Some(previous) = &self.in_flight else {
            return Ok(());
        };
        let flushed = self
            .transport
            .flush(self.op)
            .with_context(|| format!("stage {stage}: {}: sending to stage {}", previous.what, self.to));
        // The flush waited for every queued message, failed or not: the bytes are free.
        self.in_flight = None;
        flushed
    }

    fn send(&mut self, stage: usize, what: &str, tensor: &Tensor, signal: bool) -> Result<()> {
        self.settle(stage)?;
        let context = || format!("stage {stage}: {what}: sending to stage {}", self.to);
        let dims = tensor.dims();
        if tensor.dtype() != DType::F32 {
            bail!(
                "{}: only f32 tensors travel between stages, got {:?}",
                context(),
                tensor.dtype()
            );
        }
        if dims.len() > MAX_DIMS {
            bail!(
                "{}: a tensor of {} dimensions {dims:?}; at most {MAX_DIMS} travel between stages",
                context(),
                dims.len()
            );
        }
        let values = tensor
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .with_context(context)?;
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(&F32_TAG.to_le_bytes());
        header.extend_from_slice(&(dims.len() as u64).to_le_bytes());
        header.extend_from_slice(&u64::from(signal).to_le_bytes());
        for i in 0..MAX_DIMS {
            header.extend_from_slice(&(dims.get(i).copied().unwrap_or(0) as u64).to_le_bytes());
        }
        let queued = self.in_flight.insert(InFlight {
            what: what.to_string(),
            header,
            values,
        });
        // SAFETY (both sends): the buffers live in `self.in_flight`, untouched, until `settle`
        // has flushed them, or until the transport, dropped before them, has.
        unsafe { self.transport.send_queued(self.op, &queued.header) }.with_context(context)?;
        unsafe {
            self.transport
                .send_queued(self.op, bytemuck::cast_slice(&queued.values))
        }
        .with_context(context)
    }

    /// The next tensor and the signal it carried.
    fn recv(&mut self, stage: usize, what: &str, device: &Device) -> Result<(Tensor, bool)> {
        let context = || format!("stage {stage}: {what}: receiving from stage {}", self.from);
        let mut header = [0u8; HEADER_BYTES];
        self.transport.recv_into(self.op, &mut header).with_context(context)?;
        let word = |i: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&header[i * 8..(i + 1) * 8]);
            u64::from_le_bytes(bytes)
        };
        if word(0) != F32_TAG {
            bail!(
                "{}: the header names dtype {:#x}, only f32 travels between stages",
                context(),
                word(0)
            );
        }
        let rank = word(1) as usize;
        if rank > MAX_DIMS {
            bail!(
                "{}: the header claims {rank} dimensions, at most {MAX_DIMS} travel",
                context()
            );
        }
        let signal = match word(2) {
            0 => false,
            1 => true,
            other => bail!("{}: the header's signal word is {other}, not 0 or 1", context()),
        };
        let dims: Vec<usize> = (0..rank).map(|i| word(FIRST_DIM + i) as usize).collect();
        let len = dims
            .iter()
            .try_fold(4usize, |n, &d| n.checked_mul(d))
            .with_context(|| format!("{}: a tensor of shape {dims:?} is too large", context()))?;
        // Allocated once the transport has checked the message is of that length, so a bad
        // header cannot make this rank allocate what the peer never sends.
        let mut values: Vec<f32> = Vec::new();
        self.transport
            .recv(self.op, len, &mut |offset, piece| {
                if values.is_empty() {
                    values = vec![0.0; len / 4];
                }
                bytemuck::cast_slice_mut::<f32, u8>(&mut values)[offset..offset + piece.len()].copy_from_slice(piece);
            })
            .with_context(context)?;
        if values.is_empty() {
            values = vec![0.0; len / 4];
        }
        Ok((Tensor::from_vec(values, dims, device).with_context(context)?, signal))
    }
}

impl StageLink for TransportStageLink {
    fn signal(&mut self, signals: Signals) {
        self.signals = SignalState::sending(signals);
    }

    fn heard(&mut self) -> Signals {
        std::mem::take(&mut self.signals).heard
    }

    fn send_forward(&mut self, what: &str, activation: Tensor) -> Result<()> {
        let signal = self.signals.outgoing().forward;
        self.forward.send(self.stage, what, &activation, signal)
    }

    fn recv_forward(&mut self, what: &str) -> Result<Tensor> {
        let (activation, signal) = self.forward.recv(self.stage, what, &self.device)?;
        self.signals.heard.forward |= signal;
        Ok(activation)
    }

    fn send_backward(&mut self, what: &str, gradient: Tensor) -> Result<()> {
        let signal = self.signals.outgoing().backward;
        self.backward.send(self.stage, what, &gradient, signal)
    }

    fn recv_backward(&mut self, what: &str) -> Result<Tensor> {
        let (gradient, signal) = self.backward.recv(self.stage, what, &self.device)?;
        self.signals.heard.backward |= signal;
        Ok(gradient)
    }
}

impl Drop for TransportStageLink {
    /// The last tensor of each ring may still be on its way: wait for it (bounded by the
    /// transport's timeout) so the neighbour receives it whole.
    fn drop(&mut self) {
        for ring in [&mut self.forward, &mut self.backward] {
            if let Err(e) = ring.settle(self.stage) {
                tracing::warn!("{e:#}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::comm::memory;

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// The links of `p` stages over in-memory rings.
    fn links(p: usize) -> Vec<TransportStageLink> {
        let forward = memory::ring(p, TIMEOUT);
        let mut backward: Vec<Option<_>> = memory::ring(p, TIMEOUT).into_iter().map(Some).collect();
        forward
            .into_iter()
            .enumerate()
            .map(|(s, f)| {
                let b = backward[p - 1 - s].take().unwrap();
                TransportStageLink::new(s, Box::new(f), Box::new(b), Device::Cpu).unwrap()
            })
            .collect()
    }

    /// A tensor whose shape and values say which stage sent it in which direction.
    fn tensor(stage: usize, backward: bool) -> Tensor {
        let dims: Vec<usize> = match stage {
            0 => vec![2, 3],
            1 => vec![4],
            _ => vec![1, 2, 2, 1],
        };
        let n: usize = dims.iter().product();
        let offset = if backward { 100.0 } else { 0.0 };
        let values: Vec<f32> = (0..n).map(|i| offset + (stage * 10 + i) as f32 + 0.5).collect();
        Tensor::from_vec(values, dims, &Device::Cpu).unwrap()
    }

    fn same(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && a.flatten_all().unwrap().to_vec1::<f32>().unwrap() == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn tensors_go_round_both_rings_whole() {
        let p = 3;
        let handles: Vec<_> = links(p)
            .into_iter()
            .enumerate()
            .map(|(s, mut link)| {
                std::thread::spawn(move || {
                    let (next, previous) = ((s + 1) % p, (s + p - 1) % p);
                    for round in 0..3 {
                        link.send_forward(&format!("forward {round}"), tensor(s, false))
                            .unwrap();
                        let got = link.recv_forward(&format!("forward {round}")).unwrap();
                        assert!(
                            same(&got, &tensor(previous, false)),
                            "stage {s}: forward from {previous}"
                        );
                        link.send_backward(&format!("backward {round}"), tensor(s, true))
                            .unwrap();
                        let got = link.recv_backward(&format!("backward {round}")).unwrap();
                        assert!(same(&got, &tensor(next, true)), "stage {s}: backward from {next}");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    /// One micro-batch down the chain of three stages and back: stage 1 signals forward, stage 2
    /// backward; each message passes on what its sender heard upstream.
    fn chain_of_signals(mut links: Vec<Box<dyn StageLink>>) -> Vec<Signals> {
        let own = [
            Signals::default(),
            Signals {
                forward: true,
                backward: false,
            },
            Signals {
                forward: false,
                backward: true,
            },
        ];
        for (link, own) in links.iter_mut().zip(own) {
            link.signal(own);
        }
        let x = tensor(0, false);
        for s in 0..2 {
            links[s].send_forward("activation", x.clone()).unwrap();
            links[s + 1].recv_forward("activation").unwrap();
        }
        for s in (1..3).rev() {
            links[s].send_backward("gradient", x.clone()).unwrap();
            links[s - 1].recv_backward("gradient").unwrap();
        }
        let heard = links.iter_mut().map(|link| link.heard()).collect();
        // Evaluation's messages after the step carry nothing.
        links[1].send_forward("evaluation", x.clone()).unwrap();
        links[2].recv_forward("evaluation").unwrap();
        assert_eq!(links[2].heard(), Signals::default());
        heard
    }

    #[test]
    fn signals_pass_down_the_chain_in_their_direction() {
        let heard = |forward, backward| Signals { forward, backward };
        let expected = vec![heard(false, true), heard(false, true), heard(true, false)];
        let memory: Vec<Box<dyn StageLink>> = memory_links(3, TIMEOUT)
            .into_iter()
            .map(|l| Box::new(l) as Box<dyn StageLink>)
            .collect();
        assert_eq!(chain_of_signals(memory), expected);
        let transport = links(3)
            .into_iter()
            .map(|l| Box::new(l) as Box<dyn StageLink>)
            .collect();
        assert_eq!(chain_of_signals(transport), expected);
    }

    #[test]
    fn other_dtypes_and_gone_peers_are_errors_naming_the_stages() {
        let mut links = links(3);
        let ids = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        let err = format!(
            "{:#}",
            links[1].send_forward("activation of micro-batch 0", ids).unwrap_err()
        );
        assert!(
            err.contains("stage 1: activation of micro-batch 0: sending to stage 2") && err.contains("only f32"),
            "{err}"
        );
        let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
        links[1].send_forward("a scalar", scalar.clone()).unwrap();
        assert!(same(&links[2].recv_forward("a scalar").unwrap(), &scalar));

        links.truncate(2);
        let err = format!("{:#}", links[0].recv_forward("forward of micro-batch 3").unwrap_err());
        assert!(
            err.contains("stage 0: forward of micro-batch 3: receiving from stage 2") && err.contains("left the ring"),
            "{err}"
        );
        let err = format!("{:#}", links[1].recv_backward("backward of micro-batch 1").unwrap_err());
        assert!(
            err.contains("stage 1: backward of micro-batch 1: receiving from stage 2: backward stage ring")
                && err.contains("left the ring"),
            "{err}"
        );
    }

    #[test]
    fn rings_in_the_wrong_order_are_refused() {
        let mut forward = memory::ring(2, TIMEOUT).into_iter();
        let mut backward = memory::ring(2, TIMEOUT).into_iter();
        let (f0, b0) = (forward.next().unwrap(), backward.next().unwrap());
        let Err(err) = TransportStageLink::new(0, Box::new(f0), Box::new(b0), Device::Cpu) else {
            panic!("stage 0 is backward ring rank 1 of 2, not 0");
        };
        assert!(err.to_string().contains("backward rank 0 of 2"), "{err}");
    }
}
