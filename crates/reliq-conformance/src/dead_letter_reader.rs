//! Scenarios of the dead-letter reader ([`reliq_core::DeadLetters`]): browsing changes
//! nothing, pages cover every entry once, get and remove by id, the count and the oldest
//! entry's time, a browse cut short skips nothing, a filtered replay leaves the rest.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, ensure};
use reliq_core::{
    BoxError, Cursor, DeadLetterEntry, DeadLetterFilter, DeadLetterReason, DeadLetters, Delivery,
    Message, MessageId, Permanent, Replay,
};

use crate::support::{Backend, Ctx, browse_all, soon, wait_until};

/// Dead-letter `n` messages (permanent failures, published one at a time so the DLQ holds
/// them in this order where the broker keeps one) with consumer `c`; their ids, in order.
async fn park(ctx: &Ctx<'_>, n: usize) -> anyhow::Result<Vec<MessageId>> {
    let h = ctx
        .consumer("c")
        .start(|_d: Delivery| async move {
            Err::<(), BoxError>(Permanent::msg("order 42 refers to a missing sku").into())
        })
        .await?;
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let m = Message::new(format!("parked-{i}")).with_header("x-seq", i.to_string());
        ids.push(m.id().clone());
        ctx.publish(m).await?;
        let parked = i as u64 + 1;
        wait_until("dead-lettered", soon(ctx.backend), || {
            h.stats().dead_lettered == parked
        })
        .await?;
    }
    let s = h.shutdown().await.stats;
    ensure!(s.dead_lettered == n as u64, "{s:?}");
    Ok(ids)
}

/// What a browse shows of an entry, to compare two browses: id, payload, headers.
fn seen(e: &DeadLetterEntry) -> (MessageId, Vec<u8>, Vec<(String, String)>) {
    let mut headers: Vec<(String, String)> = e
        .headers()
        .iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    headers.sort();
    (e.id().clone(), e.payload().to_vec(), headers)
}

/// Every entry, in pages of `page`, checking each page's size.
async fn browse_in_pages(
    dlq: &dyn DeadLetters,
    page: usize,
) -> anyhow::Result<(Vec<DeadLetterEntry>, usize)> {
    let mut cursor = Cursor::start();
    let mut all = Vec::new();
    let mut pages = 0;
    loop {
        let p = dlq.browse(&cursor, page).await?;
        pages += 1;
        ensure!(
            p.entries.len() <= page,
            "a page of {} entries, asked for at most {page}",
            p.entries.len()
        );
        let empty = p.entries.is_empty();
        all.extend(p.entries);
        if p.at_end || empty {
            return Ok((all, pages));
        }
        ensure!(pages < 1_000, "the browse never reached the end");
        cursor = p.next;
    }
}

/// Browsing twice shows the same entries in the same order, with the same headers; the
/// count, the records' attempts and what a replay finds are unchanged.
pub async fn dead_letter_browse_changes_nothing(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-browse").await?;
    let ids = park(&ctx, 5).await?;
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let before = dlq.count().await?;
    ensure!(before.count == 5, "count {before:?}");
    let (first, _) = browse_in_pages(dlq.as_ref(), 2).await?;
    let (second, _) = browse_in_pages(dlq.as_ref(), 2).await?;
    let first: Vec<_> = first.iter().map(seen).collect();
    let second: Vec<_> = second.iter().map(seen).collect();
    ensure!(
        first == second,
        "a second browse saw something else:\n{first:?}\n{second:?}"
    );
    let found: HashSet<MessageId> = first.iter().map(|(id, ..)| id.clone()).collect();
    ensure!(
        found == ids.iter().cloned().collect(),
        "browse found {found:?}, parked {ids:?}"
    );
    ensure!(
        first.len() == 5,
        "{} entries for 5 dead letters",
        first.len()
    );
    let after = dlq.count().await?;
    ensure!(after == before, "count changed: {before:?} -> {after:?}");
    let plan = Replay::new(ctx.broker.clone(), ctx.subscription("c"))
        .dry_run()
        .await?;
    ensure!(plan.matched.len() == 5, "dry run after browsing: {plan:?}");
    ensure!(
        plan.matched.iter().all(|m| m.record.attempts == 1),
        "browsing counted as an attempt: {plan:?}"
    );
    let dead = ctx.take_dead_letters("c", 5, soon(b)).await?;
    ensure!(dead.iter().all(|(_, r)| r.attempts == 1));
    Ok(())
}

