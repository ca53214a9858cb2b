//! The consumer's rate limit ([`ConsumerBuilder::rate_limit`](super::ConsumerBuilder::rate_limit)):
//! a GCRA limiter (governor) on tokio's clock, so it waits in virtual time under
//! `tokio::time::pause` like everything else in the runtime. The receive loop takes its
//! cells *before* asking the broker for deliveries, so over a backlog no delivery sits
//! leased while it waits. When the broker made the receive wait (little or nothing was
//! there), the cells taken before it are stale — what arrived together would start
//! together, above the limit — so the deliveries take fresh cells before they are handed
//! out: a short wait (at most `burst / per_second`) with the deliveries leased, and only
//! when the consumer has caught up with its source.

use std::num::NonZeroU32;
use std::ops::Add;

use governor::clock::{Clock, Reference};
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

/// A point of [`TokioClock`]: nanoseconds since the clock was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct TokioInstant(u64);

impl Add<Nanos> for TokioInstant {
    type Output = Self;

    fn add(self, other: Nanos) -> Self {
        Self(self.0.saturating_add(other.as_u64()))
    }
}

impl Reference for TokioInstant {
    fn duration_since(&self, earlier: Self) -> Nanos {
        self.0.saturating_sub(earlier.0).into()
    }

    fn saturating_sub(&self, duration: Nanos) -> Self {
        Self(self.0.checked_sub(duration.as_u64()).unwrap_or(self.0))
    }
}

/// governor's clock, read from tokio's.
#[derive(Clone, Debug)]
pub(super) struct TokioClock {
    start: tokio::time::Instant,
}

impl Clock for TokioClock {
    type Instant = TokioInstant;

    fn now(&self) -> TokioInstant {
        let elapsed = self.start.elapsed().as_nanos();
        TokioInstant(u64::try_from(elapsed).unwrap_or(u64::MAX))
    }
}

/// At most `per_second` deliveries a second, `burst` at once.
pub(super) struct HandlerRate {
    limiter: RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<TokioInstant>>,
    clock: TokioClock,
    interval: std::time::Duration,
}

impl std::fmt::Debug for HandlerRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerRate").finish_non_exhaustive()
    }
}

impl HandlerRate {
    pub(super) fn new(per_second: NonZeroU32, burst: NonZeroU32) -> Self {
        let clock = TokioClock {
            start: tokio::time::Instant::now(),
        };
        Self {
            limiter: RateLimiter::direct_with_clock(
                Quota::per_second(per_second).allow_burst(burst),
                clock.clone(),
            ),
            clock,
            interval: std::time::Duration::from_secs(1) / per_second.get(),
        }
    }

    /// One cell's time at the limit's rate (the GCRA emission interval).
    pub(super) fn interval(&self) -> std::time::Duration {
        self.interval
    }

    /// Wait for `n` cells, one after the other. Cancel safe (a cancelled wait keeps the
    /// cells it took: the limiter errs on the slow side).
    pub(super) async fn take_exactly(&self, n: usize) {
        for _ in 0..n {
            self.wait_one().await;
        }
    }

    async fn wait_one(&self) {
        while let Err(not_until) = self.limiter.check() {
            tokio::time::sleep(not_until.wait_time_from(self.clock.now())).await;
        }
    }

    /// Wait for one cell, then take as many more as are free now, up to `want` in all:
    /// how many deliveries may be asked for. Cancel safe (a cancelled wait took nothing).
    pub(super) async fn take(&self, want: usize) -> usize {
        self.wait_one().await;
        let mut taken = 1;
        while taken < want && self.limiter.check().is_ok() {
            taken += 1;
        }
        taken
    }
}
