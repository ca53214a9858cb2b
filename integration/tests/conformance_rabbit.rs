//! The conformance suite on the real RabbitMQ (real time, tiers 1 s and 2 s).

use reliq_integration::rabbit::RabbitBackend;

reliq_conformance::conformance_suite!(rabbit, real, RabbitBackend::new();
    shutdown_while_receiving_holds_nothing_until_a_lease,
);
