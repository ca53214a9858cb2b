//! The per-partition offset tracker: which offsets were handed out, which are done, and
//! the highest position that is safe to commit.
//!
//! Kafka commits a *position* (the next offset to read), not individual records. Records
//! of one partition are handed out in offset order but finish in any order, so the
//! tracker commits only up to the first unfinished record: everything before the
//! committed position is done, nothing after it is skipped after a restart.

use std::collections::VecDeque;

/// Offsets of one partition handed out since the partition was assigned.
#[derive(Debug, Default, Clone)]
pub(crate) struct OffsetTracker {
    /// Handed-out offsets not yet below the commit position, in increasing order (they
    /// are handed out in order); `true` = done. A ring, not a tree: one record in and
    /// out per message, no allocation once it has grown to the in-flight count.
    pending: VecDeque<(i64, bool)>,
    /// The position everything below is done (the offset after the last contiguous done
    /// record), if any record finished yet.
    done_position: Option<i64>,
    /// The position last handed to [`OffsetTracker::take_commit`].
    committed: Option<i64>,
}

impl OffsetTracker {
    /// An empty tracker.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Record that `offset` was handed out. Offsets must be handed out in increasing
    /// order; an offset at or below one already seen is ignored (returns false).
    pub(crate) fn handed_out(&mut self, offset: i64) -> bool {
        let floor = self
            .pending
            .back()
            .map(|(o, _)| o + 1)
            .max(self.done_position)
            .unwrap_or(i64::MIN);
        if offset < floor {
            return false;
        }
        self.pending.push_back((offset, false));
        true
    }

    /// Mark `offset` done; returns false if it was not outstanding.
    pub(crate) fn complete(&mut self, offset: i64) -> bool {
        // Offsets are mostly contiguous (gaps only after compaction or transaction
        // markers): try the slot `offset` would have without gaps before searching.
        let direct = self.pending.front().and_then(|&(first, _)| {
            let i = usize::try_from(offset.checked_sub(first)?).ok()?;
            (self.pending.get(i)?.0 == offset).then_some(i)
        });
        let Some(i) =
            direct.or_else(|| self.pending.binary_search_by_key(&offset, |(o, _)| *o).ok())
        else {
            return false;
        };
        if self.pending[i].1 {
            return false;
        }
        self.pending[i].1 = true;
        while let Some(&(first, true)) = self.pending.front() {
            self.pending.pop_front();
            self.done_position = Some(first + 1);
        }
        true
    }

    /// Offsets handed out and not finished.
    #[cfg(test)]
    pub(crate) fn unfinished(&self) -> usize {
        self.pending.iter().filter(|(_, done)| !done).count()
    }

    /// The highest position safe to commit (all records below it are done).
    pub(crate) fn position(&self) -> Option<i64> {
        self.done_position
    }

    /// The position to commit now, if it moved since the last call.
    pub(crate) fn take_commit(&mut self) -> Option<i64> {
        match self.done_position {
            Some(p) if self.committed.is_none_or(|c| p > c) => {
                self.committed = Some(p);
                Some(p)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn commits_the_contiguous_prefix_only() {
        let mut t = OffsetTracker::new();
        for o in [10, 11, 13, 14] {
            assert!(t.handed_out(o));
        }
        assert!(t.complete(11));
        assert_eq!(t.take_commit(), None, "10 is unfinished");
        assert!(t.complete(10));
        assert_eq!(t.take_commit(), Some(12));
        assert_eq!(t.take_commit(), None, "no double commit");
        assert!(t.complete(14));
        assert_eq!(t.position(), Some(12));
        assert!(t.complete(13));
        assert_eq!(
            t.take_commit(),
            Some(15),
            "gaps (e.g. control records) are skipped"
        );
        assert!(!t.complete(13), "settling twice is refused");
        assert!(!t.handed_out(12), "offsets never go backwards");
    }

    proptest! {
        /// Whatever order records finish in, the committed position never passes an
        /// unfinished record, never goes backwards, and reaches the end when all are done.
        #[test]
        fn never_commits_past_an_unfinished_record(
            gaps in proptest::collection::vec(1i64..4, 1..60),
            order in proptest::collection::vec(any::<prop::sample::Index>(), 1..60),
        ) {
            let mut offsets = Vec::new();
            let mut o = 100;
            for g in &gaps {
                offsets.push(o);
                o += g;
            }
            let mut t = OffsetTracker::new();
            for &o in &offsets {
                prop_assert!(t.handed_out(o));
            }
            let mut left: Vec<i64> = offsets.clone();
            let mut done = std::collections::BTreeSet::new();
            let mut last_commit = i64::MIN;
            for idx in order {
                if left.is_empty() { break; }
                let o = left.remove(idx.index(left.len()));
                prop_assert!(t.complete(o));
                done.insert(o);
                if let Some(c) = t.take_commit() {
                    prop_assert!(c > last_commit, "commit went backwards");
                    last_commit = c;
                    for &x in offsets.iter().filter(|&&x| x < c) {
                        prop_assert!(done.contains(&x), "committed {c} past unfinished {x}");
                    }
                }
            }
            if left.is_empty() {
                prop_assert_eq!(t.position(), offsets.last().map(|l| l + 1));
                prop_assert_eq!(t.unfinished(), 0);
            } else {
                let first_unfinished = left.iter().min().copied().unwrap_or(i64::MAX);
                prop_assert!(t.position().is_none_or(|p| p <= first_unfinished));
            }
        }
    }
}
