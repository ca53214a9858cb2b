//! The conformance suite on SQS (the moto endpoint started by scripts/brokers).
//!
//! Tiers, tolerance and backlog are sized for moto, a single Python process (see
//! `SqsBackend`); nextest retries a real-broker scenario once and reports it as FLAKY.

use reliq_integration::sqs::SqsBackend;

reliq_conformance::conformance_suite!(sqs, real, SqsBackend::new();
    shutdown_while_receiving_holds_nothing_until_a_lease,
);
