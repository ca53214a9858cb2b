//! A consumer's backlog read from RabbitMQ: the ready count of its queue and of each
//! retry (TTL) queue from a passive `queue.declare` (live, over AMQP), and the consumer
//! queue's unacknowledged count from the management API when there is one (AMQP does not
//! say it; the API's counters trail by its statistics interval, 5 s by default).

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use reliq_core::{Backlog, BrokerError, Subscription, TierBacklog};

use crate::client::Inner;
use crate::error::RabbitError;
use crate::error::reply_code;
use crate::names::{Names, short};

/// `sub`'s backlog (see the module docs).
pub(crate) async fn backlog(inner: &Inner, sub: &Subscription) -> Result<Backlog, BrokerError> {
    let names = Names::of(sub);
    let waiting = ready(inner, &names.queue).await?;
    let mut tiers = Vec::with_capacity(names.retry.len());
    for (delay, queue) in &names.retry {
        tiers.push(TierBacklog {
            delay: *delay,
            waiting: ready(inner, queue).await?,
        });
    }
    let in_flight = match &inner.management {
        Some(api) => {
            let stats = api.queue(&inner.vhost(), &names.queue).await?;
            // Absent until the statistics collector has seen the queue once.
            Some(stats["messages_unacknowledged"].as_u64().unwrap_or(0))
        }
        None => None,
    };
    Ok(Backlog::waiting(waiting)
        .with_in_flight(in_flight)
        .with_tiers(tiers))
}

/// The ready messages of `queue` (passive declare: a missing queue is an error, and
/// closes only the short-lived channel it was asked on).
async fn ready(inner: &Inner, queue: &str) -> Result<u64, BrokerError> {
    message_count(inner, queue).await?.ok_or_else(|| {
        BrokerError::Unroutable(format!(
            "queue `{queue}` does not exist (subscribe once to declare it)"
        ))
    })
}

/// The ready messages of `queue` now, `None` when it does not exist (a passive declare:
/// exact, unlike the management API's counters; a 404 closes only the short-lived
/// channel it was asked on).
pub(crate) async fn message_count(inner: &Inner, queue: &str) -> Result<Option<u64>, BrokerError> {
    let ch = inner.channel().await?;
    let declared = ch
        .queue_declare(
            short("queue", queue)?,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(d) => {
            let _ = ch.close(200, "ok".into()).await;
            Ok(Some(u64::from(d.message_count())))
        }
        Err(e) if reply_code(&e) == Some(404) => Ok(None),
        Err(e) => Err(RabbitError::client("reading a queue's depth", e)),
    }
}
