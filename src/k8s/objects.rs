//! The Kubernetes objects every form of a job shares — its config, its checkpoint volume, its
//! pods' template — and the plain-Kubernetes form's headless Service and Indexed Jobs.

use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec, ResourceRequirements,
    SecretKeySelector, Service, ServicePort, ServiceSpec, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::pods::PodGroup;
use super::{K8sOptions, Operator, CONFIG_DIR, CONFIG_FILE, DATA_DIR, RUN_DIR, TOKEN_KEY};
use crate::config::JobConfig;
use crate::launch::RUN_DIR_VAR;
use crate::net::auth::TOKEN_VAR;

/// The label every object of a job carries, its value the job's name.
pub(super) const JOB_LABEL: &str = "flotilla.io/job";
/// The label of a pod's role in its job.
const ROLE_LABEL: &str = "flotilla.io/role";
/// Memory a process takes beyond the config's estimate (runtime, buffers, allocator).
const MEMORY_HEADROOM: u128 = 512 << 20;

/// An object's name, namespace and the job's label.
pub(super) fn metadata(options: &K8sOptions, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: options.namespace.clone(),
        labels: Some(job_labels(options, None)),
        ..Default::default()
    }
}

fn job_labels(options: &K8sOptions, role: Option<&str>) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "flotilla".to_string()),
        (JOB_LABEL.to_string(), options.name.clone()),
    ]);
    if let Some(role) = role {
        labels.insert(ROLE_LABEL.to_string(), role.to_string());
    }
    labels
}

/// The job's resolved config, as every pod reads it. What differs between pods and clusters —
/// the coordinator's and the peers' addresses, the token — is left out: each pod's launcher and
/// the job's Secret give those.
pub(super) fn config_map(config: &JobConfig, options: &K8sOptions) -> Result<ConfigMap> {
    let mut shared = config.clone();
    shared.cluster.master = None;
    shared.cluster.endpoints.clear();
    shared.cluster.pservers.clear();
    shared.cluster.token = None;
    shared.cluster.job_id = None;
    Ok(ConfigMap {
        metadata: metadata(options, config_map_name(options)),
        data: Some(BTreeMap::from([(CONFIG_FILE.to_string(), shared.to_toml_string()?)])),
        ..Default::default()
    })
}

fn config_map_name(options: &K8sOptions) -> String {
    format!("{}-config", options.name)
}

fn checkpoint_claim_name(options: &K8sOptions) -> String {
    format!("{}-checkpoints", options.name)
}

/// The Secret the cluster token is read from (created by the user, never rendered).
pub(super) fn token_secret_name(options: &K8sOptions) -> String {
    format!("{}-token", options.name)
}

