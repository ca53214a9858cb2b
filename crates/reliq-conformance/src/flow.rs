//! Scenarios of flow control and concurrency: `max_in_flight` and `concurrency` bounds,
//! backpressure on a large backlog, per-key order with concurrency, graceful shutdown,
//! and batch handlers.

use reliq_core::{
    Batch, BatchError, BoxError, DeadLetterReason, Delivery, DeliveryOrder, Message, MessageId,
    Poison, Transient, seam::lock,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::Duration;

use anyhow::ensure;

use crate::support::{Backend, Ctx, Order, Recorder, order, soon, wait_until};
use tokio::time::Instant;

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
                let running_now = || lock(&running);
                running_now().push((d.id().clone(), Instant::now()));
                tokio::time::sleep(Duration::from_secs(1)).await;
                r.effect(d.id());
                running_now().retain(|(id, _)| id != d.id());
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
                lock(&seen).entry(key).or_default().push(o.n);
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
    let seen = lock(&seen).clone();
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
            lock(&s2).push(batch.len());
            for d in &batch {
                r.call(d);
                r.effect(d.id());
            }
            async { Ok(()) }
        })
        .await?;
    wait_until("the backlog handled", soon(b), || rec.effect_count() == N).await?;
    let s = h.shutdown().await.stats;
    let sizes = lock(&sizes).clone();
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

/// A rate limit of 10 deliveries a second with a burst of 5, over a backlog of 30: every
/// message handled once; in no stretch of time more handler calls than the limit allows
/// (burst + rate × stretch, one call and 50 ms of scheduling slack); so the backlog takes
/// at least (30 − 5 − 1) / 10 s. Virtual time on the embedded broker.
pub async fn rate_limit_holds_over_a_backlog(b: &dyn Backend) -> anyhow::Result<()> {
    let (rate, burst, n) = (10.0_f64, 5.0_f64, 30usize);
    let ctx = Ctx::new(b, "rate-limit").await?;
    let rec = Recorder::new();
    let h = ctx
        .consumer("c")
        .rate_limit(10, 5)
        .start(rec.succeeding())
        .await?;
    ctx.publish_all((0..n as u32).map(order).collect()).await?;
    wait_until("30 processed", soon(b) * 2, || rec.effect_count() == n).await?;
    let stats = h.shutdown().await.stats;
    ensure!(stats.processed == n as u64, "{stats:?}");
    let mut at: Vec<Instant> = rec.calls().iter().map(|c| c.at).collect();
    at.sort();
    ensure!(at.len() == n, "{} handler calls for {n} messages", at.len());
    let slack = Duration::from_millis(50);
    for i in 0..at.len() {
        for j in i + 1..at.len() {
            let stretch = (at[j] - at[i] + slack).as_secs_f64();
            let calls = (j - i + 1) as f64;
            ensure!(
                calls <= burst + rate * stretch + 1.0,
                "{calls} calls within {:?}: over the limit",
                at[j] - at[i]
            );
        }
    }
    let took = at[n - 1] - at[0];
    ensure!(
        took + slack >= Duration::from_secs_f64((n as f64 - burst - 1.0) / rate),
        "{n} calls in {took:?}: the limit did not hold them back"
    );
    Ok(())
}

