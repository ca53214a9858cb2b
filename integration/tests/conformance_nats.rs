//! The conformance suite on NATS JetStream (the server started by scripts/brokers).

use reliq_integration::nats::NatsBackend;

// Not stamped for NATS yet (issue 18), a known gap found when the scheduled-retry
// receiver landed: shutdown_while_receiving_holds_nothing_until_a_lease — after a
// shutdown while messages keep arriving, some wait for the lease (ack wait) before a new
// consumer gets them (it passed with the NakWithDelay receiver). Likely the open pull
// request at close: the server keeps filling it after the receiver stops reading.
reliq_conformance::conformance_suite!(nats, real, NatsBackend::new());
