//! The conformance suite on SQS (the moto endpoint started by scripts/brokers).
//!
//! Not yet part of `just test`: on moto the 28 scenarios pass, but two are flaky
//! (crash_loop: the emulator sometimes redrives after 4 receives with maxReceiveCount 5;
//! non_blocking: now and then no later message is received inside the retry window) —
//! both passed on nextest's retry in the last run. Run it explicitly with
//! `cargo nextest run --workspace --features reliq-integration/sqs-conformance -E 'test(/conformance::sqs::/)'`.
#![cfg(feature = "sqs-conformance")]

use reliq_integration::sqs::SqsBackend;

reliq_conformance::conformance_suite!(sqs, real, SqsBackend::new());
