//! The orders example: inventory reservation with retries, a dead-letter queue and an
//! inbox, unchanged on every backend.
//!
//! It publishes `--orders` order events (deterministically including poison payloads,
//! orders for unknown SKUs, orders whose reservation fails transiently a few times, and
//! duplicate copies), consumes them with an inbox, reserves stock, and ends with one
//! machine-readable line:
//!
//! ```text
//! summary published=N processed=P retried=R dead_lettered=D duplicates=U lost=L
//! ```
//!
//! `published` counts distinct orders; `lost` counts published orders that were neither
//! reserved nor dead-lettered (it must be 0).
//!
//! Run: `cargo run --example orders` (embedded broker) or
//! `cargo run --example orders -- --url amqp://…` with the backend's feature enabled.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use reliq::{
    BoxError, Consumer, Delivery, Destination, Envelope, MemoryInbox, Message, MessageId,
    Permanent, Replay, RetryPolicy, Subscription, Transient,
};
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
#[command(about = "reliq orders example: reserve stock for order events on any broker")]
struct Args {
    /// Broker URL (memory://, amqp://, kafka://, nats://, sqs://).
    #[arg(long, env = "RELIQ_URL", default_value = "memory://orders")]
    url: String,
    /// Distinct orders to publish.
    #[arg(long, default_value_t = 200)]
    orders: u32,
    /// Topic / exchange / stream to use (a fresh name per run by default).
    #[arg(long)]
    topic: Option<String>,
    /// Give up waiting after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct OrderCreated {
    order_id: String,
    sku: String,
    qty: u32,
}

/// Stock and the inbox: in a real service both live in one database and change in one
/// transaction.
#[derive(Default)]
struct Inventory {
    reserved: Mutex<HashMap<String, u32>>,
    reserved_orders: Mutex<HashSet<MessageId>>,
    flaky_calls: Mutex<HashMap<MessageId, u32>>,
}

impl Inventory {
    async fn reserve(&self, id: &MessageId, order: &OrderCreated) -> Result<(), BoxError> {
        if !order.sku.starts_with("sku-") {
            return Err(Permanent::msg(format!("unknown sku `{}`", order.sku)).into());
        }
        // Every 10th order meets a flaky warehouse service: it fails twice, then works.
        if order.order_id.ends_with('7') {
            let mut calls = self.flaky_calls.lock().unwrap_or_else(|p| p.into_inner());
            let n = calls.entry(id.clone()).or_insert(0);
            *n += 1;
            if *n <= 2 {
                return Err(Transient::msg("warehouse service timed out").into());
            }
        }
        *self
            .reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(order.sku.clone())
            .or_insert(0) += order.qty;
        self.reserved_orders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone());
        Ok(())
    }
}

/// The deterministic stream of orders: `(message, copies)`.
fn orders(n: u32) -> anyhow::Result<Vec<(Message, u32)>> {
    let mut out = Vec::new();
    for i in 0..n {
        let message = match i % 25 {
            // poison: not JSON at all / not UTF-8
            3 => Message::new(format!("order {i} as plain text")),
            13 => Message::new(vec![0xff, 0xfe, b'{']),
            // permanent: a SKU that does not exist
            20 => Envelope::new(
                "order.created",
                OrderCreated {
                    order_id: format!("o-{i:05}"),
                    sku: format!("gone-{i}"),
                    qty: 1,
                },
            )
            .to_message()?,
            _ => Envelope::new(
                "order.created",
                OrderCreated {
                    order_id: format!("o-{i:05}"),
                    sku: format!("sku-{}", i % 5),
                    qty: 1 + i % 3,
                },
            )
            .to_message()?,
        };
        // every 16th order is published twice (a producer retry after a lost confirm)
        let copies = if i % 16 == 5 { 2 } else { 1 };
        out.push((message.with_key(format!("customer-{}", i % 11)), copies));
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,reliq=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let broker = reliq::connect(&args.url)
        .await
        .with_context(|| format!("connecting to {}", args.url))?;
    let topic = args
        .topic
        .clone()
        .unwrap_or_else(|| format!("orders-{}", MessageId::generate()));
    let inventory = Arc::new(Inventory::default());
    let inbox = Arc::new(MemoryInbox::new());

    let inv = inventory.clone();
    let consumer = Consumer::builder(broker.clone(), "inventory")
        .subscribe(topic.clone(), None::<String>)
        .retry(
            RetryPolicy::tiers([Duration::from_millis(200), Duration::from_millis(500)])
                .max_attempts(4)
                .max_age(Duration::from_secs(60))
                .jitter(0.2),
        )
        .max_in_flight(64)
        .inbox(inbox.clone())
        .start(move |d: Delivery| {
            let inv = inv.clone();
            async move {
                let order: Envelope<OrderCreated> = d.envelope(1)?; // poison ⇒ DLQ at once
                inv.reserve(d.id(), &order.data).await
            }
        })
        .await?;

    let stream = orders(args.orders)?;
    let published: HashSet<MessageId> = stream.iter().map(|(m, _)| m.id().clone()).collect();
    let destination = Destination::new(topic.clone()).with_route("order.created");
    for (message, copies) in stream {
        for _ in 0..copies {
            broker.publish(&destination, message.clone()).await?;
        }
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_secs);
    let expected = published.len() as u64;
    loop {
        let s = consumer.stats();
        if s.processed + s.dead_lettered >= expected && s.in_flight == 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            eprintln!("timed out waiting: {s:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the duplicate copies drain too.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let report = consumer.shutdown().await;

    let dead = read_dead_letters(&broker, &Subscription::new("inventory", topic)).await?;
    let reserved = inventory
        .reserved_orders
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let both = reserved.intersection(&dead).count();
    if both > 0 {
        bail!("{both} orders were both reserved and dead-lettered");
    }
    let lost = published
        .iter()
        .filter(|id| !reserved.contains(*id) && !dead.contains(*id))
        .count();
    let s = report.stats;
    println!(
        "summary published={} processed={} retried={} dead_lettered={} duplicates={} lost={}",
        published.len(),
        reserved.len(),
        s.retried,
        dead.len(),
        s.duplicates,
        lost
    );
    if lost > 0 {
        bail!("{lost} orders were lost");
    }
    Ok(())
}

/// List the DLQ with the operator tooling's dry run: which orders are parked, and why.
async fn read_dead_letters(
    broker: &Arc<dyn reliq::Broker>,
    sub: &Subscription,
) -> anyhow::Result<HashSet<MessageId>> {
    let listing = Replay::new(broker.clone(), sub.clone())
        .idle_timeout(Duration::from_millis(500))
        .dry_run()
        .await?;
    for entry in &listing.matched {
        tracing::info!(id = %entry.id, reason = %entry.record.reason, error = ?entry.record.error, "parked");
    }
    Ok(listing.matched.into_iter().map(|e| e.id).collect())
}
