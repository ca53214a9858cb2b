//! The one-way stop signals (hard stop, crash) every in-flight delivery races against.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::task::Poll;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// A one-way stop signal (hard stop, crash) that every in-flight delivery races against.
/// A `CancellationToken::cancelled()` per delivery locks the token and its waiter list to
/// register and again to deregister — shared locks every worker takes for every
/// message. Here a flag is read first, and the token is registered with only when the
/// guarded work has to wait.
#[derive(Default)]
pub(super) struct Signal {
    pub(super) fired: AtomicBool,
    pub(super) token: CancellationToken,
}

impl Signal {
    pub(super) fn fire(&self) {
        self.fired.store(true, AtomicOrdering::SeqCst);
        self.token.cancel();
    }

    pub(super) fn is_fired(&self) -> bool {
        self.fired.load(AtomicOrdering::SeqCst)
    }

    /// `work`'s output, or `None` if the signal fired first. Checked before every poll of
    /// `work`, as a biased `select!` with the signal first would.
    pub(super) fn unless_fired<F: Future>(&self, work: F) -> UnlessFired<'_, F> {
        UnlessFired {
            signal: self,
            work,
            wait: None,
        }
    }
}

pin_project_lite::pin_project! {
    /// [`Signal::unless_fired`]'s future. A named future rather than an `async fn`: an
    /// `async fn` keeps its argument and the pinned copy of it side by side, so each of
    /// the two nested races doubled the per-delivery state (2 KB where the handling
    /// inside needs a few hundred bytes; above ~1 KB every allocation of it also misses
    /// the allocator's per-thread cache).
    pub(super) struct UnlessFired<'a, F> {
        pub(super) signal: &'a Signal,
        #[pin]
        pub(super) work: F,
        #[pin]
        pub(super) wait: Option<WaitForCancellationFuture<'a>>,
    }
}

impl<F: Future> Future for UnlessFired<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if this.signal.fired.load(AtomicOrdering::SeqCst) {
            return Poll::Ready(None);
        }
        if let Poll::Ready(out) = this.work.poll(cx) {
            return Poll::Ready(Some(out));
        }
        // `work` waits: be woken by the signal too. (No lost wake-up: the token checks
        // its own state when the waiter registers.)
        if this.wait.is_none() {
            this.wait.set(Some(this.signal.token.cancelled()));
        }
        match this.wait.as_pin_mut().map(|w| w.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}
