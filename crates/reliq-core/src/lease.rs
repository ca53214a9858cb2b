use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What a renewal says about the next one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewed {
    /// Renewed: renew again after the next period.
    Yes,
    /// Nothing more to renew (settled meanwhile, or the renewal failed and was logged).
    Stop,
}

/// Spawn a task that calls `renew` every `period` (at least 100 ms) until `settled` is
/// cancelled (the delivery was settled or its receiver closed), `renew` returns
/// [`Renewed::Stop`], or `max` has passed since the start — then it logs a warning that
/// the broker may hand the message out again, and stops.
///
/// Keeping a delivery leased while its handler runs, for backends whose broker leases
/// each delivery for a fixed time (NATS ack wait, SQS visibility timeout): one helper, so
/// every backend renews on the same schedule and stops on the same events.
pub fn keep_leased<F, Fut>(
    settled: CancellationToken,
    period: Duration,
    max: Option<Duration>,
    mut renew: F,
) -> JoinHandle<()>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Renewed> + Send,
{
    let period = period.max(Duration::from_millis(100));
    let deadline = max.map(|max| (tokio::time::Instant::now() + max, max));
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = settled.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
            if let Some((at, max)) = deadline
                && tokio::time::Instant::now() >= at
            {
                tracing::warn!(
                    ?max,
                    "handler ran past the maximum lease extension; the broker may deliver the message again"
                );
                return;
            }
            if renew().await == Renewed::Stop {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn renews_every_period_until_settled_or_past_the_maximum() {
        let renewals = Arc::new(AtomicU32::new(0));
        let settled = CancellationToken::new();
        let r = renewals.clone();
        let keeper = keep_leased(settled.clone(), Duration::from_secs(10), None, move || {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Renewed::Yes
            }
        });
        tokio::time::sleep(Duration::from_secs(35)).await;
        assert_eq!(renewals.load(Ordering::SeqCst), 3);
        settled.cancel();
        keeper.await.expect("keeper ends");
        assert_eq!(renewals.load(Ordering::SeqCst), 3);

        let capped = Arc::new(AtomicU32::new(0));
        let c = capped.clone();
        let keeper = keep_leased(
            CancellationToken::new(),
            Duration::from_secs(10),
            Some(Duration::from_secs(25)),
            move || {
                let c = c.clone();
                async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    Renewed::Yes
                }
            },
        );
        keeper.await.expect("keeper ends at the maximum");
        assert_eq!(
            capped.load(Ordering::SeqCst),
            2,
            "renewed at 10 s and 20 s, stopped at 30 s"
        );

        let once = Arc::new(AtomicU32::new(0));
        let o = once.clone();
        let keeper = keep_leased(
            CancellationToken::new(),
            Duration::from_secs(1),
            None,
            move || {
                let o = o.clone();
                async move {
                    o.fetch_add(1, Ordering::SeqCst);
                    Renewed::Stop
                }
            },
        );
        keeper.await.expect("keeper ends when told");
        assert_eq!(once.load(Ordering::SeqCst), 1);
    }
}
