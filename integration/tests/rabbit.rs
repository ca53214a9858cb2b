//! RabbitMQ-specific tests beyond the portable suite, on the broker started by
//! `scripts/brokers`: the traps of seed 004 (a retry must not fan out to other consumers,
//! a broken retry route or a missing parking queue must not lose the source, a crash
//! between the confirmed retry copy and the ack gives two copies and one effect).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_trait::async_trait;
use reliq_conformance::browse_all;
use reliq_conformance::support::{Recorder, unique, wait_until};
use reliq_core::{
    BoxError, Broker, BrokerError, Capabilities, Consumer, DeadLetter, DeadLetterReason, Delivery,
    Destination, MemoryInbox, Message, RetryPolicy, Subscription, Transient,
    seam::{Receiver, RetryRequest, headers},
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
            .subscribe(topic.clone())
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

/// The dead-letter stream is gone: dead-lettering fails (nothing is acked), the message is
/// delivered again; once the stream is back the copy lands there with its record.
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
    backend.delete_queue(&Names::of(&s).parking).await?;
    let err = rx
        .dead_letter(&d, dead_copy(&d, "c"))
        .await
        .err()
        .context("must fail")?;
    ensure!(matches!(err, BrokerError::Unroutable(_)), "{err:?}");
    rx.release(&d, Duration::ZERO).await?;
    let again = receive(rx.as_ref()).await?;
    ensure!(again.id() == &id, "the source must come back");
    broker.declare_dead_letter_queue(&s).await?;
    rx.dead_letter(&again, dead_copy(&again, "c")).await?;
    rx.close().await?;
    let dlq = broker.dead_letters(&s).await?;
    let entries = browse_all(dlq.as_ref()).await?;
    ensure!(entries.len() == 1, "{} dead letters, not 1", entries.len());
    let record = entries[0].record()?;
    ensure!(entries[0].id() == &id && record.reason == DeadLetterReason::Permanent);
    ensure!(*record.origin.destination == *topic);
    ensure!(dlq.remove(std::slice::from_ref(&id)).await? == vec![id.clone()]);
    ensure!(
        dlq.count().await?.count == 0,
        "the removed entry is still counted"
    );
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
    async fn dead_letters(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, BrokerError> {
        self.inner.dead_letters(s).await
    }
    async fn ping(&self) -> Result<(), BrokerError> {
        self.inner.ping().await
    }

    async fn backlog(&self, s: &Subscription) -> Result<reliq_core::Backlog, BrokerError> {
        self.inner.backlog(s).await
    }

    async fn plan(&self, s: &Subscription) -> Result<reliq_core::Plan, reliq_core::BrokerError> {
        self.inner.plan(s).await
    }

    async fn inspect(
        &self,
        s: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, reliq_core::BrokerError> {
        self.inner.inspect(s, plan).await
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
            .subscribe(topic.clone())
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
    // The broker moved it to the landing queue; the consumer's relay (or the reader)
    // moves it into the dead-letter stream with a reliq record.
    let dlq = broker.dead_letters(&s).await?;
    let deadline = tokio::time::Instant::now() + SOON;
    let parked = loop {
        if let Some(entry) = dlq.get(&id).await? {
            break entry;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the delivery-limit move never reached the dead-letter stream"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let record = parked.record()?;
    ensure!(parked.id() == &id && parked.headers().get("tenant") == Some("acme"));
    ensure!(
        record.reason == DeadLetterReason::MaxDeliveries,
        "{record:?}"
    );
    ensure!(record.consumer == "c" && *record.origin.destination == *topic);
    ensure!(record.origin.route.as_deref() == Some("order.created"));
    ensure!(parked.headers().get("x-death").is_none());
    let entries = browse_all(dlq.as_ref()).await?;
    ensure!(
        entries.len() == 1,
        "one move, one entry: {:?}",
        entries.iter().map(|e| e.id()).collect::<Vec<_>>()
    );
    rx.close().await?;

    let version = broker.server_version().await.context("management API")?;
    let plan = broker.plan_text(&s).await;
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
        .subscribe(topic.clone())
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
    // The broker's own dead-lettering goes to the landing queue (reliq moves it on).
    ensure!(effective["dead-letter-routing-key"] == names.landing.as_str());
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
    for queue in [&names.queue, &names.landing]
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

/// A dead-letter copy of `d` with a `permanent` record.
fn dead_copy(d: &Delivery, consumer: &str) -> Message {
    let mut copy = d.message().clone();
    DeadLetter {
        reason: DeadLetterReason::Permanent,
        error_class: Some(reliq_core::ErrorClass::Permanent),
        error: Some("rejected by the test".into()),
        attempts: d.attempt(),
        first_failure_at: None,
        dead_lettered_at: std::time::SystemTime::now(),
        consumer: consumer.into(),
        origin: d.origin().clone(),
    }
    .write(copy.headers_mut());
    copy
}

/// Publish `n` messages to `topic` and dead-letter each through a receiver of `s`; their
/// ids in dead-letter order. The receiver is closed afterwards.
async fn dead_letter_n(
    broker: &RabbitBroker,
    s: &Subscription,
    n: usize,
) -> anyhow::Result<Vec<reliq_core::MessageId>> {
    let rx = broker.subscribe(s).await?;
    for i in 0..n {
        broker
            .publish(
                &Destination::new(s.source.clone()),
                Message::new(format!("dead {i}")).with_header("n", i.to_string()),
            )
            .await?;
    }
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let d = receive(rx.as_ref()).await?;
        rx.dead_letter(&d, dead_copy(&d, &s.consumer)).await?;
        ids.push(d.id().clone());
    }
    rx.close().await?;
    Ok(ids)
}

/// Every entry of a stream read raw (offset, headers as AMQP sees them), until it is quiet
/// for 1.5 s: what the broker holds, independent of reliq's reader.
async fn raw_stream(
    backend: &RabbitBackend,
    stream: &str,
) -> anyhow::Result<Vec<(i64, lapin::types::FieldTable)>> {
    use futures::StreamExt as _;
    let raw = backend.raw().await?;
    let ch = raw.create_channel().await?;
    ch.basic_qos(100, lapin::options::BasicQosOptions::default())
        .await?;
    let mut args = lapin::types::FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        lapin::types::AMQPValue::LongString("first".into()),
    );
    let mut consumer = ch
        .basic_consume(
            stream.into(),
            "".into(),
            lapin::options::BasicConsumeOptions::default(),
            args,
        )
        .await?;
    let mut out = Vec::new();
    while let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(1500), consumer.next()).await
    {
        let d = d?;
        d.ack(lapin::options::BasicAckOptions::default()).await?;
        let headers = d.properties.headers().clone().unwrap_or_default();
        let offset = match headers.inner().get("x-stream-offset") {
            Some(lapin::types::AMQPValue::LongLongInt(n)) => *n,
            other => anyhow::bail!("no x-stream-offset: {other:?}"),
        };
        out.push((offset, headers));
    }
    ch.close(200, "ok".into()).await?;
    Ok(out)
}

/// Ready messages in a queue (passive declare: exact for classic and quorum queues).
async fn depth(backend: &RabbitBackend, queue: &str) -> anyhow::Result<u32> {
    let raw = backend.raw().await?;
    let ch = raw.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await?;
    ch.close(200, "ok".into()).await?;
    Ok(q.message_count())
}

/// Browsing the dead-letter stream changes no dead letter: two full browses (pages of 7)
/// give the same entries in the same order, each entry once; the broker's copies keep
/// their offsets and carry no delivery count; the source queue, the landing queue and the
/// count are unchanged; what a browse adds is its read fence, one per page, after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsing_dead_letters_changes_nothing_and_pages_cover_each_entry_once()
-> anyhow::Result<()> {
    let backend = RabbitBackend::new();
    let broker = RabbitBackend::broker().await?;
    let topic = unique("dlq-browse");
    let s = sub("c", &topic);
    let ids = dead_letter_n(&broker, &s, 25).await?;
    // Five messages wait in the source queue, untouched by any browse.
    for i in 0..5 {
        broker
            .publish(
                &Destination::new(topic.clone()),
                Message::new(format!("waiting {i}")),
            )
            .await?;
    }
    let names = Names::of(&s);
    let dlq = broker.dead_letters(&s).await?;
    let raw_before = raw_stream(&backend, &names.parking).await?;
    let source_before = depth(&backend, &names.queue).await?;
    let count_before = dlq.count().await?;

    let browse_paged = || async {
        let mut cursor = reliq_core::Cursor::start();
        let mut all = Vec::new();
        let mut pages = 0;
        loop {
            let page = dlq.browse(&cursor, 7).await?;
            pages += 1;
            all.extend(page.entries);
            if page.at_end {
                return Ok::<_, anyhow::Error>((all, pages));
            }
            cursor = page.next;
        }
    };
    let (first, pages) = browse_paged().await?;
    let (second, _) = browse_paged().await?;
    let seen: Vec<_> = first.iter().map(|e| e.id().clone()).collect();
    ensure!(
        seen == ids,
        "every entry once, in dead-letter order: {seen:?}"
    );
    ensure!(pages == 4, "25 entries in pages of 7: {pages} pages");
    ensure!(first == second, "a second browse differs from the first");
    ensure!(
        first.iter().all(|e| e
            .record()
            .is_ok_and(|r| r.reason == DeadLetterReason::Permanent)),
        "every entry carries its record"
    );

    // Each browse appended one read fence (a confirmed, empty entry with a
    // `reliq-fence` header, after every dead letter): the dead letters themselves are
    // untouched.
    let (raw_after, fences): (Vec<_>, Vec<_>) = raw_stream(&backend, &names.parking)
        .await?
        .into_iter()
        .partition(|(_, h)| !h.inner().contains_key("reliq-fence"));
    let offsets = |raw: &[(i64, lapin::types::FieldTable)]| -> Vec<i64> {
        raw.iter().map(|(o, _)| *o).collect()
    };
    ensure!(
        raw_before.len() == 25,
        "{} entries in the stream",
        raw_before.len()
    );
    ensure!(
        fences.len() == 2 * pages,
        "{} read fences after {} browses",
        fences.len(),
        2 * pages
    );
    let last_entry = offsets(&raw_before).into_iter().max().unwrap_or_default();
    ensure!(
        offsets(&fences).iter().all(|o| *o > last_entry),
        "a fence before a dead letter: {:?}",
        offsets(&fences)
    );
    ensure!(offsets(&raw_before) == offsets(&raw_after), "offsets moved");
    ensure!(
        raw_before == raw_after,
        "the broker's copies changed while browsing"
    );
    ensure!(
        raw_after
            .iter()
            .all(|(_, h)| !h.inner().contains_key("x-delivery-count")),
        "a stream entry carries a delivery count"
    );
    ensure!(depth(&backend, &names.queue).await? == source_before);
    ensure!(source_before == 5, "source depth {source_before}");
    ensure!(depth(&backend, &names.landing).await? == 0);
    let count_after = dlq.count().await?;
    ensure!(
        count_before == count_after && count_after.count == 25,
        "{count_after:?}"
    );
    let oldest = first[0].record()?.dead_lettered_at;
    ensure!(
        count_after.oldest_dead_lettered_at == Some(oldest),
        "oldest {:?}, first entry {oldest:?}",
        count_after.oldest_dead_lettered_at
    );
    // A page at the end, read again later, picks up what was dead-lettered since.
    let end = dlq.browse(&reliq_core::Cursor::start(), 100).await?;
    ensure!(end.at_end && end.entries.len() == 25);
    let later = dead_letter_n(&broker, &s, 1).await?;
    let tail = dlq.browse(&end.next, 100).await?;
    let tail_ids: Vec<_> = tail.entries.iter().map(|e| e.id().clone()).collect();
    ensure!(tail_ids == later && tail.at_end, "{tail_ids:?}");
    Ok(())
}

/// A removal is a confirmed ledger record: a new reader on a new connection never sees
/// the removed entries again, the others keep their order, the count and the oldest
/// time follow, and ids that are not there (or no longer) are skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_dead_letters_never_reappear_for_a_new_reader() -> anyhow::Result<()> {
    let broker = RabbitBackend::broker().await?;
    let topic = unique("dlq-remove");
    let s = sub("c", &topic);
    let ids = dead_letter_n(&broker, &s, 6).await?;
    let a = broker.dead_letters(&s).await?;
    // A cursor taken before the removal still reads on correctly afterwards.
    let page = a.browse(&reliq_core::Cursor::start(), 2).await?;
    ensure!(page.entries.len() == 2 && !page.at_end);
    let gone = vec![ids[0].clone(), ids[3].clone()];
    let unknown = reliq_core::MessageId::from("not-in-the-dlq");
    let removed = a
        .remove(&[gone[0].clone(), unknown.clone(), gone[1].clone()])
        .await?;
    ensure!(removed == gone, "{removed:?}");
    ensure!(a.remove(&gone).await?.is_empty(), "removed twice");

    let b = RabbitBackend::broker().await?.dead_letters(&s).await?;
    let left: Vec<_> = browse_all(b.as_ref())
        .await?
        .iter()
        .map(|e| e.id().clone())
        .collect();
    let expected = vec![
        ids[1].clone(),
        ids[2].clone(),
        ids[4].clone(),
        ids[5].clone(),
    ];
    ensure!(left == expected, "{left:?}");
    let rest = b.browse(&page.next, 100).await?;
    let rest_ids: Vec<_> = rest.entries.iter().map(|e| e.id().clone()).collect();
    ensure!(rest_ids == expected[1..], "{rest_ids:?}");
    ensure!(b.get(&gone[0]).await?.is_none() && b.get(&ids[2]).await?.is_some());
    let count = b.count().await?;
    let oldest = b
        .get(&ids[1])
        .await?
        .context("entry 1")?
        .record()?
        .dead_lettered_at;
    ensure!(count.count == 4, "{count:?}");
    ensure!(count.oldest_dead_lettered_at == Some(oldest), "{count:?}");
    // Remove the rest: empty, for both readers.
    ensure!(b.remove(&expected).await? == expected);
    ensure!(a.count().await?.count == 0);
    ensure!(browse_all(a.as_ref()).await?.is_empty());
    Ok(())
}

/// What sits in the landing queue — an existing deployment's quorum parking queue of the
/// same name, or delivery-limit moves made while no consumer ran — is moved into the
/// stream by the reader: a reliq dead letter as it was, a broker move (`x-death`) as a
/// `max-deliveries` record with the move's time, queue and routing key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landed_dead_letters_are_moved_into_the_stream_by_the_reader() -> anyhow::Result<()> {
    use lapin::types::{AMQPValue, FieldArray, FieldTable};
    let backend = RabbitBackend::new();
    let broker = RabbitBackend::broker().await?;
    let topic = unique("dlq-landing");
    let s = sub("c", &topic);
    let names = broker.declare(&s).await?;
    let raw = backend.raw().await?;
    let ch = raw.create_channel().await?;
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    // A reliq dead letter published by an earlier reliq to its quorum parking queue.
    let legacy = Message::new("legacy").with_header(headers::ATTEMPT, "3");
    let mut legacy_dead = legacy.clone();
    let legacy_at = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    DeadLetter {
        reason: DeadLetterReason::Exhausted,
        error_class: Some(reliq_core::ErrorClass::Transient),
        error: Some("timeout".into()),
        attempts: 3,
        first_failure_at: None,
        dead_lettered_at: legacy_at,
        consumer: "c".into(),
        origin: reliq_core::Origin {
            destination: topic.as_str().into(),
            ..reliq_core::Origin::default()
        },
    }
    .write(legacy_dead.headers_mut());
    let mut legacy_headers = FieldTable::default();
    for (k, v) in legacy_dead.headers().iter() {
        legacy_headers.insert(k.into(), AMQPValue::LongString(v.into()));
    }
    // A delivery-limit move as the broker writes it.
    let mut death = FieldTable::default();
    death.insert(
        "reason".into(),
        AMQPValue::LongString("delivery_limit".into()),
    );
    death.insert(
        "queue".into(),
        AMQPValue::LongString(names.queue.as_str().into()),
    );
    death.insert("count".into(), AMQPValue::LongLongInt(1));
    death.insert(
        "exchange".into(),
        AMQPValue::LongString(topic.as_str().into()),
    );
    death.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
            "order.created".into(),
        )])),
    );
    death.insert("time".into(), AMQPValue::Timestamp(1_700_000_100));
    let mut moved_headers = FieldTable::default();
    moved_headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
    );
    for (id, headers, payload) in [
        (legacy.id().as_str(), legacy_headers, "legacy"),
        ("moved-by-the-broker", moved_headers, "crash loop"),
    ] {
        ch.basic_publish(
            "".into(),
            names.landing.as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            payload.as_bytes(),
            lapin::BasicProperties::default()
                .with_message_id(id.into())
                .with_headers(headers),
        )
        .await?
        .await?;
    }
    ch.close(200, "ok".into()).await?;
    ensure!(depth(&backend, &names.landing).await? == 2);

    let dlq = broker.dead_letters(&s).await?;
    let entries = browse_all(dlq.as_ref()).await?;
    ensure!(entries.len() == 2, "{entries:?}");
    ensure!(
        depth(&backend, &names.landing).await? == 0,
        "the landing queue was not drained"
    );
    let first = entries[0].record()?;
    ensure!(entries[0].id() == legacy.id() && first.reason == DeadLetterReason::Exhausted);
    ensure!(first.dead_lettered_at == legacy_at && first.attempts == 3);
    let second = entries[1].record()?;
    ensure!(entries[1].id().as_str() == "moved-by-the-broker");
    ensure!(
        second.reason == DeadLetterReason::MaxDeliveries,
        "{second:?}"
    );
    ensure!(
        second.dead_lettered_at
            == std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_100)
    );
    ensure!(second.origin.route.as_deref() == Some("order.created"));
    ensure!(*second.origin.destination == *topic && second.consumer == "c");
    let count = dlq.count().await?;
    ensure!(
        count.count == 2 && count.oldest_dead_lettered_at == Some(legacy_at),
        "{count:?}"
    );
    // A second read moves nothing again.
    ensure!(browse_all(dlq.as_ref()).await?.len() == 2);
    Ok(())
}
