//! `flotilla doctor`: checks before a launch, one line each — the config loads, its data files
//! are there, every address
//! the job will use resolves, this machine's ports are free, the other machines answer, the
//! clock is synchronized and the device's libraries load — so that a job fails here, with the
//! fix, rather than minutes into a launch on several machines.

mod clock;
mod data_files;
mod endpoints;
mod gpu;
mod network;
mod port_owner;
mod report;

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Result;

use crate::config::{ConfigError, DeviceKind, JobConfig, Strategy, GPU_NOT_BUILT};
use endpoints::job_endpoints;
use network::{check_peers, check_port, is_local, resolve, resolved_line, Resolved};
use report::{Line, Report};

/// The doctor's own flags (the config comes with `--config` / `--set`, as for `flotilla train`).
#[derive(Debug, Clone, clap::Args)]
pub struct DoctorOptions {
    /// This node's IP, as given to the launcher: only endpoints on it are checked as local
    /// ports, all others as peers (default: every address of this machine is local).
    #[arg(long = "node-ip", alias = "node_ip", value_name = "IP")]
    pub node_ip: Option<IpAddr>,
    /// How long a peer may take to answer a TCP connect, in milliseconds.
    #[arg(
        long = "connect-timeout-ms",
        value_name = "MS",
        default_value_t = 2000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub connect_timeout_ms: u64,
}

/// Runs every check on `config` (the job as `flotilla train` loads it, or why it did not load),
/// printing one line each and a count; an error when any check failed.
pub fn run(options: &DoctorOptions, config: Result<JobConfig>) -> Result<()> {
    let mut report = Report::default();
    let config = match config {
        Ok(config) => config,
        Err(error) => {
            report.push(Line::fail(format!("config: {error:#}")));
            // A GPU job is rejected by a build without CUDA; what its machine has for one is
            // still worth knowing.
            if rejects_gpu(&error) {
                report.push(clock::check_clock());
                report.extend(gpu::check_device(DeviceKind::Gpu));
                return report.finish(Some("the endpoint checks need a valid config and were skipped"));
            }
            return report.finish(Some("the other checks need a valid config and were skipped"));
        }
    };
    report.push(Line::ok(format!(
        "config: {} is valid ({})",
        config.source_name,
        describe(&config)
    )));
    report.extend(data_files::check_data_files(&config));
    check_endpoints(&mut report, &config, options);
    report.push(clock::check_clock());
    report.extend(gpu::check_device(config.cluster.device));
    report.finish(None)
}

/// Whether the config failed only for `cluster.device = "gpu"` in a build without CUDA.
fn rejects_gpu(error: &anyhow::Error) -> bool {
    matches!(
        error.downcast_ref::<ConfigError>(),
        Some(ConfigError::Invalid { key, message, .. }) if key == "cluster.device" && message == GPU_NOT_BUILT
    )
}

/// `collective, 2 ranks on 1 node`.
fn describe(config: &JobConfig) -> String {
    let cluster = &config.cluster;
    let nodes = match cluster.nnodes {
        1 => "1 node".to_string(),
        n => format!("{n} nodes"),
    };
    match config.resolved_strategy() {
        Strategy::ParameterServer => format!(
            "parameter-server ({}), {} server(s) and {} trainer(s)",
            config.strategy.ps_mode().name(),
            cluster.server_num,
            config.world_size()
        ),
        Strategy::Pipeline => format!("pipeline, {} ranks on {nodes}", config.world_size()),
        Strategy::DataParallel if config.mp_degree() > 1 => format!(
            "collective, {} ranks on {nodes}: {} replica(s) of the model, each layer split {} ways",
            config.world_size(),
            config.data_parallel_replicas(),
            config.mp_degree()
        ),
        Strategy::DataParallel => format!("collective, {} ranks on {nodes}", config.world_size()),
    }
}

/// Resolves every endpoint, then binds the local ones and connects to the others.
fn check_endpoints(report: &mut Report, config: &JobConfig, options: &DoctorOptions) {
    let job = match job_endpoints(&config.cluster, options.node_ip) {
        Ok(job) => job,
        Err(error) => {
            report.push(Line::fail(format!("endpoints: {error:#}")));
            return;
        }
    };
    for key in &job.unplaced {
        report.push(Line::warn(format!(
            "{key}: not set: for a {}-node job the launcher derives it from its --cluster_node_ips, which this \
             check cannot see — set {key} to have it checked",
            config.cluster.nnodes
        )));
    }
    let mut resolved: Vec<Resolved> = Vec::with_capacity(job.endpoints.len());
    for endpoint in &job.endpoints {
        match resolve(endpoint) {
            Ok(found) => {
                report.push(resolved_line(&found, &resolved));
                resolved.push(found);
            }
            Err(line) => report.push(line),
        }
    }
    let (local, peers): (Vec<Resolved>, Vec<Resolved>) = resolved
        .into_iter()
        .partition(|r| is_local(r.addr.ip(), options.node_ip));
    for endpoint in &local {
        report.push(check_port(endpoint));
    }
    report.extend(check_peers(&peers, Duration::from_millis(options.connect_timeout_ms)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::process_env;

    fn load(text: &str, overrides: &[&str]) -> Result<JobConfig> {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        Ok(JobConfig::from_toml_str(text, "job.toml", &|_| None, &overrides)?)
    }

    #[test]
    fn only_the_gpu_rejection_counts_as_one() {
        let gpu = load("[cluster]\ndevice = \"gpu\"\n", &[]);
        if cfg!(feature = "cuda") {
            assert!(gpu.is_ok(), "a cuda build accepts a GPU job");
        } else {
            assert!(rejects_gpu(&gpu.unwrap_err()));
        }
        assert!(!rejects_gpu(&load("[cluster]\ndevice = \"tpu\"\n", &[]).unwrap_err()));
        assert!(!rejects_gpu(&load("", &["cluster.nnodes=0"]).unwrap_err()));
        let io = JobConfig::from_file("/nonexistent/job.toml".as_ref(), &process_env, &[]);
        assert!(!rejects_gpu(&anyhow::Error::from(io.unwrap_err())));
    }

    #[test]
    fn jobs_are_described_by_strategy() -> Result<()> {
        assert_eq!(describe(&load("", &[])?), "collective, 2 ranks on 1 node");
        let ps = load(include_str!("../../examples/ctr_ps.toml"), &[])?;
        assert!(describe(&ps).starts_with("parameter-server ("), "{}", describe(&ps));
        assert!(
            describe(&ps).ends_with("), 2 server(s) and 2 trainer(s)"),
            "{}",
            describe(&ps)
        );
        Ok(())
    }
}
