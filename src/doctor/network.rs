//! The network checks of one job's endpoints: each address resolves, no two roles share one,
//! this machine's ports are free, and the other machines answer.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::endpoints::Endpoint;
use super::port_owner::owner_of;
use super::report::Line;

/// Connection attempts in flight at once: enough that a large job's peers cost about one
/// timeout, few enough not to exhaust descriptors or flood a network.
const MAX_CONCURRENT_CONNECTS: usize = 64;

/// An endpoint and the socket address it resolved to.
#[derive(Debug, Clone)]
pub(super) struct Resolved {
    pub(super) endpoint: Endpoint,
    pub(super) addr: SocketAddr,
}

/// Resolves `endpoint` (an IP or a host name) to its first address.
pub(super) fn resolve(endpoint: &Endpoint) -> Result<Resolved, Line> {
    let fail = |why: String| {
        Line::fail(format!(
            "resolve {} = {}: {why} — check the name, or give an IP address",
            endpoint.key, endpoint.address
        ))
    };
    let addr = endpoint
        .address
        .to_socket_addrs()
        .map_err(|e| fail(e.to_string()))?
        .next()
        .ok_or_else(|| fail("the name has no address".to_string()))?;
    Ok(Resolved {
        endpoint: endpoint.clone(),
        addr,
    })
}

/// The line of a resolved endpoint, or a failure when an earlier one has the same address:
/// two roles cannot listen on one port.
pub(super) fn resolved_line(resolved: &Resolved, earlier: &[Resolved]) -> Line {
    let Resolved { endpoint, addr } = resolved;
    let shown = if endpoint.address == addr.to_string() {
        endpoint.address.clone()
    } else {
        format!("{} ({addr})", endpoint.address)
    };
    match earlier.iter().find(|other| other.addr == *addr) {
        Some(other) => Line::fail(format!(
            "resolve {} = {shown}{}: the same address as {} — each role needs its own port",
            endpoint.key,
            endpoint.default_note(),
            other.endpoint.origin()
        )),
        None => Line::ok(format!("resolve {} = {shown}{}", endpoint.key, endpoint.default_note())),
    }
}

/// Whether the job's process at `ip` runs on this machine: `ip` is `node_ip` when given, else
/// any address this machine can bind.
pub(super) fn is_local(ip: IpAddr, node_ip: Option<IpAddr>) -> bool {
    match node_ip {
        Some(node_ip) => ip == node_ip,
        None => TcpListener::bind(SocketAddr::new(ip, 0)).is_ok(),
    }
}

/// Binds the port a local role will listen on (and closes it again).
pub(super) fn check_port(resolved: &Resolved) -> Line {
    let Resolved { endpoint, addr } = resolved;
    let what = format!("port {addr} ({})", endpoint.origin());
    let Err(error) = TcpListener::bind(addr) else {
        return Line::ok(format!("{what} is free"));
    };
    match error.kind() {
        io::ErrorKind::AddrInUse => {
            let owner = match owner_of(*addr) {
                Some(owner) if owner.command.is_empty() => format!(" (pid {})", owner.pid),
                Some(owner) => format!(" (pid {}, {})", owner.pid, owner.command),
                None => String::new(),
            };
            if endpoint.by_launcher {
                // The launcher that starts a whole job picks free ports unless told a first one.
                Line::warn(format!(
                    "{what} is in use{owner}: a launcher that starts the whole job picks free ports instead; \
                     only with --started_port {} would it collide",
                    addr.port()
                ))
            } else {
                Line::fail(format!(
                    "{what} is in use{owner}: stop that process or {}",
                    endpoint.other_port_hint()
                ))
            }
        }
        io::ErrorKind::AddrNotAvailable => Line::fail(format!(
            "{what} cannot be bound: {error}: {} is not an address of this machine — run this check on the node \
             that owns it, or fix --node-ip or {}",
            addr.ip(),
            endpoint.key
        )),
        io::ErrorKind::PermissionDenied => Line::fail(format!(
            "{what} cannot be bound: {error}: ports below 1024 need root or CAP_NET_BIND_SERVICE — {}",
            endpoint.other_port_hint()
        )),
        _ => Line::fail(format!("{what} cannot be bound: {error}")),
    }
}

