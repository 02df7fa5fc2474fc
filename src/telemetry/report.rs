//! `flotilla report`: a run's `metrics.jsonl` drawn against step as one PNG, in three panels —
//! loss with the spread of the ranks' losses, throughput, and the share of step time spent
//! communicating (and, for pipeline jobs, waiting in the bubble).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{bail, ensure, Context as _, Result};
use plotters::coord::types::{RangedCoordf64, RangedCoordu64};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::register_font;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

use super::metrics::{read_metrics, StepMetrics, METRICS_FILE};

/// Width and height of the report, in pixels.
pub const IMAGE_SIZE: (u32, u32) = (1200, 1000);

/// Steps the throughput's moving average spans.
const MOVING_AVERAGE_STEPS: usize = 20;

/// The share of step time communication should stay under, in percent.
const COMM_TARGET_PERCENT: f64 = 20.0;

/// Width of the column right of the charts that holds their legends, so no legend covers a line.
const LEGEND_WIDTH: u32 = 230;

/// The family every text asks for: plotters' own defaults ask for it too.
const FONT: &str = "sans-serif";

/// DejaVu Sans (licence in `assets/fonts/`), embedded so the report looks the same on every machine.
static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

const LOSS: RGBColor = RGBColor(31, 119, 180);
const THROUGHPUT: RGBColor = RGBColor(44, 160, 44);
const COMM: RGBColor = RGBColor(214, 39, 40);
const BUBBLE: RGBColor = RGBColor(148, 103, 189);
const EXPOSED: RGBColor = RGBColor(255, 127, 14);
const TARGET: RGBColor = RGBColor(90, 90, 90);
const GRID: RGBColor = RGBColor(225, 225, 225);
const GRID_MINOR: RGBColor = RGBColor(243, 243, 243);

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordu64, RangedCoordf64>>;

/// Draws `run_dir/metrics.jsonl` (and the title from `run_dir/summary.json`, where there is
/// one) into the PNG `out`, [`IMAGE_SIZE`] pixels.
pub fn render(run_dir: &Path, out: &Path) -> Result<()> {
    ensure!(
        out.extension().is_some_and(|e| e.eq_ignore_ascii_case("png")),
        "{}: the report is a PNG; give a file name ending in .png",
        out.display()
    );
    let steps = load_steps(run_dir)?;
    register_fonts()?;
    let root = BitMapBackend::new(out, IMAGE_SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let body = root
        .titled(&title(run_dir, steps.len()), (FONT, 26))?
        .margin(0, 0, 10, 0);
    let (charts, legends) = body.split_horizontally(IMAGE_SIZE.0 - LEGEND_WIDTH);
    let (charts, legends) = (charts.split_evenly((3, 1)), legends.split_evenly((3, 1)));
    let steps_range = step_range(&steps);
    draw_loss(&charts[0], &legends[0], &steps, steps_range.clone())?;
    draw_throughput(&charts[1], &legends[1], &steps, steps_range.clone())?;
    draw_comm(&charts[2], &legends[2], &steps, steps_range)?;
    root.present().with_context(|| format!("writing {}", out.display()))
}

/// Every step's metrics in step order; where a resumed run wrote a step twice, its later line.
fn load_steps(run_dir: &Path) -> Result<Vec<StepMetrics>> {
    let path = run_dir.join(METRICS_FILE);
    if !path.exists() {
        bail!(
            "{} not found: every training run writes its per-step metrics there; is {} a run directory \
             (train's --run-dir)?",
            path.display(),
            run_dir.display()
        );
    }
    let by_step: BTreeMap<usize, StepMetrics> = read_metrics(&path)?.into_iter().map(|m| (m.step, m)).collect();
    ensure!(!by_step.is_empty(), "{}: no steps recorded", path.display());
    Ok(by_step.into_values().collect())
}

/// Registers the embedded font under [`FONT`], once per process.
fn register_fonts() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let registered = *REGISTERED.get_or_init(|| register_font(FONT, FontStyle::Normal, DEJAVU_SANS).is_ok());
    ensure!(registered, "the embedded DejaVu Sans font does not parse");
    Ok(())
}

