//! The receive stage: the receive loop (in-flight bound, circuit breaker, rate limit)
//! and how what it receives is handed to the handle stage: per delivery in groups, per
//! key in order, or as one batch.

use super::handle::{Handling, ack_handled, handle_one, process, process_batch};
use super::rate::HandlerRate;
use super::settle::Settler;
use super::stats::Stats;
use crate::batch::{Batch, BatchError};
use crate::classify::BoxError;
use crate::delivery::Delivery;
use crate::error::BrokerError;
use crate::sync::lock;
use futures::stream::StreamExt as _;
use futures_buffered::FuturesUnorderedBounded;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

/// How deliveries of one consumer are ordered relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeliveryOrder {
    /// Any delivery may run beside any other (up to `concurrency`).
    #[default]
    Unordered,
    /// Deliveries with the same key run one at a time, in arrival order; different keys
    /// (and keyless messages) run in parallel.
    PerKey,
}

/// The receive stage's state: the handle stage it hands deliveries to, and how it hands
/// them out (rate limit, per-key queues, group runners).
pub(super) struct Shared<F> {
    pub(super) handling: Arc<Handling<F>>,
    /// The rate limit on deliveries taken, if any.
    pub(super) rate: Option<HandlerRate>,
    pub(super) keyed: Mutex<HashMap<String, VecDeque<Held>>>,
    /// Most deliveries one task handles together ([`dispatch_each`]): about two groups
    /// per runtime worker when `max_in_flight` deliveries are held.
    pub(super) group_size: usize,
    /// The tasks that run those groups, kept between groups.
    pub(super) runners: GroupRunners,
    pub(super) ordering: DeliveryOrder,
    pub(super) tracker: TaskTracker,
}

impl<F> Shared<F> {
    pub(super) fn settler(&self) -> &Settler {
        &self.handling.settler
    }
}

/// A delivery and its in-flight permit (none if a backend returned more than asked for).
pub(super) type Held = (Delivery, Option<OwnedSemaphorePermit>);

/// Most deliveries the receive loop takes from the backend in one call for a per-message
/// handler (bounded by the free in-flight room as well).
pub(super) const RECEIVE_BATCH: usize = 64;

/// Hands out what one `receive_batch` returned: per delivery ([`dispatch_each`]) or as
/// one batch ([`dispatch_batch`]). The permits cover the deliveries the receive asked for.
pub(super) type Dispatch<H> =
    fn(&Arc<Shared<H>>, &Arc<Semaphore>, &mut Vec<Delivery>, OwnedSemaphorePermit);

/// The stop signal, registered once for the whole loop (a fresh `cancelled()` per
/// message costs a lock on the token each time). Each step below returns `None` when it
/// fired.
type Stopped<'a, 'b> = Pin<&'a mut WaitForCancellationFuture<'b>>;

/// Receives while there is in-flight room, the circuit breaker and the rate limit allow,
/// and hands out what arrives; on stop, releases what a cut-short receive took.
pub(super) async fn receive_loop<H: Send + Sync + 'static>(
    shared: Arc<Shared<H>>,
    stop: CancellationToken,
    in_flight: Arc<Semaphore>,
    receive_max: usize,
    dispatch: Dispatch<H>,
) {
    // However the loop ends — a panic in a backend's receive too — the parked group
    // runners end with it; shutdown waits for them.
    let _runners = CloseOnDrop(&shared.runners);
    let mut receive_errors: u32 = 0;
    let mut batch = Vec::with_capacity(receive_max);
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    loop {
        let Some(room) = take_room(&shared, &in_flight, receive_max, &mut stopped).await else {
            break;
        };
        let Some(admitted) = admit(&shared, room, &mut stopped).await else {
            break;
        };
        let Some(received) = receive_admitted(&shared, &admitted, &mut batch, &mut stopped).await
        else {
            break;
        };
        dispatch(&shared, &in_flight, &mut batch, admitted.permits);
        match received {
            Ok(()) => receive_errors = 0,
            Err(BrokerError::Closed) => {
                tracing::info!(consumer = %shared.settler().name, "receiver closed; consumer stops receiving");
                break;
            }
            Err(e) => {
                receive_errors = receive_errors.saturating_add(1);
                let wait = shared.settler().backoff.delay_for(receive_errors);
                tracing::warn!(consumer = %shared.settler().name, error = %crate::classify::ErrorChain(&e), retry_in = ?wait, "receive failed");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stopped.as_mut() => break,
                }
            }
        }
    }
    // Taken from the broker by a receive the stop cut short: never handed to a handler,
    // so give them back now rather than leave them leased until their lease runs out.
    // (A crash settles and releases nothing, as when the process dies.)
    if !shared.handling.crash.is_fired() {
        for d in batch.drain(..) {
            shared.settler().release(&d, Duration::ZERO).await;
        }
    }
}

