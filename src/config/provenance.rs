//! Who wrote each key of a config: the file, an environment variable or `--set`, so that an
//! error about a key names whoever supplied its value.

use super::{ConfigError, FieldError};

/// Records which keys environment variables and `--set` wrote, so errors about those keys name
/// the variable or `--set` instead of the file.
#[derive(Debug)]
pub(super) struct Provenance {
    /// The config file (or `<built-in default>`): the source of every key not written later.
    file: String,
    /// `(dotted key, source name)` in the order written; later writes win.
    writes: Vec<(String, String)>,
}

impl Provenance {
    pub(super) fn new(file: &str) -> Self {
        Self {
            file: file.to_string(),
            writes: Vec::new(),
        }
    }

    /// Notes that `source` wrote the dotted `key` (and everything below it).
    pub(super) fn record(&mut self, key: String, source: String) {
        self.writes.push((key, source));
    }

    /// Who supplied the value at `key`: the latest write at or above `key`; failing that, the
    /// latest write below it (the override created or changed part of that value); otherwise
    /// the file.
    pub(super) fn source_of(&self, key: &str) -> &str {
        let latest = |matches: &dyn Fn(&str) -> bool| {
            self.writes
                .iter()
                .rev()
                .find(|(written, _)| matches(written))
                .map(|(_, source)| source.as_str())
        };
        latest(&|written| is_within(key, written))
            .or_else(|| latest(&|written| is_within(written, key)))
            .unwrap_or(&self.file)
    }

    /// How late the value at `key` was written: `None` for the file, else the index of the
    /// latest override at or above it, so a larger value outranks a smaller one.
    pub(super) fn precedence(&self, key: &str) -> Option<usize> {
        self.writes.iter().rposition(|(written, _)| is_within(key, written))
    }

    /// The key `error` names: of its keys, the one written last (by the environment or
    /// `--set`; the more precise key written when it was written below one), else its first.
    pub(super) fn named_key(&self, error: &FieldError) -> String {
        let candidates = std::iter::once(&error.key).chain(&error.also);
        let latest = candidates
            .filter_map(|key| {
                let touching = self
                    .writes
                    .iter()
                    .rposition(|(written, _)| is_within(key, written) || is_within(written, key))?;
                let written = &self.writes[touching].0;
                let named = if is_within(written, key) { written } else { key };
                Some((touching, named))
            })
            .max_by_key(|(touching, _)| *touching);
        latest.map_or_else(|| error.key.clone(), |(_, named)| named.clone())
    }

    /// A [`ConfigError`] about `key`, attributed to whoever supplied it.
    pub(super) fn error(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        let key = key.into();
        ConfigError::Invalid {
            source_name: self.source_of(&key).to_string(),
            key,
            message: message.into(),
        }
    }
}

/// Whether dotted `key` is `ancestor` itself or lies below it (`a.b` and `a.b[0]` are within
/// `a.b`; `a.bc` is not).
fn is_within(key: &str, ancestor: &str) -> bool {
    match key.strip_prefix(ancestor) {
        Some(rest) => rest.is_empty() || rest.starts_with('.') || rest.starts_with('['),
        None => false,
    }
}
