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
    match &e {
        SdkError::ServiceError(_) => {
            let code = e.code().unwrap_or("unknown").to_owned();
            let message = e.message().unwrap_or_default().to_owned();
            if is_missing_queue(&code) {
                return BrokerError::Unroutable(format!("{operation}: {message}"));
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

fn is_missing_queue(code: &str) -> bool {
    code == "AWS.SimpleQueueService.NonExistentQueue" || code == "QueueDoesNotExist"
}
