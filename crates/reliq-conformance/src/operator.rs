//! Scenarios of the operator's operations ([`reliq_admin::Dlq`]) on each backend: stats
//! grouped by error fingerprint, listings with every filter and a cursor, show, replay
//! (dry run and at a rate), edit-and-replay, purge (dry run and by filter) — ids and
//! counts asserted, and every read and dry run changes nothing.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use reliq_admin::{AdminError, Dlq, EditRequest, FilterSpec, PurgeRequest, ReplayRequest};
use reliq_core::{
    BoxError, BrokerError, ConsumerHandle, Cursor, Delivery, Message, MessageId, Permanent, Poison,
    Subscription, seam::headers,
};

use crate::support::{Backend, Ctx, Recorder, browse_all, soon, wait_until};

/// A consumer `c` whose handler fails every first-time message — `missing-N` payloads
/// with a permanent "order N not found", `poison-N` ones as poison — and succeeds for a
/// replayed copy (recorded), as a fixed deployment would.
async fn failing_until_replayed(ctx: &Ctx<'_>) -> anyhow::Result<(ConsumerHandle, Recorder)> {
    let rec = Recorder::new();
    let r = rec.clone();
    let h = ctx
        .consumer("c")
        .start(move |d: Delivery| {
            let r = r.clone();
            async move {
                if d.headers().get(headers::REPLAY_COUNT).is_some() {
                    r.call(&d);
                    r.effect(d.id());
                    return Ok(());
                }
                let kind: serde_json::Value =
                    serde_json::from_slice(d.payload()).unwrap_or_default();
                let n = kind["n"].as_u64().unwrap_or(0);
                if kind["kind"] == "poison" {
                    Err::<(), BoxError>(
                        Poison::msg(format!("bad field at byte {}", 100 + n)).into(),
                    )
                } else {
                    Err(Permanent::msg(format!("order {} not found", 8000 + n)).into())
                }
            }
        })
        .await?;
    Ok((h, rec))
}

/// Dead-letter `missing` permanent failures then `poison` poison ones, one at a time (so
/// the DLQ holds them in this order where the broker keeps one); their ids, in order.
async fn park(
    ctx: &Ctx<'_>,
    h: &ConsumerHandle,
    missing: usize,
    poison: usize,
) -> anyhow::Result<(Vec<MessageId>, Vec<MessageId>)> {
    let mut ids = (Vec::new(), Vec::new());
    let base = h.stats().dead_lettered;
    for i in 0..missing + poison {
        let kind = if i < missing { "missing" } else { "poison" };
        let m = Message::json(&serde_json::json!({ "kind": kind, "n": i }))?
            .with_header("x-seq", i.to_string());
        if i < missing {
            ids.0.push(m.id().clone());
        } else {
            ids.1.push(m.id().clone());
        }
        ctx.publish(m).await?;
        let parked = base + i as u64 + 1;
        wait_until("dead-lettered", soon(ctx.backend), || {
            h.stats().dead_lettered == parked
        })
        .await?;
    }
    Ok(ids)
}

/// What the DLQ holds, entry by entry (id, payload, headers), to compare before/after.
async fn snapshot(
    ctx: &Ctx<'_>,
) -> anyhow::Result<Vec<(MessageId, Vec<u8>, Vec<(String, String)>)>> {
    let dlq = ctx.broker.dead_letters(&ctx.subscription("c")).await?;
    let entries = browse_all(dlq.as_ref()).await?;
    Ok(entries
        .iter()
        .map(|e| {
            let mut h: Vec<(String, String)> = e
                .headers()
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            h.sort();
            (e.id().clone(), e.payload().to_vec(), h)
        })
        .collect())
}

fn spec() -> FilterSpec {
    FilterSpec::default()
}

/// Every `ls` page (of `max`) for `filter`; the ids in order and how many pages.
async fn ls_all(
    dlq: &Dlq,
    filter: &FilterSpec,
    max: usize,
) -> anyhow::Result<(Vec<MessageId>, usize)> {
    let mut cursor = Cursor::start();
    let mut ids = Vec::new();
    let mut pages = 0;
    loop {
        let page = dlq.list(filter, &cursor, max).await?;
        pages += 1;
        ensure!(
            page.entries.len() <= max,
            "a page of {} for max {max}",
            page.entries.len()
        );
        ids.extend(page.entries.iter().map(|e| MessageId::from(e.id.as_str())));
        if page.at_end {
            return Ok((ids, pages));
        }
        ensure!(pages < 100, "ls never reached the end");
        cursor = Cursor::from(page.next_cursor);
    }
}

