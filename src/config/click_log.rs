//! `[train.click_log]`: the columns of a click log of the user's own (dataset `click_log`) — which
//! column is the click, which are dense inputs and which are the sparse slots, and how a slot's
//! values become feature ids — so a log trains as it is, without being reshaped into Criteo's
//! 40 columns. Criteo's own layout is one such schema ([`ClickLogSchema::criteo`]).

use serde::{Deserialize, Serialize};

use super::FieldError;

/// The largest number of ids a slot's values map to: ids are 32-bit codes within their slot.
pub const SLOT_CODES: u64 = 1 << 32;

/// The file format of a click log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ClickLogFormat {
    /// Tab-separated text lines (plain, or gzip-compressed when the name ends in `.gz`).
    Tsv,
    /// Comma-separated text lines; a field may be quoted (`"a,b"`, `""` for a quote), but not
    /// across lines.
    Csv,
    /// Apache Parquet: top-level columns of strings, integers, floating-point numbers or
    /// booleans, or lists of them (a multi-valued slot).
    Parquet,
}

impl ClickLogFormat {
    /// The format a file's name says: `.parquet` / `.pq` Parquet, `.csv` (or `.csv.gz`) CSV,
    /// anything else TSV.
    pub fn of_path(path: &std::path::Path) -> Self {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let name = name.strip_suffix(".gz").unwrap_or(name);
        if name.ends_with(".parquet") || name.ends_with(".pq") {
            Self::Parquet
        } else if name.ends_with(".csv") {
            Self::Csv
        } else {
            Self::Tsv
        }
    }
}

/// A column of a click log: its 0-based position, or its name in the header line (text with
/// `header = true`) or the Parquet schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum ColumnRef {
    /// The column's 0-based position.
    Position(usize),
    /// The column's name.
    Name(String),
}

impl std::fmt::Display for ColumnRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Position(p) => write!(f, "column {p}"),
            Self::Name(name) => write!(f, "column {name:?}"),
        }
    }
}

/// What a click log's column is to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnRole {
    /// The click.
    Label,
    /// Dense input `i`.
    Dense(usize),
    /// Sparse slot `i`.
    Slot(usize),
}

impl ColumnRole {
    /// The key that names the column in `[train.click_log]`.
    pub fn key(self) -> String {
        match self {
            Self::Label => "train.click_log.label".to_string(),
            Self::Dense(i) => format!("train.click_log.dense[{i}]"),
            Self::Slot(i) => format!("train.click_log.slots[{i}].column"),
        }
    }
}

impl std::fmt::Display for ColumnRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Label => write!(f, "label"),
            Self::Dense(i) => write!(f, "dense {i}"),
            Self::Slot(i) => write!(f, "slot {i}"),
        }
    }
}

/// How a dense column's values become model inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DenseTransform {
    /// `ln(1 + max(x, 0))`, missing as 0: heavy-tailed counts (Criteo's integer columns) kept in
    /// a range a network takes without per-column statistics.
    #[default]
    Log1p,
    /// The value as it is (missing as 0): inputs already scaled.
    None,
}

/// How a slot's values become the 32-bit codes its feature ids are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SlotIds {
    /// The value's text hashed (64-bit FNV-1a, then SplitMix64's finaliser) modulo
    /// `hash_buckets`: any string, as Paddle's and TorchRec's hashing of raw features.
    #[default]
    Hash,
    /// At most 8 hexadecimal digits, the code itself: values already hashed to 32 bits, as
    /// Criteo ships them.
    Hex,
    /// A decimal integer in `[0, id_range)`, the code itself: ids already assigned.
    Integer,
}

/// One sparse slot: the column it reads and how its values become ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SlotSpec {
    /// The column (a name or a 0-based position).
    pub column: ColumnRef,
    /// How values become ids: `hash` (default), `hex` or `integer`.
    #[serde(default)]
    pub ids: SlotIds,
    /// `ids = "hash"`: the number of buckets values hash into, at most 2^32 (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_buckets: Option<u64>,
    /// `ids = "integer"` (required there): values must lie in `[0, id_range)`, at most 2^32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_range: Option<u64>,
    /// A multi-valued slot: the string between a cell's values (text formats; a Parquet list
    /// column is multi-valued as it is). The values' rows are summed (sum pooling); an empty
    /// cell is the slot's missing value, as in a single-valued slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub separator: Option<String>,
}

