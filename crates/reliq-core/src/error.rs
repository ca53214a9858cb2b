//! [`BrokerError`]: what a backend reports, each keeping the client error behind it.

use std::time::Duration;

/// A boxed error: what a handler returns and what [`BrokerError::Other`] carries.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors a backend reports. Each keeps the client error that caused it, where there was
/// one, as its [`source`](std::error::Error::source); the built-in [`Classifier`] reads
/// the variant (a timeout or a lost connection is transient, an unroutable destination or
/// a bad configuration permanent), so a handler that returns one — its own publish failed
/// — gets the retry budget the failure deserves.
///
/// [`Classifier`]: crate::classify::Classifier
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The destination does not exist / nothing is bound to receive the message.
    #[error("destination `{0}` is unroutable (does not exist or nothing is bound to it)")]
    Unroutable(String),
    /// The broker refused the message (negative confirm, rejected publish, quota).
    #[error("broker rejected the message: {reason}")]
    Rejected {
        /// What the broker said.
        reason: String,
        /// The client's error, if there was one.
        #[source]
        source: Option<BoxError>,
    },
    /// No confirmation arrived in time.
    #[error("timed out after {0:?} waiting for the broker")]
    Timeout(Duration),
    /// The connection or channel is gone.
    #[error("connection lost: {context}")]
    Connection {
        /// What was being done, and what went wrong.
        context: String,
        /// The client's error, if there was one.
        #[source]
        source: Option<BoxError>,
    },
    /// An object a read needs does not exist at the broker (a consumer's DLQ before the
    /// consumer first subscribed, a queue deleted by hand). Reads never create what they
    /// look at: only [`Broker::subscribe`](crate::Broker::subscribe) declares. The text
    /// names the object and how it comes to exist.
    #[error("{0}")]
    NotFound(String),
    /// The receiver was closed.
    #[error("receiver closed")]
    Closed,
    /// A delivery was settled on a receiver that did not hand it out (another consumer's,
    /// or one from before a reconnect). Nothing was settled; the delivery stays with the
    /// receiver that owns it.
    #[error("the delivery was handed out by another receiver; settle it on its own")]
    ForeignDelivery,
    /// This receiver no longer holds the delivery (the channel it came on closed, its
    /// lease ended, its partition was revoked): nothing was settled, and the broker
    /// delivers it again. The runtime stops settling it and does not release it.
    #[error("the delivery is no longer held by this receiver: {0}")]
    NotHeld(String),
    /// The backend cannot do this.
    #[error("not supported by the {backend} backend: {what}")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// The operation.
        what: &'static str,
    },
    /// The broker refused this principal an operation on a resource (a missing ACL or
    /// permission). Another try is refused the same way until an operator grants it:
    /// `reliq topology permissions` prints what the consumer needs.
    #[error("not authorized: {resource}: {reason}")]
    Unauthorized {
        /// The resource the broker named (`topic orders.billing.dlq`, `group billing`).
        resource: String,
        /// What was being done, and what the broker said.
        reason: String,
        /// The client's error, if there was one.
        #[source]
        source: Option<BoxError>,
    },
    /// Invalid configuration or URL; names the field.
    #[error("invalid configuration `{field}`: {reason}")]
    Config {
        /// The setting or URL part.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Any other client error.
    #[error(transparent)]
    Other(BoxError),
}

impl BrokerError {
    /// [`BrokerError::Connection`] without a client error behind it.
    pub fn connection(context: impl Into<String>) -> Self {
        Self::Connection {
            context: context.into(),
            source: None,
        }
    }

    /// The broker could not be reached or did not answer in time ([`BrokerError::Connection`],
    /// [`BrokerError::Timeout`]): asking again later may succeed (see [`crate::through_outage`]).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Connection { .. } | Self::Timeout(_))
    }

    /// [`BrokerError::Rejected`] without a client error behind it.
    pub fn rejected(reason: impl Into<String>) -> Self {
        Self::Rejected {
            reason: reason.into(),
            source: None,
        }
    }

    /// Keep `cause` as the source of a [`BrokerError::Connection`] or
    /// [`BrokerError::Rejected`] (other variants are returned unchanged).
    pub fn caused_by(mut self, cause: impl Into<BoxError>) -> Self {
        if let Self::Connection { source, .. } | Self::Rejected { source, .. } = &mut self {
            *source = Some(cause.into());
        }
        self
    }

    /// A short, stable name of the variant — the `kind` label of
    /// `reliq_publish_failures_total` and the spans' `error.type`: `unroutable`,
    /// `rejected`, `not_found`, `timeout`, `connection`, `closed`, `foreign_delivery`, `not_held`,
    /// `unsupported`, `unauthorized`, `config`, `other`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unroutable(_) => "unroutable",
            Self::Rejected { .. } => "rejected",
            Self::NotFound(_) => "not_found",
            Self::Timeout(_) => "timeout",
            Self::Connection { .. } => "connection",
            Self::Closed => "closed",
            Self::ForeignDelivery => "foreign_delivery",
            Self::NotHeld(_) => "not_held",
            Self::Unsupported { .. } => "unsupported",
            Self::Unauthorized { .. } => "unauthorized",
            Self::Config { .. } => "config",
            Self::Other(_) => "other",
        }
    }
}
