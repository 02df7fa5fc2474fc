//! `flotilla k8s`: the Kubernetes manifests of a job, built from the typed API objects of
//! `k8s-openapi` — a headless Service, the job's config as a ConfigMap, checkpoint volumes (each
//! pod's own, or one shared), and its pods: an Indexed Job per role, or the Kubeflow training
//! operators' PyTorchJob or PaddleJob. Every pod runs one of flotilla's launchers (`launch`,
//! `launch-ps`) for its part of the job, with the node rank, the addresses and the cluster token
//! its form gives it, so a pod lost with its node is recovered as a lost node is: its launcher,
//! started again, rejoins. The pods meet Pod Security's `restricted` profile. Flags the API
//! server would reject are refused here, naming them.

mod names;
mod objects;
mod operators;
mod pods;
mod template;
mod values;

use std::collections::BTreeMap;

use anyhow::{bail, ensure, Result};
use k8s_openapi::api::core::v1::Toleration;
use serde_json::{json, Value};

use crate::cli::{ConfigArgs, DefaultConfig};
use crate::config::{ConfigError, DeviceKind, JobConfig, GPU_NOT_BUILT};
use crate::job::Refusal;
use crate::launch::DEFAULT_STARTED_PORT;

use pods::PodGroup;

/// Where a pod finds the job's config (the ConfigMap's volume).
pub const CONFIG_DIR: &str = "/etc/flotilla";
/// The config's file name in [`CONFIG_DIR`].
pub const CONFIG_FILE: &str = "job.toml";
/// Where the checkpoint volume is mounted in every pod, and its working directory: a relative
/// path the job writes (a relative `checkpoint_dir`, `--log_dir`) lands on the volume, not on
/// the read-only root file system.
pub const DATA_DIR: &str = "/var/lib/flotilla";
/// The run directory every process writes into, on the checkpoint volume.
pub const RUN_DIR: &str = "/var/lib/flotilla/run";
/// Scratch space of a pod (an `emptyDir`): the only other writable path under its read-only
/// root file system.
pub const SCRATCH_DIR: &str = "/tmp";
/// The uid and gid every pod runs as, and the group owning its volumes: the image's `flotilla`
/// user (the Dockerfile's `USER`).
pub const RUN_AS_USER: i64 = 10001;
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

/// Where the pods keep their checkpoints and the run's outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum VolumeMode {
    /// A ReadWriteOnce volume of each pod's own, made and deleted with the pod (a generic
    /// ephemeral volume), which every storage class offers. A job that recovers in place needs
    /// no more: each node keeps its copy of the checkpoint, what no other node holds is also
    /// stored on the next node, and a pod made again with an empty volume fetches its part
    /// from its peers.
    PerPod,
    /// One ReadWriteMany PersistentVolumeClaim every pod mounts, kept after the job: what
    /// `fault_tolerance.recovery = "restart"` needs (every process restarts from the checkpoint
    /// in one shared directory); needs a storage class that offers ReadWriteMany (NFS, EFS,
    /// Filestore, CephFS).
    Shared,
}

