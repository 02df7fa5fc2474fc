//! The accept loop every listening role shares: each connection on a task of its own, the
//! cluster-token handshake first — a connection that fails it is dropped before any frame is
//! read — and a log line naming why a served connection closed.

use std::future::Future;

use tokio::net::{TcpListener, TcpStream};

use super::auth::{self, Credentials};

/// Accepts connections on `listener` until the actor system stops, and serves each proven one
/// with `serve`; `what` names them in the log (`control`, `parameter-server`).
pub async fn accept_authenticated<F, Fut>(listener: TcpListener, credentials: Credentials, what: &'static str, serve: F)
where
    F: Fn(TcpStream) -> Fut + Clone + 'static,
    Fut: Future<Output = Result<(), String>> + 'static,
{
    loop {
        match listener.accept().await {
            Ok((mut stream, peer)) => {
                let (credentials, serve) = (credentials.clone(), serve.clone());
                actix::spawn(async move {
                    if let Err(e) = auth::accept(&mut stream, &credentials).await {
                        tracing::warn!(%peer, "dropped a {what} connection before any frame: {e:#}");
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