/// In-flight room for the next receive: one permit (waiting for it), and whatever else is
/// free now, up to `receive_max`. After failed settlements it first pauses instead of
/// hammering a broken route — until a delivery is handled and acknowledged again, which
/// resets the back-off.
async fn take_room<H>(
    shared: &Shared<H>,
    in_flight: &Arc<Semaphore>,
    receive_max: usize,
    stopped: &mut Stopped<'_, '_>,
) -> Option<OwnedSemaphorePermit> {
    let pause = shared.settler().backoff.current();
    if !pause.is_zero() {
        Stats::bump(&shared.settler().stats.throttled);
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stopped.as_mut() => return None,
        }
    }
    let mut permits = tokio::select! {
        p = in_flight.clone().acquire_owned() => p.ok()?,
        _ = stopped.as_mut() => return None,
    };
    // Whatever else is free now joins the batch; nothing waits for more room.
    let more = in_flight.available_permits().min(receive_max - 1);
    if more > 0
        && let Ok(extra) = in_flight
            .clone()
            .try_acquire_many_owned(u32::try_from(more).unwrap_or(1))
    {
        permits.merge(extra);
    }
    Some(permits)
}

/// The room the circuit breaker and the rate limit let through.
struct Admitted {
    /// One per delivery this receive may take.
    permits: OwnedSemaphorePermit,
    /// Half-open breaker: the permits are its probes.
    probes: bool,
    /// When the rate limit's cells were taken (with a rate limit).
    cells_taken: Option<tokio::time::Instant>,
}

/// The circuit breaker (nothing while it is open — what waits stays in the broker — its
/// probes when half-open), then the rate limit (as many deliveries as it allows now,
/// waiting for the first); the in-flight room left over goes back at once.
async fn admit<H>(
    shared: &Shared<H>,
    mut permits: OwnedSemaphorePermit,
    stopped: &mut Stopped<'_, '_>,
) -> Option<Admitted> {
    let mut probes = false;
    if let Some(breaker) = &shared.settler().breaker {
        let want = permits.num_permits();
        let (allowed, as_probes) = tokio::select! {
            a = breaker.admit(want) => a,
            _ = stopped.as_mut() => return None,
        };
        probes = as_probes;
        if allowed < want {
            drop(permits.split(want - allowed));
        }
    }
    let cells_taken = shared.rate.as_ref().map(|_| tokio::time::Instant::now());
    if let Some(rate) = &shared.rate {
        let want = permits.num_permits();
        let allowed = tokio::select! {
            n = rate.take(want) => n,
            _ = stopped.as_mut() => return None,
        };
        if allowed < want {
            Stats::bump(&shared.settler().stats.throttled);
            drop(permits.split(want - allowed));
        }
    }
    Some(Admitted {
        permits,
        probes,
        cells_taken,
    })
}

/// One receive of up to the admitted number of deliveries into `batch` (the backend's
/// shortcut first). Cancelled by the stop signal, a receive keeps in `batch` whatever it
/// took from the broker (the `receive_batch` cancel-safety contract); the loop releases
/// it. Then the limits' bookkeeping: a receive the broker made wait takes fresh rate
/// cells, unused probes go back to the breaker, and deliveries received under a breaker
/// that opened meanwhile are held (leased) until it lets deliveries through again.
async fn receive_admitted<H>(
    shared: &Shared<H>,
    admitted: &Admitted,
    batch: &mut Vec<Delivery>,
    stopped: &mut Stopped<'_, '_>,
) -> Option<Result<(), BrokerError>> {
    let want = admitted.permits.num_permits();
    let receiver = &shared.settler().receiver;
    let received = if receiver.try_receive_batch(want, batch) {
        Ok(())
    } else {
        tokio::select! {
            r = receiver.receive_batch(want, batch) => r,
            _ = stopped.as_mut() => return None,
        }
    };
    // A receive the broker made wait: its cells are stale (see `rate`).
    if let (Some(rate), Some(taken)) = (&shared.rate, admitted.cells_taken)
        && taken.elapsed() > rate.interval()
        && !batch.is_empty()
    {
        tokio::select! {
            () = rate.take_exactly(batch.len()) => {}
            _ = stopped.as_mut() => return None,
        }
    }
    if let Some(breaker) = &shared.settler().breaker {
        if admitted.probes {
            breaker.unused(want.saturating_sub(batch.len()));
        } else if !batch.is_empty() && breaker.state() != crate::breaker::CircuitState::Closed {
            tokio::select! {
                () = breaker.hold(batch.len()) => {}
                _ = stopped.as_mut() => return None,
            }
        }
    }
    Some(received)
}

