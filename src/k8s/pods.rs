//! What each kind of pod of a job runs: which launcher, with which node rank, addresses and
//! environment. The forms differ only in where a pod learns its index and its peers' names —
//! the Indexed Job's completion index and headless-Service names, PyTorchJob's `PET_NODE_RANK`
//! and `MASTER_ADDR`, PaddleJob's `PADDLE_TRAINER_ID`, `POD_IP` and endpoint lists.

use anyhow::{bail, Result};
use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, ObjectFieldSelector};

use super::{K8sOptions, Operator, CONFIG_DIR, CONFIG_FILE};
use crate::config::{DeviceKind, JobConfig, Strategy};

/// The variable an Indexed Job's pod reads its index into (from the pod's annotation).
pub(super) const INDEX_VAR: &str = "FLOTILLA_INDEX";
/// The variable holding a pod's own host name, as its peers resolve it.
pub(super) const HOST_VAR: &str = "FLOTILLA_HOST";
/// The annotation the Job controller gives each pod of an Indexed Job.
const INDEX_ANNOTATION: &str = "batch.kubernetes.io/job-completion-index";

/// One kind of pod of a job.
#[derive(Debug, Clone)]
pub(super) struct PodGroup {
    /// Its role in its pods' names (`node`, `ps`, `trainer`; the operators' `master`, `worker`).
    pub(super) role: &'static str,
    /// How many pods.
    pub(super) replicas: usize,
    /// The `flotilla` arguments of each.
    pub(super) args: Vec<String>,
    /// Environment besides the token and the run directory.
    pub(super) env: Vec<EnvVar>,
    /// Processes per pod: its CPU request, and its GPUs on a CUDA job.
    pub(super) processes: usize,
    /// The ports its processes listen on, named.
    pub(super) ports: Vec<(&'static str, u16)>,
}

impl PodGroup {
    /// The name (and host name) of pod `index` of this group in the job `job`.
    pub(super) fn pod_name(&self, job: &str, index: usize) -> String {
        format!("{job}-{}-{index}", self.role)
    }