/// A downstream outage behind a circuit breaker: 30 messages published while the
/// database is down fail transiently until the breaker opens; then no handler is called
/// at all (what waits stays in the broker, or leased in the receiver, and spends no
/// attempt) until the cool-down ends. The database is back by then: the probes succeed,
/// the breaker closes, and every message is handled once — none dead-lettered, and each
/// message's successful call is at the attempt after its failed calls (no attempt spent
/// unseen while the breaker was open).
pub async fn circuit_breaker_pauses_consumption_through_an_outage(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    use reliq_core::{CircuitBreaker, CircuitState};
    use std::sync::atomic::AtomicBool;
    let ctx = Ctx::new(b, "breaker").await?;
    let rec = Recorder::new();
    let down = Arc::new(AtomicBool::new(true));
    let settle = b.quiet_period();
    let cool_down = settle * 3 + Duration::from_secs(2);
    let breaker = CircuitBreaker::new(crate::support::unique("db"))
        .failure_ratio(0.5)
        .minimum_calls(5)
        .window(Duration::from_secs(120))
        .cool_down(cool_down)
        .probes(2);
    let h = ctx
        .consumer("c")
        .max_in_flight(4)
        .circuit_breaker(breaker.clone())
        .start(rec.down_while(down.clone()))
        .await?;
    let n = 30;
    ctx.publish_all((0..n).map(|i| Message::new(format!("order-{i}"))).collect())
        .await?;
    wait_until("the breaker opens", soon(b), || {
        breaker.state() == CircuitState::Open
    })
    .await?;
    let opened = Instant::now();
    ensure!(h.circuit_state() == Some(CircuitState::Open));
    // The handlers that started before it opened finish (and fail).
    tokio::time::sleep(settle).await;
    let failed = rec.calls().len();
    ensure!(
        (5..n).contains(&failed),
        "{failed} calls before the breaker opened (5 failures open it; 4 in flight at most besides)"
    );
    // Open: no delivery reaches the handler until just before the cool-down ends.
    tokio::time::sleep_until(opened + cool_down - Duration::from_millis(500)).await;
    let while_open = rec.calls().len() - failed;
    ensure!(
        while_open == 0,
        "{while_open} handler calls while the breaker was open"
    );
    ensure!(breaker.state() == CircuitState::Open, "still open");
    down.store(false, AtomicOrdering::SeqCst);

    wait_until("every message handled", soon(b), || rec.effect_count() == n).await?;
    ensure!(
        breaker.state() == CircuitState::Closed,
        "closed by the probes"
    );
    tokio::time::sleep(b.quiet_period()).await;
    let calls = rec.calls();
    ensure!(
        calls.len() == failed + n,
        "{} calls: {failed} failed before the breaker opened, then one success each",
        calls.len()
    );
    for (id, effects) in rec.effects() {
        ensure!(effects == 1, "{id} handled {effects} times");
        let of = rec.calls_for(&id);
        let successful = of.last().map(|c| c.attempt);
        ensure!(
            successful == Some(of.len() as u32),
            "{id}: calls at attempts {:?}",
            of.iter().map(|c| c.attempt).collect::<Vec<_>>()
        );
    }
    ctx.assert_no_dead_letters("c").await?;
    h.shutdown().await;
    Ok(())
}

/// A poison storm is about the messages, not the downstream: 20 poison messages among 10
/// good ones are dead-lettered as poison, the good ones handled, and the breaker never
/// leaves closed.
pub async fn circuit_breaker_stays_closed_through_a_poison_storm(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    use reliq_core::{CircuitBreaker, CircuitState};
    use std::sync::atomic::AtomicBool;
    let ctx = Ctx::new(b, "breaker-poison").await?;
    let rec = Recorder::new();
    let breaker = CircuitBreaker::new(crate::support::unique("db"))
        .failure_ratio(0.5)
        .minimum_calls(5)
        .cool_down(Duration::from_secs(60));
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .circuit_breaker(breaker.clone())
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                r.call(&d);
                if d.payload().starts_with(b"bad") {
                    return Err::<(), BoxError>(Poison::msg("undecodable order").into());
                }
                r.effect(d.id());
                Ok(())
            }
        })
        .await?;
    let messages: Vec<Message> = (0..30)
        .map(|i| {
            Message::new(if i % 3 == 0 {
                format!("good-{i}")
            } else {
                format!("bad-{i}")
            })
        })
        .collect();
    ctx.publish_all(messages).await?;
    let left_closed = Arc::new(AtomicBool::new(false));
    let seen = left_closed.clone();
    wait_until("the good ones handled", soon(b), || {
        if breaker.state() != CircuitState::Closed {
            seen.store(true, AtomicOrdering::SeqCst);
        }
        rec.effect_count() == 10
    })
    .await?;
    let dead = ctx.take_dead_letters("c", 20, soon(b)).await?;
    ensure!(
        dead.len() == 20
            && dead
                .iter()
                .all(|(_, d)| d.reason == DeadLetterReason::Poison),
        "{} dead letters, reasons {:?}",
        dead.len(),
        dead.iter().map(|(_, d)| d.reason).collect::<Vec<_>>()
    );
    ensure!(
        !left_closed.load(AtomicOrdering::SeqCst) && breaker.state() == CircuitState::Closed,
        "poison opened the breaker"
    );
    h.shutdown().await;
    Ok(())
}
