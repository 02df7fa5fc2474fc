//! Environment-variable overrides, for compatibility with the launchers people use: Paddle's
//! (`python -m paddle.distributed.launch`), which describes the job to each trainer through
//! `PADDLE_*` variables, and torchrun's (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `TORCHELASTIC_RUN_ID`). Where both families are set they must agree.
//!
//! Each variable is parsed into a TOML value and written into the config table before
//! deserialization, so it goes through exactly the same type checks and validation as the file.
//! Unset or empty (all-whitespace) variables are ignored. Parse errors name the variable
//! (`environment: PADDLE_TRAINERS_NUM: ...`); later errors about a key a variable wrote are
//! attributed to `environment (VAR)`.

use toml::{Table, Value};

use super::{set_path, ConfigError, Provenance};

/// Source name of errors in parsing an environment variable.
const ENV_SOURCE: &str = "environment";

/// How a variable's text becomes a TOML value.
#[derive(Debug, Clone, Copy)]
enum Parse {
    /// A decimal integer.
    Integer,
    /// The text as is.
    Text,
    /// Comma-separated strings (blank items dropped).
    List,
    /// A size in MiB: a plain number of MiB or a number with an `MB` / `GB` suffix.
    SizeMb,
}

/// Which launcher's contract a variable belongs to: two variables of different families that
/// set one key must agree (within a family, the later one is an alias and wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Paddle,
    Torchrun,
    Flotilla,
}

/// One variable and the config key it overrides.
#[derive(Debug, Clone, Copy)]
struct EnvOverride {
    var: &'static str,
    key: &'static [&'static str],
    parse: Parse,
    family: Family,
}

/// Every environment override, applied in this order.
const ENV_OVERRIDES: &[EnvOverride] = &[
    EnvOverride {
        var: "PADDLE_TRAINERS_NUM",
        key: &["cluster", "world_size"],
        family: Family::Paddle,
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "PADDLE_NNODES",
        key: &["cluster", "nnodes"],
        family: Family::Paddle,
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "FLOTILLA_MIN_NNODES",
        key: &["cluster", "min_nnodes"],
        family: Family::Flotilla,
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "PADDLE_LOCAL_SIZE",
        key: &["cluster", "nproc_per_node"],
        family: Family::Paddle,
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "PADDLE_TRAINER_ENDPOINTS",
        key: &["cluster", "endpoints"],
        family: Family::Paddle,
        parse: Parse::List,
    },
    EnvOverride {
        var: "PADDLE_PSERVER_ENDPOINTS",
        key: &["cluster", "pservers"],
        family: Family::Paddle,
        parse: Parse::List,
    },
    // After PADDLE_PSERVER_ENDPOINTS, so Paddle's primary name wins when both are set.
    EnvOverride {
        var: "PADDLE_PSERVERS_IP_PORT_LIST",
        key: &["cluster", "pservers"],
        family: Family::Paddle,
        parse: Parse::List,
    },
    EnvOverride {
        var: "PADDLE_MASTER",
        key: &["cluster", "master"],
        family: Family::Paddle,
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLOTILLA_TOKEN",
        key: &["cluster", "token"],
        family: Family::Flotilla,
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLOTILLA_JOB_ID",
        key: &["cluster", "job_id"],
        family: Family::Flotilla,
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLOTILLA_DEVICE",
        key: &["cluster", "device"],
        family: Family::Flotilla,
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLAGS_fuse_parameter_groups_size",
        key: &["strategy", "fuse_grad_size_in_MB"],
        family: Family::Paddle,
        parse: Parse::SizeMb,
    },
    EnvOverride {
        var: "WORLD_SIZE",
        key: &["cluster", "world_size"],
        family: Family::Torchrun,
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "LOCAL_WORLD_SIZE",
        key: &["cluster", "nproc_per_node"],
        family: Family::Torchrun,
        parse: Parse::Integer,
    },
];

