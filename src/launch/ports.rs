//! Free ports for a job a launcher starts whole on one host: a run of consecutive ones (the
//! coordinator's, then the roles'), so that two jobs on one host never collide on the default
//! ports.
//!
//! The run is drawn below the kernel's ephemeral range (`ip_local_port_range`), where no
//! outgoing connection is given a port and the kernel hands out none for port 0: a run taken
//! from there could be claimed by any connection between the check and the roles' binds (two
//! jobs starting together did collide so). Only where that range leaves no room is the run
//! taken after a port the kernel hands out.

use std::net::TcpListener;

use anyhow::{bail, Context as _, Result};

use crate::rng::SplitMix64;

/// Tries before giving up.
const ATTEMPTS: usize = 50;

/// The lowest port a drawn run starts at: below are well-known and registered services.
const LOWEST: u16 = 10_000;

/// Where the kernel's ephemeral range starts when it cannot be read (Linux's default).
const EPHEMERAL_DEFAULT: u16 = 32_768;

/// The first of `count` consecutive ports all free on `host` now. They are released before the
/// roles bind them: another program may take one in between, which the role's bind then names.
pub(super) fn free_run(host: &str, count: usize) -> Result<u16> {
    let below = ephemeral_start();
    let room = usize::from(below.saturating_sub(LOWEST)).saturating_sub(count);
    // Each launcher draws its own bases: two started together try different runs.
    let mut draws = SplitMix64::new(u64::from(std::process::id()) ^ now_nanos());
    for _ in 0..ATTEMPTS {
        let base = match room {
            0 => TcpListener::bind((host, 0))
                .and_then(|listener| listener.local_addr())
                .with_context(|| format!("cannot bind a port on {host} (--node_ip / --host)"))?
                .port(),
            _ => LOWEST + (draws.next_u64() % room as u64) as u16,
        };
        let Some(last) = usize::from(base)
            .checked_add(count)
            .filter(|&last| last <= usize::from(u16::MAX))
        else {
            continue;
        };
        // Held together, so the run is checked whole.
        let held: Result<Vec<_>, _> = (usize::from(base)..last)
            .map(|port| TcpListener::bind((host, port as u16)))
            .collect();
        if held.is_ok() {
            return Ok(base);
        }
    }
    bail!("found no {count} consecutive free ports on {host} in {ATTEMPTS} tries: give --started_port")
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(EPHEMERAL_DEFAULT)
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_run_lies_below_the_ephemeral_range_and_can_be_bound_whole() {
        let base = free_run("127.0.0.1", 3).unwrap();
        assert!((LOWEST..ephemeral_start() - 3).contains(&base), "{base}");
        let listeners: Vec<_> = (base..base + 3)
            .map(|port| TcpListener::bind(("127.0.0.1", port)).expect("free"))
            .collect();
        assert_eq!(listeners.len(), 3);
    }
}
