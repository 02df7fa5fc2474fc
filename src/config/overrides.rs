//! `--set section.key=value` command-line overrides, the highest-precedence config source.
//!
//! The key is a dotted path (nested tables allowed: `strategy.a_sync_configs.k_steps=4`); the
//! value is parsed as a TOML value (`3`, `0.5`, `true`, `"s"`, `[1, 2]`) and falls back to a
//! plain string when it is not one, so `--set train.optimizer=adamw` needs no quoting. The value
//! is written into the config table, so it is checked exactly like the same key in the file;
//! errors about keys written by `--set` name `--set` as their source.

use toml::{Table, Value};

use super::{set_path, ConfigError, Provenance, SET_SOURCE};

/// Applies every override in order (later ones win), recording them in `provenance`.
pub(super) fn apply(table: &mut Table, overrides: &[String], provenance: &mut Provenance) -> Result<(), ConfigError> {
    for text in overrides {
        let error = |message: String| ConfigError::Invalid {
            source_name: SET_SOURCE.to_string(),
            key: text.clone(),
            message,
        };
        let (path, raw) = parse(text).map_err(error)?;
        let value = parse_value(raw).map_err(|message| ConfigError::Invalid {
            source_name: SET_SOURCE.to_string(),
            key: path.join("."),
            message,
        })?;
        set_path(table, &path, value).map_err(error)?;
        drop_replaced_length(table, &path, provenance);
        provenance.record(path.join("."), SET_SOURCE.to_string());
    }
    Ok(())
}

/// `train.steps` and `train.epochs` are two ways of saying how long to train, so setting one on
/// the command line replaces the other when the file or the environment gave it; two `--set`
/// overrides naming both still contradict each other.
fn drop_replaced_length(table: &mut Table, path: &[&str], provenance: &Provenance) {
    let other = match path {
        ["train", "steps"] => "epochs",
        ["train", "epochs"] => "steps",
        _ => return,
    };
    if provenance.source_of(&format!("train.{other}")) == SET_SOURCE {
        return;
    }
    if let Some(Value::Table(train)) = table.get_mut("train") {
        train.remove(other);
    }
}

/// Splits `section.key=value` into the key's segments and the value's text.
fn parse(text: &str) -> Result<(Vec<&str>, &str), String> {
    const EXPECTED: &str = "expected `section.key=value`";
    let Some((key, raw)) = text.split_once('=') else {
        return Err(format!("{EXPECTED} (no `=`)"));
    };
    let key = key.trim();
    if key.is_empty() {
        return Err(format!("{EXPECTED} (empty key)"));
    }
    let path: Vec<&str> = key.split('.').map(str::trim).collect();
    if path.len() < 2 {
        return Err(format!("{EXPECTED} (no section in `{key}`)"));
    }
    if path.iter().any(|segment| segment.is_empty()) {
        return Err(format!("{EXPECTED} (empty segment in `{key}`)"));
    }
    Ok((path, raw.trim()))
}

