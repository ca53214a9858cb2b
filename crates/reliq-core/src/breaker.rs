use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sync::lock;
use crate::telemetry::{CIRCUIT_STATE, CIRCUIT_TRANSITIONS};

/// Where a breaker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CircuitState {
    /// Deliveries flow; outcomes are counted.
    Closed,
    /// No delivery is taken until the cool-down ends.
    Open,
    /// A few probe deliveries go through.
    HalfOpen,
}

impl CircuitState {
    /// `closed`, `open`, `half_open`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }

    /// The value of `reliq_circuit_state`: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::HalfOpen => 1.0,
            Self::Open => 2.0,
        }
    }
}

/// Outcomes counted in one slice of the window.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    start: Instant,
    succeeded: u64,
    failed: u64,
}

#[derive(Debug)]
struct State {
    state: CircuitState,
    /// Open: when it opened. Half-open: when the last probe was admitted.
    since: Instant,
    window: VecDeque<Bucket>,
    /// Half-open: probes admitted whose outcome has not come.
    probes_out: u32,
    /// Half-open: probes that succeeded.
    probes_ok: u32,
}

/// Which transient failures a breaker counts ([`CircuitBreaker::counting`]).
type Counts = dyn Fn(&(dyn std::error::Error + 'static)) -> bool + Send + Sync;

struct Inner {
    name: String,
    /// `None`: every transient failure.
    counts: Option<Box<Counts>>,
    failure_ratio: f64,
    window: Duration,
    minimum_calls: u64,
    cool_down: Duration,
    probes: u32,
    state: Mutex<State>,
    changed: Notify,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("name", &self.name)
            .field(
                "counting",
                &self
                    .counts
                    .as_ref()
                    .map_or("every transient failure", |_| "a predicate"),
            )
            .field("failure_ratio", &self.failure_ratio)
            .field("window", &self.window)
            .field("minimum_calls", &self.minimum_calls)
            .field("cool_down", &self.cool_down)
            .field("probes", &self.probes)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// A circuit breaker on a consumer's handler outcomes.
/// Give it to [`ConsumerBuilder::circuit_breaker`](crate::consumer::ConsumerBuilder::circuit_breaker).
///
/// [`CircuitBreaker`]: stop taking deliveries while the downstream fails.
///
/// When the database or the payment provider behind a handler is down, every delivery
/// fails transiently, spends an attempt, waits on a retry tier and, the budget spent,
/// lands in the DLQ — an outage turned into thousands of dead letters. A breaker watches
/// the share of **transient** failures among the handler's outcomes over a sliding window
/// (permanent, poison and panic failures are about the message, not the downstream, and do
/// not count). Crossing the threshold **opens** it: the consumer stops receiving, so what
/// waits stays in the broker and spends no attempt. After the cool-down it is
/// **half-open**: a few probe deliveries go through; as many successes **close** it, one
/// transient failure opens it again.
///
/// Not receiving is how each broker stops handing out work to this consumer: nothing is
/// received beyond the deliveries the backend already holds (at most the prefetch), which
/// stay leased and unsettled until the breaker lets them through:
///
/// | broker | while open |
/// |---|---|
/// | Kafka | the poll thread pauses the partitions once its buffer is full and keeps polling: no rebalance, nothing committed |
/// | RabbitMQ | nothing is acked, so after `prefetch` unacknowledged deliveries the broker pushes no more (`basic.qos`); held longer than the broker's `consumer_timeout` (30 min by default) the channel is closed and they are requeued, which counts against a quorum queue's delivery limit |
/// | NATS | no pull request is sent; the held deliveries are kept in progress |
/// | SQS | the poller stops at `prefetch` held messages, whose visibility is extended |
/// | embedded | nothing is taken from the queue |
///
/// A handler often calls more than one downstream: [`CircuitBreaker::counting`] says
/// which transient failures are this breaker's downstream's (the database's, not a
/// partner API's timeouts the same handler returns); the others are neutral.
///
/// One breaker can serve several consumers that call the same downstream
/// ([`CircuitBreaker`] is cheap to clone: clones share their state), so an outage seen by
/// one stops them all.
#[derive(Clone, Debug)]
pub struct CircuitBreaker {
    inner: Arc<Inner>,
}

/// Slices of the sliding window.
const BUCKETS: u32 = 10;

impl CircuitBreaker {
    /// A breaker named `name` (the `breaker` label of its metrics): opens when at least
    /// half of at least 20 outcomes over the last 10 s are transient failures; cools down
    /// for 30 s; closes after 3 probes succeed.
    pub fn new(name: impl Into<String>) -> Self {
        crate::telemetry::describe_metrics();
        let name = name.into();
        gauge!(CIRCUIT_STATE, "breaker" => name.clone()).set(CircuitState::Closed.gauge());
        Self {
            inner: Arc::new(Inner {
                name,
                counts: None,
                failure_ratio: 0.5,
                window: Duration::from_secs(10),
                minimum_calls: 20,
                cool_down: Duration::from_secs(30),
                probes: 3,
                state: Mutex::new(State {
                    state: CircuitState::Closed,
                    since: Instant::now(),
                    window: VecDeque::new(),
                    probes_out: 0,
                    probes_ok: 0,
                }),
                changed: Notify::new(),
            }),
        }
    }

    fn with(mut self, set: impl FnOnce(&mut Inner)) -> Self {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => set(inner),
            None => tracing::error!(breaker = %self.inner.name,
                "a circuit breaker is configured before it is shared; setting ignored"),
        }
        self
    }

    /// Open when the share of transient failures reaches `ratio` (0 < ratio ≤ 1).
    pub fn failure_ratio(self, ratio: f64) -> Self {
        self.with(|i| i.failure_ratio = ratio)
    }

    /// Count only the transient failures for which `counts` holds (given the handler's
    /// error); the others say nothing about this breaker's downstream and are neutral, as
    /// permanent failures are. A handler timeout always counts. Default: every transient
    /// failure.
    ///
    /// ```
    /// # use reliq_core::CircuitBreaker;
    /// // In front of the database: its errors open the breaker, a partner API's
    /// // timeouts (retried as transient too) do not.
    /// let breaker = CircuitBreaker::new("orders-db")
    ///     .counting(|e| reliq_core::ErrorChain(e).to_string().contains("database"));
    /// ```
    pub fn counting(
        self,
        counts: impl Fn(&(dyn std::error::Error + 'static)) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.with(|i| i.counts = Some(Box::new(counts)))
    }

    /// Whether a transient failure with error `e` is news about this breaker's
    /// downstream ([`counting`](Self::counting)).
    pub(crate) fn counts(&self, e: &(dyn std::error::Error + 'static)) -> bool {
        self.inner.counts.as_ref().is_none_or(|counts| counts(e))
    }

    /// The sliding window the share is taken over.
    pub fn window(self, window: Duration) -> Self {
        self.with(|i| i.window = window)
    }

    /// Fewer outcomes in the window never open the breaker (one failure out of one is
    /// no outage).
    pub fn minimum_calls(self, n: u64) -> Self {
        self.with(|i| i.minimum_calls = n)
    }

    /// How long it stays open before probing.
    pub fn cool_down(self, cool_down: Duration) -> Self {
        self.with(|i| i.cool_down = cool_down)
    }

    /// Probe deliveries let through half-open; as many successes close it.
    pub fn probes(self, probes: u32) -> Self {
        self.with(|i| i.probes = probes)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Where it is now.
    pub fn state(&self) -> CircuitState {
        lock(&self.inner.state).state
    }

    /// The setting that is out of range, if one is.
    pub(crate) fn invalid(&self) -> Option<(&'static str, String)> {
        let i = &self.inner;
        if !(i.failure_ratio > 0.0 && i.failure_ratio <= 1.0) {
            return Some((
                "circuit_breaker.failure_ratio",
                format!("{} is not in (0, 1]", i.failure_ratio),
            ));
        }
        if i.window.is_zero() {
            return Some(("circuit_breaker.window", "must be longer than zero".into()));
        }
        if i.probes == 0 {
            return Some((
                "circuit_breaker.probes",
                "at least one probe closes it".into(),
            ));
        }
        if i.minimum_calls == 0 {
            return Some((
                "circuit_breaker.minimum_calls",
                "at least one outcome".into(),
            ));
        }
        None
    }

    fn transition(&self, s: &mut State, to: CircuitState, now: Instant) {
        let from = s.state;
        s.state = to;
        s.since = now;
        s.probes_out = 0;
        s.probes_ok = 0;
        if to == CircuitState::Closed {
            s.window.clear();
        }
        let name = self.inner.name.clone();
        gauge!(CIRCUIT_STATE, "breaker" => name.clone()).set(to.gauge());
        counter!(CIRCUIT_TRANSITIONS, "breaker" => name.clone(), "to" => to.as_str()).increment(1);
        match to {
            CircuitState::Open => tracing::warn!(breaker = %name, from = from.as_str(),
                cool_down = ?self.inner.cool_down, "circuit breaker opened: no deliveries are taken"),
            _ => tracing::info!(breaker = %name, from = from.as_str(), to = to.as_str(),
                "circuit breaker state changed"),
        }
        self.inner.changed.notify_waiters();
    }

    /// Add an outcome to the window's current slice, dropping slices that left it.
    fn count(&self, s: &mut State, now: Instant, failed: bool, n: u64) {
        let slice = self.inner.window / BUCKETS;
        while s
            .window
            .front()
            .is_some_and(|b| now.duration_since(b.start) >= self.inner.window)
        {
            s.window.pop_front();
        }
        if s.window
            .back()
            .is_none_or(|b| now.duration_since(b.start) >= slice)
        {
            s.window.push_back(Bucket {
                start: now,
                succeeded: 0,
                failed: 0,
            });
        }
        if let Some(b) = s.window.back_mut() {
            if failed {
                b.failed += n;
            } else {
                b.succeeded += n;
            }
        }
    }

    /// `n` deliveries handled and acknowledged.
    pub(crate) fn succeeded(&self, n: u64) {
        let now = Instant::now();
        let mut s = lock(&self.inner.state);
        match s.state {
            CircuitState::Closed => self.count(&mut s, now, false, n),
            CircuitState::HalfOpen => {
                let n = u32::try_from(n).unwrap_or(u32::MAX);
                s.probes_out = s.probes_out.saturating_sub(n);
                s.probes_ok = s.probes_ok.saturating_add(n);
                if s.probes_ok >= self.inner.probes {
                    self.transition(&mut s, CircuitState::Closed, now);
                } else {
                    self.inner.changed.notify_waiters();
                }
            }
            // Handlers that started before it opened: no news about the downstream now.
            CircuitState::Open => {}
        }
    }

    /// One delivery failed transiently.
    pub(crate) fn failed(&self) {
        let now = Instant::now();
        let mut s = lock(&self.inner.state);
        match s.state {
            CircuitState::Closed => {
                self.count(&mut s, now, true, 1);
                let (ok, failed) = s
                    .window
                    .iter()
                    .fold((0, 0), |(o, f), b| (o + b.succeeded, f + b.failed));
                let total = ok + failed;
                if total >= self.inner.minimum_calls
                    && failed as f64 >= self.inner.failure_ratio * total as f64
                {
                    self.transition(&mut s, CircuitState::Open, now);
                }
            }
            CircuitState::HalfOpen => self.transition(&mut s, CircuitState::Open, now),
            CircuitState::Open => {}
        }
    }

    /// A delivery settled in a way that says nothing about the downstream (a permanent
    /// or poison failure, a duplicate): a half-open probe slot is free again.
    pub(crate) fn neutral(&self) {
        let mut s = lock(&self.inner.state);
        if s.state == CircuitState::HalfOpen && s.probes_out > 0 {
            s.probes_out -= 1;
            self.inner.changed.notify_waiters();
        }
    }

    /// Probe slots admitted and not used (the receive brought fewer deliveries).
    pub(crate) fn unused(&self, n: usize) {
        if n > 0 {
            let mut s = lock(&self.inner.state);
            if s.state == CircuitState::HalfOpen {
                let n = u32::try_from(n).unwrap_or(u32::MAX);
                s.probes_out = s.probes_out.saturating_sub(n);
                self.inner.changed.notify_waiters();
            }
        }
    }

    /// Deliveries received under a closed breaker that opened while the receive waited
    /// (an idle consumer sharing the breaker, or a slow receive): wait while it is open,
    /// then let them through — as probes when half-open. What was received stays leased
    /// meanwhile, so it spends no attempt on the failing downstream.
    pub(crate) async fn hold(&self, received: usize) {
        self.wait_for(|s, now| match s.state {
            CircuitState::Closed => Step::Done(()),
            CircuitState::HalfOpen => {
                s.probes_out = s
                    .probes_out
                    .saturating_add(u32::try_from(received).unwrap_or(u32::MAX));
                s.since = now;
                Step::Done(())
            }
            CircuitState::Open => Step::CoolDown,
        })
        .await
    }

    /// How many of `want` deliveries the receive loop may take now, waiting while none
    /// may — all when closed; none while open (until the cool-down ends); the probes not
    /// yet out when half-open — and whether they are probes. Half-open probes whose
    /// outcome never comes (a delivery released, lost with its receiver) free their slot
    /// after another cool-down.
    pub(crate) async fn admit(&self, want: usize) -> (usize, bool) {
        self.wait_for(|s, now| match s.state {
            CircuitState::Closed => Step::Done((want, false)),
            CircuitState::Open => Step::CoolDown,
            CircuitState::HalfOpen => {
                let room = self
                    .inner
                    .probes
                    .saturating_sub(s.probes_ok)
                    .saturating_sub(s.probes_out);
                if room > 0 {
                    let n = want.min(room as usize);
                    s.probes_out += u32::try_from(n).unwrap_or(room);
                    s.since = now;
                    return Step::Done((n, true));
                }
                let until = s.since + self.inner.cool_down;
                if now >= until {
                    s.probes_out = 0;
                    return Step::Again;
                }
                Step::Until(until)
            }
        })
        .await
    }

    /// Decide under the state lock until `decide` is done, waking on every state change
    /// and at the time it names. [`Step::CoolDown`]: the breaker is open — half-open once
    /// its cool-down has passed (and decide again), otherwise wait for the cool-down.
    async fn wait_for<T>(&self, mut decide: impl FnMut(&mut State, Instant) -> Step<T>) -> T {
        loop {
            // Registered before the state is read, so a change in between wakes it.
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let wait = {
                let now = Instant::now();
                let mut s = lock(&self.inner.state);
                match decide(&mut s, now) {
                    Step::Done(v) => return v,
                    Step::Again => continue,
                    Step::Until(until) => until,
                    Step::CoolDown => {
                        let until = s.since + self.inner.cool_down;
                        if now >= until {
                            self.transition(&mut s, CircuitState::HalfOpen, now);
                            continue;
                        }
                        until
                    }
                }
            };
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(wait) => {}
            }
        }
    }
}

/// What [`CircuitBreaker::wait_for`]'s decision says.
enum Step<T> {
    /// Done, with this.
    Done(T),
    /// The state was changed: decide again at once.
    Again,
    /// Wait until then (or a state change), then decide again.
    Until(Instant),
    /// The breaker is open: wait out its cool-down.
    CoolDown,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> CircuitBreaker {
        CircuitBreaker::new("test")
            .failure_ratio(0.5)
            .minimum_calls(4)
            .window(Duration::from_secs(10))
            .cool_down(Duration::from_secs(5))
            .probes(2)
    }

    async fn nothing_within(b: &CircuitBreaker, secs: u64) -> bool {
        tokio::time::timeout(Duration::from_secs(secs), b.admit(10))
            .await
            .is_err()
    }

    #[tokio::test(start_paused = true)]
    async fn opens_on_the_share_of_transient_failures_and_closes_after_probes() {
        let b = breaker();
        b.succeeded(2);
        b.failed();
        assert_eq!(b.state(), CircuitState::Closed, "1 of 3: below the minimum");
        b.failed();
        assert_eq!(b.state(), CircuitState::Open, "2 of 4");
        assert!(
            nothing_within(&b, 4).await,
            "open: nothing during the cool-down"
        );
        assert_eq!(b.admit(10).await, (2, true), "half-open: the probes");
        assert_eq!(b.state(), CircuitState::HalfOpen);
        b.succeeded(1);
        b.neutral();
        assert_eq!(
            b.admit(10).await,
            (1, true),
            "a neutral probe frees its slot"
        );
        b.succeeded(1);
        assert_eq!(b.state(), CircuitState::Closed);
        assert_eq!(b.admit(10).await, (10, false));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_opens_again_and_old_outcomes_leave_the_window() {
        let b = breaker();
        for _ in 0..3 {
            b.failed();
        }
        tokio::time::advance(Duration::from_secs(11)).await;
        b.succeeded(3);
        b.failed();
        assert_eq!(
            b.state(),
            CircuitState::Closed,
            "the old failures left the window"
        );
        b.failed();
        b.failed();
        assert_eq!(b.state(), CircuitState::Open, "3 of 6");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(b.admit(1).await, (1, true));
        b.failed();
        assert_eq!(b.state(), CircuitState::Open, "a failed probe");
        // A probe whose outcome never comes frees its slot after a cool-down.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(b.admit(5).await, (2, true));
        assert!(nothing_within(&b, 4).await);
        assert_eq!(b.admit(5).await, (2, true), "after another cool-down");
        let shared = b.clone();
        shared.succeeded(2);
        assert_eq!(b.state(), CircuitState::Closed, "clones share the state");
    }

    #[tokio::test(start_paused = true)]
    async fn deliveries_received_as_it_opened_are_held_until_the_cool_down_ends() {
        let b = breaker();
        for _ in 0..4 {
            b.failed();
        }
        assert_eq!(b.state(), CircuitState::Open);
        let started = Instant::now();
        b.hold(3).await;
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert!(
            nothing_within(&b, 4).await,
            "the held deliveries are the probes"
        );
        b.succeeded(2);
        assert_eq!(b.state(), CircuitState::Closed);
        b.hold(3).await;
    }
}
