//! Scenarios of a consumer's life beyond one delivery: a redeploy with another retry
//! policy while retries wait, a restart with retries pending, a failure burst larger than
//! every in-flight window, an inbox outage and its recovery, a shutdown in the middle of
//! a receive, a handler whose own publish fails, a delivery settled on the wrong
//! receiver, and a clean run that logs no warning.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use reliq_core::{
    BoxError, BrokerError, Claim, DeadLetterReason, Delivery, Destination, ErrorClass, Inbox,
    InboxError, MemoryInbox, Message, MessageId, RetryPolicy, Transient,
};

use crate::support::{Backend, Ctx, Recorder, soon, unique, wait_until};

/// `n` messages whose handler fails once (transient) and then succeeds.
fn fail_once_handler(
    rec: &Recorder,
) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, Result<(), BoxError>> + Send + Sync + 'static
{
    let rec = rec.clone();
    move |d: Delivery| {
        let r = rec.clone();
        Box::pin(async move {
            r.call(&d);
            if d.attempt() == 1 {
                return Err(Transient::msg("downstream timed out").into());
            }
            r.effect(d.id());
            Ok(())
        })
    }
}

fn messages(prefix: &str, n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| Message::new(format!("{prefix}-{i}")).with_key(format!("k{}", i % 5)))
        .collect()
}

/// Retries wait in a long tier; the service is redeployed at once with a policy whose
/// only tier is short. Every waiting retry is still processed (a backend drains the
/// retry routes of its own that hold messages, whatever the current policy says).
pub async fn redeploy_with_another_retry_policy_processes_waiting_retries(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "redeploy").await?;
    let [short, long] = b.tiers();
    let rec = Recorder::new();
    let h = ctx
        .consumer("c")
        .retry(RetryPolicy::tiers([long * 2]).max_attempts(3))
        .start(fail_once_handler(&rec))
        .await?;
    let batch = messages("redeploy", 10);
    let ids: HashSet<MessageId> = batch.iter().map(|m| m.id().clone()).collect();
    ctx.publish_all(batch).await?;
    wait_until("10 retries confirmed", soon(b), || h.stats().retried == 10).await?;
    let first = h.shutdown().await.stats;
    ensure!(
        first.processed == 0,
        "nothing succeeded before the redeploy: {first:?}"
    );
    let h = ctx
        .consumer("c")
        .retry(RetryPolicy::tiers([short]).max_attempts(3))
        .start(fail_once_handler(&rec))
        .await?;
    wait_until(
        "every retry waiting in the old tier processed after the redeploy",
        long * 2 + soon(b),
        || rec.effect_count() == 10,
    )
    .await?;
    let done: HashSet<MessageId> = rec.effects().into_keys().collect();
    ensure!(done == ids, "processed {done:?}");
    ensure!(
        rec.calls().iter().filter(|c| c.attempt >= 2).count() == 10,
        "each processed at its second attempt"
    );
    h.shutdown().await;
    ctx.assert_no_dead_letters("c").await
}

/// Shutdown while retries wait: after a restart with the same policy they are processed,
/// each once, at attempt 2.
pub async fn shutdown_with_retries_pending_processes_them_after_restart(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "restart-retries").await?;
    let rec = Recorder::new();
    let h = ctx.consumer("c").start(fail_once_handler(&rec)).await?;
    ctx.publish_all(messages("pending", 8)).await?;
    wait_until("8 retries confirmed", soon(b), || h.stats().retried == 8).await?;
    h.shutdown().await;
    let h = ctx.consumer("c").start(fail_once_handler(&rec)).await?;
    wait_until("retries processed after the restart", soon(b), || {
        rec.effect_count() == 8
    })
    .await?;
    tokio::time::sleep(b.quiet_period()).await;
    ensure!(
        rec.effects().values().all(|n| *n == 1),
        "each once: {:?}",
        rec.effects()
    );
    let late: Vec<u32> = rec
        .calls()
        .iter()
        .filter(|c| c.attempt > 1)
        .map(|c| c.attempt)
        .collect();
    // Where every delivery counts as an attempt (SQS's receive count), a long poll still
    // open when the first consumer stopped may have taken a retry and given it back:
    // one more attempt, never a lost or doubled effect.
    let every_delivery = ctx.broker.capabilities().attempts_count_every_delivery;
    ensure!(
        late.len() == 8 && late.iter().all(|a| *a == 2 || (every_delivery && *a > 2)),
        "attempts {late:?}"
    );
    h.shutdown().await;
    Ok(())
}

