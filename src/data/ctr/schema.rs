//! A click log's columns (`[train.click_log]`, or Criteo's) compiled for reading: which position
//! plays which role once a file's header is known, and how one record's cells become a
//! [`CtrExample`]. Text and Parquet readers share it, so the same value gives the same id
//! whatever file it came from.

use std::borrow::Cow;

use super::{feature_id, CtrExample, CtrShape};
use crate::config::{ClickLogSchema, ColumnRef, ColumnRole as Role, DenseTransform, SlotIds, SlotSpec};
use crate::rng::mix64;

/// The roles of one file's columns: by position, and the fewest columns a record must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ColumnRoles {
    /// `by_position[c]`: the role of column `c` (`None`: not read).
    pub(crate) by_position: Vec<Option<Role>>,
    /// The columns of the header, where there is one: every record has exactly these.
    pub(crate) header: Option<Vec<String>>,
    /// `slot_position[s]`: the column of slot `s`.
    slot_position: Vec<usize>,
}

impl ColumnRoles {
    /// The columns a record must have: the header's, or enough to reach the last read.
    pub(crate) fn expected_columns(&self) -> usize {
        self.header.as_ref().map_or(self.by_position.len(), Vec::len)
    }

    /// `column N (role)`, or `column N "name" (role)` under a header, for errors.
    pub(crate) fn describe(&self, position: usize) -> String {
        let role = self.by_position[position].map_or("not read".to_string(), |r| r.to_string());
        match self.header.as_ref().and_then(|names| names.get(position)) {
            Some(name) => format!("column {position} {name:?} ({role})"),
            None => format!("column {position} ({role})"),
        }
    }
}

/// A click log's schema, ready to turn cells into model inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct ClickLogParser {
    schema: ClickLogSchema,
}

impl ClickLogParser {
    /// The parser of logs in `schema`'s columns (checked by the config).
    pub fn new(schema: ClickLogSchema) -> Self {
        Self { schema }
    }

    /// The schema read.
    pub fn schema(&self) -> &ClickLogSchema {
        &self.schema
    }

    /// The model inputs a record becomes.
    pub fn shape(&self) -> CtrShape {
        CtrShape::of(&self.schema)
    }

    /// The roles of a file whose columns are named `header` (`None`: a file read by position).
    /// A name missing from the header, or any name without one, is an error naming it.
    pub(crate) fn roles(&self, header: Option<&[String]>) -> Result<ColumnRoles, String> {
        let mut by_position: Vec<Option<Role>> = vec![None; header.map_or(0, <[String]>::len)];
        let mut slot_position = Vec::with_capacity(self.schema.slots.len());
        for (role, column) in self.schema.columns() {
            let position = match (column, header) {
                (ColumnRef::Position(p), _) => *p,
                (ColumnRef::Name(name), Some(names)) => names
                    .iter()
                    .position(|n| n == name)
                    .ok_or_else(|| format!("the {role} column {name:?} is not among the file's columns {names:?}"))?,
                (ColumnRef::Name(name), None) => {
                    return Err(format!(
                        "the {role} column is named {name:?}, but the file has no header to name columns \
                         (train.click_log.header = false): name it by position"
                    ))
                }
            };
            if let Some(names) = header.filter(|names| position >= names.len()) {
                return Err(format!(
                    "the {role} column is column {position}, but the header names {} columns",
                    names.len()
                ));
            }
            if by_position.len() <= position {
                by_position.resize(position + 1, None);
            }
            if let Some(other) = by_position[position] {
                return Err(format!("column {position} is both the {other} and the {role} column"));
            }
            by_position[position] = Some(role);
            if let Role::Slot(_) = role {
                slot_position.push(position);
            }
        }
        Ok(ColumnRoles {
            by_position,
            header: header.map(<[String]>::to_vec),
            slot_position,
        })
    }

