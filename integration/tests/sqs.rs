//! SQS-specific behaviour beyond the portable suite, on the local endpoint (moto) from
//! `scripts/brokers`: the visibility extender, dead-lettering a message that already
//! uses every message attribute, the redrive policy ending a crash loop, and the
//! dead-letter reader (browse without consuming, pages, get, remove, count).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_conformance::support::{Recorder, browse_all, unique, wait_until};
use reliq_core::{
    BoxError, Broker, Consumer, Cursor, DeadLetter, DeadLetterEntry, DeadLetterReason, Delivery,
    Destination, Message, MessageId, Permanent, Subscription,
};
use reliq_integration::sqs::SqsBackend;

async fn broker() -> anyhow::Result<Arc<dyn Broker>> {
    Ok(Arc::new(SqsBackend::new().connect_sqs().await?))
}

/// The first dead letter of `sub` (waiting up to 30 s for one), removed from the DLQ.
async fn one_dead_letter(
    broker: &Arc<dyn Broker>,
    sub: &Subscription,
) -> anyhow::Result<(DeadLetterEntry, DeadLetter)> {
    let dlq = broker.dead_letters(sub).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let parked = loop {
        if let Some(first) = dlq.browse(&Cursor::start(), 1).await?.entries.pop() {
            break first;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "nothing dead-lettered within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let record = parked.record()?;
    let removed = dlq.remove(std::slice::from_ref(parked.id())).await?;
    ensure!(removed == vec![parked.id().clone()], "removed {removed:?}");
    Ok((parked, record))
}

/// A handler running three times the visibility timeout (2 s lease, 6 s handler) is not
/// redelivered: the extender renews the lease until the message is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_three_times_the_visibility_timeout_is_not_redelivered() -> anyhow::Result<()> {
    let broker = broker().await?;
    let topic = unique("extender");
    let rec = Recorder::new();
    let r = rec.clone();
    let h = Consumer::builder(broker.clone(), "c")
        .subscribe(topic.clone())
        .lease(Duration::from_secs(2))
        .handler_timeout(Duration::from_secs(30))
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                r.call(&d);
                tokio::time::sleep(Duration::from_secs(6)).await;
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let m = Message::new("slow");
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    wait_until("processed", Duration::from_secs(30), || {
        rec.effect_count() == 1
    })
    .await?;
    // Longer than a lease: a copy that became visible again would arrive meanwhile.
    tokio::time::sleep(Duration::from_secs(4)).await;
    ensure!(
        rec.calls_for(&id).len() == 1,
        "redelivered: {} calls",
        rec.calls_for(&id).len()
    );
    let s = h.shutdown().await.stats;
    ensure!(s.processed == 1 && s.received == 1, "{s:?}");
    Ok(())
}

/// A message that already carries 10 user headers (SQS allows 10 message attributes in
/// all) still dead-letters with its complete record, and keeps every user header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_user_attributes_still_dead_letter_with_metadata() -> anyhow::Result<()> {
    let broker = broker().await?;
    let topic = unique("ten-attrs");
    let builder = Consumer::builder(broker.clone(), "c").subscribe(topic.clone());
    let sub = builder.subscription()?;
    let h = builder
        .start(|_d: Delivery| async move {
            Err::<(), BoxError>(Permanent::msg("order rejected").into())
        })
        .await?;
    let mut m = Message::new("{}").with_key("customer-7");
    for i in 0..10 {
        m = m.with_header(format!("user-{i}"), format!("value-{i}"));
    }
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    let (parked, record) = one_dead_letter(&broker, &sub).await?;
    h.shutdown().await;
    ensure!(parked.id() == &id && parked.message.key() == Some("customer-7"));
    ensure!(record.reason == DeadLetterReason::Permanent, "{record:?}");
    ensure!(record.consumer == "c" && record.attempts == 1, "{record:?}");
    ensure!(
        record
            .error
            .as_deref()
            .is_some_and(|e| e.contains("order rejected")),
        "{record:?}"
    );
    for i in 0..10 {
        ensure!(
            parked.headers().get(&format!("user-{i}")) == Some(format!("value-{i}").as_str()),
            "user-{i} lost: {:?}",
            parked.headers()
        );
    }
    Ok(())
}

