//! Connection settings.

#[cfg(feature = "test-util")]
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "test-util")]
use reliq_core::seam::Faults;

/// What to do when a durable consumer already exists with a different configuration
/// (for example an unlimited `max_deliver` left by another tool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExistingConsumer {
    /// Fail at startup, naming the differing settings (the default).
    #[default]
    Error,
    /// Log a warning and update the consumer to reliq's configuration.
    Update,
}

/// Settings of a NATS connection.
#[derive(Clone, Debug)]
pub struct NatsOptions {
    /// How long to wait for a `PubAck`.
    pub publish_timeout: Duration,
    /// Confirm acks with the server (double ack). Slower, but an ack that is lost on the
    /// way cannot silently turn into a redelivery.
    pub confirm_acks: bool,
    /// Policy for an existing consumer with a different configuration.
    pub existing_consumer: ExistingConsumer,
    /// Room on the server for deliveries *released* with a delay (a shutdown or a settle
    /// back-off: `NakWithDelay`, which JetStream counts against `max_ack_pending` until it
    /// redelivers them); the consumer's `max_ack_pending` is `prefetch + retry_headroom`.
    /// Retries do not need it: they wait as scheduled messages outside the consumer's
    /// in-flight window, however many there are. What this process holds stays bounded by
    /// `prefetch` (demand-driven pulls).
    pub retry_headroom: u32,
    /// Replicas of the streams reliq creates (source and DLQ): 1 on a single server, 3 on
    /// a three-node cluster so a stream survives the loss of a node (its consumers move
    /// with it). An existing stream keeps its own. URL: `?reliq.replicas=3`.
    pub replicas: usize,
    /// Fault injection for tests (see [`Faults`]; feature `test-util`).
    #[cfg(feature = "test-util")]
    pub faults: Option<Arc<Faults>>,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            publish_timeout: Duration::from_secs(10),
            confirm_acks: true,
            existing_consumer: ExistingConsumer::Error,
            retry_headroom: 1000,
            replicas: 1,
            #[cfg(feature = "test-util")]
            faults: None,
        }
    }
}
