//! Benchmark: the full consumer runtime on the memory backend (no-op handler) against a
//! raw baseline (a tokio channel + manual ack bookkeeping), in the same run, on one core
//! (current-thread runtime). Also counts heap allocations per message in steady state.
//!
//! ```sh
//! cargo run --release -p reliq-integration --bin bench-memory -- --messages 1000000
//! scripts/bench-callgrind        # instructions per message (valgrind --tool=callgrind)
//! ```
//!
//! `--only runtime|raw` runs one side (for callgrind); `--only publish` only builds and
//! publishes the runtime side's messages (what callgrind subtracts to leave the consume
//! path); `--repeat` repeats the pair. The typed paths: `--only typed-json|typed-avro`
//! consume an order event through `start_typed` with `JsonCodec` / `Avro` (the handler
//! gets the decoded value), `--only bytes` the same JSON payloads through `start` (the
//! handler gets the bytes), and `--only publish-json|publish-avro` their set-up alone;
//! without `--only` the three are measured after the pair.
#![allow(unsafe_code)] // the counting allocator

use reliq_integration::settings;
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy};
use reliq_memory::MemoryBroker;
use tokio::sync::Notify;

struct CountingAlloc;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: delegates every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

struct Run {
    msgs_per_sec: f64,
    allocs_per_msg: f64,
}

fn messages(n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| Message::with_id_and_payload(format!("m-{i}"), "x"))
        .collect()
}

/// The full runtime: pre-published queue, consumer with a no-op handler.
async fn runtime(n: usize) -> anyhow::Result<Run> {
    consume(n, true).await
}

/// The runtime side's set-up alone: the queue declared and filled, no consumer.
async fn publish_only(n: usize) -> anyhow::Result<()> {
    consume(n, false).await.map(drop)
}

async fn consume(n: usize, run_consumer: bool) -> anyhow::Result<Run> {
    let broker = MemoryBroker::new();
    let shared: Arc<dyn Broker> = Arc::new(broker.clone());
    let topic = "bench";
    let done = Arc::new(Notify::new());
    let handled = Arc::new(AtomicU64::new(0));
    let (d2, h2) = (done.clone(), handled.clone());
    let target = n as u64;
    let builder = Consumer::builder(shared.clone(), "bench")
        .subscribe(topic)
        .retry(RetryPolicy::tiers([Duration::from_secs(1)]))
        .max_in_flight(256);
    // Declare the group's queue, then fill it before the consumer starts.
    let sub = builder.subscription()?;
    drop(shared.subscribe(&sub).await?);
    let dest = Destination::new(topic);
    for m in messages(n) {
        shared.publish(&dest, m).await?;
    }
    if !run_consumer {
        return Ok(Run {
            msgs_per_sec: 0.0,
            allocs_per_msg: 0.0,
        });
    }
    let allocs0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let handle = builder
        .start(move |_d: Delivery| {
            let (done, handled) = (d2.clone(), h2.clone());
            async move {
                if handled.fetch_add(1, Ordering::Relaxed) + 1 == target {
                    done.notify_one();
                }
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    done.notified().await;
    let elapsed = t0.elapsed();
    let allocs = ALLOCS.load(Ordering::Relaxed) - allocs0;
    while handle.stats().processed < target {
        tokio::task::yield_now().await;
    }
    handle.shutdown().await;
    Ok(Run {
        msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
        allocs_per_msg: allocs as f64 / n as f64,
    })
}

/// The raw baseline: a pre-filled tokio channel, a no-op handler future, and the
/// bookkeeping any at-least-once consumer needs (a set of unacknowledged tags).
async fn raw(n: usize) -> anyhow::Result<Run> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Message)>();
    for (i, m) in messages(n).into_iter().enumerate() {
        tx.send((i as u64, m))?;
    }
    drop(tx);
    let allocs0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let mut unacked: HashSet<u64> = HashSet::with_capacity(256);
    let handled = AtomicU64::new(0);
    while let Some((tag, msg)) = rx.recv().await {
        unacked.insert(tag);
        let handler = async {
            std::hint::black_box(&msg);
            handled.fetch_add(1, Ordering::Relaxed);
            Ok::<(), BoxError>(())
        };
        if handler.await.is_ok() {
            unacked.remove(&tag);
        }
    }
    let elapsed = t0.elapsed();
    let allocs = ALLOCS.load(Ordering::Relaxed) - allocs0;
    anyhow::ensure!(handled.load(Ordering::Relaxed) == n as u64 && unacked.is_empty());
    Ok(Run {
        msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
        allocs_per_msg: allocs as f64 / n as f64,
    })
}

/// The event the typed paths carry.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
struct OrderCreated {
    order: String,
    sku: String,
    qty: i32,
    cents: i64,
}

/// How a typed run's consumer reads the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Payload {
    /// `start`: the handler gets the (JSON) bytes and does not read them.
    Bytes,
    /// `start_typed` with `JsonCodec`.
    Json,
    /// `start_typed` with `Avro` (the plain codec: no registry).
    Avro,
}

