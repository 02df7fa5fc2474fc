//! A client of PyTorch's `TCPStore` (c10d's key-value store), the one torchrun's elastic agent
//! serves at `MASTER_ADDR:MASTER_PORT` for its workers. Only what a rank needs to meet its
//! peers: set a key, and get one once it exists.
//!
//! The wire format is c10d's: a one-byte query type, then native-endian (little-endian on every
//! platform flotilla builds for) fixed-size integers and `u64`-length-prefixed byte strings. A
//! connection first validates itself with a magic number and answers a ping. Keys carry the
//! `/` prefix PyTorch's `TCPStore` gives them, so a PyTorch process sees the same keys.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// c10d's query types (`QueryType` in its TCPStore backend), the ones used here.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Wait = 6,
    CancelWait = 12,
    Ping = 13,
}

/// The number a client proves it speaks the protocol with, first on every connection.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// c10d's answers to a wait.
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// Values larger than this are refused: what a rank reads is an address.
const MAX_VALUE_BYTES: u64 = 1 << 16;

/// An open connection to a `TCPStore`.
#[derive(Debug)]
pub struct TcpStoreClient {
    stream: TcpStream,
    /// `host:port`, for errors.
    address: String,
}

impl TcpStoreClient {
    /// Connects to the store at `address`, retrying while it is not yet up, for at most
    /// `timeout`; validates the connection and pings the store. A peer that answers the ping
    /// wrong is no store: refused at once.
    pub fn connect(address: &str, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            match Self::try_connect(address, timeout) {
                Ok(client) => return Ok(client),
                Err(e) if Instant::now() >= deadline || e.root_cause().downcast_ref::<std::io::Error>().is_none() => {
                    return Err(e.context(format!(
                        "could not reach torchrun's store at {address} within {:.1}s",
                        timeout.as_secs_f64()
                    )))
                }
                Err(e) => tracing::debug!("torchrun's store at {address} not reachable yet: {e:#}"),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn try_connect(address: &str, timeout: Duration) -> Result<Self> {
        let socket = address
            .to_socket_addrs()
            .with_context(|| format!("resolving torchrun's store address {address}"))?
            .next()
            .ok_or_else(|| anyhow!("torchrun's store address {address} resolves to nothing"))?;
        let stream = TcpStream::connect_timeout(&socket, timeout.min(Duration::from_secs(5)))
            .with_context(|| format!("connecting to torchrun's store at {address}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut client = Self {
            stream,
            address: address.to_string(),
        };
        client.send(&[&[Query::Validate as u8], &VALIDATION_MAGIC.to_le_bytes()])?;
        let nonce = std::process::id();
        client.send(&[&[Query::Ping as u8], &nonce.to_le_bytes()])?;
        let echoed = u32::from_le_bytes(client.receive::<4>()?);
        if echoed != nonce {
            bail!("{address} answered a ping with {echoed}, not {nonce}: it is not a TCPStore");
        }
        Ok(client)
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let key = prefixed(key);
        self.send(&[&[Query::Set as u8], &string(key.as_bytes()), &string(value)])
            .with_context(|| format!("setting {key} in torchrun's store at {}", self.address))
    }

    /// The value of `key`, waiting at most `timeout` for some process to set it.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let key = prefixed(key);
        self.wait(&key, timeout)?;
        self.send(&[&[Query::Get as u8], &string(key.as_bytes())])?;
        let len = u64::from_le_bytes(self.receive::<8>()?);
        if len > MAX_VALUE_BYTES {
            bail!(
                "torchrun's store at {} holds {len} bytes at {key}: not an address",
                self.address
            );
        }
        let mut value = vec![0u8; len as usize];
        self.stream
            .read_exact(&mut value)
            .with_context(|| format!("reading {key} from torchrun's store at {}", self.address))?;
        Ok(value)
    }

    /// Waits until `key` exists, for at most `timeout`: the store answers when it does; past
    /// the timeout the wait is cancelled (the store then confirms the cancel).
    fn wait(&mut self, key: &str, timeout: Duration) -> Result<()> {
        self.send(&[&[Query::Wait as u8], &1u64.to_le_bytes(), &string(key.as_bytes())])?;
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        let answer = self.receive::<1>();
        self.stream.set_read_timeout(Some(timeout))?;
        match answer {
            Ok([STOP_WAITING]) => return Ok(()),
            Ok([other]) => bail!("torchrun's store at {} answered a wait with {other}", self.address),
            Err(e) if !timed_out(&e) => return Err(e),
            Err(_) => {}
        }
        self.send(&[&[Query::CancelWait as u8]])?;
        // The key may have appeared just before the cancel: its answer comes first.
        let mut answer = self.receive::<1>()?;
        if answer == [STOP_WAITING] {
            answer = self.receive::<1>()?;
        }
        if answer != [WAIT_CANCELED] {
            bail!(
                "torchrun's store at {} answered a cancelled wait with {}",
                self.address,
                answer[0]
            );
        }
        bail!(
            "{key} did not appear in torchrun's store at {} within {:.1}s",
            self.address,
            timeout.as_secs_f64()
        )
    }

    fn send(&mut self, parts: &[&[u8]]) -> Result<()> {
        let message = parts.concat();
        self.stream
            .write_all(&message)
            .with_context(|| format!("writing to torchrun's store at {}", self.address))
    }

    fn receive<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut bytes = [0u8; N];
        self.stream
            .read_exact(&mut bytes)
            .with_context(|| format!("reading from torchrun's store at {}", self.address))?;
        Ok(bytes)
    }
}

/// A key as PyTorch's `TCPStore` sends it.
fn prefixed(key: &str) -> String {
    format!("/{key}")
}

/// A `u64`-length-prefixed byte string.
fn string(bytes: &[u8]) -> Vec<u8> {
    [&(bytes.len() as u64).to_le_bytes()[..], bytes].concat()
}

/// Whether `error` is a read that timed out.
fn timed_out(error: &anyhow::Error) -> bool {
    error
        .root_cause()
        .downcast_ref::<std::io::Error>()
        .is_some_and(|e| matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A store of one connection that follows the protocol for the queries a rank makes:
    /// enough to check the client's bytes, not a store.
    fn one_connection_store(value_appears_after: Option<Duration>) -> (String, std::thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let serving = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut header = [0u8; 5];
            stream.read_exact(&mut header).unwrap();
            assert_eq!(header[0], Query::Validate as u8);
            assert_eq!(u32::from_le_bytes(header[1..].try_into().unwrap()), VALIDATION_MAGIC);
            stream.read_exact(&mut header).unwrap();
            assert_eq!(header[0], Query::Ping as u8);
            stream.write_all(&header[1..]).unwrap();
            // A WAIT for one key: answered when the value "appears", or cancelled.
            let mut wait = [0u8; 9];
            stream.read_exact(&mut wait).unwrap();
            assert_eq!(wait[0], Query::Wait as u8);
            let key = read_string(&mut stream);
            match value_appears_after {
                Some(delay) => {
                    std::thread::sleep(delay);
                    stream.write_all(&[STOP_WAITING]).unwrap();
                    let mut get = [0u8; 1];
                    stream.read_exact(&mut get).unwrap();
                    assert_eq!(get[0], Query::Get as u8);
                    assert_eq!(read_string(&mut stream), key);
                    stream.write_all(&string(b"10.0.0.1:4000")).unwrap();
                }
                None => {
                    let mut cancel = [0u8; 1];
                    stream.read_exact(&mut cancel).unwrap();
                    assert_eq!(cancel[0], Query::CancelWait as u8);
                    stream.write_all(&[WAIT_CANCELED]).unwrap();
                }
            }
            key
        });
        (address, serving)
    }

