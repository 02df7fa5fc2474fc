//! A kubelet's part, emulated: the pods of rendered manifests run on this machine as their
//! controllers would make them — each pod's command with exactly the environment the kubelet
//! gives it, in a network namespace of its own, the pods' names in a hosts file, its volumes
//! bind-mounted where it mounts them: a ConfigMap's and a shared claim's directory shared by the
//! pods, an ephemeral claim's and an `emptyDir`'s each pod's own.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::common::hosts::Hosts;
use super::common::{self, children_of, end_leftovers, Finished};

/// The pods of the Indexed Jobs of `items`, run as a kubelet would on `hosts` (one pod per
/// host, in order), with the Secret's token [`common::TEST_TOKEN`].
pub struct Cluster {
    dir: tempfile::TempDir,
    /// Host directories of the shared volumes, by volume source (`configMap/NAME`, `claim/NAME`).
    volumes: HashMap<String, PathBuf>,
    /// `/etc/netns/NAME` of each host, holding its hosts file.
    netns_dirs: Vec<PathBuf>,
    /// Mount points this test made on this machine, to remove again.
    made: Vec<PathBuf>,
    /// This cluster's turn: its pods share this machine's mount points, which removing
    /// would take from another cluster's pods.
    _turn: std::sync::MutexGuard<'static, ()>,
}

/// One pod: its name, its index in its Job, the names it is found by, its spec, and what its
/// controller adds to its container's environment.
pub struct Pod {
    pub name: String,
    index: usize,
    /// `POD.SUBDOMAIN` beside `POD` (an Indexed Job's pods under the headless Service).
    subdomain: Option<String>,
    spec: Value,
    /// Variables the operator appends to the container's own, in its order.
    operator_env: Vec<(String, String)>,
}

impl Cluster {
    pub fn new(items: &[Value]) -> Self {
        // One emulated cluster at a time.
        static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let turn = ONE_CLUSTER.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Not under /tmp, which a pod's scratch volume covers.
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let mut volumes = HashMap::new();
        for item in items {
            let name = item["metadata"]["name"].as_str().unwrap();
            match item["kind"].as_str().unwrap() {
                "ConfigMap" => {
                    let path = dir.path().join("configmaps").join(name);
                    std::fs::create_dir_all(&path).unwrap();
                    for (file, text) in item["data"].as_object().unwrap() {
                        std::fs::write(path.join(file), text.as_str().unwrap()).unwrap();
                    }
                    volumes.insert(format!("configMap/{name}"), path);
                }
                "PersistentVolumeClaim" => {
                    let path = dir.path().join("claims").join(name);
                    std::fs::create_dir_all(&path).unwrap();
                    volumes.insert(format!("claim/{name}"), path);
                }
                _ => {}
            }
        }
        Cluster {
            dir,
            volumes,
            netns_dirs: Vec::new(),
            made: Vec::new(),
            _turn: turn,
        }
    }

    /// Every pod of `items`: those the Job controller makes of each Indexed Job, or the
    /// training operator of its PyTorchJob or PaddleJob, with the environment each operator
    /// adds (as their sources set it: Kubeflow's `pytorch/envvar.go`, Paddle's
    /// `paddlejob_helper.go`).
    pub fn pods(items: &[Value]) -> Vec<Pod> {
        let mut pods = Vec::new();
        for item in items {
            let job = item["metadata"]["name"].as_str().unwrap();
            match item["kind"].as_str().unwrap() {
                "Job" => indexed_job_pods(job, item, &mut pods),
                "PyTorchJob" => pytorch_job_pods(job, item, &mut pods),
                "PaddleJob" => paddle_job_pods(job, item, &mut pods),
                _ => {}
            }
        }
        pods
    }

    /// The host directory a pod's volume `volume` is: a shared one, or the pod's own (an
    /// ephemeral claim's or an `emptyDir`).
    fn volume_dir(&self, pod: &Pod, volume: &str) -> PathBuf {
        let volumes = pod.spec["volumes"].as_array().unwrap();
        let source = volumes.iter().find(|v| v["name"] == volume).unwrap();
        let key = match (
            source["configMap"]["name"].as_str(),
            source["persistentVolumeClaim"]["claimName"].as_str(),
        ) {
            (Some(map), _) => format!("configMap/{map}"),
            (_, Some(claim)) => format!("claim/{claim}"),
            _ if source["ephemeral"].is_object() || source["emptyDir"].is_object() => {
                let own = self.dir.path().join("pods").join(&pod.name).join(volume);
                std::fs::create_dir_all(&own).unwrap();
                return own;
            }
            _ => panic!("a volume this test does not provide: {source}"),
        };
        self.volumes[&key].clone()
    }

    /// The host path of `path` inside the pods (under one of their mounts).
    pub fn host_path(&self, pod: &Pod, path: &str) -> PathBuf {
        let mounts = pod.spec["containers"][0]["volumeMounts"].as_array().unwrap();
        for mount in mounts {
            let inside = mount["mountPath"].as_str().unwrap();
            if let Ok(rest) = Path::new(path).strip_prefix(inside) {
                return self.volume_dir(pod, mount["name"].as_str().unwrap()).join(rest);
            }
        }
        panic!("{path} is on no volume of pod {}", pod.name);
    }

