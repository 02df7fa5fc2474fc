//! Clocks of a timeline: spans are measured on a process's monotonic clock from an origin whose
//! wall-clock time is known, and each process's wall clock is compared with the coordinator's
//! at start, so that `flotilla trace merge` can put all processes on one time base.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch on this machine's wall clock.
pub fn unix_now_us() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// One round trip of a clock probe, all in microseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClockSample {
    /// This process's clock when the probe left.
    pub sent: f64,
    /// The remote clock when it answered.
    pub remote: f64,
    /// This process's clock when the answer arrived.
    pub received: f64,
}

/// How far the remote clock is ahead of this one: NTP's estimate (the remote reading minus the
/// midpoint of the round trip) from the sample with the shortest round trip, whose error is at
/// most half of it. Zero without samples.
pub fn offset_us(samples: &[ClockSample]) -> f64 {
    samples
        .iter()
        .min_by(|a, b| (a.received - a.sent).total_cmp(&(b.received - b.sent)))
        .map_or(0.0, |s| s.remote - (s.sent + s.received) / 2.0)
}

/// Where a process's timeline starts: a monotonic instant and the wall-clock time it was taken.
#[derive(Debug, Clone, Copy)]
pub struct TraceOrigin {
    /// Spans are measured from here.
    pub instant: Instant,
    /// The wall clock at `instant`, in microseconds since the epoch.
    pub unix_us: f64,
}

impl TraceOrigin {
    /// Now.
    pub fn now() -> Self {
        Self {
            instant: Instant::now(),
            unix_us: unix_now_us(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shortest_round_trip_decides() {
        let samples = [
            // Remote 1000 µs ahead, answered after a slow, lopsided trip.
            ClockSample {
                sent: 0.0,
                remote: 1900.0,
                received: 1000.0,
            },
            // Remote 1000 µs ahead, symmetric 20 µs trip.
            ClockSample {
                sent: 5000.0,
                remote: 6010.0,
                received: 5020.0,
            },
        ];
        assert_eq!(offset_us(&samples), 1000.0);
        assert_eq!(offset_us(&[]), 0.0);
    }
}
