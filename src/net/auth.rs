//! The handshake every connection between roles starts with: both ends prove they know the
//! cluster token, without sending it, before any other byte is read.
//!
//! 1. connecting side → accepting side: `FLOTAUTH` and a fresh 32-byte nonce `c`;
//! 2. accepting side → connecting side: a fresh nonce `s` and `HMAC-SHA256(token, "server" ‖ job ‖ c ‖ s)`;
//! 3. connecting side → accepting side: `HMAC-SHA256(token, "client" ‖ job ‖ c ‖ s)`.
//!
//! `job` is the job id (length-prefixed): two jobs that share a token, on one host or one set of
//! ports, cannot complete a handshake with each other, so neither can steer the other.
//!
//! Each side checks the other's MAC (in constant time) and drops the connection on a mismatch:
//! a stranger learns nothing it could replay, since both nonces are fresh. Every read is
//! bounded by the deadline the caller gives; nothing the peer sends sizes an allocation.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::config::ClusterConfig;

const MAGIC: &[u8; 8] = b"FLOTAUTH";
const NONCE: usize = 32;
const MAC: usize = 32;
const HELLO: usize = MAGIC.len() + NONCE;
const REPLY: usize = NONCE + MAC;

/// Why a peer's proof fails: either a stranger or a process of another job.
const MISMATCH: &str = "the peer does not know the cluster token, or belongs to another job (cluster.job_id)";

/// The longest a peer may take over its handshake: honest peers answer in milliseconds, and a
/// silent stranger must not hold up an accept loop for the job's whole timeout.
const HANDSHAKE_MAX: Duration = Duration::from_secs(10);

/// The variable a launcher hands its processes the token in (`cluster.token` reads it too).
pub const TOKEN_VAR: &str = "FLOTILLA_TOKEN";

/// What a connection's handshake needs: the token and the deadline.
#[derive(Debug, Clone)]
pub struct Credentials {
    token: ClusterToken,
    timeout: Duration,
}

impl Credentials {
    /// `token`, with handshakes bounded by `timeout` (and by 10 s at most).
    pub fn new(token: ClusterToken, timeout: Duration) -> Self {
        Self {
            token,
            timeout: timeout.min(HANDSHAKE_MAX),
        }
    }

    /// The token of `cluster` (`cluster.token`, for the job `cluster.job_id`), with handshakes
    /// bounded by `timeout`.
    pub fn of_cluster(cluster: &ClusterConfig, timeout: Duration) -> Result<Self> {
        let text = cluster.token.as_deref().ok_or_else(|| {
            anyhow::anyhow!(
                "cluster.token is not set: processes of one job must share a secret (set FLOTILLA_TOKEN \
                 or cluster.token to the same value everywhere; `flotilla launch` generates one for its node)"
            )
        })?;
        let token = ClusterToken::new(text).context("cluster.token")?;
        Ok(Self::new(
            token.for_job(cluster.job_id.as_deref().unwrap_or_default()),
            timeout,
        ))
    }

    /// The token of [`TOKEN_VAR`] for the job of [`JOB_ID_VAR`], as the processes of a
    /// benchmark get them.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        let text = std::env::var(TOKEN_VAR).with_context(|| format!("{TOKEN_VAR} is not set"))?;
        let job = std::env::var(JOB_ID_VAR).unwrap_or_default();
        Ok(Self::new(
            ClusterToken::new(&text).context(TOKEN_VAR)?.for_job(&job),
            timeout,
        ))
    }
}

/// The variable a launcher hands its processes the job id in (`cluster.job_id` reads it too).
pub const JOB_ID_VAR: &str = "FLOTILLA_JOB_ID";

/// The secret every role of one cluster shares (`cluster.token` or `FLOTILLA_TOKEN`), bound to
/// the job its holder belongs to.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken {
    secret: Vec<u8>,
    job: String,
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(…)")
    }
}

