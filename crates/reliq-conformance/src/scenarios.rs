//! The scenarios. Each is `async fn(&dyn Backend) -> anyhow::Result<()>`, asserting
//! behaviour (counts, ids, headers, delays with tolerances).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_core::headers;
use reliq_core::{
    Batch, BatchError, BoxError, BrokerError, DeadLetterReason, Delivery, DeliveryOrder,
    Destination, ErrorClass, MemoryInbox, Message, MessageId, PanicAction, Permanent, Poison,
    Replay, ReplayFilter, RetryPolicy, Transient,
};
use serde::{Deserialize, Serialize};

use crate::support::{Backend, Ctx, Recorder, soon, wait_until};
use tokio::time::Instant;

type HandlerResult = Result<(), BoxError>;

#[derive(Serialize, Deserialize)]
struct Order {
    n: u32,
}

fn order(n: u32) -> Message {
    Message::json(&Order { n }).unwrap_or_else(|_| Message::new(n.to_string()))
}

/// 1,000 messages published, consumed and acked with payload, key, headers and id intact.
pub async fn publish_consume_ack_keeps_payload_headers_and_id(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "pub-consume").await?;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx.consumer("c").start(r.succeeding()).await?;
    let mut sent = HashMap::new();
    let mut messages = Vec::new();
    for i in 0..1000u32 {
        let m = Message::new(format!("payload-{i}"))
            .with_key(format!("k{}", i % 7))
            .with_header("x-seq", i.to_string())
            .with_correlation_id(format!("corr-{i}"));
        sent.insert(m.id().clone(), i);
        messages.push(m);
    }
    ctx.publish_all(messages).await?;
    wait_until("1,000 processed", soon(b), || h.stats().processed == 1000).await?;
    let calls = rec.calls();
    ensure!(calls.len() == 1000, "handler called {} times", calls.len());
    for c in &calls {
        let i = *sent.get(&c.id).context("an id that was never published")?;
        ensure!(
            c.payload == format!("payload-{i}").as_bytes(),
            "payload changed"
        );
        ensure!(
            c.key.as_deref() == Some(format!("k{}", i % 7).as_str()),
            "key changed"
        );
        let hv = |n: &str| {
            c.headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.clone())
        };
        ensure!(hv("x-seq") == Some(i.to_string()), "user header changed");
        ensure!(
            hv(headers::CORRELATION_ID) == Some(format!("corr-{i}")),
            "correlation id changed"
        );
        ensure!(c.attempt == 1, "first delivery must be attempt 1");
    }
    ensure!(rec.effect_count() == 1000, "every id once");
    let report = h.shutdown().await;
    ensure!(
        report.stats.settle_failures == 0,
        "no failed settlement: {:?}",
        report.stats
    );
    Ok(())
}

/// Two groups on one topic each get every message.
pub async fn two_groups_each_get_every_message(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "two-groups").await?;
    let (ra, rb) = (Recorder::new(), Recorder::new());
    let mut handles = Vec::new();
    for (name, rec) in [("a", ra.clone()), ("b", rb.clone())] {
        handles.push(
            ctx.consumer(name)
                .start(move |d: Delivery| {
                    let r = rec.clone();
                    async move {
                        r.effect(d.id());
                        Ok::<(), BoxError>(())
                    }
                })
                .await?,
        );
    }
    ctx.publish_all((0..100).map(order).collect()).await?;
    wait_until("both groups got 100", soon(b), || {
        ra.effect_count() == 100 && rb.effect_count() == 100
    })
    .await?;
    ensure!(ra.effects().values().all(|n| *n == 1) && rb.effects().values().all(|n| *n == 1));
    for h in handles {
        h.shutdown().await;
    }
    Ok(())
}

