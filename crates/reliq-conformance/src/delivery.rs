//! Scenarios of delivery and acknowledgement: a message arrives intact, every group gets
//! every message while members of one group split them, an ack is final, a crash before
//! the ack redelivers (and a crash loop ends at the delivery limit), and a publish with
//! no receiver fails loudly.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_core::{
    BoxError, BrokerError, DeadLetterReason, Delivery, Destination, Message, seam::headers,
};

use crate::support::{Backend, Ctx, Recorder, order, soon, wait_until};

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

/// A consumer with a filter gets only the messages whose route matches it (`*` one word,
/// `#` any number), while a consumer without one gets every message; on a broker that
/// cannot filter ([`Capabilities::filters`](reliq_core::Capabilities::filters) false), a
/// filter fails at start naming the field instead of being ignored.
pub async fn filter_delivers_only_matching_routes(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "filter").await?;
    let noop = |_d: Delivery| async { Ok::<(), BoxError>(()) };
    if !ctx.broker.capabilities().filters {
        let refused = ctx.consumer("filtered").filter("order.*").start(noop).await;
        match refused {
            Err(reliq_core::ConsumerError::Subscribe(BrokerError::Config { field, .. })) => {
                ensure!(field == "filter", "refused naming `{field}`");
                return Ok(());
            }
            Err(e) => anyhow::bail!("a filter this broker cannot apply failed with {e}"),
            Ok(h) => {
                h.shutdown().await;
                anyhow::bail!("a filter this broker cannot apply was accepted");
            }
        }
    }
    let (filtered, everything) = (Recorder::new(), Recorder::new());
    let mut handles = Vec::new();
    for (name, filter, rec) in [
        ("filtered", Some("order.*"), filtered.clone()),
        ("everything", None, everything.clone()),
    ] {
        let builder = ctx.consumer(name);
        let builder = match filter {
            Some(pattern) => builder.filter(pattern),
            None => builder,
        };
        handles.push(
            builder
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
    let routes = [
        "order.created",
        "order.cancelled",
        "invoice.created",
        "order.created.eu",
    ];
    let mut wanted = std::collections::HashSet::new();
    for i in 0..20 {
        let route = routes[i % routes.len()];
        let m = Message::new(format!("{route} {i}"));
        if route.starts_with("order.") && route.matches('.').count() == 1 {
            wanted.insert(m.id().clone());
        }
        let dest = Destination::new(ctx.topic.clone()).with_route(route);
        ctx.broker.publish(&dest, m).await.context("publish")?;
    }
    wait_until("the unfiltered consumer got all 20", soon(b), || {
        everything.effect_count() == 20
    })
    .await?;
    // Whatever the filtered consumer would wrongly get has had as long to arrive.
    wait_until("the filtered consumer got its 10", soon(b), || {
        filtered.effect_count() >= wanted.len()
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got: std::collections::HashSet<_> = filtered.effects().into_keys().collect();
    ensure!(
        got == wanted,
        "filter `order.*` let through {} unwanted and missed {}",
        got.difference(&wanted).count(),
        wanted.difference(&got).count()
    );
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
