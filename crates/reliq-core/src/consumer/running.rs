//! A running consumer: its counters, graceful shutdown and the crash of tests.

use super::receive::Shared;
use super::signal::Signal;
use super::stats::{Stats, StatsSnapshot};
use crate::broker::Receiver;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What shutdown did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// True if every in-flight handler finished within the shutdown timeout.
    pub drained: bool,
    /// The counters at the end.
    pub stats: StatsSnapshot,
}

/// A running consumer.
pub struct ConsumerHandle {
    pub(super) shared: Arc<dyn Control>,
    pub(super) stop: CancellationToken,
    pub(super) loop_task: JoinHandle<()>,
    pub(super) shutdown_timeout: Duration,
    pub(super) receiver: Arc<dyn Receiver>,
}

impl std::fmt::Debug for ConsumerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerHandle")
            .field("stats", &self.shared.stats().snapshot())
            .field("shutdown_timeout", &self.shutdown_timeout)
            .finish_non_exhaustive()
    }
}

impl ConsumerHandle {
    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats().snapshot()
    }

    /// Where the consumer's circuit breaker is (`None`: it has none).
    pub fn circuit_state(&self) -> Option<crate::breaker::CircuitState> {
        self.shared
            .breaker()
            .map(crate::breaker::CircuitBreaker::state)
    }

    /// Stop receiving, wait up to the shutdown timeout for in-flight handlers, release
    /// the rest, close the receiver.
    pub async fn shutdown(self) -> ShutdownReport {
        self.stop.cancel();
        let _ = self.loop_task.await;
        let tracker = self.shared.tracker();
        tracker.close();
        let drained = tokio::time::timeout(self.shutdown_timeout, tracker.wait())
            .await
            .is_ok();
        if !drained {
            tracing::warn!(
                timeout = ?self.shutdown_timeout,
                "in-flight handlers did not finish in time; releasing their deliveries"
            );
            self.shared.hard_stop().fire();
            tracker.wait().await;
        }
        if let Err(e) = self.receiver.close().await {
            tracing::warn!(error = %crate::classify::ErrorChain(&e), "closing the receiver failed");
        }
        ShutdownReport {
            drained,
            stats: self.shared.stats().snapshot(),
        }
    }

    /// Stop as if the process died: nothing in flight is settled or released; the
    /// receiver is dropped without closing, so the broker redelivers what was unsettled
    /// (after its lease / on connection loss). For tests of crash behaviour (feature
    /// `test-util`).
    #[cfg(feature = "test-util")]
    pub async fn crash(self) {
        // Fired before the stop, so the receive loop sees the crash when it stops.
        self.shared.crash().fire();
        self.stop.cancel();
        let _ = self.loop_task.await;
        let tracker = self.shared.tracker();
        tracker.close();
        tracker.wait().await;
    }
}

/// The part of the shared state a handle needs, without the handler type.
pub(super) trait Control: Send + Sync {
    fn stats(&self) -> &Stats;
    fn tracker(&self) -> &TaskTracker;
    fn hard_stop(&self) -> &Signal;
    fn breaker(&self) -> Option<&crate::breaker::CircuitBreaker>;
    #[cfg(feature = "test-util")]
    fn crash(&self) -> &Signal;
}

impl<F: Send + Sync> Control for Shared<F> {
    fn stats(&self) -> &Stats {
        &self.settler().stats
    }
    fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }
    fn hard_stop(&self) -> &Signal {
        &self.settler().hard_stop
    }
    fn breaker(&self) -> Option<&crate::breaker::CircuitBreaker> {
        self.settler().breaker.as_ref()
    }
    #[cfg(feature = "test-util")]
    fn crash(&self) -> &Signal {
        &self.handling.crash
    }
}
