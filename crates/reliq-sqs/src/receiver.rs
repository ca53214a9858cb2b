//! Receiving from a consumer queue (a background long poll bounded by the prefetch, a
//! visibility extender per delivery).

use reliq_core::{
    BrokerError, Delivery, Message, Origin, Subscription,
    seam::{DeliveryToken, Receiver, ReceiverId, Renewed, RetryRequest, lock},
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageSystemAttributeName;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::client::{Declared, whole_seconds};
use crate::error::sdk_error;
use crate::{client::SqsBroker, codec};

/// Deliveries received from SQS and not yet settled (buffered or handed out).
#[derive(Default)]
struct Counter {
    outstanding: AtomicU32,
    /// The leases of the messages held, by SQS message id: a second copy of one of them
    /// (SQS is at-least-once; moto can hand one message to two concurrent receives) adds
    /// its receipt handle to the held one instead of becoming a second delivery.
    held: Mutex<HashMap<String, Arc<Lease>>>,
    /// Signalled when a delivery is settled: the poller may ask for more.
    demand: Notify,
}

/// A delivery's lease: the extender renews it until `settled` is cancelled; `lock`
/// serialises a renewal with the settlement, so a late renewal never overrides a retry's
/// visibility.
struct Lease {
    settled: CancellationToken,
    lock: tokio::sync::Mutex<()>,
    /// Every receipt handle this receiver got for the message, the latest last: each is
    /// settled (SQS acts on the latest; an earlier one may still hold a copy hidden).
    receipts: Mutex<Vec<String>>,
    /// Until when the message is surely invisible to other consumers: from the start of
    /// the receive (or renewal) that hid it, plus its visibility timeout. Past it — the
    /// process was frozen, or renewals failed — SQS may have handed the message to
    /// another consumer, and a retry or dead-letter copy made here would be a second one.
    hidden_until: Mutex<Instant>,
}

impl Lease {
    fn receipts(&self) -> Vec<String> {
        lock(&self.receipts).clone()
    }

    fn latest(&self) -> Option<String> {
        lock(&self.receipts).last().cloned()
    }

    /// The message was hidden again by a receive that started at `asked`.
    fn hidden(&self, asked: Instant, for_: Duration) {
        let mut until = lock(&self.hidden_until);
        *until = (*until).max(asked + for_);
    }

    /// A renewal that started at `asked` succeeded. It counts only if its answer came
    /// before the lease ran out: SQS applied it before then, so the message stayed hidden
    /// throughout. A later success proves nothing (SQS may accept an earlier receipt
    /// handle after handing the message to another consumer), and the lease stays lost.
    fn renewed(&self, asked: Instant, for_: Duration) -> bool {
        let mut until = lock(&self.hidden_until);
        if Instant::now() >= *until {
            return false;
        }
        *until = (*until).max(asked + for_);
        true
    }

    /// `NotHeld` once the visibility timeout ran out (see [`Lease::hidden_until`]).
    fn check_hidden(&self) -> Result<(), BrokerError> {
        let until = *lock(&self.hidden_until);
        let now = Instant::now();
        if now < until {
            return Ok(());
        }
        Err(BrokerError::NotHeld(format!(
            "its visibility timeout ran out {:?} ago (the lease was not renewed: a frozen \
             process or failed renewals); SQS hands the message out again",
            now - until
        )))
    }
}

/// The settlement handle kept in each delivery's token.
struct SqsToken {
    /// The SQS message id (the key of [`Counter::held`]).
    sqs_id: String,
    /// FIFO queues: the message's `MessageGroupId`.
    group: Option<String>,
    lease: Arc<Lease>,
    done: AtomicBool,
    counter: Arc<Counter>,
}

impl SqsToken {
    /// No longer held by this receiver (settled, or given up).
    fn finish(&self) {
        self.lease.settled.cancel();
        if !self.done.swap(true, Ordering::AcqRel) {
            lock(&self.counter.held).remove(&self.sqs_id);
            self.counter.outstanding.fetch_sub(1, Ordering::AcqRel);
            self.counter.demand.notify_one();
        }
    }

    /// Stop the extender and wait for a renewal in progress.
    /// Settle with `op` under the lease's lock (no renewal runs meanwhile, none follows a
    /// settlement with a stale receipt); renewals stop only if `op` succeeded. A retry or
    /// dead-letter that failed leaves the delivery leased: the runtime holds it and tries
    /// again (a stopped renewal would let SQS hand it out again meanwhile).
    async fn settle_leased(
        &self,
        op: impl std::future::Future<Output = Result<(), BrokerError>>,
    ) -> Result<(), BrokerError> {
        let _guard = self.lease.lock.lock().await;
        op.await?;
        self.lease.settled.cancel();
        Ok(())
    }

    async fn stop_extending(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.lease.settled.cancel();
        self.lease.lock.lock().await
    }
}

impl Drop for SqsToken {
    fn drop(&mut self) {
        // A delivery dropped unsettled: SQS hands it out again after its visibility timeout.
        self.finish();
    }
}

/// The SQS part of a delivery's token (its receiver is checked at the seam).
fn token(d: &Delivery) -> Result<&SqsToken, BrokerError> {
    d.token()
        .extra::<SqsToken>()
        .ok_or(BrokerError::ForeignDelivery)
}

struct Shared {
    /// Stamped on every delivery's token; settling checks it.
    owner: ReceiverId,
    broker: SqsBroker,
    sub: Subscription,
    declared: Declared,
    buffer: Mutex<VecDeque<Delivery>>,
    /// FIFO queues: per message group, whether one of its messages is with the runtime,
    /// and the group's later messages received meanwhile (see [`Groups`]).
    groups: Mutex<Groups>,
    ready: Notify,
    counter: Arc<Counter>,
    closed: CancellationToken,
    error: Mutex<Option<BrokerError>>,
}

impl Shared {
    async fn change_visibility(&self, receipt: &str, seconds: i32) -> Result<(), BrokerError> {
        change_visibility(&self.broker, &self.declared.url, receipt, seconds).await
    }

    /// Change the visibility of every copy `t` holds; the latest receipt's result (an
    /// earlier one's copy may be gone already, which is no error).
    async fn change_visibility_all(&self, t: &SqsToken, seconds: i32) -> Result<(), BrokerError> {
        let receipts = t.lease.receipts();
        let results =
            futures::future::join_all(receipts.iter().map(|r| self.change_visibility(r, seconds)))
                .await;
        latest_result(results)
    }

    /// Delete every copy `t` holds; the latest receipt's result.
    async fn delete_all(&self, t: &SqsToken) -> Result<(), BrokerError> {
        let receipts = t.lease.receipts();
        let results = futures::future::join_all(
            receipts
                .iter()
                .map(|r| self.broker.delete(&self.declared.url, r)),
        )
        .await;
        latest_result(results)
    }

    /// A received message as a delivery (`asked`: when its receive request started).
    fn convert(&self, m: &aws_sdk_sqs::types::Message, asked: Instant) -> Option<Delivery> {
        let receipt = m.receipt_handle()?.to_owned();
        let sqs_id = m.message_id().unwrap_or(&receipt).to_owned();
        let visibility =
            Duration::from_secs(whole_seconds(self.sub.lease).max(1).unsigned_abs().into());
        let mut held = lock(&self.counter.held);
        if let Some(lease) = held.get(&sqs_id) {
            // A second copy of a message this receiver holds: settled with it, not
            // handed out again.
            tracing::debug!(sqs_message_id = %sqs_id, "a second copy of a held message; settled with the first");
            lock(&lease.receipts).push(receipt);
            lease.hidden(asked, visibility);
            return None;
        }
        let (attempt, sent) = system_attributes(m);
        let group = m
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .cloned();
        let decoded = codec::decode(
            m.body(),
            m.message_attributes(),
            m.message_id().unwrap_or(&receipt),
        );
        self.counter.outstanding.fetch_add(1, Ordering::AcqRel);
        let lease = Arc::new(Lease {
            settled: self.closed.child_token(),
            lock: tokio::sync::Mutex::new(()),
            receipts: Mutex::new(vec![receipt]),
            hidden_until: Mutex::new(asked + visibility),
        });
        held.insert(sqs_id.clone(), lease.clone());
        drop(held);
        extend(
            self.broker.clone(),
            self.declared.url.clone(),
            lease.clone(),
            self.sub.lease,
        );
        let origin = Origin {
            destination: self.sub.source.as_str().into(),
            route: decoded.route,
            ..Origin::default()
        };
        let token = DeliveryToken::new(self.owner, 0).with_extra(SqsToken {
            sqs_id,
            group,
            lease,
            done: AtomicBool::new(false),
            counter: self.counter.clone(),
        });
        Some(match sent {
            Some(sent) => {
                Delivery::with_published_at(decoded.message, attempt, origin, token, sent)
            }
            None => Delivery::new(decoded.message, attempt, origin, token),
        })
    }

    /// Give back every delivery received but not handed out.
    async fn release_buffered(&self) {
        let mut left: Vec<Delivery> = lock(&self.buffer).drain(..).collect();
        left.extend(self.lock_groups().drain_all());
        self.give_back(left).await;
    }

    /// Make `deliveries` visible again at once (they were received, never handed out).
    async fn give_back(&self, deliveries: Vec<Delivery>) {
        let releases = deliveries.iter().filter_map(|d| token(d).ok()).map(|t| async move {
            let _guard = t.stop_extending().await;
            if let Err(e) = self.change_visibility_all(t, 0).await {
                tracing::debug!(error = %e, "releasing a buffered delivery failed; it returns after its lease");
            }
            t.finish();
        });
        futures::future::join_all(releases).await;
    }

    fn lock_groups(&self) -> std::sync::MutexGuard<'_, Groups> {
        lock(&self.groups)
    }

    /// A FIFO group's message was settled for good (deleted): the group's messages
    /// received meanwhile go to the front of the buffer, in order, so the next one is
    /// handed out next.
    fn group_done(&self, t: &SqsToken) {
        let Some(group) = &t.group else { return };
        let waiting = self.lock_groups().release(group);
        if waiting.is_empty() {
            return;
        }
        let mut buffer = lock(&self.buffer);
        for d in waiting.into_iter().rev() {
            buffer.push_front(d);
        }
        drop(buffer);
        self.ready.notify_one();
    }

    /// A FIFO group's message goes back to SQS (retry, release): the group's later
    /// messages this receiver holds go back too, so SQS hands the group out again in
    /// order, starting with that message (SQS holds the group while it is invisible).
    async fn group_returned(&self, t: &SqsToken) {
        let Some(group) = &t.group else { return };
        let mut back: Vec<Delivery> = self.lock_groups().release(group).into();
        back.extend({
            let mut buffer = lock(&self.buffer);
            let (same, other): (VecDeque<Delivery>, VecDeque<Delivery>) = buffer
                .drain(..)
                .partition(|d| token(d).ok().and_then(|t| t.group.as_ref()) == Some(group));
            *buffer = other;
            same
        });
        self.give_back(back).await;
    }
}

