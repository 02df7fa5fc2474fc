//! `flotilla report`: a run's `metrics.jsonl` drawn against step as one PNG, in three panels —
//! loss with the spread of the ranks' losses, throughput, and the share of step time spent
//! communicating (and, for pipeline jobs, waiting in the bubble).
//!
//! Long runs stay readable: beyond `MAX_POINTS` steps each panel draws one point per bin of
//! steps — the smoothed curve through the bins' means over a light band of each bin's range —
//! the smoothing window grows with the run, a loss spanning more than a decade is drawn on a
//! log scale, and a panel's range leaves out the rarest spikes (the top 0.5 % of values).

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

/// Steps a moving average spans at least; longer runs smooth over a 1/200 of their steps.
const MOVING_AVERAGE_STEPS: usize = 20;

/// Most points a curve draws: about one per pixel column of a chart.
const MAX_POINTS: usize = 800;

/// The share of the highest values a panel's range may leave out, so one spike does not flatten
/// the rest.
const SPIKE_SHARE: f64 = 0.005;

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
/// one) into the PNG `out`, [`IMAGE_SIZE`] pixels; the loss of the run in `compare` (another
/// run directory) overlaid on its loss, where given.
pub fn render(run_dir: &Path, out: &Path, compare: Option<&Path>) -> Result<()> {
    ensure!(
        out.extension().is_some_and(|e| e.eq_ignore_ascii_case("png")),
        "{}: the report is a PNG; give a file name ending in .png",
        out.display()
    );
    let steps = load_steps(run_dir)?;
    let other = compare
        .map(|dir| Ok::<_, anyhow::Error>((run_name(dir), load_steps(dir)?)))
        .transpose()?;
    register_fonts()?;
    let root = BitMapBackend::new(out, IMAGE_SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let body = root
        .titled(&title(run_dir, steps.len()), (FONT, 26))?
        .margin(0, 0, 10, 0);
    let (charts, legends) = body.split_horizontally(IMAGE_SIZE.0 - LEGEND_WIDTH);
    let (charts, legends) = (charts.split_evenly((3, 1)), legends.split_evenly((3, 1)));
    let steps_range = step_range(&steps);
    let losses = Losses {
        steps: &steps,
        name: run_name(run_dir),
        other: other.as_ref().map(|(name, steps)| (name.as_str(), &steps[..])),
    };
    draw_loss(&charts[0], &legends[0], &losses, steps_range.clone())?;
    draw_throughput(&charts[1], &legends[1], &steps, steps_range.clone())?;
    draw_comm(
        &charts[2],
        &legends[2],
        &steps,
        steps_range,
        on_parameter_servers(run_dir),
    )?;
    root.present().with_context(|| format!("writing {}", out.display()))
}

/// Whether the run trained on parameter servers, whose communication is pulls and pushes: its
/// resolved `config.toml` has servers (a running job has no summary yet).
fn on_parameter_servers(run_dir: &Path) -> bool {
    let config = std::fs::read_to_string(run_dir.join("config.toml")).unwrap_or_default();
    let servers = toml::from_str::<toml::Table>(&config)
        .ok()
        .and_then(|t| t.get("cluster")?.get("server_num")?.as_integer());
    servers.is_some_and(|n| n > 0)
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

/// The run directory's name.
fn run_name(run_dir: &Path) -> String {
    run_dir
        .file_name()
        .unwrap_or(run_dir.as_os_str())
        .to_string_lossy()
        .into_owned()
}

/// "strategy · cluster × ranks · N steps" from `summary.json`; the run directory's name in
/// their place where it is absent.
fn title(run_dir: &Path, steps: usize) -> String {
    let mut parts = summary_parts(run_dir);
    if parts.is_empty() {
        parts.push(run_name(run_dir));
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

/// The moving-average window for a run of `steps` steps.
fn smoothing_window(steps: usize) -> usize {
    MOVING_AVERAGE_STEPS.max(steps / 200)
}

/// A bin of consecutive points: its last step, and the mean, least and most of its values.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bin {
    step: u64,
    mean: f64,
    low: f64,
    high: f64,
}

/// `points` in at most [`MAX_POINTS`] bins of consecutive points (one point each when there are
/// fewer).
fn bins(points: &[(u64, f64)]) -> Vec<Bin> {
    let size = points.len().div_ceil(MAX_POINTS).max(1);
    points
        .chunks(size)
        .map(|chunk| {
            let values = chunk.iter().map(|&(_, v)| v);
            Bin {
                step: chunk[chunk.len() - 1].0,
                mean: values.clone().sum::<f64>() / chunk.len() as f64,
                low: values.clone().fold(f64::INFINITY, f64::min),
                high: values.fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect()
}

/// The bins' means as a curve.
fn means(bins: &[Bin]) -> Vec<(u64, f64)> {
    bins.iter().map(|b| (b.step, b.mean)).collect()
}

/// The value below which all but the top [`SPIKE_SHARE`] of `values` lie.
fn spike_ceiling(values: &[f64]) -> f64 {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let keep = ((sorted.len() as f64) * (1.0 - SPIKE_SHARE)).ceil() as usize;
    sorted.get(keep.saturating_sub(1)).copied().unwrap_or(0.0)
}

/// Draws `bins`' ranges as a light band (nothing when each bin holds one point).
fn draw_range_band(chart: &mut Chart, bins: &[Bin], color: RGBColor) -> Result<bool> {
    if bins.iter().all(|b| b.low == b.high) {
        return Ok(false);
    }
    let upper = bins.iter().map(|b| (b.step, b.high));
    let lower = bins.iter().rev().map(|b| (b.step, b.low));
    let band: Vec<(u64, f64)> = upper.chain(lower).collect();
    chart.draw_series(std::iter::once(Polygon::new(band, color.mix(0.2).filled())))?;
    Ok(true)
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

/// A panel's chart: its caption, the step axis below and `y` on the left, a grid. On a `log`
/// panel `y` is in powers of ten, labelled with the values.
fn panel<'a, 'b>(
    area: &'a Area<'b>,
    caption: &str,
    steps: Range<u64>,
    y: Range<f64>,
    (y_desc, log): (&str, bool),
) -> Result<Chart<'a, 'b>> {
    // Ticks come in 1, 2 and 5 times a power of ten, about ten to the range: one decimal more
    // than the range's order of magnitude shows them all apart.
    let decimals = (1.0 - (y.end - y.start).log10().floor()).clamp(0.0, 9.0) as usize;
    let y_label = |v: &f64| match log {
        true => {
            let value = 10f64.powf(*v);
            if value >= 0.01 {
                format!("{value:.3}")
            } else {
                format!("{value:.2e}")
            }
        }
        false => format!("{v:.decimals$}"),
    };
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

/// A line's `(step, value)` points.
type Points = Vec<(u64, f64)>;

/// The losses the loss panel draws: the run's, and another run's to compare, by name.
struct Losses<'a> {
    steps: &'a [StepMetrics],
    name: String,
    other: Option<(&'a str, &'a [StepMetrics])>,
}

/// `(step, loss)` of each step whose loss is a number.
fn finite_losses(steps: &[StepMetrics]) -> Vec<(u64, f64)> {
    steps
        .iter()
        .filter(|m| m.loss.is_finite())
        .map(|m| (m.step as u64, f64::from(m.loss)))
        .collect()
}

fn draw_loss(area: &Area, column: &Area, losses: &Losses, steps_range: Range<u64>) -> Result<()> {
    let steps = losses.steps;
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
    let raw: Vec<(u64, f64)> = finite.iter().map(|&(s, loss, _)| (s, loss)).collect();
    let other: Option<(&str, Vec<(u64, f64)>)> = losses.other.map(|(name, steps)| (name, finite_losses(steps)));
    let others = other.iter().flat_map(|(_, points)| points.iter().map(|&(_, v)| v));
    let values: Vec<f64> = raw.iter().map(|&(_, v)| v).chain(others).collect();
    let ceiling = spike_ceiling(&values);
    let floor = values.iter().copied().fold(f64::INFINITY, f64::min);
    // A loss falling over decades is read on a log scale; a flat line at 0 otherwise.
    let log = floor > 0.0 && ceiling / floor > 10.0;
    let scale = |v: f64| if log { v.max(floor).log10() } else { v };
    let long = raw.len() > MAX_POINTS;
    let window = smoothing_window(raw.len());
    let caption = loss_caption(log, long, steps.len() - finite.len());
    let drawn = finite.iter().filter(|&&(_, loss, _)| loss <= ceiling);
    let compared = other
        .iter()
        .flat_map(|(_, points)| points.iter().map(|&(_, v)| v).filter(|&v| v <= ceiling));
    let y = match long {
        true => padded_range(drawn.map(|&(_, loss, _)| scale(loss)).chain(compared.map(scale))),
        false => padded_range(
            drawn
                .flat_map(|&(_, loss, half)| [scale(loss - half), scale(loss + half)])
                .chain(compared.map(scale)),
        ),
    };
    let mut chart = panel(area, &caption, steps_range, y, ("loss", log))?;
    let scaled = |points: Vec<(u64, f64)>| points.into_iter().map(|(s, v)| (s, scale(v))).collect::<Vec<_>>();
    let mut entries = Vec::new();
    if long {
        let binned: Vec<Bin> = bins(&scaled(raw.clone()));
        if draw_range_band(&mut chart, &binned, LOSS)? {
            entries.push((Sample::Band(LOSS.mix(0.2).filled()), "range per bin".to_owned()));
        }
        let style = LOSS.stroke_width(2);
        let smoothed = means(&bins(&scaled(moving_average(&raw, window))));
        chart.draw_series(line(smoothed, style))?;
        entries.insert(0, (Sample::Line(style), format!("mean of last {window} steps")));
    } else {
        if finite.iter().any(|&(_, _, half)| half > 0.0) {
            let upper: Vec<(u64, f64)> = finite.iter().map(|&(s, loss, half)| (s, scale(loss + half))).collect();
            let lower: Vec<(u64, f64)> = finite.iter().map(|&(s, loss, half)| (s, scale(loss - half))).collect();
            let band: Vec<(u64, f64)> = upper.iter().chain(lower.iter().rev()).copied().collect();
            let fill = LOSS.mix(0.18).filled();
            chart.draw_series(std::iter::once(Polygon::new(band, fill)))?;
            let edge = LOSS.mix(0.45).stroke_width(1);
            chart.draw_series(line(upper, edge))?;
            chart.draw_series(line(lower, edge))?;
            entries.push((Sample::Band(fill), "± spread / 2 (ranks)".to_owned()));
        }
        let style = LOSS.stroke_width(2);
        chart.draw_series(line(scaled(raw), style))?;
        entries.insert(0, (Sample::Line(style), "loss".to_owned()));
    }
    if let Some(other) = other {
        let smoothing = long.then_some(window);
        overlay(&mut chart, &mut entries, (&losses.name, other), smoothing, &scaled)?;
    }
    legend(column, &chart, &entries)
}

/// The loss panel's caption: its scale, what its band shows, how many losses were not drawn.
fn loss_caption(log: bool, long: bool, skipped: usize) -> String {
    let mut caption = String::from("Loss, mean over the global batch");
    if log {
        caption += ", log scale";
    }
    caption += match long {
        true => "; band: range per bin of steps",
        false => "; band: ± half the ranks' spread",
    };
    if skipped > 0 {
        caption += &format!(" — {skipped} non-finite not drawn");
    }
    caption
}

/// Draws another run's loss `points` over this run's (named `this`) in `chart`, smoothed and
/// binned as this run's is (over `smoothing` steps, where it is), each line in `entries` named
/// by its run.
fn overlay(
    chart: &mut Chart,
    entries: &mut Vec<(Sample, String)>,
    (this, (name, points)): (&str, (&str, Points)),
    smoothing: Option<usize>,
    scaled: &dyn Fn(Points) -> Points,
) -> Result<()> {
    entries[0].1 = this.to_owned();
    let style = EXPOSED.stroke_width(2);
    let points = match smoothing {
        Some(window) => means(&bins(&scaled(moving_average(&points, window)))),
        None => scaled(points),
    };
    chart.draw_series(line(points, style))?;
    entries.insert(1, (Sample::Line(style), name.to_owned()));
    Ok(())
}

fn draw_throughput(area: &Area, column: &Area, steps: &[StepMetrics], steps_range: Range<u64>) -> Result<()> {
    let raw: Vec<(u64, f64)> = steps
        .iter()
        .filter(|m| m.samples_per_sec.is_finite())
        .map(|m| (m.step as u64, m.samples_per_sec))
        .collect();
    let window = smoothing_window(raw.len());
    let average = means(&bins(&moving_average(&raw, window)));
    // From zero, so a dip reads as the share of throughput it costs.
    let values: Vec<f64> = raw.iter().map(|&(_, v)| v).collect();
    let top = padded_range([0.0, spike_ceiling(&values)]).end;
    let mut chart = panel(area, "Throughput", steps_range, 0.0..top, ("samples / s", false))?;
    let binned = bins(&raw);
    let mut entries = Vec::new();
    if draw_range_band(&mut chart, &binned, THROUGHPUT)? {
        entries.push((Sample::Band(THROUGHPUT.mix(0.2).filled()), "range per bin".to_owned()));
    } else {
        let thin = THROUGHPUT.mix(0.4).stroke_width(1);
        chart.draw_series(line(means(&binned), thin))?;
        entries.push((Sample::Line(thin), "per step".to_owned()));
    }
    let bold = THROUGHPUT.stroke_width(3);
    chart.draw_series(line(average, bold))?;
    entries.push((Sample::Line(bold), format!("mean of last {window} steps")));
    legend(column, &chart, &entries)
}

fn draw_comm(
    area: &Area,
    column: &Area,
    steps: &[StepMetrics],
    steps_range: Range<u64>,
    parameter_servers: bool,
) -> Result<()> {
    let percent = |ratio: f64| ratio.is_finite().then_some(100.0 * ratio);
    let comm: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|m| Some((m.step as u64, percent(m.comm_time_ratio)?)))
        .collect();
    let window = smoothing_window(comm.len());
    // Per-step shares swing with scheduling noise: their moving averages carry the story.
    let exposed = moving_average(
        &steps
            .iter()
            .filter_map(|m| Some((m.step as u64, percent(m.exposed_comm_ratio)?)))
            .collect::<Vec<_>>(),
        window,
    );
    let comm_average = moving_average(&comm, window);
    let bubble: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|m| Some((m.step as u64, percent(m.bubble_fraction?)?)))
        .collect();
    let (caption, busy, blocked) = match (parameter_servers, bubble.is_empty()) {
        (true, _) => (
            "Pulls and pushes, share of step time",
            "pulling and pushing",
            "compute waiting on pulls",
        ),
        (false, true) => ("Communication, share of step time", "in collectives", "compute blocked"),
        (false, false) => (
            "Communication and pipeline bubble, share of step time",
            "in collectives",
            "compute blocked",
        ),
    };
    // Always up to past the target, so the target line shows.
    let values: Vec<f64> = comm.iter().chain(&bubble).map(|&(_, v)| v).collect();
    let top = padded_range([0.0, COMM_TARGET_PERCENT * 1.2, spike_ceiling(&values)]).end;
    let target = [steps_range.start, steps_range.end].map(|s| (s, COMM_TARGET_PERCENT));
    let mut chart = panel(area, caption, steps_range, 0.0..top, ("% of step time", false))?;
    let dashed = TARGET.stroke_width(2);
    chart.draw_series(DashedLineSeries::new(target, 10, 6, dashed))?;
    let mut entries = vec![(Sample::Dashed(dashed), format!("target < {COMM_TARGET_PERCENT} %"))];
    let binned = bins(&comm);
    if !draw_range_band(&mut chart, &binned, COMM)? {
        chart.draw_series(line(means(&binned), COMM.mix(0.3).stroke_width(1)))?;
    }
    let style = COMM.stroke_width(2);
    chart.draw_series(line(means(&bins(&comm_average)), style))?;
    entries.push((Sample::Line(style), busy.to_owned()));
    let style = EXPOSED.stroke_width(2);
    chart.draw_series(line(means(&bins(&exposed)), style))?;
    entries.push((Sample::Line(style), blocked.to_owned()));
    if !bubble.is_empty() {
        let style = BUBBLE.stroke_width(2);
        chart.draw_series(line(means(&bins(&moving_average(&bubble, window))), style))?;
        entries.push((Sample::Line(style), "pipeline bubble".to_owned()));
    }
    legend(column, &chart, &entries)
}

#[cfg(test)]
mod tests;