/// What `flotilla k8s` is told beside the job's config.
#[derive(Debug, Clone, clap::Args)]
pub struct K8sOptions {
    /// The job's name, the prefix of every object's and pod's (a DNS label: lowercase letters,
    /// digits and '-', starting with a letter).
    #[arg(long, default_value = "flotilla")]
    pub name: String,
    /// The container image holding the `flotilla` binary on its PATH (the repository's
    /// Dockerfile builds one, running as uid 10001).
    #[arg(long)]
    pub image: String,
    /// The namespace of every object (default: kubectl's current one; a DNS label).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Which objects run the pods.
    #[arg(long, value_enum, default_value = "indexed")]
    pub operator: Operator,
    /// Where the pods keep their checkpoints and the run's outputs (default: per-pod for a job
    /// that recovers in place, shared for `fault_tolerance.recovery = "restart"`, which refuses
    /// per-pod).
    #[arg(long, value_enum)]
    pub volume: Option<VolumeMode>,
    /// Size of the checkpoint volume, each pod's or the shared one (a Kubernetes quantity).
    #[arg(long, default_value = "10Gi")]
    pub storage: String,
    /// The checkpoint volume's StorageClass (default: the cluster's default class).
    #[arg(long)]
    pub storage_class: Option<String>,
    /// The coordinator's port, and the servers' (default 6170; a PaddleJob uses its operator's
    /// 36000, the port its Services expose).
    #[arg(long)]
    pub port: Option<u16>,
    /// A Secret holding the registry credentials the image is pulled with (repeatable).
    #[arg(long = "image-pull-secret", value_name = "NAME")]
    pub image_pull_secrets: Vec<String>,
    /// Schedule the pods only on nodes with this label (repeatable: all of them).
    #[arg(long = "node-selector", value_name = "KEY=VALUE")]
    pub node_selectors: Vec<String>,
    /// Let the pods run on nodes with this taint, written as `kubectl taint` writes it
    /// (repeatable; without `=VALUE`, any value).
    #[arg(long = "toleration", value_name = "KEY[=VALUE]:EFFECT")]
    pub tolerations: Vec<String>,
    /// The PriorityClass of the pods.
    #[arg(long, value_name = "NAME")]
    pub priority_class: Option<String>,
}

/// The operator's first port, which its per-pod Services expose (Paddle's operator).
const PADDLE_OPERATOR_PORT: u16 = 36000;

impl K8sOptions {
    /// The first port of the job's pods.
    fn port(&self) -> Result<u16> {
        match (self.operator, self.port) {
            (Operator::Paddlejob, Some(port)) if port != PADDLE_OPERATOR_PORT => {
                bail!("--port {port}: a PaddleJob's pods are reached on its operator's port {PADDLE_OPERATOR_PORT}")
            }
            (Operator::Paddlejob, _) => Ok(PADDLE_OPERATOR_PORT),
            (_, port) => Ok(port.unwrap_or(DEFAULT_STARTED_PORT)),
        }
    }

    /// Refuses a flag whose value the API server would reject, naming it.
    fn check_values(&self) -> Result<()> {
        values::image(&self.image)?;
        values::positive_quantity("--storage", &self.storage)?;
        if let Some(namespace) = &self.namespace {
            values::dns_label("--namespace", namespace)?;
        }
        let subdomains = [
            ("--storage-class", &self.storage_class),
            ("--priority-class", &self.priority_class),
        ];
        for (flag, value) in subdomains {
            if let Some(value) = value {
                values::dns_subdomain(flag, value)?;
            }
        }
        for secret in &self.image_pull_secrets {
            values::dns_subdomain("--image-pull-secret", secret)?;
        }
        Ok(())
    }
}

/// A job's manifests as they are rendered: its config, the flags (checked) and what they and
/// the config decide together.
#[derive(Debug)]
struct Plan<'a> {
    /// The job's resolved config.
    config: &'a JobConfig,
    /// The flags.
    options: &'a K8sOptions,
    /// Its kinds of pods.
    groups: Vec<PodGroup>,
    /// Where the pods keep their checkpoints.
    volume: VolumeMode,
    /// `--node-selector`s.
    node_selector: BTreeMap<String, String>,
    /// `--toleration`s.
    tolerations: Vec<Toleration>,
}

impl<'a> Plan<'a> {
    /// The plan of `config`'s job told `options`; an error names the flag that cannot be
    /// rendered.
    fn new(config: &'a JobConfig, options: &'a K8sOptions) -> Result<Self> {
        options.check_values()?;
        let groups = pods::groups(config, options)?;
        check_name(&options.name, &groups)?;
        let node_selector = options
            .node_selectors
            .iter()
            .map(|text| values::node_selector(text))
            .collect::<Result<_>>()?;
        let tolerations = options
            .tolerations
            .iter()
            .map(|text| values::toleration(text))
            .collect::<Result<_>>()?;
        Ok(Plan {
            config,
            options,
            groups,
            volume: volume_mode(config, options.volume)?,
            node_selector,
            tolerations,
        })
    }
}

