//! The names reliq records metrics and spans under: what dashboards and alert rules use.
//!
//! # Spans
//!
//! After OpenTelemetry's messaging semantic conventions, [`SEMCONV_VERSION`] (messaging is
//! still "development" there: the names may change, and reliq pins the version it
//! follows). `tracing` spans whose fields `tracing-opentelemetry` turns into the span's
//! name (`otel.name`), kind (`otel.kind`) and attributes:
//!
//! | span | kind | when |
//! |---|---|---|
//! | `send <destination>` | producer | each publish through a [`MeteredBroker`](crate::metered::MeteredBroker) |
//! | `process <source>` | consumer | each delivery handled (child of the message's `traceparent` with the `otel` feature) |
//! | `settle <source>` | client | a retry, a dead-lettering, a release (inside `process`), a group of acks |
//! | `process <source>` (batch) | consumer | each batch-handler call, `messaging.batch.message_count` |
//!
//! Attributes: `messaging.system` ([`messaging_system`]: `kafka`, `rabbitmq`, `aws_sqs`,
//! and reliq's own values `nats` and `reliq_memory`), `messaging.destination.name`,
//! `messaging.consumer.group.name`, `messaging.message.id`, `messaging.operation.type`
//! (`send`, `process`, `settle`), `messaging.operation.name` (`send`, `process`, `ack`,
//! `retry`, `dead_letter`, `release`), `error.type` (the error class, or the
//! [`BrokerError::kind`](crate::error::BrokerError::kind) of a failed publish); reliq's own under
//! `reliq.*`: `reliq.attempt`, `reliq.decision` (`ack`, `retry`, `dead_letter`,
//! `discard`, `duplicate`, `release`), `reliq.error.class`, `reliq.dead_letter.reason`.
//! The process span also records the `traceparent`'s ids as `trace_id` and
//! `parent_span_id`, for logs read without OpenTelemetry.
//!
//! All metrics carry a `consumer` label. Names:
//!
//! | name | type | extra labels |
//! |---|---|---|
//! | `reliq_messages_received_total` | counter | |
//! | `reliq_messages_processed_total` | counter | |
//! | `reliq_messages_retried_total` | counter | `class` |
//! | `reliq_messages_dead_lettered_total` | counter | `reason` |
//! | `reliq_messages_discarded_total` | counter | `reason` |
//! | `reliq_messages_duplicate_total` | counter | |
//! | `reliq_handler_duration_seconds` | histogram | |
//! | `reliq_batch_size` | histogram | |
//! | `reliq_in_flight` | gauge | |
//! | `reliq_settle_failures_total` | counter | `operation` = `ack\|retry\|dead_letter\|release` (`dead_letter` = DLQ publish failures) |
//! | `reliq_messages_replayed_total` | counter | |
//!
//! `reliq_handler_duration_seconds` has one observation per handler call: per message, or
//! per batch with a batch handler, whose calls also record their size in
//! `reliq_batch_size`.
//!
//! The outbox relay's metrics carry a `relay` label (the relay's name) instead:
//!
//! | name | type |
//! |---|---|
//! | `reliq_outbox_published_total` | counter |
//! | `reliq_outbox_publish_failures_total` | counter |
//! | `reliq_outbox_store_failures_total` | counter |
//! | `reliq_outbox_backlog_rows` | gauge (unsent rows, read from the store every 5 s) |
//! | `reliq_outbox_oldest_age_seconds` | gauge (the oldest unsent row's age) |
//!
//! Publishes through a [`MeteredBroker`](crate::metered::MeteredBroker) (what `reliq::connect`
//! returns) carry `backend` and `destination` (the topic):
//!
//! | name | type | extra labels |
//! |---|---|---|
//! | `reliq_messages_published_total` | counter | |
//! | `reliq_publish_failures_total` | counter | `kind` ([`BrokerError::kind`](crate::error::BrokerError::kind)) |
//! | `reliq_publish_duration_seconds` | histogram | (until the broker's confirm, failures included) |
//!
//! What waits at the broker, read by a [`BacklogGauges`](crate::gauges::BacklogGauges) poller
//! (`reliq admin serve` runs one for its consumers), with `consumer` and `source`:
//!
//! | name | type | extra labels |
//! |---|---|---|
//! | `reliq_consumer_backlog_messages` | gauge | ([`Backlog::waiting`](crate::backlog::Backlog::waiting): Kafka's lag) |
//! | `reliq_consumer_unsettled_messages` | gauge | (delivered, not settled; only where the broker says) |
//! | `reliq_retry_waiting_messages` | gauge | `tier` (the delay, e.g. `30s`; `in_place` where retries wait without tiers) |
//! | `reliq_dlq_messages` | gauge | |
//! | `reliq_dlq_oldest_age_seconds` | gauge | (from the record's `reliq-dead-lettered-at`; 0 when empty) |
//! | `reliq_backlog_last_poll_timestamp_seconds` | gauge | (the last poll that read everything: a stale one means the gauges are old) |
//! | `reliq_backlog_poll_failures_total` | counter | |
//!
//! The topology check ([`TopologyReport::record`](crate::topology::TopologyReport::record):
//! a consumer's start-up check, the poller's check every few polls) sets, with `consumer`
//! and `source`:
//!
//! | name | type | extra labels |
//! |---|---|---|
//! | `reliq_topology_drift` | gauge | `severity` = `breaking\|cosmetic` (differences from the plan) |
//!
//! A [`CircuitBreaker`](crate::breaker::CircuitBreaker) records, with `breaker` (its name):
//!
//! | name | type | extra labels |
//! |---|---|---|
//! | `reliq_circuit_state` | gauge | (0 closed, 1 half-open, 2 open) |
//! | `reliq_circuit_transitions_total` | counter | `to` = `open\|half_open\|closed` |
//!
//! And the Kafka producer's buffer, `reliq_producer_buffer_ratio` (gauge, `backend`): the
//! share of `queue.buffering.max.messages` in use after each publish.

pub use crate::gauges::tier_label;
pub use crate::telemetry::{
    ALL_METRICS, BACKLOG, BACKLOG_LAST_POLL, BACKLOG_POLL_FAILURES, BATCH_SIZE, BATCH_SIZE_BUCKETS,
    CIRCUIT_STATE, CIRCUIT_TRANSITIONS, DEAD_LETTERED, DISCARDED, DLQ_MESSAGES, DLQ_OLDEST_AGE,
    DUPLICATES, DURATION_BUCKETS, HANDLER_DURATION, IN_FLIGHT, OUTBOX_BACKLOG, OUTBOX_OLDEST_AGE,
    OUTBOX_PUBLISH_FAILURES, OUTBOX_PUBLISHED, OUTBOX_STORE_FAILURES, PROCESSED,
    PRODUCER_BUFFER_RATIO, PUBLISH_DURATION, PUBLISH_FAILURES, PUBLISHED, RECEIVED, REPLAYED,
    RETRIED, RETRY_WAITING, SEMCONV_VERSION, SETTLE_FAILURES, TOPOLOGY_DRIFT, UNSETTLED,
    describe_metrics, messaging_system,
};
