//! Which process holds a TCP port: the socket's inode from `/proc/net/tcp{,6}`, then the
//! process whose `/proc/PID/fd` links to `socket:[inode]`. Best effort: processes this user may
//! not inspect are skipped silently.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `st` of a listening socket in `/proc/net/tcp`.
const TCP_LISTEN: u8 = 0x0A;

/// A process that holds a socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Owner {
    pub(super) pid: u32,
    /// Its command name (`/proc/PID/comm`), empty when unreadable.
    pub(super) command: String,
}

/// One socket of `/proc/net/tcp` or `/proc/net/tcp6`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SocketEntry {
    local: SocketAddr,
    state: u8,
    inode: u64,
}

/// The process holding a socket bound to `addr`'s port on its IP (or on every IP): a listener
/// first, else any socket on that address.
pub(super) fn owner_of(addr: SocketAddr) -> Option<Owner> {
    let entries: Vec<SocketEntry> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| text.lines().skip(1).filter_map(parse_line).collect::<Vec<_>>())
        .filter(|entry| entry.inode != 0 && occupies(entry.local, addr))
        .collect();
    let inode = entries
        .iter()
        .find(|entry| entry.state == TCP_LISTEN)
        .or_else(|| entries.first())?
        .inode;
    process_with_socket(inode)
}

/// Whether a socket bound to `local` keeps `addr` from being bound.
fn occupies(local: SocketAddr, addr: SocketAddr) -> bool {
    local.port() == addr.port()
        && (local.ip() == addr.ip() || local.ip().is_unspecified() || addr.ip().is_unspecified())
}

/// Parses a line of `/proc/net/tcp{,6}`:
/// `sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode …`.
fn parse_line(line: &str) -> Option<SocketEntry> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let local = parse_address(fields.get(1)?)?;
    let state = u8::from_str_radix(fields.get(3)?, 16).ok()?;
    let inode = fields.get(9)?.parse().ok()?;
    Some(SocketEntry { local, state, inode })
}

/// `0100007F:1A0A` (IPv4) or 32 hex digits and a port (IPv6). The kernel prints the address as
/// 32-bit words in this machine's byte order, each holding four bytes of the address in network
/// order, and the port as a plain number.
fn parse_address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    if !ip.is_ascii() || !matches!(ip.len(), 8 | 32) {
        return None;
    }
    let mut bytes = Vec::with_capacity(16);
    for word in ip.as_bytes().chunks(8) {
        let word = std::str::from_utf8(word).ok()?;
        bytes.extend_from_slice(&u32::from_str_radix(word, 16).ok()?.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(bytes.as_slice()).ok()?)),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes.as_slice()).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The first process with a descriptor on socket `inode`.
fn process_with_socket(inode: u64) -> Option<Owner> {
    let target = format!("socket:[{inode}]");
    for process in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = process.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(descriptors) = std::fs::read_dir(process.path().join("fd")) else {
            continue;
        };
        let holds = descriptors
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|link| link.as_os_str() == target.as_str()));
        if holds {
            let command = std::fs::read_to_string(process.path().join("comm")).unwrap_or_default();
            return Some(Owner {
                pid,
                command: command.trim().to_string(),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_endian = "little")]
    #[test]
    fn parses_ipv4_and_ipv6_lines() {
        let v4 = "   0: 0100007F:1A0A 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 12345 1 0000000000000000 100 0 0 10 0";
        assert_eq!(
            parse_line(v4),
            Some(SocketEntry {
                local: "127.0.0.1:6666".parse().unwrap(),
                state: TCP_LISTEN,
                inode: 12345,
            })
        );
        let v6 = "   1: 00000000000000000000000001000000:1A0B 00000000000000000000000000000000:0000 06 00000000:00000000 03:00000A2B 00000000     0        0 0 3 0000000000000000";
        assert_eq!(
            parse_line(v6),
            Some(SocketEntry {
                local: "[::1]:6667".parse().unwrap(),
                state: 0x06,
                inode: 0,
            })
        );
    }

    #[test]
    fn the_header_and_garbage_are_skipped() {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        assert_eq!(parse_line(header), None);
        assert_eq!(parse_line(""), None);
        assert_eq!(parse_line("0: 0100007F 00000000:0000 0A"), None);
        assert_eq!(parse_address("0100007F:ZZZZ"), None);
        assert_eq!(parse_address("01007F:1A0A"), None);
        assert_eq!(parse_address("é100007F:1A0A"), None);
    }

    #[test]
    fn wildcard_sockets_occupy_every_address() {
        let addr: SocketAddr = "127.0.0.1:6170".parse().unwrap();
        assert!(occupies("0.0.0.0:6170".parse().unwrap(), addr));
        assert!(occupies("[::]:6170".parse().unwrap(), addr));
        assert!(occupies("127.0.0.1:6170".parse().unwrap(), addr));
        assert!(!occupies("127.0.0.2:6170".parse().unwrap(), addr));
        assert!(!occupies("127.0.0.1:6171".parse().unwrap(), addr));
    }

    #[test]
    fn finds_this_process_listening() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let owner = owner_of(listener.local_addr().unwrap());
        // A process may always read its own descriptors, so this finds it wherever /proc is
        // mounted.
        assert_eq!(owner.map(|o| o.pid), Some(std::process::id()));
    }
}