/// Connects to every peer, [`MAX_CONCURRENT_CONNECTS`] at a time, so that N silent peers cost
/// about one timeout rather than N; the lines come back in the order of `peers`.
pub(super) fn check_peers(peers: &[Resolved], timeout: Duration) -> Vec<Line> {
    let next = AtomicUsize::new(0);
    let workers = peers.len().min(MAX_CONCURRENT_CONNECTS);
    let mut lines: Vec<(usize, Line)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(peer) = peers.get(i) else {
                            return done;
                        };
                        done.push((i, check_peer(peer, timeout)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| vec![(usize::MAX, Line::fail("peer check: a checking thread panicked"))])
            })
            .collect()
    });
    lines.sort_by_key(|(i, _)| *i);
    lines.into_iter().map(|(_, line)| line).collect()
}

/// One TCP connect to a peer, judged: a refusal still proves the host is there.
fn check_peer(peer: &Resolved, timeout: Duration) -> Line {
    let what = format!("peer {} ({})", peer.addr, peer.endpoint.origin());
    match TcpStream::connect_timeout(&peer.addr, timeout) {
        Ok(_) => Line::ok(format!("{what} is listening")),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Line::ok(format!(
            "{what}: host reachable, nothing listening yet — start that node's launcher"
        )),
        Err(e) if e.kind() == io::ErrorKind::TimedOut => Line::fail(format!(
            "{what} unreachable: no answer in {:.1}s — check the address, routing and firewall",
            timeout.as_secs_f64()
        )),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EHOSTUNREACH | libc::ENETUNREACH)) => Line::fail(format!(
            "{what} unreachable: {e} — check the address, routing and firewall"
        )),
        Err(e) => Line::fail(format!("{what}: cannot connect: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    fn resolved(key: &str, address: &str) -> Resolved {
        resolve(&Endpoint {
            key: key.to_string(),
            address: address.to_string(),
            by_launcher: false,
        })
        .unwrap()
    }

    #[test]
    fn shared_addresses_fail() {
        let master = resolved("cluster.master", "127.0.0.1:7000");
        let rank = resolved("cluster.endpoints[0]", "127.0.0.1:7000");
        assert_eq!(resolved_line(&master, &[]).status, Status::Ok);
        let line = resolved_line(&rank, std::slice::from_ref(&master));
        assert_eq!(
            line.text,
            "resolve cluster.endpoints[0] = 127.0.0.1:7000: the same address as cluster.master — each role needs \
             its own port"
        );
    }

    #[test]
    fn unresolvable_addresses_fail_with_the_key() {
        // A bad port fails before any name lookup, so the test needs no resolver.
        let line = resolve(&Endpoint {
            key: "cluster.master".into(),
            address: "node0:99999".into(),
            by_launcher: false,
        })
        .unwrap_err();
        assert_eq!(line.status, Status::Fail);
        assert!(
            line.text.starts_with("resolve cluster.master = node0:99999: "),
            "{line}"
        );
    }

    #[test]
    fn node_ip_decides_what_is_local() {
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        assert!(is_local(loopback, None));
        assert!(!is_local(loopback, Some("127.0.0.2".parse().unwrap())));
        // TEST-NET-2 (RFC 5737, documentation only) is no address of this machine.
        assert!(!is_local("198.51.100.77".parse().unwrap(), None));
    }

    #[test]
    fn refused_connections_count_as_reachable() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let open = resolved("cluster.master", &listener.local_addr().unwrap().to_string());
        let closed_port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let closed = resolved("cluster.endpoints[0]", &closed_port.to_string());
        let lines = check_peers(&[open, closed], Duration::from_secs(2));
        assert_eq!(lines.len(), 2);
        assert!(lines[0].text.ends_with("(cluster.master) is listening"), "{}", lines[0]);
        assert!(lines[1].text.contains("nothing listening yet"), "{}", lines[1]);
        assert!(lines.iter().all(|l| l.status == Status::Ok));
    }
}
