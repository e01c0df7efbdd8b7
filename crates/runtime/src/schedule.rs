//! Learning-rate schedules with warm-up, as Hugging Face's `get_constant_schedule_with_warmup`,
//! `get_cosine_with_min_lr_schedule_with_warmup` and `get_linear_schedule_with_warmup` (with a floor):
//! the rate of update k (0-based) of a run of `total` updates.

/// The shape of the rate after the warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScheduleKind {
    /// The peak rate throughout.
    #[default]
    Constant,
    /// Half a cosine from the peak down to the floor at the last update.
    Cosine,
    /// A straight line from the peak down to the floor at the last update.
    Linear,
}

/// A learning-rate schedule over a run of `total` updates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// The peak rate (`--lr`).
    pub peak: f64,
    /// Updates spent rising linearly from 0 to the peak.
    pub warmup: u64,
    /// The rate the decay ends at (`--min-lr`).
    pub floor: f64,
    /// Updates in the whole run (`--steps`).
    pub total: u64,
}

impl Schedule {
    /// The peak rate throughout: what a run without a schedule does.
    pub fn constant(peak: f64, total: u64) -> Schedule {
        Schedule { kind: ScheduleKind::Constant, peak, warmup: 0, floor: 0.0, total }
    }

    /// The rate of update `k` (0-based). During the warm-up, peak * k / warmup; after it, cosine gives
    /// floor + (peak - floor) * (1 + cos(pi * (k - warmup) / (total - warmup))) / 2 and linear
    /// floor + (peak - floor) * (total - k) / (total - warmup); never below 0.
    pub fn rate(&self, k: u64) -> f64 {
        if k < self.warmup {
            return self.peak * k as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let decay = match self.kind {
            ScheduleKind::Constant => return self.peak,
            ScheduleKind::Cosine => {
                let progress = (k - self.warmup) as f64 / span;
                0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
            ScheduleKind::Linear => (self.total.saturating_sub(k) as f64 / span).max(0.0),
        };
        (self.floor + (self.peak - self.floor) * decay).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: ScheduleKind, warmup: u64, floor: f64) -> Schedule {
        Schedule { kind, peak: 1e-2, warmup, floor, total: 10 }
    }

    #[test]
    fn warmup_rises_linearly_from_zero() {
        for kind in [ScheduleKind::Constant, ScheduleKind::Cosine, ScheduleKind::Linear] {
            let s = schedule(kind, 4, 1e-3);
            let rates: Vec<f64> = (0..4).map(|k| s.rate(k)).collect();
            assert_eq!(rates, vec![0.0, 2.5e-3, 5e-3, 7.5e-3], "{kind:?}");
            // floor + (peak - floor) * 1 rounds once: within an ulp of the peak.
            assert!((s.rate(4) - 1e-2).abs() <= 1e-17, "{kind:?}: the peak right after the warm-up");
        }
    }

    #[test]
    fn cosine_and_linear_decay_to_the_floor_at_the_end() {
        let cosine = schedule(ScheduleKind::Cosine, 2, 1e-3);
        // Half-way through the decay (k = 6 of 2..10) the cosine is at the middle of peak and floor.
        assert!((cosine.rate(6) - 5.5e-3).abs() < 1e-15);
        assert!((cosine.rate(10) - 1e-3).abs() < 1e-15);
        let linear = schedule(ScheduleKind::Linear, 2, 1e-3);
        assert!((linear.rate(6) - 5.5e-3).abs() < 1e-15);
        assert!((linear.rate(9) - (1e-3 + 9e-3 / 8.0)).abs() < 1e-15);
        // Decreasing after the warm-up.
        for s in [cosine, linear] {
            assert!((2..10).all(|k| s.rate(k + 1) <= s.rate(k)), "{s:?}");
        }
    }

    #[test]
    fn constant_is_the_peak_and_degenerate_runs_stay_finite() {
        assert!((0..10).all(|k| Schedule::constant(3e-4, 10).rate(k) == 3e-4));
        let all_warmup = Schedule { kind: ScheduleKind::Cosine, peak: 1.0, warmup: 10, floor: 0.0, total: 10 };
        assert!((0..12).all(|k| all_warmup.rate(k).is_finite() && all_warmup.rate(k) >= 0.0));
    }
}