/// A message whose consumer dies every time (never settled) is moved by the queue's
/// redrive policy after `maxReceiveCount` (= the delivery limit) receives; read back, it
/// is a `max-deliveries` dead letter with its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_settled_message_is_redriven_as_max_deliveries() -> anyhow::Result<()> {
    let broker = broker().await?;
    let topic = unique("redrive");
    let mut sub = Subscription::new("c", topic.clone());
    sub.delivery_limit = 3;
    sub.lease = Duration::from_secs(1);
    sub.prefetch = 1;
    let rx = broker.subscribe(&sub).await?;
    let m = Message::new("crashes the consumer");
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    let mut receives = 0;
    while receives < 3 {
        // Not settled: the lease runs out, as when the process is killed.
        let d = tokio::time::timeout(Duration::from_secs(20), rx.receive())
            .await
            .with_context(|| format!("receive {} never came", receives + 1))??;
        ensure!(d.id() == &id);
        receives += 1;
        drop(d); // unsettled: the extender stops, the lease runs out
    }
    // The next receive finds the count exhausted: SQS moves it to the DLQ instead.
    let again = tokio::time::timeout(Duration::from_secs(5), rx.receive()).await;
    ensure!(
        again.is_err(),
        "delivered a 4th time with maxReceiveCount 3"
    );
    rx.close().await?;
    // The move happens on the receive after the third: wait for it to show in the DLQ.
    let dlq = broker.dead_letters(&sub).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while dlq.count().await?.count == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "not moved to the DLQ"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Read twice: the record made up for it is the same each time (its time is the
    // DLQ's SentTimestamp, not the time of the read), and it is what `count` reports.
    let first = browse_all(dlq.as_ref()).await?;
    let second = browse_all(dlq.as_ref()).await?;
    ensure!(
        first.len() == 1 && first == second,
        "{first:?} / {second:?}"
    );
    let count = dlq.count().await?;
    let read = first[0].record()?;
    ensure!(count.count == 1, "{count:?}");
    ensure!(
        count.oldest_dead_lettered_at == Some(read.dead_lettered_at),
        "{count:?} vs {read:?}"
    );
    let (parked, record) = one_dead_letter(&broker, &sub).await?;
    ensure!(parked.id() == &id);
    ensure!(
        record.reason == DeadLetterReason::MaxDeliveries,
        "{record:?}"
    );
    ensure!(record.consumer == "c" && record.attempts == 3, "{record:?}");
    ensure!(*record.origin.destination == *topic, "{record:?}");
    ensure!(dlq.count().await?.count == 0, "removed, yet counted");
    Ok(())
}

