//! The accept loop every listening role shares: each connection on a task of its own, the
//! cluster-token handshake first — a connection that fails it is dropped before any frame is
//! read — and a log line naming why a served connection closed.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use super::auth::{self, Credentials};

/// Refused connections logged in full per window; the rest are counted.
const REFUSALS_IN_FULL: usize = 5;

/// How often the count of refusals not logged is reported.
const REFUSAL_WINDOW: Duration = Duration::from_secs(60);

/// Accepts connections on `listener` until the actor system stops, and serves each proven one
/// with `serve`; `what` names them in the log (`control`, `parameter-server`).
pub async fn accept_authenticated<F, Fut>(listener: TcpListener, credentials: Credentials, what: &'static str, serve: F)
where
    F: Fn(TcpStream) -> Fut + Clone + 'static,
    Fut: Future<Output = Result<(), String>> + 'static,
{
    let refusals = Rc::new(RefCell::new(RefusalLog::new(Instant::now())));
    loop {
        match listener.accept().await {
            Ok((mut stream, peer)) => {
                let (credentials, serve, refusals) = (credentials.clone(), serve.clone(), refusals.clone());
                actix::spawn(async move {
                    if let Err(e) = auth::accept(&mut stream, &credentials).await {
                        if e.is::<auth::ClosedUnheard>() {
                            tracing::debug!(%peer, "a {what} connection closed before sending anything (a port probe)");
                            return;
                        }
                        let (logged, unlogged) = refusals.borrow_mut().note(Instant::now());
                        if let Some(count) = unlogged {
                            tracing::warn!(
                                "{count} more {what} connections were dropped before any frame in the last {}s",
                                REFUSAL_WINDOW.as_secs()
                            );
                        }
                        match logged {
                            Logged::InFull => {
                                tracing::warn!(%peer, "dropped a {what} connection before any frame: {e:#}")
                            }
                            Logged::FirstCounted => tracing::warn!(
                                %peer,
                                "dropped a {what} connection before any frame: {e:#}; more this minute are \
                                 counted, not logged one by one"
                            ),
                            Logged::Counted => {}
                        }
                        return;
                    }
                    if let Err(reason) = serve(stream).await {
                        tracing::warn!(%peer, "closed {what} connection: {reason}");
                    }
                });
            }
            Err(e) => tracing::warn!("accepting a {what} connection failed: {e}"),
        }
    }
}

/// How one refused connection is logged.
#[derive(Debug, PartialEq, Eq)]
enum Logged {
    /// With its peer and reason.
    InFull,
    /// In full, saying that the next ones are counted.
    FirstCounted,
    /// Only counted: a crowd of strangers must not flood the log, nor the disk under it.
    Counted,
}

/// The refused connections of one listener, in windows of [`REFUSAL_WINDOW`]: the first
/// [`REFUSALS_IN_FULL`] of a window are logged in full, the rest counted and reported once the
/// window has passed.
struct RefusalLog {
    window_start: Instant,
    in_window: usize,
}

impl RefusalLog {
    fn new(now: Instant) -> Self {
        Self {
            window_start: now,
            in_window: 0,
        }
    }

    /// Notes a refusal at `now`: how to log it, and the count of the last window's refusals
    /// not logged, once that window has passed.
    fn note(&mut self, now: Instant) -> (Logged, Option<usize>) {
        let mut unlogged = None;
        if now.saturating_duration_since(self.window_start) >= REFUSAL_WINDOW {
            unlogged = Some(self.in_window.saturating_sub(REFUSALS_IN_FULL + 1)).filter(|&n| n > 0);
            *self = Self::new(now);
        }
        self.in_window += 1;
        let logged = match self.in_window {
            n if n <= REFUSALS_IN_FULL => Logged::InFull,
            n if n == REFUSALS_IN_FULL + 1 => Logged::FirstCounted,
            _ => Logged::Counted,
        };
        (logged, unlogged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crowd_of_refusals_logs_a_few_in_full_and_counts_the_rest_once_a_window() {
        let start = Instant::now();
        let mut log = RefusalLog::new(start);
        let noted: Vec<(Logged, Option<usize>)> = (0..1500).map(|_| log.note(start)).collect();
        let in_full = noted.iter().filter(|(l, _)| *l != Logged::Counted).count();
        assert_eq!(in_full, REFUSALS_IN_FULL + 1, "1,500 strangers, a handful of lines");
        assert_eq!(noted[REFUSALS_IN_FULL].0, Logged::FirstCounted);
        assert!(noted.iter().all(|(_, unlogged)| unlogged.is_none()));
        // The next window reports the count not logged, then logs in full again.
        let (logged, unlogged) = log.note(start + REFUSAL_WINDOW);
        assert_eq!((logged, unlogged), (Logged::InFull, Some(1500 - REFUSALS_IN_FULL - 1)));
        let (_, unlogged) = log.note(start + REFUSAL_WINDOW * 2);
        assert_eq!(unlogged, None, "a quiet window has nothing to report");
    }
}
