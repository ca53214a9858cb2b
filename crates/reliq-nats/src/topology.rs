//! The plan of a subscription's JetStream objects and how the server has them: the source
//! stream, the durable consumer and the DLQ stream.
//!
//! Settings are named as `nats stream info` / `nats consumer info` name them; durations are
//! compared as text (`30s`). Retries wait as scheduled messages in the source stream, so
//! there are no tier objects that an earlier policy could leave behind.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use reliq_core::{
    BrokerError, Channel, Found, LiveObject, LiveTopology, ObjectKind, Plan, PlannedObject,
    Severity, Subscription, Traffic, Wanted, seam::duration_text as text,
};

use crate::error::{api, stream_not_found};
use crate::names::{
    consumer_name, dead_letter_stream, dead_letter_subject, filter_subjects, retry_subjects,
    stream_name,
};
use crate::options::NatsOptions;

/// The durable pull consumer reliq declares for `sub`.
pub(crate) fn wanted_consumer(sub: &Subscription, options: &NatsOptions) -> pull::Config {
    pull::Config {
        durable_name: Some(consumer_name(&sub.consumer)),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: sub.lease,
        max_deliver: i64::from(sub.delivery_limit),
        max_ack_pending: i64::from(sub.prefetch) + i64::from(options.retry_headroom),
        filter_subjects: filter_subjects(sub),
        ..Default::default()
    }
}

/// A plan's name for the consumer: `<stream>/<consumer>`, as the server scopes it.
fn consumer_object(sub: &Subscription) -> String {
    format!(
        "{}/{}",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// How long a DLQ stream remembers the `Nats-Msg-Id`s of its entries (the server's
/// default is 2 min): a message's dead letter repeated within it — a redelivery, a retry
/// copy, the advisory watcher's — is dropped. A dead letter held through a long outage
/// (its copy sent again until confirmed) can land minutes after another delivery of the
/// same message parked it: a chaos round parked one 155 s after the first. The server
/// keeps one id per entry in memory for the window.
pub(crate) const DEAD_LETTER_DUPLICATE_WINDOW: Duration = Duration::from_secs(600);

/// The limits that delete stored messages whether they were consumed or not.
fn keeps_everything(object: PlannedObject, what: &str) -> PlannedObject {
    let lost = format!("{what} are deleted by the limit, consumed or not");
    object
        .with("max_age", Wanted::equals("0s"), Severity::Breaking, &lost)
        .with("max_msgs", Wanted::equals(-1), Severity::Breaking, &lost)
        .with("max_bytes", Wanted::equals(-1), Severity::Breaking, &lost)
        .with(
            "storage",
            Wanted::equals("file"),
            Severity::Breaking,
            format!("{what} in memory storage are lost when the server restarts"),
        )
}

/// What producers publish to: the filter's subjects, or the source's own subject.
fn source_address(sub: &Subscription) -> String {
    match filter_subjects(sub).first() {
        Some(subject) if sub.filter.as_deref().is_some_and(|f| f != "#") => subject.clone(),
        _ => sub.source.clone(),
    }
}

/// Retries wait in the source stream as scheduled messages, one subject per delivery
/// (`retry.<stream>.<consumer>.at.<sequence>`), and come due on the consumer's own
/// `retry.<stream>.<consumer>.due`.
fn retry_channel(sub: &Subscription) -> Channel {
    Channel::new(
        Traffic::retry(sub.retry_tiers.iter().copied()),
        format!(
            "retry.{}.{}.at.*",
            stream_name(&sub.source),
            crate::names::consumer_name(&sub.consumer)
        ),
    )
}

pub(crate) fn plan(sub: &Subscription, options: &NatsOptions) -> Plan {
    let consumer = wanted_consumer(sub, options);
    let mut filters = consumer.filter_subjects.clone();
    filters.sort();
    let source = keeps_everything(
        PlannedObject::new(
            ObjectKind::Stream,
            stream_name(&sub.source),
            "source stream",
        )
        .with(
            "subjects",
            Wanted::includes([
                sub.source.clone(),
                format!("{}.>", sub.source),
                retry_subjects(&sub.source),
            ]),
            Severity::Breaking,
            "publishes or retries to a subject the stream does not have are refused",
        )
        .with(
            "allow_msg_schedules",
            Wanted::equals(true),
            Severity::Breaking,
            "retries cannot wait in the stream as scheduled messages",
        ),
        "unconsumed messages",
    )
    .carrying(Channel::new(Traffic::Source, source_address(sub)))
    .carrying(retry_channel(sub));
    let dlq = keeps_everything(
        PlannedObject::new(ObjectKind::Stream, dead_letter_stream(sub), "the DLQ")
            .with(
                "subjects",
                Wanted::includes([dead_letter_subject(sub)]),
                Severity::Breaking,
                "dead-lettering is refused",
            )
            .with(
                "duplicate_window",
                Wanted::equals(text(DEAD_LETTER_DUPLICATE_WINDOW)),
                Severity::Cosmetic,
                "a message parked again after the window (a dead letter held through a long \
                 outage) is a second entry",
            ),
        "dead letters",
    )
    .carrying(Channel::new(Traffic::DeadLetters, dead_letter_subject(sub)));
    let consumer = PlannedObject::new(
        ObjectKind::Consumer,
        consumer_object(sub),
        "durable pull consumer",
    )
    .with(
        "ack_policy",
        Wanted::equals("explicit"),
        Severity::Breaking,
        "deliveries are settled without the handler's ack",
    )
    .with(
        "max_deliver",
        Wanted::equals(consumer.max_deliver),
        Severity::Breaking,
        "a crash loop is dead-lettered at another count (or never, with -1)",
    )
    .with(
        "filter_subjects",
        Wanted::Equals(filters.into()),
        Severity::Breaking,
        "the consumer receives other messages than its subscription asks for, or not its retries",
    )
    .with(
        "ack_wait",
        Wanted::equals(text(consumer.ack_wait)),
        Severity::Cosmetic,
        "a delivery is leased for another time than the subscription's lease (reliq keeps long handlers leased)",
    )
    .with(
        "max_ack_pending",
        Wanted::equals(consumer.max_ack_pending),
        Severity::Cosmetic,
        "more or fewer deliveries are in flight than prefetch + retry headroom",
    );
    Plan::new("nats", sub)
        .with(source)
        .with(consumer)
        .with(dlq)
        .not_checking(
            "the source stream's retention policy and replicas (a choice of its owner; \
             reliq works with limits and interest retention)",
        )
}

/// `None` when the stream does not exist.
async fn stream_config(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<stream::Config>, BrokerError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s.cached_info().config.clone())),
        Err(e) if stream_not_found(&e) => Ok(None),
        Err(e) => Err(api(format!("reading stream `{name}`"))(e)),
    }
}