/// A config key one variable (or two, torchrun's master) sets.
struct Setting {
    key: &'static [&'static str],
    family: Family,
    var: String,
    value: Value,
}

/// Writes every set variable of [`ENV_OVERRIDES`] into `table`, recording it in `provenance`.
pub(super) fn apply(
    table: &mut Table,
    env: &dyn Fn(&str) -> Option<String>,
    provenance: &mut Provenance,
) -> Result<(), ConfigError> {
    let mut server_list = None;
    let master = torchrun_master(env)?;
    let run_id = torchrun_run_id(env);
    let settings = ENV_OVERRIDES
        .iter()
        .filter_map(|entry| {
            let text = env(entry.var)?.trim().to_string();
            (!text.is_empty()).then_some((*entry, text))
        })
        .map(|(entry, text)| {
            Ok(Setting {
                key: entry.key,
                family: entry.family,
                var: entry.var.to_string(),
                value: parse(entry.parse, &text).map_err(|message| invalid(entry.var, message))?,
            })
        })
        .chain(master.map(Ok))
        .chain(run_id.map(Ok))
        .collect::<Result<Vec<_>, ConfigError>>()?;
    // What each key was set to, and by which variable, to check the other family against.
    let mut set_by: Vec<Setting> = Vec::new();
    for setting in settings {
        let Setting { key, var, value, .. } = &setting;
        let other = set_by.iter().find(|s| s.key == *key && s.family != setting.family);
        if let Some(earlier) = other.filter(|earlier| earlier.value != *value) {
            return Err(invalid(
                var,
                format!(
                    "{value} contradicts {} = {} (both set {})",
                    earlier.var,
                    earlier.value,
                    key.join(".")
                ),
            ));
        }
        if let (["cluster", "pservers"], Value::Array(list)) = (*key, value) {
            server_list = Some((var.clone(), list.len()));
        }
        set_path(table, key, value.clone()).map_err(|message| invalid(var, message))?;
        provenance.record(key.join("."), format!("{ENV_SOURCE} ({var})"));
        set_by.push(setting);
    }
    // The launcher's server list also says how many servers the job has, as its trainer count
    // says how many trainers.
    nodes_from_torchrun_sizes(table, &set_by, provenance)?;
    if let Some((var, servers)) = server_list {
        let key = ["cluster", "server_num"];
        set_path(table, &key, Value::Integer(servers as i64)).map_err(|message| invalid(&var, message))?;
        provenance.record(key.join("."), format!("{ENV_SOURCE} ({var})"));
    }
    Ok(())
}

/// torchrun says how many ranks there are and how many run on each node, not how many nodes:
/// that is their quotient (`cluster.nnodes`), unless a variable set it.
fn nodes_from_torchrun_sizes(
    table: &mut Table,
    set_by: &[Setting],
    provenance: &mut Provenance,
) -> Result<(), ConfigError> {
    let torchrun = |key: &[&str]| {
        set_by
            .iter()
            .find(|s| s.key == key && s.family == Family::Torchrun)
            .and_then(|s| s.value.as_integer())
    };
    let nodes_given = set_by.iter().any(|s| s.key == ["cluster", "nnodes"]);
    let (Some(world), Some(local), false) = (
        torchrun(&["cluster", "world_size"]),
        torchrun(&["cluster", "nproc_per_node"]),
        nodes_given,
    ) else {
        return Ok(());
    };
    if local <= 0 || world % local != 0 {
        return Err(invalid(
            "LOCAL_WORLD_SIZE",
            format!("{local} does not divide WORLD_SIZE = {world}: every node runs as many ranks"),
        ));
    }
    let key = ["cluster", "nnodes"];
    set_path(table, &key, Value::Integer(world / local)).map_err(|message| invalid("WORLD_SIZE", message))?;
    provenance.record(key.join("."), format!("{ENV_SOURCE} (WORLD_SIZE / LOCAL_WORLD_SIZE)"));
    Ok(())
}

/// An error in variable `var`'s value.
fn invalid(var: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        source_name: ENV_SOURCE.to_string(),
        key: var.to_string(),
        message,
    }
}