/// `n` order events encoded for `payload`, published before the consumer starts; then
/// (when `run_consumer`) consumed through the path `payload` names.
async fn typed(n: usize, payload: Payload, run_consumer: bool) -> anyhow::Result<Run> {
    use reliq_core::{Codec, JsonCodec};
    let broker = MemoryBroker::new();
    let shared: Arc<dyn Broker> = Arc::new(broker.clone());
    let topic = "bench-typed";
    let builder = Consumer::builder(shared.clone(), "bench")
        .subscribe(topic)
        .retry(RetryPolicy::tiers([Duration::from_secs(1)]))
        .max_in_flight(256);
    drop(shared.subscribe(&builder.subscription()?).await?);
    let json = JsonCodec::<OrderCreated>::new();
    let avro = reliq_contracts::Avro::<OrderCreated>::new();
    let dest = Destination::new(topic);
    for i in 0..n {
        let order = OrderCreated {
            order: format!("o-{i:07}"),
            sku: "sku-3".into(),
            qty: 2,
            cents: 1250,
        };
        let bytes = match payload {
            Payload::Avro => avro.encode(&order, topic).await?,
            Payload::Bytes | Payload::Json => json.encode(&order, topic).await?,
        };
        shared
            .publish(&dest, Message::with_id_and_payload(format!("m-{i}"), bytes))
            .await?;
    }
    if !run_consumer {
        return Ok(Run {
            msgs_per_sec: 0.0,
            allocs_per_msg: 0.0,
        });
    }
    let done = Arc::new(Notify::new());
    let handled = Arc::new(AtomicU64::new(0));
    let target = n as u64;
    let counted = move |done: Arc<Notify>, handled: Arc<AtomicU64>| {
        if handled.fetch_add(1, Ordering::Relaxed) + 1 == target {
            done.notify_one();
        }
    };
    let allocs0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let (d, h) = (done.clone(), handled.clone());
    let handle = match payload {
        Payload::Bytes => {
            builder
                .start(move |_d: Delivery| {
                    counted(d.clone(), h.clone());
                    async { Ok::<(), BoxError>(()) }
                })
                .await?
        }
        Payload::Json => {
            builder
                .start_typed(json, move |order: OrderCreated, _d: Delivery| {
                    std::hint::black_box(&order);
                    counted(d.clone(), h.clone());
                    async { Ok::<(), BoxError>(()) }
                })
                .await?
        }
        Payload::Avro => {
            builder
                .start_typed(avro, move |order: OrderCreated, _d: Delivery| {
                    std::hint::black_box(&order);
                    counted(d.clone(), h.clone());
                    async { Ok::<(), BoxError>(()) }
                })
                .await?
        }
    };
    done.notified().await;
    let elapsed = t0.elapsed();
    let allocs = ALLOCS.load(Ordering::Relaxed) - allocs0;
    while handle.stats().processed < target {
        tokio::task::yield_now().await;
    }
    anyhow::ensure!(
        handle.stats().dead_lettered == 0,
        "{payload:?}: nothing parks"
    );
    handle.shutdown().await;
    Ok(Run {
        msgs_per_sec: n as f64 / elapsed.as_secs_f64(),
        allocs_per_msg: allocs as f64 / n as f64,
    })
}

fn main() -> anyhow::Result<()> {
    let n: usize = settings::arg("--messages")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(200_000);
    let repeat: usize = settings::arg("--repeat")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(3);
    let only = settings::arg("--only");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        match only.as_deref() {
            Some("runtime") => {
                runtime(n).await?;
                return Ok(());
            }
            Some("raw") => {
                raw(n).await?;
                return Ok(());
            }
            Some("publish") => return publish_only(n).await,
            Some("bytes") => return typed(n, Payload::Bytes, true).await.map(drop),
            Some("typed-json") => return typed(n, Payload::Json, true).await.map(drop),
            Some("typed-avro") => return typed(n, Payload::Avro, true).await.map(drop),
            Some("publish-json") => return typed(n, Payload::Json, false).await.map(drop),
            Some("publish-avro") => return typed(n, Payload::Avro, false).await.map(drop),
            Some(other) => anyhow::bail!(
                "--only runtime|raw|publish|bytes|typed-json|typed-avro|publish-json|publish-avro, not {other}"
            ),
            None => {}
        }
        // warm-up
        runtime(n.min(20_000)).await?;
        raw(n.min(20_000)).await?;
        println!("messages per run: {n}, one core (current-thread runtime), no-op handler");
        for i in 1..=repeat {
            let r = runtime(n).await?;
            let b = raw(n).await?;
            println!(
                "run {i}: reliq runtime {:>10.0} msg/s ({:.3} allocs/msg) | raw baseline {:>10.0} msg/s ({:.3} allocs/msg) | ratio {:.3}",
                r.msgs_per_sec,
                r.allocs_per_msg,
                b.msgs_per_sec,
                b.allocs_per_msg,
                r.msgs_per_sec / b.msgs_per_sec
            );
        }
        println!("typed paths: an order event (JSON 56 bytes, Avro 19), no-op handler");
        for i in 1..=repeat {
            let bytes = typed(n, Payload::Bytes, true).await?;
            let json = typed(n, Payload::Json, true).await?;
            let avro = typed(n, Payload::Avro, true).await?;
            println!(
                "run {i}: bytes {:>10.0} msg/s ({:.3} allocs/msg) | typed JSON {:>10.0} msg/s ({:.3} allocs/msg, {:.3}×) | typed Avro {:>10.0} msg/s ({:.3} allocs/msg, {:.3}×)",
                bytes.msgs_per_sec,
                bytes.allocs_per_msg,
                json.msgs_per_sec,
                json.allocs_per_msg,
                json.msgs_per_sec / bytes.msgs_per_sec,
                avro.msgs_per_sec,
                avro.allocs_per_msg,
                avro.msgs_per_sec / bytes.msgs_per_sec
            );
        }
        Ok(())
    })
}
