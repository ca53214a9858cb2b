//! Errors of the SQS backend and the conversion of the SDK's errors into reliq's.

use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use reliq_core::BrokerError;

/// Errors of the SQS backend (carried inside [`BrokerError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqsError {
    /// SQS answered with an error.
    #[error("SQS {operation} failed: {code}: {message}")]
    Service {
        /// The API operation.
        operation: &'static str,
        /// The error code.
        code: String,
        /// The error message.
        message: String,
    },
    /// A queue SQS should have returned is missing from its answer.
    #[error("SQS {operation} returned no {what}")]
    Incomplete {
        /// The API operation.
        operation: &'static str,
        /// What was missing.
        what: &'static str,
    },
}

pub(crate) fn sdk_error<E, R>(operation: &'static str, e: SdkError<E, R>) -> BrokerError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    // Resolving the credentials failed before anything was sent (the SDK reports it as
    // a dispatch failure, which would read as a transient connection problem).
    if let Some(c) = crate::credentials::credentials_error(&e) {
        return crate::credentials::credentials_failure(operation, c);
    }
    match &e {
        SdkError::ServiceError(_) => {
            let code = e.code().unwrap_or("unknown").to_owned();
            let message = e.message().unwrap_or_default().to_owned();
            if is_missing_queue(&code) {
                return BrokerError::Unroutable(format!("{operation}: {message}"));
            }
            if is_refusal(&code) {
                return BrokerError::Unauthorized {
                    resource: format!("SQS {operation}"),
                    reason: format!("{code}: {message}"),
                    source: None,
                };
            }
            BrokerError::Other(Box::new(SqsError::Service {
                operation,
                code,
                message,
            }))
        }
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            BrokerError::connection(format!("SQS {operation}: {}", DisplayErrorContext(&e)))
                .caused_by(e)
        }
        _ => BrokerError::Other(Box::new(e)),
    }
}

/// Codes of a request AWS refused for who signed it: a missing permission, keys it does
/// not know, a wrong secret, an expired session.
fn is_refusal(code: &str) -> bool {
    matches!(
        code,
        "AccessDenied"
            | "AccessDeniedException"
            | "AWS.SimpleQueueService.AccessDenied"
            | "InvalidClientTokenId"
            | "UnrecognizedClientException"
            | "SignatureDoesNotMatch"
            | "IncompleteSignature"
            | "MissingAuthenticationToken"
            | "ExpiredToken"
            | "InvalidSecurity"
    )
}

fn is_missing_queue(code: &str) -> bool {
    code == "AWS.SimpleQueueService.NonExistentQueue" || code == "QueueDoesNotExist"
}
