//! A typed consumer and publisher of Avro orders through the schema registry, on the
//! embedded broker. Needs the registry `scripts/brokers up` starts:
//!
//! ```sh
//! RELIQ_SCHEMA_REGISTRY_URL=http://127.0.0.1:8081/apis/ccompat/v7 \
//!   cargo run -p reliq-contracts --features avro --example typed_orders
//! ```

use std::sync::Arc;
use std::time::Duration;

use reliq_contracts::{Avro, RegistryCodec, SchemaRegistry, SubjectStrategy};
use reliq_core::{BoxError, Consumer, Delivery, Destination, StartupCheck, TypedPublisher};

// guide:typed-avro
/// The event as the producers and consumers of `orders` agree on it; the registry keeps
/// its schema under the subject `orders-value`.
#[derive(Debug, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
#[avro(namespace = "shop")]
struct OrderCreated {
    order: String,
    cents: i64,
}

async fn run(broker: Arc<dyn reliq_core::Broker>, registry_url: &str) -> Result<(), BoxError> {
    let registry = Arc::new(SchemaRegistry::new(registry_url)?);
    let codec = || {
        RegistryCodec::new(Avro::<OrderCreated>::new(), registry.clone())
            .subject_strategy(SubjectStrategy::TopicName)
    };
    let consumer = Consumer::builder(broker.clone(), "billing")
        .subscribe("orders")
        // Refuse to start when this type cannot read what the registry holds for the topic.
        .check_schema(StartupCheck::Refuse)
        .start_typed(codec(), |order: OrderCreated, d: Delivery| async move {
            println!("{} ({}): {} cents", order.order, d.id(), order.cents);
            Ok::<(), BoxError>(())
        })
        .await?;

    let orders = TypedPublisher::new(broker, Destination::new("orders"), codec());
    orders
        .publish(&OrderCreated {
            order: "o-1".into(),
            cents: 1250,
        })
        .await?;
    // guide:end
    while consumer.stats().processed == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    consumer.shutdown().await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("RELIQ_SCHEMA_REGISTRY_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:8081/apis/ccompat/v7".into());
    let broker: Arc<dyn reliq_core::Broker> = Arc::new(reliq_memory::MemoryBroker::new());
    run(broker, &url).await
}
