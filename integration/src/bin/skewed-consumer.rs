//! A consumer whose handler fails each message's first attempt (transient) and takes the
//! retry, for the clock-skew tests (`integration/tests/clock_skew.rs`), which run it
//! with its wall clock minutes off (`integration/skew/skew_clock.c` preloaded).
//!
//! ```text
//! skewed-consumer --backend rabbit|kafka|nats|sqs --topic T --group-prefix P --delay-ms D
//! ```
//!
//! Prints on stdout, one line each: `clock <ms since the epoch>` (its wall clock as it
//! sees it), `ready`, and `call <id> <attempt>` as each handler call starts. It consumes
//! until its stdin closes, then shuts down gracefully.

use std::time::Duration;

use anyhow::Context;
use reliq_core::{BoxError, Consumer, Delivery, RetryPolicy, Transient};
use reliq_integration::crash::{self, Backend};
use reliq_integration::settings;
use tokio::io::AsyncReadExt;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let need = |name: &str| settings::arg(name).with_context(|| format!("{name} is required"));
    let backend = Backend::parse(&need("--backend")?)?;
    let topic = need("--topic")?;
    let group_prefix = settings::arg("--group-prefix").unwrap_or_default();
    let delay = Duration::from_millis(
        need("--delay-ms")?
            .parse()
            .context("--delay-ms takes a number")?,
    );
    println!("clock {}", reliq_integration::skew::unix_ms_now());

    let broker = crash::connect(backend, &group_prefix).await?;
    let consumer = Consumer::builder(broker, "skewed")
        .subscribe(&topic)
        .retry(RetryPolicy::tiers([delay]).jitter(0.0))
        .start(|d: Delivery| async move {
            println!("call {} {}", d.id(), d.attempt());
            if d.attempt() == 1 {
                return Err::<(), BoxError>(Transient::msg("first attempt fails").into());
            }
            Ok(())
        })
        .await?;
    println!("ready");

    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    let report = consumer.shutdown().await;
    eprintln!("skewed-consumer: {:?}", report.stats);
    Ok(())
}