/// The volume every pod keeps its checkpoints and the run's outputs on: shared by all pods, so
/// a pod started again on another node finds them.
pub(super) fn checkpoint_volume(options: &K8sOptions) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: metadata(options, checkpoint_claim_name(options)),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteMany".into()]),
            storage_class_name: options.storage_class.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity(options.storage.clone()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The Service that gives each pod of the job a DNS name (`POD.JOB`) from its first moment:
/// the coordinator is reached through it before any pod is ready.
pub(super) fn headless_service(options: &K8sOptions, groups: &[PodGroup]) -> Service {
    // A Service takes each port once (the API server refuses a repeated one).
    let mut seen = std::collections::BTreeSet::new();
    let ports: Vec<ServicePort> = groups
        .iter()
        .flat_map(|group| &group.ports)
        .filter(|(_, port)| seen.insert(*port))
        .map(|&(name, port)| ServicePort {
            name: Some(name.to_string()),
            port: i32::from(port),
            ..Default::default()
        })
        .collect();
    Service {
        metadata: metadata(options, options.name.clone()),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(BTreeMap::from([(JOB_LABEL.to_string(), options.name.clone())])),
            ports: Some(ports),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// An Indexed Job of `group`'s pods: pod `i` is `JOB-ROLE-i`, found as `JOB-ROLE-i.JOB`. A pod
/// that fails is started again by the Job, up to the job's restarts; its launcher restarts the
/// processes inside it first.
pub(super) fn indexed_job(config: &JobConfig, options: &K8sOptions, group: &PodGroup) -> Job {
    let pods = i32::try_from(group.replicas).unwrap_or(i32::MAX);
    let mut template = pod_template(config, options, group, "Never");
    if let Some(spec) = template.spec.as_mut() {
        spec.subdomain = Some(options.name.clone());
    }
    Job {
        metadata: metadata(options, format!("{}-{}", options.name, group.role)),
        spec: Some(JobSpec {
            completion_mode: Some("Indexed".into()),
            completions: Some(pods),
            parallelism: Some(pods),
            backoff_limit: Some(restarts(config)),
            template,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How many times the pods of the job may fail before the job does.
pub(super) fn restarts(config: &JobConfig) -> i32 {
    i32::try_from(config.fault_tolerance.max_restarts).unwrap_or(i32::MAX)
}

/// The template of `group`'s pods: one `flotilla` container running its launcher, the config
/// and checkpoint volumes, the token from the job's Secret, requests sized from the config.
pub(super) fn pod_template(
    config: &JobConfig,
    options: &K8sOptions,
    group: &PodGroup,
    restart_policy: &str,
) -> PodTemplateSpec {
    let (container_name, port_name) = match options.operator {
        // The training operator finds its container and port by these names.
        Operator::Pytorchjob => ("pytorch", Some("pytorchjob-port")),
        _ => ("flotilla", None),
    };
    let mut env = group.env.clone();
    env.push(EnvVar {
        name: TOKEN_VAR.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: token_secret_name(options),
                key: TOKEN_KEY.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    env.push(EnvVar {
        name: RUN_DIR_VAR.into(),
        value: Some(RUN_DIR.into()),
        ..Default::default()
    });
    let ports = group
        .ports
        .iter()
        .map(|&(name, port)| ContainerPort {
            name: Some(match (name, port_name) {
                ("coordinator", Some(operator_name)) => operator_name.to_string(),
                _ => name.to_string(),
            }),
            container_port: i32::from(port),
            ..Default::default()
        })
        .collect();
    let container = Container {
        name: container_name.into(),
        image: Some(options.image.clone()),
        command: Some(vec!["flotilla".into()]),
        args: Some(group.args.clone()),
        env: Some(env),
        ports: Some(ports),
        resources: Some(resources(config, group)),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "config".into(),
                mount_path: CONFIG_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: "checkpoints".into(),
                mount_path: DATA_DIR.into(),
                ..Default::default()
            },
        ]),
        ..Default::default()
    };
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(job_labels(options, Some(group.role))),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            restart_policy: Some(restart_policy.into()),
            containers: vec![container],
            volumes: Some(vec![
                Volume {
                    name: "config".into(),
                    config_map: Some(ConfigMapVolumeSource {
                        name: config_map_name(options),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Volume {
                    name: "checkpoints".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: checkpoint_claim_name(options),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
    }
}

/// A core per process and the config's memory estimate with headroom, requested; the GPUs of a
/// CUDA job, as limits (how extended resources are asked for).
fn resources(config: &JobConfig, group: &PodGroup) -> ResourceRequirements {
    let memory_mib = (config.estimated_node_bytes() + MEMORY_HEADROOM).div_ceil(1 << 20);
    let requests = BTreeMap::from([
        ("cpu".to_string(), Quantity(group.processes.to_string())),
        ("memory".to_string(), Quantity(format!("{memory_mib}Mi"))),
    ]);
    let gpus = group.gpus(config);
    ResourceRequirements {
        requests: Some(requests),
        limits: (gpus > 0).then(|| BTreeMap::from([("nvidia.com/gpu".to_string(), Quantity(gpus.to_string()))])),
        ..Default::default()
    }
}