    /// The GPUs each pod asks for.
    pub(super) fn gpus(&self, config: &JobConfig) -> usize {
        match config.cluster.device {
            DeviceKind::Gpu => self.processes,
            _ => 0,
        }
    }
}

/// The pod groups of `config`'s job in the form `options` names.
pub(super) fn groups(config: &JobConfig, options: &K8sOptions) -> Result<Vec<PodGroup>> {
    let port = options.port()?;
    let name = options.name.as_str();
    if config.resolved_strategy() == Strategy::ParameterServer {
        return parameter_servers(config, options, port);
    }
    let nodes = config.cluster.nnodes;
    let per_node = config.cluster.nproc_per_node;
    // An elastic job's launchers say so as torchrun's do: MIN:MAX.
    let nnodes = match config.cluster.min_nnodes {
        Some(min) if min < nodes => format!("{min}:{nodes}"),
        _ => nodes.to_string(),
    };
    // Every form's pod runs one node's launcher; only its node rank and master differ.
    let node = |role, replicas, rank: &str, master_addr: String, master_port: String, env| PodGroup {
        role,
        replicas,
        args: with_train(
            [
                "launch",
                "--nnodes",
                &nnodes,
                "--nproc_per_node",
                &per_node.to_string(),
                "--node-rank",
                rank,
                "--master-addr",
                &master_addr,
                "--master-port",
                &master_port,
            ],
            name,
        ),
        env,
        processes: per_node,
        ports: vec![("coordinator", port)],
    };
    Ok(match options.operator {
        Operator::Indexed => vec![node(
            "node",
            nodes,
            &expand(INDEX_VAR),
            format!("{name}-node-0.{name}"),
            port.to_string(),
            vec![index_from_annotation()],
        )],
        // The operator names the master pod and gives every pod its node rank and the master.
        Operator::Pytorchjob => {
            let pod = |role, replicas| {
                node(
                    role,
                    replicas,
                    &expand("PET_NODE_RANK"),
                    expand("MASTER_ADDR"),
                    expand("MASTER_PORT"),
                    Vec::new(),
                )
            };
            let mut groups = vec![pod("master", 1)];
            if nodes > 1 {
                groups.push(pod("worker", nodes - 1));
            }
            groups
        }
        Operator::Paddlejob => vec![node(
            "worker",
            nodes,
            &expand("PADDLE_TRAINER_ID"),
            format!("{name}-worker-0"),
            port.to_string(),
            Vec::new(),
        )],
    })
}

/// A parameter-server job: a pod per server and a pod per trainer, each running `launch-ps`
/// for its own role (`--host` is the pod's name, as its peers know it); the coordinator runs
/// in trainer 0's pod.
fn parameter_servers(config: &JobConfig, options: &K8sOptions, port: u16) -> Result<Vec<PodGroup>> {
    let name = options.name.as_str();
    let (servers, trainers) = (config.cluster.server_num, config.world_size());
    let (server_role, trainer_role, host, servers_list, trainers_list) = match options.operator {
        Operator::Indexed => {
            let list = |role: &str, count: usize| -> String {
                (0..count)
                    .map(|i| format!("{name}-{role}-{i}.{name}:{port}"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            ("ps", "trainer", expand(HOST_VAR), list("ps", servers), list("trainer", trainers))
        }
        Operator::Paddlejob => (
            "ps",
            "worker",
            expand("POD_IP"),
            expand("PADDLE_PSERVERS_IP_PORT_LIST"),
            expand("PADDLE_TRAINER_ENDPOINTS"),
        ),
        Operator::Pytorchjob => bail!(
            "--operator pytorchjob runs collective jobs; {} is a parameter-server job (cluster.server_num = {servers}): use --operator indexed or paddlejob",
            config.source_name
        ),
    };
    let master = match options.operator {
        Operator::Indexed => format!("{name}-{trainer_role}-0.{name}:{}", port + 1),
        _ => format!("{name}-{trainer_role}-0:{}", port + 1),
    };
    let group = |role: &'static str, replicas: usize, ports: Vec<(&'static str, u16)>| PodGroup {
        role,
        replicas,
        args: with_train(
            [
                "launch-ps",
                "--host",
                &host,
                "--servers",
                &servers_list,
                "--workers",
                &trainers_list,
                "--master",
                &master,
            ],
            name,
        ),
        env: match options.operator {
            // The pod's index, then its name under the headless Service.
            Operator::Indexed => vec![
                index_from_annotation(),
                EnvVar {
                    name: HOST_VAR.into(),
                    value: Some(format!("{name}-{role}-{}.{name}", expand(INDEX_VAR))),
                    ..Default::default()
                },
            ],
            _ => Vec::new(),
        },
        processes: 1,
        ports,
    };
    Ok(vec![
        group(server_role, servers, vec![("server", port)]),
        // Trainers listen on nothing; trainer 0's pod runs the coordinator.
        group(trainer_role, trainers, vec![("coordinator", port + 1)]),
    ])
}

/// A launcher's `flags`, then the job's id and the trainer every process runs.
fn with_train<const N: usize>(flags: [&str; N], job: &str) -> Vec<String> {
    let config = format!("{CONFIG_DIR}/{CONFIG_FILE}");
    flags
        .into_iter()
        .chain(["--job_id", job, "--", "train", "--config", &config])
        .map(str::to_string)
        .collect()
}

/// `$(VAR)`: the kubelet replaces it with the container's variable in arguments and values.
fn expand(var: &str) -> String {
    format!("$({var})")
}

/// [`INDEX_VAR`] from the pod's completion-index annotation.
fn index_from_annotation() -> EnvVar {
    EnvVar {
        name: INDEX_VAR.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: format!("metadata.annotations['{INDEX_ANNOTATION}']"),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}
