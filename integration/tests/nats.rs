//! NATS JetStream behaviour beyond the portable suite (the server from scripts/brokers).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use reliq_conformance::support::unique;
use reliq_core::{
    BoxError, Broker, Consumer, DeadLetter, DeadLetterReason, Delivery, Destination, Message,
    RetryPolicy, Subscription,
};
use reliq_integration::nats::NatsBackend;

/// A handler running 3× the ack wait is kept leased by in-progress acks: not redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_handler_is_kept_leased_by_progress_acks() -> anyhow::Result<()> {
    let backend = NatsBackend::new();
    let broker: Arc<dyn Broker> = Arc::new(backend.connect_nats().await?);
    let topic = unique("nats-long");
    backend.connect_nats().await?.declare_source(&topic).await?;
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = Consumer::builder(broker.clone(), "slow")
        .subscribe(topic.clone(), None::<String>)
        .lease(Duration::from_secs(1))
        .start(move |_d: Delivery| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    broker
        .publish(&Destination::new(topic), Message::new("slow"))
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while h.stats().processed < 1 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "never processed: {:?}",
            h.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = h.shutdown().await.stats;
    ensure!(
        calls.load(Ordering::SeqCst) == 1,
        "redelivered while still being handled: {s:?}"
    );
    ensure!(s.received == 1 && s.settle_failures == 0, "{s:?}");
    Ok(())
}

/// Two advisory relays (two connections) for one consumer, as after a relay restart:
/// a message past `max_deliver` lands in the DLQ exactly once, as `max-deliveries`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_relays_are_idempotent() -> anyhow::Result<()> {
    let backend = NatsBackend::new();
    let first = backend.connect_nats().await?;
    let second = backend.connect_nats().await?;
    let topic = unique("nats-relay");
    let mut sub = Subscription::new("relayed", topic.clone());
    sub.delivery_limit = 2;
    sub.lease = Duration::from_secs(1);
    sub.retry_tiers = RetryPolicy::no_retry().tier_delays();
    // Both connections subscribe: each starts a relay for the consumer.
    let rx1 = first.subscribe(&sub).await?;
    let rx2 = second.subscribe(&sub).await?;
    drop(rx2);
    first
        .publish(&Destination::new(topic.clone()), Message::new("crashes"))
        .await?;
    // Receive it `delivery_limit` times without settling (a consumer dying each time).
    let d = tokio::time::timeout(Duration::from_secs(10), rx1.receive()).await??;
    let id = d.id().clone();
    drop(d);
    drop(rx1);
    let rx = first.subscribe(&sub).await?;
    let again = tokio::time::timeout(Duration::from_secs(10), rx.receive()).await??;
    ensure!(again.id() == &id && again.attempt() == 2);
    drop(again);
    drop(rx); // stops its in-progress acks: the lease runs out
    let rx = first.subscribe(&sub).await?;
    // A pending pull lets the server notice the limit and send the advisory.
    let none = tokio::time::timeout(Duration::from_secs(4), rx.receive()).await;
    ensure!(none.is_err(), "delivered past max_deliver");
    let dlq = first.dead_letter_receiver(&sub).await?;
    let dead = tokio::time::timeout(Duration::from_secs(10), dlq.receive())
        .await
        .context("no dead letter")??;
    let record = DeadLetter::read(dead.headers())?;
    ensure!(dead.id() == &id);
    ensure!(
        record.reason == DeadLetterReason::MaxDeliveries && record.attempts == 2,
        "{record:?}"
    );
    ensure!(record.origin.sequence == Some(1), "{:?}", record.origin);
    let duplicate = tokio::time::timeout(Duration::from_secs(2), dlq.receive()).await;
    ensure!(
        duplicate.is_err(),
        "the second relay made a duplicate DLQ entry"
    );
    Ok(())
}

/// A message terminated by another client (`+TERM`, not reliq) is parked in the DLQ by
/// the advisory relay; reliq's own terminations (after dead-lettering) are not doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_terminations_are_parked_and_reliq_ones_not_doubled() -> anyhow::Result<()> {
    use async_nats::jetstream::{self, AckKind};
    use futures::StreamExt;

    let backend = NatsBackend::new();
    let broker = backend.connect_nats().await?;
    let topic = unique("nats-term");
    let sub = Subscription::new("terms", topic.clone());
    drop(broker.subscribe(&sub).await?); // declares, starts the relay
    broker
        .publish(&Destination::new(topic.clone()), Message::new("foreign"))
        .await?;

    // Another client on the same durable consumer terminates it.
    let client = async_nats::connect(reliq_integration::settings::get("RELIQ_NATS_URL")).await?;
    let js = jetstream::new(client);
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream(reliq_nats::stream_name(&topic))
        .await?
        .get_consumer("terms")
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    let msg = batch
        .next()
        .await
        .context("nothing fetched")?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    msg.double_ack_with(AckKind::Term)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    let dlq = broker.dead_letter_receiver(&sub).await?;
    let dead = tokio::time::timeout(Duration::from_secs(10), dlq.receive())
        .await
        .context("the terminated message never reached the DLQ")??;
    let record = DeadLetter::read(dead.headers())?;
    ensure!(dead.payload() == b"foreign");
    ensure!(record.reason == DeadLetterReason::Permanent, "{record:?}");
    ensure!(
        record
            .error
            .as_deref()
            .is_some_and(|e| e.contains("terminated outside reliq"))
    );
    ensure!(
        tokio::time::timeout(Duration::from_secs(2), dlq.receive())
            .await
            .is_err(),
        "one termination, one DLQ entry"
    );
    Ok(())
}
