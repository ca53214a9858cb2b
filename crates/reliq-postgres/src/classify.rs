//! What a PostgreSQL error means for retrying, for handlers that use the inbox and
//! outbox in their own transactions.
//!
//! Without a rule a `sqlx::Error` is [`ErrorClass::Unknown`]: a small retry budget, then
//! parked as `exhausted`. The failures a Postgres client is *expected* to retry — a
//! serialization failure under `SERIALIZABLE` / `REPEATABLE READ`, a deadlock, a lock or
//! statement timeout, a lost connection, a full pool — deserve the transient budget.

use reliq_core::{Classifier, ErrorClass};

/// The class of a `sqlx::Error` from PostgreSQL: transient for the SQLSTATE classes and
/// client conditions a retry resolves, [`ErrorClass::Unknown`] for everything else
/// (constraint violations, bad SQL, decode errors: a retry will not fix them, but whether
/// they are permanent is the application's call — add a rule of your own with
/// [`Classifier::on`] after this one).
pub fn error_class(e: &sqlx::Error) -> ErrorClass {
    match e {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => ErrorClass::Transient,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some(code) if is_transient_sqlstate(code) => ErrorClass::Transient,
            _ => ErrorClass::Unknown,
        },
        _ => ErrorClass::Unknown,
    }
}

/// SQLSTATEs a retry resolves: `40001` serialization_failure, `40P01` deadlock_detected,
/// `55P03` lock_not_available, `57014` query_canceled (statement timeout), `57P01`–`57P03`
/// (admin shutdown, crash shutdown, cannot connect now), class `08` (connection
/// exception) and class `53` (insufficient resources: too many connections, disk full,
/// out of memory).
fn is_transient_sqlstate(code: &str) -> bool {
    matches!(
        code,
        "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03"
    ) || code.starts_with("08")
        || code.starts_with("53")
}

/// `classifier` with [`error_class`] as its rule for `sqlx::Error`.
///
/// ```
/// use reliq_core::{Classifier, ErrorClass};
/// let classifier = reliq_postgres::with_error_rules(Classifier::default());
/// let err: reliq_core::BoxError = Box::new(sqlx::Error::PoolTimedOut);
/// assert_eq!(classifier.classify(err.as_ref()), ErrorClass::Transient);
/// ```
pub fn with_error_rules(classifier: Classifier) -> Classifier {
    classifier.on::<sqlx::Error>(error_class)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_sqlstates_are_transient_and_the_rest_unknown() {
        for code in [
            "40001", "40P01", "55P03", "57014", "57P01", "08006", "53300",
        ] {
            assert!(is_transient_sqlstate(code), "{code}");
        }
        for code in ["23505", "23503", "42P01", "22P02", "42601"] {
            assert!(!is_transient_sqlstate(code), "{code}");
        }
        assert_eq!(
            error_class(&sqlx::Error::PoolTimedOut),
            ErrorClass::Transient
        );
        assert_eq!(error_class(&sqlx::Error::RowNotFound), ErrorClass::Unknown);
    }
}