fn sorted(ids: &[MessageId]) -> Vec<MessageId> {
    let mut v = ids.to_vec();
    v.sort();
    v
}

/// `stats` counts and groups by reason, class and fingerprint (10 failures of one bug are
/// one row), `ls` pages cover a filter's entries once with every filter kind, `show` has
/// the record, headers and payload — and none of it changes the DLQ.
pub async fn operator_stats_ls_and_show_change_nothing(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "op-stats").await?;
    let (h, _rec) = failing_until_replayed(&ctx).await?;
    let (missing, poison) = park(&ctx, &h, 5, 3).await?;
    h.shutdown().await;
    let before = snapshot(&ctx).await?;
    ensure!(before.len() == 8, "{} entries parked", before.len());
    let dlq = Dlq::new(ctx.broker.clone(), ctx.subscription("c"))?;

    let stats = dlq.stats(&spec()).await?;
    ensure!(stats.count == 8 && stats.unreadable == 0, "{stats:?}");
    ensure!(
        stats.by_reason.get("permanent") == Some(&5) && stats.by_reason.get("poison") == Some(&3),
        "{:?}",
        stats.by_reason
    );
    ensure!(
        stats.by_class.get("permanent") == Some(&5),
        "{:?}",
        stats.by_class
    );
    ensure!(stats.groups.len() == 2, "groups: {:?}", stats.groups);
    let (big, small) = (&stats.groups[0], &stats.groups[1]);
    ensure!(
        big.count == 5 && big.fingerprint.masked_error == "order <n> not found",
        "{big:?}"
    );
    ensure!(
        small.count == 3 && small.fingerprint.masked_error == "bad field at byte <n>",
        "{small:?}"
    );
    ensure!(big.first_seen <= big.last_seen, "{big:?}");
    ensure!(
        missing.iter().any(|id| id.as_str() == big.example_id),
        "{big:?}"
    );
    ensure!(
        stats.oldest_age_seconds.is_some_and(|a| a < 600),
        "{stats:?}"
    );
    let poisoned = dlq
        .stats(&FilterSpec {
            reason: vec!["poison".into()],
            ..spec()
        })
        .await?;
    ensure!(
        poisoned.count == 3 && poisoned.groups.len() == 1,
        "{poisoned:?}"
    );

    // ls: a fingerprint's entries in pages of 2, each once.
    let by_fingerprint = FilterSpec {
        fingerprint: vec![big.fingerprint.id.clone()],
        ..spec()
    };
    let (listed, pages) = ls_all(&dlq, &by_fingerprint, 2).await?;
    ensure!(
        sorted(&listed) == sorted(&missing) && pages >= 3,
        "{pages} pages: {listed:?}"
    );
    let (everything, _) = ls_all(&dlq, &spec(), 3).await?;
    let distinct: HashSet<&MessageId> = everything.iter().collect();
    ensure!(
        everything.len() == 8 && distinct.len() == 8,
        "{everything:?}"
    );
    for (filter, expected) in [
        (
            FilterSpec {
                header: vec!["x-seq=3".into()],
                ..spec()
            },
            vec![missing[3].clone()],
        ),
        (
            FilterSpec {
                payload_contains: Some("\"poison\"".into()),
                ..spec()
            },
            poison.clone(),
        ),
        (
            FilterSpec {
                id: vec![missing[0].to_string(), poison[2].to_string()],
                ..spec()
            },
            vec![missing[0].clone(), poison[2].clone()],
        ),
        (
            FilterSpec {
                class: vec!["poison".into()],
                ..spec()
            },
            poison.clone(),
        ),
        (
            FilterSpec {
                since: Some("1h".into()),
                reason: vec!["permanent".into()],
                ..spec()
            },
            missing.clone(),
        ),
        (
            FilterSpec {
                until: Some("1h".into()),
                ..spec()
            },
            vec![],
        ),
    ] {
        let (got, _) = ls_all(&dlq, &filter, 50).await?;
        ensure!(sorted(&got) == sorted(&expected), "{filter:?}: {got:?}");
    }
    let limited = dlq
        .list(
            &FilterSpec {
                limit: Some(2),
                ..spec()
            },
            &Cursor::start(),
            50,
        )
        .await?;
    ensure!(
        limited.entries.len() == 2,
        "limit 2 listed {}",
        limited.entries.len()
    );

    // show: the whole entry.
    let shown = dlq.show(missing[2].as_str()).await?;
    ensure!(
        shown.summary.reason == "permanent" && shown.summary.fingerprint == big.fingerprint.id,
        "{shown:?}"
    );
    ensure!(
        shown.summary.error.as_deref() == Some("order 8002 not found"),
        "{shown:?}"
    );
    ensure!(
        shown.headers.get("x-seq").map(String::as_str) == Some("2"),
        "{:?}",
        shown.headers
    );
    ensure!(
        shown.payload_encoding == "json"
            && shown.payload["kind"] == "missing"
            && shown.payload["n"] == 2,
        "{shown:?}"
    );
    match dlq.show("no-such-id").await {
        Err(AdminError::NotFound { .. }) => {}
        other => anyhow::bail!("show of an unknown id: {other:?}"),
    }

    let after = snapshot(&ctx).await?;
    ensure!(after == before, "stats, ls and show changed the DLQ");
    Ok(())
}

