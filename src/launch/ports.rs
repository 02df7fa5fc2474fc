//! Free ports for a job a launcher starts whole on one host: a run of consecutive ones (the
//! coordinator's, then the roles'), so that two jobs on one host never collide on the default
//! ports.

use std::net::TcpListener;

use anyhow::{bail, Context as _, Result};

/// Tries before giving up: each takes a base port the kernel hands out and checks the run after it.
const ATTEMPTS: usize = 50;

/// The first of `count` consecutive ports all free on `host` now. They are released before the
/// roles bind them: another program may take one in between, which the role's bind then names.
pub(super) fn free_run(host: &str, count: usize) -> Result<u16> {
    for _ in 0..ATTEMPTS {
        let base = TcpListener::bind((host, 0))
            .and_then(|listener| listener.local_addr())
            .with_context(|| format!("cannot bind a port on {host} (--node_ip / --host)"))?
            .port();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_run_can_be_bound_whole() {
        let base = free_run("127.0.0.1", 3).unwrap();
        let listeners: Vec<_> = (base..base + 3)
            .map(|port| TcpListener::bind(("127.0.0.1", port)).expect("free"))
            .collect();
        assert_eq!(listeners.len(), 3);
    }
}
