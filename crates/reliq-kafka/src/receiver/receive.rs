//! The runtime's end of the stream: the chunks the poll threads send become deliveries.

use reliq_core::{BrokerError, Delivery, seam::lock};

use super::fetch::LazyRecord;
use super::flow::{buffer_bound, refill_room};
use super::shared::{Inbound, Record, Shared};

impl Shared {
    pub(super) async fn receive_batch(
        &self,
        max: usize,
        into: &mut Vec<Delivery>,
    ) -> Result<(), BrokerError> {
        let max = max.max(1);
        loop {
            if self.is_stopped() {
                return Err(BrokerError::Closed);
            }
            let mut inbound = self.inbound.lock().await;
            if inbound.ready.is_empty() {
                match inbound.rx.recv().await {
                    Some(chunk) => inbound.ready.extend(chunk),
                    // Every sender is gone.
                    None => return Err(BrokerError::Closed),
                }
            }
            // More chunks that are already there, without waiting.
            while inbound.ready.len() < max {
                match inbound.rx.try_recv() {
                    Ok(chunk) => inbound.ready.extend(chunk),
                    Err(_) => break,
                }
            }
            let Inbound { ready, kept, .. } = &mut *inbound;
            let taken = ready.len().min(max);
            if taken == 0 {
                // An empty chunk: a poll thread's wake-up on stop.
                continue;
            }
            // One lock for the batch: leave the buffer, count as busy on its partition —
            // or drop a record whose partition was revoked meanwhile (the new owner
            // reads it from the commit).
            {
                let mut s = lock(&self.state);
                s.queued = s.queued.saturating_sub(taken);
                let bound = buffer_bound(self.sub.prefetch);
                if s.room_wanted && bound.saturating_sub(s.queued) >= refill_room(bound) {
                    s.room_wanted = false;
                    self.room.notify_all();
                }
                for record in ready.drain(..taken) {
                    let current = record.info().is_some_and(|info| {
                        match s.parts.get_mut(&(info.client, info.partition)) {
                            Some(part) if part.generation == info.generation && !part.revoking => {
                                part.busy += 1;
                                true
                            }
                            _ => false,
                        }
                    });
                    if current {
                        kept.push(record);
                    }
                }
            }
            // Outside the state lock (the poll threads and settlements take it): the
            // records become deliveries, their messages decoded when first read.
            let kept_any = !kept.is_empty();
            into.extend(kept.drain(..).map(|r| self.delivery_of(r)));
            if kept_any {
                return Ok(());
            }
        }
    }

    /// A record as the runtime gets it: a fast-path record (source, see
    /// [`Shared::on_record`]) with its message decoded on demand.
    pub(super) fn delivery_of(&self, record: Record) -> Delivery {
        match record {
            Record::Ready(d) => *d,
            Record::Polled(p) => {
                let message = LazyRecord::new(p.message, p.owner);
                Delivery::raw(
                    Box::new(message),
                    self.origin(p.info),
                    p.info.token(self.owner),
                )
            }
        }
    }

    /// Drop every undecoded record of `client`'s consumer still in the inbound: nobody
    /// will take them (they are uncommitted: the partition's next owner reads them
    /// again), and each holds the consumer, which goes with the last of them. Runs after
    /// `stop`: a receive waiting for a chunk holds the inbound lock, so an empty chunk
    /// wakes it and it returns on seeing `stop`, releasing the lock.
    pub(super) fn purge_polled(&self, client: usize) {
        let _ = self.tx.send(Vec::new());
        let mut inbound = self.inbound.blocking_lock();
        let Inbound { rx, ready, kept } = &mut *inbound;
        while let Ok(chunk) = rx.try_recv() {
            ready.extend(chunk);
        }
        let other = |r: &Record| !matches!(r, Record::Polled(p) if p.info.client == client);
        let before = ready.len() + kept.len();
        ready.retain(other);
        kept.retain(other);
        let purged = before - ready.len() - kept.len();
        tracing::debug!(topic = %self.clients[client].topic, purged, "undecoded records dropped before the consumer closes");
    }
}
