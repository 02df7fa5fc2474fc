//! A thread that owns a communicator and runs the collectives submitted to
//! it in order, so the compute thread can hand over a gradient bucket and go
//! on with backward while the bucket is all-reduced.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use super::Communicator;

type Job = Box<dyn FnOnce(&mut Communicator) + Send>;

/// Owns the communicator's thread. Jobs run in submission order, which is
/// what keeps every rank's sequence of collectives identical.
pub struct CommWorker {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    busy_nanos: Arc<AtomicU64>,
    /// Set once a collective failed: the ring is broken, and every later one fails too.
    failed: Arc<AtomicBool>,
    rank: usize,
    world_size: usize,
}

/// The result of a submitted collective, to be waited for.
#[must_use = "a submitted collective must be waited for"]
pub struct Pending<T> {
    result: Receiver<Result<T>>,
}

impl<T> Pending<T> {
    /// Blocks until the collective has finished.
    pub fn wait(self) -> Result<T> {
        self.result
            .recv()
            .map_err(|_| anyhow!("the communication thread stopped before finishing a collective"))?
    }
}

impl CommWorker {
    /// Starts the thread.
    pub fn spawn(mut comm: Communicator) -> Result<Self> {
        let (rank, world_size) = (comm.rank(), comm.world_size());
        let (jobs, queue) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("comm-rank{rank}"))
            .spawn(move || {
                for job in queue {
                    job(&mut comm);
                }
            })?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
            busy_nanos: Arc::default(),
            failed: Arc::default(),
            rank,
            world_size,
        })
    }

    /// Starts the thread over `comm` for a replica computing on `device`: on GPU jobs whose
    /// ranks each have a GPU of their own, NCCL joins the ring first (see
    /// `nccl::connect`), each of its collectives bounded by `timeout`, so gradient
    /// buckets stay on the GPUs. Every rank of the ring calls it at the same point.
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut, unused_variables))]
    pub fn spawn_on(mut comm: Communicator, device: &candle_core::Device, timeout: Duration) -> Result<Self> {
        #[cfg(feature = "cuda")]
        comm.connect_nccl(device, timeout)?;
        Self::spawn(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the ring.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Queues `collective`; its time is added to [`CommWorker::busy_time`].
    pub fn submit<T: Send + 'static>(
        &self,
        collective: impl FnOnce(&mut Communicator) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (reply, result) = channel();
        let (busy, failed) = (self.busy_nanos.clone(), self.failed.clone());
        let job: Job = Box::new(move |comm| {
            let start = Instant::now();
            let outcome = collective(comm);
            busy.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if outcome.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            // The submitter may have given up waiting; nothing to do then.
            let _ = reply.send(outcome);
        });
        if let Some(jobs) = &self.jobs {
            // A send error means the thread is gone; the dropped reply then
            // makes `wait` report it.
            let _ = jobs.send(job);
        }
        Pending { result }
    }

    /// Runs `collective` and waits for it.
    pub fn run<T: Send + 'static>(
        &self,
        collective: impl FnOnce(&mut Communicator) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.submit(collective).wait()
    }

    /// Whether a collective has failed (a peer is gone, or the ring was broken to roll back):
    /// the compute thread may stop its step early, its result is lost anyway.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Total time spent inside collectives so far.
    pub fn busy_time(&self) -> Duration {
        Duration::from_nanos(self.busy_nanos.load(Ordering::Relaxed))
    }
}

impl Drop for CommWorker {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
