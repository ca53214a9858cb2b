//! # reliq-sqs
//!
//! The Amazon SQS backend of reliq: a thin mapping of reliq's seam onto SQS queues.
//!
//! | reliq primitive | SQS |
//! |---|---|
//! | publish (confirmed) | SQS has no topics: `SendMessage` (batched like deletes; the entry's success = confirmed) to **every consumer queue of the topic** — the queues named `<topic>-…` ([`topic_prefix`]) and tagged `reliq-source=<topic>` (+ `reliq-filter` matching the route), found with `ListQueues` and cached briefly ([`SqsOptions::topic_cache_ttl`]); no such queue → [`BrokerError::Unroutable`](reliq_core::BrokerError::Unroutable) |
//! | subscribe | queue `<source>-<consumer>` ([`queue_name`]), declared idempotently: `VisibilityTimeout` = lease, `RedrivePolicy` → the DLQ with `maxReceiveCount` = delivery limit; tags `reliq-source`, `reliq-consumer`, `reliq-filter` |
//! | receive (bounded) | a background long poll (`ReceiveMessage`, ≤ 10, never more than `prefetch − held`), message attributes `All`, `ApproximateReceiveCount`, `SentTimestamp`; a visibility extender (`ChangeMessageVisibility` every lease/3, up to [`SqsOptions::max_lease_extension`]) keeps long handlers leased |
//! | ack | `DeleteMessage`, batched: deletes within [`SqsOptions::batch_window`] go out as one `DeleteMessageBatch`; a failed entry is that ack's error |
//! | retry after d | `ChangeMessageVisibility(d)` (whole seconds, rounded up, ≤ 12 h): the original comes back after `d` |
//! | release | `ChangeMessageVisibility(d or 0)` |
//! | dead-letter | `SendMessage` to the DLQ queue `<source>_<consumer>_dlq` with the record, then `DeleteMessage` |
//! | attempt | `ApproximateReceiveCount` |
//! | crash loop | the `RedrivePolicy`; a message moved by it carries no reliq record, and the dead-letter reader reads it as `max-deliveries` (attempts = the delivery limit, dead-lettered-at = its `SentTimestamp` in the DLQ: SQS records no time of the move) |
//! | dead_letters ([`Broker::dead_letters`](reliq_core::Broker::dead_letters)) | SQS has no non-destructive read, so every call is one **scan**: `ReceiveMessage` of the whole DLQ (long polls of 1 s, ≤ [`SqsOptions::dead_letter_scan_max`] entries) under a short scan lease ([`SqsOptions::dead_letter_lease`]) so the scan sees each message once, then `ChangeMessageVisibilityBatch` to 0 for everything before the call returns — nothing stays hidden between calls, so a concurrent replay or operator and the next page see the whole DLQ (a scan that sees fewer than SQS counts, e.g. colliding with another, rescans for ≤ 2 s). **browse**: pages in the order (`reliq-dead-lettered-at`, SQS message id), the cursor is the last entry's pair (stable, unaffected by removals), `at_end` when no entry is left after the page; each page costs a full scan. **get**: a scan. **remove**: a scan, then `DeleteMessageBatch` of the oldest entry per id with the scan's own receipt handles while its lease still hides them (each entry confirmed), ids not found skipped. **count**: `ApproximateNumberOfMessages + …NotVisible` (approximate, as SQS says) and the oldest `reliq-dead-lettered-at` from a scan of ≤ [`SqsOptions::dead_letter_count_scan_max`] entries (reliq's record, not `SentTimestamp`, which a redrive resets). Not possible on SQS: a read that bumps no `ApproximateReceiveCount` (harmless: the DLQ has no redrive policy, and reliq's attempt lives in its header); order on standard queues (reliq sorts each scan); on FIFO DLQs more than the first 10 entries of a message group at a time (SQS holds the group while they are received). Cancel safe: each call runs in a task of its own, one at a time; a cancelled call's task stops receiving and gives back what it hid before the next call scans. Details: [`SqsDeadLetters`]. |
//! | FIFO ([`SqsOptions::fifo`], URL `fifo=true`) | queues `….fifo`; `MessageGroupId` = the key (keyless: one shared group), `MessageDeduplicationId` = the message id (DLQ copies and replays get unique ones, so SQS never drops them as duplicates); the receiver hands out **one message per group at a time** — SQS returns several of a group in one receive — and when one goes back (retry, release) the group's later messages held here go back too, so SQS delivers the group again in order. A retry therefore holds its group (ordered, in-place retries). |
//! | redrive | the portable replay engine (receive → send → delete, rate-limited) works everywhere; [`SqsBroker::start_message_move_task`] asks SQS for a server-side move and reports whether the endpoint runs it (moto does not) |
//! | backlog | `GetQueueAttributes` of the consumer queue: `ApproximateNumberOfMessages` + `…Delayed` waiting, `…NotVisible` in flight (retries wait there too, so there is no separate retry count) |
//! | plan / inspect | `GetQueueAttributes` and `ListQueueTags` of the consumer queue (`RedrivePolicy` target and `maxReceiveCount`, the routing tags; `VisibilityTimeout` cosmetic) and of the DLQ (`MessageRetentionPeriod`) |
//! | metadata | at most 10 message attributes: reliq's headers, id and key packed into one JSON attribute `reliq`, user headers as attributes while they fit (see [`RELIQ_ATTRIBUTE`] and [`MAX_ATTRIBUTES`]) |
//!
//! Capabilities (documented limitations, see [`reliq_core::Capabilities`]):
//! `attempts_count_every_delivery` (a release or a crash also uses an attempt), publish
//! deduplication only on FIFO queues ([`SqsOptions::fifo`]), exact
//! retry delays (to the second), `send_to_consumer` supported (replay goes to one
//! consumer's queue).
//!
//! **Fan-out.** A real deployment would put an SNS topic in front of the consumer queues;
//! that is out of scope here. The convention above lets any process publish without a
//! registry; a publisher sees a consumer that subscribed in *another* process after at
//! most [`SqsOptions::topic_cache_ttl`]. A publish to several queues that fails part way
//! is reported as an error; a retry by the producer may duplicate the message in the
//! queues that already got it (the inbox absorbs that).
//!
//! **URLs.** `sqs://?region=…` is real AWS; `sqs://host:port?region=…` talks to an
//! endpoint over http (`&tls=true`: https) — an emulator (moto, ElasticMQ, LocalStack) or
//! a VPC endpoint. Options: `region`, `tls`, `fifo`, `profile=<name>` (the shared
//! profile, instead of `AWS_PROFILE`), `sts_endpoint=<url>|aws` (where the credential
//! chain's STS calls go: by default the endpoint's host, else AWS's regional STS),
//! `account=<12 digits>` (the account id of generated IAM policies).
//!
//! **Credentials.** Without keys in the URL, the AWS default credential chain signs
//! every call — environment keys, the shared profile (static keys, `role_arn` with
//! `source_profile` through STS `AssumeRole`), web identity (`AWS_WEB_IDENTITY_TOKEN_FILE`
//! and `AWS_ROLE_ARN`: EKS IRSA), the container endpoint, instance metadata — resolved on
//! the first call and refreshed before they expire; a failure is that call's
//! [`BrokerError::Unauthorized`](reliq_core::BrokerError::Unauthorized) naming the cause
//! (an STS that does not answer: `Connection`). An emulator's plain-http endpoint signs
//! with the placeholder `reliq`/`reliq` when nothing configures the chain; `KEY:SECRET@`
//! in the URL is for emulators only. [`SqsBroker::caller_identity`] asks STS who the
//! credentials are. Secrets are never logged or shown by `Debug`.
//!
//! **Least privilege.** [`Broker::permissions`](reliq_core::Broker::permissions) gives an
//! IAM policy on the exact queue ARNs of the consumers (their queue and DLQ), plus the
//! topic queues a service publishes to and the operator's dead-letter actions.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use reliq_core::{Broker, Destination, Message};
//! let broker: Arc<dyn Broker> =
//!     Arc::new(reliq_sqs::SqsBroker::connect("sqs://127.0.0.1:4566?region=us-east-1").await?);
//! broker.publish(&Destination::new("orders"), Message::new("{}")).await?;
//! # Ok(()) }
//! ```

mod batch;
mod broker;
mod client;
mod codec;
mod credentials;
mod dead_letters;
mod error;
mod names;
mod options;
mod permissions;
mod receiver;
mod topology;

pub use client::{CallerIdentity, SqsBroker};
pub use codec::{BODY_FIELD, KEY_FIELD, MAX_ATTRIBUTES, RELIQ_ATTRIBUTE, ROUTE_FIELD};
pub use dead_letters::SqsDeadLetters;
pub use error::SqsError;
pub use names::{
    CONSUMER_TAG, FILTER_TAG, ROLE_TAG, SOURCE_TAG, dead_letter_queue_name, queue_name,
    topic_prefix,
};
#[cfg(feature = "test-util")]
pub use options::Faults;
pub use options::{MAX_VISIBILITY, SqsOptions};

/// The URL schemes this backend serves (`reliq::connect` dispatches on them).
pub const SCHEMES: &[&str] = &["sqs"];

/// Connect to the endpoint an `sqs://` URL names, as a [`reliq_core::Broker`].
pub async fn connect(
    url: &str,
) -> Result<std::sync::Arc<dyn reliq_core::Broker>, reliq_core::BrokerError> {
    Ok(std::sync::Arc::new(SqsBroker::connect(url).await?))
}
