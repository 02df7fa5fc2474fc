//! `[cluster]`: the job's topology — how many nodes and processes, on which device, and where
//! the coordinator and the trainers listen.

use std::collections::HashMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::FieldError;

/// Compute device the trainers run on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host CPU.
    #[default]
    Cpu,
    /// One CUDA GPU per rank (`FLAGS_selected_gpus`, else the rank's place on its node); needs
    /// a build with the `cuda` feature. A build without it still parses the value, so its
    /// error can say how to get one rather than "unknown variant".
    Gpu,
}

/// Why `cluster.device = "gpu"` is rejected by a build without the `cuda` feature.
pub(crate) const GPU_NOT_BUILT: &str = "\"gpu\": built without CUDA support; rebuild with --features cuda";

/// Largest `cluster.max_frame_mb`: frames carry a 32-bit length, so none reaches 4 GiB.
const MAX_FRAME_MB: usize = 4095;

/// `[cluster]` section: the process layout of the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Number of machines (`PADDLE_NNODES`).
    pub nnodes: usize,
    /// Elastic membership: the fewest machines the job may go on with (`--nnodes MIN:MAX` sets
    /// it, and `nnodes` to MAX; `FLOTILLA_MIN_NNODES`). A machine lost for good is dropped once
    /// `fault_tolerance.elastic_timeout_s` passes without its replacement, and one that comes
    /// later is admitted at the next checkpoint. Unset, every machine must train.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_nnodes: Option<usize>,
    /// Trainer processes per machine (`PADDLE_LOCAL_SIZE`).
    pub nproc_per_node: usize,
    /// Total trainers (`PADDLE_TRAINERS_NUM`); redundant with `nnodes × nproc_per_node` and only
    /// accepted when equal, so a launcher and a file that disagree are caught before training.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub world_size: Option<usize>,
    /// Compute device (`FLOTILLA_DEVICE`; `flotilla launch --devices` sets `"gpu"`).
    pub device: DeviceKind,
    /// `host:port` of the coordinator (rendezvous) process (`PADDLE_MASTER`); `None` lets the
    /// launcher choose.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master: Option<String>,
    /// Data endpoints (`ip:port`) of the trainers, indexed by rank
    /// (`PADDLE_TRAINER_ENDPOINTS`). Empty means in-process or assigned by the launcher.
    pub endpoints: Vec<String>,
    /// Largest control frame accepted from a peer, in MiB; bounds memory a corrupt or hostile
    /// length prefix can make a process allocate.
    pub max_frame_mb: usize,
    /// When every rank is on one host, move ring traffic through shared memory (`/dev/shm`)
    /// instead of loopback TCP, sparing the kernel's two copies of every byte.
    pub shared_memory: bool,
    /// The secret every connection between roles proves it knows (HMAC handshake; at least 16
    /// characters). Also `FLOTILLA_TOKEN`; `flotilla launch` generates one when neither is set.
    /// Never written to the run directory's config.
    #[serde(skip_serializing)]
    pub token: Option<String>,
    /// Which job this process belongs to: every handshake proves it beside the token, so two
    /// jobs that share a token and a host never talk to each other. Also `FLOTILLA_JOB_ID`;
    /// `flotilla launch` (one node) and `launch-ps` generate one when neither is set; the nodes of
    /// a multi-node job share one. Not written to the run directory's config (a resumed run is a
    /// new job); its claim records it, to tell the job's own processes from another job's.
    #[serde(skip_serializing)]
    pub job_id: Option<String>,
    /// Parameter-server shards; `> 0` selects the parameter-server strategy (the trainers are
    /// then the `world_size` processes). 0 with `pservers` given means "as many as listed".
    pub server_num: usize,
    /// `ip:port` of every parameter-server shard, indexed by shard
    /// (`PADDLE_PSERVERS_IP_PORT_LIST` / `PADDLE_PSERVER_ENDPOINTS`). Empty means in-process.
    pub pservers: Vec<String>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            nnodes: 1,
            min_nnodes: None,
            nproc_per_node: 2,
            world_size: None,
            device: DeviceKind::Cpu,
            master: None,
            endpoints: Vec::new(),
            max_frame_mb: 1024,
            shared_memory: true,
            token: None,
            job_id: None,
            server_num: 0,
            pservers: Vec::new(),
        }
    }
}

impl ClusterConfig {
    /// Number of trainer processes, `nnodes × nproc_per_node` (saturating; validation rejects
    /// overflow).
    pub fn world_size(&self) -> usize {
        self.nnodes.saturating_mul(self.nproc_per_node)
    }

    /// Whether the job uses the parameter-server strategy.
    pub fn is_parameter_server(&self) -> bool {
        self.server_num > 0
    }

    /// Fills `server_num` in from the length of `pservers` when only the list was given.
    pub(crate) fn resolve_defaults(&mut self) {
        if self.server_num == 0 {
            self.server_num = self.pservers.len();
        }
    }

