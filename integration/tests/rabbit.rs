//! RabbitMQ-specific tests beyond the portable suite, on the broker started by
//! `scripts/brokers`: the traps of seed 004 (a retry must not fan out to other consumers,
//! a broken retry route or a missing parking queue must not lose the source, a crash
//! between the confirmed retry copy and the ack gives two copies and one effect).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_trait::async_trait;
use reliq_conformance::support::{Recorder, unique, wait_until};
use reliq_core::headers;
use reliq_core::{
    BoxError, Broker, BrokerError, Capabilities, Consumer, DeadLetter, DeadLetterReason, Delivery,
    Destination, MemoryInbox, Message, Receiver, RetryPolicy, RetryRequest, Subscription,
    Transient,
};
use reliq_integration::rabbit::RabbitBackend;
use reliq_rabbit::{Names, RabbitBroker};

const TIERS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(2)];
const SOON: Duration = Duration::from_secs(30);

fn sub(consumer: &str, source: &str) -> Subscription {
    let mut s = Subscription::new(consumer, source);
    s.retry_tiers = TIERS.to_vec();
    s.delivery_limit = 8;
    s.prefetch = 8;
    s
}

async fn receive(rx: &dyn Receiver) -> anyhow::Result<Delivery> {
    Ok(tokio::time::timeout(SOON, rx.receive())
        .await
        .context("no delivery within 30 s")??)
}

/// Two consumer queues bound to one exchange: the consumer that fails and retries sees
/// its retry; the other consumer sees every message exactly once and never a retry copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_of_one_consumer_never_reaches_another_on_the_same_exchange() -> anyhow::Result<()> {
    let broker: Arc<dyn Broker> = Arc::new(RabbitBackend::broker().await?);
    let topic = unique("fanout-retry");
    let (failing, other) = (Recorder::new(), Recorder::new());
    let start = |name: &'static str, rec: Recorder, fail_first: bool| {
        Consumer::builder(broker.clone(), name)
            .subscribe(topic.clone(), None::<String>)
            .retry(RetryPolicy::tiers(TIERS).max_attempts(3))
            .start(move |d: Delivery| {
                let r = rec.clone();
                async move {
                    r.call(&d);
                    if fail_first && d.attempt() == 1 {
                        return Err::<(), BoxError>(Transient::msg("downstream busy").into());
                    }
                    r.effect(d.id());
                    Ok(())
                }
            })
    };
    let a = start("retrying", failing.clone(), true).await?;
    let b = start("bystander", other.clone(), false).await?;
    let msgs: Vec<Message> = (0..20).map(|i| Message::new(format!("m{i}"))).collect();
    for m in &msgs {
        broker
            .publish(&Destination::new(topic.clone()), m.clone())
            .await?;
    }
    wait_until(
        "the retrying consumer processed all 20 on attempt 2",
        SOON,
        || failing.effect_count() == 20,
    )
    .await?;
    // Longer than the 1 s tier plus slack: a leaked retry copy would have arrived by now.
    tokio::time::sleep(TIERS[0] * 3).await;
    let calls = other.calls();
    ensure!(
        calls.len() == 20,
        "the bystander was called {} times, not 20",
        calls.len()
    );
    ensure!(
        calls.iter().all(|c| c.attempt == 1),
        "a retry copy reached the bystander"
    );
    ensure!(other.effects().values().all(|n| *n == 1));
    let attempts: Vec<u32> = failing.calls().iter().map(|c| c.attempt).collect();
    ensure!(attempts.iter().filter(|a| **a == 1).count() == 20);
    ensure!(attempts.iter().filter(|a| **a == 2).count() == 20);
    let (sa, sb) = (a.shutdown().await.stats, b.shutdown().await.stats);
    ensure!(sa.retried == 20 && sa.processed == 20, "{sa:?}");
    ensure!(sb.retried == 0 && sb.processed == 20, "{sb:?}");
    Ok(())
}

