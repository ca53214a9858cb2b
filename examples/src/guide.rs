//! The Rust code the guide shows (README.md and `docs/`), compiled: each ```rust block
//! there is preceded by `<!-- source: examples/src/guide.rs#NAME -->` and is a verbatim
//! copy of the region between `// guide:NAME` and `// guide:end` below (indentation
//! aside). `scripts/docs-check` fails when a block and its region differ, so the guide
//! shows only code that builds against the current API; the test at the end runs the
//! quick start on the embedded broker.

use std::sync::Arc;
use std::time::Duration;

use reliq::{
    Batch, BatchError, BoxError, CircuitBreaker, Classifier, Consumer, ConsumerHandle, Delivery,
    ErrorClass, Inbox, MessageId, RetryPolicy,
};

/// The event the guide's consumers read.
#[derive(Debug, serde::Deserialize)]
pub struct OrderCreated {
    /// The article.
    pub sku: String,
    /// How many.
    pub qty: u32,
}

/// A database's "deadlock detected", which a retry usually gets past.
#[derive(Debug, thiserror::Error)]
#[error("deadlock detected")]
pub struct Deadlock;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn mins(n: u64) -> Duration {
    Duration::from_secs(60 * n)
}

async fn reserve(_id: &MessageId, order: &OrderCreated) -> Result<(), BoxError> {
    tracing::debug!(sku = %order.sku, qty = order.qty, "reserved");
    Ok(())
}

async fn bulk_insert(rows: &[OrderCreated]) -> Result<(), sqlx::Error> {
    tracing::debug!(rows = rows.len(), "inserted");
    Ok(())
}

/// README.md and docs/consumers.md, "A consumer".
#[rustfmt::skip]
pub async fn quick_start(url: &str, inbox: Arc<dyn Inbox>) -> Result<ConsumerHandle, BoxError> {
    let url = url.to_owned();
    // guide:consumer
    let broker = reliq::connect(&url).await?;           // memory://, amqp://, kafka://, nats://, sqs://
    let consumer = reliq::Consumer::builder(broker, "inventory")
        .subscribe("orders").filter("order.created")
        .retry(RetryPolicy::tiers([secs(5), secs(30), mins(5)]).max_age(mins(15)).jitter(0.2))
        .max_in_flight(64)
        .inbox(inbox)
        .start(|d: Delivery| async move {
            let order: OrderCreated = d.json()?;        // undecodable ⇒ poison ⇒ DLQ at once
            reserve(d.id(), &order).await?;              // the error's type decides: retry or park
            Ok(())
        })
        .await?;
    // guide:end
    Ok(consumer)
}

/// docs/consumers.md, "Classifying errors".
#[rustfmt::skip]
pub fn classifier() -> Classifier {
    // guide:classifier
    let classifier = Classifier::default().on::<Deadlock>(|_| ErrorClass::Transient);
    // guide:end
    classifier
}

/// docs/consumers.md, "A circuit breaker".
#[rustfmt::skip]
pub fn circuit_breaker(broker: Arc<dyn reliq::Broker>) -> CircuitBreaker {
    // guide:circuit-breaker
    let db = CircuitBreaker::new("inventory-db")
        .failure_ratio(0.5)          // half of the outcomes in the window…
        .minimum_calls(20)           // …of at least 20…
        .window(Duration::from_secs(10))
        .cool_down(Duration::from_secs(5))
        .probes(3)
        .counting(|e| e.is::<sqlx::Error>()); // the database's errors, not the warehouse's
    Consumer::builder(broker, "inventory").subscribe("orders").circuit_breaker(db.clone());
    // guide:end
    db
}

/// docs/consumers.md, "Batch handlers".
#[rustfmt::skip]
pub async fn batch_handler(broker: Arc<dyn reliq::Broker>) -> Result<ConsumerHandle, BoxError> {
    let handle =
    // guide:batch
    Consumer::builder(broker, "indexer")
        .subscribe("orders")
        .batch_size(256)
        .start_batch(|batch: Batch| async move {
            let mut failed = BatchError::new();
            let mut rows = Vec::new();
            for (i, d) in batch.iter().enumerate() {
                match d.json::<OrderCreated>() {
                    Ok(order) => rows.push(order),
                    Err(e) => failed.fail(i, e),          // poison: this one to the DLQ
                }
            }
            bulk_insert(&rows).await?;                   // an error here fails (retries) the batch
            failed.into_result()
        })
        .await?;
    // guide:end
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guides_classifier_retries_a_deadlock() {
        let err: BoxError = Box::new(Deadlock);
        assert_eq!(classifier().classify(err.as_ref()), ErrorClass::Transient);
        let other: BoxError = "no such order".into();
        assert_ne!(classifier().classify(other.as_ref()), ErrorClass::Transient);
    }

    #[tokio::test]
    async fn the_quick_start_runs_on_the_embedded_broker() {
        let inbox: Arc<dyn Inbox> = Arc::new(reliq::MemoryInbox::new());
        let consumer = quick_start("memory://guide", inbox).await.expect("starts");
        let report = consumer.shutdown().await;
        assert!(report.drained, "{report:?}");
    }
}
