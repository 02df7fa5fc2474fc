//! Environment-variable overrides, for compatibility with the Paddle launcher
//! (`python -m paddle.distributed.launch`), which describes the job to each trainer through
//! `PADDLE_*` variables.
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

/// One variable and the config key it overrides.
#[derive(Debug, Clone, Copy)]
struct EnvOverride {
    var: &'static str,
    key: &'static [&'static str],
    parse: Parse,
}

/// Every environment override, applied in this order.
const ENV_OVERRIDES: &[EnvOverride] = &[
    EnvOverride {
        var: "PADDLE_TRAINERS_NUM",
        key: &["cluster", "world_size"],
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "PADDLE_NNODES",
        key: &["cluster", "nnodes"],
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "PADDLE_LOCAL_SIZE",
        key: &["cluster", "nproc_per_node"],
        parse: Parse::Integer,
    },
    EnvOverride {
        var: "PADDLE_TRAINER_ENDPOINTS",
        key: &["cluster", "endpoints"],
        parse: Parse::List,
    },
    EnvOverride {
        var: "PADDLE_PSERVER_ENDPOINTS",
        key: &["cluster", "pservers"],
        parse: Parse::List,
    },
    // After PADDLE_PSERVER_ENDPOINTS, so Paddle's primary name wins when both are set.
    EnvOverride {
        var: "PADDLE_PSERVERS_IP_PORT_LIST",
        key: &["cluster", "pservers"],
        parse: Parse::List,
    },
    EnvOverride {
        var: "PADDLE_MASTER",
        key: &["cluster", "master"],
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLOTILLA_TOKEN",
        key: &["cluster", "token"],
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLOTILLA_JOB_ID",
        key: &["cluster", "job_id"],
        parse: Parse::Text,
    },
    EnvOverride {
        var: "FLAGS_fuse_parameter_groups_size",
        key: &["strategy", "fuse_grad_size_in_MB"],
        parse: Parse::SizeMb,
    },
];

/// Writes every set variable of [`ENV_OVERRIDES`] into `table`, recording it in `provenance`.
pub(super) fn apply(
    table: &mut Table,
    env: &dyn Fn(&str) -> Option<String>,
    provenance: &mut Provenance,
) -> Result<(), ConfigError> {
    let mut server_list = None;
    for entry in ENV_OVERRIDES {
        let Some(raw) = env(entry.var) else {
            continue;
        };
        let text = raw.trim();
        if text.is_empty() {
            continue;
        }
        let error = |message: String| ConfigError::Invalid {
            source_name: ENV_SOURCE.to_string(),
            key: entry.var.to_string(),
            message,
        };
        let value = parse(entry.parse, text).map_err(error)?;
        if let (["cluster", "pservers"], Value::Array(list)) = (entry.key, &value) {
            server_list = Some((entry.var, list.len()));
        }
        set_path(table, entry.key, value).map_err(error)?;
        provenance.record(entry.key.join("."), format!("{ENV_SOURCE} ({})", entry.var));
    }
    // The launcher's server list also says how many servers the job has, as its trainer count
    // says how many trainers.
    if let Some((var, servers)) = server_list {
        let key = ["cluster", "server_num"];
        set_path(table, &key, Value::Integer(servers as i64)).map_err(|message| ConfigError::Invalid {
            source_name: ENV_SOURCE.to_string(),
            key: var.to_string(),
            message,
        })?;
        provenance.record(key.join("."), format!("{ENV_SOURCE} ({var})"));
    }
    Ok(())
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
             \"nope\" is not an ip:port address"
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