fn live_stream(c: &stream::Config) -> LiveObject {
    let storage = match c.storage {
        stream::StorageType::File => "file",
        stream::StorageType::Memory => "memory",
    };
    LiveObject::default()
        .with("subjects", Found::own(c.subjects.clone()))
        .with("allow_msg_schedules", Found::own(c.allow_message_schedules))
        .with("max_age", Found::own(text(c.max_age)))
        .with("max_msgs", Found::own(c.max_messages))
        .with("max_bytes", Found::own(c.max_bytes))
        .with("storage", Found::own(storage))
        .with("duplicate_window", Found::own(text(c.duplicate_window)))
}

fn live_consumer(c: &pull::Config) -> LiveObject {
    let ack_policy = match c.ack_policy {
        jetstream::consumer::AckPolicy::Explicit => "explicit",
        jetstream::consumer::AckPolicy::None => "none",
        jetstream::consumer::AckPolicy::All => "all",
        _ => "other",
    };
    let mut filters = c.filter_subjects.clone();
    if !c.filter_subject.is_empty() {
        filters.push(c.filter_subject.clone());
    }
    filters.sort();
    LiveObject::default()
        .with("ack_policy", Found::own(ack_policy))
        .with("max_deliver", Found::own(c.max_deliver))
        .with("filter_subjects", Found::own(filters))
        .with("ack_wait", Found::own(text(c.ack_wait)))
        .with("max_ack_pending", Found::own(c.max_ack_pending))
}

pub(crate) async fn inspect(
    js: &jetstream::Context,
    sub: &Subscription,
) -> Result<LiveTopology, BrokerError> {
    let mut live = LiveTopology::default();
    let source = stream_name(&sub.source);
    if let Some(config) = stream_config(js, &source).await? {
        live.push(ObjectKind::Stream, &source, live_stream(&config));
        let stream = js
            .get_stream(&source)
            .await
            .map_err(api(format!("reading stream `{source}`")))?;
        let name = consumer_name(&sub.consumer);
        match stream.consumer_info(&name).await {
            Ok(info) => live.push(
                ObjectKind::Consumer,
                consumer_object(sub),
                live_consumer(&pull_config(info.config)),
            ),
            Err(e)
                if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound
                    || e.kind() == jetstream::context::ConsumerInfoErrorKind::StreamNotFound => {}
            Err(e) => return Err(api(format!("reading consumer `{name}`"))(e)),
        }
    }
    let dlq = dead_letter_stream(sub);
    if let Some(config) = stream_config(js, &dlq).await? {
        live.push(ObjectKind::Stream, &dlq, live_stream(&config));
    }
    Ok(live)
}

/// The settings compared, from the server's consumer configuration (push or pull).
fn pull_config(c: jetstream::consumer::Config) -> pull::Config {
    pull::Config {
        ack_policy: c.ack_policy,
        ack_wait: c.ack_wait,
        max_deliver: c.max_deliver,
        max_ack_pending: c.max_ack_pending,
        filter_subject: c.filter_subject,
        filter_subjects: c.filter_subjects,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_defaults_for_a_declared_consumer_are_as_planned() {
        let sub = Subscription::new("billing", "orders");
        let options = NatsOptions::default();
        let plan = plan(&sub, &options);
        let wanted = wanted_consumer(&sub, &options);
        let live = LiveTopology::default()
            .found(
                ObjectKind::Stream,
                "orders",
                live_stream(&stream::Config {
                    subjects: vec!["orders".into(), "orders.>".into(), "retry.orders.>".into()],
                    allow_message_schedules: true,
                    max_messages: -1,
                    max_bytes: -1,
                    ..Default::default()
                }),
            )
            .found(
                ObjectKind::Consumer,
                "orders/billing",
                live_consumer(&wanted),
            )
            .found(
                ObjectKind::Stream,
                "DLQ_orders_billing",
                live_stream(&stream::Config {
                    subjects: vec!["dlq.orders.billing".into()],
                    max_messages: -1,
                    max_bytes: -1,
                    duplicate_window: DEAD_LETTER_DUPLICATE_WINDOW,
                    ..Default::default()
                }),
            );
        assert_eq!(reliq_core::seam::compare(&plan, &live), vec![]);
    }
}
