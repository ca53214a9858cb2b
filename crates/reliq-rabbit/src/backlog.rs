//! A consumer's backlog read from RabbitMQ: the ready count of its queue and of each
//! retry (TTL) queue from a passive `queue.declare` (live, over AMQP), and the consumer
//! queue's unacknowledged count from the management API when there is one (AMQP does not
//! say it; the API's counters trail by its statistics interval, 5 s by default).

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use reliq_core::{Backlog, BrokerError, Subscription, TierBacklog};

use crate::RabbitError;
use crate::broker::Inner;
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
            let vhost = inner
                .url
                .parse::<lapin::uri::AMQPUri>()
                .map(|u| u.vhost)
                .unwrap_or_else(|_| "/".to_owned());
            let stats = api.queue(&vhost, &names.queue).await?;
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
        .await
        .map_err(|e| {
            if reply_code(&e) == Some(404) {
                BrokerError::Unroutable(format!(
                    "queue `{queue}` does not exist (subscribe once to declare it)"
                ))
            } else {
                RabbitError::client("reading a queue's depth", e)
            }
        })?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(u64::from(declared.message_count()))
}
