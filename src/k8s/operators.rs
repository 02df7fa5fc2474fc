//! The custom resources of the training operators people run: Kubeflow's PyTorchJob
//! (`kubeflow.org/v1`) and Paddle's PaddleJob (`batch.paddlepaddle.org/v1`), typed here with the
//! fields flotilla sets; their pod templates are the core API's.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;

use super::names::metadata;
use super::objects::restarts;
use super::pods::PodGroup;
use super::template::pod_template;
use super::{Plan, VolumeMode};
use crate::config::JobConfig;

/// How the operator treats a pod that failed: started again in place while the job may
/// restart (`fault_tolerance.max_restarts` > 0), else left failed, failing the job.
fn restart_policy(config: &JobConfig) -> &'static str {
    match config.fault_tolerance.max_restarts {
        0 => "Never",
        _ => "OnFailure",
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PyTorchJob {
    api_version: &'static str,
    kind: &'static str,
    metadata: ObjectMeta,
    spec: PyTorchJobSpec,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct PyTorchJobSpec {
    run_policy: RunPolicy,
    /// Processes per pod (the operator's `PET_NPROC_PER_NODE`, and its `WORLD_SIZE` factor).
    nproc_per_node: String,
    /// `Master` and `Worker`.
    pytorch_replica_specs: BTreeMap<&'static str, ReplicaSpec>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct RunPolicy {
    clean_pod_policy: &'static str,
    backoff_limit: i32,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ReplicaSpec {
    replicas: i32,
    restart_policy: &'static str,
    template: PodTemplateSpec,
}

/// A PyTorchJob of the collective job: a `Master` pod (node 0, the coordinator's) and `Worker`
/// pods, each running its node's launcher with the operator's node rank and master address;
/// the operator fails the job once its pods restarted `fault_tolerance.max_restarts` times.
pub(super) fn pytorch_job(plan: &Plan) -> PyTorchJob {
    let (config, options) = (plan.config, plan.options);
    let restart_policy = restart_policy(config);
    let specs = plan
        .groups
        .iter()
        .map(|group| {
            let replica_type = if group.role == "master" { "Master" } else { "Worker" };
            (
                replica_type,
                ReplicaSpec {
                    replicas: replicas(group),
                    restart_policy,
                    template: pod_template(plan, group, restart_policy),
                },
            )
        })
        .collect();
    PyTorchJob {
        api_version: "kubeflow.org/v1",
        kind: "PyTorchJob",
        metadata: metadata(options, options.name.clone()),
        spec: PyTorchJobSpec {
            run_policy: RunPolicy {
                clean_pod_policy: "None",
                backoff_limit: restarts(config),
            },
            nproc_per_node: config.cluster.nproc_per_node.to_string(),
            pytorch_replica_specs: specs,
        },
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PaddleJob {
    api_version: &'static str,
    kind: &'static str,
    metadata: ObjectMeta,
    spec: PaddleJobSpec,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct PaddleJobSpec {
    clean_pod_policy: &'static str,
    /// Pods reach each other through the operator's per-pod Services, by pod name.
    intranet: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ps: Option<ResourceSpec>,
    worker: ResourceSpec,
}

#[derive(Debug, Serialize)]
struct ResourceSpec {
    replicas: i32,
    template: PodTemplateSpec,
}

/// A PaddleJob: `ps` pods for the servers of a parameter-server job and `worker` pods for its
/// trainers or a collective job's nodes. Its operator has no limit of restarts: a job that may
/// restart has its failed pods started again in place by the kubelet, with its back-off.
pub(super) fn paddle_job(plan: &Plan) -> anyhow::Result<PaddleJob> {
    let spec = |group: &PodGroup| ResourceSpec {
        replicas: replicas(group),
        template: pod_template(plan, group, restart_policy(plan.config)),
    };
    let ps = plan.groups.iter().find(|group| group.role == "ps").map(spec);
    let worker = plan
        .groups
        .iter()
        .find(|group| group.role == "worker")
        .map(spec)
        .ok_or_else(|| anyhow::anyhow!("a PaddleJob needs worker pods"))?;
    Ok(PaddleJob {
        api_version: "batch.paddlepaddle.org/v1",
        kind: "PaddleJob",
        metadata: metadata(plan.options, plan.options.name.clone()),
        spec: PaddleJobSpec {
            // Per-pod volumes go with their pods: rank 0's holds the run's outputs.
            clean_pod_policy: match plan.volume {
                VolumeMode::PerPod => "Never",
                VolumeMode::Shared => "OnCompletion",
            },
            intranet: "Service",
            ps,
            worker,
        },
    })
}

fn replicas(group: &PodGroup) -> i32 {
    i32::try_from(group.replicas).unwrap_or(i32::MAX)
}