/// The retry queue is deleted: the mandatory, confirmed publish comes back with
/// `basic.return` (Unroutable), the source is not acked and is delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_route_deleted_returns_and_source_is_not_acked() -> anyhow::Result<()> {
    let backend = RabbitBackend::new();
    let broker = RabbitBackend::broker().await?;
    let topic = unique("retry-return");
    let s = sub("c", &topic);
    let rx = broker.subscribe(&s).await?;
    let m = Message::new("x").with_key("k1");
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    let d = receive(rx.as_ref()).await?;
    ensure!(d.id() == &id && d.attempt() == 1);
    for (_, q) in Names::of(&s).retry {
        backend.delete_queue(&q).await?;
    }
    let mut copy = d.message().clone();
    copy.headers_mut().insert(headers::ATTEMPT, "2");
    let err = rx
        .retry(
            &d,
            RetryRequest {
                message: copy,
                delay: TIERS[0],
                tier: 0,
            },
        )
        .await
        .err()
        .context("retry to a deleted queue must fail")?;
    ensure!(
        matches!(&err, BrokerError::Unroutable(text) if text.contains("basic.return")),
        "expected Unroutable from basic.return, got {err:?}"
    );
    // Not acked: closing the channel gives it back, and it is delivered again, unchanged.
    rx.close().await?;
    drop(rx);
    let rx = broker.subscribe(&s).await?; // also restores the retry queues
    let again = receive(rx.as_ref()).await?;
    ensure!(again.id() == &id && again.attempt() == 1 && again.key() == Some("k1"));
    // With the route back, the same retry goes through and arrives after the tier delay.
    let mut copy = again.message().clone();
    copy.headers_mut().insert(headers::ATTEMPT, "2");
    let sent = tokio::time::Instant::now();
    rx.retry(
        &again,
        RetryRequest {
            message: copy,
            delay: TIERS[0],
            tier: 0,
        },
    )
    .await?;
    let retried = receive(rx.as_ref()).await?;
    ensure!(retried.id() == &id && retried.attempt() == 2);
    ensure!(
        sent.elapsed() >= TIERS[0],
        "the retry came back after {:?}",
        sent.elapsed()
    );
    ensure!(
        *retried.origin().destination == *topic,
        "origin {:?}",
        retried.origin()
    );
    rx.ack(&retried).await?;
    rx.close().await?;
    Ok(())
}

/// The parking queue is gone: dead-lettering fails (nothing is acked), the message is
/// delivered again; once the parking queue is back the copy lands there with its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_queue_unavailable_loses_nothing() -> anyhow::Result<()> {
    let backend = RabbitBackend::new();
    let broker = RabbitBackend::broker().await?;
    let topic = unique("parking-down");
    let s = sub("c", &topic);
    let rx = broker.subscribe(&s).await?;
    let m = Message::new("bad order");
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    let d = receive(rx.as_ref()).await?;
    backend.delete_queue(&s.dead_letter_name()).await?;
    let dead = |d: &Delivery| {
        let mut copy = d.message().clone();
        DeadLetter {
            reason: DeadLetterReason::Permanent,
            error_class: Some(reliq_core::ErrorClass::Permanent),
            error: Some("bad order".into()),
            attempts: d.attempt(),
            first_failure_at: None,
            dead_lettered_at: std::time::SystemTime::now(),
            consumer: "c".into(),
            origin: d.origin().clone(),
        }
        .write(copy.headers_mut());
        copy
    };
    let err = rx
        .dead_letter(&d, dead(&d))
        .await
        .err()
        .context("must fail")?;
    ensure!(matches!(err, BrokerError::Unroutable(_)), "{err:?}");
    rx.release(&d, Duration::ZERO).await?;
    let again = receive(rx.as_ref()).await?;
    ensure!(again.id() == &id, "the source must come back");
    broker.declare_dead_letter_queue(&s).await?;
    rx.dead_letter(&again, dead(&again)).await?;
    rx.close().await?;
    let dlq = broker.dead_letter_receiver(&s).await?;
    let parked = receive(dlq.as_ref()).await?;
    let record = DeadLetter::read(parked.headers())?;
    ensure!(parked.id() == &id && record.reason == DeadLetterReason::Permanent);
    ensure!(*record.origin.destination == *topic);
    dlq.ack(&parked).await?;
    ensure!(
        tokio::time::timeout(Duration::from_millis(1500), dlq.receive())
            .await
            .is_err(),
        "exactly one copy in the parking queue"
    );
    dlq.close().await?;
    Ok(())
}

