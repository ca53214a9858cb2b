//! The crate's error type, and the conversion of client errors into reliq's: each keeps
//! the client's error as its source and says what was being done.

use std::time::Duration;

use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use reliq_core::BrokerError;

/// Errors of the Kafka backend (converted to [`BrokerError`] at the seam).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// A setting or the URL is invalid; names it.
    #[error("invalid Kafka setting `{field}`: {reason}")]
    Config {
        /// The setting or URL part.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The Kafka client failed.
    #[error("kafka client: {0}")]
    Client(#[from] RdError),
    /// Creating, deleting or looking up a topic failed.
    #[error("kafka admin on `{topic}`: {reason}")]
    Admin {
        /// The topic.
        topic: String,
        /// What was being done, and what the broker said.
        reason: String,
        /// The broker's error code or the client's error, if there was one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The cluster refused the connection (TLS, SASL, protocol): see `refusals`.
    #[error(transparent)]
    Refused(Box<BrokerError>),
}

impl From<KafkaError> for BrokerError {
    fn from(e: KafkaError) -> Self {
        match e {
            KafkaError::Config { field, reason } => BrokerError::Config { field, reason },
            KafkaError::Client(e) => client_error(e, "using the Kafka client for", "kafka"),
            KafkaError::Refused(e) => *e,
            KafkaError::Admin {
                topic,
                reason,
                source: Some(code),
            } if code
                .downcast_ref::<RDKafkaErrorCode>()
                .is_some_and(|c| authorization_resource(*c).is_some()) =>
            {
                let kind = code
                    .downcast_ref::<RDKafkaErrorCode>()
                    .and_then(|c| authorization_resource(*c))
                    .unwrap_or("topic");
                BrokerError::Unauthorized {
                    resource: format!("{kind} {topic}"),
                    reason,
                    source: Some(code),
                }
            }
            other => BrokerError::Other(Box::new(other)),
        }
    }
}

/// The kind of resource an authorization error code is about (`topic`, `group`,
/// `cluster`, `transactional id`), or `None` when it is no authorization error.
pub(crate) fn authorization_resource(code: RDKafkaErrorCode) -> Option<&'static str> {
    match code {
        RDKafkaErrorCode::TopicAuthorizationFailed => Some("topic"),
        RDKafkaErrorCode::GroupAuthorizationFailed => Some("group"),
        RDKafkaErrorCode::ClusterAuthorizationFailed => Some("cluster"),
        RDKafkaErrorCode::TransactionalIdAuthorizationFailed => Some("transactional id"),
        _ => None,
    }
}

/// Map a client error to the seam's error, keeping it as the source; `doing` and `topic`
/// say what failed (`producing to`, `orders.billing.dlq`).
pub(crate) fn client_error(e: RdError, doing: &str, topic: &str) -> BrokerError {
    if let Some(kind) = e.rdkafka_error_code().and_then(authorization_resource) {
        // Only a topic is named by the caller; a group or the cluster by its kind.
        let resource = if kind == "topic" {
            format!("topic {topic}")
        } else {
            kind.to_owned()
        };
        return BrokerError::Unauthorized {
            resource,
            reason: format!("{doing} {topic}: {e}"),
            source: Some(Box::new(e)),
        };
    }
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
            | RDKafkaErrorCode::UnknownPartition,
        ) => BrokerError::Unroutable(topic.to_owned()),
        Some(RDKafkaErrorCode::MessageTimedOut | RDKafkaErrorCode::RequestTimedOut) => {
            BrokerError::Timeout(Duration::ZERO)
        }
        Some(RDKafkaErrorCode::QueueFull) => BrokerError::rejected(format!(
            "{doing} {topic}: producer buffer full (queue.buffering.max.messages)"
        ))
        .caused_by(e),
        Some(
            RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::Resolve,
        ) => BrokerError::connection(format!("{doing} {topic}: {e}")).caused_by(e),
        _ => BrokerError::Other(Box::new(KafkaError::Client(e))),
    }
}

/// An error librdkafka recovers from by itself while a broker is lost or a leader is
/// being elected (it reconnects, refreshes the metadata and asks the new leader): a
/// request that met one is worth making again shortly, within its caller's deadline.
pub(crate) fn passes_with_an_election(e: &RdError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::DestroyBroker
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::NotCoordinator
                | RDKafkaErrorCode::CoordinatorLoadInProgress
                | RDKafkaErrorCode::CoordinatorNotAvailable
        )
    )
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn a_lost_node_or_an_election_is_waited_through_and_a_refusal_is_not() {
        for code in [
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::DestroyBroker,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::AllBrokersDown,
        ] {
            assert!(
                passes_with_an_election(&RdError::MessageConsumption(code)),
                "{code:?}"
            );
        }
        for code in [
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::InvalidConfig,
            RDKafkaErrorCode::MessageSizeTooLarge,
        ] {
            assert!(
                !passes_with_an_election(&RdError::MessageConsumption(code)),
                "{code:?}"
            );
        }
    }

    #[test]
    fn client_errors_keep_their_cause_and_say_what_was_done() {
        let down = RdError::MessageProduction(RDKafkaErrorCode::AllBrokersDown);
        let e = client_error(down, "producing to", "orders");
        assert!(
            matches!(&e, BrokerError::Connection { context, .. }
            if context.starts_with("producing to orders: ")),
            "{e:?}"
        );
        assert!(
            e.source()
                .and_then(|s| s.downcast_ref::<RdError>())
                .is_some_and(|s| s.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown)),
            "{e:?}"
        );
        let full = RdError::MessageProduction(RDKafkaErrorCode::QueueFull);
        let e = client_error(full, "producing to", "orders");
        assert!(
            matches!(
                &e,
                BrokerError::Rejected {
                    source: Some(_),
                    ..
                }
            ),
            "{e:?}"
        );
        let denied = RdError::MessageProduction(RDKafkaErrorCode::TopicAuthorizationFailed);
        let e = client_error(denied, "producing to", "orders");
        assert!(
            matches!(&e, BrokerError::Unauthorized { resource, .. } if resource == "topic orders"),
            "{e:?}"
        );
        let admin = KafkaError::Admin {
            topic: "orders.billing.dlq".into(),
            reason: "creating the topic: Broker: Topic authorization failed".into(),
            source: Some(Box::new(RDKafkaErrorCode::TopicAuthorizationFailed)),
        };
        assert!(
            matches!(BrokerError::from(admin), BrokerError::Unauthorized { resource, .. } if resource == "topic orders.billing.dlq")
        );
        let gone = RdError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition);
        assert!(
            matches!(client_error(gone, "producing to", "orders"), BrokerError::Unroutable(t) if t == "orders")
        );
    }
}
