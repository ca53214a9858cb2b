//! Riding out an outage where failing would end a process: a service (re)started while a
//! broker node or its database is down asks again, for a bounded time, instead of exiting
//! (and crash-looping under its supervisor). One helper for every such wait — connecting,
//! subscribing, opening a database — so they back off and log alike.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

/// How long and how often [`through_outage`] asks again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutageWait {
    /// No attempt starts after this much time from the first (counted on the clock, so
    /// attempts that time out themselves count too).
    pub within: Duration,
    /// The first pause; each pause doubles, up to [`OutageWait::longest`].
    pub first: Duration,
    /// The longest pause.
    pub longest: Duration,
}

impl OutageWait {
    /// Asking again for up to `within`: pauses 250 ms, doubling to 5 s.
    pub const fn up_to(within: Duration) -> Self {
        Self {
            within,
            first: Duration::from_millis(250),
            longest: Duration::from_secs(5),
        }
    }
}

/// Runs `attempt` until it succeeds, fails with an error `is_outage` does not accept (at
/// once), or [`OutageWait::within`] has passed (the last error). Each pause is logged as
/// a warning naming `what` and the error (with its causes).
pub async fn through_outage<T, E, A, F>(
    what: &str,
    wait: OutageWait,
    is_outage: impl Fn(&E) -> bool,
    attempt: A,
) -> Result<T, E>
where
    A: FnMut() -> F,
    F: Future<Output = Result<T, E>>,
    E: Display,
{
    let started = tokio::time::Instant::now();
    let backoff = ExponentialBuilder::new()
        .with_min_delay(wait.first)
        .with_max_delay(wait.longest)
        .without_max_times();
    attempt
        .retry(backoff)
        .sleep(tokio::time::sleep)
        .when(|e| is_outage(e) && started.elapsed() < wait.within)
        .notify(|e, pause| {
            tracing::warn!(error = %format!("{e:#}"), retry_in = ?pause,
                "{what}: unreachable; asking again");
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BrokerError;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn unreachable(e: &BrokerError) -> bool {
        e.is_unreachable()
    }

    #[tokio::test(start_paused = true)]
    async fn asks_again_through_an_outage_then_returns_the_answer() {
        let calls = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        let answer = through_outage(
            "test",
            OutageWait::up_to(Duration::from_secs(60)),
            unreachable,
            || async {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(BrokerError::connection("refused")),
                    1 => Err(BrokerError::Timeout(Duration::from_secs(10))),
                    _ => Ok(7),
                }
            },
        )
        .await;
        assert_eq!(answer.ok(), Some(7));
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        // Paused 250 ms, then 500 ms.
        assert_eq!(started.elapsed(), Duration::from_millis(750));
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_that_is_no_outage_ends_it_at_once() {
        let calls = AtomicU32::new(0);
        let answer: Result<(), _> = through_outage(
            "test",
            OutageWait::up_to(Duration::from_secs(60)),
            unreachable,
            || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(BrokerError::rejected("not allowed"))
            },
        )
        .await;
        assert!(
            matches!(answer, Err(BrokerError::Rejected { .. })),
            "{answer:?}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_with_the_last_error_once_the_time_is_up() {
        let calls = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        let answer: Result<(), _> = through_outage(
            "test",
            OutageWait::up_to(Duration::from_secs(20)),
            unreachable,
            || async {
                calls.fetch_add(1, Ordering::SeqCst);
                // Each attempt itself takes 3 s (a connect timing out): counted too.
                tokio::time::sleep(Duration::from_secs(3)).await;
                Err(BrokerError::connection("refused"))
            },
        )
        .await;
        assert!(
            matches!(answer, Err(BrokerError::Connection { .. })),
            "{answer:?}"
        );
        // Attempts end at 3, 6.25, 9.75, 13.75, 18.75 (pauses 0.25, 0.5, 1, 2, then 4 s)
        // and 25.75 s: past 20 s, no more.
        assert_eq!(calls.load(Ordering::SeqCst), 6);
        assert_eq!(started.elapsed(), Duration::from_millis(25_750));
    }
}
