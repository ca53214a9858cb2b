use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::classify::BoxError;
use crate::delivery::Delivery;

/// The deliveries of one batch handler call, in the order the broker handed them out.
/// Cheap to clone (shared).
///
/// Batch handlers: one handler call for many deliveries.
///
/// A per-message handler pays the runtime's per-message costs (a task, a settlement, a
/// span) once per message. Where the broker hands out records by the thousand (Kafka) and
/// the work batches naturally (a bulk insert, one HTTP call for many items), a batch
/// handler gets up to [`ConsumerBuilder::batch_size`](crate::consumer::ConsumerBuilder::batch_size)
/// deliveries in one call and the runtime settles the successes with one
/// [`Receiver::ack_batch`](crate::broker::Receiver::ack_batch).
///
/// Failures stay per message: the handler names the deliveries that failed
/// ([`BatchError::fail`]), or fails the whole batch ([`BatchError::all`]); each failed
/// delivery then goes through the same classification, retry and dead-letter path as a
/// per-message failure, and the others are acknowledged. A batch is whatever the broker
/// had ready when the runtime asked (never waiting to fill up), so under light load
/// batches are small and latency stays that of single messages.
///
/// ```
/// use reliq_core::{Batch, BatchError, Consumer, Poison};
/// # async fn demo(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), Box<dyn std::error::Error>> {
/// let handle = Consumer::builder(broker, "indexer")
///     .subscribe("orders")
///     .batch_size(256)
///     .start_batch(|batch: Batch| async move {
///         let mut failed = BatchError::new();
///         let mut rows = Vec::with_capacity(batch.len());
///         for (i, d) in batch.iter().enumerate() {
///             match d.text() {
///                 Ok(text) => rows.push(text.to_owned()),
///                 Err(e) => failed.fail(i, e),           // poison: this one to the DLQ
///             }
///         }
///         // … one bulk write of `rows`; `?` on its error fails the whole batch …
///         failed.into_result()
///     })
///     .await?;
/// # handle.shutdown().await; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Batch(Arc<Vec<Delivery>>);

impl Batch {
    pub(crate) fn new(deliveries: Arc<Vec<Delivery>>) -> Self {
        Self(deliveries)
    }
}

impl Deref for Batch {
    type Target = [Delivery];

    fn deref(&self) -> &[Delivery] {
        &self.0
    }
}

impl<'a> IntoIterator for &'a Batch {
    type Item = &'a Delivery;
    type IntoIter = std::slice::Iter<'a, Delivery>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// What failed in a batch: every delivery ([`BatchError::all`], also what `?` on any
/// error gives), or the ones named by index ([`BatchError::fail`]). Deliveries not named
/// are done and acknowledged.
pub struct BatchError(pub(crate) Failed);

pub(crate) enum Failed {
    All(BoxError),
    Some(Vec<(usize, BoxError)>),
}

impl BatchError {
    /// No failure yet; name failed deliveries with [`BatchError::fail`].
    pub fn new() -> Self {
        Self(Failed::Some(Vec::new()))
    }

    /// Every delivery of the batch failed with `error` (classified once, then retried or
    /// dead-lettered one by one).
    pub fn all(error: impl Into<BoxError>) -> Self {
        Self(Failed::All(error.into()))
    }

    /// The delivery at `index` (its position in the [`Batch`]) failed with `error`. After
    /// [`BatchError::all`] this changes nothing: everything failed already.
    pub fn fail(&mut self, index: usize, error: impl Into<BoxError>) {
        if let Failed::Some(list) = &mut self.0 {
            list.push((index, error.into()));
        }
    }

    /// [`BatchError::fail`], chained.
    pub fn with(mut self, index: usize, error: impl Into<BoxError>) -> Self {
        self.fail(index, error);
        self
    }

    /// True when no delivery is named as failed (and not [`BatchError::all`]).
    pub fn is_empty(&self) -> bool {
        matches!(&self.0, Failed::Some(list) if list.is_empty())
    }

    /// `Ok(())` when nothing failed, otherwise `Err(self)`: the handler's return value.
    pub fn into_result(self) -> Result<(), Self> {
        if self.is_empty() { Ok(()) } else { Err(self) }
    }
}

impl Default for BatchError {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Failed::All(e) => f.debug_tuple("BatchError::All").field(e).finish(),
            Failed::Some(list) => f.debug_tuple("BatchError::Some").field(list).finish(),
        }
    }
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Failed::All(e) => write!(f, "the whole batch failed: {e}"),
            Failed::Some(list) => write!(f, "{} deliveries of the batch failed", list.len()),
        }
    }
}

/// `?` on an error inside a batch handler fails the whole batch.
impl<E: std::error::Error + Send + Sync + 'static> From<E> for BatchError {
    fn from(error: E) -> Self {
        Self::all(error)
    }
}