/// FIFO message groups in this receiver: one message per group with the runtime at a
/// time. SQS returns several messages of a group in one receive; handing them all out
/// would let a later one run while an earlier one waits for its retry.
#[derive(Default)]
struct Groups {
    /// Groups with a message handed out and not settled, and what waits behind it.
    busy: HashMap<String, VecDeque<Delivery>>,
}

impl Groups {
    /// Whether `d` may be handed out now (its group is free; it is marked busy), or
    /// was queued behind its group's message (`Some(d)` is returned when it may go).
    fn admit(&mut self, d: Delivery) -> Option<Delivery> {
        let Some(group) = token(&d).ok().and_then(|t| t.group.clone()) else {
            return Some(d);
        };
        match self.busy.get_mut(&group) {
            Some(waiting) => {
                waiting.push_back(d);
                None
            }
            None => {
                self.busy.insert(group, VecDeque::new());
                Some(d)
            }
        }
    }

    /// The group's handed-out message is settled: the group is free again; returns
    /// what waited behind it, in order.
    fn release(&mut self, group: &str) -> VecDeque<Delivery> {
        self.busy.remove(group).unwrap_or_default()
    }

    fn drain_all(&mut self) -> Vec<Delivery> {
        self.busy.drain().flat_map(|(_, w)| w).collect()
    }
}

