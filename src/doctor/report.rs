//! The doctor's output: one line per check, `[ OK ]`, `[WARN]` or `[FAIL]`, and a count.

use std::fmt;

/// The verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Status {
    /// Nothing to do.
    Ok,
    /// Worth knowing; the job can still run.
    Warn,
    /// The job would fail (or hang) this way; the line says how to fix it.
    Fail,
}

/// One check's line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Line {
    pub(super) status: Status,
    pub(super) text: String,
}

impl Line {
    pub(super) fn ok(text: impl Into<String>) -> Self {
        Self {
            status: Status::Ok,
            text: text.into(),
        }
    }

    pub(super) fn warn(text: impl Into<String>) -> Self {
        Self {
            status: Status::Warn,
            text: text.into(),
        }
    }

    pub(super) fn fail(text: impl Into<String>) -> Self {
        Self {
            status: Status::Fail,
            text: text.into(),
        }
    }
}

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.status {
            Status::Ok => "[ OK ]",
            Status::Warn => "[WARN]",
            Status::Fail => "[FAIL]",
        };
        write!(f, "{tag} {}", self.text)
    }
}

/// Prints lines as the checks produce them (a slow peer check should not hide the lines before
/// it) and counts them.
#[derive(Debug, Default)]
pub(super) struct Report {
    ok: usize,
    warn: usize,
    fail: usize,
}

impl Report {
    pub(super) fn push(&mut self, line: Line) {
        match line.status {
            Status::Ok => self.ok += 1,
            Status::Warn => self.warn += 1,
            Status::Fail => self.fail += 1,
        }
        println!("{line}");
    }

    pub(super) fn extend(&mut self, lines: impl IntoIterator<Item = Line>) {
        for line in lines {
            self.push(line);
        }
    }

    /// Prints the count line (with `note`, if any); an error when a check failed, so the
    /// command's exit status says so.
    pub(super) fn finish(self, note: Option<&str>) -> anyhow::Result<()> {
        let total = self.ok + self.warn + self.fail;
        let note = note.map(|n| format!("; {n}")).unwrap_or_default();
        let checks = if total == 1 { "check" } else { "checks" };
        println!(
            "{total} {checks}: {} OK, {} WARN, {} FAIL{note}",
            self.ok, self.warn, self.fail
        );
        anyhow::ensure!(self.fail == 0, "{} of {total} {checks} failed", self.fail);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_line_up() {
        assert_eq!(Line::ok("a").to_string(), "[ OK ] a");
        assert_eq!(Line::warn("b").to_string(), "[WARN] b");
        assert_eq!(Line::fail("c").to_string(), "[FAIL] c");
    }

    #[test]
    fn a_failure_fails_the_report_and_a_warning_does_not() {
        let mut report = Report::default();
        report.extend([Line::ok("a"), Line::warn("b")]);
        assert!(report.finish(None).is_ok());
        let mut report = Report::default();
        report.extend([Line::ok("a"), Line::fail("c")]);
        let err = report.finish(None).unwrap_err();
        assert_eq!(err.to_string(), "1 of 2 checks failed");
    }
}