/// A failure burst much larger than the prefetch and any retry headroom fails once with a
/// long delay; healthy messages published right after are processed long before those
/// retries come due: waiting retries take no room in the consumer's in-flight window.
pub async fn failure_burst_does_not_hold_back_healthy_messages(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "burst").await?;
    let burst = b.failure_burst();
    // Long enough that the burst's first retries are not yet due when the last of it has
    // failed, even on a loaded machine (failing 1,100 can take half a minute there).
    let wait = Duration::from_secs(40);
    // How long 50 healthy messages may take (well below `wait`).
    let healthy_within = Duration::from_secs(10);
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .retry(RetryPolicy::tiers([wait]).max_attempts(3))
        .max_in_flight(16)
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                if d.payload().starts_with(b"burst") && d.attempt() == 1 {
                    return Err::<(), BoxError>(Transient::msg("downstream overloaded").into());
                }
                r.call(&d);
                r.effect(d.id());
                Ok(())
            }
        })
        .await?;
    ctx.publish_all(messages("burst", burst)).await?;
    wait_until("the burst failed once", soon(b) + wait / 2, || {
        h.stats().retried >= burst as u64
    })
    .await?;
    let healthy = messages("healthy", 50);
    let healthy_ids: HashSet<MessageId> = healthy.iter().map(|m| m.id().clone()).collect();
    let published = tokio::time::Instant::now();
    ctx.publish_all(healthy).await?;
    let done = |rec: &Recorder| {
        rec.effects()
            .keys()
            .filter(|id| healthy_ids.contains(*id))
            .count()
    };
    wait_until(
        "healthy messages processed while the burst's retries wait",
        healthy_within,
        || done(&rec) == 50,
    )
    .await?;
    ensure!(
        published.elapsed() < healthy_within,
        "healthy messages waited {:?}",
        published.elapsed()
    );
    let burst_done = rec.effect_count() - 50;
    ensure!(
        burst_done == 0,
        "{burst_done} retries ran before their {wait:?} delay: the test measured nothing"
    );
    wait_until("the burst's retries processed", wait + soon(b), || {
        rec.effect_count() == burst + 50
    })
    .await?;
    h.shutdown().await;
    Ok(())
}

/// An inbox whose first claims fail (a short database outage), then works.
struct OutageInbox {
    failures_left: AtomicU32,
    inner: MemoryInbox,
}

#[async_trait::async_trait]
impl Inbox for OutageInbox {
    async fn claim(&self, consumer: &str, id: &MessageId) -> Result<Claim, InboxError> {
        let down = self
            .failures_left
            .fetch_update(AtomicOrdering::SeqCst, AtomicOrdering::SeqCst, |n| {
                n.checked_sub(1)
            })
            .is_ok();
        if down {
            return Err(InboxError(Box::new(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "database unavailable",
            ))));
        }
        self.inner.claim(consumer, id).await
    }
    async fn complete(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.inner.complete(consumer, id).await
    }
    async fn abandon(&self, consumer: &str, id: &MessageId) -> Result<(), InboxError> {
        self.inner.abandon(consumer, id).await
    }
}