pub(crate) fn system_attributes(m: &aws_sdk_sqs::types::Message) -> (u32, Option<SystemTime>) {
    let attrs = m.attributes();
    let get = |name: &MessageSystemAttributeName| attrs.and_then(|a| a.get(name));
    let attempt = get(&MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let sent = get(&MessageSystemAttributeName::SentTimestamp)
        .and_then(|v| v.parse::<u64>().ok())
        .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
    (attempt, sent)
}

async fn change_visibility(
    broker: &SqsBroker,
    url: &str,
    receipt: &str,
    seconds: i32,
) -> Result<(), BrokerError> {
    broker
        .inner
        .client
        .change_message_visibility()
        .queue_url(url)
        .receipt_handle(receipt)
        .visibility_timeout(seconds)
        .send()
        .await
        .map_err(|e| sdk_error("ChangeMessageVisibility", e))?;
    Ok(())
}

/// Renew a delivery's lease every lease/3 until it is settled, the receiver is gone, or
/// the maximum extension is reached.
fn extend(broker: SqsBroker, url: String, lease: Arc<Lease>, every: Duration) {
    let seconds = whole_seconds(every).max(1);
    let max = broker.inner.options.max_lease_extension;
    let settled = lease.settled.clone();
    reliq_core::seam::keep_leased(settled, every / 3, Some(max), move || {
        let (broker, url, lease) = (broker.clone(), url.clone(), lease.clone());
        async move {
            // Held across the renewal: settling waits for it, so no renewal follows a
            // delete with a stale receipt.
            let _guard = lease.lock.lock().await;
            if lease.settled.is_cancelled() {
                return Renewed::Stop;
            }
            // The latest receipt: SQS renews only through the latest receive's handle.
            let Some(receipt) = lease.latest() else {
                return Renewed::Stop;
            };
            // A lease that ran out (the process was frozen past it) is not renewed: SQS
            // may have handed the message out again, and a renewal would hide that.
            if let Err(lost) = lease.check_hidden() {
                tracing::warn!(error = %lost, "not renewing a lease that ran out");
                return Renewed::Stop;
            }
            let asked = Instant::now();
            match change_visibility(&broker, &url, &receipt, seconds).await {
                Ok(())
                    if lease.renewed(asked, Duration::from_secs(seconds.unsigned_abs().into())) =>
                {
                    Renewed::Yes
                }
                Ok(()) => {
                    tracing::warn!(
                        "a lease renewal was answered after the lease ran out; treated as lost"
                    );
                    Renewed::Stop
                }
                Err(e) => {
                    tracing::warn!(error = %e, "renewing a lease failed; SQS may deliver the message again");
                    Renewed::Stop
                }
            }
        }
    });
}

/// The background long poll: asks for at most `min(10, prefetch − outstanding)` messages,
/// so what this receiver holds (buffered + handed out) never exceeds the prefetch.
async fn poll(shared: Arc<Shared>) {
    let options = &shared.broker.inner.options;
    // At most half the lease: a poll still open when the consumer dies ends before the
    // dead consumer's deliveries (renewed every lease/3) become visible again.
    let wait = whole_seconds(options.wait_time.min(Duration::from_secs(20)))
        .min(whole_seconds(shared.sub.lease) / 2);
    let mut failures: u32 = 0;
    loop {
        if shared.closed.is_cancelled() {
            break;
        }
        let held = shared.counter.outstanding.load(Ordering::Acquire);
        let want = shared.sub.prefetch.saturating_sub(held).min(10);
        // Refill in batches (each receive is a round trip): wait until at least half a
        // batch is free, or everything is (nothing held, nothing to wait for).
        let threshold = (shared.sub.prefetch.min(10) / 2).max(1);
        if want == 0 || (want < threshold && held > 0) {
            tokio::select! {
                _ = shared.counter.demand.notified() => continue,
                _ = shared.closed.cancelled() => break,
            }
        }
        let asked = Instant::now();
        let result = shared
            .broker
            .inner
            .client
            .receive_message()
            .queue_url(&shared.declared.url)
            .max_number_of_messages(i32::try_from(want).unwrap_or(10))
            .wait_time_seconds(wait)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .send()
            .await;
        match result {
            Ok(out) => {
                failures = 0;
                let messages = out.messages();
                if shared.closed.is_cancelled() {
                    // Closed while polling: give these back at once.
                    for m in messages {
                        if let Some(receipt) = m.receipt_handle() {
                            let _ = shared.change_visibility(receipt, 0).await;
                        }
                    }
                    break;
                }
                let mut got = 0;
                for m in messages {
                    if let Some(d) = shared.convert(m, asked) {
                        lock(&shared.buffer).push_back(d);
                        got += 1;
                    }
                }
                if got > 0 {
                    shared.ready.notify_one();
                } else if wait == 0 {
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                        _ = shared.closed.cancelled() => break,
                    }
                }
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let e = sdk_error("ReceiveMessage", e);
                let pause = Duration::from_millis(100)
                    .saturating_mul(2u32.saturating_pow(failures.min(6)))
                    .min(Duration::from_secs(5));
                tracing::warn!(error = %e, retry_in = ?pause, "receiving from SQS failed");
                *lock(&shared.error) = Some(e);
                shared.ready.notify_one();
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = shared.closed.cancelled() => break,
                }
            }
        }
    }
    shared.release_buffered().await;
}

