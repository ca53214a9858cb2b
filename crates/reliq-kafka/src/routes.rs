//! Which retry and DLQ topics exist: the route producer never auto-creates a topic, so
//! a copy to a topic that is gone must be caught before it is produced.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reliq_core::seam::lock;

/// How long a retry or DLQ topic seen to exist is taken to exist without asking again.
pub(crate) const ROUTE_RECHECK: Duration = Duration::from_secs(10);

/// The routes seen to exist, and one lookup at a time per topic.
///
/// Whether a topic exists is a metadata request (a broker round trip on the blocking
/// pool). Asked per copy it was the dead-letter path's bottleneck; asked once per
/// [`ROUTE_RECHECK`] but by every copy in flight when the answer is not known yet (a new
/// topic, each recheck, each failed produce), it was a burst of up to the prefetch of
/// concurrent requests, each on a blocking-pool thread of its own — the Kafka retry
/// path's fixed cost per run (256 lookups and as many threads for 20,000 retries). Now
/// one caller looks the topic up and the callers that arrived while it did take its
/// answer.
pub(crate) struct Routes {
    /// [`ROUTE_RECHECK`] outside tests.
    recheck: Duration,
    topics: Mutex<HashMap<String, Arc<Route>>>,
}

#[derive(Default)]
struct Route {
    /// The last answer, and when it came.
    known: Mutex<Option<(Instant, bool)>>,
    /// Held while one caller looks the topic up.
    lookup: tokio::sync::Mutex<()>,
}

impl Route {
    fn known(&self) -> Option<(Instant, bool)> {
        *lock(&self.known)
    }
}

impl Routes {
    pub(crate) fn new(recheck: Duration) -> Self {
        Self {
            recheck,
            topics: Mutex::default(),
        }
    }

    /// Whether `topic` exists: `true` if seen to exist within the recheck interval, else
    /// the answer of `lookup` — run by one caller at a time; a caller that waited for
    /// another's lookup takes that answer (a lookup that failed leaves none: the next
    /// caller asks again).
    pub(crate) async fn exists<E>(
        &self,
        topic: &str,
        lookup: impl Future<Output = Result<bool, E>>,
    ) -> Result<bool, E> {
        let arrived = Instant::now();
        let route = self.route(topic);
        let recent = |known: Option<(Instant, bool)>| match known {
            Some((at, exists)) if at >= arrived => Some(exists),
            Some((at, true)) if at.elapsed() < self.recheck => Some(true),
            _ => None,
        };
        if let Some(exists) = recent(route.known()) {
            return Ok(exists);
        }
        let _looking = route.lookup.lock().await;
        if let Some(exists) = recent(route.known()) {
            return Ok(exists);
        }
        let exists = lookup.await?;
        *lock(&route.known) = Some((Instant::now(), exists));
        Ok(exists)
    }

    /// Forget what is known of `topic` (a produce to it failed): the next copy asks.
    pub(crate) fn forget(&self, topic: &str) {
        if let Some(route) = lock(&self.topics).get(topic) {
            *lock(&route.known) = None;
        }
    }

    fn route(&self, topic: &str) -> Arc<Route> {
        let mut topics = lock(&self.topics);
        if let Some(route) = topics.get(topic) {
            return route.clone();
        }
        topics.entry(topic.to_owned()).or_default().clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::future::join_all;

    use super::*;

    /// `lookups` counts the calls; each answers `exists` after a short wait.
    async fn ask(routes: &Routes, lookups: &AtomicUsize, exists: bool) -> Result<bool, String> {
        routes
            .exists("t.retry", async {
                lookups.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(exists)
            })
            .await
    }

    #[tokio::test]
    async fn copies_in_flight_share_one_lookup_and_its_answer() {
        let (routes, lookups) = (Routes::new(ROUTE_RECHECK), AtomicUsize::new(0));
        let answers = join_all((0..256).map(|_| ask(&routes, &lookups, true))).await;
        assert!(answers.iter().all(|a| a == &Ok(true)));
        assert_eq!(
            lookups.load(Ordering::SeqCst),
            1,
            "one lookup for 256 copies"
        );
        // Known now: no lookup until the recheck is due.
        assert_eq!(ask(&routes, &lookups, true).await, Ok(true));
        assert_eq!(lookups.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_missing_topic_is_shared_by_the_waiters_then_asked_again() {
        let (routes, lookups) = (Routes::new(ROUTE_RECHECK), AtomicUsize::new(0));
        let answers = join_all((0..64).map(|_| ask(&routes, &lookups, false))).await;
        assert!(answers.iter().all(|a| a == &Ok(false)));
        assert_eq!(lookups.load(Ordering::SeqCst), 1);
        // Not cached: a later copy asks again (the topic may have been created).
        assert_eq!(ask(&routes, &lookups, true).await, Ok(true));
        assert_eq!(lookups.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failed_lookup_leaves_no_answer_and_forget_asks_again() {
        let (routes, lookups) = (Routes::new(ROUTE_RECHECK), AtomicUsize::new(0));
        let failed: Result<bool, String> = routes
            .exists("t.retry", async { Err("timed out".to_owned()) })
            .await;
        assert_eq!(failed, Err("timed out".to_owned()));
        assert_eq!(ask(&routes, &lookups, true).await, Ok(true));
        assert_eq!(lookups.load(Ordering::SeqCst), 1, "asked after the failure");
        routes.forget("t.retry");
        assert_eq!(ask(&routes, &lookups, true).await, Ok(true));
        assert_eq!(lookups.load(Ordering::SeqCst), 2, "asked after forget");
    }

    #[tokio::test]
    async fn a_known_topic_is_asked_again_after_the_recheck() {
        let (routes, lookups) = (Routes::new(Duration::from_millis(50)), AtomicUsize::new(0));
        assert_eq!(ask(&routes, &lookups, true).await, Ok(true));
        assert_eq!(ask(&routes, &lookups, true).await, Ok(true));
        assert_eq!(lookups.load(Ordering::SeqCst), 1, "known: not asked");
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(ask(&routes, &lookups, false).await, Ok(false));
        assert_eq!(
            lookups.load(Ordering::SeqCst),
            2,
            "asked again after the recheck"
        );
    }
}
