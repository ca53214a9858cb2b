//! A poll thread's consumer and its fetch queue, and what keeps them alive as long as a
//! record they handed out.

use std::sync::Arc;

use rdkafka::consumer::{BaseConsumer, Consumer};
use reliq_core::{BrokerError, Message};

use super::rebalance::Ctx;
use crate::codec::decode;
use crate::fetch::{FetchQueue, Fetched, RecordOwner};

/// A poll thread's consumer and its fetch queue. The queue is declared first: it goes
/// before the consumer it refers to.
pub(super) struct ClientConsumer {
    pub(super) fetch: Arc<FetchQueue>,
    pub(super) consumer: BaseConsumer<Ctx>,
}

/// A poll thread's consumer, shared with every record it hands out.
///
/// librdkafka destroys a consumer only after all of its messages, and a delivery holds
/// its record until it is dropped (its message is decoded on demand,
/// [`LazyRecord`](crate::fetch::LazyRecord)) — possibly after the receiver is gone, if a
/// handler keeps it. So the poll thread *closes* its consumer when it stops (final
/// commit, group leave: nothing waits for the deliveries), and the handle *destroys* it
/// with the last reference, the poll thread's or a record's.
pub(super) struct ConsumerHandle {
    /// `None` only while dropping.
    pub(super) client: Option<ClientConsumer>,
    /// The consumer's topic (for the fallback id of a record without one).
    pub(super) topic: String,
}

impl ConsumerHandle {
    pub(super) fn get(&self) -> &ClientConsumer {
        self.client
            .as_ref()
            .expect("a consumer handle holds its consumer until it is dropped")
    }
}

impl RecordOwner for ConsumerHandle {
    fn decode(&self, record: &Fetched) -> Message {
        decode(record, &self.topic).message
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        // The last record went on a runtime thread: destroying a consumer joins
        // librdkafka's threads, which must not block a runtime worker.
        if tokio::runtime::Handle::try_current().is_ok() {
            let spawned = std::thread::Builder::new()
                .name("reliq-kafka-destroy".into())
                .spawn(move || drop(client));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no thread to destroy a kafka consumer on; it is leaked");
            }
        }
    }
}

impl ClientConsumer {
    pub(super) fn new(consumer: BaseConsumer<Ctx>) -> Result<Self, BrokerError> {
        // SAFETY: the handle is the consumer's, which `Self` drops after the queue.
        #[allow(unsafe_code)]
        let fetch = unsafe { FetchQueue::new(consumer.client().native_ptr()) }
            .map(Arc::new)
            .ok_or_else(|| BrokerError::Other("librdkafka could not make a queue".into()))?;
        let _ = consumer.context().fetch.set(Arc::downgrade(&fetch));
        Ok(Self { fetch, consumer })
    }
}