    /// Starts every pod, pod `i` on host `i`, and waits for them all.
    pub fn run(&mut self, pods: &[Pod], hosts: &Hosts) -> Vec<Finished> {
        let names: String = pods
            .iter()
            .zip(&hosts.ips)
            .map(|(pod, ip)| match &pod.subdomain {
                Some(subdomain) => format!("{ip} {}.{subdomain} {}\n", pod.name, pod.name),
                None => format!("{ip} {}\n", pod.name),
            })
            .collect();
        let started: Vec<common::Started> = pods
            .iter()
            .zip(&hosts.names)
            .map(|(pod, netns)| {
                // `ip netns exec` puts /etc/netns/NAME/hosts in the place of /etc/hosts.
                let netns_dir = PathBuf::from("/etc/netns").join(netns);
                std::fs::create_dir_all(&netns_dir).unwrap();
                std::fs::write(netns_dir.join("hosts"), format!("127.0.0.1 localhost\n{names}")).unwrap();
                self.netns_dirs.push(netns_dir);
                self.start(pod, netns)
            })
            .collect();
        let pids: Vec<i32> = started.iter().flat_map(|pod| children_of(pod.child.id())).collect();
        let finished = started.into_iter().map(|pod| pod.finish(240)).collect();
        end_leftovers(pids);
        finished
    }

