//! Scenarios of retries and failure classification: a transient failure is retried after
//! its delay (never early, without holding back later messages, keeping the message
//! intact) until the budget or max age runs out; permanent, poison and panicking messages
//! are dead-lettered at once without blocking the ones after them.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};

use anyhow::ensure;
use reliq_core::{
    BoxError, DeadLetterReason, Delivery, ErrorClass, Message, MessageId, PanicAction, Permanent,
    RetryPolicy, Transient, seam::headers,
};
use serde::Deserialize;

use crate::support::{Backend, Ctx, Order, Recorder, order, soon, wait_until};

type HandlerResult = Result<(), BoxError>;

fn fail_first(
    times: u32,
    rec: Recorder,
) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, HandlerResult> + Send + Sync + 'static
{
    move |d: Delivery| {
        let r = rec.clone();
        Box::pin(async move {
            r.call(&d);
            if d.attempt() <= times {
                return Err(
                    Transient::msg(format!("flaky downstream, attempt {}", d.attempt())).into(),
                );
            }
            r.effect(d.id());
            Ok(())
        })
    }
}

/// One transient failure: retried once, no earlier than its delay, and within tolerance.
pub async fn one_transient_failure_retried_after_its_delay(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "one-transient").await?;
    let rec = Recorder::new();
    let h = ctx.consumer("c").start(fail_first(1, rec.clone())).await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    wait_until("processed after one retry", soon(b), || {
        rec.effect_count() == 1
    })
    .await?;
    let calls = rec.calls_for(&id);
    ensure!(calls.len() == 2, "expected 2 calls, got {}", calls.len());
    ensure!(
        calls[0].attempt == 1 && calls[1].attempt == 2,
        "attempts {:?}",
        calls.iter().map(|c| c.attempt).collect::<Vec<_>>()
    );
    let waited = calls[1].at - calls[0].at;
    let [t1, _] = b.tiers();
    ensure!(
        waited >= t1,
        "retried after {waited:?}, before its {t1:?} delay"
    );
    ensure!(
        waited <= t1 + b.tolerance(),
        "retried after {waited:?}, later than {t1:?} + tolerance"
    );
    let s = h.shutdown().await.stats;
    ensure!(
        s.retried == 1 && s.processed == 1 && s.dead_lettered == 0,
        "{s:?}"
    );
    Ok(())
}

/// K transient failures, then success at attempt K+1.
pub async fn k_transient_failures_processed_at_attempt_k_plus_one(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "k-transient").await?;
    let rec = Recorder::new();
    let [t1, t2] = b.tiers();
    let h = ctx
        .consumer("c")
        .retry(RetryPolicy::tiers([t1, t2]).max_attempts(4))
        .start(fail_first(3, rec.clone()))
        .await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    wait_until("processed at attempt 4", soon(b), || {
        rec.effect_count() == 1
    })
    .await?;
    let attempts: Vec<u32> = rec.calls_for(&id).iter().map(|c| c.attempt).collect();
    ensure!(attempts == vec![1, 2, 3, 4], "attempts {attempts:?}");
    let s = h.shutdown().await.stats;
    ensure!(s.retried == 3 && s.processed == 1, "{s:?}");
    ctx.assert_no_dead_letters("c").await
}

/// The retry budget runs out: DLQ `exhausted` with attempts = max.
pub async fn exhausted_budget_dead_letters_with_max_attempts(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "exhausted").await?;
    let rec = Recorder::new();
    let h = ctx
        .consumer("c")
        .start(fail_first(u32::MAX, rec.clone()))
        .await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    let (d, record) = &dead[0];
    ensure!(d.id() == &id, "same id in the DLQ");
    ensure!(
        record.reason == DeadLetterReason::Exhausted,
        "reason {}",
        record.reason
    );
    ensure!(record.attempts == 3, "attempts {}", record.attempts);
    ensure!(record.error_class == Some(ErrorClass::Transient));
    ensure!(
        rec.calls_for(&id).len() == 3,
        "handler called {} times",
        rec.calls_for(&id).len()
    );
    h.shutdown().await;
    Ok(())
}

/// Max age wins over remaining attempts: DLQ `expired`.
pub async fn max_age_dead_letters_as_expired_with_attempts_left(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "expired").await?;
    let rec = Recorder::new();
    let [t1, t2] = b.tiers();
    let h = ctx
        .consumer("c")
        .retry(
            RetryPolicy::tiers([t1, t2])
                .max_attempts(10)
                .max_age(t1 + t1 / 2),
        )
        .start(fail_first(u32::MAX, rec.clone()))
        .await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    let (_, record) = &dead[0];
    ensure!(
        record.reason == DeadLetterReason::Expired,
        "reason {}",
        record.reason
    );
    ensure!(
        record.attempts == 2,
        "expired after attempt {} (10 allowed)",
        record.attempts
    );
    ensure!(rec.calls_for(&id).len() == 2);
    h.shutdown().await;
    Ok(())
}

