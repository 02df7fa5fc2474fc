//! The configuration reference, generated from the config structs themselves (their JSON schema,
//! which `schemars` derives from the types and their doc comments): every key with its type, its
//! default, what it does and the name PaddlePaddle gives the same setting. `flotilla config
//! --defaults` prints it as commented TOML, `flotilla config --reference` as the Markdown of
//! `docs/config.md` (a test keeps that file current).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use super::JobConfig;

/// PaddlePaddle's name for the keys that have one: `DistributedStrategy` fields, or the
/// launcher flag and environment variable of the same setting.
const PADDLE_NAMES: &[(&str, &str)] = &[
    ("cluster.nnodes", "`--nnodes`, `PADDLE_NNODES`"),
    ("cluster.nproc_per_node", "`--nproc_per_node`, `PADDLE_LOCAL_SIZE`"),
    ("cluster.master", "`--master`, `PADDLE_MASTER`"),
    ("cluster.endpoints", "`PADDLE_TRAINER_ENDPOINTS`"),
    ("cluster.device", "`--devices` / `FLAGS_selected_gpus`"),
    ("cluster.job_id", "`--job_id`"),
    ("cluster.server_num", "`--server_num`"),
    ("cluster.pservers", "`--servers`, `PADDLE_PSERVERS_IP_PORT_LIST`"),
    (
        "strategy.fuse_grad_size_in_MB",
        "`fuse_grad_size_in_MB`, `FLAGS_fuse_parameter_groups_size`",
    ),
    ("strategy.fp16_allreduce", "`fp16_allreduce`"),
    ("strategy.a_sync", "`a_sync`"),
    ("strategy.a_sync_configs.k_steps", "`a_sync_configs.k_steps`"),
    (
        "strategy.a_sync_configs.send_queue_size",
        "`a_sync_configs.send_queue_size`",
    ),
    (
        "strategy.a_sync_configs.max_merge_var_num",
        "`a_sync_configs.max_merge_var_num`",
    ),
    ("strategy.pipeline", "`pipeline`"),
    (
        "strategy.pipeline_configs.schedule_mode",
        "`pipeline_configs.schedule_mode`",
    ),
    (
        "strategy.pipeline_configs.accumulate_steps",
        "`pipeline_configs.accumulate_steps`",
    ),
    (
        "strategy.pipeline_configs.micro_batch_size",
        "`pipeline_configs.micro_batch_size`",
    ),
    (
        "strategy.pipeline_configs.pp_allreduce_in_optimize",
        "`pipeline_configs.pp_allreduce_in_optimize`",
    ),
    ("strategy.hybrid_configs.dp_degree", "`hybrid_configs.dp_degree`"),
    ("strategy.hybrid_configs.pp_degree", "`hybrid_configs.pp_degree`"),
    ("strategy.hybrid_configs.mp_degree", "`hybrid_configs.mp_degree`"),
    (
        "strategy.hybrid_configs.sharding_degree",
        "`hybrid_configs.sharding_degree`",
    ),
    ("strategy.sharding", "`sharding`"),
    ("strategy.sharding_configs.stage", "`sharding_configs.stage`"),
    ("strategy.recompute", "`recompute`"),
    (
        "strategy.recompute_configs.checkpoints",
        "`recompute_configs.checkpoints`",
    ),
    ("strategy.gradient_merge", "`gradient_merge`"),
    (
        "strategy.gradient_merge_configs.k_steps",
        "`gradient_merge_configs.k_steps`",
    ),
    ("strategy.gradient_merge_configs.avg", "`gradient_merge_configs.avg`"),
    ("strategy.use_hierarchical_allreduce", "`use_hierarchical_allreduce`"),
    ("strategy.amp", "`amp`"),
    ("strategy.amp_configs.use_bf16", "`amp_configs.use_bf16`"),
    ("strategy.amp_configs.use_pure_fp16", "`amp_configs.use_pure_fp16`"),
    (
        "strategy.amp_configs.custom_white_list",
        "`amp_configs.custom_white_list`",
    ),
    (
        "strategy.amp_configs.custom_black_list",
        "`amp_configs.custom_black_list`",
    ),
    (
        "strategy.amp_configs.init_loss_scaling",
        "`amp_configs.init_loss_scaling`",
    ),
    (
        "strategy.amp_configs.use_dynamic_loss_scaling",
        "`amp_configs.use_dynamic_loss_scaling`",
    ),
    (
        "strategy.sparse_table_configs.<name>.count_filter",
        "`CountFilterEntry`",
    ),
    ("strategy.sparse_table_configs.<name>.probability", "`ProbabilityEntry`"),
    (
        "strategy.sparse_table_configs.<name>.nonclk_coeff",
        "`ctr_accessor_param.nonclk_coeff`",
    ),
    (
        "strategy.sparse_table_configs.<name>.click_coeff",
        "`ctr_accessor_param.click_coeff`",
    ),
    (
        "strategy.sparse_table_configs.<name>.show_click_decay_rate",
        "`ctr_accessor_param.show_click_decay_rate`",
    ),
    (
        "strategy.sparse_table_configs.<name>.delete_threshold",
        "`ctr_accessor_param.delete_threshold`",
    ),
    (
        "strategy.sparse_table_configs.<name>.delete_after_unseen_days",
        "`ctr_accessor_param.delete_after_unseen_days`",
    ),
    ("fault_tolerance.max_restarts", "`--max_restart`"),
    ("fault_tolerance.elastic_timeout_s", "`--elastic_timeout`"),
];

