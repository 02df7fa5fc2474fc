//! Errors no restart can change: a process that refuses to start (or to go on) for one of them
//! exits with [`REFUSAL_EXIT_CODE`], and its launcher stops the job instead of restarting it.
//! At the crate root so that every layer may refuse what its input gets wrong.

/// The exit status of a process that refused to start for a reason no restart can change (an
/// invalid config, data or stage cut, another run's checkpoints, a resume that does not match):
/// `EX_CONFIG` of sysexits.h. A launcher stops the job rather than restart it.
pub const REFUSAL_EXIT_CODE: u8 = 78;

/// An error that makes the process exit with [`REFUSAL_EXIT_CODE`]; it reads as the error it
/// wraps.
#[derive(Debug)]
pub struct Refusal(pub anyhow::Error);

impl Refusal {
    /// `error`, marked as a refusal: `.map_err(Refusal::wrap)`.
    pub fn wrap(error: anyhow::Error) -> anyhow::Error {
        Self(error).into()
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Refusal {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
