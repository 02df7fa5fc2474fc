//! The Kubernetes objects every form of a job shares — its config, its shared checkpoint
//! volume — and the plain-Kubernetes form's headless Service and Indexed Jobs.

use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolumeClaim, PersistentVolumeClaimSpec, Service, ServicePort, ServiceSpec,
    VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::pods::PodGroup;
use super::template::pod_template;
use super::{K8sOptions, Plan, CONFIG_FILE};
use crate::config::JobConfig;

/// The label every object of a job carries, its value the job's name.
pub(super) const JOB_LABEL: &str = "flotilla.io/job";
/// The label of a pod's role in its job.
const ROLE_LABEL: &str = "flotilla.io/role";

/// An object's name, namespace and the job's label.
pub(super) fn metadata(options: &K8sOptions, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: options.namespace.clone(),
        labels: Some(job_labels(options, None)),
        ..Default::default()
    }
}

/// The labels of a job's objects, and of its pods of `role`.
pub(super) fn job_labels(options: &K8sOptions, role: Option<&str>) -> BTreeMap<String, String> {
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

/// The ConfigMap holding the job's config.
pub(super) fn config_map_name(options: &K8sOptions) -> String {
    format!("{}-config", options.name)
}

/// The claim of the shared checkpoint volume.
pub(super) fn shared_claim_name(options: &K8sOptions) -> String {
    format!("{}-checkpoints", options.name)
}

/// The Secret the cluster token is read from (created by the user, never rendered).
pub(super) fn token_secret_name(options: &K8sOptions) -> String {
    format!("{}-token", options.name)
}

/// The ReadWriteMany volume every pod keeps its checkpoints and the run's outputs on
/// (`--volume shared`): a pod started again on another node finds them, and they outlive the
/// job.
pub(super) fn shared_volume(options: &K8sOptions) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: metadata(options, shared_claim_name(options)),
        spec: Some(claim_spec(options, "ReadWriteMany")),
        ..Default::default()
    }
}

/// A checkpoint volume's claim of `--storage` from `--storage-class`, in `access_mode`.
pub(super) fn claim_spec(options: &K8sOptions, access_mode: &str) -> PersistentVolumeClaimSpec {
    PersistentVolumeClaimSpec {
        access_modes: Some(vec![access_mode.into()]),
        storage_class_name: options.storage_class.clone(),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([(
                "storage".to_string(),
                Quantity(options.storage.clone()),
            )])),
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
/// that fails is made again by the Job, up to the job's restarts in all (`backoffLimit` =
/// `fault_tolerance.max_restarts`); its launcher restarts the processes inside it first.
pub(super) fn indexed_job(plan: &Plan, group: &PodGroup) -> Job {
    let options = plan.options;
    let pods = i32::try_from(group.replicas).unwrap_or(i32::MAX);
    // The Job makes a new pod for a failed one (and counts it): its pods never restart in place.
    let mut template = pod_template(plan, group, "Never");
    if let Some(spec) = template.spec.as_mut() {
        spec.subdomain = Some(options.name.clone());
    }
    Job {
        metadata: metadata(options, format!("{}-{}", options.name, group.role)),
        spec: Some(JobSpec {
            completion_mode: Some("Indexed".into()),
            completions: Some(pods),
            parallelism: Some(pods),
            backoff_limit: Some(restarts(plan.config)),
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