/// Per-message handler: count and dispatch what one `receive_batch` returned, one
/// in-flight permit each; permits the batch did not use go back when `permits` drops.
///
/// Deliveries without a key to serialise on run in groups of up to
/// [`Shared::group_size`]: one task per group drives its deliveries' futures together
/// (each completes, settles and frees its permit on its own). A tokio task per delivery
/// cost more than the rest of a cheap handler's path (spawn, a wake-up of another worker,
/// the runtime's task list locked twice); groups stay small enough to spread a CPU-heavy
/// handler's work over every worker. The group tasks are [`GroupRunners`], kept between
/// groups, so a steady stream spawns and allocates nothing.
pub(super) fn dispatch_each<F, Fut>(
    shared: &Arc<Shared<F>>,
    in_flight: &Arc<Semaphore>,
    batch: &mut Vec<Delivery>,
    mut permits: OwnedSemaphorePermit,
) where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    if batch.is_empty() {
        return;
    }
    shared.settler().count_received(batch.len());
    if batch.len() > permits.num_permits() {
        // A backend broke the `receive_batch` contract and returned more than asked:
        // handle the extra deliveries anyway (without a permit) rather than drop them.
        tracing::error!(consumer = %shared.settler().name, "receive_batch returned more deliveries than asked for");
    }
    if shared.ordering == DeliveryOrder::PerKey {
        for delivery in batch.extract_if(.., |d| d.key().is_some()) {
            let key = delivery.key().unwrap_or_default().to_owned();
            let permit = take_permits(&mut permits, in_flight, 1);
            dispatch_keyed(shared, key, (delivery, permit));
        }
    }
    while !batch.is_empty() {
        let n = batch.len().min(shared.group_size);
        let room = take_permits(&mut permits, in_flight, n);
        let (runner, parked) = shared.runners.take(shared.group_size);
        runner.hand_over(batch.drain(..n), room);
        if parked {
            runner.wake.notify_one();
        } else {
            shared
                .tracker
                .spawn(run_groups(shared.clone(), runner.clone()));
        }
    }
}

/// `n` of the receive's permits, or as many as are left (none, as an empty permit, when
/// a backend returned more deliveries than asked for).
pub(super) fn take_permits(
    permits: &mut OwnedSemaphorePermit,
    in_flight: &Arc<Semaphore>,
    n: usize,
) -> Option<OwnedSemaphorePermit> {
    permits
        .split(n.min(permits.num_permits()))
        .or_else(|| in_flight.clone().try_acquire_many_owned(0).ok())
}

/// The tasks that run per-message groups, parked between groups instead of ending, so
/// that a group costs no spawn and no allocation: each keeps its group's buffers. There
/// are as many as groups were ever in flight at once (about two per runtime worker when
/// `max_in_flight` deliveries are held); they end when the receive loop does.
#[derive(Default)]
pub(super) struct GroupRunners {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    parked: Vec<Arc<GroupRunner>>,
    closed: bool,
}

/// One group task's mailbox: the next group and a wake-up.
pub(super) struct GroupRunner {
    next: Mutex<NextGroup>,
    wake: Notify,
}

struct NextGroup {
    deliveries: Vec<Delivery>,
    /// The group's in-flight permits.
    room: Option<OwnedSemaphorePermit>,
}

impl GroupRunners {
    /// A parked runner (`true`: wake it) or a new one (`false`: spawn [`run_groups`]).
    fn take(&self, group_size: usize) -> (Arc<GroupRunner>, bool) {
        match lock(&self.idle).parked.pop() {
            Some(runner) => (runner, true),
            None => (
                Arc::new(GroupRunner {
                    next: Mutex::new(NextGroup {
                        deliveries: Vec::with_capacity(group_size),
                        room: None,
                    }),
                    wake: Notify::new(),
                }),
                false,
            ),
        }
    }

    /// Park `runner` until its next group; `false` once closed (the runner ends).
    fn park(&self, runner: &Arc<GroupRunner>) -> bool {
        let mut idle = lock(&self.idle);
        if !idle.closed {
            idle.parked.push(runner.clone());
        }
        !idle.closed
    }

    /// No more groups: wake the parked runners to end.
    pub(super) fn close(&self) {
        let parked = {
            let mut idle = lock(&self.idle);
            idle.closed = true;
            std::mem::take(&mut idle.parked)
        };
        for runner in parked {
            runner.wake.notify_one();
        }
    }
}

