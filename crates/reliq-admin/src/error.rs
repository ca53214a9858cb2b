//! What an operation can fail with, and the HTTP status each maps to.

use reliq_core::{BrokerError, NameError};

/// An operator operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// An input (a filter field, a flag, a body field) could not be read; names it.
    #[error("invalid `{field}` value `{value}`: {expected}")]
    InvalidInput {
        /// The field.
        field: &'static str,
        /// The value given (cut to 80 characters).
        value: String,
        /// What was expected.
        expected: String,
    },
    /// No dead letter with this id in the consumer's DLQ.
    #[error("no dead letter `{id}` in the DLQ of consumer `{consumer}`")]
    NotFound {
        /// The consumer.
        consumer: String,
        /// The id asked for.
        id: String,
    },
    /// No job with this id.
    #[error("no job `{0}`")]
    NoSuchJob(String),
    /// The broker failed the operation (nothing was lost: see the operation's docs).
    #[error("broker: {}", reliq_core::ErrorChain(.0))]
    Broker(#[from] BrokerError),
    /// Reading or writing a file (tokens, audit log, payload).
    #[error("{what} `{path}`: {source}")]
    File {
        /// What the file is for.
        what: &'static str,
        /// Its path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The server is stopping: it starts no new job.
    #[error(
        "the admin server is shutting down and starts no new job; run it again once it is back"
    )]
    ShuttingDown,
    /// The triage store failed.
    #[error("{what}: {source}")]
    Store {
        /// What was being done.
        what: &'static str,
        /// SQLite's error.
        #[source]
        source: sqlx::Error,
    },
    /// Triage needs a store, and this server or command has none.
    #[error(
        "triage is not enabled: start the server with --triage-db FILE (or pass it to the command)"
    )]
    TriageOff,
    /// An edit's corrected value could not be written with its dead letter's schema.
    #[error("re-encoding the corrected value: {0}")]
    Reencode(#[from] reliq_contracts::ReencodeError),
    /// The tokens file could not be read.
    #[error("tokens file `{path}`: {why}")]
    Tokens {
        /// Its path.
        path: String,
        /// What is wrong, naming the entry and field.
        why: String,
    },
}

impl AdminError {
    /// The HTTP status the API answers this error with.
    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidInput { .. } => 400,
            Self::NotFound { .. } | Self::NoSuchJob(_) | Self::Broker(BrokerError::NotFound(_)) => {
                404
            }
            Self::Broker(BrokerError::Timeout(_) | BrokerError::Connection { .. })
            | Self::ShuttingDown => 503,
            Self::Broker(BrokerError::Config { .. }) => 400,
            Self::Broker(_) => 502,
            Self::TriageOff => 404,
            Self::Reencode(reliq_contracts::ReencodeError::Registry(_)) => 502,
            Self::Reencode(_) => 400,
            Self::File { .. } | Self::Tokens { .. } | Self::Store { .. } => 500,
        }
    }
}

impl From<NameError> for AdminError {
    fn from(e: NameError) -> Self {
        Self::InvalidInput {
            field: e.field,
            value: e.value,
            expected: e.reason.to_owned(),
        }
    }
}
