//! The JetStream names reliq derives from a subscription (streams, subjects, consumers).

use reliq_core::{Destination, Subscription};

/// The JetStream stream name for a source: NATS stream names may not contain `.`, `*`,
/// `>`, spaces or path separators.
pub fn stream_name(source: &str) -> String {
    source
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
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

pub(crate) fn filter_subject(sub: &Subscription) -> String {
    match &sub.filter {
        None => String::new(),
        Some(f) if f == "#" => String::new(),
        Some(f) => {
            let nats: Vec<&str> = f
                .split('.')
                .map(|w| if w == "#" { ">" } else { w })
                .collect();
            format!("{}.{}", sub.source, nats.join("."))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_valid_for_nats() {
        assert_eq!(stream_name("orders.eu west"), "orders_eu_west");
        let sub = Subscription::new("inventory", "orders").with_filter("created.#");
        assert_eq!(filter_subject(&sub), "orders.created.>");
        assert_eq!(dead_letter_subject(&sub), "dlq.orders.inventory");
        assert_eq!(
            subject(&Destination::new("orders").with_route("created")),
            "orders.created"
        );
    }
}