/// Receives from one consumer queue.
pub(crate) struct SqsReceiver {
    shared: Arc<Shared>,
}

impl SqsReceiver {
    pub(crate) fn start(broker: SqsBroker, sub: Subscription, declared: Declared) -> Self {
        let shared = Arc::new(Shared {
            owner: ReceiverId::next(),
            broker,
            sub,
            declared,
            buffer: Mutex::new(VecDeque::new()),
            groups: Mutex::new(Groups::default()),
            ready: Notify::new(),
            counter: Arc::new(Counter::default()),
            closed: CancellationToken::new(),
            error: Mutex::new(None),
        });
        tokio::spawn(poll(shared.clone()));
        Self { shared }
    }

    #[cfg(not(feature = "test-util"))]
    fn retry_broken(&self) -> bool {
        false
    }

    #[cfg(feature = "test-util")]
    fn retry_broken(&self) -> bool {
        self.shared
            .broker
            .inner
            .options
            .faults
            .as_ref()
            .is_some_and(|f| f.retry_broken(&self.shared.sub.consumer))
    }
}

impl SqsReceiver {
    /// The oldest message the pollers buffered, if any.
    fn pop_buffered(&self) -> Option<Delivery> {
        lock(&self.shared.buffer).pop_front()
    }
}

#[async_trait]
impl Receiver for SqsReceiver {
    async fn receive(&self) -> Result<Delivery, BrokerError> {
        loop {
            let notified = self.shared.ready.notified();
            if let Some(d) = self.pop_buffered() {
                match self.shared.lock_groups().admit(d) {
                    Some(d) => return Ok(d),
                    None => continue, // waits behind its FIFO group's message
                }
            }
            if let Some(e) = lock(&self.shared.error).take() {
                return Err(e);
            }
            if self.shared.closed.is_cancelled() {
                return Err(BrokerError::Closed);
            }
            tokio::select! {
                _ = notified => {}
                _ = self.shared.closed.cancelled() => {}
            }
        }
    }

