//! The conformance suite on the real Kafka broker started by `scripts/brokers`.

use reliq_integration::kafka::KafkaBackend;

reliq_conformance::conformance_suite!(kafka, real, KafkaBackend::new();
    shutdown_while_receiving_holds_nothing_until_a_lease,
);