/// A dry-run replay lists exactly the filter's entries and changes nothing; the replay
/// at a rate takes at least the time the rate says, sends each matching id to the
/// consumer once (with the replay marker), removes exactly those, and leaves the rest.
pub async fn operator_replay_dry_run_then_at_a_rate(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "op-replay").await?;
    let (h, rec) = failing_until_replayed(&ctx).await?;
    let (missing, poison) = park(&ctx, &h, 5, 3).await?;
    let before = snapshot(&ctx).await?;
    let dlq = Dlq::new(ctx.broker.clone(), ctx.subscription("c"))?;
    let permanent = FilterSpec {
        reason: vec!["permanent".into()],
        ..spec()
    };

    let plan = dlq
        .replay(
            &ReplayRequest {
                filter: permanent.clone(),
                dry_run: true,
                ..ReplayRequest::default()
            },
            |_| {},
            Default::default(),
        )
        .await?;
    let planned: Vec<MessageId> = plan
        .ids
        .iter()
        .map(|i| MessageId::from(i.as_str()))
        .collect();
    ensure!(
        plan.dry_run && plan.matched == 5 && plan.done == 0 && sorted(&planned) == sorted(&missing),
        "{plan:?}"
    );
    ensure!(
        plan.by_fingerprint.len() == 1 && plan.by_fingerprint.values().all(|n| *n == 5),
        "{plan:?}"
    );
    tokio::time::sleep(b.quiet_period()).await;
    ensure!(
        rec.calls().is_empty(),
        "a dry run sent {} messages",
        rec.calls().len()
    );
    ensure!(snapshot(&ctx).await? == before, "a dry run changed the DLQ");

    let started = Instant::now();
    let done = dlq
        .replay(
            &ReplayRequest {
                filter: permanent,
                rate: Some(10),
                ..ReplayRequest::default()
            },
            |_| {},
            Default::default(),
        )
        .await?;
    let took = started.elapsed();
    ensure!(
        done.complete() && done.done == 5 && done.matched == 5,
        "{done:?}"
    );
    // 5 copies at 10/s: at least 4 intervals of 100 ms after the first.
    ensure!(
        took >= Duration::from_millis(350),
        "5 copies at 10/s took {took:?}"
    );
    wait_until("the replayed copies handled", soon(b), || {
        rec.effect_count() == 5
    })
    .await?;
    tokio::time::sleep(b.quiet_period()).await;
    for id in &missing {
        let calls = rec.calls_for(id);
        ensure!(calls.len() == 1, "{id}: {} calls", calls.len());
        ensure!(
            calls[0]
                .headers
                .iter()
                .any(|(k, v)| k == headers::REPLAY_COUNT && v == "1"),
            "{id}: no replay marker"
        );
    }
    let left: Vec<MessageId> = snapshot(&ctx)
        .await?
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    ensure!(
        sorted(&left) == sorted(&poison),
        "left in the DLQ: {left:?}"
    );
    h.shutdown().await;
    Ok(())
}

