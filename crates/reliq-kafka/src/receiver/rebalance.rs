//! Rebalances, as the consumer context sees them: partitions about to be assigned are
//! routed to the fetch queue; assigned partitions get their state (the committed position
//! and the crash-loop counter); revoked ones are drained (up to `reliq.rebalance.drain.ms`)
//! and committed — unless the assignment was lost or the receiver crashed — then
//! forgotten.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::counter::parse_counter;
use super::shared::{Ctx, Part, Shared, State};
use reliq_core::seam::lock;

impl Ctx {
    /// Route the partitions about to be assigned to the fetch queue (before the
    /// assignment starts their fetch; see [`FetchQueue::route`]).
    fn route(&self, tpl: &TopicPartitionList) {
        if let Some(fetch) = self.fetch.get().and_then(Weak::upgrade) {
            for e in tpl.elements() {
                fetch.route(e.topic(), e.partition());
            }
        }
    }
}

impl ClientContext for Ctx {
    crate::oauth::oauth_token_requests!(tokens);
}

impl ConsumerContext for Ctx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                if let Some(shared) = self.shared.upgrade() {
                    let lost = consumer.assignment_lost();
                    shared.revoke(self.client, consumer, tpl, lost);
                }
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Assign(tpl) => self.route(tpl),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let (Rebalance::Assign(tpl), Some(shared)) = (rebalance, self.shared.upgrade()) {
            shared.assign(self.client, consumer, tpl);
        }
    }
}

impl Shared {
    /// Positions of `client`'s partitions that pass `keep`, as a list to commit.
    pub(super) fn positions(
        &self,
        s: &State,
        client: usize,
        keep: impl Fn(i32) -> bool,
    ) -> TopicPartitionList {
        let topic = &self.clients[client].topic;
        let mut tpl = TopicPartitionList::new();
        for ((c, p), part) in &s.parts {
            if *c != client || !keep(*p) {
                continue;
            }
            if let Some(pos) = part.tracker.position() {
                let _ = tpl.add_partition_offset(topic, *p, Offset::Offset(pos));
            }
        }
        tpl
    }

    fn assign(&self, client: usize, consumer: &BaseConsumer<Ctx>, tpl: &TopicPartitionList) {
        match consumer.committed_offsets(tpl.clone(), Duration::from_secs(10)) {
            Ok(committed) => self.start_parts(client, &committed),
            Err(e) => {
                tracing::warn!(error = %e, "reading committed offsets failed; delivery counter starts at 0");
                self.start_parts(client, tpl);
            }
        }
        tracing::debug!(topic = %self.clients[client].topic, partitions = tpl.count(), "partitions assigned");
    }

    /// A fresh state, with a new generation, for each of `client`'s partitions in
    /// `committed`: its committed position and crash-loop counter, when it has one.
    pub(super) fn start_parts(&self, client: usize, committed: &TopicPartitionList) {
        let mut s = lock(&self.state);
        for e in committed.elements() {
            let (head, head_count) = match e.offset() {
                Offset::Offset(o) => (Some(o), parse_counter(e.metadata())),
                _ => (None, None),
            };
            let generation = s.next_generation;
            s.next_generation += 1;
            s.parts.insert(
                (client, e.partition()),
                Part::new(generation, head, head_count),
            );
        }
        self.rebalances.fetch_add(1, Ordering::Release);
    }

    fn revoke(
        &self,
        client: usize,
        consumer: &BaseConsumer<Ctx>,
        tpl: &TopicPartitionList,
        lost: bool,
    ) {
        let revoked: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        // librdkafka keeps a partition's pause across a rebalance: paused here (flow
        // control, a relay's hold, a blocking retry) and assigned to this consumer
        // again, it would stay paused while its new `Part` says it is not — fetching
        // nothing for good (a chaos run stalled so after a lost assignment). Resumed
        // while still assigned; a new owner starts from the commit either way.
        let mut paused = TopicPartitionList::new();
        {
            let mut s = lock(&self.state);
            for p in &revoked {
                if let Some(part) = s.parts.get_mut(&(client, *p)) {
                    part.revoking = true;
                    if part.paused {
                        paused.add_partition(&self.clients[client].topic, *p);
                    }
                }
            }
        }
        if paused.count() > 0
            && let Err(e) = consumer.resume(&paused)
        {
            tracing::warn!(error = %e, partitions = paused.count(), "resuming paused partitions on revoke failed; they may stay paused if assigned here again");
        }
        self.rebalances.fetch_add(1, Ordering::Release);
        let crashed = self.crashed.load(Ordering::SeqCst);
        if !lost && !crashed {
            // Let in-flight records of the revoked partitions settle, then commit.
            let deadline = Instant::now() + self.inner.config.rebalance_drain;
            loop {
                let busy: usize = {
                    let s = lock(&self.state);
                    revoked
                        .iter()
                        .filter_map(|p| s.parts.get(&(client, *p)))
                        .map(|p| p.busy)
                        .sum()
                };
                // Draining is the poll thread at work, not a frozen process.
                self.alive(client);
                if busy == 0 || Instant::now() >= deadline {
                    if busy > 0 {
                        tracing::warn!(
                            busy,
                            "revoke: records still in flight; the new owner will redeliver them"
                        );
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let commit = {
                let s = lock(&self.state);
                self.positions(&s, client, |p| revoked.contains(&p))
            };
            if commit.count() > 0
                && let Err(e) = consumer.commit(&commit, CommitMode::Sync)
            {
                tracing::warn!(error = %e, "commit on revoke failed; done records may be redelivered");
            }
        }
        let mut s = lock(&self.state);
        for p in &revoked {
            s.parts.remove(&(client, *p));
        }
        self.rebalances.fetch_add(1, Ordering::Release);
        tracing::debug!(topic = %self.clients[client].topic, partitions = revoked.len(), lost, "partitions revoked");
    }
}