    /// Starts `pod` in the network namespace `netns`: its volumes bind-mounted where it mounts
    /// them (in the namespace's own mount table), its command with exactly its environment, in
    /// its working directory.
    fn start(&mut self, pod: &Pod, netns: &str) -> common::Started {
        let container = &pod.spec["containers"][0];
        // Mounts under /tmp (the pod's scratch volume) go last: they cover whatever this
        // machine holds there.
        let (mut mounts, mut scratch) = (String::new(), String::new());
        for mount in container["volumeMounts"].as_array().unwrap() {
            let inside = PathBuf::from(mount["mountPath"].as_str().unwrap());
            if !inside.exists() {
                std::fs::create_dir_all(&inside).unwrap();
                self.made.push(inside.clone());
            }
            let source = self.volume_dir(pod, mount["name"].as_str().unwrap());
            let bind = format!("mount --bind '{}' '{}' && ", source.display(), inside.display());
            match inside.starts_with("/tmp") {
                true => scratch += &bind,
                false => mounts += &bind,
            }
        }
        // A build checked out under /tmp would vanish under the scratch volume with the binary
        // and every volume's directory: its target directory is bound to a stash outside /tmp
        // first and bound back over the scratch volume last.
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap();
        if !scratch.is_empty() && target.starts_with("/tmp") {
            let stash = PathBuf::from(format!("/run/flotilla-kubelet-{}", std::process::id()));
            if !stash.exists() {
                std::fs::create_dir_all(&stash).unwrap();
                self.made.push(stash.clone());
            }
            let (target, stash) = (target.display(), stash.display());
            mounts = format!(
                "mount --bind '{target}' '{stash}' && {mounts}{scratch}mkdir -p '{target}' && \
                 mount --bind '{stash}' '{target}' && "
            );
        } else {
            mounts += &scratch;
        }
        let env = environment(pod, container);
        let mut args = vec![
            "netns".to_string(),
            "exec".into(),
            netns.into(),
            "sh".into(),
            "-c".into(),
            format!("{mounts}cd {} && exec env -i \"$@\"", container["workingDir"]),
            pod.name.clone(),
        ];
        args.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
        // The image's `flotilla` is this build's.
        assert_eq!(container["command"], json!(["flotilla"]));
        args.push(env!("CARGO_BIN_EXE_flotilla").into());
        for arg in container["args"].as_array().unwrap() {
            args.push(expand(arg.as_str().unwrap(), &env));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::start_program("ip", &args, &[])
    }
}

/// The pods the Job controller makes of the Indexed Job `item`.
fn indexed_job_pods(job: &str, item: &Value, pods: &mut Vec<Pod>) {
    assert_eq!(item["spec"]["completionMode"], "Indexed");
    let spec = &item["spec"]["template"]["spec"];
    for index in 0..item["spec"]["completions"].as_u64().unwrap() as usize {
        pods.push(Pod {
            name: format!("{job}-{index}"),
            index,
            subdomain: Some(spec["subdomain"].as_str().unwrap().to_string()),
            spec: spec.clone(),
            operator_env: Vec::new(),
        });
    }
}

/// The pods Kubeflow's training operator makes of the PyTorchJob `item`.
fn pytorch_job_pods(job: &str, item: &Value, pods: &mut Vec<Pod>) {
    let specs = &item["spec"]["pytorchReplicaSpecs"];
    let per_node: usize = item["spec"]["nprocPerNode"].as_str().unwrap().parse().unwrap();
    let replicas = |kind: &str| specs[kind]["replicas"].as_u64().unwrap_or(0) as usize;
    let nodes = replicas("Master") + replicas("Worker");
    let master = &specs["Master"]["template"]["spec"];
    let ports = master["containers"][0]["ports"].as_array().unwrap();
    let port = ports.iter().find(|p| p["name"] == "pytorchjob-port").unwrap()["containerPort"].clone();
    for (kind, first_rank) in [("Master", 0), ("Worker", 1)] {
        for index in 0..replicas(kind) {
            let rank = (first_rank + index).to_string();
            pods.push(Pod {
                name: format!("{job}-{}-{index}", kind.to_lowercase()),
                index,
                subdomain: None,
                spec: specs[kind]["template"]["spec"].clone(),
                operator_env: [
                    ("PYTHONUNBUFFERED", "1".to_string()),
                    ("MASTER_PORT", port.to_string()),
                    ("MASTER_ADDR", format!("{job}-master-0")),
                    ("WORLD_SIZE", (nodes * per_node).to_string()),
                    ("RANK", rank.clone()),
                    ("PET_NODE_RANK", rank),
                    ("PET_NPROC_PER_NODE", per_node.to_string()),
                    ("PET_NNODES", nodes.to_string()),
                ]
                .map(|(k, v)| (k.to_string(), v))
                .to_vec(),
            });
        }
    }
}

/// The pods Paddle's operator makes of the PaddleJob `item`.
fn paddle_job_pods(job: &str, item: &Value, pods: &mut Vec<Pod>) {
    assert_eq!(item["spec"]["intranet"], "Service");
    let endpoints = |role: &str| -> Vec<String> {
        let count = item["spec"][role]["replicas"].as_u64().unwrap_or(0);
        (0..count).map(|i| format!("{job}-{role}-{i}:36000")).collect()
    };
    // The operator's ConfigMap of the job (named as the job), read through envFrom.
    let mut shared = vec![
        ("TRAINER_PORTS_NUM".to_string(), "20".to_string()),
        ("PADDLE_PORT".to_string(), "41234".to_string()),
        ("PADDLE_TRAINER_ENDPOINTS".to_string(), endpoints("worker").join(",")),
        ("PADDLE_TRAINERS_NUM".to_string(), endpoints("worker").len().to_string()),
    ];
    if !item["spec"]["ps"].is_null() {
        shared.push(("PADDLE_PSERVERS_IP_PORT_LIST".to_string(), endpoints("ps").join(",")));
    }
    for (role, training_role) in [("ps", "PSERVER"), ("worker", "TRAINER")] {
        let Some(count) = item["spec"][role]["replicas"].as_u64() else {
            continue;
        };
        for index in 0..count as usize {
            let name = format!("{job}-{role}-{index}");
            let mut operator_env: Vec<(String, String)> = [
                ("POD_IP", name.clone()),
                ("PADDLE_TRAINER_ID", index.to_string()),
                ("TRAINING_ROLE", training_role.to_string()),
                ("PADDLE_TRAINING_ROLE", training_role.to_string()),
            ]
            .map(|(k, v)| (k.to_string(), v))
            .to_vec();
            operator_env.extend(shared.iter().cloned());
            pods.push(Pod {
                name,
                index,
                subdomain: None,
                spec: item["spec"][role]["template"]["spec"].clone(),
                operator_env,
            });
        }
    }
}

/// The environment the kubelet gives `pod`'s `container`: its variables in order (each may
/// use the ones before), the Job's index and the pod's host name.
fn environment(pod: &Pod, container: &Value) -> Vec<(String, String)> {
    let mut env = vec![
        ("JOB_COMPLETION_INDEX".to_string(), pod.index.to_string()),
        ("HOSTNAME".to_string(), pod.name.clone()),
    ];
    for var in container["env"].as_array().unwrap() {
        let name = var["name"].as_str().unwrap().to_string();
        let value = match (&var["value"], &var["valueFrom"]) {
            (Value::String(value), _) => expand(value, &env),
            (_, from)
                if from["fieldRef"]["fieldPath"]
                    == "metadata.annotations['batch.kubernetes.io/job-completion-index']" =>
            {
                pod.index.to_string()
            }
            (_, from) if from["secretKeyRef"]["name"] == "job-token" && from["secretKeyRef"]["key"] == "token" => {
                common::TEST_TOKEN.to_string()
            }
            _ => panic!("a variable this test does not provide: {var}"),
        };
        env.push((name, value));
    }
    env.extend(pod.operator_env.iter().cloned());
    env
}

/// `text` with every `$(VAR)` of `env` replaced, as the kubelet does.
fn expand(text: &str, env: &[(String, String)]) -> String {
    env.iter().fold(text.to_string(), |text, (name, value)| {
        text.replace(&format!("$({name})"), value)
    })
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for dir in self.netns_dirs.iter().chain(&self.made) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
