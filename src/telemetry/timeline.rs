//! Timelines: spans of what a role did when (forward, backward, send, receive, all-reduce, …),
//! written as a chrome-trace JSON file (the trace-event format that Perfetto and
//! chrome://tracing open), one track per role.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context as _, Result};

/// One span of a role's time.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// What ran, e.g. `F3` (forward of micro-batch 3).
    pub name: String,
    /// The kind of work, e.g. `forward`, `recv`: Perfetto colours and filters by it.
    pub category: &'static str,
    /// Microseconds from the timeline's origin.
    pub start_us: f64,
    /// Microseconds long.
    pub duration_us: f64,
}

/// A role's spans, measured from an origin shared by the roles of one process.
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

    /// Records `name` of `category` from `start` until now.
    pub fn record(&mut self, name: impl Into<String>, category: &'static str, start: Instant) {
        let end = Instant::now();
        self.spans.push(Span {
            name: name.into(),
            category,
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

/// One track of a trace: a role's name and its spans.
#[derive(Debug, Clone, PartialEq)]
pub struct Track {
    /// Shown as the track's title, e.g. `stage 1 (replica 0)`.
    pub name: String,
    /// The spans, in any order.
    pub spans: Vec<Span>,
}

/// Writes `tracks` to `path` as chrome-trace JSON: complete (`"X"`) events, one thread per
/// track (named by a metadata event), timestamps in microseconds.
pub fn write_chrome_trace(path: &Path, tracks: &[Track]) -> Result<()> {
    let mut events = Vec::new();
    for (tid, track) in tracks.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
            "args": { "name": track.name },
        }));
        events.push(serde_json::json!({
            "name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
            "args": { "sort_index": tid },
        }));
        for span in &track.spans {
            events.push(serde_json::json!({
                "name": span.name, "cat": span.category, "ph": "X", "pid": 0, "tid": tid,
                "ts": span.start_us, "dur": span.duration_us,
            }));
        }
    }
    let trace = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_vec(&trace)?).with_context(|| format!("writing the trace {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_become_named_threads_of_complete_events() -> Result<()> {
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
        let spans = timeline.unwrap().take();
        assert_eq!(spans.len(), 1);
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("trace.json");
        let tracks = [
            Track {
                name: "stage 0".into(),
                spans,
            },
            Track {
                name: "stage 1".into(),
                spans: vec![],
            },
        ];
        write_chrome_trace(&path, &tracks)?;
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        let events = trace["traceEvents"].as_array().context("events")?;
        assert_eq!(events.len(), 5);
        assert_eq!(events[0]["args"]["name"], "stage 0");
        assert_eq!(
            (events[2]["ph"].as_str(), events[2]["name"].as_str()),
            (Some("X"), Some("F0"))
        );
        assert!(events[2]["ts"].as_f64().context("ts")? >= 0.0);
        assert_eq!(events[3]["args"]["name"], "stage 1");
        Ok(())
    }
}
