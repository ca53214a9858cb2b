//! The conformance suite on the real Kafka broker started by `scripts/brokers`.

use reliq_integration::kafka::KafkaBackend;

reliq_conformance::conformance_suite!(kafka, real, KafkaBackend::new());