/// Two members of one group split the messages; none is handled twice.
pub async fn group_members_split_without_double_handling(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "members").await?;
    let rec = Recorder::new();
    let per_member = [Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0))];
    // Each member's calls (attempt, time), to tell what a double handling was.
    let member_calls = [Recorder::new(), Recorder::new()];
    let started = tokio::time::Instant::now();
    let mut handles = Vec::new();
    for (counter, calls) in per_member.iter().zip(&member_calls) {
        let counter = counter.clone();
        let calls = calls.clone();
        let rec = rec.clone();
        let broker = b.connect().await?;
        handles.push(
            ctx.consumer_on(broker, "shared")
                .max_in_flight(4)
                .start(move |d: Delivery| {
                    let (r, c) = (rec.clone(), counter.clone());
                    calls.call(&d);
                    async move {
                        c.fetch_add(1, AtomicOrdering::Relaxed);
                        // Slow enough that one member cannot take everything.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        r.effect(d.id());
                        Ok::<(), BoxError>(())
                    }
                })
                .await?,
        );
    }
    ctx.publish_all((0..400).map(order).collect()).await?;
    wait_until("400 handled", soon(b), || rec.effect_count() == 400).await?;
    for h in handles {
        h.shutdown().await;
    }
    let twice: Vec<String> = rec
        .effects()
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(id, _)| {
            let calls: Vec<String> = member_calls
                .iter()
                .enumerate()
                .flat_map(|(member, calls)| {
                    calls.calls_for(&id).into_iter().map(move |c| {
                        let at = c.at.saturating_duration_since(started);
                        format!("member {member} attempt {} at {at:?}", c.attempt)
                    })
                })
                .collect();
            format!("{id}: {}", calls.join(", "))
        })
        .collect();
    ensure!(twice.is_empty(), "a message was handled twice: {twice:?}");
    let counts: Vec<u32> = per_member
        .iter()
        .map(|c| c.load(AtomicOrdering::Relaxed))
        .collect();
    ensure!(counts.iter().sum::<u32>() == 400, "calls {counts:?}");
    ensure!(
        counts.iter().all(|c| *c > 0),
        "both members must get work: {counts:?}"
    );
    Ok(())
}