/// Edit-and-replay sends a corrected copy with a new id whose causation id is the
/// original's, and removes the original; a purge dry run changes nothing, and a purge by
/// filter removes exactly its entries.
pub async fn operator_edit_and_purge(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "op-edit").await?;
    let (h, rec) = failing_until_replayed(&ctx).await?;
    let (missing, poison) = park(&ctx, &h, 2, 3).await?;
    let dlq = Dlq::new(ctx.broker.clone(), ctx.subscription("c"))?;

    let refused = dlq
        .edit(
            poison[0].as_str(),
            &EditRequest {
                headers: vec!["reliq-attempt=1".into()],
                ..EditRequest::default()
            },
        )
        .await;
    ensure!(
        matches!(
            refused,
            Err(AdminError::InvalidInput {
                field: "header",
                ..
            })
        ),
        "{refused:?}"
    );
    let fixed = br#"{"kind":"fixed","n":0}"#.to_vec();
    let edit = EditRequest {
        payload: Some(fixed.clone().into()),
        headers: vec!["x-fixed=yes".into()],
        ..EditRequest::default()
    };
    let outcome = dlq.edit(poison[0].as_str(), &edit).await?;
    ensure!(
        outcome.original == poison[0].as_str() && outcome.copy != outcome.original,
        "{outcome:?}"
    );
    let copy = MessageId::from(outcome.copy.as_str());
    wait_until("the corrected copy handled", soon(b), || {
        rec.effect_count() == 1
    })
    .await?;
    let calls = rec.calls_for(&copy);
    let call = calls
        .first()
        .context("the corrected copy reached the consumer")?;
    let header = |n: &str| {
        call.headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_str())
    };
    ensure!(
        call.payload == fixed,
        "payload {:?}",
        String::from_utf8_lossy(&call.payload)
    );
    ensure!(
        header(headers::CAUSATION_ID) == Some(poison[0].as_str()),
        "{:?}",
        call.headers
    );
    ensure!(
        header("x-fixed") == Some("yes") && header("x-seq") == Some("2"),
        "{:?}",
        call.headers
    );
    ensure!(
        header(headers::DEAD_LETTER_REASON).is_none(),
        "failure headers kept: {:?}",
        call.headers
    );
    ensure!(
        rec.calls_for(&poison[0]).is_empty(),
        "the original was replayed too"
    );
    ensure!(
        matches!(
            dlq.show(poison[0].as_str()).await,
            Err(AdminError::NotFound { .. })
        ),
        "original still in the DLQ"
    );
    ensure!(
        matches!(
            dlq.edit(poison[0].as_str(), &edit).await,
            Err(AdminError::NotFound { .. })
        ),
        "a second edit of a removed entry"
    );

    let poisoned = FilterSpec {
        reason: vec!["poison".into()],
        ..spec()
    };
    let before = snapshot(&ctx).await?;
    let plan = dlq
        .purge(
            &PurgeRequest {
                filter: poisoned.clone(),
                dry_run: true,
            },
            |_| {},
            Default::default(),
        )
        .await?;
    let planned: Vec<MessageId> = plan
        .ids
        .iter()
        .map(|i| MessageId::from(i.as_str()))
        .collect();
    ensure!(
        plan.matched == 2 && plan.done == 0 && sorted(&planned) == sorted(&poison[1..]),
        "{plan:?}"
    );
    ensure!(
        snapshot(&ctx).await? == before,
        "a purge dry run changed the DLQ"
    );
    let purged = dlq
        .purge(
            &PurgeRequest {
                filter: poisoned,
                dry_run: false,
            },
            |_| {},
            Default::default(),
        )
        .await?;
    let gone: Vec<MessageId> = purged
        .ids
        .iter()
        .map(|i| MessageId::from(i.as_str()))
        .collect();
    ensure!(
        purged.complete() && purged.done == 2 && sorted(&gone) == sorted(&poison[1..]),
        "{purged:?}"
    );
    let left: Vec<MessageId> = snapshot(&ctx)
        .await?
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    ensure!(
        sorted(&left) == sorted(&missing),
        "left after the purge: {left:?}"
    );
    ensure!(dlq.stats(&spec()).await?.count == 2);
    h.shutdown().await;
    Ok(())
}