/// FIFO queues (`fifo=true`): three keys (message groups) of ten messages each, four
/// handlers with per-key ordering, one message retried once: every group is processed in
/// publish order — the retried message holds its group until it succeeds — while the
/// groups run side by side; a second publish of an id is dropped by SQS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_groups_keep_their_order_with_concurrency() -> anyhow::Result<()> {
    let url = format!(
        "{}&fifo=true",
        reliq_integration::settings::get("RELIQ_SQS_URL")
    );
    let broker: Arc<dyn Broker> = Arc::new(reliq_sqs::SqsBroker::connect(&url).await?);
    ensure!(broker.capabilities().deduplicates_publishes);
    let topic = unique("fifo");
    let builder = Consumer::builder(broker.clone(), "c")
        .subscribe(topic.clone())
        .retry(reliq_core::RetryPolicy::tiers([Duration::from_secs(1)]).max_attempts(3))
        .ordering(reliq_core::DeliveryOrder::PerKey)
        .concurrency(4)
        // A short lease keeps the long poll short (half the lease): moto does not answer
        // a waiting poll when a FIFO group frees up, SQS does.
        .lease(Duration::from_secs(4));
    // Declare the queue, publish everything, then consume: moto forgets a deduplication
    // id once its message is deleted (SQS keeps it 5 minutes), so the second publish of
    // an id must happen while the first copy is still queued.
    broker
        .subscribe(&builder.subscription()?)
        .await?
        .close()
        .await?;
    let dest = Destination::new(topic.clone());
    let mut published = Vec::new();
    for i in 0..10 {
        for k in 0..3 {
            let m = Message::new(format!("k{k}-{i}")).with_key(format!("k{k}"));
            published.push(m.clone());
            broker.publish(&dest, m).await?;
        }
    }
    broker.publish(&dest, published[0].clone()).await?;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = builder
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                r.call(&d);
                if d.payload() == b"k1-3" && d.attempt() == 1 {
                    return Err(reliq_core::Transient::msg("downstream 503").into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    wait_until("30 processed", Duration::from_secs(60), || {
        rec.effect_count() == 30
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls = rec.calls();
    let effects = rec.effects();
    ensure!(
        effects.values().all(|n| *n == 1),
        "a message was processed twice: {effects:?}"
    );
    for k in 0..3 {
        let key = format!("k{k}");
        let order: Vec<String> = calls
            .iter()
            .filter(|c| c.key.as_deref() == Some(key.as_str()))
            .map(|c| String::from_utf8_lossy(&c.payload).into_owned())
            .collect();
        let mut expected: Vec<String> = (0..10).map(|i| format!("{key}-{i}")).collect();
        if k == 1 {
            expected.insert(3, "k1-3".into()); // its retry, before k1-4
        }
        ensure!(order == expected, "group {key} in order {order:?}");
    }
    let s = h.shutdown().await.stats;
    ensure!(
        s.processed == 30 && s.retried == 1 && s.dead_lettered == 0,
        "{s:?}"
    );
    ensure!(s.max_running > 1, "groups never ran side by side: {s:?}");
    Ok(())
}

/// Redrive: the endpoint is asked for a server-side `StartMessageMoveTask`; moto does not
/// run one (it answers HTTP 500), which the probe reports as `None` without touching the
/// dead letters — the caller then uses the portable replay engine (its conformance
/// scenarios run on SQS too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_task_is_probed_and_the_dead_letters_stay_for_the_replay_engine() -> anyhow::Result<()>
{
    let sqs = SqsBackend::new().connect_sqs().await?;
    let broker: Arc<dyn Broker> = Arc::new(sqs.clone());
    let topic = unique("move-task");
    let builder = Consumer::builder(broker.clone(), "c").subscribe(topic.clone());
    let sub = builder.subscription()?;
    let h = builder
        .start(|_d: Delivery| async move { Err::<(), BoxError>(Permanent::msg("no").into()) })
        .await?;
    let m = Message::new("parked");
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    wait_until("dead-lettered", Duration::from_secs(30), || {
        h.stats().dead_lettered == 1
    })
    .await?;
    h.shutdown().await;
    let task = sqs.start_message_move_task(&sub, Some(10)).await?;
    ensure!(task.is_none(), "moto ran a move task: {task:?}");
    let (parked, record) = one_dead_letter(&broker, &sub).await?;
    ensure!(parked.id() == &id && record.reason == DeadLetterReason::Permanent);
    Ok(())
}

/// Dead-letter `n` messages of a fresh topic through a consumer whose handler rejects
/// everything; returns the subscription and the ids, once the DLQ counts all `n`.
async fn dead_lettered(
    broker: &Arc<dyn Broker>,
    base: &str,
    n: usize,
) -> anyhow::Result<(Subscription, Vec<MessageId>)> {
    let topic = unique(base);
    let builder = Consumer::builder(broker.clone(), "c").subscribe(topic.clone());
    let sub = builder.subscription()?;
    let h = builder
        .start(|_d: Delivery| async move { Err::<(), BoxError>(Permanent::msg("no").into()) })
        .await?;
    let messages: Vec<Message> = (0..n).map(|i| Message::new(format!("m{i}"))).collect();
    let ids = messages.iter().map(|m| m.id().clone()).collect();
    let dest = Destination::new(topic);
    for m in messages {
        broker.publish(&dest, m).await?;
    }
    wait_until("all dead-lettered", Duration::from_secs(60), || {
        h.stats().dead_lettered == n as u64
    })
    .await?;
    h.shutdown().await;
    Ok((sub, ids))
}

fn sorted(ids: impl IntoIterator<Item = MessageId>) -> Vec<MessageId> {
    let mut ids: Vec<MessageId> = ids.into_iter().collect();
    ids.sort();
    ids
}

/// Browsing a DLQ twice sees every entry each time, in the same order (oldest
/// dead-lettered first), and deletes nothing: the count and `get` still find them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsing_twice_sees_every_entry_and_deletes_nothing() -> anyhow::Result<()> {
    let broker = broker().await?;
    let (sub, ids) = dead_lettered(&broker, "dlq-browse", 25).await?;
    let dlq = broker.dead_letters(&sub).await?;
    let first = browse_all(dlq.as_ref()).await?;
    let second = browse_all(dlq.as_ref()).await?;
    let first_ids: Vec<MessageId> = first.iter().map(|e| e.id().clone()).collect();
    let second_ids: Vec<MessageId> = second.iter().map(|e| e.id().clone()).collect();
    ensure!(first_ids == second_ids, "order changed between browses");
    ensure!(
        sorted(first_ids) == sorted(ids.clone()),
        "not every entry, or twice"
    );
    let times: Vec<_> = first
        .iter()
        .map(|e| e.record().map(|r| r.dead_lettered_at))
        .collect::<Result<_, _>>()?;
    ensure!(times.windows(2).all(|w| w[0] <= w[1]), "not oldest first");
    let count = dlq.count().await?;
    ensure!(count.count == 25, "{count:?}");
    ensure!(count.oldest_dead_lettered_at == Some(times[0]), "{count:?}");
    let found = dlq.get(&ids[7]).await?;
    ensure!(
        found.as_ref().map(DeadLetterEntry::id) == Some(&ids[7]),
        "{found:?}"
    );
    ensure!(dlq.get(&MessageId::from("not-there")).await?.is_none());
    // Nothing is left hidden between calls: a fresh reader sees everything at once.
    let fresh = broker.dead_letters(&sub).await?;
    ensure!(browse_all(fresh.as_ref()).await?.len() == 25);
    Ok(())
}

/// The pages of one scan cover every entry exactly once, also when the entries of each
/// page are removed before the next page is read (as the replay engine does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_of_a_scan_cover_every_entry_once() -> anyhow::Result<()> {
    let broker = broker().await?;
    let (sub, ids) = dead_lettered(&broker, "dlq-pages", 23).await?;
    let dlq = broker.dead_letters(&sub).await?;
    for remove_as_we_go in [false, true] {
        let mut cursor = Cursor::start();
        let mut seen = Vec::new();
        let mut pages = 0;
        loop {
            let page = dlq.browse(&cursor, 5).await?;
            pages += 1;
            ensure!(page.entries.len() <= 5, "page of {}", page.entries.len());
            ensure!(
                page.at_end || page.entries.len() == 5,
                "a short page not at the end"
            );
            let page_ids: Vec<MessageId> = page.entries.iter().map(|e| e.id().clone()).collect();
            if remove_as_we_go {
                ensure!(dlq.remove(&page_ids).await?.len() == page_ids.len());
            }
            seen.extend(page_ids);
            if page.at_end {
                break;
            }
            // The cursor is text: a page read from its printed form continues the same.
            cursor = Cursor::from(page.next.to_string());
        }
        ensure!(pages == 5, "{pages} pages for 23 entries of 5");
        ensure!(
            sorted(seen) == sorted(ids.clone()),
            "pages do not cover each entry once (removing: {remove_as_we_go})"
        );
    }
    ensure!(dlq.count().await?.count == 0, "all removed");
    Ok(())
}

/// `remove` deletes exactly the entries asked for, confirmed; ids the DLQ does not hold
/// (or no longer holds) are skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_deletes_exactly_the_asked_ids() -> anyhow::Result<()> {
    let broker = broker().await?;
    let (sub, ids) = dead_lettered(&broker, "dlq-remove", 10).await?;
    let dlq = broker.dead_letters(&sub).await?;
    let asked = vec![
        ids[1].clone(),
        ids[4].clone(),
        MessageId::from("never-dead-lettered"),
        ids[8].clone(),
        ids[4].clone(), // a second copy that is not there
    ];
    let removed = dlq.remove(&asked).await?;
    ensure!(
        sorted(removed.clone()) == sorted([ids[1].clone(), ids[4].clone(), ids[8].clone()]),
        "removed {removed:?}"
    );
    let left: Vec<MessageId> = browse_all(dlq.as_ref())
        .await?
        .iter()
        .map(|e| e.id().clone())
        .collect();
    let expected: Vec<MessageId> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| ![1, 4, 8].contains(i))
        .map(|(_, id)| id.clone())
        .collect();
    ensure!(sorted(left) == sorted(expected), "the others stay");
    ensure!(dlq.count().await?.count == 7);
    ensure!(
        dlq.remove(&[ids[1].clone()]).await?.is_empty(),
        "removed twice"
    );
    Ok(())
}

