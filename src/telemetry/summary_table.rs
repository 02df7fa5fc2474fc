//! The table a run prints at its end: every figure of its `summary.json`, one per row, so the
//! two can never disagree.

use anyhow::Result;
use serde::Serialize;
use serde_json::Value;

/// The widest the table is drawn: a long figure (a parameter-server job's per-shard lists)
/// wraps within its cell instead of widening every row.
const WIDTH: u16 = 100;

/// `summary` as a two-column table of its fields, in their order.
pub fn render(title: &str, summary: &impl Serialize) -> Result<String> {
    let Value::Object(fields) = serde_json::to_value(summary)? else {
        anyhow::bail!("a summary is a set of named figures");
    };
    let mut table = comfy_table::Table::new();
    table
        .load_style(comfy_table::presets::ASCII_FULL_CONDENSED)
        .set_content_arrangement(comfy_table::ContentArrangement::Dynamic)
        .set_width(WIDTH)
        .set_header(["figure", "value"]);
    for (key, value) in &fields {
        table.add_row([key.clone(), cell(value)]);
    }
    if let Some(values) = table.column_mut(1) {
        values.set_cell_alignment(comfy_table::CellAlignment::Right);
    }
    Ok(format!("{title}\n{table}\n"))
}

/// A figure as shown: floats to four significant digits, lists and objects as compact JSON.
fn cell(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) if n.is_f64() => n.as_f64().map_or_else(|| n.to_string(), significant),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            let cells: Vec<String> = items.iter().map(cell).collect();
            format!("[{}]", cells.join(", "))
        }
        other => other.to_string(),
    }
}

fn significant(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return x.to_string();
    }
    let digits = (3 - x.abs().log10().floor() as i32).max(0) as usize;
    format!("{x:.digits$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Figures {
        strategy: &'static str,
        steps: usize,
        final_loss: f32,
        samples_per_sec: f64,
        per_stage: Vec<usize>,
    }

    #[test]
    fn every_field_is_a_row_in_order() -> Result<()> {
        let table = render(
            "run",
            &Figures {
                strategy: "collective",
                steps: 300,
                final_loss: 0.123456,
                samples_per_sec: 12345.678,
                per_stage: vec![1, 2],
            },
        )?;
        let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(rows.len(), 6, "{table}");
        assert!(
            rows[1].contains("strategy") && rows[1].contains("collective"),
            "{table}"
        );
        assert!(rows[3].contains("0.1235"), "{table}");
        assert!(rows[4].contains("12346"), "{table}");
        assert!(rows[5].contains("[1, 2]"), "{table}");
        let widths: Vec<usize> = table.lines().skip(1).map(|l| l.chars().count()).collect();
        assert!(widths.windows(2).all(|w| w[0] == w[1]), "ragged table:\n{table}");
        Ok(())
    }
}