/// The backlog the broker reports ([`reliq_core::Broker::backlog`]) follows what waits
/// for a consumer: six published are six waiting or in flight; after two acks and one
/// retry on a 60 s tier, three are left and one retry waits — counted apart where the
/// broker keeps retries apart, on its tier where each tier is a route of its own; after
/// the rest are acked nothing waits but the retry. A consumer that was never subscribed
/// has no backlog to read: an error, not a zero.
pub async fn backlog_follows_waiting_in_flight_and_retries(b: &dyn Backend) -> anyhow::Result<()> {
    use reliq_core::seam::RetryRequest;
    use reliq_core::{Backlog, TierBacklog};
    let ctx = Ctx::new(b, "backlog").await?;
    let caps = ctx.broker.capabilities();
    let tier = Duration::from_secs(60);
    let mut sub = ctx.subscription("c");
    sub.retry_tiers = vec![tier];
    let missing = {
        let mut s = ctx.subscription("never");
        s.retry_tiers = vec![tier];
        s
    };
    let receiver = ctx.broker.subscribe(&sub).await?;
    ctx.publish_all((0..6).map(|i| Message::new(format!("b-{i}"))).collect())
        .await?;
    // Outside the retry: waiting + in flight (where the broker says it) + retries.
    let total = |l: &Backlog| l.waiting + l.in_flight.unwrap_or(0);
    let backlog_until = |what: &'static str, cond: fn(&Backlog) -> bool| {
        let broker = ctx.broker.clone();
        let sub = sub.clone();
        async move {
            let deadline = Instant::now() + soon(b);
            loop {
                let backlog = broker.backlog(&sub).await.context("backlog")?;
                if cond(&backlog) {
                    return anyhow::Ok(backlog);
                }
                ensure!(
                    Instant::now() < deadline,
                    "timed out waiting for a backlog with {what}; the last: {backlog:?}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    let first = backlog_until("6 waiting or in flight", |l| {
        l.waiting + l.in_flight.unwrap_or(0) == 6
    })
    .await?;
    ensure!(first.retries.unwrap_or(0) == 0, "no retry yet: {first:?}");

    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            tokio::time::timeout(soon(b), receiver.receive())
                .await
                .context("a delivery")??,
        );
    }
    receiver.ack(&held[0]).await?;
    receiver.ack(&held[1]).await?;
    let retried = held[2].id().clone();
    receiver
        .retry(
            &held[2],
            RetryRequest {
                message: held[2].message().clone(),
                delay: tier,
                tier: 0,
            },
        )
        .await?;
    let after = if caps.retries_counted_apart {
        backlog_until("3 left and 1 retry apart", |l| {
            l.waiting + l.in_flight.unwrap_or(0) == 3 && l.retries == Some(1)
        })
        .await?
    } else {
        // The retry waits invisible in the source queue: it is in flight.
        backlog_until("3 left and the retry in flight", |l| {
            l.waiting + l.in_flight.unwrap_or(0) == 4 && l.retries.is_none()
        })
        .await?
    };
    let tiers = if caps.exact_retry_delay {
        vec![]
    } else {
        vec![TierBacklog {
            delay: tier,
            waiting: 1,
        }]
    };
    ensure!(after.retry_tiers == tiers, "tiers: {after:?}");
    ensure!(total(&after) <= 4, "{after:?}");

    for _ in 0..3 {
        let d = tokio::time::timeout(soon(b), receiver.receive())
            .await
            .context("a delivery")??;
        ensure!(d.id() != &retried, "the 60 s retry came back early");
        receiver.ack(&d).await?;
    }
    if caps.retries_counted_apart {
        backlog_until("nothing left but the retry", |l| {
            l.waiting + l.in_flight.unwrap_or(0) == 0 && l.retries == Some(1)
        })
        .await?;
    } else {
        backlog_until("nothing left but the retry in flight", |l| {
            l.waiting + l.in_flight.unwrap_or(0) == 1
        })
        .await?;
    }
    receiver.close().await?;
    ensure!(
        ctx.broker.backlog(&missing).await.is_err(),
        "a consumer never subscribed has no backlog to read"
    );
    Ok(())
}

