//! [`ConsumerError`]: what starting or running a consumer can fail with.

use crate::error::BrokerError;
use crate::retry::PolicyError;

/// Errors of the consumer builder and runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// A setting is invalid; names it.
    #[error("invalid consumer setting `{field}`: {reason}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The retry policy is invalid.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The broker refused the subscription.
    #[error("subscribing failed: {0}")]
    Subscribe(#[source] BrokerError),
    /// The start-up topology check ([`StartupCheck::Refuse`](crate::topology::StartupCheck::Refuse))
    /// found a difference that breaks delivery guarantees; the report names each.
    #[error("the broker's topology breaks this consumer's guarantees: {0}")]
    Topology(Box<crate::topology::TopologyReport>),
    /// The start-up topology check ([`StartupCheck::Refuse`](crate::topology::StartupCheck::Refuse))
    /// could not read the broker.
    #[error("checking the topology failed: {0}")]
    TopologyCheck(#[source] BrokerError),
    /// The broker could not plan the consumer's topology (for its AsyncAPI document).
    #[error("planning the topology failed: {0}")]
    Plan(#[source] BrokerError),
    /// The start-up schema check ([`ConsumerBuilder::check_schema`](crate::ConsumerBuilder::check_schema)
    /// with [`StartupCheck::Refuse`](crate::topology::StartupCheck::Refuse)) found that what
    /// the producers write cannot be read as the handler's type; says why.
    #[error("the producers' schema for `{topic}` cannot be read by this consumer: {reason}")]
    Schema {
        /// The consumer's source.
        topic: String,
        /// The codec's reason (the registry's answer).
        reason: String,
    },
    /// The start-up schema check ([`StartupCheck::Refuse`](crate::topology::StartupCheck::Refuse))
    /// could not ask the registry.
    #[error("checking the schema failed: {0}")]
    SchemaCheck(#[source] crate::classify::CodecError),
}