/// Permanent failure: DLQ at once, handler called once.
pub async fn permanent_failure_dead_letters_at_once(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "permanent").await?;
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ctx
        .consumer("c")
        .start(move |_d: Delivery| {
            let c = c.clone();
            async move {
                c.fetch_add(1, AtomicOrdering::Relaxed);
                Err::<(), BoxError>(Permanent::msg("sku does not exist").into())
            }
        })
        .await?;
    ctx.publish(order(1)).await?;
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    ensure!(dead[0].1.reason == DeadLetterReason::Permanent);
    ensure!(dead[0].1.attempts == 1);
    ensure!(
        calls.load(AtomicOrdering::Relaxed) == 1,
        "handler called more than once"
    );
    let s = h.shutdown().await.stats;
    ensure!(s.retried == 0 && s.dead_lettered == 1, "{s:?}");
    Ok(())
}

/// Poison (bad JSON, invalid UTF-8, missing id field): DLQ at once.
pub async fn poison_dead_letters_at_once(b: &dyn Backend) -> anyhow::Result<()> {
    #[derive(Deserialize)]
    struct Strict {
        #[allow(dead_code)]
        id: String,
        #[allow(dead_code)]
        n: u32,
    }
    let ctx = Ctx::new(b, "poison").await?;
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ctx
        .consumer("c")
        .start(move |d: Delivery| {
            let c = c.clone();
            async move {
                c.fetch_add(1, AtomicOrdering::Relaxed);
                let _text = d.text()?;
                let _order: Strict = d.json()?;
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let bad = [
        Message::new(&b"{not json"[..]),
        Message::new(&[0xffu8, 0xfe, 0x00][..]),
        Message::new(&br#"{"n": 1}"#[..]),
    ];
    let ids: HashSet<MessageId> = bad.iter().map(|m| m.id().clone()).collect();
    ctx.publish_all(bad.to_vec()).await?;
    let dead = ctx.take_dead_letters("c", 3, soon(b)).await?;
    ensure!(
        dead.iter()
            .all(|(_, r)| r.reason == DeadLetterReason::Poison && r.attempts == 1)
    );
    ensure!(
        dead.iter()
            .map(|(d, _)| d.id().clone())
            .collect::<HashSet<_>>()
            == ids
    );
    ensure!(
        calls.load(AtomicOrdering::Relaxed) == 3,
        "each poison message handled once"
    );
    let utf8 = dead
        .iter()
        .find(|(d, _)| d.payload().as_ref() == [0xff, 0xfe, 0x00]);
    ensure!(utf8.is_some(), "binary payload kept byte for byte");
    h.shutdown().await;
    Ok(())
}

/// A panic dead-letters (default policy) and the consumer goes on; other messages are
/// unaffected. With `PanicAction::Retry` the panic is retried.
pub async fn panic_dead_letters_and_consumer_survives(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "panic").await?;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                if d.payload() == b"boom" {
                    panic!("handler bug");
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let boom = Message::new("boom");
    let boom_id = boom.id().clone();
    let mut msgs: Vec<Message> = (0..20).map(order).collect();
    msgs.insert(10, boom);
    ctx.publish_all(msgs).await?;
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    ensure!(dead[0].0.id() == &boom_id && dead[0].1.reason == DeadLetterReason::Panic);
    ensure!(
        dead[0]
            .1
            .error
            .as_deref()
            .is_some_and(|e| e.contains("handler bug"))
    );
    wait_until("others processed", soon(b), || rec.effect_count() == 20).await?;
    ctx.publish(order(99)).await?;
    wait_until("consumer still alive", soon(b), || rec.effect_count() == 21).await?;
    let s = h.shutdown().await.stats;
    ensure!(s.panics == 1, "{s:?}");

    // PanicAction::Retry: a one-off panic is retried and succeeds (a fresh source, so the
    // new consumer does not start with the messages above on brokers that replay history).
    let ctx = Ctx::new(b, "panic-retry").await?;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("retrying")
        .retry(RetryPolicy::tiers(b.tiers()).on_panic(PanicAction::Retry))
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                r.call(&d);
                if d.attempt() == 1 {
                    panic!("first attempt panics");
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    ctx.publish(order(1)).await?;
    wait_until("panic retried and processed", soon(b), || {
        rec.effect_count() == 1
    })
    .await?;
    let s = h.shutdown().await.stats;
    ensure!(s.retried == 1 && s.panics == 1, "{s:?}");
    Ok(())
}

/// A poison message in the middle of a stream does not block the ones after it.
pub async fn poison_does_not_block_following_messages(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "poison-flow").await?;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .max_in_flight(1)
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                let o: Order = d.json()?;
                let _ = o.n;
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let mut msgs = vec![Message::new("garbage")];
    msgs.extend((0..30).map(order));
    ctx.publish_all(msgs).await?;
    wait_until("30 valid processed behind the poison one", soon(b), || {
        rec.effect_count() == 30
    })
    .await?;
    ctx.take_dead_letters("c", 1, soon(b)).await?;
    h.shutdown().await;
    Ok(())
}

/// The retry copy keeps id, key, payload, user headers, correlation/causation, traceparent.
pub async fn retry_keeps_id_key_payload_and_headers(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "retry-keeps").await?;
    let rec = Recorder::new();
    let h = ctx.consumer("c").start(fail_first(1, rec.clone())).await?;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let m = Message::new("payload")
        .with_key("k-1")
        .with_header("tenant", "acme")
        .with_header(headers::TRACEPARENT, tp)
        .with_correlation_id("corr-1")
        .with_causation_id("cause-1");
    let id = m.id().clone();
    ctx.publish(m).await?;
    wait_until("processed on retry", soon(b), || rec.effect_count() == 1).await?;
    let calls = rec.calls_for(&id);
    ensure!(calls.len() == 2);
    let second = &calls[1];
    let hv = |n: &str| {
        second
            .headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    ensure!(second.payload == b"payload");
    ensure!(second.key.as_deref() == Some("k-1"));
    ensure!(hv("tenant") == Some("acme"));
    ensure!(hv(headers::TRACEPARENT) == Some(tp));
    ensure!(hv(headers::CORRELATION_ID) == Some("corr-1"));
    ensure!(hv(headers::CAUSATION_ID) == Some("cause-1"));
    ensure!(second.attempt == 2);
    h.shutdown().await;
    Ok(())
}

/// While a failed message waits for its retry, later messages are processed.
pub async fn non_blocking_retry_lets_later_messages_flow(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "non-blocking").await?;
    let rec = Recorder::new();
    let r = rec.clone();
    // Only A fails, and only on its first delivery.
    let h = ctx
        .consumer("c")
        .max_in_flight(1)
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                let first_call = r.calls_for(d.id()).is_empty();
                r.call(&d);
                if d.payload() == b"A" && first_call {
                    return Err(Transient::msg("A fails once").into());
                }
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let a = Message::new("A");
    let a_id = a.id().clone();
    ctx.publish(a).await?;
    wait_until("A failed once", soon(b), || rec.calls_for(&a_id).len() == 1).await?;
    let later: Vec<Message> = (0..10).map(order).collect();
    let later_ids: Vec<MessageId> = later.iter().map(|m| m.id().clone()).collect();
    ctx.publish_all(later).await?;
    wait_until("A retried", soon(b), || rec.calls_for(&a_id).len() == 2).await?;
    let a_retry = rec.calls_for(&a_id)[1].at;
    for id in &later_ids {
        let c = rec.calls_for(id);
        ensure!(c.len() == 1, "later message handled {} times", c.len());
        ensure!(c[0].at < a_retry, "a later message waited behind A's retry");
    }
    h.shutdown().await;
    Ok(())
}

/// Many retries, none earlier than its delay.
pub async fn retry_never_fires_early(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "never-early").await?;
    let rec = Recorder::new();
    let [t1, t2] = b.tiers();
    let h = ctx
        .consumer("c")
        .retry(RetryPolicy::tiers([t1, t2]).max_attempts(3).jitter(0.5))
        .start(fail_first(2, rec.clone()))
        .await?;
    let msgs: Vec<Message> = (0..20).map(order).collect();
    let ids: Vec<MessageId> = msgs.iter().map(|m| m.id().clone()).collect();
    ctx.publish_all(msgs).await?;
    wait_until("20 processed at attempt 3", soon(b) * 2, || {
        rec.effect_count() == 20
    })
    .await?;
    for id in &ids {
        let c = rec.calls_for(id);
        ensure!(c.len() == 3, "calls {}", c.len());
        ensure!(
            c[1].at - c[0].at >= t1,
            "first retry early: {:?}",
            c[1].at - c[0].at
        );
        ensure!(
            c[2].at - c[1].at >= t2,
            "second retry early: {:?}",
            c[2].at - c[1].at
        );
    }
    h.shutdown().await;
    Ok(())
}
