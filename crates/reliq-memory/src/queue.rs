//! A queue: what one consumer group (or one dead-letter queue) holds — ready messages,
//! retries waiting on the timer, and unsettled deliveries with their leases.

use reliq_core::{Delivery, Message, seam::lock};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

/// The hasher of the broker's tables: keys are the broker's own tags and names, not
/// outside input to defend against, and SipHash was a tenth of a delivery's cost.
pub(crate) type FastHash = foldhash::fast::RandomState;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

/// A message in a queue.
pub(crate) struct Entry {
    pub(crate) message: Message,
    pub(crate) route: Option<String>,
    pub(crate) deliveries: u32,
    /// Position in its queue, set when pushed (a dead-letter browse cursor).
    pub(crate) seq: u64,
}

impl Entry {
    pub(crate) fn new(message: Message, route: Option<String>) -> Self {
        Self {
            message,
            route,
            deliveries: 0,
            seq: 0,
        }
    }
}

/// A retry, or a release with a delay, waiting for its due time.
pub(crate) struct Delayed {
    pub(crate) due: Instant,
    pub(crate) seq: u64,
    pub(crate) entry: Entry,
}

impl PartialEq for Delayed {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Delayed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(other.due, other.seq))
    }
}

/// A delivery handed out and not settled yet.
pub(crate) struct Unacked {
    pub(crate) delivery: Delivery,
    pub(crate) route: Option<String>,
    pub(crate) deliveries: u32,
    pub(crate) lease_until: Instant,
    pub(crate) receiver: u64,
}

/// What a queue holds, behind its lock.
#[derive(Default)]
pub(crate) struct QueueState {
    pub(crate) ready: VecDeque<Entry>,
    pub(crate) delayed: BinaryHeap<Reverse<Delayed>>,
    pub(crate) unacked: HashMap<u64, Unacked, FastHash>,
    pub(crate) held: HashMap<u64, u32, FastHash>,
    pub(crate) next_tag: u64,
    pub(crate) next_seq: u64,
    /// No unacked lease ends before this (it may be earlier than the true minimum after
    /// acks); leases are scanned only once it passes, not on every receive.
    pub(crate) next_lease_due: Option<Instant>,
}

/// The fault switches a broker's receivers consult: reliq-core's `Faults` with the
/// `test-util` feature, nothing without it.
#[cfg(feature = "test-util")]
pub(crate) type Switches = Arc<reliq_core::seam::Faults>;
/// The fault switches a broker's receivers consult: nothing without `test-util`.
#[cfg(not(feature = "test-util"))]
pub(crate) type Switches = NoSwitches;

/// No fault switches (a build without `test-util`).
#[cfg(not(feature = "test-util"))]
#[derive(Clone, Default)]
pub(crate) struct NoSwitches;

/// A consumer group's queue, or a dead-letter queue (which has no `dlq` of its own).
pub(crate) struct Queue {
    pub(crate) name: String,
    /// The source topic, shared with every delivery's origin (not copied per delivery).
    pub(crate) topic: Arc<str>,
    pub(crate) filter: Option<String>,
    pub(crate) delivery_limit: Option<u32>,
    pub(crate) dlq: Option<Arc<Queue>>,
    state: Mutex<QueueState>,
    pub(crate) notify: Notify,
}

impl Queue {
    pub(crate) fn new(
        name: String,
        topic: String,
        filter: Option<String>,
        delivery_limit: Option<u32>,
        dlq: Option<Arc<Queue>>,
    ) -> Self {
        Self {
            name,
            topic: topic.into(),
            filter,
            delivery_limit,
            dlq,
            state: Mutex::new(QueueState::default()),
            notify: Notify::new(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, QueueState> {
        lock(&self.state)
    }

    /// (ready + delayed, unsettled).
    #[cfg(feature = "test-util")]
    pub(crate) fn depth(&self) -> (usize, usize) {
        let s = self.lock();
        (s.ready.len() + s.delayed.len(), s.unacked.len())
    }

    pub(crate) fn accepts(&self, route: Option<&str>) -> bool {
        match (&self.filter, route) {
            (None, _) => true,
            (Some(pattern), Some(route)) => route_matches(pattern, route),
            (Some(pattern), None) => pattern == "#",
        }
    }

    pub(crate) fn push(&self, mut entry: Entry) {
        {
            let mut s = self.lock();
            s.next_seq += 1;
            entry.seq = s.next_seq;
            s.ready.push_back(entry);
        }
        self.notify.notify_waiters();
    }

    /// Put a dead letter on this (dead-letter) queue.
    pub(crate) fn push_dead(&self, message: Message) {
        self.push(Entry::new(message, None));
    }
}

/// Matches AMQP-style topic patterns: words separated by `.`, `*` = one word, `#` = zero
/// or more words.
fn route_matches(pattern: &str, route: &str) -> bool {
    fn go(p: &[&str], r: &[&str]) -> bool {
        match (p.first(), r.first()) {
            (None, None) => true,
            (Some(&"#"), _) => go(&p[1..], r) || (!r.is_empty() && go(p, &r[1..])),
            (Some(&"*"), Some(_)) => go(&p[1..], &r[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &r[1..]),
            _ => false,
        }
    }
    let p: Vec<&str> = pattern.split('.').collect();
    let r: Vec<&str> = route.split('.').collect();
    go(&p, &r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns() {
        assert!(route_matches("order.*", "order.created"));
        assert!(!route_matches("order.*", "order.created.eu"));
        assert!(route_matches("order.#", "order.created.eu"));
        assert!(route_matches("#", "anything.at.all"));
        assert!(route_matches("order.created", "order.created"));
        assert!(!route_matches("order.created", "order.deleted"));
    }
}