/// Pages of three over seven entries cover every entry exactly once and end.
pub async fn dead_letter_pages_cover_every_entry_once(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-pages").await?;
    let ids = park(&ctx, 7).await?;
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let (all, pages) = browse_in_pages(dlq.as_ref(), 3).await?;
    let got: Vec<MessageId> = all.iter().map(|e| e.id().clone()).collect();
    let unique: HashSet<&MessageId> = got.iter().collect();
    ensure!(unique.len() == got.len(), "an entry came twice: {got:?}");
    ensure!(
        unique == ids.iter().collect(),
        "pages found {got:?}, parked {ids:?}"
    );
    ensure!(pages >= 3, "7 entries in pages of 3 took {pages} pages");
    // Browsing on from the end finds nothing new.
    let last = dlq.browse(&Cursor::start(), 7).await?;
    ensure!(
        last.entries.len() == 7,
        "one page of 7: {}",
        last.entries.len()
    );
    let past = dlq.browse(&last.next, 3).await?;
    ensure!(
        past.entries.is_empty() && past.at_end,
        "past the end: {:?}",
        past.entries.iter().map(|e| e.id()).collect::<Vec<_>>()
    );
    ctx.take_dead_letters("c", 7, soon(b)).await.map(drop)
}

/// `get` finds an entry by id (and nothing for an unknown id); `remove` takes exactly the
/// ids asked for, skipping unknown ones, and they are gone for every later read.
pub async fn dead_letter_get_and_remove_by_id(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-get-remove").await?;
    let ids = park(&ctx, 4).await?;
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let entry = dlq
        .get(&ids[1])
        .await?
        .context("get of a dead-lettered id found nothing")?;
    ensure!(entry.id() == &ids[1]);
    ensure!(
        entry.payload() == b"parked-1",
        "payload {:?}",
        entry.payload()
    );
    let record = entry.record().context("the entry's record")?;
    ensure!(record.reason == DeadLetterReason::Permanent, "{record:?}");
    let unknown = MessageId::generate();
    ensure!(dlq.get(&unknown).await?.is_none(), "get of an unknown id");

    let removed = dlq.remove(&[ids[1].clone(), unknown]).await?;
    ensure!(removed == vec![ids[1].clone()], "removed {removed:?}");
    ensure!(
        dlq.get(&ids[1]).await?.is_none(),
        "a removed entry is still found"
    );
    ensure!(dlq.count().await?.count == 3);
    let reader = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let left: HashSet<MessageId> = browse_all(reader.as_ref())
        .await?
        .iter()
        .map(|e| e.id().clone())
        .collect();
    let want: HashSet<MessageId> = [&ids[0], &ids[2], &ids[3]].into_iter().cloned().collect();
    ensure!(left == want, "a new reader sees {left:?}, want {want:?}");

    let rest = [ids[0].clone(), ids[2].clone(), ids[3].clone()];
    let removed = reader.remove(&rest).await?;
    ensure!(removed.len() == 3, "removed {removed:?}");
    let count = reader.count().await?;
    ensure!(
        count.count == 0 && count.oldest_dead_lettered_at.is_none(),
        "{count:?}"
    );
    ensure!(browse_all(reader.as_ref()).await?.is_empty());
    ctx.assert_no_dead_letters("c").await
}

/// A message dead-lettered twice — published twice (a producer's retry after a lost
/// confirm), as a DLQ copy sent again after its confirm was lost, or parked again after a
/// crash does — is one dead letter: browsed once, counted once, removed with every copy.
/// The same id parked again after a replay (its replay count differs) is a second dead
/// letter, which outlives the removal of the first.
pub async fn dead_letter_copies_count_once(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-copies").await?;
    let h = ctx
        .consumer("c")
        .start(|_d: Delivery| async move {
            Err::<(), BoxError>(Permanent::msg("order 7 refers to a missing sku").into())
        })
        .await?;
    let order = Message::new("order 7");
    let id = order.id().clone();
    let replayed = order
        .clone()
        .with_header(reliq_core::seam::headers::REPLAY_COUNT, "1");
    // Where the broker deduplicates publishes by id, the second copy never reaches the
    // consumer: the DLQ then holds one entry of it, which must read the same.
    let twice = !ctx.broker.capabilities().deduplicates_publishes;
    let publishes = [
        (order.clone(), true),
        (order, twice),
        (Message::new("order 8"), true),
        (replayed, true),
    ];
    let mut parked = 0;
    for (message, parks) in publishes {
        ctx.publish(message).await?;
        parked += u64::from(parks);
        // One at a time: each copy is parked before the next arrives.
        wait_until("dead-lettered", soon(b), || {
            h.stats().dead_lettered == parked
        })
        .await?;
    }
    h.shutdown().await;

    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let count = dlq.count().await?;
    ensure!(count.count == 3, "3 dead letters, {count:?}");
    let entries = browse_all(dlq.as_ref()).await?;
    let replay_counts = |entries: &[DeadLetterEntry]| -> Vec<Option<String>> {
        let mut of_id: Vec<Option<String>> = entries
            .iter()
            .filter(|e| e.id() == &id)
            .map(|e| {
                e.headers()
                    .get(reliq_core::seam::headers::REPLAY_COUNT)
                    .map(str::to_owned)
            })
            .collect();
        of_id.sort();
        of_id
    };
    ensure!(
        entries.len() == 3 && replay_counts(&entries) == vec![None, Some("1".into())],
        "browse shows each dead letter once: {:?}",
        entries
            .iter()
            .map(|e| (e.id(), &e.position))
            .collect::<Vec<_>>()
    );
    let plan = Replay::new(ctx.broker.clone(), ctx.subscription("c"))
        .dry_run()
        .await?;
    ensure!(plan.matched.len() == 3, "a replay would send {plan:?}");

    // The first dead letter goes with both its copies; the one parked after the replay stays.
    ensure!(dlq.remove(std::slice::from_ref(&id)).await? == vec![id.clone()]);
    ensure!(dlq.count().await?.count == 2, "after removing the first");
    let reader = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let left = browse_all(reader.as_ref()).await?;
    ensure!(
        left.len() == 2 && replay_counts(&left) == vec![Some("1".into())],
        "a new reader sees {:?}",
        left.iter()
            .map(|e| (e.id(), &e.position))
            .collect::<Vec<_>>()
    );
    ensure!(reader.remove(std::slice::from_ref(&id)).await? == vec![id.clone()]);
    ensure!(
        reader.get(&id).await?.is_none(),
        "a copy of a removed dead letter is found"
    );
    ensure!(reader.count().await?.count == 1);
    Ok(())
}