/// torchrun's `MASTER_ADDR` and `MASTER_PORT` as the coordinator's `cluster.master`: both, or
/// neither.
fn torchrun_master(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Setting>, ConfigError> {
    let read = |var: &str| env(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let (addr, port) = match (read("MASTER_ADDR"), read("MASTER_PORT")) {
        (None, None) => return Ok(None),
        (Some(addr), Some(port)) => (addr, port),
        (Some(_), None) => return Err(invalid("MASTER_ADDR", "is set without MASTER_PORT".to_string())),
        (None, Some(_)) => return Err(invalid("MASTER_PORT", "is set without MASTER_ADDR".to_string())),
    };
    let port: u16 = port
        .parse()
        .map_err(|_| invalid("MASTER_PORT", format!("expected a port number, found {port:?}")))?;
    let master = super::host_port(&addr, port);
    Ok(Some(Setting {
        key: &["cluster", "master"],
        family: Family::Torchrun,
        var: "MASTER_ADDR:MASTER_PORT".to_string(),
        value: Value::String(master),
    }))
}

/// torchrun's run id (`--rdzv-id`, a fresh one under `--standalone`) as the job's id: the same
/// on every node and across the agent's restarts, as a job id must be. `FLOTILLA_JOB_ID` wins
/// when set; the static rendezvous's default id, `none`, names no job.
fn torchrun_run_id(env: &dyn Fn(&str) -> Option<String>) -> Option<Setting> {
    let set = |var: &str| env(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    if set("FLOTILLA_JOB_ID").is_some() {
        return None;
    }
    let id = set("TORCHELASTIC_RUN_ID").filter(|id| id != "none")?;
    Some(Setting {
        key: &["cluster", "job_id"],
        family: Family::Torchrun,
        var: "TORCHELASTIC_RUN_ID".to_string(),
        value: Value::String(id),
    })
}

/// Converts a variable's (trimmed, non-empty) text according to `kind`.
fn parse(kind: Parse, text: &str) -> Result<Value, String> {
    match kind {
        Parse::Integer => text
            .parse::<i64>()
            .map(Value::Integer)
            .map_err(|_| format!("expected an integer, found {text:?}")),
        Parse::Text => Ok(Value::String(text.to_string())),
        Parse::List => Ok(Value::Array(
            text.split(',')
                .map(str::trim)
                .filter(|item| !item.is_empty())
                .map(|item| Value::String(item.to_string()))
                .collect(),
        )),
        Parse::SizeMb => parse_size_mb(text)
            .map(Value::Float)
            .ok_or_else(|| format!("expected a size like \"32\", \"32MB\" or \"1GB\", found {text:?}")),
    }
}

/// Parses `32`, `32MB`, `0.5MB`, `1GB` (suffix case-insensitive, optional space) into MiB.
fn parse_size_mb(text: &str) -> Option<f64> {
    let lower = text.to_ascii_lowercase();
    let (number, scale) = if let Some(n) = lower.strip_suffix("gb") {
        (n, 1024.0)
    } else if let Some(n) = lower.strip_suffix("mb") {
        (n, 1.0)
    } else {
        (lower.as_str(), 1.0)
    };
    let value = number.trim().parse::<f64>().ok()? * scale;
    value.is_finite().then_some(value)
}

#[cfg(test)]
mod tests {
    use super::parse_size_mb;
    use crate::config::tests::{err_text, load_with};

    const FOUR_NODES: &str = "[cluster]\nnnodes = 2\nnproc_per_node = 2\nworld_size = 4\n\
         endpoints = [\"10.0.0.1:1\", \"10.0.0.1:2\", \"10.0.0.2:1\", \"10.0.0.2:2\"]\n\
         [strategy]\nfuse_grad_size_in_MB = 16\n";

    #[test]
    fn size_suffixes() {
        assert_eq!(parse_size_mb("32"), Some(32.0));
        assert_eq!(parse_size_mb("32MB"), Some(32.0));
        assert_eq!(parse_size_mb("100MB"), Some(100.0));
        assert_eq!(parse_size_mb("0.5MB"), Some(0.5));
        assert_eq!(parse_size_mb("1GB"), Some(1024.0));
        assert_eq!(parse_size_mb("64 mb"), Some(64.0));
        assert_eq!(parse_size_mb("MB"), None);
        assert_eq!(parse_size_mb("12KB"), None);
        assert_eq!(parse_size_mb("inf"), None);
    }

    #[test]
    fn paddle_variables_override_the_file() {
        let config = load_with(
            FOUR_NODES,
            &[
                ("PADDLE_TRAINERS_NUM", "2"),
                ("PADDLE_NNODES", "1"),
                ("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:7001, 127.0.0.1:7002"),
                ("PADDLE_MASTER", "127.0.0.1:7000"),
                ("FLAGS_fuse_parameter_groups_size", "64MB"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(config.cluster.world_size, Some(2));
        assert_eq!(config.world_size(), 2);
        assert_eq!(
            config.cluster.endpoints,
            vec!["127.0.0.1:7001".to_string(), "127.0.0.1:7002".to_string()]
        );
        assert_eq!(config.cluster.master.as_deref(), Some("127.0.0.1:7000"));
        assert_eq!(config.strategy.fuse_grad_size_in_mb, 64.0);
    }

    #[test]
    fn parameter_server_launcher_variables() {
        let vars = [
            ("PADDLE_TRAINERS_NUM", "4"),
            ("PADDLE_PSERVERS_IP_PORT_LIST", "127.0.0.1:6170,127.0.0.1:6171"),
        ];
        let ctr = "[train]\nmodel = \"wide_deep\"\ndataset = \"criteo_synthetic\"\noptimizer = \"adam\"\n";
        let config = load_with(ctr, &vars, &[]).unwrap();
        assert_eq!(
            config.world_size(),
            4,
            "the trainer count alone sets the trainers per node"
        );
        assert_eq!(config.cluster.server_num, 2, "the server count follows the list");
        assert!(config.cluster.is_parameter_server());
        let config = load_with(&format!("[cluster]\nserver_num = 3\n{ctr}"), &vars, &[]).unwrap();
        assert_eq!(config.cluster.server_num, 2, "the launcher's list wins over the file");
        let msg = err_text(load_with(ctr, &vars, &["cluster.server_num=3"]));
        assert_eq!(
            msg,
            "environment (PADDLE_PSERVERS_IP_PORT_LIST): cluster.pservers: lists 2 parameter servers \
             but cluster.server_num = 3"
        );
        let config = load_with(ctr, &[("PADDLE_PSERVER_ENDPOINTS", "127.0.0.1:7000")], &[]).unwrap();
        assert_eq!(config.cluster.pservers, vec!["127.0.0.1:7000".to_string()]);
    }

    #[test]
    fn torchruns_variables_set_the_layout_and_the_coordinator() {
        let torchrun = [
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ];
        let config = load_with("", &torchrun, &[]).unwrap();
        assert_eq!((config.cluster.nnodes, config.cluster.nproc_per_node), (2, 2));
        assert_eq!(config.cluster.master.as_deref(), Some("node0:29500"));
        let config = load_with("", &[("MASTER_ADDR", "fd00::1"), ("MASTER_PORT", "1")], &[]).unwrap();
        assert_eq!(config.cluster.master.as_deref(), Some("[fd00::1]:1"));
        // The same job told by both families.
        let both = [
            &torchrun[..],
            &[("PADDLE_TRAINERS_NUM", "4"), ("PADDLE_MASTER", "node0:29500")],
        ]
        .concat();
        assert!(load_with("", &both, &[]).is_ok());
    }

    #[test]
    fn torchruns_run_id_is_the_job_id_unless_flotillas_names_one() {
        let agent = [("TORCHELASTIC_RUN_ID", "nightly-7")];
        let config = load_with("", &agent, &[]).unwrap();
        assert_eq!(config.cluster.job_id.as_deref(), Some("nightly-7"));
        let both = [agent[0], ("FLOTILLA_JOB_ID", "mine")];
        assert_eq!(
            load_with("", &both, &[]).unwrap().cluster.job_id.as_deref(),
            Some("mine")
        );
        let static_default = [("TORCHELASTIC_RUN_ID", "none")];
        assert_eq!(load_with("", &static_default, &[]).unwrap().cluster.job_id, None);
    }

    #[test]
    fn torchrun_and_paddle_variables_that_disagree_are_named() {
        let msg = err_text(load_with("", &[("PADDLE_TRAINERS_NUM", "2"), ("WORLD_SIZE", "4")], &[]));
        assert_eq!(
            msg,
            "environment: WORLD_SIZE: 4 contradicts PADDLE_TRAINERS_NUM = 2 (both set cluster.world_size)"
        );
        let vars = [
            ("PADDLE_MASTER", "10.0.0.1:6170"),
            ("MASTER_ADDR", "10.0.0.2"),
            ("MASTER_PORT", "6170"),
        ];
        let msg = err_text(load_with("", &vars, &[]));
        assert!(
            msg.contains("MASTER_ADDR:MASTER_PORT: \"10.0.0.2:6170\" contradicts PADDLE_MASTER"),
            "{msg}"
        );
        let msg = err_text(load_with("", &[("MASTER_ADDR", "node0")], &[]));
        assert_eq!(msg, "environment: MASTER_ADDR: is set without MASTER_PORT");
        let msg = err_text(load_with("", &[("WORLD_SIZE", "5"), ("LOCAL_WORLD_SIZE", "2")], &[]));
        assert!(
            msg.contains("LOCAL_WORLD_SIZE: 2 does not divide WORLD_SIZE = 5"),
            "{msg}"
        );
    }

    #[test]
    fn empty_variables_are_ignored() {
        let config = load_with(FOUR_NODES, &[("PADDLE_TRAINERS_NUM", " ")], &[]).unwrap();
        assert_eq!(config.cluster.world_size, Some(4));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let msg = err_text(load_with("", &[("PADDLE_TRAINERS_NUM", "x")], &[]));
        assert_eq!(
            msg,
            "environment: PADDLE_TRAINERS_NUM: expected an integer, found \"x\""
        );
        let msg = err_text(load_with("", &[("FLAGS_fuse_parameter_groups_size", "lots")], &[]));
        assert!(
            msg.starts_with("environment: FLAGS_fuse_parameter_groups_size: expected a size"),
            "{msg}"
        );
    }

    #[test]
    fn later_errors_are_attributed_to_the_variable() {
        let msg = err_text(load_with(
            "",
            &[("PADDLE_TRAINERS_NUM", "3"), ("PADDLE_LOCAL_SIZE", "2")],
            &[],
        ));
        assert_eq!(
            msg,
            "environment (PADDLE_TRAINERS_NUM): cluster.world_size: 3 contradicts \
             cluster.nnodes × cluster.nproc_per_node = 1 × 2"
        );
        let msg = err_text(load_with("", &[("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:1,nope")], &[]));
        assert_eq!(
            msg,
            "environment (PADDLE_TRAINER_ENDPOINTS): cluster.endpoints[1]: \
             \"nope\" is not a host:port address"
        );
        let msg = err_text(load_with("", &[("PADDLE_NNODES", "-2")], &[]));
        assert!(
            msg.starts_with("environment (PADDLE_NNODES): cluster.nnodes: invalid value"),
            "{msg}"
        );
    }

    #[test]
    fn section_that_is_not_a_table_names_the_variable() {
        let msg = err_text(load_with("cluster = 1\n", &[("PADDLE_NNODES", "2")], &[]));
        assert!(msg.starts_with("environment: PADDLE_NNODES: cannot set"), "{msg}");
    }
}
