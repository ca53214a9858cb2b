//! What an SQLite error means for retrying, for handlers that use the inbox and outbox
//! in their own transactions.
//!
//! Without a rule a `sqlx::Error` is [`ErrorClass::Unknown`]: a small retry budget, then
//! parked as `exhausted`. A database that stayed locked past the busy timeout
//! (`SQLITE_BUSY`, another writer) or a locked table (`SQLITE_LOCKED`) is the failure an
//! SQLite client is expected to retry; so are I/O errors and a full pool.

use reliq_core::{Classifier, ErrorClass};

/// `SQLITE_BUSY` and `SQLITE_LOCKED`, the primary result codes (the low byte of the
/// extended code sqlx reports).
const BUSY: i32 = 5;
const LOCKED: i32 = 6;

/// The class of a `sqlx::Error` from SQLite: transient for busy / locked databases and
/// client conditions a retry resolves, [`ErrorClass::Unknown`] for everything else
/// (constraint violations, bad SQL, decode errors — whether they are permanent is the
/// application's call: add a rule of your own with [`Classifier::on`] after this one).
pub fn error_class(e: &sqlx::Error) -> ErrorClass {
    match e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::WorkerCrashed => ErrorClass::Transient,
        sqlx::Error::Database(db) => {
            let primary = db
                .code()
                .and_then(|c| c.parse::<i32>().ok())
                .map(|c| c & 0xff);
            match primary {
                Some(BUSY | LOCKED) => ErrorClass::Transient,
                _ => ErrorClass::Unknown,
            }
        }
        _ => ErrorClass::Unknown,
    }
}

/// `classifier` with [`error_class`] as its rule for `sqlx::Error`.
///
/// ```
/// use reliq_core::{Classifier, ErrorClass};
/// let classifier = reliq_sqlite::with_error_rules(Classifier::default());
/// let err: reliq_core::BoxError = Box::new(sqlx::Error::PoolTimedOut);
/// assert_eq!(classifier.classify(err.as_ref()), ErrorClass::Transient);
/// ```
pub fn with_error_rules(classifier: Classifier) -> Classifier {
    classifier.on::<sqlx::Error>(error_class)
}
