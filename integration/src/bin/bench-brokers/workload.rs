//! What both sides do alike: the payload, the confirmed-publish window, the settling
//! after a fill, and the raw forwarding loop.

use std::future::Future;
use std::time::Instant;

use anyhow::{Context, ensure};
use futures::StreamExt;
use futures::stream::FuturesOrdered;

use crate::measure::{Rate, cpu_time};
use crate::{IN_FLIGHT, PREFETCH};

pub fn payload(i: usize) -> Vec<u8> {
    format!("{{\"n\":{i},\"pad\":\"{}\"}}", "x".repeat(100)).into_bytes()
}

/// Time `n` confirmed publishes, [`IN_FLIGHT`] outstanding at a time: `publish(i)` is
/// the i-th publish, resolving once the broker confirmed it. Every side of every broker
/// publishes through this, so they differ only in the client calls.
pub async fn publish_window<F, Fut>(n: usize, publish: F) -> anyhow::Result<Rate>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    publish_window_of(n, IN_FLIGHT, publish).await
}

/// After a fill, before a timed consume: flush the fill's dirty pages (`sync`), so the
/// kernel's writeback of the broker's log — ~0.6 GB a round at 1 M records — does not
/// land in the middle of the next measurement on one side or the other.
pub async fn settle_after_fill() -> anyhow::Result<()> {
    let status = tokio::process::Command::new("sync").status().await?;
    ensure!(status.success(), "sync failed: {status}");
    Ok(())
}

/// [`publish_window`] with `window` publishes outstanding.
pub async fn publish_window_of<F, Fut>(
    n: usize,
    window: usize,
    mut publish: F,
) -> anyhow::Result<Rate>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let (t0, cpu0) = (Instant::now(), cpu_time());
    let mut pending = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        if pending.len() >= window
            && let Some(r) = pending.next().await
        {
            r?;
        }
        pending.push(publish(i));
    }
    while let Some(r) = pending.next().await {
        r?;
    }
    Ok(Rate::since(n, t0, cpu0))
}

/// Drive a raw forwarding loop: take the next message while fewer than [`PREFETCH`] are
/// in flight, start its `forward` (publish, confirm, ack), and hand each finished one, in
/// the order received, to `done`; timed from the first message to the n-th finished.
pub async fn forward_loop<T, C, Fut>(
    n: usize,
    mut messages: impl futures::Stream<Item = anyhow::Result<T>> + Unpin,
    mut forward: impl FnMut(T) -> Fut,
    mut done: impl FnMut(C) -> anyhow::Result<()>,
) -> anyhow::Result<Rate>
where
    Fut: Future<Output = anyhow::Result<C>>,
{
    let cpu0 = cpu_time();
    let (mut received, mut finished, mut t0) = (0usize, 0usize, None);
    let mut in_flight = FuturesOrdered::new();
    while finished < n {
        tokio::select! {
            Some(r) = in_flight.next(), if !in_flight.is_empty() => {
                done(r?)?;
                finished += 1;
            }
            m = messages.next(), if received < n && in_flight.len() < PREFETCH as usize => {
                let m = m.context("the consumer ended")??;
                t0.get_or_insert_with(Instant::now);
                received += 1;
                in_flight.push_back(forward(m));
            }
        }
    }
    Ok(Rate::since(n, t0.context("no delivery")?, cpu0))
}