    /// [`ClusterConfig::max_frame_mb`] in bytes (saturating).
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_mb.saturating_mul(1 << 20)
    }

    /// Range and consistency checks of the section.
    pub(crate) fn check(&self) -> Result<(), FieldError> {
        self.check_node_counts()?;
        let world_size = self.checked_world_size()?;
        if self.device == DeviceKind::Gpu && !cfg!(feature = "cuda") {
            return Err(FieldError::new("cluster.device", GPU_NOT_BUILT));
        }
        self.check_addresses(world_size)?;
        if !(1..=MAX_FRAME_MB).contains(&self.max_frame_mb) {
            return Err(FieldError::new(
                "cluster.max_frame_mb",
                format!(
                    "must be in [1, {MAX_FRAME_MB}] MiB (a frame's length is a 32-bit number), got {}",
                    self.max_frame_mb
                ),
            ));
        }
        Ok(())
    }

    /// At least one node and one process a node; an elastic job's minimum within its nodes.
    fn check_node_counts(&self) -> Result<(), FieldError> {
        if self.nnodes == 0 {
            return Err(FieldError::new("cluster.nnodes", "must be at least 1, got 0"));
        }
        if self.nproc_per_node == 0 {
            return Err(FieldError::new("cluster.nproc_per_node", "must be at least 1, got 0"));
        }
        match self.min_nnodes {
            Some(0) => Err(FieldError::new("cluster.min_nnodes", "must be at least 1, got 0")),
            Some(min) if min > self.nnodes => Err(FieldError::new(
                "cluster.min_nnodes",
                format!(
                    "{min} is more than cluster.nnodes = {} (--nnodes MIN:MAX needs MIN <= MAX)",
                    self.nnodes
                ),
            )),
            _ => Ok(()),
        }
    }

    /// `nnodes × nproc_per_node`, when it does not overflow and agrees with a given
    /// `world_size`.
    fn checked_world_size(&self) -> Result<usize, FieldError> {
        let Some(product) = self.nnodes.checked_mul(self.nproc_per_node) else {
            return Err(FieldError::new(
                "cluster.nproc_per_node",
                format!(
                    "cluster.nnodes × cluster.nproc_per_node = {} × {} overflows",
                    self.nnodes, self.nproc_per_node
                ),
            ));
        };
        if let Some(world_size) = self.world_size {
            if world_size != product {
                return Err(FieldError::new(
                    "cluster.world_size",
                    format!(
                        "{world_size} contradicts cluster.nnodes × cluster.nproc_per_node = {} × {}",
                        self.nnodes, self.nproc_per_node
                    ),
                ));
            }
        }
        Ok(product)
    }

    /// The master, trainer and parameter-server addresses are `host:port`s, and the lists
    /// have one entry per trainer and per server.
    fn check_addresses(&self, world_size: usize) -> Result<(), FieldError> {
        if let Some(master) = &self.master {
            check_host_port(master).map_err(|why| FieldError::new("cluster.master", why))?;
        }
        check_address_list("cluster.endpoints", &self.endpoints)?;
        if !self.endpoints.is_empty() && self.endpoints.len() != world_size {
            return Err(FieldError::new(
                "cluster.endpoints",
                format!(
                    "has {} entries but the world size is {world_size} \
                     (cluster.nnodes × cluster.nproc_per_node = {} × {})",
                    self.endpoints.len(),
                    self.nnodes,
                    self.nproc_per_node
                ),
            ));
        }
        check_address_list("cluster.pservers", &self.pservers)?;
        if !self.pservers.is_empty() && self.pservers.len() != self.server_num {
            return Err(FieldError::new(
                "cluster.pservers",
                format!(
                    "lists {} parameter servers but cluster.server_num = {}",
                    self.pservers.len(),
                    self.server_num
                ),
            ));
        }
        Ok(())
    }
}

/// `address` in one spelling (an IP address's canonical one), if it is a `host:port`.
fn parse_host_port(address: &str) -> Option<String> {
    if let Ok(addr) = address.parse::<SocketAddr>() {
        return Some(addr.to_string());
    }
    let (host, port) = address.rsplit_once(':')?;
    let name = |label: &str| {
        !label.is_empty() && !label.starts_with('-') && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    };
    (port.parse::<u16>().is_ok() && host.split('.').all(name)).then(|| address.to_ascii_lowercase())
}

/// Every entry of the list at `key` must be a distinct `host:port`: an IP address, or a name
/// that DNS resolves (a Kubernetes pod's `POD.SERVICE`).
fn check_address_list(key: &str, addresses: &[String]) -> Result<(), FieldError> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, address) in addresses.iter().enumerate() {
        let entry = format!("{key}[{i}]");
        let address = address.trim();
        let addr = parse_host_port(address)
            .ok_or_else(|| FieldError::new(&entry, format!("{address:?} is not a host:port address")))?;
        if let Some(first) = seen.insert(addr, i) {
            return Err(FieldError::new(entry, format!("{address:?} duplicates {key}[{first}]")));
        }
    }
    Ok(())
}