impl SlotSpec {
    /// A single-valued slot of `column` whose values become ids as `ids` says.
    pub fn new(column: ColumnRef, ids: SlotIds) -> Self {
        Self {
            column,
            ids,
            hash_buckets: None,
            id_range: None,
            separator: None,
        }
    }

    /// The number of codes the slot's values map into: the hash's buckets, the id range, or
    /// every 32-bit code.
    pub fn codes(&self) -> u64 {
        match self.ids {
            SlotIds::Hash => self.hash_buckets.unwrap_or(SLOT_CODES),
            SlotIds::Integer => self.id_range.unwrap_or(SLOT_CODES),
            SlotIds::Hex => SLOT_CODES,
        }
    }

    fn check(&self, key: &str) -> Result<(), FieldError> {
        let bound = |name: &str, value: Option<u64>| match value {
            Some(v) if v == 0 || v > SLOT_CODES => Err(FieldError::new(
                format!("{key}.{name}"),
                format!("{v} is not between 1 and 2^32 = {SLOT_CODES}"),
            )),
            _ => Ok(()),
        };
        bound("hash_buckets", self.hash_buckets)?;
        bound("id_range", self.id_range)?;
        if self.hash_buckets.is_some() && self.ids != SlotIds::Hash {
            return Err(FieldError::new(
                format!("{key}.hash_buckets"),
                "applies to ids = \"hash\" only",
            ));
        }
        match (self.ids, self.id_range) {
            (SlotIds::Integer, None) => {
                return Err(FieldError::new(
                    format!("{key}.id_range"),
                    "ids = \"integer\" needs the range its values lie in ([0, id_range))",
                ))
            }
            (SlotIds::Hash | SlotIds::Hex, Some(_)) => {
                return Err(FieldError::new(
                    format!("{key}.id_range"),
                    "applies to ids = \"integer\" only",
                ))
            }
            _ => {}
        }
        if self.separator.as_deref() == Some("") {
            return Err(FieldError::new(format!("{key}.separator"), "is empty"));
        }
        Ok(())
    }
}

/// `[train.click_log]`: the columns of a click log of the user's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ClickLogSchema {
    /// `tsv`, `csv` or `parquet`; unset: each file's name says (`.parquet`/`.pq`, `.csv`,
    /// anything else TSV).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<ClickLogFormat>,
    /// Text formats: the first line of every file names the columns (and is not a record).
    pub header: bool,
    /// The click: `0` or `1` (a number equal to either; a Parquet boolean too).
    pub label: ColumnRef,
    /// The dense inputs, in the model's order: numbers, an empty cell missing.
    pub dense: Vec<ColumnRef>,
    /// How dense values become inputs: `log1p` or `none`.
    pub dense_transform: DenseTransform,
    /// The sparse slots, in the model's order (`[[train.click_log.slots]]`).
    pub slots: Vec<SlotSpec>,
}

impl Default for ClickLogSchema {
    fn default() -> Self {
        Self {
            format: None,
            header: false,
            label: ColumnRef::Position(0),
            dense: Vec::new(),
            dense_transform: DenseTransform::Log1p,
            slots: Vec::new(),
        }
    }
}

/// Criteo's integer columns (I1..I13).
pub const CRITEO_DENSE: usize = 13;
/// Criteo's categorical columns (C1..C26).
pub const CRITEO_SLOTS: usize = 26;

impl ClickLogSchema {
    /// Criteo's display-advertising layout: TSV without a header, the label, 13 counts
    /// (`log1p`), 26 categorical columns of 32-bit hex hashes.
    pub fn criteo() -> Self {
        Self {
            format: Some(ClickLogFormat::Tsv),
            header: false,
            label: ColumnRef::Position(0),
            dense: (1..=CRITEO_DENSE).map(ColumnRef::Position).collect(),
            dense_transform: DenseTransform::Log1p,
            slots: (1 + CRITEO_DENSE..1 + CRITEO_DENSE + CRITEO_SLOTS)
                .map(|c| SlotSpec::new(ColumnRef::Position(c), SlotIds::Hex))
                .collect(),
        }
    }

    /// Whether any slot may hold several values in one record.
    pub fn multi_valued(&self) -> bool {
        self.slots.iter().any(|s| s.separator.is_some())
    }

    /// Every column the schema reads, with its role: the label, the dense columns, the slots.
    pub fn columns(&self) -> impl Iterator<Item = (ColumnRole, &ColumnRef)> {
        std::iter::once((ColumnRole::Label, &self.label))
            .chain((self.dense.iter().enumerate()).map(|(i, c)| (ColumnRole::Dense(i), c)))
            .chain((self.slots.iter().enumerate()).map(|(i, s)| (ColumnRole::Slot(i), &s.column)))
    }