    /// The example of one record whose cells `cell(position)` gives, for the columns `roles`
    /// reads; an error names the column.
    pub(crate) fn example<'a>(
        &self,
        roles: &ColumnRoles,
        mut cell: impl FnMut(usize) -> Cell<'a>,
    ) -> Result<CtrExample, String> {
        let shape = self.shape();
        let mut example = CtrExample {
            label: 0.0,
            dense: vec![0.0; shape.dense],
            ids: Vec::with_capacity(shape.slots),
            slot_ends: Vec::new(),
        };
        let bad = |position: usize| move |why: String| format!("{}: {why}", roles.describe(position));
        for (position, role) in roles.by_position.iter().enumerate() {
            match role {
                Some(Role::Label) => example.label = self.label(&cell(position)).map_err(bad(position))?,
                Some(Role::Dense(i)) => example.dense[*i] = self.dense(&cell(position)).map_err(bad(position))?,
                Some(Role::Slot(_)) | None => {}
            }
        }
        let multi = self.schema.multi_valued();
        for (slot, &position) in roles.slot_position.iter().enumerate() {
            self.slot_ids(slot, &cell(position), &mut example.ids)
                .map_err(bad(position))?;
            if multi {
                example.slot_ends.push(example.ids.len() as u32);
            }
        }
        Ok(example)
    }

    fn label(&self, cell: &Cell) -> Result<f32, String> {
        match cell {
            Cell::Text(text) => match text.as_ref() {
                "0" => Ok(0.0),
                "1" => Ok(1.0),
                other => match other.trim().parse::<f64>() {
                    Ok(v) if v == 0.0 || v == 1.0 => Ok(v as f32),
                    _ => Err(format!("{other:?} is not a click label: it must be 0 or 1")),
                },
            },
            Cell::Missing => Err("the click label is missing".to_string()),
            Cell::List(_) => Err("a list is not a click label: it must be 0 or 1".to_string()),
        }
    }

    fn dense(&self, cell: &Cell) -> Result<f32, String> {
        let value = match cell {
            Cell::Missing => return Ok(0.0),
            Cell::Text(text) if text.is_empty() => return Ok(0.0),
            Cell::Text(text) => text
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| format!("{text:?} is not a number"))?,
            Cell::List(_) => return Err("a list is not a dense value".to_string()),
        };
        Ok(match self.schema.dense_transform {
            // 1 + x is exact in f32 for counts below 2^24, and `ln` is cheaper than `ln_1p`.
            DenseTransform::Log1p => (value.max(0.0) as f32 + 1.0).ln(),
            DenseTransform::None => value as f32,
        })
    }

    /// Appends the ids of `slot`'s cell: one per value (a multi-valued slot's cell split at its
    /// separator, empty values dropped), or the slot's missing id when it has none.
    fn slot_ids(&self, slot: usize, cell: &Cell, ids: &mut Vec<u64>) -> Result<(), String> {
        let spec = &self.schema.slots[slot];
        let before = ids.len();
        let mut push = |value: &str| -> Result<(), String> {
            if !value.is_empty() {
                ids.push(feature_id(slot, Some(value_code(spec, value)?)));
            }
            Ok(())
        };
        match (cell, &spec.separator) {
            (Cell::Missing, _) => {}
            (Cell::Text(text), Some(separator)) => text.split(separator.as_str()).try_for_each(&mut push)?,
            (Cell::Text(text), None) => push(text)?,
            (Cell::List(values), Some(_)) => values.iter().try_for_each(|v| push(v))?,
            (Cell::List(values), None) => match values.as_slice() {
                [] => {}
                [value] => push(value)?,
                _ => {
                    return Err(format!(
                        "a list of {} values in a single-valued slot (give the slot a separator to read lists)",
                        values.len()
                    ))
                }
            },
        }
        if ids.len() == before {
            ids.push(feature_id(slot, None));
        }
        Ok(())
    }
}

/// One cell of a record as read from a file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell<'a> {
    /// A value's text (numbers as their decimal text, so a value hashes alike in every format).
    Text(Cow<'a, str>),
    /// The values of a list cell (Parquet).
    List(Vec<String>),
    /// A null or absent cell.
    Missing,
}

/// The 32-bit code of one value of a slot, as its `ids` says.
fn value_code(spec: &SlotSpec, value: &str) -> Result<u32, String> {
    match spec.ids {
        SlotIds::Hex => {
            if !value.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("{value:?} is not hexadecimal"));
            }
            if value.len() > 8 {
                return Err(format!("{value:?} has more than 8 hex digits"));
            }
            u32::from_str_radix(value, 16).map_err(|e| format!("{value:?}: {e}"))
        }
        SlotIds::Integer => {
            let range = spec.codes();
            match value.trim().parse::<u64>() {
                Ok(v) if v < range => Ok(v as u32),
                _ => Err(format!("{value:?} is not an integer id in [0, {range})")),
            }
        }
        SlotIds::Hash => Ok((text_hash(value) % spec.codes()) as u32),
    }
}

