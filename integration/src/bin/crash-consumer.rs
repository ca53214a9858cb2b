//! The orders service's inventory consumer as a child process of the crash harness
//! (`reliq_integration::crash`): it consumes until its stdin closes (then shuts down
//! gracefully) or until it is killed.
//!
//! ```text
//! crash-consumer --backend rabbit|kafka|nats|sqs --db URL [--schema S] --topic T
//!                [--group-prefix P] [--crash-after-commit K]
//! ```
//!
//! It reports on stdout, one line each (see `crash::Event`): `ready`, `duplicate <id>`,
//! `stats …` every 200 ms, and with `--crash-after-commit K`, `commit-ack <id>` after
//! the K-th committed reservation, whose handler then never returns: the delivery is not
//! acknowledged, and the harness sends SIGKILL.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use reliq_examples::orders::Db;
use reliq_integration::crash::{self, Backend, Emit, Event};
use reliq_integration::settings;
use tokio::io::AsyncReadExt;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // reliq's own crates at error level (a run's faults make many warnings);
                // the example's and the harness's warnings (waiting for the database or
                // the broker at startup) are shown. A target matches by prefix: the
                // longer directives win over `reliq`.
                .unwrap_or_else(|_| {
                    "warn,reliq=error,reliq_examples=warn,reliq_integration=warn".into()
                }),
        )
        .with_writer(std::io::stderr)
        .init();
    let need = |name: &str| settings::arg(name).with_context(|| format!("{name} is required"));
    let backend = Backend::parse(&need("--backend")?)?;
    let topic = need("--topic")?;
    let db_url = need("--db")?;
    let crash_after_commit = settings::arg("--crash-after-commit")
        .map(|k| k.parse::<u64>())
        .transpose()
        .context("--crash-after-commit takes a number")?;
    let group_prefix = settings::arg("--group-prefix").unwrap_or_default();

    let broker = crash::connect_through_outages(backend, &group_prefix).await?;
    let db = Db::open(&db_url, settings::arg("--schema").as_deref()).await?;
    let emit: Emit = Arc::new(|e: Event| println!("{}", e.line()));
    // What the driver reads this process's clock skew from.
    emit(Event::Clock(reliq_integration::skew::unix_ms_now()));
    let consumer = crash::consumer(broker, &topic, &db)
        .start(crash::handler(db.clone(), crash_after_commit, emit.clone()))
        .await?;
    emit(Event::Ready);

    let mut stdin_closed = tokio::spawn(async {
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    });
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = tick.tick() => emit(Event::Stats(consumer.stats())),
            _ = &mut stdin_closed => break,
        }
    }
    let report = consumer.shutdown().await;
    emit(Event::Stats(report.stats));
    db.close().await;
    Ok(())
}
