//! Acks and releases under strain: a backend returning more than asked, a slow delivery
//! in a group, the settle back-off after an inbox outage, and a receive cut short by the
//! stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use reliq_core::{BoxError, Consumer, Delivery, Destination, Message, Subscription};
use reliq_memory::MemoryBroker;

use crate::support::{How, Misbehaving, filled_and_started, secs, wait_for};

/// A backend that breaks the `receive_batch` contract (returns more deliveries than
/// asked for): the runtime still handles and acknowledges every one — a delivery is never
/// dropped for lack of an in-flight permit.
#[tokio::test(start_paused = true)]
async fn a_backend_returning_more_than_asked_loses_nothing() {
    use reliq_core::Broker;
    let (_memory, broker) = Misbehaving::over_memory(How::Greedy);
    let builder = Consumer::builder(broker.clone(), "greedy")
        .subscribe("orders")
        .max_in_flight(4)
        // A dropped delivery would come back only after its lease: far past the wait.
        .lease(Duration::from_secs(3600));
    // Declare the queue, then fill it: the first batch finds 20 waiting.
    drop(
        broker
            .subscribe(&builder.subscription().unwrap())
            .await
            .unwrap(),
    );
    for i in 0..20 {
        broker
            .publish(&Destination::new("orders"), Message::new(format!("{i}")))
            .await
            .unwrap();
    }
    let handled = Arc::new(AtomicU32::new(0));
    let h = handled.clone();
    let consumer = builder
        .start(move |_d: Delivery| {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::Relaxed);
                Ok::<(), BoxError>(())
            }
        })
        .await
        .unwrap();
    wait_for("20 handled", || handled.load(Ordering::Relaxed) >= 20).await;
    let report = consumer.shutdown().await;
    assert_eq!(report.stats.processed, 20, "{:?}", report.stats);
    assert_eq!(report.stats.in_flight, 0, "{:?}", report.stats);
}

/// Deliveries handled together (one group of the per-message runtime) are acknowledged
/// as each pass over them finishes: one slow handler holds back neither the acks nor the
/// in-flight slots of the deliveries that finished beside it.
#[tokio::test(start_paused = true)]
async fn a_slow_delivery_does_not_hold_back_the_acks_of_its_group() {
    use reliq_core::Broker;
    let broker = MemoryBroker::new();
    let sub = Subscription::new("c", "t");
    // The backlog exists before the consumer starts, so one receive takes all ten and
    // they run side by side.
    drop(broker.subscribe(&sub).await.unwrap());
    for i in 0..10 {
        broker
            .publish(&Destination::new("t"), Message::new(format!("{i}")))
            .await
            .unwrap();
    }
    let t0 = tokio::time::Instant::now();
    let h = Consumer::builder(Arc::new(broker.clone()), "c")
        .subscribe("t")
        .max_in_flight(64)
        .start(|d: Delivery| async move {
            // Shorter than the memory broker's lease (30 s), past which it redelivers.
            if d.payload() == b"0" {
                tokio::time::sleep(secs(20)).await;
            }
            Ok::<(), BoxError>(())
        })
        .await
        .unwrap();
    wait_for("the nine fast deliveries acknowledged", || {
        h.stats().processed == 9
    })
    .await;
    assert!(
        t0.elapsed() < secs(1),
        "acknowledged only after {:?}: held back by the slow delivery",
        t0.elapsed()
    );
    assert_eq!(
        broker.depth(&sub),
        (0, 1),
        "only the slow delivery is still unacknowledged"
    );
    assert_eq!(
        h.stats().in_flight,
        1,
        "the nine freed their in-flight slots"
    );
    wait_for("the slow delivery acknowledged", || {
        h.stats().processed == 10
    })
    .await;
    assert!(t0.elapsed() >= secs(20));
    assert_eq!(h.stats().received, 10, "nothing redelivered");
    h.shutdown().await;
}

/// An inbox whose first `failures` claims fail (a database outage), then works.
struct OutageInbox {
    failures: AtomicU32,
    inner: reliq_core::MemoryInbox,
}

#[async_trait::async_trait]
impl reliq_core::Inbox for OutageInbox {
    async fn claim(
        &self,
        consumer: &str,
        id: &reliq_core::MessageId,
    ) -> Result<reliq_core::Claim, reliq_core::InboxError> {
        let down = self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if down {
            return Err(reliq_core::InboxError("database unavailable".into()));
        }
        self.inner.claim(consumer, id).await
    }
    async fn complete(
        &self,
        consumer: &str,
        id: &reliq_core::MessageId,
    ) -> Result<(), reliq_core::InboxError> {
        self.inner.complete(consumer, id).await
    }
    async fn abandon(
        &self,
        consumer: &str,
        id: &reliq_core::MessageId,
    ) -> Result<(), reliq_core::InboxError> {
        self.inner.abandon(consumer, id).await
    }
}