    /// One delivery (waiting), then what the pollers already buffered, never waiting.
    async fn receive_batch(&self, max: usize, into: &mut Vec<Delivery>) -> Result<(), BrokerError> {
        into.push(self.receive().await?);
        for _ in 1..max {
            let Some(d) = self.pop_buffered() else { break };
            // `None`: held back behind its FIFO group's message, handed out later.
            if let Some(d) = self.shared.lock_groups().admit(d) {
                into.push(d);
            }
        }
        Ok(())
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), BrokerError> {
        delivery.token().check(self.shared.owner)?;
        let t = token(delivery)?;
        let _guard = t.stop_extending().await;
        let result = self.shared.delete_all(t).await;
        // Settled either way: a failed delete comes back after the visibility timeout.
        t.finish();
        match &result {
            Ok(()) => self.shared.group_done(t),
            // It will be received again, ahead of its group's later messages.
            Err(_) => self.shared.group_returned(t).await,
        }
        result
    }

    async fn retry(&self, delivery: &Delivery, retry: RetryRequest) -> Result<(), BrokerError> {
        delivery.token().check(self.shared.owner)?;
        let t = token(delivery)?;
        t.lease.check_hidden()?;
        if self.retry_broken() {
            return Err(BrokerError::connection(
                "retry route broken (fault injection)",
            ));
        }
        t.settle_leased(
            self.shared
                .change_visibility_all(t, whole_seconds(retry.delay)),
        )
        .await?;
        t.finish();
        self.shared.group_returned(t).await;
        Ok(())
    }

