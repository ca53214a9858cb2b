//! The consumer runtime's steady state on the embedded broker allocates nothing: a
//! counting global allocator over a window of 10,000 messages after a warm-up of 10,000
//! (per-message handler, no inbox, the default policy, `max_in_flight(256)`) — and a
//! typed consumer (`start_typed` with `JsonCodec`) of a value with no heap fields
//! allocates nothing either (its decode answers without a boxed future).
//!
//! What makes it zero: deliveries recycled through the receiver's `DeliveryPool`, group
//! tasks parked between groups with their buffers (`GroupRunners`), and the broker's
//! `try_receive_batch` / `try_ack_batch` (no boxed future while something is ready). A
//! regression in any of them fails here with the count. `bench-memory` reports the same
//! figure per message beside the throughput.
#![allow(unsafe_code)] // the counting allocator

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, RetryPolicy};
use reliq_memory::MemoryBroker;
use tokio::sync::Notify;

struct CountingAlloc;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// While set, the first allocation's stack is kept, for the failure message.
static WATCHING: AtomicBool = AtomicBool::new(false);
static FIRST: OnceLock<String> = OnceLock::new();

thread_local! {
    /// Set while this thread records a stack (which allocates itself).
    static RECORDING: Cell<bool> = const { Cell::new(false) };
}

fn counted(layout: Layout) {
    if RECORDING.get() {
        return; // the recording's own allocations
    }
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    if WATCHING.load(Ordering::Relaxed) && FIRST.get().is_none() {
        RECORDING.set(true);
        let stack = std::backtrace::Backtrace::force_capture();
        let _ = FIRST.set(format!("{layout:?}\n{stack}"));
        RECORDING.set(false);
    }
}

// SAFETY: delegates every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted(layout);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted(layout);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const WARM_UP: u64 = 10_000;
const WINDOW: u64 = 10_000;

/// What a window counted: allocations between the warm-up's end and the window's, and
/// the consumer's report.
fn window<S, F>(payload: impl Fn(u64) -> Vec<u8>, start: S) -> (u64, reliq_core::ShutdownReport)
where
    S: FnOnce(reliq_core::ConsumerBuilder, Arc<dyn Fn() + Send + Sync>) -> F,
    F: std::future::Future<Output = reliq_core::ConsumerHandle>,
{
    // One thread, as `bench-memory` measures: what runs is the runtime's path alone.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let broker: Arc<dyn Broker> = Arc::new(MemoryBroker::new());
        let builder = Consumer::builder(broker.clone(), "alloc")
            .subscribe("alloc")
            .retry(RetryPolicy::tiers([Duration::from_secs(1)]))
            .max_in_flight(256);
        drop(
            broker
                .subscribe(&builder.subscription().expect("subscription"))
                .await,
        );
        let total = WARM_UP + WINDOW + 1_000; // the window ends before the queue does
        let before_publish = ALLOCATIONS.load(Ordering::Relaxed);
        let dest = Destination::new("alloc");
        for i in 0..total {
            let m = Message::with_id_and_payload(format!("m-{i}"), payload(i));
            broker.publish(&dest, m).await.expect("publish");
        }
        // The counter counts: publishing made ids and queue entries.
        assert!(ALLOCATIONS.load(Ordering::Relaxed) - before_publish >= total);

        // Read by the handler itself at the window's two ends, so the count covers
        // exactly the deliveries handled in between and nothing the test does.
        let at_start = Arc::new(AtomicU64::new(0));
        let at_end = Arc::new(AtomicU64::new(0));
        let handled = Arc::new(AtomicU64::new(0));
        let done = Arc::new(Notify::new());
        let (start_at, end, count, finished) = (
            at_start.clone(),
            at_end.clone(),
            handled.clone(),
            done.clone(),
        );
        let hook: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            let n = count.fetch_add(1, Ordering::Relaxed) + 1;
            if n == WARM_UP {
                start_at.store(ALLOCATIONS.load(Ordering::Relaxed), Ordering::Relaxed);
                WATCHING.store(true, Ordering::Relaxed);
            } else if n == WARM_UP + WINDOW {
                end.store(ALLOCATIONS.load(Ordering::Relaxed), Ordering::Relaxed);
                WATCHING.store(false, Ordering::Relaxed);
                finished.notify_one();
            }
        });
        let handle = start(builder, hook).await;
        tokio::time::timeout(Duration::from_secs(60), done.notified())
            .await
            .expect("the window's messages are handled within a minute");
        let report = handle.shutdown().await;
        let allocations = at_end.load(Ordering::Relaxed) - at_start.load(Ordering::Relaxed);
        assert!(report.stats.processed >= WARM_UP + WINDOW, "{report:?}");
        assert_eq!(report.stats.dead_lettered, 0);
        (allocations, report)
    })
}

fn assert_none(allocations: u64) {
    assert_eq!(
        allocations,
        0,
        "{allocations} heap allocations while handling {WINDOW} messages in steady state \
         ({:.3} per message); the first: {}",
        allocations as f64 / WINDOW as f64,
        FIRST.get().map_or("(not recorded)", String::as_str)
    );
}

#[test]
fn steady_state_consume_allocates_nothing() {
    let (allocations, _) = window(
        |_| b"x".to_vec(),
        |builder, hook| async move {
            builder
                .start(move |_d: Delivery| {
                    hook();
                    std::future::ready(Ok::<(), BoxError>(()))
                })
                .await
                .expect("consumer starts")
        },
    );
    assert_none(allocations);
}

/// A value whose fields live on the stack: decoding it allocates nothing.
#[derive(serde::Serialize, serde::Deserialize)]
struct Reading {
    sensor: u32,
    value: f64,
    at_ms: u64,
}

#[test]
fn steady_state_typed_json_consume_allocates_nothing() {
    let (allocations, _) = window(
        |i| {
            serde_json::to_vec(&Reading {
                sensor: 7,
                value: 21.5,
                at_ms: i,
            })
            .expect("JSON")
        },
        |builder, hook| async move {
            builder
                .start_typed(
                    reliq_core::JsonCodec::<Reading>::new(),
                    move |reading: Reading, _d: Delivery| {
                        std::hint::black_box(reading.value);
                        hook();
                        std::future::ready(Ok::<(), BoxError>(()))
                    },
                )
                .await
                .expect("consumer starts")
        },
    );
    assert_none(allocations);
}