impl ClusterToken {
    /// The token written as text.
    pub fn new(text: &str) -> Result<Self> {
        anyhow::ensure!(
            text.len() >= 16,
            "a cluster token needs at least 16 characters, got {}",
            text.len()
        );
        Ok(Self {
            secret: text.as_bytes().to_vec(),
            job: String::new(),
        })
    }

    /// The same secret for the processes of job `job` only (`cluster.job_id`).
    pub fn for_job(self, job: &str) -> Self {
        Self {
            job: job.to_string(),
            ..self
        }
    }

    /// A fresh random token (64 hex digits), as a launcher hands its processes.
    pub fn generate() -> Result<String> {
        random_hex::<32>("a cluster token")
    }

    fn mac(&self, role: &[u8], client: &[u8], server: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).expect("HMAC takes keys of any length");
        let job = self.job.as_bytes();
        for part in [role, &(job.len() as u64).to_le_bytes(), job, client, server] {
            mac.update(part);
        }
        mac
    }
}

/// A fresh job id (32 hex digits), as a launcher hands the processes of one job.
pub fn generate_job_id() -> Result<String> {
    random_hex::<16>("a job id")
}

fn random_hex<const N: usize>(what: &str) -> Result<String> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for {what}: {e}"))?;
    Ok(hex::encode(bytes))
}

fn nonce() -> Result<[u8; NONCE]> {
    let mut bytes = [0u8; NONCE];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for a handshake nonce: {e}"))?;
    Ok(bytes)
}

/// The accepting side's answer to `hello`: its nonce and its proof, or an error when `hello`
/// is not a flotilla hello.
fn answer(token: &ClusterToken, hello: &[u8; HELLO]) -> Result<([u8; NONCE], [u8; REPLY])> {
    if &hello[..MAGIC.len()] != MAGIC {
        bail!("not a flotilla handshake (a peer without the cluster token, or not a flotilla peer)");
    }
    let server = nonce()?;
    let mut reply = [0u8; REPLY];
    reply[..NONCE].copy_from_slice(&server);
    let proof = token
        .mac(b"server", &hello[MAGIC.len()..], &server)
        .finalize()
        .into_bytes();
    reply[NONCE..].copy_from_slice(&proof);
    Ok((server, reply))
}

/// The connecting side's proof, after checking the accepting side's.
fn prove(token: &ClusterToken, client: &[u8; NONCE], reply: &[u8; REPLY]) -> Result<[u8; MAC]> {
    let server = &reply[..NONCE];
    token
        .mac(b"server", client, server)
        .verify_slice(&reply[NONCE..])
        .map_err(|_| anyhow::anyhow!(MISMATCH))?;
    Ok(token.mac(b"client", client, server).finalize().into_bytes().into())
}

/// The accepting side's check of the connecting side's proof.
fn check(token: &ClusterToken, hello: &[u8; HELLO], server: &[u8; NONCE], proof: &[u8; MAC]) -> Result<()> {
    token
        .mac(b"client", &hello[MAGIC.len()..], server)
        .verify_slice(proof)
        .map_err(|_| anyhow::anyhow!(MISMATCH))
}

fn hello() -> Result<([u8; NONCE], [u8; HELLO])> {
    let client = nonce()?;
    let mut hello = [0u8; HELLO];
    hello[..MAGIC.len()].copy_from_slice(MAGIC);
    hello[MAGIC.len()..].copy_from_slice(&client);
    Ok((client, hello))
}

/// The connecting side of the handshake on a blocking stream, every read within the deadline.
pub fn connect_sync(stream: &mut TcpStream, credentials: &Credentials) -> Result<()> {
    stream.set_read_timeout(Some(credentials.timeout))?;
    connect_on(stream, credentials)
}

/// The accepting side of the handshake on a blocking stream, every read within the deadline.
pub fn accept_sync(stream: &mut TcpStream, credentials: &Credentials) -> Result<()> {
    stream.set_read_timeout(Some(credentials.timeout))?;
    accept_on(stream, credentials)
}

