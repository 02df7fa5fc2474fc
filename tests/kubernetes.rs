//! `flotilla k8s`: every rendered manifest is valid against Kubernetes' official schemas
//! (PyPI's `kubernetes-validate`, schemas bundled, offline; CI installs it), every pod meets
//! Pod Security's `restricted` profile as the image's user, flags the API server would reject
//! are refused naming them, and the pods of each form train — an Indexed Job's, and a
//! PyTorchJob's and a PaddleJob's with the variables their operators add (as the operators'
//! sources set them), run by the emulated kubelet of `kubernetes/kubelet.rs` — to the end the
//! in-process run reaches. The pods need root and iproute2 for their namespaces (as CI has:
//! there, without them, the tests fail); skipped, saying why, elsewhere.

mod common;
#[path = "kubernetes/kubelet.rs"]
mod kubelet;

use common::hosts::Hosts;
use common::{config, flotilla, installed, train_in_process, Finished};
use kubelet::Cluster;
use serde_json::{json, Value};

/// The manifests `flotilla k8s ARGS` prints, as a list of objects.
fn render(args: &[&str]) -> Vec<Value> {
    let args = [&["k8s", "--image", "flotilla:test", "--name", "job"], args].concat();
    let out = flotilla(&args, &[], 60);
    assert!(out.success, "flotilla k8s {args:?}:\n{}", out.stderr);
    let list: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(list["kind"], "List");
    list["items"].as_array().unwrap().clone()
}

/// The objects of `items` the core API's schemas describe: the core ones as they are, and each
/// pod template of an operator's custom resource as a `PodTemplate`.
fn core_objects(items: &[Value]) -> Vec<Value> {
    let mut objects = Vec::new();
    for item in items {
        let templates: Vec<(String, &Value)> = match item["kind"].as_str().unwrap() {
            "PyTorchJob" => {
                assert_eq!(item["apiVersion"], "kubeflow.org/v1");
                let specs = item["spec"]["pytorchReplicaSpecs"].as_object().unwrap();
                specs
                    .iter()
                    .map(|(kind, spec)| (kind.to_lowercase(), &spec["template"]))
                    .collect()
            }
            "PaddleJob" => {
                assert_eq!(item["apiVersion"], "batch.paddlepaddle.org/v1");
                assert_eq!(item["spec"]["intranet"], "Service");
                ["ps", "worker"]
                    .iter()
                    .filter(|role| !item["spec"][**role].is_null())
                    .map(|role| (role.to_string(), &item["spec"][*role]["template"]))
                    .collect()
            }
            _ => {
                objects.push(item.clone());
                continue;
            }
        };
        for (role, template) in templates {
            objects.push(json!({
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": { "name": format!("job-{role}") },
                "template": template,
            }));
        }
    }
    objects
}

/// Runs `kubernetes-validate --strict` on `objects` against the API version the manifests
/// target.
fn validate(objects: &[Value]) -> Finished {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<String> = objects
        .iter()
        .enumerate()
        .map(|(i, object)| {
            let path = dir.path().join(format!("{i}.json"));
            std::fs::write(&path, object.to_string()).unwrap();
            path.display().to_string()
        })
        .collect();
    let mut args = vec!["--strict", "--kubernetes-version", "1.33.0"];
    args.extend(files.iter().map(String::as_str));
    common::start_program("kubernetes-validate", &args, &[]).finish(120)
}

/// Every pod template of `items`: the Jobs', and those of an operator's custom resource.
fn pod_templates(items: &[Value]) -> Vec<Value> {
    core_objects(items)
        .into_iter()
        .filter_map(|object| match object["kind"].as_str().unwrap() {
            "Job" => Some(object["spec"]["template"].clone()),
            "PodTemplate" => Some(object["template"].clone()),
            _ => None,
        })
        .collect()
}

/// The flags that place the pods, and the pod spec they make.
const PLACED: [&str; 14] = [
    "--image-pull-secret",
    "registry",
    "--image-pull-secret",
    "mirror",
    "--node-selector",
    "pool=gpu",
    "--node-selector",
    "example.com/zone=a",
    "--toleration",
    "nvidia.com/gpu=present:NoSchedule",
    "--toleration",
    "spot:NoExecute",
    "--priority-class",
    "training",
];

