//! Backend factories for the conformance suite, and connection settings shared by the
//! integration tests (read from `brokers.env`, overridable by environment variables).

pub mod crash;
pub mod kafka;
pub mod memory;
pub mod nats;
pub mod rabbit;
pub mod settings;
pub mod sqs;
pub mod stores;