/// The inbox fails its first claims, then recovers. Once a delivery was claimed, handled
/// and acknowledged again, no receive is held back by the settle back-off: the back-off
/// slows the failing path, not every receive after it.
pub async fn inbox_outage_then_recovery_is_not_held_back(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "inbox-outage").await?;
    let inbox = Arc::new(OutageInbox {
        failures_left: AtomicU32::new(4),
        inner: MemoryInbox::new(),
    });
    let rec = Recorder::new();
    let h = ctx
        .consumer("c")
        .inbox(inbox.clone())
        .start(rec.succeeding())
        .await?;
    ctx.publish_all(messages("outage", 4)).await?;
    wait_until("the outage's messages processed", soon(b), || {
        h.stats().processed == 4
    })
    .await?;
    ensure!(inbox.failures_left.load(AtomicOrdering::SeqCst) == 0);
    let recovered = h.stats();
    ensure!(
        recovered.released >= 4,
        "each failed claim releases its delivery: {recovered:?}"
    );
    // One at a time, so that each message is its own receive.
    for (i, m) in messages("after", 30).into_iter().enumerate() {
        ctx.publish(m).await?;
        let want = 5 + i as u64;
        wait_until("processed after the recovery", soon(b), || {
            h.stats().processed == want
        })
        .await?;
    }
    let after = h.shutdown().await.stats;
    ensure!(
        after.throttled == recovered.throttled,
        "{} receives were held back after the inbox recovered ({recovered:?} -> {after:?})",
        after.throttled - recovered.throttled
    );
    Ok(())
}

