//! Timelines: spans of what a rank did when (forward, backward, send, receive, all-reduce,
//! pull, push, …). Each rank writes its own chrome-trace file (the trace-event format that
//! Perfetto and chrome://tracing open) with its clock's origin and its offset to the
//! coordinator's clock; [`merge`] puts the files of all ranks on one time base, one process
//! track per rank with a thread per lane.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use super::clock::TraceOrigin;

/// Which thread of a rank a span ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The compute thread (and what blocks it).
    Compute,
    /// The communication thread, or requests in flight beside compute.
    Communication,
}

impl Lane {
    const ALL: [Lane; 2] = [Lane::Compute, Lane::Communication];

    fn thread_id(self) -> usize {
        self as usize
    }

    fn title(self) -> &'static str {
        match self {
            Lane::Compute => "compute",
            Lane::Communication => "communication",
        }
    }
}

/// One span of a rank's time.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// What ran, e.g. `F3` (forward of micro-batch 3).
    pub name: String,
    /// The kind of work, e.g. `forward`, `recv`: Perfetto colours and filters by it.
    pub category: &'static str,
    /// The thread it ran on.
    pub lane: Lane,
    /// Microseconds from the timeline's origin.
    pub start_us: f64,
    /// Microseconds long.
    pub duration_us: f64,
}

/// A rank's spans, measured from an origin shared by the ranks of one process.
#[derive(Debug, Clone)]
pub struct Timeline {
    origin: Instant,
    spans: Vec<Span>,
}

impl Timeline {
    /// An empty timeline measured from `origin`.
    pub fn new(origin: Instant) -> Self {
        Self {
            origin,
            spans: Vec::new(),
        }
    }

    /// Records `name` of `category` on the compute lane from `start` until now.
    pub fn record(&mut self, name: impl Into<String>, category: &'static str, start: Instant) {
        self.record_between(Lane::Compute, name, category, start, Instant::now());
    }

    /// Records `name` of `category` on `lane` from `start` to `end`.
    pub fn record_between(
        &mut self,
        lane: Lane,
        name: impl Into<String>,
        category: &'static str,
        start: Instant,
        end: Instant,
    ) {
        self.spans.push(Span {
            name: name.into(),
            category,
            lane,
            start_us: start.saturating_duration_since(self.origin).as_secs_f64() * 1e6,
            duration_us: end.saturating_duration_since(start).as_secs_f64() * 1e6,
        });
    }

    /// The spans recorded so far, leaving the timeline empty.
    pub fn take(&mut self) -> Vec<Span> {
        std::mem::take(&mut self.spans)
    }
}

/// Records into an optional timeline: tracing is off unless asked for, and then costs one
/// push per span.
pub fn record(timeline: &mut Option<Timeline>, name: impl FnOnce() -> String, category: &'static str, start: Instant) {
    if let Some(t) = timeline {
        t.record(name(), category, start);
    }
}

/// One rank's timeline as written to `rank-N.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct RankTrace {
    /// The rank (the process track's id).
    pub rank: usize,
    /// What it was, e.g. `trainer`, `stage 1 (replica 0)`.
    pub role: String,
    /// The wall-clock time of the spans' origin, microseconds since the epoch.
    pub origin_unix_us: f64,
    /// How far the coordinator's clock was ahead of this process's.
    pub clock_offset_us: f64,
    /// The spans, in any order.
    pub spans: Vec<Span>,
}

/// Where a rank's timeline goes, and the origin its spans are measured from.
#[derive(Debug, Clone)]
pub struct TraceTarget {
    /// The trace directory (`--trace DIR`).
    pub dir: PathBuf,
    /// The origin of the process's timelines.
    pub origin: TraceOrigin,
}

impl TraceTarget {
    /// Writes rank `rank`'s `spans` as `DIR/rank-N.json`.
    pub fn write(&self, rank: usize, role: &str, clock_offset_us: f64, spans: Vec<Span>) -> Result<PathBuf> {
        RankTrace {
            rank,
            role: role.to_string(),
            origin_unix_us: self.origin.unix_us,
            clock_offset_us,
            spans,
        }
        .write(&self.dir)
    }
}

/// Metadata key of a rank file, under the trace's `otherData`.
const RANK_META: &str = "flotilla_rank";

impl RankTrace {
    /// The file rank `rank` writes in a trace directory.
    pub fn file_name(rank: usize) -> String {
        format!("rank-{rank}.json")
    }

    /// Writes `dir/rank-N.json`: on its own a valid trace measured from the rank's origin.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the trace directory {}", dir.display()))?;
        let mut events = vec![
            json!({ "name": "process_name", "ph": "M", "pid": self.rank,
                    "args": { "name": format!("rank {}: {}", self.rank, self.role) } }),
            json!({ "name": "process_sort_index", "ph": "M", "pid": self.rank,
                    "args": { "sort_index": self.rank } }),
        ];
        for lane in Lane::ALL {
            events.push(
                json!({ "name": "thread_name", "ph": "M", "pid": self.rank, "tid": lane.thread_id(),
                                "args": { "name": lane.title() } }),
            );
        }
        for span in &self.spans {
            events.push(json!({
                "name": span.name, "cat": span.category, "ph": "X", "pid": self.rank,
                "tid": span.lane.thread_id(), "ts": span.start_us, "dur": span.duration_us,
            }));
        }
        let trace = json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": { RANK_META: {
                "rank": self.rank, "role": self.role,
                "origin_unix_us": self.origin_unix_us, "clock_offset_us": self.clock_offset_us,
            } },
        });
        let path = dir.join(Self::file_name(self.rank));
        std::fs::write(&path, serde_json::to_vec(&trace)?)
            .with_context(|| format!("writing the trace {}", path.display()))?;
        Ok(path)
    }
}

