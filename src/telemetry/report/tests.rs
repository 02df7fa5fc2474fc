//! The report's panels drawn from synthetic runs.

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
                eval: None,
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
    render(dir.path(), &out, None)?;
    png_size(&out)
}

/// Another run's loss drawn over this one's, short runs and long ones alike; a compared
/// directory without metrics is an error naming it.
#[test]
fn another_runs_loss_is_overlaid() -> Result<()> {
    for (ours, theirs) in [
        (synthetic(50, false), synthetic(40, false)),
        (long_run(), synthetic(30, false)),
    ] {
        let (dir, other) = (tempfile::tempdir()?, tempfile::tempdir()?);
        write_metrics(dir.path(), &ours)?;
        write_metrics(other.path(), &theirs)?;
        let out = dir.path().join("report.png");
        render(dir.path(), &out, Some(other.path()))?;
        assert_eq!(png_size(&out)?, IMAGE_SIZE);
    }
    let (dir, empty) = (tempfile::tempdir()?, tempfile::tempdir()?);
    write_metrics(dir.path(), &synthetic(5, false))?;
    let error = format!(
        "{:#}",
        render(dir.path(), &dir.path().join("r.png"), Some(empty.path())).unwrap_err()
    );
    assert!(error.contains(&empty.path().display().to_string()), "{error}");
    Ok(())
}

/// A 100 000-step run: the loss falls over three decades with rare spikes a hundred times
/// the loss, throughput and communication jitter from step to step.
fn long_run() -> Vec<StepMetrics> {
    let mut steps = synthetic(100_000, false);
    for m in &mut steps {
        let t = m.step as f64;
        let noise = ((t * 12.9898).sin() * 43_758.545).fract().abs();
        m.loss = (2.3 * (-t / 8000.0).exp() + 0.002 + 0.001 * noise) as f32;
        if m.step % 9973 == 0 {
            m.loss *= 100.0;
        }
        m.samples_per_sec = 5000.0 + 2000.0 * noise;
        m.comm_time_ratio = 0.1 + 0.2 * noise;
        m.exposed_comm_ratio = 0.05 * noise;
    }
    steps
}

#[test]
fn a_parameter_server_run_is_told_by_its_config() -> Result<()> {
    let dir = tempfile::tempdir()?;
    assert!(!on_parameter_servers(dir.path()));
    std::fs::write(dir.path().join("config.toml"), "[cluster]\nserver_num = 2\n")?;
    assert!(on_parameter_servers(dir.path()));
    write_metrics(dir.path(), &synthetic(30, false))?;
    render(dir.path(), &dir.path().join("report.png"), None)?;
    std::fs::write(dir.path().join("config.toml"), "[cluster]\nserver_num = 0\n")?;
    assert!(!on_parameter_servers(dir.path()));
    Ok(())
}

#[test]
fn a_run_of_100_000_steps_renders() -> Result<()> {
    assert_eq!(render_into_tempdir(&long_run(), None)?, IMAGE_SIZE);
    Ok(())
}

#[test]
fn long_curves_are_binned_and_spikes_left_out_of_the_range() {
    let points: Vec<(u64, f64)> = (1..=10_000).map(|s| (s, (s % 10) as f64)).collect();
    let binned = bins(&points);
    assert!(binned.len() <= MAX_POINTS && binned.len() >= MAX_POINTS / 2);
    assert_eq!(binned.last().map(|b| b.step), Some(10_000));
    // Every bin but the shorter last one spans all ten values.
    let whole = &binned[..binned.len() - 1];
    assert!(whole
        .iter()
        .all(|b| b.low == 0.0 && b.high == 9.0 && (b.mean - 4.5).abs() < 1.0));
    let short: Vec<(u64, f64)> = (1..=5).map(|s| (s, s as f64)).collect();
    assert_eq!(means(&bins(&short)), short);
    let mut values = vec![1.0; 1000];
    values[7] = 1e6;
    assert_eq!(spike_ceiling(&values), 1.0);
    assert_eq!(spike_ceiling(&[]), 0.0);
    assert_eq!(smoothing_window(100), MOVING_AVERAGE_STEPS);
    assert_eq!(smoothing_window(100_000), 500);
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
            eval: None,
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
    let error = format!("{:#}", render(dir.path(), &out, None).unwrap_err());
    let path = dir.path().join(METRICS_FILE);
    assert!(error.contains(&path.display().to_string()), "{error}");
    assert!(error.contains("every training run writes"), "{error}");
    std::fs::write(&path, "\n")?;
    let error = format!("{:#}", render(dir.path(), &out, None).unwrap_err());
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
