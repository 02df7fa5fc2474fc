//! What a job's Kubernetes objects are called and labelled, whichever form renders them.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::K8sOptions;

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