/// "strategy · cluster × ranks · N steps" from `summary.json`; the run directory's name in
/// their place where it is absent.
fn title(run_dir: &Path, steps: usize) -> String {
    let mut parts = summary_parts(run_dir);
    if parts.is_empty() {
        parts.push(
            run_dir
                .file_name()
                .unwrap_or(run_dir.as_os_str())
                .to_string_lossy()
                .into_owned(),
        );
    }
    parts.push(format!("{steps} step{}", if steps == 1 { "" } else { "s" }));
    parts.join(" · ")
}

/// The strategy and "cluster × ranks" of `summary.json`, as far as it says them.
fn summary_parts(run_dir: &Path) -> Vec<String> {
    let path = run_dir.join("summary.json");
    if !path.exists() {
        return Vec::new();
    }
    let read = || -> Result<Value> { Ok(serde_json::from_str(&std::fs::read_to_string(&path)?)?) };
    let summary = match read() {
        Ok(summary) => summary,
        // The metrics alone make the report; a bad summary only costs the title.
        Err(e) => {
            tracing::warn!("{}: {e}; the title leaves it out", path.display());
            return Vec::new();
        }
    };
    let strategy = summary.get("strategy").and_then(Value::as_str);
    let cluster = summary.get("cluster").and_then(Value::as_str);
    // Parameter-server summaries count trainers instead.
    let ranks = summary
        .get("world_size")
        .or_else(|| summary.get("trainers"))
        .and_then(Value::as_u64);
    let placement = match (cluster, ranks) {
        (Some(cluster), Some(ranks)) => Some(format!("{cluster} × {ranks}")),
        (Some(cluster), None) => Some(cluster.to_owned()),
        (None, Some(ranks)) => Some(format!("{ranks} ranks")),
        (None, None) => None,
    };
    strategy.map(str::to_owned).into_iter().chain(placement).collect()
}

/// The steps' span; one step gets one step of room either side.
fn step_range(steps: &[StepMetrics]) -> Range<u64> {
    let first = steps.first().map_or(0, |m| m.step as u64);
    let last = steps.last().map_or(0, |m| m.step as u64);
    if first == last {
        first.saturating_sub(1)..last + 1
    } else {
        first..last
    }
}

/// The smallest range holding every finite value, widened 5 % each side so no line runs along the
/// frame; equal values get 10 % of their size (or 1) either side, since plotters needs a non-empty
/// range; 0..1 without any finite value.
fn padded_range(values: impl IntoIterator<Item = f64>) -> Range<f64> {
    let (low, high) = values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| {
            (low.min(v), high.max(v))
        });
    if low > high {
        return 0.0..1.0;
    }
    let size = low.abs().max(high.abs());
    let pad = if high - low > size * 1e-9 {
        (high - low) * 0.05
    } else if size > 0.0 {
        size * 0.1
    } else {
        1.0
    };
    low - pad..high + pad
}

/// Each point's mean over itself and the `window - 1` points before it (fewer at the start).
fn moving_average(points: &[(u64, f64)], window: usize) -> Vec<(u64, f64)> {
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(step, value))| {
            sum += value;
            if i >= window {
                sum -= points[i - window].1;
            }
            (step, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

/// A panel's chart: its caption, the step axis below and `y` on the left, a grid.
fn panel<'a, 'b>(
    area: &'a Area<'b>,
    caption: &str,
    steps: Range<u64>,
    y: Range<f64>,
    y_desc: &str,
) -> Result<Chart<'a, 'b>> {
    // Ticks come in 1, 2 and 5 times a power of ten, about ten to the range: one decimal more
    // than the range's order of magnitude shows them all apart.
    let decimals = (1.0 - (y.end - y.start).log10().floor()).clamp(0.0, 9.0) as usize;
    let y_label = |v: &f64| format!("{v:.decimals$}");
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 19))
        .margin(8)
        .x_label_area_size(46)
        .y_label_area_size(84)
        .build_cartesian_2d(steps, y)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .y_label_formatter(&y_label)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .bold_line_style(GRID)
        .light_line_style(GRID_MINOR)
        .max_light_lines(1)
        .draw()?;
    Ok(chart)
}

/// How a legend shows a series.
enum Sample {
    Line(ShapeStyle),
    Dashed(ShapeStyle),
    Band(ShapeStyle),
}