/// Accepts `host:port` with a non-empty host (IP or name) and a numeric port; the coordinator
/// may be given by host name, unlike trainer endpoints.
/// `host:port`, an IPv6 address bracketed before its port (`[fd00::1]:29500`).
pub fn host_port(host: &str, port: u16) -> String {
    match host.contains(':') && !host.starts_with('[') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

fn check_host_port(text: &str) -> Result<(), String> {
    if text.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let valid = text
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if valid {
        Ok(())
    } else {
        Err(format!("{text:?} is not a host:port address"))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_str, load_with};
    use crate::config::DeviceKind;

    #[test]
    fn world_size_contradiction_names_both_sides() {
        let msg = err_text(load_str("[cluster]\nworld_size = 3\nnnodes = 1\n"));
        assert_eq!(
            msg,
            "config.toml: cluster.world_size: 3 contradicts \
             cluster.nnodes × cluster.nproc_per_node = 1 × 2"
        );
        let config = load_str("[cluster]\nworld_size = 4\nnnodes = 2\n").unwrap();
        assert_eq!(config.world_size(), 4);
    }

    #[test]
    fn zero_processes_rejected() {
        let msg = err_text(load_str("[cluster]\nnnodes = 0\n"));
        assert!(msg.starts_with("config.toml: cluster.nnodes: "), "{msg}");
        let msg = err_text(load_str("[cluster]\nnproc_per_node = 0\n"));
        assert!(msg.starts_with("config.toml: cluster.nproc_per_node: "), "{msg}");
        for frame in [0, 4096] {
            let msg = err_text(load_str(&format!("[cluster]\nmax_frame_mb = {frame}\n")));
            assert!(
                msg.starts_with("config.toml: cluster.max_frame_mb: must be in [1, 4095] MiB"),
                "{msg}"
            );
        }
    }

    #[test]
    fn endpoint_that_is_not_ip_port_is_rejected_by_index() {
        let msg = err_text(load_str("[cluster]\nendpoints = [\"127.0.0.1:7001\", \"localhost\"]\n"));
        assert_eq!(
            msg,
            "config.toml: cluster.endpoints[1]: \"localhost\" is not a host:port address"
        );
    }

    #[test]
    fn endpoint_count_must_match_world_size() {
        let msg = err_text(load_str("[cluster]\nendpoints = [\"127.0.0.1:7001\"]\n"));
        assert!(
            msg.starts_with("config.toml: cluster.endpoints: has 1 entries but the world size is 2"),
            "{msg}"
        );
        let msg = err_text(load_str(
            "[cluster]\nendpoints = [\"127.0.0.1:7001\", \"127.0.0.1:7001\"]\n",
        ));
        assert!(
            msg.contains("cluster.endpoints[1]: \"127.0.0.1:7001\" duplicates cluster.endpoints[0]"),
            "{msg}"
        );
        let config = load_str("[cluster]\nendpoints = [\"127.0.0.1:7001\", \"[::1]:7002\"]\n").unwrap();
        assert_eq!(config.cluster.endpoints.len(), 2);
    }

    #[test]
    fn gpu_device_needs_a_cuda_build() {
        // From the file, and from the variable a launcher given `--devices` sets.
        for (loaded, source) in [
            (load_str("[cluster]\ndevice = \"gpu\"\n"), "config.toml"),
            (
                load_with("[cluster]\ndevice = \"cpu\"\n", &[("FLOTILLA_DEVICE", "gpu")], &[]),
                "environment (FLOTILLA_DEVICE)",
            ),
        ] {
            if cfg!(feature = "cuda") {
                assert_eq!(loaded.unwrap().cluster.device, DeviceKind::Gpu);
            } else {
                assert_eq!(
                    err_text(loaded),
                    format!(
                        "{source}: cluster.device: \"gpu\": built without CUDA support; rebuild with --features cuda"
                    )
                );
            }
        }
        let msg = err_text(load_str("[cluster]\ndevice = \"tpu\"\n"));
        assert!(
            msg.starts_with("config.toml: cluster.device: unknown variant `tpu`"),
            "{msg}"
        );
    }

    #[test]
    fn master_must_be_host_port() {
        let config = load_str("[cluster]\nmaster = \"node0:6170\"\n").unwrap();
        assert_eq!(config.cluster.master.as_deref(), Some("node0:6170"));
        let msg = err_text(load_with("", &[("PADDLE_MASTER", "node0")], &[]));
        assert_eq!(
            msg,
            "environment (PADDLE_MASTER): cluster.master: \"node0\" is not a host:port address"
        );
    }
}
