//! The crate's error type and its mapping onto [`BrokerError`].

use reliq_core::BrokerError;

/// Errors of this crate (converted into [`BrokerError`] at the seam).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// Declaring an exchange or queue failed.
    #[error("declaring `{object}` failed: {source}")]
    Declare {
        /// The exchange or queue.
        object: String,
        /// The client error.
        #[source]
        source: lapin::Error,
    },
    /// A client call failed.
    #[error("{operation} failed: {source}")]
    Client {
        /// What was attempted.
        operation: &'static str,
        /// The client error.
        #[source]
        source: lapin::Error,
    },
}

/// The AMQP reply code of a channel/connection error, if it is one.
pub(crate) fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

impl RabbitError {
    pub(crate) fn declare(object: &str, source: lapin::Error) -> BrokerError {
        let code = reply_code(&source);
        let e = RabbitError::Declare {
            object: object.to_owned(),
            source,
        };
        match code {
            Some(406) => BrokerError::Config {
                field: object.to_owned(),
                reason: format!(
                    "{e} (PRECONDITION_FAILED: it exists with other arguments; change it with a \
                     policy or delete and redeclare it)"
                ),
            },
            _ => e.into(),
        }
    }

    pub(crate) fn client(operation: &'static str, source: lapin::Error) -> BrokerError {
        RabbitError::Client { operation, source }.into()
    }
}

impl From<RabbitError> for BrokerError {
    fn from(e: RabbitError) -> Self {
        let source = match &e {
            RabbitError::Declare { source, .. } | RabbitError::Client { source, .. } => source,
        };
        if source.is_io_error()
            || source.is_amqp_hard_error()
            || matches!(
                source.kind(),
                lapin::ErrorKind::InvalidChannelState(..)
                    | lapin::ErrorKind::InvalidConnectionState(..)
                    | lapin::ErrorKind::MissingHeartbeatError
            )
        {
            BrokerError::connection(e.to_string())
        } else {
            BrokerError::Other(Box::new(e))
        }
    }
}