/// The name standing for a user's name in the keys of a table of tables.
const NAMED: &str = "<name>";

/// One key of the configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// `section.key`, as `--set` and the TOML name it.
    pub key: String,
    /// Its type, or the values it takes.
    pub kind: String,
    /// Its default as TOML; `None` when unset by default.
    pub default: Option<String>,
    /// What it does: the field's doc comment.
    pub doc: String,
    /// PaddlePaddle's name for the same setting.
    pub paddle: Option<&'static str>,
    /// Whether the key is in a table that is absent by default (`[train.click_log]`): shown
    /// commented out, as an example.
    pub in_optional_table: bool,
}

/// Every key of the configuration, in the structs' order.
pub fn entries() -> Vec<Entry> {
    let schema = serde_json::to_value(schemars::schema_for!(JobConfig)).unwrap_or_default();
    let defaults = JobConfig::default().leaves().unwrap_or_default();
    let walk = Walk {
        defs: schema.get("$defs").cloned().unwrap_or_default(),
        defaults,
    };
    let mut out = Vec::new();
    walk.table(&schema, "", false, &mut out);
    out
}

struct Walk {
    defs: Value,
    defaults: BTreeMap<String, toml::Value>,
}

impl Walk {
    /// `node` with a `$ref` followed.
    fn resolve<'a>(&'a self, node: &'a Value) -> &'a Value {
        match node.get("$ref").and_then(Value::as_str) {
            Some(reference) => {
                let name = reference.rsplit('/').next().unwrap_or_default();
                self.defs.get(name).unwrap_or(node)
            }
            None => node,
        }
    }

    /// `node` without the `null` of an optional value.
    fn present<'a>(&'a self, node: &'a Value) -> &'a Value {
        let node = self.resolve(node);
        match node.get("anyOf").and_then(Value::as_array) {
            Some(choices) if choices.len() == 2 && choices.iter().any(is_null) => {
                choices.iter().find(|c| !is_null(c)).map_or(node, |c| self.resolve(c))
            }
            _ => node,
        }
    }

