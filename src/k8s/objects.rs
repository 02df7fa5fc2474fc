//! The Kubernetes objects every form of a job shares — its config, its shared checkpoint
//! volume — and the plain-Kubernetes form's headless Service and Indexed Jobs.

use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Service, ServicePort, ServiceSpec};

use super::names::{config_map_name, metadata, shared_claim_name, JOB_LABEL};
use super::pods::PodGroup;
use super::template::{claim_spec, pod_template};
use super::{K8sOptions, Plan, CONFIG_FILE};
use crate::config::JobConfig;

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
