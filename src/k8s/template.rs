//! The template of a job's pods, which every form shares: one `flotilla` container running its
//! launcher, its volumes (the config, the checkpoints, scratch), the flags that place it on the
//! cluster's nodes, requests sized from the config, and the security contexts of Pod Security's
//! `restricted` profile — a non-root user, no privilege escalation, no capabilities, the
//! runtime's seccomp profile and a read-only root file system.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    EphemeralVolumeSource, LocalObjectReference, PersistentVolumeClaimSpec, PersistentVolumeClaimTemplate,
    PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements,
    SeccompProfile, SecretKeySelector, SecurityContext, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::names::{config_map_name, job_labels, shared_claim_name, token_secret_name};
use super::pods::PodGroup;
use super::{
    K8sOptions, Operator, Plan, VolumeMode, CONFIG_DIR, DATA_DIR, RUN_AS_USER, RUN_DIR, SCRATCH_DIR, TOKEN_KEY,
};
use crate::config::JobConfig;
use crate::launch::RUN_DIR_VAR;
use crate::net::auth::TOKEN_VAR;

/// Memory a process takes beyond the config's estimate (runtime, buffers, allocator).
const MEMORY_HEADROOM: u128 = 512 << 20;
/// The volume of the job's config.
const CONFIG_VOLUME: &str = "config";
/// The volume of the checkpoints and the run's outputs.
const CHECKPOINT_VOLUME: &str = "checkpoints";
/// The pod's scratch space.
const SCRATCH_VOLUME: &str = "scratch";

/// The template of `group`'s pods, which their controller restarts by `restart_policy`.
pub(super) fn pod_template(plan: &Plan, group: &PodGroup, restart_policy: &str) -> PodTemplateSpec {
    let options = plan.options;
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(job_labels(options, Some(group.role))),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            restart_policy: Some(restart_policy.into()),
            containers: vec![container(plan, group)],
            volumes: Some(volumes(plan)),
            security_context: Some(pod_security()),
            image_pull_secrets: (!options.image_pull_secrets.is_empty()).then(|| {
                let secret = |name: &String| LocalObjectReference { name: name.clone() };
                options.image_pull_secrets.iter().map(secret).collect()
            }),
            node_selector: (!plan.node_selector.is_empty()).then(|| plan.node_selector.clone()),
            tolerations: (!plan.tolerations.is_empty()).then(|| plan.tolerations.clone()),
            priority_class_name: options.priority_class.clone(),
            ..Default::default()
        }),
    }
}

/// The pod's one container: `flotilla` running `group`'s launcher, working on the volume.
fn container(plan: &Plan, group: &PodGroup) -> Container {
    let options = plan.options;
    let (container_name, coordinator_port) = match options.operator {
        // The training operator finds its container and port by these names.
        Operator::Pytorchjob => ("pytorch", Some("pytorchjob-port")),
        _ => ("flotilla", None),
    };
    let ports = group
        .ports
        .iter()
        .map(|&(name, port)| ContainerPort {
            name: Some(match (name, coordinator_port) {
                ("coordinator", Some(operator_name)) => operator_name.to_string(),
                _ => name.to_string(),
            }),
            container_port: i32::from(port),
            ..Default::default()
        })
        .collect();
    Container {
        name: container_name.into(),
        image: Some(options.image.clone()),
        command: Some(vec!["flotilla".into()]),
        args: Some(group.args.clone()),
        env: Some(environment(plan, group)),
        ports: Some(ports),
        resources: Some(resources(plan.config, group)),
        volume_mounts: Some(volume_mounts()),
        working_dir: Some(DATA_DIR.into()),
        security_context: Some(container_security()),
        ..Default::default()
    }
}

/// `group`'s variables, then the token from the job's Secret and the run directory.
fn environment(plan: &Plan, group: &PodGroup) -> Vec<EnvVar> {
    let mut env = group.env.clone();
    env.push(EnvVar {
        name: TOKEN_VAR.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: token_secret_name(plan.options),
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
    env
}

/// Where the container mounts its volumes.
fn volume_mounts() -> Vec<VolumeMount> {
    [
        (CONFIG_VOLUME, CONFIG_DIR, true),
        (CHECKPOINT_VOLUME, DATA_DIR, false),
        (SCRATCH_VOLUME, SCRATCH_DIR, false),
    ]
    .map(|(name, path, read_only)| VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    })
    .to_vec()
}

/// The pod's volumes: the config's ConfigMap, the checkpoint volume — the shared claim, or a
/// ReadWriteOnce claim of the pod's own made with it — and an `emptyDir` for scratch.
fn volumes(plan: &Plan) -> Vec<Volume> {
    let options = plan.options;
    let checkpoints = match plan.volume {
        VolumeMode::Shared => Volume {
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: shared_claim_name(options),
                ..Default::default()
            }),
            ..Default::default()
        },
        VolumeMode::PerPod => Volume {
            ephemeral: Some(EphemeralVolumeSource {
                volume_claim_template: Some(PersistentVolumeClaimTemplate {
                    metadata: Some(ObjectMeta {
                        labels: Some(job_labels(options, None)),
                        ..Default::default()
                    }),
                    spec: claim_spec(options, "ReadWriteOnce"),
                }),
            }),
            ..Default::default()
        },
    };
    let config = Volume {
        config_map: Some(ConfigMapVolumeSource {
            name: config_map_name(options),
            ..Default::default()
        }),
        ..Default::default()
    };
    let scratch = Volume {
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    };
    [
        (CONFIG_VOLUME, config),
        (CHECKPOINT_VOLUME, checkpoints),
        (SCRATCH_VOLUME, scratch),
    ]
    .map(|(name, volume)| Volume {
        name: name.into(),
        ..volume
    })
    .to_vec()
}

/// The pod runs as the image's user, its volumes owned by that user's group, under the
/// runtime's seccomp profile.
fn pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS_USER),
        run_as_group: Some(RUN_AS_USER),
        fs_group: Some(RUN_AS_USER),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The container gains no privilege and holds no capability — the launcher and the ranks only
/// open ports above 1024 and write to their volumes — on a read-only root file system.
fn container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        ..Default::default()
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