/// Parses `raw` as a single TOML value, or keeps it as a string if it is not exactly one; an
/// integer too large for TOML is an error rather than a string that fails as "invalid type".
fn parse_value(raw: &str) -> Result<Value, String> {
    if let Ok(mut document) = format!("v = {raw}").parse::<Table>() {
        // More than one key means `raw` smuggled in extra lines; treat it as text instead.
        if document.len() == 1 {
            if let Some(value) = document.remove("v") {
                return Ok(value);
            }
        }
    }
    let digits = raw.replace('_', "");
    let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(&digits);
    let is_integer = !unsigned.is_empty() && unsigned.chars().all(|c| c.is_ascii_digit());
    if is_integer && digits.parse::<i64>().is_err() {
        return Err(format!(
            "{raw} is out of range for a 64-bit integer (from {} to {})",
            i64::MIN,
            i64::MAX
        ));
    }
    Ok(Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{err_text, load_with};
    use crate::config::OptimizerKind;

    #[test]
    fn values_parse_as_toml_or_fall_back_to_strings() {
        let value = |raw: &str| parse_value(raw).unwrap();
        assert_eq!(value("3"), Value::Integer(3));
        assert_eq!(value("0.5"), Value::Float(0.5));
        assert_eq!(value("true"), Value::Boolean(true));
        assert_eq!(value("\"s\""), Value::String("s".into()));
        assert_eq!(value("[1,2]"), Value::Array(vec![Value::Integer(1), Value::Integer(2)]));
        assert_eq!(value("adamw"), Value::String("adamw".into()));
        assert_eq!(value("1\nw = 2"), Value::String("1\nw = 2".into()));
        assert_eq!(value(""), Value::String(String::new()));
        assert_eq!(value("1_000"), Value::Integer(1000));
    }

    #[test]
    fn set_beats_env_and_file() {
        let config = load_with(
            "[cluster]\nworld_size = 2\n[train]\nlr = 0.1\n",
            &[("PADDLE_TRAINERS_NUM", "8")],
            &[
                "cluster.world_size=4",
                "cluster.nnodes=2",
                "train.lr=0.2",
                "train.optimizer=adamw",
                "train.hidden_sizes=[32, 16]",
            ],
        )
        .unwrap();
        assert_eq!(config.cluster.world_size, Some(4));
        assert_eq!(config.train.lr, 0.2);
        assert_eq!(config.train.optimizer, OptimizerKind::Adamw);
        assert_eq!(config.train.hidden_sizes(), vec![32, 16]);
    }

    #[test]
    fn setting_steps_replaces_the_files_epochs_but_two_sets_still_clash() {
        let config = load_with("[train]\nepochs = 30\n", &[], &["train.steps=7"]).unwrap();
        assert_eq!(config.train.steps, Some(7));
        assert_eq!(config.train.epochs, None);
        let msg = err_text(load_with("", &[], &["train.steps=7", "train.epochs=2"]));
        assert!(msg.contains("train.steps") && msg.contains("train.epochs"), "{msg}");
    }

    #[test]
    fn unknown_key_from_set_is_rejected_and_attributed() {
        let msg = err_text(load_with("", &[], &["strategy.bogus=1"]));
        assert!(msg.starts_with("--set: strategy: unknown field `bogus`"), "{msg}");
    }

    #[test]
    fn bad_value_from_set_names_set() {
        let msg = err_text(load_with("[train]\nlr = 0.1\n", &[], &["train.lr=fast"]));
        assert_eq!(msg, "--set: train.lr: invalid type: string \"fast\", expected f64");
        let msg = err_text(load_with("", &[], &["train.batch_size=7"]));
        assert!(msg.starts_with("--set: train.batch_size: "), "{msg}");
    }

    #[test]
    fn an_integer_too_large_is_out_of_range_not_a_string() {
        let msg = err_text(load_with("", &[], &["train.steps=99999999999999999999"]));
        assert_eq!(
            msg,
            "--set: train.steps: 99999999999999999999 is out of range for a 64-bit integer \
             (from -9223372036854775808 to 9223372036854775807)"
        );
        let msg = err_text(load_with("", &[], &["train.seed=-99999999999999999999"]));
        assert!(
            msg.starts_with("--set: train.seed: -99999999999999999999 is out of range"),
            "{msg}"
        );
    }

    #[test]
    fn malformed_overrides_are_rejected_naming_the_text() {
        for (text, why) in [
            ("foo", "no `=`"),
            ("=3", "empty key"),
            ("lr=3", "no section"),
            ("train..lr=3", "empty segment"),
        ] {
            let msg = err_text(load_with("", &[], &[text]));
            assert!(msg.starts_with(&format!("--set: {text}: expected")), "{msg}");
            assert!(msg.contains(why), "{msg}");
        }
        let msg = err_text(load_with("[train]\nlr = 0.1\n", &[], &["train.lr.x=1"]));
        assert_eq!(
            msg,
            "--set: train.lr.x=1: cannot set `train.lr.x`: `train.lr` is a float, not a table"
        );
        let msg = err_text(load_with("", &[], &["train.lr.x=1"]));
        assert!(msg.starts_with("--set: train.lr: invalid type: map"), "{msg}");
    }
}