#[test]
fn every_rendered_manifest_is_valid_against_the_official_schemas() {
    if !installed("kubernetes-validate", "PyPI's kubernetes-validate") {
        return;
    }
    let collective = ["--set", "cluster.nnodes=4"];
    let ps = ["--config", "examples/ctr_ps.toml"];
    let pipeline = ["--config", "examples/gpt_pipeline.toml"];
    let jobs: [(&[&str], &str, usize); 6] = [
        (&collective, "indexed", 3),
        (&collective, "pytorchjob", 2),
        (&collective, "paddlejob", 2),
        (&ps, "indexed", 4),
        (&ps, "paddlejob", 2),
        (&pipeline, "indexed", 3),
    ];
    // Per-pod volumes (no claim of their own), and a shared one with the pods placed.
    let shared = [&["--volume", "shared"][..], &PLACED].concat();
    for (job, operator, count) in jobs {
        for (flags, claims) in [(&[][..], 0), (&shared[..], 1)] {
            let items = render(&[job, &["--operator", operator], flags].concat());
            assert_eq!(items.len(), count + claims, "{job:?} {operator} {flags:?}: {items:?}");
            let validated = validate(&core_objects(&items));
            validated.assert_success(&format!("{job:?} --operator {operator} {flags:?}"));
        }
    }
    // The validator itself refuses what the schema does not allow.
    let mut wrong = render(&collective)[0].clone();
    wrong["spec"] = json!({ "replicas": 2 });
    assert!(!validate(&[wrong]).success);
}

#[test]
fn what_cannot_be_rendered_is_refused_naming_why() {
    for (args, expected) in [
        (
            &["k8s", "--image", "i", "--name", "Job_1"][..],
            "--name \"Job_1\": a job's name is a DNS label",
        ),
        (
            &[
                "k8s",
                "--image",
                "i",
                "--config",
                "examples/ctr_ps.toml",
                "--operator",
                "pytorchjob",
            ],
            "--operator pytorchjob runs collective jobs; examples/ctr_ps.toml is a parameter-server job (cluster.server_num = 2)",
        ),
        (
            &["k8s", "--image", "i", "--operator", "paddlejob", "--port", "6170"],
            "--port 6170: a PaddleJob's pods are reached on its operator's port 36000",
        ),
        (&["k8s", "--image", "i", "--storage", "10XB"], "--storage \"10XB\": not a Kubernetes quantity"),
        (&["k8s", "--image", "i", "--storage", "0Gi"], "--storage \"0Gi\": a size is more than zero"),
        (&["k8s", "--image", ""], "--image \"\": not an image reference"),
        (&["k8s", "--image", "i", "--namespace", "Bad_NS"], "--namespace \"Bad_NS\": not a DNS label"),
        (&["k8s", "--image", "i", "--name", "job-"], "--name \"job-\": a job's name is a DNS label"),
        (
            &["k8s", "--image", "i", "--storage-class", "fast_ssd"],
            "--storage-class \"fast_ssd\": not a DNS subdomain",
        ),
        (
            &["k8s", "--image", "i", "--image-pull-secret", "Registry"],
            "--image-pull-secret \"Registry\": not a DNS subdomain",
        ),
        (&["k8s", "--image", "i", "--priority-class", "High"], "--priority-class \"High\": not a DNS subdomain"),
        (&["k8s", "--image", "i", "--toleration", "gpu"], "--toleration \"gpu\": not KEY[=VALUE]:EFFECT"),
        (
            &["k8s", "--image", "i", "--toleration", "gpu=a:Never"],
            "--toleration \"gpu=a:Never\": the effect \"Never\" is none of NoSchedule, PreferNoSchedule, NoExecute",
        ),
        (
            &["k8s", "--image", "i", "--toleration", "a b:NoSchedule"],
            "--toleration \"a b:NoSchedule\": \"a b\" is not a label key",
        ),
        (&["k8s", "--image", "i", "--node-selector", "pool"], "--node-selector \"pool\": not KEY=VALUE"),
        (
            &["k8s", "--image", "i", "--node-selector", "pool=a b"],
            "--node-selector \"pool=a b\": \"a b\" is not a label value",
        ),
    ] {
        let out = flotilla(args, &[], 60);
        assert!(out.stderr.contains(expected), "{args:?}:\n{}", out.stderr);
        assert_eq!(out.code, Some(78), "{args:?}: refused as a config is, not as a failure");
    }
}