/// `count` says how many entries there are and when the oldest was dead-lettered (its
/// reliq record's time, not the broker's).
pub async fn dead_letter_count_reports_the_oldest(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-count").await?;
    // The consumer declares its DLQ: a reader opens only what exists.
    park(&ctx, 0).await?;
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let empty = dlq.count().await?;
    ensure!(
        empty.count == 0 && empty.oldest_dead_lettered_at.is_none(),
        "{empty:?}"
    );
    let started = SystemTime::now();
    park(&ctx, 3).await?;
    let count = dlq.count().await?;
    ensure!(count.count == 3, "{count:?}");
    let times: Vec<SystemTime> = browse_all(dlq.as_ref())
        .await?
        .iter()
        .map(|e| e.record().map(|r| r.dead_lettered_at))
        .collect::<Result<_, _>>()?;
    let oldest = times.iter().min().copied();
    ensure!(
        count.oldest_dead_lettered_at == oldest,
        "oldest {:?}, records {times:?}",
        count.oldest_dead_lettered_at
    );
    // The record's time, from this run (the embedded broker's clock may be virtual, and
    // the header keeps milliseconds).
    if let Some(at) = oldest {
        let slack = Duration::from_secs(1);
        ensure!(at + slack >= started, "oldest {at:?} before the test began");
    }
    ctx.take_dead_letters("c", 3, soon(b)).await.map(drop)
}

/// A browse dropped part-way (timed out at different points) and read again from the same
/// cursor misses nothing: a cursor is an input, never the reader's state.
pub async fn dead_letter_browse_cut_short_skips_nothing(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-cut-short").await?;
    let ids = park(&ctx, 6).await?;
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let first = dlq.browse(&Cursor::start(), 2).await?;
    for i in 0..12u64 {
        let cut = Duration::from_micros(i * i * 250);
        let _ = tokio::time::timeout(cut, dlq.browse(&first.next, 2)).await;
        let _ = tokio::time::timeout(cut, dlq.browse(&Cursor::start(), 4)).await;
    }
    let (all, _) = browse_in_pages(dlq.as_ref(), 2).await?;
    let found: HashSet<MessageId> = all.iter().map(|e| e.id().clone()).collect();
    ensure!(
        found == ids.iter().cloned().collect() && all.len() == 6,
        "after cut-short browses: {found:?} of {ids:?}"
    );
    ctx.take_dead_letters("c", 6, soon(b)).await.map(drop)
}

/// A replay of some ids takes those and leaves every other entry where it was.
pub async fn dead_letter_filtered_replay_leaves_the_rest(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "dlq-replay-some").await?;
    let ids = park(&ctx, 4).await?;
    let done = Replay::new(ctx.broker.clone(), ctx.subscription("c"))
        .filter(DeadLetterFilter::default().ids([ids[0].clone(), ids[3].clone()]))
        .execute()
        .await?;
    let mut replayed = done.replayed.clone();
    replayed.sort();
    let mut want = vec![ids[0].clone(), ids[3].clone()];
    want.sort();
    ensure!(replayed == want, "replayed {done:?}");
    ensure!(done.failed.is_empty(), "{done:?}");
    // No consumer runs: the replayed copies wait in the consumer's input, and the DLQ
    // holds exactly the two the filter left.
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let left: HashSet<MessageId> = browse_all(dlq.as_ref())
        .await?
        .iter()
        .map(|e| e.id().clone())
        .collect();
    let untouched: HashSet<MessageId> = [ids[1].clone(), ids[2].clone()].into_iter().collect();
    ensure!(left == untouched, "left {left:?}, want {untouched:?}");
    ctx.take_dead_letters("c", 2, soon(b)).await.map(drop)
}
