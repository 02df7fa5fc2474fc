//! How a stage exchanges activations (forward, to the next stage) and their gradients
//! (backward, to the previous one). Stages form a ring, so with interleaving the last stage's
//! chunk feeds the first stage's next chunk.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use anyhow::{anyhow, Result};
use candle_core::Tensor;

/// A stage's connections to its neighbours. `what` names the transfer in errors.
pub trait StageLink: Send {
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
    to_next: Sender<Tensor>,
    from_previous: Receiver<Tensor>,
    to_previous: Sender<Tensor>,
    from_next: Receiver<Tensor>,
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
        })
        .collect()
}

impl MemoryStageLink {
    fn receive(&self, from: &Receiver<Tensor>, peer: usize, what: &str) -> Result<Tensor> {
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
    fn send_forward(&mut self, what: &str, activation: Tensor) -> Result<()> {
        self.to_next
            .send(activation)
            .map_err(|_| anyhow!("stage {}: {what}: stage {} is gone", self.stage, self.next()))
    }

    fn recv_forward(&mut self, what: &str) -> Result<Tensor> {
        self.receive(&self.from_previous, self.previous(), what)
    }

    fn send_backward(&mut self, what: &str, gradient: Tensor) -> Result<()> {
        self.to_previous
            .send(gradient)
            .map_err(|_| anyhow!("stage {}: {what}: stage {} is gone", self.stage, self.previous()))
    }

    fn recv_backward(&mut self, what: &str) -> Result<Tensor> {
        self.receive(&self.from_next, self.next(), what)
    }
}