/// A consumer shut down while messages keep arriving (receives in progress) leaves
/// nothing leased: a new consumer gets every message long before any lease runs out.
pub async fn shutdown_while_receiving_holds_nothing_until_a_lease(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "shutdown-receiving").await?;
    let lease = Duration::from_secs(120);
    let rec = Recorder::new();
    let h = ctx
        .consumer("c")
        .lease(lease)
        .start(rec.succeeding())
        .await?;
    let all = messages("arriving", 120);
    let ids: HashSet<MessageId> = all.iter().map(|m| m.id().clone()).collect();
    let mut rest = all.into_iter();
    for m in rest.by_ref().take(40) {
        ctx.publish(m).await?;
    }
    wait_until("some processed", soon(b), || h.stats().processed >= 20).await?;
    let publisher = {
        let broker = ctx.broker.clone();
        let dest = Destination::new(ctx.topic.clone());
        let rest: Vec<Message> = rest.collect();
        tokio::spawn(async move {
            for m in rest {
                broker.publish(&dest, m).await?;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok::<(), BrokerError>(())
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let report = h.shutdown().await;
    ensure!(report.drained, "{report:?}");
    publisher.await.context("publisher task")??;
    let h = ctx
        .consumer("c")
        .lease(lease)
        .start(rec.succeeding())
        .await?;
    wait_until(
        "every message processed, none waiting for a lease",
        soon(b).min(lease / 2),
        || rec.effect_count() == ids.len(),
    )
    .await?;
    h.shutdown().await;
    let done: HashSet<MessageId> = rec.effects().into_keys().collect();
    ensure!(
        done == ids,
        "missing {:?}",
        ids.difference(&done).collect::<Vec<_>>()
    );
    Ok(())
}

/// A handler's own broker errors are classified by what they are: a publish that timed
/// out is transient (retried), a publish to a destination nothing routes is permanent
/// (dead-lettered at once) where the broker rejects unroutable publishes.
pub async fn handler_publish_failure_is_classified_by_its_cause(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "handler-publish").await?;
    let rejects_unroutable = ctx.broker.capabilities().rejects_unroutable;
    let broker = ctx.broker.clone();
    let nowhere = unique("nowhere");
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .start(move |d: Delivery| {
            let r = r.clone();
            let broker = broker.clone();
            let nowhere = nowhere.clone();
            async move {
                r.call(&d);
                if d.payload() == b"timeout" && d.attempt() == 1 {
                    // What reliq's own publish returns when no confirm arrives in time.
                    return Err::<(), BoxError>(
                        BrokerError::Timeout(Duration::from_secs(5)).into(),
                    );
                }
                if d.payload() == b"unroutable" {
                    let m = Message::new("downstream event");
                    broker.publish(&Destination::new(nowhere), m).await?;
                }
                r.effect(d.id());
                Ok(())
            }
        })
        .await?;
    let timeout = Message::new("timeout");
    let timeout_id = timeout.id().clone();
    ctx.publish(timeout).await?;
    wait_until("the timed-out publish retried", soon(b), || {
        rec.effects().contains_key(&timeout_id)
    })
    .await?;
    let attempts: Vec<u32> = rec
        .calls_for(&timeout_id)
        .iter()
        .map(|c| c.attempt)
        .collect();
    ensure!(
        attempts == vec![1, 2],
        "a timeout is transient: attempts {attempts:?}"
    );
    if rejects_unroutable {
        let unroutable = Message::new("unroutable");
        let id = unroutable.id().clone();
        ctx.publish(unroutable).await?;
        let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
        ensure!(dead[0].0.id() == &id);
        let record = &dead[0].1;
        ensure!(
            record.reason == DeadLetterReason::Permanent
                && record.error_class == Some(ErrorClass::Permanent)
                && record.attempts == 1,
            "an unroutable publish is permanent: {record:?}"
        );
    }
    h.shutdown().await;
    Ok(())
}

/// Settling a delivery on a receiver that did not hand it out is refused with
/// [`BrokerError::ForeignDelivery`] and settles nothing; its own receiver settles it.
pub async fn settling_on_another_receiver_is_refused(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "foreign").await?;
    let mine = ctx.broker.subscribe(&ctx.subscription("a")).await?;
    let other = ctx.broker.subscribe(&ctx.subscription("b")).await?;
    let m = Message::new("one");
    let id = m.id().clone();
    ctx.publish(m).await?;
    let d = tokio::time::timeout(soon(b), mine.receive())
        .await
        .context("consumer a's delivery")??;
    ensure!(d.id() == &id);
    match other.ack(&d).await {
        Err(BrokerError::ForeignDelivery) => {}
        other => bail!("ack on another consumer's receiver: {other:?}"),
    }
    match other.release(&d, Duration::ZERO).await {
        Err(BrokerError::ForeignDelivery) => {}
        other => bail!("release on another consumer's receiver: {other:?}"),
    }
    mine.ack(&d).await.context("ack on its own receiver")?;
    // Consumer b still has its own copy, untouched by the refused settlements.
    let own = tokio::time::timeout(soon(b), other.receive())
        .await
        .context("consumer b's own copy")??;
    ensure!(own.id() == &id);
    other.ack(&own).await?;
    if let Ok(again) = tokio::time::timeout(b.quiet_period(), mine.receive()).await {
        bail!(
            "acknowledged, yet delivered again: {:?}",
            again.map(|d| d.id().clone())
        );
    }
    mine.close().await?;
    other.close().await?;
    Ok(())
}

/// A consumer started, fed, and shut down cleanly logs no warning and no error — neither
/// reliq nor the broker's client (log-based alerts fire on them). Reads the process's
/// log: run it as its own process (nextest does).
pub async fn clean_run_logs_no_warning_or_error(b: &dyn Backend) -> anyhow::Result<()> {
    let log = crate::support::captured_log()?;
    let ctx = Ctx::new(b, "clean-log").await?;
    let rec = Recorder::new();
    let h = ctx.consumer("c").start(rec.succeeding()).await?;
    ctx.publish_all(messages("clean", 20)).await?;
    wait_until("20 processed", soon(b), || h.stats().processed == 20).await?;
    let report = h.shutdown().await;
    ensure!(report.drained && report.stats.processed == 20, "{report:?}");
    drop(ctx);
    log.ensure_quiet_after(b.quiet_period(), "a clean run")
        .await
}