/// The stable 64-bit hash of a value's text: FNV-1a, then SplitMix64's finaliser so that the
/// low bits (a bucket) depend on every byte. Part of the id contract: never changes.
pub fn text_hash(text: &str) -> u64 {
    let fnv = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    mix64(fnv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SlotSpec;

    fn text(s: &str) -> Cell<'_> {
        Cell::Text(Cow::Borrowed(s))
    }

    fn parser() -> ClickLogParser {
        let mut tags = SlotSpec::new(ColumnRef::Name("tags".into()), SlotIds::Hash);
        tags.separator = Some("|".into());
        let mut country = SlotSpec::new(ColumnRef::Position(4), SlotIds::Integer);
        country.id_range = Some(10);
        ClickLogParser::new(ClickLogSchema {
            header: true,
            label: ColumnRef::Name("click".into()),
            dense: vec![ColumnRef::Name("price".into())],
            dense_transform: DenseTransform::None,
            slots: vec![
                SlotSpec::new(ColumnRef::Name("user".into()), SlotIds::Hash),
                tags,
                country,
            ],
            ..ClickLogSchema::default()
        })
    }

    fn header() -> Vec<String> {
        ["user", "click", "tags", "price", "country"].map(String::from).to_vec()
    }

    #[test]
    fn names_resolve_against_the_header_and_missing_ones_are_named() {
        let p = parser();
        let roles = p.roles(Some(&header())).expect("roles");
        assert_eq!(
            roles.by_position,
            [
                Some(Role::Slot(0)),
                Some(Role::Label),
                Some(Role::Slot(1)),
                Some(Role::Dense(0)),
                Some(Role::Slot(2))
            ]
        );
        let err = p.roles(Some(&header()[..4])).expect_err("a short header");
        assert_eq!(err, "the slot 2 column is column 4, but the header names 4 columns");
        let err = p.roles(None).expect_err("no header");
        assert!(
            err.starts_with("the label column is named \"click\", but the file has no header"),
            "{err}"
        );
        let mut renamed = header();
        renamed[2] = "labels".into();
        let err = p.roles(Some(&renamed)).expect_err("no tags");
        assert!(err.starts_with("the slot 1 column \"tags\" is not among"), "{err}");
    }

    #[test]
    fn cells_become_inputs_and_multi_valued_slots_end_where_their_ids_do() {
        let p = parser();
        let roles = p.roles(Some(&header())).expect("roles");
        let row = ["alice", "1", "a||b|c", "2.5", "7"];
        let example = p.example(&roles, |c| text(row[c])).expect("an example");
        assert_eq!((example.label, example.dense.clone()), (1.0, vec![2.5]));
        let hash = |slot: usize, v: &str| feature_id(slot, Some((text_hash(v) % (1 << 32)) as u32));
        assert_eq!(
            example.ids,
            [
                hash(0, "alice"),
                hash(1, "a"),
                hash(1, "b"),
                hash(1, "c"),
                feature_id(2, Some(7))
            ]
        );
        assert_eq!(example.slot_ends, [1, 4, 5]);
        let empty = ["bob", "0", "", "", "0"];
        let example = p.example(&roles, |c| text(empty[c])).expect("an example");
        assert_eq!(
            example.ids[1],
            feature_id(1, None),
            "an empty multi-valued cell is the missing id"
        );
        assert_eq!((example.dense[0], example.slot_ends.clone()), (0.0, vec![1, 2, 3]));
    }

    #[test]
    fn bad_cells_name_their_column() {
        let p = parser();
        let roles = p.roles(Some(&header())).expect("roles");
        let err = |row: [&str; 5]| p.example(&roles, |c| text(row[c])).expect_err("bad");
        assert_eq!(
            err(["a", "2", "", "1", "1"]),
            "column 1 \"click\" (label): \"2\" is not a click label: it must be 0 or 1"
        );
        assert_eq!(
            err(["a", "0", "", "x", "1"]),
            "column 3 \"price\" (dense 0): \"x\" is not a number"
        );
        assert_eq!(
            err(["a", "0", "", "1", "10"]),
            "column 4 \"country\" (slot 2): \"10\" is not an integer id in [0, 10)"
        );
    }

    #[test]
    fn hashes_are_stable() {
        // The contract's values: a change here changes every id of every trained table.
        assert_eq!(text_hash(""), mix64(0xcbf2_9ce4_8422_2325));
        assert_ne!(text_hash("a"), text_hash("b"));
    }
}
