//! Reading a config document: the file's text (bounded), the TOML parsed with positions, the
//! environment and `--set` written into the table, keys not built yet refused, the table
//! deserialized with every error naming its dotted key, and the defaults that depend on other
//! keys.

use std::path::Path;

use toml::{Table, Value};

use super::provenance::Provenance;
use super::{env, overrides, ConfigError, JobConfig, MAX_CONFIG_BYTES, ROOT_KEY};

/// The text of the config file at `path`, at most [`MAX_CONFIG_BYTES`] of it: one past that is
/// an error rather than a read without end.
pub(super) fn read_config_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!(
                "more than {} MiB; a config file is at most that",
                MAX_CONFIG_BYTES >> 20
            ),
        ));
    }
    Ok(text)
}

/// The whole pipeline after the file has been parsed: env, `--set`, unsupported keys,
/// deserialization, defaults that depend on other keys, validation.
pub(super) fn load(
    mut table: Table,
    source_name: &str,
    env: &dyn Fn(&str) -> Option<String>,
    overrides: &[String],
) -> Result<JobConfig, ConfigError> {
    let mut provenance = Provenance::new(source_name);
    env::apply(&mut table, env, &mut provenance)?;
    overrides::apply(&mut table, overrides, &mut provenance)?;
    trainers_from_world_size(&mut table, &mut provenance);
    let mut config = deserialize(table, &provenance)?;
    config.source_name = source_name.to_string();
    config.cluster.resolve_defaults();
    config.train.resolve_defaults();
    config.train.resolve_data_parts(config.world_size());
    config.check().map_err(|e| {
        let key = provenance.named_key(&e);
        provenance.error(key, e.message)
    })?;
    Ok(config)
}

/// A world size given alone (as a parameter-server launcher gives `PADDLE_TRAINERS_NUM`) says how
/// many trainers there are: it sets `cluster.nproc_per_node` (to world size / `cluster.nnodes`)
/// when neither layout key was given, or when `nproc_per_node` was given by a source the world
/// size outranks (the file, under an environment variable or `--set`), instead of contradicting
/// it.
fn trainers_from_world_size(table: &mut Table, provenance: &mut Provenance) {
    let Some(Value::Table(cluster)) = table.get_mut("cluster") else {
        return;
    };
    let Some(world_size) = cluster.get("world_size").and_then(Value::as_integer) else {
        return;
    };
    let replaces = if cluster.contains_key("nproc_per_node") {
        provenance.precedence("cluster.world_size") > provenance.precedence("cluster.nproc_per_node")
    } else {
        !cluster.contains_key("nnodes")
    };
    if !replaces {
        return;
    }
    let nnodes = match cluster.get("nnodes") {
        Some(value) => value.as_integer().unwrap_or(0),
        None => 1,
    };
    if nnodes <= 0 || world_size % nnodes != 0 {
        return;
    }
    let nproc = world_size / nnodes;
    let source = provenance.source_of("cluster.world_size").to_string();
    if let Some(replaced) = cluster.get("nproc_per_node").and_then(Value::as_integer) {
        if replaced != nproc {
            tracing::warn!(
                "cluster.world_size = {world_size} ({source}) sets cluster.nproc_per_node to {nproc} over {replaced} \
                 ({}): a world size given by a source of higher precedence says how many trainers there are",
                provenance.source_of("cluster.nproc_per_node")
            );
        }
    }
    cluster.insert("nproc_per_node".to_string(), Value::Integer(nproc));
    provenance.record("cluster.nproc_per_node".to_string(), source);
}

/// Parses TOML text, turning syntax errors into a [`ConfigError`] with line and column.
pub(super) fn parse_document(text: &str, source_name: &str) -> Result<Table, ConfigError> {
    text.parse::<Table>().map_err(|err| {
        let key = match err.span() {
            Some(span) => {
                let (line, column) = line_column(text, span.start);
                format!("line {line}, column {column}")
            }
            None => ROOT_KEY.to_string(),
        };
        ConfigError::Invalid {
            source_name: source_name.to_string(),
            key,
            message: format!("invalid TOML: {}", err.message().trim_end().replace('\n', "; ")),
        }
    })
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// Deserializes the merged table, naming the dotted key of the first error.
fn deserialize(table: Table, provenance: &Provenance) -> Result<JobConfig, ConfigError> {
    serde_path_to_error::deserialize(Value::Table(table)).map_err(|err| {
        let path = err.path().to_string();
        let message = err.into_inner().message().trim_end().to_string();
        // The error is attributed to whoever wrote the value at `path`; an unknown field is
        // reported at its enclosing table (`strategy: unknown field `x``, with serde's list of
        // the valid ones), but still attributed to whoever wrote the field itself.
        let key = match unknown_field_name(&message) {
            Some(field) if path == field => ROOT_KEY.to_string(),
            Some(field) => match path.strip_suffix(field).and_then(|p| p.strip_suffix('.')) {
                Some(parent) => parent.to_string(),
                None => display_path(&path),
            },
            None => display_path(&path),
        };
        ConfigError::Invalid {
            source_name: provenance.source_of(&path).to_string(),
            key,
            message,
        }
    })
}

/// `serde_path_to_error` prints the root path as `.`; give it a readable name.
pub(super) fn display_path(path: &str) -> String {
    if path.is_empty() || path == "." {
        ROOT_KEY.to_string()
    } else {
        path.to_string()
    }
}

/// The field name in serde's "unknown field `x`, expected ..." message, if it is one.
fn unknown_field_name(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("unknown field `")?;
    rest.split('`').next()
}

/// Writes `value` at the dotted `path` inside `table`, creating intermediate tables, so env and
/// `--set` overrides edit the document exactly like a file would.
pub(crate) fn set_path(table: &mut Table, path: &[&str], value: Value) -> Result<(), String> {
    let Some((last, parents)) = path.split_last() else {
        return Err("empty key".to_string());
    };
    let mut current = table;
    for (depth, segment) in parents.iter().enumerate() {
        let entry = current
            .entry(segment.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        current = match entry {
            Value::Table(inner) => inner,
            other => {
                return Err(format!(
                    "cannot set `{}`: `{}` is a {}, not a table",
                    path.join("."),
                    path[..=depth].join("."),
                    other.type_str()
                ))
            }
        };
    }
    current.insert(last.to_string(), value);
    Ok(())
}
