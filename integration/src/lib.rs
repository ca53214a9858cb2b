//! Backend factories for the conformance suite, and connection settings shared by the
//! integration tests (read from `brokers.env`, overridable by environment variables).

pub mod aws_env;
pub mod crash;
pub mod kafka;
pub mod memory;
pub mod nats;
pub mod packet_loss;
pub mod proxy;
pub mod rabbit;
pub mod secure;
pub mod settings;
pub mod skew;
pub mod sqs;
pub mod stores;

use std::sync::Arc;

/// A plain connection (default options) to the backend named `memory | rabbit | kafka |
/// nats | sqs`, at its URL from [`settings`]: what the benchmarks measure.
pub async fn connect_by_name(broker: &str) -> anyhow::Result<Arc<dyn reliq_core::Broker>> {
    Ok(match broker {
        "memory" => Arc::new(reliq_memory::MemoryBroker::new()),
        "rabbit" => {
            Arc::new(reliq_rabbit::RabbitBroker::connect(&settings::get("RELIQ_RABBIT_URL")).await?)
        }
        "nats" => {
            Arc::new(reliq_nats::NatsBroker::connect(&settings::get("RELIQ_NATS_URL")).await?)
        }
        "kafka" => Arc::new(reliq_kafka::KafkaBroker::connect(&settings::get(
            "RELIQ_KAFKA_URL",
        ))?),
        "sqs" => Arc::new(reliq_sqs::SqsBroker::connect(&settings::get("RELIQ_SQS_URL")).await?),
        other => anyhow::bail!("--broker memory|rabbit|nats|kafka|sqs, not {other}"),
    })
}
