//! The crate's error type and the conversions of client errors into reliq's: each keeps
//! the client's error as its source and says what was being done.

use reliq_core::{BoxError, BrokerError};

/// A NATS client error, with what reliq was doing when it happened. Reaches callers as
/// the source of a [`BrokerError`] (`BrokerError::Other` for a JetStream API request,
/// otherwise inside `BrokerError::Connection` / `Rejected`); find it with
/// [`std::error::Error::source`] or `downcast_ref::<NatsError>()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// A JetStream API request failed: declaring or reading a stream or a consumer,
    /// getting or deleting a stream message.
    #[error("{action}")]
    JetStream {
        /// What was being done (`declaring source stream `orders``).
        action: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

/// A failed JetStream API request, kept with `action` as a [`NatsError`] inside
/// [`BrokerError::Other`].
pub(crate) fn api<E>(action: impl Into<String>) -> impl FnOnce(E) -> BrokerError
where
    E: Into<BoxError>,
{
    let action = action.into();
    move |e| {
        BrokerError::Other(Box::new(NatsError::JetStream {
            action,
            source: e.into(),
        }))
    }
}

/// A failure of the connection while doing `context`, the client's error as its source.
pub(crate) fn connection<E>(context: impl Into<String>) -> impl FnOnce(E) -> BrokerError
where
    E: Into<BoxError>,
{
    let context = context.into();
    move |e| BrokerError::connection(context).caused_by(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_keep_the_client_error_and_say_what_was_done() {
        let e = api("reading stream `orders`")(std::io::Error::other("no responders"));
        assert_eq!(e.to_string(), "reading stream `orders`");
        let nats = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<NatsError>())
            .or_else(|| match &e {
                BrokerError::Other(inner) => inner.downcast_ref::<NatsError>(),
                _ => None,
            });
        let Some(NatsError::JetStream { source, .. }) = nats else {
            panic!("no NatsError in {e:?}");
        };
        assert_eq!(source.to_string(), "no responders");

        let e = connection("acking a delivery")(std::io::Error::other("broken pipe"));
        assert!(matches!(e, BrokerError::Connection { .. }), "{e:?}");
        assert!(e.to_string().contains("acking a delivery"));
        let source = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("broken pipe"));
    }
}
