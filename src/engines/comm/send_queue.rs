//! A thread that writes queued messages to one link, in order, so the ring
//! can keep forwarding pieces while the calling thread receives and reduces
//! the next ones.

use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use super::transport::MessageHeader;

/// Where a send queue writes: a socket, or a shared-memory link.
pub(super) trait MessageSink: Send + 'static {
    /// Writes one whole message.
    fn write_message(&mut self, header: MessageHeader, bytes: &[u8]) -> io::Result<()>;
}

impl MessageSink for TcpStream {
    fn write_message(&mut self, header: MessageHeader, bytes: &[u8]) -> io::Result<()> {
        self.write_all(&header.encode())?;
        self.write_all(bytes)
    }
}

struct Job {
    header: MessageHeader,
    /// Address and length of bytes the queue's owner keeps alive until
    /// [`SendQueue::wait_all`] returns.
    ptr: usize,
    len: usize,
}

/// Ordered, asynchronous writes to one stream.
pub(super) struct SendQueue {
    jobs: Option<Sender<Job>>,
    results: Receiver<io::Result<()>>,
    outstanding: usize,
    /// Messages queued so far: the next one's sequence number.
    sent: u64,
    thread: Option<JoinHandle<()>>,
}

impl SendQueue {
    /// Starts the writer thread on `sink`.
    pub(super) fn new(sink: impl MessageSink, name: String) -> io::Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let (report, results) = channel();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            let mut sink = sink;
            for job in queue {
                // SAFETY: `push`'s contract keeps the bytes alive and
                // unchanged until `wait_all` has received this job's result.
                let bytes = unsafe { std::slice::from_raw_parts(job.ptr as *const u8, job.len) };
                let written = sink.write_message(job.header, bytes);
                if report.send(written).is_err() {
                    break;
                }
            }
        })?;
        Ok(Self {
            jobs: Some(jobs),
            results,
            outstanding: 0,
            sent: 0,
            thread: Some(thread),
        })
    }

    /// Queues `bytes` as the link's next message.
    ///
    /// # Safety
    /// `bytes` must stay valid and must not be written to until the next
    /// [`SendQueue::wait_all`] has returned.
    pub(super) unsafe fn push(&mut self, bytes: &[u8]) -> io::Result<()> {
        let header = MessageHeader {
            seq: self.sent,
            len: bytes.len() as u64,
        };
        let job = Job {
            header,
            ptr: bytes.as_ptr() as usize,
            len: bytes.len(),
        };
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(job).ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "the ring sender thread has stopped"))?;
        self.outstanding += 1;
        self.sent += 1;
        Ok(())
    }

    /// Waits until every queued message has been written; the first error
    /// wins, and every job is waited for even after one failed.
    pub(super) fn wait_all(&mut self) -> io::Result<()> {
        let mut first_error = None;
        while self.outstanding > 0 {
            let result = self
                .results
                .recv()
                .unwrap_or_else(|_| Err(io::Error::other("the ring sender thread died")));
            self.outstanding -= 1;
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for SendQueue {
    fn drop(&mut self) {
        // Queued bytes may belong to a caller's buffer: finish with them first.
        let _ = self.wait_all();
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
