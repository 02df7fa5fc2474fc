//! `[strategy.sparse_table_configs.<table>]`: how a parameter-server shard admits, counts and
//! evicts the rows of one sparse table, in the vocabulary of Paddle's CTR accessor. A table
//! without a section keeps every row it is pushed, for ever.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{FieldError, JobConfig};

/// One table's row policy. Every row of such a table counts its shows (training occurrences)
/// and clicks (occurrences in clicked samples); its score is
/// `nonclk_coeff × (shows − clicks) + click_coeff × clicks`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SparseTableConfig {
    /// Entry: a row is stored from its `count_filter`-th training occurrence on (its gradients
    /// before are dropped); until then it reads as zeros. 0 or 1: from its first.
    pub count_filter: u32,
    /// Entry: each training occurrence of a row not stored yet stores it with this probability
    /// (drawn from the job's seed, the table, the id and the occurrence, so runs repeat).
    pub probability: f64,
    /// Weight of a show without a click in the score.
    pub nonclk_coeff: f32,
    /// Weight of a click in the score.
    pub click_coeff: f32,
    /// At the end of each pass, every row's shows and clicks are multiplied by this.
    pub show_click_decay_rate: f32,
    /// At the end of each pass, rows whose (decayed) score is below this are deleted.
    pub delete_threshold: f32,
    /// At the end of each pass, rows not trained for more than this many passes are deleted.
    pub delete_after_unseen_days: u32,
    /// The most this table's rows (values, optimizer state, counts and index) and, under an
    /// entry rule, its candidates (a quarter) may take on one shard, in MiB; rows and candidates
    /// beyond it evict the lowest-scored. 0: no cap.
    pub max_memory_mb: f64,
}

/// Paddle's defaults (`CtrCommonAccessor`), except the entry rules, which admit every row.
impl Default for SparseTableConfig {
    fn default() -> Self {
        Self {
            count_filter: 0,
            probability: 1.0,
            nonclk_coeff: 0.1,
            click_coeff: 1.0,
            show_click_decay_rate: 0.98,
            delete_threshold: 0.8,
            delete_after_unseen_days: 30,
            max_memory_mb: 0.0,
        }
    }
}

impl SparseTableConfig {
    /// Whether a row must earn its place before it is stored.
    pub fn has_entry_rule(&self) -> bool {
        self.count_filter > 1 || self.probability < 1.0
    }

    /// Checks the values of table `table`'s section.
    fn check(&self, table: &str) -> Result<(), FieldError> {
        let key = |name: &str| format!("strategy.sparse_table_configs.{table}.{name}");
        if !(self.probability > 0.0 && self.probability <= 1.0) {
            return Err(FieldError::new(
                key("probability"),
                format!("{} is not in (0, 1]: the chance a new row is stored", self.probability),
            ));
        }
        if self.count_filter > 1 && self.probability < 1.0 {
            return Err(FieldError::new(
                key("probability"),
                format!(
                    "{} with count_filter = {}: a table admits rows by one entry rule",
                    self.probability, self.count_filter
                ),
            ));
        }
        if !(self.show_click_decay_rate > 0.0 && self.show_click_decay_rate <= 1.0) {
            return Err(FieldError::new(
                key("show_click_decay_rate"),
                format!("{} is not in (0, 1]", self.show_click_decay_rate),
            ));
        }
        for (name, value) in [
            ("nonclk_coeff", self.nonclk_coeff),
            ("click_coeff", self.click_coeff),
            ("delete_threshold", self.delete_threshold),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(FieldError::new(key(name), format!("{value} is not a number ≥ 0")));
            }
        }
        if !(self.max_memory_mb.is_finite() && self.max_memory_mb >= 0.0) {
            return Err(FieldError::new(
                key("max_memory_mb"),
                format!("{} is not a size in MiB ≥ 0", self.max_memory_mb),
            ));
        }
        Ok(())
    }
}

/// Checks the values of every section. Which tables exist is the model's to say: see
/// [`JobConfig::check_sparse_table_names`].
pub(super) fn check_sparse_tables(configs: &BTreeMap<String, SparseTableConfig>) -> Result<(), FieldError> {
    configs.iter().try_for_each(|(table, config)| config.check(table))
}

impl JobConfig {
    /// Checks that every `[strategy.sparse_table_configs.<table>]` names one of the model's
    /// `tables`.
    pub fn check_sparse_table_names(&self, tables: &[&str]) -> anyhow::Result<()> {
        match self
            .strategy
            .sparse_table_configs
            .keys()
            .find(|table| !tables.contains(&table.as_str()))
        {
            Some(table) => anyhow::bail!(
                "{}: strategy.sparse_table_configs.{table}: the model has no sparse table `{table}`; its tables are {}",
                self.source_name,
                tables.join(", ")
            ),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{err_text, load_str};

    const CTR: &str = "[cluster]\nserver_num = 2\n[train]\nmodel = \"wide_deep\"\ndataset = \"criteo_synthetic\"\n";

    fn with_table(section: &str) -> String {
        format!("{CTR}[strategy.sparse_table_configs.{section}\n")
    }

    #[test]
    fn a_policy_loads_with_paddles_defaults_where_unset() {
        let config = load_str(&with_table("embedding]\ncount_filter = 3")).unwrap();
        let policy = &config.strategy.sparse_table_configs["embedding"];
        assert_eq!((policy.count_filter, policy.delete_after_unseen_days), (3, 30));
        assert!(policy.has_entry_rule());
    }

    #[test]
    fn a_policy_for_a_table_the_model_lacks_is_named() {
        let config = load_str(&with_table("user_id]\ncount_filter = 3")).unwrap();
        let err = config.check_sparse_table_names(&["embedding", "wide"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config.toml: strategy.sparse_table_configs.user_id: the model has no sparse table `user_id`; its tables are embedding, wide"
        );
        assert!(config.check_sparse_table_names(&["user_id"]).is_ok());
    }

    #[test]
    fn bad_policies_name_the_table_and_the_key() {
        let cases = [
            (
                with_table("wide]\ncount_filter = \"3\""),
                "strategy.sparse_table_configs.wide.count_filter: invalid type: string \"3\"",
            ),
            (
                with_table("wide]\nmax_rows = 3"),
                "strategy.sparse_table_configs.wide: unknown field `max_rows`",
            ),
            (
                with_table("wide]\nprobability = 0.0"),
                "strategy.sparse_table_configs.wide.probability: 0 is not in (0, 1]",
            ),
            (
                with_table("wide]\nprobability = 0.5\ncount_filter = 2"),
                "strategy.sparse_table_configs.wide.probability: 0.5 with count_filter = 2",
            ),
            (
                with_table("wide]\nmax_memory_mb = -1.0"),
                "strategy.sparse_table_configs.wide.max_memory_mb: -1 is not a size",
            ),
            (
                "[strategy.sparse_table_configs.embedding]\ncount_filter = 3\n".to_owned(),
                "strategy.sparse_table_configs.embedding: sparse tables live on parameter servers",
            ),
        ];
        for (text, want) in cases {
            let got = err_text(load_str(&text));
            assert!(got.contains(want), "{text}\n→ {got}");
        }
    }
}
