//! The conformance suite on NATS JetStream (the server started by scripts/brokers).

use reliq_integration::nats::NatsBackend;

reliq_conformance::conformance_suite!(nats, real, NatsBackend::new();
    shutdown_while_receiving_holds_nothing_until_a_lease,
);
