//! The crate's error type and the conversions of client errors into reliq's: each keeps
//! the client's error as its source and says what was being done.

use reliq_core::{BoxError, BrokerError, seam::lock};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// The subjects the server refused this process's users lately (`-ERR 'Permissions
/// Violation for Publish to "…"'`), newest last. NATS does not answer a refused request:
/// it reports the violation asynchronously and the request times out, so a failed
/// JetStream call looks here for the refusal that explains it.
static VIOLATIONS: Mutex<Vec<(Instant, String)>> = Mutex::new(Vec::new());
/// How long a reported violation can explain a failed call (a JetStream request's
/// timeout, with room).
const VIOLATION_WINDOW: Duration = Duration::from_secs(30);
const VIOLATIONS_KEPT: usize = 64;

/// Record the subject of a server's `Permissions Violation` report.
pub(crate) fn record_violation(report: &str) {
    let Some(subject) = report.split('"').nth(1).filter(|s| !s.is_empty()) else {
        return;
    };
    let mut seen = lock(&VIOLATIONS);
    seen.retain(|(at, _)| at.elapsed() < VIOLATION_WINDOW);
    if seen.len() >= VIOLATIONS_KEPT {
        seen.remove(0);
    }
    seen.push((Instant::now(), subject.to_owned()));
}

/// A refused subject that names one of the streams or consumers `action` names (the
/// words in backticks), reported within [`VIOLATION_WINDOW`]: the likely cause of the
/// call's failure.
fn violation_for(action: &str) -> Option<String> {
    let names: Vec<&str> = action.split('`').skip(1).step_by(2).collect();
    let seen = lock(&VIOLATIONS);
    seen.iter()
        .rev()
        .filter(|(at, _)| at.elapsed() < VIOLATION_WINDOW)
        .map(|(_, subject)| subject)
        .find(|subject| subject.split('.').any(|token| names.contains(&token)))
        .cloned()
}

/// JetStream answered that the stream does not exist (not a lost connection, not a
/// refusal).
pub(crate) fn stream_not_found(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        async_nats::jetstream::context::GetStreamErrorKind::JetStream(j)
            if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// A failed JetStream API request, kept with `action` as a [`NatsError`] inside
/// [`BrokerError::Other`] — or [`BrokerError::Unauthorized`] naming the subject when the
/// server reported refusing this user a subject of the same stream or consumer.
pub(crate) fn api<E>(action: impl Into<String>) -> impl FnOnce(E) -> BrokerError
where
    E: Into<BoxError>,
{
    let action = action.into();
    move |e| {
        let source = e.into();
        if let Some(subject) = violation_for(&action) {
            return BrokerError::Unauthorized {
                resource: format!("subject {subject}"),
                reason: format!(
                    "{action}: the server refused this user the subject (Permissions \
                     Violation), so the request got no answer; grant what `reliq topology \
                     permissions` prints"
                ),
                source: Some(source),
            };
        }
        BrokerError::Other(Box::new(NatsError::JetStream { action, source }))
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
    fn a_reported_violation_explains_a_failed_call_on_its_stream() {
        record_violation(
            r#"Permissions Violation for Publish to "$JS.API.STREAM.INFO.orders_violated""#,
        );
        let e =
            api("declaring source stream `orders_violated`")(std::io::Error::other("timed out"));
        assert!(
            matches!(&e, BrokerError::Unauthorized { resource, .. }
                if resource == "subject $JS.API.STREAM.INFO.orders_violated"),
            "{e:?}"
        );
        // Another stream's failure is not explained by it.
        let e = api("declaring source stream `orders_fine`")(std::io::Error::other("timed out"));
        assert!(matches!(e, BrokerError::Other(_)), "{e:?}");
    }

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