/// The volume `requested`, else the one `config`'s recovery needs: per-pod volumes unless every
/// process restarts from one shared checkpoint directory.
fn volume_mode(config: &JobConfig, requested: Option<VolumeMode>) -> Result<VolumeMode> {
    match (requested, config.recovers_in_place()) {
        (Some(VolumeMode::PerPod), false) => bail!(
            "--volume per-pod: {} recovers by restarting every process (fault_tolerance.recovery = \"restart\"), each from the checkpoint in one directory all pods share, which per-pod volumes are not: use --volume shared (a ReadWriteMany storage class), or recovery = \"in_place\"",
            config.source_name
        ),
        (Some(mode), _) => Ok(mode),
        (None, true) => Ok(VolumeMode::PerPod),
        (None, false) => Ok(VolumeMode::Shared),
    }
}

/// The manifests of `config`'s job as one Kubernetes `List` (what `kubectl apply -f` takes). A
/// flag that cannot be rendered is refused ([`Refusal`]), naming it.
pub fn manifests(config: &JobConfig, options: &K8sOptions) -> Result<Value> {
    let plan = Plan::new(config, options).map_err(Refusal::wrap)?;
    let mut items = vec![to_value(objects::config_map(config, options)?)?];
    if plan.volume == VolumeMode::Shared {
        items.push(to_value(objects::shared_volume(options))?);
    }
    match options.operator {
        Operator::Indexed => {
            items.push(to_value(objects::headless_service(options, &plan.groups))?);
            for group in &plan.groups {
                items.push(to_value(objects::indexed_job(&plan, group))?);
            }
        }
        Operator::Pytorchjob => items.push(to_value(operators::pytorch_job(&plan))?),
        Operator::Paddlejob => items.push(to_value(operators::paddle_job(&plan)?)?),
    }
    Ok(json!({ "apiVersion": "v1", "kind": "List", "items": items }))
}

fn to_value(object: impl serde::Serialize) -> Result<Value> {
    Ok(serde_json::to_value(object)?)
}

/// Refuses a name that is not a DNS label, or that makes a pod's host name longer than one.
fn check_name(name: &str, groups: &[PodGroup]) -> Result<()> {
    // A Service's name (the job's) is an RFC 1035 label: it starts with a letter.
    ensure!(
        name.starts_with(|c: char| c.is_ascii_lowercase()) && values::dns_label("--name", name).is_ok(),
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

/// The job's config as `flotilla k8s` reads it: as `train` does, and a refusal where it does
/// not load — except that a GPU job loads in a build without the `cuda` feature too, since
/// printing its manifests runs nothing (the image its pods run needs CUDA).
pub fn job_config(
    args: &ConfigArgs,
    env: &dyn Fn(&str) -> Option<String>,
    default: &DefaultConfig,
) -> Result<JobConfig> {
    let error = match args.load(env, default) {
        Ok(config) => return Ok(config),
        Err(error) => error,
    };
    let rejects_gpu = matches!(
        error.downcast_ref::<ConfigError>(),
        Some(ConfigError::Invalid { key, message, .. }) if key == "cluster.device" && message == GPU_NOT_BUILT
    );
    if !rejects_gpu {
        return Err(Refusal::wrap(error));
    }
    // The same job on the CPU passes every other check; its manifests are the GPU job's.
    let mut on_cpu = args.clone();
    on_cpu.overrides.push("cluster.device=cpu".into());
    let mut config = on_cpu.load(env, default).map_err(Refusal::wrap)?;
    config.cluster.device = DeviceKind::Gpu;
    Ok(config)
}