/// A receiver whose `retry` publishes the copy (confirmed) and then loses its channel
/// without acking, as a process killed between the confirm and the ack would.
struct StallAfterRetryCopy {
    inner: RabbitBroker,
    copies: Arc<AtomicU32>,
}

struct StallingReceiver {
    inner: Box<dyn Receiver>,
    broker: RabbitBroker,
    sub: Subscription,
    copies: Arc<AtomicU32>,
}

#[async_trait]
impl Broker for StallAfterRetryCopy {
    fn kind(&self) -> &'static str {
        "rabbit"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn publish(&self, d: &Destination, m: Message) -> Result<(), BrokerError> {
        self.inner.publish(d, m).await
    }
    async fn subscribe(&self, s: &Subscription) -> Result<Box<dyn Receiver>, BrokerError> {
        Ok(Box::new(StallingReceiver {
            inner: self.inner.subscribe(s).await?,
            broker: self.inner.clone(),
            sub: s.clone(),
            copies: self.copies.clone(),
        }))
    }
    async fn dead_letter_receiver(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn Receiver>, BrokerError> {
        self.inner.dead_letter_receiver(s).await
    }
    async fn dead_letters(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        self.inner.dead_letters(s).await
    }
}

#[async_trait]
impl Receiver for StallingReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        self.inner.receive().await
    }
    async fn ack(&self, d: &Delivery) -> Result<(), BrokerError> {
        self.inner.ack(d).await
    }
    async fn retry(&self, _d: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        // The confirmed copy to the tier's TTL queue (default exchange) …
        let queue = self.sub.retry_name(self.sub.retry_tiers[retry.tier]);
        self.broker
            .publish(&Destination::new("").with_route(queue), retry.message)
            .await?;
        self.copies.fetch_add(1, Ordering::SeqCst);
        // … and the process dies before the ack: its channel closes, as on a kill.
        self.inner.close().await?;
        Err(BrokerError::connection(
            "simulated kill between the confirmed retry copy and the ack",
        ))
    }
    async fn dead_letter(&self, d: &Delivery, m: Message) -> Result<(), BrokerError> {
        self.inner.dead_letter(d, m).await
    }
    async fn release(&self, d: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        self.inner.release(d, delay).await
    }
    async fn close(&self) -> Result<(), BrokerError> {
        self.inner.close().await
    }
}

/// Killed after the retry copy was confirmed but before the source was acked: the
/// source comes back *and* the retry copy arrives — two copies, one effect with an inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_retry_copy_and_ack_gives_two_copies_one_effect() -> anyhow::Result<()> {
    let topic = unique("retry-crash");
    let copies = Arc::new(AtomicU32::new(0));
    let stalling: Arc<dyn Broker> = Arc::new(StallAfterRetryCopy {
        inner: RabbitBackend::broker().await?,
        copies: copies.clone(),
    });
    let inbox = Arc::new(MemoryInbox::new());
    let builder = |broker: Arc<dyn Broker>| {
        Consumer::builder(broker, "c")
            .subscribe(topic.clone(), None::<String>)
            .retry(RetryPolicy::tiers(TIERS).max_attempts(3))
            .inbox(inbox.clone())
    };
    let h = builder(stalling.clone())
        .start(|_d: Delivery| async move {
            Err::<(), BoxError>(Transient::msg("database restarting").into())
        })
        .await?;
    let m = Message::new("order-1");
    let id = m.id().clone();
    stalling
        .publish(&Destination::new(topic.clone()), m)
        .await?;
    wait_until("retry copy confirmed", SOON, || {
        copies.load(Ordering::SeqCst) == 1
    })
    .await?;
    h.crash().await;

    let rec = Recorder::new();
    let r = rec.clone();
    let h = builder(Arc::new(RabbitBackend::broker().await?))
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                r.call(&d);
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    wait_until("both copies seen", SOON, || {
        h.stats().processed + h.stats().duplicates == 2
    })
    .await?;
    let s = h.shutdown().await.stats;
    ensure!(s.processed == 1 && s.duplicates == 1, "{s:?}");
    ensure!(
        rec.effects().get(&id) == Some(&1),
        "effects {:?}",
        rec.effects()
    );
    let attempts: Vec<u32> = rec.calls_for(&id).iter().map(|c| c.attempt).collect();
    ensure!(
        attempts.len() == 1,
        "the inbox skips the second copy before the handler: {attempts:?}"
    );
    ensure!(inbox.contains("c", &id));
    Ok(())
}