impl GroupRunner {
    fn hand_over(
        &self,
        deliveries: impl Iterator<Item = Delivery>,
        room: Option<OwnedSemaphorePermit>,
    ) {
        let mut next = lock(&self.next);
        next.deliveries.extend(deliveries);
        next.room = room;
    }

    /// The group handed over, swapped into `group` (both keep their capacity).
    fn take_group(&self, group: &mut Vec<Delivery>) -> Option<OwnedSemaphorePermit> {
        let mut next = lock(&self.next);
        std::mem::swap(&mut next.deliveries, group);
        next.room.take()
    }
}

/// Closes the runners when dropped: at the receive loop's end, by return or by panic.
struct CloseOnDrop<'a>(&'a GroupRunners);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// A group runner: run the group handed over, park, repeat until the runners close.
async fn run_groups<F, Fut>(shared: Arc<Shared<F>>, me: Arc<GroupRunner>)
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    // Allocated here, once per runner, on the thread that runs it.
    let mut running = FuturesUnorderedBounded::new(shared.group_size);
    let mut group = Vec::with_capacity(shared.group_size);
    let mut handled = Vec::with_capacity(shared.group_size);
    loop {
        let room = me.take_group(&mut group);
        if group.is_empty() {
            // Woken by `close` with nothing handed over.
            return;
        }
        // A group never exceeds `group_size` (`dispatch_each` splits by it).
        for delivery in group.drain(..) {
            running.push(handle_one(shared.handling.clone(), delivery));
        }
        run_group(&shared, &mut running, &mut handled, room).await;
        if !shared.runners.park(&me) {
            return;
        }
        me.wake.notified().await;
    }
}

/// Drive a group's deliveries to the end. After each pass over the group, the successes
/// of the pass are acknowledged together (one `ack_batch`: one lock for Kafka offsets)
/// and the permits of every delivery settled in it are freed at once (one semaphore
/// lock).
async fn run_group<F, Fut, G>(
    shared: &Shared<F>,
    running: &mut FuturesUnorderedBounded<G>,
    handled: &mut Vec<Delivery>,
    mut room: Option<OwnedSemaphorePermit>,
) where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    G: Future<Output = Option<Delivery>>,
{
    loop {
        let mut settled = 0;
        let finished = std::future::poll_fn(|cx| {
            loop {
                match running.poll_next_unpin(cx) {
                    Poll::Ready(Some(success)) => {
                        settled += 1;
                        handled.extend(success);
                    }
                    Poll::Ready(None) => return Poll::Ready(true),
                    Poll::Pending if settled > 0 => return Poll::Ready(false),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
        if !handled.is_empty() {
            ack_handled(&shared.handling, handled).await;
            handled.clear();
        }
        if let Some(room) = room.as_mut()
            && settled > 0
        {
            drop(room.split(settled.min(room.num_permits())));
        }
        if finished {
            break;
        }
    }
}

/// Per-key ordering: a delivery whose key is being handled queues behind it; otherwise
/// one task handles the key's deliveries in order until its queue is empty.
pub(super) fn dispatch_keyed<F, Fut>(shared: &Arc<Shared<F>>, key: String, held: Held)
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    {
        let mut keyed = lock(&shared.keyed);
        if let Some(queue) = keyed.get_mut(&key) {
            // A delivery of this key is being handled: queue behind it.
            queue.push_back(held);
            return;
        }
        keyed.insert(key.clone(), VecDeque::new());
    }
    let shared = shared.clone();
    shared.tracker.clone().spawn(async move {
        let mut next = Some(held);
        while let Some((delivery, permit)) = next {
            process(shared.handling.clone(), delivery).await;
            drop(permit);
            let mut keyed = lock(&shared.keyed);
            next = keyed.get_mut(&key).and_then(VecDeque::pop_front);
            if next.is_none() {
                keyed.remove(&key);
            }
        }
    });
}

/// Batch handler: what one `receive_batch` returned is one batch, holding its permits
/// until every delivery of it is settled.
pub(super) fn dispatch_batch<F, Fut>(
    shared: &Arc<Shared<F>>,
    _in_flight: &Arc<Semaphore>,
    batch: &mut Vec<Delivery>,
    permits: OwnedSemaphorePermit,
) where
    F: Fn(Batch) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BatchError>> + Send + 'static,
{
    if batch.is_empty() {
        return;
    }
    shared.settler().count_received(batch.len());
    let deliveries = Arc::new(std::mem::replace(
        batch,
        Vec::with_capacity(batch.capacity()),
    ));
    shared
        .tracker
        .spawn(process_batch(shared.handling.clone(), deliveries, permits));
}
