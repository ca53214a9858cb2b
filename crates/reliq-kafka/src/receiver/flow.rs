//! Flow control: the bound of the buffer ahead of the runtime, and what a poll thread
//! does while that buffer is full (hold records back in librdkafka, then pause).

use std::time::{Duration, Instant};

use super::fetch::POLL_BATCH;
use super::shared::State;

/// While the buffer ahead of the runtime is full the poll thread stops taking records
/// but leaves them in librdkafka's own bounded fetch queue (`queued.max.messages.kbytes`),
/// waiting for the runtime to take some (at most [`FULL_RECHECK`] per wait). Pausing
/// would discard that queue and cost a refetch (hundreds of milliseconds) on resume; only
/// a buffer full for longer than this pauses the partitions, so the poll loop goes back
/// to serving rebalances and `max.poll.interval.ms` while slow handlers catch up.
pub(super) const FLOW_PAUSE_AFTER: Duration = Duration::from_secs(1);
/// Longest a poll thread waits for room in a full buffer before it looks again (the
/// runtime wakes it as soon as it takes records).
pub(super) const FULL_RECHECK: Duration = Duration::from_millis(1);

/// Most deliveries buffered ahead of the runtime (which itself holds at most
/// `prefetch`): four times the prefetch, at least 16, so the handlers never wait for the
/// poll thread.
pub(super) fn buffer_bound(prefetch: u32) -> usize {
    (prefetch.max(1) as usize).saturating_mul(4).max(16)
}

/// Room in the buffer a poll thread waits for before its next pass (a quarter of the
/// bound, at most one pass): passes of a few records would cost a lock, a clock read and
/// a wake-up each.
pub(super) fn refill_room(bound: usize) -> usize {
    (bound / 4).clamp(1, POLL_BATCH)
}

impl State {
    /// The buffer ahead of the runtime has reached [`buffer_bound`].
    pub(super) fn full(&self, prefetch: u32) -> bool {
        self.queued >= buffer_bound(prefetch)
    }
}

/// Flow control of one poll thread (see [`FLOW_PAUSE_AFTER`]).
#[derive(Default)]
pub(super) struct Flow {
    /// Since when the buffer has been full.
    full_since: Option<Instant>,
    /// The partitions are paused because the buffer stayed full; they resume once it is
    /// down to a quarter.
    pub(super) paused: bool,
}

impl Flow {
    /// Update with the buffer state; `true` = take no records now (the caller waits
    /// for room and checks again), `false` = poll (records, or only events while the
    /// partitions are paused). The buffer counts as full while less than a
    /// [`refill_room`] is left, so a stuck runtime leads to the pause (and polling for
    /// events) whatever the level it stopped at.
    pub(super) fn hold_back(&mut self, queued: usize, prefetch: u32, now: Instant) -> bool {
        let high = buffer_bound(prefetch);
        if high.saturating_sub(queued) >= refill_room(high) {
            self.full_since = None;
            if self.paused && queued <= high / 4 {
                self.paused = false;
            }
            return false;
        }
        let since = *self.full_since.get_or_insert(now);
        if now.duration_since(since) >= FLOW_PAUSE_AFTER {
            self.paused = true;
        }
        !self.paused
    }
}

/// A relay's intake while it holds its bound of records not due yet (`RELAY_HOLD`): its
/// poll thread takes no records, which wait in librdkafka's bounded fetch queue, until
/// every partition is down to half — no pause, so nothing fetched is discarded. Held
/// back for [`FLOW_PAUSE_AFTER`] (a tier long enough that its heads are not due soon),
/// the relay pauses the partitions at the bound instead and polls again, so rebalances
/// and `max.poll.interval.ms` are served while they wait.
#[derive(Default)]
pub(super) struct RelayHold {
    /// Since when the relay has held its bound.
    since: Option<Instant>,
    /// Held back too long: pause the partitions at the bound, take records again.
    pub(super) pausing: bool,
}

impl RelayHold {
    /// Update with whether the relay holds its bound (`over`); `true` = take no records
    /// now.
    pub(super) fn hold_back(&mut self, over: bool, now: Instant) -> bool {
        if !over {
            self.since = None;
            self.pausing = false;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) >= FLOW_PAUSE_AFTER {
            self.pausing = true;
        }
        !self.pausing
    }

    /// Held back now (the caller's hysteresis: over the bound until down to half).
    pub(super) fn holding(&self) -> bool {
        self.since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_at_its_bound_holds_back_then_pauses_until_below_it() {
        let mut hold = RelayHold::default();
        let t0 = Instant::now();
        assert!(!hold.hold_back(false, t0), "under the bound: take records");
        assert!(
            hold.hold_back(true, t0),
            "at the bound: hold back, no pause"
        );
        assert!(hold.holding() && !hold.pausing);
        assert!(hold.hold_back(true, t0 + FLOW_PAUSE_AFTER / 2));
        // Held back for long: pause at the bound, take records again.
        assert!(!hold.hold_back(true, t0 + FLOW_PAUSE_AFTER));
        assert!(hold.pausing);
        // Down to half: neither.
        assert!(!hold.hold_back(false, t0 + FLOW_PAUSE_AFTER * 2));
        assert!(!hold.holding() && !hold.pausing);
        // Over again later: the clock starts again.
        assert!(hold.hold_back(true, t0 + FLOW_PAUSE_AFTER * 3));
        assert!(!hold.pausing);
    }

    #[test]
    fn a_full_buffer_holds_records_back_then_pauses_until_a_quarter_is_left() {
        let mut flow = Flow::default();
        let t0 = Instant::now();
        let high = buffer_bound(8); // 32
        let refill = refill_room(high); // 8
        assert!(
            !flow.hold_back(high - refill, 8, t0),
            "a refill's room: poll"
        );
        assert!(
            flow.hold_back(high - refill + 1, 8, t0),
            "less than a refill left: hold back, no pause"
        );
        assert!(flow.hold_back(high, 8, t0 + FLOW_PAUSE_AFTER / 2));
        assert!(!flow.paused);
        // Room again before the pause: poll at once, and the clock restarts.
        assert!(!flow.hold_back(high - refill, 8, t0 + FLOW_PAUSE_AFTER / 2));
        assert!(flow.hold_back(high - 1, 8, t0 + FLOW_PAUSE_AFTER));
        assert!(!flow.paused);
        // Held back for longer — also short of full, where a stuck runtime may leave
        // it: pause and poll (events only) ...
        assert!(!flow.hold_back(high - 1, 8, t0 + FLOW_PAUSE_AFTER * 2));
        assert!(flow.paused);
        // ... until the runtime has drained it to a quarter.
        assert!(!flow.hold_back(high / 2, 8, t0 + FLOW_PAUSE_AFTER * 3));
        assert!(flow.paused);
        assert!(!flow.hold_back(high / 4, 8, t0 + FLOW_PAUSE_AFTER * 3));
        assert!(!flow.paused);
    }
}
