//! The conformance suite on Amazon SQS (the moto server started by scripts/brokers).

use reliq_integration::sqs::SqsBackend;

reliq_conformance::conformance_suite!(sqs, real, SqsBackend::new());
