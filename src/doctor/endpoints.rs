//! Which addresses a job listens on: the config's `cluster.master`, `cluster.endpoints` and
//! `cluster.pservers`, and where the config leaves them to the launcher, the ones
//! `flotilla launch` / `launch-ps` choose with their default flags.

use std::net::IpAddr;

use anyhow::{Context, Result};

use crate::config::ClusterConfig;
use crate::launch::{
    JobAddresses, LaunchArgs, LaunchPsArgs, NodeRange, ProcessFlags, PsRoles, DEFAULT_NODE_IP, DEFAULT_STARTED_PORT,
};

/// One address of the job and the config key it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Endpoint {
    /// `cluster.master`, `cluster.endpoints[1]`, `cluster.pservers[0]`.
    pub(super) key: String,
    /// `host:port` as the job will use it.
    pub(super) address: String,
    /// The config leaves the key unset: the launcher chooses this address.
    pub(super) by_launcher: bool,
}

impl Endpoint {
    /// The key, and where the address comes from when not from the config.
    pub(super) fn origin(&self) -> String {
        if self.by_launcher {
            format!("{}, the launcher's default", self.key)
        } else {
            self.key.clone()
        }
    }

    /// ` (the launcher's default)` when the launcher chooses the address, else nothing.
    pub(super) fn default_note(&self) -> &'static str {
        if self.by_launcher {
            " (the launcher's default)"
        } else {
            ""
        }
    }

    /// How to give this endpoint another port.
    pub(super) fn other_port_hint(&self) -> String {
        if self.by_launcher {
            format!(
                "start the launcher with another --started_port (or set {})",
                self.list_key()
            )
        } else if self.key == "cluster.master" {
            "choose another port (--set cluster.master=HOST:PORT)".to_string()
        } else {
            format!("choose another port (--set {}=[...])", self.list_key())
        }
    }

    /// `cluster.endpoints` for `cluster.endpoints[3]`.
    fn list_key(&self) -> &str {
        self.key.split('[').next().unwrap_or(&self.key)
    }
}

/// The addresses of a job that the doctor can know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct JobEndpoints {
    /// The coordinator first, then trainers or parameter servers in index order.
    pub(super) endpoints: Vec<Endpoint>,
    /// Unset keys whose addresses depend on launcher flags the doctor does not see (the node
    /// IPs of a multi-node job).
    pub(super) unplaced: Vec<&'static str>,
}

/// The listening addresses of the job `cluster` describes. A parameter-server job's trainers
/// listen on nothing, so only its coordinator and servers are listed. `node_ip` stands for the
/// launcher's `--node_ip` / `--host` (default [`DEFAULT_NODE_IP`]).
pub(super) fn job_endpoints(cluster: &ClusterConfig, node_ip: Option<IpAddr>) -> Result<JobEndpoints> {
    let host = node_ip.map_or_else(|| DEFAULT_NODE_IP.to_string(), |ip| ip.to_string());
    if cluster.is_parameter_server() {
        return ps_job_endpoints(cluster, host);
    }
    let launched = launcher_addresses(cluster, host)?;
    let mut found = JobEndpoints {
        endpoints: Vec::new(),
        unplaced: Vec::new(),
    };
    match (&cluster.master, &launched) {
        (Some(master), _) => found
            .endpoints
            .push(endpoint("cluster.master".into(), master.clone(), false)),
        (None, Some(addresses)) => {
            found
                .endpoints
                .push(endpoint("cluster.master".into(), addresses.master.clone(), true))
        }
        (None, None) => found.unplaced.push("cluster.master"),
    }
    match (cluster.endpoints.is_empty(), launched) {
        (false, _) => found
            .endpoints
            .extend(listed("cluster.endpoints", cluster.endpoints.clone(), false)),
        (true, Some(addresses)) => found
            .endpoints
            .extend(listed("cluster.endpoints", addresses.trainers, true)),
        (true, None) => found.unplaced.push("cluster.endpoints"),
    }
    Ok(found)
}

/// A parameter-server job's coordinator and servers, where the config or else `launch-ps`
/// (at `host`, with its default flags) puts them: one launcher sees every address.
fn ps_job_endpoints(cluster: &ClusterConfig, host: String) -> Result<JobEndpoints> {
    let launch = LaunchPsArgs {
        roles: PsRoles {
            server_num: Some(cluster.server_num),
            worker_num: Some(cluster.world_size()),
            servers: cluster.pservers.clone(),
            workers: cluster.endpoints.clone(),
        },
        host,
        started_port: Some(DEFAULT_STARTED_PORT),
        processes: ProcessFlags::default(),
        master: cluster.master.clone(),
        command: Vec::new(),
    };
    let JobAddresses { master, servers, .. } = launch
        .addresses()
        .context("the addresses `flotilla launch-ps` would choose")?;
    let mut endpoints = vec![endpoint("cluster.master".into(), master, cluster.master.is_none())];
    endpoints.extend(listed("cluster.pservers", servers, cluster.pservers.is_empty()));
    Ok(JobEndpoints {
        endpoints,
        unplaced: Vec::new(),
    })
}

