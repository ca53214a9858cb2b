//! Settling a delivery: ack (its offset done, committed by the poll thread), retry (a
//! copy to the tier's retry topic, or in place in blocking mode), dead-letter, release.

use std::time::{Duration, SystemTime};

use reliq_core::{
    BrokerError, Delivery, Message,
    seam::{RetryRequest, headers, lock},
};

use super::shared::{Held, Record, Shared, State};
use super::token::TokenInfo;
use crate::client::route_produce;
use crate::codec::source_headers;

impl Shared {
    pub(super) fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        delivery.token().check(self.owner)?;
        self.finish(delivery);
        Ok(())
    }

    /// One lock for the batch; the offsets are committed with the poll thread's next
    /// service, like single acks.
    pub(super) fn ack_batch(&self, deliveries: &[Delivery]) -> Vec<(usize, BrokerError)> {
        let mut failed = Vec::new();
        let mut s = lock(&self.state);
        for (i, d) in deliveries.iter().enumerate() {
            match d.token().check(self.owner) {
                Ok(_) => self.finish_locked(&mut s, d),
                Err(e) => failed.push((i, e)),
            }
        }
        failed
    }

    pub(super) async fn retry(
        &self,
        delivery: &Delivery,
        retry: RetryRequest,
    ) -> Result<(), BrokerError> {
        delivery.token().check(self.owner)?;
        if let Some(info) = TokenInfo::of(delivery)
            && self.blocking(info.client)
        {
            return self.retry_in_place(delivery, info, retry);
        }
        self.still_held(delivery)?;
        let tiers = &self.sub.retry_tiers;
        let delay = tiers
            .get(retry.tier)
            .or(tiers.last())
            .ok_or(BrokerError::Unsupported {
                backend: "kafka",
                what: "retry without retry tiers (no retry topic declared)",
            })?;
        let topic = self.sub.retry_name(*delay);
        route_produce(
            &self.inner,
            &topic,
            &retry.message,
            &source_headers(delivery),
        )
        .await?;
        self.finish(delivery);
        Ok(())
    }

    pub(super) async fn dead_letter(
        &self,
        delivery: &Delivery,
        dead: Message,
    ) -> Result<(), BrokerError> {
        delivery.token().check(self.owner)?;
        self.still_held(delivery)?;
        let topic = self.sub.dead_letter_name();
        route_produce(&self.inner, &topic, &dead, &[]).await?;
        self.finish(delivery);
        Ok(())
    }

    pub(super) fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        delivery.token().check(self.owner)?;
        let Some(info) = TokenInfo::of(delivery) else {
            return Err(BrokerError::ForeignDelivery);
        };
        {
            let mut s = lock(&self.state);
            match s.parts.get_mut(&(info.client, info.partition)) {
                Some(part) if part.generation == info.generation => {
                    part.busy = part.busy.saturating_sub(1);
                    s.queued += 1;
                }
                // Revoked meanwhile: uncommitted, the new owner delivers it.
                _ => return Ok(()),
            }
        }
        // The offset stays unfinished (nothing is committed past it); hand the same
        // record out again after the delay.
        let tx = self.tx.clone();
        let again = delivery.clone();
        if delay.is_zero() {
            let _ = tx.send(vec![Record::Ready(Box::new(again))]);
        } else {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = tx.send(vec![Record::Ready(Box::new(again))]);
            });
        }
        Ok(())
    }

    /// Settle: the record is done (acked, retried or dead-lettered).
    /// A copy is produced only for a record whose partition this receiver still owns:
    /// after a revoke its new owner delivers it again, and a copy made here as well
    /// would be a second one. (The runtime sends a copy again while a retry or DLQ topic
    /// is unavailable; the partition can move meanwhile.)
    fn still_held(&self, d: &Delivery) -> Result<(), BrokerError> {
        let Some(info) = TokenInfo::of(d) else {
            return Err(BrokerError::ForeignDelivery);
        };
        // Checked before the generation: until the poll thread runs again after a
        // freeze, the state still says the partition is ours (see `frozen`).
        if let Some(silent) = self.frozen(info.client) {
            return Err(BrokerError::NotHeld(format!(
                "this consumer did not run for {silent:?}, longer than its group session;                  partition {} may be another member's, which delivers offset {} again",
                info.partition, info.offset
            )));
        }
        match lock(&self.state).parts.get(&(info.client, info.partition)) {
            Some(part) if part.generation == info.generation => Ok(()),
            _ => Err(BrokerError::NotHeld(format!(
                "partition {} was revoked; its new owner delivers offset {}",
                info.partition, info.offset
            ))),
        }
    }

    fn finish(&self, d: &Delivery) {
        self.finish_locked(&mut lock(&self.state), d);
    }

    /// [`Shared::finish`] under a lock the caller holds (one lock for a batch).
    fn finish_locked(&self, s: &mut State, d: &Delivery) {
        let Some(TokenInfo {
            client,
            partition,
            offset,
            generation,
        }) = TokenInfo::of(d)
        else {
            return;
        };
        match s.parts.get_mut(&(client, partition)) {
            Some(part) if part.generation == generation => {
                part.busy = part.busy.saturating_sub(1);
                part.tracker.complete(offset);
                if part.out {
                    // Blocking mode: the partition's next record, in order.
                    part.out = false;
                    let mut skipped = 0;
                    while let Some((next, d)) = part.waiting.pop_front() {
                        if part.tracker.handed_out(next) {
                            part.out = true;
                            self.send(vec![Record::Ready(Box::new(d))]);
                            break;
                        }
                        skipped += 1; // already seen (cannot happen in offset order)
                    }
                    s.queued = s.queued.saturating_sub(skipped);
                }
            }
            _ => tracing::debug!(
                partition,
                offset,
                "settled after its partition was revoked; the new owner may deliver it again"
            ),
        }
    }

    /// Blocking mode: hold the record (its partition paused, what was read past it
    /// dropped and read again later) and hand it out again after the policy's delay.
    /// The offset stays unfinished, so nothing past it is committed meanwhile.
    fn retry_in_place(
        &self,
        delivery: &Delivery,
        info: TokenInfo,
        retry: RetryRequest,
    ) -> Result<(), BrokerError> {
        let attempt = headers::attempt(retry.message.headers());
        let again = Delivery::new(
            retry.message,
            attempt,
            delivery.origin().clone(),
            info.token(self.owner),
        );
        let mut s = lock(&self.state);
        if let Some(part) = s.parts.get_mut(&(info.client, info.partition))
            && part.generation == info.generation
        {
            part.busy = part.busy.saturating_sub(1);
            part.hold(Held {
                due: SystemTime::now() + retry.delay,
                offset: info.offset,
                delivery: again,
            });
            part.rewind = true;
        }
        // Otherwise revoked meanwhile: uncommitted, the new owner delivers it.
        Ok(())
    }
}
