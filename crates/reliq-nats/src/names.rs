//! The JetStream names reliq derives from a subscription (streams, subjects, consumers).

use reliq_core::{Destination, Subscription};

/// The JetStream stream name for a source: NATS stream names may not contain `.`, `*`,
/// `>`, spaces or path separators.
pub fn stream_name(source: &str) -> String {
    reliq_core::seam::word_characters(source)
}

/// The subject a destination publishes to: `<topic>` or `<topic>.<route>`.
pub fn subject(destination: &Destination) -> String {
    match &destination.route {
        Some(route) if !route.is_empty() => format!("{}.{}", destination.topic, route),
        _ => destination.topic.clone(),
    }
}

pub(crate) fn consumer_name(consumer: &str) -> String {
    stream_name(consumer)
}

/// The DLQ stream of a subscription: `DLQ_<stream>_<consumer>`.
pub fn dead_letter_stream(sub: &Subscription) -> String {
    format!(
        "DLQ_{}_{}",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// The DLQ subject of a subscription: `dlq.<stream>.<consumer>`.
pub fn dead_letter_subject(sub: &Subscription) -> String {
    format!(
        "dlq.{}.{}",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// The subjects of a source stream that hold its consumers' waiting and due retries:
/// `retry.<stream>.>` (one subject for every consumer, so declaring it never races).
pub fn retry_subjects(source: &str) -> String {
    format!("retry.{}.>", stream_name(source))
}

/// Where a consumer's retries come due: `retry.<stream>.<consumer>.due`, a subject of the
/// source stream that only this consumer reads.
pub fn retry_due_subject(sub: &Subscription) -> String {
    format!(
        "retry.{}.{}.due",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// The schedule subject of the retry of the message at stream sequence `seq`:
/// `retry.<stream>.<consumer>.at.<seq>`. One schedule per subject (the server keeps the
/// last), so scheduling the same delivery's retry again replaces it instead of doubling it.
pub(crate) fn retry_schedule_subject(sub: &Subscription, seq: u64) -> String {
    format!(
        "retry.{}.{}.at.{seq}",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// Every waiting retry schedule of `sub`: `retry.<stream>.<consumer>.at.>`.
pub(crate) fn retry_schedules(sub: &Subscription) -> String {
    format!(
        "retry.{}.{}.at.>",
        stream_name(&sub.source),
        consumer_name(&sub.consumer)
    )
}

/// The subjects a subscription's consumer reads: its filter (or the whole source) and its
/// own due retries — never another consumer's retries, nor any waiting schedule.
pub(crate) fn filter_subjects(sub: &Subscription) -> Vec<String> {
    let mut subjects = match &sub.filter {
        None => vec![sub.source.clone(), format!("{}.>", sub.source)],
        Some(f) if f == "#" => vec![sub.source.clone(), format!("{}.>", sub.source)],
        Some(f) => {
            let nats: Vec<&str> = f
                .split('.')
                .map(|w| if w == "#" { ">" } else { w })
                .collect();
            vec![format!("{}.{}", sub.source, nats.join("."))]
        }
    };
    subjects.push(retry_due_subject(sub));
    subjects
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_valid_for_nats() {
        assert_eq!(stream_name("orders.eu west"), "orders_eu_west");
        let sub = Subscription::new("inventory", "orders").with_filter("created.#");
        assert_eq!(
            filter_subjects(&sub),
            ["orders.created.>", "retry.orders.inventory.due"]
        );
        assert_eq!(
            filter_subjects(&Subscription::new("c", "o")),
            ["o", "o.>", "retry.o.c.due"]
        );
        assert_eq!(
            retry_schedule_subject(&sub, 7),
            "retry.orders.inventory.at.7"
        );
        assert_eq!(dead_letter_subject(&sub), "dlq.orders.inventory");
        assert_eq!(
            subject(&Destination::new("orders").with_route("created")),
            "orders.created"
        );
    }
}