/// The addresses `flotilla launch` would choose at `host` with its default flags, when the
/// config leaves some to it; `None` when it leaves none, or on several nodes, where they
/// depend on flags the doctor does not see.
fn launcher_addresses(cluster: &ClusterConfig, host: String) -> Result<Option<JobAddresses>> {
    if (cluster.master.is_some() && !cluster.endpoints.is_empty()) || cluster.nnodes != 1 {
        return Ok(None);
    }
    let launch = LaunchArgs {
        nnodes: NodeRange { min: 1, max: 1 },
        nproc_per_node: Some(cluster.nproc_per_node),
        devices: Vec::new(),
        run_mode: None,
        ps_roles: PsRoles::default(),
        node_ip: host.clone(),
        cluster_node_ips: vec![host],
        master: cluster.master.clone(),
        node_rank: None,
        master_addr: None,
        master_port: None,
        rdzv_endpoint: None,
        rdzv_backend: None,
        standalone: false,
        started_port: Some(DEFAULT_STARTED_PORT),
        processes: ProcessFlags::default(),
        command: Vec::new(),
    };
    let addresses = launch
        .addresses()
        .context("the addresses `flotilla launch` would choose")?;
    Ok(Some(addresses))
}

fn endpoint(key: String, address: String, by_launcher: bool) -> Endpoint {
    Endpoint {
        key,
        address: address.trim().to_string(),
        by_launcher,
    }
}

fn listed(key: &str, addresses: Vec<String>, by_launcher: bool) -> impl Iterator<Item = Endpoint> + '_ {
    addresses
        .into_iter()
        .enumerate()
        .map(move |(i, address)| endpoint(format!("{key}[{i}]"), address, by_launcher))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addresses(found: &JobEndpoints) -> Vec<(String, String, bool)> {
        found
            .endpoints
            .iter()
            .map(|e| (e.key.clone(), e.address.clone(), e.by_launcher))
            .collect()
    }

    fn own(key: &str, address: &str, by_launcher: bool) -> (String, String, bool) {
        (key.to_string(), address.to_string(), by_launcher)
    }

    #[test]
    fn unset_addresses_are_the_launchers_defaults() -> Result<()> {
        let cluster = ClusterConfig::default();
        let found = job_endpoints(&cluster, None)?;
        assert_eq!(
            addresses(&found),
            [
                own("cluster.master", "127.0.0.1:6170", true),
                own("cluster.endpoints[0]", "127.0.0.1:6171", true),
                own("cluster.endpoints[1]", "127.0.0.1:6172", true),
            ]
        );
        let found = job_endpoints(&cluster, Some("10.0.0.5".parse()?))?;
        assert_eq!(found.endpoints[2].address, "10.0.0.5:6172");
        Ok(())
    }

    #[test]
    fn the_configs_addresses_win() -> Result<()> {
        let cluster = ClusterConfig {
            master: Some("node0:7000".into()),
            ..ClusterConfig::default()
        };
        let found = job_endpoints(&cluster, None)?;
        assert_eq!(
            found.endpoints[0],
            endpoint("cluster.master".into(), "node0:7000".into(), false)
        );
        assert!(found.endpoints[1].by_launcher);
        let cluster = ClusterConfig {
            endpoints: vec!["10.0.0.1:7001".into(), "10.0.0.2:7001".into()],
            ..ClusterConfig::default()
        };
        let found = job_endpoints(&cluster, None)?;
        assert_eq!(
            addresses(&found),
            [
                own("cluster.master", "127.0.0.1:6170", true),
                own("cluster.endpoints[0]", "10.0.0.1:7001", false),
                own("cluster.endpoints[1]", "10.0.0.2:7001", false),
            ]
        );
        Ok(())
    }

    #[test]
    fn multi_node_jobs_without_addresses_are_not_guessed() -> Result<()> {
        let cluster = ClusterConfig {
            nnodes: 2,
            ..ClusterConfig::default()
        };
        let found = job_endpoints(&cluster, None)?;
        assert!(found.endpoints.is_empty());
        assert_eq!(found.unplaced, ["cluster.master", "cluster.endpoints"]);
        Ok(())
    }

    #[test]
    fn parameter_server_jobs_list_the_coordinator_and_the_servers() -> Result<()> {
        let cluster = ClusterConfig {
            server_num: 2,
            ..ClusterConfig::default()
        };
        let found = job_endpoints(&cluster, None)?;
        // Servers on 6170 and 6171, the two trainers' ports after them, the coordinator next.
        assert_eq!(
            addresses(&found),
            [
                own("cluster.master", "127.0.0.1:6174", true),
                own("cluster.pservers[0]", "127.0.0.1:6170", true),
                own("cluster.pservers[1]", "127.0.0.1:6171", true),
            ]
        );
        Ok(())
    }

    #[test]
    fn hints_name_the_key_to_change() {
        let master = endpoint("cluster.master".into(), "a:1".into(), false);
        assert_eq!(master.origin(), "cluster.master");
        assert_eq!(
            master.other_port_hint(),
            "choose another port (--set cluster.master=HOST:PORT)"
        );
        let rank = endpoint("cluster.endpoints[1]".into(), "a:1".into(), true);
        assert_eq!(rank.origin(), "cluster.endpoints[1], the launcher's default");
        assert_eq!(rank.default_note(), " (the launcher's default)");
        assert_eq!(master.default_note(), "");
        assert_eq!(
            rank.other_port_hint(),
            "start the launcher with another --started_port (or set cluster.endpoints)"
        );
    }
}