/// Draws one line per entry in `column` (right of `chart`, which plotters' own legends cannot
/// reach), from the height of the chart's top.
fn legend(column: &Area, chart: &Chart, entries: &[(Sample, String)]) -> Result<()> {
    let top = chart.plotting_area().get_pixel_range().1.start - column.get_base_pixel().1;
    let text = TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (row, (sample, label)) in (0..).zip(entries) {
        let y = top + 12 + 26 * row;
        match *sample {
            Sample::Line(style) => column.draw(&PathElement::new([(12, y), (40, y)], style))?,
            Sample::Dashed(style) => {
                column.draw(&PathElement::new([(12, y), (22, y)], style))?;
                column.draw(&PathElement::new([(30, y), (40, y)], style))?;
            }
            Sample::Band(style) => column.draw(&Rectangle::new([(12, y - 7), (40, y + 7)], style))?,
        }
        column.draw(&Text::new(label.as_str(), (50, y), text.clone()))?;
    }
    Ok(())
}

/// A line through `points`; a lone point, which makes no line, is drawn as a dot.
fn line<DB: DrawingBackend>(points: Vec<(u64, f64)>, style: ShapeStyle) -> LineSeries<DB, (u64, f64)> {
    let dot = if points.len() == 1 { 4 } else { 0 };
    LineSeries::new(points, style).point_size(dot)
}

fn draw_loss(area: &Area, column: &Area, steps: &[StepMetrics], steps_range: Range<u64>) -> Result<()> {
    // (step, loss, half the spread) where the loss is a number.
    let finite: Vec<(u64, f64, f64)> = steps
        .iter()
        .filter(|m| m.loss.is_finite())
        .map(|m| {
            let half_spread = m
                .loss_spread
                .filter(|s| s.is_finite())
                .map_or(0.0, |s| f64::from(s.abs()) / 2.0);
            (m.step as u64, f64::from(m.loss), half_spread)
        })
        .collect();
    let skipped = steps.len() - finite.len();
    let caption = if skipped == 0 {
        String::from("Loss, mean over the global batch; band: ± half the spread of the ranks' losses")
    } else {
        let plural = if skipped == 1 { "" } else { "es" };
        format!("Loss; band: ± half the ranks' spread — {skipped} non-finite loss{plural} not drawn")
    };
    let y = padded_range(finite.iter().flat_map(|&(_, loss, half)| [loss - half, loss + half]));
    let mut chart = panel(area, &caption, steps_range, y, "loss")?;
    let mut entries = Vec::new();
    if finite.iter().any(|&(_, _, half)| half > 0.0) {
        let upper: Vec<(u64, f64)> = finite.iter().map(|&(s, loss, half)| (s, loss + half)).collect();
        let lower: Vec<(u64, f64)> = finite.iter().map(|&(s, loss, half)| (s, loss - half)).collect();
        let band: Vec<(u64, f64)> = upper.iter().chain(lower.iter().rev()).copied().collect();
        let fill = LOSS.mix(0.18).filled();
        chart.draw_series(std::iter::once(Polygon::new(band, fill)))?;
        let edge = LOSS.mix(0.45).stroke_width(1);
        chart.draw_series(line(upper, edge))?;
        chart.draw_series(line(lower, edge))?;
        entries.push((Sample::Band(fill), "± spread / 2 (ranks)".to_owned()));
    }
    let style = LOSS.stroke_width(2);
    chart.draw_series(line(finite.iter().map(|&(s, loss, _)| (s, loss)).collect(), style))?;
    entries.insert(0, (Sample::Line(style), "loss".to_owned()));
    legend(column, &chart, &entries)
}

fn draw_throughput(area: &Area, column: &Area, steps: &[StepMetrics], steps_range: Range<u64>) -> Result<()> {
    let raw: Vec<(u64, f64)> = steps
        .iter()
        .filter(|m| m.samples_per_sec.is_finite())
        .map(|m| (m.step as u64, m.samples_per_sec))
        .collect();
    let average = moving_average(&raw, MOVING_AVERAGE_STEPS);
    // From zero, so a dip reads as the share of throughput it costs.
    let top = padded_range(raw.iter().map(|&(_, v)| v).chain([0.0])).end;
    let mut chart = panel(area, "Throughput", steps_range, 0.0..top, "samples / s")?;
    let thin = THROUGHPUT.mix(0.4).stroke_width(1);
    chart.draw_series(line(raw, thin))?;
    let bold = THROUGHPUT.stroke_width(3);
    chart.draw_series(line(average, bold))?;
    let entries = [
        (Sample::Line(thin), "per step".to_owned()),
        (Sample::Line(bold), format!("mean of last {MOVING_AVERAGE_STEPS} steps")),
    ];
    legend(column, &chart, &entries)
}