/// The rank files in `dir` merged into one trace on the coordinator's clock: every event's
/// time moved by its rank's origin and clock offset, the earliest origin at zero.
pub fn merge(dir: &Path) -> Result<Value> {
    let mut ranks = Vec::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading the trace directory {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !(name.starts_with("rank-") && name.ends_with(".json")) {
            continue;
        }
        let trace: Value =
            serde_json::from_slice(&std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?)
                .with_context(|| format!("{}: not JSON", path.display()))?;
        let meta = &trace["otherData"][RANK_META];
        let (Some(origin), Some(offset)) = (meta["origin_unix_us"].as_f64(), meta["clock_offset_us"].as_f64()) else {
            bail!(
                "{}: not a rank's timeline (no otherData.{RANK_META} with its clock)",
                path.display()
            );
        };
        let events = trace["traceEvents"]
            .as_array()
            .with_context(|| format!("{}: no traceEvents", path.display()))?
            .clone();
        ranks.push((origin + offset, events, meta.clone()));
    }
    if ranks.is_empty() {
        bail!(
            "{} holds no rank-N.json timelines (written by a run with --trace {0})",
            dir.display()
        );
    }
    let base = ranks.iter().map(|(start, ..)| *start).fold(f64::INFINITY, f64::min);
    let mut merged = Vec::new();
    let mut clocks = Vec::new();
    for (start, events, meta) in ranks {
        let shift = start - base;
        for mut event in events {
            if let Some(ts) = event["ts"].as_f64() {
                event["ts"] = json!(ts + shift);
            }
            merged.push(event);
        }
        clocks.push(meta);
    }
    Ok(json!({
        "traceEvents": merged,
        "displayTimeUnit": "ms",
        "otherData": { "flotilla_ranks": clocks, "origin_unix_us": base },
    }))
}

/// Merges the rank files of `dir` into `out`.
pub fn write_merged(dir: &Path, out: &Path) -> Result<()> {
    let trace = merge(dir)?;
    if let Some(parent) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(out, serde_json::to_vec(&trace)?).with_context(|| format!("writing the trace {}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, lane: Lane, start_us: f64) -> Span {
        Span {
            name: name.into(),
            category: "forward",
            lane,
            start_us,
            duration_us: 10.0,
        }
    }

    #[test]
    fn spans_are_recorded_only_when_tracing() {
        let origin = Instant::now();
        let mut timeline = Some(Timeline::new(origin));
        record(&mut timeline, || "F0".into(), "forward", Instant::now());
        let mut off = None;
        record(
            &mut off,
            || unreachable!("no span is named when tracing is off"),
            "x",
            origin,
        );
        let spans = timeline.map(|mut t| t.take()).unwrap_or_default();
        assert_eq!(spans.len(), 1);
        assert_eq!((spans[0].lane, spans[0].category), (Lane::Compute, "forward"));
        assert!(spans[0].start_us >= 0.0);
    }

    #[test]
    fn merging_moves_each_rank_by_its_origin_and_clock_offset() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // Rank 1 started 500 µs after rank 0 by its own clock, which runs 2000 µs behind the
        // coordinator's; rank 0's is the coordinator's.
        RankTrace {
            rank: 0,
            role: "stage 0".into(),
            origin_unix_us: 1_000_000.0,
            clock_offset_us: 0.0,
            spans: vec![span("F0", Lane::Compute, 100.0)],
        }
        .write(dir.path())?;
        RankTrace {
            rank: 1,
            role: "stage 1".into(),
            origin_unix_us: 998_500.0,
            clock_offset_us: 2000.0,
            spans: vec![
                span("F0", Lane::Compute, 100.0),
                span("all-reduce", Lane::Communication, 5.0),
            ],
        }
        .write(dir.path())?;
        std::fs::write(dir.path().join("notes.txt"), "not a trace")?;
        let out = dir.path().join("merged/trace.json");
        write_merged(dir.path(), &out)?;
        let trace: Value = serde_json::from_slice(&std::fs::read(out)?)?;
        let spans: Vec<(u64, u64, &str, f64)> = trace["traceEvents"]
            .as_array()
            .context("events")?
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| {
                (
                    e["pid"].as_u64().unwrap_or(99),
                    e["tid"].as_u64().unwrap_or(99),
                    e["name"].as_str().unwrap_or(""),
                    e["ts"].as_f64().unwrap_or(f64::NAN),
                )
            })
            .collect();
        assert!(spans.contains(&(0, 0, "F0", 100.0)), "{spans:?}");
        assert!(spans.contains(&(1, 0, "F0", 600.0)), "{spans:?}");
        assert!(spans.contains(&(1, 1, "all-reduce", 505.0)), "{spans:?}");
        let names: Vec<&str> = trace["traceEvents"]
            .as_array()
            .context("events")?
            .iter()
            .filter(|e| e["name"] == "process_name")
            .filter_map(|e| e["args"]["name"].as_str())
            .collect();
        assert_eq!(names.len(), 2);
        assert!(names.contains(&"rank 1: stage 1"), "{names:?}");
        Ok(())
    }

    #[test]
    fn a_directory_without_rank_files_is_an_error() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let error = format!("{:#}", merge(dir.path()).unwrap_err());
        assert!(error.contains("no rank-N.json"), "{error}");
        std::fs::write(dir.path().join("rank-0.json"), r#"{"traceEvents": []}"#)?;
        let error = format!("{:#}", merge(dir.path()).unwrap_err());
        assert!(error.contains("not a rank's timeline"), "{error}");
        Ok(())
    }
}
