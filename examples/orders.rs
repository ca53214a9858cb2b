//! The orders example: inventory reservation with retries, a dead-letter queue, an
//! inbox and an outbox, unchanged on every backend.
//!
//! The orders service places `--orders` orders (deterministically including poison
//! payloads, orders for unknown SKUs, orders whose reservation fails transiently twice,
//! and duplicate copies): each order row and its `order.created` event are written in one
//! transaction (the **outbox**), and a relay publishes the events. The inventory consumer
//! claims each message id in the **inbox** and reserves stock in **one transaction**; the
//! runtime acknowledges after COMMIT, so a redelivered copy finds the claim and is skipped.
//! Stock, inbox and outbox live in SQLite (a temporary file) by default, in PostgreSQL when
//! a database URL is given (`--database-url` or `RELIQ_DATABASE_URL`; the tables go to a
//! fresh schema, dropped at the end). The program ends with one machine-readable line:
//!
//! ```text
//! summary published=N processed=P retried=R dead_lettered=D duplicates=U lost=L
//! ```
//!
//! `published` counts distinct orders; `processed` the orders reserved (each exactly once,
//! read back from the database); `dead_lettered` the distinct orders in the DLQ;
//! `lost` the published orders that were neither (it must be 0), so
//! `published = processed + dead_lettered + lost`. `retried` counts retries sent (two per
//! transiently failing order), `duplicates` the copies the inbox absorbed (the orders
//! published twice; a copy of a poison order is dead-lettered again instead).
//!
//! Run: `cargo run --example orders` (embedded broker) or
//! `cargo run --example orders -- --url amqp://…` with the backend's feature enabled.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use reliq::{Delivery, MessageId};
use reliq_examples::orders::{self, CONSUMER, Db, Expected};

#[derive(Parser, Debug)]
#[command(about = "reliq orders example: reserve stock for order events on any broker")]
struct Args {
    /// Broker URL (memory://, amqp://, kafka://, nats://, sqs://).
    #[arg(long, env = "RELIQ_URL", default_value = "memory://orders")]
    url: String,
    /// Database for stock, inbox and outbox: `postgres://…` or `sqlite://file.db`
    /// (default: SQLite in a temporary file).
    #[arg(long, env = "RELIQ_DATABASE_URL")]
    database_url: Option<String>,
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
    let run = MessageId::generate();
    let topic = args
        .topic
        .clone()
        .unwrap_or_else(|| format!("orders-{run}"));

    // The database: a temporary SQLite file, or a fresh schema on PostgreSQL.
    let temp = tempfile::tempdir()?;
    let (url, schema) = match &args.database_url {
        Some(url) if url.starts_with("postgres") => (
            url.clone(),
            Some(format!("orders_{}", run.as_str().replace('-', "_"))),
        ),
        Some(url) => (url.clone(), None),
        None => (
            format!("sqlite://{}", temp.path().join("orders.db").display()),
            None,
        ),
    };
    let db = Db::open(&url, schema.as_deref()).await?;
    let outcome = run_orders(&args, &db, &topic).await;
    db.close().await;
    if let Some(schema) = &schema {
        Db::drop_schema(&url, schema).await?;
    }
    outcome
}

async fn run_orders(args: &Args, db: &Db, topic: &str) -> anyhow::Result<()> {
    db.setup().await?;
    let broker = reliq::connect(&args.url)
        .await
        .with_context(|| format!("connecting to {}", args.url))?;

    let handler_db = db.clone();
    let consumer = orders::consumer(broker.clone(), topic, db)
        .start(move |d: Delivery| {
            let db = handler_db.clone();
            async move { db.reserve(CONSUMER, &d).await }
        })
        .await?;
    let relay = db.relay(broker.clone())?;

    // The orders service: every order and its event in one transaction; the relay
    // publishes. An order published twice stands for a relay that died between the
    // broker's confirm and marking the row sent: its second copy goes out directly.
    let stream = orders::orders(args.orders)?;
    let expected = Expected::of(&stream);
    let published: HashSet<MessageId> = stream.iter().map(|o| o.message.id().clone()).collect();
    let messages: Vec<_> = stream.iter().map(|o| o.message.clone()).collect();
    let destination = orders::destination(topic);
    db.place(&destination, &messages).await?;
    for order in stream.iter().filter(|o| o.copies > 1) {
        for _ in 1..order.copies {
            broker.publish(&destination, order.message.clone()).await?;
        }
    }

    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_secs);
    loop {
        let s = consumer.stats();
        let reserved = db.reserved_orders().await?;
        if reserved >= expected.valid.len() as u64
            && s.dead_lettered >= expected.dead.len() as u64
            && s.in_flight == 0
            && db.unsent().await? == 0
        {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            eprintln!("timed out waiting: reserved {reserved}, {s:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the duplicate copies drain too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.shutdown().await;
    let report = consumer.shutdown().await;

    let dead: HashSet<MessageId> = orders::dead_letters(&broker, &orders::subscription(topic))
        .await?
        .into_keys()
        .collect();
    let rows = db.reservations().await?;
    let reserved: HashSet<MessageId> = published
        .iter()
        .filter(|id| rows.contains_key(id.as_str()))
        .cloned()
        .collect();
    let twice = rows.values().filter(|n| **n > 1).count();
    if twice > 0 {
        bail!("{twice} orders were reserved more than once");
    }
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