    async fn dead_letter(&self, delivery: &Delivery, dead: Message) -> Result<(), BrokerError> {
        delivery.token().check(self.shared.owner)?;
        let t = token(delivery)?;
        // No copy for a message SQS may have handed to another consumer already.
        t.lease.check_hidden()?;
        let encoded = codec::encode(&dead, delivery.origin().route.as_deref())?;
        // The copy is confirmed before the source is deleted.
        self.shared
            .broker
            .send(
                &self.shared.declared.dead_letter_url,
                &encoded,
                &dead,
                // Never the id alone: a message dead-lettered again within 5 minutes
                // (after a replay) would be dropped by a FIFO DLQ's deduplication and
                // then deleted from the source — lost.
                &format!("{}-dlq-{}", dead.id(), unique_suffix()),
            )
            .await?;
        // The check and the send are not one step: a process frozen in between (or a
        // send slower than what was left of the lease) lands a copy after SQS may have
        // handed the message to another consumer, which parks it too. Said, so an
        // operator counting DLQ entries knows which one may be there twice.
        if let Err(late) = t.lease.check_hidden() {
            tracing::warn!(id = %dead.id(), reason = %late, "the dead-letter copy landed after the lease ran out: the message may be parked twice");
        }
        t.settle_leased(self.shared.delete_all(t)).await?;
        t.finish();
        self.shared.group_done(t);
        Ok(())
    }

    async fn release(&self, delivery: &Delivery, delay: Duration) -> Result<(), BrokerError> {
        delivery.token().check(self.shared.owner)?;
        let t = token(delivery)?;
        let _guard = t.stop_extending().await;
        let result = self
            .shared
            .change_visibility_all(t, whole_seconds(delay))
            .await;
        t.finish();
        self.shared.group_returned(t).await;
        result
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.shared.closed.cancel();
        self.shared.release_buffered().await;
        Ok(())
    }
}

impl Drop for SqsReceiver {
    fn drop(&mut self) {
        // Stops the poller (which gives back what it buffered) and every extender:
        // unsettled deliveries come back after their visibility timeout.
        self.shared.closed.cancel();
    }
}

/// The last result (the latest receipt's); earlier receipts' failures are only logged.
fn latest_result(mut results: Vec<Result<(), BrokerError>>) -> Result<(), BrokerError> {
    let latest = results.pop().unwrap_or(Ok(()));
    for e in results.into_iter().filter_map(Result::err) {
        tracing::debug!(error = %e, "settling an earlier copy's receipt failed (the copy is gone)");
    }
    latest
}

/// Nanoseconds since the epoch: makes a deduplication id unique per send.
pub(crate) fn unique_suffix() -> u128 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