/// Six failed inbox claims, then 2,000 messages whose handlers all succeed: the settle
/// back-off ends with the first success, so the run takes about what the six released
/// deliveries' back-off needs (virtual seconds), not a pause before every receive (102 s
/// before the fix, with the back-off never reset by a plain success).
#[tokio::test(start_paused = true)]
async fn a_success_ends_the_settle_back_off() {
    let broker = Arc::new(MemoryBroker::new());
    let inbox = Arc::new(OutageInbox {
        failures: AtomicU32::new(6),
        inner: reliq_core::MemoryInbox::new(),
    });
    let builder = Consumer::builder(broker.clone(), "c")
        .subscribe("t")
        .inbox(inbox.clone())
        .settle_backoff(Duration::from_millis(100), secs(10));
    use reliq_core::Broker as _;
    drop(
        broker
            .subscribe(&builder.subscription().unwrap())
            .await
            .unwrap(),
    );
    let started = tokio::time::Instant::now();
    let h = builder
        .start(|_d: Delivery| async { Ok::<(), BoxError>(()) })
        .await
        .unwrap();
    for i in 0..2000 {
        broker
            .publish(&Destination::new("t"), Message::new(format!("{i}")))
            .await
            .unwrap();
        // Messages arrive over time, as they do in production: each receive finds a few.
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    wait_for("2,000 processed", || h.stats().processed == 2000).await;
    let took = started.elapsed();
    let s = h.shutdown().await.stats;
    assert_eq!(inbox.failures.load(Ordering::SeqCst), 0);
    assert!(s.released >= 6, "{s:?}");
    assert!(
        took < secs(10),
        "2,000 healthy messages after 6 failed claims took {took:?} (virtual)"
    );
    assert!(s.throttled <= 12, "receives held back: {s:?}");
}

/// A receive the stop cuts short after it took a delivery from the broker: the runtime
/// releases that delivery at once instead of leaving it leased (on a broker with leases
/// it would wait for the lease to run out, and on NATS spend a delivery attempt).
#[tokio::test(start_paused = true)]
async fn shutdown_releases_what_a_cut_short_receive_took() {
    let (memory, broker) = Misbehaving::over_memory(How::TakeOneThenHang);
    let builder = Consumer::builder(broker.clone(), "c")
        .subscribe("t")
        .lease(Duration::from_secs(3600));
    let (sub, h) = filled_and_started(&memory, builder, "t", ["taken".to_owned()]).await;
    wait_for("the delivery taken", || memory.depth(&sub) == (0, 1)).await;
    let s = h.shutdown().await.stats;
    assert_eq!((s.received, s.processed, s.released), (0, 0, 1), "{s:?}");
    assert_eq!(
        memory.depth(&sub),
        (1, 0),
        "released at shutdown, not left leased"
    );
}

/// A receive loop that dies (a backend's receive panics) still lets shutdown finish: the
/// group tasks parked for the next group end with the loop, and what was received before
/// is handled and acknowledged.
#[tokio::test(start_paused = true)]
async fn shutdown_finishes_after_the_receive_loop_panicked() {
    let (memory, broker) = Misbehaving::over_memory(How::PanicAfterFirst);
    let builder = Consumer::builder(broker.clone(), "c").subscribe("t");
    let (sub, h) = filled_and_started(&memory, builder, "t", (0..5).map(|i| format!("m{i}"))).await;
    wait_for("the first receive handled", || h.stats().processed == 5).await;
    let report = tokio::time::timeout(secs(120), h.shutdown())
        .await
        .expect("shutdown finishes although the receive loop panicked");
    assert_eq!(report.stats.processed, 5, "{report:?}");
    assert_eq!(memory.depth(&sub), (0, 0), "nothing left waiting or leased");
}

/// A dead letter the DLQ refuses is held and its copy sent again — not released, the
/// handler not called again — until the receiver no longer holds it (here: its lease
/// ended on the embedded broker, which does not renew leases) or a hard stop releases it.
#[tokio::test(start_paused = true)]
async fn a_refused_dead_letter_is_held_until_no_longer_held_or_stopped() {
    use reliq_core::Broker;
    let broker = Arc::new(MemoryBroker::new());
    let calls = Arc::new(AtomicU32::new(0));
    let builder = Consumer::builder(broker.clone(), "held")
        .subscribe("t")
        .lease(secs(5))
        .settle_backoff(Duration::from_millis(100), secs(1))
        .shutdown_timeout(secs(2));
    let sub = builder.subscription().unwrap();
    drop(broker.subscribe(&sub).await.unwrap());
    broker.faults().set_dead_letter_available("held", false);
    let c = calls.clone();
    let h = builder
        .start(move |_d: Delivery| {
            c.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), BoxError>(reliq_core::Permanent::msg("bad order").into()) }
        })
        .await
        .unwrap();
    broker
        .publish(&Destination::new("t"), Message::new("order"))
        .await
        .unwrap();
    // Held for its whole lease: copies sent again, the handler not called again.
    tokio::time::sleep(secs(4)).await;
    let s = h.stats();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "{s:?}");
    assert!(s.settle_failures >= 4, "{s:?}");
    assert_eq!((s.released, s.dead_lettered), (0, 0), "{s:?}");
    assert_eq!(broker.depth(&sub), (0, 1), "held, leased");
    // The lease ends: the broker hands it out again, and the first holder lets go
    // rather than dead-letter a delivery it no longer holds.
    wait_for("handled again after the lease", || {
        calls.load(Ordering::SeqCst) == 2
    })
    .await;
    // Stopping releases the delivery held now; the DLQ never got a copy.
    let s = h.shutdown().await.stats;
    assert_eq!((s.released, s.dead_lettered), (1, 0), "{s:?}");
    assert_eq!(broker.depth(&sub), (1, 0), "released at the stop");
    assert_eq!(broker.dead_letter_depth(&sub), 0);
}
