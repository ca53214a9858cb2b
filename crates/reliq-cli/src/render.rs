//! The text a person reads (`--json` prints the same data as JSON).

use reliq_admin::{DlqStats, EntryDetail, EntryList, RunOutcome, SchemaView};

pub(crate) fn stats(s: &DlqStats) {
    println!("consumer {}: {} dead letters", s.consumer, s.count);
    if let (Some(at), Some(age)) = (&s.oldest_dead_lettered_at, s.oldest_age_seconds) {
        println!(
            "oldest: {at} ({} ago)",
            humantime::format_duration(std::time::Duration::from_secs(age))
        );
    }
    if s.unreadable > 0 {
        println!("unreadable (no dead-letter record): {}", s.unreadable);
    }
    if s.count == 0 {
        return;
    }
    let counts = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("by reason: {}", counts(&s.by_reason));
    println!("by class:  {}", counts(&s.by_class));
    if s.groups.is_empty() {
        return;
    }
    println!();
    println!(
        "{:<16}  {:>7}  {:<24}  {:<24}  {:<28}  {:<24}  error",
        "FINGERPRINT", "COUNT", "FIRST SEEN", "LAST SEEN", "REASON/CLASS", "TRIAGE"
    );
    for g in &s.groups {
        let kind = match &g.fingerprint.class {
            Some(c) => format!("{}/{c}", g.fingerprint.reason),
            None => g.fingerprint.reason.clone(),
        };
        let triage = match &g.assignee {
            Some(a) => format!("{} ({a})", g.status.as_str()),
            None => g.status.as_str().to_owned(),
        };
        println!(
            "{:<16}  {:>7}  {:<24}  {:<24}  {:<28}  {:<24}  {}",
            g.fingerprint.id,
            g.count,
            g.first_seen,
            g.last_seen,
            kind,
            triage,
            g.fingerprint.masked_error
        );
    }
    if s.archived_groups > 0 {
        println!(
            "\n{} archived group(s) not shown (--archived shows them)",
            s.archived_groups
        );
    }
}

pub(crate) fn triage(t: &reliq_admin::Triage) {
    println!(
        "group {} of consumer {}: {}",
        t.fingerprint,
        t.consumer,
        t.status.as_str()
    );
    println!("assignee: {}", t.assignee.as_deref().unwrap_or("—"));
    if let (Some(at), Some(by)) = (&t.updated_at, &t.updated_by) {
        println!("last change: {at} by {by}");
    }
    for n in &t.notes {
        println!(
            "\n{} · {}\n  {}",
            n.at,
            n.author,
            n.text.replace('\n', "\n  ")
        );
    }
}

pub(crate) fn list(page: &EntryList) {
    println!(
        "{:<38}  {:<14}  {:<20}  {:>3}  {:<24}  error",
        "ID", "REASON", "POSITION", "ATT", "DEAD-LETTERED AT"
    );
    for e in &page.entries {
        println!(
            "{:<38}  {:<14}  {:<20}  {:>3}  {:<24}  {}",
            e.id,
            e.reason,
            e.position,
            e.attempts,
            e.dead_lettered_at,
            e.error.as_deref().unwrap_or("")
        );
    }
    if page.at_end {
        println!("({} listed; end of the DLQ)", page.entries.len());
    } else {
        println!(
            "({} listed; next: --cursor '{}')",
            page.entries.len(),
            page.next_cursor
        );
    }
}

pub(crate) fn detail(d: &EntryDetail) {
    let s = &d.summary;
    println!("id:               {}", s.id);
    println!("position:         {}", s.position);
    if let Some(key) = &s.key {
        println!("key:              {key}");
    }
    println!("reason:           {}", s.reason);
    if let Some(class) = &s.class {
        println!("class:            {class}");
    }
    if let Some(error) = &s.error {
        println!("error:            {error}");
    }
    println!("fingerprint:      {}", s.fingerprint);
    println!("attempts:         {}", s.attempts);
    println!("dead-lettered at: {}", s.dead_lettered_at);
    println!("headers:");
    for (k, v) in &d.headers {
        println!("  {k}: {v}");
    }
    println!(
        "payload ({}, {} bytes):",
        d.payload_encoding, s.payload_bytes
    );
    match (&d.payload, d.payload_encoding) {
        (serde_json::Value::String(text), "text" | "hex") => println!("{text}"),
        (value, _) => println!(
            "{}",
            serde_json::to_string_pretty(value).unwrap_or_default()
        ),
    }
    match &d.schema {
        None => {}
        Some(SchemaView::Decoded(r)) => {
            println!(
                "decoded with schema id {} ({:?}):",
                r.schema_id, r.schema_type
            );
            match (&r.value, &r.note) {
                (Some(value), _) => println!(
                    "{}",
                    serde_json::to_string_pretty(value).unwrap_or_default()
                ),
                (None, Some(note)) => println!("  ({note})"),
                (None, None) => {}
            }
        }
        Some(SchemaView::Unavailable { error }) => {
            println!("not decoded with its writer's schema: {error}")
        }
    }
}

pub(crate) fn outcome(o: &RunOutcome) {
    let verb = match (o.operation, o.dry_run) {
        ("replay", true) => "would replay",
        ("replay", false) => "replayed",
        (_, true) => "would purge",
        _ => "purged",
    };
    println!(
        "{}: {} of {} read matched; {verb} {}{}",
        o.operation,
        o.matched,
        o.scanned,
        if o.dry_run { o.matched } else { o.done },
        if o.dry_run {
            String::new()
        } else {
            format!(
                " in {:.1} s ({:.0}/s while publishing)",
                o.elapsed_seconds, o.rate_per_second
            )
        }
    );
    for (fingerprint, n) in &o.by_fingerprint {
        println!("  fingerprint {fingerprint}: {n}");
    }
    if o.dry_run {
        for id in o.ids.iter().take(20) {
            println!("  {id}");
        }
        if o.ids.len() > 20 {
            println!("  … and {} more (--json lists every id)", o.ids.len() - 20);
        }
        println!("dry run: nothing was changed");
    }
    if o.unreadable > 0 {
        println!(
            "left alone: {} entries without a readable dead-letter record",
            o.unreadable
        );
    }
    for f in o.failed.iter().take(20) {
        println!("  left in the DLQ: {}: {}", f.id, f.error);
    }
    if o.failed.len() > 20 {
        println!("  … and {} more left in the DLQ", o.failed.len() - 20);
    }
    if let Some(why) = &o.stopped {
        println!("stopped by the guard: {why}");
        println!("the rest is in the DLQ: fix the consumer, then run the same command again");
    } else if o.cancelled {
        println!("interrupted: run the same command again to go on");
    }
}
