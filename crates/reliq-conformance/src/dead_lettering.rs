//! Scenarios of dead-lettering and replay: the dead-letter copy's metadata, a DLQ or retry
//! route that is down (the source is kept, nothing lost), the inbox's one effect for a
//! duplicate delivery, and replay back to the consumer (once, or twice with an inbox).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_core::{
    BoxError, DeadLetterFilter, DeadLetterReason, Delivery, ErrorClass, MemoryInbox, Message,
    MessageId, Permanent, Replay, RetryPolicy, Transient, seam::headers,
};

use crate::support::{Backend, Ctx, Recorder, order, soon, wait_until};

/// The DLQ copy: same id, key, payload, user headers, and a complete record.
pub async fn dead_letter_metadata_complete_and_decodable(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-meta").await?;
    let before = reliq_core::Clock::new().now();
    let h = ctx
        .consumer("meta")
        .start(|_d: Delivery| async move {
            Err::<(), BoxError>(Permanent::msg("quantity must be positive\nline two").into())
        })
        .await?;
    let m = Message::new("{\"n\":1}")
        .with_key("customer-9")
        .with_header("tenant", "acme")
        .with_header(
            headers::TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
    let id = m.id().clone();
    ctx.publish(m).await?;
    let dead = ctx.take_dead_letters("meta", 1, soon(b)).await?;
    let (d, r) = &dead[0];
    ensure!(d.id() == &id);
    ensure!(d.payload().as_ref() == b"{\"n\":1}");
    ensure!(d.key() == Some("customer-9"), "key {:?}", d.key());
    ensure!(d.headers().get("tenant") == Some("acme"));
    ensure!(d.headers().get(headers::TRACEPARENT).is_some());
    ensure!(r.reason == DeadLetterReason::Permanent);
    ensure!(r.error_class == Some(ErrorClass::Permanent));
    let err = r.error.as_deref().unwrap_or_default();
    ensure!(
        err.contains("quantity must be positive") && !err.contains('\n'),
        "error text {err:?}"
    );
    ensure!(r.attempts == 1);
    ensure!(r.consumer == "meta");
    ensure!(*r.origin.destination == *ctx.topic, "origin {:?}", r.origin);
    let first = r.first_failure_at.context("first failure time")?;
    ensure!(first <= r.dead_lettered_at);
    ensure!(
        r.dead_lettered_at + Duration::from_secs(1) >= before,
        "timestamps are now-ish"
    );
    h.shutdown().await;
    Ok(())
}

/// DLQ unavailable: the source stays unacked and held (nothing lost, the handler not
/// called again, no attempt spent); once the DLQ is back the message lands there exactly
/// once, with the reason and attempt count decided before the outage.
pub async fn dead_letter_unavailable_source_kept_nothing_lost(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-down").await?;
    let sub = ctx.subscription("c");
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    // The lease crash scenarios use: short where the broker hands a delivery out again
    // when its lease runs out (NATS, SQS), so the outage below outlasts it.
    let lease = b.crash_lease();
    let h = ctx
        .consumer("c")
        .lease(lease)
        .start(move |_d: Delivery| {
            let c = c.clone();
            async move {
                c.fetch_add(1, AtomicOrdering::Relaxed);
                Err::<(), BoxError>(Permanent::msg("bad order").into())
            }
        })
        .await?;
    b.set_dead_letter_available(&ctx.broker, &sub, false)
        .await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    wait_until("dead-lettering attempted and failed twice", soon(b), || {
        h.stats().settle_failures >= 2
    })
    .await?;
    // Held past two leases where leases run out: kept leased meanwhile, not handed out
    // again (the handler count below).
    if lease <= Duration::from_secs(5) {
        tokio::time::sleep(lease * 2).await;
    }
    let s = h.stats();
    ensure!(
        s.dead_lettered == 0 && s.processed == 0 && s.released == 0,
        "{s:?}"
    );
    b.set_dead_letter_available(&ctx.broker, &sub, true).await?;
    wait_until("dead-lettered once the DLQ is back", soon(b), || {
        h.stats().dead_lettered == 1
    })
    .await?;
    let s = h.shutdown().await.stats;
    ensure!(
        calls.load(AtomicOrdering::Relaxed) == 1 && s.received == 1,
        "the decided dead letter was handled again: {} calls, {s:?}",
        calls.load(AtomicOrdering::Relaxed)
    );
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    ensure!(
        dead[0].0.id() == &id
            && dead[0].1.reason == DeadLetterReason::Permanent
            && dead[0].1.attempts == 1,
        "{:?}",
        dead[0].1
    );
    Ok(())
}

/// Retry route broken: the source is not acked, no DLQ copy is made; when the route is
/// repaired the retry goes through.
pub async fn retry_route_failure_keeps_source_and_makes_no_dlq_copy(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "retry-down").await?;
    let sub = ctx.subscription("c");
    let rec = Recorder::new();
    // Fails while the route is broken, and once more after it is repaired (that failure
    // must go through the repaired route); then succeeds.
    let restored = Arc::new(AtomicBool::new(false));
    let calls_after_restore = Arc::new(AtomicU32::new(0));
    let (r, rs, after) = (rec.clone(), restored.clone(), calls_after_restore.clone());
    // A budget that outlasts a redelivery or two if the broker hands it out again.
    let h = ctx
        .consumer("c")
        .retry(RetryPolicy::tiers(b.tiers()).max_attempts(10))
        .start(move |d: Delivery| {
            let (r, rs, after) = (r.clone(), rs.clone(), after.clone());
            async move {
                r.call(&d);
                if !rs.load(AtomicOrdering::SeqCst)
                    || after.fetch_add(1, AtomicOrdering::SeqCst) == 0
                {
                    return Err(Transient::msg("downstream unavailable").into());
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    b.set_retry_available(&ctx.broker, &sub, false).await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    wait_until("retry attempted and failed twice", soon(b), || {
        h.stats().settle_failures >= 2
    })
    .await?;
    let s = h.stats();
    ensure!(
        s.retried == 0 && s.dead_lettered == 0 && s.processed == 0 && s.released == 0,
        "{s:?}"
    );
    // Held, its retry copy sent again: not handed to the handler again meanwhile.
    let calls: Vec<u32> = rec.calls_for(&id).iter().map(|c| c.attempt).collect();
    ensure!(
        calls == [1],
        "handler calls while the route was down: {calls:?}"
    );
    b.set_retry_available(&ctx.broker, &sub, true).await?;
    restored.store(true, AtomicOrdering::SeqCst);
    wait_until("processed after the route is back", soon(b), || {
        rec.effect_count() == 1
    })
    .await
    .with_context(|| {
        let attempts: Vec<u32> = rec.calls_for(&id).iter().map(|c| c.attempt).collect();
        format!("{:?}; attempts seen {attempts:?}", h.stats())
    })?;
    let s = h.shutdown().await.stats;
    // At least one retry went through the repaired route (a call already in flight while
    // the route was repaired can fail and retry too, so not exactly one), none before.
    ensure!(s.dead_lettered == 0 && s.retried >= 1, "{s:?}");
    ctx.assert_no_dead_letters("c").await
}

/// The same message delivered twice with an inbox: one effect, one duplicate counted.
pub async fn duplicate_delivery_with_inbox_has_one_effect(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dup").await?;
    let rec = Recorder::new();
    let h = ctx
        .consumer("c")
        .inbox(Arc::new(MemoryInbox::new()))
        .start(rec.succeeding())
        .await?;
    let m = order(7);
    ctx.publish(m.clone()).await?;
    wait_until("first copy processed", soon(b), || h.stats().processed == 1).await?;
    ctx.publish(m.clone()).await?;
    if ctx.broker.capabilities().deduplicates_publishes {
        // The broker itself drops the second publish: it must never reach the consumer.
        tokio::time::sleep(b.quiet_period()).await;
        ensure!(
            h.stats().received == 1,
            "a deduplicated publish was delivered: {:?}",
            h.stats()
        );
    } else {
        wait_until("duplicate skipped", soon(b), || h.stats().duplicates == 1).await?;
    }
    ensure!(
        rec.effects().get(m.id()) == Some(&1),
        "effects {:?}",
        rec.effects()
    );
    h.shutdown().await;
    Ok(())
}

async fn dead_letter_then_fix(
    b: &dyn Backend,
    ctx: &Ctx<'_>,
    copies: usize,
    inbox: Option<Arc<MemoryInbox>>,
) -> anyhow::Result<(Recorder, MessageId)> {
    let fixed = Arc::new(AtomicBool::new(false));
    let rec = Recorder::new();
    let (f, r) = (fixed.clone(), rec.clone());
    let mut builder = ctx.consumer("c");
    if let Some(inbox) = inbox {
        builder = builder.inbox(inbox);
    }
    let h = builder
        .start(move |d: Delivery| {
            let (f, r) = (f.clone(), r.clone());
            async move {
                r.call(&d);
                if !f.load(AtomicOrdering::SeqCst) {
                    return Err(Permanent::msg("bug in handler v1").into());
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let m = order(5);
    let id = m.id().clone();
    for i in 0..copies {
        // A second dead letter of one id is a message parked again after a replay (its
        // replay count differs): identical copies are one dead letter in the DLQ, and a
        // broker that deduplicates publishes by id would not even deliver them.
        let copy = if i > 0 {
            m.clone().with_header(headers::REPLAY_COUNT, i.to_string())
        } else {
            m.clone()
        };
        ctx.publish(copy).await?;
        // One copy at a time: a copy arriving while the other is still being handled is
        // (rightly) skipped by the inbox as a duplicate, and the test needs two in the DLQ.
        wait_until("dead-lettered", soon(b), || {
            h.stats().dead_lettered == i as u64 + 1
        })
        .await?;
    }
    fixed.store(true, AtomicOrdering::SeqCst);
    // keep the consumer running: replay delivers to it
    std::mem::forget(h);
    Ok((rec, id))
}

/// Replay: back to the consumer with the same id and a replay marker; processed; the DLQ
/// copy removed. A dry run moves nothing.
pub async fn replay_returns_to_consumer_with_same_id_and_marker(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "replay").await?;
    let (rec, id) = dead_letter_then_fix(b, &ctx, 1, None).await?;
    let sub = ctx.subscription("c");
    let plan = Replay::new(ctx.broker.clone(), sub.clone())
        .dry_run()
        .await?;
    ensure!(
        plan.matched.len() == 1 && plan.replayed.is_empty(),
        "dry run: {plan:?}"
    );
    ensure!(rec.effect_count() == 0, "a dry run moved something");
    let done = Replay::new(ctx.broker.clone(), sub)
        .filter(
            DeadLetterFilter::default()
                .ids([id.clone()])
                .reasons([DeadLetterReason::Permanent]),
        )
        .execute()
        .await?;
    ensure!(done.replayed == vec![id.clone()], "replay: {done:?}");
    wait_until("replayed copy processed", soon(b), || {
        rec.effect_count() == 1
    })
    .await?;
    let calls = rec.calls_for(&id);
    let last = calls.last().context("a call")?;
    let hv = |n: &str| {
        last.headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    ensure!(
        hv(headers::REPLAY_COUNT) == Some("1"),
        "replay marker {:?}",
        hv(headers::REPLAY_COUNT)
    );
    ensure!(hv(headers::REPLAYED_AT).is_some());
    ensure!(
        hv(headers::DEAD_LETTER_REASON).is_none(),
        "failure headers stripped"
    );
    ensure!(last.attempt == 1, "a replay starts a fresh retry budget");
    ctx.assert_no_dead_letters("c").await
}

/// Two dead-lettered copies of one id replayed, with an inbox: one effect.
pub async fn replay_twice_with_inbox_has_one_effect(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "replay-twice").await?;
    let inbox = Arc::new(MemoryInbox::new());
    let (rec, id) = dead_letter_then_fix(b, &ctx, 2, Some(inbox.clone())).await?;
    let done = Replay::new(ctx.broker.clone(), ctx.subscription("c"))
        .execute()
        .await?;
    ensure!(done.replayed.len() == 2, "replay: {done:?}");
    wait_until("both replayed copies handled", soon(b), || {
        inbox.contains("c", &id) && rec.calls_for(&id).len() >= 3
    })
    .await?;
    tokio::time::sleep(b.quiet_period()).await;
    ensure!(
        rec.effects().get(&id) == Some(&1),
        "effects {:?}",
        rec.effects()
    );
    Ok(())
}