/// A browse cancelled mid-scan (its future dropped by a timeout) skips nothing: the
/// next browse, at once, reads every entry (what the cancelled scan held is given back
/// before it reads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browse_cancelled_mid_scan_hides_nothing() -> anyhow::Result<()> {
    let broker = broker().await?;
    let (sub, ids) = dead_lettered(&broker, "dlq-cancel", 25).await?;
    let dlq = broker.dead_letters(&sub).await?;
    for cut in [30, 120] {
        let cancelled = tokio::time::timeout(
            Duration::from_millis(cut),
            dlq.browse(&Cursor::start(), 100),
        )
        .await;
        ensure!(cancelled.is_err(), "the browse finished within {cut} ms");
        let all = browse_all(dlq.as_ref()).await?;
        ensure!(
            sorted(all.iter().map(|e| e.id().clone())) == sorted(ids.clone()),
            "after a browse cut at {cut} ms: {} of 25",
            all.len()
        );
    }
    Ok(())
}

/// A message this receiver holds that SQS hands out again (here: its lease runs out with
/// the extender off, as when SQS delivers a copy twice or moto hands one message to two
/// concurrent receives) is not a second delivery: the second copy's receipt is kept with
/// the first, and the ack settles both — the message is gone, nothing is redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_copy_of_a_held_message_is_settled_with_the_first() -> anyhow::Result<()> {
    let url = reliq_integration::settings::get("RELIQ_SQS_URL");
    let options = reliq_sqs::SqsOptions {
        max_lease_extension: Duration::ZERO,
        ..reliq_sqs::SqsOptions::default()
    };
    let sqs = reliq_sqs::SqsBroker::connect_with(&url, options).await?;
    let broker: Arc<dyn Broker> = Arc::new(sqs.clone());
    let topic = unique("second-copy");
    let mut sub = Subscription::new("c", topic.clone());
    sub.lease = Duration::from_secs(2);
    let rx = broker.subscribe(&sub).await?;
    let m = Message::new("held");
    let id = m.id().clone();
    broker.publish(&Destination::new(topic.clone()), m).await?;
    let first = tokio::time::timeout(Duration::from_secs(20), rx.receive()).await??;
    ensure!(first.id() == &id);
    // Three leases: the copy became visible and the poller received it again.
    let again = tokio::time::timeout(Duration::from_secs(6), rx.receive()).await;
    ensure!(again.is_err(), "a second copy was handed out: {again:?}");
    rx.ack(&first).await?;
    let after = tokio::time::timeout(Duration::from_secs(5), rx.receive()).await;
    ensure!(after.is_err(), "delivered again after the ack: {after:?}");
    rx.close().await?;
    ensure!(sqs.not_visible(&sub).await? == 0, "a copy is still held");
    Ok(())
}