    fn read_string(stream: &mut TcpStream) -> Vec<u8> {
        let mut len = [0u8; 8];
        stream.read_exact(&mut len).unwrap();
        let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
        stream.read_exact(&mut bytes).unwrap();
        bytes
    }

    #[test]
    fn a_get_waits_for_the_key_then_reads_it() {
        let (address, serving) = one_connection_store(Some(Duration::from_millis(200)));
        let mut client = TcpStoreClient::connect(&address, Duration::from_secs(5)).unwrap();
        let value = client.get("flotilla/job/coordinator", Duration::from_secs(5)).unwrap();
        assert_eq!(value, b"10.0.0.1:4000");
        assert_eq!(
            serving.join().unwrap(),
            b"/flotilla/job/coordinator",
            "PyTorch's key prefix"
        );
    }

    #[test]
    fn a_key_that_never_appears_cancels_the_wait_and_names_the_key() {
        let (address, serving) = one_connection_store(None);
        let mut client = TcpStoreClient::connect(&address, Duration::from_secs(5)).unwrap();
        let error = client
            .get("flotilla/job/coordinator", Duration::from_millis(300))
            .unwrap_err();
        assert!(
            format!("{error:#}").contains("/flotilla/job/coordinator did not appear"),
            "{error:#}"
        );
        serving.join().unwrap();
    }

    #[test]
    fn a_peer_that_is_no_store_is_refused_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let peer = std::thread::spawn(move || {
            // Answers the ping with a wrong nonce.
            let (mut stream, _) = listener.accept().unwrap();
            let mut hello = [0u8; 10];
            stream.read_exact(&mut hello).unwrap();
            stream.write_all(&[0xFF; 4]).unwrap();
        });
        let error = TcpStoreClient::connect(&address, Duration::from_secs(5)).unwrap_err();
        assert!(format!("{error:#}").contains("is not a TCPStore"), "{error:#}");
        peer.join().unwrap();
    }
}