/// The topology check ([`reliq_core::Broker::check_topology`]): right after a consumer
/// subscribed, the broker has its plan exactly (nothing missing, nothing different,
/// nothing extra). Checked then for a redeployed policy — one retry tier fewer, another
/// delivery limit — without subscribing it: every setting whose planned value the new
/// policy changes is named as different, with the old value found and the new one
/// wanted, at the plan's severity; the dropped tier's queue or topic is named as extra,
/// empty and cosmetic; nothing else is reported.
pub async fn topology_check_names_each_difference_from_the_plan(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    use reliq_core::{Difference, ObjectKind, Severity};
    let ctx = Ctx::new(b, "topology").await?;
    let [short, long] = b.tiers();
    let mut sub = ctx.subscription("c");
    sub.retry_tiers = vec![short, long];
    sub.delivery_limit = 7;
    let receiver = ctx.broker.subscribe(&sub).await?;

    let plan = ctx.broker.plan(&sub).await.context("plan")?;
    ensure!(
        plan.consumer == sub.consumer && plan.source == sub.source && !plan.objects.is_empty(),
        "{plan:?}"
    );
    ensure!(
        plan.objects
            .iter()
            .any(|o| o.name.contains(&sub.dead_letter_name()) || o.role.contains("DLQ")),
        "the plan has the DLQ: {plan}"
    );
    // Groups and consumers join shortly after subscribe returns: wait for the plan.
    let deadline = Instant::now() + soon(b);
    let clean = loop {
        let report = ctx.broker.check_topology(&sub).await.context("check")?;
        if report.drift.is_empty() || Instant::now() >= deadline {
            break report;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    ensure!(
        clean.drift.is_empty(),
        "just subscribed, yet differs from its plan:\n{clean}"
    );

    let mut redeployed = sub.clone();
    redeployed.retry_tiers = vec![short];
    redeployed.delivery_limit = 9;
    let new_plan = ctx.broker.plan(&redeployed).await.context("plan")?;
    // What must differ: each setting whose wanted value changed between the two plans.
    let mut changed = Vec::new();
    for o in &new_plan.objects {
        let Some(old) = plan.object(o.kind, &o.name) else {
            continue;
        };
        for s in &o.settings {
            let before = old.settings.iter().find(|x| x.key == s.key);
            if before.is_some_and(|x| x.wanted != s.wanted) {
                changed.push((o.name.clone(), s.key.clone(), s.severity));
            }
        }
    }
    // What must be extra: the dropped tier's queue or topic.
    let dropped: Vec<String> = plan
        .objects
        .iter()
        .filter(|o| matches!(o.kind, ObjectKind::Queue | ObjectKind::Topic))
        .filter(|o| new_plan.object(o.kind, &o.name).is_none())
        .map(|o| o.name.clone())
        .collect();
    let report = ctx
        .broker
        .check_topology(&redeployed)
        .await
        .context("check")?;
    let mut different = Vec::new();
    let mut extra = Vec::new();
    for d in &report.drift {
        match &d.difference {
            Difference::Different {
                setting,
                found,
                wanted,
                ..
            } => {
                ensure!(
                    found.is_some() && !wanted.holds(found.as_ref()),
                    "a difference whose value holds: {d}"
                );
                different.push((d.object.clone(), setting.clone(), d.severity));
            }
            Difference::Extra { messages, .. } => {
                ensure!(
                    d.severity == Severity::Cosmetic && *messages == Some(0),
                    "an empty stale tier is cosmetic: {d}"
                );
                extra.push(d.object.clone());
            }
            Difference::Missing { .. } => anyhow::bail!("nothing is missing: {d}"),
        }
    }
    different.sort();
    changed.sort();
    extra.sort();
    let mut dropped = dropped;
    dropped.sort();
    ensure!(
        different == changed,
        "named {different:?}, the plans differ in {changed:?}:\n{report}"
    );
    ensure!(
        extra == dropped,
        "extra {extra:?}, dropped {dropped:?}:\n{report}"
    );
    if ctx.broker.kind() != "kafka" {
        // Every broker but Kafka keeps the delivery limit (Kafka's is reliq's own count).
        ensure!(
            changed.iter().any(|(_, _, s)| *s == Severity::Breaking),
            "another delivery limit breaks the contract: {report}"
        );
    }
    if !ctx.broker.capabilities().exact_retry_delay {
        ensure!(!dropped.is_empty(), "tiers are routes here: {plan}");
    }
    receiver.close().await?;
    Ok(())
}

/// `ping` (the admin server's `/readyz`) answers on a reachable broker and creates
/// nothing, however often it is called.
pub async fn ping_answers_and_creates_nothing(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "op-ping").await?;
    let before = b.objects(&ctx.broker, &ctx.topic).await?;
    for n in 0..3 {
        tokio::time::timeout(Duration::from_secs(10), ctx.broker.ping())
            .await
            .map_err(|_| anyhow::anyhow!("ping {n}: no answer within 10 s"))?
            .map_err(|e| anyhow::anyhow!("ping {n}: {e}"))?;
    }
    let after = b.objects(&ctx.broker, &ctx.topic).await?;
    ensure!(
        before == after,
        "ping changed the broker's objects: {before:?} -> {after:?}"
    );
    Ok(())
}

/// A look never changes the broker. Every read of the operator plane — stats, `ls`,
/// `show`, count, the DLQ reader itself, the backlog, the plan and the live topology — of
/// a consumer that never subscribed (of this test's source, and of a source that does not
/// exist) is refused as not found (the API's 404, the command's exit 4) or answered, and
/// creates nothing; a name no broker object may have is refused before it reaches the
/// broker (`400` naming the field); reads of the consumer that exists create nothing
/// either. Checked on the broker's own object list (topics, streams and their consumers,
/// queues, exchanges), before and after.
pub async fn reads_of_an_unknown_consumer_create_nothing(b: &dyn Backend) -> anyhow::Result<()> {
    let ctx = Ctx::new(b, "op-ro").await?;
    let (h, _rec) = failing_until_replayed(&ctx).await?;
    let (missing, _) = park(&ctx, &h, 1, 0).await?;
    h.shutdown().await;
    let before = b.objects(&ctx.broker, &ctx.topic).await?;
    ensure!(
        before.len() >= 2,
        "the consumer's objects are listed: {before:?}"
    );

    let ghosts = [
        ctx.subscription("ghost"),
        Subscription::new("ghost", format!("{}-none", ctx.topic)),
    ];
    for sub in &ghosts {
        let opened = ctx.broker.dead_letters(sub).await.map(drop);
        ensure!(
            matches!(opened, Err(BrokerError::NotFound(_))),
            "opening the DLQ of `{}` on `{}`: {opened:?}",
            sub.consumer,
            sub.source
        );
        let dlq = Dlq::new(ctx.broker.clone(), sub.clone())?;
        let reads = [
            ("stats", dlq.stats(&spec()).await.map(drop)),
            (
                "ls",
                dlq.list(&spec(), &Cursor::start(), 10).await.map(drop),
            ),
            ("show", dlq.show(missing[0].as_str()).await.map(drop)),
            ("count", dlq.count().await.map(drop)),
        ];
        for (read, result) in reads {
            match result {
                Err(e @ AdminError::Broker(BrokerError::NotFound(_))) => {
                    ensure!(e.status() == 404, "{read}: status {}", e.status());
                    ensure!(
                        e.to_string().contains("ghost"),
                        "{read}: the error names the consumer: {e}"
                    );
                }
                other => anyhow::bail!("{read} of `{}`: {other:?}", sub.source),
            }
        }
        // Answered or refused, as the broker has it: only that nothing is created counts.
        let _ = ctx.broker.backlog(sub).await;
        let plan = ctx.broker.plan(sub).await?;
        let _ = ctx.broker.inspect(sub, &plan).await;
    }
    for (consumer, source, field) in [
        ("../../etc", ctx.topic.clone(), "consumer"),
        ("ghost", format!("{}/../x", ctx.topic), "source"),
        (&"g".repeat(200)[..], ctx.topic.clone(), "consumer"),
    ] {
        match Dlq::new(ctx.broker.clone(), Subscription::new(consumer, source)) {
            Err(e @ AdminError::InvalidInput { field: f, .. }) if f == field => {
                ensure!(e.status() == 400, "{e}: status {}", e.status());
            }
            other => anyhow::bail!("the name `{consumer}` was not refused: {other:?}"),
        }
    }

    let dlq = Dlq::new(ctx.broker.clone(), ctx.subscription("c"))?;
    let stats = dlq.stats(&spec()).await?;
    ensure!(stats.count == 1, "{stats:?}");
    ensure!(dlq.show(missing[0].as_str()).await?.summary.id == missing[0].as_str());
    ensure!(dlq.count().await?.count == 1);

    let after = b.objects(&ctx.broker, &ctx.topic).await?;
    ensure!(
        before == after,
        "reads changed the broker's objects: before {before:?}, after {after:?}"
    );
    Ok(())
}