/// Acked messages are not delivered again to a restarted consumer.
pub async fn ack_only_after_success_nothing_redelivered_after_restart(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "restart").await?;
    let rec = Recorder::new();
    let start = |rec: Recorder| {
        ctx.consumer("c").start(move |d: Delivery| {
            let r = rec.clone();
            async move {
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
    };
    let h = start(rec.clone()).await?;
    ctx.publish_all((0..50).map(order).collect()).await?;
    wait_until("50 processed", soon(b), || h.stats().processed == 50).await?;
    h.shutdown().await;
    let after = Recorder::new();
    let h = start(after.clone()).await?;
    tokio::time::sleep(b.quiet_period()).await;
    ensure!(
        after.effect_count() == 0,
        "acked messages came back: {}",
        after.effect_count()
    );
    h.shutdown().await;
    Ok(())
}

/// A consumer that dies before acking: the message is delivered again.
pub async fn crash_before_ack_redelivers(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "crash").await?;
    let entered = Arc::new(AtomicU32::new(0));
    let e = entered.clone();
    let h = ctx
        .consumer_on(b.connect().await?, "c")
        .lease(b.crash_lease())
        .start(move |_d: Delivery| {
            let e = e.clone();
            async move {
                e.fetch_add(1, AtomicOrdering::Relaxed);
                std::future::pending::<()>().await;
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let m = order(1);
    let id = m.id().clone();
    ctx.publish(m).await?;
    wait_until("handler entered", soon(b), || {
        entered.load(AtomicOrdering::Relaxed) == 1
    })
    .await?;
    h.crash().await;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer_on(b.connect().await?, "c")
        .lease(b.crash_lease())
        .start(r.succeeding())
        .await?;
    wait_until("redelivered after crash", soon(b), || {
        rec.effect_count() == 1
    })
    .await?;
    ensure!(
        rec.calls_for(&id).len() == 1,
        "the crashed message must come back once"
    );
    h.shutdown().await;
    Ok(())
}

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

/// DLQ unavailable: the source stays unacked (nothing lost); once the DLQ is back the
/// message lands there exactly once.
pub async fn dead_letter_unavailable_source_kept_nothing_lost(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-down").await?;
    let sub = ctx.subscription("c");
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ctx
        .consumer("c")
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
    let s = h.stats();
    ensure!(s.dead_lettered == 0 && s.processed == 0, "{s:?}");
    ensure!(
        calls.load(AtomicOrdering::Relaxed) >= 2,
        "the released message must come back"
    );
    b.set_dead_letter_available(&ctx.broker, &sub, true).await?;
    wait_until("dead-lettered once the DLQ is back", soon(b), || {
        h.stats().dead_lettered == 1
    })
    .await?;
    h.shutdown().await;
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    ensure!(dead[0].0.id() == &id && dead[0].1.reason == DeadLetterReason::Permanent);
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
    // A budget that outlasts the releases on brokers where every delivery is an attempt.
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
        s.retried == 0 && s.dead_lettered == 0 && s.processed == 0,
        "{s:?}"
    );
    ensure!(
        rec.calls_for(&id).len() >= 2,
        "the released message must come back"
    );
    if !ctx.broker.capabilities().attempts_count_every_delivery {
        // A release is not an attempt where reliq counts attempts in a header.
        ensure!(
            rec.calls_for(&id).iter().all(|c| c.attempt == 1),
            "released, not retried"
        );
    }
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

/// A message that kills its consumer every time still leaves: the broker's delivery
/// limit moves it to the DLQ with `max-deliveries`.
pub async fn crash_loop_dead_letters_via_delivery_limit(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "crash-loop").await?;
    let limit = 5u32;
    let entered = Arc::new(AtomicU32::new(0));
    let m = order(1);
    let id = m.id().clone();
    let mut published = false;
    let mut crashes = 0;
    loop {
        let e = entered.clone();
        let h = ctx
            .consumer_on(b.connect().await?, "c")
            .delivery_limit(limit)
            .lease(b.crash_lease())
            .start(move |_d: Delivery| {
                let e = e.clone();
                async move {
                    e.fetch_add(1, AtomicOrdering::Relaxed);
                    std::future::pending::<()>().await;
                    Ok::<(), BoxError>(())
                }
            })
            .await?;
        if !published {
            ctx.publish(m.clone()).await?;
            published = true;
        }
        let before = crashes;
        let got = wait_until("handler entered", b.quiet_period() * 3, || {
            entered.load(AtomicOrdering::Relaxed) > before
        })
        .await;
        h.crash().await;
        if got.is_err() {
            break;
        }
        crashes += 1;
        ensure!(crashes <= limit + 1, "the delivery limit never kicked in");
    }
    ensure!(
        crashes == limit,
        "delivered {crashes} times with a limit of {limit}"
    );
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    ensure!(dead[0].0.id() == &id);
    ensure!(
        dead[0].1.reason == DeadLetterReason::MaxDeliveries,
        "reason {}",
        dead[0].1.reason
    );
    Ok(())
}

/// `max_in_flight` (and `concurrency`) are never exceeded under a 1,000 backlog.
pub async fn max_in_flight_never_exceeded(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "in-flight").await?;
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .max_in_flight(16)
        .concurrency(4)
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                r.effect(d.id());
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    ctx.publish_all((0..1000).map(order).collect()).await?;
    wait_until("1,000 processed", soon(b) * 2, || {
        rec.effect_count() == 1000
    })
    .await?;
    let s = h.shutdown().await.stats;
    ensure!(s.max_in_flight <= 16, "held {} at once", s.max_in_flight);
    ensure!(s.max_running <= 4, "ran {} handlers at once", s.max_running);
    ensure!(
        s.max_running >= 2,
        "concurrency not used: {}",
        s.max_running
    );
    Ok(())
}

/// Shutdown: stop receiving, finish or release in-flight work; a second consumer gets
/// the rest; every message has exactly one effect and no settlement failed.
pub async fn graceful_shutdown_loses_nothing_and_settles_once(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "shutdown").await?;
    let rec = Recorder::new();
    // Start times of the handlers running right now.
    let running: Arc<std::sync::Mutex<Vec<(MessageId, Instant)>>> = Arc::default();
    let handler = |rec: Recorder, running: Arc<std::sync::Mutex<Vec<(MessageId, Instant)>>>| {
        move |d: Delivery| {
            let (r, running) = (rec.clone(), running.clone());
            async move {
                let lock = || running.lock().unwrap_or_else(|p| p.into_inner());
                lock().push((d.id().clone(), Instant::now()));
                tokio::time::sleep(Duration::from_secs(1)).await;
                r.effect(d.id());
                lock().retain(|(id, _)| id != d.id());
                Ok::<(), BoxError>(())
            }
        }
    };
    let h = ctx
        .consumer_on(b.connect().await?, "c")
        .max_in_flight(8)
        .shutdown_timeout(Duration::from_millis(100))
        .start(handler(rec.clone(), running.clone()))
        .await?;
    let msgs: Vec<Message> = (0..40).map(order).collect();
    let ids: HashSet<MessageId> = msgs.iter().map(|m| m.id().clone()).collect();
    ctx.publish_all(msgs).await?;
    // Shut down while some work is done and a handler started less than 300 ms ago: it
    // cannot finish (1 s) within the 100 ms shutdown timeout, so something is released.
    wait_until("some processed and a handler just started", soon(b), || {
        let fresh = running
            .lock()
            .map(|r| {
                r.iter()
                    .any(|(_, t)| t.elapsed() < Duration::from_millis(300))
            })
            .unwrap_or(false);
        rec.effect_count() >= 8 && fresh
    })
    .await?;
    let first = h.shutdown().await;
    ensure!(
        !first.drained && first.stats.released > 0,
        "the short deadline must release some: {:?}",
        first.stats
    );
    ensure!(first.stats.settle_failures == 0, "{:?}", first.stats);
    let h = ctx
        .consumer_on(b.connect().await?, "c")
        .max_in_flight(8)
        .start(handler(rec.clone(), running.clone()))
        .await?;
    wait_until("all 40 processed", soon(b), || rec.effect_count() == 40).await?;
    let second = h.shutdown().await;
    ensure!(
        second.drained && second.stats.settle_failures == 0,
        "{:?}",
        second.stats
    );
    let effects = rec.effects();
    ensure!(effects.keys().cloned().collect::<HashSet<_>>() == ids);
    ensure!(
        effects.values().all(|n| *n == 1),
        "a message took effect twice"
    );
    ensure!(
        first.stats.processed + second.stats.processed == 40,
        "acked {} + {}",
        first.stats.processed,
        second.stats.processed
    );
    Ok(())
}

/// Per-key ordering with concurrency > 1: each key in order, keys in parallel.
pub async fn per_key_order_kept_with_concurrency(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "per-key").await?;
    let seen: Arc<std::sync::Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let s2 = seen.clone();
    let h = ctx
        .consumer("c")
        .max_in_flight(64)
        .concurrency(8)
        .ordering(DeliveryOrder::PerKey)
        .start(move |d: Delivery| {
            let seen = s2.clone();
            async move {
                let o: Order = d.json()?;
                // Later messages finish faster: without per-key ordering they overtake.
                tokio::time::sleep(Duration::from_millis(u64::from(40 - o.n % 40))).await;
                let key = d.key().unwrap_or_default().to_owned();
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(key)
                    .or_default()
                    .push(o.n);
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    // One at a time: concurrent publishes may land in the broker in any order.
    for n in 0..40u32 {
        for k in 0..5 {
            ctx.publish(order(n).with_key(format!("key-{k}"))).await?;
        }
    }
    wait_until("200 handled", soon(b), || {
        seen.lock()
            .map(|m| m.values().map(Vec::len).sum::<usize>() == 200)
            .unwrap_or(false)
    })
    .await?;
    let s = h.shutdown().await.stats;
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for (k, v) in &seen {
        ensure!(
            v == &(0..40).collect::<Vec<u32>>(),
            "key {k} out of order: {v:?}"
        );
    }
    ensure!(
        s.max_running >= 2,
        "keys must run in parallel (max running {})",
        s.max_running
    );
    Ok(())
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
        // Where the broker deduplicates publishes by id, a second copy of the same id
        // reaches the consumer only as a replayed copy (its publish id differs).
        let copy = if i > 0 && ctx.broker.capabilities().deduplicates_publishes {
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
            ReplayFilter::default()
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

/// Slow handler, 10,000 queued: what the consumer holds stays within the prefetch bound.
pub async fn backpressure_bounds_buffered_messages(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "backpressure").await?;
    let sub_name = "c";
    let started = Arc::new(AtomicU32::new(0));
    let s = started.clone();
    let h = ctx
        .consumer(sub_name)
        .max_in_flight(16)
        .concurrency(2)
        .start(move |_d: Delivery| {
            let s = s.clone();
            async move {
                s.fetch_add(1, AtomicOrdering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let backlog = b.backpressure_backlog();
    ctx.publish_all((0..backlog).map(order).collect()).await?;
    wait_until("handling under way", soon(b), || {
        started.load(AtomicOrdering::Relaxed) >= 20
    })
    .await?;
    for _ in 0..5 {
        let st = h.stats();
        ensure!(st.in_flight <= 16, "holding {} > prefetch 16", st.in_flight);
        if let Some(n) = b.unsettled(&ctx.broker, &ctx.subscription(sub_name)).await {
            ensure!(n <= 16, "the broker handed out {n} > 16 unsettled");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let st = h.stats();
    ensure!(st.max_in_flight <= 16 && st.max_running <= 2, "{st:?}");
    ensure!(
        st.received < u64::from(backlog),
        "everything was pulled in: {st:?}"
    );
    h.shutdown().await;
    Ok(())
}

/// Publishing where nothing can receive fails loudly (capability-flagged where the
/// broker auto-creates destinations).
pub async fn unroutable_publish_fails_loudly(b: &dyn Backend) -> anyhow::Result<()> {
    let broker = b.connect().await?;
    let nowhere = crate::support::unique("nowhere");
    let result = broker
        .publish(&Destination::new(nowhere), Message::new("x"))
        .await;
    if broker.capabilities().rejects_unroutable {
        ensure!(
            matches!(result, Err(BrokerError::Unroutable(_))),
            "expected Unroutable, got {result:?}"
        );
    } else {
        ensure!(
            result.is_ok(),
            "a broker that auto-creates destinations accepts: {result:?}"
        );
    }
    Ok(())
}

/// A batch handler: the deliveries it names as failed take the failure path one by one
/// (poison → DLQ at once, transient → retried after its delay), the rest are
/// acknowledged once; no batch is larger than `batch_size`.
pub async fn batch_handler_settles_each_delivery_by_its_outcome(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    const BATCH: usize = 16;
    let ctx = Ctx::new(b, "batch").await?;
    let rec = Recorder::new();
    let largest = Arc::new(AtomicU32::new(0));
    let (r, l) = (rec.clone(), largest.clone());
    let h = ctx
        .consumer("c")
        .batch_size(BATCH)
        .start_batch(move |batch: Batch| {
            let (rec, largest) = (r.clone(), l.clone());
            async move {
                largest.fetch_max(batch.len() as u32, AtomicOrdering::Relaxed);
                let mut failed = BatchError::new();
                for (i, d) in batch.iter().enumerate() {
                    rec.call(d);
                    match d.text()? {
                        "poison" => failed.fail(i, Poison::msg("unreadable order")),
                        "flaky" if d.attempt() == 1 => failed.fail(i, Transient::msg("db busy")),
                        _ => rec.effect(d.id()),
                    }
                }
                failed.into_result()
            }
        })
        .await?;
    let mut ids: HashMap<&str, Vec<MessageId>> = HashMap::new();
    let mut messages = Vec::new();
    for i in 0..60 {
        let kind = ["poison", "flaky", "ok"][i % 3];
        let m = Message::new(kind);
        ids.entry(kind).or_default().push(m.id().clone());
        messages.push(m);
    }
    ctx.publish_all(messages).await?;
    wait_until("40 handled", soon(b), || rec.effect_count() == 40).await?;
    let dead = ctx.take_dead_letters("c", 20, soon(b)).await?;
    let dead_ids: HashSet<MessageId> = dead.iter().map(|(d, _)| d.id().clone()).collect();
    ensure!(
        dead_ids == ids["poison"].iter().cloned().collect::<HashSet<_>>(),
        "the dead letters are not exactly the poison messages"
    );
    for (_, record) in &dead {
        ensure!(
            record.reason == DeadLetterReason::Poison && record.attempts == 1,
            "dead-letter record {record:?}"
        );
    }
    let attempts =
        |id: &MessageId| -> Vec<u32> { rec.calls_for(id).iter().map(|c| c.attempt).collect() };
    for id in &ids["ok"] {
        ensure!(
            attempts(id) == vec![1],
            "ok message {id}: attempts {:?}",
            attempts(id)
        );
    }
    for id in &ids["flaky"] {
        ensure!(
            attempts(id) == vec![1, 2],
            "flaky message {id}: attempts {:?}",
            attempts(id)
        );
    }
    for id in &ids["poison"] {
        ensure!(
            attempts(id) == vec![1],
            "poison message {id}: attempts {:?}",
            attempts(id)
        );
    }
    ensure!(
        rec.effects().values().all(|n| *n == 1),
        "an effect happened twice"
    );
    let most = largest.load(AtomicOrdering::Relaxed) as usize;
    ensure!(most <= BATCH, "a batch of {most} > batch_size {BATCH}");
    let s = h.shutdown().await.stats;
    ensure!(
        s.processed == 40 && s.retried == 20 && s.dead_lettered == 20 && s.in_flight == 0,
        "{s:?}"
    );
    Ok(())
}

/// A backlog waiting in the broker reaches a batch handler in batches: fewer handler
/// calls than messages, none larger than `batch_size`, every message handled once.
pub async fn batch_handler_gets_a_backlog_in_batches(b: &dyn Backend) -> anyhow::Result<()> {
    const BATCH: usize = 16;
    const N: usize = 100;
    let ctx = Ctx::new(b, "batch-backlog").await?;
    // Declare the consumer's topology first, so the backlog waits for it.
    ctx.broker
        .subscribe(&ctx.subscription("c"))
        .await?
        .close()
        .await?;
    let messages: Vec<Message> = (0..N as u32).map(order).collect();
    let ids: HashSet<MessageId> = messages.iter().map(|m| m.id().clone()).collect();
    ctx.publish_all(messages).await?;
    let rec = Recorder::new();
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (r, s2) = (rec.clone(), sizes.clone());
    let h = ctx
        .consumer("c")
        .batch_size(BATCH)
        .start_batch(move |batch: Batch| {
            s2.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(batch.len());
            for d in &batch {
                r.call(d);
                r.effect(d.id());
            }
            async { Ok(()) }
        })
        .await?;
    wait_until("the backlog handled", soon(b), || rec.effect_count() == N).await?;
    let s = h.shutdown().await.stats;
    let sizes = sizes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let effects = rec.effects();
    ensure!(
        effects.keys().cloned().collect::<HashSet<_>>() == ids,
        "handled ids differ from the published ones"
    );
    ensure!(
        effects.values().all(|n| *n == 1),
        "a message was handled twice"
    );
    ensure!(
        sizes.iter().all(|n| (1..=BATCH).contains(n)),
        "batch sizes {sizes:?} (batch_size {BATCH})"
    );
    ensure!(
        sizes.len() < N,
        "{} handler calls for {N} waiting messages: never more than one per batch",
        sizes.len()
    );
    ensure!(s.processed == N as u64 && s.in_flight == 0, "{s:?}");
    Ok(())
}