/// The connecting side over any blocking byte stream whose reads the caller bounds by
/// `credentials`' deadline.
pub fn connect_on(stream: &mut (impl Read + Write), credentials: &Credentials) -> Result<()> {
    let (client, hello) = hello()?;
    stream.write_all(&hello).context("sending the handshake")?;
    let mut reply = [0u8; REPLY];
    read_within(stream, &mut reply, "reading the handshake reply", credentials.timeout)?;
    let proof = prove(&credentials.token, &client, &reply)?;
    stream.write_all(&proof).context("sending the handshake proof")?;
    Ok(())
}

/// The accepting side over any blocking byte stream whose reads the caller bounds by
/// `credentials`' deadline.
pub fn accept_on(stream: &mut (impl Read + Write), credentials: &Credentials) -> Result<()> {
    let mut hello = [0u8; HELLO];
    read_within(stream, &mut hello, "reading the handshake", credentials.timeout)?;
    let (server, reply) = answer(&credentials.token, &hello)?;
    stream.write_all(&reply).context("answering the handshake")?;
    let mut proof = [0u8; MAC];
    read_within(stream, &mut proof, "reading the handshake proof", credentials.timeout)?;
    check(&credentials.token, &hello, &server, &proof)
}

/// Fills `buf` from a stream whose reads time out after `timeout`; a timeout is said as one (a
/// socket's read timeout surfaces as "Resource temporarily unavailable").
fn read_within(stream: &mut impl Read, buf: &mut [u8], what: &str, timeout: Duration) -> Result<()> {
    stream
        .read_exact(buf)
        .map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => io::Error::new(
                ErrorKind::TimedOut,
                format!("the peer sent nothing for {:.1}s", timeout.as_secs_f64()),
            ),
            _ => e,
        })
        .context(what.to_string())
}

/// The connecting side of the handshake on an async stream, all of it within the deadline.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, credentials: &Credentials) -> Result<()> {
    let (token, timeout) = (&credentials.token, credentials.timeout);
    let exchange = async {
        let (client, hello) = hello()?;
        stream.write_all(&hello).await.context("sending the handshake")?;
        let mut reply = [0u8; REPLY];
        stream
            .read_exact(&mut reply)
            .await
            .context("reading the handshake reply")?;
        let proof = prove(token, &client, &reply)?;
        stream.write_all(&proof).await.context("sending the handshake proof")?;
        Ok(())
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| anyhow::anyhow!("the handshake took longer than {timeout:.1?}"))?
}

/// A connection closed before it sent a byte: a port probe (a readiness check, or a rank
/// checking that the coordinator it read of is up), not a stranger.
#[derive(Debug)]
pub struct ClosedUnheard;

impl std::fmt::Display for ClosedUnheard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("closed before sending anything")
    }
}

impl std::error::Error for ClosedUnheard {}