/// The broker's delivery limit moves a crash-looping message to the parking queue with
/// `x-death`; the DLQ reader turns it into a reliq record (`max-deliveries`), and the
/// topology plan shows the equivalent policies for this broker's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_dead_letter_is_read_as_max_deliveries_and_plan_matches_version()
-> anyhow::Result<()> {
    let broker = RabbitBackend::broker().await?;
    let topic = unique("x-death");
    let mut s = sub("c", &topic);
    s.delivery_limit = 2;
    let rx = broker.subscribe(&s).await?;
    let m = Message::new("boom").with_header("tenant", "acme");
    let id = m.id().clone();
    broker
        .publish(
            &Destination::new(topic.clone()).with_route("order.created"),
            m,
        )
        .await?;
    for n in 1..=2 {
        let d = receive(rx.as_ref()).await?;
        ensure!(d.id() == &id, "delivery {n}");
        rx.release(&d, Duration::ZERO).await?;
    }
    let dlq = broker.dead_letter_receiver(&s).await?;
    let parked = receive(dlq.as_ref()).await?;
    let record = DeadLetter::read(parked.headers())?;
    ensure!(parked.id() == &id && parked.headers().get("tenant") == Some("acme"));
    ensure!(
        record.reason == DeadLetterReason::MaxDeliveries,
        "{record:?}"
    );
    ensure!(record.consumer == "c" && *record.origin.destination == *topic);
    ensure!(record.origin.route.as_deref() == Some("order.created"));
    ensure!(parked.headers().get("x-death").is_none());
    dlq.ack(&parked).await?;
    dlq.close().await?;
    rx.close().await?;

    let version = broker.server_version().await.context("management API")?;
    let plan = broker.plan(&s).await;
    let apply_to = if reliq_rabbit::knows_quorum_apply_to(&version) {
        "--apply-to quorum_queues"
    } else {
        "--apply-to queues"
    };
    ensure!(plan.contains(apply_to), "{plan}");
    ensure!(
        plan.contains(&format!("queue {}.c.retry.1000ms", topic)),
        "{plan}"
    );
    ensure!(plan.contains("\"delivery-limit\":1"), "{plan}");
    Ok(())
}

