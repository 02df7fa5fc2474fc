//! Ranks started by torchrun's elastic agent (`torchrun --no-python … flotilla run --role
//! trainer`). The agent serves a `TCPStore` of its own at `MASTER_ADDR:MASTER_PORT`
//! (`TORCHELASTIC_USE_AGENT_STORE=True`), where its workers meet, so the coordinator cannot
//! bind there. As PyTorch's own processes do, the ranks meet through that store: rank 0 takes a
//! free port on the address that routes to the store, publishes it, and hosts the coordinator
//! there; the others read it. The agent's `TORCHELASTIC_RUN_ID` is the job's id, the same on
//! every node and across the agent's restarts, which resume from the newest checkpoint.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use super::launched_rank::address_towards;
use crate::config::{host_port, JobConfig, Strategy};
use crate::net::tcp_store::TcpStoreClient;

/// Set to `True` by torchrun's agent when it serves the store at `MASTER_ADDR:MASTER_PORT`.
const AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// How many times the agent may start its workers again (`--max-restarts`).
const MAX_RESTARTS_VAR: &str = "TORCHELASTIC_MAX_RESTARTS";

/// How long a rank tries one published coordinator address before reading the key again.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The address of the store torchrun's agent serves this process's workers, when an agent
/// started it with one.
fn agent_store(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    if env(AGENT_STORE_VAR)?.trim() != "True" {
        return None;
    }
    let port = env("MASTER_PORT")?.trim().parse().ok()?;
    Some(host_port(env("MASTER_ADDR")?.trim(), port))
}

/// Whether torchrun's agent may start this process's job again after a failure: then every
/// start resumes from the newest checkpoint when there is one, as after a restart by our own
/// launcher. (The agent's restart count cannot say it: an agent whose workers were healthy
/// starts them again, when another node's failed, without counting a restart.)
pub fn agent_may_restart(env: &dyn Fn(&str) -> Option<String>) -> bool {
    agent_store(env).is_some()
        && env(MAX_RESTARTS_VAR)
            .and_then(|n| n.trim().parse::<u32>().ok())
            .unwrap_or(0)
            > 0
}

/// Refuses a parameter-server job under torchrun's agent: it starts only workers of one kind,
/// while the job's coordinator lives in its first server, which nothing would start.
pub fn refuse_parameter_servers(config: &JobConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    if agent_store(env).is_some() && config.resolved_strategy() == Strategy::ParameterServer {
        anyhow::bail!(
            "{}: a parameter-server job (cluster.server_num = {}) cannot be started by torchrun, which \
             starts trainers only: start it with `flotilla launch-ps` (or `flotilla launch --server_num N`)",
            config.source_name,
            config.cluster.server_num
        );
    }
    Ok(())
}

/// Where rank `rank` of `config`'s job meets its coordinator when torchrun's agent holds
/// `cluster.master` (the master torchrun names) with its store: `cluster.master` becomes the
/// coordinator's address, published in the store by rank 0. Any other job is left as it is.
pub fn meet_coordinator(config: &mut JobConfig, rank: usize, env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    let Some(store_address) = agent_store(env) else {
        return Ok(());
    };
    if config.cluster.master.as_deref() != Some(store_address.as_str()) {
        return Ok(());
    }
    let timeout = config.fault_tolerance.timeout();
    let key = format!(
        "flotilla/{}/coordinator",
        config.cluster.job_id.as_deref().unwrap_or("job")
    );
    let mut store = TcpStoreClient::connect(&store_address, timeout).with_context(|| format!("rank {rank}"))?;
    let master = if rank == 0 {
        // A free port, released for the coordinator to bind at once (as PyTorch's agent picks
        // its own ports).
        let host = address_towards(Some(&store_address));
        let port = TcpListener::bind((host, 0))
            .and_then(|listener| listener.local_addr())
            .with_context(|| format!("rank 0: no free port on {host} for the coordinator"))?
            .port();
        let master = host_port(&host.to_string(), port);
        store.set(&key, master.as_bytes()).context("rank 0")?;
        master
    } else {
        published_coordinator(&mut store, &key, timeout).with_context(|| format!("rank {rank}"))?
    };
    tracing::info!(rank, %master, store = %store_address, "the coordinator's address, met through torchrun's store");
    config.cluster.master = Some(master);
    Ok(())
}

/// The coordinator's address rank 0 published at `key`, waiting at most `timeout`. The store
/// outlives the agent's restarts, so the key may still hold the address of a coordinator
/// whose workers the agent stopped: an address that accepts no connection is read again until
/// this run's rank 0 has replaced it.
fn published_coordinator(store: &mut TcpStoreClient, key: &str, timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let value = store.get(key, left)?;
        let master = String::from_utf8(value).map_err(|_| anyhow!("the value of {key} is not text"))?;
        let socket = resolve(&master)?;
        match TcpStream::connect_timeout(&socket, PROBE_TIMEOUT) {
            Ok(_) => return Ok(master),
            Err(e) if Instant::now() >= deadline => {
                return Err(anyhow!(e).context(format!(
                    "the coordinator published at {key} ({master}) accepted no connection within {:.1}s",
                    timeout.as_secs_f64()
                )))
            }
            Err(e) => tracing::debug!("the coordinator at {master} does not answer yet ({e}): reading {key} again"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn resolve(address: &str) -> Result<SocketAddr> {
    address
        .to_socket_addrs()
        .with_context(|| format!("resolving the coordinator's published address {address}"))?
        .next()
        .ok_or_else(|| anyhow!("the coordinator's published address {address} resolves to nothing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |key| vars.iter().find(|(k, _)| *k == key).map(|(_, v)| v.to_string())
    }

    #[test]
    fn only_an_agent_that_serves_a_store_is_met_through_it() {
        let agent = [
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
        ];
        assert_eq!(agent_store(&env(&agent)).as_deref(), Some("localhost:29500"));
        assert!(agent_may_restart(&env(&agent)));
        let no_restarts = [&agent[..3], &[("TORCHELASTIC_MAX_RESTARTS", "0")]].concat();
        assert!(!agent_may_restart(&env(&no_restarts)));
        // Variables set by hand, or by an agent that shares no store, name the coordinator.
        let by_hand = [("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")];
        assert_eq!(agent_store(&env(&by_hand)), None);
        let no_store = [
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        assert_eq!(agent_store(&env(&no_store)), None);
    }
}