    /// The keys of the struct `node`, under `prefix`; `optional`: in a table absent by default.
    fn table(&self, node: &Value, prefix: &str, optional: bool, out: &mut Vec<Entry>) {
        let Some(properties) = self.resolve(node).get("properties").and_then(Value::as_object) else {
            return;
        };
        for (name, property) in properties {
            let key = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            let value = self.present(property);
            if value.get("properties").is_some() {
                let absent = optional || !std::ptr::eq(value, self.resolve(property));
                self.table(value, &key, absent, out);
                continue;
            }
            // An array of tables (`[[train.click_log.slots]]`): its items' keys under `key[]`.
            if let Some(items) = value.get("items").map(|v| self.resolve(v)) {
                if items.get("properties").is_some() {
                    self.table(items, &format!("{key}[]"), true, out);
                    continue;
                }
            }
            // A table of tables by a name of the user's (`sparse_table_configs`).
            if let Some(named) = value.get("additionalProperties").map(|v| self.resolve(v)) {
                if named.get("properties").is_some() {
                    self.table(named, &format!("{key}.{NAMED}"), true, out);
                    continue;
                }
            }
            let doc = property
                .get("description")
                .or_else(|| value.get("description"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            out.push(Entry {
                doc: doc.split_whitespace().collect::<Vec<_>>().join(" "),
                kind: self.kind(property),
                default: self
                    .defaults
                    .get(&key)
                    .map(toml::Value::to_string)
                    .or_else(|| property.get("default").filter(|v| !v.is_null()).map(json_default)),
                paddle: PADDLE_NAMES.iter().find(|(k, _)| *k == key).map(|(_, paddle)| *paddle),
                in_optional_table: optional,
                key,
            });
        }
    }

    /// What values `node` takes, as the reference says it.
    fn kind(&self, node: &Value) -> String {
        let node = self.present(node);
        if let Some(values) = node.get("enum").and_then(Value::as_array) {
            return values.iter().map(Value::to_string).collect::<Vec<_>>().join(" \\| ");
        }
        if let Some(choices) = node
            .get("oneOf")
            .or_else(|| node.get("anyOf"))
            .and_then(Value::as_array)
        {
            let kinds: Vec<String> = choices
                .iter()
                .map(|choice| match choice.get("const") {
                    Some(value) => value.to_string(),
                    None => self.kind(choice),
                })
                .collect();
            return kinds.join(" \\| ");
        }
        // An optional value's type is `[type, "null"]`.
        let kind = match node.get("type") {
            Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).find(|k| *k != "null"),
            other => other.and_then(Value::as_str),
        };
        match kind {
            Some("array") => format!(
                "array of {}",
                node.get("items").map_or("values".into(), |i| self.kind(i))
            ),
            Some("object") => match node.get("additionalProperties") {
                Some(values) => format!("table of {}", self.kind(values)),
                None => "table".to_string(),
            },
            Some("boolean") => "bool".to_string(),
            Some(other) => other.to_string(),
            None => "value".to_string(),
        }
    }
}

/// A default from the schema as TOML: an `f32` field's default in its own shortest digits.
fn json_default(value: &Value) -> String {
    match value.as_f64() {
        Some(wide) if value.is_f64() && f64::from(wide as f32) == wide => format!("{:?}", wide as f32),
        _ => value.to_string(),
    }
}

fn is_null(node: &Value) -> bool {
    node.get("type").and_then(Value::as_str) == Some("null")
}

/// The reference as Markdown: a table per section.
pub fn markdown() -> String {
    let mut text = String::from(
        "# Configuration reference\n\n\
         Every key of a job's TOML (also `--set section.key=value`), generated from the config \
         structs by `flotilla config --reference`; `flotilla config --defaults` prints the same \
         as commented TOML. The Paddle column names PaddlePaddle's `DistributedStrategy` field, \
         or launcher flag and environment variable, for the same setting.\n",
    );
    let mut section = String::new();
    for entry in entries() {
        let this = entry.key.split('.').next().unwrap_or_default();
        if this != section {
            section = this.to_string();
            let _ = write!(
                text,
                "\n## `[{section}]`\n\n| key | type | default | Paddle | what it does |\n| --- | --- | --- | --- | --- |\n"
            );
        }
        let default = entry
            .default
            .as_deref()
            .map_or("unset".to_string(), |d| format!("`{}`", d.replace('|', "\\|")));
        let _ = writeln!(
            text,
            "| `{}` | {} | {} | {} | {} |",
            entry.key,
            entry.kind,
            default,
            entry.paddle.unwrap_or(""),
            entry.doc.replace('|', "\\|")
        );
    }
    text
}

/// Every key at its default as TOML, each under its documentation; keys unset by default are
/// shown commented out.
pub fn commented_defaults() -> String {
    // TOML has each table's keys in one place: grouped by table, tables in first-seen order.
    let mut tables: Vec<(String, Vec<Entry>)> = Vec::new();
    for entry in entries() {
        let parent = entry.key.rsplit_once('.').map_or("", |(parent, _)| parent).to_string();
        match tables.iter_mut().find(|(table, _)| *table == parent) {
            Some((_, keys)) => keys.push(entry),
            None => tables.push((parent, vec![entry])),
        }
    }
    let mut text = String::new();
    for (table, keys) in tables {
        // A table named by the user, or absent by default, is shown commented out with its
        // keys' defaults.
        let example = keys.iter().any(|entry| entry.in_optional_table);
        let comment = if example { "# " } else { "" };
        let _ = match table.strip_suffix("[]") {
            Some(array) => write!(text, "\n{comment}[[{array}]]\n"),
            None => write!(text, "\n{comment}[{table}]\n"),
        };
        for entry in keys {
            write_key(&mut text, &entry, comment);
        }
    }
    text.trim_start().to_string()
}

/// `entry` as TOML under its documentation.
fn write_key(text: &mut String, entry: &Entry, comment: &str) {
    let name = entry.key.rsplit_once('.').map_or(entry.key.as_str(), |(_, name)| name);
    text.push('\n');
    for line in wrap(&entry.doc, 98) {
        let _ = writeln!(text, "# {line}");
    }
    if let Some(paddle) = entry.paddle {
        let _ = writeln!(text, "# Paddle: {}", paddle.replace('`', ""));
    }
    let _ = match &entry.default {
        Some(default) => writeln!(text, "{comment}{name} = {default}"),
        None => writeln!(text, "# {name} = ({}, unset)", entry.kind.replace("\\|", "|")),
    };
}

/// `text` in lines of at most `width` characters, broken between words.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split_whitespace() {
        let line = lines.last_mut().expect("one line at least");
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(word.to_string());
        } else {
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
    }
    lines.retain(|line| !line.is_empty());
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_documented_and_every_paddle_name_names_a_key() {
        let entries = entries();
        for entry in &entries {
            assert!(!entry.doc.is_empty(), "{} has no documentation", entry.key);
        }
        for (key, _) in PADDLE_NAMES {
            assert!(entries.iter().any(|e| e.key == *key), "{key} is not a key");
        }
        let find = |key: &str| entries.iter().find(|e| e.key == key).cloned();
        let batch = find("train.batch_size").expect("train.batch_size");
        assert_eq!((batch.kind.as_str(), batch.default.as_deref()), ("integer", Some("64")));
        let mode = find("strategy.pipeline_configs.schedule_mode").expect("schedule_mode");
        assert!(mode.kind.contains("\"1F1B\""), "{}", mode.kind);
        assert_eq!(find("cluster.master").and_then(|e| e.default), None);
    }

    #[test]
    fn the_commented_defaults_load_as_the_defaults() {
        let text = commented_defaults();
        let loaded = JobConfig::from_toml_str(&text, "defaults", &|_| None, &[]).expect("the defaults load");
        assert_eq!(loaded.leaves().ok(), JobConfig::default().leaves().ok());
    }
}