#[test]
fn checkpoint_volumes_are_each_pods_own_unless_the_recovery_needs_a_shared_one() {
    let checkpoints = |template: &Value| {
        let volumes = template["spec"]["volumes"].as_array().unwrap();
        volumes.iter().find(|v| v["name"] == "checkpoints").unwrap().clone()
    };
    let claims = |items: &[Value]| -> Vec<Value> {
        items
            .iter()
            .filter(|i| i["kind"] == "PersistentVolumeClaim")
            .cloned()
            .collect()
    };
    // In place (the default), every form's pods keep a ReadWriteOnce volume of their own.
    for operator in ["indexed", "pytorchjob", "paddlejob"] {
        let items = render(&["--operator", operator, "--set", "cluster.nnodes=2", "--storage", "20Gi"]);
        assert_eq!(claims(&items), Vec::<Value>::new(), "{operator}: no shared claim");
        for template in pod_templates(&items) {
            let claim = &checkpoints(&template)["ephemeral"]["volumeClaimTemplate"]["spec"];
            assert_eq!(claim["accessModes"], json!(["ReadWriteOnce"]), "{operator}: {template}");
            assert_eq!(claim["resources"]["requests"]["storage"], "20Gi");
        }
    }
    // Restarting every process reads one shared checkpoint directory: ReadWriteMany, as asked.
    let restart = ["--set", "fault_tolerance.recovery=restart"];
    for flags in [
        &restart[..],
        &["--volume", "shared"],
        &[&restart[..], &["--volume", "shared"]].concat(),
    ] {
        let items = render(flags);
        let claim = &claims(&items)[0];
        assert_eq!(claim["spec"]["accessModes"], json!(["ReadWriteMany"]), "{flags:?}");
        for template in pod_templates(&items) {
            assert_eq!(
                checkpoints(&template)["persistentVolumeClaim"]["claimName"],
                "job-checkpoints"
            );
        }
    }
    let out = flotilla(
        &[&["k8s", "--image", "i", "--volume", "per-pod"], &restart[..]].concat(),
        &[],
        60,
    );
    assert!(
        out.stderr
            .contains("--volume per-pod: config.toml recovers by restarting every process")
            && out.stderr.contains("use --volume shared"),
        "{}",
        out.stderr
    );
    assert_eq!(out.code, Some(78));
}

/// What in the pod `template` Pod Security's `restricted` profile forbids, by its rules
/// (kubernetes.io/docs/concepts/security/pod-security-standards): one line per breach. A
/// container's setting overrides its pod's.
fn restricted_breaches(template: &Value) -> Vec<String> {
    const VOLUME_TYPES: [&str; 8] = [
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    let (spec, pod) = (&template["spec"], &template["spec"]["securityContext"]);
    let mut breaches = Vec::new();
    let mut rule = |holds: bool, what: String| breaches.extend((!holds).then_some(what));
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        rule(spec[host] != true, format!("{host} is set"));
    }
    for volume in spec["volumes"].as_array().into_iter().flatten() {
        let kind = volume.as_object().unwrap().keys().find(|key| *key != "name").unwrap();
        rule(VOLUME_TYPES.contains(&kind.as_str()), format!("a {kind} volume"));
    }
    rule(pod["runAsUser"] != 0, "the pod runs as root".into());
    let containers = ["initContainers", "containers", "ephemeralContainers"].map(|key| spec[key].as_array());
    for container in containers.into_iter().flatten().flatten() {
        let (name, own) = (&container["name"], &container["securityContext"]);
        let setting = |key: &str| if own[key].is_null() { &pod[key] } else { &own[key] };
        rule(
            setting("runAsNonRoot") == true,
            format!("{name}: runAsNonRoot is not true"),
        );
        rule(own["runAsUser"] != 0, format!("{name}: runs as root"));
        rule(own["privileged"] != true, format!("{name}: privileged"));
        rule(
            own["allowPrivilegeEscalation"] == false,
            format!("{name}: may escalate privileges"),
        );
        let capabilities = |list: &str| own["capabilities"][list].as_array().cloned().unwrap_or_default();
        rule(
            capabilities("drop").contains(&json!("ALL")),
            format!("{name}: does not drop ALL"),
        );
        let added = capabilities("add");
        rule(
            added.iter().all(|c| c == "NET_BIND_SERVICE"),
            format!("{name}: adds {added:?}"),
        );
        let seccomp = &setting("seccompProfile")["type"];
        rule(
            seccomp == "RuntimeDefault" || seccomp == "Localhost",
            format!("{name}: seccomp {seccomp}"),
        );
    }
    breaches
}

