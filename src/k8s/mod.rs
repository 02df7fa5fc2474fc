//! `flotilla k8s`: the Kubernetes manifests of a job, built from the typed API objects of
//! `k8s-openapi` — a headless Service, the job's config as a ConfigMap, a checkpoint volume, and
//! its pods: an Indexed Job per role, or the Kubeflow training operators' PyTorchJob or
//! PaddleJob. Every pod runs one of flotilla's launchers (`launch`, `launch-ps`) for its part of
//! the job, with the node rank, the addresses and the cluster token its form gives it, so a pod
//! lost with its node is recovered as a lost node is: its launcher, started again, rejoins.

mod objects;
mod operators;
mod pods;

use anyhow::{ensure, Result};
use serde_json::{json, Value};

use crate::config::JobConfig;
use crate::launch::DEFAULT_STARTED_PORT;

use pods::PodGroup;

/// Where a pod finds the job's config (the ConfigMap's volume).
pub const CONFIG_DIR: &str = "/etc/flotilla";
/// The config's file name in [`CONFIG_DIR`].
pub const CONFIG_FILE: &str = "job.toml";
/// Where the checkpoint volume is mounted in every pod.
pub const DATA_DIR: &str = "/var/lib/flotilla";
/// The run directory every process writes into, on the checkpoint volume.
pub const RUN_DIR: &str = "/var/lib/flotilla/run";
/// The key of the cluster token in the job's Secret (`NAME-token`).
pub const TOKEN_KEY: &str = "token";

/// Which objects run the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Operator {
    /// Plain Kubernetes: an Indexed Job per role (no operator needed).
    Indexed,
    /// The PaddleJob of Paddle's operator (`batch.paddlepaddle.org/v1`, pods reached through
    /// its Services).
    Paddlejob,
    /// The PyTorchJob of Kubeflow's training operator (`kubeflow.org/v1`; collective jobs).
    Pytorchjob,
}

/// What `flotilla k8s` is told beside the job's config.
#[derive(Debug, Clone, clap::Args)]
pub struct K8sOptions {
    /// The job's name, the prefix of every object's and pod's (a DNS label: lowercase letters,
    /// digits and '-', starting with a letter).
    #[arg(long, default_value = "flotilla")]
    pub name: String,
    /// The container image holding the `flotilla` binary on its PATH.
    #[arg(long)]
    pub image: String,
    /// The namespace of every object (default: kubectl's current one).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Which objects run the pods.
    #[arg(long, value_enum, default_value = "indexed")]
    pub operator: Operator,
    /// Size of the checkpoint volume, a ReadWriteMany PersistentVolumeClaim every pod writes its
    /// checkpoints (and rank 0 the run's outputs) into.
    #[arg(long, default_value = "10Gi")]
    pub storage: String,
    /// The checkpoint volume's StorageClass (default: the cluster's default class).
    #[arg(long)]
    pub storage_class: Option<String>,
    /// The coordinator's port, and the servers' (default 6170; a PaddleJob uses its operator's
    /// 36000, the port its Services expose).
    #[arg(long)]
    pub port: Option<u16>,
}

/// The operator's first port, which its per-pod Services expose (Paddle's operator).
const PADDLE_OPERATOR_PORT: u16 = 36000;

impl K8sOptions {
    /// The first port of the job's pods.
    fn port(&self) -> Result<u16> {
        match (self.operator, self.port) {
            (Operator::Paddlejob, Some(port)) if port != PADDLE_OPERATOR_PORT => {
                anyhow::bail!(
                    "--port {port}: a PaddleJob's pods are reached on its operator's port {PADDLE_OPERATOR_PORT}"
                )
            }
            (Operator::Paddlejob, _) => Ok(PADDLE_OPERATOR_PORT),
            (_, port) => Ok(port.unwrap_or(DEFAULT_STARTED_PORT)),
        }
    }
}

/// The manifests of `config`'s job as one Kubernetes `List` (what `kubectl apply -f` takes).
pub fn manifests(config: &JobConfig, options: &K8sOptions) -> Result<Value> {
    let groups = pods::groups(config, options)?;
    check_name(&options.name, &groups)?;
    let mut items = vec![
        to_value(objects::config_map(config, options)?)?,
        to_value(objects::checkpoint_volume(options))?,
    ];
    match options.operator {
        Operator::Indexed => {
            items.push(to_value(objects::headless_service(options, &groups))?);
            for group in &groups {
                items.push(to_value(objects::indexed_job(config, options, group))?);
            }
        }
        Operator::Pytorchjob => items.push(to_value(operators::pytorch_job(config, options, &groups))?),
        Operator::Paddlejob => items.push(to_value(operators::paddle_job(config, options, &groups)?)?),
    }
    Ok(json!({ "apiVersion": "v1", "kind": "List", "items": items }))
}

fn to_value(object: impl serde::Serialize) -> Result<Value> {
    Ok(serde_json::to_value(object)?)
}

/// Refuses a name that is not a DNS label, or that makes a pod's host name longer than one.
fn check_name(name: &str, groups: &[PodGroup]) -> Result<()> {
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    ensure!(
        valid,
        "--name {name:?}: a job's name is a DNS label (lowercase letters, digits and '-', starting with a letter, not ending with '-')"
    );
    for group in groups {
        let longest = group.pod_name(name, group.replicas.saturating_sub(1));
        ensure!(
            longest.len() <= 63,
            "--name {name:?}: the pod name {longest} is longer than a DNS label's 63 characters; choose a shorter name"
        );
    }
    Ok(())
}
