//! Conversions of client errors into reliq's.

use reliq_core::BrokerError;

pub(crate) fn other(e: impl std::error::Error + Send + Sync + 'static) -> BrokerError {
    BrokerError::Other(Box::new(e))
}

pub(crate) fn connection(e: impl std::fmt::Display) -> BrokerError {
    BrokerError::connection(e.to_string())
}
