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
//! `--metrics-listen 127.0.0.1:9464` serves its metrics for Prometheus (how an
//! application exposes its own: [`reliq_examples::metrics::serve`]). `--db-outage 10`
//! takes the inventory database down for the first 10 s: the consumer's circuit breaker
//! opens and consumption pauses at the broker, and the summary line adds
//! `outage_failures=F outage_dead_lettered=0`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use reliq::MessageId;
use reliq_examples::orders::{self, Db};

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
    /// Serve Prometheus metrics at http://ADDR/metrics (reliq's counters and the
    /// consumer's broker-side gauges).
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// With --metrics-listen: keep serving this long after the summary line.
    #[arg(long, default_value_t = 0)]
    linger_secs: u64,
    /// The inventory database is down for the first SECS of the run: the handler fails
    /// transiently, the circuit breaker opens and consumption pauses at the broker; the
    /// summary adds `outage_failures` and `outage_dead_lettered` (0: nothing was
    /// dead-lettered because of the outage).
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    db_outage: u64,
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
    let broker = reliq::connect(&args.url)
        .await
        .with_context(|| format!("connecting to {}", args.url))?;
    // The broker-side gauges (lag, retries waiting per tier, DLQ depth and age) of the
    // inventory consumer, read every second while the service runs and once at the end.
    let gauges = match args.metrics_listen {
        Some(addr) => {
            reliq_examples::metrics::serve(addr)?;
            eprintln!("metrics: http://{addr}/metrics");
            let subscription = orders::consumer(broker.clone(), topic, db).subscription()?;
            Some(Arc::new(
                reliq::BacklogGauges::new(broker.clone(), [subscription])
                    .every(Duration::from_secs(1)),
            ))
        }
        None => None,
    };
    let stop = tokio_util::sync::CancellationToken::new();
    if let Some(g) = &gauges {
        let (g, stop) = (g.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => { g.poll().await; }
                }
            }
        });
    }
    let summary = orders::run_with_outage(
        broker,
        db,
        topic,
        args.orders,
        Duration::from_secs(args.timeout_secs),
        Duration::from_secs(args.db_outage),
    )
    .await;
    stop.cancel();
    let summary = summary?;
    if let Some(g) = &gauges {
        g.poll().await;
    }
    println!("{summary}");
    if summary.lost > 0 {
        bail!("{} orders were lost", summary.lost);
    }
    if summary.outage_dead_lettered > 0 {
        bail!(
            "{} orders were dead-lettered because of the database outage",
            summary.outage_dead_lettered
        );
    }
    if args.linger_secs > 0 {
        // Keep /metrics up for a last scrape.
        tokio::time::sleep(Duration::from_secs(args.linger_secs)).await;
    }
    Ok(())
}