    pub(crate) fn check(&self) -> Result<(), FieldError> {
        if self.slots.is_empty() {
            return Err(FieldError::new(
                "train.click_log.slots",
                "a click log needs at least one sparse slot ([[train.click_log.slots]] with a column)",
            ));
        }
        for (i, slot) in self.slots.iter().enumerate() {
            slot.check(&format!("train.click_log.slots[{i}]"))?;
        }
        let columns: Vec<(ColumnRole, &ColumnRef)> = self.columns().collect();
        for (i, (role, column)) in columns.iter().enumerate() {
            let key = role.key();
            if let Some((first, _)) = columns[..i].iter().find(|(_, c)| c == column) {
                return Err(FieldError::new(
                    key,
                    format!("{column} is read already by {}: each column has one role", first.key()),
                ));
            }
            let text = matches!(self.format, Some(ClickLogFormat::Tsv | ClickLogFormat::Csv));
            if text && !self.header && matches!(column, ColumnRef::Name(_)) {
                return Err(FieldError::new(
                    key,
                    format!("{column} is a name, but train.click_log.header = false: files without a header are read by position"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(toml_text: &str) -> ClickLogSchema {
        toml::from_str(toml_text).expect("a schema")
    }

    #[test]
    fn the_criteo_layout_is_a_valid_schema() {
        let criteo = ClickLogSchema::criteo();
        assert!(criteo.check().is_ok());
        assert_eq!((criteo.dense.len(), criteo.slots.len()), (13, 26));
        assert_eq!(criteo.slots[0].column, ColumnRef::Position(14));
        assert!(!criteo.multi_valued());
    }

    #[test]
    fn columns_are_names_or_positions() {
        let s = schema(
            "header = true\nlabel = \"click\"\ndense = [\"price\", 4]\n[[slots]]\ncolumn = \"user\"\n\
             [[slots]]\ncolumn = 7\nids = \"integer\"\nid_range = 100\nseparator = \"|\"\n",
        );
        assert_eq!(s.label, ColumnRef::Name("click".into()));
        assert_eq!(s.dense, [ColumnRef::Name("price".into()), ColumnRef::Position(4)]);
        assert_eq!(s.slots[1].codes(), 100);
        assert_eq!(s.slots[0].codes(), SLOT_CODES);
        assert!(s.multi_valued());
        assert!(s.check().is_ok());
    }

    #[test]
    fn bad_schemas_name_the_key() {
        let cases = [
            ("label = 0\n", "train.click_log.slots"),
            ("[[slots]]\ncolumn = 0\n", "train.click_log.slots[0].column"),
            ("dense = [1, 1]\n[[slots]]\ncolumn = 2\n", "train.click_log.dense[1]"),
            (
                "[[slots]]\ncolumn = 1\nids = \"integer\"\n",
                "train.click_log.slots[0].id_range",
            ),
            (
                "[[slots]]\ncolumn = 1\nid_range = 5\n",
                "train.click_log.slots[0].id_range",
            ),
            (
                "[[slots]]\ncolumn = 1\nids = \"hex\"\nhash_buckets = 5\n",
                "train.click_log.slots[0].hash_buckets",
            ),
            (
                "[[slots]]\ncolumn = 1\nhash_buckets = 0\n",
                "train.click_log.slots[0].hash_buckets",
            ),
            (
                "[[slots]]\ncolumn = 1\nhash_buckets = 4294967297\n",
                "train.click_log.slots[0].hash_buckets",
            ),
            (
                "[[slots]]\ncolumn = 1\nseparator = \"\"\n",
                "train.click_log.slots[0].separator",
            ),
            (
                "format = \"csv\"\n[[slots]]\ncolumn = \"user\"\n",
                "train.click_log.slots[0].column",
            ),
        ];
        for (text, key) in cases {
            let err = schema(text).check().expect_err(text);
            assert_eq!(err.key, key, "{text}: {}", err.message);
        }
    }

    #[test]
    fn formats_follow_file_names() {
        use std::path::Path;
        assert_eq!(
            ClickLogFormat::of_path(Path::new("a/b.parquet")),
            ClickLogFormat::Parquet
        );
        assert_eq!(ClickLogFormat::of_path(Path::new("b.csv.gz")), ClickLogFormat::Csv);
        assert_eq!(ClickLogFormat::of_path(Path::new("day_0.gz")), ClickLogFormat::Tsv);
    }
}