/// The accepting side of the handshake on an async stream, all of it within the deadline; a
/// connection closed before its first byte is a [`ClosedUnheard`].
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, credentials: &Credentials) -> Result<()> {
    let (token, timeout) = (&credentials.token, credentials.timeout);
    let exchange = async {
        let mut hello = [0u8; HELLO];
        let first = stream.read(&mut hello).await.context("reading the handshake")?;
        if first == 0 {
            return Err(ClosedUnheard.into());
        }
        stream
            .read_exact(&mut hello[first..])
            .await
            .context("reading the handshake")?;
        let (server, reply) = answer(token, &hello)?;
        stream.write_all(&reply).await.context("answering the handshake")?;
        let mut proof = [0u8; MAC];
        stream
            .read_exact(&mut proof)
            .await
            .context("reading the handshake proof")?;
        check(token, &hello, &server, &proof)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| anyhow::anyhow!("the handshake took longer than {timeout:.1?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn token(text: &str) -> ClusterToken {
        ClusterToken::new(text).unwrap()
    }

    fn credentials(text: &str) -> Credentials {
        Credentials::new(token(text), Duration::from_secs(2))
    }

    /// Runs the accepting side with `server` and the connecting side with `client` over
    /// loopback; returns both results.
    fn handshake(server: Credentials, client: impl FnOnce(&mut TcpStream) -> Result<()>) -> (Result<()>, Result<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            accept_sync(&mut stream, &server)
        });
        let mut stream = TcpStream::connect(addr).unwrap();
        let connected = client(&mut stream);
        drop(stream);
        (accepting.join().unwrap(), connected)
    }

    #[test]
    fn the_same_token_passes_both_ways() {
        let c = credentials("a cluster token of enough length");
        let (server, client) = handshake(c.clone(), |s| connect_sync(s, &c));
        assert!(server.is_ok() && client.is_ok(), "{server:?} {client:?}");
    }

    #[test]
    fn a_wrong_token_is_refused_by_both_sides() {
        let (server, client) = handshake(credentials("the servers token, long enough"), |s| {
            connect_sync(s, &credentials("another token, also long enough"))
        });
        assert!(client
            .unwrap_err()
            .to_string()
            .contains("does not know the cluster token"));
        assert!(server.is_err());
    }

    #[test]
    fn one_token_in_two_jobs_is_refused_by_both_sides() {
        let job = |id: &str| {
            Credentials::new(
                token("one token shared by two jobs").for_job(id),
                Duration::from_secs(2),
            )
        };
        let (server, client) = handshake(job("job-a"), |s| connect_sync(s, &job("job-b")));
        assert!(client.unwrap_err().to_string().contains("another job"));
        assert!(server.is_err());
        let (server, client) = handshake(job("job-a"), |s| connect_sync(s, &job("job-a")));
        assert!(server.is_ok() && client.is_ok(), "{server:?} {client:?}");
    }

    #[test]
    fn a_silent_peer_is_named_as_a_timeout() {
        let (server, _) = handshake(credentials("a cluster token of enough length"), |_| {
            std::thread::sleep(Duration::from_millis(2500));
            Ok(())
        });
        let error = format!("{:#}", server.unwrap_err());
        assert!(error.contains("sent nothing for 2.0s"), "{error}");
        assert!(!error.contains("os error"), "{error}");
    }

    #[test]
    fn garbage_and_silence_are_refused_without_a_hang() {
        let c = credentials("a cluster token of enough length");
        let (server, _) = handshake(c.clone(), |s| {
            s.write_all(&[0xff; 64])?;
            Ok(())
        });
        assert!(server.unwrap_err().to_string().contains("not a flotilla handshake"));
        let (server, _) = handshake(c, |s| {
            s.write_all(b"FLOTAUTH")?; // then nothing: the accepting side must not wait forever
            std::thread::sleep(Duration::from_millis(2500));
            Ok(())
        });
        assert!(server.is_err());
    }

    #[test]
    fn a_connection_closed_before_its_first_byte_is_a_probe_and_one_cut_short_is_not() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let accepted = |client: fn(&mut TcpStream)| {
            runtime.block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                let connecting = std::thread::spawn(move || client(&mut TcpStream::connect(addr).unwrap()));
                let (mut stream, _) = listener.accept().await.unwrap();
                connecting.join().unwrap();
                accept(&mut stream, &credentials("a token of at least sixteen bytes")).await
            })
        };
        let probe = accepted(|_| {}).unwrap_err();
        assert!(probe.is::<ClosedUnheard>(), "{probe:#}");
        let cut = accepted(|s| s.write_all(b"FLOTAUTH").unwrap()).unwrap_err();
        assert!(!cut.is::<ClosedUnheard>(), "{cut:#}");
    }

    #[test]
    fn tokens_are_long_and_fresh() {
        assert!(ClusterToken::new("short").is_err());
        let (a, b) = (ClusterToken::generate().unwrap(), ClusterToken::generate().unwrap());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert_eq!(format!("{:?}", token(&a)), "ClusterToken(…)");
    }
}
