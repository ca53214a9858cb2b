//! A member that was frozen (the process stopped by SIGSTOP, a paused VM or container, a
//! stall of the whole host) for longer than its group session comes back as a *zombie*:
//! the coordinator gave its partitions to another member meanwhile, but until librdkafka
//! serves the lost assignment on a poll, this receiver still thinks it owns them. Left
//! alone, the deliveries it held — in handlers, in the runtime's buffer, in librdkafka's
//! fetch queue — would be settled as if nothing happened: a retry or dead-letter copy for
//! a record the new owner delivers too (the DLQ holds it twice).
//!
//! The fence: each poll thread stamps when it last ran ([`Shared::alive`]). A settlement
//! that finds its poll thread silent for longer than `session.timeout.ms` makes no copy
//! ([`Shared::frozen`], answered `NotHeld`); the poll thread, on its first pass after such
//! a gap, starts every partition of its consumer over — new generations (so every
//! delivery handed out before is refused the same way), read again from the committed
//! offsets ([`Shared::restart_after_freeze`]). Whatever the group decided, nothing is
//! lost: the partition's owner — the new member, or this one if it kept it — delivers
//! those records again (the inbox absorbs a second handling).
//!
//! What the fence cannot undo: a copy that was already produced when the process froze
//! (confirmed after the thaw, or sitting in the producer's queue) lands, and the owner
//! makes its own. So after a freeze the DLQ or a retry topic can hold a record twice, at
//! most once per delivery the frozen member held. Closing that window needs the copy and
//! the offset commit in one Kafka transaction, fenced by the group generation.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq_core::seam::lock;

use super::shared::{Ctx, Shared};

/// How long `committed_offsets` may take when the partitions restart.
const COMMITTED_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a seek may wait to be applied.
const SEEK_TIMEOUT: Duration = Duration::from_millis(100);

impl Shared {
    /// Since `client`'s poll thread last stamped [`Shared::alive`].
    fn silent_for(&self, client: usize) -> Duration {
        let last = Duration::from_millis(self.alive_at[client].load(Ordering::Acquire));
        self.epoch.elapsed().saturating_sub(last)
    }

    /// `client`'s poll thread is running: stamp it.
    pub(super) fn alive(&self, client: usize) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.alive_at[client].store(now, Ordering::Release);
    }

    /// `client`'s poll thread has been silent for longer than the group session: the
    /// member may have lost its partitions without knowing it yet. `Some(silence)` then.
    pub(super) fn frozen(&self, client: usize) -> Option<Duration> {
        let silent = self.silent_for(client);
        (silent > self.session_timeout).then_some(silent)
    }

    /// The poll thread's pass begins: after a silence longer than the session, restart
    /// the consumer's partitions (see the module docs); then stamp.
    pub(super) fn pass_begins(&self, client: usize, consumer: &BaseConsumer<Ctx>) {
        if let Some(silent) = self.frozen(client) {
            self.restart_after_freeze(client, consumer, silent);
        }
        self.alive(client);
    }

    /// New generations for `client`'s partitions, read again from the committed offsets.
    /// If the committed offsets cannot be read, nothing changes (a new generation without
    /// a seek would commit past records handed out before it): the settlements refused
    /// meanwhile are delivered again after the next rebalance.
    fn restart_after_freeze(&self, client: usize, consumer: &BaseConsumer<Ctx>, silent: Duration) {
        let topic = self.clients[client].topic.as_str();
        let mut held = TopicPartitionList::new();
        let mut paused = TopicPartitionList::new();
        {
            let s = lock(&self.state);
            for ((c, p), part) in &s.parts {
                if *c == client && !part.revoking {
                    held.add_partition(topic, *p);
                    if part.paused {
                        paused.add_partition(topic, *p);
                    }
                }
            }
        }
        if held.count() == 0 {
            return;
        }
        let committed = match consumer.committed_offsets(held.clone(), COMMITTED_TIMEOUT) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(topic, error = %e, ?silent, "this consumer was frozen past its group session and cannot read its committed offsets; its partitions are not restarted");
                return;
            }
        };
        tracing::warn!(
            topic,
            ?silent,
            session = ?self.session_timeout,
            partitions = held.count(),
            "this consumer did not run for longer than its group session (frozen?): its \
             partitions may be another member's now; what it held is not settled here, and \
             it reads again from the committed offsets"
        );
        // A new `Part` says "not paused": resume what librdkafka keeps paused (as a
        // revoke does), or the partition would fetch nothing for good.
        if paused.count() > 0
            && let Err(e) = consumer.resume(&paused)
        {
            tracing::warn!(topic, error = %e, "resuming partitions after a freeze failed");
        }
        self.start_parts(client, &committed);
        for e in committed.elements() {
            let from = match e.offset() {
                Offset::Offset(o) => Offset::Offset(o),
                // Nothing committed: `auto.offset.reset` is earliest.
                _ => Offset::Beginning,
            };
            if let Err(err) = consumer.seek(topic, e.partition(), from, SEEK_TIMEOUT) {
                tracing::warn!(topic, partition = e.partition(), error = %err, "seeking back to the committed offset after a freeze failed");
            }
        }
    }
}
