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

/// The resource an `ACCESS_REFUSED` / `NOT_ALLOWED` reply names: RabbitMQ says
/// ``access to queue 'orders.billing' in vhost 'shop' refused for user 'billing'``.
fn refused_resource(text: &str) -> Option<String> {
    let (_, rest) = text.split_once("access to ")?;
    let (resource, _) = rest.split_once(" refused for user")?;
    Some(resource.to_owned())
}

/// A channel or connection closed with 403 `ACCESS_REFUSED` (or a connection with 530
/// `NOT_ALLOWED`, a vhost the user may not open) as [`BrokerError::Unauthorized`], naming
/// the resource; `None` for any other error.
fn unauthorized(doing: &str, e: &lapin::Error) -> Option<BrokerError> {
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return None;
    };
    if !matches!(amqp.get_id(), 403 | 530) {
        return None;
    }
    let text = amqp.get_message().to_string();
    Some(BrokerError::Unauthorized {
        resource: refused_resource(&text).unwrap_or_else(|| doing.to_owned()),
        reason: format!("{doing}: {text}"),
        source: Some(Box::new(e.clone())),
    })
}

/// What a failed connection attempt means: a refused sign-in or vhost is
/// [`BrokerError::Unauthorized`]; a certificate the client or the broker does not accept
/// is [`BrokerError::Config`] naming the setting to fix (`cacertfile` for the broker's,
/// `certfile` for the client's); anything else is a connection error (retried).
pub(crate) fn refused_connection(e: lapin::Error) -> BrokerError {
    if let Some(refused) = unauthorized("signing in", &e) {
        return refused;
    }
    let text = e.to_string();
    // rustls's words: the broker's certificate failed verification here, or the broker
    // sent an alert about ours.
    let field = if text.contains("invalid peer certificate") {
        Some((
            "cacertfile",
            "the broker's certificate is not trusted (add its CA with cacertfile)",
        ))
    } else if text.contains("received fatal alert") {
        Some((
            "certfile",
            "the broker refused the TLS handshake: its alert names what it did not accept              in the client certificate (missing, unknown CA, expired)",
        ))
    } else if text.contains("InvalidContentType") || text.contains("corrupt message") {
        Some((
            "url",
            "the port did not answer TLS: amqps:// to a plain AMQP listener?",
        ))
    } else {
        None
    };
    match field {
        Some((field, why)) => BrokerError::Config {
            field: field.into(),
            reason: format!("{why}: {text}"),
        },
        None => BrokerError::connection(text),
    }
}

impl RabbitError {
    pub(crate) fn declare(object: &str, source: lapin::Error) -> BrokerError {
        if let Some(refused) = unauthorized(&format!("declaring `{object}`"), &source) {
            return refused;
        }
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
        if let Some(refused) = unauthorized(operation, &source) {
            return refused;
        }
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
            BrokerError::connection(e.to_string()).caused_by(e)
        } else {
            BrokerError::Other(Box::new(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refused_resource_is_read_from_the_reply_text() {
        assert_eq!(
            refused_resource(
                "ACCESS_REFUSED - access to queue 'orders.billing' in vhost 'shop' refused for user 'billing'"
            )
            .as_deref(),
            Some("queue 'orders.billing' in vhost 'shop'")
        );
        assert_eq!(
            refused_resource("NOT_ALLOWED - access to vhost 'shop' refused for user 'x'")
                .as_deref(),
            Some("vhost 'shop'")
        );
        assert_eq!(refused_resource("ACCESS_REFUSED - Login was refused"), None);
    }
}