fn draw_comm(area: &Area, column: &Area, steps: &[StepMetrics], steps_range: Range<u64>) -> Result<()> {
    let percent = |ratio: f64| ratio.is_finite().then_some(100.0 * ratio);
    let comm: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|m| Some((m.step as u64, percent(m.comm_time_ratio)?)))
        .collect();
    // Per-step shares swing with scheduling noise: their moving averages carry the story.
    let exposed = moving_average(
        &steps
            .iter()
            .filter_map(|m| Some((m.step as u64, percent(m.exposed_comm_ratio)?)))
            .collect::<Vec<_>>(),
        MOVING_AVERAGE_STEPS,
    );
    let comm_average = moving_average(&comm, MOVING_AVERAGE_STEPS);
    let bubble: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|m| Some((m.step as u64, percent(m.bubble_fraction?)?)))
        .collect();
    let caption = if bubble.is_empty() {
        "Communication, share of step time"
    } else {
        "Communication and pipeline bubble, share of step time"
    };
    // Always up to past the target, so the target line shows.
    let values = comm.iter().chain(&bubble).map(|&(_, v)| v);
    let top = padded_range(values.chain([0.0, COMM_TARGET_PERCENT * 1.2])).end;
    let target = [steps_range.start, steps_range.end].map(|s| (s, COMM_TARGET_PERCENT));
    let mut chart = panel(area, caption, steps_range, 0.0..top, "% of step time")?;
    let dashed = TARGET.stroke_width(2);
    chart.draw_series(DashedLineSeries::new(target, 10, 6, dashed))?;
    let mut entries = vec![(Sample::Dashed(dashed), format!("target < {COMM_TARGET_PERCENT} %"))];
    let thin = COMM.mix(0.3).stroke_width(1);
    chart.draw_series(line(comm, thin))?;
    let style = COMM.stroke_width(2);
    chart.draw_series(line(comm_average, style))?;
    entries.push((Sample::Line(style), "in collectives".to_owned()));
    let style = EXPOSED.stroke_width(2);
    chart.draw_series(line(exposed, style))?;
    entries.push((Sample::Line(style), "compute blocked".to_owned()));
    if !bubble.is_empty() {
        let style = BUBBLE.stroke_width(2);
        chart.draw_series(line(bubble, style))?;
        entries.push((Sample::Line(style), "pipeline bubble".to_owned()));
    }
    legend(column, &chart, &entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2-rank-like run of `n` steps: loss falling, ranks disagreeing less, throughput
    /// warming up, communication around the target; pipeline runs report a bubble.
    fn synthetic(n: usize, pipeline: bool) -> Vec<StepMetrics> {
        (1..=n)
            .map(|step| {
                let t = step as f64;
                let wobble = (t * 0.7).sin();
                StepMetrics {
                    step,
                    elapsed_s: t * 0.05,
                    step_time_s: 0.05,
                    samples_per_sec: 5000.0 + 400.0 * wobble - if step == 1 { 3000.0 } else { 0.0 },
                    comm_time_ratio: 0.18 + 0.04 * wobble,
                    exposed_comm_ratio: 0.06 + 0.02 * wobble,
                    bubble_fraction: pipeline.then_some(0.3 + 0.02 * wobble),
                    peak_rss_bytes: 200 << 20,
                    gpu_memory_bytes: None,
                    gpu_utilization: None,
                    lr: 0.1,
                    loss: (2.3 * (-t / 30.0).exp() + 0.1) as f32,
                    loss_spread: Some((0.2 * (-t / 60.0).exp()) as f32),
                    sparse_tables: None,
                }
            })
            .collect()
    }

    fn write_metrics(dir: &Path, steps: &[StepMetrics]) -> Result<()> {
        let mut text = String::new();
        for m in steps {
            text += &serde_json::to_string(m)?;
            text.push('\n');
        }
        std::fs::write(dir.join(METRICS_FILE), text)?;
        Ok(())
    }

    /// Width and height from the PNG's signature and IHDR chunk.
    fn png_size(path: &Path) -> Result<(u32, u32)> {
        let bytes = std::fs::read(path)?;
        ensure!(bytes.len() > 24, "{} is too short for a PNG", path.display());
        ensure!(
            bytes[..8] == *b"\x89PNG\r\n\x1a\n",
            "{} has no PNG signature",
            path.display()
        );
        ensure!(bytes[12..16] == *b"IHDR", "{} does not start with IHDR", path.display());
        let be = |at: usize| -> Result<u32> { Ok(u32::from_be_bytes(bytes[at..at + 4].try_into()?)) };
        Ok((be(16)?, be(20)?))
    }

    fn render_into_tempdir(steps: &[StepMetrics], summary: Option<&str>) -> Result<(u32, u32)> {
        let dir = tempfile::tempdir()?;
        write_metrics(dir.path(), steps)?;
        if let Some(summary) = summary {
            std::fs::write(dir.path().join("summary.json"), summary)?;
        }
        let out = dir.path().join("report.png");
        render(dir.path(), &out)?;
        png_size(&out)
    }

    #[test]
    fn a_collective_run_renders_at_the_declared_size() -> Result<()> {
        let mut steps = synthetic(50, false);
        steps[10].loss = f32::NAN;
        steps[11].loss = f32::INFINITY;
        let summary = r#"{"strategy": "collective", "world_size": 2, "cluster": "in-process"}"#;
        assert_eq!(render_into_tempdir(&steps, Some(summary))?, IMAGE_SIZE);
        Ok(())
    }

    #[test]
    fn a_pipeline_run_renders_its_bubble() -> Result<()> {
        let summary = r#"{"strategy": "pipeline", "world_size": 4, "cluster": "multi-process"}"#;
        assert_eq!(render_into_tempdir(&synthetic(50, true), Some(summary))?, IMAGE_SIZE);
        Ok(())
    }

    #[test]
    fn one_step_and_equal_values_render() -> Result<()> {
        assert_eq!(render_into_tempdir(&synthetic(1, true), None)?, IMAGE_SIZE);
        let flat: Vec<StepMetrics> = synthetic(5, false)
            .into_iter()
            .map(|m| StepMetrics {
                loss: 0.0,
                loss_spread: Some(0.0),
                sparse_tables: None,
                samples_per_sec: 0.0,
                comm_time_ratio: 0.0,
                ..m
            })
            .collect();
        assert_eq!(render_into_tempdir(&flat, Some("not json"))?, IMAGE_SIZE);
        Ok(())
    }

    #[test]
    fn a_repeated_step_keeps_its_later_line() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut steps = synthetic(3, false);
        let mut again = steps[1].clone();
        again.loss = 9.0;
        steps.push(again);
        write_metrics(dir.path(), &steps)?;
        let loaded = load_steps(dir.path())?;
        assert_eq!(loaded.iter().map(|m| m.step).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(loaded[1].loss, 9.0);
        Ok(())
    }

    #[test]
    fn a_missing_or_empty_log_is_explained() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let out = dir.path().join("report.png");
        let error = format!("{:#}", render(dir.path(), &out).unwrap_err());
        let path = dir.path().join(METRICS_FILE);
        assert!(error.contains(&path.display().to_string()), "{error}");
        assert!(error.contains("every training run writes"), "{error}");
        std::fs::write(&path, "\n")?;
        let error = format!("{:#}", render(dir.path(), &out).unwrap_err());
        assert!(error.contains("no steps recorded"), "{error}");
        assert!(!out.exists());
        Ok(())
    }

    #[test]
    fn title_names_strategy_cluster_and_ranks() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let summary = r#"{"strategy": "collective", "world_size": 2, "cluster": "in-process", "steps": 7}"#;
        std::fs::write(dir.path().join("summary.json"), summary)?;
        assert_eq!(title(dir.path(), 300), "collective · in-process × 2 · 300 steps");
        Ok(())
    }

    #[test]
    fn ranges_are_never_empty() {
        assert_eq!(padded_range([]), 0.0..1.0);
        assert_eq!(padded_range([f64::NAN, f64::INFINITY]), 0.0..1.0);
        assert_eq!(padded_range([0.0, 0.0]), -1.0..1.0);
        let r = padded_range([2.0, 2.0]);
        assert!(r.start < 2.0 && r.end > 2.0, "{r:?}");
    }

    #[test]
    fn moving_average_covers_what_came_before() {
        let points: Vec<(u64, f64)> = (1..=4).map(|s| (s, s as f64)).collect();
        assert_eq!(moving_average(&points, 2), [(1, 1.0), (2, 1.5), (3, 2.5), (4, 3.5)]);
    }
}
