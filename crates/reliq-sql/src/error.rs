//! The stores' error.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::time::Duration;

use reliq_core::{InboxError, OutboxError};

use crate::dialect::{OutOfRange, StoreSql};

/// Errors of the stores on database `S` (`reliq_postgres::Error`, `reliq_sqlite::Error`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error<S: StoreSql> {
    /// A query failed.
    #[error("{name}: {0}", name = S::NAME)]
    Database(#[from] sqlx::Error),
    /// Applying the schema failed.
    #[error("{name}: migrating the reliq schema failed: {0}", name = S::NAME)]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A duration does not fit the database's range.
    #[error("duration {0:?} is out of range")]
    Duration(Duration),
    /// Never made: it only holds the type parameter.
    #[doc(hidden)]
    #[error("{0:?}")]
    Never(Infallible, PhantomData<S>),
}

impl<S: StoreSql> From<OutOfRange> for Error<S> {
    fn from(OutOfRange(d): OutOfRange) -> Self {
        Self::Duration(d)
    }
}

impl<S: StoreSql> From<Error<S>> for InboxError {
    fn from(e: Error<S>) -> Self {
        InboxError(Box::new(e))
    }
}

impl<S: StoreSql> From<Error<S>> for OutboxError {
    fn from(e: Error<S>) -> Self {
        OutboxError(Box::new(e))
    }
}