#[test]
fn every_pod_meets_the_restricted_pod_security_profile() {
    let collective = ["--set", "cluster.nnodes=2"];
    let ps = ["--config", "examples/ctr_ps.toml"];
    let jobs: [(&[&str], &str); 5] = [
        (&collective, "indexed"),
        (&collective, "pytorchjob"),
        (&collective, "paddlejob"),
        (&ps, "indexed"),
        (&ps, "paddlejob"),
    ];
    for (job, operator) in jobs {
        for volume in ["per-pod", "shared"] {
            let items = render(&[job, &["--operator", operator, "--volume", volume]].concat());
            for template in pod_templates(&items) {
                assert_eq!(
                    restricted_breaches(&template),
                    Vec::<String>::new(),
                    "{operator} {volume}: {template}"
                );
                let container = &template["spec"]["containers"][0];
                assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
                // The one path it writes outside its volumes is scratch space of its own.
                let scratch = container["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["mountPath"] == "/tmp");
                let volumes = template["spec"]["volumes"].as_array().unwrap();
                let scratch = volumes.iter().find(|v| v["name"] == scratch.unwrap()["name"]).unwrap();
                assert!(scratch["emptyDir"].is_object(), "{scratch}");
            }
        }
    }
    // The check sees what the profile forbids.
    let mut root = pod_templates(&render(&[]))[0].clone();
    root["spec"]["hostNetwork"] = json!(true);
    root["spec"]["containers"][0]["securityContext"] =
        json!({ "runAsNonRoot": false, "capabilities": { "add": ["SYS_ADMIN"] } });
    root["spec"]["volumes"][0] = json!({ "name": "host", "hostPath": { "path": "/" } });
    assert_eq!(restricted_breaches(&root).len(), 6, "{:?}", restricted_breaches(&root));
}

/// `backoffLimit` and restart policies of `operator`'s manifests for `max_restarts`, as
/// `[limit, policy]` per pod template.
fn retries(operator: &str, max_restarts: usize) -> Vec<Value> {
    let restarts = format!("fault_tolerance.max_restarts={max_restarts}");
    let items = render(&["--operator", operator, "--set", "cluster.nnodes=2", "--set", &restarts]);
    let job = items.last().unwrap();
    let limit = match job["kind"].as_str().unwrap() {
        "Job" => job["spec"]["backoffLimit"].clone(),
        "PyTorchJob" => job["spec"]["runPolicy"]["backoffLimit"].clone(),
        _ => Value::Null,
    };
    let templates = pod_templates(&items);
    templates
        .iter()
        .map(|t| json!([limit, t["spec"]["restartPolicy"]]))
        .collect()
}

#[test]
fn pods_are_placed_by_the_flags_and_retried_as_the_config_says() {
    for operator in ["indexed", "pytorchjob", "paddlejob"] {
        let items = render(&[&["--operator", operator, "--set", "cluster.nnodes=2"], &PLACED[..]].concat());
        for template in pod_templates(&items) {
            let spec = &template["spec"];
            assert_eq!(
                spec["imagePullSecrets"],
                json!([{ "name": "registry" }, { "name": "mirror" }])
            );
            assert_eq!(spec["nodeSelector"], json!({ "example.com/zone": "a", "pool": "gpu" }));
            let tolerations = json!([
                { "key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule" },
                { "key": "spot", "operator": "Exists", "effect": "NoExecute" },
            ]);
            assert_eq!(spec["tolerations"], tolerations, "{operator}");
            assert_eq!(spec["priorityClassName"], "training");
        }
    }
    // A lost pod is retried up to fault_tolerance.max_restarts: by the Job, which makes it
    // again, or by its operator; a PaddleJob's operator has no limit, so its pods restart in
    // place only when the job may restart at all.
    for restarts in [0, 3] {
        let in_place = if restarts == 0 { "Never" } else { "OnFailure" };
        assert_eq!(retries("indexed", restarts), [json!([restarts, "Never"])]);
        assert_eq!(retries("pytorchjob", restarts), vec![json!([restarts, in_place]); 2]);
        assert_eq!(retries("paddlejob", restarts), [json!([null, in_place])]);
    }
    let help = flotilla(&["k8s", "--help"], &[], 60).stdout;
    assert!(
        help.contains("fault_tolerance.max_restarts") && help.contains("backoffLimit"),
        "{help}"
    );
}

#[test]
fn a_gpu_jobs_manifests_print_in_any_build() {
    let items = render(&["--set", "cluster.device=gpu", "--set", "cluster.nnodes=2"]);
    for template in pod_templates(&items) {
        assert_eq!(
            template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
            "2"
        );
    }
    let job = items[0]["data"]["job.toml"].as_str().unwrap();
    assert!(job.contains("device = \"gpu\""), "{job}");
    if installed("kubernetes-validate", "PyPI's kubernetes-validate") {
        assert!(validate(&core_objects(&items)).success);
    }
}

#[test]
fn the_image_runs_as_the_user_the_pods_run_as() {
    let dockerfile = std::fs::read_to_string("Dockerfile").unwrap();
    let instruction = |name: &str| -> Vec<&str> {
        let prefix = format!("{name} ");
        dockerfile
            .lines()
            .filter_map(|line| line.strip_prefix(prefix.as_str()))
            .collect()
    };
    let user = *instruction("USER").last().unwrap();
    let (uid, gid) = user.split_once(':').unwrap();
    let pod = &pod_templates(&render(&[]))[0]["spec"]["securityContext"];
    assert_eq!(
        [uid, gid, gid],
        [&pod["runAsUser"], &pod["runAsGroup"], &pod["fsGroup"]].map(|id| id.to_string())
    );
    assert!(
        dockerfile.contains(&format!("--uid {uid}")),
        "the image has no user {uid}"
    );
    assert_eq!(instruction("ENTRYPOINT"), [r#"["flotilla"]"#]);
    assert!(instruction("RUN")
        .iter()
        .any(|run| run.contains("cargo build --release --locked")));
    let ignored = std::fs::read_to_string(".dockerignore").unwrap();
    for dir in ["target/", "runs/"] {
        assert!(
            ignored.lines().any(|line| line == dir),
            "{dir} is sent to the image build"
        );
    }
}

/// Renders `args`' job, runs its pods on hosts of their own, and returns the run's outputs: the
/// files of every pod's run directory (each pod's own, on per-pod volumes), the first pod's
/// where two wrote one.
fn train_in_pods(args: &[&str]) -> Option<tempfile::TempDir> {
    let items = render(args);
    let pods = Cluster::pods(&items);
    assert!(!pods.is_empty(), "{args:?} renders no pods");
    let hosts = Hosts::create_or_say_why(pods.len())?;
    let mut cluster = Cluster::new(&items);
    let finished = cluster.run(&pods, &hosts);
    for (pod, end) in pods.iter().zip(&finished) {
        assert!(end.success, "pod {} failed:\n{}\n{}", pod.name, end.stdout, end.stderr);
    }
    let outputs = tempfile::tempdir().unwrap();
    for pod in &pods {
        for entry in std::fs::read_dir(cluster.host_path(pod, flotilla::k8s::RUN_DIR)).unwrap() {
            let entry = entry.unwrap();
            let (path, copy) = (entry.path(), outputs.path().join(entry.file_name()));
            if path.is_file() && !copy.exists() {
                std::fs::copy(&path, &copy).unwrap();
            }
        }
    }
    Some(outputs)
}

/// The pods of a 2-node data-parallel job rendered for `operator` end bit-identical to the
/// in-process cluster: two ranks, one per pod, in the same ring order.
fn data_parallel_pods_train_as_in_one_process(operator: &str) {
    let steps = "train.steps=20";
    #[rustfmt::skip]
    let args = ["--operator", operator, "--set", "cluster.nnodes=2", "--set", "cluster.nproc_per_node=1", "--set", steps];
    let Some(outputs) = train_in_pods(&args) else {
        return;
    };
    let summary = common::read_summary(outputs.path());
    assert_eq!(summary["world_size"], 2);
    let simulated = train_in_process(config(&[steps]));
    assert_eq!(summary["param_checksum"], simulated.summary.param_checksum.as_str());
}

/// The pods of a sync parameter-server job (a pod per shard and per trainer) rendered for
/// `operator` end bit-identical to the in-process job.
fn parameter_server_pods_train_as_in_one_process(operator: &str) {
    let steps = "train.steps=40";
    let args = [
        "--operator",
        operator,
        "--config",
        "examples/ctr_ps.toml",
        "--set",
        steps,
    ];
    let Some(outputs) = train_in_pods(&args) else {
        return;
    };
    common::ps_matches_uninterrupted(&[steps], &common::read_summary(outputs.path()), outputs.path());
}

#[test]
fn the_pods_of_indexed_jobs_train_as_in_one_process() {
    data_parallel_pods_train_as_in_one_process("indexed");
    parameter_server_pods_train_as_in_one_process("indexed");
}

#[test]
fn the_pods_of_a_pytorchjob_train_with_the_operators_environment() {
    data_parallel_pods_train_as_in_one_process("pytorchjob");
}

#[test]
fn the_pods_of_paddlejobs_train_with_the_operators_environment() {
    data_parallel_pods_train_as_in_one_process("paddlejob");
    parameter_server_pods_train_as_in_one_process("paddlejob");
}

#[test]
fn an_elastic_jobs_pods_run_launchers_that_say_min_and_max() {
    let items = render(&[
        "--set",
        "cluster.nnodes=3",
        "--set",
        "cluster.min_nnodes=2",
        "--set",
        "train.batch_size=48",
    ]);
    let args = serde_json::to_string(&items).unwrap();
    assert!(args.contains(r#""--nnodes","2:3""#), "{args}");
}