/// The connection is killed by the broker (management API) while a handler runs: the
/// consumer reconnects with backoff, re-declares its topology and resumes; the delivery
/// that was unacked on the lost channel comes back; publishing reconnects too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_loss_reconnects_and_unacked_delivery_comes_back() -> anyhow::Result<()> {
    let name = unique("reconnect-conn");
    let options = reliq_rabbit::RabbitOptions {
        connection_name: name.clone(),
        ..RabbitBackend::options()
    };
    let url = reliq_integration::settings::get("RELIQ_RABBIT_URL");
    let rabbit = RabbitBroker::connect_with(&url, options).await?;
    let mgmt = rabbit.management().context("management URL")?.clone();
    let broker: Arc<dyn Broker> = Arc::new(rabbit);
    let topic = unique("reconnect");
    let rec = Recorder::new();
    let gate = Arc::new(tokio::sync::Notify::new());
    let (r, g) = (rec.clone(), gate.clone());
    let h = Consumer::builder(broker.clone(), "c")
        .subscribe(topic.clone(), None::<String>)
        .retry(RetryPolicy::tiers(TIERS).max_attempts(3))
        .settle_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .start(move |d: Delivery| {
            let (r, g) = (r.clone(), g.clone());
            async move {
                r.call(&d);
                if d.payload() == b"held" && r.calls_for(d.id()).len() == 1 {
                    g.notified().await; // still running when the connection dies
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let held = Message::new("held");
    let held_id = held.id().clone();
    broker
        .publish(&Destination::new(topic.clone()), held)
        .await?;
    wait_until("handler holds the message", SOON, || {
        rec.calls_for(&held_id).len() == 1
    })
    .await?;

    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        if mgmt.close_connections(&name).await? > 0 {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "connection never listed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    gate.notify_one(); // the handler finishes; its ack goes to a dead channel
    wait_until(
        "the unacked delivery came back on the new channel",
        SOON,
        || rec.calls_for(&held_id).len() == 2,
    )
    .await?;
    let after: Vec<Message> = (0..10)
        .map(|i| Message::new(format!("after-{i}")))
        .collect();
    for m in &after {
        broker
            .publish(&Destination::new(topic.clone()), m.clone())
            .await?;
    }
    wait_until("messages after the reconnect processed", SOON, || {
        after.iter().all(|m| rec.calls_for(m.id()).len() == 1)
    })
    .await?;
    let s = h.shutdown().await.stats;
    // 12 handler completions: the held message twice, ten after. The first ack of the
    // held message went to a dying connection: AMQP acks are not confirmed, so it either
    // failed (channel already known closed) or "succeeded" into a socket the broker had
    // closed; either way the broker redelivered it, as asserted above.
    ensure!(s.processed + s.settle_failures == 12, "{s:?}");
    ensure!(s.processed >= 11, "{s:?}");
    Ok(())
}

/// One queue's settings as the management API shows them.
async fn queue_info(broker: &RabbitBroker, queue: &str) -> anyhow::Result<serde_json::Value> {
    let api = broker.management().context("management URL")?;
    Ok(api.queue("/", queue).await?)
}

/// A queue's info once `ready` holds (the management API lags by its statistics
/// interval); an error with the last info after 20 s.
async fn queue_info_when(
    broker: &RabbitBroker,
    queue: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let info = queue_info(broker, queue).await?;
        if ready(&info) {
            return Ok(info);
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "queue {queue} never reached the expected state: {info:#}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// With a management URL the settings live in one policy per queue: the queue carries
/// only its type, the policy holds the delivery limit / dead-lettering / TTL with the
/// `apply-to` of this broker's version, and a changed delivery limit is applied by
/// declaring again — no PRECONDITION_FAILED, no queue to recreate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_carry_the_settings_and_change_without_recreating_the_queue() -> anyhow::Result<()>
{
    let broker = RabbitBackend::policy_broker().await?;
    let topic = unique("policies");
    let mut s = sub("c", &topic);
    s.delivery_limit = 5;
    let names = broker.declare(&s).await?;

    // The management API refreshes a queue's `policy` with the statistics (5 s).
    let main = queue_info_when(&broker, &names.queue, |q| {
        q["policy"] == format!("reliq-{}", names.queue)
    })
    .await?;
    let args = main["arguments"].as_object().context("arguments")?;
    ensure!(
        args.keys().collect::<Vec<_>>() == ["x-queue-type"],
        "the queue must carry only its type: {args:?}"
    );
    let effective = &main["effective_policy_definition"];
    ensure!(effective["delivery-limit"] == 4, "{effective:#}");
    ensure!(effective["dead-letter-routing-key"] == names.parking.as_str());
    ensure!(effective["dead-letter-strategy"] == "at-least-once");
    ensure!(effective["overflow"] == "reject-publish");

    let (delay, retry_queue) = &names.retry[0];
    let retry = queue_info_when(&broker, retry_queue, |q| !q["policy"].is_null()).await?;
    ensure!(retry["effective_policy_definition"]["message-ttl"] == delay.as_millis() as u64);
    ensure!(
        retry["effective_policy_definition"]["dead-letter-routing-key"] == names.queue.as_str()
    );

    let api = broker.management().context("management URL")?;
    let version = api.server_version().await?;
    let policy = api
        .get(&format!("/api/policies/%2F/reliq-{}", names.queue))
        .await?;
    let apply_to = if reliq_rabbit::knows_quorum_apply_to(&version) {
        "quorum_queues"
    } else {
        "queues"
    };
    ensure!(policy["apply-to"] == apply_to, "{policy:#}");
    ensure!(policy["priority"] == 10, "{policy:#}");

    // A new delivery limit: declared again, applied through the policy.
    s.delivery_limit = 9;
    broker.declare(&s).await?;
    queue_info_when(&broker, &names.queue, |q| {
        q["effective_policy_definition"]["delivery-limit"] == 8
    })
    .await?;
    // Policies outlive their queues: remove this test's.
    for queue in [&names.queue, &names.parking]
        .into_iter()
        .chain(names.retry.iter().map(|(_, q)| q))
    {
        api.delete_policy("/", &format!("reliq-{queue}")).await?;
    }
    Ok(())
}

/// Without policies the settings are queue arguments, fixed for the queue's life:
/// declaring it again with another delivery limit is a configuration error naming the
/// queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arguments_mode_fixes_settings_in_the_queue() -> anyhow::Result<()> {
    let url = reliq_integration::settings::get("RELIQ_RABBIT_URL");
    let broker = RabbitBroker::connect_with(
        &url,
        reliq_rabbit::RabbitOptions {
            queue_settings: reliq_rabbit::QueueSettings::Arguments,
            ..RabbitBackend::options()
        },
    )
    .await?;
    let topic = unique("arguments");
    let mut s = sub("c", &topic);
    s.delivery_limit = 5;
    let names = broker.declare(&s).await?;
    let main = queue_info(&broker, &names.queue).await?;
    ensure!(main["arguments"]["x-delivery-limit"] == 4, "{main:#}");
    ensure!(main["policy"].as_str().unwrap_or("").is_empty(), "{main:#}");
    s.delivery_limit = 9;
    match broker.declare(&s).await {
        Err(BrokerError::Config { field, .. }) => ensure!(field == names.queue, "{field}"),
        other => anyhow::bail!("expected a configuration error, got {other:?}"),
    }
    Ok(())
}

/// An operator's broader policy with a higher priority would silently replace reliq's
/// (RabbitMQ applies one policy per queue): the declaration fails naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_policy_is_reported_at_declaration() -> anyhow::Result<()> {
    let broker = RabbitBackend::policy_broker().await?;
    let api = broker.management().context("management URL")?.clone();
    let topic = unique("shadowed");
    let shadow = reliq_rabbit::Policy {
        name: format!("ops-{topic}"),
        pattern: format!("^{}\\.", topic.replace('.', "\\.")),
        apply_to: "queues".into(),
        priority: 50,
        definition: serde_json::json!({"max-length": 100_000})
            .as_object()
            .cloned()
            .context("object")?,
    };
    api.put_policy("/", &shadow).await?;
    let result = broker.declare(&sub("c", &topic)).await;
    api.delete_policy("/", &shadow.name).await?;
    match result {
        Err(BrokerError::Config { field, reason }) => {
            ensure!(field == "policy_priority", "{field}");
            ensure!(
                reason.contains(&shadow.name) && reason.contains(&format!("reliq-{topic}.c")),
                "{reason}"
            );
        }
        other => anyhow::bail!("expected a configuration error, got {other:?}"),
    }
    Ok(())
}

/// `Policies` without a reachable management API fails at connect, naming the field —
/// it never falls back to arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_without_a_management_api_fail_at_connect() -> anyhow::Result<()> {
    let url = reliq_integration::settings::get("RELIQ_RABBIT_URL");
    for management_url in [None, Some("http://guest:guest@127.0.0.1:1".to_owned())] {
        let result = RabbitBroker::connect_with(
            &url,
            reliq_rabbit::RabbitOptions {
                queue_settings: reliq_rabbit::QueueSettings::Policies,
                management_url: management_url.clone(),
                ..RabbitBackend::options()
            },
        )
        .await;
        match result {
            Err(BrokerError::Config { field, .. }) => {
                ensure!(field == "management_url", "{management_url:?}: {field}")
            }
            other => {
                anyhow::bail!("{management_url:?}: expected a configuration error, got {other:?}")
            }
        }
    }
    Ok(())
}
